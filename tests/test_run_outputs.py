"""A run that spends privacy never loses its result, and a resume never starts over.

Output folders are checked before any data is read; a write that fails after training lands
in a fallback folder the error names; `dpfit train` without --output keeps its result in a
default run folder; --resume without a checkpoint is an error, never a fresh start.
"""

import dataclasses
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


@pytest.mark.parametrize(
    "error", [RuntimeError("CUDA error: device-side assert"), KeyboardInterrupt()]
)
def test_a_run_stopped_mid_training_keeps_what_it_spent(tiny, tmp_path, monkeypatch, error):
    """An error (or Ctrl-C) after some private steps: metrics.json records the epsilon spent
    and the model so far is saved beside it; the original error still propagates."""
    from dpfit.tasks.classification import ClassificationTask

    calls = {"n": 0}
    real = ClassificationTask.loss

    def failing(self, model, batch):
        calls["n"] += 1
        if calls["n"] == 3:  # one physical batch per step: two steps taken
            raise error
        return real(self, model, batch)

    monkeypatch.setattr(ClassificationTask, "loss", failing)
    out = tmp_path / "run"
    config = TrainConfig(
        model=tiny[0], data=tiny[1], max_steps=5, batch_size=20, physical_batch_size=120,
        head_first=False, output=str(out),
    )  # fmt: skip
    with pytest.raises(type(error)):
        train(config)
    m = json.loads((out / "metrics.json").read_text())
    status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
    assert m["status"] == status and m["steps"] == 2 and m["privacy"]["steps"] == 2
    assert m["epsilon"] > 0 and m["epsilon"] == m["privacy"]["epsilon"]
    record = json.loads((out / "model" / "dpfit.json").read_text())
    assert record["epsilon"] == m["epsilon"] and (out / "model" / "config.json").is_file()
    with pytest.raises(OutputError, match="already holds a run"):  # not overwritten
        train(dataclasses.replace(config, max_steps=1))


