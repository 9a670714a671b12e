"""User data loading: formats, label inference, and the clear errors for bad input."""

import json

import pytest

from dpfit.data.text import (
    ColumnError,
    DataError,
    DataFileNotFoundError,
    EmptyDataError,
    LabelTypeError,
    SingleClassError,
    UnseenLabelError,
    bundled_rotten_tomatoes,
    load_texts,
)


def write_csv(path, rows, header=("text", "label")):
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def test_csv_label_names_inferred_sorted(tmp_path):
    p = write_csv(tmp_path / "d.csv", [("a fine film", "pos"), ("dull", "neg"), ("ok", "pos")])
    d = load_texts(p)
    assert d.label_names == ("neg", "pos")
    assert d.labels == (1, 0, 1)
    assert d.texts[1] == "dull"
    assert d.class_counts() == {"neg": 1, "pos": 2}


def test_integer_labels_sorted_numerically(tmp_path):
    p = write_csv(tmp_path / "d.csv", [("x y", "10"), ("y z", "2"), ("z w", "1")])
    d = load_texts(p)
    assert d.label_names == ("1", "2", "10")
    assert d.labels == (2, 1, 0)


def test_jsonl_and_custom_columns(tmp_path):
    p = tmp_path / "d.jsonl"
    rows = [
        {"review": "great", "stars": 1},
        {"review": "awful", "stars": 0},
        {"review": "meh", "stars": 1.0},
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    d = load_texts(p, text_column="review", label_column="stars")
    assert d.label_names == ("0", "1")
    assert d.labels == (1, 0, 1)  # 1.0 and 1 are one class


def test_csv_and_jsonl_agree_on_label_ids(tmp_path):
    csv_p = write_csv(tmp_path / "d.csv", [("a b", "1"), ("c d", "0")])
    js = tmp_path / "d.jsonl"
    js.write_text('{"text": "a b", "label": 1}\n{"text": "c d", "label": 0}\n')
    assert load_texts(csv_p).labels == load_texts(js).labels


def test_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": ["good", "bad", "fine"], "label": [1, 0, 1]})
    datasets.DatasetDict({"train": ds, "test": ds.select([0, 1])}).save_to_disk(
        str(tmp_path / "dd")
    )
    d = load_texts(tmp_path / "dd")
    assert len(d) == 3 and d.label_names == ("0", "1")
    assert len(load_texts(tmp_path / "dd", split="test")) == 2
    with pytest.raises(DataError, match="splits"):
        load_texts(tmp_path / "dd", split="validation")


def test_eval_maps_with_training_labels_and_rejects_unseen(tmp_path):
    p = write_csv(tmp_path / "e.csv", [("a", "pos"), ("b", "neg")])
    assert load_texts(p, label_names=("neg", "pos")).labels == (1, 0)
    q = write_csv(tmp_path / "f.csv", [("a", "pos"), ("b", "neutral"), ("c", "neutral")])
    with pytest.raises(UnseenLabelError, match="neutral.*2x"):
        load_texts(q, label_names=("neg", "pos"))


def test_default_label_names_accept_integer_ids(tmp_path):
    p = write_csv(tmp_path / "e.csv", [("a", "1"), ("b", "0")])
    assert load_texts(p, label_names=("LABEL_0", "LABEL_1")).labels == (1, 0)


def test_missing_file(tmp_path):
    with pytest.raises(DataFileNotFoundError, match="does not exist"):
        load_texts(tmp_path / "nope.csv")


def test_empty_file(tmp_path):
    p = write_csv(tmp_path / "d.csv", [])
    with pytest.raises(EmptyDataError):
        load_texts(p)
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(EmptyDataError):
        load_texts(tmp_path / "e.jsonl")


def test_rows_without_text_are_empty(tmp_path):
    p = write_csv(tmp_path / "d.csv", [("", "pos"), ("  ", "neg")])
    with pytest.raises(EmptyDataError, match="non-empty"):
        load_texts(p)


def test_one_class_only(tmp_path):
    p = write_csv(tmp_path / "d.csv", [("a", "pos"), ("b", "pos")])
    with pytest.raises(SingleClassError, match="two classes"):
        load_texts(p)


def test_non_text_column(tmp_path):
    p = write_csv(tmp_path / "d.csv", [("1.5", "pos"), ("2", "neg")])
    with pytest.raises(ColumnError, match="--text-column"):
        load_texts(p)
    js = tmp_path / "d.jsonl"
    js.write_text('{"text": "a tedious waste of time", "label": 1}\n\n{"text": 3, "label": 0}\n')
    with pytest.raises(ColumnError) as e:
        load_texts(js)
    msg = str(e.value)  # the offending row, not a valid one
    assert "line 3" in msg and "3 (int)" in msg and "tedious" not in msg and "\n" not in msg


def test_non_utf8_file_names_the_line_and_the_fix(tmp_path):
    p = tmp_path / "latin.csv"
    p.write_bytes("text,label\nfine,pos\nun film rat\xe9,neg\n".encode("latin-1"))
    with pytest.raises(DataError) as e:
        load_texts(p)
    msg = str(e.value)
    assert "line 3" in msg and "0xe9" in msg and "UTF-8" in msg and "iconv" in msg


def test_labels_mixing_numbers_and_names_are_refused_or_mapped_by_labels(tmp_path):
    rows = [("good", "pos"), ("bad", "neg"), ("fine", "1"), ("dull", "0")] * 5
    p = write_csv(tmp_path / "d.csv", rows)
    with pytest.raises(LabelTypeError) as e:
        load_texts(p)
    assert "'0' at line 5" in str(e.value) and "--labels" in str(e.value)
    data = load_texts(p, label_names=("neg", "pos"), label_ids=True)
    assert data.label_names == ("neg", "pos") and data.labels[:4] == (1, 0, 1, 0)
    assert load_texts(p, label_names=("neg", "pos"), label_ids=True).num_labels == 2
    with pytest.raises(UnseenLabelError):  # evaluation: a number is not a trained name
        load_texts(p, label_names=("neg", "pos"))


@pytest.mark.parametrize(
    "labels,needle",
    [
        ([f"{0.37 * i:.2f}" for i in range(40)], "looks continuous"),
        ([str(i) for i in range(1000)], "1000 distinct values"),
    ],
    ids=["float", "1000 classes"],
)
def test_continuous_or_too_many_labels_are_refused_in_one_short_line(tmp_path, labels, needle):
    p = write_csv(tmp_path / "d.csv", [(f"text {i}", y) for i, y in enumerate(labels)])
    with pytest.raises(LabelTypeError) as e:
        load_texts(p)
    assert needle in str(e.value) and len(str(e.value)) < 300


def test_integral_floats_are_the_same_class(tmp_path):
    p = write_csv(tmp_path / "d.csv", [("a", "1.0"), ("b", "0"), ("c", "1")])
    assert load_texts(p).label_names == ("0", "1")


def test_missing_column_names_the_flag(tmp_path):
    p = write_csv(tmp_path / "d.csv", [("a", "pos")], header=("sentence", "label"))
    with pytest.raises(ColumnError, match="--text-column"):
        load_texts(p)
    with pytest.raises(ColumnError, match="--label-column"):
        load_texts(p, text_column="sentence", label_column="y")


def test_unsupported_type_and_bad_json(tmp_path):
    (tmp_path / "d.parquet").write_text("x")
    with pytest.raises(DataError, match="unsupported"):
        load_texts(tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text('{"text": "a", "label": 1}\n{oops\n')
    with pytest.raises(DataError, match="line 2"):
        load_texts(tmp_path / "d.jsonl")


def test_subsample_and_split_are_seeded(tmp_path):
    p = write_csv(tmp_path / "d.csv", [(f"t{i}", str(i % 2)) for i in range(50)])
    d = load_texts(p)
    assert d.subsample(10, seed=1).texts == d.subsample(10, seed=1).texts
    assert d.subsample(10, seed=1).texts != d.subsample(10, seed=2).texts
    rest, held = d.split(0.2, seed=0)
    # each row is held out by its own hash, so the count is binomial around 10 (rule and
    # neighbour stability: tests/data/test_rowhash.py)
    assert len(held) + len(rest) == 50 and 3 <= len(held) <= 17
    assert not set(rest.texts) & set(held.texts)
    assert d.split(0.2, seed=0)[1].texts == held.texts


def test_bundled_splits_by_movie():
    try:
        s = bundled_rotten_tomatoes(seed=0)
    except FileNotFoundError:
        pytest.skip("bundled data not installed")
    assert s.train.label_names == ("rotten", "fresh")
    assert len(s.train) > 8 * len(s.test) > 0
    assert not set(s.train.texts) & set(s.test.texts)
    assert set(s.train.labels) == {0, 1}
    assert bundled_rotten_tomatoes(seed=0).test.texts == s.test.texts
