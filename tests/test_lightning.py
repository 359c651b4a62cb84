"""The Lightning strategies on the CPU: same weights as the plain strategy, the engine really
packs, and Lightning's own features (precision, accumulation, manual optimisation, checkpoints,
DDP, FSDP precision) keep working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import Destructive, Faithful
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import (
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

from cswap_lightning import CSwapConfig, compile_blocks
from cswap_lightning.integrations.lightning import (
    CSwapDDPStrategy,
    CSwapFSDPStrategy,
    CSwapHooks,
    CSwapModelParallelStrategy,
    CSwapStrategy,
)
from cswap_lightning.integrations.metrics import run_summary
from cswap_lightning.records import fmt_bytes

LOSSLESS = CSwapConfig(plan="zvc", min_bytes=0)


class ReluNet(pl.LightningModule):
    """A small ReLU MLP: its activations are about half zeros, so ZVC has work to do."""

    def __init__(self, width: int = 32, manual: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width),
                                 nn.ReLU(), nn.Linear(width, 4))
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader(batches: int = 6, batch_size: int = 8) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batches * batch_size, 16, generator=generator)
    y = torch.randint(0, 4, (batches * batch_size,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the Trainer writes (default_root_dir) by default


def train(strategy, model: Callable[[], pl.LightningModule] = ReluNet,
          ckpt_path: str | None = None, batch_size: int = 8,
          **trainer_kwargs) -> tuple[pl.Trainer, pl.LightningModule]:
    torch.manual_seed(0)
    model = model()
    options = {"accelerator": "cpu", "devices": 1, "max_steps": 3, "logger": False,
               "enable_checkpointing": False, "enable_progress_bar": False,
               "enable_model_summary": False, "deterministic": True}
    trainer = pl.Trainer(strategy=strategy, **(options | trainer_kwargs))
    trainer.fit(model, loader(batch_size=batch_size), ckpt_path=ckpt_path)
    return trainer, model


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("plan", ["raw", "zvc"])
def test_weights_match_the_plain_strategy(plan):
    trainer, model = train(CSwapStrategy(CSwapConfig(plan=plan, min_bytes=0)))
    _, plain = train(SingleDeviceStrategy("cpu"))
    assert_same_weights(model, plain)
    last = trainer.strategy.offloader.last_step()
    assert last.step == 2  # one engine step per training batch
    assert last.offloaded_bytes > 0
    assert {s.decision for s in last.sites} >= {plan}


def test_registered_name_builds_the_strategy_on_the_accelerator_device():
    trainer = pl.Trainer(strategy="cswap", accelerator="cpu", logger=False)
    assert type(trainer.strategy) is CSwapStrategy
    assert trainer.strategy.cswap_config == CSwapConfig()
    assert trainer.strategy.root_device == torch.device("cpu")
    assert type(pl.Trainer(strategy="cswap_ddp", accelerator="cpu").strategy) is CSwapDDPStrategy


@pytest.mark.slow
def test_the_package_imports_lightning_and_transformers_only_when_asked():
    code = ("import sys, cswap_lightning\n"
            "print(any(m in sys.modules for m in ('lightning', 'transformers')))\n"
            "cswap_lightning.CSwapStrategy\n"
            "print('lightning' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["False", "True"]


def test_an_explicit_device_wins():
    assert CSwapStrategy(device="meta").root_device == torch.device("meta")


def test_gradient_accumulation_enters_the_engine_per_micro_batch():
    trainer, model = train(CSwapStrategy(LOSSLESS), max_steps=2, accumulate_grad_batches=3)
    _, plain = train(SingleDeviceStrategy("cpu"), max_steps=2, accumulate_grad_batches=3)
    assert_same_weights(model, plain)
    assert trainer.strategy.offloader.last_step().step == 5  # 2 optimizer steps x 3 batches


def test_bf16_mixed_precision():
    trainer, model = train(CSwapStrategy(LOSSLESS), precision="bf16-mixed")
    _, plain = train(SingleDeviceStrategy("cpu"), precision="bf16-mixed")
    assert_same_weights(model, plain)
    dtypes = {s.dtype for s in trainer.strategy.offloader.last_step().sites
              if s.decision == "zvc"}
    assert "bfloat16" in dtypes  # autocast's activations went through the engine


class CompiledReluNet(ReluNet):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.compile(self.net, backend="aot_eager")


def test_a_compiled_network_inside_the_module():
    excluding = replace(LOSSLESS, lossy_exclude=("head*",))  # so that sites carry module names
    trainer, model = train(CSwapStrategy(excluding), model=CompiledReluNet)
    _, plain = train(SingleDeviceStrategy("cpu"), model=CompiledReluNet)
    assert_same_weights(model, plain)
    sites = trainer.strategy.offloader.last_step().sites
    zvc = [s for s in sites if s.decision == "zvc"]
    assert {s.module for s in zvc} == {"", "net"}  # "": the loss, in training_step
    assert {s.shape for s in zvc if s.module == "net"} == {(8, 32)}  # compiled region
    # the batch, which Lightning holds through the step: moving it freed nothing
    assert {s.reason for s in sites if s.shape == (8, 16)} == {"held elsewhere"}


class BlockCompiledReluNet(ReluNet):
    def __init__(self) -> None:
        super().__init__()
        compile_blocks(self.net, backend="aot_eager")


@pytest.mark.parametrize(("model", "named"), [
    (lambda: torch.compile(ReluNet(), backend="aot_eager"), "the model"),  # fit(torch.compile(m))
    (CompiledReluNet, "net"),
    (BlockCompiledReluNet, None),
])
def test_a_module_compiled_whole_is_told_at_setup_to_compile_per_block(model, named):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(CSwapStrategy(LOSSLESS), model=model)
    told = [str(w.message) for w in caught if "compiled as a whole" in str(w.message)]
    if named is None:
        assert told == [] and not [w for w in caught if "at once" in str(w.message)]
    else:
        assert len(told) == 1 and told[0].startswith(f"cswap: {named} is compiled as a whole")
        assert "cswap_lightning.compile_blocks" in told[0]


class ShardedReluNet(ReluNet):
    """ReluNet with FSDP2 applied per linear layer and to the whole, as Lightning's model-parallel
    strategy expects (in ``configure_model``, on its device mesh)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


