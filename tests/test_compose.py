"""The Docker image and compose stack, checked without a Docker engine.

- ``compose.yaml`` validates against the Compose Specification schema.
- ``docker/Dockerfile`` is parsed; the facts the stack relies on (stages, user, ports,
  volume, healthcheck, command, pins) are checked against it and against compose.yaml.
- The Dockerfile's own pip commands, extracted from it, build a fresh venv: the server
  runs there and torch is absent.
- The compose services' commands, extracted from compose.yaml, run as plain processes
  in compose's order: prepare, serve, healthcheck until ready, train; then resume.
- ``examples/demo.py`` runs end to end on a short schedule.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tokenfeed_server.launch import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT.parent / "shared" / "schemas" / "compose-spec.json"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "compose.yaml"
VENV_BIN = Path(sys.executable).parent  # has torch, both distributions and the CLI


# ---------------------------------------------------------------------------- parsing


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        assert found, f"stage {self.name} has no {keyword}"
        return found[-1]

    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for args in self.all("ENV"):
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                env[key] = value
        return env

    def pip_commands(self) -> list[list[str]]:
        """Each ``pip ...`` of a RUN, as argv, with RUN's own ``--mount`` options removed."""
        commands = []
        for args in self.all("RUN"):
            words = [w for w in shlex.split(args) if not w.startswith("--mount=")]
            if words and words[0] == "pip":
                commands.append(words)
        return commands


def parse_dockerfile(path: Path) -> list[Stage]:
    """Stages of a Dockerfile: continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", args, re.IGNORECASE)
            assert m, line
            stages.append(Stage(name=m.group(2) or str(len(stages)), base=m.group(1)))
        elif stages:
            stages[-1].instructions.append((keyword, args))
    return stages


def stages_by_name() -> dict[str, Stage]:
    return {s.name: s for s in parse_dockerfile(DOCKERFILE)}


def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def interpolate(value: str, environ: dict[str, str]) -> str:
    """Compose's ``${VAR:-default}`` and ``$$`` (enough for our file)."""

    def sub(m: re.Match[str]) -> str:
        return environ.get(m.group(1)) or (m.group(2) or "")

    value = re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", sub, value)
    return value.replace("$$", "$")


def service_env(service: dict[str, Any], environ: dict[str, str]) -> dict[str, str]:
    return {k: interpolate(str(v), environ) for k, v in service.get("environment", {}).items()}


def version_of(pyproject: Path) -> str:
    m = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.MULTILINE)
    assert m, pyproject
    return m.group(1)


# ---------------------------------------------------------------------------- static checks


def test_compose_validates_against_the_compose_spec() -> None:
    if not SCHEMA.exists():
        pytest.skip(f"no Compose Specification schema at {SCHEMA} (shared/ is not beside repo)")
    import jsonschema

    schema = json.loads(SCHEMA.read_text())
    # The file says draft-07 as ".../draft-07/schema" (no "#"), which jsonschema's lookup
    # does not recognise: name the draft instead of letting it guess.
    assert "draft-07" in schema["$schema"]
    jsonschema.Draft7Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose()), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_dockerfile_server_stage() -> None:
    stages = parse_dockerfile(DOCKERFILE)
    by_name = {s.name: s for s in stages}
    assert set(by_name) == {"build", "trainer-build", "trainer", "server"}
    server = stages[-1]
    assert server.name == "server", "the server must be the last stage: plain `docker build`"
    assert all(s.base.startswith("python:") and s.base.endswith("-slim") for s in stages)

    # Installs come from the build stage's wheels only, pinned to the repo's versions.
    [install] = server.pip_commands()
    assert "--no-index" in install
    assert install[-1] == f"tokenfeed-server=={version_of(ROOT / 'server/pyproject.toml')}"
    [trainer_lib] = [c for c in by_name["trainer"].pip_commands() if "--no-index" in c]
    assert trainer_lib[-1] == f"tokenfeed=={version_of(ROOT / 'client/pyproject.toml')}"
    assert not any("torch" in " ".join(c) for c in server.pip_commands())
    [wheel] = by_name["build"].pip_commands()
    assert wheel[:2] == ["pip", "wheel"] and wheel[-2:] == ["./client", "./server"]

    # .dockerignore sends only an allowlist to the builder: everything COPY needs is on it.
    allowed = {line[1:] for line in (ROOT / ".dockerignore").read_text().split() if line[:1] == "!"}
    for stage in stages:
        for args in stage.all("COPY"):
            if "--from=" not in args:
                assert shlex.split(args)[0] in allowed, f"COPY {args}: not in .dockerignore"

    user = server.last("USER")
    assert user not in ("root", "0") and not user.startswith("0:")
    env = server.env()
    assert env["TOKENFEED_STORE"] in json.loads(server.last("VOLUME"))
    assert env["TOKENFEED_HOST"] == "0.0.0.0"
    exposed = set(server.last("EXPOSE").split())
    assert exposed == {env["TOKENFEED_ZMQ_PORT"], env["TOKENFEED_HTTP_PORT"]}
    assert json.loads(server.last("CMD")) == ["tokenfeed-server", "serve"]
    health = server.last("HEALTHCHECK")
    assert "/readyz" in health and "urllib" in health and "curl" not in health


