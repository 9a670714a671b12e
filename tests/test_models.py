"""Model loading: local folders, decoders without a pad token, and offline hub errors."""

import pytest
import torch

from dpfit.models import (
    ModelLoadError,
    count_bias_parameters,
    head_module_names,
    load_classifier,
    save_tiny_random_model,
)


@pytest.mark.parametrize(
    "arch,head", [("bert", "classifier"), ("gpt2", "score"), ("llama", "score")]
)
def test_local_folder_gets_a_head_for_the_labels(tmp_path, arch, head):
    folder = save_tiny_random_model(tmp_path / arch, arch=arch)
    loaded = load_classifier(folder, ["neg", "neutral", "pos"], seed=0)
    m = loaded.model
    assert loaded.head_names[-1] == head and head_module_names(m) == loaded.head_names
    assert m.config.num_labels == 3 and m.config.id2label[2] == "pos"
    assert loaded.tokenizer.pad_token is not None
    assert m.config.pad_token_id == loaded.tokenizer.pad_token_id
    enc = loaded.tokenizer(["the film was good", "bad"], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert m(**enc).logits.shape == (2, 3)


def test_new_head_init_is_seeded(tmp_path):
    folder = save_tiny_random_model(tmp_path / "m")  # saved with a 2-label head
    labels = ["a", "b", "c"]  # a different size: the head is new
    a = load_classifier(folder, labels, seed=1).model.classifier.weight
    b = load_classifier(folder, labels, seed=1).model.classifier.weight
    c = load_classifier(folder, labels, seed=2).model.classifier.weight
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_saved_head_kept_when_no_labels_given(tmp_path):
    folder = save_tiny_random_model(tmp_path / "m")
    first = load_classifier(folder, ["x", "y"], seed=3)
    first.model.save_pretrained(tmp_path / "saved")
    first.tokenizer.save_pretrained(tmp_path / "saved")
    again = load_classifier(tmp_path / "saved")
    assert again.model.config.id2label == {0: "x", 1: "y"}
    assert torch.equal(again.model.classifier.weight, first.model.classifier.weight)


def test_bias_counts(tmp_path):
    bert = load_classifier(save_tiny_random_model(tmp_path / "b"), ["a", "b"]).model
    llama = load_classifier(save_tiny_random_model(tmp_path / "l", arch="llama"), ["a", "b"]).model
    assert count_bias_parameters(bert, exclude=("classifier",)) > 0
    assert count_bias_parameters(llama, exclude=("score",)) == 0


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
    with pytest.raises(ModelLoadError, match="pass a local folder"):
        load_classifier("dpfit-test-org/no-such-model", ["a", "b"])


def test_bundled_default_loads_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        loaded = load_classifier(None, ["rotten", "fresh"], seed=0)
    except FileNotFoundError:
        pytest.skip("bundled MiniLM not installed")
    assert type(loaded.model).__name__ == "BertForSequenceClassification"
    assert loaded.head_names == ("classifier",)
    assert count_bias_parameters(loaded.model, exclude=("classifier",)) == 26_112
