"""DPTrainer: an ordinary transformers Trainer script made private by swapping one class."""

import dataclasses
import json
import math

import pytest
import torch

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from trainer_args import stop_at  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForMaskedLM,
    BertForTokenClassification,
    DataCollatorWithPadding,
    GPT2Config,
    GPT2LMHeadModel,
    TrainingArguments,
)

from dpfit.errors import DPFitError, LossReductionError  # noqa: E402
from dpfit.integrations import (  # noqa: E402
    DPTrainer,
    MissingPrivacyStateError,
    NoCheckpointError,
    PrivacyArguments,
)
from dpfit.integrations.losses import IGNORE_INDEX  # noqa: E402
from dpfit.integrations.trainer import ENGINE_STATE_NAME  # noqa: E402
from dpfit.models import load_classifier, save_tiny_random_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_random_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture
def make(tiny_folder):
    """make() -> (model, dataset, collator); a fresh, identically initialised model each call."""

    def build():
        loaded = load_classifier(tiny_folder, ["neg", "pos"], seed=0)
        words = ("good", "bad", "great", "awful", "fine", "poor")
        texts = [f"the film was {w}" for w in words] * 16
        ds = datasets.Dataset.from_dict({"text": texts, "label": [i % 2 for i in range(96)]})
        ds = ds.map(lambda b: loaded.tokenizer(b["text"]), batched=True)
        return loaded.model, ds, DataCollatorWithPadding(loaded.tokenizer)

    return build


def targs(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=16, num_train_epochs=2,
                learning_rate=5e-2, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no",
                seed=0, disable_tqdm=True)  # fmt: skip
    return TrainingArguments(**{**base, **kw})


def trained_biases(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def same(a, b, atol=0.0):
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=atol) for k in a)


def test_dp_trainer_trains_biases_privately(make, tmp_path):
    model, ds, collator = make()
    frozen_before = model.backbone.encoder.layer[0].attention.self.query.weight.detach().clone()
    bias_before = model.backbone.encoder.layer[0].attention.self.query.bias.detach().clone()
    args = targs(tmp_path)
    trainer = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=collator,
                        privacy=PrivacyArguments(target_epsilon=3.0, target_delta=1e-4))  # fmt: skip
    trainer.train()
    engine = trainer.privacy_engine
    assert engine.steps_taken == 2 * round(len(ds) / 16)
    assert 2.9 < engine.epsilon() <= 3.0 + 1e-6
    layer = model.backbone.encoder.layer[0].attention.self.query
    assert torch.equal(layer.weight, frozen_before)  # only biases (and the head) train
    assert not torch.equal(layer.bias, bias_before)
    logged = [h for h in trainer.state.log_history if "epsilon" in h]
    assert logged and logged[-1]["epsilon"] == pytest.approx(engine.epsilon(), rel=1e-6)
    assert args.max_grad_norm == 1.0 and not args.ignore_data_skip  # the user's args untouched
    trainer.save_model(str(tmp_path / "saved"))
    record = json.loads((tmp_path / "saved" / "dpfit.json").read_text())
    assert record["epsilon"] == pytest.approx(engine.epsilon())
    assert record["trained_biases_only"] is False and record["insecure_seed"] is False
    assert not (tmp_path / "saved" / ENGINE_STATE_NAME).exists()  # secret state: checkpoints only


def test_gradient_accumulation_is_refused(make, tmp_path):
    model, ds, collator = make()
    with pytest.raises(DPFitError, match="gradient_accumulation_steps=1"):
        DPTrainer(model=model, args=targs(tmp_path, gradient_accumulation_steps=2),
                  train_dataset=ds, data_collator=collator)  # fmt: skip


def test_noise_multiplier_and_max_steps(make, tmp_path):
    model, ds, collator = make()
    trainer = DPTrainer(model=model, args=targs(tmp_path, max_steps=3), train_dataset=ds,
                        data_collator=collator, privacy=PrivacyArguments(noise_multiplier=2.0))  # fmt: skip
    trainer.train()
    assert trainer.privacy_engine.steps_taken == 3
    assert trainer.privacy_engine.noise_multiplier == 2.0


# ----------------------------------------------------------------- randomness of the mechanism
def _run(make, tmp_path, privacy, **kw):
    model, ds, collator = make()
    trainer = DPTrainer(model=model, args=targs(tmp_path, **kw), train_dataset=ds,
                        data_collator=collator, privacy=privacy)  # fmt: skip
    trainer.train()
    return trainer, trained_biases(model)


