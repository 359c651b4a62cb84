"""cswap-lightning: swap autograd's saved activations to host memory, compressed when it pays."""

from .config import CSwapConfig
from .core.compile import compile_blocks
from .core.engine import Offloader
from .core.saved_hooks import no_offload
from .core.shared import offload
from .integrations.strategy_names import register_strategy_names
from .records import SiteStats, StepStats

# Imported on first use, so that `import cswap_lightning` loads neither Lightning nor
# transformers. The Lightning strategies' names ("cswap", "cswap_ddp", "cswap_fsdp",
# "cswap_model_parallel") are registered now if Lightning is loaded, else when it is.
register_strategy_names()
_LAZY = {
    "CSwapStrategy": "integrations.lightning",
    "CSwapDDPStrategy": "integrations.lightning",
    "CSwapFSDPStrategy": "integrations.lightning",
    "CSwapModelParallelStrategy": "integrations.lightning",
    "CSwapCallback": "integrations.hf",
}


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        from .extras import missing

        try:
            module = import_module(f".{_LAZY[name]}", __name__)
        except ModuleNotFoundError as err:  # CSwapCallback without transformers
            raise missing(err, f"cswap_lightning.{name}") from err
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CSwapCallback",
    "CSwapConfig",
    "CSwapDDPStrategy",
    "CSwapFSDPStrategy",
    "CSwapModelParallelStrategy",
    "CSwapStrategy",
    "Offloader",
    "SiteStats",
    "StepStats",
    "compile_blocks",
    "no_offload",
    "offload",
]
__version__ = "0.1.0"
