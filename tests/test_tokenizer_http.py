"""The dataset's tokenizer over HTTP: ``GET /v1/datasets/{name}/tokenizer.json`` and
``tokenfeed.fetch_tokenizer``, against real servers over a real store.

A BPE dataset round-trips (its tokens, read from the store, decode with the fetched
tokenizer to the corpus it was prepared from); a byte dataset answers a 404 that says how
to decode it; a tenant cannot tell a dataset it may not read from a missing one.
"""

from __future__ import annotations

import collections
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import tokenfeed
from live_server import LiveServer, tenants_toml
from shard_data import BYTE
from tokenfeed.errors import (
    AuthenticationFailed,
    ConfigError,
    ServerUnavailable,
    TokenFeedError,
    UnknownDataset,
)
from tokenfeed.tokenizer import NoTokenizerFile, decode_bytes, fetch_tokenizer_json
from tokenfeed_server.prepare import PrepareConfig, prepare
from tokenfeed_server.store import open_dataset, write_dataset

pytestmark = pytest.mark.network

ALICE = "alice-tokenizer-token-0123456789"
BOB = "bob-tokenizer-token-9876543210ab"
ADMIN = "admin-tokenizer-token-abcdefghij"


def corpus(n: int) -> list[str]:
    rng = np.random.default_rng(7)
    words = ["token", "feed", "data", "server", "naïve", "δέλτα", "日本語", "return x", "\n"]
    return [" ".join(rng.choice(words, size=int(rng.integers(2, 40)))) + f" #{i}" for i in range(n)]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``bpe-text`` (prepared with bpe:300 from :func:`corpus`) and ``bytes-text``."""
    root = tmp_path_factory.mktemp("store")
    source = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(200)))
    prepare(
        PrepareConfig(
            inputs=(source,), store=root, dataset="bpe-text", tokenizer="bpe:300", progress=False
        )
    )
    docs = [np.frombuffer(t.encode(), dtype=np.uint8).astype(np.uint16) for t in corpus(20)]
    write_dataset(root, "bytes-text", docs, tokenizer=BYTE, shuffle_seed=0)
    return root


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[LiveServer]:
    with LiveServer(store) as srv:
        yield srv


@pytest.fixture(scope="module")
def tenants(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = tmp_path_factory.mktemp("conf") / "tenants.toml"
    path.write_text(tenants_toml(ADMIN, {"alice": (ALICE, ["bpe-*"]), "bob": (BOB, ["bytes-*"])}))
    with LiveServer(store, extra=["--tenants", str(path)]) as srv:
        yield srv


def documents(store: Path, name: str) -> list[np.ndarray]:
    """The dataset's documents as stored (the stream split after each EOS)."""
    with open_dataset(store, name) as ds:
        stream = ds.read(0, ds.n_tokens)
        eos = ds.manifest.tokenizer.eos_id
    cuts = np.flatnonzero(stream == eos) + 1
    return [d[:-1] for d in np.split(stream, cuts) if len(d)]


def test_fetched_bpe_tokenizer_decodes_the_stored_tokens_to_the_corpus(
    server: LiveServer, store: Path
) -> None:
    tok = tokenfeed.fetch_tokenizer(server.http, "bpe-text")
    on_disk = (store / "bpe-text" / "tokenizer.json").read_text()
    assert fetch_tokenizer_json(server.http + "/", "bpe-text") == on_disk
    manifest = json.loads((store / "bpe-text" / "manifest.json").read_text())
    assert tok.get_vocab_size(with_added_tokens=True) == manifest["tokenizer"]["vocab_size"]
    decoded = [tok.decode(d.tolist()) for d in documents(store, "bpe-text")]
    assert collections.Counter(decoded) == collections.Counter(corpus(200))
    text = "a trainer decodes naïve δέλτα"
    assert tok.decode(tok.encode(text).ids) == text


def test_answer_is_the_file_with_its_digest(server: LiveServer, store: Path) -> None:
    answer = server.get("/v1/datasets/bpe-text/tokenizer.json")
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    assert answer.content == (store / "bpe-text" / "tokenizer.json").read_bytes()
    manifest = json.loads((store / "bpe-text" / "manifest.json").read_text())
    assert answer.headers["etag"] == f'"{manifest["tokenizer"]["file_hash"]}"'
    fingerprint = server.get("/v1/datasets/bpe-text").json()["fingerprint"]
    assert answer.headers["x-tokenfeed-fingerprint"] == fingerprint


