"""Lightning strategies that run each training step's forward under the offload engine.

Each strategy is its Lightning base (one device, DDP, FSDP, model parallel) plus one change:
``training_step`` runs inside ``with offloader:``, so the tensors autograd saves during forward
are offloaded, and the backward Lightning runs afterwards brings them back. Everything else
(precision plugins, ``no_sync`` under gradient accumulation, distributed samplers, manual
optimisation, checkpointing) is the base's own code. With lossy sites, every ``guard_every``
steps the accuracy guard first checks the step's batch through the module's own
``training_step`` (logging muted, metric states restored); with ``guard_shadow`` a lossless
shadow of the weights trains on every batch the same way, and is evaluated beside the module
on the validation data at each check. Importing this module registers the names ``"cswap"``,
``"cswap_ddp"``, ``"cswap_fsdp"`` and ``"cswap_model_parallel"``, so ``Trainer(strategy="cswap")``
and YAML configs work::

    import cswap_lightning.integrations.lightning  # or: from cswap_lightning import CSwapStrategy

    trainer = Trainer(strategy="cswap")
    trainer = Trainer(strategy=CSwapDDPStrategy(CSwapConfig(plan="zvc")), devices=2)

The Trainer-side work lives in :class:`CSwapHooks`, a callback each strategy adds to the
Trainer it is connected to: metrics after every training batch, re-profiling at each epoch
start, the learned plan in checkpoints, the summary at the end of training and, with several
processes, the link's bandwidth measured with all of them copying at once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import fields, replace
from difflib import get_close_matches
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator, MPSAccelerator
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import (
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    StrategyRegistry,
)
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torchmetrics import Metric

from ..config import CSwapConfig, as_config
from ..core.compile import compiled_whole
from ..core.engine import Offloader
from ..core.guard import AccuracyGuard
from ..core.shadow import Shadow
from ..planning.profiler import measure_link
from ..records import StepStats
from .metrics import (
    offload_metrics,
    plan_values,
    run_summary,
    step_values,
    undefined,
    write_summary,
)

# The default as a value, not None, so LightningCLI's --print_config lists every field.
DEFAULT_CONFIG = CSwapConfig()
CONFIG_FIELDS = tuple(f.name for f in fields(CSwapConfig))


class _CSwapMixin:
    """What the CSwap strategies add to their Lightning base (listed first, so it wraps it).

    ``CSwapConfig``'s fields may be given as keywords (``CSwapStrategy(budget=0.5)``): they
    replace those of ``config``; every other keyword goes to the Lightning base."""

    def __init__(self, config: CSwapConfig | None = DEFAULT_CONFIG, **kwargs: Any) -> None:
        name = type(self).__name__
        given = {key: kwargs.pop(key) for key in list(kwargs) if key in CONFIG_FIELDS}
        config = as_config(config, name)
        self.cswap_config = replace(config, **given) if given else config
        try:
            super().__init__(**kwargs)
        except TypeError as err:  # a keyword neither the config nor the base takes
            if "unexpected keyword argument" not in str(err):
                raise
            wrong = next((k for k in kwargs if f"'{k}'" in str(err)), "")
            close = get_close_matches(wrong, CONFIG_FIELDS, n=1)
            hint = f"; did you mean CSwapConfig's {close[0]!r}?" if close else ""
            mro = type(self).__mro__
            base = mro[mro.index(_CSwapMixin) + 1].__name__
            raise TypeError(f"{name} got an unexpected keyword argument {wrong!r}{hint}. It "
                            f"takes config=CSwapConfig(...), CSwapConfig's fields "
                            f"({', '.join(CONFIG_FIELDS)}) and {base}'s arguments") from None
        self._offloader: Offloader | None = None
        self._guard: AccuracyGuard | None = None
        self.shadow: Shadow | None = None  # with guard_shadow, from the first training step

    @property
    def offloader(self) -> Offloader:
        """The engine session of this process, built on first use (after any process launch,
        since its worker threads cannot be sent to another process)."""
        if self._offloader is None:
            self._offloader = Offloader(self.cswap_config)
        return self._offloader

    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        # The Trainer sets `model.trainer` before it connects the strategy, and restores
        # callback states from a checkpoint only after this, so the plan comes back too.
        # First in the list: the metrics are logged before checkpoint callbacks look.
        callbacks = model.trainer.callbacks
        if not any(isinstance(c, CSwapHooks) and c.strategy is self for c in callbacks):
            callbacks.insert(0, CSwapHooks(self))

    @property
    def guard(self) -> AccuracyGuard:
        """The accuracy guard of the offloader's lossy sites (its reports, its metrics)."""
        if self._guard is None:
            self._guard = AccuracyGuard(self.offloader)
        return self._guard

    def can_probe(self) -> bool:
        """Whether the guard can run ``training_step`` on its own: not with sharded parameters
        (FSDP, model parallel) nor with manual optimisation (the step would update weights)."""
        return (not isinstance(self, (FSDPStrategy, ModelParallelStrategy))
                and self.lightning_module.automatic_optimization)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.can_probe():
            module = self.lightning_module
            check = self.guard.due()
            config = self.cswap_config
            if self.shadow is None and config.guard_shadow and config.lossy_possible:
                self.shadow = Shadow(module, module.trainer.optimizers[0])
            if check or self.shadow is not None:
                self._beside(module, check, args, kwargs)
        # Manual optimisation runs backward inside training_step: inside the block, by design.
        self.offloader.backward_inside = not self.lightning_module.automatic_optimization
        with self.offloader:
            return super().training_step(*args, **kwargs)

    def _beside(self, module: pl.LightningModule, check: bool, args: tuple,
                kwargs: dict[str, Any]) -> None:
        """The guard's check and the shadow's pass over this batch, through the module's own
        ``training_step`` (past any DDP wrapper: neither must sync), its logging muted."""
        def loss() -> torch.Tensor:
            return _loss(module.training_step(*args, **kwargs))

        with self.precision_plugin.train_step_context(), _traceless(module):
            if check:
                self.guard.probe(module, loss)
            if self.shadow is not None:
                scale = module.trainer.accumulate_grad_batches
                self.shadow.accumulate(lambda: loss() / scale)


