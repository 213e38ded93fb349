"""A loopback TCP proxy that adds a fixed delay to every request: object storage far away.

    python benchmarks/latency_proxy.py --upstream 127.0.0.1:9000 --delay-ms 50
    # prints {"event": "ready", "endpoint": "http://127.0.0.1:PORT", ...}; then
    AWS_ENDPOINT_URL=http://127.0.0.1:PORT tokenfeed-server serve --store s3://...

Each client connection gets one upstream connection; bytes go through unchanged, both
ways. The client-to-upstream direction waits ``delay`` before forwarding the first bytes of
each request: the first bytes on a connection, and on a keep-alive connection the first
bytes that arrive after the upstream has answered something (HTTP/1.1 request/response
turns). So every HTTP request pays the delay once, like a round trip to a distant
endpoint, however many TCP segments it spans. (An ``Expect: 100-continue`` upload pays it
twice: once for its headers and once for its body after the ``100`` answer.)

Bounded: at most ``max_connections`` client connections at once (more are closed at once),
reads of at most 64 KiB, and a write waits for the peer to drain (no unbounded buffers).
Loopback only: it listens on and connects to loopback addresses only, since it is a
benchmark and test tool, not a network service.

:class:`LatencyProxy` is the asyncio core; :class:`ProxyThread` runs one in a thread of a
synchronous program; the command line runs one in the foreground until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import signal
import sys
import threading
from dataclasses import dataclass

__all__ = ["LatencyProxy", "ProxyStats", "ProxyThread", "main"]

READ_BYTES = 64 * 1024


def _require_loopback(host: str, what: str) -> None:
    """Refuse anything but a loopback address (``localhost`` included)."""
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(
            f"{what} {host!r} is not a loopback address; this proxy is a loopback-only "
            "benchmark tool (use 127.0.0.1)"
        )


@dataclass
class ProxyStats:
    """What went through: connections accepted/refused, delayed requests, bytes each way."""

    connections: int = 0
    refused: int = 0
    delayed_requests: int = 0
    #: requests forwarded (or being delayed) whose answer has not begun yet
    waiting: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


class LatencyProxy:
    """Forward loopback TCP connections to ``upstream``, delaying each client request.

    Args:
        upstream_host, upstream_port: where to forward (a loopback address).
        delay_s: added before the first bytes of each client request (>= 0).
        host, port: where to listen (port 0: any free port; see :attr:`port`).
        max_connections: client connections served at once; more are closed on accept.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        delay_s: float = 0.05,
        host: str = "127.0.0.1",
        port: int = 0,
        max_connections: int = 256,
    ) -> None:
        _require_loopback(upstream_host, "upstream")
        _require_loopback(host, "listen address")
        if delay_s < 0:
            raise ValueError(f"delay must be >= 0 seconds, got {delay_s}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.upstream = (upstream_host, upstream_port)
        self.delay_s = delay_s
        self.host = host
        self.requested_port = port
        self.max_connections = max_connections
        self.stats = ProxyStats()
        self._server: asyncio.Server | None = None
        self._active: set[asyncio.Task[None]] = set()
        self._stopping = False

    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def endpoint(self) -> str:
        """``http://host:port`` of the proxy, e.g. for ``AWS_ENDPOINT_URL``."""
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        """Bind and start accepting."""
        self._server = await asyncio.start_server(self._accept, self.host, self.requested_port)

    async def stop(self) -> None:
        """Stop accepting and close every connection in flight."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._active):
            task.cancel()
        if self._active:
            await asyncio.gather(*self._active, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._active) >= self.max_connections:
            self.stats.refused += 1
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return
        task = asyncio.current_task()
        assert task is not None
        self._active.add(task)
        self.stats.connections += 1
        try:
            await self._relay(reader, writer)
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            # stop() cancelled it: end quietly (the transports are closed by _relay)
        finally:
            self._active.discard(task)

    async def _relay(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            u_reader, u_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            c_writer.close()  # the client sees the connection cut, as with a dead endpoint
            return
        except asyncio.CancelledError:
            c_writer.close()
            raise
        # True when the next client bytes start a new request: at the start, and again
        # once the upstream has answered (set by the downstream pump).
        turn = asyncio.Event()
        turn.set()
        pending = False  # a request of this connection awaits its answer

        async def up() -> None:
            nonlocal pending
            while data := await c_reader.read(READ_BYTES):
                if turn.is_set():
                    turn.clear()
                    self.stats.delayed_requests += 1
                    if not pending:
                        pending = True
                        self.stats.waiting += 1
                    await asyncio.sleep(self.delay_s)
                u_writer.write(data)
                self.stats.bytes_up += len(data)
                await u_writer.drain()
            with contextlib.suppress(OSError):
                u_writer.write_eof()  # half-close: the upstream still answers

        async def down() -> None:
            nonlocal pending
            while data := await u_reader.read(READ_BYTES):
                turn.set()
                if pending:
                    pending = False
                    self.stats.waiting -= 1
                c_writer.write(data)
                self.stats.bytes_down += len(data)
                await c_writer.drain()
            with contextlib.suppress(OSError):
                c_writer.write_eof()

        pumps = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
        try:
            # Both directions end on EOF; a reset on either side ends the connection.
            await asyncio.gather(*pumps)
        except OSError:
            pass
        finally:
            # Close both transports before any await: a cancel (stop) arriving during a
            # wait must not leave either one open.
            u_writer.close()
            c_writer.close()
            for task in pumps:
                task.cancel()
            if pending:  # cut before its answer began
                pending = False
                self.stats.waiting -= 1
            await asyncio.gather(*pumps, return_exceptions=True)


class ProxyThread:
    """A :class:`LatencyProxy` on an event loop of its own thread, for synchronous code.

    ``with ProxyThread("127.0.0.1", 9000, delay_s=0.05) as proxy: use(proxy.endpoint)``.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        delay_s: float = 0.05,
        host: str = "127.0.0.1",
        port: int = 0,
        max_connections: int = 256,
    ) -> None:
        self.proxy = LatencyProxy(
            upstream_host,
            upstream_port,
            delay_s=delay_s,
            host=host,
            port=port,
            max_connections=max_connections,
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        """``http://host:port`` of the proxy."""
        return self.proxy.endpoint

    @property
    def port(self) -> int:
        """The bound port."""
        return self.proxy.port

    def start(self, timeout: float = 10.0) -> ProxyThread:
        """Start the loop thread and bind; return once the proxy accepts."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self._loop).result(timeout)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Close everything and end the thread."""
        if self._thread.is_alive():
            fut = asyncio.run_coroutine_threadsafe(self.proxy.stop(), self._loop)
            with contextlib.suppress(TimeoutError):
                fut.result(timeout)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> ProxyThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


async def _serve(args: argparse.Namespace) -> None:
    host, port = args.upstream
    proxy = LatencyProxy(
        host,
        port,
        delay_s=args.delay_ms / 1000.0,
        host=args.host,
        port=args.port,
        max_connections=args.max_connections,
    )
    await proxy.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = {
        "event": "ready",
        "endpoint": proxy.endpoint,
        "port": proxy.port,
        "upstream": f"{host}:{port}",
        "delay_ms": args.delay_ms,
    }
    print(json.dumps(ready), flush=True)
    await stop.wait()
    await proxy.stop()
    print(json.dumps({"event": "stopped", **vars(proxy.stats)}), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run a proxy in the foreground; print one JSON ready line on stdout."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", type=_hostport, required=True, help="HOST:PORT to forward to")
    ap.add_argument("--delay-ms", type=float, default=50.0, help="added per request (ms)")
    ap.add_argument("--host", default="127.0.0.1", help="loopback address to listen on")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (0: any free one)")
    ap.add_argument("--max-connections", type=int, default=256)
    args = ap.parse_args(argv)
    try:
        asyncio.run(_serve(args))
    except ValueError as exc:
        print(f"latency_proxy: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