def test_training_seed_does_not_fix_noise_or_batches_unless_insecure_seed(make, tmp_path):
    """TrainingArguments.seed is public (it is in every script); noise and Poisson batches must
    not follow from it. With insecure_seed the run repeats exactly (and says so)."""
    secure = PrivacyArguments(noise_multiplier=1.0)
    _, a = _run(make, tmp_path, secure, max_steps=2, seed=42)
    t, b = _run(make, tmp_path, secure, max_steps=2, seed=42)
    assert not same(a, b, atol=1e-6)
    batches = []
    for _ in range(2):  # the batches, not only the noise, differ between runs
        loader = t.privacy_engine.data_loader(t.train_dataset)
        batches.append([loader.sampler.draw() for _ in range(3)])
    assert batches[0] != batches[1]
    insecure = PrivacyArguments(noise_multiplier=1.0, insecure_seed=7)
    t, c = _run(make, tmp_path, insecure, max_steps=2, seed=42)
    _, d = _run(make, tmp_path, insecure, max_steps=2, seed=42)
    assert same(c, d)
    t.save_model(str(tmp_path / "saved"))
    assert json.loads((tmp_path / "saved" / "dpfit.json").read_text())["insecure_seed"] is True


# ----------------------------------------------------------------- resume
def test_resume_counts_every_step_and_continues_the_same_run(make, tmp_path):
    """2 steps, checkpoint, resume 2 more (mid-epoch): the same epsilon, steps and parameters
    as 4 uninterrupted steps (insecure_seed makes the two runs comparable)."""
    privacy = PrivacyArguments(noise_multiplier=1.0, target_delta=1e-4, insecure_seed=3)
    kw = dict(max_steps=4, per_device_train_batch_size=8, save_steps=2)  # 12 steps per epoch
    whole, whole_params = _run(make, tmp_path / "whole", privacy, **kw)

    model, ds, collator = make()
    # its own resume below is the checkpoint's second continuation: a fork, asked for
    first = DPTrainer(model=model, args=targs(tmp_path, save_strategy="steps", **kw),
                      train_dataset=ds, data_collator=collator,
                      privacy=dataclasses.replace(privacy, allow_fork=True),
                      callbacks=[stop_at(2)])  # fmt: skip
    first.train()
    assert first.privacy_engine.steps_taken == 2
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / ENGINE_STATE_NAME).is_file()

    model, ds, collator = make()
    resumed = DPTrainer(model=model, args=targs(tmp_path, save_strategy="steps", **kw),
                        train_dataset=ds, data_collator=collator, privacy=privacy)  # fmt: skip
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.privacy_engine.steps_taken == whole.privacy_engine.steps_taken == 4
    assert resumed.privacy_engine.epsilon() == pytest.approx(
        whole.privacy_engine.epsilon(), rel=1e-9
    )
    assert same(trained_biases(model), whole_params, atol=1e-6)
    assert resumed.state.epoch == pytest.approx(whole.state.epoch) == pytest.approx(4 / 12)
    # the same trainer object, whose engine already drew batches, resumes the same way
    first.train(resume_from_checkpoint=str(checkpoint))
    assert first.privacy_engine.steps_taken == 4
    assert same(trained_biases(first.model), whole_params, atol=1e-6)


def test_resume_without_engine_state_is_refused(make, tmp_path):
    privacy = PrivacyArguments(noise_multiplier=1.0)
    kw = dict(max_steps=6, save_strategy="steps", save_steps=2)
    model, ds, collator = make()
    first = DPTrainer(model=model, args=targs(tmp_path, **kw), train_dataset=ds,
                      data_collator=collator, privacy=privacy, callbacks=[stop_at(4)])  # fmt: skip
    first.train()
    (tmp_path / "out" / "checkpoint-2" / ENGINE_STATE_NAME).unlink()
    model, ds, collator = make()
    again = DPTrainer(model=model, args=targs(tmp_path, **kw), train_dataset=ds,
                      data_collator=collator, privacy=privacy)  # fmt: skip
    with pytest.raises(MissingPrivacyStateError, match=ENGINE_STATE_NAME):
        again.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    # resume_from_checkpoint=True picks the newest checkpoint (4), which has the state
    again.train(resume_from_checkpoint=True)
    assert again.privacy_engine.steps_taken == 6


