"""Labels that fit the model: pre-shifted for plain torch, unshifted for Hugging Face.

A real server process and real DataLoader workers. ``labels="shifted"`` (the default)
gives ``labels[:, t] == token t + 1``; ``labels="unshifted"`` gives a copy of
``input_ids``, which Hugging Face causal LMs shift themselves. Both modes read the same
stream: everything but ``labels`` is identical, through every conversion path (the
background thread of ``num_workers=0``, one batch per worker item, packed items unpacked
in the main process, a dataset iterated directly) and with document boundaries. A tiny
GPT-2 built from a config (no download) shows that the unshifted labels give Hugging
Face's loss equal to plain next-token cross-entropy, and that the shifted ones would not.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch.nn.functional import cross_entropy
from transformers import GPT2Config, GPT2LMHeadModel

from live_server import LiveServer
from tokenfeed import TokenFeedDataset, TokenFeedLoader
from tokenfeed.dataset import LabelMode, unpack
from tokenfeed.errors import ConfigError
from tokenfeed_server.store import TokenizerInfo, write_dataset

pytestmark = pytest.mark.network

SEQ, BATCH, STEPS, EOS = 32, 3, 11, 256
Batch = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(3)
    # short documents, so that most rows hold several and the boundaries matter
    docs = [rng.integers(0, 256, size=int(n), dtype=np.uint16) for n in rng.integers(3, 40, 300)]
    byte = TokenizerInfo(kind="byte", vocab_size=257, eos_id=EOS)
    write_dataset(root, "alpha", docs, tokenizer=byte, shuffle_seed=0, shard_tokens=4_000)
    with LiveServer(root, log_path=tmp_path_factory.mktemp("logs") / "server.log") as srv:
        yield srv


def dataset(
    server: LiveServer,
    labels: LabelMode,
    *,
    boundaries: bool = False,
    batches_per_item: int | None = None,
) -> TokenFeedDataset:
    return TokenFeedDataset(
        server.zmq,
        "alpha",
        seq_len=SEQ,
        batch_size=BATCH,
        seed=7,
        rank=0,
        world_size=1,
        samples=STEPS * BATCH,
        labels=labels,
        document_boundaries=boundaries,
        batches_per_item=batches_per_item,
        request_timeout=2.0,
        deadline=20.0,
    )


def batches(
    server: LiveServer,
    labels: LabelMode,
    *,
    workers: int,
    boundaries: bool = False,
    batches_per_item: int | None = None,
) -> list[Batch]:
    ds = dataset(server, labels, boundaries=boundaries, batches_per_item=batches_per_item)
    loader = TokenFeedLoader(ds, num_workers=workers, pin_memory=False, prefetch=2)
    got = list(loader)
    if workers > 0 and batches_per_item is None:
        assert loader.batches_per_item > 1  # the automatic packing: the unpack path ran
    return got


def assert_modes_agree(shifted: list[Batch], unshifted: list[Batch]) -> None:
    """Row by row: the label relation of each mode, and nothing else differs."""
    assert len(shifted) == len(unshifted) == STEPS
    for step, (s, u) in enumerate(zip(shifted, unshifted, strict=True)):
        assert s.keys() == u.keys(), step
        for key in s.keys() - {"labels"}:
            assert torch.equal(s[key], u[key]), (step, key)
        for batch in (s, u):
            assert batch["labels"].shape == batch["input_ids"].shape == (BATCH, SEQ)
            assert batch["labels"].dtype == torch.int64
        # shifted: the label at t is the input at t + 1 (the last one is the window's
        # extra token, which only the labels hold)
        assert torch.equal(s["labels"][:, :-1], s["input_ids"][:, 1:]), step
        assert not torch.equal(s["labels"], s["input_ids"]), step
        # unshifted: equal to the inputs, but its own memory
        assert torch.equal(u["labels"], u["input_ids"]), step
        assert u["labels"].data_ptr() != u["input_ids"].data_ptr(), step


@pytest.mark.parametrize(
    ("workers", "batches_per_item"),
    [(0, None), (2, None), (2, 1)],
    ids=["thread", "workers-packed", "workers-one-per-item"],
)
@pytest.mark.parametrize("boundaries", [False, True], ids=["rows", "documents"])
def test_both_modes_read_the_same_stream(
    server: LiveServer, workers: int, batches_per_item: int | None, boundaries: bool
) -> None:
    shifted, unshifted = (
        batches(
            server, mode, workers=workers, boundaries=boundaries, batches_per_item=batches_per_item
        )
        for mode in ("shifted", "unshifted")
    )
    assert_modes_agree(shifted, unshifted)
    if boundaries:
        assert any(len(b["cu_seqlens"]) > BATCH + 1 for b in unshifted)  # documents were cut


def test_default_is_shifted(server: LiveServer) -> None:
    ds = TokenFeedDataset(server.zmq, "alpha", seq_len=SEQ, batch_size=BATCH, samples=BATCH)
    assert ds.labels == "shifted"
    (batch,) = TokenFeedLoader(ds, num_workers=0, pin_memory=False)
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])


def test_packed_items_iterated_directly_keep_their_mode(server: LiveServer) -> None:
    # Your own loop over packed items: unpack() learns the mode from the item itself.
    shifted = [b for item in dataset(server, "shifted", batches_per_item=4) for b in unpack(item)]
    unshifted = [
        b for item in dataset(server, "unshifted", batches_per_item=4) for b in unpack(item)
    ]
    assert_modes_agree(shifted, unshifted)


@pytest.mark.parametrize("bad", ["hf", "Unshifted", None, True])
def test_an_unknown_mode_is_refused_naming_the_valid_ones(server: LiveServer, bad: object) -> None:
    mode: LabelMode = bad  # type: ignore[assignment]  # what an untyped caller can pass
    with pytest.raises(ConfigError, match="'shifted', 'unshifted'"):
        TokenFeedDataset(server.zmq, "alpha", seq_len=SEQ, batch_size=BATCH, labels=mode)


# ------------------------------------------------------------------ Hugging Face's loss


def tiny_gpt2() -> GPT2LMHeadModel:
    """A one-layer GPT-2 from a config: random weights, nothing downloaded."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=257, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2, eos_token_id=EOS
    )
    model = GPT2LMHeadModel(config)
    model.eval()
    return model


