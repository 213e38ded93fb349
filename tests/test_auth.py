"""The tenants file: one strict schema, and every refusal names the tenant and the field.

Real TOML files in a temporary directory, read by :meth:`Tenants.load`; one case goes
through the real CLI to show the operator's view (exit 2, one line, no traceback).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tokenfeed.errors import ConfigError
from tokenfeed_server.dataplane.auth import Tenants, token_digest

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-fedcba9876543210xyz"
ADMIN = "admin-token-zyxwvutsrqponmlkj"


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "t.toml"
    path.write_text(text)
    return path


def _refusal(tmp_path: Path, text: str) -> str:
    path = _file(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        Tenants.load(path)
    message = str(info.value)
    assert message.startswith(f"tenants file {path}: ")
    assert "\n" not in message
    return message


ALICE_BARE = f'[[tenant]]\nname = "alice"\ntoken = "{ALICE}"\n'
ALICE_OK = ALICE_BARE + 'datasets = ["web-*"]\n'


def test_a_valid_file_loads_every_field(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        f'admin_token_sha256 = "{token_digest(ADMIN)}"\n'
        + ALICE_OK
        + "max_connections = 3\nweight = 2\n"
        + f'[[tenant]]\nname = "bob"\ntoken_sha256 = "{token_digest(BOB)}"\n',
    )
    tenants = Tenants.load(path)
    alice, bob = tenants.by_name["alice"], tenants.by_name["bob"]
    assert tenants.authenticate(ALICE) == alice and tenants.authenticate(BOB) == bob
    assert tenants.authenticate("not-a-token-of-anyone") is None
    assert tenants.is_admin(ADMIN) and not tenants.is_admin(ALICE)
    assert alice.may_read("web-v1") and not alice.may_read("code")
    assert (alice.max_connections, alice.weight) == (3, 2.0)
    # no CURVE key without the server's secret key (tests/test_curve_keys.py); a clear
    # token implies only the version 1 key, kept to recognise (and refuse) old clients
    assert alice.curve_public_key is None and alice.legacy_curve_key is not None
    # no datasets given: the tenant reads nothing until the operator says what
    assert bob.datasets == () and not bob.may_read("web-v1")
    assert (bob.max_connections, bob.weight, bob.legacy_curve_key) == (None, 1.0, None)


def test_a_string_of_datasets_is_refused_not_read_letter_by_letter(tmp_path: Path) -> None:
    # read as a sequence, "web-*" would have granted "*", every dataset of the store
    message = _refusal(tmp_path, ALICE_BARE + 'datasets = "web-*"\n')
    assert message.endswith(
        "tenant 'alice': datasets: must be a list of name patterns, got a string"
    )


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            'datasets = ["web-*", 3]',
            "tenant 'alice': datasets: must be a list of name patterns, got an integer at "
            "position 2",
        ),
        (
            'datasets = [""]',
            "tenant 'alice': datasets: must be a list of name patterns, got an empty string at "
            "position 1",
        ),
        ("weight = 0", "tenant 'alice': weight: must be a number > 0, got 0"),
        ("weight = -1.5", "tenant 'alice': weight: must be a number > 0, got -1.5"),
        ("weight = inf", "tenant 'alice': weight: must be a number > 0, got inf"),
        ('weight = "2"', "tenant 'alice': weight: must be a number > 0, got a string"),
        ("max_connections = 0", "tenant 'alice': max_connections: must be an integer >= 1"),
        ("max_connections = 2.5", "tenant 'alice': max_connections: must be an integer >= 1"),
        ("colour = 'red'", "tenant 'alice': colour: unknown key (known: name, token,"),
    ],
)
def test_bad_tenant_fields_are_named(tmp_path: Path, extra: str, expected: str) -> None:
    base = ALICE_BARE if extra.startswith("datasets") else ALICE_OK
    assert expected in _refusal(tmp_path, base + extra + "\n")


def test_token_digests_are_checked_everywhere(tmp_path: Path) -> None:
    message = _refusal(tmp_path, '[[tenant]]\nname = "bob"\ntoken_sha256 = "ABC"\n')
    assert "tenant 'bob': token_sha256: must be 64 lowercase hex digits" in message
    upper = token_digest(BOB).upper()
    message = _refusal(tmp_path, f'[[tenant]]\nname = "bob"\ntoken_sha256 = "{upper}"\n')
    assert "tenant 'bob': token_sha256:" in message and upper not in message
    # the admin digest was never checked: a typo silently meant "no admin"
    message = _refusal(tmp_path, 'admin_token_sha256 = "not-a-digest"\n' + ALICE_OK)
    assert "admin_token_sha256: must be 64 lowercase hex digits" in message


def test_tokens(tmp_path: Path) -> None:
    message = _refusal(tmp_path, '[[tenant]]\nname = "alice"\ntoken = "short"\n')
    assert "tenant 'alice': token: must be 16-256 visible ASCII characters" in message
    assert "short" not in message.split("token:")[1]  # a token is never echoed
    # one rule on every port: a space or a non-ASCII letter passes ZeroMQ but not HTTP
    for bad in ("a token with spaces in it", "tökentökentökentöken"):
        message = _refusal(tmp_path, f'[[tenant]]\nname = "alice"\ntoken = "{bad}"\n')
        assert "visible ASCII" in message and bad not in message
    both = (
        f'[[tenant]]\nname = "alice"\ntoken = "{ALICE}"\ntoken_sha256 = "{token_digest(ALICE)}"\n'
    )
    assert "tenant 'alice': give exactly one of token or token_sha256" in _refusal(tmp_path, both)
    neither = '[[tenant]]\nname = "alice"\ndatasets = ["x"]\n'
    assert "tenant 'alice': give exactly one of token or token_sha256" in _refusal(
        tmp_path, neither
    )
    shared = ALICE_OK + f'[[tenant]]\nname = "eve"\ntoken_sha256 = "{token_digest(ALICE)}"\n'
    message = _refusal(tmp_path, shared)
    assert "tenant 'eve': token: the same token as tenant 'alice'" in message


def test_names(tmp_path: Path) -> None:
    twice = ALICE_OK + f'[[tenant]]\nname = "alice"\ntoken = "{BOB}"\n'
    assert "tenant 'alice': name: used by two tenants" in _refusal(tmp_path, twice)
    nameless = f'[[tenant]]\ntoken = "{ALICE}"\n'
    assert "tenant #1: name: required" in _refusal(tmp_path, nameless)
    empty = f'[[tenant]]\nname = ""\ntoken = "{ALICE}"\n'
    assert "tenant #1: name: must be a non-empty string" in _refusal(tmp_path, empty)


def test_the_file_as_a_whole(tmp_path: Path) -> None:
    # a misspelt top-level key was silently ignored
    message = _refusal(tmp_path, 'admin_token = "x"\n' + ALICE_OK)
    assert "admin_token: unknown key (known: admin_token_sha256, tenant)" in message
    message = _refusal(tmp_path, '[[tenants]]\nname = "alice"\n')
    assert "tenants: unknown key" in message
    assert "defines no [[tenant]] entries" in _refusal(tmp_path, "")
    assert "tenant: must be a list of [[tenant]] tables" in _refusal(tmp_path, 'tenant = "a"\n')
    assert "tenant #1: must be a table" in _refusal(tmp_path, 'tenant = ["alice"]\n')
    assert "not valid TOML" in _refusal(tmp_path, "[[tenant]\n")


def test_shared_token_tenant_reads_everything() -> None:
    tenants = Tenants.shared_token(ALICE, ADMIN)
    tenant = tenants.authenticate(ALICE)
    assert tenant is not None and tenant.may_read("anything")
    assert tenants.is_admin(ADMIN)


def test_the_cli_refuses_a_bad_tenants_file_in_one_line(tmp_path: Path) -> None:
    path = _file(tmp_path, f'[[tenant]]\nname = "alice"\ntoken = "{ALICE}"\ndatasets = "web-*"\n')
    r = subprocess.run(
        [sys.executable, "-m", "tokenfeed_server.cli", "serve", "--store", str(tmp_path),
         "--tenants", str(path), "--zmq-port", "0", "--http-port", "0"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert "tenant 'alice': datasets: must be a list of name patterns, got a string" in lines[-1]
    assert ALICE not in r.stderr
