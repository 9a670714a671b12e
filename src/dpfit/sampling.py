"""Poisson sampling: every example joins each logical batch independently with probability q.

This is the sampling the accountant's amplification assumes. A logical batch is split into
physical batches of bounded size (virtual steps), and an empty logical batch is still a step:
it releases pure noise and is accounted for.

In a data-parallel job every rank draws the same Poisson sample of the whole dataset and keeps
every world-th of its indices (`RankPart`): the union is exactly the one-process logical batch,
and the ranks' shares differ by at most one example, so no rank waits on a larger share at the
step's all-reduce (independent samples of per-rank shards, the other exact design, differ by
about sqrt(B/W) examples, and the slowest rank sets the pace). A loader over documents
(privacy_unit="document") splits the sample by documents: each rank holds whole documents.

The loader knows nothing of the engine: it reports where logical batches begin and end to any
`LogicalBatchEvents` (the engine passes a `LogicalStepTracker`, which it then consults).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dpfit.errors import SamplingError
from dpfit.rng import os_uniform, secure_seed

__all__ = [
    "EMPTY_BATCH",
    "EmptyBatch",
    "LogicalBatch",
    "LogicalBatchEvents",
    "LogicalStepTracker",
    "PhysicalBatches",
    "PoissonBatchSampler",
    "PoissonDataLoader",
    "RankPart",
    "secure_seed",
]


@dataclass(frozen=True)
class RankPart:
    """This process's part of every logical batch in a data-parallel job.

    share: hands rank 0's global draw to every rank (a broadcast); needed only with secure
    draws, which keep no generator state that the ranks could hold in common.
    """

    rank: int
    world_size: int
    share: Callable[[torch.Tensor | None], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")


class PoissonBatchSampler:
    """Yields index lists (possibly empty), `steps_per_epoch` of them per pass.

    Saves its position, so a pass can stop after any step and resume there (with the same
    draws only when `reproducible`: a publicly seeded generator).
    Without a generator it seeds one from os.urandom; with `secure` it uses none and draws
    every inclusion decision from os.urandom. With a `part`, every rank must hold the same
    generator state (the engine seeds it from rank 0); it yields this rank's indices only.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps_per_epoch: int | None = None,
        generator: torch.Generator | None = None,
        secure: bool = False,
        part: RankPart | None = None,
        reproducible: bool = False,
    ) -> None:
        if num_samples <= 0:
            raise ValueError("the dataset is empty")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if part is not None and part.world_size > 1:
            if secure and part.share is None:
                raise ValueError("secure draws in a data-parallel job need part.share")
            if not secure and generator is None:
                raise ValueError("a data-parallel part needs the generator every rank shares")
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.steps_per_epoch = steps_per_epoch or max(1, round(1 / sample_rate))
        self.secure = secure
        if generator is None and not secure:
            generator = torch.Generator().manual_seed(secure_seed())
        self.generator = None if secure else generator
        self.position = 0  # logical steps completed in the current pass
        # the generator was seeded from a public seed: its state is saved and restored, so a
        # resumed run draws what the uninterrupted one would. Otherwise a resumed pass keeps
        # its own OS-seeded generator: two continuations of one checkpoint draw different
        # batches, and no generator state is written to checkpoints.
        self.reproducible = reproducible
        self.part = None if part is None or part.world_size == 1 else part

    def __len__(self) -> int:
        return self.steps_per_epoch

    def draw(self) -> list[int]:
        """This process's indices of the next logical batch, ascending."""
        chosen = self._draw_all()
        if self.part is not None:
            chosen = chosen[self.part.rank :: self.part.world_size]
        return chosen.tolist()

    def _draw_all(self) -> torch.Tensor:
        if not self.secure:
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            return mask.nonzero().flatten()
        if self.part is None:
            return (os_uniform(self.num_samples) < self.sample_rate).nonzero().flatten()
        mine = None
        if self.part.rank == 0:
            mine = (os_uniform(self.num_samples) < self.sample_rate).nonzero().flatten()
        return self.part.share(mine)

    def __iter__(self) -> Iterator[list[int]]:
        while self.position < self.steps_per_epoch:
            idx = self.draw()
            self.position += 1
            yield idx
        self.position = 0

    def state_dict(self) -> dict:
        keep = self.reproducible and self.generator is not None
        return {"position": self.position, "rng": self.generator.get_state() if keep else None}

    def load_state_dict(self, sd: dict) -> None:
        self.position = int(sd["position"])
        if self.reproducible and self.generator is not None and sd.get("rng") is not None:
            self.generator.set_state(sd["rng"])


