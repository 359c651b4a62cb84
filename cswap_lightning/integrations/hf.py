"""A ``transformers.Trainer`` callback that runs each training micro-batch's forward under the
offload engine::

    trainer = Trainer(model, args, train_dataset=data, callbacks=[CSwapCallback(CSwapConfig())])

A callback cannot wrap the Trainer's code, and no callback event falls between a micro-batch's
forward and its backward. The model's own forward hooks do: the callback registers a pre-hook
that enters the engine and a hook that leaves it, so every forward of every micro-batch of
gradient accumulation is covered and its backward runs outside, as the engine requires. They
act only in training mode with gradients on, so evaluation and prediction are untouched, and
only while the Trainer's training loop runs: the Trainer calls ``on_train_end`` only when
training succeeds, so after an exception the next forward finds the loop gone from the stack
and removes the hooks instead of entering the engine. The pre-hook also holds the
micro-batch's inputs, so with a lossy plan it runs the accuracy guard's check there, through
the model alone (no Trainer code runs twice), and with ``guard_shadow`` the lossless shadow's
pass over the micro-batch.

With ``torch_compile=True`` the Trainer would compile the whole model, and a compiled region's
backward asks for every tensor it saved at once (pytorch/pytorch#148222): every offloaded
activation would be back on the device when backward starts. The callback compiles the model
per block instead (:func:`~cswap_lightning.compile_blocks`), with the Trainer's compile
settings, before the Trainer gets to it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from types import CodeType, FrameType
from typing import Any

import torch
from accelerate.utils import DynamoBackend
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.utils import logging

from ..config import CSwapConfig, as_config
from ..core.compile import blocks, compile_blocks
from ..core.engine import Offloader
from ..core.guard import AccuracyGuard
from ..core.shadow import Shadow
from ..hf_checkpointing import checkpointing_switch, trainer_checkpointing
from ..records import StepStats
from .metrics import offload_metrics, plan_values, run_summary, step_values, write_summary

logger = logging.get_logger(__name__)


def _trainer_frame() -> FrameType:
    """The frame of the Trainer method that is calling the callbacks: its ``__init__`` or its
    training loop (whatever a Trainer subclass or a later transformers release names it)."""
    frame = sys._getframe(1)
    while frame is not None and not isinstance(frame.f_locals.get("self"), Trainer):
        frame = frame.f_back
    if frame is None:
        raise ValueError("CSwapCallback runs inside a transformers.Trainer")
    return frame


def _on_stack(code: CodeType | None) -> bool:
    """Whether a frame running ``code`` is on this thread's stack (a few frames up)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return frame is not None


def _take_over_checkpoint_offload(args: TrainingArguments, model: nn.Module) -> None:
    """Turn off the Trainer's checkpointing offload (``activation_checkpointing_kwargs=
    {"offload": True}``, ``gradient_checkpointing_kwargs`` in transformers 5.17-5.22), keeping
    the checkpointing.

    That offload wraps each checkpointed layer in torch's ``save_on_cpu``, whose hooks, nested
    inside the engine's, take the layer's inputs (all a checkpointed layer saves) and copy them
    synchronously, uncompressed. Without it the engine moves them, as it does the rest.
    """
    kwargs = trainer_checkpointing(args)
    if kwargs is None or not kwargs.pop("offload", False):
        return
    every_n_layers = kwargs.pop("every_n_layers", 1)
    model.disable_input_require_grads()  # enabling again adds the Trainer's hook again
    checkpointing_switch(model)(kwargs or None, every_n_layers=every_n_layers, offload=False)
    logger.warning("cswap: activation checkpointing stays on, its offload is off for this run: "
                   "cswap moves (and compresses) the checkpointed layers' inputs instead of "
                   "torch's synchronous save_on_cpu")