def test_compose_matches_the_dockerfile() -> None:
    spec = compose()
    services = spec["services"]
    assert set(services) == {"prepare", "server", "trainer"}
    stages = stages_by_name()
    # One build per image: prepare runs the image the server service builds.
    assert "build" not in services["prepare"]
    assert services["prepare"]["image"] == services["server"]["image"]
    assert services["prepare"]["pull_policy"] == "never"
    for name in ("server", "trainer"):
        assert services[name]["build"]["dockerfile"] == "docker/Dockerfile"
        assert services[name]["build"]["target"] == name and name in stages
        assert services[name]["pull_policy"] == "build"  # local tags: never pulled first

    # `docker compose up server` starts the server alone: nothing it depends on writes.
    server = services["server"]
    assert "depends_on" not in server
    # The demo trainer waits for a successful prepare (a failed one stops the demo) and a
    # healthy server.
    assert services["trainer"]["depends_on"] == {
        "prepare": {"condition": "service_completed_successfully", "required": True},
        "server": {"condition": "service_healthy", "required": True},
    }

    env = service_env(server, {})
    image_env = stages["server"].env()
    assert env["TOKENFEED_TOKEN"] == "tokenfeed-demo-token"  # the safe demo default
    assert service_env(server, {"TOKENFEED_TOKEN": "s3cret"})["TOKENFEED_TOKEN"] == "s3cret"
    assert service_env(services["trainer"], {})["TOKENFEED_TOKEN"] == "tokenfeed-demo-token"
    assert env["TOKENFEED_HOST"] == "0.0.0.0"
    # Published on loopback unless TOKENFEED_PUBLISH_ADDR opens them on purpose.
    published = [interpolate(p, {}).split(":") for p in server["ports"]]
    assert {addr for addr, _, _ in published} == {"127.0.0.1"}
    assert {target for _, _, target in published} == set(stages["server"].last("EXPOSE").split())
    opened = [interpolate(p, {"TOKENFEED_PUBLISH_ADDR": "0.0.0.0"}) for p in server["ports"]]
    assert all(p.startswith("0.0.0.0:") for p in opened)
    # The healthcheck is the image's (GET /readyz); compose only probes it more often.
    assert "test" not in server["healthcheck"]
    store = image_env["TOKENFEED_STORE"]
    volumes = {name: [interpolate(v, {}) for v in services[name]["volumes"]] for name in services}
    assert volumes["prepare"] == [f"store:{store}"]
    # the server's ring door, on a volume the trainer shares (shared-memory rings)
    door = env["TOKENFEED_RING_DOOR"]
    assert volumes["server"] == [f"store:{store}", f"rings:{door}"]
    assert volumes["trainer"] == [f"rings:{door}"]
    assert service_env(services["trainer"], {})["TOKENFEED_SHARED_MEMORY"] == "1"
    assert any(f"mkdir -p /data/store {door}" in run for run in stages["server"].all("RUN"))
    endpoint = service_env(services["trainer"], {})["TOKENFEED_ENDPOINT"]
    assert endpoint == f"tcp://server:{env['TOKENFEED_ZMQ_PORT']}"


