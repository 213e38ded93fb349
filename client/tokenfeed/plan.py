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
    ``W`` windows are cut into *regions* of ``R = region_windows`` consecutive windows,
    region ``r`` = windows ``[r*R, min((r+1)*R, W))`` (``M = ceil(W/R)`` regions; only
    the last may be shorter); a region is about one shard of the store (see
    :func:`default_block_sizes`). Each epoch:

    - the regions are permuted: slot ``s`` of the epoch's region sequence holds a region
      drawn by a keyed permutation of ``(seed, epoch)``, domain-separated from every
      other key. The short last region sits at a slot ``S`` hashed from
      ``(seed, epoch)``; the other slots hold ``permute(s', M-1, ...)`` of the ``M - 1``
      full regions (``s'`` = ``s`` with ``S`` skipped). Placing the one short region
      directly, instead of inverting the permutation to find it, keeps every block's size
      and first position O(1) to compute;
    - the slots are grouped into *blocks* of ``K = block_regions`` consecutive slots
      (``ceil(M/K)`` blocks; the last may hold fewer regions). The epoch's positions go
      to the blocks in order: block ``b`` covers the local positions
      ``[b*K*R - d*[S//K < b], ...)`` for a block of ``K*R - d*[S//K == b]`` windows
      (``d`` = the short region's missing windows), so a position's block is O(1);
    - inside a block, the positions are a keyed permutation (key from the seed and the
      block's serial number in the stream, ``epoch * blocks + b``) of the block's windows
      taken across all its regions, so consecutive rows mix ``K`` regions.

    Cost: one keyed permutation per row as in the global shuffle, plus a region lookup
    in small per-block tables (a bounded LRU cache of a few MiB at most, whatever the
    dataset's size or the epoch): ``benchmarks/bench_block_shuffle.py`` measures the
    block shuffle at 0.9-1.1x the global one's rate with the default sizes.

    Trade-off: every window of a region lands within one block of the stream (at most
    ``K*R`` positions apart), and a stretch of the stream reads only its block's ``K``
    regions, so a server can prefetch the next block's regions (:meth:`Plan.block_spans`)
    and keep only a few blocks cached; the price is less mixing: rows near each other in
    the stream come from at most ``K`` (occasionally ``2K``) regions instead of the whole
    dataset, and a window's neighbours within an epoch are biased towards its own block.
    Pick ``K`` large enough that ``K`` regions are a good sample of the data (regions are
    contiguous in the source order, so a region is usually one source file's worth).

The permutation
    :func:`permute` is a keyed bijection on ``[0, n)``: a Feistel network on the
    smallest power-of-two domain ``2**b >= n`` (``b >= 2``), restricted to ``[0, n)`` by
    cycle-walking (re-encrypt until the value falls below ``n``; the cycle of a
    permutation through a point of ``[0, n)`` returns to ``[0, n)``, so this is a
    bijection on ``[0, n)`` and terminates). For odd ``b`` the halves are ``b // 2`` and
    ``b - b // 2`` bits and swap widths every round (the alternating Feistel of NIST
    FF1), instead of padding to an even power of two: the domain stays below ``2n``, so
    fewer than 2 walks are expected (below 4 with padding), which more than doubled
    throughput on real window counts. Each of the :data:`ROUNDS` rounds
    (:data:`SMALL_ROUNDS` when ``n <= 16``) maps ``(A, B) -> (B, A xor F_k(B))`` where
    ``F_k(B)`` is the top bits of ``((B * M1) xor k) * M2`` on uint64. Round keys come from
    ``(seed, epoch, round)`` by the splitmix64 finalizer on uint64, so the order is the
    same on every machine: no Python ``hash()``, no global RNG, no platform ``int``
    width. Memory is O(batch), time O(batch) and independent of ``n`` and of the
    position in the stream; ``n`` may be as large as ``2**63 - 1``.

Why it is unbiased
    Coverage is exact by construction, not by sampling: a Feistel network is a bijection
    whatever its round function, so every epoch visits every window exactly once, and no
    window is favoured across epochs. The order itself is pseudorandom: the round keys
    are independent-looking 64-bit values per (seed, epoch), a multi-round Feistel
    network with well-mixed round functions behaves like a random permutation
    (Luby-Rackoff), and the tests check it statistically (no correlation between a
    window's original and shuffled position; the gaps between neighbours' original
    positions are distributed as in a uniform random permutation; every window lands at
    every position equally often across seeds). It is not a uniform draw from all
    ``n!`` orders (no 64-bit keyed family can be), which training does not need.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Final, overload

import numpy as np
import numpy.typing as npt

from tokenfeed.errors import PlanError

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

INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1
#: Feistel rounds. Luby-Rackoff needs 4 for a strong PRP from PRF rounds; 6 leaves margin
#: for round functions that are fast mixers rather than true PRFs.
ROUNDS = 6
#: Rounds for tiny domains (h <= 2 bits per half, n <= 16): a round function with 1- or
#: 2-bit outputs has few distinct values, and 6 rounds left a measurable position bias
#: there (chi-square over 4000 seeds, ~6 sigma at n = 5). Cheap: such datasets are tiny.
SMALL_ROUNDS = 12

#: The shuffle modes of a :class:`Plan`.
SHUFFLES: Final = ("global", "block")
#: Regions per block when the trainer leaves ``block_regions`` at 0.
DEFAULT_BLOCK_REGIONS: Final = 4

_MASK64 = UINT64_MAX
# Domain separation of the block shuffle's keys (ASCII tags, xored into the seed before it
# is mixed), so the region order, the short region's slot and the in-block orders are
# independent of each other and of the global shuffle's keys for the same seed.
_TAG_REGIONS = 0x7466_2E72_6567_696F  # "tf.regio"
_TAG_SHORT = 0x7466_2E73_686F_7274  # "tf.short"
_TAG_BLOCK = 0x7466_2E62_6C6F_636B  # "tf.block"
_GOLDEN = 0x9E3779B97F4A7C15
# Multipliers of the round function (odd, from splitmix64 / murmur3's fmix64).
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_TOP = [np.uint64(64 - m) for m in range(65)]  # shift that keeps the top m bits

IntArray = npt.NDArray[np.int64]


def _mix64(z: int) -> int:
    """The splitmix64 finalizer on a Python int (exact, no numpy overflow warnings)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@overload
def splitmix64(x: int) -> int: ...
@overload
def splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]: ...
def splitmix64(x: int | npt.NDArray[np.uint64]) -> int | npt.NDArray[np.uint64]:
    """One splitmix64 output for state ``x`` (a fixed, portable 64-bit integer mixer).

    ``x`` is a Python int (exact, any size, taken mod 2**64) or a uint64 array (one output
    per element, wrapping arithmetic); both give the same bits for the same state.
    """
    if isinstance(x, int):
        return _mix64(x + _GOLDEN)
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) + np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        out: npt.NDArray[np.uint64] = z ^ (z >> np.uint64(31))
        return out


def _rounds(bits: int) -> int:
    return SMALL_ROUNDS if bits <= 4 else ROUNDS


def _round_keys(seed: int, epoch: int, rounds: int) -> list[int]:
    """The Feistel round keys of ``(seed, epoch)``; chained so that no two inputs collide
    trivially (e.g. seed 1/epoch 0 vs seed 0/epoch 1)."""
    base = splitmix64(splitmix64(seed) ^ epoch)
    return [splitmix64(base + r * _GOLDEN) for r in range(rounds)]


def _domain_bits(n: int) -> int:
    """Bits of the Feistel domain: the smallest power of two >= n, at least 4 (2 bits)."""
    return max(2, (n - 1).bit_length())


def _feistel(x: npt.NDArray[np.uint64], bits: int, keys: list[npt.NDArray[np.uint64]]) -> None:
    """Encrypt ``x`` (values in [0, 2**bits)) in place, one key (scalar or per element) per
    round; an even number of rounds.

    Alternating Feistel as in NIST FF1: ``x = A || B`` with ``A`` the top ``u = bits // 2``
    bits and ``B`` the low ``v = bits - u``; round ``i`` sets ``A, B = B, A xor F_k(B)``
    truncated to ``u`` bits on even rounds and ``v`` on odd ones, so the halves swap widths
    and an odd ``bits`` needs no padding to an even power of two.
    """
    u = bits // 2
    v = bits - u
    a = x >> np.uint64(v)
    b = x & np.uint64((1 << v) - 1)
    t = np.empty_like(x)
    for i, k in enumerate(keys):
        # F_k(B) = top m bits of ((B * M1) xor k) * M2: the first product spreads B over
        # the word, the key enters everywhere, and the top bits of the second product
        # depend on every bit below them (5 in-place ufunc calls per round).
        np.multiply(b, _M1, out=t)
        np.bitwise_xor(t, k, out=t)
        np.multiply(t, _M2, out=t)
        np.right_shift(t, _TOP[v if i % 2 else u], out=t)
        np.bitwise_xor(a, t, out=a)
        a, b = b, a
    np.left_shift(a, np.uint64(v), out=x)
    np.bitwise_or(x, b, out=x)


def _int_array(value: npt.ArrayLike, name: str) -> npt.NDArray[np.integer]:
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        raise PlanError(f"{name} must be an integer array, got dtype {arr.dtype}")
    return arr


def _permute_checked(
    index: npt.NDArray[np.integer], n: int, seed: int, epoch: int | npt.NDArray[np.integer]
) -> IntArray:
    """permute() without argument validation (the caller guarantees ranges)."""
    shape = index.shape
    if n == 1 or index.size == 0:
        return np.zeros(shape, dtype=np.int64)
    # At least 1-d: numpy 0-d results decay to scalars, whose overflow would warn.
    x = np.array(index, dtype=np.uint64, copy=True).reshape(-1)
    bits = _domain_bits(n)
    rounds = _rounds(bits)
    if isinstance(epoch, np.ndarray):
        ep = epoch.reshape(-1)
        lo, hi = int(ep.min()), int(ep.max())
        if lo == hi:
            epoch = lo
    per_element = isinstance(epoch, np.ndarray)
    if isinstance(epoch, np.ndarray):
        # Rows of one batch straddle an epoch boundary: one key table per distinct epoch,
        # gathered per element.
        uniq, inv = np.unique(epoch.reshape(-1), return_inverse=True)
        table = np.array([_round_keys(seed, int(e), rounds) for e in uniq], dtype=np.uint64)
        keys = [table[inv, r] for r in range(rounds)]
    else:
        keys = [np.full(1, k, dtype=np.uint64) for k in _round_keys(seed, epoch, rounds)]
    _encrypt(x, n, bits, keys, per_element)
    return x.astype(np.int64).reshape(shape)


def _encrypt(
    x: npt.NDArray[np.uint64],
    n: int | npt.NDArray[np.uint64],
    bits: int,
    keys: list[npt.NDArray[np.uint64]],
    per_element: bool,
) -> None:
    """Encrypt ``x`` (values in [0, n)) in place by the cycle-walking Feistel network.

    ``n`` may differ per row (an array like ``x``) if every row's ``n`` has the domain
    ``2**bits``: the network is the same, only where the walk stops differs.
    """
    _feistel(x, bits, keys)
    nn = np.uint64(n) if isinstance(n, int) else n
    out = np.flatnonzero(x >= nn)
    # Cycle-walk the values that left [0, n); each pass keeps about 1 - n/2**bits < 1/2.
    while out.size:
        sub = x[out]
        sub_keys = [k[out] for k in keys] if per_element else keys
        _feistel(sub, bits, sub_keys)
        x[out] = sub
        out = out[sub >= (nn if isinstance(nn, np.uint64) else nn[out])]


def permute(index: npt.ArrayLike, n: int, seed: int, epoch: int | npt.ArrayLike) -> IntArray:
    """Map ``index`` (values in ``[0, n)``) through the keyed permutation of ``[0, n)``.

    ``epoch`` is an int or an integer array of the same shape as ``index`` (rows of one
    batch may belong to two epochs). Vectorized; returns int64 of ``index``'s shape.
    The same ``(n, seed, epoch)`` always gives the same bijection, on any machine.
    """
    n = _check_int("n", n, 1, INT64_MAX)
    seed = _check_int("seed", seed, 0, UINT64_MAX)
    idx = _int_array(index, "index")
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise PlanError(
            f"index values must lie in [0, {n}); got [{int(idx.min())}, {int(idx.max())}]"
        )
    if isinstance(epoch, (int, np.integer)) and not isinstance(epoch, bool):
        ep: int | npt.NDArray[np.integer] = _check_int("epoch", epoch, 0, UINT64_MAX)
    else:
        ep_arr = _int_array(epoch, "epoch")
        if ep_arr.shape != idx.shape:
            raise PlanError(
                f"epoch must be an int or an array of index's shape {idx.shape}, "
                f"got shape {ep_arr.shape}"
            )
        if ep_arr.size and int(ep_arr.min()) < 0:
            raise PlanError("epoch values must be non-negative")
        ep = ep_arr
    return _permute_checked(idx, n, seed, ep)


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    """``value`` as a Python int in ``[lo, hi]``, else PlanError naming the fix."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise PlanError(f"{name} must be an integer, got {value!r}")
    v = operator.index(value)
    if v < lo:
        raise PlanError(f"{name} must be >= {lo}, got {v}")
    if v > hi:
        raise PlanError(f"{name} must be <= {hi} (int64/uint64 limit), got {v}")
    return v


U64Array = npt.NDArray[np.uint64]
# A call's blocks are described by small per-block tables (gathered per row) when they
# hold at most this many region slots, or a quarter of the rows if that is more.
_TABLE_SLOTS = 256
# Region slots a cached table describes at least (see _BlockLayout.windows).
_TABLE_BATCH = 2048
# Tables and key ranges larger than this (calls of very many rows) are not cached: the
# caches stay a few MiB at most, whatever the calls.
_CACHE_SLOTS = 16384


# A permutation's tweak per row: one int for all rows, one per row, or
# ``(first, count, rows)``: row i has tweak ``first + rows[i]``, ``0 <= rows[i] < count``.
Tweak = int | U64Array | tuple[int, int, npt.NDArray[np.intp]]


def _vector_round_keys(seed: int, tweaks: U64Array, rounds: int) -> list[U64Array]:
    """``_round_keys(seed, t, rounds)`` of every ``t`` in ``tweaks``, as one array per
    round (splitmix64 on uint64 arrays wraps exactly like _mix64 on ints)."""
    with np.errstate(over="ignore"):
        base = splitmix64(np.uint64(splitmix64(seed)) ^ tweaks)
        return [splitmix64(base + np.uint64(r * _GOLDEN & _MASK64)) for r in range(rounds)]


@lru_cache(maxsize=16)
def _range_round_keys(seed: int, first: int, count: int, rounds: int) -> list[U64Array]:
    """:func:`_vector_round_keys` of tweaks ``[first, first + count)``, cached: the block
    serials of consecutive calls (see :func:`_block_tables`)."""
    keys = _vector_round_keys(seed, np.arange(first, first + count, dtype=np.uint64), rounds)
    for key in keys:
        key.flags.writeable = False
    return keys


def _tweak_keys(seed: int, tweak: Tweak, rounds: int) -> tuple[list[U64Array], bool]:
    """The round keys ``_round_keys(seed, t, rounds)`` of every row's tweak ``t``, and
    whether they differ per row (else each key is a 1-element array)."""
    if isinstance(tweak, tuple):
        first, count, rows = tweak
        if count <= _CACHE_SLOTS:
            keys = _range_round_keys(seed, first, count, rounds)
        else:
            tweaks = np.arange(first, first + count, dtype=np.uint64)
            keys = _vector_round_keys(seed, tweaks, rounds)
        return [key[rows] for key in keys], True
    if not isinstance(tweak, int) and int(tweak.min()) == int(tweak.max()):
        tweak = int(tweak[0])
    if isinstance(tweak, int):
        return [np.full(1, k, dtype=np.uint64) for k in _round_keys(seed, tweak, rounds)], False
    # Rows often come as runs of one block each: keys per run, gathered per row.
    starts = np.flatnonzero(tweak[1:] != tweak[:-1]) + 1
    if (starts.size + 1) * 4 > tweak.size:
        return _vector_round_keys(seed, tweak, rounds), True
    keys = _vector_round_keys(seed, np.append(tweak[:1], tweak[starts]), rounds)
    run = np.repeat(np.arange(starts.size + 1), np.diff(starts, prepend=0, append=tweak.size))
    return [key[run] for key in keys], True


def _permute_sized(index: U64Array, size: U64Array | int, seed: int, tweak: Tweak) -> U64Array:
    """``permute(index[i], size[i], seed, tweak[i])`` for every row, vectorized (an int
    ``size`` or ``tweak`` is the same for every row). Rows whose sizes share a Feistel
    domain go through one network with a per-row walk bound; otherwise (rare: the short
    block's size crosses a power of two) rows are grouped by size."""
    groups: list[tuple[int, int | U64Array, npt.NDArray[np.intp] | None]]
    if isinstance(size, int):
        groups = [(size, size, None)]
    else:
        lo, hi = int(size.min()), int(size.max())
        if lo == hi:
            groups = [(lo, lo, None)]
        elif _domain_bits(lo) == _domain_bits(hi):
            groups = [(hi, size, None)]
        else:
            groups = [(int(n), int(n), np.flatnonzero(size == n)) for n in np.unique(size)]
    out = index.copy() if groups[0][2] is None else np.zeros_like(index)
    for n, bound, sel in groups:
        if n == 1:
            out[sel if sel is not None else slice(None)] = 0  # one-window blocks
            continue
        x = out if sel is None else index[sel]
        tw: Tweak = tweak
        if sel is not None:
            if isinstance(tweak, tuple):
                tw = (tweak[0], tweak[1], tweak[2][sel])
            elif not isinstance(tweak, int):
                tw = tweak[sel]
        bits = _domain_bits(n)
        keys, per_element = _tweak_keys(seed, tw, _rounds(bits))
        _encrypt(x, bound, bits, keys, per_element)
        if sel is not None:
            out[sel] = x
    return out


@dataclass(frozen=True)
class _BlockInfo:
    """Per block (one row per block serial ``epoch * nb + b``): its window count, the
    in-block index where the short region ends (past every index if the block has no
    short region), its first region slot, its epoch and the epoch's short-region slot."""

    size: U64Array
    short_end: U64Array
    first_slot: U64Array
    epoch: U64Array
    short: U64Array


@dataclass(frozen=True)
class _BlockLayout:
    """The block shuffle's sizes and keys for one (W, R, K, seed); see the module docstring.

    Per-row arithmetic is uint64: a position's offset plus the short region's deficit may
    exceed int64 when W is near 2**63.
    """

    w: int  # windows
    r: int  # windows per region, at most w
    m: int  # regions, ceil(w / r)
    last: int  # windows of the last region (1..r)
    d: int  # r - last: windows the short region lacks
    k: int  # regions per block, at most m
    kr: int  # k * r: windows of a full block
    nb: int  # blocks per epoch, ceil(m / k)
    seed_regions: int
    seed_short: int
    seed_block: int

    @staticmethod
    def of(w: int, region_windows: int, block_regions: int, seed: int) -> _BlockLayout:
        r = max(1, min(region_windows, w))
        m = -(-w // r)
        last = w - (m - 1) * r
        k = max(1, min(block_regions, m))
        return _BlockLayout(
            w=w,
            r=r,
            m=m,
            last=last,
            d=r - last,
            k=k,
            kr=k * r,
            nb=-(-m // k),
            seed_regions=splitmix64(seed ^ _TAG_REGIONS),
            seed_short=splitmix64(seed ^ _TAG_SHORT),
            seed_block=splitmix64(seed ^ _TAG_BLOCK),
        )

    def short_slot(self, epochs: U64Array) -> U64Array:
        """The slot of the short (last) region in each epoch's region sequence."""
        slot: U64Array = splitmix64(np.uint64(self.seed_short) ^ epochs) % np.uint64(self.m)
        return slot

    def short_slot_of(self, epoch: int) -> int:
        """:meth:`short_slot` of one epoch (same bits: splitmix64 is exact on ints)."""
        return splitmix64(self.seed_short ^ epoch) % self.m

    def shift(self, local: U64Array, short: U64Array | int) -> None:
        """Add the short region's deficit ``d``, in place, to the epoch-local positions
        after the block holding the short region: then block ``b`` starts at ``b*K*R``."""
        if not self.d:
            return
        k, m, r = self.k, self.m, self.r
        end: U64Array | int
        if isinstance(short, int):
            sb = short // k
            end = sb * self.kr + min(k, m - sb * k) * r - self.d
        else:
            sb_first = short // np.uint64(k) * np.uint64(k)
            regions = np.minimum(np.uint64(k), np.uint64(m) - sb_first)
            end = sb_first * np.uint64(r) + regions * np.uint64(r) - np.uint64(self.d)
        local += (local >= end) * np.uint64(self.d)  # (a masked np.add is slower)

    def block_info(self, serial: U64Array) -> _BlockInfo:
        """The :class:`_BlockInfo` of blocks ``serial`` (``epoch * nb + b``), vectorized."""
        u = np.uint64
        k = u(self.k)
        epoch = serial // u(self.nb)
        first = (serial - epoch * u(self.nb)) * k
        short = self.short_slot(epoch)
        size = np.minimum(k, u(self.m) - first) * u(self.r)
        in_block = (short >= first) & (short < first + k)
        short_index = np.where(in_block, short, first + k) - first
        if self.d:
            size[in_block] -= u(self.d)
        short_end = short_index * u(self.r) + u(self.last)
        return _BlockInfo(size, short_end, first, epoch, short)

    def regions_at(self, slots: U64Array, short: U64Array, epochs: U64Array) -> U64Array:
        """The region in slot ``slots`` of epoch ``epochs`` (the short one at ``short``)."""
        if self.m == 1:
            return np.zeros_like(slots)
        is_short = slots == short
        # Skip the short region's slot; the short slot itself gets a dummy in-range index.
        index = np.where(slots > short, slots - np.uint64(1), slots)
        index[is_short] = 0
        full = _permute_checked(index, self.m - 1, self.seed_regions, epochs.astype(np.int64))
        regions: U64Array = np.where(is_short, np.uint64(self.m - 1), full.astype(np.uint64))
        return regions

    def windows(self, local: IntArray, epochs: IntArray) -> IntArray:
        """Window ids of epoch-local positions ``local`` of epochs ``epochs`` (int64)."""
        shape = local.shape
        if local.size == 0:
            return np.zeros(shape, dtype=np.int64)
        u = np.uint64
        r = u(self.r)
        loc = local.reshape(-1).astype(np.uint64)  # a copy: shifted in place
        ep = epochs.reshape(-1)
        e0, e1 = int(ep.min()), int(ep.max())
        epu = ep.astype(np.uint64)
        self.shift(loc, self.short_slot_of(e0) if e0 == e1 else self.short_slot(epu))
        block = loc // u(self.kr)
        offset = loc - block * u(self.kr)
        # The block's serial number in the stream keys its order: unique per (epoch,
        # block), below (epoch + 1) * W <= 2**64, and consecutive across epochs.
        serial = epu * u(self.nb) + block
        s0, s1 = int(serial.min()), int(serial.max())
        n_blocks = s1 - s0 + 1
        if n_blocks * self.k > max(_TABLE_SLOTS, loc.size // 4):
            # Rows from many blocks (scattered positions, tiny blocks): everything per row.
            info = self.block_info(serial)
            j = _permute_sized(offset, info.size, self.seed_block, serial)
            if self.d:
                j += (j >= info.short_end) * u(self.d)
            within = j // r  # (np.divmod is ~15x slower than // and -)
            off = j - within * r
            regions = self.regions_at(info.first_slot + within, info.short, info.epoch)
        else:
            # The common case: a few consecutive blocks. Describe them in small tables
            # (the regions of their K slots each) and gather per row.
            # Tables of 2S blocks from a multiple of S, S >= 2 * n_blocks a power of two:
            # they cover this call, and the next calls find theirs cached. At least
            # _TABLE_BATCH slots (or as many as rows): a table's cost is mostly fixed
            # (numpy calls, walks), and a small call should not pay for a big one.
            span = 2 << (n_blocks - 1).bit_length()
            while span * self.k < min(_TABLE_BATCH, loc.size):
                span *= 2
            # No uint64 overflow: a serial is at most its position + 1 <= 2**63.
            base = s0 // span * span
            tables = _block_tables if 2 * span * self.k <= _CACHE_SLOTS else _make_block_tables
            info, table = tables(self, base, 2 * span)
            if n_blocks == 1:
                i = s0 - base
                j = _permute_sized(offset, int(info.size[i]), self.seed_block, s0)
                if self.d:
                    j += (j >= info.short_end[i]) * u(self.d)
                within = j // r
                off = j - within * r
                regions = table[within.astype(np.intp) + i * self.k]  # (intp: 3x faster)
            else:
                row = (serial - u(base)).astype(np.intp)
                tweak = (base, 2 * span, row)  # the block serials, as table rows
                j = _permute_sized(offset, info.size[row], self.seed_block, tweak)
                if self.d:
                    j += (j >= info.short_end[row]) * u(self.d)
                within = j // r
                off = j - within * r
                regions = table[row * self.k + within.astype(np.intp)]
        ids: IntArray = (regions * r + off).astype(np.int64).reshape(shape)
        return ids

    def block_serial(self, position: int) -> int:
        """The serial number (``epoch * nb + b``) of the block holding ``position``."""
        epoch, local = divmod(position, self.w)
        if self.d:  # as shift(), on ints
            sb = self.short_slot_of(epoch) // self.k
            if local >= sb * self.kr + min(self.k, self.m - sb * self.k) * self.r - self.d:
                local += self.d
        return epoch * self.nb + local // self.kr

    def block_spans(self, seq_len: int, position: int, blocks: int) -> list[tuple[int, int]]:
        """:meth:`Plan.block_spans` in block mode."""
        if self.nb == 1 or blocks > 2 * self.nb:
            # One block per epoch, or a whole epoch in range: every window.
            return [(0, self.w * seq_len + 1)]
        first = self.block_serial(position)
        # Serials past the stream's end (2**63 - 1) hold no position: leave them out.
        last = min(first + blocks - 1, (INT64_MAX // self.w + 1) * self.nb - 1)
        return list(_block_spans(self, seq_len, first, last))


@lru_cache(maxsize=64)
def _block_spans(
    layout: _BlockLayout, seq_len: int, first: int, last: int
) -> tuple[tuple[int, int], ...]:
    """Merged token spans of the regions of block serials ``[first, last]``. Cached: a
    prefetcher asks again and again while a job is inside the same block."""
    info = layout.block_info(np.arange(first, last + 1, dtype=np.uint64))
    slots = info.first_slot[:, None] + np.arange(layout.k, dtype=np.uint64)[None, :]
    valid = slots < np.uint64(layout.m)
    n = slots.shape[1]
    regions = np.unique(
        layout.regions_at(
            slots[valid],
            np.repeat(info.short, n).reshape(slots.shape)[valid],
            np.repeat(info.epoch, n).reshape(slots.shape)[valid],
        )
    )
    first_window = regions * np.uint64(layout.r)
    length = np.where(regions == np.uint64(layout.m - 1), layout.last, layout.r)
    starts = (first_window * np.uint64(seq_len)).tolist()
    stops = ((first_window + length.astype(np.uint64)) * np.uint64(seq_len) + np.uint64(1)).tolist()
    spans: list[tuple[int, int]] = []
    for start, stop in zip(starts, stops, strict=True):  # sorted by region, hence by start
        if spans and start <= spans[-1][1]:  # neighbours share a token: merge
            spans[-1] = (spans[-1][0], max(spans[-1][1], stop))
        else:
            spans.append((start, stop))
    return tuple(spans)


def _make_block_tables(layout: _BlockLayout, first: int, count: int) -> tuple[_BlockInfo, U64Array]:
    """The :class:`_BlockInfo` of block serials ``[first, first + count)`` and the regions
    of their ``K`` slots each (row-major; a short last block's spare slots repeat region
    ``M - 1``, never read)."""
    info = layout.block_info(np.arange(first, first + count, dtype=np.uint64))
    k = layout.k
    slots = info.first_slot[:, None] + np.arange(k, dtype=np.uint64)[None, :]
    np.minimum(slots, np.uint64(layout.m - 1), out=slots)
    table = layout.regions_at(slots.reshape(-1), np.repeat(info.short, k), np.repeat(info.epoch, k))
    for part in (table, info.size, info.short_end, info.first_slot, info.epoch, info.short):
        part.flags.writeable = False  # shared by every caller of the cache
    return info, table


#: :func:`_make_block_tables`, cached (tables of at most _CACHE_SLOTS slots): consecutive
#: calls mostly fall in the same blocks, and a table is most of a small call's fixed cost.
_block_tables = lru_cache(maxsize=16)(_make_block_tables)


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
        seq_len = _check_int("seq_len", self.seq_len, 1, INT64_MAX)
        batch_size = _check_int("batch_size", self.batch_size, 1, INT64_MAX)
        world_size = _check_int("world_size", self.world_size, 1, INT64_MAX)
        seed = _check_int("seed", self.seed, 0, UINT64_MAX)
        n_tokens = _check_int("n_tokens", self.n_tokens, 0, INT64_MAX)
        if not isinstance(self.shuffle, str) or self.shuffle not in SHUFFLES:
            raise PlanError(f"shuffle must be 'global' or 'block', got {self.shuffle!r}")
        region_windows = _check_int("region_windows", self.region_windows, 0, INT64_MAX)
        block_regions = _check_int("block_regions", self.block_regions, 0, INT64_MAX)
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
    def _layout(self) -> _BlockLayout:
        return _BlockLayout.of(self.n_windows, self.region_windows, self.block_regions, self.seed)

    def windows(self, positions: npt.ArrayLike) -> tuple[IntArray, IntArray]:
        """Stream positions to ``(window_ids, epochs)``, both int64 of the same shape.

        ``epoch = p // W``; globally ``window = permute(p % W, W, seed, epoch)``, in block
        mode the block shuffle of the module docstring.
        """
        p = _int_array(positions, "positions")
        if p.size and (int(p.min()) < 0 or int(p.max()) > INT64_MAX):
            raise PlanError("stream positions must lie in [0, 2**63 - 1]")
        p = p.astype(np.int64, copy=False)
        w = np.int64(self.n_windows)
        epochs = p // w  # p >= 0: the same as np.divmod, which is ~15x slower
        local = p - epochs * w
        if self.shuffle == "block":
            return self._layout.windows(local, epochs), epochs
        return _permute_checked(local, self.n_windows, self.seed, epochs), epochs

    def block_spans(self, position: int, blocks: int = 2) -> list[tuple[int, int]]:
        """Token spans ``[start, stop)``, merged and sorted, that the block of the stream
        holding ``position`` and the next ``blocks - 1`` blocks read (crossing into the
        next epoch as needed): the union of their regions' windows' tokens, window ``w``
        reading ``[w*L, w*L + L + 1)``. What a server prefetches. With the global
        shuffle any stretch reads the whole dataset: ``[(0, n_tokens)]``.
        """
        position = _check_int("position", position, 0, INT64_MAX)
        blocks = _check_int("blocks", blocks, 1, INT64_MAX)
        if self.shuffle == "global":
            return [(0, self.n_tokens)]
        return self._layout.block_spans(self.seq_len, position, blocks)

    def rank_positions(self, rank: int, pos: int, count: int = 1, stride: int = 1) -> IntArray:
        """Stream positions of rank ``rank``'s rows in ``count`` global batches.

        The global batches start at ``pos, pos + stride*G, pos + 2*stride*G, ...``; in the
        one starting at ``q``, rank ``r`` owns ``[q + r*B, q + (r+1)*B)``. Returns int64 of
        shape ``(count * batch_size,)``. ``pos`` is any non-negative position.
        """
        rank = _check_int("rank", rank, 0, INT64_MAX)
        if rank >= self.world_size:
            raise PlanError(
                f"rank {rank} is out of range for world_size {self.world_size}; "
                f"ranks are 0..{self.world_size - 1}"
            )
        pos = _check_int("pos", pos, 0, INT64_MAX)
        count = _check_int("count", count, 0, INT64_MAX)
        stride = _check_int("stride", stride, 1, INT64_MAX)
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
        w = _int_array(window_ids, "window_ids")
        if w.size and (int(w.min()) < 0 or int(w.max()) >= self.n_windows):
            raise PlanError(f"window ids must lie in [0, {self.n_windows})")
        starts: IntArray = w.astype(np.int64, copy=False) * np.int64(self.seq_len)
        return starts


def default_block_sizes(shard_tokens: Sequence[int], seq_len: int) -> tuple[int, int]:
    """``(region_windows, block_regions)`` for a dataset whose shards hold ``shard_tokens``
    tokens each, when the trainer leaves them at 0: a region is about one shard's windows
    (the largest shard's, i.e. the size the writer cuts at, so a region spans one or two
    shards), a block :data:`DEFAULT_BLOCK_REGIONS` regions, or all of them when there are
    fewer. Pure: the same store and ``seq_len`` give the same sizes on every server,
    whatever its cache size.
    """
    seq_len = _check_int("seq_len", seq_len, 1, INT64_MAX)
    tokens = [_check_int(f"shard_tokens[{i}]", t, 0, INT64_MAX) for i, t in enumerate(shard_tokens)]
    total = sum(tokens)
    if total < seq_len + 1:
        raise PlanError(
            f"the dataset's shards hold {total} tokens, fewer than one window of "
            f"seq_len + 1 = {seq_len + 1}; use a shorter seq_len or a larger dataset"
        )
    n_windows = (total - 1) // seq_len
    region = min(n_windows, max(1, max(tokens) // seq_len))
    regions = -(-n_windows // region)
    return region, min(DEFAULT_BLOCK_REGIONS, regions)


def step_position(start: int, step: int, global_batch: int) -> int:
    """Stream position of global step ``step`` counted from resume point ``start``:
    ``start + step * global_batch``."""
    start = _check_int("start", start, 0, INT64_MAX)
    step = _check_int("step", step, 0, INT64_MAX)
    global_batch = _check_int("global_batch", global_batch, 1, INT64_MAX)
    p = start + step * global_batch
    if p > INT64_MAX:
        raise PlanError(f"step {step} from position {start} overflows int64")
    return p


def steps_to_cover(start: int, end: int, global_batch: int) -> int:
    """Global steps from ``start`` needed to serve every position below ``end``:
    ``ceil((end - start) / global_batch)``, 0 if ``end <= start``.

    Every rank gets this same number of steps; the last global batch may run past
    ``end`` into the next epoch (nothing is dropped to even it out).
    """
    start = _check_int("start", start, 0, INT64_MAX)
    end = _check_int("end", end, 0, INT64_MAX)
    global_batch = _check_int("global_batch", global_batch, 1, INT64_MAX)
    return max(0, -((start - end) // global_batch))


def worker_steps(
    worker: int,
    num_workers: int,
    n_steps: int | None,
    batches_per_item: int = 1,
    *,
    ramp: bool = False,
) -> Iterator[list[int]]:
    """The local steps DataLoader worker ``worker`` of ``num_workers`` produces, item by item.

    Item ``g`` carries steps ``[g*k, (g+1)*k)`` (``k = batches_per_item``; the last item is
    shorter when ``n_steps`` is finite) and worker ``w`` produces items ``w, w+K, ...``, so
    the loader's round-robin over workers yields local steps ``0, 1, 2, ...`` in order.
    ``num_workers=0`` means the main process produces everything; ``n_steps=None`` is
    endless.

    With ``ramp``, round ``r`` of items (each worker's ``r``-th) carries ``min(k, 2**r)``
    steps instead of ``k``: the first item of every worker is a single batch, so the
    first batch reaches the trainer as soon as one batch is received, and items grow to
    ``k`` within a few rounds. The order is the same; only the item boundaries move.
    """
    num_workers = _check_int("num_workers", num_workers, 0, INT64_MAX)
    n_workers = max(1, num_workers)
    worker = _check_int("worker", worker, 0, INT64_MAX)
    if worker >= n_workers:
        raise PlanError(
            f"worker {worker} is out of range for num_workers {num_workers}; "
            f"workers are 0..{n_workers - 1}"
        )
    if n_steps is not None:
        n_steps = _check_int("n_steps", n_steps, 0, INT64_MAX)
    k = _check_int("batches_per_item", batches_per_item, 1, INT64_MAX)
    return _worker_steps(worker, n_workers, n_steps, k, 1 if ramp else k)


def _worker_steps(
    w: int, n_workers: int, n_steps: int | None, k: int, size: int
) -> Iterator[list[int]]:
    round_start = 0  # first step of the current round of items (one item per worker)
    while True:
        first = round_start + w * size
        if n_steps is not None and first >= n_steps:
            return
        last = first + size if n_steps is None else min(first + size, n_steps)
        yield list(range(first, last))
        round_start += n_workers * size
        size = min(k, 2 * size)
