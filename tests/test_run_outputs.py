"""Issue 25: a run that spends privacy never loses its result, and a resume never starts over.

Output folders are checked before any data is read; a write that fails after training lands
in a fallback folder the error names; `dpfit train` without --output keeps its result in a
default run folder; --resume without a checkpoint is an error, never a fresh start.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from dpfit.cli import main
from dpfit.models import save_tiny_random_model, write_tiny_sentiment_csv
from dpfit.outputs import OutputError
from dpfit.train import TrainConfig, train


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("outputs")
    return (
        str(save_tiny_random_model(root / "model")),
        str(write_tiny_sentiment_csv(root / "train.csv", n=120, seed=0)),
    )


def args(tiny, *extra):
    model, data = tiny
    return ["train", "--model", model, "--data", data, "--max-steps", "2", "--batch-size", "20",
            "--physical-batch-size", "20", "--threads", "1", "--quiet", *extra]  # fmt: skip


def cli(*argv, env=None):
    """`python -m dpfit.cli ARGV` as a user runs it: (exit code, stdout, stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    p = subprocess.run(
        [sys.executable, "-m", "dpfit.cli", *argv], capture_output=True, text=True, env=env
    )
    return p.returncode, p.stdout, p.stderr


def one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_output_naming_a_file_is_refused_before_any_data_is_read(tiny, tmp_path):
    """The data path is wrong too: the output error comes first, so nothing was read (and
    no privacy spent) before the bad path was found."""
    taken = tmp_path / "results.txt"
    taken.write_text("keep me\n")
    rc, out, err = cli(*args(tiny, "--output", str(taken), "--data", str(tmp_path / "none.csv")))
    line = one_line_error(err)
    assert rc == 2 and str(taken) in line and "not a folder" in line
    assert taken.read_text() == "keep me\n"


def test_output_holding_an_earlier_run_is_not_overwritten(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.json").write_text('{"epsilon": 7.998}\n')
    assert main(args(tiny, "--output", str(out))) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "already holds a run" in line and "new folder" in line
    assert json.loads((out / "metrics.json").read_text()) == {"epsilon": 7.998}
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json"]


def test_default_run_folder_keeps_a_model_that_evaluate_loads(tiny, tmp_path, capsys, monkeypatch):
    """`dpfit train` without --output writes runs/<task>-<date-time>/ (here under
    $DPFIT_RUNS_DIR) and says where; `dpfit evaluate` scores the saved model."""
    root = tmp_path / "runs"
    monkeypatch.setenv("DPFIT_RUNS_DIR", str(root))
    assert main(args(tiny, "--max-length", "1000")) == 2  # refused: no empty folder left
    assert not root.exists() or not list(root.iterdir())
    assert main(args(tiny)) == 0
    captured = capsys.readouterr()
    (run,) = list(root.iterdir())
    assert run.name.startswith("classification-") and str(run) in captured.err
    assert f"{run}/model" in captured.out
    m = json.loads((run / "metrics.json").read_text())
    assert m["steps"] == 2 and m["epsilon"] > 0
    assert main(["evaluate", "--model", str(run / "model"), "--data", tiny[1], "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["n"] == 120 and ev["privacy"]["epsilon"] == pytest.approx(m["epsilon"])
    # a second run in the same second gets a folder of its own
    assert main(args(tiny)) == 0
    assert len(list(root.iterdir())) == 2
    # --no-output: nothing written
    shutil.rmtree(root)
    assert main(args(tiny, "--no-output")) == 0
    assert not root.exists()
    assert main(args(tiny, "--no-output", "--output", str(tmp_path / "x"))) == 2
    assert "contradict" in one_line_error(capsys.readouterr().err)


def test_output_lost_during_training_is_written_to_a_named_fallback(tiny, tmp_path, monkeypatch):
    """The --output folder turns into a file while training runs: metrics.json, steps.csv
    and the model land in a fallback folder, and the error names it."""
    out = tmp_path / "run"
    root = tmp_path / "runs"
    monkeypatch.setenv("DPFIT_RUNS_DIR", str(root))

    def clobber(row, total):
        if out.is_dir():
            shutil.rmtree(out)
            out.write_text("someone else's file\n")

    config = TrainConfig(model=tiny[0], data=tiny[1], max_steps=2, batch_size=20, output=str(out))
    with pytest.raises(OutputError) as e:
        train(config, on_step=clobber)
    msg = str(e.value)
    (rescue,) = list(root.iterdir())
    assert "\n" not in msg and str(rescue) in msg and "records what was spent" in msg
    m = json.loads((rescue / "metrics.json").read_text())
    assert m["epsilon"] > 0 and m["steps"] == 2 and m["output_errors"]
    assert (rescue / "steps.csv").is_file() and (rescue / "model" / "dpfit.json").is_file()
    assert out.read_text() == "someone else's file\n"


@pytest.mark.parametrize("state", ["missing", "empty", "other files"])
def test_resume_without_a_checkpoint_is_an_error_not_a_fresh_start(tiny, tmp_path, state):
    ck = tmp_path / "ck"
    if state != "missing":
        ck.mkdir()
    if state == "other files":
        (ck / "notes.txt").write_text("x")
    out = tmp_path / "run"
    rc, _, err = cli(*args(tiny, "--checkpoint-dir", str(ck), "--resume", "--output", str(out)))
    line = one_line_error(err)
    assert rc == 2 and str(ck) in line and "drop --resume" in line
    assert {"missing": "does not exist", "empty": "is empty", "other files": "notes.txt"}[
        state
    ] in line
    assert not (out / "metrics.json").exists()  # nothing trained


def test_resume_needs_the_checkpoint_flag_by_its_name(tiny, capsys):
    assert main(args(tiny, "--resume")) == 2
    assert "--checkpoint-dir" in one_line_error(capsys.readouterr().err)


def test_a_new_run_refuses_a_checkpoint_dir_of_another_run(tiny, tmp_path, capsys):
    ck = tmp_path / "ck"
    assert main(args(tiny, "--checkpoint-dir", str(ck), "--no-output")) == 0
    before = sorted(p.name for p in ck.iterdir())
    assert before
    assert main(args(tiny, "--checkpoint-dir", str(ck), "--no-output")) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "--resume" in line and "already holds checkpoints" in line
    assert sorted(p.name for p in ck.iterdir()) == before
