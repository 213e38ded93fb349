"""The server process: store, data plane thread, HTTP on the main thread, clean stop.

Start-up order is what makes ``/readyz`` and the ``ready`` line honest: open and validate
the store, bind the ZeroMQ socket, bind the HTTP socket, start uvicorn, and only then
print ``{"event": "ready", ...}`` on stdout (the one line a supervisor or a test waits
for; all logging goes to stderr). SIGTERM or SIGINT stop uvicorn, then the data plane,
and the process exits with status 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import signal
import socket
import sys
from typing import IO

import uvicorn
import zmq

from tokenfeed.errors import ConfigError
from tokenfeed_server.config import ServerConfig
from tokenfeed_server.dataplane import security
from tokenfeed_server.dataplane.auth import Tenants
from tokenfeed_server.dataplane.plane import DataPlane
from tokenfeed_server.http.app import create_app
from tokenfeed_server.http.guard import (
    MAX_HEADER_BYTES,
    FdReserve,
    guarded_h11,
    quiet_accept_errors,
    reserved_listener,
)
from tokenfeed_server.http.state import ServerState
from tokenfeed_server.store import Store, memory, rows
from tokenfeed_server.store.handles import HANDLES
from tokenfeed_server.store.health_check import HealthCheck
from tokenfeed_server.store.leases import LeaseKeeper
from tokenfeed_server.store.objects import S3Location

log = logging.getLogger(__name__)


def serve(config: ServerConfig, *, ready_stream: IO[str] | None = None) -> int:
    """Run the server until SIGTERM/SIGINT; return the process exit status."""
    log.info("tokenfeed-server starting: %s", json.dumps(config.public_view()))
    log.info("rows read: %s", rows.read_path())
    _raise_open_file_limit()
    HANDLES.configure(config.max_open_shards)  # after the limit: 0 derives from it
    tenants = security.tenants_for(config)
    # before any thread starts (the cache's fetch threads): arenas are made per thread
    memory.limit_malloc_arenas(config.memory.malloc_arenas)
    memory.configure(
        row_pool_bytes=config.memory.row_pool_bytes,
        window_blocks_bytes=config.memory.window_blocks_bytes,
    )
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(memory.MemoryKeeper(config.memory.memory_idle_s).start().stop)
        # Undone in reverse on every way out, a failed bind included.
        store = _open_store(config, cleanup)
        cleanup.callback(store.close)
        store.open_all()
        cleanup.callback(HealthCheck(store).start().stop)  # unavailable -> ok, no restart
        leases = _lease_keeper(config, store, cleanup)
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        cleanup.callback(context.term)
        zap = security.start_zap(context, tenants)
        if zap is not None:
            cleanup.callback(zap.stop)
        dataplane = DataPlane(
            config,
            store,
            context=context,
            tenants=tenants,
            configure_socket=security.socket_setup(config, tenants),
        )
        zmq_endpoint = dataplane.start()
        cleanup.callback(dataplane.stop)
        if leases is not None:
            leases.start(lambda: _held_versions(store, dataplane), server_id=dataplane.instance)
        try:
            http_sock = _bind_http(config.host, config.http_port)
        except OSError as exc:
            log.error(
                "cannot bind HTTP port %s:%s: %s; pick another with --http-port",
                config.host,
                config.http_port,
                exc,
            )
            return 2
        cleanup.callback(http_sock.close)
        return _serve_http(
            config,
            store,
            dataplane,
            tenants=tenants,
            http_sock=http_sock,
            zmq_endpoint=zmq_endpoint,
            ready_stream=ready_stream,
        )
    raise AssertionError("unreachable")  # pragma: no cover


def _open_store(config: ServerConfig, cleanup: contextlib.ExitStack) -> Store:
    """The Store of ``config.store``: a directory, or ``s3://`` read through a piece cache
    (which then needs --cache-dir and --cache-size: ConfigError otherwise)."""
    from tokenfeed_server.store.objects import S3Location, parse_store

    location = parse_store(config.store)
    if not isinstance(location, S3Location):
        return Store(location, verify_checksums=config.verify_checksums)
    missing = [
        flag
        for flag, value in (("--cache-dir", config.cache_dir), ("--cache-size", config.cache_size))
        if value is None
    ]
    if missing:
        raise ConfigError(
            f"store {location.url()} is in object storage: serving it needs "
            f"{' and '.join(missing)} (a local directory for verified pieces, and the most "
            "bytes it may hold, e.g. --cache-dir /var/cache/tokenfeed --cache-size 50GiB; "
            "or TOKENFEED_CACHE_DIR / TOKENFEED_CACHE_SIZE)"
        )
    assert config.cache_dir is not None and config.cache_size is not None
    from tokenfeed_server.store.cache import PieceCache
    from tokenfeed_server.store.objects import ObjectStore

    # Two attempts per call (unless AWS_MAX_ATTEMPTS says otherwise): the cache retries
    # unreachable storage itself for --storage-retry-s, so botocore's own 5 attempts (up
    # to ~15 s per call) would only hide the moment storage answers again.
    objects = ObjectStore(location, max_attempts=None if os.environ.get("AWS_MAX_ATTEMPTS") else 2)
    cache = PieceCache(
        config.cache_dir,
        config.cache_size,
        objects,
        **config.cache.cache_options(),
        retry_s=config.storage.storage_retry_s,  # unreachable storage: a delay, not a failure
    )
    # Closed after the store (callbacks run in reverse): no fetch outlives the server.
    cleanup.callback(cache.close)
    log.info(
        "serving %s through the piece cache %s (%d bytes)",
        location.url(),
        config.cache_dir,
        config.cache_size,
    )
    return Store(
        location,
        verify_checksums=False,  # every piece is verified as it enters the cache
        scan_interval_s=config.remote_scan_interval_s,
        objects=objects,
        cache=cache,
    )


def _lease_keeper(
    config: ServerConfig, store: Store, cleanup: contextlib.ExitStack
) -> LeaseKeeper | None:
    """This server's lease on the versions its jobs read (so that gc keeps them), not yet
    started; its stop (which deletes it) registered now, so that it runs after the data
    plane's. None with --read-only-store: then gc protects them by its --grace alone."""
    if config.storage.read_only_store:
        log.warning(
            "--read-only-store: this server writes no lease, so gc cannot see which dataset "
            "versions its jobs read; for them gc falls back to its --grace period"
        )
        return None
    target = store.objects if store.objects is not None else store.root
    assert not isinstance(target, S3Location)  # a remote store always has its objects
    keeper = LeaseKeeper(target, lease_s=config.storage.lease_s)
    cleanup.callback(keeper.stop)
    return keeper