@pytest.fixture
def _leave_no_process_group():
    """Lightning leaves the one-process group it made (and its MASTER_PORT in the
    environment, which a later DDP launch would find taken)."""
    environ = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


@pytest.mark.usefixtures("_leave_no_process_group")
def test_model_parallel_fsdp2_weights_match_and_shards_stay():
    trainer, model = train(CSwapModelParallelStrategy(LOSSLESS), model=ShardedReluNet)
    _, plain = train(ModelParallelStrategy(), model=ShardedReluNet)
    for (name, p), q in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name  # DTensor shards
    sites = trainer.strategy.offloader.last_step().sites
    assert "zvc" in {s.decision for s in sites}
    assert {s.reason for s in sites if s.decision == "keep"} <= {"parameter", "view of a leaf",
                                                                 "small", "held elsewhere"}
    assert type(pl.Trainer(strategy="cswap_model_parallel", accelerator="cpu").strategy) is (
        CSwapModelParallelStrategy)
    with pytest.warns(UserWarning, match="cannot run under CSwapModelParallelStrategy"):
        trainer, _ = train(CSwapModelParallelStrategy(CSwapConfig(plan="fp8", min_bytes=0)),
                           model=ShardedReluNet, max_steps=1)
    assert not trainer.strategy.guard.reports


class Block(nn.Sequential):
    """The unit activation checkpointing wraps: its (8, 4 x width) activations stay inside."""

    def __init__(self, width: int) -> None:
        super().__init__(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))


class BlockReluNet(ReluNet):
    def __init__(self, width: int = 32) -> None:
        super().__init__(width)
        self.net = nn.Sequential(nn.Linear(16, width), Block(width), Block(width),
                                 nn.Linear(width, 4))


