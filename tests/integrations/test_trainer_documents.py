"""DPTrainer with PrivacyArguments(privacy_unit="document"): each train_dataset item is a
document (a list of rows, e.g. the windows of a long text), sampled as one, its rows' summed
gradient clipped once (also across physical batches), and n counts documents. Checked against
the engine called directly, the microbatch-of-one oracle (float64) and dp-accounting."""

import json

import pytest
import torch
import torch.nn.functional as F
from accounting_oracle import ADD_REMOVE, direct_epsilon
from trainer_args import sgd_training_args, stop_at, trainable

pytest.importorskip("transformers")

from transformers import DataCollatorWithPadding  # noqa: E402

import dpfit  # noqa: E402
import dpfit.engine  # noqa: E402
from dpfit.errors import DPFitError  # noqa: E402
from dpfit.integrations import DPTrainer, PrivacyArguments  # noqa: E402
from dpfit.integrations.trainer import ENGINE_STATE_NAME  # noqa: E402
from dpfit.models import head_module_names, load_classifier, save_tiny_random_model  # noqa: E402
from dpfit.params import make_bias_trainable  # noqa: E402
from dpfit.sampling import EmptyBatch, PhysicalBatches  # noqa: E402

WORDS = ("good", "bad", "great", "awful", "fine", "poor")
# publicly known: logged, saved and accounted figures may depend on these, never on the rows
TIMING_KEYS = {"train_runtime", "train_samples_per_second", "train_steps_per_second"}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_random_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture
def make(tiny_folder):
    """make(rows_per_doc, dtype) -> (model, documents, collator): a fresh, identically
    initialised classifier (dropout off) and one document per entry of rows_per_doc, each a
    list of tokenized rows of different lengths sharing the document's label.

    The head is random, not zero as load_classifier leaves it, so that the first step's
    gradient reaches the backbone's biases and differs between rows; labels are unbalanced,
    so that the documents' clipped gradients do not cancel in their sum."""

    def build(rows_per_doc, dtype=torch.float32):
        loaded = load_classifier(tiny_folder, ["neg", "pos"], seed=0)
        for m in loaded.model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        head = loaded.model.head.weight
        with torch.no_grad():
            head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(0)))
        docs = []
        for d, k in enumerate(rows_per_doc):
            label = int(d % 3 != 2)
            texts = [
                f"the film was {WORDS[(d + 2 * r) % 6]} " * (1 + (d + r) % 3) for r in range(k)
            ]
            docs.append([{**loaded.tokenizer(t), "label": label} for t in texts])
        return loaded.model.to(dtype), docs, DataCollatorWithPadding(loaded.tokenizer)

    return build


def targs(tmp_path, **kw):
    return sgd_training_args(
        tmp_path, **{**dict(per_device_train_batch_size=4, max_steps=1, learning_rate=1.0), **kw}
    )


