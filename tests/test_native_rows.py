"""The C row reader (store/_rows.c) against the portable one it replaces, on real files."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokenfeed_server.store import rows

ROW = 4098  # one 2049-token uint16 row


@pytest.fixture
def two_files(tmp_path: Path) -> Iterator[list[int]]:
    rng = np.random.default_rng(3)
    fds = []
    for k in range(2):
        path = tmp_path / f"f{k}.bin"
        path.write_bytes(rng.integers(0, 2**16, 50_000, dtype=np.uint16).tobytes())
        fds.append(os.open(path, os.O_RDONLY))
    yield fds
    for fd in fds:
        os.close(fd)


def _both(fds: Any, offsets: list[int], shape: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """(native out, native total, portable out, portable total) for the same rows."""
    a = np.zeros(shape, dtype=np.uint8)
    b = np.zeros(shape, dtype=np.uint8)
    got_a = rows.read_rows(fds, zip(a), offsets)
    got_b = rows._portable(fds, zip(b), offsets)
    return a, np.int64(got_a), b, np.int64(got_b)


def test_the_helper_was_built_here() -> None:
    # CI installs with a C compiler: a silent fallback there would hide a broken build.
    assert rows.NATIVE, rows.read_path()


def test_same_bytes_as_preadv_one_file_and_many(two_files: list[int]) -> None:
    rng = np.random.default_rng(0)
    offsets = rng.integers(0, 100_000 - ROW, 300).tolist()
    a, got_a, b, got_b = _both(two_files[0], offsets, (300, ROW))
    assert got_a == got_b == 300 * ROW
    assert np.array_equal(a, b) and a.any()
    fds = rng.choice(two_files, 300).tolist()
    a, got_a, b, got_b = _both(fds, offsets, (300, ROW))
    assert got_a == got_b == 300 * ROW and np.array_equal(a, b)
    with open(os.path.realpath(f"/proc/self/fd/{fds[7]}"), "rb") as f:
        f.seek(offsets[7])
        assert a[7].tobytes() == f.read(ROW)


def test_a_short_read_shows_in_the_total(two_files: list[int]) -> None:
    # The last row starts 10 bytes before the end of the file: 10 bytes, not ROW.
    offsets = [0, 100_000 - 10]
    a, got_a, b, got_b = _both(two_files[0], offsets, (2, ROW))
    assert got_a == got_b == ROW + 10
    assert np.array_equal(a, b)


def test_a_bad_descriptor_raises_like_preadv(two_files: list[int]) -> None:
    with pytest.raises(OSError) as native:
        rows.read_rows([two_files[0], 999_999], zip(np.zeros((2, 8), np.uint8)), [0, 0])
    with pytest.raises(OSError) as portable:
        rows._portable([two_files[0], 999_999], zip(np.zeros((2, 8), np.uint8)), [0, 0])
    assert native.value.errno == portable.value.errno == errno.EBADF


@pytest.mark.parametrize(
    ("fds", "bufs", "offsets", "error"),
    [
        (3, [], [0], ValueError),  # fewer buffers than offsets
        ([3, 3], [(bytearray(4),)], [0], TypeError),  # fds not one per row
        (3, [(b"read-only",)], [0], BufferError),  # a buffer it may not write
        ("3", [(bytearray(4),)], [0], TypeError),
    ],
)
def test_bad_arguments_are_errors_not_crashes(
    fds: Any, bufs: list[Any], offsets: list[int], error: type[Exception]
) -> None:
    if not rows.NATIVE:
        pytest.skip(rows.read_path())
    with pytest.raises(error):
        rows.read_rows(fds, bufs, offsets)


def test_the_fallback_is_chosen_by_the_environment() -> None:
    code = "from tokenfeed_server.store import rows; print(rows.NATIVE, rows.read_path())"
    env = {**os.environ, "TOKENFEED_NATIVE_READS": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("False preadv per row (TOKENFEED_NATIVE_READS=0)"), out
