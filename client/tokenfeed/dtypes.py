"""Token dtypes: the one table of token types shared by the store and the wire.

A dataset stores its tokens as ``uint16`` when every id of its vocabulary fits, else as
``uint32``; chunks carry them in the same type. Both ends name a dtype by the keys of
:data:`DTYPES` and always mean its little-endian layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

__all__ = ["DTYPES", "dtype_for_vocab"]

#: Token dtype name -> numpy dtype (little-endian); the only place these are spelled.
DTYPES: Mapping[str, np.dtype[Any]] = MappingProxyType(
    {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
)


def dtype_for_vocab(vocab_size: int) -> str:
    """The token dtype name for a vocabulary: ``uint16`` when every id fits, else ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"
