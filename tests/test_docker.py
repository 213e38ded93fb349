"""The Docker images and the compose stack on a real Docker engine.

Built with the project's own ``docker/Dockerfile`` and ``compose.yaml`` (copied with the
sources when the test starts); what differs on a machine with no registry and no torch
index comes in only through ``tests/docker/compose.test.yaml`` (build arguments) and the
local ``python:*-slim`` stand-ins that ``../shared/docker/engine-setup.sh`` builds. Runs
where ``docker info`` answers (``.ci/run`` starts an engine with that script first);
skips otherwise.

- ``docker compose up``: prepare, a healthy server, the trainer's loss falling, the
  trainer exiting 0, ports on loopback; Ctrl-C ends it; ``down`` and a second ``up``
  rebuild nothing and keep the store.
- ``docker compose up server`` on an empty host directory writes nothing into it but its
  lease (``_tokenfeed/leases/``, for ``gc``), and
  serves a dataset prepared while it runs; the server image has no torch, runs as
  non-root, turns healthy by its own HEALTHCHECK and exits 0 on ``docker stop``.
- A store the image's user cannot write stops the demo with one clear line.
- ``docker compose up --scale server=3`` with the ports published as loopback ranges: the
  trainer exits 0 and more than one replica served its job.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

BUILD_TIMEOUT = 1200  # a cold build on two loaded cores: torch alone is minutes
RUN_TIMEOUT = 600
# Whichever test comes first builds the images (the module fixture), inside its timeout.
pytestmark = [
    pytest.mark.docker,
    pytest.mark.slow,
    pytest.mark.timeout(BUILD_TIMEOUT + 2 * RUN_TIMEOUT),
]

ROOT = Path(__file__).resolve().parents[1]
OVERRIDE = ROOT / "tests" / "docker" / "compose.test.yaml"
ENGINE_SETUP = ROOT.parent / "shared" / "docker" / "engine-setup.sh"
SERVER_IMAGE = "tokenfeed-server:dev"
TRAINER_IMAGE = "tokenfeed-trainer:dev"
TOKEN = "tokenfeed-demo-token"
UID = "10001"


def sh(argv: list[str], *, timeout: float, check: bool = True, **kw: object) -> str:
    """Run a command; its stdout, or a failure that shows stdout and stderr."""
    done = subprocess.run(  # type: ignore[call-overload]
        argv, capture_output=True, text=True, timeout=timeout, check=False, **kw
    )
    if check and done.returncode != 0:
        pytest.fail(f"{argv} -> {done.returncode}\n{done.stdout}\n{done.stderr}")
    return str(done.stdout)


def engine_error() -> str | None:
    """Why no engine can be used, or None."""
    try:
        done = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        return f"no docker client or engine ({exc})"
    if done.returncode != 0:
        return f"no Docker engine reachable: {done.stderr.strip()[:200]}"
    compose = subprocess.run(
        ["docker", "compose", "version"], capture_output=True, text=True, timeout=30, check=False
    )
    if compose.returncode != 0:
        return "the docker client has no Compose v2 plugin"
    return None


def setup_values() -> dict[str, str]:
    """engine-setup.sh's KEY=VALUE lines (it is idempotent: quick once the engine runs)."""
    if not ENGINE_SETUP.exists():
        return {}
    out = sh(["bash", str(ENGINE_SETUP)], timeout=900)
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


class WheelServer:
    """A loopback HTTP server of one wheel directory: the build's ``--find-links``."""

    def __init__(self, directory: Path) -> None:
        handler = functools.partial(_QuietHandler, directory=str(directory))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Project:
    """One compose project of the test: its own name, store, ports and clean-up."""

    files: list[Path]
    env: dict[str, str]
    name: str = field(default_factory=lambda: f"tftest-{uuid.uuid4().hex[:10]}")

    def argv(self, *args: str) -> list[str]:
        files = [a for f in self.files for a in ("-f", str(f))]
        return ["docker", "compose", "-p", self.name, *files, *args]

    def run(self, *args: str, timeout: float = RUN_TIMEOUT, check: bool = True) -> str:
        return sh(self.argv(*args), timeout=timeout, check=check, env=self.env, cwd=ROOT)

    def completed(
        self, *args: str, timeout: float = RUN_TIMEOUT
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=self.env,
            cwd=ROOT,
        )

    def container(self, service: str) -> dict[str, object]:
        """``docker inspect`` of the service's one container (running or not)."""
        ids = self.run("ps", "-a", "-q", service, timeout=60).split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        [info] = json.loads(sh(["docker", "inspect", ids[0]], timeout=60))
        assert isinstance(info, dict)
        return info

    def services_created(self) -> set[str]:
        return set(self.run("ps", "-a", "--services", timeout=60).split())

    def down(self) -> None:
        self.run("down", "-v", "--remove-orphans", "--timeout", "20", timeout=120, check=False)


