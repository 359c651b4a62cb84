"""Progress lines for the benchmarks that run for a minute: silence that long reads as a hang.
They go to stderr, so that stdout holds only the results."""

from __future__ import annotations

import sys
import time


class Progress:
    """Prints ``command: what (N s)``, seconds since it was made, on stderr."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.start = time.perf_counter()

    def __call__(self, what: str) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"{self.command}: {what} ({elapsed:.0f} s)", file=sys.stderr, flush=True)
