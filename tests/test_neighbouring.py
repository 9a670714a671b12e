"""The neighbouring relation: both epsilons reported, either one calibrated.

Every epsilon is checked against dp-accounting's accountants called directly here, with the
relation spelled out, not through dpfit.accounting.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from accounting_oracle import ADD_REMOVE, REPLACE, direct_epsilon
from torch import nn

import dpfit
from dpfit.accounting import (
    NEIGHBOURING,
    PrivacyLedger,
    StepRecord,
    epsilon_for,
    noise_multiplier_for,
)
from dpfit.cli import build_parser, main, summary_rows, train_config_from_args
from dpfit.train import TrainConfig, train


@pytest.mark.parametrize("kind", ["rdp", "pld"])
@pytest.mark.parametrize("q,sigma,steps", [(0.01, 1.0, 500), (0.1, 1.5, 30)])
def test_both_relations_match_dp_accounting(kind, q, sigma, steps):
    add_remove = epsilon_for(sigma, q, steps, 1e-5, kind, "add-remove")
    replace = epsilon_for(sigma, q, steps, 1e-5, kind, "replace-one")
    assert add_remove == pytest.approx(direct_epsilon(sigma, q, steps, 1e-5, ADD_REMOVE, kind))
    # dp-accounting's RDP accountant refuses replace-one for Poisson sampling: PLD gives it
    assert replace == pytest.approx(direct_epsilon(sigma, q, steps, 1e-5, REPLACE, "pld"))
    assert replace > 1.05 * direct_epsilon(sigma, q, steps, 1e-5, ADD_REMOVE, "pld")


def test_unsampled_replace_one_is_add_remove_at_twice_the_sensitivity():
    """Without sampling a swap moves the clipped sum by up to 2R: sigma acts as sigma/2."""
    ledger = PrivacyLedger(1e-5, "pld", [StepRecord(3.0, 1.0, 4, sampling="none")])
    want = direct_epsilon(1.5, 1, 4, 1e-5, ADD_REMOVE)
    assert ledger.epsilon(neighbouring="replace-one") == pytest.approx(want, rel=1e-3)
    assert ledger.epsilons()["add-remove"] == pytest.approx(
        direct_epsilon(3.0, 1, 4, 1e-5, ADD_REMOVE)
    )


@pytest.mark.parametrize("kind", ["rdp", "pld"])
@pytest.mark.parametrize("target", [0.5, 1.0])
def test_calibration_to_replace_one_meets_it_tightly(kind, target):
    q, steps = 0.05, 100
    sigma = noise_multiplier_for(target, 1e-5, q, steps, kind, neighbouring="replace-one")
    eps = direct_epsilon(sigma, q, steps, 1e-5, REPLACE)
    assert target * 0.97 < eps <= target
    assert direct_epsilon(0.98 * sigma, q, steps, 1e-5, REPLACE) > target  # not over-noised
    # the noise calibrated to add-remove does not meet the target for replace-one
    add_remove_sigma = noise_multiplier_for(target, 1e-5, q, steps, kind)
    assert add_remove_sigma < sigma
    assert direct_epsilon(add_remove_sigma, q, steps, 1e-5, REPLACE) > 1.05 * target


def test_ledger_keeps_its_relation_through_a_checkpoint():
    ledger = PrivacyLedger(1e-5, "pld", neighbouring="replace-one")
    for _ in range(5):
        ledger.record(2.0, 0.1)
    again = PrivacyLedger.from_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert again.neighbouring == "replace-one"
    assert again.epsilon() == ledger.epsilons()["replace-one"] > ledger.epsilons()["add-remove"]
    assert set(ledger.epsilons()) == set(NEIGHBOURING)
    with pytest.raises(ValueError, match="neighbouring"):
        PrivacyLedger(1e-5, neighbouring="swap")


def small_engine(**kw) -> dpfit.PrivacyEngine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    dpfit.make_bias_trainable(model)
    kw = {"expected_batch_size": 10, "sample_size": 200, "target_delta": 1e-5, **kw}
    return dpfit.PrivacyEngine(model, **kw)


def test_engine_calibrates_to_the_relation_it_is_given_and_reports_both():
    steps = 40
    engine = small_engine(target_epsilon=1.0, steps=steps, neighbouring="replace-one")
    sigma, q = engine.noise_multiplier, engine.sample_rate
    assert direct_epsilon(sigma, q, steps, 1e-5, REPLACE) <= 1.0
    for _ in range(steps):
        engine.ledger.record(sigma, q)  # what `steps` noised steps record
    record = engine.privacy_record()
    assert record["neighbouring"] == "replace-one"
    want = direct_epsilon(sigma, q, steps, 1e-5, REPLACE)
    assert record["epsilon"] == record["epsilon_replace_one"] == pytest.approx(want)
    assert 0.95 < record["epsilon"] <= 1.0
    assert record["epsilon_add_remove"] == pytest.approx(
        direct_epsilon(sigma, q, steps, 1e-5, ADD_REMOVE, "rdp")
    )
    # the default engine is add-remove, and still states the replace-one epsilon
    default = small_engine(target_epsilon=1.0, steps=steps)
    assert default.noise_multiplier < sigma
    for _ in range(steps):
        default.ledger.record(default.noise_multiplier, q)
    d = default.privacy_record()
    assert d["neighbouring"] == "add-remove" and d["epsilon"] == d["epsilon_add_remove"]
    assert d["epsilon_replace_one"] == pytest.approx(
        direct_epsilon(default.noise_multiplier, q, steps, 1e-5, REPLACE)
    )
    assert d["epsilon_replace_one"] > direct_epsilon(
        default.noise_multiplier, q, steps, 1e-5, ADD_REMOVE
    )
    # a checkpoint accounted for one relation does not resume under the other
    with pytest.raises(ValueError, match="neighbouring='replace-one'"):
        small_engine(target_epsilon=1.0, steps=steps).load_state_dict(engine.state_dict())


def test_a_run_calibrated_to_replace_one_reports_both_and_says_which(tiny, tmp_path, capsys):
    torch.set_num_threads(1)
    model, data = tiny
    config = TrainConfig(
        model=model, data=data, epochs=1, batch_size=30, physical_batch_size=8, lr=0.05,
        epsilon=1.0, head_first=False, neighbouring="replace-one", output=str(tmp_path / "run"),
    )  # fmt: skip
    m = train(config).metrics
    sigma, q, steps = m["noise_multiplier"], m["sample_rate"], m["steps"]
    assert m["neighbouring"] == "replace-one"
    want = direct_epsilon(sigma, q, steps, m["delta"], REPLACE)
    assert m["epsilon"] == m["epsilon_replace_one"] == pytest.approx(want)
    assert 0.95 < m["epsilon"] <= 1.0
    assert m["epsilon_add_remove"] == pytest.approx(
        direct_epsilon(sigma, q, steps, m["delta"], ADD_REMOVE, "rdp")
    )
    rows = dict(summary_rows({**m, "eval_n": m.get("eval_n"), "pooling": "mean"}))
    assert rows["epsilon (replace-one neighbours)"] == m["epsilon_replace_one"]
    assert rows["epsilon (add-remove neighbours)"] == m["epsilon_add_remove"]
    assert rows["neighbouring relation"] == "replace-one (--neighbouring; default add-remove)"
    record = json.loads((tmp_path / "run" / "model" / "dpfit.json").read_text())
    assert record["epsilon_replace_one"] == m["epsilon_replace_one"]
    assert record["epsilon_add_remove"] == m["epsilon_add_remove"]
    # `dpfit evaluate` of the saved model states both, each with its relation
    capsys.readouterr()
    assert main(["evaluate", "--model", str(tmp_path / "run" / "model"), "--data", data]) == 0
    table = capsys.readouterr().out
    assert "epsilon (replace-one neighbours)" in table
    assert "epsilon (add-remove neighbours)" in table


def test_help_states_the_default_relation(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--neighbouring {add-remove,replace-one}" in text
    assert "default: add-remove" in text
    assert build_parser().parse_args(["train"]).neighbouring == "add-remove"
    args = build_parser().parse_args(["train", "--neighbouring", "replace-one"])
    assert train_config_from_args(args).neighbouring == "replace-one"
    with pytest.raises(ValueError, match="neighbouring must be one of"):
        TrainConfig(neighbouring="swap-two")


def test_accountant_command_shows_both(capsys):
    args = ["accountant", "--noise-multiplier", "2.0", "--sample-rate", "0.1", "--steps", "30"]
    assert main([*args, "--neighbouring", "replace-one", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (
        out["epsilon"]
        == out["epsilon_replace_one"]
        == pytest.approx(direct_epsilon(2.0, 0.1, 30, 1e-5, REPLACE))
    )
    assert out["epsilon_add_remove"] == pytest.approx(
        direct_epsilon(2.0, 0.1, 30, 1e-5, ADD_REMOVE, "rdp")
    )


def test_dp_trainer_takes_the_relation(tiny, tmp_path):
    transformers = pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    from dpfit.integrations import DPTrainer, PrivacyArguments
    from dpfit.models import load_classifier

    torch.set_num_threads(1)
    loaded = load_classifier(tiny[0], ["neg", "pos"], seed=0)
    ds = datasets.Dataset.from_dict(
        {"text": ["a good film", "a bad film"] * 24, "label": [1, 0] * 24}
    )
    ds = ds.map(lambda b: loaded.tokenizer(b["text"]), batched=True)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=1,
        report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    privacy = PrivacyArguments(target_epsilon=1.0, target_delta=1e-4, neighbouring="replace-one")
    trainer = DPTrainer(
        model=loaded.model, args=args, train_dataset=ds, privacy=privacy,
        data_collator=transformers.DataCollatorWithPadding(loaded.tokenizer),
    )  # fmt: skip
    trainer.train()
    engine = trainer.privacy_engine
    record = engine.privacy_record()
    assert record["neighbouring"] == "replace-one" and engine.steps_taken == 1
    want = direct_epsilon(engine.noise_multiplier, engine.sample_rate, 1, 1e-4, REPLACE)
    assert record["epsilon"] == record["epsilon_replace_one"] == pytest.approx(want)
    assert 0.95 < record["epsilon"] <= 1.0


def test_a_failing_companion_epsilon_does_not_lose_the_record(monkeypatch, caplog):
    """The relation a run is not calibrated to is reported, not enforced: if its accountant
    fails (PLD at a tiny sigma) the record holds NaN and a warning, and the run's own
    epsilon is unaffected."""
    from dpfit import accounting

    engine = small_engine(noise_multiplier=2.0)
    for _ in range(3):
        engine.ledger.record(2.0, engine.sample_rate)

    def failing(step, neighbouring, discretization):  # PLD's one-step build, what fails
        raise MemoryError("Unable to allocate 38.0 GiB")

    monkeypatch.setattr(accounting, "_one_step_pld", failing)
    record = engine.privacy_record()
    assert math.isnan(record["epsilon_replace_one"])
    assert (
        record["epsilon"]
        == record["epsilon_add_remove"]
        == pytest.approx(direct_epsilon(2.0, engine.sample_rate, 3, 1e-5, ADD_REMOVE, "rdp"))
    )
    assert "replace-one neighbours not computed" in caplog.text