def _take_over_compile(trainer: Trainer, model: nn.Module) -> dict[str, Any] | None:
    """Stop the Trainer compiling the whole model (``torch_compile``: its accelerator does it
    when ``train()`` prepares the model) and return the settings it would have compiled with,
    or ``None`` where it compiles nothing."""
    plugin = trainer.accelerator.state.dynamo_plugin
    if plugin.backend == DynamoBackend.NO:
        return None
    kwargs = plugin.to_kwargs()
    plugin.backend = DynamoBackend.NO  # this Trainer's accelerator: a new Trainer makes its own
    logger.warning(f"cswap: torch_compile is on: each of the model's {len(blocks(model))} "
                   "blocks is compiled instead of the whole model, whose compiled backward "
                   "would bring back every offloaded tensor at once")
    return kwargs


def _loss_scale(trainer: Trainer, kwargs: dict[str, Any]) -> int:
    """What the Trainer divides a micro-batch's loss by before backward (its
    ``training_step``): the accumulation steps, unless the loss was normalised already (a
    Trainer without ``loss_is_scaled_for_ga``, as transformers 5.17's: its rule, as below)."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = ((trainer.model_accepts_loss_kwargs
                   and kwargs.get("num_items_in_batch") is not None)
                  or trainer.compute_loss_func is not None)
    return 1 if scaled else trainer.current_gradient_accumulation_steps


class CSwapCallback(TrainerCallback):
    """Offload saved activations during ``Trainer.train``; log what it did with the losses.

    Args:
        config: what to offload and how (``None``: the defaults).

    The engine is left after each forward even if it raises (a hook with ``always_call``),
    and the hooks are removed when training ends: at ``on_train_end`` (early stopping
    included) or, when ``train()`` raised, at the next forward outside it. Each epoch starts
    with the engine measuring and planning again. With activation checkpointing, the engine
    moves the checkpointed layers' inputs; the Trainer's own offload of them
    (``activation_checkpointing_kwargs={"offload": True}``, or ``gradient_checkpointing_kwargs``
    in transformers 5.17-5.22) is turned off for the run. With
    ``torch_compile=True`` the model is compiled per block instead of whole (give the callback
    to the Trainer's constructor: ``add_callback`` comes too late). With lossy sites in the
    plan, every ``config.guard_every`` micro-batches :attr:`guard` first compares that
    micro-batch's gradients with and without them (the model must return its loss, i.e. get
    ``labels``). With ``config.guard_shadow`` too, :attr:`shadow` trains a lossless copy of
    the weights on every micro-batch (the model's own loss, scaled and clipped as the Trainer
    does; a ``compute_loss_func`` or label smoothing is not applied to it) and, after each
    optimizer step with a check, the Trainer's evaluation loop runs on the model and on the
    shadow.

    Each log line gets, over the micro-batches since the previous one, ``cswap/offloaded_bytes``
    and ``cswap/wait_s`` (means per micro-batch), ``cswap/peak_resident_bytes``,
    ``cswap/keep_all_bytes`` and ``cswap/peak_percent`` (the highest), ``cswap/ratio`` (where
    something moved), and the latest guard check's figures (``cswap/guard_worst_cosine``,
    ``..._worst_rel_error``, ``..._grad_error``, ``..._reverted_sites``, ``..._passes``,
    ``..._seconds``, ``cswap/reconstruction_error`` pooled and ``.../MODULE/SITE`` per lossy
    site) when one ran since, with the shadow's ``cswap/shadow/eval_*`` and
    ``cswap/shadow_delta/eval_*`` when it was evaluated; they
    are in ``trainer.state.log_history``, and reporting integrations (``report_to``) see them
    only if they run after this callback in ``trainer.callback_handler.callbacks``. At the end
    of training the per-site table and memory timeline of the latest step that tracked every
    tensor are written to ``args.output_dir``, named by the Trainer's global step, and a line
    printed: its peak beside what keeping everything holds.
    """

    def __init__(self, config: CSwapConfig | None = None) -> None:
        self.config = as_config(config, "CSwapCallback")
        self.metrics = offload_metrics()
        self.last: StepStats | None = None  # the most recent micro-batch's statistics
        # the engine's count of the latest step that tracked every site, and the Trainer's name
        self.tracked_label: tuple[int, str] = (-1, "")
        self._micro_batch = 0  # micro-batches of the optimizer step under way, so far
        self._offloader: Offloader | None = None
        self._guard: AccuracyGuard | None = None
        self.shadow: Shadow | None = None  # with guard_shadow, from train()'s start
        self._trainer: Trainer | None = None  # the Trainer whose training loop runs
        self._checked = False  # a check ran during the optimizer step under way
        self._shadow_values: dict[str, float] = {}  # to log with the next line
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._loop: CodeType | None = None  # the code of the Trainer's running training loop
        self._compile: dict[str, Any] | None = None  # torch.compile kwargs, per block
        self.inside = False  # a forward is running under the engine
        self._probing = False  # the guard is running the model itself

    @property
    def offloader(self) -> Offloader:
        """The engine session, built on first use."""
        if self._offloader is None:
            self._offloader = Offloader(self.config)
        return self._offloader

    @property
    def guard(self) -> AccuracyGuard:
        """The accuracy guard of the offloader's lossy sites (its reports, its metrics)."""
        if self._guard is None:
            self._guard = AccuracyGuard(self.offloader)
        return self._guard

    # the model's forward --------------------------------------------------------------------
    # On a model compiled whole (given to the Trainer compiled) these hooks sit at the edges of
    # the compiled forward: Dynamo must run them as they are, not trace the engine and the guard
    # into graphs of their own.
    @torch.compiler.disable
    def _enter(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if self._probing or not (module.training and torch.is_grad_enabled()):
            return
        if not _on_stack(self._loop):
            self._remove_hooks()  # train() raised: on_train_end never came
            return
        if self.guard.due():
            self.guard.probe(module, lambda: self._probe_loss(module, args, kwargs))
            self._checked = True
        if self.shadow is not None:
            scale = _loss_scale(self._trainer, kwargs)
            self.shadow.accumulate(lambda: self._probe_loss(module, args, kwargs) / scale)
        self.offloader.__enter__()
        self.inside = True

    def _probe_loss(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
        self._probing = True
        try:
            output = module(*args, **kwargs)
        finally:
            self._probing = False
        loss = output.get("loss") if isinstance(output, Mapping) else None
        if loss is None:
            raise ValueError(
                "CSwapCallback's accuracy guard needs the model to return its loss (give it "
                f"labels), or set CSwapConfig(guard_every=0); got {type(output).__name__} "
                "without a loss"
            )
        return loss

    @torch.compiler.disable
    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.inside:
            self.inside = False
            self.offloader.__exit__(None, None, None)

    @torch.compiler.disable
    def _exit_on_error(self, module: nn.Module, args: Any, output: Any) -> None:
        # Registered with always_call: alone when forward raises (inside its `except`, so
        # sys.exc_info() is that error), a no-op after `_exit` when forward returns.
        if self.inside:
            self.inside = False
            self.offloader.__exit__(*sys.exc_info())

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._loop = None
        if self._offloader is not None and self._offloader.modules is not None:
            # the global module hooks of watch(), now rather than when garbage-collected
            # (mid-way through a later torch.compile, which guards on them)
            self._offloader.modules.close()
        if self._offloader is not None and self._offloader.recomputer is not None:
            self._offloader.recomputer.unwrap()  # the model's own forwards, until it trains

    # Trainer events -------------------------------------------------------------------------
    def on_init_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, model: nn.Module | None = None,
                    **kwargs: Any) -> None:
        # The Trainer's accelerator is built by now, and compiles only when train() starts.
        self._compile = _take_over_compile(_trainer_frame().f_locals["self"], model)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, model: nn.Module | None = None,
                       **kwargs: Any) -> None:
        if model is None:
            raise ValueError("CSwapCallback needs the model: the Trainer passes it to callbacks")
        self._remove_hooks()  # a second train() on the same callback
        _take_over_checkpoint_offload(args, model)
        if self._compile is not None:  # here, not at init: `model_init` replaces the model
            compile_blocks(model, **self._compile)
        frame = _trainer_frame()
        self._loop, self._trainer = frame.f_code, frame.f_locals["self"]
        config = self.config
        if config.guard_shadow and config.lossy_possible:
            self.shadow = Shadow(model, kwargs["optimizer"])
        self._hooks = [
            model.register_forward_pre_hook(self._enter, with_kwargs=True),
            model.register_forward_hook(self._exit),
            model.register_forward_hook(self._exit_on_error, always_call=True),
        ]
        self.offloader.watch(model)  # names sites by module (for `lossy_exclude`)
        self.metrics.to(args.device)

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        self.offloader.new_epoch()  # sparsity drifts as the model learns: measure again

    def on_substep_end(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        # a micro-batch that does not end an optimizer step: of the one after global_step
        self._record(state.global_step + 1, args.gradient_accumulation_steps)

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                              control: TrainerControl, model: nn.Module | None = None,
                              optimizer: torch.optim.Optimizer | None = None,
                              **kwargs: Any) -> None:
        if self.shadow is None:
            return
        clip = None
        if args.max_grad_norm > 0:  # as the Trainer clips: over model.parameters(), in order

            def clip(copies: dict) -> None:
                torch.nn.utils.clip_grad_norm_(
                    [copies[p] for p in model.parameters() if p in copies], args.max_grad_norm)
        self.shadow.step(optimizer, clip)

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        # the micro-batch that ends an optimizer step, which global_step counts already
        self._record(state.global_step, args.gradient_accumulation_steps)
        self._micro_batch = 0
        if self._checked and self.shadow is not None and self._trainer.eval_dataset is not None:
            self._shadow_values = self.shadow.compare(self._evaluate)
        self._checked = False

    def _evaluate(self) -> dict[str, float]:
        """The Trainer's evaluation loop on its evaluation data, without logging: its
        metrics (``eval_loss``, ``compute_metrics``'s)."""
        trainer = self._trainer
        metrics = trainer.evaluation_loop(trainer.get_eval_dataloader(), "cswap shadow",
                                          metric_key_prefix="eval").metrics
        return {name: float(value) for name, value in metrics.items()
                if isinstance(value, (int, float)) and not name.endswith("preparation_time")}

    def _record(self, global_step: int, accumulation: int) -> None:
        if self._offloader is None:
            return
        self._micro_batch += 1
        self.last = self._offloader.last_step(device=False)  # no device sync per micro-batch
        tracked = self._offloader.tracked_step(device=False)
        if tracked is self.last:  # the engine counts micro-batches, the Trainer steps
            name = f"global step {global_step}" + (
                f", micro-batch {self._micro_batch} of {accumulation}" if accumulation > 1 else "")
            self.tracked_label = (self.last.step, name)
        self.metrics.update(**step_values(self.last, tracked))

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs is None or not self.metrics["ratio"].update_called:
            return  # nothing trained since the last log line (e.g. an evaluation's)
        values = {name: value.item() for name, value in self.metrics.compute().items()
                  if not value.isnan()}  # the ratio where nothing moved, ...
        values |= plan_values(self.offloader)
        self.metrics.reset()
        report = self.guard.new_report()  # the latest check since the last log line
        if report is not None:
            values |= report.log_values()
        values |= self._shadow_values
        self._shadow_values = {}
        logs.update(values)
        if state.log_history:  # the Trainer recorded its copy of `logs` before calling us
            state.log_history[-1].update(values)

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self._remove_hooks()
        if self.last is not None and state.is_world_process_zero:
            self.last = self.offloader.last_step()  # with the sparsities it measured
            tracked = self.offloader.tracked_step()
            step, label = self.tracked_label
            label = label if step == tracked.step else f"step {tracked.step}"
            table, plot = write_summary(tracked, args.output_dir, label)
            print(run_summary(tracked, label, table, plot))  # the Trainer logs below warnings