class CheckpointedShardedNet(BlockReluNet, ShardedReluNet):
    """Each block checkpointed by torch's checkpoint_wrapper, as FSDPStrategy's
    ``activation_checkpointing_policy`` does, then sharded by FSDP2."""

    def configure_model(self) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        apply_activation_checkpointing(self.net, check_fn=lambda m: isinstance(m, Block))
        super().configure_model()


def assert_the_engine_moves_the_block_inputs(trainer: pl.Trainer) -> None:
    moved = [s.shape for s in trainer.strategy.offloader.last_step().sites if s.decision == "zvc"]
    # Both blocks' inputs (saved by checkpoint), the head's input, logits and the loss:
    # nothing from inside the blocks (8 x 128); the batch (x, labels) is held by Lightning,
    # so moving it freed nothing and the engine keeps it.
    assert moved == [(8, 32), (8, 32), (8, 32), (8, 4), ()]


@pytest.mark.usefixtures("_leave_no_process_group")
def test_activation_checkpointing_under_fsdp2_leaves_the_block_inputs_to_the_engine():
    trainer, model = train(CSwapModelParallelStrategy(LOSSLESS), model=CheckpointedShardedNet)
    _, plain = train(ModelParallelStrategy(), model=CheckpointedShardedNet)
    for (name, p), q in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name
    assert_the_engine_moves_the_block_inputs(trainer)


def test_manual_optimization():
    trainer, model = train(CSwapStrategy(LOSSLESS), model=partial(ReluNet, manual=True))
    _, plain = train(SingleDeviceStrategy("cpu"), model=partial(ReluNet, manual=True))
    assert_same_weights(model, plain)
    assert trainer.strategy.offloader.last_step().offloaded_bytes > 0


class RecordPlanAtStart(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.state = trainer.strategy.offloader.state_dict()


class MeteredReluNet(ReluNet):
    """Logs and updates a metric in training_step, as real modules do."""

    def __init__(self) -> None:
        super().__init__()
        self.mean_loss = MeanMetric()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.mean_loss.update(loss.detach())
        self.log("train_loss", loss)
        return {"loss": loss}


def test_the_guard_probes_lossy_plans_logs_and_leaves_no_trace():
    # fp8 rounds to nearest (no stochastic seeds), so two runs can be compared bit for bit.
    fp8 = CSwapConfig(plan="fp8", min_bytes=0, guard_every=2, guard_tolerance=1e9)
    guarded, model = train(CSwapStrategy(fp8), model=MeteredReluNet)
    unguarded, plain = train(CSwapStrategy(replace(fp8, guard_every=0)), model=MeteredReluNet)
    reports = guarded.strategy.guard.reports
    assert len(reports) == 2  # before steps 1 and 3 of 3
    assert all(r.worst_rel_error > 0 and r.site_errors and not r.reverted for r in reports)
    assert_same_weights(model, plain)
    assert model.mean_loss.compute() == plain.mean_loss.compute()  # probes left no update
    assert model.mean_loss._update_count == 3
    logged = guarded.callback_metrics
    assert logged["cswap/guard_worst_rel_error"] == pytest.approx(reports[-1].worst_rel_error)
    assert "cswap/guard_worst_rel_error" not in unguarded.callback_metrics


def test_the_guard_moves_sites_that_destroy_gradients_back_to_lossless(as_int8):
    as_int8(Destructive())
    trainer, _ = train(CSwapStrategy(CSwapConfig(plan="int8", min_bytes=0, guard_every=1,
                                                 guard_tolerance=0.05)), max_steps=1)
    report = trainer.strategy.guard.reports[0]
    assert report.worst_rel_error > 0.5 and report.reverted
    assert trainer.strategy.offloader.reverted == set(report.reverted)
    last = trainer.strategy.offloader.last_step()  # the real step, after the probe
    assert {s.decision for s in last.sites if s.site in report.reverted} == {"raw"}


def test_the_guard_does_not_trip_on_a_faithful_codec(as_int8):
    as_int8(Faithful())
    trainer, _ = train(CSwapStrategy(CSwapConfig(plan="int8", min_bytes=0, guard_every=1,
                                                 guard_tolerance=1e-6)), max_steps=2)
    reports = trainer.strategy.guard.reports
    assert len(reports) == 2 and all(r.worst_rel_error == 0 and not r.reverted for r in reports)


def test_lossy_plans_with_manual_optimisation_warn_that_the_guard_cannot_run():
    with pytest.warns(UserWarning, match="cannot run under CSwapStrategy with manual"):
        train(CSwapStrategy(CSwapConfig(plan="fp8", min_bytes=0)),
              model=partial(ReluNet, manual=True), max_steps=1)


class RecordPlanPerEpoch(pl.Callback):
    def __init__(self) -> None:
        self.plans = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.plans.append(trainer.strategy.offloader.plan)


def test_each_epoch_is_profiled_and_planned_again():
    probe = RecordPlanPerEpoch()
    train(CSwapStrategy(CSwapConfig(plan="auto", profile_steps=1, min_bytes=0)), max_epochs=2,
          max_steps=-1, limit_train_batches=3, callbacks=[probe])
    first, second = probe.plans
    assert first is not None and second is not None
    assert second is not first  # epoch 2's first batch was measured and planned anew


def test_checkpoint_restores_the_learned_plan_and_training_resumes(tmp_path):
    config = CSwapConfig(plan="auto", profile_steps=1, min_bytes=0, budget=None)
    trainer, _ = train(CSwapStrategy(config), max_epochs=1, max_steps=-1)
    saved = trainer.strategy.offloader.state_dict()
    assert saved["plan"] is not None  # the advisor planned from the profiled step
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)

    probe = RecordPlanAtStart()
    _, model = train(CSwapStrategy(config), ckpt_path=str(path), max_epochs=2, max_steps=-1,
                     callbacks=[probe])
    assert json.loads(json.dumps(probe.state)) == json.loads(json.dumps(saved))  # JSON-able
    _, plain = train(SingleDeviceStrategy("cpu"), max_epochs=2, max_steps=-1)
    assert_same_weights(model, plain)  # resumed exactly, and the learned plan is lossless