def test_resume_without_a_checkpoint_is_refused_not_started_over(make, tmp_path):
    """Resuming with no checkpoint must not silently train from scratch (that
    spends the budget twice): an error naming the folder, and no step taken."""
    model, ds, collator = make()
    trainer = DPTrainer(model=model, args=targs(tmp_path, max_steps=2), train_dataset=ds,
                        data_collator=collator, privacy=PrivacyArguments(noise_multiplier=1.0))  # fmt: skip
    out = tmp_path / "out"
    with pytest.raises(NoCheckpointError, match=f"{out} (does not exist|holds no checkpoint)"):
        trainer.train(resume_from_checkpoint=True)
    missing = tmp_path / "typo" / "checkpoint-2"
    with pytest.raises(NoCheckpointError, match="does not exist"):
        trainer.train(resume_from_checkpoint=str(missing))
    assert trainer.privacy_engine.steps_taken == 0


# ----------------------------------------------------------------- per-example losses
def _token_task(kind):
    torch.manual_seed(0)
    if kind == "causal-lm":
        cfg = GPT2Config(vocab_size=30, n_embd=16, n_layer=2, n_head=2, n_positions=64,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return GPT2LMHeadModel(cfg)
    cfg = BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=64, num_labels=3,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    return BertForTokenClassification(cfg)


def _pad(items):
    width = max(len(x["input_ids"]) for x in items)
    out = {"input_ids": [], "attention_mask": [], "labels": []}
    for x in items:
        pad = width - len(x["input_ids"])
        out["input_ids"].append(x["input_ids"] + [0] * pad)
        out["attention_mask"].append([1] * len(x["input_ids"]) + [0] * pad)
        out["labels"].append(x["labels"] + [IGNORE_INDEX] * pad)
    return {k: torch.tensor(v) for k, v in out.items()}


@pytest.mark.parametrize("kind", ["causal-lm", "token-classification"])
def test_an_examples_clipped_row_does_not_depend_on_its_neighbour(kind, tmp_path, recorded_norms):
    """The same example next to a 2-token and next to a 40-token neighbour: the same row (its
    norm before clipping), as DP needs; a batch-wide token mean would scale it by t_x / T."""
    g = torch.Generator().manual_seed(1)

    def example(n):
        ids = torch.randint(2, 30, (n,), generator=g).tolist()
        labels = ids if kind == "causal-lm" else torch.randint(0, 3, (n,), generator=g).tolist()
        return {"input_ids": ids, "labels": labels}

    x = example(6)
    norms = []
    for neighbour in (example(2), example(40)):
        model = _token_task(kind)
        # two examples, expected batch 2: q = 1, so every batch is [x, neighbour]
        trainer = DPTrainer(model=model, args=targs(tmp_path, max_steps=1, per_device_train_batch_size=2),
                            train_dataset=[x, neighbour], data_collator=_pad,
                            privacy=PrivacyArguments(noise_multiplier=1.0, clipping="test-recording",
                                                     max_grad_norm=1e-3))  # fmt: skip
        trainer.train()
        norms.append(recorded_norms[-1][0].item())
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)


def test_models_whose_loss_does_not_split_per_example_are_refused(make, tmp_path):
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32)  # fmt: skip
    _, ds, collator = make()
    with pytest.raises(LossReductionError, match="BertForMaskedLM"):
        DPTrainer(model=BertForMaskedLM(cfg), args=targs(tmp_path), train_dataset=ds)
    model, ds, collator = make()
    with pytest.raises(LossReductionError, match="compute_loss_func"):
        DPTrainer(model=model, args=targs(tmp_path), train_dataset=ds, data_collator=collator,
                  compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum())  # fmt: skip


# ----------------------------------------------------------------- what is logged and saved
PRIVATE_KEYS = {"grad_norm", "loss", "train_loss", "total_flos", "num_input_tokens_seen"}


