"""Launch parameters (grid, block) of the CUDA codec kernels, tuned by hyperopt's TPE.

Each kernel, a codec (zvc, rle; exponent, bfloat16 only) x direction (encode, decode) x
element type, runs fastest at a grid and block size that depend on the GPU. As in CSwap,
TPE finds a near-best pair in a few dozen timed runs; an exhaustive search of a reduced
space (powers-of-two grids) is kept to compare against. A search only sees an objective
``(grid, block) -> seconds``: on a GPU, CUDA events timing the real codec
(``cuda_objective``); in tests, any function.

Results are cached as JSON per GPU model and extension build. A cache file that does not
parse, has another schema version, or was written for another GPU or build is ignored with a
warning and tuned anew, never trusted; so is anything at its path that is not a regular file,
and a cache in folders others can write to (the library loader's rule,
``cuda_build.check_cache_file``), which is then not written either.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import stat
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from hyperopt import fmin, hp, tpe

from ..codecs import cuda_build
from ..codecs.cuda import (
    CudaExponentCodec,
    CudaRLECodec,
    CudaZVCCodec,
    enable_cuda_codecs,
    load_extension,
)
from .predictor import KernelRun, record_runs
from .profiler import median_seconds

CODECS = {"zvc": CudaZVCCodec, "rle": CudaRLECodec, "exponent": CudaExponentCodec}
ZERO_CODECS = ("zvc", "rle")  # tuned for each dtype asked; exponent on bfloat16, no zeros
DIRECTIONS = ("encode", "decode")
DTYPES = ("float32", "float16", "bfloat16", "float64", "bool")
BLOCKS = (64, 128, 256)
MAX_GRID = 4096
GRID_SEARCH_GRIDS = tuple(2**i for i in range(13))  # 1, 2, 4, ..., 4096
SEARCH_SPACE = {
    "grid": hp.qloguniform("grid", 0.0, math.log(MAX_GRID), 1),  # integers 1..4096
    "block": hp.choice("block", BLOCKS),
}
CACHE_SCHEMA = "cswap-lightning/kernel-tuning"
CACHE_VERSION = 1
MAX_CACHE_BYTES = 64 << 20  # ~65 bytes a timed run: a million runs (a default tuning: 552)

Objective = Callable[[int, int], float]
"""Seconds one kernel run takes at launch parameters (grid, block)."""


class TunerUnavailable(RuntimeError):
    """Tuning needs a CUDA device and the compiled codec library."""


@dataclass(frozen=True)
class Kernel:
    """One tuned kernel. The kernels see element sizes, not dtypes: bfloat16 runs float16's."""

    codec: str
    direction: str
    dtype: str

    def __post_init__(self) -> None:
        for field, value, known in (("codec", self.codec, tuple(CODECS)),
                                    ("direction", self.direction, DIRECTIONS),
                                    ("dtype", self.dtype, DTYPES)):
            if value not in known:
                raise ValueError(f"unknown kernel {field} {value!r}; choose from {known}")
        codec = CODECS[self.codec]
        if not codec.packs(self.dtype):
            raise ValueError(f"codec {self.codec!r} packs {', '.join(map(str, codec.dtypes))} "
                             f"only, not {self.dtype}")

    @property
    def name(self) -> str:
        return f"{self.codec}/{self.direction}/{self.dtype}"

    @property
    def elem_size(self) -> int:
        return getattr(torch, self.dtype).itemsize

    def sparsity(self, settings: Settings) -> float:
        """The zeros it is timed on: the settings' (a dense codec's: none)."""
        return 0.0 if self.codec not in ZERO_CODECS else settings.sparsity


def all_kernels(dtypes: Sequence[str] = ("float32", "float16")) -> tuple[Kernel, ...]:
    """Every zero codec x direction for ``dtypes``, which must differ in element size, and
    the exponent codec's on bfloat16."""
    sizes: dict[int, str] = {}
    for dtype in dtypes:
        other = sizes.setdefault(Kernel("zvc", "encode", dtype).elem_size, dtype)
        if other != dtype:
            raise ValueError(
                f"{other} and {dtype} run the same kernels ({getattr(torch, dtype).itemsize}-byte "
                "elements): tune only one of them"
            )
    return (tuple(Kernel(c, d, t) for t in dtypes for c in ZERO_CODECS for d in DIRECTIONS)
            + tuple(Kernel("exponent", d, "bfloat16") for d in DIRECTIONS))


