"""Splits that keep neighbours neighbours: one row added to or removed from a user's file
changes the training set by exactly that row (by at most one swap under a fixed-size
subsample), wherever the row sits and whatever else the file holds."""

import csv
from collections import Counter

import numpy as np
import pytest

from dpfit.data.rowhash import (
    HELD_OUT,
    SPLIT_RULE,
    SUBSAMPLE,
    half_width_95,
    row_keys,
    small_test_note,
    smallest,
    text_row,
)
from dpfit.data.text import LabeledTexts, load_texts
from dpfit.tasks.classification import HELD_OUT_FRACTION, prepare_data
from dpfit.train import TrainConfig

N = 1000  # the reviewer's case: 86 other rows moved when one row was appended


def rows(n: int, start: int = 0) -> list[tuple[str, str]]:
    return [(f"review number {i}: {'good' if i % 3 else 'bad'}", "pos" if i % 3 else "neg")
            for i in range(start, start + n)]  # fmt: skip


def write(path, data) -> str:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("text", "label"))
        w.writerows(data)
    return str(path)


def bag(d: LabeledTexts) -> Counter:
    """The multiset of (text, label name): identical rows are interchangeable."""
    return Counter((t, d.label_names[y]) for t, y in zip(d.texts, d.labels, strict=True))