def test_metrics_are_logged_and_the_summary_written(tmp_path, caplog):
    with caplog.at_level("INFO"):
        trainer, _ = train(CSwapStrategy(LOSSLESS), max_epochs=1, max_steps=-1,
                           limit_train_batches=2)
    hooks = [c for c in trainer.callbacks if isinstance(c, CSwapHooks)]
    assert len(hooks) == 1
    last = hooks[0].last
    logged = trainer.callback_metrics
    assert logged["cswap/offloaded_bytes_step"].item() == last.offloaded_bytes
    # The first step also moved the batch, which Lightning holds (so the engine learned to
    # keep it): the epoch's mean per step is the last step's plus half the batch.
    batch = sum(s.nbytes for s in last.sites if s.reason == "held elsewhere")
    assert batch > 0
    assert logged["cswap/offloaded_bytes_epoch"].item() == last.offloaded_bytes + batch / 2
    assert logged["cswap/peak_resident_bytes_step"].item() == last.peak_resident_bytes > 0
    assert logged["cswap/keep_all_bytes_step"].item() == last.keep_all_bytes > 0
    assert logged["cswap/peak_percent_step"].item() == pytest.approx(100 * last.peak_share)
    assert logged["cswap/ratio_step"].item() == pytest.approx(last.ratio)
    assert logged["cswap/wait_s_step"].item() == pytest.approx(last.wait_s)
    table = (tmp_path / "cswap_summary.txt").read_text()
    label = "global step 2 (batch 1 of epoch 0)"  # the engine's step 1 was its second
    assert f"{label}: autograd saved" in table and "zvc" in table
    assert (tmp_path / "cswap_memory.png").read_bytes()[:4] == b"\x89PNG"
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cswap: ")]
    assert said == [run_summary(last, label, tmp_path / "cswap_summary.txt",
                                tmp_path / "cswap_memory.png")]
    assert f"{100 * last.peak_share:.0f}% of the {fmt_bytes(last.keep_all_bytes)}" in said[0]
    assert "\n".join(last.summary(label)[1:]) in table  # the same lines as the table's end