@dataclass(frozen=True)
class Settings:
    """What a search measures (tensor size and sparsity) and how (budget, seed)."""

    nbytes: int = 64 << 20
    sparsity: float = 0.5
    max_evals: int = 30
    startup: int = 6  # random samples before TPE models the results
    seed: int = 0
    compare_grid: bool = True  # also run the exhaustive search of the reduced space

    def __post_init__(self) -> None:
        if self.nbytes < 1:
            raise ValueError(f"nbytes must be positive, got {self.nbytes}")
        if not 0.0 <= self.sparsity <= 1.0:
            raise ValueError(f"sparsity must be in [0, 1], got {self.sparsity}")
        if not 1 <= self.startup <= self.max_evals:
            raise ValueError(
                f"need 1 <= startup <= max_evals, got startup={self.startup}, "
                f"max_evals={self.max_evals}"
            )


@dataclass(frozen=True)
class Search:
    """One search: its timed launches (grid, block, seconds) in order, and its wall time."""

    trials: tuple[tuple[int, int, float], ...]
    wall_seconds: float

    @property
    def best(self) -> tuple[int, int, float]:
        return min(self.trials, key=lambda trial: trial[2])

    @property
    def evaluations(self) -> int:
        return len(self.trials)


def tpe_search(objective: Objective, max_evals: int = 30, startup: int = 6, seed: int = 0
               ) -> Search:
    """hyperopt TPE over grid 1..4096 (log-uniform integers) x block in ``BLOCKS``."""
    trials: list[tuple[int, int, float]] = []

    def loss(params: dict) -> float:
        grid, block = int(params["grid"]), int(params["block"])
        trials.append((grid, block, objective(grid, block)))
        return trials[-1][2]

    start = time.perf_counter()
    # hyperopt 0.3's TPE sets arrays' shapes, which NumPy 2.5 (Python 3.12 on) deprecates: a
    # warning per evaluation, an error under -W error
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Setting the shape on a NumPy array", DeprecationWarning)
        fmin(loss, SEARCH_SPACE, algo=functools.partial(tpe.suggest, n_startup_jobs=startup),
             max_evals=max_evals, rstate=np.random.default_rng(seed), verbose=False,
             show_progressbar=False)
    return Search(tuple(trials), time.perf_counter() - start)


def grid_search(objective: Objective, grids: Sequence[int] = GRID_SEARCH_GRIDS,
                blocks: Sequence[int] = BLOCKS) -> Search:
    """Every grid x block: the exhaustive baseline TPE is compared against."""
    start = time.perf_counter()
    trials = tuple((g, b, objective(g, b)) for g in grids for b in blocks)
    return Search(trials, time.perf_counter() - start)


@dataclass(frozen=True)
class KernelTuning:
    kernel: Kernel
    tpe: Search
    grid: Search | None  # None when the exhaustive search was skipped

    @property
    def best(self) -> tuple[int, int, float]:
        """The fastest launch either search measured."""
        searches = [self.tpe] if self.grid is None else [self.tpe, self.grid]
        return min((s.best for s in searches), key=lambda trial: trial[2])


@dataclass(frozen=True)
class TimedLaunch:
    """One measured kernel run, a plain record for the codec time predictor."""

    codec: str
    direction: str
    dtype: str
    nbytes: int
    sparsity: float
    grid: int
    block: int
    seconds: float


@dataclass(frozen=True)
class CacheKey:
    """What a tuning is valid for: the GPU model and the extension build."""

    device: str
    capability: tuple[int, int]
    build: str


