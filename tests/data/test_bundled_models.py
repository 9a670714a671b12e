"""Bundled model names (`--model minilm|smollm2`) and the SmolLM2 cache's tied embedding."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from dpfit.data import bundled
from dpfit.data.smollm import EMBEDDING, TIED_HEAD, _save_weights, smollm2_folder
from dpfit.models import _resolve, load_classifier, save_tiny_random_model


def test_unknown_name_is_not_a_bundled_model():
    assert bundled.bundled_model("no-such-model") is None


def test_bundled_name_resolves_wherever_a_model_is_loaded(tmp_path, monkeypatch):
    tiny = save_tiny_random_model(tmp_path / "tiny", arch="llama")
    monkeypatch.setitem(bundled.BUNDLED_MODELS, "smollm2", lambda: tiny)  # no dequantising
    assert _resolve("smollm2") == (str(tiny), {}, True)
    assert _resolve("SmolLM2")[0] == str(tiny)
    loaded = load_classifier("smollm2", ("a", "b"), seed=0)
    assert loaded.source == str(tiny) and loaded.pooling == "last"


def test_an_existing_path_wins_over_a_bundled_name(tmp_path, monkeypatch):
    own = save_tiny_random_model(tmp_path / "minilm", arch="bert")
    monkeypatch.chdir(tmp_path)
    assert _resolve("minilm")[0] == "minilm" and own.is_dir()


def _tied_lm(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def _backbone_embedding(folder) -> torch.Tensor:
    from transformers import AutoModel

    return AutoModel.from_pretrained(folder).embed_tokens.weight


def test_cache_stores_the_tied_tensor_under_the_embedding_name(tmp_path):
    from transformers import AutoModelForCausalLM

    lm = _tied_lm()
    lm.config.save_pretrained(tmp_path)
    _save_weights(lm, tmp_path / "model.safetensors")
    torch.testing.assert_close(_backbone_embedding(tmp_path), lm.model.embed_tokens.weight)
    ids = torch.tensor([[1, 5, 7, 2]])
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(again(input_ids=ids).logits, lm(input_ids=ids).logits)


def test_a_cache_with_the_tied_tensor_only_under_lm_head_is_repaired(tmp_path):
    lm = _tied_lm(seed=1)
    lm.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in lm.state_dict().items() if k != EMBEDDING}
    assert TIED_HEAD in state
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    before = _backbone_embedding(tmp_path)  # the old layout: a random embedding
    assert not torch.allclose(before, lm.model.embed_tokens.weight)
    assert smollm2_folder(tmp_path) == tmp_path
    torch.testing.assert_close(_backbone_embedding(tmp_path), lm.model.embed_tokens.weight)
