"""`dpfit evaluate --held-out`: a run on the user's own file holds out rows it never saves;
evaluate finds exactly those rows again from the run's seed and split rule."""

import csv
import json

import pytest

from dpfit.cli import main
from dpfit.data.text import load_texts
from dpfit.tasks.classification import recorded_held_out


def _train(tiny, out, *extra):
    model, data = tiny
    argv = ["train", "--model", model, "--data", data, "--max-steps", "1", "--batch-size",
            "32", "--no-head-first", "--seed", "3", "--threads", "1", "--quiet",
            "--output", str(out), *extra]  # fmt: skip
    assert main(argv) == 0


def test_held_out_rows_are_found_again_and_scored_alike(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    _train(tiny, out)
    hint = f"dpfit evaluate --model {out}/model --data {tiny[1]} --held-out"
    assert hint in capsys.readouterr().out
    m = json.loads((out / "metrics.json").read_text())
    assert m["split_rule"] == "row-hash-v1" and m["held_out_fraction"] == 0.1
    held = recorded_held_out(out / "model", tiny[1], ("neg", "pos")).texts
    assert len(held) == m["eval_n"]
    for f in out.rglob("*"):  # no held-out row is saved in the run folder
        if f.is_file() and f.suffix in (".json", ".csv", ".md", ".txt"):
            assert not any(t in f.read_text() for t in held), f
    argv = ["evaluate", "--model", str(out / "model"), "--data", tiny[1], "--held-out", "--json"]
    assert main(argv) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["n"] == m["eval_n"] and ev["accuracy"] == pytest.approx(m["accuracy"])


def test_a_changed_file_never_brings_a_training_row_into_the_held_out_rows(tiny, tmp_path):
    out = tmp_path / "run"
    _train(tiny, out)
    names = ("neg", "pos")
    held = recorded_held_out(out / "model", tiny[1], names)
    whole = load_texts(tiny[1], label_names=names)
    trained = set(whole.texts) - set(held.texts)
    changed = tmp_path / "more.csv"
    with open(tiny[1], newline="") as f:
        rows = list(csv.reader(f))
    rows[1:1] = [[f"a review added later {i}", "pos"] for i in range(50)]
    with open(changed, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    again = recorded_held_out(out / "model", changed, names)
    assert set(held.texts) <= set(again.texts) and not set(again.texts) & trained


def test_held_out_is_refused_where_it_cannot_be_derived(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    _train(tiny, out, "--eval-data", tiny[1])
    capsys.readouterr()
    argv = ["evaluate", "--model", str(out / "model"), "--data", tiny[1], "--held-out"]
    assert main(argv) != 0
    assert "held nothing out" in capsys.readouterr().err
    # a run whose split came from the earlier rule (no split_rule recorded)
    old = tmp_path / "old"
    _train(tiny, old)
    m = json.loads((old / "metrics.json").read_text())
    del m["split_rule"]
    (old / "metrics.json").write_text(json.dumps(m))
    capsys.readouterr()
    assert main(["evaluate", "--model", str(old / "model"), "--data", tiny[1], "--held-out"]) != 0
    assert "earlier rule" in capsys.readouterr().err
