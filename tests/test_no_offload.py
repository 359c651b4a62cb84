"""``no_offload()`` (``core/saved_hooks.py``): torch.func's transforms, which refuse to run under
saved-tensor hooks, run inside the Offloader's block (a physics-informed model's slopes, in a
layer and in the loss; a slope in BERT's classifier under the Hugging Face callback), training
stays bitwise the training without the library, recomputed layers included, and the hooks in
force are back on leaving."""

from __future__ import annotations

import pytest
import torch
from test_conformance import Built, _gen, differences, projected, train
from test_lightning import assert_same_weights
from test_recompute import saved_tensors
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

import cswap_lightning as cswap
from cswap_lightning.core.saved_hooks import top_hooks

WIDTH = 16


def slopes(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """d sum(mlp(x_i)) / d x_i for each row x_i, differentiable in mlp's weights."""
    params = dict(mlp.named_parameters())

    def f(row: torch.Tensor) -> torch.Tensor:
        return functional_call(mlp, params, (row,)).sum()

    with cswap.no_offload():
        return vmap(grad(f))(x)


class Slope(nn.Module):
    """A layer that reads its own MLP's slope (as a physics-informed network does)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.Tanh(),
                                 nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x) * slopes(self.mlp, x)


class Pinn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Slope() for _ in range(3))
        self.head = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.Tanh(),
                                  nn.Linear(4 * WIDTH, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def pinn_loss(model: nn.Module, inputs: dict) -> torch.Tensor:
    """The output's projection plus the head's slope as a penalty (torch.func in the loss)."""
    x = model(inputs["x"])
    return projected(model.head(x)) + slopes(model.head, x).square().mean()


def pinn() -> Built:
    torch.manual_seed(0)
    return Built(Pinn(), {"x": torch.randn(8, WIDTH, generator=_gen())}, pinn_loss)


def config(plan: str) -> cswap.CSwapConfig:
    return cswap.CSwapConfig(plan=plan, min_bytes=0, profile_steps=1, budget=None)


def test_torch_func_refuses_the_offloaders_hooks_without_it():
    built = pinn()
    with cswap.Offloader(config("raw")), pytest.raises(
            RuntimeError, match="don't yet support saved tensor hooks"):
        vmap(grad(lambda row: built.model.head(row).sum()))(built.inputs["x"])


@pytest.mark.parametrize("plan", ["raw", "zvc", "auto"])
def test_training_with_torch_func_inside_the_block_is_bitwise_plain(plan):
    built = pinn()
    plain = train(built, 4)
    offloader = cswap.Offloader(config(plan))
    assert differences(plain, train(built, 4, offloader)) == []
    if plan != "auto":
        assert offloader.last_step().offloaded_bytes > 0


@pytest.mark.parametrize("block", ["layers.1", "layers.1:elementwise"])
def test_a_recomputed_layer_with_torch_func_inside_is_bitwise_plain(block):
    built = pinn()
    plain = train(built, 4)
    offloader = cswap.Offloader(config("raw"))
    got = train(built, 4, offloader,
                prepare=lambda model: offloader.watch(model).recompute([block]))
    assert differences(plain, got) == []
    assert offloader.recomputed == {block}
    whole = cswap.Offloader(config("raw"))
    train(built, 4, whole)
    # the layer's saves dropped (those of its slopes, kept by no_offload, never came)
    assert saved_tensors(offloader.last_step()) < saved_tensors(whole.last_step())


def test_the_hooks_in_force_are_back_on_leaving_also_on_an_exception():
    offloader = cswap.Offloader(config("raw"))
    with offloader:
        ours = top_hooks()
        with torch.autograd.graph.save_on_cpu():  # another's, on top of ours
            theirs = top_hooks()
            with cswap.no_offload():
                assert top_hooks() is None
            assert top_hooks() == theirs
            with pytest.raises(ValueError, match="inside"), cswap.no_offload():
                raise ValueError("inside")
            assert top_hooks() == theirs
        assert top_hooks() == ours and ours is not None
    assert top_hooks() is None


def test_the_lightning_strategy_trains_a_torch_func_loss_bitwise(tmp_path, monkeypatch):
    import lightning.pytorch as pl
    from test_lightning import train as fit

    class PinnModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Pinn()
            self.proj = nn.Linear(16, WIDTH)

        def training_step(self, batch, batch_idx):
            return pinn_loss(self.net, {"x": self.proj(batch[0])})

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    monkeypatch.chdir(tmp_path)  # where the strategy writes its summary
    trainer, model = fit(cswap.CSwapStrategy(config("raw")), PinnModule)
    _, plain = fit(pl.strategies.SingleDeviceStrategy("cpu"), PinnModule)
    assert_same_weights(model, plain)
    assert trainer.strategy.offloader.last_step().offloaded_bytes > 0


def test_the_hugging_face_callback_trains_a_torch_func_model_bitwise(tmp_path):
    """The callback's block holds the model's forward (the Trainer's loss is outside it):
    BERT's classifier adds its own slope to its logits there."""
    from test_hf import bert_trainer

    def with_slope(classifier: nn.Module, args: tuple, logits: torch.Tensor) -> torch.Tensor:
        def f(row: torch.Tensor) -> torch.Tensor:  # not the module: its hook would run again
            return F.linear(row, classifier.weight, classifier.bias).tanh().sum()

        with cswap.no_offload():
            slope = vmap(grad(f))(args[0])
        return logits + slope.square().mean()

    callback = cswap.CSwapCallback(config("raw"))
    trainers = []
    for where, callbacks in (("cswap", [callback]), ("plain", [])):
        trainers.append(bert_trainer(tmp_path / where, callbacks))
        trainers[-1].model.classifier.register_forward_hook(with_slope)
        trainers[-1].train()
    for (name, p), q in zip(trainers[0].model.state_dict().items(),
                            trainers[1].model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert callback.offloader.last_step().offloaded_bytes > 0
