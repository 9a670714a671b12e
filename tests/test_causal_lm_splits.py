"""Causal-LM splits keep neighbours neighbours: one example (or document) added or removed
changes the training examples by one (by at most one swap when a cap binds), wherever it
sits in the file."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

from dpfit.causal_lm import split_examples
from dpfit.tasks.causal_lm import (
    HELD_OUT_DOCUMENTS,
    capped_documents,
    held_out_documents,
    read_documents,
)


def examples(n: int, start: int = 0) -> list[str]:
    return [f"line {i} of the play\nand its answer {i}" for i in range(start, start + n)]


def diff(a: list[str], b: list[str]) -> tuple[int, int]:
    """(rows only in a, rows only in b), as multisets."""
    ca, cb = Counter(a), Counter(b)
    return sum((ca - cb).values()), sum((cb - ca).values())


def test_line_examples_change_by_one_when_one_is_added_anywhere():
    base = examples(600)
    for at in (0, 300, 600):
        added = [*base[:at], "a new example", *base[at:]]
        # no cap: the training examples gain one example (the new one, or a held one)
        t, h = split_examples(base, 10_000, 64, seed=0)
        t2, h2 = split_examples(added, 10_000, 64, seed=0)
        assert diff(t, t2) == (0, 1) and len(h2) == len(h) == 64
        # capped (the default 512): at most one in and one out
        t, _ = split_examples(base, 400, 64, seed=0)
        t2, _ = split_examples(added, 400, 64, seed=0)
        assert diff(t, t2)[0] <= 1 and diff(t, t2)[1] <= 1
    removed = base[:100] + base[101:]
    t, _ = split_examples(base, 10_000, 64, seed=0)
    t2, _ = split_examples(removed, 10_000, 64, seed=0)
    assert diff(t, t2) == (1, 0)


def test_line_examples_are_seeded_and_disjoint():
    base = examples(300)
    t, h = split_examples(base, 100, 20, seed=1)
    assert (t, h) == split_examples(base, 100, 20, seed=1)
    assert split_examples(base, 100, 20, seed=2)[1] != h
    assert len(t) == 100 and not set(t) & set(h)


def test_documents_held_out_by_group_or_own_text():
    texts = [f"speech {i} " * 5 for i in range(400)]
    groups = [f"speaker {i // 2}" for i in range(400)]  # two speeches a speaker
    held = held_out_documents(texts, groups, HELD_OUT_DOCUMENTS, seed=0)
    by_group: dict[str, set[bool]] = {}
    for g, h in zip(groups, held, strict=True):
        by_group.setdefault(g, set()).add(h)
    assert all(len(v) == 1 for v in by_group.values())  # a speaker's speeches stay together
    assert 0.04 < sum(held) / len(held) < 0.16
    # one more speaker, or one more ungrouped document: no other document changes side
    more = held_out_documents([*texts, "new"], [*groups, "speaker new"], 0.1, seed=0)
    assert more[:-1] == held
    ungrouped = held_out_documents(texts, [""] * 400, 0.1, seed=0)
    moved = held_out_documents(["new", *texts], [""] * 401, 0.1, seed=0)
    assert moved[1:] == ungrouped


def test_jsonl_documents_are_not_grouped_by_line_number(tmp_path):
    """A .jsonl file's documents are keyed by their text: a line inserted at the top must not
    rename (and so re-split) every document below it."""
    docs = [f"document {i} " * 4 for i in range(300)]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    b.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["inserted", *docs]))
    cfg = SimpleNamespace(text_column="text", privacy_unit="document", user_column=None)
    ta, ga, _ = read_documents(SimpleNamespace(data=str(a), **vars(cfg)))
    tb, gb, _ = read_documents(SimpleNamespace(data=str(b), **vars(cfg)))
    ha = held_out_documents(ta, ga, HELD_OUT_DOCUMENTS, seed=0)
    hb = held_out_documents(tb, gb, HELD_OUT_DOCUMENTS, seed=0)
    assert hb[1:] == ha


def test_document_cap_changes_by_at_most_one_swap():
    docs = [SimpleNamespace(text=f"doc {i}") for i in range(500)]
    added = [*docs[:250], SimpleNamespace(text="new"), *docs[250:]]
    a = [d.text for d in capped_documents(docs, 100, seed=0)]
    b = [d.text for d in capped_documents(added, 100, seed=0)]
    assert len(a) == len(b) == 100 and diff(a, b)[0] <= 1 and diff(a, b)[1] <= 1


def test_a_line_added_mid_file_changes_the_training_examples_by_that_line(tmp_path):
    """A text file of the user's: one line, one example, so a line inserted anywhere changes
    the training examples by that line alone (joined pairs would shift every later pair)."""
    from dpfit.models import save_tiny_random_model
    from dpfit.tasks.causal_lm import CausalLMTask
    from dpfit.train import TrainConfig

    folder = save_tiny_random_model(tmp_path / "llama", arch="llama")
    lines = [f"the good movie number {i} was great" for i in range(300)]

    def train_examples(rows: list[str], name: str) -> list[str]:
        path = tmp_path / name
        path.write_text("\n".join(rows))
        config = TrainConfig(task="causal-lm", model=str(folder), data=str(path))
        return CausalLMTask().prepare(config).state["train"]

    base = train_examples(lines, "a.txt")
    added = train_examples([*lines[:150], "a line someone added", *lines[150:]], "b.txt")
    assert all("\n" not in e for e in base)
    assert diff(base, added) == (0, 1)
