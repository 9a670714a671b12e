"""Image training end to end, through the one training loop (dpfit.train): the CLI learns a
generated task, public pretraining feeds private fine-tuning, two-phase composes one budget,
DP last layer trains the head alone, a killed run resumes bit-for-bit."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import torch.nn.functional as F
from image_tasks import patterns, write_npz
from safetensors.torch import load_file
from sigkill import assert_resumed_as_uninterrupted, kill_after_checkpoint

from dpfit import PrivacyEngine
from dpfit.accounting import epsilon_for
from dpfit.cli import main
from dpfit.data.rowhash import SPLIT_RULE
from dpfit.errors import DPFitError
from dpfit.reporting import PRIVATE_STEP_FIELDS
from dpfit.tasks.image_classification import ImageOptions, prepare_images
from dpfit.train import TrainConfig, train
from dpfit.vision.data import ImageCollate, ImageData
from dpfit.vision.models import build_model

TASK = "image-classification"

FAST = ["--threads", "1", "--quiet", "--json"]


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow
def test_cli_private_run_learns_generated_task(tiny_npz, tmp_path, capsys):
    args = ["train", "--task", "image-classification", "--data", str(tiny_npz), "--model",
            "resnet-gn", "--mode", "full", "--noise-multiplier", "1.0", "--epochs", "3",
            "--batch-size", "64", "--physical-batch-size", "32", "--lr", "5e-3",
            "--output", str(tmp_path / "out"), *FAST]  # fmt: skip
    assert main(args) == 0
    m = _json(capsys)
    assert m["accuracy"] >= 0.6, m["accuracy"]  # four classes: chance is 0.25
    assert "start_accuracy" not in m  # a factory model starts untrained: nothing to score
    # about 10% held out of the file, each image by its own hash (dpfit.data.rowhash)
    assert m["eval_n"] + m["train_examples"] == 480 and 20 <= m["eval_n"] <= 80
    q = 64 / m["train_examples"]
    assert m["sample_rate"] == pytest.approx(q)
    assert m["epsilon"] == pytest.approx(epsilon_for(1.0, q, m["steps"], m["delta"]), rel=1e-9)
    assert not m["insecure_seed"]
    record = json.loads((tmp_path / "out" / "model" / "dpfit-vision.json").read_text())
    assert record["arch"] == "resnet-gn" and record["dpfit"]["private"]


def test_pretrain_public_then_private_bitfit_then_evaluate(tiny_npz, tmp_path, capsys):
    pre = tmp_path / "pre"
    assert main(["pretrain", "--task", "image-classification", "--data", str(tiny_npz),
                 "--public-fraction", "0.3", "--epochs", "2", "--batch-size", "32",
                 "--output", str(pre), *FAST]) == 0  # fmt: skip
    m_pre = _json(capsys)
    n_files = m_pre["public_split"]["n_public"] + m_pre["public_split"]["n_private"]
    assert not m_pre["private"] and m_pre["train_examples"] == m_pre["public_split"]["n_public"]
    assert abs(m_pre["train_examples"] - 0.3 * n_files) < 0.1 * n_files  # each image by its hash
    assert m_pre["trainable_fraction"] == 1.0
    rec = json.loads((pre / "model" / "dpfit-vision.json").read_text())["dpfit"]
    assert rec["pretrained_on"]["fraction"] == 0.3 and not rec["private"]

    fine = tmp_path / "fine"
    base = ["train", "--task", "image-classification", "--data", str(tiny_npz), "--model",
            str(pre / "model"), "--noise-multiplier", "2.0", "--max-steps", "4",
            "--batch-size", "32", "--output", str(fine), *FAST]  # fmt: skip
    assert main(base) == 0
    captured = capsys.readouterr()
    m = json.loads(captured.out.strip().splitlines()[-1])
    # the private run trains on the other 70% only (the split comes from the model's record)
    assert (
        m["train_examples"]
        == m_pre["public_split"]["n_private"]
        == n_files - m_pre["train_examples"]
    )
    assert "public split from the pretrained model's record" in captured.err
    assert m["private"] and 0 < m["trainable_fraction"] < 0.05  # biases + head
    # the checkpoint is scored before training, on the same held-out images as pretraining's
    # final score (the same model, the same split seed)
    assert m["start_accuracy"] == m_pre["accuracy"]
    assert "accuracy of the starting model, before training" in captured.err
    # the recipe knows the checkpoint is trained for the task, and prints nothing about tokens
    recipe = next(line for line in captured.err.splitlines() if "note: recipe" in line)
    assert "from a checkpoint trained for the task" in recipe and "max length" not in recipe
    assert m["recipe"]["start"] == "trained" and m["recipe"]["max_length"] is None
    # private step rows carry no per-step loss or batch size (un-noised private statistics)
    header = (fine / "steps.csv").read_text().splitlines()[0].split(",")
    assert tuple(header) == PRIVATE_STEP_FIELDS
    assert json.loads((fine / "model" / "dpfit.json").read_text())["private"]
    # a split that would overlap the public examples is refused
    # (a new --output: the first run's folder holds its record and is never overwritten)
    assert main([*base, "--public-fraction", "0.2", "--output", str(tmp_path / "fine2")]) == 2
    assert "would include some of those examples" in capsys.readouterr().err

    assert (
        main(
            [
                "evaluate",
                "--model",
                str(fine / "model"),
                "--data",
                str(tiny_npz),
                *FAST[:2],
                "--json",
            ]
        )
        == 0
    )
    ev = _json(capsys)
    assert ev["n"] == 480 and ev["privacy"]["private"]
    assert ev["privacy"]["pretrained_on"]["fraction"] == 0.3


def test_two_phase_on_an_image_model_composes_one_budget():
    images, labels = patterns(200, 8, seed=1)
    data = ImageData(images[:, None], labels, ("a", "b", "c", "d"), "gen")
    m = build_model("resnet-gn", data.label_names, 1, 8, seed=0, options={"width": 8})
    model = m.module
    import dpfit

    dpfit.make_bias_trainable(model, train_head=m.head_names)
    engine = PrivacyEngine(
        model, expected_batch_size=20, sample_size=200, target_epsilon=2.0, target_delta=1e-5,
        schedule=[("full", 1), ("bias", 1)], insecure_seed=0,
    )  # fmt: skip
    loader = engine.data_loader(range(200), collate_fn=ImageCollate(data))
    conv = model.stem[0].weight
    eps_after, conv_after = {}, {}
    for phase in engine.phases():
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        before = conv.detach().clone()
        for b in loader:
            F.cross_entropy(model(b["pixel_values"]), b["labels"]).backward()
            engine.step(opt)
        eps_after[phase.mode] = engine.epsilon()
        conv_after[phase.mode] = not torch.equal(before, conv)
    assert conv_after == {"full": True, "bias": False}  # weights train only in the full phase
    steps = 2 * engine.config.steps_per_epoch
    assert engine.steps_taken == steps
    assert engine.epsilon() == pytest.approx(
        epsilon_for(engine.noise_multiplier, 0.1, steps, 1e-5), rel=1e-9
    )
    assert eps_after["full"] < eps_after["bias"] <= 2.0 * 1.001
    assert eps_after["bias"] > 0.95 * 2.0  # calibrated for both phases together
    engine.detach()


def test_config_errors_are_early(tiny_npz):
    def run(opts=None, **kw):
        return train(TrainConfig(task=TASK, data=str(tiny_npz), task_options=opts, **kw))

    with pytest.raises(DPFitError, match="non-private"):
        run(ImageOptions(split="public"))
    with pytest.raises(DPFitError, match="head alone"):
        run(ImageOptions(head_only=True), mode="full")
    with pytest.raises(DPFitError, match="text models"):
        run(add_biases=True)
    with pytest.raises(DPFitError, match="--full-epochs must be between"):
        run(full_epochs=3, epochs=3)
    with pytest.raises(ValueError, match="mode"):
        TrainConfig(task=TASK, mode="bogus")
    with pytest.raises(ValueError, match="split"):
        ImageOptions(split="both")


def test_image_flags_on_a_text_task_are_refused(capsys):
    assert main(["train", "--head-only", "--image-size", "28", *FAST]) == 2
    assert "--image-size, --head-only: for --task image-classification" in capsys.readouterr().err


def test_head_only_trains_the_head_alone_through_the_one_loop(tiny_npz):
    """DP last layer: only the head's parameters change; the run is the shared loop's."""
    from dpfit.tasks import get_task

    cfg = TrainConfig(task=TASK, data=str(tiny_npz), task_options=ImageOptions(head_only=True),
                      noise_multiplier=1.0, max_steps=2, batch_size=32, seed=1)  # fmt: skip
    task = get_task(TASK)
    prep = task.prepare(cfg)
    before = {n: p.detach().clone() for n, p in prep.model.named_parameters()}
    result = train(cfg, prepared=prep, task=task)
    changed = {n for n, p in result.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {"fc.weight", "fc.bias"}
    assert result.metrics["trains"] == "head" and result.metrics["steps"] == 2
    assert result.metrics["trainable_params"] == sum(before[n].numel() for n in changed)


def _args(data, out, *extra):
    return ["train", "--task", "image-classification", "--data", str(data), "--model", "resnet-gn",
            "--noise-multiplier", "1.0", "--epochs", "3", "--full-epochs", "1",
            "--batch-size", "30", "--physical-batch-size", "16", "--seed", "3",
            "--insecure-reproducible-noise", "--output", str(out), *FAST, *extra]  # fmt: skip


def _final(out):
    return load_file(str(out / "model" / "model.safetensors")), json.loads(
        (out / "metrics.json").read_text()
    )


@pytest.mark.slow
def test_resume_after_sigkill_matches_uninterrupted(tmp_path, capsys):
    """Two-phase image run killed at a random checkpoint, resumed: identical to a clean run."""
    data = write_npz(tmp_path / "d.npz", 200, size=8)
    assert main(_args(data, tmp_path / "ref")) == 0
    capsys.readouterr()
    ref_params, ref_metrics = _final(tmp_path / "ref")
    total = ref_metrics["steps"]
    assert ref_metrics["insecure_seed"] and total >= 15

    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    kill_at = rng.randint(2, total - 3)
    ck = tmp_path / "ck"
    argv = _args(data, tmp_path / "killed", "--checkpoint-dir", str(ck))
    killed_at = kill_after_checkpoint(argv, ck, kill_at, rng.uniform(0, 0.05))
    assert killed_at < total

    assert main(_args(data, tmp_path / "resumed", "--checkpoint-dir", str(ck), "--resume")) == 0
    params, metrics = _final(tmp_path / "resumed")
    msg = f"kill_at={kill_at}, last checkpoint={killed_at}"
    assert_resumed_as_uninterrupted(
        tmp_path / "resumed", params, metrics, ref_params, ref_metrics, ("accuracy",), msg
    )


def test_private_split_follows_the_pretraining_record(tiny_npz):
    src = str(tiny_npz)
    rec = {"source": src, "fraction": 0.25, "seed": 5, "rule": SPLIT_RULE}
    cfg = TrainConfig(task=TASK, data=src)
    got = prepare_images(cfg, ImageOptions(), rec)
    assert got.public_split["fraction"] == 0.25 and got.public_split["seed"] == 5
    public = prepare_images(
        TrainConfig(task=TASK, data=src, non_private=True),
        ImageOptions(split="public", public_fraction=0.25, split_seed=5),
    )
    rows = {
        (img.tobytes(), int(y))
        for img, y in zip(public.train.images, public.train.labels, strict=True)
    }
    assert not rows & {
        (img.tobytes(), int(y)) for img, y in zip(got.train.images, got.train.labels, strict=True)
    }
    assert len(rows) + len(got.train) == 480 - len(got.test)  # public + private: all that trains
    for bad in (dict(split_seed=6), dict(public_fraction=0.2), dict(public_fraction=0.0)):
        with pytest.raises(DPFitError, match="would include some of those examples"):
            prepare_images(cfg, ImageOptions(**bad), rec)
    with pytest.raises(DPFitError, match="protects nothing"):
        prepare_images(cfg, ImageOptions(), {"source": src, "fraction": 1.0})
    other = prepare_images(cfg, ImageOptions(), {"source": "elsewhere.npz", "fraction": 1.0})
    assert other.public_split is None and len(other.train) == 480 - len(other.test)
