"""Train a small GPT on batches streamed from a tokenfeed server.

This is the example to copy: everything tokenfeed-specific is in ``make_loader`` and in
the three lines of ``save_checkpoint`` / ``load_checkpoint`` that handle the loader
state. The model is a plain-torch decoder (a few layers, byte-level vocabulary by
default) sized to train on a laptop CPU in a minute or two, so the loss falls visibly.

    tokenfeed-server serve --store demo-store &        # or: docker compose up server
    python examples/train_gpt.py --dataset demo --steps 300 --checkpoint ckpt.pt
    python examples/train_gpt.py --dataset demo --steps 600 --checkpoint ckpt.pt --resume

A resumed run continues the data stream exactly where the checkpoint left it (no batch
seen twice, none skipped), with any ``--num-workers``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.functional import cross_entropy, scaled_dot_product_attention

from tokenfeed import TokenFeedDataset, TokenFeedLoader

# ---------------------------------------------------------------------------- model


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 257  # the byte tokenizer: 256 bytes + EOS
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        # [B, T, C] -> [B, heads, T, C/heads]
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying: fewer parameters to learn
        # GPT-2's init: torch's defaults (unit-variance embeddings) start the loss far above
        # log(vocab_size) and waste the first steps bringing it down.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of a batch (labels are the inputs shifted by one)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok_emb(input_ids) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return cross_entropy(logits.flatten(0, 1), labels.flatten())


# ---------------------------------------------------------------------------- data


def make_loader(args: argparse.Namespace) -> TokenFeedLoader:
    """The only tokenfeed-specific setup: a dataset (the plan) and a loader (the workers).

    Each DataLoader worker asks the server for exactly its own batches; rank and
    world size come from ``torch.distributed`` or ``RANK``/``WORLD_SIZE`` when set.
    """
    dataset = TokenFeedDataset(
        args.endpoint,
        args.dataset,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        seed=args.seed,
        token=args.token,  # None: the TOKENFEED_TOKEN environment variable
    )
    return TokenFeedLoader(dataset, num_workers=args.num_workers)


# ---------------------------------------------------------------------------- checkpoints


def save_checkpoint(
    path: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, loader: TokenFeedLoader
) -> None:
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "loader": loader.state_dict(),  # the consumed stream position: exact data resume
    }
    # Write then rename, so a crash mid-save never leaves a truncated checkpoint.
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(
    path: Path, model: nn.Module, opt: torch.optim.Optimizer, loader: TokenFeedLoader
) -> int:
    state: dict[str, Any] = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    loader.load_state_dict(state["loader"])
    return int(state["step"])


# ---------------------------------------------------------------------------- training


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args: argparse.Namespace) -> dict[str, float]:
    """Train to ``args.steps``; returns the first and last logged loss and tokens/s."""
    torch.manual_seed(args.seed)
    cfg = GPTConfig(
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
    )
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    loader = make_loader(args)

    step = 0
    if args.resume:
        if args.checkpoint is None or not args.checkpoint.exists():
            raise SystemExit(f"--resume: no checkpoint at {args.checkpoint}")
        step = load_checkpoint(args.checkpoint, model, opt, loader)
        print(f"resumed from {args.checkpoint} at step {step}", flush=True)

    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"training {n_params / 1e6:.2f}M parameters on {args.dataset!r} from {args.endpoint}: "
        f"{args.steps} steps of {args.batch_size} x {args.seq_len} tokens, "
        f"{args.num_workers} loader workers",
        flush=True,
    )
    losses: list[float] = []
    logged: list[float] = []
    tokens = total_tokens = 0
    started = tick = time.perf_counter()
    model.train()
    for batch in loader:  # endless: the stream runs through epochs until we stop
        if step >= args.steps:
            break
        if step == 0 and int(batch["input_ids"].max()) >= cfg.vocab_size:
            raise SystemExit(
                f"token id {int(batch['input_ids'].max())} >= --vocab-size {cfg.vocab_size}; "
                "pass the vocab size that `tokenfeed-server inspect` shows for the dataset"
            )
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        loss = model(batch["input_ids"], batch["labels"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        losses.append(loss.item())
        tokens += batch["input_ids"].numel()
        total_tokens += batch["input_ids"].numel()

        if step % args.log_every == 0 or step == args.steps:
            now = time.perf_counter()
            rate = tokens / (now - tick)
            mean = sum(losses) / len(losses)
            logged.append(mean)
            print(f"step {step:5d}  loss {mean:.3f}  tokens/s {rate:,.0f}", flush=True)
            losses, tokens, tick = [], 0, now
        if args.checkpoint is not None and (step % args.save_every == 0 or step == args.steps):
            save_checkpoint(args.checkpoint, step, model, opt, loader)

    elapsed = time.perf_counter() - started
    summary = {
        "first_loss": logged[0] if logged else float("nan"),
        "last_loss": logged[-1] if logged else float("nan"),
        "tokens_per_s": total_tokens / elapsed,  # the whole run, start-up included
        "seconds": elapsed,
    }
    if logged:
        print(
            f"done: {step} steps in {elapsed:.1f}s, loss {summary['first_loss']:.3f} -> "
            f"{summary['last_loss']:.3f}, {summary['tokens_per_s']:,.0f} tokens/s",
            flush=True,
        )
    if args.checkpoint is not None:
        print(f"checkpoint: {args.checkpoint} (continue with --resume)", flush=True)
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--endpoint",
        default=os.environ.get("TOKENFEED_ENDPOINT", "tcp://127.0.0.1:7400"),
        help="server data endpoint [TOKENFEED_ENDPOINT, tcp://127.0.0.1:7400]",
    )
    p.add_argument("--dataset", default="demo", help="dataset name in the server's store")
    p.add_argument("--token", default=None, help="client token [TOKENFEED_TOKEN]")
    p.add_argument("--steps", type=int, default=300, help="train until this step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--vocab-size", type=int, default=257, help="257: the byte tokenizer")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30, help="learning-rate warm-up steps")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--checkpoint", type=Path, default=None, help="save here (and resume)")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    train(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