@dataclass(frozen=True)
class LogicalBatch:
    """What the engine needs to know about the logical batch now being processed."""

    size: int
    physical_batches: int
    chunk_sizes: tuple[int, ...] = ()  # examples in each physical batch, in order
    # documents (a loader over documents): each physical batch's rows' documents, as
    # indices into the logical batch's documents (there are `size` of them)
    chunk_documents: tuple[tuple[int, ...], ...] = ()

    def chunk_size(self, index: int) -> int | None:
        return self.chunk_sizes[index] if index < len(self.chunk_sizes) else None

    def chunk_document_ids(self, index: int) -> tuple[int, ...] | None:
        return self.chunk_documents[index] if index < len(self.chunk_documents) else None


class LogicalBatchEvents(Protocol):
    """What a loader of logical batches reports, in order, for each logical batch."""

    def begin(self, batch: LogicalBatch) -> None:
        """A non-empty logical batch starts; its physical batches follow."""

    def end(self) -> None:
        """The loader has yielded every physical batch of the current logical batch."""

    def empty(self) -> None:
        """An empty logical batch was drawn: still a step (noise only), with no batch."""


class LogicalStepTracker:
    """Where training stands within the current logical batch (a `LogicalBatchEvents`).

    `empty_step` is called for an empty logical batch and returns False when it cannot take
    the step yet (no optimizer seen); such steps wait in `pending_empty` until it can.
    """

    def __init__(self, empty_step: Callable[[], bool]) -> None:
        self._empty_step = empty_step
        self.current: LogicalBatch | None = None
        self.physical_left = 0
        self.pending_empty = 0

    # -- LogicalBatchEvents
    def begin(self, batch: LogicalBatch) -> None:
        if self.physical_left:
            raise SamplingError(
                "a new logical batch started before engine.step(optimizer) was called for every "
                "physical batch of the previous one; call it after each backward"
            )
        self.current = batch
        self.physical_left = batch.physical_batches

    def end(self) -> None:
        if self.physical_left:
            raise SamplingError(
                "call engine.step(optimizer) after each backward: "
                f"{self.physical_left} physical batch(es) of the last logical batch were not "
                "stepped"
            )

    def empty(self) -> None:
        if not self._empty_step():
            self.pending_empty += 1

    # -- the engine's queries
    def drawn_rows(self) -> int | None:
        """Examples in the physical batch now being stepped, when a loader drew it."""
        if self.current is None:
            return None
        return self.current.chunk_size(self.current.physical_batches - self.physical_left)

    def drawn_documents(self) -> tuple[tuple[int, ...], int] | None:
        """(each row's document, documents in the logical batch) for the physical batch now
        being stepped, when a loader over documents drew it."""
        if self.current is None:
            return None
        index = self.current.physical_batches - self.physical_left
        ids = self.current.chunk_document_ids(index)
        return None if ids is None else (ids, self.current.size)

    def physical_done(self) -> bool:
        """Count one physical batch as stepped; True when its logical batch is complete."""
        self.physical_left -= 1
        return self.physical_left <= 0

    def close(self) -> None:
        """The logical step was taken."""
        self.current = None
        self.physical_left = 0


class EmptyBatch(Mapping):
    """What a loader built with `yield_empty=True` yields for a logical batch that has no
    examples (on this rank): an empty, immutable mapping. The caller takes its noise-only step
    with `engine.empty_step(optimizer)`."""

    def __getitem__(self, key: Any) -> Any:
        raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "EMPTY_BATCH"


EMPTY_BATCH = EmptyBatch()


class PhysicalBatches:
    """One logical batch as its physical batches, for loops that take one item per logical
    step (transformers' Trainer): iterating it collates one physical batch at a time, so only
    one physical batch of inputs exists at once. Iterate it once, stepping after each backward.
    """

    def __init__(self, sizes: tuple[int, ...], batches: Iterator[Any]) -> None:
        self.sizes = sizes  # examples in each physical batch, in order
        self._batches = batches

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self) -> Iterator[Any]:
        return self._batches

    def __repr__(self) -> str:
        return f"PhysicalBatches(sizes={self.sizes})"