@dataclass(frozen=True)
class TuningResult:
    key: CacheKey
    settings: Settings
    kernels: tuple[KernelTuning, ...]

    def launch(self, codec: str, direction: str, dtype: str) -> tuple[int, int]:
        """The tuned (grid, block) of one kernel; KeyError if it was not tuned."""
        wanted = Kernel(codec, direction, dtype)
        for tuning in self.kernels:
            if tuning.kernel == wanted:
                return tuning.best[:2]
        raise KeyError(f"kernel {wanted.name} was not tuned; tuned: "
                       f"{[t.kernel.name for t in self.kernels]}")

    def launches(self, codec: str) -> dict[tuple[str, int], tuple[int, int]]:
        """(direction, element size) -> (grid, block) of ``codec``, as the CUDA codecs take."""
        return {(t.kernel.direction, t.kernel.elem_size): t.best[:2]
                for t in self.kernels if t.kernel.codec == codec}

    def runs(self) -> list[TimedLaunch]:
        """Every timed kernel run of every search."""
        s = self.settings
        return [TimedLaunch(t.kernel.codec, t.kernel.direction, t.kernel.dtype, s.nbytes,
                            t.kernel.sparsity(s), grid, block, seconds)
                for t in self.kernels for search in (t.tpe, t.grid) if search is not None
                for grid, block, seconds in search.trials]

    def best_runs(self) -> list[KernelRun]:
        """Each kernel's run at its chosen launch, for the codec time predictor."""
        s = self.settings
        return [KernelRun(t.kernel.codec, t.kernel.direction, s.nbytes, t.kernel.sparsity(s),
                          t.best[2])
                for t in self.kernels]

    def to_json(self) -> dict:
        return {"schema": CACHE_SCHEMA, "version": CACHE_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: object) -> TuningResult:
        """Parse and check a cache file's contents; ValueError says what is wrong."""
        if not isinstance(data, dict) or data.get("schema") != CACHE_SCHEMA:
            raise ValueError(f"not a {CACHE_SCHEMA} file")
        if data.get("version") != CACHE_VERSION:
            raise ValueError(f"schema version {data.get('version')!r}, expected {CACHE_VERSION}")
        try:
            key = data["key"]
            return cls(
                CacheKey(str(key["device"]), tuple(map(int, key["capability"])), str(key["build"])),
                Settings(**data["settings"]),
                tuple(KernelTuning(Kernel(**k["kernel"]), _search_from_json(k["tpe"]),
                                   None if k["grid"] is None else _search_from_json(k["grid"]))
                      for k in data["kernels"]),
            )
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed tuning data ({type(err).__name__}: {err})") from None


def _search_from_json(data: dict) -> Search:
    trials = tuple((int(g), int(b), float(s)) for g, b, s in data["trials"])
    if not trials:
        raise ValueError("a search without trials")
    for grid, block, seconds in trials:
        if not (1 <= grid <= MAX_GRID and block in BLOCKS and math.isfinite(seconds)
                and seconds > 0):
            raise ValueError(f"invalid trial grid={grid}, block={block}, seconds={seconds}")
    return Search(trials, float(data["wall_seconds"]))


def tune(key: CacheKey, objective_for: Callable[[Kernel], Objective], kernels: Iterable[Kernel],
         settings: Settings = Settings(), log: Callable[[str], None] | None = None
         ) -> TuningResult:
    """Search each kernel with TPE (and, if asked, exhaustively) on ``objective_for(kernel)``."""
    done = []
    for kernel in kernels:
        objective = objective_for(kernel)
        tpe_result = tpe_search(objective, settings.max_evals, settings.startup, settings.seed)
        grid_result = grid_search(objective) if settings.compare_grid else None
        done.append(KernelTuning(kernel, tpe_result, grid_result))
        if log:
            log(f"{kernel.name}: TPE {_summary(tpe_result)}"
                + (f"; grid search {_summary(grid_result)}" if grid_result else ""))
    return TuningResult(key, settings, tuple(done))


def _summary(search: Search) -> str:
    grid, block, seconds = search.best
    return (f"best grid={grid} block={block} {seconds * 1e3:.3f} ms, "
            f"{search.evaluations} runs in {search.wall_seconds:.1f} s")


# --- the cache ------------------------------------------------------------------------------


def cache_path(key: CacheKey) -> Path:
    """``<cuda_build cache root>/tuning/<gpu>-sm<cc>-<build>.json``."""
    gpu = re.sub(r"[^a-z0-9]+", "-", key.device.lower()).strip("-")
    major, minor = key.capability
    return cuda_build.cache_root() / "tuning" / f"{gpu}-sm{major}{minor}-{key.build}.json"


def read_cache(path: Path, key: CacheKey) -> TuningResult | None:
    """The cached tuning for ``key``; None, with a warning, if the file is unusable or the
    cache folders are not private. None without one if there is no file yet."""
    try:
        cuda_build.check_cache_file(path)
        result = TuningResult.from_json(json.loads(_read_regular_file(path, MAX_CACHE_BYTES)))
        if result.key != key:
            raise ValueError(f"it was written for {result.key}, this is {key}")
    except FileNotFoundError:
        return None
    # OSError and BuildError: unreadable or not private; ValueError: JSONDecodeError and
    # UnicodeDecodeError included; RecursionError: JSON nested too deep to parse.
    except (OSError, cuda_build.BuildError, ValueError, RecursionError) as err:
        warnings.warn(f"cswap: ignoring the kernel tuning cache {path}: {err}. Tuning anew.",
                      RuntimeWarning, stacklevel=2)
        return None
    return result


