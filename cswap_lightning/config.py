"""CSwapConfig: every knob of the engine, checked when it is built so mistakes fail early."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Literal, get_args

# Literal types, so that LightningCLI rejects a bad value at parse time, naming the key.
Compressor = Literal["zvc", "rle"]
DenseCompressor = Literal["off", "exponent"]
LossyCodec = Literal["int8", "fp8", "int4"]
PlanName = Literal["auto", "keep", "raw", Compressor, "exponent", LossyCodec]
Lossy = Literal["off", "auto", LossyCodec]
RecomputeMode = Literal["auto", "off"]

COMPRESSORS: tuple[str, ...] = get_args(Compressor)
LOSSY_CODECS: tuple[str, ...] = get_args(LossyCodec)
DENSE_CODECS: tuple[str, ...] = get_args(DenseCompressor)[1:]
PLANS: tuple[str, ...] = ("auto", "keep", "raw", *COMPRESSORS, *DENSE_CODECS, *LOSSY_CODECS)

MiB = 1 << 20
# inflight_bytes="auto": the bound until the planner has replayed a measured step, and the
# larger ones it may choose where the memory the copies in flight hold stays in the budget.
AUTO_INFLIGHT_BYTES = 1024 * MiB
INFLIGHT_CHOICES: tuple[int, ...] = (2048 * MiB, 4096 * MiB, 8192 * MiB)
# More memory than any device has (the largest GPUs hold 288 GB; 16 TiB is more RAM than
# nearly any host): a byte count above it is a slip (a unit written twice), not a setting.
MAX_BYTES = 1 << 44
# A view whose storage is this many times larger than itself is kept: offloading it would
# move (and free) nothing but the whole storage.
MAX_STORAGE_TO_VIEW_RATIO = 4
# A budget of fewer bytes than this is a slip (``budget=1`` meant the whole device, 1.0):
# every step saves more.
MIN_BUDGET = 1024
# Sizes as people write them: "2GiB", "512 MiB", "1.5GB", "64kB" (decimal units are powers
# of 1000, binary ones of 1024).
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)\s*", re.IGNORECASE)
_UNIT = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_PERCENT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*%\s*")

# byte fields without an "auto"
_NO_AUTO = ("min_bytes", "host_budget")

# The types each field accepts (bool is rejected where a number is expected).
_TYPES: dict[str, tuple[type, ...]] = {
    "plan": (str,),
    "compressor": (str,),
    "dense_compressor": (str,),
    "budget": (int, float, str, type(None)),
    "profile_steps": (int,),
    "lossy": (str,),
    "lossy_exclude": (tuple,),
    "guard_every": (int,),
    "guard_tolerance": (float, int),
    "guard_shadow": (bool,),
    "min_bytes": (int, str),
    "prefetch_bytes": (int, str),
    "inflight_bytes": (int, str),
    "pin_memory": (bool,),
    "recompute": (str,),
    "host_budget": (int, str, type(None)),
}


@dataclass(frozen=True)
class CSwapConfig:
    """What to offload, how, and how much to prefetch.

    Args:
        plan: ``"auto"`` lets the advisor decide per saved tensor from measurements (keep it
            on the device, swap it raw, or compress it with ``compressor`` first, whichever
            its cost model predicts is cheaper); ``"raw"``, ``"zvc"`` or ``"rle"`` force that
            codec for every tensor that can be offloaded (``"exponent"``: every bfloat16
            one, the others raw); ``"int8"``, ``"fp8"`` or ``"int4"``
            force that lossy codec for floating tensors (others are swapped raw);
            ``"keep"`` offloads nothing (the engine only measures).
        compressor: the codec ``"auto"`` weighs against swapping raw.
        dense_compressor: ``"exponent"``: ``"auto"`` also weighs the lossless exponent codec
            for dense bfloat16 tensors (a transformer's activations, where ``compressor``
            finds no zeros; about 1.3-1.4x on them), and the planner's mix weighs what it
            widens the link's window by; ``"off"`` does not (the default until its kernels
            are measured on a GPU).
        budget: device memory for the step (``plan="auto"`` only): bytes (an int, or a
            string with a unit: ``"2GiB"``, ``"1.5GB"``, ``"512MiB"``), a share of the
            device's total memory (a float in (0, 1], or a percentage string: ``0.5`` and
            ``"50%"`` both mean half the GPU's memory, or on the CPU half the machine's RAM;
            not a share of the step's peak) or ``"auto"``, what the process can
            still have when the plan is made less a tenth of the device's memory. What the
            step holds beside its saved tensors (on CUDA the allocator's peak less theirs;
            on the CPU nothing is known of it) comes off it; the saved tensors get the rest,
            as ``StepStats.peak_resident_bytes`` measures them. The advisor keeps the latest
            saved tensors and offloads the fewest earliest ones that make the predicted peak
            fit, so a run that fits moves nothing (with ``"auto"`` on the CPU's RAM, nearly
            always); once a step has checked a plan, later steps only count the tensors it
            keeps (measuring again when what is saved changes). ``None`` offloads every
            tensor that can be.
        profile_steps: steps measured before ``"auto"`` plans (and again at each epoch start).
        lossy: ``"off"``; a lossy codec name (``"int8"``, ``"fp8"``, ``"int4"``) the advisor may
            pick for dense floating tensors where it pays, and the planner's mix weighs per
            block beside the lossless ``compressor``; ``"auto"`` lets them weigh ``"int8"``.
        lossy_exclude: module name patterns (``fnmatch``, e.g. ``"classifier*"``) whose saved
            tensors are never compressed lossily; they need ``Offloader.watch(model)`` (the
            integrations call it), and a step without it raises.
        guard_every: with lossy sites, every this many steps the accuracy guard compares one
            micro-batch's gradients with and without them (0: never).
        guard_tolerance: largest gradient error per parameter the guard accepts before it
            reverts the lossy sites that cause it: ``|g_lossy - g|`` relative to ``|g|``, or
            where that is smaller to a tenth of the norm the parameter's gradient would have
            at the model's mean gradient per element (so a parameter whose exact gradient is
            about zero cannot trip it on rounding noise).
        guard_shadow: with lossy sites, the integrations also train a lossless copy of the
            weights on the same batches (twice the compute, the weights and optimizer state
            again) and at each guard check log every validation metric of it
            (``cswap/shadow/NAME``) and the model's delta against it
            (``cswap/shadow_delta/NAME``).
        min_bytes: saved tensors smaller than this stay where they are. It, ``prefetch_bytes``
            and ``inflight_bytes`` take a number of bytes or a size such as ``"64KiB"``.
        prefetch_bytes: how many bytes backward may bring back ahead of use; ``"auto"``: as few
            as hide the measured link (the largest tensors backward uses during the link's time
            for a tensor, at least two of the largest moved ones), since every byte brought
            back early is held on the device; the largest moved tensor comes back alone, and
            the window holds at most half the bytes of the others (``planning.prefetch``).
        inflight_bytes: how many bytes forward may leave on their way off the device
            (copies not yet done, tensors not yet compressed) before it waits for the
            oldest; the wait is reported as ``StepStats.forward_wait_s``. ``"auto"``: 1 GiB,
            raised (up to 8 GiB) by the planner where its replay of a measured step under a
            budget says forward then waits less and the memory the copies in flight hold
            stays within the budget: the first blocks' activations come faster than the link
            carries them, and are copied while later blocks compute.
        pin_memory: use page-locked host memory for CUDA tensors (needed for async copies).
        recompute: ``"auto"`` lets the planner run chosen blocks of the watched model (its
            transformer layers, ResNet bottlenecks, VGG stages) again in backward instead of
            keeping what they save, whole or below the layer (only their elementwise work,
            from the fewest bytes kept or swapped: their matmuls' and attention's outputs or
            what the next operators read, or from more where that spares more work;
            ``Offloader.recompute``);
            ``"off"`` never does.
        host_budget: host memory the payloads of one step may hold at once (per process:
            several GPUs of one machine each hold their own), bytes or a size ("32GiB");
            ``None`` (the default): what they need. The planner (``plan="auto"``) swaps no
            more than that and recomputes instead, and no step holds more whatever the plan:
            a tensor that would pass it stays on the device (a compressed payload counts at
            its tensor's bytes). The host's memory ends training harder than the device's
            (the kernel kills the process) and is shared by every process.
    """

    plan: PlanName = "auto"
    compressor: Compressor = "zvc"
    dense_compressor: DenseCompressor = "off"
    budget: int | float | str | None = "auto"
    profile_steps: int = 2
    lossy: Lossy = "off"
    lossy_exclude: tuple[str, ...] = ()
    guard_every: int = 100
    guard_tolerance: float = 0.1
    guard_shadow: bool = False
    # byte counts: an int, or a size written as people write one ("64KiB", "1.5GB")
    min_bytes: int | str = 256 * 1024
    prefetch_bytes: int | str = "auto"  # or "auto"
    inflight_bytes: int | str = "auto"  # or "auto"
    pin_memory: bool = True
    recompute: RecomputeMode = "auto"
    host_budget: int | str | None = None

    @property
    def lossy_possible(self) -> bool:
        """Whether any site can be compressed lossily: a lossy plan, or the advisor's
        ``"auto"`` plan allowed a lossy codec."""
        return self.plan in LOSSY_CODECS or (self.plan == "auto" and self.lossy != "off")

    def __post_init__(self) -> None:
        if isinstance(self.lossy_exclude, list):  # YAML and CLIs give lists; a config is hashed
            object.__setattr__(self, "lossy_exclude", tuple(self.lossy_exclude))
        if isinstance(self.budget, str):  # "2GiB", "50%": kept as the bytes or share they mean
            object.__setattr__(self, "budget", parse_budget(self.budget))
        for name in ("min_bytes", "prefetch_bytes", "inflight_bytes", "host_budget"):
            value = getattr(self, name)
            if isinstance(value, str) and (value != "auto" or name in _NO_AUTO):
                size = parse_size(value)  # "64KiB": kept as the bytes it means
                if size is None:
                    auto = "" if name in _NO_AUTO else "'auto' or "
                    raise ValueError(f"CSwapConfig.{name} must be {auto}a number of bytes >= 0 "
                                     f"(an int, or a size such as '512MiB' or '1.5GB'); got "
                                     f"{value!r}")
                object.__setattr__(self, name, size)
        for f in fields(self):
            value, allowed = getattr(self, f.name), _TYPES[f.name]
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                raise TypeError(
                    f"CSwapConfig.{f.name} must be of type "
                    f"{' or '.join(t.__name__ for t in allowed)}, "
                    f"got {value!r} "
                    f"({type(value).__name__})"
                )
        _check_choice("plan", self.plan, PLANS)
        _check_choice("compressor", self.compressor, COMPRESSORS)
        _check_choice("dense_compressor", self.dense_compressor, get_args(DenseCompressor))
        _check_budget(self.budget)
        _check_choice("lossy", self.lossy, get_args(Lossy))
        _check_choice("recompute", self.recompute, get_args(RecomputeMode))
        if not all(isinstance(p, str) for p in self.lossy_exclude):
            raise TypeError("CSwapConfig.lossy_exclude must hold strings, got "
                            f"{self.lossy_exclude!r}")
        if self.guard_every < 0:
            raise ValueError(f"CSwapConfig.guard_every must be >= 0, got {self.guard_every!r}")
        if not 0.0 < self.guard_tolerance:
            raise ValueError(
                f"CSwapConfig.guard_tolerance must be > 0, got {self.guard_tolerance!r}"
            )
        if self.profile_steps < 1:
            raise ValueError(f"CSwapConfig.profile_steps must be >= 1, got {self.profile_steps!r}")
        for name in ("min_bytes", "prefetch_bytes", "inflight_bytes", "host_budget"):
            nbytes = getattr(self, name)
            if isinstance(nbytes, int) and nbytes < 0:
                raise ValueError(f"CSwapConfig.{name} must be >= 0 bytes, got {nbytes!r}")
            if isinstance(nbytes, int):
                _check_size(name, nbytes)


def as_config(config: object, caller: str) -> CSwapConfig:
    """``config``, or the defaults for ``None``; anything else is a ``TypeError`` saying what
    ``caller`` takes (a plan's name given alone, ``offload("raw")``, is the common slip)."""
    if config is None:
        return CSwapConfig()
    if isinstance(config, CSwapConfig):
        return config
    hint = (f"; for that plan: {caller}(CSwapConfig(plan={config!r}))"
            if isinstance(config, str) and config in PLANS else "")
    raise TypeError(f"{caller}() takes a CSwapConfig (or None for the defaults), got "
                    f"{config!r} ({type(config).__name__}){hint}")


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(
            f"CSwapConfig.{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}"
        )


def _check_size(name: str, nbytes: int) -> None:
    if nbytes > MAX_BYTES:
        raise ValueError(
            f"CSwapConfig.{name}={nbytes!r} bytes ({nbytes / 2**40:,.0f} TiB) is more than any "
            f"device's memory (at most {MAX_BYTES >> 40} TiB accepted); write bytes, e.g. "
            "40_000_000_000 for 40 GB"
        )


def parse_size(text: str) -> int | None:
    """The bytes a size written as a string means ("2GiB", "512 MiB", "1.5GB"); None where
    it is none."""
    size = _SIZE.fullmatch(text)
    return int(float(size[1]) * _UNIT[size[2].lower()]) if size else None


def parse_budget(text: str) -> int | float | str:
    """A budget written as a string: ``"auto"``; a size (``"2GiB"``, ``"1.5GB"``: bytes, an
    int); a percentage of the device's memory (``"50%"``: the float ``0.5``). Anything else
    is given back as it is, for the check to refuse by name."""
    size, percent = parse_size(text), _PERCENT.fullmatch(text)
    if size is not None:
        return size
    if percent:
        return float(percent[1]) / 100
    return text


def _check_budget(budget: float | str | None) -> None:
    ok = (
        budget is None
        or budget == "auto"
        or (isinstance(budget, int) and budget > 0)
        or (isinstance(budget, float) and 0.0 < budget <= 1.0)
    )
    if not ok:
        raise ValueError(
            "CSwapConfig.budget must be None (offload everything), 'auto' (fit what is free), "
            "a number of bytes > 0 (an int, or a size such as '2GiB' or '1.5GB'), or a share "
            "of the device's memory in (0, 1] (a float such as 0.5, or a percentage such as "
            f"'50%'); got {budget!r}"
        )
    if isinstance(budget, int):
        _check_size("budget", budget)
        if budget < MIN_BUDGET:
            raise ValueError(
                f"CSwapConfig.budget={budget!r} is {budget} byte{'s' * (budget != 1)}, less "
                "than any step saves (an int budget counts bytes): for the whole device's "
                "memory write 1.0 or '100%'; for a size write it with its unit, e.g. '2GiB'"
            )