def test_a_ratio_is_not_logged_where_nothing_moved(tmp_path):
    keep = CSwapConfig(plan="keep", min_bytes=0)
    trainer, _ = train(CSwapStrategy(keep), max_epochs=1, max_steps=-1, limit_train_batches=2)
    logged = trainer.callback_metrics
    assert "cswap/ratio_step" not in logged and "cswap/ratio_epoch" not in logged  # was 0.0
    assert logged["cswap/offloaded_bytes_epoch"].item() == 0
    assert logged["cswap/peak_percent_step"].item() == 100.0


def test_fsdp_strategy_selects_lightnings_fsdp_precision():
    trainer = pl.Trainer(strategy=CSwapFSDPStrategy(LOSSLESS), accelerator="cpu", devices=1,
                         precision="bf16-mixed", logger=False)
    assert isinstance(trainer.precision_plugin, FSDPPrecision)
    assert trainer.strategy.precision_plugin is trainer.precision_plugin
    assert trainer.strategy.cswap_config == LOSSLESS


@pytest.mark.gpu
def test_one_gpu_follows_the_accelerator_and_matches_the_plain_strategy():
    trainer, model = train(CSwapStrategy(LOSSLESS), accelerator="cuda")
    device = torch.device("cuda", torch.cuda.current_device())
    assert trainer.strategy.root_device == device
    _, plain = train(SingleDeviceStrategy(device), accelerator="cuda")  # Lightning needs the index
    assert_same_weights(model, plain)
    assert trainer.strategy.offloader.last_step().offloaded_bytes > 0


@pytest.mark.gpu
@pytest.mark.usefixtures("_leave_no_process_group")
def test_fsdp_on_one_gpu_offloads_activations():
    trainer, _ = train(CSwapFSDPStrategy(LOSSLESS), accelerator="cuda", precision="bf16-mixed")
    assert trainer.strategy.offloader.last_step().offloaded_bytes > 0


@pytest.mark.gpu
@pytest.mark.usefixtures("_leave_no_process_group")
def test_fsdp_activation_checkpointing_leaves_the_block_inputs_to_the_engine():
    # Lightning's policy wraps blocks in torch's checkpoint_wrapper, which never offloads.
    checkpointed = {"activation_checkpointing_policy": {Block}}
    trainer, model = train(CSwapFSDPStrategy(LOSSLESS, **checkpointed), model=BlockReluNet,
                           accelerator="cuda")
    _, plain = train(FSDPStrategy(**checkpointed), model=BlockReluNet, accelerator="cuda")
    assert_same_weights(model, plain)
    assert_the_engine_moves_the_block_inputs(trainer)


def test_fsdp_by_name_needs_a_gpu_as_lightnings_fsdp_does():
    # torch's FSDP cannot run on the CPU; Lightning says so before training starts.
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        pl.Trainer(strategy="cswap_fsdp", accelerator="cpu", logger=False)


