"""The training loop as a library function: private, non-private, and every bad input."""

import json
import math

import pytest
import torch

import dpfit
from dpfit.errors import BatchNormError, InfeasibleTargetError, NoTrainableParametersError
from dpfit.models import save_tiny_random_model, write_tiny_sentiment_csv
from dpfit.train import PhysicalBatchMemoryError, TrainConfig, train


def cfg(tiny, **kw):
    model, data = tiny
    base = dict(model=model, data=data, epochs=2, batch_size=30, physical_batch_size=8, lr=0.05)
    return TrainConfig(**{**base, **kw})


def test_private_run_spends_the_target_and_reports(tiny):
    res = train(cfg(tiny, epsilon=3.0))
    m = res.metrics
    n = m["train_examples"]  # about 10% of 200 held out, each row by its own hash
    assert n + m["eval_n"] == 200 and 10 <= m["eval_n"] <= 30
    assert m["steps"] == 2 * round(n / 30) == len(res.steps)
    assert 2.9 < m["epsilon"] <= 3.0 + 1e-6
    assert m["delta"] == pytest.approx(1e-5)
    assert m["noise_multiplier"] > 0 and m["max_grad_norm"] == 1.0
    assert 0 < m["trainable_fraction"] < 0.2
    assert [r.step for r in res.steps] == list(range(1, m["steps"] + 1))
    eps = [r.epsilon for r in res.steps]
    assert eps == sorted(eps) and eps[-1] == pytest.approx(m["epsilon"])
    # only biases and the new head moved
    assert res.privacy["trained_parameters"]
    assert all(
        n.endswith("bias") or n.startswith("head.") for n in res.privacy["trained_parameters"]
    )


def _bias(res, name="backbone.encoder.layer.0.output.dense.bias"):
    return dict(res.model.named_parameters())[name].detach().clone()


def test_seed_does_not_fix_the_noise_by_default(tiny):
    """--seed is public: two private runs with the same seed must draw different noise and
    batches (a leaked seed must not regenerate them). Fails if train() seeds the engine."""
    a = train(cfg(tiny, max_steps=3, seed=1))
    b = train(cfg(tiny, max_steps=3, seed=1))
    assert a.metrics["noise_multiplier"] > 0
    assert not torch.equal(_bias(a), _bias(b))
    assert a.metrics["insecure_seed"] is False and a.privacy["insecure_seed"] is False


def test_insecure_reproducible_noise_repeats_and_is_recorded(tiny):
    notes: list[str] = []
    a = train(
        cfg(tiny, max_steps=3, seed=1, insecure_reproducible_noise=True), on_note=notes.append
    )
    b = train(cfg(tiny, max_steps=3, seed=1, insecure_reproducible_noise=True))
    c = train(cfg(tiny, max_steps=3, seed=2, insecure_reproducible_noise=True))
    assert torch.equal(_bias(a), _bias(b))
    assert not torch.equal(_bias(a), _bias(c))
    assert a.metrics["insecure_seed"] is True and a.privacy["insecure_seed"] is True
    assert any("NOT private" in n for n in notes)


def test_non_private_runs_repeat_with_the_seed(tiny):
    a = train(cfg(tiny, max_steps=3, seed=1, non_private=True))
    b = train(cfg(tiny, max_steps=3, seed=1, non_private=True))
    assert torch.equal(_bias(a), _bias(b))


def test_private_steps_keep_no_training_loss_or_batch_size(tiny):
    res = train(cfg(tiny, max_steps=3))
    assert res.steps and all(r.loss is None for r in res.steps)
    assert res.metrics["final_train_loss"] is None
    assert not hasattr(res.steps[0], "batch_size")


