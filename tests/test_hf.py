"""The Hugging Face Trainer callback on the CPU: every micro-batch of gradient accumulation is
offloaded, weights match training without it, evaluation is untouched, and the engine's context
is always left (early stop, an error in forward)."""

from __future__ import annotations

import logging
import warnings
from dataclasses import fields, replace
from types import SimpleNamespace

import pytest
import torch
from conftest import with_checkpointing_of_5_17
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from cswap_lightning import CSwapConfig
from cswap_lightning.core.compile import is_compiled
from cswap_lightning.hf_checkpointing import trainer_checkpointing
from cswap_lightning.integrations.hf import CSwapCallback, _loss_scale
from cswap_lightning.integrations.metrics import run_summary

LOSSLESS = CSwapConfig(plan="zvc", min_bytes=0)
ACCUMULATION = 3


class RandomTokens(torch.utils.data.Dataset):
    """Sequences of random token ids with a binary label, the same every time."""

    def __init__(self, n: int = 24, length: int = 16) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 100, (n, length), generator=generator)
        self.labels = torch.randint(0, 2, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class RecordMicroBatches(TrainerCallback):
    """After each micro-batch's backward: which engine step ran, and what it offloaded."""

    def __init__(self, cswap: CSwapCallback) -> None:
        self.cswap = cswap
        self.steps: list[tuple[int, int, int]] = []  # step, bytes offloaded, bytes stored

    def _record(self) -> None:
        last = self.cswap.offloader.last_step()
        self.steps.append((last.step, last.offloaded_bytes, last.stored_bytes))

    def on_substep_end(self, args, state, control, **kwargs):
        self._record()

    def on_step_end(self, args, state, control, **kwargs):
        self._record()


def bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2)
    return BertForSequenceClassification(config)


def bert_trainer(tmp_path, callbacks: list[TrainerCallback], max_steps: int = 2,
                 epochs: int = 1, data: torch.utils.data.Dataset | None = None,
                 **arguments) -> Trainer:
    model = bert()
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, seed=0, report_to=[], max_steps=max_steps,
        num_train_epochs=epochs,
        per_device_train_batch_size=4, per_device_eval_batch_size=4,
        gradient_accumulation_steps=ACCUMULATION, learning_rate=1e-3, logging_steps=1,
        save_strategy="no", dataloader_num_workers=0, disable_tqdm=True, **arguments,
    )
    return Trainer(model, args, train_dataset=data if data is not None else RandomTokens(),
                   eval_dataset=RandomTokens(8), callbacks=callbacks)


