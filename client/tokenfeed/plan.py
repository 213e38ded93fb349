"""The plan: which window every row of every batch holds, as a pure function.

Order is computed, never stored: the server keeps no cursor per client, and any server
instance can answer any request at any time.

Windows and the stream
    The dataset is one stream of ``N`` tokens. Window ``i`` is tokens
    ``[i*L, i*L + L + 1)`` for sequence length ``L`` (inputs ``w[:-1]``, targets
    ``w[1:]``), so there are ``W = (N - 1) // L`` windows. Epochs are laid end to end
    into one *sample stream*: stream position ``p`` holds window
    ``permute(p % W, W, seed, p // W)`` of epoch ``p // W``. Nothing is dropped at an
    epoch end and nothing repeats within an epoch.

Batches, ranks, workers
    Global step ``t`` after a starting position ``start`` covers stream positions
    ``[start + t*G, start + (t+1)*G)`` with ``G = world_size * batch_size``; rank ``r``
    owns ``[q + r*B, q + (r+1)*B)`` of the global batch starting at ``q``. Every rank
    therefore has the same number of steps for any budget (no uneven-length hangs in
    collectives). A torch DataLoader takes items from its ``K`` workers round-robin,
    starting at worker 0 on every ``iter()``; :func:`worker_steps` tells worker ``w``
    which local steps to produce (``w, w+K, w+2K, ...``, or groups of ``k`` consecutive
    steps per item) so that the loader yields local steps ``0, 1, 2, ...`` in order.

Resume
    The resume state is one integer: the global stream position consumed so far,
    ``P`` (plus the plan's inputs, to check that they did not change). A new job,
    possibly with another ``world_size`` or ``num_workers``, continues at ``P``: its
    global step ``t`` starts at ``step_position(P, t, G_new) = P + t*G_new``, and the
    concatenation of its global batches is exactly the stream from ``P`` on, the same
    sequence a never-interrupted run would have produced. ``P`` need not be a multiple of
    either job's ``G``: positions, not step numbers, are what count.

Block shuffle (``shuffle="block"``)
    For datasets larger than a server's cache, the global shuffle reads the whole dataset
    in every stretch of the stream. The block shuffle keeps the same guarantees (every
    window exactly once per epoch, a new order each epoch, O(1) memory, a pure function
    of the position, so resume is one integer) while bounding what a stretch reads. The
    windows are cut into *regions* of ``R = region_windows`` consecutive windows (about
    one shard of the store, see :func:`default_block_sizes`); each epoch permutes the
    regions and visits them ``K = block_regions`` at a time, a *block*, whose windows it
    shuffles together. The layout, and why its cost stays that of the global shuffle, is
    in :mod:`tokenfeed.order.blocks`.

    Trade-off: every window of a region lands within one block of the stream (at most
    ``K*R`` positions apart), and a stretch of the stream reads only its block's ``K``
    regions, so a server can prefetch the next block's regions (:meth:`Plan.block_spans`)
    and keep only a few blocks cached; the price is less mixing: rows near each other in
    the stream come from at most ``K`` (occasionally ``2K``) regions instead of the whole
    dataset, and a window's neighbours within an epoch are biased towards its own block.
    Pick ``K`` large enough that ``K`` regions are a good sample of the data (regions are
    contiguous in the source order, so a region is usually one source file's worth).

The permutation
    :func:`permute` is a keyed bijection on ``[0, n)`` (a cycle-walking Feistel network,
    :mod:`tokenfeed.order.feistel`), so coverage is exact by construction: every epoch
    visits every window exactly once, whatever the seed. The round keys come from
    ``(seed, epoch)`` by :func:`splitmix64`, so the order is the same on every machine;
    memory and time are O(batch), independent of ``n`` (up to ``2**63 - 1``) and of the
    position in the stream. The order is pseudorandom (Luby-Rackoff), and the tests check
    it statistically: no correlation between a window's original and shuffled position,
    neighbour gaps as in a uniform random permutation, every window at every position
    equally often across seeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Final

import numpy as np
import numpy.typing as npt

from tokenfeed.errors import PlanError
from tokenfeed.order.blocks import BlockLayout, default_block_sizes
from tokenfeed.order.feistel import ROUNDS, SMALL_ROUNDS, permute, permute_checked
from tokenfeed.order.ints import INT64_MAX, UINT64_MAX, IntArray, check_int, int_array
from tokenfeed.order.splitmix import splitmix64
from tokenfeed.order.steps import step_position, steps_to_cover, worker_steps

# Re-exported: the order's public functions are documented and imported from here.
__all__ = [
    "INT64_MAX",
    "ROUNDS",
    "SMALL_ROUNDS",
    "SHUFFLES",
    "Plan",
    "default_block_sizes",
    "permute",
    "splitmix64",
    "step_position",
    "steps_to_cover",
    "worker_steps",
]

#: The shuffle modes of a :class:`Plan`.
SHUFFLES: Final = ("global", "block")


@dataclass(frozen=True)
class Plan:
    """The order of one job over one dataset: windows, epochs, ranks, steps.

    ``n_tokens`` is the dataset's token count, ``seq_len`` the window's input length
    (a window holds ``seq_len + 1`` tokens), ``batch_size`` the rows per rank and step,
    ``world_size`` the number of ranks, ``seed`` the shuffle seed (a uint64).

    ``shuffle`` is ``"global"`` (every epoch a permutation of all windows; then
    ``region_windows`` and ``block_regions`` stay 0) or ``"block"`` (see the module
    docstring; regions of ``region_windows`` windows, visited ``block_regions`` at a
    time, both >= 1; :func:`default_block_sizes` derives them from a store's shards).
    """

    n_tokens: int
    seq_len: int
    batch_size: int
    world_size: int = 1
    seed: int = 0
    shuffle: str = "global"
    region_windows: int = 0
    block_regions: int = 0

    def __post_init__(self) -> None:
        seq_len = check_int("seq_len", self.seq_len, 1, INT64_MAX)
        batch_size = check_int("batch_size", self.batch_size, 1, INT64_MAX)
        world_size = check_int("world_size", self.world_size, 1, INT64_MAX)
        seed = check_int("seed", self.seed, 0, UINT64_MAX)
        n_tokens = check_int("n_tokens", self.n_tokens, 0, INT64_MAX)
        if not isinstance(self.shuffle, str) or self.shuffle not in SHUFFLES:
            raise PlanError(f"shuffle must be 'global' or 'block', got {self.shuffle!r}")
        region_windows = check_int("region_windows", self.region_windows, 0, INT64_MAX)
        block_regions = check_int("block_regions", self.block_regions, 0, INT64_MAX)
        if self.shuffle == "global" and (region_windows or block_regions):
            raise PlanError(
                "region_windows and block_regions apply to shuffle='block' only; leave "
                f"them 0 with the global shuffle (got {region_windows} and {block_regions})"
            )
        if self.shuffle == "block" and (region_windows < 1 or block_regions < 1):
            raise PlanError(
                "shuffle='block' needs region_windows >= 1 and block_regions >= 1 (got "
                f"{region_windows} and {block_regions}); default_block_sizes(shard_tokens, "
                "seq_len) derives them from the dataset's shards"
            )
        if n_tokens < seq_len + 1:
            raise PlanError(
                f"the dataset has {n_tokens} tokens, fewer than one window of "
                f"seq_len + 1 = {seq_len + 1}; use a shorter seq_len or a larger dataset"
            )
        if world_size * batch_size > INT64_MAX:
            raise PlanError(
                f"world_size * batch_size = {world_size * batch_size} overflows int64; "
                "use smaller sizes"
            )
        # Normalize numpy integers to Python ints so arithmetic below never overflows.
        for name, v in (
            ("n_tokens", n_tokens),
            ("seq_len", seq_len),
            ("batch_size", batch_size),
            ("world_size", world_size),
            ("seed", seed),
            ("region_windows", region_windows),
            ("block_regions", block_regions),
        ):
            object.__setattr__(self, name, v)

    @property
    def n_windows(self) -> int:
        """``W = (n_tokens - 1) // seq_len``: the windows of one epoch."""
        return (self.n_tokens - 1) // self.seq_len

    @property
    def global_batch(self) -> int:
        """``G = world_size * batch_size``: stream positions per global step."""
        return self.world_size * self.batch_size

    @property
    def order_key(self) -> tuple[str, int, int, int, int]:
        """Everything :meth:`windows` depends on, hashable: ``(shuffle, n_windows, seed,
        region_windows, block_regions)``. Plans with equal keys give the same order (a
        cache of window ids may be shared between them); the batch and world sizes only
        say which positions a rank reads, not what a position holds."""
        return (self.shuffle, self.n_windows, self.seed, self.region_windows, self.block_regions)

    @cached_property
    def _layout(self) -> BlockLayout:
        return BlockLayout.of(self.n_windows, self.region_windows, self.block_regions, self.seed)

    def windows(self, positions: npt.ArrayLike) -> tuple[IntArray, IntArray]:
        """Stream positions to ``(window_ids, epochs)``, both int64 of the same shape.

        ``epoch = p // W``; globally ``window = permute(p % W, W, seed, epoch)``, in block
        mode the block shuffle of the module docstring.
        """
        p = int_array(positions, "positions")
        if p.size and (int(p.min()) < 0 or int(p.max()) > INT64_MAX):
            raise PlanError("stream positions must lie in [0, 2**63 - 1]")
        p = p.astype(np.int64, copy=False)
        w = np.int64(self.n_windows)
        epochs = p // w  # p >= 0: the same as np.divmod, which is ~15x slower
        local = p - epochs * w
        if self.shuffle == "block":
            return self._layout.windows(local, epochs), epochs
        return permute_checked(local, self.n_windows, self.seed, epochs), epochs

    def block_spans(self, position: int, blocks: int = 2) -> list[tuple[int, int]]:
        """Token spans ``[start, stop)``, merged and sorted, that the block of the stream
        holding ``position`` and the next ``blocks - 1`` blocks read (crossing into the
        next epoch as needed): the union of their regions' windows' tokens, window ``w``
        reading ``[w*L, w*L + L + 1)``. What a server prefetches. With the global
        shuffle any stretch reads the whole dataset: ``[(0, n_tokens)]``.
        """
        position = check_int("position", position, 0, INT64_MAX)
        blocks = check_int("blocks", blocks, 1, INT64_MAX)
        if self.shuffle == "global":
            return [(0, self.n_tokens)]
        return self._layout.block_spans(self.seq_len, position, blocks)

    def rank_positions(self, rank: int, pos: int, count: int = 1, stride: int = 1) -> IntArray:
        """Stream positions of rank ``rank``'s rows in ``count`` global batches.

        The global batches start at ``pos, pos + stride*G, pos + 2*stride*G, ...``; in the
        one starting at ``q``, rank ``r`` owns ``[q + r*B, q + (r+1)*B)``. Returns int64 of
        shape ``(count * batch_size,)``. ``pos`` is any non-negative position.
        """
        rank = check_int("rank", rank, 0, INT64_MAX)
        if rank >= self.world_size:
            raise PlanError(
                f"rank {rank} is out of range for world_size {self.world_size}; "
                f"ranks are 0..{self.world_size - 1}"
            )
        pos = check_int("pos", pos, 0, INT64_MAX)
        count = check_int("count", count, 0, INT64_MAX)
        stride = check_int("stride", stride, 1, INT64_MAX)
        g, b = self.global_batch, self.batch_size
        if count and pos + (count - 1) * stride * g + g - 1 > INT64_MAX:
            raise PlanError(
                f"positions up to {pos + (count - 1) * stride * g + g - 1} overflow int64; "
                "the stream cannot go that far"
            )
        first = pos + rank * b
        step = stride * g if count > 1 else b  # a lone batch's stride is irrelevant
        if step == b:  # one run of positions (one rank, consecutive batches): the hot path
            return np.arange(first, first + count * b, dtype=np.int64)
        starts = np.arange(count, dtype=np.int64) * np.int64(step) + np.int64(first)
        rows: IntArray = (starts[:, None] + np.arange(b, dtype=np.int64)[None, :]).reshape(-1)
        return rows

    def rank_batches(
        self, rank: int, pos: int, count: int = 1, stride: int = 1
    ) -> tuple[IntArray, IntArray]:
        """``windows(rank_positions(...))``, each reshaped to ``(count, batch_size)``."""
        ids, epochs = self.windows(self.rank_positions(rank, pos, count, stride))
        shape = (-1, self.batch_size)
        return ids.reshape(shape), epochs.reshape(shape)

    def token_starts(self, window_ids: npt.ArrayLike) -> IntArray:
        """First token of each window: ``window_ids * seq_len`` (int64)."""
        w = int_array(window_ids, "window_ids")
        if w.size and (int(w.min()) < 0 or int(w.max()) >= self.n_windows):
            raise PlanError(f"window ids must lie in [0, {self.n_windows})")
        starts: IntArray = w.astype(np.int64, copy=False) * np.int64(self.seq_len)
        return starts
