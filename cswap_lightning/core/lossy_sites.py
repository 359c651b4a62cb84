"""Where an Offloader may compress lossily, and how it rounds: the config names the lossy
codec, the watched model's excluded modules and the sites the accuracy guard reverted never
get one, and a guard's probe step (``Offloader.probe_next_step``) says which sites stay lossy.
The rounding is seeded by torch's seed when the Offloader is built, the count of training
steps (a probe rounds as the training step after it) and the site, so a run rounds the same
way whatever ran before it in the process."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from fnmatch import fnmatch

import torch

from ..codecs.lossy import LOSSY_DTYPES as _LOSSY_TORCH_DTYPES
from ..codecs.lossy import seed_of
from ..config import LOSSY_CODECS, CSwapConfig
from ..records import SiteStats
from .step import Probe, Step

LOSSY_DTYPES = tuple(str(d).removeprefix("torch.") for d in _LOSSY_TORCH_DTYPES)


class LossySites:
    """The lossy sites' bookkeeping of one Offloader: the reverted sites, the next step's
    probe, the training steps counted for the rounding seed, the latest of them."""

    def __init__(self, config: CSwapConfig) -> None:
        self.config = config
        self.reverted: set[int] = set()  # lossy sites the accuracy guard moved back
        self.seed = seed_of(torch.initial_seed(), torch.initial_seed() >> 32)
        self.next_probe: Probe | None = None  # the next step's, from probe_next()
        self.trained = 0  # training steps (not probes) entered
        self.latest_trained: Step | None = None

    def start(self, step: Step) -> None:
        """Give a new step its probe (if one was asked for) and its rounding seed."""
        step.probe, self.next_probe = self.next_probe, None
        step.seed = seed_of(self.seed, self.trained)
        if step.probe is None:
            self.trained += 1
            self.latest_trained = step

    def allowed(self, site: int, dtype: str, module: str) -> bool:
        """Floating tensors only, outside excluded modules, unless the guard moved them back."""
        return (dtype in LOSSY_DTYPES and site not in self.reverted
                and not any(fnmatch(module, p) for p in self.config.lossy_exclude))

    def ok(self, codec: str, site: int, stats: SiteStats, probe: Probe | None) -> bool:
        """Whether ``codec`` (lossy) may run at ``site``. The config always wins: a lossy
        codec only where it names that codec (a loaded plan cannot bring one in); on a
        guard's probe, only where the probe says."""
        cfg = self.config
        named = codec in (cfg.plan, cfg.lossy) or (cfg.lossy == "auto" and codec == "int8")
        return (named and (probe is None or probe.lossy and (probe.sites is None
                                                             or site in probe.sites))
                and self.allowed(site, stats.dtype, stats.module))

    def sites(self) -> frozenset[int] | None:
        """See ``Offloader.lossy_sites``."""
        step = self.latest_trained
        if step is None:
            return None
        stats = step.checked.stats if step.checked is not None else step.stats
        return frozenset(s.site for s in stats.sites if s.decision in LOSSY_CODECS)

    def probe_next(self, kind: str, sites: Iterable[int] | None,
                   restored: Callable[[int, torch.Tensor, torch.Tensor], None] | None) -> None:
        """See ``Offloader.probe_next_step``."""
        if kind not in ("lossless", "measure errors"):
            raise ValueError(f"probe kind must be 'lossless' or 'measure errors', got {kind!r}")
        self.next_probe = Probe(kind == "measure errors",
                                None if sites is None else frozenset(sites), restored)
