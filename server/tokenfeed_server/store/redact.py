"""One redaction for every message a client reads (HTTP answers and data-port errors):
where the store lives is the operator's business, not a tenant's.

The store's location (a directory, or ``s3://bucket/prefix``) becomes ``<store>`` and an
object store's endpoint URL ``<endpoint>``; what follows (the dataset's own name and
file) stays, so that a tenant still learns which of *its* objects failed. Messages about
another tenant's dataset never reach a tenant in the first place (failures belong to the
object that failed: :func:`~tokenfeed_server.store.cache_faults.failure_key`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from tokenfeed_server.store.serving import Store

__all__ = ["Redactor"]


class Redactor:
    """Replaces each of ``replacements``' texts with its mark, longest text first (so that
    a resolved path is not half replaced by the path as given)."""

    def __init__(self, replacements: dict[str, str]) -> None:
        self._pairs = sorted(
            ((text, mark) for text, mark in replacements.items() if text),
            key=lambda pair: len(pair[0]),
            reverse=True,
        )

    @classmethod
    def for_store(cls, store: Store) -> Redactor:
        """The redaction of ``store``'s location (and its object store's endpoint)."""
        found: dict[str, str] = {}
        if isinstance(store.root, Path):
            found = {str(store.root): "<store>", str(store.root.resolve()): "<store>"}
        if store.objects is not None:
            found[store.objects.url().rstrip("/")] = "<store>"
            found[store.objects.endpoint.rstrip("/")] = "<endpoint>"
        return cls(found)

    def __call__(self, message: str) -> str:
        for text, mark in self._pairs:
            message = message.replace(text, mark)
        return message
