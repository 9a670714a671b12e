"""`dpfit evaluate` on a classifier trained on windows (--stride): it scores the same windows
as the training run (read from DIR/model/dpfit.json), so it reproduces the run's own test
figure; --stride / --max-length override; a model trained without windows is scored on
truncated texts exactly as before."""

from __future__ import annotations

import csv
import json
import random

import pytest
from test_classification_windows import LENGTH, STRIDE, _args

from dpfit.cli import main
from dpfit.data.text import load_texts
from dpfit.models import load_classifier, save_tiny_random_model
from dpfit.tasks.classification import evaluate

pytest.importorskip("transformers")

MEAN = "texts (each from the mean of its windows' logits)"
POS, NEG = ("good", "great", "fine", "nice", "superb", "fun"), ("bad", "awful", "poor", "dull")
FILLER = ("the", "movie", "plot", "was", "a", "it")


def _csv(path, n: int, seed: int, twist: bool) -> str:
    """Texts of 4 to 40 words, half of them words of the label's sentiment. With `twist`,
    half the texts open with one window's worth of the other sentiment and go on for 40
    words of their own: truncated at one window they read as the wrong label."""
    rng = random.Random(seed)

    def words(k: int, y: int) -> list[str]:
        return [rng.choice((POS if y else NEG) if rng.random() < 0.5 else FILLER) for _ in range(k)]

    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i in range(n):
            y = i % 2
            text = (
                words(LENGTH - 2, 1 - y) + words(40, y)
                if twist and i % 4 < 2
                else words(rng.randint(4, 40), y)
            )
            w.writerow([" ".join(text), "pos" if y else "neg"])
    return str(path)


def _run(root, *extra) -> tuple:
    """A tiny classifier trained (non-privately: it must learn something, fast) on long
    texts, its test texts given as a file: (folder of the run, test file)."""
    model = save_tiny_random_model(root / "st", sentence_pooling="mean")
    train = _csv(root / "train.csv", 60, seed=0, twist=False)
    test = _csv(root / "test.csv", 40, seed=1, twist=True)
    out = root / "run"
    args = _args(model, train, out, "--eval-data", test, "--non-private", "--public-labels")
    assert main([*args, *extra]) == 0
    return out, test


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("evalwin"), "--stride", str(STRIDE))


@pytest.fixture(scope="module")
def truncated(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("evaltrunc"), "--max-steps", "2")


def _evaluate(capsys, run, test, *extra) -> dict:
    capsys.readouterr()
    assert main(["evaluate", "--model", str(run / "model"), "--data", test, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _in_process(run, test, length: int, stride: int | None) -> dict:
    loaded = load_classifier(run / "model")
    names = [loaded.model.config.id2label[i] for i in range(loaded.model.config.num_labels)]
    data = load_texts(test, "text", "label", label_names=names)
    return evaluate(loaded.model, loaded.tokenizer, data, length, stride=stride).as_dict()


def test_scores_a_windowed_model_as_its_training_run_did(windowed, capsys):
    run, test = windowed
    m = json.loads((run / "metrics.json").read_text())
    assert m["window_length"] == LENGTH and m["stride"] == STRIDE and m["eval_n"] == 40
    record = json.loads((run / "model" / "dpfit.json").read_text())
    assert record["window_length"] == LENGTH and record["stride"] == STRIDE
    # the training run's --max-length given again: the same windows, not texts truncated there
    again = _evaluate(capsys, run, test, "--max-length", str(LENGTH))
    assert again["accuracy"] == m["accuracy"] and again["per_class"] == m["per_class"]
    ev = _evaluate(capsys, run, test)
    assert ev["accuracy"] == m["accuracy"] and ev["per_class"] == m["per_class"]
    assert ev["n"] == 40 and ev["window_length"] == LENGTH and ev["stride"] == STRIDE
    assert ev["evaluated_on"] == f"40 {MEAN}"
    # the check can fail: truncating each text scores this model differently
    assert _in_process(run, test, LENGTH, None)["per_class"] != m["per_class"]
    assert main(["evaluate", "--model", str(run / "model"), "--data", test]) == 0
    table = capsys.readouterr().out
    assert f"40 {MEAN}" in table and f"{LENGTH} tokens every {STRIDE}" in table
    assert "documents" not in table  # the training run's count is not this one's


def test_stride_and_max_length_override_the_record(windowed, capsys):
    run, test = windowed
    ev = _evaluate(capsys, run, test, "--stride", str(LENGTH))
    assert (ev["window_length"], ev["stride"]) == (LENGTH, LENGTH)
    assert ev["per_class"] == _in_process(run, test, LENGTH, LENGTH)["per_class"]
    # another length alone: windows of that length, without overlap
    ev = _evaluate(capsys, run, test, "--max-length", "10")
    assert (ev["window_length"], ev["stride"]) == (10, 10)
    assert ev["per_class"] == _in_process(run, test, 10, 10)["per_class"]
    ev = _evaluate(capsys, run, test, "--max-length", "10", "--stride", "6")
    assert (ev["window_length"], ev["stride"]) == (10, 6)


def test_stride_longer_than_the_window_is_refused(windowed, capsys):
    run, test = windowed
    args = ["evaluate", "--model", str(run / "model"), "--data", test, "--stride"]
    assert main([*args, str(LENGTH + 4)]) == 2
    assert f"--stride {LENGTH + 4} is more than --max-length {LENGTH}" in capsys.readouterr().err
    assert main([*args, "12", "--max-length", "10"]) == 2
    assert "--stride 12 is more than --max-length 10" in capsys.readouterr().err


def test_a_model_trained_without_windows_is_scored_on_truncated_texts(truncated, capsys):
    run, test = truncated
    record = json.loads((run / "model" / "dpfit.json").read_text())
    assert "window_length" not in record and "stride" not in record
    ev = _evaluate(capsys, run, test)
    assert set(ev) == {"accuracy", "n", "per_class", "model", "data", "privacy"}
    assert {k: ev[k] for k in ("accuracy", "n", "per_class")} == _in_process(run, test, 128, None)
    m = json.loads((run / "metrics.json").read_text())
    ev = _evaluate(capsys, run, test, "--max-length", str(LENGTH))  # as its training run did
    assert ev["accuracy"] == m["accuracy"] and ev["per_class"] == m["per_class"]
    assert main(["evaluate", "--model", str(run / "model"), "--data", test]) == 0
    table = capsys.readouterr().out
    assert "examples" in table and "windows" not in table
    # --stride asks for windows of --max-length
    ev = _evaluate(capsys, run, test, "--max-length", str(LENGTH), "--stride", str(STRIDE))
    assert (ev["window_length"], ev["stride"]) == (LENGTH, STRIDE)
    assert ev["per_class"] == _in_process(run, test, LENGTH, STRIDE)["per_class"]
