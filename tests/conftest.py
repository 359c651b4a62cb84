import importlib.util
import itertools
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from cswap_lightning import Offloader
from cswap_lightning.codecs import codec_names, get_codec, register
from cswap_lightning.codecs.reference import RawCodec
from cswap_lightning.recipes.nets import build_cnn

# cuBLAS is deterministic only with a fixed workspace (torch.use_deterministic_algorithms
# refuses cuBLAS calls without this setting). PyTorch reads it once, to size its cuBLAS
# workspaces at the process's first cuBLAS call, so it is set here, before any test runs one;
# on an H100 it is PyTorch's default size anyway (8 x 4 MiB).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

# torch before 2.13: checkpoint saves an empty tensor of its own through the saved-tensor hooks
# at each checkpointed call (``_NoopSaveInputs``): no bytes, and not the model's.
CHECKPOINT_SAVES_EMPTY = hasattr(torch.utils.checkpoint, "_NoopSaveInputs")


def model_shapes(shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The shapes of what the model saved, without checkpoint's own empty tensors."""
    return [s for s in shapes if not (CHECKPOINT_SAVES_EMPTY and s == (0,))]


# Module fixtures that take 5 s or more before their first test (`pytest --durations` on a
# 2-core machine): the nvcc and g++ harness builds, the benchmark suite, test_compile's
# compiled runs. Their tests are slow, whichever of them runs first.
SLOW_FIXTURES = {"built_library", "lossy_harness", "emulated_harness", "suite", "runs"}


# DALI has wheels for Linux only: elsewhere the image recipes' tests skip, as CUDA's do
DALI = importlib.util.find_spec("nvidia") is not None and (
    importlib.util.find_spec("nvidia.dali") is not None)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    no_dali = pytest.mark.skip(reason="NVIDIA DALI is not installed (pip install "
                               "'cswap-lightning[dali]'; Linux only)")
    for item in items:
        if SLOW_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
        if "dali" in item.keywords and not DALI:
            item.add_marker(no_dali)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles afresh: Dynamo's recompile limit counts per code object over the
    whole process, and many tests compile an ``nn.Sequential`` (one ``forward`` code)."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()


@pytest.fixture
def deterministic():
    """Deterministic kernels for a bitwise comparison on the GPU (cuDNN otherwise picks its
    convolution algorithms per run, and some differ in rounding); the previous settings after."""
    cudnn = torch.backends.cudnn
    before = (cudnn.deterministic, cudnn.benchmark, torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    cudnn.deterministic, cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True)
    yield
    cudnn.deterministic, cudnn.benchmark = before[:2]
    torch.use_deterministic_algorithms(before[2], warn_only=before[3])


def load_benchmark(name: str, monkeypatch: pytest.MonkeyPatch):
    """``benchmarks/NAME.py`` as a module, registered while the test runs (a dataclass of
    the script looks its module up in ``sys.modules``)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)
    spec.loader.exec_module(script)
    return script


def quick_predictions(name: str, monkeypatch: pytest.MonkeyPatch, out: Path):
    """``benchmarks/NAME.py --quick --out OUT`` run: the script, and what it wrote to
    OUT.json, labelled a prediction."""
    script = load_benchmark(name, monkeypatch)
    assert script.main(["--quick", "--out", str(out)]) == 0
    data = json.loads(Path(f"{out}.json").read_text())
    assert data["meta"]["kind"].startswith("prediction")
    return script, data


def ops_run_again(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The operators (``aten::silu``) recomputations below the layer run again, as they run
    them."""
    from cswap_lightning.core import selective

    ran: list[str] = []
    real = selective.Recomputing._run

    def run(self, func, args, kwargs):
        ran.append(func._schema.name)
        return real(self, func, args, kwargs)

    monkeypatch.setattr(selective.Recomputing, "_run", run)
    return ran


def spy_on_moves(session: Offloader, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The addresses of the storages the session moves off the device, as it moves them."""
    moved: list[int] = []
    offload_one = session.transfer.offload

    def recording(entry, flat, *args, **kwargs):
        moved.append(flat.untyped_storage().data_ptr())
        return offload_one(entry, flat, *args, **kwargs)

    monkeypatch.setattr(session.transfer, "offload", recording)
    return moved


def wide_mlp(activation: type[nn.Module]) -> tuple[nn.Module, torch.Tensor]:
    """8 x (Linear(1024) + activation) and a batch of 512: every activation is 2 MiB."""
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), activation()]
    return nn.Sequential(*layers), torch.randn(512, 1024)


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def make_cnn() -> nn.Module:
    return build_cnn(width=8)


def make_transformer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                         nn.Flatten(), nn.Linear(32 * 16, 10))


MODELS = {
    "mlp": (make_mlp, (32, 64)),
    "cnn": (make_cnn, (16, 1, 8, 8)),
    "transformer": (make_transformer, (4, 16, 32)),
}


def model_and_batch(name: str, device: str = "cpu", seed: int = 0):
    factory, shape = MODELS[name]
    torch.manual_seed(seed)
    model = factory().to(device)
    x = torch.randn(*shape, device=device)
    y = torch.randint(0, 10, (shape[0],), device=device)
    return model, x, y


def grads(model, x, y, offloader=None, steps=1):
    """Gradients after `steps` forward/backward passes of the same batch (reset each step)."""
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        if offloader is None:
            loss = F.cross_entropy(model(x), y)
        else:
            with offloader:
                loss = F.cross_entropy(model(x), y)
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]


class Faithful(RawCodec):
    """Registered as "int8", but stores the bits exactly."""

    name = "int8"
    lossless = False


class Destructive(Faithful):
    """Registered as "int8", gives back noise of the right shape and dtype."""

    def decode(self, packed):
        out = super().decode(packed)
        return torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)


@pytest.fixture
def as_int8():
    previous = get_codec("int8") if "int8" in codec_names() else None

    def install(codec):
        register(codec)

    yield install
    if previous is not None:
        register(previous)


def with_checkpointing_of_5_17(model_class: type) -> type:
    """``model_class`` (a transformers model) with the checkpointing API of transformers
    5.17-5.22, whichever release is installed: no ``activation_checkpointing_enable``, and a
    ``gradient_checkpointing_enable(gradient_checkpointing_kwargs, every_n_layers, offload)``
    that checkpoints through the installed release's own code. A later release's Trainer falls
    back to that method, and calls it as 5.17's Trainer does."""
    if not hasattr(model_class, "activation_checkpointing_enable"):
        return model_class  # the installed transformers has that API

    class Checkpointing517(model_class):
        @property
        def activation_checkpointing_enable(self):
            raise AttributeError("activation_checkpointing_enable came in transformers 5.23")

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None,
                                          every_n_layers=1, offload=False):
            self._activation_checkpointing_enable(gradient_checkpointing_kwargs, every_n_layers,
                                                  offload)

    return Checkpointing517


@pytest.fixture
def ticking_clock(monkeypatch):
    """Every time stamp the engine takes one millisecond after the one before: its windows and
    blocks' times count the stamps between them, whatever this machine's speed or load (the
    planner's choice then follows the step's structure, the same on every machine)."""
    from cswap_lightning.planning import profiler

    ticks = itertools.count()
    monkeypatch.setattr(profiler.Clock, "now", lambda self: next(ticks) * 1e-3)
    monkeypatch.setattr(profiler.Clock, "seconds", lambda self, start, end: end - start)


@pytest.fixture
def config_file(tmp_path):
    """Writes a transformers config as ``<tmp>/<name>/config.json`` (as a hub snapshot holds
    it) and returns its path."""

    def write(name: str, config: dict) -> str:
        path = tmp_path / name / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(config))
        return str(path)

    return write