def compose_config(environ: dict[str, str]) -> dict[str, Any]:
    """``docker compose config`` of compose.yaml: the model compose itself would run."""
    if shutil.which("docker") is None:
        pytest.skip("no docker client: compose's own interpolation is not available")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENFEED_")}
    done = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**env, **environ},
    )
    # a docker client without the Compose v2 plugin says one or the other
    no_plugin = ("'compose' is not a docker command", "unknown shorthand flag: 'f'")
    if done.returncode != 0 and any(s in done.stderr for s in no_plugin):
        pytest.skip("the docker client has no Compose v2 plugin")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert isinstance(data, dict)
    return data


def test_compose_scales_the_server_with_port_ranges_on_loopback() -> None:
    # Plain `docker compose up`: the documented host ports, exactly, on loopback.
    server = compose_config({})["services"]["server"]
    ports = {(p["host_ip"], p["published"], p["target"]) for p in server["ports"]}
    assert ports == {("127.0.0.1", "7400", 7400), ("127.0.0.1", "7401", 7401)}
    # Replicas are told apart by compose's index, never by a fixed name: a container_name
    # or hostname would make `--scale server=3` fail, and the trainer must address the
    # service name, which Docker's DNS resolves to every replica.
    assert "container_name" not in server and "hostname" not in server
    trainer = compose_config({})["services"]["trainer"]
    assert trainer["environment"]["TOKENFEED_ENDPOINT"] == "tcp://server:7400"

    # `--scale server=3`, as compose.yaml and the README say: one range per port, still on
    # loopback, the container ports unchanged.
    scaled = compose_config(
        {"TOKENFEED_ZMQ_PUBLISH": "7400-7409", "TOKENFEED_HTTP_PUBLISH": "7410-7419"}
    )["services"]["server"]
    ports = {(p["host_ip"], p["published"], p["target"]) for p in scaled["ports"]}
    assert ports == {("127.0.0.1", "7400-7409", 7400), ("127.0.0.1", "7410-7419", 7401)}
    text = COMPOSE.read_text()
    assert "TOKENFEED_ZMQ_PUBLISH=7400-7409 TOKENFEED_HTTP_PUBLISH=7410-7419" in text
    assert "docker compose up --scale server=3" in text


def test_dockerfile_builds_without_a_registry_frontend_or_a_fixed_torch_source() -> None:
    text = DOCKERFILE.read_text()
    # The built-in frontend: a `syntax` directive would pull a frontend image at build time.
    assert not re.search(r"^#\s*syntax\s*=", text, re.MULTILINE | re.IGNORECASE)
    assert "BuildKit" in text.split("\nARG ", 1)[0]  # the header says what it needs
    stages = stages_by_name()
    assert stages["server"].base == "python:${PYTHON_VERSION}-slim"
    assert stages["trainer"].base == "python:${TRAINER_PYTHON_VERSION}-slim"
    assert stages["trainer-build"].base == stages["trainer"].base
    [torch] = [c for c in stages["trainer"].pip_commands() if any("torch" in w for w in c)]
    assert "${TORCH_PIP_SOURCE}" in torch and not any("://" in w for w in torch)
    assert any(a.startswith("TORCH_PIP_SOURCE=") for a in stages["trainer"].all("ARG"))


# ---------------------------------------------------------------------------- processes


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENFEED_", "PYTHON"))}
    env.pop("VIRTUAL_ENV", None)
    env.update(extra)
    return env


def serve(command: list[str], env: dict[str, str], log: Path) -> ServerProcess:
    """A ``serve`` process from its exact command line, awaited on its ready line."""
    return ServerProcess(command=command, env=env, log_path=log).start()


@pytest.fixture
def stopping() -> Iterator[list[ServerProcess]]:
    servers: list[ServerProcess] = []
    yield servers
    for s in servers:
        s.stop()


