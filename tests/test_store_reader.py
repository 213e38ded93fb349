"""The reader: round trip, reads across shards, validation at open, names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shard_data import BYTE, random_docs, stream
from tokenfeed.errors import (
    CorruptShard,
    DatasetNotFound,
    InvalidDatasetName,
    ManifestError,
    StoreError,
)
from tokenfeed_server.store import (
    TokenizerInfo,
    list_datasets,
    open_dataset,
    validate_dataset_name,
    write_dataset,
)
from tokenfeed_server.store.format import HEADER_SIZE


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.mark.parametrize("shard_tokens", [1, 7, 100, 1 << 20])
def test_round_trip_across_shard_boundaries(store: Path, shard_tokens: int) -> None:
    docs = random_docs(60)
    m = write_dataset(store, "d", docs, tokenizer=BYTE, shuffle_seed=3, shard_tokens=shard_tokens)
    ref = stream(docs, 256)
    with open_dataset(store, "d", verify_checksums=True) as ds:
        assert ds.dtype == np.dtype("<u2")
        assert (ds.n_tokens, ds.n_documents) == (len(ref), 60)
        assert m.total_tokens == len(ref)
        assert all(s.tokens == shard_tokens for s in m.shards[:-1])
        np.testing.assert_array_equal(ds.read(0, ds.n_tokens), ref)
        for a, b in [(0, 0), (5, 6), (3, 250), (len(ref) - 9, len(ref))]:
            np.testing.assert_array_equal(ds.read(a, b), ref[a:b])
        starts = np.random.default_rng(1).integers(0, len(ref) - 17, size=200)
        rows = ds.gather(starts, 17)
        assert rows.shape == (200, 17) and rows.dtype == ds.dtype
        for i, s in enumerate(starts):
            np.testing.assert_array_equal(rows[i], ref[s : s + 17])
        doc_starts = np.concatenate([[0], np.cumsum([len(d) + 1 for d in docs])[:-1]])
        np.testing.assert_array_equal(ds.document_starts(0, ds.n_tokens), doc_starts)
        sel = doc_starts[(doc_starts >= 50) & (doc_starts < 300)]
        np.testing.assert_array_equal(ds.document_starts(50, 300), sel)


def test_gather_into_out_and_bounds(store: Path) -> None:
    write_dataset(store, "d", random_docs(30), tokenizer=BYTE, shuffle_seed=0, shard_tokens=50)
    ds = open_dataset(store, "d")
    out = np.zeros((3, 10), dtype=ds.dtype)
    assert ds.gather(np.array([0, 45, ds.n_tokens - 10]), 10, out=out) is out
    np.testing.assert_array_equal(out[1], ds.read(45, 55))
    with pytest.raises(IndexError, match="outside dataset"):
        ds.gather(np.array([ds.n_tokens - 9]), 10)
    with pytest.raises(IndexError):
        ds.gather(np.array([-1]), 10)
    with pytest.raises(ValueError, match="shape"):
        ds.gather(np.array([0]), 10, out=np.zeros((2, 10), dtype=ds.dtype))
    with pytest.raises(IndexError):
        ds.read(0, ds.n_tokens + 1)
    assert ds.gather(np.array([], dtype=np.int64), 10).shape == (0, 10)


def scattered_rows(n: int, length: int, dtype: np.dtype, rng: np.random.Generator):
    """A sentinel-filled buffer of ``2 * n`` rows and ``n`` of its rows picked at random,
    as 1-tuples of views (a mixture's rows of one source among another's)."""
    big = np.full((2 * n, length), 0xABCD & ((1 << (8 * dtype.itemsize)) - 1), dtype=dtype)
    picked = np.sort(rng.choice(2 * n, size=n, replace=False))
    views = [(memoryview(big[i]),) for i in picked.tolist()]
    return big, picked, views


@pytest.mark.parametrize("shard_tokens", [7, 100, 1 << 20])
def test_gather_rows_writes_every_row_only_through_its_view(store: Path, shard_tokens: int) -> None:
    docs = random_docs(60)
    write_dataset(store, "d", docs, tokenizer=BYTE, shuffle_seed=3, shard_tokens=shard_tokens)
    ref = stream(docs, 256)
    rng = np.random.default_rng(5)
    with open_dataset(store, "d") as ds:
        length = 17
        starts = rng.integers(0, len(ref) - length, size=150)
        big, picked, views = scattered_rows(len(starts), length, ds.dtype, rng)
        sentinel = big[0, 0].copy()
        ds.gather_rows(starts, length, views)
        for i, s in zip(picked.tolist(), starts.tolist(), strict=True):
            np.testing.assert_array_equal(big[i], ref[s : s + length])
        others = np.setdiff1d(np.arange(len(big)), picked)
        assert (big[others] == sentinel).all()  # nothing written anywhere else
        with pytest.raises(ValueError, match="rows has 2 rows"):
            ds.gather_rows(starts[:3], length, views[:2])
        with pytest.raises(ValueError, match="bytes"):
            ds.gather_rows(starts[:2], length + 1, views[:2])
        with pytest.raises(IndexError, match="outside dataset"):
            ds.gather_rows([len(ref)], length, views[:1])


def test_gather_rows_after_a_failed_fast_read_still_fills_only_the_views(store: Path) -> None:
    """The slow path (a read failed, then row by row) writes through the views too."""
    docs = random_docs(40)
    write_dataset(store, "d", docs, tokenizer=BYTE, shuffle_seed=0, shard_tokens=100)
    ref = stream(docs, 256)
    with open_dataset(store, "d") as ds:
        last = ds.manifest.shards[-1]
        os.truncate(store / "d" / last.name, HEADER_SIZE + 10)
        starts = np.array([0, 3, 250, 7])
        big, picked, views = scattered_rows(len(starts), 6, ds.dtype, np.random.default_rng(1))
        ds.gather_rows(starts, 6, views)  # no row in the truncated shard: all read
        for i, s in zip(picked.tolist(), starts.tolist(), strict=True):
            np.testing.assert_array_equal(big[i], ref[s : s + 6])
        bad = np.array([0, ds.n_tokens - 6])
        with pytest.raises(CorruptShard, match=last.name):
            ds.gather_rows(bad, 6, views[:2])


@pytest.mark.parametrize("shard_tokens", [100, 1 << 20])
def test_gather_from_a_shard_truncated_while_open(store: Path, shard_tokens: int) -> None:
    docs = random_docs(40)
    write_dataset(store, "d", docs, tokenizer=BYTE, shuffle_seed=0, shard_tokens=shard_tokens)
    ref = stream(docs, 256)
    with open_dataset(store, "d") as ds:
        last = ds.manifest.shards[-1]
        last_start = ds.n_tokens - last.tokens
        os.truncate(store / "d" / last.name, HEADER_SIZE + 10)  # 5 tokens left
        # A short read anywhere among many rows (the fast path counts bytes) names the
        # dataset and the file, whichever row it is.
        starts = np.array([0, 3, last_start, ds.n_tokens - 6, 7])
        with pytest.raises(CorruptShard, match=rf"dataset 'd'.*{last.name}.*read \d+ of 12"):
            ds.gather(starts, 6)
        # What is still there reads as before.
        rows = ds.gather(np.array([0, last_start]), 5)
        np.testing.assert_array_equal(rows, [ref[:5], ref[last_start : last_start + 5]])


def test_uint32_for_large_vocab(store: Path) -> None:
    info = TokenizerInfo(kind="big", vocab_size=100_000, eos_id=99_999)
    docs = random_docs(10, vocab=99_999)
    write_dataset(store, "big", docs, tokenizer=info, shuffle_seed=0)
    ds = open_dataset(store, "big", verify_checksums=True)
    assert ds.dtype == np.dtype("<u4")
    np.testing.assert_array_equal(ds.read(0, ds.n_tokens), stream(docs, 99_999))


@pytest.mark.parametrize(
    "name", ["", ".", "..", "../x", "a/b", ".hidden", "-x", "a..b", "x" * 129, "a b", "é"]
)
def test_invalid_dataset_names(store: Path, name: str) -> None:
    with pytest.raises(InvalidDatasetName):
        validate_dataset_name(name)
    with pytest.raises(InvalidDatasetName):
        open_dataset(store, name)
    with pytest.raises(InvalidDatasetName):
        write_dataset(store, name, random_docs(1), tokenizer=BYTE, shuffle_seed=0)


def test_valid_names() -> None:
    for name in ["a", "A-1.b_c", "x" * 128, "9"]:
        assert validate_dataset_name(name) == name


def test_missing_dataset(store: Path) -> None:
    write_dataset(store, "there", random_docs(2), tokenizer=BYTE, shuffle_seed=0)
    with pytest.raises(DatasetNotFound, match="there"):
        open_dataset(store, "nope")


# ---------------------------------------------------------------- corruption at open


@pytest.fixture
def two_shards(store: Path) -> Path:
    write_dataset(store, "d", random_docs(40), tokenizer=BYTE, shuffle_seed=0, shard_tokens=400)
    return store / "d"


def _shard(path: Path, i: int = 1) -> Path:
    return path / f"shard-{i:06d}.bin"


def test_truncated_shard(store: Path, two_shards: Path) -> None:
    shard = _shard(two_shards)
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(CorruptShard, match=r"shard-000001\.bin.*truncated.*--overwrite"):
        open_dataset(store, "d")


def test_trailing_bytes(store: Path, two_shards: Path) -> None:
    with _shard(two_shards).open("ab") as f:
        f.write(b"x")
    with pytest.raises(CorruptShard, match="trailing"):
        open_dataset(store, "d")


def test_short_header(store: Path, two_shards: Path) -> None:
    _shard(two_shards).write_bytes(b"TKF")
    with pytest.raises(CorruptShard, match="truncated header"):
        open_dataset(store, "d")


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [(0, b"XXXXXXXX", "magic"), (8, b"\x09", "version"), (12, b"\x02", "dtype"),
     (16, b"\x01", "tokens"), (24, b"\x63", "documents")],
)  # fmt: skip
def test_bad_header_fields(
    store: Path, two_shards: Path, offset: int, value: bytes, message: str
) -> None:
    shard = _shard(two_shards)
    data = bytearray(shard.read_bytes())
    data[offset : offset + len(value)] = value
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptShard, match=rf"shard-000001\.bin.*{message}"):
        open_dataset(store, "d")


def test_flipped_token_fails_checksum_only(store: Path, two_shards: Path) -> None:
    shard = _shard(two_shards)
    data = bytearray(shard.read_bytes())
    data[HEADER_SIZE + 10] ^= 0xFF
    shard.write_bytes(bytes(data))
    open_dataset(store, "d").close()  # sizes and header are fine
    with pytest.raises(CorruptShard, match=r"shard-000001\.bin.*checksum"):
        open_dataset(store, "d", verify_checksums=True)


def test_missing_shard(store: Path, two_shards: Path) -> None:
    _shard(two_shards, 0).unlink()
    with pytest.raises(CorruptShard, match="missing"):
        open_dataset(store, "d")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m: "{not json",
        lambda m: "[]",
        lambda m: json.dumps({**m, "format_version": 99}),
        lambda m: json.dumps({**m, "dtype": "float32"}),
        lambda m: json.dumps({**m, "total_tokens": m["total_tokens"] + 1}),
        lambda m: json.dumps({**m, "shards": []}),
        lambda m: json.dumps({k: v for k, v in m.items() if k != "tokenizer"}),
        lambda m: json.dumps({**m, "shards": [{**m["shards"][0], "name": "../x"}]}),
    ],
)
def test_bad_manifest(store: Path, two_shards: Path, mutate: object) -> None:
    path = two_shards / "manifest.json"
    original = json.loads(path.read_text())
    path.write_text(mutate(original))  # type: ignore[operator]
    with pytest.raises(ManifestError, match=r"manifest\.json"):
        open_dataset(store, "d")


def test_missing_manifest_is_not_listed(store: Path, two_shards: Path) -> None:
    (two_shards / "manifest.json").unlink()
    assert list_datasets(store) == []
    with pytest.raises(ManifestError, match="manifest"):
        open_dataset(store, "d")


def test_open_sees_one_build_when_overwritten_between_manifest_and_shards(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory swap (what ``prepare --overwrite`` does) landing after the manifest was
    read but before the shards are opened must not pair the old manifest with new shards."""
    from tokenfeed_server.store.local import LocalDataset as Dataset

    docs = random_docs(80)
    write_dataset(store, "d", docs, tokenizer=BYTE, shuffle_seed=1, shard_tokens=100)
    rebuilt = [(d + 1) % 256 for d in docs]  # same sizes, other tokens
    write_dataset(store, "next", rebuilt, tokenizer=BYTE, shuffle_seed=2, shard_tokens=100)
    with open_dataset(store, "d") as old, open_dataset(store, "next") as new:
        old_tokens, new_tokens = old.read(0, old.n_tokens), new.read(0, new.n_tokens)
        old_fp = old.fingerprint
    assert old_tokens.shape == new_tokens.shape and not np.array_equal(old_tokens, new_tokens)

    attach = Dataset._attach

    def swap_then_attach(self: Dataset, *args: int) -> None:
        os.rename(store / "d", store / "old")
        os.rename(store / "next", store / "d")
        attach(self, *args)

    monkeypatch.setattr(Dataset, "_attach", swap_then_attach)
    with open_dataset(store, "d") as ds:
        assert ds.fingerprint == old_fp
        np.testing.assert_array_equal(ds.read(0, ds.n_tokens), old_tokens)
        ds.verify_checksums()