def run_ddp(worker: str, out: Path) -> list[dict]:
    """Run ``worker`` (below) as a user would run a script with a CSwap DDP strategy, which
    Lightning relaunches for rank 1 (this file is that script, see the bottom); what each rank
    wrote."""
    subprocess.run([sys.executable, __file__, worker, str(out)], check=True, cwd=out,
                   timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_packs_and_probes_on_both_ranks(tmp_path):
    ranks = run_ddp("probes", tmp_path)
    for rank in ranks:
        assert rank["world_size"] == 2
        assert rank["probes"] == 2  # one before each micro-batch of the accumulated step
        assert rank["engine_steps"] == 2 + 2 * 2  # both micro-batches, each probed twice
        assert rank["offloaded_bytes"] > 0
    assert ranks[0]["weights"] == ranks[1]["weights"]  # DDP kept the replicas equal


@pytest.mark.slow
def test_ddp_measures_the_link_with_every_rank_copying_and_plans_with_it(tmp_path):
    ranks = run_ddp("link", tmp_path)
    for rank in ranks:
        before = rank["before_training"]
        assert before.count("clock") == 2  # the start and end of the timed copies
        first = before.index("clock")
        assert before[first - 1:first + 2] == ["barrier", "clock", "clock"]  # right after one
        assert rank["advised_with"] == [rank["link"]]  # the advisor planned with that link
    # Both ranks copied at the same time.
    starts, ends = zip(*(rank["copying"] for rank in ranks))
    assert max(starts) < min(ends)


def _ddp_worker(out: Path) -> None:
    # Default sizes (min_bytes 256 KiB): activations of 64 x 2048 floats are 512 KiB. A lossy
    # plan, so the accuracy guard probes each micro-batch on each rank, outside DDP's sync.
    int8 = CSwapConfig(plan="int8", guard_every=1, guard_tolerance=1e9)
    trainer, model = train(CSwapDDPStrategy(int8), model=partial(ReluNet, width=2048),
                           batch_size=64, devices=2, max_steps=1, accumulate_grad_batches=2)
    last = trainer.strategy.offloader.last_step()
    result = {
        "world_size": trainer.world_size,
        "engine_steps": last.step + 1,
        "probes": len(trainer.strategy.guard.reports),
        "offloaded_bytes": last.offloaded_bytes,
        "weights": [p.sum().item() for p in model.parameters()],
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


class MarkTrainingStart(pl.Callback):
    def __init__(self, events: list[tuple[str, float]]) -> None:
        self.events = events

    def on_train_start(self, trainer, pl_module):
        self.events.append(("training", time.perf_counter()))


def _link_worker(out: Path) -> None:
    """Records when the strategy's barrier returns and the profiler's clock is read (the host
    clock on the CPU), and the link each advisor is built with."""
    from cswap_lightning.planning.advisor import Advisor
    from cswap_lightning.planning.profiler import Clock

    events: list[tuple[str, float]] = []
    advised: list[dict] = []
    barrier, now, advisor = CSwapDDPStrategy.barrier, Clock.now, Advisor.__init__

    def barrier_spy(self, *args, **kwargs):
        barrier(self, *args, **kwargs)
        events.append(("barrier", time.perf_counter()))

    def clock_spy(self):
        stamp = now(self)
        events.append(("clock", stamp))
        return stamp

    def advisor_spy(self, compressor, link, *args, **kwargs):
        advised.append(asdict(link))
        advisor(self, compressor, link, *args, **kwargs)

    CSwapDDPStrategy.barrier, Clock.now, Advisor.__init__ = barrier_spy, clock_spy, advisor_spy
    auto = CSwapConfig(plan="auto", profile_steps=1, min_bytes=0)
    trainer, _ = train(CSwapDDPStrategy(auto), devices=2, max_steps=2,
                       callbacks=[MarkTrainingStart(events)])
    before = events[:[what for what, _ in events].index("training")]
    link = trainer.strategy.offloader.link
    result = {
        "before_training": [what for what, _ in before],
        "copying": [stamp for what, stamp in before if what == "clock"],
        "link": None if link is None else asdict(link),
        "advised_with": advised,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    {"probes": _ddp_worker, "link": _link_worker}[sys.argv[1]](Path(sys.argv[2]))


def test_the_predicted_peak_is_logged_beside_the_measured_one():
    config = CSwapConfig(plan="auto", profile_steps=1, min_bytes=0, budget=0.5)
    trainer, _ = train(CSwapStrategy(config))
    plan = trainer.strategy.offloader.plan
    assert plan is not None  # planned after the first step
    logged = trainer.callback_metrics
    assert logged["cswap/predicted_peak_bytes"].item() == plan.predicted_peak > 0
    assert "cswap/peak_resident_bytes_step" in logged


def test_no_predicted_peak_is_logged_without_a_plan():
    trainer, _ = train(CSwapStrategy(LOSSLESS))
    assert "cswap/predicted_peak_bytes" not in trainer.callback_metrics


@pytest.mark.parametrize("strategy", [CSwapStrategy, CSwapDDPStrategy])
def test_a_strategy_names_what_it_takes(strategy):
    with pytest.raises(TypeError, match=rf"{strategy.__name__}\(\) takes a CSwapConfig .*"
                       r"got 'zvc' \(str\); for that plan: .*\(CSwapConfig\(plan='zvc'\)\)"):
        strategy("zvc")


def test_the_global_module_hooks_of_lossy_exclude_go_when_training_ends():
    """Not when the strategy is garbage-collected: a collection in the middle of a later
    torch.compile, which guards on the global hooks, failed it (KeyError in Dynamo)."""
    from torch.nn.modules import module as hooks

    before = (dict(hooks._global_forward_pre_hooks), dict(hooks._global_forward_hooks))
    trainer, _ = train(CSwapStrategy(replace(LOSSLESS, lossy_exclude=("head*",))))
    assert trainer.strategy.offloader.modules is not None  # it named sites by module
    assert (dict(hooks._global_forward_pre_hooks), dict(hooks._global_forward_hooks)) == before


@pytest.mark.parametrize("strategy", [CSwapStrategy, CSwapDDPStrategy])
def test_config_fields_given_to_a_strategy_go_to_its_config(strategy):
    assert strategy(budget=0.5).cswap_config == CSwapConfig(budget=0.5)
    given = strategy(CSwapConfig(plan="zvc"), budget="2GiB", min_bytes=0)
    assert given.cswap_config == CSwapConfig(plan="zvc", budget=2 << 30, min_bytes=0)
    with pytest.raises(ValueError, match=r"CSwapConfig.budget=1 is 1 byte"):
        strategy(budget=1)


def test_a_keyword_neither_the_config_nor_lightning_takes_is_named_with_the_likely_field():
    with pytest.raises(TypeError, match=r"CSwapStrategy got an unexpected keyword argument "
                       r"'budgett'; did you mean CSwapConfig's 'budget'\?. It takes "
                       r"config=CSwapConfig\(...\), CSwapConfig's fields \(plan, .*\) and "
                       r"SingleDeviceStrategy's arguments"):
        CSwapStrategy(budgett=0.5)


@pytest.mark.slow
@pytest.mark.parametrize("first", ["lightning", "cswap_lightning"])
def test_import_cswap_lightning_registers_the_strategy_names_in_either_order(first):
    """`import cswap_lightning` alone, before or after Lightning, is enough for
    strategy="cswap"; it loads Lightning only once the program does."""
    second = {"lightning": "cswap_lightning", "cswap_lightning": "lightning"}[first]
    code = (f"import sys, {first}, {second}\n"
            "print('lightning' in sys.modules and 'torchmetrics' in sys.modules)\n"
            "import lightning.pytorch as pl\n"
            "trainer = pl.Trainer(strategy='cswap', accelerator='cpu', logger=False)\n"
            "print(type(trainer.strategy).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["True", "CSwapStrategy"]


class SkipsFirst(ReluNet):
    """Its first two training steps return None, as a step skipped on a non-finite loss does:
    Lightning runs no backward for them."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx < 2 else loss


def test_skipped_training_steps_are_not_taken_as_measured(caplog):
    """The first batches' steps are skipped (their graphs go without backward): the engine
    measures and plans from the first step that ran one, and training matches the plain
    strategy's."""
    config = CSwapConfig(plan="auto", profile_steps=1, min_bytes=0, budget=None)
    with caplog.at_level("INFO", logger="cswap_lightning"):
        trainer, model = train(CSwapStrategy(config), SkipsFirst, max_steps=-1, max_epochs=1)
    _, plain = train(SingleDeviceStrategy("cpu"), SkipsFirst, max_steps=-1, max_epochs=1)
    assert_same_weights(model, plain)
    assert [m for m in caplog.messages if "backward had not begun" in m] == [
        f"cswap: step {i}'s backward had not begun when the next step did: it neither "
        "measures nor checks a plan" for i in (0, 1)]
    offloader = trainer.strategy.offloader
    assert offloader.plan is not None and offloader.last_step().step == 5
