"""tokenfeed: exactly-once, globally shuffled token batches from a shared data server.

``import tokenfeed`` is light: numpy, pyzmq and msgpack only. The torch parts
(:class:`TokenFeedDataset`, :class:`TokenFeedLoader`) are imported on first use, so a
server or a tool that never touches torch never pays for it. :class:`Mixture` (a blend of
datasets by weight, and its schedule) never needs torch.

Layout: :mod:`tokenfeed.protocol` is the wire (shared with the server),
:mod:`tokenfeed.transport` the client's ZeroMQ side, :mod:`tokenfeed.training` the torch
face (``tokenfeed.dataset`` and ``tokenfeed.loader`` are its documented import paths),
:mod:`tokenfeed.plan`, :mod:`tokenfeed.mixture` and :mod:`tokenfeed.order` the order of
the stream, :mod:`tokenfeed.errors` the one exception tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenfeed import errors
from tokenfeed.errors import TokenFeedError

__version__ = "0.1.0"
__all__ = [
    "Mixture",
    "TokenFeedDataset",
    "TokenFeedError",
    "TokenFeedLoader",
    "__version__",
    "errors",
    "fetch_tokenizer",
]

if TYPE_CHECKING:
    from tokenfeed.mixture import Mixture
    from tokenfeed.tokenizer import fetch_tokenizer
    from tokenfeed.training.dataset import TokenFeedDataset
    from tokenfeed.training.loader import TokenFeedLoader

_LAZY = {
    "Mixture": "tokenfeed.mixture",
    "TokenFeedDataset": "tokenfeed.training.dataset",
    "TokenFeedLoader": "tokenfeed.training.loader",
    "fetch_tokenizer": "tokenfeed.tokenizer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenfeed' has no attribute {name!r}")