def test_running_out_of_descriptors_says_ulimit_not_damaged(store: Path) -> None:
    """Shard files are opened on demand into a bounded set: a dataset of more shards than
    the process may open is read whole; a bound set above the process limit fails with
    an error naming the setting and the limit, not calling a sound dataset damaged."""
    write_dataset(store, "many", random_docs(80), tokenizer=BYTE, shuffle_seed=0, shard_tokens=20)
    script = (
        "import resource, sys\n"
        "import numpy as np\n"
        "from tokenfeed.errors import CorruptShard, StoreError\n"
        "from tokenfeed_server.store import open_dataset\n"
        "from tokenfeed_server.store.handles import HANDLES\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))\n"
        "HANDLES.configure(0)\n"
        f"ds = open_dataset({str(store)!r}, 'many')\n"
        "ds.read(0, ds.n_tokens); ds.verify_checksums()\n"
        "print('read', len(ds.manifest.shards), HANDLES.stats()['open'], HANDLES.limit)\n"
        "HANDLES.configure(64)\n"
        "try:\n"
        "    ds.gather(ds.bounds[:-1], 1)\n"
        "except CorruptShard as exc:\n"
        "    print('damaged:', exc)\n"
        "except StoreError as exc:\n"
        "    print('limit:', exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    read, limit = out.splitlines()
    _, shards, held, bound = read.split()
    assert int(shards) > 48 and int(held) <= int(bound) == 16, out
    assert limit.startswith("limit:") and "ulimit -n" in limit and "--max-open-shards" in limit


def test_symbolic_links_out_of_the_store_are_refused(tmp_path: Path) -> None:
    elsewhere, store = tmp_path / "elsewhere", tmp_path / "store"
    write_dataset(elsewhere, "secret", random_docs(10), tokenizer=BYTE, shuffle_seed=0)
    write_dataset(store, "d", random_docs(10), tokenizer=BYTE, shuffle_seed=0)
    # a dataset directory linking out of the store (a host directory, anyone's data)
    (store / "escape").symlink_to(elsewhere / "secret", target_is_directory=True)
    with pytest.raises(StoreError, match=r"symbolic link out of the store .*refused"):
        open_dataset(store, "escape")
    # a link that stays inside the store is fine
    (store / "alias").symlink_to(store / "d", target_is_directory=True)
    open_dataset(store, "alias").close()
    # a shard that is a link (prepare never writes one) is refused, whatever it names
    shard = next(p for p in (store / "d").iterdir() if p.name.startswith("shard-"))
    shard.rename(tmp_path / "moved.bin")
    shard.symlink_to(tmp_path / "moved.bin")
    with pytest.raises(CorruptShard, match="symbolic link, which is refused"):
        open_dataset(store, "d")