def test_no_unnoised_statistic_is_logged_or_saved(make, tmp_path):
    model, ds, collator = make()
    trainer = DPTrainer(model=model, args=targs(tmp_path, max_steps=4, save_strategy="steps",
                                                save_steps=4, eval_strategy="steps", eval_steps=4),
                        train_dataset=ds, eval_dataset=ds.select(range(8)), data_collator=collator,
                        privacy=PrivacyArguments(noise_multiplier=1.0))  # fmt: skip
    out = trainer.train()
    history = trainer.state.log_history
    saved = json.loads((tmp_path / "out" / "checkpoint-4" / "trainer_state.json").read_text())
    trainer.save_state()
    final = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    for logs in (history, saved["log_history"], final["log_history"]):
        assert len(logs) >= 4
        assert all(not (PRIVATE_KEYS & set(entry)) for entry in logs), logs
        assert any("eval_loss" in entry for entry in logs)  # evaluation data: declared public
        assert all("epsilon" in entry for entry in logs)
    assert saved["total_flos"] == final["total_flos"] == 0
    assert math.isnan(out.training_loss) and not (PRIVATE_KEYS & set(out.metrics))


def test_train_loss_is_logged_only_on_request(make, tmp_path):
    model, ds, collator = make()
    trainer = DPTrainer(model=model, args=targs(tmp_path, max_steps=2), train_dataset=ds,
                        data_collator=collator,
                        privacy=PrivacyArguments(noise_multiplier=1.0, log_train_loss=True))  # fmt: skip
    out = trainer.train()
    assert sum("loss" in h for h in trainer.state.log_history) == 2
    assert not any("grad_norm" in h for h in trainer.state.log_history)
    assert math.isfinite(out.training_loss)


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(include_num_input_tokens_seen="all"), "include_num_input_tokens_seen"),
        (dict(push_to_hub=True, hub_strategy="checkpoint", hub_model_id="x/y"), "hub_strategy"),
    ],
)
def test_arguments_that_would_publish_private_data_are_refused(make, tmp_path, bad, match):
    model, ds, collator = make()
    with pytest.raises(DPFitError, match=match):
        DPTrainer(
            model=model, args=targs(tmp_path, **bad), train_dataset=ds, data_collator=collator
        )


def test_empty_poisson_batches_are_steps_that_trainer_counts(make, tmp_path):
    """q = 1/96: many logical batches are empty. Each is still a noised, accounted step, and
    Trainer sees it (as EMPTY_BATCH) and counts it: its global_step is the engine's."""
    from dpfit.sampling import EmptyBatch

    empties = []

    class Counting(DPTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            empties.append(isinstance(inputs, EmptyBatch))
            return super().training_step(model, inputs, num_items_in_batch)

    model, ds, collator = make()
    privacy = PrivacyArguments(noise_multiplier=1.0, insecure_seed=1)  # fixes which are empty
    trainer = Counting(model=model, args=targs(tmp_path, max_steps=6, per_device_train_batch_size=1),
                       train_dataset=ds, data_collator=collator, privacy=privacy)  # fmt: skip
    trainer.train()
    assert any(empties) and not all(empties)
    assert trainer.state.global_step == trainer.privacy_engine.steps_taken == len(empties) == 6


def test_resuming_one_checkpoint_twice_is_a_fork_refused_unless_asked(make, tmp_path):
    """DPTrainer resumed twice from one checkpoint (say with another learning
    rate). Each continuation draws fresh noise (OS-seeded: the two differ), and the second is
    refused unless allow_fork, whose dpfit.json says what releasing both costs."""
    from dpfit.checkpoint import CheckpointForkError

    privacy = PrivacyArguments(noise_multiplier=1.0, target_delta=1e-4)
    kw = dict(max_steps=4, per_device_train_batch_size=8, save_steps=2, save_strategy="steps")
    model, ds, collator = make()
    DPTrainer(model=model, args=targs(tmp_path, **kw), train_dataset=ds, data_collator=collator,
              privacy=privacy, callbacks=[stop_at(2)]).train()  # fmt: skip
    checkpoint = str(tmp_path / "out" / "checkpoint-2")

    def resume(name, lr, p):
        model, ds, collator = make()
        args = targs(tmp_path, **{**kw, "output_dir": str(tmp_path / name)}, learning_rate=lr)
        t = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=collator,
                      privacy=p)  # fmt: skip
        t.train(resume_from_checkpoint=checkpoint)
        t.save_model()
        return t, trained_biases(model)

    one, first = resume("one", 5e-2, privacy)
    assert one.privacy_engine.steps_taken == 4
    with pytest.raises(CheckpointForkError, match="already continued"):
        resume("two", 1e-1, privacy)
    two, second = resume("three", 5e-2, dataclasses.replace(privacy, allow_fork=True))
    assert not same(first, second, atol=1e-6)  # fresh noise and batches, same learning rate
    record = json.loads((tmp_path / "three" / "dpfit.json").read_text())
    fork = record["continuation"]
    assert fork["fork"] and fork["continuation"] == 2 and fork["shared_steps"] == 2
    assert fork["epsilon_if_all_continuations_released"] > record["epsilon"]
    assert not json.loads((tmp_path / "one" / "dpfit.json").read_text())["continuation"]["fork"]


