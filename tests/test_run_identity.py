"""Run identity: every launch is a job of its own, and old peers keep working.

The job ids and hello bytes pinned here were computed by the code from before run ids
(commit 533b627) over the datasets of :func:`store`: a client from before run ids (a hello
without ``run``, sent raw) must keep exactly those job ids, and a new client without a run
id must send exactly those bytes. A server from before run ids refuses a hello with
``run``; a ROUTER socket that answers as such a server did stands in for it.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from live_server import LiveServer
from old_server import OldServer
from shard_data import BYTE, random_docs
from tokenfeed import TokenFeedDataset, protocol
from tokenfeed.errors import ConfigError, ProtocolError
from tokenfeed.protocol import JobSpec
from tokenfeed.training.config import RUN_ID_ENV, launch_run_id
from tokenfeed.transport.client import ClientOptions, FeedClient
from tokenfeed_server.store import write_dataset

pytestmark = pytest.mark.network

# Hellos of a client from before run ids: one dataset under each shuffle, and a mixture.
HELLOS: dict[str, dict[str, Any]] = {
    "global": {"dataset": "alpha", "rank": 0, "worker": 0},
    "block": {"dataset": "alpha", "rank": 1, "worker": 1, "shuffle": "block"},
    "mixture": {
        "dataset": "",
        "rank": 0,
        "worker": 0,
        "sources": ("alpha", "beta"),
        "schedule": ((0, 3, 1),),
    },
}
COMMON = {"seq_len": 16, "batch_size": 4, "seed": 5, "world_size": 2, "window": 4, "client": "pin"}
# welcome.job for each hello above, from the server before run ids
PINNED_JOBS = {
    "global": "a06a8b37a8d6c5fe",
    "block": "5499051998e14db2",
    "mixture": "313078d7c81248db",
}
# hello.header() for each hello above, from the encoder before run ids
_HEAD = (
    "a17602a174a568656c6c6fa764617461736574{ds}a77365715f6c656e10aa62617463685f73697a6504"
    "a47365656405aa776f726c645f73697a6502a472616e6b{rank}a6776f726b6572{worker}a677696e646f77"
    "04a6636c69656e74a370696e"
)
PINNED_BYTES = {
    "global": "8b" + _HEAD.format(ds="a5616c706861", rank="00", worker="00"),
    "block": "8c"
    + _HEAD.format(ds="a5616c706861", rank="01", worker="01")
    + "a773687566666c65a5626c6f636b",
    "mixture": "8d"
    + _HEAD.format(ds="a0", rank="00", worker="00")
    + "a7736f757263657392a5616c706861a462657461a87363686564756c659193000301",
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    # Exactly the datasets the pinned ids were computed over (their fingerprints key them).
    write_dataset(root, "alpha", random_docs(300, seed=7), tokenizer=BYTE, shuffle_seed=3,
                  shard_tokens=1500)  # fmt: skip
    write_dataset(root, "beta", random_docs(120, seed=8), tokenizer=BYTE, shuffle_seed=4,
                  shard_tokens=900)  # fmt: skip
    return root


@pytest.fixture(scope="module")
def server(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("runserver") / "server.log"
    with LiveServer(store, log_path=log) as srv:
        yield srv


def ask(server: LiveServer, header: bytes) -> protocol.Message:
    """Send one raw header frame on a fresh connection; the decoded answer."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(server.zmq)
        sock.send(header)
        assert sock.poll(10_000), "no answer to hello"
        return protocol.decode_header(sock.recv())
    finally:
        sock.close(linger=0)


def job_of(server: LiveServer, **fields: Any) -> str:
    welcome = ask(server, protocol.Hello(**{**COMMON, **fields}).header())
    assert isinstance(welcome, protocol.Welcome), welcome
    return welcome.job


def dataset(server: LiveServer, **kw: Any) -> TokenFeedDataset:
    args: dict[str, Any] = {"seq_len": 16, "batch_size": 4, "seed": 5, "rank": 0, "world_size": 1}
    return TokenFeedDataset(server.zmq, "alpha", deadline=20.0, **{**args, **kw})


# -- wire compatibility ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(HELLOS))
def test_a_hello_without_run_is_the_bytes_of_before(kind: str) -> None:
    hello = protocol.Hello(**COMMON, **HELLOS[kind])
    assert hello.run == ""
    assert hello.header().hex() == PINNED_BYTES[kind]


@pytest.mark.parametrize("kind", sorted(HELLOS))
def test_an_old_client_keeps_its_job_id(server: LiveServer, kind: str) -> None:
    # The hello of a client from before run ids, as it went on the wire.
    welcome = ask(server, bytes.fromhex(PINNED_BYTES[kind]))
    assert isinstance(welcome, protocol.Welcome), welcome
    assert welcome.job == PINNED_JOBS[kind]


