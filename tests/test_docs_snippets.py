"""Every fenced code block of the README and the docs site runs, or says why it does not.

Collected: the ```python, ```py, ```bash, ```sh, ```shell and ```console fences of
``README.md`` and ``docs/**/*.md`` (indented fences, inside list items, included). The
line just before a block (blank lines aside) may carry a marker:

- ``<!-- snippet: skip (why) -->``: not run; the reason is required (a Docker engine, S3
  credentials, a GPU, a server that runs until stopped, ...);
- ``<!-- snippet: file NAME -->``: not run itself; written to ``NAME`` in the page's
  directory for the blocks after it (a training script that a ``torchrun`` block runs).

Every other block runs, in the order of its page, against one live server that this
module starts (``tests/live_server.py``) over a store of four small byte-tokenized
datasets: ``demo`` (``prepare --demo``, as ``scripts/demo`` makes it), ``web``, ``code``
and ``math`` (generated text). Python blocks run with this interpreter, shell blocks with
``bash -e -o pipefail`` and this venv's ``bin`` first on PATH; each has a time limit
(:data:`BLOCK_TIMEOUT_S`). The blocks of one page share a fresh working directory.

Blocks are written for a reader, with the default addresses; before a block runs, these
placeholders are substituted (the docs say so in ``docs/development.md``):

==========================  ======================================================
in a block                  becomes
==========================  ======================================================
``tcp://127.0.0.1:7400``    the live server's data endpoint
``http://127.0.0.1:7401``   the live server's HTTP address (also ``TOKENFEED_URL``)
``/data/store``             ``store/`` in the page's directory: a fresh, empty store
==========================  ======================================================

and the page's directory holds ``demo-store`` (a link to the live server's store, the
directory ``scripts/demo`` prepares), the input directories ``corpus/``, ``web/``,
``code/``, ``math/`` (a few small text files each) and ``extra.jsonl.gz``.

The module prints ``docs snippets: N ran, M skipped (K written as files)`` and fails on a
block that fails, naming its file and line, with its output.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from live_server import LiveServer

ROOT = Path(__file__).resolve().parents[1]
LANGUAGES = {
    "python": "python",
    "py": "python",
    "bash": "shell",
    "sh": "shell",
    "shell": "shell",
    "console": "console",
}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\s`]*)")
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(?P<body>.*?)\s*-->\s*$")
SKIP = re.compile(r"^skip\s+\((?P<reason>.+)\)$")
FILE = re.compile(r"^file\s+(?P<name>[\w][\w.-]*)$")
BLOCK_TIMEOUT_S = 180
PLACEHOLDER_ZMQ = "tcp://127.0.0.1:7400"
PLACEHOLDER_HTTP = "http://127.0.0.1:7401"
PLACEHOLDER_STORE = "/data/store"


@dataclass(frozen=True)
class Block:
    path: Path  # relative to the repository root
    line: int  # 1-based line of the opening fence
    language: str  # python, shell or console
    code: str
    action: str  # run, skip or file
    note: str = ""  # the skip reason, or the file name

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def documents() -> list[Path]:
    """README.md and every page of the site, in a stable order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def parse(path: Path) -> tuple[list[Block], list[str]]:
    """The runnable-language blocks of one Markdown file, and the problems found."""
    rel = path.relative_to(ROOT)
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    pending: tuple[int, str] | None = None  # a marker waiting for its block
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = MARKER.match(line)
        if marker:
            if pending is not None:
                problems.append(f"{rel}:{pending[0]}: a snippet marker with no block after it")
            pending = (i + 1, marker.group("body"))
            i += 1
            continue
        fence = FENCE.match(line)
        if not fence:
            if line.strip() and pending is not None:
                problems.append(f"{rel}:{pending[0]}: a snippet marker with no block after it")
                pending = None
            i += 1
            continue
        indent, mark, info = fence.group("indent"), fence.group("fence"), fence.group("info")
        start = i
        body = []
        i += 1
        while i < len(lines):
            close = lines[i].strip()
            if close.startswith(mark) and set(close) <= {mark[0]} and len(close) >= len(mark):
                break
            body.append(lines[i])
            i += 1
        else:
            problems.append(f"{rel}:{start + 1}: a code fence that is never closed")
        i += 1
        language = LANGUAGES.get(info.lower())
        if language is None:
            if pending is not None:
                problems.append(f"{rel}:{pending[0]}: a snippet marker on a {info!r} block")
            pending = None
            continue
        code = textwrap.dedent(
            "\n".join(b[len(indent) :] if b.startswith(indent) else b for b in body)
        )
        action, note = "run", ""
        if pending is not None:
            body_text = pending[1]
            if skip := SKIP.match(body_text):
                action, note = "skip", skip.group("reason").strip()
            elif file := FILE.match(body_text):
                action, note = "file", file.group("name")
            else:
                problems.append(
                    f"{rel}:{pending[0]}: unknown snippet marker {body_text!r}: use "
                    "'skip (why)' or 'file NAME'"
                )
            pending = None
        blocks.append(Block(rel, start + 1, language, code + "\n", action, note))
    if pending is not None:
        problems.append(f"{rel}:{pending[0]}: a snippet marker with no block after it")
    return blocks, problems


