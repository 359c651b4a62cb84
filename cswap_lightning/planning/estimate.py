"""A training step's profile estimated without a GPU: the capture schema, from a trace.

``planning/capture.py`` measures a step on a GPU; this makes the same profile from a model's
config (``models.py``), a sequence length, a batch size, a dtype and LoRA or full
fine-tuning, for a device of ``devices.py``: the saved tensors and the allocator's bytes
from a meta-device trace (``trace.py``), each leaf module's forward and backward time from
the device's roofline. ``workload.from_profile`` reads it as it reads a measured one, so the
replay and the planner predict the step on a GPU nobody has run it on.

Beside the step, training holds what a profile never saw (``Training``): the optimizer's
state from the step's start, and the gradients of the weights autograd does not save
(embeddings, biases), which the workload cannot place in backward and which are counted held
from the step's start (at most those bytes too many). The optimizer's update has a peak of
its own: every gradient, the states and its temporaries.

Everything here is an estimate, and says so (``"estimate": true`` in the profile, the device
named "... (estimate)").
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cache

import torch

from . import models, trace
from .dataflow import WEIGHTS
from .devices import Device
from .workload import Workload, from_profile

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Optimizer:
    """Bytes per trained element: the optimizer's state, and the temporaries of its update
    (torch's foreach AdamW: the square root of the second moment, one state's size)."""

    name: str
    state_bytes: float
    update_bytes: float
    describe: str


OPTIMIZERS = {o.name: o for o in (
    Optimizer("adamw", 8, 4, "AdamW, two fp32 states per trained weight (mixed precision)"),
    Optimizer("adamw-bf16", 4, 2, "AdamW, two states in the weights' 16-bit dtype (torch's "
              "AdamW on bf16 weights)"),
    # bitsandbytes' blockwise 8-bit states (a float32 scale per 256), updated in place
    Optimizer("adamw-8bit", 2 + 2 * 4 / 256, 0, "bitsandbytes' AdamW8bit, two 8-bit states "
              "per trained weight"),
    Optimizer("sgd", 0, 0, "SGD without momentum: no state"),
)}


@dataclass(frozen=True)
class Setup:
    """What is trained, and how."""

    model: str  # a name of models.KNOWN or models.CNNS, or a config.json path
    sequence: int
    batch: int
    dtype: torch.dtype = torch.bfloat16
    lora: models.LoRA | None = None
    dropout: bool = True  # the config's dropout (False: every dropout 0)
    layers: int | None = None  # that many of a transformer's layers, not the config's

    def __post_init__(self) -> None:
        if self.batch < 1 or self.sequence < 1:
            raise ValueError(f"batch and sequence must be >= 1, got {self.batch} and "
                             f"{self.sequence}")


@dataclass(frozen=True)
class Training:
    """What a training step holds beyond its profile (module docstring), in bytes."""

    weights: int
    trained_elements: int
    gradients: int  # every trained weight's
    unsaved_gradients: int  # of the weights autograd does not save
    optimizer_state: int
    optimizer_update: int  # the update's temporaries


@dataclass(frozen=True)
class Estimate:
    """A setup's estimated profile on a device, and what training holds beside it."""

    setup: Setup
    device: Device
    optimizer: Optimizer
    profile: dict
    training: Training
    # the outermost modules whose weights the step did not read (``trace.Trace.unread``):
    # their activations are not in the estimate
    unread: dict[str, int] = field(default_factory=dict)

    def workload(self) -> Workload:
        """The profile's workload with the optimizer's state and the gradients it cannot
        place held from the step's start."""
        w = from_profile(self.profile)
        extra = self.training.optimizer_state + self.training.unsaved_gradients
        return replace(w, start_bytes=w.start_bytes + extra, peak_bytes=w.peak_bytes + extra)

    @property
    def optimizer_peak(self) -> int:
        """The allocator's bytes during the optimizer's update: the step's start, the
        optimizer's state, every gradient and the update's temporaries."""
        t = self.training
        return (self.profile["allocated_before_step"] + t.optimizer_state + t.gradients
                + t.optimizer_update)

    @property
    def saved_bytes(self) -> int:
        """The saved tensors' bytes the step allocates (each storage once)."""
        return saved_bytes(self.profile)


def saved_bytes(profile: dict) -> int:
    """A profile's saved activations: each storage once, parameters not."""
    return sum(r["storage_nbytes"] for r in profile["saved"]
               if r["first_of_storage"] and not r["parameter"])


