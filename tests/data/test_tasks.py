"""Bundled benchmark tasks: group-disjoint splits, sizes, determinism, CSV round trip."""

from __future__ import annotations

from collections import Counter

import pytest

from dpfit.data import tasks
from dpfit.data.text import load_texts

pytest.importorskip("dpfit.data.bundled")


@pytest.fixture(scope="module")
def convention():
    return tasks.convention_party_task(seed=0)


@pytest.fixture(scope="module")
def source():
    return tasks.text_source_task(seed=0)


def _groups_of(examples):
    by_text: dict[str, set[str]] = {}
    for ex in examples:
        by_text.setdefault(ex.text, set()).add(ex.group)
    return by_text


def test_sentences_split_on_glued_punctuation_and_drop_short_ones():
    text = "Thank you.Thank you so much. We will win this fight!\nAnd then we rest now"
    assert tasks.sentences(text) == [
        "Thank you so much.",
        "We will win this fight!",
        "And then we rest now",
    ]


def test_convention_split_has_no_speaker_in_both(convention):
    speaker = _groups_of(tasks.convention_examples())
    assert all(len(g) == 1 for g in speaker.values())  # dedupe leaves one speaker per text
    train_speakers = {next(iter(speaker[t])) for t in convention.train.texts}
    test_speakers = {next(iter(speaker[t])) for t in convention.test.texts}
    assert train_speakers and test_speakers
    assert not train_speakers & test_speakers
    assert len(train_speakers) + len(test_speakers) > 150  # 181 speakers in the file


def test_convention_sizes_and_labels(convention):
    assert convention.train.label_names == ("democrat", "republican")
    assert len(convention.train) >= 5000
    n = len(convention.train) + len(convention.test)
    assert 0.15 < len(convention.test) / n < 0.25
    assert set(convention.test.labels) == {0, 1}
    assert not set(convention.train.texts) & set(convention.test.texts)


def test_text_source_has_six_balanced_classes_and_disjoint_groups(source):
    assert source.num_labels == 6
    assert len(source.train) >= 5000
    counts = Counter(source.train.labels)
    assert set(counts) == set(range(6))
    assert max(counts.values()) <= tasks.PER_SOURCE
    assert not set(source.train.texts) & set(source.test.texts)
    # groups (scene, speaker, date, movie) never straddle the split
    group = {
        ex.text: f"{name}/{ex.group}"
        for name, exs in tasks.source_examples().items()
        for ex in tasks.dedupe(exs)
    }
    train_groups = {group[t] for t in source.train.texts}
    test_groups = {group[t] for t in source.test.texts}
    assert len(train_groups) > 100 and len(test_groups) > 20
    assert not train_groups & test_groups


def test_splits_are_deterministic_per_seed(convention, source):
    assert tasks.convention_party_task(seed=0) == convention
    assert tasks.text_source_task(seed=0) == source
    other = tasks.convention_party_task(seed=1)
    assert set(other.test.texts) != set(convention.test.texts)


def test_majority_rate_uses_the_training_majority(convention):
    top = Counter(convention.train.labels).most_common(1)[0][0]
    expected = convention.test.labels.count(top) / len(convention.test)
    assert convention.majority_rate() == pytest.approx(expected)
    assert 0.3 < expected < 0.8


def test_csvs_load_back_as_the_same_task(convention, tmp_path):
    train_csv, test_csv = tasks.write_task_csvs(convention, tmp_path)
    train = load_texts(train_csv)
    test = load_texts(test_csv, label_names=train.label_names)
    assert train.texts == convention.train.texts
    names = [train.label_names[y] for y in train.labels]
    assert names == [convention.train.label_names[y] for y in convention.train.labels]
    assert len(test) == len(convention.test)


def test_unknown_task_name_lists_the_choices():
    with pytest.raises(KeyError, match="rotten-tomatoes"):
        tasks.load_task("nope")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_convention_split_keeps_the_party_balance(seed):
    """Each party's speakers are split on their own: a plain split by speaker put 78% of one
    party in the test set at seed 1, below which every classifier scored."""
    t = tasks.convention_party_task(seed=seed)
    share = [sum(t.train.labels) / len(t.train), sum(t.test.labels) / len(t.test)]
    assert abs(share[0] - share[1]) < 0.04
    assert t.majority_rate() < 0.6


def test_stratified_group_split_refuses_a_group_with_two_labels():
    from dpfit.data.bundled import TextExample

    examples = [TextExample(f"text {i}", i % 2, "same speaker") for i in range(10)]
    with pytest.raises(ValueError, match="two labels"):
        tasks._split_within_labels(examples, ("a", "b"), 0, "mixed")


