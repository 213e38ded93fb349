"""``tokenfeed.integrations.hf``: a Hugging Face ``Trainer`` on the stream, resumed exactly.

A real server process, a tiny GPT-2 built from a config (nothing downloaded) and the real
``transformers.Trainer`` with accelerate. A run cut by a checkpoint and resumed in a fresh
process (``resume_from_checkpoint=True``, with DataLoader workers on both sides of the cut
and gradient accumulation) trains on exactly the batches of an uninterrupted run and
reaches the same losses; the resumed process is served by a server of its own, which
counts the batches it sent: only the batches not trained yet (no replay of the trained
ones to skip them). The model gets ``input_ids``, ``labels`` (unshifted: the model shifts)
and ``attention_mask``, each ``[batch, seq]``, and nothing else.

The runs happen in child processes (this file is their script: ``python
tests/test_hf_trainer.py SPEC OUT``), so a resume starts from nothing but the checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from live_server import LiveServer
from shard_data import BYTE
from waiting import wait_until

SEQ, BATCH, ACCUM, STEPS, CUT = 32, 4, 2, 4, 2
#: batches (micro-batches) of the whole run, and of the part after the cut
BATCHES, REST = STEPS * ACCUM, (STEPS - CUT) * ACCUM


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenfeed_server.store import write_dataset

    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(11)
    docs = [rng.integers(0, 256, size=int(n), dtype=np.uint16) for n in rng.integers(5, 300, 150)]
    write_dataset(root, "alpha", docs, tokenizer=BYTE, shuffle_seed=0, shard_tokens=6_000)
    return root


@pytest.fixture(scope="module")
def server(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with LiveServer(store, log_path=tmp_path_factory.mktemp("logs") / "server.log") as srv:
        yield srv


def run(spec: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    """Train in a child process as ``spec`` says; what each run of it recorded."""
    spec_file = out.with_suffix(".spec.json")
    spec_file.write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, __file__, str(spec_file), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"training failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    result: list[dict[str, Any]] = json.loads(out.read_text())
    return result


@pytest.mark.network
@pytest.mark.slow
def test_trainer_resumes_in_a_fresh_process_exactly(
    server: LiveServer, store: Path, tmp_path: Path
) -> None:
    # one child: an uninterrupted run, then a run cut after CUT steps (its checkpoint kept)
    whole, first = run(
        {
            "endpoint": server.zmq,
            "runs": [
                {"dir": str(tmp_path / "whole"), "workers": 0},
                {"dir": str(tmp_path / "cut"), "workers": 2, "stop_at": CUT},
            ],
        },
        tmp_path / "first.json",
    )
    assert (whole["step"], first["step"]) == (STEPS, CUT)
    assert (tmp_path / "cut" / f"checkpoint-{CUT}" / "tokenfeed_loader.json").is_file()

    # a fresh child resumes the cut run, from a server of its own that counts what it sends
    log = tmp_path / "resume-server.log"
    with LiveServer(store, log_path=log) as fresh:
        (rest,) = run(
            {
                "endpoint": fresh.zmq,
                "runs": [{"dir": str(tmp_path / "cut"), "workers": 2, "resume": True}],
            },
            tmp_path / "rest.json",
        )
        served = served_once_consumed(fresh, BATCHES * BATCH)
    assert rest["step"] == STEPS

    # the batches: as the model takes them, and the same ones across the cut
    assert len(whole["batches"]) == BATCHES and len(first["batches"]) == CUT * ACCUM
    assert first["batches"] + rest["batches"] == whole["batches"]
    for shapes in whole["shapes"] + rest["shapes"]:
        assert shapes == {k: [BATCH, SEQ] for k in ("attention_mask", "input_ids", "labels")}
    assert whole["labels_are_inputs"] and rest["labels_are_inputs"]  # unshifted
    # the same training: the losses after the cut are the uninterrupted run's
    after = {step: loss for step, loss in rest["losses"] if step > CUT}  # logged after the cut
    assert list(after) == list(range(CUT + 1, STEPS + 1))
    assert list(after.values()) == pytest.approx(
        [dict(whole["losses"])[s] for s in after], rel=1e-5
    )
    assert rest["params"] == pytest.approx(whole["params"], rel=1e-5)
    # the resumed process was sent only the batches it had not trained
    assert served == REST


def served_once_consumed(srv: LiveServer, position: int) -> int:
    """Batches ``srv`` sent, read once its job shows the loop's end (the consumed position,
    reported after the last batch arrived)."""

    def settled() -> list[dict[str, Any]] | None:
        jobs: list[dict[str, Any]] = srv.get("/v1/jobs").json()
        return jobs if any(j["consumed_position"] == position for j in jobs) else None

    jobs = wait_until(settled, 20.0, f"a job consumed up to {position}")
    return sum(int(j["batches_served"]) for j in jobs)


def test_import_tokenfeed_stays_light() -> None:
    code = (
        "import sys, tokenfeed, tokenfeed.integrations; "
        "assert 'transformers' not in sys.modules and 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_pre_shifted_labels_are_refused(server: LiveServer) -> None:
    from tokenfeed import TokenFeedDataset
    from tokenfeed.errors import ConfigError
    from tokenfeed.integrations.hf import TokenFeedTrainer

    shifted = TokenFeedDataset(server.zmq, "alpha", seq_len=SEQ, batch_size=BATCH)
    with pytest.raises(ConfigError, match='labels="unshifted"'):
        TokenFeedTrainer(None, None, train_dataset=shifted)
    with pytest.raises(ConfigError, match="TokenFeedDataset"):
        TokenFeedTrainer(None, None, train_dataset=[1, 2, 3])


# ------------------------------------------------------------------ the child process


def train_one(endpoint: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One Trainer run as the spec says; the batches it trained on and its losses."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    from tokenfeed import TokenFeedDataset
    from tokenfeed.integrations.hf import TokenFeedTrainer

    batches: list[list[list[int]]] = []
    shapes: list[dict[str, list[int]]] = []
    same_labels: list[bool] = []

    class Recording(TokenFeedTrainer):
        def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            batches.append(inputs["input_ids"].tolist())
            shapes.append({k: list(v.shape) for k, v in sorted(inputs.items())})
            same_labels.append(bool(torch.equal(inputs["labels"], inputs["input_ids"])))
            return super().training_step(model, inputs, *args, **kwargs)

    class StopAt(TrainerCallback):
        """Ends the run after ``step`` steps, as a job's time limit would."""

        def __init__(self, step: int) -> None:
            self.step = step

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if state.global_step >= self.step:
                control.should_training_stop = True
            return control

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=257, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=256, eos_token_id=256,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    dataset = TokenFeedDataset(
        endpoint, "alpha", seq_len=SEQ, batch_size=BATCH, seed=3, samples=BATCHES * BATCH,
        labels="unshifted", rank=0, world_size=1, deadline=30.0,
    )  # fmt: skip
    args = TrainingArguments(
        spec["dir"], max_steps=STEPS, gradient_accumulation_steps=ACCUM, learning_rate=3e-3,
        warmup_steps=1, lr_scheduler_type="cosine", save_strategy="steps", save_steps=CUT,
        logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
        dataloader_num_workers=spec["workers"],
        dataloader_prefetch_factor=2 if spec["workers"] else None,
    )  # fmt: skip
    callbacks = [StopAt(spec["stop_at"])] if "stop_at" in spec else []
    trainer = Recording(model, args, train_dataset=dataset, callbacks=callbacks)
    output = trainer.train(resume_from_checkpoint=spec.get("resume", False))
    # (step, loss) of every step logged; a resumed run's history starts with the checkpoint's
    losses = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    return {
        "step": int(output.global_step),
        "batches": batches,
        "shapes": shapes,
        "labels_are_inputs": all(same_labels),
        "losses": losses,
        "params": [float(p.detach().double().sum()) for p in model.parameters()],
    }


def main(spec_file: str, out: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    results = [train_one(spec["endpoint"], one) for one in spec["runs"]]
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
