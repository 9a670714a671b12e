"""privacy_unit="document": a long document's windows are sampled together and their summed
gradient is clipped once, checked against the microbatch-of-one oracle at 2,048 tokens
(each window alone, float64; a document's gradient = the sum of its windows' gradients)."""

from __future__ import annotations

import pytest
import torch
from long_llama import T, tiny_long_llama, token_ids
from oracle import Capture, assert_close_to_oracle, oracle_per_example

import dpfit
from dpfit.causal_lm import causal_lm_loss, make_collate, windows
from dpfit.errors import SamplingError

pytest.importorskip("transformers")

STRIDE = 1536  # 512 tokens of overlap
# documents of 2, 3 and 1 windows: the 3-window one spans two physical batches of 2
DOC_LENGTHS = (2500, 5000, 1200)


def _documents() -> list[list]:
    return [windows(token_ids(n, seed=10 + i), T, STRIDE) for i, n in enumerate(DOC_LENGTHS)]


def _document_gradients(model, docs) -> torch.Tensor:
    """(documents, trainable elements): each window's gradient alone, summed per document."""
    collate = make_collate(0)
    flat = [w for ws in docs for w in ws]
    per = oracle_per_example(model, lambda i: causal_lm_loss(model, collate([flat[i]])), len(flat))
    rows = torch.cat(
        [per[n].reshape(len(flat), -1) for n, p in model.named_parameters() if p.requires_grad], 1
    )
    owner = torch.tensor([d for d, ws in enumerate(docs) for _ in ws])
    return torch.zeros(len(docs), rows.shape[1], dtype=rows.dtype).index_add_(0, owner, rows)


def _released(model, docs, max_grad_norm: float, physical: int = 2) -> torch.Tensor:
    """One logical step of the engine over every document (q = 1), noise 0."""
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=len(docs), sample_size=len(docs), noise_multiplier=0.0,
        max_grad_norm=max_grad_norm, clipping="flat", privacy_unit="document",
    )  # fmt: skip
    opt = Capture(engine.parameters())
    loader = engine.data_loader(docs, make_collate(0), physical_batch_size=physical, optimizer=opt)
    batches = 0
    for batch in loader:
        causal_lm_loss(model, batch).backward()
        batches += 1
        if engine.step(opt):
            break
    assert batches == 3  # 6 windows in physical batches of 2: documents span batches
    assert engine.privacy_record()["privacy_unit"] == "document"
    engine.detach()
    return torch.cat([opt.grads[p].flatten() for p in engine.parameters()])


def _clipped_mean(grads: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    factors = (max_grad_norm / grads.norm(dim=1)).clamp(max=1.0)
    return (factors[:, None] * grads).sum(0) / grads.shape[0]


@pytest.fixture(scope="module")
def oracle():
    docs = _documents()
    assert [len(ws) for ws in docs] == [2, 3, 1] and max(len(w.ids) for ws in docs for w in ws) == T
    grads = _document_gradients(tiny_long_llama().train(), docs)
    return docs, grads


def test_unclipped_step_is_the_sum_of_document_gradients(oracle):
    docs, grads = oracle
    got = _released(tiny_long_llama().train(), docs, max_grad_norm=1e6)
    assert_close_to_oracle(got, grads.sum(0) / len(docs))


def test_each_document_is_clipped_as_one_contribution(oracle):
    """A clip norm below every document's norm: each document contributes exactly R / B in
    its summed gradient's direction, whatever its number of windows or physical batches."""
    docs, grads = oracle
    norms = grads.norm(dim=1)
    r = 0.25 * float(norms.min())
    got = _released(tiny_long_llama().train(), docs, max_grad_norm=r)
    assert_close_to_oracle(got, _clipped_mean(grads, r))
    # clipping each window alone would release something else (a window-level bound)
    windows_alone = _clipped_mean(_window_rows(docs), r) * len(_window_rows(docs)) / len(docs)
    assert (windows_alone - got.double()).abs().max() > 1e-3 * got.abs().max()


def _window_rows(docs) -> torch.Tensor:
    model = tiny_long_llama().train()
    collate = make_collate(0)
    flat = [w for ws in docs for w in ws]
    per = oracle_per_example(model, lambda i: causal_lm_loss(model, collate([flat[i]])), len(flat))
    return torch.cat(
        [per[n].reshape(len(flat), -1) for n, p in model.named_parameters() if p.requires_grad], 1
    )


def test_user_poisson_steps_take_document_ids():
    """sampling='user-poisson': the caller names each row's document; rows of one document
    are clipped together (two rows of one document, R tiny: the step has norm R / B)."""
    model = tiny_long_llama().train()
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=1, sample_size=10, noise_multiplier=0.0, max_grad_norm=1e-4,
        sampling="user-poisson", privacy_unit="document",
    )  # fmt: skip
    opt = Capture(engine.parameters())
    batch = make_collate(0)(_documents()[0])
    causal_lm_loss(model, batch).backward()
    with pytest.raises(SamplingError, match="documents="):
        engine.step(opt, batch_size=2)
    engine.step(opt, batch_size=2, documents=[7, 7])  # the rows were kept for this call
    released = torch.cat([opt.grads[p].flatten() for p in engine.parameters()])
    assert float(released.norm()) == pytest.approx(1e-4, rel=1e-4)
    engine.detach()


def test_document_unit_needs_bias_mode():
    with pytest.raises(ValueError, match="mode='bias'"):
        dpfit.PrivacyEngine(
            tiny_long_llama(), expected_batch_size=1, sample_size=10, noise_multiplier=1.0,
            mode="full", privacy_unit="document",
        )  # fmt: skip


def test_a_logical_batch_of_documents_without_rows_is_a_noise_only_step():
    """Sampled documents that have no rows give no physical batch, but the logical batch is
    still a step: noised and accounted (inside the loader, or as EMPTY_BATCH for loops that
    take one item per step), never skipped, which would make the number of released steps
    depend on the data (and, data-parallel, leave that rank out of the step's reduce)."""
    from dpfit.sampling import EMPTY_BATCH

    for yield_empty in (False, True):
        model = tiny_long_llama().train()
        engine = dpfit.PrivacyEngine(
            model, expected_batch_size=2, sample_size=2, noise_multiplier=1.0,
            privacy_unit="document", insecure_seed=0,
        )  # fmt: skip
        opt = Capture(engine.parameters())
        loader = engine.data_loader(
            [[], []], make_collate(0), optimizer=opt, yield_empty=yield_empty
        )
        items = list(loader)  # q = 1: one logical step per pass, drawing both documents
        assert items == ([EMPTY_BATCH] if yield_empty else [])
        if yield_empty:
            engine.empty_step(opt)
        assert engine.steps_taken == 1
        released = torch.cat([opt.grads[p].flatten() for p in engine.parameters()])
        assert released.abs().sum() > 0  # the noise
        engine.detach()