def _loss(output: Any) -> torch.Tensor:
    """The loss in what ``training_step`` returned (a tensor, or a mapping with ``"loss"``)."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            "the cswap accuracy guard needs training_step to return its loss (a tensor or a "
            f"dict with 'loss'), got {type(output).__name__}; or set CSwapConfig(guard_every=0)"
        )
    return loss


@contextmanager
def _traceless(module: pl.LightningModule, log: Callable[..., None] = lambda *a, **k: None
               ) -> Iterator[None]:
    """Run the module's code beside training: ``self.log`` goes to ``log`` (by default
    nowhere), and the states of its torchmetrics are put back afterwards."""
    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    saved = [(m, copy.deepcopy({k: getattr(m, k) for k in (*m._defaults, "_update_count",
                                                            "_computed")}))
             for m in metrics]
    module.log = log
    module.log_dict = lambda values, *args, **kwargs: [log(k, v) for k, v in values.items()]
    try:
        yield
    finally:
        del module.log, module.log_dict
        for metric, state in saved:
            for name, value in state.items():
                setattr(metric, name, value)


def _validation_metrics(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, float]:
    """What the module's ``validation_step`` logs over the first validation dataloader, in
    eval mode without gradients: a torchmetrics metric as computed over all of it, any other
    value as the mean of its batches' (unweighted); nothing logged or changed otherwise."""
    loaders = trainer.val_dataloaders
    if loaders is None and trainer.limit_val_batches:  # no validation ran yet: load its data
        trainer.fit_loop.epoch_loop.val_loop.setup_data()
        loaders = trainer.val_dataloaders
    if loaders is None or not trainer.limit_val_batches:
        return {}
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
    logged: dict[str, list[Any]] = {}
    training = module.training
    module.eval()
    try:
        with torch.no_grad(), _traceless(
                module, lambda name, value, *a, **k: logged.setdefault(name, []).append(value)):
            for index, batch in enumerate(loader):
                module.validation_step(trainer.strategy.batch_to_device(batch), index)
            return {name: float(values[-1].compute()) if isinstance(values[-1], Metric)
                    else float(torch.stack([torch.as_tensor(v, dtype=torch.float64).cpu()
                                            for v in values]).mean())
                    for name, values in logged.items()}
    finally:
        module.train(training)


