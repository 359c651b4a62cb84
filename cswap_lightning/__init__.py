"""cswap-lightning: swap autograd's saved activations to host memory, compressed when it pays."""

from .config import CSwapConfig
from .engine import Offloader, offload
from .stats import SiteStats, StepStats

__all__ = ["CSwapConfig", "Offloader", "SiteStats", "StepStats", "offload"]
__version__ = "0.1.0"
