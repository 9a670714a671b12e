"""Labelled text for classification: the user's own files and the bundled default, one type.

A user's CSV / JSONL / saved `datasets` folder and the bundled Rotten Tomatoes snippets all
become a :class:`LabeledTexts`, so training and evaluation never branch on where data came
from. Labels are mapped to ids once, from the training set; evaluation maps with the same
names and refuses labels it has never seen (silently dropping or remapping them would make
the reported accuracy wrong).
"""

from __future__ import annotations

import csv
import json
import logging
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dpfit.data.bundled import (
    ROTTEN_TOMATOES_LABELS,
    TextExample,
    rotten_tomatoes,
    split_by_group,
)
from dpfit.errors import DPFitError

logger = logging.getLogger(__name__)

SUPPORTED_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json")


class DataError(DPFitError, ValueError):
    """The data cannot be used as given; the message says what to change."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """The data path does not exist."""


class EmptyDataError(DataError):
    """The data holds no usable examples."""


class SingleClassError(DataError):
    """Training data with one label cannot train a classifier."""


class ColumnError(DataError):
    """A requested column is missing or does not hold what it should."""


class UnseenLabelError(DataError):
    """Evaluation data has labels the model was never trained on."""


@dataclass(frozen=True)
class LabeledTexts:
    """Texts with integer labels and the names those integers stand for."""

    texts: tuple[str, ...]
    labels: tuple[int, ...]
    label_names: tuple[str, ...]
    source: str = ""

    def __post_init__(self) -> None:
        if len(self.texts) != len(self.labels):
            raise ValueError("texts and labels differ in length")

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    def class_counts(self) -> dict[str, int]:
        counts = Counter(self.labels)
        return {name: counts.get(i, 0) for i, name in enumerate(self.label_names)}

    def subsample(self, n: int, seed: int = 0) -> LabeledTexts:
        """A seeded random subset of `n` examples (all of them if n >= len)."""
        if n >= len(self):
            return self
        idx = sorted(random.Random(seed).sample(range(len(self)), n))
        return LabeledTexts(
            tuple(self.texts[i] for i in idx),
            tuple(self.labels[i] for i in idx),
            self.label_names,
            f"{self.source} (random {n} of {len(self)})",
        )

    def split(self, fraction: float, seed: int = 0) -> tuple[LabeledTexts, LabeledTexts]:
        """Seeded random (rest, held-out) split with `fraction` of examples held out."""
        order = list(range(len(self)))
        random.Random(seed).shuffle(order)
        k = max(1, round(fraction * len(self)))
        held, rest = sorted(order[:k]), sorted(order[k:])

        def pick(idx: list[int], tag: str) -> LabeledTexts:
            return LabeledTexts(
                tuple(self.texts[i] for i in idx),
                tuple(self.labels[i] for i in idx),
                self.label_names,
                f"{self.source} ({tag})",
            )

        return pick(rest, "train part"), pick(held, "held-out part")


def from_examples(
    examples: Sequence[TextExample], label_names: Sequence[str], source: str = ""
) -> LabeledTexts:
    return LabeledTexts(
        tuple(e.text for e in examples),
        tuple(e.label for e in examples),
        tuple(label_names),
        source,
    )


@dataclass(frozen=True)
class BundledSplits:
    train: LabeledTexts
    validation: LabeledTexts
    test: LabeledTexts


def bundled_rotten_tomatoes(seed: int = 0) -> BundledSplits:
    """The default task: Rotten Tomatoes fresh/rotten, split 80/10/10 by movie with `seed`."""
    train, val, test = split_by_group(rotten_tomatoes(), (0.8, 0.1, 0.1), seed=seed)
    names = ROTTEN_TOMATOES_LABELS
    src = f"bundled Rotten Tomatoes (split by movie, seed {seed})"
    return BundledSplits(
        from_examples(train, names, f"{src}, train"),
        from_examples(val, names, f"{src}, validation"),
        from_examples(test, names, f"{src}, test"),
    )


# -- reading files -------------------------------------------------------------------------


def _read_rows(path: Path, split: str | None) -> tuple[list[dict], list[str]]:
    """Rows as dicts plus the column names, for CSV/TSV/JSONL/JSON or a `datasets` folder."""
    if path.is_dir():
        return _read_datasets_folder(path, split)
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f, delimiter="\t" if suffix == ".tsv" else ",")
            rows = list(reader)
            return rows, list(reader.fieldnames or [])
    if suffix in (".jsonl", ".json"):
        rows = []
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if suffix == ".json" and text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            for lineno, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}: line {lineno} is not valid JSON ({e.msg})") from e
        if any(not isinstance(r, dict) for r in rows):
            raise DataError(f"{path}: every JSON line must be an object with named fields")
        columns: list[str] = []
        for r in rows:
            columns.extend(k for k in r if k not in columns)
        return rows, columns
    raise DataError(
        f"{path}: unsupported file type {suffix or '(none)'!r}; use one of "
        f"{', '.join(SUPPORTED_SUFFIXES)} or a folder written by datasets' save_to_disk"
    )


def _read_datasets_folder(path: Path, split: str | None) -> tuple[list[dict], list[str]]:
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - optional dependency
        raise DataError(f"{path} is a folder; reading it needs `pip install datasets`") from e
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise DataError(
            f"{path} is a folder but not one written by datasets' save_to_disk: {e}"
        ) from e
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            split = "train" if "train" in ds else next(iter(ds))
        if split not in ds:
            raise DataError(f"{path} has splits {sorted(ds)}, not {split!r}")
        ds = ds[split]
    return ds.to_list(), list(ds.column_names)


def _is_number(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return False
        return True
    return False


def _label_key(value: object) -> str:
    """Labels are compared as strings so '1' in a CSV and 1 in JSONL mean the same class."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value).strip()


