"""What every task plug-in is (:class:`Task`) and hands the loop (:class:`Prepared`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class Prepared:
    """What a task hands the loop before training: data read, model built."""

    model: torch.nn.Module
    tokenizer: Any
    n: int  # training examples (public)
    num_classes: int  # 0 for language modelling
    head_names: tuple[str, ...]  # modules that train beside the biases
    notes: list[str] = field(default_factory=list)
    state: dict = field(default_factory=dict)  # task-private: data splits, baselines
    biases_added: bool = False  # the task already added biases (DP-BiTFiT-Add)
    head_only: bool = False  # the head modules alone train (DP last layer), no biases
    # the model arrives trained for these classes (a public checkpoint with its head): the
    # loop scores it before training, so a run shows what private training added to it
    starts_trained: bool = False
    # what one training item is, the unit epsilon protects: "example", or for long documents
    # cut into windows "window" (each window) or "document" (all of a document's windows)
    privacy_unit: str = "example"


class Task(Protocol):
    name: str

    def prepare(self, config) -> Prepared: ...

    def items(self, prep: Prepared, max_length: int) -> list: ...

    def collate(self, prep: Prepared, position_ids: bool) -> Callable[[list], dict]: ...

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor: ...

    def evaluate(self, prep: Prepared, model: torch.nn.Module, config, device) -> dict: ...

    def save(self, prep: Prepared, model: torch.nn.Module, folder) -> None: ...
