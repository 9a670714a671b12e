"""Public pretraining's defaults: the length rule from the public n, and that dpfit pretrain
applies it (with cosine lr and shift augmentation) unless told otherwise."""

from __future__ import annotations

import json

import pytest

from dpfit.cli import main
from dpfit.vision import pretrain as pt


def test_pretrain_epochs_aim_at_a_step_count_within_bounds():
    assert pt.pretrain_epochs(6000, 128) == pt.PRETRAIN_MAX_EPOCHS  # 47 steps a pass: capped
    assert pt.pretrain_epochs(60_000, 128) == 5  # 469 steps a pass: 5 passes, 2,345 steps
    assert pt.pretrain_epochs(10_000_000, 128) == pt.PRETRAIN_MIN_EPOCHS
    assert pt.pretrain_epochs(20, 128) == pt.PRETRAIN_MAX_EPOCHS
    sizes = [100, 1000, 6000, 20_000, 60_000, 300_000, 3_000_000]
    epochs = [pt.pretrain_epochs(n) for n in sizes]
    assert epochs == sorted(epochs, reverse=True)  # more public data, fewer passes
    for n, e in zip(sizes, epochs, strict=True):
        steps = e * -(-n // 128)
        assert e in (pt.PRETRAIN_MIN_EPOCHS, pt.PRETRAIN_MAX_EPOCHS) or (
            pt.PRETRAIN_STEPS <= steps < pt.PRETRAIN_STEPS + -(-n // 128)
        )
    with pytest.raises(ValueError):
        pt.pretrain_epochs(0)


def test_dpfit_pretrain_uses_the_rule_cosine_and_shift_by_default(tiny_npz, tmp_path, capsys,
                                                                 monkeypatch):  # fmt: skip
    monkeypatch.setattr(pt, "PRETRAIN_STEPS", 12)  # keep the run short: 130 images, 3 a pass
    out = tmp_path / "pre"
    assert main(["pretrain", "--data", str(tiny_npz), "--public-fraction", "0.3",
                 "--batch-size", "64", "--output", str(out), "--threads", "1", "--quiet",
                 "--json"]) == 0  # fmt: skip
    captured = capsys.readouterr()
    m = json.loads(captured.out.strip().splitlines()[-1])
    n = m["train_examples"]  # about 0.3 x 432: the public share is drawn per image
    assert abs(n - 0.3 * 432) <= 15 and m["epochs"] == pt.pretrain_epochs(n, 64) == 4
    assert m["steps"] == 4 * -(-n // 64) and m["lr_schedule"] == "cosine"
    assert f"pretraining length from the public n={n}" in captured.err
    # the note gives the steps that run, and no flag is said to override anything
    assert f"4 epochs, {m['steps']} steps of 64" in captured.err
    assert "overridden by flags" not in captured.err
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["config"]["task_options"]["augment"] == "shift"


def test_pretrain_flags_override_every_default():
    from dpfit.cli import build_parser
    from dpfit.vision.cli import pretrain_config_from_args

    args = build_parser().parse_args(["pretrain", "--output", "x"])
    c = pretrain_config_from_args(args)
    assert c.epochs is None and c.lr == pt.PRETRAIN_LR and c.lr_schedule == "cosine"
    assert c.task_options.augment == "shift" and c.non_private and c.mode == "full"
    args = build_parser().parse_args(["pretrain", "--output", "x", "--epochs", "2",
                                      "--lr-schedule", "constant", "--augment", "shift-flip",
                                      "--lr", "1e-3"])  # fmt: skip
    c = pretrain_config_from_args(args)
    assert (c.epochs, c.lr, c.lr_schedule) == (2, 1e-3, "constant")
    assert c.task_options.augment == "shift-flip"
