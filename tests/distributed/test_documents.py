"""privacy_unit="document" on a gloo process group of 2 ranks (one OS process each): ranks hold
whole documents, each document is clipped once (against the microbatch-of-one oracle), the
noise is drawn once per logical step, and the accounting is the one-process figure over
documents. One job runs every scenario of document_worker.py once per rank; the world-size-1
references run in this process."""

from __future__ import annotations

import dp_accounting
import pytest
import torch
from conftest import launch, results
from noise_check import assert_std

pytest.importorskip("transformers")

import document_worker as worker  # noqa: E402  (imports transformers)
from long_llama import tiny_long_llama  # noqa: E402
from oracle import oracle_per_example  # noqa: E402

from dpfit.causal_lm import causal_lm_loss, make_collate  # noqa: E402

R_STRADDLE = 0.05  # below a quarter of every STRADDLE_DOCS document's gradient norm
STRADDLE = f"straddle:{R_STRADDLE}"


def _job(tmp_path_factory, *specs: str) -> list[dict]:
    out = tmp_path_factory.mktemp("dist_documents")
    codes = launch(out, 2, *specs, script="document_worker.py")
    assert codes == [0, 0], launch.logs
    return results(out, 2)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Every scenario in one job (starting the two ranks costs more than any scenario): the
    deterministic ones (sigma = 0, or a refusal) and noisy steps with OS-seeded sampling."""
    return _job(tmp_path_factory, "update", STRADDLE, "refused", "noise")


def _documents_of(rows: list[tuple[int, int]]) -> dict[int, list[int]]:
    """{document: the windows of it seen, in order}."""
    seen: dict[int, list[int]] = {}
    for d, k in rows:
        seen.setdefault(d, []).append(k)
    return seen


def test_two_ranks_give_the_one_process_update(job):
    """sigma = 0, one insecure seed: the same sampled documents in 1 and 2 processes, and the
    same parameters after 4 logical steps (some documents clipped, some not)."""
    start = worker.trainable(tiny_long_llama())
    ref = worker.update(1)
    assert ref["steps"] == 4
    change = ref["params"] - start
    assert change.norm() > 0
    for rank in (0, 1):
        got = job[rank]["update"]
        assert got["steps"] == 4
        err = (got["params"] - start - change).norm() / change.norm()
        assert err <= 1e-6, (rank, float(err))
    windows = [len(d) for d in worker.documents(worker.UPDATE_DOCS)]
    for step, rows in ref["drawn"].items():
        parts = [_documents_of(job[r]["update"]["drawn"].get(step, [])) for r in (0, 1)]
        assert not set(parts[0]) & set(parts[1]), f"a document on both ranks in step {step}"
        assert {**parts[0], **parts[1]} == _documents_of(rows), step  # the one-process batch
        for part in parts:  # every window of each of its documents, in order
            assert all(ks == list(range(windows[d])) for d, ks in part.items()), (step, part)


def _oracle_rows(docs) -> tuple[torch.Tensor, torch.Tensor]:
    """(each window's gradient computed alone in float64, its document)."""
    model = tiny_long_llama().train()
    flat = [row for doc in docs for row in doc]
    collate = make_collate(0)
    per = oracle_per_example(
        model, lambda i: causal_lm_loss(model, collate([flat[i][2]])), len(flat)
    )
    rows = torch.cat(
        [per[n].reshape(len(flat), -1) for n, p in model.named_parameters() if p.requires_grad], 1
    )
    return rows, torch.tensor([d for d, _, _ in flat])


def _clipped_sum(grads: torch.Tensor, r: float) -> torch.Tensor:
    factors = (r / grads.norm(dim=1)).clamp(max=1.0)
    return (factors[:, None] * grads).sum(0)


def test_a_document_is_clipped_once_whole_on_one_rank(job):
    """q = 1, three documents of 3, 1 and 2 windows: rank 0 holds documents 0 and 2 (document
    0 spans two physical batches), rank 1 document 1. The released gradient is the sum over
    documents of (their windows' float64 gradients summed, then clipped) / B, to 1e-5."""
    docs = worker.documents(worker.STRADDLE_DOCS)
    rows, owner = _oracle_rows(docs)
    grads = torch.zeros(len(docs), rows.shape[1], dtype=rows.dtype).index_add_(0, owner, rows)
    assert R_STRADDLE < 0.25 * float(grads.norm(dim=1).min())  # every document is clipped
    want = _clipped_sum(grads, R_STRADDLE) / len(docs)

    for rank in (0, 1):
        got = job[rank][STRADDLE]["released"].double()
        err = (got - want).abs().max() / want.abs().max()
        assert err <= 1e-5, (rank, float(err))
    assert _documents_of(job[0][STRADDLE]["rows"]) == {0: [0, 1, 2], 2: [0, 1]}
    assert _documents_of(job[1][STRADDLE]["rows"]) == {1: [0]}
    assert job[0][STRADDLE]["batches"] == 3 and job[1][STRADDLE]["batches"] == 1

    # what splitting rows among ranks (every second window) and clipping each rank's part of
    # a document alone would release instead: documents 0 and 2 clipped twice
    part = torch.arange(len(owner)) % 2
    pieces = torch.zeros(2 * len(docs), rows.shape[1], dtype=rows.dtype)
    pieces.index_add_(0, owner * 2 + part, rows)
    pieces = pieces[pieces.norm(dim=1) > 0]
    assert len(pieces) == 5  # documents 0 and 2 straddle
    split = _clipped_sum(pieces, R_STRADDLE) / len(docs)
    assert (split - want).abs().max() > 1e-2 * want.abs().max()


def test_noise_is_drawn_once_per_step_across_ranks(job):
    """Zero gradients: each update is N(0, (sigma R / B)^2) per coordinate, for 1 and 2 ranks
    (a draw on every rank would show sqrt(2) times that)."""
    std = 1.0 * 1.0 / 4
    assert_std(job[0]["noise"]["deltas"], std)
    assert_std(worker.noise(1, steps=16)["deltas"], std)


def test_ranks_stay_identical_and_epsilon_is_the_one_process_figure_over_documents(job):
    a, b = job[0]["noise"], job[1]["noise"]
    assert a["steps"] == b["steps"] == 32
    assert torch.equal(a["params"], b["params"])
    # equal after every step count both ranks saw (which counts each rank sees depends on
    # the draws: a rank with an empty share steps inside the loader)
    both = sorted(a["seen"].keys() & b["seen"].keys())
    assert both[-1] == 32 and len(both) > 2
    assert all(torch.equal(a["seen"][k], b["seen"][k]) for k in both)
    assert a["deltas"].abs().sum() > 0
    q = 4 / len(worker.UPDATE_DOCS)
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.0)), 32)
    assert a["epsilon"] == b["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    assert a["record"]["privacy_unit"] == "document"
    assert a["record"]["sample_rate"] == q and a["record"]["history"] == b["record"]["history"]


def test_user_drawn_document_batches_are_refused_on_several_ranks(job):
    """The engine cannot see whether a user's loop split a document among ranks."""
    for rank in (0, 1):
        error = job[rank]["refused"]["error"]
        assert error is not None and "engine.data_loader" in error
