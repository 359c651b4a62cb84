"""Closing the steps an Offloader ran. A step closes when the next one starts: at once where
its figures are known on the host (a step that ran a checked plan), else once the device is
past its work, which each later step's start checks without waiting: a measured step's
sparsities and windows, the lengths of compressed payloads the arena is planned from, the
allocator's peak of a step that outgrew its plan. Forward never waits for the device here."""

from __future__ import annotations

from collections import deque

import torch

from .learning import Learning
from .step import Step
from .transfer import Transfer


class Closing:
    """The closed steps whose figures the device still owes (``owed``, oldest first, with
    the events after their work), handed to ``Learning`` once it is done."""

    def __init__(self, transfer: Transfer, learning: Learning) -> None:
        self.transfer = transfer
        self.learning = learning
        self.owed: deque[tuple[Step, list[torch.cuda.Event]]] = deque()

    def close(self, step: Step | None) -> None:
        """Close ``step`` (the one that ran last; None: none ran), unless closed already."""
        if step is None or step.closed:
            return
        step.closed = True
        step.residency.fold()
        if step.failed:
            self.learning.failed(step)
            return
        if step.dormant and not step.timed_plainly:
            return
        owed = step.device is not None and (step.measure or step.checked is None
                                            or step.stats.resized)
        self.owed.append((step, self.transfer.marks(step.device) if owed else []))
        self.finish(wait=False)

    def finish(self, wait: bool) -> None:
        """Finish the closed steps whose device work is done, oldest first (``wait``: all)."""
        while self.owed:
            step, marks = self.owed[0]
            if not wait and not all(event.query() for event in marks):
                return
            for event in marks:
                event.synchronize()  # done already, unless waiting
            self.owed.popleft()
            self.learning.finished(step)

    def measured(self) -> int:
        """The measured steps among those owed: they count as measured already."""
        return sum(step.measure for step, _ in self.owed)
