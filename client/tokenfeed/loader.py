"""The documented import path of :class:`TokenFeedLoader` (it lives in
:mod:`tokenfeed.training.loader`, with the rest of the torch face)."""

from __future__ import annotations

from tokenfeed.training.loader import TokenFeedLoader

__all__ = ["TokenFeedLoader"]
