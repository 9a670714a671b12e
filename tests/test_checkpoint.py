"""Checkpoints: atomic files, RNG round trips, and resume after SIGKILL == uninterrupted run."""

import json
import os
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from sigkill import as_if_crashed_after, assert_resumed_as_uninterrupted, kill_after_checkpoint

from dpfit import checkpoint as ckpt
from dpfit.cli import main
from dpfit.models import save_tiny_random_model, write_tiny_sentiment_csv


def test_save_is_atomic_and_keeps_newest(tmp_path):
    d = tmp_path / "ck"
    for step in (1, 2, 3):
        ckpt.save_checkpoint(d, step, {"step": step, "w": torch.full((3,), float(step))}, keep=2)
    # a kill mid-write leaves only a temporary file: never picked up, cleaned on the next save
    (d / ".ckpt-000000004.pt.tmp-999").write_bytes(b"half a file")
    assert [s for s, _ in ckpt.list_checkpoints(d)] == [2, 3]
    latest = ckpt.latest_checkpoint(d)
    assert ckpt.load_checkpoint(latest)["step"] == 3
    ckpt.save_checkpoint(d, 4, {"step": 4}, keep=2)
    assert not list(d.glob(".*tmp*"))
    assert ckpt.latest_checkpoint(tmp_path / "missing") is None


def test_rng_state_round_trip(tmp_path):
    state = ckpt.rng_state()
    a = (random.random(), np.random.rand(), torch.rand(3))
    ckpt.save_checkpoint(tmp_path, 1, {"rng": state})
    ckpt.set_rng_state(ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))["rng"])
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_trainable_state_round_trip_and_mismatch():
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    m[0].weight.requires_grad_(False)
    sd = ckpt.trainable_state(m)
    assert set(sd) == {"0.bias", "1.weight", "1.bias"}
    with torch.no_grad():
        m[1].bias.add_(1.0)
    ckpt.load_trainable_state(m, sd)
    assert torch.equal(m[1].bias, sd["1.bias"])
    with pytest.raises(ckpt.CheckpointError, match="same --model"):
        ckpt.load_trainable_state(m, {"2.bias": torch.zeros(1)})
    with pytest.raises(ckpt.CheckpointError, match="same model"):
        ckpt.load_trainable_state(m, {"1.bias": torch.zeros(5)})


def test_check_compatible():
    ckpt.check_compatible({"lr": 1.0}, {"lr": 1.0}, ("lr",))
    with pytest.raises(ckpt.CheckpointError, match="lr: 1.0 -> 2.0"):
        ckpt.check_compatible({"lr": 1.0}, {"lr": 2.0}, ("lr",))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return (
        save_tiny_random_model(root / "model"),
        write_tiny_sentiment_csv(root / "data.csv", n=240),
    )


def _args(tiny, out, *extra):
    model, data = tiny
    return [
        "train", "--model", str(model), "--data", str(data), "--epochs", "2",
        "--batch-size", "16", "--physical-batch-size", "8", "--lr", "0.05", "--seed", "3",
        "--epsilon", "4", "--threads", "1", "--quiet", "--json", "--output", str(out),
        "--insecure-reproducible-noise", *extra,
    ]  # fmt: skip


def _final(out):
    return load_file(str(out / "model" / "model.safetensors")), json.loads(
        (out / "metrics.json").read_text()
    )


def test_resume_with_other_settings_is_refused(tiny, tmp_path, capsys):
    ck = tmp_path / "ck"
    assert main(_args(tiny, tmp_path / "a", "--checkpoint-dir", str(ck), "--max-steps", "2")) == 0
    rc = main(_args(tiny, tmp_path / "b", "--checkpoint-dir", str(ck), "--resume", "--lr", "0.1"))
    assert rc == 2
    assert "lr: 0.05 -> 0.1" in capsys.readouterr().err