def traced(setup: Setup, attention: str) -> tuple[trace.Trace, models.Model, torch.nn.Module]:
    """``setup``'s step traced (with the fused attention kernel ``attention``), its model's
    spec and network (on the meta device, after the step: its gradients set)."""
    spec = models.model(setup.model, setup.dropout, setup.lora, setup.layers)
    if spec.max_sequence is not None and setup.sequence > spec.max_sequence:
        raise ValueError(f"{setup.model} has {spec.max_sequence} learned positions; "
                         f"sequence {setup.sequence} is longer")
    net = models.build(spec, setup.dtype)
    inputs = spec.batch(setup.batch, setup.sequence, setup.dtype)
    return (trace.trace(net, lambda: spec.loss(net, inputs), list(inputs.values()), attention),
            spec, net)


def estimate(setup: Setup, device: Device, optimizer: Optimizer = OPTIMIZERS["adamw"],
             step: tuple[trace.Trace, models.Model, torch.nn.Module] | None = None
             ) -> Estimate:
    """Trace ``setup`` (or take its ``step``, from ``traced``) and time it on ``device``
    (module docstring)."""
    traced_step, spec, net = step or traced(setup, device.attention)
    profile = _profile(traced_step, device, setup, spec)
    trained = [p for p in net.parameters() if p.requires_grad]
    weights = sum(trace.rounded(p.untyped_storage().nbytes()) for p in _unique(net))
    gradients = sum(trace.rounded(p.numel() * p.element_size()) for p in trained)
    elements = sum(p.numel() for p in trained)
    seen = from_profile(profile).weight_bytes
    return Estimate(setup, device, optimizer, profile, Training(
        weights, elements, gradients, max(gradients - seen, 0),
        round(elements * optimizer.state_bytes), round(elements * optimizer.update_bytes)),
        traced_step.unread)


def _unique(net: torch.nn.Module) -> list[torch.Tensor]:
    """What the model holds (``trace.held``), each storage once (tied weights share one)."""
    out: dict[int, torch.Tensor] = {}
    for t in trace.held(net):
        out.setdefault(t.untyped_storage()._cdata, t)
    return list(out.values())


def _profile(traced: trace.Trace, device: Device, setup: Setup, spec: models.Model) -> dict:
    """The trace in capture's schema, timed on ``device``."""
    forward: dict[str, float] = {}
    backward: dict[str, float] = {}
    for kernel in traced.kernels:
        times = backward if kernel.backward else forward
        times[kernel.module] = times.get(kernel.module, 0.0) + device.kernel_s(kernel)
    forward_ms, backward_ms = 1e3 * sum(forward.values()), 1e3 * sum(backward.values())
    # each layer's forward seconds, and those of what recomputing it below the layer runs
    # again, each way (``trace.Kernel.again``)
    layers: dict[str, list[float]] = {}
    for kernel in traced.kernels:
        if kernel.layer:
            times = layers.setdefault(kernel.layer, [0.0] * (1 + len(WEIGHTS)))
            seconds = device.kernel_s(kernel)
            times[0] += seconds
            for way, again in enumerate(kernel.again):
                times[1 + way] += seconds if again else 0.0
    shape = f"-s{setup.sequence}" if spec.sequence else ""
    return {
        "name": f"{spec.name}{shape}-b{setup.batch}", "estimate": True,
        "device": f"{device.name} (estimate)", "torch": torch.__version__,
        "dtype": str(setup.dtype).removeprefix("torch."),
        "plain_forward_ms": forward_ms, "plain_backward_ms": backward_ms,
        "forward_ms": forward_ms, "backward_ms": backward_ms,
        "allocated_before_step": traced.start_bytes, "peak_allocated": traced.peak_bytes,
        "saved": traced.saved,
        "modules": [{"module": m, "forward_ms": 1e3 * forward.get(m, 0.0),
                     "backward_ms": 1e3 * backward.get(m, 0.0), "calls": traced.calls.get(m, 0),
                     "backward_allocated": traced.backward_allocated.get(m, [])}
                    for m in traced.modules],
        # what recomputing each layer below the layer would keep and cost, each way
        "layers": [{"layer": name, "input_bytes": layer.input_bytes,
                    "forward_ms": 1e3 * times[0],
                    "below": [{"weight": weight, "kept": layer.kept_bytes(way),
                               "kept_dtype": layer.dtype[way],
                               "elementwise_forward_ms": 1e3 * times[1 + way]}
                              for way, weight in enumerate(WEIGHTS)]}
                   for name, layer in traced.layers.items()
                   for times in [layers.get(name, [0.0] * (1 + len(WEIGHTS)))]]}


@cache
def cached(setup: Setup, device: Device, optimizer: Optimizer = OPTIMIZERS["adamw"]
           ) -> Estimate:
    """``estimate``, once per setup, device and optimizer in a process (a search over
    sequence lengths asks for the same ones again)."""
    return estimate(setup, device, optimizer)