def neighbours(tmp_path, base, extra=("an added review", "pos"), at=None):
    """(the file, the file with `extra` inserted at `at` (appended when None), the file with
    row `len // 2` removed), loaded as a user's file is."""
    added = list(base)
    added.insert(len(added) if at is None else at, extra)
    removed = base[: len(base) // 2] + base[len(base) // 2 + 1 :]
    return (
        load_texts(write(tmp_path / "d.csv", base)),
        load_texts(write(tmp_path / "added.csv", added)),
        load_texts(write(tmp_path / "removed.csv", removed)),
    )


def test_keys_are_uniform_deterministic_and_seeded():
    data = [text_row(f"t{i}", "a") for i in range(20000)]
    k = row_keys(data, 3, HELD_OUT)
    assert np.array_equal(k, row_keys(data, 3, HELD_OUT))
    assert not np.array_equal(k, row_keys(data, 4, HELD_OUT))
    assert not np.array_equal(k, row_keys(data, 3, SUBSAMPLE))  # independent per purpose
    assert 0 <= k.min() and k.max() < 1
    assert abs((k < 0.1).mean() - 0.1) < 0.01  # about the fraction asked for
    # a row's key is its own: the same row has the same key wherever it sits
    assert row_keys(data[::-1], 3, HELD_OUT)[::-1].tolist() == k.tolist()


def test_identical_rows_get_distinct_keys_by_copy_number():
    k = row_keys([b"same", b"same", b"other", b"same"], 0, HELD_OUT)
    assert len(set(k.tolist())) == 4
    # copy numbers count in order: the first copy's key is the same with or without others
    assert k[0] == row_keys([b"same"], 0, HELD_OUT)[0]


def test_smallest_and_half_width():
    assert smallest(np.array([0.5, 0.1, 0.9, 0.2]), 2).tolist() == [1, 3]
    assert half_width_95(100) == pytest.approx(0.098)
    assert "±9.8 points" in small_test_note(100) and small_test_note(200) is None


@pytest.mark.parametrize("at", [None, 0, 517])
def test_split_adding_or_removing_a_row_moves_only_that_row(tmp_path, at):
    base, added, removed = neighbours(tmp_path, rows(N), at=at)
    train, test = base.split(0.1, seed=0)
    train_a, test_a = added.split(0.1, seed=0)
    train_r, test_r = removed.split(0.1, seed=0)
    new = Counter({("an added review", "pos"): 1})
    gone = Counter({rows(N)[N // 2]: 1})
    # exactly that row changes side: the other side is untouched
    assert (bag(train_a) - bag(train)) + (bag(test_a) - bag(test)) == new
    assert not (bag(train) - bag(train_a)) and not (bag(test) - bag(test_a))
    assert (bag(train) - bag(train_r)) + (bag(test) - bag(test_r)) == gone
    assert not (bag(train_r) - bag(train)) and not (bag(test_r) - bag(test))


def test_split_is_stable_when_a_new_label_renumbers_the_others(tmp_path):
    """Label ids come from the sorted names in the file: a row with a new name ("aaa") shifts
    every other id. Keys hash the name, so no other row moves."""
    base, added, _ = neighbours(tmp_path, rows(N), extra=("odd one", "aaa"))
    assert added.label_names == ("aaa", "neg", "pos")
    t, h = base.split(0.1, seed=5)
    t2, h2 = added.split(0.1, seed=5)
    assert sum(((bag(t2) - bag(t)) + (bag(h2) - bag(h))).values()) == 1
    assert not (bag(t) - bag(t2)) and not (bag(h) - bag(h2))


def test_split_with_duplicate_rows_changes_by_one_copy(tmp_path):
    base = rows(300) * 3  # every row three times
    _, added, _ = neighbours(tmp_path, base, extra=base[7], at=0)  # a fourth copy, first
    b = load_texts(write(tmp_path / "dup.csv", base))
    t, h = b.split(0.3, seed=1)
    t2, h2 = added.split(0.3, seed=1)
    assert sum(((bag(t2) - bag(t)) + (bag(h2) - bag(h))).values()) == 1
    assert not (bag(t) - bag(t2)) and not (bag(h) - bag(h2))


def test_subsample_changes_by_at_most_one_swap(tmp_path):
    base, added, removed = neighbours(tmp_path, rows(N), at=3)
    for other in (added, removed):
        for k in (500, 50):
            a, b = bag(base.subsample(k, seed=2)), bag(other.subsample(k, seed=2))
            assert sum(a.values()) == sum(b.values()) == k
            assert sum((a - b).values()) <= 1 and sum((b - a).values()) <= 1


def test_split_is_seeded_and_near_the_fraction(tmp_path):
    d = load_texts(write(tmp_path / "d.csv", rows(5000)))
    t, h = d.split(0.1, seed=0)
    assert len(t) + len(h) == 5000 and not set(t.texts) & set(h.texts)
    assert abs(len(h) / 5000 - 0.1) < 0.02
    assert d.split(0.1, seed=0)[1].texts == h.texts
    assert d.split(0.1, seed=1)[1].texts != h.texts


def test_prepare_data_hold_out_and_max_train_examples_are_neighbour_stable(tmp_path):
    """What `dpfit train --data FILE` trains on, for the file and the file plus one row."""
    base, extra = rows(N), ("an added review", "pos")
    a = write(tmp_path / "a.csv", base)
    b = write(tmp_path / "b.csv", [*base[:300], extra, *base[300:]])
    labels = ("neg", "pos")
    pa, pb = (prepare_data(TrainConfig(data=f, labels=labels)) for f in (a, b))
    diff = (bag(pb.train) - bag(pa.train)) + (bag(pb.test) - bag(pa.test))
    assert diff == Counter({extra: 1}) and not (bag(pa.train) - bag(pb.train))
    assert pa.split == {"split_rule": SPLIT_RULE, "held_out_fraction": HELD_OUT_FRACTION}
    assert any("dpfit evaluate --held-out" in n for n in pa.notes)
    sa, sb = (
        prepare_data(TrainConfig(data=f, labels=labels, max_train_examples=500)) for f in (a, b)
    )
    assert sum((bag(sa.train) - bag(sb.train)).values()) <= 1
    assert sum((bag(sb.train) - bag(sa.train)).values()) <= 1
    # the file-level guarantee under a fixed-size subsample is said, in the notes and record
    assert "epsilon_replace_one" in sa.split["file_neighbouring"]
    assert any("epsilon_replace_one" in n for n in sa.notes)


def test_small_held_out_set_says_how_much_the_score_can_move(tmp_path):
    prep = prepare_data(
        TrainConfig(data=write(tmp_path / "d.csv", rows(400)), labels=("neg", "pos"))
    )
    assert len(prep.test) < 200
    assert any(n.startswith("small test set") and "±" in n for n in prep.notes)
