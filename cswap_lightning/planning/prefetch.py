"""How far ahead backward brings moved tensors back (``CSwapConfig.prefetch_bytes="auto"``).

Every byte brought back early is held on the device until backward uses it, so the window is
as small as hiding the link allows: a moved tensor's restore has to start the link's time for
it before backward needs it, and everything backward uses in between must already be back.
That, for the worst tensor, is the window; never less than two of the largest moved tensors,
so that one restore is always under way while the one before it is used.

The largest moved tensor comes back alone: it counts in no window (the engine brings a tensor
larger than the window back when nothing else is on its way), since a window that held it
would hold as many bytes of the others beside it. One large tensor (a language model's
logits over a 50k vocabulary, more than all its layers' activations together) would otherwise
make the window everything, and offloading everything would save nothing at the peak. And the
window never holds more than half the bytes of the other moved tensors: past that, bringing
them back early gives back the memory offloading freed. A fixed window larger than the moved
bytes brings everything back at once when backward starts, and the peak is what keeping
everything would have been.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence


def lookahead_bytes(order: Sequence[int], moved: Mapping[int, int],
                    backward_s: Mapping[int, float], h2d: float) -> int:
    """The window for sites moved with these bytes (``moved``: site -> bytes), used by backward
    in ``order`` (every site, kept ones too), each after ``backward_s`` of compute since the
    site before it, over a link of ``h2d`` bytes per second."""
    largest = max(moved, key=moved.__getitem__, default=None)
    others = {site: n for site, n in moved.items() if site != largest}
    window = resident_window(list(moved.values()))
    if not math.isfinite(h2d) or h2d <= 0:
        return window
    for i, site in enumerate(order):
        if site not in others:
            continue
        needed, hidden, back = others[site] / h2d, 0.0, others[site]
        k = i
        while k > 0 and hidden < needed:  # the compute its restore runs beside
            hidden += backward_s.get(order[k], 0.0)
            k -= 1
            back += others.get(order[k], 0)  # used meanwhile: brought back before it
        window = max(window, back)
    return min(window, _most(others.values()))


def resident_window(moved_bytes: Sequence[int]) -> int:
    """Before anything is measured, and the least the window is: two of the largest moved
    tensors but the largest, which comes back alone; at most half of theirs."""
    others = sorted(moved_bytes)[:-1]
    return min(2 * max(others, default=0), _most(others))


def _most(others: Iterable[int]) -> int:
    """The most the window holds: half the bytes of the moved tensors but the largest."""
    return sum(others) // 2