def _sorted_label_names(keys: Iterable[str]) -> tuple[str, ...]:
    keys = set(keys)
    if all(k.lstrip("-").isdigit() for k in keys):
        return tuple(sorted(keys, key=int))
    return tuple(sorted(keys))


def load_texts(
    path: str | Path,
    text_column: str = "text",
    label_column: str = "label",
    label_names: Sequence[str] | None = None,
    split: str | None = None,
) -> LabeledTexts:
    """Read labelled text from CSV, TSV, JSONL, a JSON list, or a saved `datasets` folder.

    Args:
        label_names: the training label set. If given (evaluation), each label must be one of
            these names (integer labels may also index them); otherwise the set is inferred
            (numeric order for integer labels, sorted order for names).
        split: which split of a saved DatasetDict folder (default: "train" or the first).

    Raises:
        DataFileNotFoundError, EmptyDataError, ColumnError, SingleClassError (training only),
        UnseenLabelError (evaluation only).
    """
    path = Path(path)
    if not path.exists():
        raise DataFileNotFoundError(f"data file {str(path)!r} does not exist")
    rows, columns = _read_rows(path, split)
    if not rows:
        raise EmptyDataError(f"{path} holds no rows")
    for col, flag in ((text_column, "--text-column"), (label_column, "--label-column")):
        if col not in columns:
            raise ColumnError(
                f"{path} has no column {col!r} (columns: {', '.join(columns) or 'none'}); "
                f"name the right one with {flag}"
            )

    texts: list[str] = []
    raw_labels: list[str] = []
    skipped = 0
    for row in rows:
        text, label = row.get(text_column), row.get(label_column)
        if text is None or label is None or (isinstance(text, str) and not text.strip()):
            skipped += 1
            continue
        if label == "" or (isinstance(label, str) and not label.strip()):
            skipped += 1
            continue
        texts.append(text)
        raw_labels.append(_label_key(label))
    if skipped:
        logger.warning("%s: skipped %d rows with an empty text or label", path, skipped)
    if not texts:
        raise EmptyDataError(
            f"{path}: no row has both a non-empty {text_column!r} and {label_column!r}"
        )
    if any(not isinstance(t, str) for t in texts) or all(_is_number(t) for t in texts):
        raise ColumnError(
            f"{path}: column {text_column!r} does not hold text (e.g. {texts[0]!r}); "
            "name the text column with --text-column"
        )

    if label_names is None:
        names = _sorted_label_names(raw_labels)
        if len(names) < 2:
            raise SingleClassError(
                f"{path}: every example has label {names[0]!r}; a classifier needs at least "
                f"two classes in {label_column!r}"
            )
    else:
        names = tuple(label_names)
    labels = _map_labels(raw_labels, names, path)
    return LabeledTexts(tuple(texts), tuple(labels), names, str(path))


def _map_labels(raw: Sequence[str], names: Sequence[str], path: Path) -> list[int]:
    index = {n: i for i, n in enumerate(names)}
    default_names = all(n == f"LABEL_{i}" for i, n in enumerate(names))
    out: list[int] = []
    unseen: Counter[str] = Counter()
    for key in raw:
        if key in index:
            out.append(index[key])
        elif default_names and key.isdigit() and int(key) < len(names):
            out.append(int(key))  # a model saved without label names: ids are the labels
        else:
            unseen[key] += 1
    if unseen:
        shown = ", ".join(f"{k!r} ({c}x)" for k, c in unseen.most_common(5))
        raise UnseenLabelError(
            f"{path}: labels not in the training label set {list(names)}: {shown}; "
            "evaluate on data with the training labels, or retrain with these labels included"
        )
    return out