def all_blocks() -> tuple[list[Block], list[str]]:
    blocks: list[Block] = []
    problems: list[str] = []
    for path in documents():
        found, wrong = parse(path)
        blocks += found
        problems += wrong
    return blocks, problems


def pages() -> list[Path]:
    """The documents that have at least one block (one test each)."""
    blocks, _ = all_blocks()
    return sorted({b.path for b in blocks}, key=str)


# ---------------------------------------------------------------------------- tallies

TALLY = {"ran": 0, "skipped": 0, "files": 0}


@pytest.fixture(scope="module", autouse=True)
def report_counts(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if TALLY["ran"] == 0 and TALLY["skipped"] == 0:
        return
    capture = request.config.pluginmanager.getplugin("capturemanager")
    message = (
        f"\ndocs snippets: {TALLY['ran']} ran, {TALLY['skipped']} skipped "
        f"({TALLY['files']} written as files for later blocks)\n"
    )
    if capture is not None:
        with capture.global_and_fixture_disabled():
            sys.stdout.write(message)
    else:
        sys.stdout.write(message)


# ---------------------------------------------------------------------------- no server needed


def test_every_block_runs_or_says_why_not() -> None:
    """Markers are well formed and sit just before a block; every skip gives a reason."""
    blocks, problems = all_blocks()
    assert not problems, "\n".join(problems)
    assert blocks, "no code blocks found in README.md and docs/"
    for block in blocks:
        if block.action == "skip":
            assert len(block.note) >= 10, f"{block.where}: say why the block is skipped"
    counted = {a: sum(1 for b in blocks if b.action == a) for a in ("run", "skip", "file")}
    print(
        f"docs snippets: {counted['run']} to run, {counted['skip']} marked skip, "
        f"{counted['file']} written as files"
    )


def test_the_readme_is_a_front_door() -> None:
    """At most about 200 lines, with a trainer snippet on its first screen."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move material into docs/"
    first_screen = "\n".join(lines[:40])
    assert "```python" in first_screen and "TokenFeedLoader" in first_screen
    assert "scripts/demo" in "\n".join(lines) and "scripts/test" in "\n".join(lines)


# ---------------------------------------------------------------------------- the live server

# the words of the generated corpora (a few dozen, so BPE training is quick)
WORDS_TEXT = """
the of and to a in is it that for on with as was by this be are from at or an
data token server train loss batch model epoch shard window order seed rank
def return import class self value list dict range print for while if else
sum prime proof lemma theorem integral matrix vector
"""
WORDS = WORDS_TEXT.split()


def write_text_corpus(directory: Path, seed: int, files: int = 4, words: int = 3000) -> None:
    """A few files of seeded pseudo-text (``.txt`` and ``.md``)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        paragraphs = []
        for _ in range(words // 60):
            paragraphs.append(" ".join(rng.choice(WORDS) for _ in range(60)) + ".")
        suffix = ".md" if f % 2 else ".txt"
        (directory / f"doc-{f}{suffix}").write_text("\n\n".join(paragraphs) + "\n")


def prepare(store: Path, dataset: str, *args: str) -> None:
    cmd = [sys.executable, "-m", "tokenfeed_server.cli", "prepare", *args]
    cmd += ["--store", str(store), "--dataset", dataset, "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"prepare {dataset} failed:\n{done.stderr}"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The input files every page's directory gets a copy of."""
    root = tmp_path_factory.mktemp("snippet-inputs")
    for seed, name in enumerate(("corpus", "web", "code", "math")):
        write_text_corpus(root / name, seed)
    (root / "corpus" / "notes").mkdir()
    (root / "corpus" / "notes" / "more.txt").write_text("a document in a subdirectory\n")
    rng = random.Random(9)
    with gzip.open(root / "extra.jsonl.gz", "wt") as out:
        for _ in range(200):
            text = " ".join(rng.choice(WORDS) for _ in range(40))
            out.write(json.dumps({"text": text}) + "\n")
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One open loopback server over demo, web, code and math."""
    base = tmp_path_factory.mktemp("snippet-server")
    store = base / "store"
    prepare(store, "demo", "--demo")
    for seed, name in enumerate(("web", "code", "math")):
        write_text_corpus(base / name, 100 + seed, files=3, words=12000)
        prepare(store, name, str(base / name))
    with LiveServer(store, log_path=base / "server.log") as live:
        yield live


def substitute(code: str, server: LiveServer, workdir: Path) -> str:
    return (
        code.replace(PLACEHOLDER_ZMQ, server.zmq)
        .replace(PLACEHOLDER_HTTP, server.http)
        .replace(PLACEHOLDER_STORE, str(workdir / "store"))
    )


def console_commands(code: str) -> str:
    """The commands of a console transcript (``$ `` lines and their continuations)."""
    commands = []
    continuing = False
    for line in code.splitlines():
        if line.startswith("$ ") or continuing:
            text = line[2:] if line.startswith("$ ") and not continuing else line
            commands.append(text)
            continuing = text.rstrip().endswith("\\")
    return "\n".join(commands) + "\n"


def run_block(block: Block, code: str, workdir: Path, env: dict[str, str]) -> str | None:
    """Run one block; None when it passed, else what went wrong (with its output)."""
    if block.language == "python":
        script = workdir.parent / f"{workdir.name}-line{block.line}.py"
        script.write_text(code)
        cmd = [sys.executable, str(script)]
    else:
        if block.language == "console":
            code = console_commands(code)
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
    started = time.monotonic()
    try:
        done = subprocess.run(
            cmd,
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as timeout:
        out = timeout.stdout or ""
        text = out.decode(errors="replace") if isinstance(out, bytes) else out
        return f"timed out after {BLOCK_TIMEOUT_S}s\n{text[-3000:]}"
    took = time.monotonic() - started
    if done.returncode != 0:
        output = (done.stdout + done.stderr)[-4000:]
        return f"exit status {done.returncode} after {took:.1f}s\n{output}"
    return None


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", pages(), ids=str)
def test_page_snippets_run(page: Path, server: LiveServer, inputs: Path, tmp_path: Path) -> None:
    """Every unmarked block of one page runs, in order, in one fresh directory."""
    blocks, problems = parse(ROOT / page)
    assert not problems, "\n".join(problems)
    if all(b.action == "skip" for b in blocks):
        TALLY["skipped"] += len(blocks)
        return
    workdir = tmp_path / "page"
    workdir.mkdir()
    for name in ("corpus", "web", "code", "math"):
        subprocess.run(["cp", "-r", str(inputs / name), str(workdir / name)], check=True)
    (workdir / "extra.jsonl.gz").write_bytes((inputs / "extra.jsonl.gz").read_bytes())
    assert server.store is not None
    (workdir / "demo-store").symlink_to(server.store)
    venv_bin = str(Path(sys.executable).parent)
    env = dict(os.environ)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    env["TOKENFEED_URL"] = server.http
    env["PYTHONUNBUFFERED"] = "1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TOKENFEED_TOKEN", "TOKENFEED_ENDPOINT"):
        env.pop(name, None)
    failures = []
    for block in blocks:
        if block.action == "skip":
            TALLY["skipped"] += 1
            continue
        code = substitute(block.code, server, workdir)
        if block.action == "file":
            (workdir / block.note).write_text(code)
            TALLY["files"] += 1
            continue
        TALLY["ran"] += 1
        error = run_block(block, code, workdir, env)
        if error is not None:
            failures.append(f"{block.where} ({block.language}): {error}")
    assert not failures, "\n\n".join(failures)
