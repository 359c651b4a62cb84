"""The plan the engine's steps run: a decision per site (keep, raw or a codec), with the numbers
behind it, the table a user reads, and its checked round trip through a checkpoint.

The planner (``planner.py``) makes it; the advisor (``advisor.py``) chose each swapped site's
codec; ``Step`` only reads it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import NoReturn

import torch

from ..config import COMPRESSORS, LOSSY_CODECS
from ..records import HOST_BUDGET, SiteStats, StepStats, fmt_bytes

# A site the training loop holds too: moving it frees nothing, it stays for the whole step.
HELD_ELSEWHERE = "held elsewhere"

# What a plan may decide for a site.
DECISIONS: tuple[str, ...] = ("keep", "raw", *COMPRESSORS, *LOSSY_CODECS)


@dataclass
class Decision:
    """The plan for one site, with the numbers behind it."""

    site: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    sparsity: float
    decision: str  # one of DECISIONS: keep | raw | a codec name
    reason: str  # why: "budget met", "not offloadable", "hidden", "compression pays"...
    stored_bytes: int  # predicted host bytes
    raw_s: float  # predicted exposed time if swapped raw
    chosen_s: float  # predicted exposed time of the decision (0 when kept)

    @property
    def saving_s(self) -> float:
        """Exposed time the decision saves over swapping raw."""
        return self.raw_s - self.chosen_s if self.decision != "keep" else 0.0


@dataclass
class Plan:
    """Per-site decisions for steps whose sites fit ``signature``: as many sites, each of
    the same dtype and dimensions and no more elements. A plan made for the longest
    sequence serves every shorter one; what fits in the budget at the larger size fits at the
    smaller."""

    decisions: dict[int, Decision]
    signature: tuple[tuple[tuple[int, ...], str], ...]
    budget_bytes: int | None
    base_bytes: int  # what the step holds beside its saved tensors, taken off the budget
    predicted_peak: int  # saved tensors on the device at once (resident_peak)
    fits: bool  # base_bytes + predicted_peak <= budget_bytes
    prefetch_bytes: int  # the prefetch window planned with (the engine uses no more)
    # The peak measured on the first step that ran the plan, and on CUDA the allocator's
    # (the engine fills them in).
    measured_peak: int | None = field(default=None, compare=False)
    measured_allocated: int | None = field(default=None, compare=False)
    # The blocks recomputed beside these decisions, and the planner's prediction for the mix
    # (``planning.mix.table``), where it chose any.
    recompute_table: str = field(default="", compare=False)

    def codec(self, site: int, shape: tuple[int, ...], dtype: str) -> str:
        """The decision for a site; ``"raw"`` where this step's site does not fit the plan's."""
        d = self.decisions.get(site)
        if d is None or d.dtype != dtype or not _within(shape, d.shape):
            return "raw"
        return d.decision

    def covers(self, sizes: Sequence[int]) -> bool:
        """Whether a step that saved tensors of these sizes (bytes, in order) is no larger
        than the plan, site by site."""
        planned = self.site_bytes
        return len(sizes) == len(planned) and all(map(int.__le__, sizes, planned))

    def same_kinds(self, sites: Sequence[SiteStats]) -> bool:
        """Whether a step's rows are of the dtypes and dimensions of the plan's sites
        (larger or not): then it can be planned for from them without measuring again."""
        signature = self.signature
        return all(s.site < len(signature) and s.dtype == signature[s.site][1]
                   and len(s.shape) == len(signature[s.site][0]) for s in sites)

    @cached_property
    def site_bytes(self) -> tuple[int, ...]:
        """Each site's own size in the plan, in bytes."""
        return tuple(math.prod(shape) * getattr(torch, dtype).itemsize
                     for shape, dtype in self.signature)

    def table(self, every_site: bool = False) -> str:
        """One row per site the plan decided on (``every_site``: also those it could not move)."""
        head = (f"{'site':>4} {'shape':<20} {'size':>9} {'sparsity':>8} {'decision':<8} "
                f"{'host':>9} {'raw ms':>8} {'plan ms':>8} {'saved ms':>8}  why")
        rows = [head, "-" * len(head)]
        shown = [d for d in self.decisions.values()
                 if every_site or d.decision != "keep"
                 or d.reason in ("fits the budget", HOST_BUDGET)]
        for d in shown:
            rows.append(
                f"{d.site:>4} {list(d.shape)!s:<20} {fmt_bytes(d.nbytes):>9} "
                f"{100 * d.sparsity:>7.1f}% {d.decision:<8} {fmt_bytes(d.stored_bytes):>9} "
                f"{_exposed(d.raw_s):>8} {_exposed(d.chosen_s):>8} "
                f"{'-' if d.saving_s <= 0 else f'{1e3 * d.saving_s:.3f}':>8}  "
                f"{d.reason}"
            )
        rows.append("-" * len(head))
        rows.append("raw ms, plan ms: the copies' time not hidden behind compute (predicted), "
                    "swapped raw and as planned; saved ms: the difference")
        hidden = Counter(_kind(d.reason) for d in self.decisions.values() if d not in shown)
        if hidden:
            rows.append("not shown: " + ", ".join(f"{n} {kind}"
                                                  for kind, n in sorted(hidden.items())))
        if self.recompute_table:
            rows.append(self.recompute_table)
        budget = "none" if self.budget_bytes is None else fmt_bytes(self.budget_bytes)
        if self.base_bytes:
            budget += f", less {fmt_bytes(self.base_bytes)} the step holds beside them"
        measured = "-" if self.measured_peak is None else fmt_bytes(self.measured_peak)
        if self.measured_allocated is not None:
            measured += f" (the allocator's peak {fmt_bytes(self.measured_allocated)})"
        rows.append(f"prefetch window {fmt_bytes(self.prefetch_bytes)}; "
                    "saved tensors on the device at once: predicted "
                    f"{fmt_bytes(self.predicted_peak)}"
                    f", measured {measured} (budget {budget})"
                    f"{'' if self.fits else ' DOES NOT FIT'}")
        return "\n".join(rows)

    def as_dict(self) -> dict:
        """JSON-able form (checkpoints)."""
        return {
            "decisions": [asdict(d) for d in self.decisions.values()],
            "signature": [[list(shape), dtype] for shape, dtype in self.signature],
            "budget_bytes": self.budget_bytes,
            "base_bytes": self.base_bytes,
            "predicted_peak": self.predicted_peak,
            "fits": self.fits,
            "prefetch_bytes": self.prefetch_bytes,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        """The plan :meth:`as_dict` gave, checked first: a damaged checkpoint fails here,
        naming the field, rather than later in forward or backward."""
        _check_fields("plan", data, _PLAN_FIELDS)
        decisions: dict[int, Decision] = {}
        for i, d in enumerate(data["decisions"]):
            where = f"plan['decisions'][{i}]"
            decision = _decision(where, d)
            if decision.site in decisions:
                _reject(f"{where}['site']", decision.site, "each site once")
            decisions[decision.site] = decision
        signature = tuple(_signature_entry(f"plan['signature'][{i}]", entry)
                          for i, entry in enumerate(data["signature"]))
        return cls(decisions, signature, data["budget_bytes"], data["base_bytes"],
                   data["predicted_peak"], data["fits"], data["prefetch_bytes"])


@dataclass(frozen=True)
class FixedPlan:
    """A plan given by name (``plan="raw"``, ``"zvc"``, ...): no advisor weighed it, so what
    it shows is what the step that tracked every site did with each saved tensor."""

    name: str
    step: StepStats

    @property
    def decisions(self) -> dict[int, SiteStats]:
        """Each site's row, with its ``decision`` as the step made it."""
        return {s.site: s for s in self.step.sites}

    def table(self, every_site: bool = False) -> str:
        """The step's table, under a line saying the plan is fixed."""
        return (f'plan="{self.name}" is fixed (no advisor\'s decisions): every site that can '
                f"move goes {self.name}. What step {self.step.step} did with each saved tensor:\n"
                + self.step.table())


def _exposed(seconds: float) -> str:
    return "hidden" if seconds <= 0 else f"{1e3 * seconds:.3f}"


def _kind(reason: str) -> str:
    """What a site the table leaves out is, in the user's words."""
    if reason.startswith("shares storage"):
        return "views of an earlier site's storage (moved or kept with it)"
    return {"parameter": "weights", "leaf": "weights", "view of a leaf": "views of weights",
            "small": "tensors under min_bytes", HELD_ELSEWHERE: "tensors held elsewhere",
            }.get(reason, f"kept ({reason or 'not offloadable'})")


# The type of each field of a saved plan, for Plan.from_dict.
_SEQUENCE = (list, tuple)
_NUMBER = (int, float)
_PLAN_FIELDS: dict[str, tuple[type, ...]] = {
    "decisions": _SEQUENCE, "signature": _SEQUENCE, "budget_bytes": (int, type(None)),
    "base_bytes": (int,), "predicted_peak": (int,), "fits": (bool,), "prefetch_bytes": (int,),
}
_DECISION_FIELDS: dict[str, tuple[type, ...]] = {
    "site": (int,), "shape": _SEQUENCE, "dtype": (str,), "nbytes": (int,), "sparsity": _NUMBER,
    "decision": (str,), "reason": (str,), "stored_bytes": (int,), "raw_s": _NUMBER,
    "chosen_s": _NUMBER,
}
_TYPE_NAMES = {int: "an int", float: "a float", bool: "a bool", str: "a str", list: "a list",
               tuple: "a tuple", type(None): "None"}


def _within(shape: tuple[int, ...], planned: tuple[int, ...]) -> bool:
    """A tensor of ``shape`` fits a site planned at ``planned``: as many dimensions, no more
    elements."""
    return len(shape) == len(planned) and math.prod(shape) <= math.prod(planned)


def _fail(problem: str) -> NoReturn:
    raise ValueError(
        f"Plan.from_dict: {problem} (the saved plan is damaged or from another version: load "
        "the checkpoint without it to measure and plan again)"
    )


def _reject(where: str, value: object, expected: str) -> NoReturn:
    _fail(f"{where} is {value!r}; expected {expected}")


def _check_fields(where: str, data: object, fields: dict[str, tuple[type, ...]]) -> None:
    """``data`` must be a dict of exactly ``fields``, each of its type (a bool is no number),
    every number >= 0."""
    if not isinstance(data, dict):
        _reject(where, data, "a dict")
    expected = f"expected the keys {', '.join(map(repr, fields))}"
    for key in data:
        if key not in fields:
            _fail(f"{where} has an unknown key {key!r}; {expected}")
    for key, types in fields.items():
        if key not in data:
            _fail(f"{where} has no {key!r}; {expected}")
        value = data[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            _reject(f"{where}[{key!r}]", value, " or ".join(_TYPE_NAMES[t] for t in types))
        if isinstance(value, _NUMBER) and not isinstance(value, bool) and not value >= 0:  # NaN too
            _reject(f"{where}[{key!r}]", value, "a number >= 0")


def _decision(where: str, d: object) -> Decision:
    _check_fields(where, d, _DECISION_FIELDS)
    if d["decision"] not in DECISIONS:
        _reject(f"{where}['decision']", d["decision"], f"one of {', '.join(map(repr, DECISIONS))}")
    if d["sparsity"] > 1:
        _reject(f"{where}['sparsity']", d["sparsity"], "a fraction in [0, 1]")
    _check_dtype(f"{where}['dtype']", d["dtype"])
    return Decision(**(d | {"shape": _shape(f"{where}['shape']", d["shape"])}))


def _signature_entry(where: str, entry: object) -> tuple[tuple[int, ...], str]:
    if not isinstance(entry, _SEQUENCE) or len(entry) != 2:
        _reject(where, entry, "a [shape, dtype] pair")
    shape, dtype = entry
    _check_dtype(f"{where}[1]", dtype)
    return _shape(f"{where}[0]", shape), dtype


def _shape(where: str, shape: object) -> tuple[int, ...]:
    if not isinstance(shape, _SEQUENCE) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        _reject(where, shape, "a list of ints >= 0")
    return tuple(shape)


def _check_dtype(where: str, dtype: object) -> None:
    if not (isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)):
        _reject(where, dtype, "the name of a torch dtype, such as 'float32'")
