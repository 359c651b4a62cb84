"""What the engine did in one step: plain records, and a table for people."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

# Why a weight stays (trained or frozen, a leaf that requires grad, or a view of one): the
# module holds it, so moving it would copy bytes and free nothing.
WEIGHTS = ("parameter", "leaf", "view of a leaf")
# why a site the plan would move is kept: its payload would pass CSwapConfig.host_budget
HOST_BUDGET = "the host budget"


@dataclass(slots=True)
class SiteStats:
    """One saved tensor of a step (a *site*: the k-th tensor autograd saved)."""

    site: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    decision: str  # keep | dedup | raw | a lossless or lossy codec name
    reason: str = ""  # why a tensor was kept, or which site it shares storage with
    stored_bytes: int = 0  # bytes held off the device (compressed size when compressed)
    sparsity: float | None = None  # fraction of bitwise-zero elements
    offload_s: float = 0.0  # worker time to compress and copy out
    wait_s: float = 0.0  # time backward waited for this tensor to come back
    prefetched: bool = False  # brought back ahead of use, not on demand
    packed_at: int = 0  # step clock (one tick per pack and per first unpack) when saved
    unpacked_at: int | None = None  # step clock when backward first needed it
    module: str = ""  # qualified name of the module that saved it (Offloader.watch)
    error: float | None = None  # relative L2 error of a lossy round trip (guard probes only)

    @property
    def ratio(self) -> float | None:
        """Its compression ratio: bytes on the device over bytes stored (None: not stored)."""
        return self.nbytes / self.stored_bytes if self.stored_bytes else None


@dataclass(frozen=True)
class Recomputed:
    """The blocks a step runs recomputed (``Offloader.recomputed``), with what the latest step
    that ran every block plainly measured (the engine's step ``plain_step``; None where none
    did): what keeping all its saved tensors held, and the blocks' forward time there, which
    recomputing them spends once more in backward."""

    blocks: tuple[str, ...]
    plain_step: int | None = None
    plain_keep_all_bytes: int = 0
    forward_s: float = 0.0


@dataclass
class StepStats:
    """All sites of one step, with the totals people ask about."""

    step: int
    sites: list[SiteStats] = field(default_factory=list)
    # Measured: the most bytes of the step's saved tensors on the compute device at once
    # (kept ones, originals not yet copied out or still held elsewhere, restored and
    # prefetched ones), each storage counted once; and the bytes (``timeline_bytes``) at each
    # change, ``timeline_s`` seconds after the step's first saved tensor.
    peak_resident_bytes: int = 0
    # What keeping every saved tensor would hold at the end of forward, where all of them are
    # alive (the peak of a step that moves nothing): the bytes of each storage the ledger
    # counted, once; weights excepted, as the peak excepts them. Summed on the sites a step
    # tracks: compare it with ``peak_resident_bytes`` on a step that tracked every site. A
    # step that ran a checked plan (untracked, or without hooks) reports the checking step's,
    # as it reports its peak.
    keep_all_bytes: int = 0
    timeline_s: array = field(default_factory=lambda: array("d"), repr=False)
    timeline_bytes: array = field(default_factory=lambda: array("q"), repr=False)
    peak_allocated_bytes: int | None = None  # CUDA: the allocator's peak during the step
    forward_wait_s: float = 0.0  # forward's waits at the in-flight bound (inflight_bytes)
    host_held_bytes: int = 0  # host memory the engine keeps between steps (the pinned arena)
    # Once a step has checked a plan, later steps keep the sites it keeps without
    # tracking each (no rows in ``sites``): how many, and their bytes; and move the sites it
    # moves with a codec of exact size (raw, lossy) untracked: how many, their bytes, the
    # host bytes holding them, and backward's waits for them. Such a step's
    # ``peak_resident_bytes`` is the one measured on the step that checked the plan; with
    # ``resized``, that step saved tensors of other sizes (varying lengths), so it is not
    # this step's own.
    untracked_tensors: int = 0
    untracked_bytes: int = 0
    untracked_moved_tensors: int = 0
    untracked_moved_bytes: int = 0
    untracked_stored_bytes: int = 0
    untracked_wait_s: float = 0.0
    resized: bool = False
    # The checked plan moves nothing, so the step ran without the engine's hooks: autograd
    # kept every saved tensor itself (the figures are the checking step's).
    hooks_off: bool = False
    # Measured on a step that tracks every site: how many recomputed blocks backward ran
    # again, and the peak of ``peak_resident_bytes``'s ledger with what they saved again
    # (held until each block's backward used it; ``Residency.again``).
    recomputations: int = 0
    peak_with_recompute_bytes: int = 0
    recomputed: Recomputed | None = None  # the blocks run recomputed, where any are
    # The budget the step's plan is made for, as configured (bytes; None: no budget or no
    # plan yet), and the type of the device its saved tensors were on ("cpu", "cuda").
    budget_bytes: int | None = None
    device: str = ""

    def _sum(self, attr: str, include: Callable[[str], bool] = lambda decision: True) -> float:
        return sum(getattr(s, attr) for s in self.sites if include(s.decision))

    @property
    def saved_bytes(self) -> int:
        """Bytes autograd saved (each storage counted once, where tracked)."""
        return (int(self._sum("nbytes", lambda d: d != "dedup")) + self.untracked_bytes
                + self.untracked_moved_bytes)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights autograd saved (trained or frozen, and views of them), where
        tracked: the module holds them, so they stay where they are."""
        return sum(s.nbytes for s in self.sites if s.reason in WEIGHTS)

    @property
    def tracked_all(self) -> bool:
        """Whether every saved tensor of the step has a row (its figures are its own)."""
        return not (self.untracked_tensors or self.untracked_moved_tensors or self.hooks_off)

    @property
    def peak_bytes(self) -> int:
        """The measured peak a user's memory sees: the step's saved tensors, with what
        recomputed blocks held again while backward ran them."""
        return max(self.peak_resident_bytes, self.peak_with_recompute_bytes)

    @property
    def baseline_bytes(self) -> int:
        """What keeping every saved tensor holds without the engine: ``keep_all_bytes``, or
        where blocks are recomputed, the keep-all of the step that ran them plainly."""
        recomputed = self.recomputed
        if recomputed is not None and recomputed.plain_keep_all_bytes:
            return recomputed.plain_keep_all_bytes
        return self.keep_all_bytes

    @property
    def recompute_freed_bytes(self) -> int:
        """Bytes of saved tensors that recomputing blocks spared (measured: the plain step's
        keep-all less this step's), on a step that tracked every site; 0 otherwise."""
        if self.recomputed is None or not self.tracked_all:
            return 0
        return max(self.baseline_bytes - self.keep_all_bytes, 0)

    @property
    def peak_share(self) -> float | None:
        """The measured peak (``peak_bytes``) as a fraction of what keeping everything holds
        (``baseline_bytes``), on a step that tracked every site; None otherwise."""
        return (self.peak_bytes / self.baseline_bytes
                if self.baseline_bytes and self.tracked_all else None)

    @property
    def budget_met(self) -> bool | None:
        """Whether the measured peak stayed within the budget: on CUDA the allocator's peak
        of the step, on the CPU ``peak_bytes`` (all the ledger knows of); None where there is
        no budget or no such figure."""
        if self.budget_bytes is None:
            return None
        if self.device == "cuda":
            peak = self.peak_allocated_bytes
            return None if peak is None else peak <= self.budget_bytes
        return self.peak_bytes <= self.budget_bytes

    @property
    def offloaded_bytes(self) -> int:
        """Bytes that left the device (swapped raw, or compressed losslessly or lossily)."""
        return (int(self._sum("nbytes", lambda d: d not in ("keep", "dedup")))
                + self.untracked_moved_bytes)

    @property
    def offloaded_tensors(self) -> int:
        """Storages that left the device."""
        return (sum(s.decision not in ("keep", "dedup") for s in self.sites)
                + self.untracked_moved_tensors)

    @property
    def stored_bytes(self) -> int:
        """Bytes held off the device for them (after compression)."""
        return int(self._sum("stored_bytes")) + self.untracked_stored_bytes

    @property
    def kept_bytes(self) -> int:
        """Bytes of the saved tensors kept where they were (each storage once; weights too)."""
        return int(self._sum("nbytes", lambda d: d == "keep")) + self.untracked_bytes

    @property
    def ratio(self) -> float | None:
        """Compression ratio of what left the device: its bytes over the bytes stored for it
        (None: nothing stored)."""
        return self.offloaded_bytes / self.stored_bytes if self.stored_bytes else None

    @property
    def wait_s(self) -> float:
        """Seconds backward's unpacks waited for tensors coming back."""
        return float(self._sum("wait_s")) + self.untracked_wait_s

    def as_dict(self) -> dict:
        """The step's totals (not its sites' rows), for logs and JSON."""
        return {
            "step": self.step,
            "saved_bytes": self.saved_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "stored_bytes": self.stored_bytes,
            "kept_bytes": self.kept_bytes,
            "ratio": self.ratio,
            "wait_s": self.wait_s,
            "forward_wait_s": self.forward_wait_s,
            "peak_resident_bytes": self.peak_resident_bytes,
            "keep_all_bytes": self.keep_all_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "host_held_bytes": self.host_held_bytes,
            "untracked_tensors": self.untracked_tensors,
            "untracked_bytes": self.untracked_bytes,
            "untracked_moved_tensors": self.untracked_moved_tensors,
            "untracked_moved_bytes": self.untracked_moved_bytes,
            "untracked_stored_bytes": self.untracked_stored_bytes,
            "untracked_wait_s": self.untracked_wait_s,
            "resized": self.resized,
            "hooks_off": self.hooks_off,
            "recomputations": self.recomputations,
            "peak_with_recompute_bytes": self.peak_with_recompute_bytes,
            "recomputed": None if self.recomputed is None else asdict(self.recomputed),
            "recompute_freed_bytes": self.recompute_freed_bytes,
            "budget_bytes": self.budget_bytes,
            "budget_met": self.budget_met,
            "device": self.device,
            "sites": [asdict(s) | {"ratio": s.ratio} for s in self.sites],
        }

    def table(self, label: str | None = None) -> str:
        """A per-site table and what the step did, in words, for printing; ``label`` names the
        step (default ``step N``, the engine's count of steps)."""
        label = label or f"step {self.step}"
        sparsity = any(s.sparsity is not None for s in self.sites)  # measured on this step
        head = (f"{'site':>4} {'shape':<20} {'dtype':<9} {'size':>9} {'decision':<8} "
                + (f"{'sparsity':>8} " if sparsity else "")
                + f"{'stored':>9} {'ratio':>6} {'wait ms':>8}  note")
        rows = [head, "-" * len(head)]
        for s in self.sites:
            rows.append(
                f"{s.site:>4} {list(s.shape)!s:<20} {s.dtype:<9} {fmt_bytes(s.nbytes):>9} "
                f"{s.decision:<8} " + (f"{_pct(s.sparsity):>8} " if sparsity else "")
                + f"{fmt_bytes(s.stored_bytes):>9} {_ratio(s.ratio):>6} {s.wait_s * 1e3:>8.2f}  "
                f"{s.reason}"
            )
        rows.append("-" * len(head))
        if self.sites and not sparsity:
            rows.append("(sparsity is measured on the steps that profile, the first of each "
                        "epoch: the plan's table shows it)")
        rows += self.summary(label)
        return "\n".join(rows)

    def summary(self, label: str | None = None) -> list[str]:
        """What the step did, in the user's terms (the lines that end :meth:`table`, and that
        the integrations print when training ends): what autograd saved (activations apart
        from weights), what was recomputed, moved and kept, the measured peak against keeping
        everything, and whether the budget held."""
        label = label or f"step {self.step}"
        count = len(self.sites) + self.untracked_tensors + self.untracked_moved_tensors
        if self.tracked_all:
            lines = [(f"{label}: autograd saved {count} tensors: "
                      f"{fmt_bytes(self.keep_all_bytes)} of activations (each storage once) and "
                      f"{fmt_bytes(self.weight_bytes)} of weights, which stay where they are")]
            kept = ("activations kept in place: "
                    f"{fmt_bytes(self.keep_all_bytes - self.offloaded_bytes)}")
        elif self.hooks_off:
            lines = [(f"{label}: ran without the engine's hooks: the checked plan moves "
                      "nothing, so autograd kept every saved tensor itself")]
            kept = "every saved tensor kept in place"
        else:  # untracked tensors are summed as they come: a storage once per view of it
            lines = [f"{label}: autograd saved {count} tensors"]
            kept = f"kept in place, weights included: {fmt_bytes(self.kept_bytes)}"
        if self.recomputed is not None:
            lines.append(self._recomputed_line())
        if self.untracked_tensors:
            lines.append(f"kept as the plan says, not tracked one by one: "
                         f"{self.untracked_tensors} saved tensors "
                         f"({fmt_bytes(self.untracked_bytes)}, each tensor's own bytes)")
        if self.untracked_moved_tensors:
            lines.append(f"moved as the plan says, not tracked one by one: "
                         f"{self.untracked_moved_tensors} saved tensors "
                         f"({fmt_bytes(self.untracked_moved_bytes)} stored as "
                         f"{fmt_bytes(self.untracked_stored_bytes)})")
        moved, stored = self.offloaded_bytes, self.stored_bytes
        compressed = ("" if not moved else " (not compressed)" if moved == stored
                      else f" ({_ratio(self.ratio)} smaller: {self._moved_by_codec()})")
        held = sum(s.reason == HOST_BUDGET for s in self.sites)
        lines.append(f"moved out to host memory: {fmt_bytes(moved)}, held there as "
                     f"{fmt_bytes(stored)}{compressed}; {kept}"
                     + (f"; {held} saved tensors kept for the host budget" if held else ""))
        lines.append(self._peak_line())
        if self.budget_bytes is not None:
            lines.append(self._budget_line())
        if self.device == "cpu":
            lines.append(self._ram_line())
        lines.append(f"backward waited {self.wait_s * 1e3:.2f} ms for tensors coming back, "
                     f"forward waited {self.forward_wait_s * 1e3:.2f} ms for copies out; host "
                     f"memory held between steps {fmt_bytes(self.host_held_bytes)}")
        return lines

    def _recomputed_line(self) -> str:
        """The blocks recomputed, what that spared (measured against the plain step) and
        what it costs (their forward again, as the plain step timed it)."""
        r = self.recomputed
        names = ", ".join(r.blocks[:6]) + (f" and {len(r.blocks) - 6} more"
                                           if len(r.blocks) > 6 else "")
        line = f"recomputed in backward: {len(r.blocks)} blocks ({names})"
        if self.tracked_all:
            line += f", {self.recomputations} run again by this step's backward"
        if r.plain_step is None or not r.plain_keep_all_bytes:
            return line + " (no step ran them plainly to compare with)"
        if self.tracked_all:
            line += (f"; keeping only their inputs spared {fmt_bytes(self.recompute_freed_bytes)}"
                     f" of the {fmt_bytes(r.plain_keep_all_bytes)} of saved tensors step "
                     f"{r.plain_step} kept, running every block plainly")
        return line + (f"; it costs their forward once more, {1e3 * r.forward_s:.1f} ms a step "
                       f"as step {r.plain_step} timed it")

    def _peak_line(self) -> str:
        peak = f"saved tensors resident at once: {fmt_bytes(self.peak_resident_bytes)} at the peak"
        if self.tracked_all and self.peak_with_recompute_bytes > self.peak_resident_bytes:
            peak += (f" (measured); with what the recomputed blocks hold again while backward "
                     f"runs them, {fmt_bytes(self.peak_bytes)}")
        if self.peak_share is not None:
            without = " without recomputation" if self.baseline_bytes != self.keep_all_bytes else ""
            peak += (f" (measured), {100 * self.peak_share:.0f}% of the "
                     f"{fmt_bytes(self.baseline_bytes)} that keeping them all holds{without} "
                     f"({_less(self.baseline_bytes - self.peak_bytes)})")
        elif not self.tracked_all or self.resized:
            peak += ", measured on the step that checked the plan" + (
                ", whose saved tensors differ in size from this step's" if self.resized else "")
        if self.peak_allocated_bytes is not None:
            peak += f"; allocator peak {fmt_bytes(self.peak_allocated_bytes)}"
        return peak

    def _budget_line(self) -> str:
        """Whether the budget held, by the figure it is of (CUDA: the allocator's peak; the
        CPU: the ledger's, saved tensors only, nothing else of the step being known)."""
        budget = fmt_bytes(self.budget_bytes)
        if self.device == "cuda":
            peak, what = self.peak_allocated_bytes, "the allocator's peak"
        else:
            peak = self.peak_bytes
            what = ("the ledger's peak (saved tensors, recomputed blocks' included; the rest "
                    "of the step's memory is not measured on the CPU)")
        met = self.budget_met
        if met is None:
            return f"budget {budget}: not measured on this step"
        if met:
            return f"budget {budget}: held, by {what}: {fmt_bytes(peak)}"
        return (f"budget {budget}: NOT MET: {what} was {fmt_bytes(peak)}, "
                f"{fmt_bytes(peak - self.budget_bytes)} over it")

    def _ram_line(self) -> str:
        """On the CPU the host is the same RAM: what the saved tensors took of it at most."""
        ram = self.peak_bytes + self.stored_bytes
        baseline = self.baseline_bytes
        line = (f"on the CPU a moved tensor is a copy in the same RAM: saved tensors took at "
                f"most {fmt_bytes(ram)} of it at once (the peak and the "
                f"{fmt_bytes(self.stored_bytes)} held on the host)")
        if baseline:
            line += (f", against {fmt_bytes(baseline)} keeping them all "
                     f"({_less(baseline - ram)}; only compression and recomputation save RAM "
                     "here)")
        return line + ("; the process's RSS also holds the engine's host buffers, Python's "
                       "objects and memory the allocator keeps for reuse")

    def _moved_by_codec(self) -> str:
        """What moved, by codec (tracked sites): bytes, and bytes held where compressed."""
        moved: dict[str, list[int]] = {}
        for s in self.sites:
            if s.decision not in ("keep", "dedup"):
                total = moved.setdefault(s.decision, [0, 0])
                total[0] += s.nbytes
                total[1] += s.stored_bytes
        return ", ".join(f"{codec} {fmt_bytes(n)}" + ("" if n == held else f" as {fmt_bytes(held)}")
                         for codec, (n, held) in sorted(moved.items())) or "not tracked"


def _less(n: int) -> str:
    return f"{fmt_bytes(n)} less" if n >= 0 else f"{fmt_bytes(-n)} more"


def fmt_bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"
