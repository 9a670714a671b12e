"""Per-row keyed hashes: which rows are held out, subsampled, public, or a client's.

A split drawn from a seeded permutation of row *indices* depends on every row's position, so
adding one row to a file moves many others between the training and held-out sets, and the
stated epsilon then protects a group of rows, not one. Here a row's fate depends on its own
content and the public seed only: its key is a keyed BLAKE2b hash of the row's content (and,
for identical rows, which copy it is) mapped to [0, 1). A row is held out iff its key is below
the hold-out fraction, so adding or removing one row changes the other side by exactly that
row. A fixed-size subsample (the k smallest keys) cannot be as stable: adding a row changes it
by at most one row in and one out, a replace-one neighbour of the subsample.

Old runs' splits (permutations) are not reproduced; runs record :data:`SPLIT_RULE`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable

import numpy as np

SPLIT_RULE = "row-hash-v1"  # recorded by every run whose splits come from this module

# what a key is for: the same row gets independent keys for independent choices
HELD_OUT = "held-out"
SUBSAMPLE = "subsample"
PUBLIC = "public"
CLIENT = "client"
EVAL_SUBSAMPLE = "eval-subsample"
CLIENT_CAP = "client-cap"  # which of a client's rows train under --examples-per-client

# --max-train-examples is a fixed-size subsample: a row added to the file changes it by at
# most one row in and one row out, a replace-one neighbour of what trains
FIXED_SIZE_NOTE = (
    "a fixed-size subsample is not stable under adding one row to the file (one row may "
    "come in and another go out), so for adding or removing a row of the file the "
    "guarantee is the training set's replace-one epsilon (epsilon_replace_one)"
)
FIXED_SIZE_RECORD = (
    "--max-train-examples: adding or removing one row of the file changes the training set "
    "by at most one row in and one out; the file-level guarantee is epsilon_replace_one"
)

_UNIT = float(2**53)  # keys are 53-bit fractions: exact in a float64, never 1.0


def _key(seed: int) -> bytes:
    return str(int(seed)).encode()


def row_keys(contents: Iterable[bytes], seed: int, purpose: str) -> np.ndarray:
    """One key in [0, 1) per row, from the row's content, its copy number among identical
    rows (0 for the first in order, 1 for the second, ...), the seed and the purpose.

    Identical rows are interchangeable, so with copy numbers the *multiset* of rows on each
    side still changes by at most one row when a copy is added or removed anywhere.
    """
    person = purpose.encode()[:16]
    key = _key(seed)
    copies: dict[bytes, int] = {}
    out = []
    for content in contents:
        ident = hashlib.blake2b(content, digest_size=16).digest()
        copy = copies.get(ident, 0)
        copies[ident] = copy + 1
        h = hashlib.blake2b(ident + copy.to_bytes(8, "big"), key=key, person=person)
        out.append((int.from_bytes(h.digest()[:8], "big") >> 11) / _UNIT)
    return np.asarray(out, dtype=np.float64)


def text_row(text: str, label: str) -> bytes:
    """A labelled text's content: the text and its label *name* (ids depend on which other
    labels the file holds)."""
    return json.dumps([text, label], ensure_ascii=False).encode("utf-8")


def image_row(image: np.ndarray, label: str) -> bytes:
    """An image's content: dtype, shape and pixels, and its label name."""
    head = json.dumps([str(image.dtype), list(image.shape), label]).encode("utf-8")
    return head + b"\0" + np.ascontiguousarray(image).tobytes()


def held_out_mask(keys: np.ndarray, fraction: float) -> np.ndarray:
    """True for the rows held out: each row alone, iff its key < `fraction`."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    return np.asarray(keys) < fraction


def smallest(keys: np.ndarray, k: int) -> np.ndarray:
    """Indices (ascending) of the `k` rows with the smallest keys: a fixed-size subsample that
    one added row changes by at most one row in and one row out."""
    keys = np.asarray(keys)
    k = max(0, min(int(k), len(keys)))
    return np.sort(np.argsort(keys, kind="stable")[:k])


def half_width_95(n: int) -> float:
    """The binomial 95% half-width of an accuracy measured on `n` examples, at its widest
    (accuracy 0.5): how far the score can move by the draw of the test set alone."""
    return 1.96 * math.sqrt(0.25 / n) if n > 0 else math.inf


SMALL_TEST = 200  # a test set below this gets a note on how much its score can move


def small_test_note(n: int, what: str = "accuracy") -> str | None:
    """One line for a test set of fewer than SMALL_TEST examples, else None."""
    if n >= SMALL_TEST:
        return None
    return (
        f"small test set: {n} examples, so the {what} can move by up to "
        f"±{100 * half_width_95(n):.1f} points by the draw of the test set alone (binomial "
        "95% half-width at 50%)"
    )
