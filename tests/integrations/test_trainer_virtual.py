"""DPTrainer virtual steps: a logical Poisson batch processed as several physical batches
(PrivacyArguments.physical_batch_size), clipped per example into one sum, noised once."""

import dp_accounting
import pytest
import torch
from trainer_args import sgd_training_args, trainable

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from transformers import DataCollatorWithPadding  # noqa: E402

import dpfit.engine  # noqa: E402
from dpfit.errors import DPFitError  # noqa: E402
from dpfit.integrations import DPTrainer, PrivacyArguments  # noqa: E402
from dpfit.models import load_classifier, save_tiny_random_model  # noqa: E402
from dpfit.sampling import EmptyBatch, PhysicalBatches  # noqa: E402

N = 96


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_random_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture
def make(tiny_folder):
    """make() -> (model, dataset, collator); a fresh, identically initialised model each call.
    Texts of different lengths, so physical batches are padded differently from the one pass."""

    def build():
        loaded = load_classifier(tiny_folder, ["neg", "pos"], seed=0)
        words = ("good", "bad", "great", "awful", "fine", "poor")
        texts = [f"the film was {w} " * (1 + i % 4) for i, w in enumerate(words * (N // 6))]
        labels = [int(w not in ("bad", "awful")) for w in words * (N // 6)]
        ds = datasets.Dataset.from_dict({"text": texts, "label": labels})
        ds = ds.map(lambda b: loaded.tokenizer(b["text"]), batched=True)
        for m in loaded.model.modules():  # dropout draws depend on the batch shapes
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        return loaded.model, ds, DataCollatorWithPadding(loaded.tokenizer)

    return build


def targs(tmp_path, **kw):
    return sgd_training_args(
        tmp_path, **{**dict(per_device_train_batch_size=16, max_steps=3, learning_rate=0.5), **kw}
    )


class Recording(DPTrainer):
    """Records each logical item Trainer hands over and the batch size of every forward."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.items: list[tuple[int, ...] | None] = []  # physical sizes; None: EMPTY_BATCH
        self.forward_rows: list[int] = []
        self.model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        self.forward_rows.append(int(kwargs["input_ids"].shape[0]))

    def training_step(self, model, inputs, num_items_in_batch=None):
        assert isinstance(inputs, EmptyBatch | PhysicalBatches)
        self.items.append(None if isinstance(inputs, EmptyBatch) else inputs.sizes)
        return super().training_step(model, inputs, num_items_in_batch)


def run(make, tmp_path, privacy, **kw):
    model, ds, collator = make()
    trainer = Recording(model=model, args=targs(tmp_path, **kw), train_dataset=ds,
                        data_collator=collator, privacy=privacy)  # fmt: skip
    start = trainable(model).clone()  # after DPTrainer made only the biases and head train
    trainer.train()
    return trainer, trainable(model) - start


@pytest.fixture
def noise_draws(monkeypatch):
    """Shapes of every noise draw the engine makes (through its gaussian_noise seam)."""
    draws = []
    real = dpfit.engine.gaussian_noise

    def counting(shape, *a, **kw):
        draws.append(tuple(shape))
        return real(shape, *a, **kw)

    monkeypatch.setattr(dpfit.engine, "gaussian_noise", counting)
    return draws


def test_physical_batches_give_the_one_pass_update_at_sigma_zero(make, tmp_path):
    """sigma=0, same Poisson draws (insecure_seed): split into physical batches of 5, the
    update after 3 steps is the one-pass update to 1e-6 relative."""
    privacy = PrivacyArguments(noise_multiplier=0.0, insecure_seed=3)
    one, ref = run(make, tmp_path / "one", privacy)
    virt, got = run(make, tmp_path / "virt", PrivacyArguments(
        noise_multiplier=0.0, insecure_seed=3, physical_batch_size=5))  # fmt: skip
    assert ref.norm() > 1e-2
    assert [sum(s) for s in virt.items] == [sum(s) for s in one.items]  # the same draws
    assert all(len(s) == 1 for s in one.items)
    assert any(len(s) > 1 for s in virt.items)  # the logical batches were really split
    assert (got - ref).norm() <= 1e-6 * ref.norm()
    assert virt.privacy_engine.steps_taken == one.privacy_engine.steps_taken == 3


def test_forward_batches_are_at_most_the_physical_size(make, tmp_path):
    """The memory bound: no forward sees more than physical_batch_size examples, and each
    physical batch is collated only after the previous one's forward (never the whole logical
    batch's inputs at once)."""
    model, ds, collator = make()
    forwards_at_collate = []

    def lazy_checked(features):
        forwards_at_collate.append(len(trainer.forward_rows))
        return collator(features)

    privacy = PrivacyArguments(noise_multiplier=1.0, insecure_seed=5, physical_batch_size=4)
    trainer = Recording(model=model, args=targs(tmp_path, per_device_train_batch_size=24),
                        train_dataset=ds, data_collator=lazy_checked, privacy=privacy)  # fmt: skip
    trainer.train()
    sizes = [s for item in trainer.items if item is not None for s in item]
    assert max(trainer.forward_rows) == 4 == max(sizes)
    assert len(sizes) > 3 * 2  # several physical batches per logical batch
    assert len(forwards_at_collate) == len(sizes)
    assert all(seen >= i for i, seen in enumerate(forwards_at_collate))


def test_one_noise_draw_per_logical_step_and_accounting_unchanged(make, tmp_path, noise_draws):
    """Four logical steps of about 16 examples in physical batches of 3: four noise draws (not
    one per physical batch), four accounted steps at q = 16/96, epsilon as dp-accounting."""
    privacy = PrivacyArguments(noise_multiplier=1.0, target_delta=1e-4, insecure_seed=7,
                               physical_batch_size=3)  # fmt: skip
    trainer, _ = run(make, tmp_path, privacy, max_steps=4)
    engine = trainer.privacy_engine
    assert sum(len(s) for s in trainer.items if s) > 4 * 2  # many physical batches
    assert len(noise_draws) == engine.steps_taken == trainer.state.global_step == 4
    assert engine.sample_rate == 16 / N
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(16 / N, dp_accounting.GaussianDpEvent(1.0)), 4)
    assert engine.epsilon() == pytest.approx(acc.get_epsilon(1e-4), rel=1e-9)


def test_noise_of_one_logical_step_has_the_one_draw_scale(make, tmp_path):
    """Same draws at sigma=0 and sigma=2 (insecure_seed), one SGD step at lr 1: the difference
    of the updates is the noise / B, so its spread times B is sigma * R, not sqrt(k) times it
    (what k draws, one per physical batch, would give)."""
    sigma, b = 2.0, 16
    kw = dict(max_steps=1, learning_rate=1.0, per_device_train_batch_size=b)
    _, quiet = run(make, tmp_path / "q", PrivacyArguments(
        noise_multiplier=0.0, insecure_seed=9, physical_batch_size=2), **kw)  # fmt: skip
    trainer, noisy = run(make, tmp_path / "n", PrivacyArguments(
        noise_multiplier=sigma, insecure_seed=9, physical_batch_size=2), **kw)  # fmt: skip
    assert len(trainer.items[0]) > 4
    noise = (quiet - noisy) * b  # SGD: p -= lr * (sum + noise) / B
    assert noise.numel() > 300  # relative standard error of the std: under 4.1%
    assert noise.std().item() == pytest.approx(sigma * 1.0, rel=0.15)
    assert abs(noise.mean().item()) < 4 * sigma / noise.numel() ** 0.5


def test_empty_logical_batches_are_noise_only_steps_with_physical_batches(
    make, tmp_path, noise_draws
):
    """q = 1/96: many logical batches are empty; each is still one noised, accounted step."""
    privacy = PrivacyArguments(noise_multiplier=1.0, insecure_seed=1, physical_batch_size=1)
    trainer, _ = run(make, tmp_path, privacy, max_steps=6, per_device_train_batch_size=1)
    assert None in trainer.items and any(trainer.items)
    assert trainer.state.global_step == trainer.privacy_engine.steps_taken == 6
    assert len(noise_draws) == 6 == len(trainer.items)


@pytest.mark.parametrize("bad", [0, -3])
def test_physical_batch_size_must_be_positive(bad):
    with pytest.raises(DPFitError, match="physical_batch_size"):
        PrivacyArguments(physical_batch_size=bad)
