"""Hugging Face ``Trainer`` on a tokenfeed stream, resumed exactly from its checkpoints.

:class:`TokenFeedTrainer` is a ``transformers.Trainer`` whose ``train_dataset`` is a
:class:`~tokenfeed.TokenFeedDataset` (with ``labels="unshifted"``: Hugging Face causal
LMs shift the labels inside their loss). It trains from a
:class:`~tokenfeed.TokenFeedLoader` (the arguments' ``dataloader_num_workers``,
``dataloader_prefetch_factor`` and ``dataloader_pin_memory`` apply), writes the loader's
state into every checkpoint folder (:data:`STATE_FILE`) and loads it back on
``train(resume_from_checkpoint=...)``.

What the plain ``Trainer`` gets wrong with a stream: its DataLoader would batch single
rows and accelerate would shard them again, every key of a batch (``window_ids``,
``epoch``) would reach ``model.forward``, and on resume accelerate's
``skip_first_batches`` reads the trained batches again to throw them away (a replay of
the whole run through the server), or fails on a loader that is not a torch
``DataLoader``. Here the loader resumes from its saved position, so the Trainer is told
not to skip (``ignore_data_skip``); the model gets ``input_ids``, ``labels`` and
``attention_mask`` (plus ``position_ids`` with ``document_boundaries=True``), each
``[batch_size, seq_len]``.

This module imports ``transformers``; ``import tokenfeed`` does not import it.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput, get_last_checkpoint

from tokenfeed.errors import ConfigError
from tokenfeed.training.batches import Batch
from tokenfeed.training.dataset import TokenFeedDataset
from tokenfeed.training.loader import TokenFeedLoader

__all__ = ["STATE_FILE", "ModelBatches", "TokenFeedTrainer", "model_inputs"]

#: the loader's state in a checkpoint folder (``checkpoint-N/``)
STATE_FILE = "tokenfeed_loader.json"


def model_inputs(batch: Batch, *, position_ids: bool = False) -> Batch:
    """What a Hugging Face causal LM takes from a tokenfeed batch: ``input_ids``,
    ``labels`` and an all-ones ``attention_mask`` (rows are full windows, never padded),
    plus ``position_ids`` when asked (they restart at every document of a packed row)."""
    ids = batch["input_ids"]
    out = {"input_ids": ids, "labels": batch["labels"], "attention_mask": torch.ones_like(ids)}
    if position_ids:
        out["position_ids"] = batch["position_ids"]
    return out


class ModelBatches:
    """The loader's batches as :func:`model_inputs`, for the Trainer's loop.

    No ``__len__``: the stream's length is the Trainer's ``max_steps``. Re-iterating
    continues the stream (the loader keeps its position); :meth:`close` stops the
    iteration under way (its worker processes or receiver thread) when training ends.
    """

    def __init__(self, loader: TokenFeedLoader, *, position_ids: bool) -> None:
        self.loader = loader
        self.position_ids = position_ids
        self._live: Iterator[Batch] | None = None

    def __iter__(self) -> Iterator[Batch]:
        self.close()
        self._live = iter(self.loader)
        return (model_inputs(b, position_ids=self.position_ids) for b in self._live)

    def close(self) -> None:
        """Stop the iteration under way, if any (the loader then reports its position)."""
        live, self._live = self._live, None
        close = getattr(live, "close", None)
        if close is not None:
            close()


class TokenFeedTrainer(Trainer):
    """A ``transformers.Trainer`` that trains on a tokenfeed stream and resumes it exactly.

    Takes ``Trainer``'s arguments (``model`` and ``args`` positional, the rest by
    keyword); ``train_dataset`` must be a :class:`~tokenfeed.TokenFeedDataset` with
    ``labels="unshifted"``. The arguments are copied, with ``ignore_data_skip=True`` (the
    loader resumes itself) and ``per_device_train_batch_size`` set to the dataset's
    ``batch_size`` (the dataset batches; the Trainer's figures then count right). Give
    ``max_steps``: the stream is endless unless the dataset's ``epochs`` or ``samples``
    end it. :attr:`loader` is the :class:`~tokenfeed.TokenFeedLoader` it trains from.
    """

    def __init__(
        self, model: Any = None, args: TrainingArguments | None = None, **kwargs: Any
    ) -> None:
        dataset = kwargs.get("train_dataset")
        if not isinstance(dataset, TokenFeedDataset):
            raise ConfigError(
                f"TokenFeedTrainer needs train_dataset=TokenFeedDataset(...), got {dataset!r}"
            )
        if dataset.labels != "unshifted":
            raise ConfigError(
                "Hugging Face causal LMs shift the labels inside their loss: create the "
                'TokenFeedDataset with labels="unshifted" (the default, pre-shifted labels '
                "would train the model on the token after next)"
            )
        args = copy.copy(args) if args is not None else TrainingArguments("trainer_output")
        args.ignore_data_skip = True
        args.per_device_train_batch_size = dataset.job.batch_size
        super().__init__(model, args, **kwargs)
        self.loader = TokenFeedLoader(
            dataset,
            num_workers=args.dataloader_num_workers,
            pin_memory=None if args.dataloader_pin_memory else False,
            prefetch=args.dataloader_prefetch_factor or 4,
            multiprocessing_context=_context_name(args.dataloader_multiprocessing_context),
        )
        self._batches = ModelBatches(self.loader, position_ids=dataset.document_boundaries)
        self.add_callback(_LoaderCheckpoint(self.loader, self._batches))

    def get_train_dataloader(self) -> Any:
        """The loader's batches as the model takes them (see :class:`ModelBatches`)."""
        return self._batches

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> TrainOutput:
        """``Trainer.train``; resuming also loads the loader's state from the checkpoint
        (``True``: the last checkpoint in ``output_dir``, as the Trainer finds it)."""
        checkpoint: str | None = None
        if resume_from_checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
            if checkpoint is None:
                raise ValueError(
                    f"No valid checkpoint found in output directory ({self.args.output_dir})"
                )
        elif resume_from_checkpoint:
            checkpoint = os.fspath(resume_from_checkpoint)
        if checkpoint is not None:
            self.loader.load_state_dict(load_loader_state(checkpoint))
        return super().train(
            resume_from_checkpoint=checkpoint,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
            **kwargs,
        )


def load_loader_state(checkpoint: str | os.PathLike[str]) -> dict[str, Any]:
    """The loader state saved in ``checkpoint`` (a ``checkpoint-N`` folder)."""
    path = Path(checkpoint) / STATE_FILE
    try:
        state: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        # Refused, not restarted: without it the run would train on the first batches again.
        raise ConfigError(
            f"{checkpoint} has no {STATE_FILE}: it was not saved by TokenFeedTrainer, so "
            "where the data stream stopped is unknown; resume from a checkpoint it saved"
        ) from None
    return state


class _LoaderCheckpoint(TrainerCallback):
    """Writes the loader's state into each checkpoint folder; stops the loader's
    iteration when training ends."""

    def __init__(self, loader: TokenFeedLoader, batches: ModelBatches) -> None:
        self.loader = loader
        self.batches = batches

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        # Every rank's loader holds the same (global) position: the ranks that save write it.
        if not args.should_save:
            return
        folder = Path(str(args.output_dir)) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not folder.is_dir():  # a hyperparameter search saves elsewhere: nothing to pair
            return
        tmp = folder / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(self.loader.state_dict(), indent=1))
        os.replace(tmp, folder / STATE_FILE)  # never a half-written state

    def on_train_end(
        self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any
    ) -> None:
        self.batches.close()


def _context_name(context: Any) -> str | None:
    """The Trainer's multiprocessing context setting as the name the loader takes."""
    if context is None or isinstance(context, str):
        return context
    return str(context.get_start_method())
