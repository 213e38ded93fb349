"""A shared server: tenants, tokens, CURVE, limits. Real processes, loopback.

Fair share between tenants: the scheduler's unit tests (``tests/test_scheduler.py``) and
``benchmarks/bench_fairness.py`` (a ratio measured on a real server, not asserted here).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import zmq

from live_server import LiveServer
from shard_data import BYTE
from tokenfeed import TokenFeedDataset, protocol
from tokenfeed.errors import (
    AuthenticationFailed,
    ConfigError,
    ConnectionLimit,
    DatasetForbidden,
    RequestRejected,
)
from tokenfeed.protocol import JobSpec
from tokenfeed.protocol.curve import legacy_keypair_from_token
from tokenfeed.transport.client import ClientOptions, FeedClient, Request
from tokenfeed_server.dataplane.auth import token_digest
from tokenfeed_server.store import write_dataset

pytestmark = pytest.mark.network

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-fedcba9876543210xyz"
CAPPED = "capped-token-abcdefghijklmnop"
ADMIN = "admin-token-zyxwvutsrqponmlkj"
SHARED = "shared-token-0000111122223333"
SECRETS = (ALICE, BOB, CAPPED, ADMIN, SHARED)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(1)
    docs = [
        rng.integers(0, 256, size=int(n), dtype=np.uint16)
        for n in rng.integers(100, 5000, size=400)
    ]
    for name in ("alpha", "beta-1"):
        write_dataset(root, name, docs, tokenizer=BYTE, shuffle_seed=0)
    return root


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    directory = tmp_path_factory.mktemp("logs")
    yield directory
    # No secret ever reaches a log, whatever the tests above did.
    for log in directory.glob("*.log"):
        text = log.read_text()
        for secret in SECRETS:
            assert secret not in text, f"{secret[:6]}... leaked into {log.name}"


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("conf") / "tenants.toml"
    path.write_text(f"""
admin_token_sha256 = "{token_digest(ADMIN)}"

[[tenant]]
name = "alice"
token = "{ALICE}"
datasets = ["alpha"]
weight = 1

[[tenant]]
name = "bob"
token_sha256 = "{token_digest(BOB)}"
datasets = ["beta-*", "alpha"]
weight = 3