class Recording(DPTrainer):
    """Records the physical batch sizes (rows) of each logical item Trainer hands over."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.items: list[tuple[int, ...] | None] = []  # None: EMPTY_BATCH

    def training_step(self, model, inputs, num_items_in_batch=None):
        assert isinstance(inputs, EmptyBatch | PhysicalBatches)
        self.items.append(None if isinstance(inputs, EmptyBatch) else inputs.sizes)
        return super().training_step(model, inputs, num_items_in_batch)


def document_privacy(**kw):
    return PrivacyArguments(privacy_unit="document", **kw)


def run(make, tmp_path, rows_per_doc, privacy, dtype=torch.float32, **kw):
    """Train; return (trainer, update of the trainables)."""
    model, docs, collator = make(rows_per_doc, dtype)
    trainer = Recording(model=model, args=targs(tmp_path, **kw), train_dataset=docs,
                        data_collator=collator, privacy=privacy)  # fmt: skip
    start = trainable(model).clone()  # after DPTrainer made only the biases and head train
    trainer.train()
    return trainer, trainable(model) - start


def logits_of(model, batch):
    out = model(**{k: v for k, v in batch.items() if k != "labels"})
    return out["logits"] if isinstance(out, dict) else out[0]


# ----------------------------------------------------------------- against the engine
def test_one_step_is_the_engines_document_step(make, tmp_path):
    """sigma=0, insecure_seed: one DPTrainer step over 12 documents (expected 4, physical
    batches of 3 rows) is the step of a PrivacyEngine(privacy_unit="document") driven by hand
    over the same documents with the same seed (same draw), to 1e-6 relative."""
    rows_per_doc = (2, 1, 3, 2, 1, 4, 2, 3, 1, 2, 2, 3)
    seed, physical, r = 4, 3, 0.05
    privacy = document_privacy(noise_multiplier=0.0, insecure_seed=seed, max_grad_norm=r,
                               physical_batch_size=physical)  # fmt: skip
    trainer, got = run(make, tmp_path, rows_per_doc, privacy, learning_rate=0.5)
    assert trainer.privacy_engine.steps_taken == 1
    (sizes,) = trainer.items
    assert sizes is not None and len(sizes) > 1  # a real, split draw

    model, docs, collator = make(rows_per_doc)
    make_bias_trainable(model, train_head=head_module_names(model))
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=4, sample_size=len(docs), noise_multiplier=0.0,
        max_grad_norm=r, insecure_seed=seed, privacy_unit="document",
    )  # fmt: skip
    opt = torch.optim.SGD(engine.parameters(), lr=0.5)
    start = trainable(model).clone()
    seen = []
    for batch in engine.data_loader(docs, collator, physical_batch_size=physical, optimizer=opt):
        seen.append(len(batch["labels"]))
        F.cross_entropy(logits_of(model, batch), batch["labels"]).backward()
        if engine.step(opt):
            break
    engine.detach()
    want = trainable(model) - start
    assert tuple(seen) == sizes  # the same documents, cut into the same physical batches
    drawn = engine.ledger.steps == 1 and sum(sizes) < sum(rows_per_doc)
    assert drawn and want.norm() > 1e-3
    assert (got - want).norm() <= 1e-6 * want.norm()


# ----------------------------------------------------------------- against the oracle
def row_gradients(make, rows_per_doc) -> tuple[torch.Tensor, torch.Tensor]:
    """float64: (rows, trainables), each row's loss backpropagated alone (a batch of one),
    and (documents, trainables), their sums over each document's rows."""
    model, docs, collator = make(rows_per_doc, torch.float64)
    make_bias_trainable(model, train_head=head_module_names(model))
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for doc in docs:
        for row in doc:
            batch = collator([row])
            loss = F.cross_entropy(logits_of(model, batch), batch["labels"], reduction="sum")
            rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    per_row = torch.stack(rows)
    owner = torch.tensor([d for d, k in enumerate(rows_per_doc) for _ in range(k)])
    per_doc = torch.zeros(len(docs), per_row.shape[1], dtype=per_row.dtype)
    return per_row, per_doc.index_add_(0, owner, per_row)


def clipped_mean(grads: torch.Tensor, r: float, b: int) -> torch.Tensor:
    factors = (r / grads.norm(dim=1)).clamp(max=1.0)
    return (factors[:, None] * grads).sum(0) / b


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    err = (got.to(want.dtype) - want).abs().max() / want.abs().max()
    assert err <= rtol, f"relative error {err:.2e}"


def test_each_document_is_clipped_once_as_the_oracle_says(make, tmp_path, recorded_norms):
    """float64, q = 1 (every document), sigma = 0, R below every document's norm: the norms
    clipped are the documents' (the sum of each document's rows' gradients, each row alone),
    and the update is their clipped mean, to 1e-5 relative. Physical batches of 3 rows cut
    documents of 2, 3, 1 and 2 rows as [a a b | b b c | d d]: document b straddles two."""
    rows_per_doc = (2, 3, 1, 2)
    per_row, grads = row_gradients(make, rows_per_doc)
    norms = grads.norm(dim=1)
    r = 0.25 * float(norms.min())
    privacy = document_privacy(noise_multiplier=0.0, max_grad_norm=r, physical_batch_size=3,
                               clipping="test-recording", insecure_seed=0)  # fmt: skip
    trainer, update = run(make, tmp_path, rows_per_doc, privacy, dtype=torch.float64,
                          per_device_train_batch_size=len(rows_per_doc))  # fmt: skip
    assert trainer.items == [(3, 3, 2)]
    (clipped,) = recorded_norms  # one clip, at the end of the logical batch
    assert_close(clipped, norms)
    want = clipped_mean(grads, r, len(rows_per_doc))
    assert_close(-update, want)  # SGD at lr 1: the update is minus the released gradient
    # each row clipped alone would release something else (a row-level bound)
    rows_alone = clipped_mean(per_row, r, len(rows_per_doc))
    assert (rows_alone - want).abs().max() > 1e-3 * want.abs().max()


