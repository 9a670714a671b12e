"""Model loading: local folders, decoders without a pad token, and offline hub errors."""

import json

import pytest
import torch

from dpfit.models import (
    ModelLoadError,
    count_bias_parameters,
    load_classifier,
    save_tiny_random_model,
)
from dpfit.tasks.pooling import PoolingError, pool


@pytest.mark.parametrize("arch", ["bert", "gpt2", "llama"])
def test_local_folder_gets_a_head_for_the_labels(tmp_path, arch):
    folder = save_tiny_random_model(tmp_path / arch, arch=arch)
    loaded = load_classifier(folder, ["neg", "neutral", "pos"], seed=0)
    m = loaded.model
    assert loaded.head_names == ("head",)
    assert m.config.num_labels == 3 and m.config.id2label[2] == "pos"
    assert loaded.tokenizer.pad_token is not None
    assert m.config.pad_token_id == loaded.tokenizer.pad_token_id
    enc = loaded.tokenizer(["the film was good", "bad"], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert m(**enc).logits.shape == (2, 3)


def test_new_head_is_zero_initialised(tmp_path):
    folder = save_tiny_random_model(tmp_path / "m")
    head = load_classifier(folder, ["a", "b", "c"], seed=1).model.head
    assert head.weight.shape == (3, 16)
    assert not head.weight.any() and not head.bias.any()


def test_native_classifier_folder_is_evaluated_with_its_own_head(tmp_path):
    folder = save_tiny_random_model(tmp_path / "m")  # a BertForSequenceClassification folder
    loaded = load_classifier(folder)
    assert type(loaded.model).__name__ == "BertForSequenceClassification"
    assert loaded.pooling == "native"


def test_bias_counts(tmp_path):
    bert = load_classifier(save_tiny_random_model(tmp_path / "b"), ["a", "b"]).model
    llama = load_classifier(save_tiny_random_model(tmp_path / "l", arch="llama"), ["a", "b"]).model
    assert count_bias_parameters(bert, exclude=("head",)) > 0
    assert count_bias_parameters(llama, exclude=("head",)) == 0


# -- pooling ---------------------------------------------------------------------------------


def _as_sentence_transformers(folder, mode="pooling_mode_mean_tokens"):
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )  # fmt: skip
    (folder / "1_Pooling").mkdir()
    flags = {k: False for k in ("pooling_mode_mean_tokens", "pooling_mode_cls_token")}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({**flags, mode: True}))
    return folder


def test_auto_pooling_per_backbone(tmp_path):
    bert = save_tiny_random_model(tmp_path / "bert")  # trained pooler in the checkpoint
    assert load_classifier(bert, ["a", "b"]).pooling == "pooler"
    st = _as_sentence_transformers(save_tiny_random_model(tmp_path / "st"))
    loaded = load_classifier(st, ["a", "b"])
    assert loaded.pooling == "mean" and "sentence-transformers" in loaded.pooling_reason
    assert loaded.model.backbone.pooler is None  # unused: not a trainable without gradient
    cls = _as_sentence_transformers(
        save_tiny_random_model(tmp_path / "cls"), "pooling_mode_cls_token"
    )
    assert load_classifier(cls, ["a", "b"]).pooling == "cls"
    for arch in ("gpt2", "llama"):
        dec = save_tiny_random_model(tmp_path / arch, arch=arch)
        assert load_classifier(dec, ["a", "b"]).pooling == "last"
    assert load_classifier(st, ["a", "b"], pooling="cls").pooling == "cls"  # the flag wins
    with pytest.raises(PoolingError, match="no trained pooler"):
        load_classifier(
            save_tiny_random_model(tmp_path / "g2", arch="gpt2"), ["a", "b"], pooling="pooler"
        )


def test_bundled_minilm_pools_by_mean(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        loaded = load_classifier(None, ["rotten", "fresh"], seed=0)
    except FileNotFoundError:
        pytest.skip("bundled MiniLM not installed")
    assert loaded.pooling == "mean" and loaded.head_names == ("head",)
    assert count_bias_parameters(loaded.model, exclude=("head",)) > 0


@pytest.mark.parametrize("side", ["right", "left"])
def test_last_pooling_reads_the_last_real_token(side):
    hidden = torch.arange(2 * 5 * 3, dtype=torch.float).view(2, 5, 3)
    lengths = [2, 5]
    mask = torch.zeros(2, 5, dtype=torch.long)
    for i, k in enumerate(lengths):
        if side == "right":
            mask[i, :k] = 1
        else:
            mask[i, 5 - k :] = 1
    out = pool(hidden, mask, "last")
    last = [k - 1 for k in lengths] if side == "right" else [4, 4]
    assert torch.equal(out, torch.stack([hidden[i, j] for i, j in enumerate(last)]))


@pytest.mark.parametrize("side", ["right", "left"])
def test_decoder_logits_ignore_padding(tmp_path, side):
    """A decoder classifies a text the same alone and in a padded batch (last real token).
    Position ids follow the mask, as a left-padded decoder needs."""
    loaded = load_classifier(save_tiny_random_model(tmp_path / "g", arch="gpt2"), ["a", "b"])
    model, tok = loaded.model.eval(), loaded.tokenizer
    torch.nn.init.normal_(loaded.model.head.weight)
    tok.padding_side = side
    texts = ["the film was good", "bad"]
    batch = tok(texts, padding=True, return_tensors="pt")
    pos = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        together = model(**batch, position_ids=pos).logits
        alone = torch.cat([model(**tok([t], return_tensors="pt")).logits for t in texts])
    assert torch.allclose(together, alone, atol=1e-5)


def test_sentence_pooling_mean_ignores_padding():
    hidden = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    out = pool(hidden, mask, "mean")
    assert torch.allclose(out[0], hidden[0, :2].mean(0)) and torch.allclose(
        out[1], hidden[1].mean(0)
    )


def test_missing_local_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not a folder"):
        load_classifier(tmp_path / "no" / "such" / "model", ["a", "b"])
    with pytest.raises(ModelLoadError, match="not a folder"):
        load_classifier("./relative-missing", ["a", "b"])


def test_folder_without_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="could not load"):
        load_classifier(tmp_path / "empty", ["a", "b"])


def test_hub_id_offline_says_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="hub is off.*pass --model minilm.*or a folder"):
        load_classifier("dpfit-test-org/no-such-model", ["a", "b"])
