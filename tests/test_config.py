"""The settings layer: one declaration per setting gives its flag, its ``TOKENFEED_*`` twin,
its default and its range; flags > environment > defaults; a bad value of either stops the
command with exit 2 and one line naming both spellings and the valid range.

The refusals run the real CLI as a subprocess (what an operator sees); precedence is checked
in-process on the real parser.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenfeed_server import config
from tokenfeed_server.cli import build_parser
from tokenfeed_server.config import (
    CacheSettings,
    Limits,
    MemorySettings,
    PrepareSettings,
    ServerConfig,
    StorageSettings,
)

CLI = [sys.executable, "-m", "tokenfeed_server.cli"]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENFEED_")}
    return env | extra


def _refused(tmp_path: Path, args: list[str], env: dict[str, str] | None = None) -> str:
    """Run the CLI; it must refuse with exit 2 and exactly one line; return that line."""
    r = subprocess.run(
        [*CLI, *args],
        env=_clean_env(**(env or {})),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert r.stdout == ""  # no ready line: nothing was started
    return lines[0]


# (flags, environment, the flag named, what a valid value is); the twin is named with it
SERVE_CASES = [
    (["--chunk-bytes", "0"], {}, "--chunk-bytes", "an integer >= 1 (got 0)"),
    (["--chunk-bytes", "lots"], {}, "--chunk-bytes", "an integer >= 1 (got lots)"),
    (["--max-tokens-per-s", "-1"], {}, "--max-tokens-per-s", "an integer >= 0 (got -1)"),
    ([], {"TOKENFEED_LOG_LEVEL": "loud"}, "--log-level",
     "one of debug, info, warning, error (got loud)"),
    (["--max-window", "0"], {}, "--max-window", "an integer >= 1 (got 0)"),
    ([], {"TOKENFEED_MAX_JOBS": "0"}, "--max-jobs", "an integer >= 1 (got 0)"),
    (["--max-connections-per-tenant", "-3"], {}, "--max-connections-per-tenant",
     "an integer >= 1 (got -3)"),
    (["--zmq-port", "65536"], {}, "--zmq-port", "an integer in 0..65535 (got 65536)"),
    ([], {"TOKENFEED_HTTP_PORT": "-1"}, "--http-port", "an integer in 0..65535 (got -1)"),
    (["--peer-timeout-s", "-1"], {}, "--peer-timeout-s", "a number > 0 (got -1)"),
    ([], {"TOKENFEED_JOB_TTL_S": "-5"}, "--job-ttl-s", "a number > 0 (got -5)"),
    ([], {"TOKENFEED_INSECURE": "maybe"}, "--insecure", "true or false"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "env", "flag", "valid"), SERVE_CASES)
def test_serve_refuses_a_bad_value_in_one_line(
    tmp_path: Path, flags: list[str], env: dict[str, str], flag: str, valid: str
) -> None:
    line = _refused(tmp_path, ["serve", "--store", str(tmp_path), *flags], env)
    twin = "TOKENFEED_" + flag[2:].upper().replace("-", "_")
    assert line.startswith(f"tokenfeed-server serve: error: {flag} / {twin}: must be {valid}")


SEEDS = "an integer in 0..18446744073709551615"
PREPARE_CASES = [
    (["--seed", "-1"], {}, "--seed", f"{SEEDS} (got -1)"),
    (["--seed", str(1 << 64)], {}, "--seed", f"{SEEDS} (got {1 << 64})"),
    ([], {"TOKENFEED_PREPARE_MEMORY_MB": "abc"}, "--memory-mb", "a number > 0 (got abc)"),
    (["--memory-mb", "0"], {}, "--memory-mb", "a number > 0 (got 0)"),
    (["--workers", "-2"], {}, "--workers", "an integer >= 0 (got -2)"),
    (["--shard-tokens", "0"], {}, "--shard-tokens", "an integer >= 1 (got 0)"),
    (["--bpe-train-mb", "-1"], {}, "--bpe-train-mb", "a number > 0 (got -1)"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "env", "flag", "valid"), PREPARE_CASES)
def test_prepare_refuses_a_bad_value_in_one_line(
    tmp_path: Path, flags: list[str], env: dict[str, str], flag: str, valid: str
) -> None:
    corpus = tmp_path / "a.txt"
    corpus.write_text("hello\n")
    args = ["prepare", str(corpus), "--store", str(tmp_path / "s"), "--dataset", "d", *flags]
    line = _refused(tmp_path, args, env)
    twin = "TOKENFEED_PREPARE_" + flag[2:].upper().replace("-", "_")
    assert line == f"tokenfeed-server prepare: error: {flag} / {twin}: must be {valid}"
    assert not (tmp_path / "s").exists()  # refused before anything was written


def test_missing_store_names_both_spellings(tmp_path: Path) -> None:
    line = _refused(tmp_path, ["serve"])
    assert "--store / TOKENFEED_STORE: required" in line


def test_a_bad_token_is_refused_without_echoing_it(tmp_path: Path) -> None:
    line = _refused(tmp_path, ["serve", "--store", str(tmp_path)], {"TOKENFEED_TOKEN": "hunter2"})
    assert "--token / TOKENFEED_TOKEN: a token must be 16-256 visible ASCII" in line
    assert "hunter2" not in line
    spaced = "a token with spaces in it"
    line = _refused(tmp_path, ["serve", "--store", str(tmp_path), "--admin-token", spaced], {})
    assert "--admin-token / TOKENFEED_ADMIN_TOKEN: a token must be" in line
    assert spaced not in line


def test_tokens_come_from_files(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("a-long-enough-token-0123\n")
    c = ServerConfig(store=str(tmp_path), token_file=tmp_path / "token")
    assert c.token == "a-long-enough-token-0123"
    with pytest.raises(ValueError, match="give --token or --token-file, not both"):
        ServerConfig(
            store=str(tmp_path), token="b-long-enough-token-0123", token_file=tmp_path / "token"
        )
    (tmp_path / "short").write_text("abc")
    with pytest.raises(ValueError, match="a token must be") as refused:
        ServerConfig(store=str(tmp_path), admin_token_file=tmp_path / "short")
    assert "abc" not in str(refused.value).replace("admin", "")


def test_help_shows_the_twin_the_range_and_the_real_default() -> None:
    r = subprocess.run(
        [*CLI, "serve", "--help"],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0
    text = " ".join(r.stdout.split())  # argparse wraps lines
    assert "[TOKENFEED_CHUNK_BYTES; an integer >= 1; default 4194304]" in text
    assert "[TOKENFEED_ZMQ_PORT; an integer in 0..65535; default 7400]" in text
    assert "[TOKENFEED_MAX_JOBS; an integer >= 1; default 256]" in text
    assert "--tenants PATH" in text and "[TOKENFEED_TENANTS_FILE; a path; default none]" in text


# ---------------------------------------------------------------------------- precedence


def _serve(monkeypatch: pytest.MonkeyPatch, argv: list[str], **env: str) -> ServerConfig:
    for name in list(os.environ):
        if name.startswith("TOKENFEED_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["serve", *argv])
    return config.load(ServerConfig, args)


def test_defaults_when_neither_flag_nor_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    c = _serve(monkeypatch, ["--store", "/s"])
    assert c == ServerConfig(store=Path("/s"))
    assert (c.zmq_port, c.http_port, c.chunk_bytes, c.limits) == (7400, 7401, 4 << 20, Limits())


def test_environment_beats_default_and_flag_beats_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {"TOKENFEED_STORE": "/env", "TOKENFEED_ZMQ_PORT": "5", "TOKENFEED_MAX_WINDOW": "3"}
    c = _serve(monkeypatch, [], **env)
    assert (c.store, c.zmq_port, c.limits.max_window) == ("/env", 5, 3)
    c = _serve(monkeypatch, ["--store", "/flag", "--zmq-port", "9", "--max-window", "4"], **env)
    assert (c.store, c.zmq_port, c.limits.max_window) == ("/flag", 9, 4)
    # a valid flag replaces its twin: the twin's bad value is never looked at
    c = _serve(monkeypatch, ["--store", "/s", "--chunk-bytes", "7"], TOKENFEED_CHUNK_BYTES="0")
    assert c.chunk_bytes == 7


def test_environment_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    c = _serve(
        monkeypatch,
        ["--store", "/s"],
        TOKENFEED_INSECURE="yes",
        TOKENFEED_VERIFY_CHECKSUMS="0",
        TOKENFEED_LOG_LEVEL="DEBUG",
        TOKENFEED_HOST="",  # empty: as if unset (compose passes unset variables that way)
        TOKENFEED_TENANTS_FILE="t.toml",
    )
    assert (c.insecure, c.verify_checksums, c.log_level) == (True, False, "debug")
    assert (c.host, c.tenants_file, c.auth_mode()) == ("127.0.0.1", Path("t.toml"), "tenants")


def test_switch_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    c = _serve(monkeypatch, ["--store", "/s", "--insecure", "--verify-checksums"])
    assert c.insecure and c.verify_checksums


def test_prepare_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("TOKENFEED_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("TOKENFEED_STORE", "/env")
    monkeypatch.setenv("TOKENFEED_PREPARE_MEMORY_MB", "12")
    args = build_parser().parse_args(["prepare", "x.txt", "--dataset", "d"])
    s = config.load(PrepareSettings, args)
    assert (s.store, s.memory_mb, s.seed, s.bpe_train_mb, s.workers) == ("/env", 12, 0, 64, 0)
    args = build_parser().parse_args(
        ["prepare", "x.txt", "--dataset", "d", "--memory-mb", "8", "--seed", str((1 << 64) - 1)]
    )
    s = config.load(PrepareSettings, args)
    assert (s.memory_mb, s.seed) == (8, (1 << 64) - 1)


def test_a_config_built_in_python_reads_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENFEED_ZMQ_PORT", "5")
    c = ServerConfig(store=Path("/s"), token="a-long-enough-token-0123")
    assert c.zmq_port == 7400
    assert "a-long-enough-token" not in repr(c)  # secrets stay out of reprs and logs
    assert "a-long-enough-token" not in str(c.public_view())
    with pytest.raises(ValueError, match="frozen"):
        c.zmq_port = 1


def test_every_setting_has_one_flag_and_one_twin() -> None:
    serve = config.settings_of(ServerConfig)
    flags = {s.flag for s in serve}
    # the CLI surface that compose.yaml, the README and the tests use
    assert flags == {
        "--store", "--host", "--zmq-port", "--http-port", "--chunk-bytes", "--peer-timeout-s",
        "--job-ttl-s", "--verify-checksums", "--log-level", "--tenants", "--token",
        "--admin-token", "--token-file", "--admin-token-file", "--insecure",
        "--curve-secret-key", "--max-tokens-per-s", "--http-header-timeout-s",
        "--http-max-connections", "--http-allowed-hosts", "--tls-cert-file", "--tls-key-file",
        "--cache-dir", "--cache-size", "--remote-scan-interval-s", "--max-open-shards",
        "--ring-door", "--ring-size", "--hello-timeout-s", "--max-unattached-connections",
        *(f"--{name.replace('_', '-')}" for name in Limits.model_fields),
        *(f"--{name.replace('_', '-')}" for name in CacheSettings.model_fields),
        *(f"--{name.replace('_', '-')}" for name in MemorySettings.model_fields),
        *(f"--{name.replace('_', '-')}" for name in StorageSettings.model_fields),
    }  # fmt: skip
    assert {s.env for s in serve} >= {"TOKENFEED_TENANTS_FILE", "TOKENFEED_CURVE_SECRET_KEY_FILE"}
    for model in (ServerConfig, PrepareSettings):
        found = config.settings_of(model)
        assert len({s.flag for s in found}) == len({s.env for s in found}) == len(found)
        assert all(s.field.description for s in found)
    prepare = {s.flag: s.env for s in config.settings_of(PrepareSettings)}
    assert prepare["--store"] == "TOKENFEED_STORE"
    assert prepare["--memory-mb"] == "TOKENFEED_PREPARE_MEMORY_MB"