def test_every_micro_batch_is_offloaded_and_weights_match(tmp_path, capsys):
    cswap = CSwapCallback(LOSSLESS)
    probe = RecordMicroBatches(cswap)
    trainer = bert_trainer(tmp_path / "cswap", [cswap, probe])
    trainer.train()
    plain = bert_trainer(tmp_path / "plain", [])
    plain.train()

    assert [step for step, _, _ in probe.steps] == list(range(2 * ACCUMULATION))
    assert all(offloaded > 0 for _, offloaded, _ in probe.steps)
    for (name, p), q in zip(trainer.model.state_dict().items(),
                            plain.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name

    train_logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(train_logs) == 2
    per_step = [probe.steps[i:i + ACCUMULATION] for i in (0, ACCUMULATION)]
    for entry, micro_batches in zip(train_logs, per_step, strict=True):
        offloaded = sum(b for _, b, _ in micro_batches)
        stored = sum(b for _, _, b in micro_batches)
        assert entry["cswap/offloaded_bytes"] == offloaded / ACCUMULATION  # per micro-batch
        assert entry["cswap/ratio"] == pytest.approx(offloaded / stored)
    # The summary names the step that checked the plan, the engine's third, as the Trainer
    # counts: the last micro-batch of the first optimizer step (the engine said "step 2").
    label = f"global step 1, micro-batch {ACCUMULATION} of {ACCUMULATION}"
    table, plot = tmp_path / "cswap" / "cswap_summary.txt", tmp_path / "cswap" / "cswap_memory.png"
    assert f"{label}: autograd saved" in table.read_text()
    tracked = cswap.offloader.tracked_step()
    assert tracked.step == ACCUMULATION - 1
    assert run_summary(tracked, label, table, plot) in capsys.readouterr().out

    entered = cswap.offloader.last_step().step
    metrics = trainer.evaluate()
    assert cswap.offloader.last_step().step == entered  # evaluation never entered the engine
    assert "cswap/ratio" not in metrics


@pytest.mark.slow
def test_a_compiled_model_is_offloaded_and_weights_match(tmp_path):
    from torch._dynamo.utils import counters

    compiled = {"torch_compile": True, "torch_compile_backend": "aot_eager"}
    cswap = CSwapCallback(LOSSLESS)
    trainer = bert_trainer(tmp_path / "cswap", [cswap], **compiled)
    counters.clear()
    trainer.train()
    assert not counters["graph_break"]  # Dynamo ran the callback's hooks, never traced them
    plain = bert_trainer(tmp_path / "plain", [], **compiled)
    plain.train()
    last = cswap.offloader.last_step()
    assert last.step == 2 * ACCUMULATION - 1 and last.offloaded_bytes > 0
    assert "zvc" in {s.decision for s in last.sites}
    for (name, p), q in zip(trainer.model.state_dict().items(),
                            plain.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


class RecordPlanPerEpoch(TrainerCallback):
    def __init__(self, cswap: CSwapCallback) -> None:
        self.cswap = cswap
        self.plans = []

    def on_epoch_end(self, args, state, control, **kwargs):
        self.plans.append(self.cswap.offloader.plan)


def test_each_epoch_is_profiled_and_planned_again(tmp_path):
    cswap = CSwapCallback(CSwapConfig(plan="auto", profile_steps=1, min_bytes=0))
    probe = RecordPlanPerEpoch(cswap)
    bert_trainer(tmp_path, [cswap, probe], max_steps=-1, epochs=2).train()
    first, second = probe.plans
    assert first is not None and second is not None
    assert second is not first  # epoch 2's first micro-batch was measured and planned anew


class StopAfterFirstStep(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = True


def test_early_stop_removes_the_hooks(tmp_path):
    cswap = CSwapCallback(LOSSLESS)
    trainer = bert_trainer(tmp_path, [cswap, StopAfterFirstStep()], max_steps=5)
    trainer.train()
    assert trainer.state.global_step == 1
    assert not cswap.inside
    model = trainer.model.train()
    model(**RandomTokens()[0:2])  # a forward outside train(): not offloaded any more
    assert cswap.offloader.last_step().step == ACCUMULATION - 1


class FailOnCall:
    """A forward pre-hook: raises on its n-th call, inside the model's forward."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, module, args):
        self.n -= 1
        if self.n == 0:
            raise RuntimeError("boom")


def test_an_error_in_forward_leaves_the_engine(tmp_path):
    cswap = CSwapCallback(LOSSLESS)
    trainer = bert_trainer(tmp_path, [cswap])
    trainer.model.bert.encoder.register_forward_pre_hook(FailOnCall(2))
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert not cswap.inside
    with cswap.offloader:  # entering again works: the failed forward's context was closed
        pass


class FailingTokens(RandomTokens):
    """Raises when its n-th item is read: training ends by an exception, mid-epoch."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.left -= 1
        if self.left == 0:
            raise RuntimeError("unreadable item")
        return super().__getitem__(i)


def loss_and_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
    torch.manual_seed(1)  # the same dropout masks
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss, [p.grad for p in model.parameters()]


def test_forwards_after_training_failed_are_left_alone(tmp_path):
    cswap = CSwapCallback(LOSSLESS)
    data = FailingTokens(4 * ACCUMULATION + 8)  # a batch of the second optimizer step
    trainer = bert_trainer(tmp_path, [cswap], data=data)
    with pytest.raises(RuntimeError, match="unreadable item"):
        trainer.train()
    assert trainer.state.global_step == 1  # on_train_end never came
    entered = cswap.offloader.last_step().step

    batch = RandomTokens()[0:2]
    model = trainer.model.train()
    loss, grads = loss_and_grads(model, batch)  # a plain forward and backward, outside train()
    assert cswap.offloader.last_step().step == entered  # the engine saw nothing
    plain = bert()
    plain.load_state_dict(model.state_dict())
    plain_loss, plain_grads = loss_and_grads(plain.train(), batch)
    assert torch.equal(loss, plain_loss)
    for g, h in zip(grads, plain_grads, strict=True):
        assert torch.equal(g, h)


def test_the_accuracy_guard_probes_lossy_plans_and_leaves_no_trace(tmp_path):
    # fp8 rounds to nearest (no stochastic seeds), so two runs can be compared bit for bit.
    fp8 = CSwapConfig(plan="fp8", min_bytes=0, guard_every=2, guard_tolerance=1e9)
    guarded = CSwapCallback(fp8)
    trainer = bert_trainer(tmp_path / "guarded", [guarded])
    trainer.train()
    unguarded = bert_trainer(tmp_path / "unguarded", [CSwapCallback(replace(fp8, guard_every=0))])
    unguarded.train()

    reports = guarded.guard.reports
    assert len(reports) == 3  # micro-batches 1, 3 and 5 of 6
    assert all(r.worst_rel_error > 0 and r.site_errors for r in reports)  # fp8 is lossy
    logged = [h["cswap/guard_worst_rel_error"] for h in trainer.state.log_history
              if "cswap/guard_worst_rel_error" in h]
    assert logged and logged[-1] == pytest.approx(reports[-1].worst_rel_error)
    for (name, p), q in zip(trainer.model.state_dict().items(),
                            unguarded.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_the_guard_moves_sites_that_bend_gradients_back_to_lossless(tmp_path):
    # int4 at the default tolerance: some sites bend a gradient past it, not all.
    cswap = CSwapCallback(CSwapConfig(plan="int4", min_bytes=0, guard_every=1))
    bert_trainer(tmp_path, [cswap], max_steps=1).train()
    first = cswap.guard.reports[0]
    assert first.reverted and first.error_after <= first.culprit_errors[first.reverted[0]]
    assert first.error_after <= 0.1 and set(first.reverted) < set(first.site_errors)
    reverted = set().union(*(r.reverted for r in cswap.guard.reports))
    assert cswap.offloader.reverted == reverted
    tracked = cswap.offloader.tracked_step()  # a real step after a check
    assert {s.decision for s in tracked.sites if s.site in reverted} == {"raw"}
    assert "int4" in {s.decision for s in tracked.sites}  # the others stay lossy


class RandomText(RandomTokens):
    """Random token sequences for a causal language model (the model shifts the labels)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def llama_trainer(tmp_path, callbacks: list[TrainerCallback],
                  model_class: type[LlamaForCausalLM] = LlamaForCausalLM, **arguments) -> Trainer:
    """A tiny Llama (two decoder layers), trained for two steps."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, seed=0, report_to=[], max_steps=2,
        per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, save_strategy="no",
        dataloader_num_workers=0, disable_tqdm=True, **arguments,
    )
    return Trainer(model_class(config), args, train_dataset=RandomText(),
                   callbacks=callbacks)


def test_the_trainer_turns_the_models_key_value_cache_off_by_default(tmp_path):
    """What the README and the engine's warning about a cache handed to recomputed layers say
    of the Trainer: it sets the model's ``use_cache`` from ``TrainingArguments.use_cache``,
    False unless asked."""
    assert llama_trainer(tmp_path / "default", []).model.config.use_cache is False
    assert llama_trainer(tmp_path / "asked", [], use_cache=True).model.config.use_cache is True


# The Trainer's checkpointing arguments and the model's switch, as transformers names them:
# from 5.23, and in 5.17-5.22 (the offload switch's first releases; later ones take those
# argument names as aliases, and their Trainer calls the old switch where it is the only one).
CHECKPOINTING_NAMES = {
    "activation_checkpointing": LlamaForCausalLM,
    "gradient_checkpointing": with_checkpointing_of_5_17(LlamaForCausalLM),
}
if "activation_checkpointing" not in {f.name for f in fields(TrainingArguments)}:
    del CHECKPOINTING_NAMES["activation_checkpointing"]  # transformers 5.17-5.22
INSTALLED_NAMES = next(iter(CHECKPOINTING_NAMES))


def checkpointed_llama_trainer(tmp_path, callbacks: list[TrainerCallback],
                               checkpointing: dict | None,
                               names: str = INSTALLED_NAMES) -> Trainer:
    """The tiny Llama with activation checkpointing (``checkpointing``: its kwargs), under the
    names of ``CHECKPOINTING_NAMES[names]``."""
    return llama_trainer(tmp_path, callbacks, CHECKPOINTING_NAMES[names],
                         **{names: True, f"{names}_kwargs": checkpointing})


def logged_bytes(trainer: Trainer) -> list[float]:
    return [h["cswap/offloaded_bytes"] for h in trainer.state.log_history
            if "cswap/offloaded_bytes" in h]


def test_the_trainers_checkpointing_arguments_are_read_under_either_name(tmp_path):
    checkpointing = {"offload": True, "every_n_layers": 2}
    for names in CHECKPOINTING_NAMES:
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                 **{names: True, f"{names}_kwargs": checkpointing})
        assert trainer_checkpointing(args) == checkpointing
    assert trainer_checkpointing(TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                   report_to=[])) is None
    # The fields of transformers 5.17-5.22's TrainingArguments (no activation_checkpointing):
    older = SimpleNamespace(gradient_checkpointing=True,
                            gradient_checkpointing_kwargs=checkpointing)
    assert trainer_checkpointing(older) == checkpointing


@pytest.mark.parametrize("names", sorted(CHECKPOINTING_NAMES))
def test_the_engine_takes_the_checkpoint_boundaries_over_from_hf_offload(tmp_path, caplog,
                                                                          names):
    raw = CSwapConfig(plan="raw", min_bytes=0)
    with caplog.at_level(logging.WARNING, logger=CSwapCallback.__module__):
        offloading = checkpointed_llama_trainer(tmp_path / "offload", [CSwapCallback(raw)],
                                                {"offload": True}, names)
        offloading.train()
    told = [r.getMessage() for r in caplog.records if "cswap" in r.getMessage()]
    assert len(told) == 1 and "offload" in told[0]

    checkpointing = checkpointed_llama_trainer(tmp_path / "checkpoint", [CSwapCallback(raw)],
                                               None, names)
    checkpointing.train()
    assert logged_bytes(offloading) == logged_bytes(checkpointing)  # per optimizer step
    assert len(logged_bytes(offloading)) == 2 and logged_bytes(offloading)[0] > 0

    plain = checkpointed_llama_trainer(tmp_path / "plain", [], None, names)
    plain.train()
    for (name, p), q in zip(offloading.model.state_dict().items(),
                            plain.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.slow
def test_torch_compile_is_done_per_block_so_offloading_lowers_the_peak(tmp_path, caplog):
    """The Trainer would compile the whole model, whose backward brings back every offloaded
    tensor at once; the callback compiles each decoder layer instead. Measured (raw, no
    prefetch): the last step's peak of saved tensors resident at once is 118,272 B per block
    against 263,432 B compiled whole (the callback added after the Trainer was built, too late
    to take over), and the weights are those of the Trainer's own whole-model compile."""
    compiled = {"torch_compile": True, "torch_compile_backend": "aot_eager"}
    raw = CSwapConfig(plan="raw", min_bytes=0, prefetch_bytes=0)
    cswap = CSwapCallback(raw)
    with caplog.at_level(logging.WARNING, logger=CSwapCallback.__module__), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        per_block = llama_trainer(tmp_path / "per_block", [cswap], **compiled)
        per_block.train()
    told = [r.getMessage() for r in caplog.records if "cswap" in r.getMessage()]
    assert len(told) == 1 and "compile" in told[0]
    assert not [w for w in caught if "at once" in str(w.message)]
    layers = per_block.model.model.layers
    assert all(is_compiled(layer) for layer in layers)
    assert per_block.model_wrapped is per_block.model

    late = CSwapCallback(raw)
    whole = llama_trainer(tmp_path / "whole", [], **compiled)
    whole.add_callback(late)
    with pytest.warns(RuntimeWarning, match="moved off the device at once"):
        whole.train()
    peak = cswap.offloader.last_step().peak_resident_bytes
    assert peak < 0.6 * late.offloader.last_step().peak_resident_bytes

    plain = llama_trainer(tmp_path / "plain", [], **compiled)
    plain.train()
    for (name, p), q in zip(per_block.model.state_dict().items(),
                            plain.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_the_predicted_peak_is_logged_beside_the_measured_one(tmp_path):
    cswap = CSwapCallback(CSwapConfig(plan="auto", profile_steps=1, min_bytes=0, budget=0.5))
    trainer = bert_trainer(tmp_path, [cswap])
    trainer.train()
    plan = cswap.offloader.plan
    assert plan is not None
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged[-1]["cswap/predicted_peak_bytes"] == plan.predicted_peak > 0
    assert logged[-1]["cswap/peak_resident_bytes"] > 0


def test_the_callback_names_what_it_takes():
    with pytest.raises(TypeError, match=r"CSwapCallback\(\) takes a CSwapConfig .* got 'raw'"):
        CSwapCallback("raw")


def test_the_global_module_hooks_of_lossy_exclude_go_when_training_ends(tmp_path):
    from torch.nn.modules import module as hooks

    before = (dict(hooks._global_forward_pre_hooks), dict(hooks._global_forward_hooks))
    cswap = CSwapCallback(replace(LOSSLESS, lossy_exclude=("classifier*",)))
    bert_trainer(tmp_path, [cswap]).train()
    assert cswap.offloader.modules is not None  # it named sites by module
    assert (dict(hooks._global_forward_pre_hooks), dict(hooks._global_forward_hooks)) == before


def test_the_shadows_loss_scale_follows_a_trainer_without_loss_is_scaled_for_ga():
    """transformers 5.17 (the floor) has no ``Trainer.loss_is_scaled_for_ga``: the shadow's
    loss is divided by the accumulation steps unless the model got ``num_items_in_batch`` or
    a ``compute_loss_func`` normalised it, as that Trainer's ``training_step`` does."""
    trainer = SimpleNamespace(model_accepts_loss_kwargs=True, compute_loss_func=None,
                              current_gradient_accumulation_steps=4)
    assert _loss_scale(trainer, {"num_items_in_batch": torch.tensor(8)}) == 1
    assert _loss_scale(trainer, {"num_items_in_batch": None}) == 4
    assert _loss_scale(trainer, {}) == 4
    trainer.compute_loss_func = lambda *args, **kwargs: None
    assert _loss_scale(trainer, {}) == 1