def default_collate(items: list[Any]) -> Any:
    return torch.utils.data.default_collate(items)


class PoissonDataLoader:
    """Physical batches of Poisson-sampled logical batches, reporting logical boundaries.

    `events` learns where each logical batch begins and ends (so the engine knows when to add
    noise) and when one is empty (a noise-only step without calling the model).
    """

    def __init__(
        self,
        events: LogicalBatchEvents,
        dataset: Sequence,
        sampler: PoissonBatchSampler,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        physical_batch_size: int | None = None,
        batch_context: Callable[[], contextlib.AbstractContextManager] | None = None,
        stop: Callable[[], bool] | None = None,
        yield_empty: bool = False,
        group_physical: bool = False,
        documents: bool = False,
    ) -> None:
        if physical_batch_size is not None and physical_batch_size < 1:
            raise ValueError("physical_batch_size must be >= 1")
        self.events = events
        self.dataset = dataset
        self.sampler = sampler
        self.collate_fn = collate_fn or default_collate
        self.physical_batch_size = physical_batch_size
        # held while the caller runs forward+backward on each physical batch (DDP's no_sync)
        self.batch_context = batch_context or contextlib.nullcontext
        # asked before each logical batch: ranks of a distributed job stop at the same step
        # even when the last ones are empty on some ranks (which step inside this loader)
        self.stop = stop
        # yield EMPTY_BATCH for an empty logical batch instead of reporting it to `events`
        # (its step is then the caller's): for loops that count one item per logical step,
        # like transformers' Trainer, so that every rank of a job counts the same steps
        self.yield_empty = yield_empty
        # yield one PhysicalBatches per logical batch instead of its physical batches one by
        # one: for the same one-item-per-logical-step loops
        self.group_physical = group_physical
        # the dataset's items are documents, each a sequence of rows (e.g. the windows of a
        # long text): documents are sampled, their rows batched, and each physical batch
        # reports which document every row belongs to (LogicalBatch.chunk_documents)
        self.documents = documents

    def __len__(self) -> int:
        """Logical steps per pass (the number of physical batches varies)."""
        return len(self.sampler)

    def _chunks(self, idx: list) -> list[list]:
        size = self.physical_batch_size or max(1, len(idx))
        return [idx[i : i + size] for i in range(0, len(idx), size)]

    def __iter__(self) -> Iterator[Any]:
        for idx in self.sampler:
            if self.stop is not None and self.stop():
                break
            rows: list = []
            if self.documents:  # rows: (document's place in this logical batch, item)
                # data-parallel, `idx` holds this rank's whole documents (RankPart splits the
                # sample by documents, not rows): a document's rows are all summed here, and
                # clipped once, never in parts on several ranks
                rows = [(j, x) for j, i in enumerate(idx) for x in self.dataset[i]]
            if not idx or (self.documents and not rows):
                # no examples, or only documents without rows (their gradient is zero):
                # still a step, of noise only, so every drawn logical batch is released
                # and accounted
                if self.yield_empty:
                    yield EMPTY_BATCH
                else:
                    self.events.empty()
                continue
            if self.documents:
                chunks = self._chunks(rows)
                owners = tuple(tuple(j for j, _ in c) for c in chunks)
                chunks = [[x for _, x in c] for c in chunks]
            else:
                chunks, owners = self._chunks(idx), ()
            sizes = tuple(len(c) for c in chunks)
            self.events.begin(LogicalBatch(len(idx), len(chunks), sizes, owners))
            if self.group_physical:
                yield PhysicalBatches(sizes, self._collated(chunks))
            else:
                yield from self._collated(chunks)
            self.events.end()

    def _collated(self, chunks: list[list[Any]]) -> Iterator[Any]:
        """Each chunk collated when it is reached (indices; a document loader's rows)."""
        for chunk in chunks:
            with self.batch_context():
                items = chunk if self.documents else [self.dataset[i] for i in chunk]
                yield self.collate_fn(items)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.sampler.load_state_dict(sd)
