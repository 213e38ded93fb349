"""CURVE client keys: issued by the operator from the server's secret key, never derivable
from a token alone. The handshake itself (issued key served, sniffed token refused, the
upgrade hint) runs on a real server in ``tests/test_security.py::test_curve_encryption``;
here: the derivation, the ``client-key`` command, and the client's refusals.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from tokenfeed.errors import ConfigError
from tokenfeed.protocol.curve import (
    client_secret_key,
    curve_keypair,
    is_z85_key,
    legacy_keypair_from_token,
)
from tokenfeed.training.config import DatasetConfig
from tokenfeed.transport.options import ClientOptions
from tokenfeed_server.dataplane.auth import Tenants, token_digest
from tokenfeed_server.dataplane.security import keygen

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-fedcba9876543210xyz"


@pytest.fixture
def server_key(tmp_path: Path) -> Path:
    secret, _ = keygen(tmp_path / "keys")
    return Path(secret)


def client_key_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenfeed_server.cli", "client-key", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_key_needs_the_server_secret_and_differs_per_tenant(server_key: Path) -> None:
    server = server_key.read_text().strip().encode()
    alice = client_secret_key(server, token_digest(ALICE))
    assert is_z85_key(alice) and alice == client_secret_key(server, token_digest(ALICE))
    assert alice != client_secret_key(server, token_digest(BOB))
    assert alice != client_secret_key(zmq.curve_keypair()[1], token_digest(ALICE))
    assert alice != legacy_keypair_from_token(ALICE)[1]  # the token alone does not give it
    # the server expects exactly the issued key's public half, from the digest alone
    tenants = Tenants.shared_token(ALICE)
    tenants.use_curve(server)
    assert tenants.authenticate_curve(curve_keypair(alice)[0]) is tenants.by_name["default"]
    assert tenants.authenticate_curve(legacy_keypair_from_token(ALICE)[0]) is None
    assert tenants.legacy_curve_tenant(legacy_keypair_from_token(ALICE)[0]) is not None


def test_client_key_prints_the_key_from_a_token_file_or_its_digest(
    server_key: Path, tmp_path: Path
) -> None:
    token_file = tmp_path / "alice.token"
    token_file.write_text(ALICE + "\n")
    expected = client_secret_key(server_key.read_text().strip().encode(), token_digest(ALICE))
    by_file = client_key_cli("--curve-secret-key", str(server_key), "--token-file", str(token_file))
    assert by_file.returncode == 0, by_file.stderr
    assert by_file.stdout == expected.decode() + "\n"  # stdout holds the key alone
    by_digest = client_key_cli(
        "--curve-secret-key", str(server_key), "--token-sha256", token_digest(ALICE)
    )
    assert (by_digest.returncode, by_digest.stdout) == (0, by_file.stdout)


@pytest.mark.parametrize(
    "case, said",
    [
        ("short token", "--token-file: a token must be"),
        ("missing token file", "cannot read the token file"),
        ("bad digest", "--token-sha256 must be 64 lowercase hex digits"),
        ("bad server key", "is not a Z85 CURVE key"),
        ("missing server key", "cannot read CURVE secret key"),
        ("no token", "one of the arguments --token-file --token-sha256 is required"),
    ],
)
def test_client_key_refuses_bad_input_with_status_2(
    server_key: Path, tmp_path: Path, case: str, said: str
) -> None:
    short = tmp_path / "short.token"
    short.write_text("short-secret\n")
    not_a_key = tmp_path / "not.key"
    not_a_key.write_text("~" * 40 + "\n")
    key = str(server_key)
    args = {
        "short token": ["--curve-secret-key", key, "--token-file", str(short)],
        "missing token file": ["--curve-secret-key", key, "--token-file", str(tmp_path / "nope")],
        "bad digest": ["--curve-secret-key", key, "--token-sha256", token_digest(ALICE).upper()],
        "bad server key": ["--curve-secret-key", str(not_a_key), "--token-sha256", "0" * 64],
        "missing server key": ["--curve-secret-key", str(tmp_path / "no.key"), "--token-sha256",
                               "0" * 64],
        "no token": ["--curve-secret-key", key],
    }[case]  # fmt: skip
    r = client_key_cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert said in r.stderr and r.stdout == ""
    assert "Traceback" not in r.stderr and "short-secret" not in r.stderr


def test_the_client_refuses_curve_without_an_issued_key() -> None:
    public, secret = (k.decode() for k in zmq.curve_keypair())
    with pytest.raises(ConfigError, match="tokenfeed-server client-key") as refused:
        ClientOptions(token=ALICE, server_public_key=public)
    assert ALICE not in str(refused.value)
    with pytest.raises(ConfigError, match="server_public_key= too"):
        ClientOptions(client_secret_key=secret)
    with pytest.raises(ConfigError, match="client_secret_key must be") as refused:
        ClientOptions(server_public_key=public, client_secret_key=secret[:-1] + "~")
    assert secret[:-1] not in str(refused.value)  # a secret, even when malformed
    with pytest.raises(ConfigError, match="server_public_key must be"):
        ClientOptions(server_public_key="not-a-key", client_secret_key=secret)
    options = ClientOptions(server_public_key=public, client_secret_key=secret)
    assert secret not in repr(options)


def test_the_dataset_takes_the_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    public, secret = (k.decode() for k in zmq.curve_keypair())
    monkeypatch.setenv("TOKENFEED_CLIENT_KEY", secret)

    def config(server_public_key: str | None) -> DatasetConfig:
        return DatasetConfig(
            "tcp://127.0.0.1:1", "alpha", seq_len=8, batch_size=1, rank=0, world_size=1,
            run="r1", server_public_key=server_public_key,
        )  # fmt: skip

    assert config(public).options.client_secret_key == secret
    # without a server key the variable is not used: a PLAIN or open server is still served
    assert config(None).options.client_secret_key is None
    monkeypatch.delenv("TOKENFEED_CLIENT_KEY")
    with pytest.raises(ConfigError, match="TOKENFEED_CLIENT_KEY"):
        config(public)