def _read_regular_file(path: Path, limit: int) -> str:
    """The text of ``path`` if it is a regular file of at most ``limit`` bytes; ValueError if
    not. Opening without blocking and checking the open file means a FIFO cannot hang the
    read, nor a device (``/dev/zero``) exhaust memory."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("it is not a regular file")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"it is larger than {limit} bytes")
    return data.decode()


def write_cache(path: Path, result: TuningResult) -> None:
    """Write through a temporary file and a rename: readers never see half a file. Where the
    cache folders are not private or the file cannot be written, warn and write nothing: the
    tuning is still good, only not cached."""
    try:
        cuda_build.make_cache_folder(path.parent)
        fd, tmp = tempfile.mkstemp(prefix=".tuning-", suffix=".json", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(result.to_json(), f, indent=1)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except (OSError, cuda_build.BuildError) as err:
        warnings.warn(f"cswap: not writing the kernel tuning cache {path}: {err}",
                      RuntimeWarning, stacklevel=2)


def load_or_tune(key: CacheKey, objective_for: Callable[[Kernel], Objective],
                 kernels: Iterable[Kernel], settings: Settings = Settings(),
                 path: Path | None = None, force: bool = False,
                 log: Callable[[str], None] | None = None) -> TuningResult:
    """The cached tuning if it covers ``kernels`` with ``settings``, else a new one, cached."""
    kernels = tuple(kernels)
    path = path or cache_path(key)
    cached = None if force else read_cache(path, key)
    if (cached is not None and cached.settings == settings
            and set(kernels) <= {t.kernel for t in cached.kernels}):
        return cached
    result = tune(key, objective_for, kernels, settings, log)
    write_cache(path, result)
    return result


# --- on a GPU -------------------------------------------------------------------------------


def cuda_key() -> CacheKey:
    """This process's GPU and extension build; TunerUnavailable says what is missing."""
    need = "kernel tuning needs a CUDA device and the CUDA codec library (compiled with nvcc)"
    if not torch.cuda.is_available():
        raise TunerUnavailable(f"{need}; here torch.cuda.is_available() is False")
    try:
        build = cuda_build.library_path().parent.name
    except cuda_build.BuildError as err:
        raise TunerUnavailable(f"{need}; here {err}") from None
    if load_extension() is None:
        raise TunerUnavailable(f"{need}; here the library did not load (see the warning above)")
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return CacheKey(torch.cuda.get_device_name(index), (major, minor), build)


def cuda_objective(kernel: Kernel, nbytes: int = 64 << 20, sparsity: float = 0.5,
                   repeats: int = 5, warmup: int = 2) -> Objective:
    """Median CUDA-event time of the real kernel on ``nbytes`` with ``sparsity`` zeros."""
    dtype, device = getattr(torch, kernel.dtype), torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    numel = max(nbytes // dtype.itemsize, 1)
    t = (torch.rand(numel, device=device, generator=gen) + 0.5).to(dtype)
    t.masked_fill_(torch.rand(numel, device=device, generator=gen) < sparsity, 0)
    codec_type = CODECS[kernel.codec]
    packed = codec_type().encode(t) if kernel.direction == "decode" else None

    def objective(grid: int, block: int) -> float:
        codec = codec_type(grid=grid, block=block)

        def run() -> object:
            return codec.encode(t) if packed is None else codec.decode(packed)

        return median_seconds(run, device, warmup, repeats)

    return objective


def tune_cuda(settings: Settings = Settings(), dtypes: Sequence[str] = ("float32", "float16"),
              force: bool = False, log: Callable[[str], None] | None = None) -> TuningResult:
    """Tune this GPU's kernels, or read them from its cache."""
    kernels = all_kernels(dtypes)  # a bad list is said before anything needs a GPU

    def objective_for(kernel: Kernel) -> Objective:
        return cuda_objective(kernel, settings.nbytes, kernel.sparsity(settings))

    return load_or_tune(cuda_key(), objective_for, kernels, settings, force=force, log=log)


def enable_tuned_cuda_codecs(settings: Settings = Settings(),
                             dtypes: Sequence[str] = ("float32", "float16")) -> bool:
    """Register the CUDA codecs with tuned launch parameters (tuning once per GPU and build),
    and give the codec time predictor the tuned runs.

    False, with the loader's warning, where the CUDA codecs are unavailable."""
    if load_extension() is None:
        return False
    result = tune_cuda(settings, dtypes)
    record_runs(torch.device("cuda", torch.cuda.current_device()), result.best_runs())
    return enable_cuda_codecs(tuned={codec: result.launches(codec) for codec in CODECS})
