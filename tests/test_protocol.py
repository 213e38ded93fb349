"""Wire protocol v2, one rule at a time: no sockets, just frames (see tokenfeed.protocol)."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np
import pytest

from tokenfeed import protocol
from tokenfeed.errors import ProtocolError
from tokenfeed.protocol import messages
from tokenfeed.protocol.bounds import depth

HELLO = protocol.Hello("alpha", 128, 8, 0, 1, 0, 0, window=4, client="c")
EVERY = [
    HELLO,
    dataclasses.replace(HELLO, fingerprint="f" * 16),
    protocol.Welcome("s", "j", "fp", 10, 2, "uint16", 4, 8, 256),
    protocol.Get(req=1, job="j", rank=0, pos=0, count=1, stride=1),
    protocol.Chunk(req=1, rows=2, cols=3, dtype="uint16", provenance=("window", "epoch")),
    protocol.Err(code="internal", message="m", retry=False, req=-1),
    protocol.Ping(),
    protocol.Pong(),
    protocol.Bye(),
    protocol.Bye(consumed=1 << 40),
    protocol.Get(req=1, job="j", rank=0, pos=64, count=1, stride=1, consumed=32),
    MIX_HELLO := dataclasses.replace(
        HELLO,
        dataset="",
        sources=("web", "code", "math"),
        schedule=((0, 7, 2, 1), (1000, 1, 1, 0)),
        fingerprints=("a" * 16, "", "b" * 16),
    ),
    dataclasses.replace(HELLO, shuffle="block"),
    dataclasses.replace(HELLO, shuffle="block", region_windows=512, block_regions=4),
    dataclasses.replace(MIX_HELLO, shuffle="block", region_windows=8),
    protocol.Welcome("s", "j", "fp", 10, 2, "uint16", 4, 8, 256, region_windows=3),
    protocol.Welcome(
        "s",
        "j",
        "fp",
        30,
        6,
        "uint16",
        4,
        8,
        256,
        source_fingerprints=("a", "b"),
        source_tokens=(10, 20),
        source_windows=(2, 4),
        source_region_windows=(0, 0),
        source_block_regions=(0, 0),
    ),
]


def fields(msg: protocol.Message) -> dict[str, Any]:
    out: dict[str, Any] = msgpack.unpackb(msg.header())
    return out


def packed(obj: object) -> bytes:
    raw: bytes = msgpack.packb(obj)
    return raw


@pytest.mark.parametrize("msg", EVERY, ids=lambda m: m.TYPE)
def test_every_message_round_trips(msg: protocol.Message) -> None:
    assert protocol.decode_header(msg.header()) == msg


def test_v1_peers_are_refused_with_what_to_do() -> None:
    v1 = {**fields(HELLO), "v": 1}
    with pytest.raises(ProtocolError, match=r"version 1 .*install matching versions"):
        protocol.decode_header(packed(v1))
    assert fields(HELLO)["v"] == protocol.VERSION == 2


def test_optional_field_left_out_at_its_default_and_filled_in() -> None:
    assert "fingerprint" not in fields(HELLO)  # an older v2 server never sees it unused
    with_fp = dataclasses.replace(HELLO, fingerprint="abc")
    assert fields(with_fp)["fingerprint"] == "abc"
    decoded = protocol.decode_header(HELLO.header())
    assert isinstance(decoded, protocol.Hello) and decoded.fingerprint == ""


def test_consumed_is_optional_on_get_and_bye() -> None:
    """A client that does not know its consumed position sends what v2 always had."""
    get = protocol.Get(req=1, job="j", rank=0, pos=0, count=1, stride=1)
    assert "consumed" not in fields(get) and fields(protocol.Bye()) == {"v": 2, "t": "bye"}
    assert fields(dataclasses.replace(get, consumed=0))["consumed"] == 0  # 0 is a position
    bye = protocol.decode_header(packed({"v": 2, "t": "bye", "consumed": 96}))
    assert bye == protocol.Bye(consumed=96)
    with pytest.raises(ProtocolError, match=r"get\.consumed must be an integer"):
        protocol.decode_header(dataclasses.replace(get, consumed=-2).header())


def test_a_hostile_value_cannot_forge_log_lines() -> None:
    # a string where an integer belongs is named in the error, which the server logs
    forged = "5\n2026-12-04 INFO tokenfeed: job admin granted\x1b[2J"
    with pytest.raises(ProtocolError) as refused:
        protocol.decode_header(packed({"v": 2, "t": "bye", "consumed": forged}))
    message = str(refused.value)
    assert "\n" not in message and "\x1b" not in message
    assert "\\n2026-12-04 INFO" in message  # shown, escaped


def test_missing_required_field_is_named() -> None:
    raw = fields(HELLO)
    del raw["seq_len"]
    with pytest.raises(ProtocolError, match=r"missing fields \['seq_len'\]"):
        protocol.decode_header(packed(raw))


def test_unknown_fields_are_refused_naming_them() -> None:
    raw = {**fields(HELLO), "curriculum": [1, 2]}
    with pytest.raises(ProtocolError, match=r"unexpected fields \['curriculum'\].*newer"):
        protocol.decode_header(packed(raw))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("seq_len", True, "integer"),  # bool is not an int on the wire
        ("seq_len", -2, "integer"),
        ("seq_len", 2**63, "not valid msgpack|integer"),
        ("seq_len", 1.5, "integer"),
        ("dataset", 7, "string"),
        ("fingerprint", [1], "string"),
    ],
)
def test_scalar_types_and_ranges(field: str, value: object, match: str) -> None:
    raw = {**fields(HELLO), field: value}
    with pytest.raises(ProtocolError, match=match):
        protocol.decode_header(packed(raw))


def test_list_values_are_typed_item_by_item() -> None:
    raw = fields(EVERY[4])
    assert protocol.decode_header(packed(raw)) == EVERY[4]
    with pytest.raises(ProtocolError, match=r"chunk.provenance\[1\] must be a string"):
        protocol.decode_header(packed({**raw, "provenance": ["window", 3]}))
    with pytest.raises(ProtocolError, match="must be a list"):
        protocol.decode_header(packed({**raw, "provenance": "window"}))


def test_sizes_are_bounded_before_unpacking() -> None:
    raw = fields(EVERY[4])
    too_many = {**raw, "provenance": ["x"] * (protocol.MAX_ITEMS + 1)}
    with pytest.raises(ProtocolError, match="max_array_len"):
        protocol.decode_header(packed(too_many))
    big_map = {**raw, **{f"k{i}": 0 for i in range(protocol.MAX_ITEMS)}}
    with pytest.raises(ProtocolError, match="max_map_len"):
        protocol.decode_header(packed(big_map))
    with pytest.raises(ProtocolError, match="max_str_len"):
        protocol.decode_header(packed({**fields(HELLO), "client": "x" * (protocol.MAX_STR + 1)}))
    with pytest.raises(ProtocolError, match=f"exceeds {protocol.MAX_HEADER_BYTES}"):
        protocol.decode_header(b"\x80" * (protocol.MAX_HEADER_BYTES + 1))
    # A header near the cap that obeys every other bound decodes: the cap is not 4 KiB.
    near = {**raw, "provenance": [f"{i:0>40}" for i in range(protocol.MAX_ITEMS)]}
    assert 40_000 < len(packed(near)) <= protocol.MAX_HEADER_BYTES
    decoded = protocol.decode_header(packed(near))
    assert isinstance(decoded, protocol.Chunk) and len(decoded.provenance) == protocol.MAX_ITEMS


def test_nesting_is_bounded() -> None:
    deep = b"\x91" * 5000 + b"\x01"  # [[[[...1...]]]] five thousand deep
    raw = fields(HELLO)
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        protocol.decode_header(packed({**raw, "v": 2})[:-1] + deep)
    with pytest.raises(ProtocolError, match="must be a string"):
        protocol.decode_header(packed({**raw, "client": [[[["x"]]]]}))
    assert protocol.MAX_DEPTH >= 1
    for hints in messages.HINTS.values():  # every declared field type is within the bound
        for hint in hints.values():
            assert depth(hint) <= protocol.MAX_DEPTH


@pytest.mark.parametrize(
    "frame",
    [packed([1, 2]), packed("hello"), b"\xc1", packed({"v": 2}), packed({"v": 2, "t": "nope"})],
)
def test_not_a_message(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        protocol.decode_header(frame)


def chunk(rows: dict[str, np.ndarray]) -> tuple[protocol.Chunk, list[Any]]:
    tokens = np.arange(12, dtype="<u2").reshape(3, 4)
    frames = protocol.chunk_frames(7, tokens, rows)
    header = protocol.decode_header(frames[0])
    assert isinstance(header, protocol.Chunk)
    return header, [bytes(memoryview(f)) for f in frames[1:]]


def test_provenance_rows_are_named_and_can_grow() -> None:
    window, epoch = np.array([5, 6, 7]), np.array([0, 0, 1])
    header, payload = chunk({"window": window, "epoch": epoch, "source": np.array([2, 0, 1])})
    assert header.provenance == ("window", "epoch", "source")
    tokens, rows = protocol.decode_chunk(header, payload)
    assert tokens.tolist() == np.arange(12).reshape(3, 4).tolist()
    # a reader takes the rows it knows and ignores a newer one
    got = protocol.require_rows(rows, protocol.ROW_WINDOW, protocol.ROW_EPOCH)
    assert [r.tolist() for r in got] == [[5, 6, 7], [0, 0, 1]]
    with pytest.raises(ProtocolError, match=r"lacks provenance rows \['epoch'\]"):
        protocol.require_rows({"window": window}, "window", "epoch")


def test_chunk_payload_sizes_are_checked() -> None:
    header, (tokens, meta) = chunk({"window": np.zeros(3), "epoch": np.zeros(3)})
    with pytest.raises(ProtocolError, match="2 payload frames"):
        protocol.decode_chunk(header, [tokens])
    with pytest.raises(ProtocolError, match="token frame"):
        protocol.decode_chunk(header, [tokens[:-2], meta])
    with pytest.raises(ProtocolError, match="provenance frame"):
        protocol.decode_chunk(header, [tokens, meta[:-8]])
    with pytest.raises(ProtocolError, match="distinct"):
        protocol.decode_chunk(dataclasses.replace(header, provenance=("w", "w")), [tokens, meta])
    with pytest.raises(ProtocolError, match="dtype"):
        protocol.decode_chunk(dataclasses.replace(header, dtype="float32"), [tokens, meta])


def test_every_err_fits_the_string_bound() -> None:
    """An err quoting hostile input is cut, so the other end can always decode it."""
    long = protocol.Err(code="bad_request", message="é" * 2000, retry=False, req=-1)
    decoded = protocol.decode_header(long.header())
    assert isinstance(decoded, protocol.Err) and decoded.message.endswith("...")
    assert len(decoded.message.encode()) <= protocol.MAX_STR
    junk = packed({"v": 2, "t": "ping"}) + b"\xa9" * 5000  # trailing bytes after a message
    with pytest.raises(ProtocolError) as info:
        protocol.decode_header(junk)
    assert len(str(info.value)) < 200  # names the problem without echoing the bytes


# -- mixtures and shuffle (issue 13) ------------------------------------------------------


def test_single_dataset_messages_are_byte_identical_to_before_mixtures() -> None:
    """A single-dataset hello/welcome/chunk carries exactly the fields v2 had, so an older
    v2 peer never sees the mixture or shuffle fields unless they are used."""
    assert set(fields(HELLO)) == {
        "v",
        "t",
        "dataset",
        "seq_len",
        "batch_size",
        "seed",
        "world_size",
        "rank",
        "worker",
        "window",
        "client",
    }
    assert list(fields(EVERY[2])) == [
        "v",
        "t",
        "server",
        "job",
        "fingerprint",
        "n_tokens",
        "n_windows",
        "dtype",
        "window",
        "max_count",
        "eos_id",
    ]
    old_hello = {k: v for k, v in fields(HELLO).items()}
    assert HELLO.header() == packed(old_hello)


def test_mixture_fields_go_on_the_wire_only_when_used() -> None:
    mix = fields(MIX_HELLO)
    assert mix["dataset"] == "" and mix["sources"] == ["web", "code", "math"]
    assert mix["schedule"] == [[0, 7, 2, 1], [1000, 1, 1, 0]]
    assert "shuffle" not in mix and "region_windows" not in mix
    block = fields(dataclasses.replace(HELLO, shuffle="block"))
    assert block["shuffle"] == "block" and "region_windows" not in block


def test_lists_are_accepted_and_compare_equal_to_what_is_decoded() -> None:
    """Callers build messages from lists (Mixture.to_wire()); the decoder makes tuples."""
    from_lists = protocol.Hello(
        "",
        128,
        8,
        0,
        1,
        0,
        0,
        window=4,
        client="c",
        sources=["web", "code"],  # type: ignore[arg-type]
        schedule=[[0, 1, 3]],  # type: ignore[arg-type]
        fingerprints=["x", "y"],  # type: ignore[arg-type]
    )
    assert protocol.decode_header(from_lists.header()) == from_lists
    assert from_lists.schedule == ((0, 1, 3),)
    spec = protocol.JobSpec("", 8, 2, 0, 1, sources=["a", "b"], schedule=[[0, 1, 1]])  # type: ignore[arg-type]
    assert spec.is_mixture and hash(spec) == hash(
        protocol.JobSpec("", 8, 2, 0, 1, ("a", "b"), ((0, 1, 1),))
    )
    assert not protocol.JobSpec("alpha", 8, 2, 0, 1).is_mixture


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"dataset": "web"}, "dataset must be empty"),
        ({"sources": ["web", "bad/name", "math"]}, "invalid dataset name 'bad/name'"),
        ({"sources": ["web", "..x", "math"]}, "invalid dataset name"),
        ({"sources": ["web", "code", "web"]}, r"names \['web'\] more than once"),
        ({"schedule": []}, "needs a schedule"),
        ({"schedule": [[0, 1, 1]]}, r"schedule\[0\] must be \[start, one weight per source\]"),
        ({"schedule": [[0, 1, 1, 1], [5, 1, -1, 1]]}, r"schedule\[1\] must be"),
        ({"schedule": [[0, 1, 1, "1"]]}, r"schedule\[0\]\[3\] must be an integer"),
        ({"fingerprints": ["a", "b"]}, "2 entries for 3 sources"),
        ({"shuffle": "random"}, "shuffle must be one of"),
        ({"region_windows": 4}, 'shuffle="block" only'),
        ({"shuffle": "block", "block_regions": -1}, "must be >= 0"),
    ],
)
def test_mixture_hello_is_validated_by_the_decoder(change: dict[str, Any], match: str) -> None:
    raw = {**fields(MIX_HELLO), **change}
    with pytest.raises(ProtocolError, match=match):
        protocol.decode_header(packed(raw))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"schedule": [[0, 1]]}, "need hello.sources"),
        ({"fingerprints": ["a"]}, "need hello.sources"),
        ({"shuffle": "global", "block_regions": 2}, 'shuffle="block" only'),
    ],
)
def test_single_dataset_hello_refuses_mixture_only_fields(
    change: dict[str, Any], match: str
) -> None:
    with pytest.raises(ProtocolError, match=match):
        protocol.decode_header(packed({**fields(HELLO), **change}))


def test_welcome_source_lists_are_parallel() -> None:
    raw = fields(EVERY[-1])
    assert raw["source_tokens"] == [10, 20] and "region_windows" not in raw
    with pytest.raises(ProtocolError, match=r"one entry per source each.*source_windows=1"):
        protocol.decode_header(packed({**raw, "source_windows": [2]}))
    with pytest.raises(ProtocolError, match="source_tokens=0"):
        protocol.decode_header(packed({**raw, "source_tokens": []}))


def test_source_names_follow_the_stores_rule() -> None:
    """The decoder's name check and the store's are the same rule."""
    from tokenfeed.errors import InvalidDatasetName
    from tokenfeed_server.store.reader import validate_dataset_name

    names = ["a", "web", "A.b_c-d", "x" * 128, "x" * 129, ".hidden", "-x", "a..b", "a/b", "é", ""]
    for name in names:
        try:
            validate_dataset_name(name)
            store_ok = True
        except InvalidDatasetName:
            store_ok = False
        raw = {**fields(MIX_HELLO), "sources": [name, "zz"], "schedule": [[0, 1, 1]]}
        raw.pop("fingerprints")
        try:
            protocol.decode_header(packed(raw))
            wire_ok = True
        except ProtocolError:
            wire_ok = False
        assert wire_ok == store_ok, name


def test_mixture_fingerprint_depends_on_every_source_and_their_order() -> None:
    fp = protocol.mixture_fingerprint(["a" * 16, "b" * 16])
    assert len(fp) == 32 and fp == protocol.mixture_fingerprint(("a" * 16, "b" * 16))
    assert fp != protocol.mixture_fingerprint(["b" * 16, "a" * 16])
    assert fp != protocol.mixture_fingerprint(["a" * 16, "c" * 16])


def test_source_row_is_a_named_provenance_row() -> None:
    header, payload = chunk(
        {
            protocol.ROW_WINDOW: np.array([5, 6, 7]),
            protocol.ROW_EPOCH: np.array([0, 0, 1]),
            protocol.ROW_SOURCE: np.array([2, 0, 1]),
        }
    )
    _, rows = protocol.decode_chunk(header, payload)
    (source,) = protocol.require_rows(rows, protocol.ROW_SOURCE)
    assert source.tolist() == [2, 0, 1]