# ----------------------------------------------------------------- accounting
def test_epsilon_counts_documents(make, tmp_path):
    """12 documents of 1-4 rows, expected 3 per step, 4 steps at sigma 1: epsilon is
    dp-accounting's for q = 3/12 (documents), not for q over rows; dpfit.json says so."""
    rows_per_doc = (1, 4, 2, 3, 1, 2, 4, 1, 3, 2, 1, 2)
    sigma, delta, steps, expected = 1.0, 1e-4, 4, 3
    privacy = document_privacy(noise_multiplier=sigma, target_delta=delta, insecure_seed=2,
                               physical_batch_size=2)  # fmt: skip
    trainer, _ = run(make, tmp_path, rows_per_doc, privacy, max_steps=steps,
                     per_device_train_batch_size=expected)  # fmt: skip
    engine = trainer.privacy_engine
    assert engine.steps_taken == trainer.state.global_step == steps
    want = direct_epsilon(sigma, expected / len(rows_per_doc), steps, delta, ADD_REMOVE, "rdp")
    assert engine.epsilon() == pytest.approx(want, rel=1e-9)
    over_rows = direct_epsilon(sigma, expected / sum(rows_per_doc), steps, delta, ADD_REMOVE, "rdp")
    assert abs(over_rows - want) > 0.05 * want  # the test tells documents from rows
    assert trainer.state.log_history[-1]["epsilon"] == pytest.approx(want, rel=1e-9)
    trainer.save_model(str(tmp_path / "saved"))
    record = json.loads((tmp_path / "saved" / "dpfit.json").read_text())
    assert record["privacy_unit"] == "document"
    assert record["sample_size"] == len(rows_per_doc) and record["expected_batch_size"] == 3


def test_nothing_published_depends_on_the_number_of_rows(make, tmp_path):
    """The same 6 documents cut into 1 or into 3 rows each (same seed, so the same draws):
    every log entry (timing aside), the checkpoint's trainer_state and dpfit.json are the same,
    so they reveal nothing of the windows' count (a function of the private texts' lengths)."""
    privacy = document_privacy(noise_multiplier=1.0, insecure_seed=5)
    kw = dict(max_steps=2, per_device_train_batch_size=2, save_strategy="steps", save_steps=2)
    published, drawn = [], []
    for rows in (1, 3):
        folder = tmp_path / f"rows{rows}"
        trainer, _ = run(make, folder, (rows,) * 6, privacy, **kw)
        drawn.append([0 if s is None else sum(s) for s in trainer.items])  # rows per step
        trainer.save_model(str(folder / "saved"))
        state = json.loads((folder / "out" / "checkpoint-2" / "trainer_state.json").read_text())
        logs = [{k: v for k, v in e.items() if k not in TIMING_KEYS}
                for e in trainer.state.log_history]  # fmt: skip
        published.append({
            "logs": logs,
            "keys": [sorted(e) for e in trainer.state.log_history],
            "state": {k: v for k, v in state.items() if k != "log_history"},
            "record": json.loads((folder / "saved" / "dpfit.json").read_text()),
        })  # fmt: skip
    assert drawn[1] == [3 * k for k in drawn[0]] and sum(drawn[0]) > 0  # same draws, 3x rows
    assert published[0] == published[1]
    assert published[0]["state"]["total_flos"] == 0


