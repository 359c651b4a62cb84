"""How far ahead backward brings moved tensors back (``CSwapConfig.prefetch_bytes="auto"``).

Every byte brought back early is held on the device until backward uses it, so the window is
as small as hiding the link allows: a moved tensor's restore has to start the link's time for
it before backward needs it, and everything backward uses in between must already be back.
That, for the worst tensor, is the window; never less than two of the largest moved tensors,
so that one restore is always under way while the one before it is used. A fixed window
larger than the moved bytes brings everything back at once when backward starts, and the
peak is what keeping everything would have been.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def lookahead_bytes(order: Sequence[int], moved: Mapping[int, int],
                    backward_s: Mapping[int, float], h2d: float) -> int:
    """The window for sites moved with these bytes (``moved``: site -> bytes), used by backward
    in ``order`` (every site, kept ones too), each after ``backward_s`` of compute since the
    site before it, over a link of ``h2d`` bytes per second."""
    largest = max(moved.values(), default=0)
    window = 2 * largest
    if not math.isfinite(h2d) or h2d <= 0:
        return window
    for i, site in enumerate(order):
        if site not in moved:
            continue
        needed, hidden, back = moved[site] / h2d, 0.0, moved[site]
        k = i
        while k > 0 and hidden < needed:  # the compute its restore runs beside
            hidden += backward_s.get(order[k], 0.0)
            k -= 1
            back += moved.get(order[k], 0)  # used meanwhile: brought back before it
        window = max(window, back)
    return window


def resident_window(moved_bytes: Sequence[int]) -> int:
    """Before anything is measured: two of the largest moved tensors."""
    return 2 * max(moved_bytes, default=0)