def test_byte_dataset_says_how_to_decode(server: LiveServer, store: Path) -> None:
    answer = server.get("/v1/datasets/bytes-text/tokenizer.json")
    assert answer.status_code == 404
    detail = answer.json()["detail"]
    assert "no tokenizer file" in detail and "byte-tokenized" in detail
    assert "0-255" in detail and "id 256" in detail and "/v1/datasets/bytes-text" in detail
    with pytest.raises(NoTokenizerFile, match="byte-tokenized"):
        tokenfeed.fetch_tokenizer(server.http, "bytes-text")
    # The documented way decodes the stored ids to the text.
    decoded = [decode_bytes(d) for d in documents(store, "bytes-text")]
    assert collections.Counter(decoded) == collections.Counter(corpus(20))
    assert decode_bytes([104, 105, 256]) == "hi"


def test_missing_and_invalid_names(server: LiveServer) -> None:
    with pytest.raises(UnknownDataset, match="no-such"):
        fetch_tokenizer_json(server.http, "no-such")
    with pytest.raises(ConfigError):
        fetch_tokenizer_json(server.http, ".hidden")
    assert server.get("/v1/datasets/..%2Fetc/tokenizer.json").status_code in (400, 404)


def test_tenancy(tenants: LiveServer) -> None:
    assert fetch_tokenizer_json(tenants.http, "bpe-text", ALICE)
    assert fetch_tokenizer_json(tenants.http, "bpe-text", ADMIN)
    # Bob may not read bpe-text: the same answer as for a dataset that does not exist.
    forbidden = tenants.get("/v1/datasets/bpe-text/tokenizer.json", headers=bearer(BOB))
    missing = tenants.get("/v1/datasets/bpe-none/tokenizer.json", headers=bearer(BOB))
    assert forbidden.status_code == missing.status_code == 404
    assert forbidden.json()["detail"].replace("bpe-text", "X") == missing.json()["detail"].replace(
        "bpe-none", "X"
    )
    with pytest.raises(UnknownDataset):
        fetch_tokenizer_json(tenants.http, "bpe-text", BOB)
    with pytest.raises(AuthenticationFailed, match="wants a token"):
        fetch_tokenizer_json(tenants.http, "bpe-text")
    with pytest.raises(AuthenticationFailed, match="refused"):
        fetch_tokenizer_json(tenants.http, "bpe-text", "not-a-token")


def test_unreachable_server_and_bad_url() -> None:
    with pytest.raises(ServerUnavailable, match="cannot reach"):
        fetch_tokenizer_json("http://127.0.0.1:9", "bpe-text")
    with pytest.raises(ConfigError, match="http"):
        fetch_tokenizer_json("tcp://127.0.0.1:7400", "bpe-text")


def test_without_tokenizers_installed_the_error_says_what_to_do(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # what a missing package looks like
    with pytest.raises(TokenFeedError, match="pip install tokenizers"):
        tokenfeed.fetch_tokenizer(server.http, "bpe-text")


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_manifest_naming_a_file_outside_the_dataset_serves_nothing(tmp_path: Path) -> None:
    """A hand-edited manifest whose tokenizer file escapes the dataset directory (and has
    no hash to check it against) leaves the dataset broken; nothing outside is served and
    the listing still answers every caller."""
    root = tmp_path / "store"
    secret = tmp_path / "secret.json"
    secret.write_text('{"leaked": "7f3a"}')
    docs = [np.arange(10, dtype=np.uint16)]
    write_dataset(root, "escape", docs, tokenizer=BYTE, shuffle_seed=0)
    write_dataset(root, "fine", docs, tokenizer=BYTE, shuffle_seed=0)
    manifest_path = root / "escape" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["tokenizer"].update(file="../../secret.json", file_hash=None)
    manifest_path.write_text(json.dumps(manifest))
    with LiveServer(root) as srv:
        answer = srv.get("/v1/datasets/escape/tokenizer.json")
        assert answer.status_code != 200 and b"7f3a" not in answer.content
        listing = srv.get("/v1/datasets")
        assert listing.status_code == 200
        by_name = {d["name"]: d for d in listing.json()}
        assert by_name["fine"]["ok"] is True and by_name["escape"]["ok"] is False
        assert "tokenizer.file" in by_name["escape"]["error"]