def test_resume_continues_the_same_document_run(make, tmp_path):
    """2 steps, checkpoint, resume 2 more: the same steps, epsilon (over documents) and
    trainables as 4 uninterrupted steps, with documents straddling physical batches
    (insecure_seed makes the two runs comparable)."""
    rows_per_doc = (1, 3, 2, 1, 2, 3, 1, 2)
    privacy = document_privacy(noise_multiplier=1.0, target_delta=1e-4, insecure_seed=7,
                               physical_batch_size=2)  # fmt: skip
    kw = dict(max_steps=4, per_device_train_batch_size=3, save_strategy="steps", save_steps=2)
    whole, _ = run(make, tmp_path / "whole", rows_per_doc, privacy, **kw)
    want = trainable(whole.model)

    model, docs, collator = make(rows_per_doc)
    first = DPTrainer(model=model, args=targs(tmp_path, **kw), train_dataset=docs,
                      data_collator=collator, privacy=privacy, callbacks=[stop_at(2)])  # fmt: skip
    first.train()
    assert first.privacy_engine.steps_taken == 2
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / ENGINE_STATE_NAME).is_file()

    model, docs, collator = make(rows_per_doc)
    resumed = DPTrainer(model=model, args=targs(tmp_path, **kw), train_dataset=docs,
                        data_collator=collator, privacy=privacy)  # fmt: skip
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.privacy_engine.steps_taken == whole.privacy_engine.steps_taken == 4
    assert resumed.privacy_engine.epsilon() == pytest.approx(
        whole.privacy_engine.epsilon(), rel=1e-9
    )
    assert resumed.privacy_engine.config.sample_size == len(rows_per_doc)  # documents, not rows
    torch.testing.assert_close(trainable(model), want, rtol=0, atol=1e-6)
    assert not torch.equal(want, trainable(make(rows_per_doc)[0]))  # it trained


# ----------------------------------------------------------------- edge cases and errors
def test_documents_without_rows_are_noise_only_steps(make, tmp_path, monkeypatch):
    """Two documents, both empty (q = 1: each step draws both, and no row): every step is
    still a noised, accounted step that Trainer counts (EMPTY_BATCH), not a skipped one."""
    draws = []
    real = dpfit.engine.gaussian_noise

    def counting(shape, *a, **kw):
        draws.append(tuple(shape))
        return real(shape, *a, **kw)

    monkeypatch.setattr(dpfit.engine, "gaussian_noise", counting)
    privacy = document_privacy(noise_multiplier=1.0, insecure_seed=0)
    trainer, update = run(make, tmp_path, (0, 0), privacy, max_steps=3,
                          per_device_train_batch_size=2)  # fmt: skip
    assert trainer.items == [None] * 3
    assert trainer.state.global_step == trainer.privacy_engine.steps_taken == len(draws) == 3
    assert update.abs().sum() > 0  # the noise was released


def test_bad_privacy_unit_is_refused():
    with pytest.raises(DPFitError, match="privacy_unit must be one of"):
        PrivacyArguments(privacy_unit="window")


def test_a_dataset_of_rows_is_refused_as_documents(make, tmp_path):
    """A dataset whose items are rows (dicts) is not a dataset of documents: refused at
    construction, saying how to group rows, before anything is sampled."""
    model, docs, collator = make((2, 1))
    rows = [row for doc in docs for row in doc]
    trainables = [p.requires_grad for p in model.parameters()]
    with pytest.raises(DPFitError, match=r"documents, each a list of rows.*dict"):
        DPTrainer(model=model, args=targs(tmp_path), train_dataset=rows, data_collator=collator,
                  privacy=document_privacy(noise_multiplier=1.0))  # fmt: skip
    assert [p.requires_grad for p in model.parameters()] == trainables  # left as it was
    assert all(trainables)  # as loaded: bias-only training would have frozen the weights
    # a row among documents is found wherever it is, not only as the first item
    mixed = [*docs, rows[0]]
    with pytest.raises(DPFitError, match=rf"item {len(docs)} is a dict"):
        DPTrainer(model=model, args=targs(tmp_path), train_dataset=mixed,
                  data_collator=collator, privacy=document_privacy(noise_multiplier=1.0))  # fmt: skip
