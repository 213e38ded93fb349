"""Train a small Hugging Face GPT-2 (built from a config, nothing downloaded) through tokenfeed.

The Hugging Face twin of ``train_gpt.py``. What differs for a ``transformers`` model is
one argument: ``labels="unshifted"`` (see ``make_loader``), because Hugging Face causal
LMs shift the labels inside their loss. tokenfeed's default labels are already shifted
for plain ``cross_entropy``; fed to a Hugging Face model they would train it to predict
the token after next. Checkpoints hold the model, the optimizer, the learning-rate
schedule and ``loader.state_dict()``, so ``--resume`` continues the data stream exactly.
This is a plain training loop; with the Hugging Face ``Trainer`` use
``tokenfeed.integrations.hf.TokenFeedTrainer``, which does the same in its checkpoints
(``docs/guides/huggingface.md``).

    python examples/train_hf.py                          # starts a server over ./demo-store
    python examples/train_hf.py --steps 100 --stop-after 40 --checkpoint hf.pt
    python examples/train_hf.py --steps 100 --checkpoint hf.pt --resume
    python examples/train_hf.py --endpoint tcp://127.0.0.1:7400 --dataset demo

Without ``--endpoint`` (or ``TOKENFEED_ENDPOINT``) it prepares the demo dataset into
``--store`` unless it is there, like ``demo.py``, and serves it for the run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, get_cosine_schedule_with_warmup

from tokenfeed import TokenFeedDataset, TokenFeedLoader
from tokenfeed_server.launch import ServerProcess

DEMO = "demo"


def make_model(args: argparse.Namespace, eos_id: int) -> GPT2LMHeadModel:
    """A GPT-2 sized by the flags, randomly initialised (seeded)."""
    torch.manual_seed(args.seed)
    config = GPT2Config(
        vocab_size=args.vocab_size,
        bos_token_id=eos_id,  # GPT-2's convention: one id starts and ends documents
        eos_token_id=eos_id,
        n_positions=args.seq_len,
        n_embd=args.d_model,
        n_layer=args.layers,
        n_head=args.heads,
        # no dropout: a small model on a stream sees every window once, and a resumed run
        # then computes exactly what an uninterrupted one would
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # the loss it uses anyway; naming it stops a warning
    return model


def make_loader(args: argparse.Namespace, endpoint: str) -> TokenFeedLoader:
    """The tokenfeed part: the plan, and labels the way Hugging Face models want them."""
    dataset = TokenFeedDataset(
        endpoint,
        args.dataset,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        seed=args.seed,
        token=args.token,  # None: the TOKENFEED_TOKEN environment variable
        labels="unshifted",  # labels == input_ids: the model shifts them itself
    )
    return TokenFeedLoader(dataset, num_workers=args.num_workers)


def save_checkpoint(path: Path, step: int, parts: dict[str, Any]) -> None:
    """Every ``state_dict()`` in ``parts`` plus the step, written then renamed."""
    state = {"step": step, **{name: part.state_dict() for name, part in parts.items()}}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash mid-save never leaves a truncated checkpoint


def load_checkpoint(path: Path, parts: dict[str, Any]) -> int:
    """Restore every part (the loader included) and return the step saved."""
    state: dict[str, Any] = torch.load(path, weights_only=True)
    for name, part in parts.items():
        part.load_state_dict(state[name])
    return int(state["step"])


def train(args: argparse.Namespace, endpoint: str) -> dict[str, Any]:
    """Train to ``args.steps``; returns the first and last logged loss, the step reached
    and the window ids trained on (one list per step), which tell a resumed run's data
    apart from an uninterrupted one's."""
    loader = make_loader(args, endpoint)
    eos_id = loader.dataset.check_server().eos_id  # the dataset's, from the server
    if eos_id >= args.vocab_size:
        raise SystemExit(f"the dataset's EOS id {eos_id} >= --vocab-size {args.vocab_size}")
    model = make_model(args, eos_id)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    schedule = get_cosine_schedule_with_warmup(opt, args.warmup, args.steps)
    parts: dict[str, Any] = {
        "model": model,
        "optimizer": opt,
        "schedule": schedule,
        "loader": loader,  # the consumed stream position: exact data resume
    }

    step = 0
    if args.resume:
        if args.checkpoint is None or not args.checkpoint.exists():
            raise SystemExit(f"--resume: no checkpoint at {args.checkpoint}")
        step = load_checkpoint(args.checkpoint, parts)
        print(f"resumed from {args.checkpoint} at step {step}", flush=True)

    stop = args.steps if args.stop_after is None else min(args.steps, step + args.stop_after)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"training a {n_params / 1e6:.2f}M-parameter GPT-2 on {args.dataset!r} from {endpoint}: "
        f"steps {step}-{stop} of {args.steps}, {args.batch_size} x {args.seq_len} tokens a step",
        flush=True,
    )
    windows: list[list[int]] = []
    losses: list[float] = []
    logged: list[float] = []
    started = time.perf_counter()
    model.train()
    for batch in loader:  # endless: the stream runs through epochs until we stop
        if step >= stop:
            break
        if int(batch["input_ids"].max()) >= args.vocab_size:
            raise SystemExit(
                f"token id {int(batch['input_ids'].max())} >= --vocab-size {args.vocab_size}; "
                "pass the vocab size that `tokenfeed-server inspect` shows for the dataset"
            )
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        step += 1
        losses.append(loss.item())
        windows.append(batch["window_ids"].tolist())
        if step % args.log_every == 0 or step == stop:
            logged.append(sum(losses) / len(losses))
            print(f"step {step:5d}  loss {logged[-1]:.3f}", flush=True)
            losses = []
        if args.checkpoint is not None and (step % args.save_every == 0 or step == stop):
            save_checkpoint(args.checkpoint, step, parts)

    if logged:
        print(
            f"done: step {step} in {time.perf_counter() - started:.1f}s, "
            f"loss {logged[0]:.3f} -> {logged[-1]:.3f}",
            flush=True,
        )
    return {
        "step": step,
        "first_loss": logged[0] if logged else float("nan"),
        "last_loss": logged[-1] if logged else float("nan"),
        "windows": windows,
    }