class Attached:
    """``docker compose up`` in the foreground, its output read by a thread."""

    def __init__(self, project: Project, *args: str) -> None:
        self.proc = subprocess.Popen(
            project.argv("up", *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=project.env,
            cwd=ROOT,
            start_new_session=True,  # our SIGINT is the operator's Ctrl-C, to compose only
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for line in self.proc.stdout:
                self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first output line (from now) matching ``pattern``; fails on EOF or timeout."""
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(f"no {pattern!r} in {timeout}s:\n{self.text}")
            if line is None:
                pytest.fail(f"compose ended without {pattern!r}:\n{self.text}")
            self.seen.append(line)
            m = re.search(pattern, line)
            if m:
                return m

    def stop(self, timeout: float = 120) -> int:
        """Ctrl-C, as an operator ends the demo; compose's exit status."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait(timeout=30)
        self.drain()
        return code

    def drain(self) -> None:
        while True:
            try:
                line = self.lines.get(timeout=5)
            except queue.Empty:
                return
            if line is None:
                return
            self.seen.append(line)

    @property
    def text(self) -> str:
        return "".join(self.seen)


# ---------------------------------------------------------------------------- fixtures


@dataclass
class Stack:
    files: list[Path]
    env: dict[str, str]

    def project(self, **extra: str) -> Project:
        return Project(self.files, {**self.env, **extra})


def snapshot(into: Path) -> Path:
    """compose.yaml, the Dockerfile and what it copies, as they are now, under ``into``."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for part in ("client", "server", "examples", "docker"):
        shutil.copytree(ROOT / part, into / part, ignore=skip)
    for name in ("compose.yaml", ".dockerignore"):
        shutil.copy2(ROOT / name, into / name)
    return into


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The engine, the build inputs and the images, built once by compose."""
    reason = engine_error()
    if reason is not None:
        pytest.skip(f"{reason}; .ci/run starts one with ../shared/docker/engine-setup.sh")
    values = setup_values()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENFEED_")}
    env["COMPOSE_ANSI"] = "never"
    env["COMPOSE_PROGRESS"] = "plain"
    # A snapshot of what the build reads: edits to the working tree while the test runs
    # would otherwise rebuild the images and fail the "rebuilds nothing" check.
    context = snapshot(tmp_path_factory.mktemp("context"))
    files = [context / "compose.yaml"]
    wheels: WheelServer | None = None
    wheel_dir = Path(values.get("TORCH_WHEEL_DIR", ""))
    if values.get("TORCH_WHEEL_DIR") and any(wheel_dir.glob("torch-*.whl")):
        wheels = WheelServer(wheel_dir)
        files.append(OVERRIDE)
        env["TOKENFEED_TEST_TORCH_URL"] = wheels.url
        env["TOKENFEED_TEST_TRAINER_PYTHON"] = values.get("TRAINER_PYTHON_VERSION", "3.11")
    built = Stack(files, env)
    try:
        Project(files, env, name="tftest-build").run("build", timeout=BUILD_TIMEOUT)
        yield built
    finally:
        if wheels is not None:
            wheels.close()


def free_range(n: int) -> tuple[int, int]:
    """``n`` consecutive free loopback ports: a range to publish replicas on."""
    for _ in range(100):
        first = free_port()
        if first + n > 65536:
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + n):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return first, first + n - 1
    pytest.fail(f"no {n} consecutive free ports on 127.0.0.1")


def ports() -> dict[str, str]:
    return {
        "TOKENFEED_ZMQ_PUBLISH": str(free_port()),
        "TOKENFEED_HTTP_PUBLISH": str(free_port()),
    }


def image_id(ref: str) -> str:
    return sh(["docker", "image", "inspect", "-f", "{{.Id}}", ref], timeout=60).strip()


def exit_code(info: dict[str, object]) -> int:
    state = info["State"]
    assert isinstance(state, dict)
    return int(state["ExitCode"])


# ---------------------------------------------------------------------------- tests


@pytest.mark.timeout(BUILD_TIMEOUT + 3 * RUN_TIMEOUT)
def test_demo_up_trains_then_a_second_up_rebuilds_nothing(stack: Stack) -> None:
    # Fewer steps than the default 300: the loss falls by far more than 1 in the first 100.
    project = stack.project(TOKENFEED_DEMO_STEPS="100", **ports())
    try:
        up = Attached(project)
        try:
            up.wait_for(r"prepare-1 +\| prepared /data/store/demo", RUN_TIMEOUT)
            up.wait_for(r"prepare-1 exited with code 0", 60)
            first = up.wait_for(r"trainer-1 +\| step +\d+ +loss (\d+\.\d+)", RUN_TIMEOUT)
            done = up.wait_for(r"trainer-1 +\| done: .* loss (\d+\.\d+) -> (\d+\.\d+)", RUN_TIMEOUT)
            up.wait_for(r"trainer-1 exited with code 0", 60)
            # The server is a service: still up, healthy, published on loopback only.
            server = project.container("server")
            state = server["State"]
            assert isinstance(state, dict)
            assert state["Running"] and state["Health"]["Status"] == "healthy"
            bindings = server["HostConfig"]["PortBindings"]  # type: ignore[index]
            assert {b["HostIp"] for v in bindings.values() for b in v} == {"127.0.0.1"}
        finally:
            code = up.stop()
        losses = [
            float(x) for x in re.findall(r"trainer-1 +\| step +\d+ +loss (\d+\.\d+)", up.text)
        ]
        assert float(first.group(1)) == losses[0]
        assert losses[-1] < losses[0] - 1.0, up.text
        assert float(done.group(2)) < float(done.group(1)), up.text
        assert code in (0, 130), up.text  # Ctrl-C after the trainer: a clean stop
        assert exit_code(project.container("server")) == 0  # SIGTERM: clean shutdown

        # Taken now, not before the first up: compose labels the images it builds with the
        # project name, so this project's first up rebuilt the fixture's images once.
        images = {ref: image_id(ref) for ref in (SERVER_IMAGE, TRAINER_IMAGE)}
        # down keeps the named volume; a second up builds nothing and prepares nothing.
        project.run("down", "--timeout", "20")
        second = Project(project.files, {**project.env, "TOKENFEED_DEMO_STEPS": "20"}, project.name)
        up = Attached(second)
        try:
            up.wait_for(r"prepare-1 +\| store has datasets; demo not prepared", RUN_TIMEOUT)
            up.wait_for(r"trainer-1 +\| step +20 +loss", RUN_TIMEOUT)
            up.wait_for(r"trainer-1 exited with code 0", 60)
        finally:
            up.stop()
        assert {ref: image_id(ref) for ref in images} == images

        # The one-shot form: ends with the trainer, with its exit status.
        once = second.completed("run", "--rm", "trainer")
        assert once.returncode == 0, once.stdout + once.stderr
        assert re.search(r"done: 20 steps", once.stdout), once.stdout
    finally:
        project.down()


def test_up_scaled_to_three_servers_trains_across_replicas(stack: Stack) -> None:
    # As compose.yaml documents it: one host port range per container port, on loopback.
    zmq, http = free_range(3), free_range(3)
    while set(range(zmq[0], zmq[1] + 1)) & set(range(http[0], http[1] + 1)):
        http = free_range(3)
    project = stack.project(
        TOKENFEED_DEMO_STEPS="20",
        TOKENFEED_ZMQ_PUBLISH=f"{zmq[0]}-{zmq[1]}",
        TOKENFEED_HTTP_PUBLISH=f"{http[0]}-{http[1]}",
    )
    try:
        # Detached: compose still starts the trainer only after prepare and every replica.
        project.run("up", "--detach", "--scale", "server=3")
        [trainer] = project.run("ps", "-a", "-q", "trainer", timeout=60).split()
        code = sh(["docker", "wait", trainer], timeout=RUN_TIMEOUT).strip()
        logs = project.run("logs", "--no-color", "trainer", timeout=60)
        assert code == "0", logs
        assert re.search(r"done: 20 steps", logs), logs

        servers = project.run("ps", "-q", "server", timeout=60).split()
        assert len(servers) == 3
        published: dict[str, set[int]] = {"7400/tcp": set(), "7401/tcp": set()}
        for cid in servers:
            [info] = json.loads(sh(["docker", "inspect", cid], timeout=60))
            assert info["State"]["Health"]["Status"] == "healthy"
            for port, bound in info["NetworkSettings"]["Ports"].items():
                assert {b["HostIp"] for b in bound} == {"127.0.0.1"}, info["NetworkSettings"]
                published[port] |= {int(b["HostPort"]) for b in bound}
        assert len(published["7400/tcp"]) == 3 and len(published["7401/tcp"]) == 3
        assert all(zmq[0] <= p <= zmq[1] for p in published["7400/tcp"])
        assert all(http[0] <= p <= http[1] for p in published["7401/tcp"])

        # The trainer's two loader workers started on two different replicas, as the
        # client spreads them: each replica's /v1/jobs shows what it served of the one job.
        auth = {"Authorization": f"Bearer {TOKEN}"}
        served: dict[int, list[dict[str, object]]] = {}
        for index in (1, 2, 3):
            address = project.run("port", "--index", str(index), "server", "7401", timeout=60)
            host, _, port = address.strip().rpartition(":")
            assert host == "127.0.0.1" and int(port) in published["7401/tcp"], address
            jobs = httpx.get(f"http://{address.strip()}/v1/jobs", headers=auth, timeout=10)
            served[index] = [
                j for j in jobs.json() if j["dataset"] == "demo" and j["batches_served"]
            ]
        busy = {i: jobs for i, jobs in served.items() if jobs}
        assert len(busy) >= 2, served
        assert len({j["id"] for jobs in busy.values() for j in jobs}) == 1, served
    finally:
        project.down()


def test_up_server_alone_writes_only_its_lease_and_serves_a_dataset_prepared_later(
    stack: Stack, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    os.chown(store, int(UID), int(UID))  # writable by the image's user: a write would land
    published = ports()
    project = stack.project(TOKENFEED_STORE_DIR=str(store), **published)
    try:
        project.run("up", "--detach", "--wait", "--wait-timeout", "120", "server")
        assert project.services_created() == {"server"}  # no prepare, no trainer
        # nothing but the server's lease (which versions its jobs read, for gc)
        written = [str(p.relative_to(store)) for p in store.rglob("*") if p.is_file()]
        assert all(re.fullmatch(r"_tokenfeed/leases/[0-9a-f]+\.json", w) for w in written)

        server = project.container("server")
        # The image's own HEALTHCHECK (compose only probes it more often) made it healthy.
        image = json.loads(sh(["docker", "image", "inspect", SERVER_IMAGE], timeout=60))[0]
        assert "/readyz" in " ".join(image["Config"]["Healthcheck"]["Test"])
        assert server["State"]["Health"]["Status"] == "healthy"  # type: ignore[index]
        assert server["Config"]["User"] == UID  # type: ignore[index]
        assert project.run("exec", "-T", "server", "id", "-u").strip() == UID
        bindings = server["HostConfig"]["PortBindings"]  # type: ignore[index]
        assert {b["HostIp"] for v in bindings.values() for b in v} == {"127.0.0.1"}

        http = f"http://127.0.0.1:{published['TOKENFEED_HTTP_PUBLISH']}"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(f"{http}/readyz", timeout=10).status_code == 200
        page = httpx.get(f"{http}/", timeout=10)  # the status page ships in the image
        assert page.status_code == 200 and "console/console.js" in page.text
        assert httpx.get(f"{http}/console/console.js", timeout=10).status_code == 200
        assert httpx.get(f"{http}/v1/datasets", headers=auth, timeout=10).json() == []

        # A dataset prepared while the server runs is served without a restart.
        project.run("run", "--rm", "--no-deps", "prepare")
        # The store's watcher (not the request) notices new datasets, within its scan
        # interval: poll for it, bounded.
        deadline = time.monotonic() + 30
        names: list[str] = []
        while not names and time.monotonic() < deadline:
            answer = httpx.get(f"{http}/v1/datasets", headers=auth, timeout=10).json()
            names = [d["name"] for d in answer]
            if not names:
                time.sleep(0.2)
        assert names == ["demo"]

        project.run("stop", "--timeout", "20", "server")
        assert exit_code(project.container("server")) == 0
    finally:
        project.down()


def test_server_image_has_no_torch_and_runs_as_non_root(stack: Stack) -> None:
    done = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            SERVER_IMAGE,
            "python",
            "-c",
            "import os, torch; print(os.getuid())",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1 and "No module named 'torch'" in done.stderr, done.stderr
    uid = sh(["docker", "run", "--rm", SERVER_IMAGE, "id", "-u"], timeout=120).strip()
    assert uid == UID


def test_unwritable_store_stops_the_demo_with_one_clear_line(stack: Stack, tmp_path: Path) -> None:
    store = tmp_path / "root-owned-store"
    store.mkdir(mode=0o755)  # root's, as a host directory made with sudo mkdir is
    project = stack.project(TOKENFEED_STORE_DIR=str(store), **ports())
    try:
        up = project.completed("up")
        out = up.stdout + up.stderr
        assert up.returncode != 0, out
        message = (
            f"prepare: the store {store} is not writable by uid {UID}, the image's user: "
            f"run 'sudo chown -R {UID} {store}' on the host and try again"
        )
        assert message in out, out
        assert "Traceback" not in out, out
        assert exit_code(project.container("prepare")) == 1
        trainer = project.container("trainer")
        assert trainer["State"]["Status"] == "created", trainer["State"]  # type: ignore[index]
        assert list(store.iterdir()) == []
    finally:
        project.down()