def _labelled_csv(path, counts: dict[str, int]):
    import csv

    rows = []
    words = ("good", "bad", "fine", "dull")
    for k, (label, c) in enumerate(counts.items()):
        rows += [(f"the film was {words[k % 4]} {i % 7}", label) for i in range(c)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows(rows)
    return str(path)


def test_rare_label_is_refused_unless_declared_public(tiny, tmp_path):
    """A label carried by one training example must not reach config.json (id2label)."""
    from dpfit.train import MIN_PUBLIC_LABEL_COUNT, RareLabelError

    data = _labelled_csv(tmp_path / "d.csv", {"neg": 60, "pos": 60, "patient-4711": 1})
    base = dict(model=tiny[0], data=data, eval_data=data, max_steps=1, batch_size=30)
    with pytest.raises(RareLabelError, match="--labels"):
        train(TrainConfig(**base))
    assert MIN_PUBLIC_LABEL_COUNT >= 10
    # the user's public label set: the rare name is not in it, so the data is refused...
    with pytest.raises(dpfit.DPFitError, match="patient-4711"):
        train(TrainConfig(**base, labels=("neg", "pos")))
    # ...and with an explicit declaration the names are published, and said to be public
    out = tmp_path / "run"
    res = train(TrainConfig(**base, public_labels=True, output=str(out)))
    assert (
        "patient-4711"
        in json.loads((out / "model" / "config.json").read_text())["id2label"].values()
    )
    assert res.metrics["label_names_source"] == "--public-labels"


def test_label_gate_counts_the_rows_that_train(tmp_path):
    """A name carried by 20 rows of the file but fewer than 20 training rows
    (the rest held out, or left out by --max-train-examples) is refused."""
    from dpfit.data.text import load_texts
    from dpfit.train import MIN_PUBLIC_LABEL_COUNT, RareLabelError, prepare_data

    k = MIN_PUBLIC_LABEL_COUNT
    data = _labelled_csv(tmp_path / "d.csv", {"neg": 100, "pos": 100, "rare": k})
    train_part, _ = load_texts(data).split(0.1, seed=0)  # the hold-out prepare_data makes
    assert 0 < train_part.class_counts()["rare"] < k  # the case under test
    with pytest.raises(RareLabelError, match="rare"):
        prepare_data(TrainConfig(data=data))
    # --eval-data: nothing held out, the whole file trains and the name is common enough
    assert prepare_data(TrainConfig(data=data, eval_data=data)).train.class_counts()["rare"] == k
    # --max-train-examples 100: about 7 of the 100 sampled rows carry it
    with pytest.raises(RareLabelError, match="rare"):
        prepare_data(TrainConfig(data=data, eval_data=data, max_train_examples=100))
    # declared public: the names are published whatever the counts
    assert prepare_data(TrainConfig(data=data, public_labels=True)).train.num_labels == 3


def test_declared_labels_fix_the_names_and_order(tiny, tmp_path):
    data = _labelled_csv(tmp_path / "d.csv", {"neg": 60, "pos": 60})
    out = tmp_path / "run"
    res = train(
        TrainConfig(
            model=tiny[0], data=data, max_steps=1, batch_size=30,
            labels=("pos", "neg", "neutral"), output=str(out),
        )
    )  # fmt: skip
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["id2label"] == {"0": "pos", "1": "neg", "2": "neutral"}
    assert res.metrics["label_names_source"] == "--labels"


def test_fixed_noise_multiplier(tiny):
    res = train(cfg(tiny, noise_multiplier=1.5, epsilon=None, max_steps=4))
    m = res.metrics
    assert m["noise_multiplier"] == 1.5
    assert m["steps"] == 4 and m["head_first_steps"] > 0  # head-first is on by default
    total = 4 + m["head_first_steps"]
    q = 30 / m["train_examples"]
    assert m["epsilon"] == pytest.approx(dpfit.epsilon_for(1.5, q, total, 1e-5), rel=1e-9)
    off = train(cfg(tiny, noise_multiplier=1.5, epsilon=None, max_steps=4, head_first=False))
    assert off.metrics["head_first_steps"] == 0
    assert off.metrics["epsilon"] == pytest.approx(dpfit.epsilon_for(1.5, q, 4, 1e-5))


def test_non_private_learns_the_toy_task(tiny):
    # full fine-tuning: a 16-wide random BERT is too weak to learn this from biases alone
    res = train(cfg(tiny, non_private=True, mode="full", epochs=10, lr=3e-3, batch_size=16))
    m = res.metrics
    assert m["private"] is False and math.isinf(m["epsilon"]) and m["noise_multiplier"] is None
    assert m["trainable_fraction"] == 1.0
    assert m["steps"] == 10 * math.ceil(m["train_examples"] / 16)
    assert m["accuracy"] >= 0.8  # the toy sentiment words are easy; chance is ~0.5
    assert res.steps[-1].loss < res.steps[0].loss


def test_decoder_model_trains_with_score_head(tmp_path):
    model = save_tiny_random_model(tmp_path / "gpt2", arch="gpt2")
    data = write_tiny_sentiment_csv(tmp_path / "d.csv", n=100)
    res = train(
        TrainConfig(
            model=str(model), data=str(data), epochs=1, batch_size=20, physical_batch_size=8
        )
    )
    # about 10% of 100 held out
    assert res.metrics["steps"] == round(res.metrics["train_examples"] / 20)
    names = res.privacy["trained_parameters"]
    assert "head.weight" in names and any(".attn.c_attn.bias" in n for n in names)


def test_model_without_biases_points_to_add_biases(tmp_path):
    model = save_tiny_random_model(tmp_path / "llama", arch="llama")
    data = write_tiny_sentiment_csv(tmp_path / "d.csv", n=50)
    with pytest.raises(NoTrainableParametersError, match="--add-biases"):
        train(TrainConfig(model=str(model), data=str(data), epochs=1, batch_size=10))


def test_batchnorm_model_is_refused(tiny, monkeypatch):
    from dpfit.tasks import classification

    real = classification.load_classifier

    def with_batchnorm(*a, **kw):
        loaded = real(*a, **kw)
        loaded.model.backbone.pooler.add_module("norm", torch.nn.BatchNorm1d(16))
        return loaded

    monkeypatch.setattr(classification, "load_classifier", with_batchnorm)
    with pytest.raises(BatchNormError, match="GroupNorm"):
        train(cfg(tiny, max_steps=1))


def test_infeasible_epsilon(tiny):
    with pytest.raises(InfeasibleTargetError, match="epsilon"):
        train(cfg(tiny, epsilon=1e-4, batch_size=150, epochs=1))


def test_out_of_memory_suggests_physical_batch_size(tiny, monkeypatch):
    from transformers import BertModel

    def oom(self, *a, **kw):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(BertModel, "forward", oom)
    with pytest.raises(PhysicalBatchMemoryError, match="--physical-batch-size 4"):
        train(cfg(tiny, max_steps=1))


def test_other_runtime_errors_are_not_disguised(tiny, monkeypatch):
    from transformers import BertModel

    def broken(self, *a, **kw):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(BertModel, "forward", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        train(cfg(tiny, max_steps=1))


def test_eval_data_with_unseen_labels_fails_before_training(tiny, tmp_path):
    bad = tmp_path / "eval.csv"
    bad.write_text("text,label\nthe film was good,pos\nthe film was meh,neutral\n")
    with pytest.raises(dpfit.DPFitError, match="neutral"):
        train(cfg(tiny, eval_data=str(bad)))


def test_config_validation():
    with pytest.raises(ValueError, match="clipping"):
        TrainConfig(clipping="per-layer")
    with pytest.raises(ValueError, match="resume"):
        TrainConfig(resume=True)
    with pytest.raises(ValueError, match="epsilon"):
        TrainConfig(epsilon=None)


def test_impossible_schedules_say_so(tiny):
    with pytest.raises(dpfit.DPFitError, match="--full-epochs"):
        train(cfg(tiny, full_epochs=2))  # must leave at least one bias-only epoch
    with pytest.raises(dpfit.DPFitError, match="--non-private"):
        train(cfg(tiny, full_epochs=1, non_private=True))
    with pytest.raises(dpfit.DPFitError, match="--head-first"):
        train(cfg(tiny, full_epochs=1, head_first=True))


def test_two_phase_full_then_bias_under_one_budget(tiny):
    from transformers import AutoModel

    res = train(cfg(tiny, epochs=3, full_epochs=1, epsilon=3.0))
    m = res.metrics
    assert 2.9 < m["epsilon"] <= 3.0 + 1e-6  # both phases composed into one figure
    assert m["steps"] == 3 * round(180 / 30)
    # the second phase trains biases and the head only...
    names = res.privacy["trained_parameters"]
    assert names and all(n.endswith("bias") or n.startswith("head.") for n in names)
    # ...but the first phase moved the weights too
    start = AutoModel.from_pretrained(tiny[0])
    before = dict(start.named_parameters())
    moved = [
        n
        for n, p in res.model.backbone.named_parameters()
        if n.endswith("weight") and not torch.equal(p.detach().cpu(), before[n].detach())
    ]
    assert moved


def test_full_mode_runs_on_bert_with_per_example_positions(tiny):
    res = train(cfg(tiny, mode="full", epochs=1, epsilon=3.0))
    assert res.metrics["steps"] == round(180 / 30)
    assert 0 < res.metrics["epsilon"] <= 3.0 + 1e-6


def test_add_biases_makes_a_bias_free_model_trainable(tmp_path):
    model = save_tiny_random_model(tmp_path / "llama", arch="llama")
    data = write_tiny_sentiment_csv(tmp_path / "d.csv", n=50)
    res = train(
        TrainConfig(model=str(model), data=str(data), epochs=1, batch_size=15, add_biases=True)
    )
    names = res.privacy["trained_parameters"]
    assert res.metrics["steps"] == 3 and any(n.endswith("bias") for n in names)


PLAIN_TRANSFORMERS = """
import torch
from safetensors.torch import load_file
from transformers import AutoModel, AutoTokenizer

tok = AutoTokenizer.from_pretrained(folder)
backbone = AutoModel.from_pretrained(folder).eval()
head = load_file(f"{folder}/dpfit_head.safetensors")
pooling = backbone.config.dpfit_pooling
enc = tok(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
with torch.no_grad():
    out = backbone(**enc)
    h, m = out.last_hidden_state, enc["attention_mask"]
    if pooling == "mean":
        pooled = (h * m[..., None]).sum(1) / m.sum(1, keepdim=True)
    elif pooling == "cls":
        pooled = h[:, 0]
    elif pooling == "pooler":
        pooled = out.pooler_output
    else:  # "last": the last token the attention mask keeps
        pooled = h[torch.arange(len(h)), (m * torch.arange(m.shape[1])).argmax(1)]
    logits = pooled @ head["weight"].T + head["bias"]
"""


@pytest.mark.parametrize("arch,pooling", [("bert", "auto"), ("bert", "mean"), ("gpt2", "auto")])
def test_saved_model_reloads_with_identical_logits(tmp_path, arch, pooling):
    """`dpfit evaluate`'s loader and the plain transformers code in docs/train.md give the
    trained model's logits."""
    from dpfit.models import load_classifier
    from dpfit.train import evaluate

    model = save_tiny_random_model(tmp_path / arch, arch=arch)
    data = write_tiny_sentiment_csv(tmp_path / "d.csv", n=100)
    out = tmp_path / "run"
    res = train(TrainConfig(model=str(model), data=str(data), max_steps=3, batch_size=20,
                            pooling=pooling, output=str(out)))  # fmt: skip
    texts = ["the film was good", "bad plot", "a very dull movie and it was not fun"]
    folder = str(out / "model")
    trained = res.model.eval()
    assert trained.head.weight.abs().sum() > 0  # trained away from its zero init
    enc = res.tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = trained(**enc).logits
    again = load_classifier(folder)
    assert again.pooling == trained.pooling and again.model.config.id2label == {0: "neg", 1: "pos"}
    with torch.no_grad():
        assert torch.allclose(again.model.eval()(**enc).logits, expected, atol=1e-6)
    scope = {"folder": folder, "texts": texts}
    exec(PLAIN_TRANSFORMERS, scope)
    assert torch.allclose(scope["logits"], expected, atol=1e-5)
    test = dpfit.data.load_texts(str(data), label_names=("neg", "pos"))
    assert evaluate(again.model, again.tokenizer, test).accuracy == pytest.approx(
        evaluate(trained, res.tokenizer, test).accuracy
    )


def test_head_first_composes_both_phases_and_reads_the_backbone_once(tiny, monkeypatch):
    """Head-first: the head phase computes features in one backbone pass (no backbone
    forward per head step), and one noise multiplier covers head + bias steps on one ledger."""
    from dpfit.tasks import classification

    seen: list[int] = []  # examples through the backbone, per forward
    marks: dict[str, int] = {}
    real = classification.load_classifier

    def counting(*a, **kw):
        loaded = real(*a, **kw)
        loaded.model.backbone.register_forward_pre_hook(
            lambda mod, args, kwargs: seen.append(int(kwargs["input_ids"].shape[0])),
            with_kwargs=True,
        )
        return loaded

    def on_note(msg):
        if "private head steps" in msg:
            marks["head_done"] = sum(seen)

    monkeypatch.setattr(classification, "load_classifier", counting)
    res = train(cfg(tiny, head_first=True, head_epochs=2, epochs=1, epsilon=3.0), on_note=on_note)
    n = res.privacy["sample_size"]  # ~180 of 200: the hold-out is drawn per row
    steps_per_epoch = round(n / 30)
    m = res.metrics
    assert marks["head_done"] == n  # every example once, and nothing per head step
    assert m["head_first_steps"] == 2 * steps_per_epoch and m["steps"] == steps_per_epoch
    total = m["head_first_steps"] + m["steps"]
    assert res.privacy["steps"] == total
    assert m["epsilon"] == pytest.approx(
        dpfit.epsilon_for(m["noise_multiplier"], 30 / n, total, 1e-5), rel=1e-9
    )
    assert 2.9 < m["epsilon"] <= 3.0 + 1e-6  # calibrated for the whole run, not one phase
    assert res.model.head.weight.abs().sum() > 0
    # the probe alone is scored on the (public) evaluation data before the biases train
    assert 0.0 <= m["head_first_accuracy"] <= 1.0
    assert any("linear probe alone" in note for note in res.notes)


def test_bf16_run_casts_each_frozen_weight_once_across_both_phases(tiny, monkeypatch):
    """Head-first features and the bias steps share one set of bf16 frozen-weight copies."""
    from dpfit.frozen_casts import FrozenWeightCasts

    casts: list[int] = []  # id of each weight cast to bf16
    real = FrozenWeightCasts._copy

    def counting(self, w):
        before = self._copies.get(w)
        low = real(self, w)
        if before is None or before[1] is not low:
            casts.append(id(w))
        return low

    monkeypatch.setattr(FrozenWeightCasts, "_copy", counting)
    res = train(cfg(tiny, head_first=True, head_epochs=1, epochs=1, max_steps=2, precision="bf16"))
    assert res.metrics["head_first_steps"] > 0 and res.metrics["steps"] == 2
    frozen = FrozenWeightCasts(res.model, "bf16", "cpu").frozen_weights()
    assert frozen and sorted(casts) == sorted(id(w) for w in frozen)


def test_a_saved_classifier_is_scored_before_it_trains_again(tiny, tmp_path):
    first = train(cfg(tiny, non_private=True, epochs=1, output=str(tmp_path / "a")))
    assert "start_accuracy" not in first.metrics  # a new zero head: nothing to score
    notes: list[str] = []
    again = train(
        cfg(tiny, model=str(tmp_path / "a" / "model"), epsilon=3.0, epochs=1), on_note=notes.append
    )
    # the saved head is loaded and scored on the same held-out texts (same split seed)
    assert again.metrics["start_accuracy"] == first.metrics["accuracy"]
    assert any("the saved model's trained linear layer" in n for n in notes)
    assert any("accuracy of the starting model, before training" in n for n in notes)


def test_classification_items_are_sorted_by_length_for_cheap_padding(tiny, tmp_path):
    """The Poisson loader keeps index order inside a logical batch, so length-sorted items
    give physical batches of similar length (about half the padded tokens on short texts)."""
    import csv

    from dpfit.tasks import get_task

    data = tmp_path / "varied.csv"
    with open(data, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows((" ".join(["good"] * (1 + (7 * i) % 11)), "ab"[i % 2]) for i in range(60))
    task = get_task("classification")
    prep = task.prepare(cfg(tiny, data=str(data), epsilon=3.0))
    lengths = [len(item["input_ids"]) for item in task.items(prep, 128)]
    assert len(lengths) == prep.n and len(set(lengths)) > 3
    assert lengths == sorted(lengths)


def _dropout_rates(model) -> set[float]:
    return {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}


def test_private_runs_train_without_dropout_and_the_reference_keeps_the_models(tiny):
    notes: list[str] = []
    res = train(cfg(tiny, epochs=1), on_note=notes.append)
    assert res.metrics["config"]["dropout"] == 0.0 and _dropout_rates(res.model) == {0.0}
    assert any(n.startswith("dropout: off (") for n in notes)
    assert any("dropout off" in n for n in notes if n.startswith("recipe"))
    ref = train(cfg(tiny, epochs=1, non_private=True))
    assert ref.metrics["config"]["dropout"] == "model" and _dropout_rates(ref.model) == {0.1}


def test_a_dropout_flag_overrides_the_recipe(tiny):
    notes: list[str] = []
    res = train(cfg(tiny, epochs=1, dropout=0.2), on_note=notes.append)
    assert res.metrics["config"]["dropout"] == 0.2 and _dropout_rates(res.model) == {0.2}
    (recipe,) = [n for n in notes if n.startswith("recipe")]
    assert "overridden by flags" in recipe and "dropout" in recipe.split("overridden")[1]
    own = train(cfg(tiny, epochs=1, dropout="model"))
    assert _dropout_rates(own.model) == {0.1}


def test_dropout_cannot_be_set_for_models_it_cannot_reach():
    from dpfit.run.resolve import dropout_for as _dropout_for

    assert _dropout_for(TrainConfig(), as_given=True) == "model"
    assert _dropout_for(TrainConfig(), as_given=False) == 0.0
    assert _dropout_for(TrainConfig(non_private=True), as_given=False) == "model"
    for task in ("image-classification", "classification"):
        with pytest.raises(dpfit.DPFitError, match="--dropout"):
            _dropout_for(TrainConfig(task=task, dropout=0.1), as_given=True)
    with pytest.raises(ValueError, match="dropout"):
        TrainConfig(dropout=1.0)
