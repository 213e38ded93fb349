"""A real S3 protocol server for tests: moto's server mode as a separate process.

Usage (import it the way the tests import ``live_server``)::

    from s3_server import S3Server, s3_server  # noqa: F401  (s3_server is a fixture)

    def test_x(s3_server: S3Server) -> None:
        s3_server.make_bucket("b")
        subprocess.run([...], env=s3_server.env(), check=True)

    with S3Server() as s3:                      # outside pytest
        s3.client.list_buckets()

The server listens on 127.0.0.1 on a free port; start-up waits (bounded) until it
answers HTTP. ``stop()`` terminates it and waits, so no test leaks the process; the
fixtures stop it even when the test fails. Its state lives in memory: a restarted
server is empty.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import boto3
import pytest

from tokenfeed_server.store.objects import ObjectStore, S3Location

__all__ = ["S3Server", "s3_server", "s3_server_module"]

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class S3Server:
    """One ``moto_server`` child on loopback.

    Attributes (set by :meth:`start`): ``port``, ``endpoint`` (``http://127.0.0.1:PORT``)
    and ``client`` (a boto3 S3 client for it).
    """

    def __init__(self, log_path: Path | None = None, env: Mapping[str, str] | None = None) -> None:
        """``env``: more environment for the server process (e.g. moto's
        ``INITIAL_NO_AUTH_ACTION_COUNT=0``, which makes it check credentials)."""
        self.log_path = log_path
        self.server_env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.endpoint = ""
        self._client: Any = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> S3Server:
        """Start the server and return once it answers HTTP (raises after ``timeout``)."""
        exe = Path(sys.executable).parent / "moto_server"
        if not exe.exists():
            raise RuntimeError(f"{exe} not found: install moto[server] (requirements-dev.txt)")
        # A free port can be taken between the probe and moto's bind: try a few.
        last = ""
        for _ in range(3):
            self.port = _free_port()
            self.endpoint = f"http://127.0.0.1:{self.port}"
            log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
            try:
                self.proc = subprocess.Popen(
                    [str(exe), "-H", "127.0.0.1", "-p", str(self.port)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    env={**os.environ, **self._credentials(), **self.server_env},
                )
            finally:
                if log is not subprocess.DEVNULL:
                    log.close()  # type: ignore[union-attr]
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    last = f"moto_server exited with status {self.proc.returncode}"
                    break
                if self._answers():
                    return self
                time.sleep(0.05)
            else:
                self.stop()
                raise RuntimeError(f"moto_server did not answer on {self.endpoint} in {timeout}s")
            self.proc = None
        raise RuntimeError(f"moto_server did not start: {last}")

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint + "/", timeout=1.0):
                return True
        except urllib.error.HTTPError:
            return True  # any HTTP answer (an auth-checking server says 403, or 500)
        except OSError:
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the server and wait for it (kill if it does not exit in ``timeout``)."""
        proc, self.proc = self.proc, None
        self._client = None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def kill(self) -> None:
        """Kill the server abruptly (SIGKILL), as a crashed or unreachable S3 would be."""
        proc, self.proc = self.proc, None
        self._client = None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10.0)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- helpers -----------------------------------------------------------------------

    @staticmethod
    def _credentials() -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
        }

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment (``base`` or this process's) that points AWS clients here.

        Profiles and shared config files are cut off (``AWS_CONFIG_FILE`` /
        ``AWS_SHARED_CREDENTIALS_FILE`` set to /dev/null, ``AWS_PROFILE`` removed) so a
        developer's ~/.aws cannot leak into a test.
        """
        env = dict(os.environ if base is None else base)
        env.pop("AWS_PROFILE", None)
        env.pop("AWS_SESSION_TOKEN", None)
        env.update(self._credentials())
        env["AWS_ENDPOINT_URL"] = self.endpoint
        env["AWS_CONFIG_FILE"] = os.devnull
        env["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
        return env

    @property
    def client(self) -> Any:
        """A boto3 S3 client for this server (made on first use)."""
        if not self.endpoint:
            raise RuntimeError("the S3 server is not started")
        if self._client is None:
            self._client = boto3.session.Session(
                aws_access_key_id=ACCESS_KEY,
                aws_secret_access_key=SECRET_KEY,
                region_name=REGION,
            ).client("s3", endpoint_url=self.endpoint)
        return self._client

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` and return it."""
        self.client.create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every key in ``bucket`` under ``prefix``, sorted."""
        out: list[str] = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            out.extend(obj["Key"] for obj in page.get("Contents", []))
        return sorted(out)

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset API), for a shared server."""
        req = urllib.request.Request(self.endpoint + "/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=10.0):
            pass


@pytest.fixture
def s3_server(tmp_path: Path) -> Iterator[S3Server]:
    """A fresh moto server for one test (stopped afterwards, pass or fail)."""
    server = S3Server(log_path=tmp_path / "moto.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def s3_server_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One moto server shared by a module's tests (cheaper; call ``reset()`` if needed)."""
    server = S3Server(log_path=tmp_path_factory.mktemp("moto") / "moto.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def empty_bucket(
    server: S3Server, monkeypatch: pytest.MonkeyPatch, bucket: str, prefix: str = "p"
) -> ObjectStore:
    """An empty ``bucket`` on ``server`` (everything else on it cleared), this process's AWS
    environment pointing at it, and the object store at ``prefix`` in it."""
    server.reset()
    server.make_bucket(bucket)
    for key, value in server.env({}).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    return ObjectStore(S3Location(bucket, prefix))