def test_resume_keeps_the_dropout_rate_and_reads_older_checkpoints_as_the_models(
    tiny, tmp_path, capsys
):
    ck = tmp_path / "ck"

    def run(out, *extra):
        return main(
            _args(tiny, tmp_path / out, "--checkpoint-dir", str(ck), "--max-steps", "2", *extra)
        )

    assert run("a") == 0
    as_if_crashed_after(ck, 1)  # killed after step 1: one step left
    assert run("b", "--resume", "--dropout", "0.1") == 2
    assert "dropout: 0.0 -> 0.1" in capsys.readouterr().err
    # a checkpoint written before the dropout rule ran the model's own rates: it resumes with
    # --dropout model, and a resume under the new default is refused, not silently changed
    path = ckpt.latest_checkpoint(ck)
    state = ckpt.load_checkpoint(path)
    del state["config"]["dropout"]
    torch.save(state, path)
    assert run("c", "--resume") == 2
    assert "dropout: 'model' -> 0.0" in capsys.readouterr().err
    assert run("d", "--resume", "--dropout", "model") == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    "extra,first_kill",
    [
        ((), 1),
        # two-phase X+BiTFiT, killed in the bias phase: the full phase's weights, the rebuilt
        # optimizer and the composed ledger must all come back
        (("--epochs", "3", "--full-epochs", "1"), 15),
    ],
    ids=["bias", "two-phase"],
)
def test_resume_after_sigkill_matches_uninterrupted(tiny, tmp_path, extra, first_kill):
    """Kill a run with SIGKILL at a random moment, resume it, compare with a clean run."""
    assert main([*_args(tiny, tmp_path / "ref"), *extra]) == 0
    ref_params, ref_metrics = _final(tmp_path / "ref")
    total = ref_metrics["steps"]
    assert total >= 20

    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    kill_at = rng.randint(first_kill, total - 4)
    delay = rng.uniform(0, 0.05)
    ck = tmp_path / "ck"
    argv = [*_args(tiny, tmp_path / "killed", "--checkpoint-dir", str(ck)), *extra]
    killed_at = kill_after_checkpoint(argv, ck, kill_at, delay, timeout=120)
    assert not (tmp_path / "killed" / "metrics.json").exists()
    assert killed_at < total, "killed after the last step: nothing left to resume"

    assert (
        main([*_args(tiny, tmp_path / "resumed", "--checkpoint-dir", str(ck), "--resume"), *extra])
        == 0
    )
    params, metrics = _final(tmp_path / "resumed")
    msg = f"kill_at={kill_at}, delay={delay:.3f}, last checkpoint before kill={killed_at}"
    assert_resumed_as_uninterrupted(
        tmp_path / "resumed", params, metrics, ref_params, ref_metrics, ("accuracy",), msg
    )


# -- continuations and forks ----------------------------------------------


def test_claim_marks_a_checkpoint_once_and_forks_only_when_asked(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 4, {"step": 4})
    first = ckpt.claim_continuation(path, steps=4)
    assert (first.number, first.fork) == (1, False)
    with pytest.raises(ckpt.CheckpointForkError, match="already continued.*--fork"):
        ckpt.claim_continuation(path, steps=4)
    second = ckpt.claim_continuation(path, steps=4, allow_fork=True)
    assert (second.number, second.fork) == (2, True)
    assert [m.name for m in ckpt.continuation_markers(path)] == [
        "ckpt-000000004.pt.continued-1",
        "ckpt-000000004.pt.continued-2",
    ]
    assert ckpt.latest_checkpoint(tmp_path) == path  # markers are not checkpoints
    for step in (5, 6):  # pruned with their checkpoint
        ckpt.save_checkpoint(tmp_path, step, {"step": step})
    # 4's markers went with it; 5 is claimed by the run that went on to write 6
    assert [p.name for p in tmp_path.glob("*.continued-*")] == ["ckpt-000000005.pt.continued-1"]


