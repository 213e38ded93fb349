"""Progress reporting for long jobs: a tqdm bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType
from typing import Any

__all__ = ["ByteProgress", "Progress"]

log = logging.getLogger(__name__)

_LOG_EVERY_S = 5.0


class Progress:
    """Counts documents, tokens and text bytes; shows them with rates, on stderr.

    ``enabled=None`` picks a bar when stderr is a terminal and log lines every few seconds
    when it is not (CI, docker logs); ``False`` shows nothing.
    """

    def __init__(self, *, enabled: bool | None, desc: str) -> None:
        self.desc = desc
        self.docs = 0
        self.tokens = 0
        self.text_bytes = 0
        self._start = time.monotonic()
        self._last_log = self._start
        self._bar: Any = None
        self._quiet = enabled is False
        if enabled is None:
            enabled = sys.stderr.isatty()
        if enabled and not self._quiet:
            from tqdm import tqdm

            self._bar = tqdm(desc=desc, unit=" docs", unit_scale=True, file=sys.stderr)

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(log_summary=exc is None)

    def update(self, docs: int, tokens: int, text_bytes: int) -> None:
        """Add ``docs`` and ``tokens``; ``text_bytes`` is the running total read so far."""
        self.docs += docs
        self.tokens += tokens
        self.text_bytes = text_bytes
        if self._bar is not None:
            self._bar.update(docs)
            self._bar.set_postfix_str(self._rates(), refresh=False)
            return
        now = time.monotonic()
        if not self._quiet and now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            log.info("%s: %s", self.desc, self._rates())

    def _rates(self) -> str:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        return (
            f"{self.docs:,} docs, {self.tokens / 1e6:.1f}M tokens "
            f"({self.tokens / elapsed / 1e6:.2f}M tok/s, "
            f"{self.text_bytes / elapsed / 1e6:.1f} MB/s of text)"
        )

    def close(self, *, log_summary: bool = True) -> None:
        """Close the bar; log a final summary line unless quiet."""
        if self._bar is not None:
            self._bar.set_postfix_str(self._rates())
            self._bar.close()
            self._bar = None
        elif log_summary and not self._quiet:
            log.info("%s: done, %s", self.desc, self._rates())


class ByteProgress:
    """Bytes done of a known total (a download, a check), shown the way :class:`Progress`
    shows documents: a tqdm bar on a terminal, a log line every few seconds otherwise,
    nothing with ``enabled=False``. Call :meth:`begin` with the total, then :meth:`advance`.
    """

    def __init__(self, *, enabled: bool | None, desc: str) -> None:
        self.desc = desc
        self.done = 0
        self.total = 0
        self._enabled = sys.stderr.isatty() if enabled is None else enabled
        self._log = enabled is None and not self._enabled  # not a terminal: log lines
        self._start = self._last_log = time.monotonic()
        self._bar: Any = None
        self._logged = False  # a short job ends without a line: it needed no progress

    def begin(self, total_bytes: int) -> None:
        """The bytes to be done in all (starts the bar)."""
        self.total = total_bytes
        self._start = self._last_log = time.monotonic()
        if self._enabled and self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(
                desc=self.desc, total=total_bytes, unit="B", unit_scale=True, file=sys.stderr
            )

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more are done."""
        self.done += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)
            return
        now = time.monotonic()
        if self._log and now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            self._logged = True
            log.info("%s: %s", self.desc, self._line())

    def _line(self) -> str:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        return (
            f"{self.done / 1e6:,.1f} of {self.total / 1e6:,.1f} MB{share}, "
            f"{self.done / elapsed / 1e6:.1f} MB/s"
        )

    def close(self) -> None:
        """Close the bar (a final log line when logging)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._logged:
            log.info("%s: done, %s", self.desc, self._line())

    def __enter__(self) -> ByteProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
