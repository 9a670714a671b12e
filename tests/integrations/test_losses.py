"""Per-example losses for transformers heads: each example's loss is its own, and it is the
loss the model computes wherever the model's own loss already splits per example."""

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertForTokenClassification,
    GPT2Config,
    GPT2LMHeadModel,
)

from dpfit.errors import LossReductionError  # noqa: E402
from dpfit.integrations.losses import (  # noqa: E402
    IGNORE_INDEX,
    LossInputs,
    per_example_loss_for,
    register_per_example_loss,
)


def tiny_bert(cls, **kw):
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, **kw)  # fmt: skip
    return cls(cfg).eval()


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=30, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(cfg).eval()


def per_example(model, labels, **inputs):
    task, fn = per_example_loss_for(model)
    out = model(**inputs)
    return task, fn(LossInputs(out.logits, labels, model.config))


def test_causal_lm_equals_model_loss_for_equal_lengths_and_ignores_neighbours():
    model = tiny_gpt2()
    ids = torch.randint(0, 30, (3, 7))
    task, rows = per_example(model, ids, input_ids=ids)
    assert task == "causal-lm"
    assert rows.shape == (3,)
    assert rows.mean().item() == pytest.approx(
        model(input_ids=ids, labels=ids).loss.item(), rel=1e-5
    )
    # example 0 next to a short and next to a long (padded) neighbour: the same loss
    x = ids[0, :5]
    for n in (2, 12):
        other = torch.randint(0, 30, (n,))
        width = max(5, n)
        batch = torch.zeros(2, width, dtype=torch.long)
        mask = torch.zeros(2, width, dtype=torch.long)
        labels = torch.full((2, width), IGNORE_INDEX)
        for i, seq in enumerate((x, other)):
            batch[i, : len(seq)], mask[i, : len(seq)], labels[i, : len(seq)] = seq, 1, seq
        _, rows = per_example(model, labels, input_ids=batch, attention_mask=mask)
        alone = per_example(model, x[None], input_ids=x[None])[1]
        assert rows[0].item() == pytest.approx(alone.item(), rel=1e-5)


def test_token_classification_is_each_examples_mean_over_its_labelled_tokens():
    model = tiny_bert(BertForTokenClassification, num_labels=3)
    ids = torch.randint(5, 30, (2, 6))
    labels = torch.randint(0, 3, (2, 6))
    task, rows = per_example(model, labels, input_ids=ids)
    assert task == "token-classification"
    assert rows.mean().item() == pytest.approx(
        model(input_ids=ids, labels=labels).loss.item(), rel=1e-5
    )
    labels[1, 2:] = IGNORE_INDEX  # fewer labelled tokens in example 1: its mean, not the batch's
    _, rows = per_example(model, labels, input_ids=ids)
    logits = model(input_ids=ids).logits
    own = torch.nn.functional.cross_entropy(logits[1, :2], labels[1, :2])
    assert rows[1].item() == pytest.approx(own.item(), rel=1e-5)


@pytest.mark.parametrize(
    "num_labels,problem,make_labels",
    [
        (3, None, lambda: torch.tensor([0, 2, 1])),
        (1, None, lambda: torch.tensor([0.5, -1.0, 2.0])),
        (3, "multi_label_classification", lambda: torch.tensor([[1, 0, 1], [0, 0, 1], [1, 1, 0]]).float()),
    ],
)  # fmt: skip
def test_sequence_classification_equals_model_loss(num_labels, problem, make_labels):
    model = tiny_bert(BertForSequenceClassification, num_labels=num_labels, problem_type=problem)
    ids = torch.randint(5, 30, (3, 5))
    labels = make_labels()
    task, rows = per_example(model, labels, input_ids=ids)
    assert task == "sequence-classification" and rows.shape == (3,)
    expected = model(input_ids=ids, labels=labels).loss.item()
    assert rows.mean().item() == pytest.approx(expected, rel=1e-5)


def test_a_model_without_a_known_decomposition_is_refused():
    with pytest.raises(LossReductionError, match="BertForMaskedLM.*register_per_example_loss"):
        per_example_loss_for(tiny_bert(BertForMaskedLM))


def test_a_registered_loss_applies_to_the_class_and_its_subclasses():
    class MyMLM(BertForMaskedLM):
        pass

    def fn(x):
        return x.logits.float().pow(2).mean((1, 2))

    register_per_example_loss("BertForMaskedLM", fn)
    try:
        assert per_example_loss_for(tiny_bert(MyMLM)) == ("BertForMaskedLM", fn)
    finally:
        from dpfit.integrations import losses

        losses._USER_CLASSES.pop("BertForMaskedLM")
