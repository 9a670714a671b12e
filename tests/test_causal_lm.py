"""Causal LM with DP-BiTFiT-Add: per-example loss, a tiny end-to-end run, a SmolLM2 smoke run."""

from __future__ import annotations

import math

import pytest
import torch

from dpfit.causal_lm import TokenizedLines, causal_lm_loss, make_collate
from dpfit.recipe import default_delta, resolve_recipe
from dpfit.tasks.causal_lm import CausalLMTask
from dpfit.train import TrainConfig, train_causal_lm

torch.set_num_threads(1)


class CharTokenizer:
    """Enough of a tokenizer for the training loop: bytes as ids, 0 = pad, 1 = eos."""

    pad_token_id = 0
    eos_token_id = 1

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        ids = [2 + (b % 60) for b in text.encode()]
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + int(i)) for i in ids if int(i) > 1)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, eos_token_id=1, pad_token_id=0, bos_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


LINES = [f"line {i}: to be or not to be, that is {i % 7}" for i in range(80)]


def test_loss_is_mean_of_per_example_token_means():
    model = tiny_llama().eval()
    data = TokenizedLines(
        ["short", "a much longer line of text", "mid length"], CharTokenizer(), 32
    )
    collate = make_collate(0)
    batch = collate([data[i] for i in range(3)])
    alone = [causal_lm_loss(model, collate([data[i]])) for i in range(3)]
    assert torch.allclose(causal_lm_loss(model, batch), torch.stack(alone).mean(), rtol=1e-5)


def test_tiny_llama_end_to_end():
    """Through the one training loop: private steps, the composed epsilon, biases only."""
    model = tiny_llama()
    task = CausalLMTask(
        lines_per_example=1, eval_examples=8, sample_prompts=("line",), sample_tokens=4
    )
    cfg = TrainConfig(
        task="causal-lm", max_train_examples=32, max_length=24, batch_size=8,
        physical_batch_size=4, epochs=1, epsilon=4.0,
    )  # fmt: skip
    res = train_causal_lm(model, CharTokenizer(), LINES, cfg, task)
    m = res.metrics
    assert m["steps"] == round(32 / 8)
    assert 0 < m["epsilon"] <= 4.0 * 1.001
    assert m["delta"] == default_delta(32)
    assert math.isfinite(m["perplexity_before"]) and math.isfinite(m["perplexity_after"])
    assert m["trainable_params"] < m["total_params"] and len(m["samples"]) == 1
    assert m["final_train_loss"] is None and all(r.loss is None for r in res.steps)
    # the language-model rate (dpfit.recipe): the noise walk, not the fresh backbone's 5e-3
    assert m["lr"] == m["recipe"]["lr"] == resolve_recipe(32, 0, 4.0, None, 1).lr < 1e-3
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(n.endswith("bias") for n in trained)


@pytest.mark.parametrize("rule", [True, False])
def test_private_bias_lora_on_a_causal_lm_follows_the_language_model_rule(monkeypatch, rule):
    """A causal LM's lora_A default is PRIVATE_LM_LORA_FREEZE_A (measured on its own,
    benchmarks/results/causal_lm_ffa.md), not the classification suite's constant."""
    import dpfit.recipe as R

    monkeypatch.setattr(R, "PRIVATE_LM_LORA_FREEZE_A", rule)
    monkeypatch.setattr(R, "PRIVATE_LORA_FREEZE_A", not rule)
    model = tiny_llama()
    task = CausalLMTask(lines_per_example=1, eval_examples=4, sample_prompts=(), sample_tokens=1)
    cfg = TrainConfig(task="causal-lm", max_train_examples=16, max_length=16, batch_size=8,
                      physical_batch_size=8, epochs=1, max_steps=1, mode="bias+lora",
                      lora_r=2, epsilon=8.0)  # fmt: skip
    m = train_causal_lm(model, CharTokenizer(), LINES, cfg, task).metrics
    assert m["config"]["lora_freeze_a"] is rule and m["recipe"]["lora_freeze_a"] is rule


def test_causal_lm_delta_follows_the_one_rule(tmp_path):
    """min(1e-5, 1/n^1.1) for every task (was 1/n^1.1 = 0.001 for the Hamlet run)."""
    model = tiny_llama()
    task = CausalLMTask(lines_per_example=1, eval_examples=4, sample_prompts=(), sample_tokens=1)
    cfg = TrainConfig(task="causal-lm", max_train_examples=40, max_length=16, batch_size=8,
                      physical_batch_size=8, epochs=1, max_steps=1)  # fmt: skip
    res = train_causal_lm(model, CharTokenizer(), LINES, cfg, task)
    assert res.metrics["delta"] == pytest.approx(min(1e-5, 40**-1.1)) == 1e-5


@pytest.mark.slow
def test_smollm2_smoke():
    """The bundled SmolLM2-135M: add biases (same outputs), a few DP steps on Hamlet."""
    pytest.importorskip("gguf")
    from dpfit.data.bundled import hamlet_lines
    from dpfit.data.smollm import load_smollm2

    loaded = load_smollm2()  # ~40 s the first time on this machine, ~1 s from the cache
    model, tok = loaded.model, loaded.tokenizer
    task = CausalLMTask(eval_examples=4, sample_prompts=("My lord,",), sample_tokens=4)
    cfg = TrainConfig(task="causal-lm", max_train_examples=8, max_length=24, batch_size=4,
                      physical_batch_size=4, epochs=1, epsilon=8.0)  # fmt: skip
    ids = tok("To be, or not to be", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        before = model(input_ids=ids).logits
    res = train_causal_lm(model, tok, hamlet_lines(), cfg, task)
    m = res.metrics
    assert m["steps"] == 2
    assert m["perplexity_before"] < 2000  # a trained LM (uniform over 49,152 tokens: 49,152)
    assert m["trainable_fraction"] < 2e-3
    assert math.isfinite(m["perplexity_after"])
    model.eval()
    for p in model.parameters():  # zero the learned biases: the original function returns
        if p.requires_grad:
            p.data.zero_()
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, before, atol=1e-4, rtol=1e-4)


def test_cli_task_causal_lm_writes_metrics(tmp_path, capsys):
    import json

    from dpfit.cli import main
    from dpfit.models import save_tiny_random_model

    folder = save_tiny_random_model(tmp_path / "llama", arch="llama")
    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(f"the good movie number {i} was great" for i in range(80)))
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            "--task",
            "causal-lm",
            "--model",
            str(folder),
            "--data",
            str(lines),
            "--epochs",
            "1",
            "--max-train-examples",
            "32",
            "--batch-size",
            "8",
            "--physical-batch-size",
            "4",
            "--max-length",
            "16",
            "--epsilon",
            "8",
            "--output",
            str(out),
        ]
    )
    assert rc == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["task"] == "causal-lm"
    assert 0 < m["epsilon"] <= 8.0
    assert m["steps"] >= 1
    assert math.isfinite(m["perplexity_after"])
    assert (out / "model" / "config.json").exists()
    assert "perplexity" in capsys.readouterr().out
    # every task's result table carries the mechanism, and the warning when the noise was seeded
    from dpfit.cli import summary_rows

    rows = dict(summary_rows(m))
    assert rows["epsilon (add-remove neighbours)"] == m["epsilon"]
    assert rows["epsilon (replace-one neighbours)"] == m["epsilon_replace_one"] > m["epsilon"]
    assert "sigma (noise multiplier)" in rows
    assert "NOT PRIVATE against" not in rows
    assert "NOT PRIVATE against" in dict(summary_rows({**m, "insecure_seed": True}))
