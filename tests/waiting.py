"""The one way a test waits for a condition: poll it, bounded, and say what never came.

Tests never sleep a fixed time to let a server catch up; they poll what they need (a
status snapshot that refreshes twice a second, a thread that ends, a process that opens
a file) until it holds, and fail with ``what`` named when it does not within ``timeout``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(probe: Callable[[], T], timeout: float, what: str, *, interval: float = 0.05) -> T:
    """The first truthy value of ``probe()``, polled every ``interval`` seconds.

    Raises AssertionError naming ``what`` if none comes within ``timeout`` seconds (the
    probe runs at least once, and once more at the deadline).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(interval)
