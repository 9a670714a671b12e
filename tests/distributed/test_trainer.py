"""DPTrainer under torchrun: 2 gloo ranks (started with torchrun's environment, so
transformers and accelerate set up the group and wrap the model in DDP themselves) against
one process."""

from __future__ import annotations

import dp_accounting
import pytest
import torch
from conftest import launch, results

pytest.importorskip("transformers")
pytest.importorskip("datasets")

import trainer_worker  # noqa: E402

from dpfit.integrations.trainer import ENGINE_STATE_NAME  # noqa: E402
from dpfit.models import save_tiny_random_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_random_model(tmp_path_factory.mktemp("tiny") / "m"))


@pytest.fixture(scope="module")
def job(tmp_path_factory, model_dir):
    out = tmp_path_factory.mktemp("trainer")
    codes = launch(out, 2, model_dir, "update", "update_physical", "resume", "update_documents",
                   "update_users", script="trainer_worker.py", timeout=400)  # fmt: skip
    assert codes == [0, 0], launch.logs
    return results(out, 2)


def test_two_ranks_give_the_one_process_update(job, model_dir, tmp_path):
    """sigma=0, q=1: the logical batch is every example, split between the ranks (each rank
    pads its own share); 3 steps match one process to 1e-6."""
    ref = trainer_worker.run(1, tmp_path, model_dir, "update")
    assert ref["delta"].norm() > 1e-2
    for rank in (0, 1):
        got = job[rank]["update"]
        assert got["steps"] == got["global_step"] == 3
        assert got["sample_rate"] == ref["sample_rate"] == 1.0
        err = (got["delta"] - ref["delta"]).norm()
        assert err <= 1e-6 * ref["delta"].norm(), (rank, err)


def test_two_ranks_with_physical_batches_give_the_one_process_update(job, model_dir, tmp_path):
    """As above, each rank's share of 12 split into physical batches of 5:
    the 3 steps still match one process in one pass to 1e-6, and DDP never reduces."""
    ref = trainer_worker.run(1, tmp_path, model_dir, "update")
    assert ref["physical_sizes"] == [(24,)] * 3
    for rank in (0, 1):
        got = job[rank]["update_physical"]
        assert got["physical_sizes"] == [(5, 5, 2)] * 3
        assert got["steps"] == got["global_step"] == 3
        assert got["ddp_reduces"] == 0
        err = (got["delta"] - ref["delta"]).norm()
        assert err <= 1e-6 * ref["delta"].norm(), (rank, err)


