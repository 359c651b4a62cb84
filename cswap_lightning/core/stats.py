"""What the engine did in one step: plain records, and a table for people."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .tensors import WEIGHTS


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
        return self.nbytes / self.stored_bytes if self.stored_bytes else None


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
    def peak_share(self) -> float | None:
        """The measured peak as a fraction of what keeping everything holds
        (``keep_all_bytes``), on a step that tracked every site; None otherwise."""
        return (self.peak_resident_bytes / self.keep_all_bytes
                if self.keep_all_bytes and self.tracked_all else None)

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
        return int(self._sum("nbytes", lambda d: d == "keep")) + self.untracked_bytes

    @property
    def ratio(self) -> float | None:
        return self.offloaded_bytes / self.stored_bytes if self.stored_bytes else None

    @property
    def wait_s(self) -> float:
        return float(self._sum("wait_s")) + self.untracked_wait_s

    def as_dict(self) -> dict:
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
        rows += self._summary(label)
        return "\n".join(rows)

    def _summary(self, label: str) -> list[str]:
        """What the step did, in the user's terms: what autograd saved (activations apart from
        weights), what moved and what stayed, the measured peak against keeping everything."""
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
                      else f" ({_ratio(self.ratio)} smaller)")
        lines.append(f"moved out to host memory: {fmt_bytes(moved)}, held there as "
                     f"{fmt_bytes(stored)}{compressed}; {kept}")
        peak = f"saved tensors resident at once: {fmt_bytes(self.peak_resident_bytes)} at the peak"
        if self.peak_share is not None:
            peak += (f" (measured), {100 * self.peak_share:.0f}% of the "
                     f"{fmt_bytes(self.keep_all_bytes)} that keeping them all holds "
                     f"({fmt_bytes(self.keep_all_bytes - self.peak_resident_bytes)} less)")
        elif not self.tracked_all or self.resized:
            peak += ", measured on the step that checked the plan" + (
                ", whose saved tensors differ in size from this step's" if self.resized else "")
        if self.peak_allocated_bytes is not None:
            peak += f"; allocator peak {fmt_bytes(self.peak_allocated_bytes)}"
        lines.append(peak)
        lines.append(f"backward waited {self.wait_s * 1e3:.2f} ms for tensors coming back, "
                     f"forward waited {self.forward_wait_s * 1e3:.2f} ms for copies out; host "
                     f"memory held between steps {fmt_bytes(self.host_held_bytes)}")
        return lines


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
