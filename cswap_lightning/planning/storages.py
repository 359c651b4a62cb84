"""Which saved tensor is its storage's first save, though the allocator reuses addresses."""

from __future__ import annotations

import weakref

import torch


class FirstSaves:
    """The storages saved so far, each known by identity, held weakly (holding one would keep
    its memory, which a profile measures): a freed storage's address, and its ``_cdata``,
    may go to the next one allocated, whose first save that is."""

    def __init__(self) -> None:
        self._seen: dict[int, weakref.ref] = {}

    def first(self, storage: torch.UntypedStorage) -> bool:
        """Whether no save before this one was of ``storage``."""
        seen = self._seen.get(storage._cdata)
        if seen is not None and seen() is storage:
            return False
        self._seen[storage._cdata] = weakref.ref(storage)
        return True