def test_a_run_stopped_in_the_head_first_phase_keeps_what_it_spent(tiny, tmp_path, monkeypatch):
    """The head-first phase spends privacy too: an error after some of its steps leaves
    metrics.json with the epsilon spent and the model as it stands."""
    import dpfit.run.head_first as head_mod

    calls = {"n": 0}
    real = head_mod.F.cross_entropy

    def failing(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # the head phase's third step
            raise RuntimeError("boom in the head phase")
        return real(*a, **kw)

    monkeypatch.setattr(head_mod.F, "cross_entropy", failing)
    out = tmp_path / "run"
    config = TrainConfig(
        model=tiny[0], data=tiny[1], max_steps=3, batch_size=20, physical_batch_size=120,
        head_first=True, head_epochs=5, output=str(out),
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="boom in the head phase"):
        train(config)
    m = json.loads((out / "metrics.json").read_text())
    assert m["status"] == "failed" and m["privacy"]["steps"] == 2
    assert m["error"] == "RuntimeError"  # a message may quote the private batch: not written
    assert "boom" not in (out / "metrics.json").read_text()
    assert m["epsilon"] > 0 and m["epsilon"] == m["privacy"]["epsilon"]
    assert (out / "model" / "config.json").is_file()


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


# -- kill -9 at each phase boundary, then --resume: the same ledger, model and result --------


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    return (
        str(save_tiny_random_model(root / "model")),
        str(write_tiny_sentiment_csv(root / "train.csv", n=96, seed=0)),
    )


def kill_args(small, out, ck, *extra):
    model, data = small
    return ["train", "--model", model, "--data", data, "--batch-size", "16",
            "--physical-batch-size", "16", "--lr", "0.05", "--seed", "3", "--epsilon", "4",
            "--threads", "1", "--quiet", "--json", "--insecure-reproducible-noise",
            "--output", str(out), "--checkpoint-dir", str(ck), *extra]  # fmt: skip


BOUNDARIES = {
    # (extra flags, what marks the boundary): the head-first phase's end is its checkpoint at
    # main step 0; the full -> bias switch is its note; the save is metrics.json appearing
    "head-first": (("--epochs", "1", "--head-epochs", "1"), "ckpt-000000000.pt"),
    "phase-switch": (("--epochs", "2", "--full-epochs", "1"), "note: phase switch"),
    "save": (("--epochs", "1", "--head-epochs", "1"), "metrics.json"),
}


def _kill_at(argv, out, ck, marker):
    """Run the CLI in a subprocess and SIGKILL it as soon as `marker` shows (a file in the
    checkpoint or output folder, or a line on stderr). Returns the stderr read so far."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpfit.cli", *argv],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    seen = []
    try:
        if marker.startswith("note:"):
            for line in proc.stderr:
                seen.append(line)
                if line.startswith(marker):
                    proc.kill()
                    break
        else:
            import time

            path = (ck if marker.startswith("ckpt-") else out) / marker
            deadline = time.monotonic() + 120
            while proc.poll() is None and time.monotonic() < deadline:
                if path.exists():
                    proc.kill()
                    break
                time.sleep(0.001)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.stderr.close()
    assert proc.returncode == -9, f"not killed at {marker!r} (rc {proc.returncode}): {seen}"
    return "".join(seen)


def _ledger(out):
    record = json.loads((out / "model" / "dpfit.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    return record, metrics


@pytest.fixture(scope="module")
def reference_runs(small, tmp_path_factory):
    """Uninterrupted runs, one per flag set (the boundaries share them)."""
    done: dict[tuple, object] = {}

    def get(extra):
        if extra not in done:
            ref = tmp_path_factory.mktemp("ref")
            assert main(kill_args(small, ref / "out", ref / "ck", *extra)) == 0
            done[extra] = ref / "out"
        return done[extra]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("boundary", list(BOUNDARIES))
def test_kill_at_a_phase_boundary_then_resume_ends_with_the_same_ledger(
    small, reference_runs, tmp_path, capsys, boundary
):
    from safetensors.torch import load_file

    extra, marker = BOUNDARIES[boundary]
    ref = reference_runs(extra)
    ref_record, ref_metrics = _ledger(ref)

    out, ck = tmp_path / "run", tmp_path / "ck"
    _kill_at(kill_args(small, out, ck, *extra), out, ck, marker)
    assert ck.is_dir() and any(ck.iterdir()), "killed before the first checkpoint"
    capsys.readouterr()
    assert main(kill_args(small, out, ck, *extra, "--resume")) == 0, capsys.readouterr().err
    record, metrics = _ledger(out)
    # the same ledger: every step counted once, none twice, the same noise and sample rate
    assert record["history"] == ref_record["history"]
    assert record["epsilon"] == ref_record["epsilon"] == metrics["epsilon"]
    assert metrics["steps"] == ref_metrics["steps"]
    assert metrics["head_first_steps"] == ref_metrics["head_first_steps"]
    assert metrics["accuracy"] == ref_metrics["accuracy"]
    assert metrics.get("head_first_accuracy") == ref_metrics.get("head_first_accuracy")
    assert metrics["train_time_s"] <= metrics["wall_time_s"]
    params, ref_params = (load_file(str(d / "model" / "model.safetensors")) for d in (out, ref))
    assert set(params) == set(ref_params)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=0, msg=name)
    steps_csv = (out / "steps.csv").read_text().splitlines()
    assert len(steps_csv) == metrics["steps"] + 1


# -- progress on long stretches, and the report ---------------------------------------------


def test_long_stretches_report_progress_and_the_epsilon_of_each_phase(tiny, tmp_path):
    """Features, tokenising and evaluation report (stage, done, total) to a listener (the
    CLI's bars), ending at total; metrics.json says what the head-first phase spent, checked
    against dp-accounting directly, and epsilon.png is drawn from it."""
    import dp_accounting

    from dpfit import progress

    seen: dict[str, list[tuple[int, int]]] = {}
    out = tmp_path / "run"
    config = TrainConfig(
        model=tiny[0], data=tiny[1], max_steps=2, batch_size=20, physical_batch_size=16,
        head_epochs=1, output=str(out),
    )  # fmt: skip
    with progress.listening(lambda s, d, t: seen.setdefault(s, []).append((d, t))):
        res = train(config)
    for stage in ("tokenising", "head-first: features", "evaluating"):
        runs: list[list[tuple[int, int]]] = []  # each pass over some data: 0 ... total
        for d, t in seen[stage]:
            if d == 0:
                runs.append([])
            runs[-1].append((d, t))
        for r in runs:
            assert [d for d, _ in r] == sorted(d for d, _ in r), stage
            assert r[-1][0] == r[-1][1] > 0 and len({t for _, t in r}) == 1, stage
    assert len(seen["head-first: features"]) > 2  # per batch, not only start and end
    m = res.metrics
    head, main_ = m["epsilon_by_phase"]
    assert (head["phase"], main_["phase"]) == ("head-first", "main")
    assert head["steps"] == m["head_first_steps"] > 0 and main_["steps"] == m["steps"] == 2
    direct = dp_accounting.rdp.RdpAccountant()
    event = dp_accounting.GaussianDpEvent(m["noise_multiplier"])
    direct.compose(dp_accounting.PoissonSampledDpEvent(m["sample_rate"], event), head["steps"])
    assert head["epsilon_after"] == pytest.approx(direct.get_epsilon(m["delta"]), rel=1e-9)
    assert head["epsilon_after"] < main_["epsilon_after"] == m["epsilon"]
    assert json.loads((out / "metrics.json").read_text())["epsilon_by_phase"][0] == head
    assert (out / "epsilon.png").stat().st_size > 1000


def test_result_table_keeps_one_line_per_row():
    from dpfit.reporting import format_table

    table = format_table([("sample: 'Once'", "upon a time\nthere was\r\na model"), ("x", 1.0)])
    lines = table.splitlines()
    assert len(lines) == 4 and len({len(ln) for ln in lines}) == 1


def test_a_run_on_the_bundled_data_is_scored_by_evaluate_without_data(
    tiny, tmp_path, capsys, monkeypatch
):
    """README's first command trains on the bundled data with no flags; its default run
    folder holds a model that `dpfit evaluate --model DIR/model` scores on the same held-out
    movies (the split seed is in dpfit.json), with the accuracy training reported."""
    root = tmp_path / "runs"
    monkeypatch.setenv("DPFIT_RUNS_DIR", str(root))
    argv = ["train", "--model", tiny[0], "--max-train-examples", "200", "--max-steps", "1",
            "--no-head-first", "--seed", "2", "--threads", "1", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    (run,) = list(root.iterdir())
    assert f"dpfit evaluate --model {run}/model\n" in capsys.readouterr().out
    m = json.loads((run / "metrics.json").read_text())
    assert json.loads((run / "model" / "dpfit.json").read_text())["bundled_split_seed"] == 2
    assert main(["evaluate", "--model", str(run / "model"), "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["n"] == m["eval_n"] and ev["accuracy"] == pytest.approx(m["accuracy"])
    # a model trained on a file needs --data, and says so
    assert main(args(tiny, "--output", str(tmp_path / "own"))) == 0
    capsys.readouterr()
    assert main(["evaluate", "--model", str(tmp_path / "own" / "model")]) == 2
    assert "--data FILE" in one_line_error(capsys.readouterr().err)


def test_an_image_model_built_from_a_name_says_it_starts_untrained(tmp_path):
    from dpfit.tasks.image_classification import DEFAULT_MODEL, _fresh_model_note

    (note,) = _fresh_model_note(DEFAULT_MODEL, None)
    assert "randomly initialised" in note and "(no --model)" in note and "--model" in note
    assert "(no --model)" not in _fresh_model_note(DEFAULT_MODEL, DEFAULT_MODEL)[0]
    assert _fresh_model_note(str(tmp_path / "saved-model"), str(tmp_path / "saved-model")) == []


def test_image_runs_mention_no_max_length():
    from dpfit.recipe import default_delta, resolve_recipe
    from dpfit.run.oom import oom_error as _oom_error

    image = TrainConfig(task="image-classification", physical_batch_size=8, max_length=128)
    msg = str(_oom_error(image, RuntimeError("out of memory")))
    assert "--physical-batch-size 4" in msg and "length" not in msg
    text = dataclasses.replace(image, task="classification")
    assert "max length 128" in str(_oom_error(text, RuntimeError("out of memory")))
    recipe = resolve_recipe(1000, 10, 8.0, default_delta(1000), 10**6, "bias")
    images = resolve_recipe(1000, 10, 8.0, default_delta(1000), 10**6, "bias", tokens=False)
    assert "max length" not in images.describe() and "max length" in recipe.describe()


def test_a_rare_label_error_stays_short_with_many_names():
    from dpfit.tasks.labels import RareLabelError, check_data_label_names

    names = [f"person-{i:04d}" for i in range(1000)]
    with pytest.raises(RareLabelError) as e:
        check_data_label_names(names, dict.fromkeys(names, 1), "d.csv", False, "metrics.json")
    assert "person-0009, ... (990 more)" in str(e.value) and len(str(e.value)) < 600


# -- releases and forks: one rule wherever a model leaves the process ----------------------


def _stop_at(step: int):
    def on_step(row, total):
        if row.step == step:
            raise KeyboardInterrupt  # as Ctrl-C inside the progress callback

    return on_step


def _ck_config(tiny, tmp_path, name, **kw):
    base = dict(
        model=tiny[0], data=tiny[1], max_steps=6, batch_size=20, physical_batch_size=120,
        head_first=False, output=str(tmp_path / name), checkpoint_dir=str(tmp_path / "ck"),
    )  # fmt: skip
    return TrainConfig(**{**base, **kw})


def test_a_partial_model_is_the_checkpoint_that_resume_continues(tiny, tmp_path):
    """Ctrl-C after step 4 with checkpoint 3 the newest: the model released is checkpoint 3's
    (step 4 leaves the process in no form), so --resume continues exactly what was released
    and the pair of releases costs the resumed run's 6 steps, as it reports; releasing the
    live step-4 model too would have made an unaccounted fork (3 shared + 1 + 3 = 7 steps)."""
    from safetensors.torch import load_file

    from dpfit import checkpoint as ckpt

    config = _ck_config(tiny, tmp_path, "a", checkpoint_every=3)
    with pytest.raises(KeyboardInterrupt):
        train(config, on_step=_stop_at(4))
    m = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert m["status"] == "interrupted" and m["steps"] == 3 and m["steps_discarded"] == 1
    assert m["privacy"]["steps"] == 3
    saved = ckpt.load_checkpoint(ckpt.checkpoint_path(tmp_path / "ck", 3))["trainable"]
    released = load_file(str(tmp_path / "a" / "model" / "model.safetensors"))
    backbone = {n.removeprefix("backbone."): v for n, v in saved.items() if "backbone." in n}
    assert backbone and set(backbone) <= set(released)
    for name, value in backbone.items():
        torch.testing.assert_close(released[name], value, rtol=0, atol=0, msg=name)
    resumed = train(dataclasses.replace(config, output=str(tmp_path / "b"), resume=True))
    assert resumed.metrics["steps"] == 6
    cont = resumed.metrics["continuation"]
    assert cont["continuation"] == 1 and not cont["fork"] and cont["shared_steps"] == 3


def test_resuming_a_checkpoint_older_than_a_release_is_a_fork(tiny, tmp_path):
    """A finished run released the model of step 6; checkpoint 5 (kept beside 6) was continued
    by it. Resuming 5 is refused unless asked, then reported as what releasing both costs: 5
    shared steps + 1 + 1 (checked against dp-accounting directly)."""
    from accounting_oracle import ADD_REMOVE, direct_epsilon

    from dpfit import checkpoint as ckpt

    config = _ck_config(tiny, tmp_path, "a")
    done = train(config)
    ckpt.checkpoint_path(tmp_path / "ck", 6).unlink()  # the newest gone: 5 is what is left
    again = dataclasses.replace(config, output=str(tmp_path / "b"), resume=True)
    with pytest.raises(ckpt.CheckpointForkError, match="already continued"):
        train(again)
    fork = train(dataclasses.replace(again, output=str(tmp_path / "c"), allow_fork=True))
    report = fork.metrics["continuation"]
    assert report["fork"] and report["continuation"] == 2 and report["shared_steps"] == 5
    sigma, q = done.privacy["noise_multiplier"], done.privacy["sample_rate"]
    assert report["epsilon_if_all_continuations_released"] == pytest.approx(
        direct_epsilon(sigma, q, 7, done.privacy["delta"], ADD_REMOVE, kind="rdp"), rel=1e-6
    )


@pytest.mark.parametrize("where", ["probe evaluation", "main engine", "first checkpoint"])
def test_ctrl_c_between_the_head_first_steps_and_the_main_phase_keeps_the_run(
    tiny, tmp_path, monkeypatch, where
):
    """After the head-first steps and before the main phase's first step: the epsilon spent
    is on disk, and --resume continues from the head-first checkpoint when one was written."""
    import dpfit.run.loop as loop_mod
    import dpfit.run.main_phase as main_mod
    from dpfit import checkpoint as ckpt

    owner, name = {
        "probe evaluation": (loop_mod, "score_before"),
        "main engine": (main_mod, "make_engine"),
        "first checkpoint": (ckpt, "save_checkpoint"),
    }[where]
    real = getattr(owner, name)

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, interrupted)
    config = _ck_config(tiny, tmp_path, "a", head_first=True, head_epochs=1, max_steps=2)
    with pytest.raises(KeyboardInterrupt):
        train(config)
    m = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert m["status"] == "interrupted" and m["epsilon"] > 0 and m["privacy"]["steps"] > 0
    monkeypatch.setattr(owner, name, real)
    again = dataclasses.replace(config, output=str(tmp_path / "b"), resume=True)
    if where == "probe evaluation":  # the head-first checkpoint was written
        resumed = train(again)
        assert resumed.metrics["steps"] == 2
        assert resumed.metrics["head_first_steps"] == m["privacy"]["steps"]
    else:  # nothing to continue: said so, never a silent fresh start
        with pytest.raises(ckpt.CheckpointError, match="nothing to continue"):
            train(again)


@pytest.mark.parametrize("where", ["phase switch", "final evaluation"])
def test_ctrl_c_at_the_phase_switch_or_the_final_evaluation_keeps_the_run(
    tiny, tmp_path, monkeypatch, where
):
    """Ctrl-C as X+BiTFiT switches from full to bias steps, or while the trained model is
    scored: metrics.json says what was spent, and --resume finishes the run."""
    import dpfit.run.loop as loop_mod
    from dpfit.tasks.classification import ClassificationTask

    if where == "phase switch":
        owner, name = loop_mod, "enter_bias_phase"
        extra = dict(full_epochs=1, epochs=2, max_steps=None)
    else:
        owner, name = ClassificationTask, "evaluate"
        extra = dict(max_steps=3)
    real = getattr(owner, name)

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, interrupted)
    config = _ck_config(tiny, tmp_path, "a", **extra)
    with pytest.raises(KeyboardInterrupt):
        train(config)
    m = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert m["status"] == "interrupted" and m["epsilon"] > 0 and m["privacy"]["steps"] > 0
    monkeypatch.setattr(owner, name, real)
    resumed = train(dataclasses.replace(config, output=str(tmp_path / "b"), resume=True))
    assert resumed.metrics["steps"] >= m["steps"] and "accuracy" in resumed.metrics
