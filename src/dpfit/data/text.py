"""Labelled text for classification: the user's own files and the bundled default, one type.

A user's CSV / JSONL / saved `datasets` folder and the bundled Rotten Tomatoes snippets all
become a :class:`LabeledTexts`, so training and evaluation never branch on where data came
from. Labels are mapped to ids once, from the training set; evaluation maps with the same
names and refuses labels it has never seen (silently dropping or remapping them would make
the reported accuracy wrong).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpfit.data.bundled import (
    ROTTEN_TOMATOES_LABELS,
    TextExample,
    rotten_tomatoes,
    split_by_group,
)
from dpfit.data.rowhash import (
    HELD_OUT,
    SUBSAMPLE,
    held_out_mask,
    row_keys,
    smallest,
    text_row,
)
from dpfit.errors import DPFitError

logger = logging.getLogger(__name__)

SUPPORTED_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json")
SKIPPED_SHOWN = 5  # rows skipped for an empty cell: where the first few are, in the warning


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


class LabelTypeError(ColumnError):
    """The label column does not look like class names: mixed types, continuous, too many."""


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

    def row_keys(self, seed: int, purpose: str) -> np.ndarray:
        """Each row's key in [0, 1) from its text and label name (dpfit.data.rowhash)."""
        names = self.label_names
        rows = (text_row(t, names[y]) for t, y in zip(self.texts, self.labels, strict=True))
        return row_keys(rows, seed, purpose)

    def subsample(self, n: int, seed: int = 0) -> LabeledTexts:
        """The `n` rows with the smallest keys (all of them if n >= len): one row added to
        the data changes this subset by at most one row in and one row out."""
        if n >= len(self):
            return self
        idx = smallest(self.row_keys(seed, SUBSAMPLE), n).tolist()
        return self._pick(idx, f"random {n} of {len(self)} by row hash, seed {seed}")

    def split(self, fraction: float, seed: int = 0) -> tuple[LabeledTexts, LabeledTexts]:
        """(rest, held-out): a row is held out iff its own key is below `fraction`, so one
        row added to or removed from the data changes each side by that row alone. About
        `fraction` of the rows are held out (binomially many; possibly none)."""
        held = held_out_mask(self.row_keys(seed, HELD_OUT), fraction)
        rest_idx = [i for i in range(len(self)) if not held[i]]
        held_idx = [i for i in range(len(self)) if held[i]]
        return self._pick(rest_idx, "train part"), self._pick(held_idx, "held-out part")

    def _pick(self, idx: Sequence[int], tag: str) -> LabeledTexts:
        return LabeledTexts(
            tuple(self.texts[i] for i in idx),
            tuple(self.labels[i] for i in idx),
            self.label_names,
            f"{self.source} ({tag})",
        )


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