def test_a_run_id_names_a_job_of_its_own(server: LiveServer) -> None:
    plain = HELLOS["global"]
    first, second = job_of(server, **plain, run="run-a"), job_of(server, **plain, run="run-b")
    assert len({first, second, PINNED_JOBS["global"]}) == 3
    # Every rank and worker of one run joins its job; the same run again is the same job.
    assert job_of(server, **{**plain, "rank": 1, "worker": 1}, run="run-a") == first
    assert job_of(server, **plain, run="run-a") == first
    # A mixture and a block shuffle are keyed by their run too.
    assert job_of(server, **HELLOS["mixture"], run="run-a") != PINNED_JOBS["mixture"]
    assert job_of(server, **HELLOS["block"], run="run-a") != PINNED_JOBS["block"]


def test_a_bad_run_id_is_refused(server: LiveServer) -> None:
    bad = protocol.Hello(**COMMON, **HELLOS["global"], run="two words")
    with pytest.raises(ProtocolError, match="invalid run id"):
        bad.check()
    refusal = ask(server, bad.header())  # header() does not check: the server must
    assert isinstance(refusal, protocol.Err)
    assert refusal.code == "bad_request" and "invalid run id" in refusal.message


def test_a_new_client_says_hello_to_an_old_server_without_its_run() -> None:
    old = OldServer({"run"})
    job = JobSpec("alpha", 16, 4, 5, 2, run="run-a")
    options = ClientOptions(request_timeout=2.0, deadline=10.0)
    try:
        with FeedClient(old.endpoint, job, rank=0, worker=0, options=options) as client:
            assert client.hello().job == "0123456789abcdef"
            client.hello()  # a reconnect: the run id stays out, no second refusal
        with FeedClient(old.endpoint, JobSpec("alpha", 16, 4, 5, 2), rank=0, worker=0) as plain:
            plain.hello()
    finally:
        old.close()
    sent = [msgpack.unpackb(frame) for frame in old.frames]
    assert [f.get("run") for f in sent] == ["run-a", None, None, None]
    # Refused, the client sends exactly the hello of a client without a run id.
    assert sent[1] == {k: v for k, v in sent[0].items() if k != "run"}
    assert sent[2]["fingerprint"] == "f" * 32  # the reconnect pins the build it met


# -- where the run id comes from ------------------------------------------------------------


def test_the_run_id_comes_from_the_argument_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv(RUN_ID_ENV, "from-env")
    assert launch_run_id(None, 4) == "from-env"
    assert launch_run_id("given", 4) == "given"
    monkeypatch.setenv(RUN_ID_ENV, "no spaces allowed")
    with pytest.raises(ConfigError, match=RUN_ID_ENV):
        launch_run_id(None, 1)
    with pytest.raises(ConfigError, match="run="):
        launch_run_id("", 1)


def test_torchrun_and_a_lone_rank_give_a_run_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUN_ID_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "6f1c2a9e-6a7b-4e43-9d51-3f1f1a1b1c1d")
    assert launch_run_id(None, 2) == "6f1c2a9e-6a7b-4e43-9d51-3f1f1a1b1c1d"
    # torchrun's default rendezvous id is "none": the same in every launch, so no id.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    ids = {launch_run_id(None, 1) for _ in range(3)}
    assert len(ids) == 3 and all(len(i) == 32 for i in ids)
    # Several ranks with nothing shared: no id (the job of the inputs, as before).
    assert launch_run_id(None, 2) == ""


# -- datasets: two launches, and a resumed one ----------------------------------------------


def test_two_identical_runs_are_two_jobs(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(RUN_ID_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    first, second = dataset(server), dataset(server)
    assert first.job.run and second.job.run and first.job.run != second.job.run
    assert first.check_server().job != second.check_server().job
    # DataLoader workers get the dataset pickled: the same run, so the same job.
    copy = pickle.loads(pickle.dumps(first))
    assert copy.job.run == first.job.run
    assert copy.check_server().job == first.check_server().job
    named = dataset(server, run="shared")
    assert named.check_server().job == dataset(server, run="shared").check_server().job


def test_a_resumed_run_reattaches_to_its_own_job(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(RUN_ID_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    saved = dataset(server, samples=8)
    assert sum(1 for _ in saved) == 2
    state = saved.state_dict()
    assert state["run"] == saved.job.run
    resumed = dataset(server, samples=16)
    assert resumed.job.run != saved.job.run  # a new launch, until it loads the state
    resumed.load_state_dict(state)
    assert resumed.job.run == saved.job.run
    assert resumed.check_server().job == saved.check_server().job
    assert [int(b["window_ids"][0]) for b in resumed] == [
        int(b["window_ids"][0]) for b in list(dataset(server, samples=16, run=saved.job.run))[2:]
    ]
    # A state from before run ids loads and keeps the loading launch's own id.
    older = dataset(server)
    own = older.job.run
    older.load_state_dict({k: v for k, v in state.items() if k != "run"})
    assert older.job.run == own and older.position == 8
    with pytest.raises(ConfigError, match="'run'"):
        dataset(server).load_state_dict({**state, "run": 7})
