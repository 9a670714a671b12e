"""Dropout rates set in a transformers config before the model is built (dpfit.dropout)."""

import json

import pytest
import torch
from transformers import BertConfig, GPT2Config, LlamaConfig

from dpfit.dropout import (
    MODEL,
    check_rate,
    config_rates,
    describe,
    modules_off_rate,
    set_config_rates,
)
from dpfit.models import load_classifier, save_tiny_random_model


@pytest.mark.parametrize(
    "config,names",
    [
        (BertConfig(), {"hidden_dropout_prob", "attention_probs_dropout_prob"}),
        (GPT2Config(), {"resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout"}),
        (LlamaConfig(), {"attention_dropout"}),
    ],
    ids=["bert", "gpt2", "llama"],
)
def test_every_rate_of_a_config_is_found_and_set(config, names):
    assert set(config_rates(config)) == names
    assert set(set_config_rates(config, 0.0)) == names
    assert all(getattr(config, k) == 0.0 for k in names)
    # "use the hidden rate" (None) is not a rate: it follows the rates that were set
    if isinstance(config, BertConfig):
        assert config.classifier_dropout is None


def test_flags_that_are_not_rates_are_left_alone():
    cfg = BertConfig()
    cfg.use_dropout = True  # a bool named like a rate
    cfg.dropout_note = "text"
    set_config_rates(cfg, 0.0)
    assert cfg.use_dropout is True and cfg.dropout_note == "text"


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, "off"])
def test_rates_outside_0_1_are_refused(bad):
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        check_rate(bad)


def test_none_and_model_and_rates_pass():
    for ok in (None, MODEL, 0.0, 0.5):
        check_rate(ok)


def test_the_note_names_what_was_set_and_what_was_not():
    assert describe(MODEL, (), []) == "dropout: the model's own rates"
    assert describe(0.0, ("a_dropout",), []) == "dropout: off (a_dropout)"
    note = describe(0.2, (), ["m1", "m2"])
    assert "0.2" in note and "no dropout rate in the model's config" in note
    assert "2 dropout modules keep their own rate" in note and "m1, m2" in note


def _train_mode_logits_twice(model, tokenizer):
    batch = tokenizer(["the good movie was great", "bad film"], padding=True, return_tensors="pt")
    model.train()
    with torch.no_grad():
        return model(**batch).logits, model(**batch).logits


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    return save_tiny_random_model(tmp_path_factory.mktemp("bert") / "m")


def test_a_classifier_built_with_dropout_off_is_deterministic_in_train_mode(bert_folder):
    """No dropout anywhere, the attention's functional call included: two forwards in train
    mode agree exactly. With the model's own rates they do not (the test can fail)."""
    off = load_classifier(bert_folder, ["neg", "pos"], seed=0, dropout=0.0)
    assert modules_off_rate(off.model, 0.0) == []
    assert off.dropout_note.startswith("dropout: off (")
    torch.nn.init.normal_(off.model.head.weight)  # a zero head would hide any difference
    a, b = _train_mode_logits_twice(off.model, off.tokenizer)
    assert torch.equal(a, b)

    own = load_classifier(bert_folder, ["neg", "pos"], seed=0)
    assert own.dropout_note == "dropout: the model's own rates"
    assert modules_off_rate(own.model, 0.0)  # BERT's 0.1 everywhere
    torch.nn.init.normal_(own.model.head.weight)
    a, b = _train_mode_logits_twice(own.model, own.tokenizer)
    assert not torch.equal(a, b)


def test_a_rate_reaches_every_dropout_module(bert_folder):
    loaded = load_classifier(bert_folder, ["neg", "pos"], seed=0, dropout=0.25)
    rates = {m.p for m in loaded.model.modules() if isinstance(m, torch.nn.Dropout)}
    assert rates == {0.25}
    # the saved folder is not touched: a fresh load has the model's own rate again
    assert json.loads((bert_folder / "config.json").read_text())["hidden_dropout_prob"] == 0.1


def test_causal_lm_from_a_folder_is_built_with_the_rate(tmp_path):
    from dpfit.tasks.causal_lm import CausalLMTask
    from dpfit.train import TrainConfig

    folder = save_tiny_random_model(tmp_path / "llama", arch="llama")
    cfg_path = folder / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "attention_dropout": 0.3}))
    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(f"the good movie number {i}" for i in range(80)))
    config = TrainConfig(model=str(folder), data=str(lines), task="causal-lm", dropout=0.0)
    prep = CausalLMTask().prepare(config)
    assert prep.model.config.attention_dropout == 0.0
    assert "dropout: off (attention_dropout)" in prep.notes
    own = CausalLMTask().prepare(TrainConfig(**{**config.__dict__, "dropout": MODEL}))
    assert own.model.config.attention_dropout == 0.3
    assert not any(n.startswith("dropout") for n in own.notes)


def test_the_engine_docs_recipe_builds_a_model_without_dropout(bert_folder):
    """docs/engine.md's snippet, run as written on the tiny BERT."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "engine.md").read_text()
    section = doc.split("**Dropout.**", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    scope = {"name": str(bert_folder)}
    exec(code, scope)
    model = scope["model"]
    assert modules_off_rate(model, 0.0) == [] and any(
        isinstance(m, torch.nn.Dropout) for m in model.modules()
    )
