"""The non-private stepper: the same loop as a private run, no clipping or noise.

It keeps the `engine.step` contract, so private and non-private runs share one loop and their
comparison is like for like."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch


class ShuffledBatches:
    """Fixed-size shuffled logical batches split into physical ones; resumable by position.

    The order of a pass depends only on (seed, epoch), so the state is two integers.
    """

    def __init__(
        self, dataset: Sequence, batch_size: int, physical_batch_size: int, collate, seed: int
    ):
        self.dataset = dataset
        self.batch_size = batch_size
        self.physical_batch_size = physical_batch_size
        self.collate = collate
        self.seed = seed
        self.epoch = 0
        self.position = 0  # logical batches completed in this epoch
        self.last_chunk = False
        self.logical_size = 0

    def __len__(self) -> int:
        return math.ceil(len(self.dataset) / self.batch_size)

    def __iter__(self) -> Iterator[dict]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        perm = torch.randperm(len(self.dataset), generator=gen).tolist()
        while self.position < len(self):
            idx = perm[self.position * self.batch_size : (self.position + 1) * self.batch_size]
            self.position += 1
            self.logical_size = len(idx)
            idx = sorted(idx)  # the data is sorted by length: chunks pad little
            chunks = [
                idx[i : i + self.physical_batch_size]
                for i in range(0, len(idx), self.physical_batch_size)
            ]
            for j, chunk in enumerate(chunks):
                self.last_chunk = j == len(chunks) - 1
                batch = self.collate([self.dataset[i] for i in chunk])
                batch["_weight"] = len(chunk) / len(idx)
                yield batch
        self.position = 0
        self.epoch += 1

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.position = int(sd["epoch"]), int(sd["position"])


class PlainStepper:
    """The `engine.step` contract without privacy: step the optimizer after each logical batch."""

    def __init__(self, loader: ShuffledBatches):
        self.loader = loader
        self.steps_taken = 0

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        if not self.loader.last_chunk:
            return False
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.steps_taken += 1
        return True

    def epsilon(self) -> float:
        return math.inf

    def state_dict(self) -> dict:
        return {"steps_taken": self.steps_taken}

    def load_state_dict(self, sd: dict) -> None:
        self.steps_taken = int(sd["steps_taken"])