def test_a_released_run_makes_its_older_checkpoints_forks(make, tmp_path):
    """transformers keeps every checkpoint-N: once the model of step 6 is saved, resuming
    checkpoint-2 would release a second continuation of it. It is refused unless allow_fork,
    and then reported with both continuations' steps: 2 shared + this one's 1 + the earlier
    one's 4 (as far as its release went, though this fork is shorter) = 7."""
    from accounting_oracle import ADD_REMOVE, direct_epsilon

    from dpfit.checkpoint import CheckpointForkError

    privacy = PrivacyArguments(noise_multiplier=1.0, target_delta=1e-4)
    kw = dict(max_steps=6, per_device_train_batch_size=8, save_steps=2, save_strategy="steps")
    model, ds, collator = make()
    done = DPTrainer(model=model, args=targs(tmp_path, **kw), train_dataset=ds,
                     data_collator=collator, privacy=privacy)  # fmt: skip
    done.train()
    done.save_model()
    q = done.privacy_engine.sample_rate
    model, ds, collator = make()
    again = DPTrainer(model=model, args=targs(tmp_path, **kw), train_dataset=ds,
                      data_collator=collator, privacy=privacy)  # fmt: skip
    with pytest.raises(CheckpointForkError, match="already continued"):
        again.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    model, ds, collator = make()
    args = targs(tmp_path, **{**kw, "output_dir": str(tmp_path / "fork"), "max_steps": 3})
    fork = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=collator,
                     privacy=dataclasses.replace(privacy, allow_fork=True))  # fmt: skip
    fork.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    fork.save_model()
    report = json.loads((tmp_path / "fork" / "dpfit.json").read_text())["continuation"]
    assert report["fork"] and report["earlier_continuation_steps_at_most"] == 4
    assert report["epsilon_if_all_continuations_released"] == pytest.approx(
        direct_epsilon(1.0, q, 7, 1e-4, ADD_REMOVE, kind="rdp"), rel=1e-6
    )


def test_default_delta_follows_the_dataset_size(make, tmp_path):
    """PrivacyArguments' delta is dpfit train's rule, min(1e-5, n^-1.1), not a fixed 1e-5
    whatever n (at 48,000 examples 1e-5 would be over 1/n^1.1)."""
    model, ds, collator = make()
    big = datasets.concatenate_datasets([ds] * 500)  # 48,000 rows
    t = DPTrainer(model=model, args=targs(tmp_path, max_steps=1), train_dataset=big,
                  data_collator=collator, privacy=PrivacyArguments(noise_multiplier=1.0))  # fmt: skip
    assert t.privacy_engine.target_delta == pytest.approx(48_000**-1.1)
    assert t.privacy_engine.target_delta < 1e-5


def test_a_saved_dpfit_classifier_loads_again(make, tmp_path):
    """DPTrainer on dpfit's own classifier (load_classifier) saves a folder that
    load_classifier reads back: the same biases and head, and dpfit.json beside them."""
    from transformers import AutoTokenizer

    from dpfit.models import load_classifier

    model, ds, collator = make()
    t = DPTrainer(model=model, args=targs(tmp_path, max_steps=1), train_dataset=ds,
                  data_collator=collator, processing_class=collator.tokenizer,
                  privacy=PrivacyArguments(noise_multiplier=1.0))  # fmt: skip
    t.train()
    t.save_model(str(tmp_path / "saved"))
    back = dict(load_classifier(str(tmp_path / "saved"), ["neg", "pos"]).model.named_parameters())
    trained = trained_biases(model)
    assert same(trained, {n: back[n].detach() for n in trained})
    assert json.loads((tmp_path / "saved" / "dpfit.json").read_text())["private"]
    assert AutoTokenizer.from_pretrained(str(tmp_path / "saved")) is not None