def _read_text(path: Path) -> str:
    """The file as UTF-8; a file in another encoding is a DataError naming the line and fix."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path}: line {line} is not UTF-8 (byte 0x{data[e.start]:02x}; a Latin-1 or "
            f"Windows-1252 file?); save it as UTF-8, e.g. iconv -f latin1 -t utf-8 {path} > "
            f"{path.with_stem(path.stem + '-utf8')}"
        ) from None


def _read_rows(path: Path, split: str | None) -> tuple[list[dict], list[str], list[str]]:
    """Rows as dicts, the column names, and where each row is ("line 7", for errors), for
    CSV/TSV/JSONL/JSON or a `datasets` folder."""
    if path.is_dir():
        rows, columns = _read_datasets_folder(path, split)
        return rows, columns, [f"row {i}" for i in range(1, len(rows) + 1)]
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        text = _read_text(path)
        reader = csv.DictReader(
            io.StringIO(text, newline=""), delimiter="\t" if suffix == ".tsv" else ","
        )
        rows, where = [], []
        for row in reader:
            rows.append(row)
            where.append(f"line {reader.line_num}")
        return rows, list(reader.fieldnames or []), where
    if suffix in (".jsonl", ".json"):
        rows, where = [], []
        text = _read_text(path)
        if suffix == ".json" and text.lstrip().startswith("["):
            rows = json.loads(text)
            where = [f"item {i}" for i in range(1, len(rows) + 1)]
        else:
            for lineno, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}: line {lineno} is not valid JSON ({e.msg})") from e
                where.append(f"line {lineno}")
        if any(not isinstance(r, dict) for r in rows):
            raise DataError(f"{path}: every JSON line must be an object with named fields")
        columns: list[str] = []
        for r in rows:
            columns.extend(k for k in r if k not in columns)
        return rows, columns, where
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
    key = str(value).strip()
    if re.fullmatch(r"-?\d+\.0+", key):  # "1.0" in a CSV is the class 1, as 1.0 in JSON
        key = key.split(".")[0]
    return key


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
    label_ids: bool = False,
) -> LabeledTexts:
    """Read labelled text from CSV, TSV, JSONL, a JSON list, or a saved `datasets` folder.

    Args:
        label_names: the training label set. If given (evaluation), each label must be one of
            these names (integer labels may also index them); otherwise the set is inferred
            (numeric order for integer labels, sorted order for names).
        split: which split of a saved DatasetDict folder (default: "train" or the first).
        label_ids: with `label_names` (the user's --labels), an integer label k that is not
            itself a name stands for the k-th name (their order fixes the class ids).

    Raises:
        DataFileNotFoundError, EmptyDataError, ColumnError, SingleClassError (training only),
        UnseenLabelError (evaluation only).
    """
    return _load(path, text_column, label_column, label_names, split, label_ids)[0]


def load_grouped_texts(
    path: str | Path,
    group_column: str,
    text_column: str = "text",
    label_column: str = "label",
    label_names: Sequence[str] | None = None,
    split: str | None = None,
    label_ids: bool = False,
    *,
    flag: str = "--client-column",
    required: bool = False,
) -> tuple[LabeledTexts, tuple[str, ...]]:
    """:func:`load_texts` plus each kept row's value of `group_column` (as a string), for
    data whose rows belong to units such as federated clients or users. A row with an empty
    group is skipped like one with an empty text, or with `required` (the group is the unit
    epsilon protects: a row without one would be nobody's) refused, naming the rows; a
    column empty in every row is a ColumnError. `flag`: the option that names the column."""
    return _load(
        path, text_column, label_column, label_names, split, label_ids, group_column, flag,
        required,
    )  # fmt: skip


def _load(
    path: str | Path,
    text_column: str,
    label_column: str,
    label_names: Sequence[str] | None,
    split: str | None,
    label_ids: bool,
    group_column: str | None = None,
    group_flag: str = "--client-column",
    group_required: bool = False,
) -> tuple[LabeledTexts, tuple[str, ...]]:
    path = Path(path)
    if not path.exists():
        raise DataFileNotFoundError(f"data file {str(path)!r} does not exist")
    rows, columns, where = _read_rows(path, split)
    if not rows:
        raise EmptyDataError(f"{path} holds no rows")
    wanted = [(text_column, "--text-column"), (label_column, "--label-column")]
    if group_column is not None:
        wanted.append((group_column, group_flag))
    for col, flag in wanted:
        if col not in columns:
            raise ColumnError(
                f"{path} has no column {col!r} (columns: {', '.join(columns) or 'none'}); "
                f"name the right one with {flag}"
            )

    texts: list[str] = []
    raw_labels: list[str] = []
    kept_at: list[str] = []
    groups: list[str] = []
    skipped: list[str] = []  # where each skipped row is ("line 7")
    if group_column is not None and all(_blank(r.get(group_column)) for r in rows):
        raise ColumnError(
            f"{path}: column {group_column!r} is empty in every row (columns: "
            f"{', '.join(columns)}); name the column that says whose each row is with "
            f"{group_flag}"
        )
    if group_column is not None and group_required:
        blank = [at for r, at in zip(rows, where, strict=True) if _blank(r.get(group_column))]
        if blank:
            shown = ", ".join(blank[:SKIPPED_SHOWN]) + (", ..." if blank[SKIPPED_SHOWN:] else "")
            raise ColumnError(
                f"{path}: {len(blank)} row(s) have an empty {group_column!r} ({shown}); "
                "every row must say whose it is, since all of one person's rows are "
                "protected together: fill in their ids, or remove those rows"
            )
    for row, at in zip(rows, where, strict=True):
        text, label = row.get(text_column), row.get(label_column)
        if group_column is not None and _blank(row.get(group_column)):
            skipped.append(at)
            continue
        if text is None or label is None or (isinstance(text, str) and not text.strip()):
            skipped.append(at)
            continue
        if label == "" or (isinstance(label, str) and not label.strip()):
            skipped.append(at)
            continue
        texts.append(text)
        raw_labels.append(_label_key(label))
        kept_at.append(at)
        if group_column is not None:
            groups.append(_label_key(row[group_column]))
    if skipped:
        what = "text, label or " + repr(group_column) if group_column else "text or label"
        shown = ", ".join(skipped[:SKIPPED_SHOWN]) + (", ..." if skipped[SKIPPED_SHOWN:] else "")
        logger.warning("%s: skipped %d rows with an empty %s (%s)", path, len(skipped), what, shown)
    if not texts:
        raise EmptyDataError(
            f"{path}: no row has both a non-empty {text_column!r} and {label_column!r}"
        )
    if all(_is_number(t) for t in texts):
        raise ColumnError(
            f"{path}: column {text_column!r} holds numbers, not text (e.g. {texts[0]!r} at "
            f"{kept_at[0]}); name the text column with --text-column"
        )
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise ColumnError(
            f"{path}: {kept_at[bad]}: {text_column!r} is {texts[bad]!r} ({type(texts[bad]).__name__}), "
            f"not text; write it as a string (in quotes) or drop that row"
        )

    if label_names is None:
        names = _sorted_label_names(raw_labels)
        if len(names) < 2:
            raise SingleClassError(
                f"{path}: every example has label {names[0]!r}; a classifier needs at least "
                f"two classes in {label_column!r}"
            )
        _check_inferred_labels(names, raw_labels, kept_at, path, label_column)
    else:
        names = tuple(label_names)
    labels = _map_labels(raw_labels, names, path, ids=label_ids)
    return LabeledTexts(tuple(texts), tuple(labels), names, str(path)), tuple(groups)


def _blank(value: object) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


MAX_INFERRED_CLASSES = 100  # more distinct labels read from a file: refused, see below


def _check_inferred_labels(
    names: Sequence[str], raw: Sequence[str], at: Sequence[str], path: Path, column: str
) -> None:
    """Label sets read from the data that are almost surely a mistake, refused with the
    reason: numbers mixed with names (0/1 beside neg/pos would train four classes), values
    that look continuous, or more classes than MAX_INFERRED_CLASSES."""
    numeric = [n for n in names if _is_number(n)]
    if numeric and len(numeric) < len(names):
        word = next(n for n in names if not _is_number(n))
        i, j = raw.index(numeric[0]), raw.index(word)
        raise LabelTypeError(
            f"{path}: column {column!r} mixes numbers and names ({numeric[0]!r} at {at[i]}, "
            f"{word!r} at {at[j]}), which would train {len(names)} classes; make the column "
            "consistent, or give the classes in id order with --labels (e.g. --labels "
            f"{','.join(n for n in names if not _is_number(n))[:60]}) to map number k to the "
            "k-th name"
        )
    fractional = [n for n in numeric if not n.lstrip("-").isdigit()]
    if fractional:
        raise LabelTypeError(
            f"{path}: column {column!r} looks continuous ({len(names)} distinct values, e.g. "
            f"{fractional[0]!r}); a classifier needs categories: bin the values into classes, "
            "or name the label column with --label-column"
        )
    if len(names) > MAX_INFERRED_CLASSES:
        raise LabelTypeError(
            f"{path}: column {column!r} has {len(names)} distinct values, more than the "
            f"{MAX_INFERRED_CLASSES} classes dpfit reads from data (e.g. {names[0]!r}, "
            f"{names[1]!r}); check --label-column, or give the classes with --labels"
        )


def _map_labels(
    raw: Sequence[str], names: Sequence[str], path: Path, ids: bool = False
) -> list[int]:
    index = {n: i for i, n in enumerate(names)}
    default_names = ids or all(n == f"LABEL_{i}" for i, n in enumerate(names))
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


# -- users: many rows to one person (--privacy-unit user) ----------------------------------

# Rows of one user that train, at most. The guarantee does not depend on it (a user's rows are
# summed and clipped as one contribution, however many there are); it bounds the work one
# sampled user brings to a step (at most this many rows, so a logical batch of B users costs
# at most 32 B rows) and how much of a user's data is kept: 32 keeps every row of most users
# in per-user text data (reviews, messages, notes) at a step cost within 32x of one row each.
MAX_ROWS_PER_USER = 32
USER_ROWS = "user-rows"  # rowhash purpose: which of a user's rows train under the cap


def user_keys(users: Iterable[str], seed: int, purpose: str) -> dict[str, float]:
    """Each distinct user's key in [0, 1) from the user id alone (dpfit.data.rowhash): which
    side of a split a user falls on depends on that user only, and all their rows go there."""
    names = sorted(set(users))
    keys = row_keys((b"user\0" + u.encode("utf-8") for u in names), seed, purpose)
    return dict(zip(names, keys.tolist(), strict=True))


def user_groups(users: Sequence[str]) -> list[list[int]]:
    """Each user's row indices (ascending), users in order of their ids."""
    by_user: dict[str, list[int]] = {}
    for i, u in enumerate(users):
        by_user.setdefault(u, []).append(i)
    return [by_user[u] for u in sorted(by_user)]


def rows_within_cap(
    users: Sequence[str], contents: Sequence[bytes], k: int, seed: int
) -> list[int]:
    """Indices (ascending) of the rows kept: of each user with more than `k` rows, the `k`
    with the smallest keyed hash of their content (copies numbered within the user). Which
    of a user's rows train depends on that user's rows and the seed alone, never on the
    labels, the file order or other users."""
    kept: list[int] = []
    for idx in user_groups(users):
        if len(idx) <= k:
            kept += idx
            continue
        keys = row_keys((contents[i] for i in idx), seed, USER_ROWS)
        kept += [idx[j] for j in smallest(keys, k).tolist()]
    return sorted(kept)


@dataclass(frozen=True)
class UserTexts:
    """Labelled texts and each row's user (``--user-column``): the data of the user unit,
    where epsilon protects everything one user contributed."""

    rows: LabeledTexts
    users: tuple[str, ...]  # one per row

    def __post_init__(self) -> None:
        if len(self.users) != len(self.rows):
            raise ValueError("users and rows differ in length")

    def __len__(self) -> int:
        """The number of users (n of the user unit), not of rows."""
        return len(set(self.users))

    def split(
        self, fraction: float, seed: int = 0, purpose: str = HELD_OUT
    ) -> tuple[UserTexts, UserTexts]:
        """(rest, held-out) by user: a user is held out iff the keyed hash of their id (for
        `purpose`) is below `fraction`, with all their rows; adding or removing a user
        changes each side by that user alone."""
        keys = user_keys(self.users, seed, purpose)
        held = [keys[u] < fraction for u in self.users]
        rest = [i for i, h in enumerate(held) if not h]
        return self._pick(rest, "train users"), self._pick(
            [i for i, h in enumerate(held) if h], "held-out users"
        )

    def subsample(self, k: int, seed: int = 0) -> UserTexts:
        """The `k` users with the smallest keyed hash of their id, with all their rows (one
        user added changes them by at most one user in and one out)."""
        keys = user_keys(self.users, seed, SUBSAMPLE)
        if k >= len(keys):
            return self
        chosen = set(sorted(keys, key=keys.__getitem__)[:k])
        return self._pick([i for i, u in enumerate(self.users) if u in chosen], f"{k} users")

    def capped(self, k: int, seed: int = 0) -> UserTexts:
        """At most `k` rows of each user (rows_within_cap)."""
        names = self.rows.label_names
        contents = [
            text_row(t, names[y]) for t, y in zip(self.rows.texts, self.rows.labels, strict=True)
        ]
        kept = rows_within_cap(self.users, contents, k, seed)
        return self if len(kept) == len(self.users) else self._pick(kept, f"<= {k} rows a user")

    def groups(self) -> list[list[int]]:
        """Each user's row indices, users in order of their ids."""
        return user_groups(self.users)

    def _pick(self, idx: Sequence[int], tag: str) -> UserTexts:
        return UserTexts(self.rows._pick(idx, tag), tuple(self.users[i] for i in idx))