def run(argv: list[str], *, env: dict[str, str], timeout: float, **kw: Any) -> str:
    done = subprocess.run(
        argv, env=env, timeout=timeout, capture_output=True, text=True, check=False, **kw
    )
    assert done.returncode == 0, f"{argv} -> {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def small_corpus(path: Path) -> Path:
    path.mkdir()
    for i in range(40):
        (path / f"doc{i}.txt").write_text(f"document {i}: " + "tokens for the feed. " * 200)
    return path


def in_image(path: str, base: Path) -> Path:
    """A path the Dockerfile uses (``/wheels``), moved under ``base``."""
    return base / path.lstrip("/")


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_dockerfile_install_runs_the_server_without_torch(
    tmp_path: Path, stopping: list[ServerProcess]
) -> None:
    stages = stages_by_name()
    # COPY client/ server/ into a clean source tree, as the image build does.
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("*.egg-info", "__pycache__", "build")  # .dockerignore
    for part in ("client", "server"):
        shutil.copytree(ROOT / part, src / part, ignore=ignore)

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    python = str(env_dir / "bin" / "python")
    env = clean_env(PATH=f"{env_dir / 'bin'}:{os.environ['PATH']}")

    def as_local(cmd: list[str]) -> list[str]:
        # The image's `pip` is its Python's; paths of the image move under tmp_path.
        out = [python, "-m", "pip"]
        for word in cmd[1:]:
            key, eq, value = word.partition("=")
            if value.startswith("/"):
                out.append(f"{key}{eq}{in_image(value, tmp_path)}")
            elif word.startswith("/"):
                out.append(str(in_image(word, tmp_path)))
            else:
                out.append(word)
        return out

    [wheel] = stages["build"].pip_commands()
    run(as_local(wheel), env=env, timeout=240, cwd=src)
    [install] = stages["server"].pip_commands()
    run(as_local(install), env=env, timeout=120, cwd=tmp_path)

    no_torch = subprocess.run(
        [python, "-c", "import torch"], env=env, capture_output=True, check=False
    )
    assert no_torch.returncode != 0 and b"No module named 'torch'" in no_torch.stderr

    cli = str(env_dir / "bin" / "tokenfeed-server")
    store = tmp_path / "store"
    corpus = small_corpus(tmp_path / "corpus")
    run(
        [cli, "prepare", str(corpus), "--store", str(store), "--dataset", "d", "--no-progress"],
        env=env,
        timeout=60,
    )
    image_env = stages["server"].env()
    serve_env = clean_env(**{**env, **image_env, "TOKENFEED_STORE": str(store)})
    # Loopback and OS-assigned ports here; the image listens on 0.0.0.0:7400/7401.
    serve_env |= {
        "TOKENFEED_HOST": "127.0.0.1",
        "TOKENFEED_ZMQ_PORT": "0",
        "TOKENFEED_HTTP_PORT": "0",
    }
    server = serve(
        [cli, *json.loads(stages["server"].last("CMD"))[1:]], serve_env, tmp_path / "serve.log"
    )
    stopping.append(server)
    # The image's own HEALTHCHECK command, with the port the server bound.
    health = json.loads(stages["server"].last("HEALTHCHECK").split("CMD", 1)[1])
    assert health[0] == "python"
    run(
        [python, *health[1:]],
        env={**serve_env, "TOKENFEED_HTTP_PORT": str(server.http_port)},
        timeout=30,
    )
    # The status page's files ship in the wheel (package data), not only in the tree.
    page = httpx.get(server.http + "/", timeout=10)
    assert page.status_code == 200 and "console/console.js" in page.text
    for asset in ("console/console.js", "console/console.css"):
        assert httpx.get(f"{server.http}/{asset}", timeout=10).status_code == 200, asset
    assert "site-packages" in run(
        [python, "-c", "import tokenfeed_server.http.console as c; print(c.__file__)"],
        env=env,
        timeout=30,
    )
    assert server.stop() == 0


