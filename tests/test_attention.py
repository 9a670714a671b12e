"""dpfit.attention: the models `dpfit train` loads run eager attention where it was measured
faster (CPU, short inputs), compute the same function there, and keep SDPA elsewhere."""

from __future__ import annotations

import pytest
import torch

from dpfit.attention import EAGER_MAX_LENGTH, choose_attention

transformers = pytest.importorskip("transformers")


def _bert(kernel: str = "sdpa"):
    cfg = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, attn_implementation=kernel,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertModel(cfg).double().eval()


def test_short_inputs_on_cpu_switch_to_eager_and_compute_the_same_function():
    model = _bert()
    ids = torch.randint(0, 50, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 5:] = 0  # a padded example: the mask must be applied the same way
    before = model(input_ids=ids, attention_mask=mask).last_hidden_state
    wrapper = torch.nn.Sequential(model)  # as PooledClassifier holds the backbone
    assert choose_attention(wrapper, torch.device("cpu"), EAGER_MAX_LENGTH, "bf16")
    assert model.config._attn_implementation == "eager"
    after = model(input_ids=ids, attention_mask=mask).last_hidden_state
    keep = mask.bool()
    torch.testing.assert_close(after[keep], before[keep], rtol=1e-10, atol=1e-12)
    assert not choose_attention(wrapper, torch.device("cpu"), 16, "bf16")  # already eager


@pytest.mark.parametrize(
    "device, length, precision",
    [("cpu", EAGER_MAX_LENGTH + 1, "bf16"), ("cuda", 16, "bf16"), ("cpu", None, "bf16"),
     ("cpu", 16, "fp32")],
    ids=["long inputs", "gpu", "no length", "float32"],
)  # fmt: skip
def test_sdpa_stays_where_it_was_not_slower(device, length, precision):
    model = _bert()
    assert not choose_attention(model, torch.device(device), length, precision)
    assert model.config._attn_implementation == "sdpa"


def test_models_without_transformers_attention_are_left_alone():
    assert not choose_attention(torch.nn.Linear(3, 2), torch.device("cpu"), 16, "bf16")


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_dpfit_train_notes_the_kernel_it_chose(tiny, precision):
    from dpfit.train import TrainConfig, train

    model, data = tiny
    notes: list[str] = []
    cfg = TrainConfig(model=model, data=data, non_private=True, epochs=1, batch_size=50,
                      max_length=32, seed=0, head_first=False, precision=precision)  # fmt: skip
    train(cfg, on_note=notes.append)
    eager = any(n.startswith("attention: eager") for n in notes)
    assert eager == (precision == "bf16"), notes
