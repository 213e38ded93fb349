"""A job over datasets in object storage against the server's piece cache, at ``hello``.

* :func:`remote_rows`: the most rows one request should read, counting the distinct
  pieces its rows really need (a block shuffle's request reads about a block's; a
  global shuffle's rows land a piece each, two for the few near a piece's end), so that
  chunks of many batches flow when the cache allows; a request that needs more anyway is
  read in rounds (:mod:`~tokenfeed_server.store.cache_rounds`), never refused.
* :func:`check_remote_cache`: the refusals. One row whose pieces do not fit in the whole
  cache (:class:`~tokenfeed.errors.RequestRejected` naming ``--cache-size``); and a
  global shuffle of a dataset the cache cannot hold, which fetches a whole piece for
  nearly every row (the message gives the figures and the fixes) unless the hello says
  ``allow_read_amplification``.
"""

from __future__ import annotations

from tokenfeed import protocol
from tokenfeed.errors import RequestRejected
from tokenfeed_server.store.cache_policy import (
    UNLIMITED_ROWS,
    amplification_refusal,
    one_row_fits,
    span_pieces,
)
from tokenfeed_server.store.mixing import Feed
from tokenfeed_server.store.remote import RemoteDataset

__all__ = ["check_remote_cache", "remote_rows"]


def _remote(feed: Feed) -> list[tuple[RemoteDataset, str, int, int, int]]:
    """``(dataset, shuffle, region_windows, block_regions, seq_len)`` of each remote
    source."""
    return [
        (s.dataset, s.plan.shuffle, s.plan.region_windows, s.plan.block_regions, s.plan.seq_len)
        for s in feed.sources
        if isinstance(s.dataset, RemoteDataset)
    ]


def remote_rows(msg: protocol.Hello, feed: Feed) -> int:
    """The most rows one request of this job should read (:data:`UNLIMITED_ROWS` when
    no source is remote)."""
    remote = _remote(feed)
    if not remote:
        return UNLIMITED_ROWS
    # every remote source of a mixture together: one request reads from all of them
    remote_bytes = sum(ds.nbytes for ds, *_ in remote)
    blocks: int | None = 0
    rows = UNLIMITED_ROWS
    for ds, shuffle, region_windows, block_regions, seq_len in remote:
        row_bytes = (seq_len + 1) * ds.dtype.itemsize
        if shuffle == "block" and blocks is not None:
            # a request of at most a block's rows reads within one block, or the end of
            # one and the start of the next (both wanted by the prefetch: in the cache,
            # read in rounds without a wait if more than half of it): a block's pieces,
            # each of its regions one span
            region_bytes = region_windows * seq_len * ds.dtype.itemsize + row_bytes
            blocks += block_regions * span_pieces(region_bytes, ds.largest_piece)
            rows = min(rows, region_windows * block_regions)
        else:
            blocks = None
    for ds, _, _, _, seq_len in remote:
        row_bytes = (seq_len + 1) * ds.dtype.itemsize
        fit = ds.cache.rows_per_request(
            ds.largest_piece, row_bytes, remote_bytes, span_pieces=blocks
        )
        rows = min(rows, fit)
    return rows


def check_remote_cache(msg: protocol.Hello, feed: Feed) -> None:
    """Refuse a job the cache cannot serve: one row too big for it, or (unless the hello
    allows it) a global shuffle of a dataset bigger than it."""
    remote = _remote(feed)
    for ds, _, _, _, seq_len in remote:
        row_bytes = (seq_len + 1) * ds.dtype.itemsize
        problem = one_row_fits(ds.cache.capacity, ds.largest_piece, row_bytes)
        if problem is not None:
            raise RequestRejected(f"dataset {ds.name!r}: {problem}")
    # the global sources of a mixture are read at once: together they must fit
    spread = [(ds, seq_len) for ds, shuffle, _, _, seq_len in remote if shuffle == "global"]
    if not spread or msg.allow_read_amplification:
        return
    ds, seq_len = spread[0]
    name = "+".join(d.name for d, _ in spread)
    total = sum(d.nbytes for d, _ in spread)
    row_bytes = (seq_len + 1) * ds.dtype.itemsize
    refusal = amplification_refusal(name, total, ds.cache.capacity, ds.largest_piece, row_bytes)
    if refusal is not None:
        raise RequestRejected(refusal)