[[tenant]]
name = "capped"
token = "{CAPPED}"
datasets = ["*"]
max_connections = 1
""")
    return path


@pytest.fixture(scope="module")
def server(store: Path, tenants_file: Path, logs: Path) -> Iterator[LiveServer]:
    with LiveServer(
        store, extra=["--tenants", str(tenants_file)], log_path=logs / "tenants.log"
    ) as srv:
        yield srv


def dataset(srv: LiveServer, name: str, token: str | None, **kw: object) -> TokenFeedDataset:
    args: dict[str, object] = {
        "seq_len": 128,
        "batch_size": 4,
        "rank": 0,
        "world_size": 1,
        "token": token,
        "request_timeout": 2.0,
        "deadline": 15.0,
    }
    args.update(kw)
    return TokenFeedDataset(srv.zmq, name, **args)  # type: ignore[arg-type]


def test_tenant_reads_its_datasets_and_is_refused_others(server: LiveServer) -> None:
    assert sum(1 for _ in dataset(server, "alpha", ALICE, samples=40)) == 10
    with pytest.raises(DatasetForbidden, match=r"alice.*beta-1") as refused:
        next(iter(dataset(server, "beta-1", ALICE)))
    # the refusal names what alice may read, so a typo does not pass for a permission
    assert "may read datasets matching: alpha" in str(refused.value)
    assert sum(1 for _ in dataset(server, "beta-1", BOB, samples=8)) == 2


@pytest.mark.parametrize("token", ["wrong-token-but-long-enough", None])
def test_bad_or_missing_token_fails_fast(server: LiveServer, token: str | None) -> None:
    t0 = time.monotonic()
    with pytest.raises(AuthenticationFailed, match="token"):
        next(iter(dataset(server, "alpha", token, deadline=60.0)))
    assert time.monotonic() - t0 < 5.0  # refused clients do not spin until the deadline


def test_connection_cap_per_tenant(server: LiveServer) -> None:
    job = JobSpec("alpha", 128, 4, 0, 1)
    first = FeedClient(server.zmq, job, rank=0, worker=0, options=ClientOptions(token=CAPPED))
    second = FeedClient(server.zmq, job, rank=0, worker=1, options=ClientOptions(token=CAPPED))
    try:
        first.hello()
        with pytest.raises(ConnectionLimit, match="capped"):
            second.hello()
    finally:
        first.close()
        second.close()


def test_http_shows_a_tenant_only_its_own(server: LiveServer) -> None:
    for _ in dataset(server, "alpha", ALICE, samples=8):
        pass
    for _ in dataset(server, "beta-1", BOB, samples=8):
        pass
    assert server.get("/v1/jobs").status_code == 401
    assert server.get("/v1/jobs", headers=bearer("nope")).status_code == 401

    def tenants_seen(token: str) -> set[str]:
        deadline = time.monotonic() + 5
        while True:  # the snapshot refreshes twice a second
            seen = {j["tenant"] for j in server.get("/v1/jobs", headers=bearer(token)).json()}
            if token != ADMIN or {"alice", "bob"} <= seen or time.monotonic() > deadline:
                return seen
            time.sleep(0.1)

    assert tenants_seen(ADMIN) >= {"alice", "bob"}
    assert tenants_seen(ALICE) == {"alice"}
    assert tenants_seen(BOB) == {"bob"}
    names = {d["name"] for d in server.get("/v1/datasets", headers=bearer(ALICE)).json()}
    assert names == {"alpha"}
    assert server.get("/v1/datasets/beta-1", headers=bearer(ALICE)).status_code == 404
    assert server.get("/v1/datasets/beta-1", headers=bearer(BOB)).status_code == 200
    # open endpoints stay open (/metrics wants the admin token: tests/test_api.py);
    # no response carries a secret
    for path in ("/healthz", "/readyz", "/v1/limits", "/v1/status"):
        response = server.get(path)
        assert response.status_code == 200, path
        assert not any(s in response.text for s in SECRETS)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_non_loopback_needs_a_token(store: Path, logs: Path) -> None:
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenfeed_server.cli",
            "serve",
            "--store",
            str(store),
            "--host",
            "0.0.0.0",
            "--zmq-port",
            "0",
            "--http-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 2
    assert "--token" in refused.stderr and "--insecure" in refused.stderr
    # With a shared token it serves; an unauthenticated client (over loopback) is refused.
    with LiveServer(
        store, extra=["--host", "0.0.0.0", "--token", SHARED], log_path=logs / "shared.log"
    ) as srv:
        endpoint = f"tcp://127.0.0.1:{srv.zmq_port}"
        anonymous = TokenFeedDataset(
            endpoint, "alpha", seq_len=128, batch_size=4, rank=0, world_size=1, deadline=30.0
        )
        with pytest.raises(AuthenticationFailed):
            next(iter(anonymous))
        ok = TokenFeedDataset(
            endpoint,
            "alpha",
            seq_len=128,
            batch_size=4,
            rank=0,
            world_size=1,
            token=SHARED,
            samples=8,
        )
        assert sum(1 for _ in ok) == 2


def test_insecure_flag_warns_loudly(store: Path, logs: Path) -> None:
    log = logs / "insecure.log"
    with LiveServer(store, extra=["--host", "0.0.0.0", "--insecure"], log_path=log) as srv:
        assert srv.get_at("127.0.0.1", "/readyz").status_code == 200
    assert "INSECURE" in log.read_text()


def client_key(secret: Path, token: str, tmp_path: Path) -> str:
    """The key ``tokenfeed-server client-key`` issues for ``token`` (the operator's step)."""
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    issued = subprocess.run(
        [sys.executable, "-m", "tokenfeed_server.cli", "client-key",
         "--curve-secret-key", str(secret), "--token-file", str(token_file)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert token not in issued.stdout + issued.stderr
    return issued.stdout.strip()


def test_curve_encryption(store: Path, tenants_file: Path, logs: Path, tmp_path: Path) -> None:
    keygen = subprocess.run(
        [sys.executable, "-m", "tokenfeed_server.cli", "keygen", str(tmp_path / "keys")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "server.key.pub" in keygen.stdout
    secret = tmp_path / "keys" / "server.key"
    assert secret.stat().st_mode & 0o077 == 0  # private to the owner
    public = (tmp_path / "keys" / "server.key.pub").read_text().strip()
    alice_key, bob_key = client_key(secret, ALICE, tmp_path), client_key(secret, BOB, tmp_path)
    log = logs / "curve.log"
    with LiveServer(
        store,
        extra=["--tenants", str(tenants_file), "--curve-secret-key", str(secret)],
        log_path=log,
    ) as srv:
        curve = {"server_public_key": public}
        ds = dataset(srv, "alpha", ALICE, samples=16, client_secret_key=alice_key, **curve)
        assert sum(1 for _ in ds) == 4
        # bob's tenant entry holds only token_sha256: CURVE serves him all the same
        ds = dataset(srv, "beta-1", None, samples=8, client_secret_key=bob_key, **curve)
        assert sum(1 for _ in ds) == 2
        with pytest.raises(DatasetForbidden):  # the key names alice, with alice's rights
            next(iter(dataset(srv, "beta-1", None, client_secret_key=alice_key, **curve)))
        # Someone who sniffed alice's bearer token: the old derivation from the token alone,
        # or any key pair of their own, fails the handshake.
        sniffed = legacy_keypair_from_token(ALICE)[1].decode()
        with pytest.raises(AuthenticationFailed):
            next(iter(dataset(srv, "alpha", ALICE, client_secret_key=sniffed, **curve)))
        with pytest.raises(AuthenticationFailed):  # a second try: the log still says it once
            next(iter(dataset(srv, "alpha", ALICE, client_secret_key=sniffed, **curve)))
        forged = zmq.curve_keypair()[1].decode()
        with pytest.raises(AuthenticationFailed):
            next(iter(dataset(srv, "alpha", ALICE, client_secret_key=forged, **curve)))
        with pytest.raises(ConfigError, match="tokenfeed-server client-key"):
            dataset(srv, "alpha", ALICE, **curve)  # the token alone: refused before connecting
        with pytest.raises(AuthenticationFailed):  # a PLAIN client cannot talk to CURVE
            next(iter(dataset(srv, "alpha", ALICE)))
    text = log.read_text()
    hint = (
        "CURVE key derived from the token: upgrade the client and use `tokenfeed-server client-key`"
    )
    assert text.count(hint) == 1, text[-3000:]
    assert "tenant 'alice'" in text
    for key in (alice_key, bob_key, sniffed):
        assert key not in text


def test_limits_are_enforced_and_reported(store: Path, logs: Path) -> None:
    # An egress cap of 1 token/s lets exactly one chunk out (the bucket's first tenth of a
    # second), then nothing for minutes: requests sent after that one stay queued, so the
    # window check sees them all whatever the timing. (Without the cap the server could
    # answer a get before the next one arrived, and a third get was rightly inside the
    # window: 2 runs in 5 saw no err.)
    with LiveServer(
        store,
        extra=["--max-window", "2", "--max-batch-tokens", "10000", "--max-tokens-per-s", "1"],
        log_path=logs / "limits.log",
    ) as srv:
        limits = srv.get("/v1/limits").json()
        assert limits["max_window"] == 2 and limits["max_batch_tokens"] == 10000
        job = JobSpec("alpha", 128, 4, 0, 1)
        with FeedClient(srv.zmq, job, rank=0, worker=0, options=ClientOptions(window=8)) as c:
            assert c.hello().window == 2  # the window is negotiated down to the limit
            sock = c.connection.sock
            assert sock is not None

            def reply() -> protocol.Message:
                assert sock.poll(10_000), "no answer from the server"
                return protocol.decode_header(sock.recv_multipart()[0])

            c._send_get(0, Request(pos=0, count=1))
            first = reply()
            assert isinstance(first, protocol.Chunk), first  # spends the egress budget
            for i in range(1, 4):  # a client that ignores its credit gets an err, not data
                c._send_get(i, Request(pos=i * 4, count=1))
            err = reply()
            assert isinstance(err, protocol.Err) and "window=2" in err.message, err
            assert not sock.poll(200)  # the two requests within the window wait for budget
        with pytest.raises(RequestRejected, match="max_batch_tokens"):
            next(
                iter(
                    TokenFeedDataset(
                        srv.zmq, "alpha", seq_len=128, batch_size=100, rank=0, world_size=1
                    )
                )
            )


def test_bearer_errors_do_not_echo_tokens(server: LiveServer) -> None:
    response = httpx.get(server.http + "/v1/jobs", headers=bearer(ALICE + "x"), timeout=10)
    assert response.status_code == 401
    assert ALICE not in response.text