# -- held-out tasks: never used to choose the recipe, only to check it --------------------------


@pytest.fixture(scope="module", params=tasks.HELD_OUT)
def held_out(request):
    return request.param


_BUILT: dict[tuple[str, int], tasks.TaskSplits] = {}


def _task(name: str, seed: int) -> tasks.TaskSplits:
    """Each (task, seed) built once per test session."""
    if (name, seed) not in _BUILT:
        _BUILT[name, seed] = tasks.load_task(name, seed)
    return _BUILT[name, seed]


def _group_of(name: str) -> dict[str, str]:
    examples = {"headline-month": tasks.headline_examples, "debate-role": tasks.debate_examples}
    return {ex.text: ex.group for ex in examples[name]()}


def test_held_out_tasks_are_registered_and_differ_from_the_suite():
    assert set(tasks.HELD_OUT) <= set(tasks.TASKS)
    suite = [n for n in tasks.TASKS if n not in tasks.HELD_OUT]
    assert suite  # the tasks the recipe was chosen on
    suite_classes = {tasks.load_task(n).num_labels for n in ("convention-party", "rotten-tomatoes")}
    suite_classes.add(len(tasks.SOURCES))
    for name in tasks.HELD_OUT:
        assert _task(name, 0).num_labels not in suite_classes


@pytest.mark.parametrize("seed", [0, 1])
def test_held_out_split_keeps_groups_on_one_side(held_out, seed):
    t = _task(held_out, seed)
    group = _group_of(held_out)
    train_groups = {group[x] for x in t.train.texts}
    test_groups = {group[x] for x in t.test.texts}
    assert len(train_groups) > 50 and len(test_groups) > 10
    assert not train_groups & test_groups
    assert not set(t.train.texts) & set(t.test.texts)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_held_out_sizes_and_class_shares(held_out, seed):
    """A test split of >= 500 (standard error of about 2 points), and every class split on
    its own: 10-30% of each class in the test split (whole days or segments move together,
    so not exactly 20%)."""
    t = _task(held_out, seed)
    assert len(t.test) >= 500
    assert 0.15 < len(t.test) / (len(t.train) + len(t.test)) < 0.25
    k = t.num_labels
    assert set(t.train.labels) == set(t.test.labels) == set(range(k))
    for y in range(k):
        in_test = t.test.labels.count(y)
        assert 0.1 < in_test / (in_test + t.train.labels.count(y)) < 0.3, y


def test_held_out_sizes_match_their_sources():
    month = _task("headline-month", 0)
    assert month.train.label_names == tasks.MONTHS
    assert 3000 < len(month.train) < 3600  # 4,080 headlines, 80% of those with >= 4 words
    role = _task("debate-role", 0)
    assert role.train.label_names == tasks.ROLES
    assert 2500 < len(role.train) < 3200  # 3,659 sentences of >= 4 words


def test_held_out_splits_are_deterministic_per_seed(held_out):
    first = _task(held_out, 0)
    assert tasks.load_task(held_out, 0) == first  # built again, not the cached one
    assert set(_task(held_out, 1).test.texts) != set(first.test.texts)


def test_debate_segments_are_consecutive_statements_of_one_debate():
    examples = tasks.debate_examples()
    debates = {ex.group.split("/")[0] for ex in examples}
    assert debates == {"1st", "2nd", "3rd", "VP"}
    segments = {ex.group.rsplit("/", 1)[0] for ex in examples}
    assert 100 < len(segments) < 130  # 1,122 statements in runs of 10
    # a group holds one role: the split can be stratified by label
    role_of = {}
    for ex in examples:
        assert role_of.setdefault(ex.group, ex.label) == ex.label


def test_held_out_csvs_load_back_as_a_users_file(held_out, tmp_path):
    """The suite trains on the CSV a user would pass to `dpfit train --data`."""
    t = _task(held_out, 0)
    train_csv, test_csv = tasks.write_task_csvs(t, tmp_path)
    train = load_texts(train_csv)
    test = load_texts(test_csv, label_names=train.label_names)
    assert train.texts == t.train.texts
    assert train.num_labels == t.num_labels
    assert [train.label_names[y] for y in train.labels] == [
        t.train.label_names[y] for y in t.train.labels
    ]
    assert [test.label_names[y] for y in test.labels] == [
        t.test.label_names[y] for y in t.test.labels
    ]


def test_headline_outside_the_months_is_refused(monkeypatch):
    monkeypatch.setattr(
        tasks,
        "_read_csv",
        lambda *a, **k: [{"Text": "Markets fall again today", "Date": "2021-01-05"}],
    )
    with pytest.raises(ValueError, match="outside"):
        tasks.headline_examples()