class CSwapStrategy(_CSwapMixin, SingleDeviceStrategy):
    """Train on one device with saved activations offloaded.

    Args:
        config: what to offload and how (``None``: the defaults).
        device: the device to train on; by default the Trainer's accelerator decides (the
            CPU, or the current CUDA device).
        **kwargs: passed to :class:`~lightning.pytorch.strategies.SingleDeviceStrategy`.
    """

    strategy_name = "cswap"

    def __init__(self, config: CSwapConfig | None = DEFAULT_CONFIG,
                 device: str | torch.device | None = None, **kwargs: Any) -> None:
        super().__init__(config, device=device if device is not None else "cpu", **kwargs)
        self._follow_accelerator = device is None

    @property
    def root_device(self) -> torch.device:
        if not self._follow_accelerator:
            return self._root_device
        accelerator = self.accelerator
        if accelerator is None or isinstance(accelerator, CPUAccelerator):
            return torch.device("cpu")
        if isinstance(accelerator, CUDAAccelerator):
            return torch.device("cuda", torch.cuda.current_device())
        if isinstance(accelerator, MPSAccelerator):
            return torch.device("mps")
        raise ValueError(
            f"CSwapStrategy cannot tell which device {type(accelerator).__name__} trains on; "
            "pass it explicitly, e.g. CSwapStrategy(device='cuda:1')"
        )

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="one device, saved activations offloaded (cswap)"
        )


class CSwapDDPStrategy(_CSwapMixin, DDPStrategy):
    """Distributed data parallel training with saved activations offloaded on every rank.

    Args:
        config: what to offload and how (``None``: the defaults).
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (e.g.
            ``start_method``, ``find_unused_parameters``).
    """

    strategy_name = "cswap_ddp"

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="DDP, saved activations offloaded (cswap)"
        )


class CSwapFSDPStrategy(_CSwapMixin, FSDPStrategy):
    """Fully sharded data parallel training with saved activations offloaded on every rank
    (parameters are leaves of the autograd graph, so the engine never moves FSDP's shards).

    Args:
        config: what to offload and how (``None``: the defaults).
        **kwargs: passed to :class:`~lightning.pytorch.strategies.FSDPStrategy`.
    """

    strategy_name = "cswap_fsdp"

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if not torch.distributed.is_available():
            return
        strategy_registry.register(
            cls.strategy_name, cls, description="FSDP, saved activations offloaded (cswap)"
        )
        # As Lightning does for "fsdp": the Trainer then rejects the name without a GPU.
        cls._registered_strategies.append(cls.strategy_name)


class CSwapModelParallelStrategy(_CSwapMixin, ModelParallelStrategy):
    """Lightning's model-parallel strategy (FSDP2 and tensor parallelism, applied by the
    module's ``configure_model``) with saved activations offloaded on every rank. FSDP2's
    parameters are leaves and tensor-parallel activations are DTensors: both stay in place.

    Args:
        config: what to offload and how (``None``: the defaults).
        **kwargs: passed to :class:`~lightning.pytorch.strategies.ModelParallelStrategy`
            (``data_parallel_size``, ``tensor_parallel_size``, ...).
    """

    strategy_name = "cswap_model_parallel"

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls,
            description="FSDP2/tensor parallel, saved activations offloaded (cswap)",
        )


def _warn_if_compiled_whole(module: pl.LightningModule) -> None:
    """Say, before the first step, what the engine would only measure at the end of it: a
    module compiled whole gets nothing from offloading at the peak. Users compile in their own
    code, so the strategy cannot compile differently for them."""
    whole = compiled_whole(module)
    if whole:
        rank_zero_warn(
            f"cswap: {', '.join(whole)} is compiled as a whole, and the backward of a compiled "
            "region brings back every tensor it saved at once (pytorch/pytorch#148222): "
            "offloading lowers nothing at the peak. Compile per block instead: "
            "cswap_lightning.compile_blocks(module) where you call torch.compile(module) (for "
            "trainer.fit(torch.compile(model)): trainer.fit(compile_blocks(model)))."
        )


