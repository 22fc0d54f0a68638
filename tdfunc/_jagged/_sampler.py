"""Batches of similar lengths: a DataLoader batch sampler that groups samples by length, so
that a padded batch wastes little padding and a compiled step sees a handful of shapes.

The rule (as Hugging Face's ``group_by_length``): each epoch the samples are shuffled, cut
into groups of ``batch_size * group_size``, each group sorted by length (longest first) and
cut into batches; the batches are then shuffled. A batch holds samples of similar lengths,
the epoch still visits every sample once in a random order of batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor
from torch.utils.data import Sampler

SAMPLER_LENGTHS = (
    "LengthGroupedSampler: lengths must be a 1-d sequence of non-negative ints, got {got}"
)
SAMPLER_POSITIVE = "LengthGroupedSampler: {name} must be a positive int, got {got!r}"


class LengthGroupedSampler(Sampler[list[int]]):
    """Batches of indices of samples of similar lengths, for ``DataLoader(batch_sampler=...)``.

    Args:
        lengths: the length of each sample (ints or a 1-d integer tensor).
        batch_size: samples per batch.
        group_size: batches per group sorted together: larger groups give batches of closer
            lengths and a less random epoch (50: Hugging Face's default).
        shuffle: shuffle the samples and the batches (``False``: the dataset's order cut
            into groups, each sorted, for evaluation).
        drop_last: drop the last batch of each group when it is smaller than ``batch_size``
            (only the last group can have one).
        seed: the epoch's shuffle is drawn from ``seed + epoch`` (:meth:`set_epoch`), so
            each epoch is reproducible and every process of a job draws the same one.

    Raises:
        ValueError: lengths that are not non-negative ints, or ``batch_size`` /
            ``group_size`` below 1.

    Example:
        >>> import torch, tdfunc
        >>> lengths = [3, 90, 4, 88, 5, 91, 2, 89]
        >>> sampler = tdfunc.LengthGroupedSampler(lengths, batch_size=2, group_size=4)
        >>> batches = list(sampler)
        >>> sorted(i for b in batches for i in b) == list(range(8))
        True
        >>> all(max(lengths[i] for i in b) - min(lengths[i] for i in b) <= 2 for b in batches)
        True
        >>> len(sampler)
        4
    """

    def __init__(
        self,
        lengths: Sequence[int] | Tensor,
        batch_size: int,
        *,
        group_size: int = 50,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
    ) -> None:
        for name, v in (("batch_size", batch_size), ("group_size", group_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(SAMPLER_POSITIVE.format(name=name, got=v))
        try:
            lens = torch.as_tensor(lengths)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(SAMPLER_LENGTHS.format(got=type(lengths).__name__)) from e
        if lens.dim() != 1 or lens.dtype.is_floating_point or lens.dtype.is_complex:
            raise ValueError(SAMPLER_LENGTHS.format(got=f"shape {tuple(lens.shape)}, {lens.dtype}"))
        if lens.dtype == torch.bool or (lens.numel() and int(lens.min()) < 0):
            raise ValueError(SAMPLER_LENGTHS.format(got="a negative or bool entry"))
        self.lengths = lens.to(torch.int64)
        self.batch_size = batch_size
        self.group_size = group_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw the next ``__iter__`` from ``seed + epoch`` (as ``DistributedSampler``)."""
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        n = len(self.lengths)
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)
        span = self.batch_size * self.group_size
        batches: list[list[int]] = []
        for start in range(0, n, span):
            group = order[start : start + span]
            # longest first; stable, so equal lengths keep the shuffled order
            ranked = group[torch.sort(self.lengths[group], descending=True, stable=True)[1]]
            for b in range(0, len(ranked), self.batch_size):
                batch = ranked[b : b + self.batch_size].tolist()
                if len(batch) == self.batch_size or not self.drop_last:
                    batches.append(batch)
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        n = len(self.lengths)
        full, rest = divmod(n, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)


__all__ = ["LengthGroupedSampler"]
