"""benchmarks/archive/position_sums.py (archived): its in-step ablations swap what they say they swap, and the
committed floor table is what the committed JSON renders to."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "archive"))
import position_sums  # noqa: E402

from dpfit.grad_sample import registry  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "archive"


@pytest.mark.parametrize("batch_dim", [0, 1])
def test_ablation_swaps_give_rows_of_the_sums_shape(batch_dim):
    """Each swap returns the per-example rows' shape and dtype (batch-first and sequence-first),
    so the rest of the step runs unchanged; the bf16 form is the float32 sums to bf16 rounding."""
    torch.manual_seed(0)
    g = torch.randn(6, 7, 5).bfloat16()
    dims = [1 - batch_dim]
    ref = registry._float32_sums(g, batch_dim, dims)
    for swap in (position_sums._zero_rows, position_sums._bf16_rows, position_sums._one_reduction):
        out = swap(g, batch_dim, dims)
        assert out.shape == ref.shape and out.dtype == torch.float32
    bf16 = position_sums._bf16_rows(g, batch_dim, dims)
    assert torch.allclose(bf16, ref, rtol=2**-8, atol=0)
    assert not torch.equal(bf16, ref)  # rounded: the ablation is not dpfit's form


def test_swapped_function_is_what_bias_rows_of_a_bf16_gradient_run():
    """The ablations patch `registry._float32_sums`; if `sum_positions` stopped calling it for
    a half-precision gradient, they would time dpfit's own sums under another name."""
    g = torch.randn(4, 3, 8).bfloat16()
    with mock.patch.object(registry, "_float32_sums", wraps=registry._float32_sums) as spy:
        registry.sum_positions(g, 0)
    assert spy.call_count == 1


def test_verdict_follows_the_budget():
    assert "missed" in position_sums.verdict(0.021, 0.02, 0.02)
    assert "missed" in position_sums.verdict(0.01, 0.015, 0.02)
    assert "within it" in position_sums.verdict(0.008, 0.01, 0.02)


def test_committed_table_renders_from_committed_json():
    res = json.loads((RESULTS / "position_sums.json").read_text())
    assert res["step"] is not None and set(res["step"]["step_cpu_s"]) == set(
        position_sums.STEP_ARMS
    )
    assert (RESULTS / "position_sums.md").read_text() == position_sums.render(res)