def test_fork_report_composes_every_continuation():
    from dpfit.accounting import PrivacyLedger, StepRecord

    records = [StepRecord(1.0, 0.1, 30), StepRecord(1.0, 0.1, 20)]  # 30 shared, 20 own
    fork = ckpt.fork_report(ckpt.Continuation("c", 3, 30), records, 1e-5, "rdp")
    assert fork["fork"] and fork["shared_steps"] == 30
    want = PrivacyLedger(1e-5, "rdp", [StepRecord(1.0, 0.1, 30 + 3 * 20)]).epsilon()
    assert fork["epsilon_if_all_continuations_released"] == pytest.approx(want, rel=1e-9)
    assert (
        fork["epsilon_if_all_continuations_released"]
        > PrivacyLedger(1e-5, "rdp", records).epsilon()
    )
    assert "epsilon_if_all_continuations_released" not in ckpt.fork_report(
        ckpt.Continuation("c", 1, 30), records, 1e-5, "rdp"
    )


def test_second_continuation_is_refused_the_crash_resume_chain_is_not(tiny, tmp_path, capsys):
    """A crash is simulated by deleting the checkpoints written after it."""
    ck = tmp_path / "ck"

    def run(name, *extra):
        args = [a for a in _args(tiny, tmp_path / name) if a != "--insecure-reproducible-noise"]
        return main(
            [*args, "--max-steps", "6", "--no-head-first", "--checkpoint-dir", str(ck), *extra]
        )

    def crash_after(step):
        as_if_crashed_after(ck, step)

    assert run("a", "--checkpoint-every", "2") == 0  # checkpoints at steps 4 and 6 kept
    crash_after(4)
    assert run("r1", "--resume") == 0  # continues ckpt 4, writes 5 and 6
    m1 = json.loads((tmp_path / "r1" / "metrics.json").read_text())
    assert m1["steps"] == 6 and m1["continuation"]["continuation"] == 1
    assert not m1["continuation"]["fork"]
    crash_after(5)  # r1 crashed after writing ckpt 5: resuming the newer checkpoint is fine
    assert run("r2", "--resume") == 0
    assert json.loads((tmp_path / "r2" / "metrics.json").read_text())["steps"] == 6
    crash_after(5)  # ckpt 5 has now been continued (by r2): another --resume is a fork
    capsys.readouterr()
    assert run("r3", "--resume") == 2
    err = capsys.readouterr().err
    assert "ckpt-000000005.pt was already continued" in err and "--fork" in err
    assert not (tmp_path / "r3" / "metrics.json").exists()  # refused before any step
    assert run("r4", "--resume", "--fork") == 0
    m4 = json.loads((tmp_path / "r4" / "metrics.json").read_text())
    fork = m4["continuation"]
    assert (
        fork["fork"]
        and fork["continuation"] == 2
        and fork["shared_steps"] == m4["head_first_steps"] + 5
    )
    assert fork["epsilon_if_all_continuations_released"] > m4["epsilon"]
    assert "costs" in fork["note"]


def test_a_checkpoint_of_the_old_split_rule_is_not_resumed(tiny, tmp_path, capsys):
    """Splits are drawn per row now (dpfit.data.rowhash): a checkpoint written under the old
    permutation rule trained on rows the new rule may hold out, so it is refused."""
    ck = tmp_path / "ck"
    args = ("--checkpoint-dir", str(ck), "--max-steps", "2")
    assert main(_args(tiny, tmp_path / "a", *args)) == 0
    as_if_crashed_after(ck, 1)
    path = ckpt.latest_checkpoint(ck)
    state = ckpt.load_checkpoint(path)
    del state["config"]["split_rule"]  # as the old rule's checkpoints were written
    torch.save(state, path)
    capsys.readouterr()
    assert main(_args(tiny, tmp_path / "b", *args, "--resume")) == 2
    assert "split_rule: None -> 'row-hash-v1'" in capsys.readouterr().err
