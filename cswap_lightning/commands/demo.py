"""`cswap demo`: a small ReLU CNN learns scikit-learn's handwritten digits with the engine on.

It shows, on a real training run that needs no download and no GPU, what the library does:
which saved tensors it moved, how much compression saved, and that gradients are untouched.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import torch
from torch import nn
from torch.nn import functional as F

from ..config import COMPRESSORS, LOSSY_CODECS, CSwapConfig
from ..core.engine import Offloader
from ..planning.advisor import predicted_stored_bytes
from ..planning.profiler import measure_link
from ..recipes.nets import build_cnn
from ..records import StepStats, fmt_bytes

CODECS_THAT_COMPRESS = (*COMPRESSORS, *LOSSY_CODECS)
TRAIN_FRACTION = 0.8
TRAIN_IMAGES = int(TRAIN_FRACTION * 1797)  # of scikit-learn's digits: the largest batch size


def load_digits(device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """scikit-learn's 1,797 8x8 digits, scaled to [0, 1], split 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits as sk_digits

    data = sk_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm].to(device), y[perm].to(device)
    n_train = int(TRAIN_FRACTION * len(x))
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def gradients_match(model: nn.Module, offloader: Offloader, x: torch.Tensor,
                    y: torch.Tensor) -> bool:
    """One step with and without the engine from the same weights: are all gradients bitwise
    equal?"""
    plain, swapped = copy.deepcopy(model), copy.deepcopy(model)
    F.cross_entropy(plain(x), y).backward()
    with offloader:
        loss = F.cross_entropy(swapped(x), y)
    loss.backward()
    return all(
        torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), swapped.parameters())
    )


def peak_keeping_everything(model: nn.Module, config: CSwapConfig, x: torch.Tensor,
                            y: torch.Tensor) -> int:
    """The measured peak of saved tensors of one step that moves nothing (the baseline)."""
    keeping = Offloader(replace(config, plan="keep"))
    with keeping:
        loss = F.cross_entropy(model(x), y)
    torch.autograd.grad(loss, list(model.parameters()))  # leaves the model's gradients alone
    peak = keeping.last_step().peak_resident_bytes
    keeping.close()
    return peak


def run_demo(
    epochs: int = 3,
    batch_size: int = 128,
    width: int = 32,
    device: str = "auto",
    config: CSwapConfig | None = None,
    seed: int = 0,
) -> dict:
    """Train, print what the engine did, and return the figures (for tests and scripts)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    torch.manual_seed(seed)
    # No budget: the whole model fits in memory, and the default ("auto") would move nothing;
    # a small prefetch window, so that what moving freed shows in the measured peak.
    config = config or CSwapConfig(min_bytes=64 * 1024, budget=None, prefetch_bytes=2 << 20)
    x_train, y_train, x_val, y_val = load_digits(dev, seed)
    model = build_cnn(width).to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    offloader = Offloader(config)
    print(f"cswap demo: ReLU CNN (width {width}) on scikit-learn digits, "
          f"{len(x_train)} train / {len(x_val)} val images, device {dev}, plan {config.plan!r}")

    for epoch in range(epochs):
        model.train()
        offloader.new_epoch()  # sparsity drifts as the model learns: measure and plan again
        start, losses = time.perf_counter(), []
        for i in range(0, len(x_train) - batch_size + 1, batch_size):  # full batches only
            xb, yb = x_train[i:i + batch_size], y_train[i:i + batch_size]
            with offloader:
                loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_val).argmax(1) == y_val).float().mean().item()
        step = offloader.last_step()
        print(f"epoch {epoch + 1}/{epochs}: loss {sum(losses) / len(losses):.3f}, "
              f"val accuracy {100 * accuracy:.1f}%, {time.perf_counter() - start:.1f}s; "
              f"last step: offloaded {fmt_bytes(step.offloaded_bytes)} "
              f"stored as {fmt_bytes(step.stored_bytes)}")

    model.train()
    xb, yb = x_train[:batch_size], y_train[:batch_size]
    equal = gradients_match(model, offloader, xb, yb)
    step = offloader.tracked_step()
    print(f"\nWhat the engine did on step {step.step}, the last it tracked one tensor at a time "
          "(one row per tensor autograd saved; once a step has checked the plan, later "
          "steps only sum what they keep and move):")
    print(step.table())
    if config.plan == "auto" and offloader.plan is not None:
        print(f"\nThe advisor's plan, made from {config.profile_steps} measured step(s) at the "
              "start of each epoch (times are predicted transfer time exposed beyond the "
              "compute that can hide it):")
        print(offloader.plan.table())
        if not any(d.decision in CODECS_THAT_COMPRESS for d in offloader.plan.decisions.values()):
            link = offloader.link or measure_link(dev)
            raw = [p for p in offloader.learning.profiler.profile()
                   if offloader.plan.decisions[p.site].decision == "raw"]
            zvc = sum(predicted_stored_bytes("zvc", p) for p in raw)
            print(f"No site is compressed: here a swap costs a copy at {link.d2h / 1e9:.1f} GB/s, "
                  f"faster than the {dev.type} codec, so compressing would expose more time than "
                  f"it saves. Over a PCIe link ZVC would have sent {fmt_bytes(zvc)} instead of "
                  f"{fmt_bytes(sum(s.nbytes for s in raw))}; `--plan zvc` forces it.")
    keep_peak = peak_keeping_everything(model, config, xb, yb)
    print()
    print(memory_summary(step, dev, keep_peak))
    arena = offloader.transfer.arena_report()
    if arena is not None:
        print(f"Host arena (one planned buffer for a step's payloads): {arena}.")
    print(f"Gradient check: gradients with the engine are "
          f"{'bitwise equal to' if equal else 'DIFFERENT from'} those without it "
          f"({sum(1 for _ in model.parameters())} parameter tensors).")
    offloader.close()
    return {"accuracy": accuracy, "gradients_equal": equal, "last_step": step.as_dict(),
            "keep_peak_bytes": keep_peak}


def memory_summary(step: StepStats, device: torch.device, keep_peak: int) -> str:
    """What moving saved, in the words of the machine it ran on: on the CPU the host buffers
    are the same RAM, so only compression holds less there."""
    moved, stored = step.offloaded_bytes, step.stored_bytes
    share = f"{100 * moved / max(step.keep_all_bytes, 1):.0f}%"
    if device.type == "cpu":
        where = (f"were moved into the engine's host buffers ({share}), held there as "
                 f"{fmt_bytes(stored)}. Without a GPU those buffers are the same RAM: only "
                 f"compression makes the step hold less ({fmt_bytes(moved - stored)} here); on a "
                 "GPU the moved bytes leave its memory.")
    else:
        where = (f"({share}) left {device.type} memory for host memory, held there as "
                 f"{fmt_bytes(stored)} ({fmt_bytes(moved - stored)} less thanks to compression).")
    peak = step.peak_resident_bytes
    return (f"Memory: of the {fmt_bytes(step.keep_all_bytes)} of activations saved for backward, "
            f"{fmt_bytes(moved)} {where}\nSaved tensors resident at once, measured: "
            f"{fmt_bytes(peak)} with the engine, {fmt_bytes(keep_peak)} in a step keeping them "
            f"all ({100 * peak / max(keep_peak, 1):.0f}%, {fmt_bytes(keep_peak - peak)} less).")