def test_two_ranks_with_documents_give_the_one_process_update(job, model_dir, tmp_path):
    """privacy_unit="document", sigma=0, q=1, a clip norm that clips: each rank holds whole
    documents (every other one, so its rows are theirs) in physical batches of 3 rows, each
    document summed and clipped once on its rank; 3 steps match one process to 1e-6."""
    ref = trainer_worker.run(1, tmp_path, model_dir, "update_documents")
    unclipped = trainer_worker.run(1, tmp_path / "u", model_dir, "update_documents:1e6")
    assert ref["delta"].norm() > 1e-2
    assert (unclipped["delta"] - ref["delta"]).norm() > 1e-2 * ref["delta"].norm()  # it clips
    rows = trainer_worker.DOC_ROWS
    assert ref["physical_sizes"] == [(3,) * (sum(rows) // 3)] * 3
    for rank in (0, 1):
        got = job[rank]["update_documents"]
        assert [sum(s) for s in got["physical_sizes"]] == [sum(rows[rank::2])] * 3
        assert got["steps"] == got["global_step"] == 3 and got["ddp_reduces"] == 0
        assert got["sample_rate"] == 1.0
        err = (got["delta"] - ref["delta"]).norm()
        assert err <= 1e-6 * ref["delta"].norm(), (rank, err)


def test_two_ranks_with_users_give_the_one_process_update(job, model_dir, tmp_path):
    """privacy_unit="user" from a row dataset with a user column, sigma=0, q=1, a clip norm
    that clips: DPTrainer groups the rows per user, each rank holds whole users (a user's rows
    never split between ranks), each user summed and clipped once; 3 steps match one process
    to 1e-6, and match the documents scenario (the same rows grouped by hand)."""
    ref = trainer_worker.run(1, tmp_path, model_dir, "update_users")
    unclipped = trainer_worker.run(1, tmp_path / "u", model_dir, "update_users:1e6")
    assert ref["delta"].norm() > 1e-2
    assert (unclipped["delta"] - ref["delta"]).norm() > 1e-2 * ref["delta"].norm()  # it clips
    rows = trainer_worker.DOC_ROWS
    shares = []
    for rank in (0, 1):
        got = job[rank]["update_users"]
        assert got["steps"] == got["global_step"] == 3 and got["ddp_reduces"] == 0
        assert got["sample_rate"] == 1.0
        shares.append({sum(s) for s in got["physical_sizes"]})
        err = (got["delta"] - ref["delta"]).norm()
        assert err <= 1e-6 * ref["delta"].norm(), (rank, err)
    # each rank's rows every step are whole users' rows, together all of them
    assert len(shares[0]) == len(shares[1]) == 1
    assert shares[0].pop() + shares[1].pop() == sum(rows)
    docs = job[0]["update_documents"]
    assert (docs["delta"] - ref["delta"]).norm() <= 1e-6 * ref["delta"].norm()


def test_ddp_never_reduces_unclipped_gradients(job):
    """Trainer wraps the model in DDP; DDP's own all-reduce (counted through its comm hook)
    must never run: it would average raw gradients, and the engine reduces clipped sums."""
    for rank in (0, 1):
        for run in (job[rank]["update"], job[rank]["resume"]["first"]):
            assert run["wrapped"] == "DistributedDataParallel"
            assert run["ddp_reduces"] == 0


def test_ddp_buffer_broadcast_off_without_deprecated_arguments(job):
    """The model has buffers, so DDP's broadcast in every forward (a collective a rank with an
    empty share would skip) must be off, set without DDP's deprecated broadcast_buffers."""
    for rank in (0, 1):
        for run in (job[rank]["update"], job[rank]["resume"]["first"]):
            assert run["has_buffers"]
            assert run["forward_buffer_sync"] is False
            assert run["deprecation_warnings"] == []


def test_noisy_steps_keep_ranks_identical_and_epsilon_single_process(job):
    """q=1/12, sigma=1: many ranks' shares are empty (still a step on every rank, so Trainer
    counts the engine's steps); parameters stay bit-identical; epsilon is dp-accounting's
    single-process figure for (sigma, q, steps)."""
    a, b = (job[r]["resume"] for r in (0, 1))
    for run in ("first", "resumed"):
        assert torch.equal(a[run]["params"], b[run]["params"])
        assert a[run]["history"] == b[run]["history"]
    assert a["first"]["delta"].abs().sum() > 0
    empties = sum(r[k]["empty_batches"] for r in (a, b) for k in ("first", "resumed"))
    assert empties > 0  # fixed by insecure_seed: the scenario exercises empty shares
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(2 / 24, dp_accounting.GaussianDpEvent(1.0)), 6)
    for r in (a, b):
        assert r["first"]["steps"] == r["first"]["global_step"] == 4
        assert r["resumed"]["steps"] == r["resumed"]["global_step"] == 6
        assert r["resumed"]["sample_rate"] == pytest.approx(2 / 24)
        assert r["resumed"]["epsilon"] == pytest.approx(acc.get_epsilon(1e-4), rel=1e-9)


def test_engine_state_is_written_by_rank_0_only(job):
    """Each rank has its own output_dir here, so a write by rank 1 would show."""
    expected = [f"rank0/checkpoint-{s}/{ENGINE_STATE_NAME}" for s in (2, 4)]
    assert job[0]["resume"]["engine_states"] == expected
