"""The torch face of tokenfeed: what a training loop iterates.

- :mod:`~tokenfeed.training.dataset`: :class:`TokenFeedDataset`, the ``IterableDataset``
  each DataLoader worker runs (its arguments checked once in
  :mod:`~tokenfeed.training.config`, its resume state in :mod:`~tokenfeed.training.resume`).
- :mod:`~tokenfeed.training.loader`: :class:`TokenFeedLoader`, a DataLoader that knows its
  place (fed by :mod:`~tokenfeed.training.sources`).
- :mod:`~tokenfeed.training.batches`: received rows to the batches a model takes
  (:mod:`~tokenfeed.training.documents` for document boundaries).
- :mod:`~tokenfeed.training.device`: pinned, asynchronous copies to the GPU.
- :mod:`~tokenfeed.training.consumed`: the consumed position, shared with the workers.

This package imports nothing itself, so :mod:`~tokenfeed.training.consumed` and
:mod:`~tokenfeed.training.documents` stay usable without torch; ``tokenfeed.dataset`` and
``tokenfeed.loader`` are the documented import paths of the two classes.
"""
