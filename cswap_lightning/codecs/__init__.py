"""Codecs for swapped tensors, looked up by name.

The pure-torch reference codecs, lossless and lossy, are registered at import; a faster
implementation of the same format (e.g. a CUDA kernel) replaces one by registering under the
same name.
"""

from __future__ import annotations

from .format import CODEC_IDS, DTYPES, FORMAT_VERSION, Header, Packed, bit_view
from .lossy import FP8Codec, Int4Codec, Int8Codec, LossyCodec, reconstruction_error
from .reference import Codec, ExponentCodec, RawCodec, RLECodec, ZVCCodec, nonzero_count

__all__ = [
    "DTYPES",
    "FORMAT_VERSION",
    "Codec",
    "Header",
    "LossyCodec",
    "Packed",
    "bit_view",
    "codec_names",
    "get_codec",
    "nonzero_count",
    "reconstruction_error",
    "register",
]

_REGISTRY: dict[str, Codec] = {}


def register(codec: Codec) -> None:
    """Make ``codec`` available under ``codec.name``, replacing any codec of that name."""
    if codec.name not in CODEC_IDS:
        raise ValueError(
            f"codec name {codec.name!r} has no wire id in format.CODEC_IDS; "
            f"known: {sorted(CODEC_IDS)}"
        )
    _REGISTRY[codec.name] = codec


def get_codec(name: str) -> Codec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; registered: {codec_names()}") from None


def codec_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


# The lossy codecs are looked up only by name: nothing chooses them unless a plan does.
for _codec in (RawCodec(), ZVCCodec(), RLECodec(), ExponentCodec(), Int8Codec(), FP8Codec(),
               Int4Codec()):
    register(_codec)
