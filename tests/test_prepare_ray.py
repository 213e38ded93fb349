"""prepare --engine ray on a real local Ray cluster (2 CPUs): the same bytes as local."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zstandard

from tokenfeed.errors import BadRecord, PrepareError
from tokenfeed_server.prepare import PrepareConfig, PrepareStats, prepare
from tokenfeed_server.store import list_datasets, open_dataset
from waiting import wait_until

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'tokenfeed-server[ray]'")

# Ray's own modules warn about Ray's own deprecated settings; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")

CLI = [sys.executable, "-m", "tokenfeed_server.cli"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray cluster of 2 CPUs for this module; yields its address."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "δέλτα", "naïve", "日本語", "emoji😀", "def f(x):", "\n", "the"]
    return [" ".join(rng.choice(words, size=int(rng.integers(1, 40)))) + f" #{i}" for i in range(n)]


def _corpus(root: Path, texts: list[str], *, bad: bool = True) -> Path:
    """Several files in several forms (jsonl, gz, zst, txt in a subdirectory), bad lines."""
    parts = np.array_split(np.arange(len(texts)), 4)
    (root / "txt").mkdir(parents=True)
    for i in parts[0]:
        (root / "txt" / f"doc{i:03d}.txt").write_text(texts[i], encoding="utf-8")
    lines = [[json.dumps({"text": texts[i]}) for i in part] for part in parts[1:]]
    if bad:
        lines[0].insert(3, "{not json")
        lines[2].insert(5, json.dumps({"body": "no text field"}))
        lines[2].insert(9, json.dumps({"text": "lone \udc80"}))
    (root / "a.jsonl").write_text("\n".join(lines[0]) + "\n\n", encoding="utf-8")
    with gzip.open(root / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(lines[1]) + "\n")
    data = ("\n".join(lines[2]) + "\n").encode()
    (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    (root / "txt" / "empty.txt").write_text("")
    return root


def _config(inputs: Path, store: Path, engine: str, **kw: object) -> PrepareConfig:
    base: dict[str, object] = {"dataset": "d", "progress": False, "shard_tokens": 700}
    base.update(kw)
    return PrepareConfig(inputs=(inputs,), store=store, engine=engine, **base)  # type: ignore[arg-type]


def _stream(store: Path) -> tuple[np.ndarray, np.ndarray, str]:
    ds = open_dataset(store, "d", verify_checksums=True)
    return ds.read(0, ds.n_tokens), ds.document_starts(0, ds.n_tokens), ds.fingerprint


@pytest.mark.parametrize("tokenizer", ["byte", "bpe:300"])
def test_ray_and_local_engines_give_the_same_bytes(
    cluster: str, tmp_path: Path, tokenizer: str
) -> None:
    corpus = _corpus(tmp_path / "corpus", _texts(160, seed=1))
    results = {}
    for engine in ("local", "ray"):
        stats = PrepareStats()
        config = _config(corpus, tmp_path / engine, engine, skip_bad=True, tokenizer=tokenizer)
        manifest = prepare(config, stats)
        results[engine] = (manifest, stats, _stream(tmp_path / engine))
    (m_local, s_local, (t_local, d_local, f_local)) = results["local"]
    (m_ray, s_ray, (t_ray, d_ray, f_ray)) = results["ray"]
    assert len(m_local.shards) > 2  # shards cut at the same global offsets
    assert np.array_equal(t_local, t_ray) and np.array_equal(d_local, d_ray)
    assert f_local == f_ray and m_local.shards == m_ray.shards
    assert s_local.corpus == s_ray.corpus and s_local.tokens == s_ray.tokens
    assert s_ray.corpus.bad_records == 3 and s_ray.corpus.empty_documents == 1
    assert m_ray.documents == 160
    if tokenizer != "byte":  # the driver's trained tokenizer went with the dataset
        assert (tmp_path / "ray" / "d" / "tokenizer.json").read_bytes() == (
            tmp_path / "local" / "d" / "tokenizer.json"
        ).read_bytes()
    assert sorted(p.name for p in (tmp_path / "ray").iterdir()) == ["d"]


def test_bad_records_give_the_local_engines_error(cluster: str, tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "corpus", _texts(40, seed=2))
    messages = []
    for engine in ("local", "ray"):
        with pytest.raises(BadRecord) as info:
            prepare(_config(corpus, tmp_path / engine, engine))
        messages.append(str(info.value))
        assert list_datasets(tmp_path / engine) == []
    # The first bad record in input order, named as the user gave the path.
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"{corpus / 'a.jsonl'}:4: not valid JSON")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "x.txt").write_text("")
    with pytest.raises(PrepareError, match=r"empty corpus: .* 1 input file\(s\) .* 1 empty"):
        prepare(_config(empty, tmp_path / "e", "ray"))


def _pids_reading(path: Path) -> set[int]:
    """The processes (other than this one) with ``path`` open."""
    found = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        pid = int(fd_dir.parent.name)
        if pid == os.getpid():
            continue
        try:
            if any(os.readlink(fd) == str(path) for fd in fd_dir.iterdir()):
                found.add(pid)
        except OSError:  # gone, or not ours
            continue
    return found


def _wait_for_reader(path: Path, exclude: set[int], proc: subprocess.Popen[str]) -> int:
    def reader() -> int | None:  # polling /proc for the worker that opened the file
        assert proc.poll() is None, proc.communicate()[1]
        readers = _pids_reading(path) - exclude
        return readers.pop() if readers else None

    return wait_until(reader, 90, f"process that opened {path}")


@pytest.mark.skipif(sys.platform != "linux", reason="finds the worker through /proc")
def test_worker_killed_mid_run_gives_the_same_bytes(cluster: str, tmp_path: Path) -> None:
    texts = _texts(80, seed=3)
    corpus = _corpus(tmp_path / "corpus", texts, bad=False)
    # The reference: the same files under another root, the last one a plain file.
    reference = tmp_path / "reference"
    shutil.copytree(corpus, reference)
    last = "zz.jsonl"
    tail = "".join(json.dumps({"text": t}) + "\n" for t in _texts(30, seed=4))
    (reference / last).write_text(tail, encoding="utf-8")
    prepare(_config(reference, tmp_path / "local", "local"))
    # In the corpus the last file is a FIFO: the worker reading it blocks until we write,
    # so it is certainly mid-task when it is killed. Holding it open read-write keeps a
    # writer, so the reader's open() returns and its read() waits.
    fifo = corpus / last
    os.mkfifo(fifo)
    holder = os.open(fifo, os.O_RDWR)
    args = ["prepare", corpus, "--store", tmp_path / "ray", "--dataset", "d", "--engine",
            "ray", "--ray-address", cluster, "--shard-tokens", "700", "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(
        [*CLI, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        first = _wait_for_reader(fifo, set(), proc)
        os.kill(first, signal.SIGKILL)
        _wait_for_reader(fifo, {first}, proc)  # Ray ran the task again, in a new worker
        os.write(holder, tail.encode())
        os.close(holder)
        holder = -1
        out, err = proc.communicate(timeout=180)
    finally:
        if holder >= 0:
            os.close(holder)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "110 documents" in out
    assert _stream(tmp_path / "ray")[2] == _stream(tmp_path / "local")[2]
    local, ray_ = _stream(tmp_path / "local"), _stream(tmp_path / "ray")
    assert np.array_equal(local[0], ray_[0]) and np.array_equal(local[1], ray_[1])