class CSwapHooks(Callback):
    """Connects a CSwap strategy's offloader to the Trainer's events.

    A callback rather than strategy code because these are Trainer events a Strategy does not
    receive (epoch starts, batch ends) and because Lightning already stores callback state in
    every checkpoint (``checkpoint["callbacks"]["CSwap"]``) and restores it before training
    resumes: the plan the engine learned survives a restart without a new file format.
    """

    def __init__(self, strategy: _CSwapMixin) -> None:
        self.strategy = strategy
        self.metrics = offload_metrics()
        self.last: StepStats | None = None  # the most recent training step's statistics
        # the engine's count of the latest step that tracked every site, and the Trainer's name
        self.tracked_label: tuple[int, str] = (-1, "")

    @property
    def state_key(self) -> str:
        return "CSwap"

    def state_dict(self) -> dict[str, Any]:
        return self.strategy.offloader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.strategy.offloader.load_state_dict(state_dict)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.strategy.offloader.watch(pl_module)  # names sites by module (for `lossy_exclude`)
        self.metrics.to(pl_module.device)  # states where distributed reduction expects them
        config = self.strategy.cswap_config
        if config.plan == "auto" and trainer.world_size > 1:
            # The ranks of a host share its memory bandwidth and PCIe switches: the advisor
            # plans with the link each one gets while all copy at once, as in training.
            self.strategy.offloader.link = measure_link(pl_module.device,
                                                        barrier=self.strategy.barrier)
        _warn_if_compiled_whole(pl_module)
        if config.lossy_possible and (config.guard_every or config.guard_shadow) and (
                not self.strategy.can_probe()):
            rank_zero_warn(
                f"cswap: the accuracy guard (guard_every={config.guard_every}, guard_shadow="
                f"{config.guard_shadow}) cannot run under {type(self.strategy).__name__} with "
                f"{'automatic' if pl_module.automatic_optimization else 'manual'} optimisation: "
                "lossy sites stay lossy. Check accuracy with `cswap compare`, or use lossless "
                "plans."
            )

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.strategy.offloader.new_epoch()  # sparsity drifts as the model learns: measure again
        self.metrics.reset()  # Lightning resets only those it logged (not a ratio never defined)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:
        offloader = self.strategy.offloader
        self.last = offloader.last_step(device=False)  # no device sync per step
        tracked = offloader.tracked_step(device=False)
        if tracked is self.last:  # what the summary at the end names it by
            name = (f"global step {trainer.global_step} (batch {batch_idx} of epoch "
                    f"{trainer.current_epoch})")
            self.tracked_label = (self.last.step, name)
        values = step_values(self.last, tracked)
        self.metrics(**values)
        skip = {f"cswap/{name}" for name in undefined(values)}
        for name, metric in self.metrics.items():
            if name not in skip:
                pl_module.log(name, metric, on_step=True, on_epoch=True, metric_attribute=name)
        for name, value in plan_values(offloader).items():
            pl_module.log(name, value, on_step=True, on_epoch=False)
        report = self.strategy.guard.new_report()  # a check ran before this step
        if report is not None:
            values = report.log_values()
            shadow = self.strategy.shadow
            if shadow is not None:
                values |= shadow.compare(lambda: _validation_metrics(trainer, pl_module))
            pl_module.log_dict(values, on_step=True, on_epoch=False)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        shadow = self.strategy.shadow
        if shadow is None:
            return
        clip = None
        if trainer.gradient_clip_val:  # as the precision plugin clips: in the groups' order
            by = (torch.nn.utils.clip_grad_value_
                  if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE
                  else torch.nn.utils.clip_grad_norm_)

            def clip(copies: dict) -> None:
                by([copies[p] for group in optimizer.param_groups for p in group["params"]],
                   trainer.gradient_clip_val)
        shadow.step(optimizer, clip)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """Training stopped by an exception: the model's own forwards back; after a SIGTERM,
        which Lightning raises between steps, the summary too, as at the end of training."""
        if isinstance(exception, SIGTERMException):
            self.on_train_end(trainer, pl_module)
        else:
            self._release()

    def _release(self) -> None:
        modules = self.strategy.offloader.modules
        if modules is not None:  # its global module hooks go now, not when garbage-collected
            modules.close()  # (mid-way through a later torch.compile, which guards on them)
        if self.strategy.offloader.recomputer is not None:
            self.strategy.offloader.recomputer.unwrap()  # the model's own forwards, until it trains

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release()
        log_dir = trainer.log_dir or trainer.default_root_dir  # every rank: it broadcasts
        if self.last is None or not trainer.is_global_zero:
            return
        self.last = self.strategy.offloader.last_step()  # with the sparsities it measured
        tracked = self.strategy.offloader.tracked_step()
        step, label = self.tracked_label
        label = label if step == tracked.step else f"step {tracked.step}"
        table, plot = write_summary(tracked, log_dir, label)
        rank_zero_info(run_summary(tracked, label, table, plot))


for _strategy in (CSwapStrategy, CSwapDDPStrategy, CSwapFSDPStrategy, CSwapModelParallelStrategy):
    _strategy.register_strategies(StrategyRegistry)