@contextmanager
def demo_server(store: Path) -> Iterator[str]:
    """Prepare the demo dataset into ``store`` unless it is there; serve it; yield its
    data endpoint; stop the server at the end."""
    from demo import DATASET, prepare_if_missing  # the script next to this one

    prepare_if_missing(store, "byte")
    with tempfile.TemporaryDirectory(prefix="tokenfeed-hf-") as tmp:
        server = ServerProcess(store, log_path=Path(tmp) / "server.log")
        try:
            server.start()
        except (RuntimeError, TimeoutError) as exc:
            raise SystemExit(f"the server did not get ready: {exc}") from None
        print(f"serving {DATASET!r} from {store} at {server.zmq}", flush=True)
        try:
            yield server.zmq
        finally:
            server.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--endpoint",
        default=os.environ.get("TOKENFEED_ENDPOINT"),
        help="server data endpoint [TOKENFEED_ENDPOINT; unset: serve --store for this run]",
    )
    p.add_argument(
        "--store", type=Path, default=Path("demo-store"), help="without --endpoint [./demo-store]"
    )
    p.add_argument("--dataset", default=DEMO, help="dataset name in the server's store")
    p.add_argument("--token", default=None, help="client token [TOKENFEED_TOKEN]")
    p.add_argument(
        "--steps", type=int, default=50, help="train until this step (the schedule's length)"
    )
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop (and save) after this many steps of this run, as a time-limited job would; "
        "--resume continues",
    )
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--vocab-size", type=int, default=257, help="257: the byte tokenizer")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10, help="learning-rate warm-up steps")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint", type=Path, default=None, help="save here (and resume)")
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    return p


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, serve the demo store if no endpoint is given, and train."""
    args = build_parser().parse_args(argv)
    if args.endpoint is not None:
        return train(args, args.endpoint)
    if args.dataset != DEMO:
        raise SystemExit(f"--dataset {args.dataset!r} needs --endpoint (only the demo is served)")
    with demo_server(args.store) as endpoint:
        return train(args, endpoint)


def main(argv: Sequence[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