@pytest.mark.parametrize("workers", [0, 2])
def test_hf_loss_on_unshifted_labels_is_next_token_cross_entropy(
    server: LiveServer, workers: int
) -> None:
    model = tiny_gpt2()
    shifted = batches(server, "shifted", workers=workers)[:2]
    unshifted = batches(server, "unshifted", workers=workers)[:2]
    with torch.no_grad():
        for s, u in zip(shifted, unshifted, strict=True):
            ids = u["input_ids"]
            out = model(input_ids=ids, labels=u["labels"])
            logits = out.logits
            # by hand: the logits at t predict the token at t + 1, over L - 1 positions
            next_token = cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            torch.testing.assert_close(out.loss, next_token)
            # the same targets the shifted labels give a plain model at those positions
            plain = cross_entropy(logits[:, :-1].flatten(0, 1), s["labels"][:, :-1].flatten())
            torch.testing.assert_close(plain, next_token)

            # the trap: pre-shifted labels into a model that shifts again train it on the
            # token after next (t + 2), not the next one
            trap = model(input_ids=ids, labels=s["labels"]).loss
            after_next = cross_entropy(logits[:, :-1].flatten(0, 1), s["labels"][:, 1:].flatten())
            torch.testing.assert_close(trap, after_next)
            assert not torch.allclose(trap, next_token)


def test_unshifted_labels_can_be_masked_without_touching_the_inputs(server: LiveServer) -> None:
    # The usual HF recipe masks padding or prompts with -100 in place.
    batch = batches(server, "unshifted", workers=0)[0]
    ids = batch["input_ids"].clone()
    batch["labels"][batch["labels"] == EOS] = -100
    batch["labels"][:, 0] = -100
    assert torch.equal(batch["input_ids"], ids)
