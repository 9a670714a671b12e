"""DPTrainer: an ordinary transformers Trainer script made private by swapping one class."""

import json

import pytest
import torch

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from transformers import DataCollatorWithPadding, TrainingArguments  # noqa: E402

from dpfit.errors import DPFitError  # noqa: E402
from dpfit.integrations import DPTrainer, PrivacyArguments  # noqa: E402
from dpfit.models import load_classifier, save_tiny_random_model  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def setup(tmp_path):
    loaded = load_classifier(save_tiny_random_model(tmp_path / "m"), ["neg", "pos"], seed=0)
    texts = [f"the film was {w}" for w in ("good", "bad", "great", "awful", "fine", "poor")] * 16
    labels = [i % 2 == 0 for i in range(len(texts))]
    ds = datasets.Dataset.from_dict({"text": texts, "label": [int(not y) for y in labels]})
    ds = ds.map(lambda b: loaded.tokenizer(b["text"]), batched=True)
    return loaded, ds, DataCollatorWithPadding(loaded.tokenizer)


def targs(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=16, num_train_epochs=2,
                learning_rate=5e-2, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no",
                seed=0, disable_tqdm=True)  # fmt: skip
    return TrainingArguments(**{**base, **kw})


def test_dp_trainer_trains_biases_privately(setup, tmp_path):
    loaded, ds, collator = setup
    model = loaded.model
    frozen_before = model.bert.encoder.layer[0].attention.self.query.weight.detach().clone()
    bias_before = model.bert.encoder.layer[0].attention.self.query.bias.detach().clone()
    args = targs(tmp_path)
    trainer = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=collator,
                        privacy=PrivacyArguments(target_epsilon=3.0, target_delta=1e-4))  # fmt: skip
    trainer.train()
    engine = trainer.privacy_engine
    assert engine.steps_taken == 2 * round(len(ds) / 16)
    assert 2.9 < engine.epsilon() <= 3.0 + 1e-6
    layer = model.bert.encoder.layer[0].attention.self.query
    assert torch.equal(layer.weight, frozen_before)  # only biases (and the head) train
    assert not torch.equal(layer.bias, bias_before)
    logged = [h for h in trainer.state.log_history if "epsilon" in h]
    assert logged and logged[-1]["epsilon"] == pytest.approx(engine.epsilon(), rel=1e-6)
    assert args.max_grad_norm == 1.0  # the user's arguments are untouched
    trainer.save_model(str(tmp_path / "saved"))
    record = json.loads((tmp_path / "saved" / "dpfit.json").read_text())
    assert (
        record["epsilon"] == pytest.approx(engine.epsilon())
        and record["trained_biases_only"] is False
    )


def test_gradient_accumulation_is_refused(setup, tmp_path):
    loaded, ds, collator = setup
    with pytest.raises(DPFitError, match="gradient_accumulation_steps=1"):
        DPTrainer(model=loaded.model, args=targs(tmp_path, gradient_accumulation_steps=2),
                  train_dataset=ds, data_collator=collator)  # fmt: skip


def test_noise_multiplier_and_max_steps(setup, tmp_path):
    loaded, ds, collator = setup
    trainer = DPTrainer(model=loaded.model, args=targs(tmp_path, max_steps=3), train_dataset=ds,
                        data_collator=collator, privacy=PrivacyArguments(noise_multiplier=2.0))  # fmt: skip
    trainer.train()
    assert trainer.privacy_engine.steps_taken == 3
    assert trainer.privacy_engine.noise_multiplier == 2.0