def _held_versions(store: Store, dataplane: DataPlane) -> dict[str, set[str]]:
    """What this server's lease names (read on the lease's thread): every version the
    store has open (the current ones, older ones jobs hold or a resume is opening) and
    every version a job reads, from the data plane's snapshot (rebuilt on its thread)."""
    held = {name: set(fps) for name, fps in store.held_versions().items()}
    for name, fps in dataplane.snapshot.get("held", {}).items():
        held.setdefault(name, set()).update(fps)
    return held


def _serve_http(
    config: ServerConfig,
    store: Store,
    dataplane: DataPlane,
    *,
    tenants: Tenants | None,
    http_sock: socket.socket,
    zmq_endpoint: str,
    ready_stream: IO[str] | None,
) -> int:
    """Serve HTTP on ``http_sock`` until a signal; the caller closes everything after."""
    host, port = http_sock.getsockname()[:2]
    scheme = "https" if config.tls_cert_file is not None else "http"
    http_url = f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
    state = ServerState(config, store, dataplane, tenants)
    reserve = FdReserve()  # answers /healthz at the descriptor limit (see http/guard.py)
    listener = reserved_listener(http_sock, reserve)
    uv = uvicorn.Server(
        uvicorn.Config(
            create_app(state),
            log_config=None,  # our logging setup (stderr) applies to uvicorn too
            log_level=config.log_level,
            access_log=False,
            lifespan="off",
            http=guarded_h11(config.http_header_timeout_s, config.http_max_connections, reserve),
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
            ssl_certfile=config.tls_cert_file,
            ssl_keyfile=config.tls_key_file,
        )
    )
    # uvicorn re-raises the signal it caught once it has shut down; a handler of ours
    # turns that into a normal return instead of death by signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)

    async def run() -> None:
        quiet_accept_errors(asyncio.get_running_loop())
        task = asyncio.create_task(uv.serve(sockets=[listener]))
        while not uv.started and not task.done():
            await asyncio.sleep(0.005)
        if uv.started:
            state.ready = True
            line = {"event": "ready", "zmq": zmq_endpoint, "http": http_url}
            out = ready_stream or sys.stdout
            out.write(json.dumps(line) + "\n")
            out.flush()
            log.info("ready: data %s, http %s", zmq_endpoint, http_url)
        await task

    try:
        asyncio.run(run())
    finally:
        listener.close()
        state.ready = False
        log.info("tokenfeed-server stopped")
    return 0


def _bind_http(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _raise_open_file_limit() -> None:
    """Lift the soft limit on open files to the hard one: room for connections, dataset
    directories and ``--max-open-shards`` shard files past the usual soft limit of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:  # e.g. an infinite hard limit some kernels refuse
            log.warning("could not raise the open-file limit from %d: %s", soft, exc)
