"""The public-label gate (dpfit.tasks.labels) counts the privacy unit, never rows: a unit
holding many rows of a name counts once, so adding or removing one unit moves each count by
at most 1 (the gate's stability argument)."""

from __future__ import annotations

import csv
import random

import pytest

from dpfit.tasks.labels import (
    MIN_PUBLIC_LABEL_COUNT,
    LabelUnits,
    RareLabelError,
    check_data_label_names,
)

K = MIN_PUBLIC_LABEL_COUNT


def test_a_unit_with_many_rows_of_a_name_counts_once():
    labels = ["rare"] * (K + 5) + ["common"] * K
    units = ["alice"] * (K + 5) + [f"u{i}" for i in range(K)]
    counted = LabelUnits.count(labels, units, "clients")
    assert counted.counts == {"rare": 1, "common": K}
    with pytest.raises(RareLabelError, match=r"1 label name.*fewer than 20 clients \(rare\)"):
        check_data_label_names(["common", "rare"], counted, "d.csv", False, "metrics.json")
    note = check_data_label_names(["common"], counted, "d.csv", False, "metrics.json")
    assert f"each carried by >= {K} clients" in note
    # declared public: published whatever the counts, and said so
    assert "--public-labels" in check_data_label_names(
        ["rare"], counted, "d.csv", True, "metrics.json"
    )
    with pytest.raises(ValueError):  # one unit id per row, or the count means nothing
        LabelUnits.count(labels, units[:-1], "clients")


def test_a_plain_mapping_counts_each_row_as_one_training_example():
    with pytest.raises(RareLabelError, match=f"fewer than {K} training examples"):
        check_data_label_names(["a", "b"], {"a": K, "b": K - 1}, "d.csv", False, "m.json")
    note = check_data_label_names(["a"], {"a": K}, "d.csv", False, "m.json")
    assert f"each carried by >= {K} training examples" in note


# -- the central document unit: a document cut into many windows is one unit ------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    pytest.importorskip("transformers")
    from dpfit.models import save_tiny_random_model

    return save_tiny_random_model(tmp_path_factory.mktemp("labels") / "bert")


def _csv(path, rows) -> str:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows(rows)
    return str(path)


def test_document_unit_gate_counts_documents_not_windows(folder, tmp_path):
    """With --privacy-unit document, one long text of a name, cut into more than 20 windows,
    is one document: the name is refused (publishing it would reveal that document)."""
    from dpfit.models import TINY_WORDS
    from dpfit.tasks.classification import ClassificationTask
    from dpfit.train import TrainConfig

    rng = random.Random(0)
    words = lambda k: " ".join(rng.choices(TINY_WORDS, k=k))  # noqa: E731
    rows = [(words(6), y) for _ in range(K + 10) for y in ("neg", "pos")]
    rows.append((words(400), "alice-hiv-positive"))  # one long document
    data = _csv(tmp_path / "d.csv", rows)
    config = dict(model=str(folder), data=data, eval_data=data, max_length=16, stride=12)
    with pytest.raises(RareLabelError, match="alice-hiv-positive"):
        ClassificationTask().prepare(TrainConfig(**config, privacy_unit="document"))
    # declared public, the run prepares: the document is many windows, and one unit of n
    prep = ClassificationTask().prepare(
        TrainConfig(**config, privacy_unit="document", public_labels=True)
    )
    long_doc = prep.state["docs"][-1]
    assert long_doc[0]["labels"] == prep.state["data"].train.label_names.index("alice-hiv-positive")
    assert len(long_doc) > K  # more windows than the gate's threshold...
    assert prep.n == len(rows)  # ...yet n (and the gate) count documents