def compose_argv(command: list[str], steps: str | None = None) -> list[str]:
    """A compose ``command`` as argv here: ``$$`` unescaped, ``python`` is this one."""
    argv = [interpolate(word, {}) for word in command]
    if argv[0] == "python":
        argv[0] = sys.executable
    if steps is not None:
        argv[argv.index("--steps") + 1] = steps
    return argv


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compose_services_run_as_processes_in_order(
    tmp_path: Path, stopping: list[ServerProcess]
) -> None:
    spec = compose()["services"]
    image_env = stages_by_name()["server"].env()
    base = clean_env(PATH=f"{VENV_BIN}:{os.environ['PATH']}")
    store = tmp_path / "store"
    store.mkdir()  # the volume exists before the first container starts

    # prepare: the demo dataset (stdlib sources, byte tokenizer: seconds) into the store.
    prepare_env = {**base, **image_env, "TOKENFEED_STORE": str(store)}
    prepare = compose_argv(spec["prepare"]["command"])
    out = run(prepare, env=prepare_env, timeout=120, cwd=tmp_path)
    assert "prepared" in out and (store / "demo" / "manifest.json").exists()
    # Again, as a second `docker compose up` does on an existing store: writes nothing.
    before = sorted(p.name for p in store.iterdir())
    out = run(prepare, env=prepare_env, timeout=60, cwd=tmp_path)
    assert "demo not prepared" in out and sorted(p.name for p in store.iterdir()) == before

    # server: the image's CMD with the image's and the service's environment, on loopback.
    server_env = {**prepare_env, **service_env(spec["server"], {})}
    server_env |= {
        "TOKENFEED_HOST": "127.0.0.1",
        "TOKENFEED_ZMQ_PORT": "0",
        "TOKENFEED_HTTP_PORT": "0",
    }
    cmd = json.loads(stages_by_name()["server"].last("CMD"))
    server = serve(cmd, server_env, tmp_path / "serve.log")
    stopping.append(server)

    # The image's healthcheck (the service keeps it), with the port the server bound.
    health = json.loads(stages_by_name()["server"].last("HEALTHCHECK").split("CMD", 1)[1])
    run(
        compose_argv(health),
        env={**base, "TOKENFEED_HTTP_PORT": str(server.http_port)},
        timeout=30,
    )

    # trainer: the service's command and environment, pointed at this server, few steps.
    trainer_env = {**base, **service_env(spec["trainer"], {}), "TOKENFEED_ENDPOINT": server.zmq}
    train = compose_argv(spec["trainer"]["command"], steps="6")
    ckpt = tmp_path / "ckpt.pt"
    out = run(
        [*train, "--log-every", "2", "--checkpoint", str(ckpt)],
        env=trainer_env,
        timeout=150,
        cwd=ROOT,
    )
    losses = [float(x) for x in re.findall(r"step +\d+ +loss (\d+\.\d+)", out)]
    assert len(losses) >= 3 and "tokens/s" in out, out
    # Resume: model, optimizer and loader position come back from the checkpoint.
    out = run(
        [
            *compose_argv(spec["trainer"]["command"], steps="8"),
            "--log-every",
            "2",
            "--checkpoint",
            str(ckpt),
            "--resume",
            "--num-workers",
            "1",
        ],
        env=trainer_env,
        timeout=150,
        cwd=ROOT,
    )
    assert "at step 6" in out and re.search(r"step +8 +loss", out), out
    assert server.stop() == 0


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    env = clean_env(PATH=f"{VENV_BIN}:{os.environ['PATH']}")
    demo = [sys.executable, str(ROOT / "examples" / "demo.py"), "--store", str(tmp_path / "s")]
    out = run([*demo, "--steps", "40", "--log-every", "20"], env=env, timeout=240, cwd=tmp_path)
    losses = [float(x) for x in re.findall(r"step +\d+ +loss (\d+\.\d+)", out)]
    assert len(losses) >= 2 and losses[-1] < losses[0], out
    assert "server stopped (exit status 0)" in out, out
    # A second run finds the dataset and does not prepare again.
    out = run([*demo, "--steps", "2", "--log-every", "1"], env=env, timeout=120, cwd=tmp_path)
    assert "already in" in out, out
