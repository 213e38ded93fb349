"""manifest.json: the fingerprint covers the content, not the build time."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shard_data import BYTE, random_docs
from tokenfeed.errors import ManifestError
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


def _with_tokenizer(m: Manifest, **fields: object) -> str:
    data = json.loads(m.to_json())
    data["tokenizer"].update(fields)
    return json.dumps(data)


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"kind": 5}, "tokenizer.kind"),
        ({"kind": ""}, "tokenizer.kind"),
        ({"vocab_size": 300.5}, "tokenizer.vocab_size"),
        ({"vocab_size": True}, "tokenizer.vocab_size"),
        ({"eos_id": 256.0}, "tokenizer.eos_id"),
        ({"eos_id": "256"}, "tokenizer.eos_id"),
        ({"file_hash": 7}, "tokenizer.file_hash"),
        ({"surprise": 1}, "unknown fields"),
        ({"eos_id": 300}, "eos_id 300 is outside"),
        ({"file": "../../../etc/passwd", "file_hash": None}, "not a plain file name"),
        ({"file": "/etc/passwd", "file_hash": "blake2b-128:00"}, "not a plain file name"),
        ({"file": "..", "file_hash": "blake2b-128:00"}, "not a plain file name"),
        ({"file": "other.json", "file_hash": "blake2b-128:00"}, "not among the dataset's files"),
    ],
)
def test_tokenizer_table_is_checked_field_by_field(
    tmp_path: Path, fields: dict[str, object], names: str
) -> None:
    m = write_dataset(tmp_path, "a", random_docs(5), tokenizer=BYTE, shuffle_seed=0)
    with pytest.raises(ManifestError, match=re.escape(names)):
        Manifest.from_json(_with_tokenizer(m, **fields))


def test_tokenizer_file_needs_its_hash_and_to_be_a_dataset_file(tmp_path: Path) -> None:
    extra = tmp_path / "tokenizer.json"
    extra.write_text("{}")
    m = write_dataset(
        tmp_path / "store",
        "a",
        random_docs(5),
        tokenizer=BYTE,
        shuffle_seed=0,
        extra_files={"tokenizer.json": extra},
    )
    ok = _with_tokenizer(m, file="tokenizer.json", file_hash="blake2b-128:00")
    assert Manifest.from_json(ok).tokenizer.file == "tokenizer.json"
    with pytest.raises(ManifestError, match="file_hash is not"):
        Manifest.from_json(_with_tokenizer(m, file="tokenizer.json", file_hash=None))


def test_manifest_nested_too_deep_is_a_manifest_error() -> None:
    with pytest.raises(ManifestError, match="nested too deeply"):
        Manifest.from_json("[" * 200_000 + "]" * 200_000)
