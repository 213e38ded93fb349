"""An :class:`Answer`: the rows of one request, read zero-copy from a ``chunk``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenfeed import protocol
from tokenfeed.errors import ProtocolError
from tokenfeed.protocol import JobSpec
from tokenfeed.window import Request

__all__ = ["Answer", "answer_of"]


@dataclass(frozen=True)
class Answer:
    """The rows that answer one :class:`Request`: this rank's ``[count * B, L + 1]``
    tokens with their provenance (global window index and epoch of each row)."""

    request: Request
    tokens: np.ndarray
    window_ids: np.ndarray
    epochs: np.ndarray
    #: for a mixture, each row's source (an index into the job's ``sources``); else None
    sources: np.ndarray | None = None


def answer_of(req: Request, job: JobSpec, header: protocol.Chunk, payload: list[Any]) -> Answer:
    """The answer a chunk carries for ``req``; ProtocolError if it is not what was asked."""
    tokens, rows = protocol.decode_chunk(header, payload)
    window_ids, epochs = protocol.require_rows(rows, protocol.ROW_WINDOW, protocol.ROW_EPOCH)
    n_rows = req.count * job.batch_size
    if tokens.shape != (n_rows, job.seq_len + 1):
        raise ProtocolError(
            f"chunk for {req} has shape {tokens.shape}, expected ({n_rows}, {job.seq_len + 1})"
        )
    sources = None
    if job.is_mixture:
        (sources,) = protocol.require_rows(rows, protocol.ROW_SOURCE)
        # A row labelled with a source that does not exist would be silently
        # mislabelled downstream: refuse it here (two reductions per chunk).
        if n_rows and not 0 <= int(sources.min()) <= int(sources.max()) < len(job.sources):
            raise ProtocolError(
                f"chunk for {req} labels rows with sources outside "
                f"[0, {len(job.sources)}); install matching versions of tokenfeed "
                "and tokenfeed-server, or report a server bug"
            )
    return Answer(req, tokens, window_ids, epochs, sources)
