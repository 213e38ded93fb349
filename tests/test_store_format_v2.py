"""Format version 2: piece checksums written while writing, v1 manifests still read.

The piece digests are recomputed here from the bytes of the files on disk (not with the
writer's code path), and a v1 manifest's fingerprint from its JSON by the formula of
version 1, so a change in either breaks these tests.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfeed.errors import ManifestError
from tokenfeed_server.store import open_dataset
from tokenfeed_server.store.format import (
    HEADER_SIZE,
    MANIFEST_NAME,
    piece_count,
    shard_content_id,
)
from tokenfeed_server.store.manifest import Manifest, TokenizerInfo
from tokenfeed_server.store.shard_file import PieceHasher
from tokenfeed_server.store.writer import write_dataset as _write_dataset

# this file pins version 2 (still written on request); version 3: test_store_format_v3.py
write_dataset = functools.partial(_write_dataset, format_version=2)

BYTE = TokenizerInfo("byte", 256, 255)


def _digests(data: bytes, piece: int) -> list[str]:
    return [
        hashlib.blake2b(data[i : i + piece], digest_size=16).hexdigest()
        for i in range(0, len(data), piece)
    ]


def _docs(seed: int, n: int, max_len: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, int(rng.integers(0, max_len))) for _ in range(n)]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n_docs=st.integers(1, 60),
    max_len=st.integers(1, 5000),
    shard_tokens=st.integers(1, 40_000),
    piece=st.sampled_from([4096, 4096 + 8, 5000, 8192, 1 << 20]),
)
def test_pieces_match_the_file_bytes(
    tmp_path_factory: pytest.TempPathFactory,
    seed: int,
    n_docs: int,
    max_len: int,
    shard_tokens: int,
    piece: int,
) -> None:
    store = tmp_path_factory.mktemp("s")
    m = write_dataset(
        store,
        "d",
        _docs(seed, n_docs, max_len),
        tokenizer=BYTE,
        shuffle_seed=0,
        shard_tokens=shard_tokens,
        piece_bytes=piece,
    )
    assert m.format_version == 2 and m.piece_bytes == piece
    for shard in m.shards:
        data = (store / "d" / shard.name).read_bytes()
        assert len(data) == shard.file_size(m.itemsize)
        assert list(shard.pieces) == _digests(data, piece)
        assert len(shard.pieces) == piece_count(len(data), piece)
    reread = Manifest.from_json((store / "d" / MANIFEST_NAME).read_text())
    assert reread == m


@settings(max_examples=200, deadline=None)
@given(
    body=st.binary(min_size=0, max_size=3 * 4096 + 100),
    cuts=st.lists(st.integers(0, 3 * 4096 + 100), max_size=8),
    piece=st.sampled_from([4096, 4160, 5000]),
)
def test_piece_hasher_any_chunking(body: bytes, cuts: list[int], piece: int) -> None:
    # the body follows a 64-byte header that is only known at the end
    header = bytes(range(HEADER_SIZE))
    hasher = PieceHasher(piece)
    edges = sorted({0, len(body), *(c for c in cuts if c <= len(body))})
    for a, b in itertools.pairwise(edges):
        hasher.update(body[a:b])
    whole = header + body
    read = lambda size, offset: whole[offset : offset + size]  # noqa: E731
    assert hasher.finish(read).hex() == "".join(_digests(whole, piece))


def test_file_exactly_whole_pieces(tmp_path: Path) -> None:
    # one document of 4096*2 - 64 - 8 bytes (uint16) + EOS + index: exactly 2 pieces
    piece = 4096
    tokens = (2 * piece - HEADER_SIZE - 8) // 2 - 1  # -1: the writer appends the EOS
    m = write_dataset(
        tmp_path, "d", [np.zeros(tokens, dtype=np.uint16)], tokenizer=BYTE, shuffle_seed=0,
        piece_bytes=piece,
    )  # fmt: skip
    data = (tmp_path / "d" / m.shards[0].name).read_bytes()
    assert len(data) == 2 * piece
    assert list(m.shards[0].pieces) == _digests(data, piece)


def _as_v1(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    data["format_version"] = 1
    del data["piece_bytes"]
    for shard in data["shards"]:
        del shard["pieces"]
    path.write_text(json.dumps(data, indent=2) + "\n")
    return data


def test_v1_manifest_still_opens_with_its_v1_fingerprint(tmp_path: Path) -> None:
    docs = _docs(1, 40, 3000)
    write_dataset(tmp_path, "d", docs, tokenizer=BYTE, shuffle_seed=3, shard_tokens=9000)
    data = _as_v1(tmp_path / "d" / MANIFEST_NAME)
    content = {k: v for k, v in data.items() if k != "created"}
    blob = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    v1_fingerprint = hashlib.blake2b(blob, digest_size=16).hexdigest()
    with open_dataset(tmp_path, "d", verify_checksums=True) as ds:
        assert ds.manifest.format_version == 1
        assert ds.manifest.piece_bytes == 0 and all(not s.pieces for s in ds.manifest.shards)
        assert ds.fingerprint == v1_fingerprint
        eos = np.asarray([255])
        expected = np.concatenate([np.concatenate([d, eos]) for d in docs]).astype(np.uint16)
        assert np.array_equal(ds.read(0, ds.n_tokens), expected)
        # the JSON of a v1 manifest round-trips exactly: no v2 field appears
        assert json.loads(ds.manifest.to_json()) == data


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.update(format_version=4), "format version 4"),
        (lambda d: d.update(format_version=True), "format version True"),
        (lambda d: d.update(piece_bytes=64), "piece_bytes is 64"),
        (lambda d: d["shards"][0]["pieces"].pop(), "piece checksums"),
        (lambda d: d["shards"][0]["pieces"].__setitem__(0, "XY"), "hex digests"),
        (lambda d: d.pop("piece_bytes"), "piece_bytes"),
        (lambda d: d.update(format_version=1), "version-1 manifest has no piece"),
    ],
)
def test_bad_v2_manifests_are_refused(tmp_path: Path, edit: object, match: str) -> None:
    m = write_dataset(tmp_path, "d", _docs(2, 5, 100), tokenizer=BYTE, shuffle_seed=0)
    data = json.loads(m.to_json())
    edit(data)  # type: ignore[operator]
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(json.dumps(data))


def test_v2_fingerprint_is_the_token_stream_not_the_names(tmp_path: Path) -> None:
    docs = _docs(4, 30, 2000)
    a = write_dataset(tmp_path, "d", docs, tokenizer=BYTE, shuffle_seed=0, shard_tokens=7000)
    renamed = a.with_names([f"shard-{i}x.bin" for i in range(len(a.shards))], {})
    assert renamed.fingerprint == a.fingerprint
    b = write_dataset(
        tmp_path, "e", docs, tokenizer=BYTE, shuffle_seed=0, shard_tokens=7000, piece_bytes=8192
    )
    assert b.fingerprint != a.fingerprint  # the dataset's name is content
    assert b.with_names([s.name for s in b.shards], {}).fingerprint == b.fingerprint
    c = write_dataset(
        tmp_path, "f", [*docs[:-1], docs[-1] + 1], tokenizer=BYTE, shuffle_seed=0,
        shard_tokens=7000,
    )  # fmt: skip
    assert c.fingerprint != a.with_names([s.name for s in a.shards], {}).fingerprint


def test_content_ids_and_shared_names(tmp_path: Path) -> None:
    # two identical shards: one content id, and a v2 manifest may name that file twice
    doc = np.arange(100, dtype=np.uint16) % 200
    m = write_dataset(tmp_path, "d", [doc, doc], tokenizer=BYTE, shuffle_seed=0, shard_tokens=101)
    assert m.shards[0].pieces == m.shards[1].pieces
    ids = [shard_content_id(m.piece_bytes, s.pieces) for s in m.shards]
    assert ids[0] == ids[1]
    shared = m.with_names([f"shard-{i}.bin" for i in ids], {})
    assert Manifest.from_json(shared.to_json()) == shared
    other = write_dataset(tmp_path, "e", [doc + 1], tokenizer=BYTE, shuffle_seed=0)
    assert shard_content_id(other.piece_bytes, other.shards[0].pieces) != ids[0]
    # a name shared by two different shards is refused
    mixed = json.loads(m.to_json())
    mixed["shards"][1]["name"] = mixed["shards"][0]["name"]
    mixed["shards"][1]["checksum"] = "blake2b-128:" + "0" * 32
    with pytest.raises(ManifestError, match="twice"):
        Manifest.from_json(json.dumps(mixed))
