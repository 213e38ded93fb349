"""manifest.json: the fingerprint covers the content, not the build time."""

from __future__ import annotations

from pathlib import Path

from shard_data import BYTE, random_docs
from tokenfeed_server.store import Manifest, write_dataset


def test_fingerprint_is_content_only(tmp_path: Path) -> None:
    a = write_dataset(tmp_path, "a", random_docs(5), tokenizer=BYTE, shuffle_seed=0)
    b = write_dataset(tmp_path, "b", random_docs(5), tokenizer=BYTE, shuffle_seed=0)
    c = write_dataset(tmp_path, "c", random_docs(5), tokenizer=BYTE, shuffle_seed=1)
    assert Manifest.from_json(a.to_json()) == a
    assert a.fingerprint != b.fingerprint  # the name is part of the content
    assert Manifest.from_json(a.to_json().replace(a.created, "2000-01-01")).fingerprint == (
        a.fingerprint
    )
    assert c.fingerprint != a.fingerprint
