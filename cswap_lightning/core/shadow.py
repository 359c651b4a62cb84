"""A lossless shadow: the model's weights trained again beside it, with exact gradients.

The accuracy guard bounds what lossy sites do to one step's gradients; what they do to
accuracy shows only over training. The shadow measures it during training: a copy of the
trained parameters and of the buffers, trained on the same micro-batches with exact gradients
(outside the engine: what training without the library computes) by an optimizer of the
model's optimizer's class, whose hyperparameters (the learning rate and the rest, as
schedulers change them) are copied from the model's at each step. The integrations evaluate
the model and its shadow at the guard's cadence and log each validation metric's delta.

The shadow runs in the model's own modules, its tensors swapped in for the pass (so hooks,
dropout and the model's code are the same), and puts the random number generators back
after each pass: the model trains as it would without it, and the shadow draws the same
dropout masks. So where lossy sites change nothing, the shadow's weights equal the model's
bit for bit. It costs a second forward and backward per micro-batch, and the weights and
optimizer state again.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .rng import RandomStates


class Shadow:
    """The lossless shadow of ``model``, trained by a copy of ``optimizer`` (a wrapper's
    ``.optimizer`` is unwrapped: Accelerate's, Lightning's)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer = getattr(optimizer, "optimizer", optimizer)
        self.model = model
        trained = {p for group in optimizer.param_groups for p in group["params"]}
        # a copy of each trained parameter
        self.copies: dict[nn.Parameter, torch.Tensor] = {
            p: p.detach().clone().requires_grad_() for p in model.parameters() if p in trained}
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [self.copies[p] for p in group["params"]]}
                  for group in optimizer.param_groups]
        accepted = inspect.signature(type(optimizer)).parameters  # defaults hold more keys
        self.optimizer = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items()
                                                    if k in accepted})

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Run the model with the shadow's parameters and buffers."""
        pairs = [*self.copies.items(), *self.buffers]
        for tensor, copy in pairs:
            tensor.data, copy.data = copy.data, tensor.data
        try:
            yield
        finally:
            for tensor, copy in pairs:
                tensor.data, copy.data = copy.data, tensor.data

    def accumulate(self, compute_loss: Callable[[], torch.Tensor]) -> None:
        """One micro-batch: add the gradients of ``compute_loss()`` (the loss the trainer
        backpropagates, scaled for gradient accumulation as it scales it) to the shadow's."""
        random = RandomStates()
        params = list(self.copies)
        with self.swapped():
            loss = compute_loss()
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        random.restore()
        for p, g in zip(params, grads):
            if g is None:
                continue
            copy = self.copies[p]
            copy.grad = g if copy.grad is None else copy.grad + g

    def step(self, optimizer: torch.optim.Optimizer,
             clip: Callable[[dict[nn.Parameter, torch.Tensor]], object] | None = None) -> None:
        """The optimizer step, with ``optimizer``'s hyperparameters as they are now. ``clip``
        clips the shadow's gradients as the trainer clips the model's, given ``copies`` (each
        parameter's copy): in the trainer's order of parameters, which a norm's rounding
        depends on."""
        optimizer = getattr(optimizer, "optimizer", optimizer)
        for mine, theirs in zip(self.optimizer.param_groups, optimizer.param_groups):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        if clip is not None:
            clip(self.copies)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def compare(self, evaluate: Callable[[], dict[str, float]],
                prefix: str = "cswap/") -> dict[str, float]:
        """``evaluate()`` (validation metrics by name) of the model, then of the shadow, each
        from the same random state (a shuffling loader draws the same order) and the state put
        back after: each metric of the shadow (``cswap/shadow/NAME``) and the model's delta
        against it (``cswap/shadow_delta/NAME``: the model's value less the shadow's), to log."""
        random = RandomStates()
        lossy = evaluate()
        random.restore()
        with self.swapped():
            lossless = evaluate()
        random.restore()
        values = {f"{prefix}shadow/{name}": value for name, value in lossless.items()}
        values |= {f"{prefix}shadow_delta/{name}": lossy[name] - value
                   for name, value in lossless.items() if name in lossy}
        return values
