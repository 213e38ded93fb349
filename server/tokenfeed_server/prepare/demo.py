"""The demo corpus (``prepare --demo``): real text that needs no download."""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

from tokenfeed.errors import PrepareError

__all__ = ["demo_corpus_paths"]


def demo_corpus_paths(max_bytes: int = 30 << 20) -> list[Path]:
    """Real text that needs no download: this interpreter's standard library sources.

    The ``.py`` files (and any ``.txt``/``.rst`` docs) under the stdlib directory, in
    sorted order, up to ``max_bytes`` in total; site-packages and test data excluded.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    picked: list[Path] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")
        )
        for name in sorted(filenames):
            if not name.endswith((".py", ".txt", ".rst")):
                continue
            path = Path(dirpath) / name
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if size == 0 or total + size > max_bytes or not _is_utf8(path):
                continue
            picked.append(path)
            total += size
    if not picked:
        raise PrepareError(f"no standard library sources found under {root} ({sys.executable})")
    return picked


def _is_utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return True
