"""benchmarks/throughput.py: its model-FLOP formula against torch's own FLOP counter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import throughput  # noqa: E402

import dpfit  # noqa: E402

transformers = pytest.importorskip("transformers")


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=2, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    # eager attention: its score products are matmuls torch's counter sees (it does not count
    # the fused CPU attention kernel, which does the same products)
    cfg._attn_implementation = "eager"
    return transformers.BertForSequenceClassification(cfg).train(), cfg


@pytest.mark.parametrize("weights_train", [False, True])
def test_model_flops_match_torch_flop_counter(weights_train):
    """Forward and whole-step FLOPs from the shapes equal what torch counts for the products
    (bias-only: no weight gradients; full: all of them)."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model, cfg = _bert()
    if weights_train:
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        dpfit.make_bias_trainable(model, train_head=("classifier",))
    b, length = 3, 11
    ids = torch.randint(3, 100, (b, length))
    with FlopCounterMode(display=False) as fwd:
        out = model(input_ids=ids).logits
    with FlopCounterMode(display=False) as bwd:
        out.sum().backward()
    want = throughput.model_flops(cfg, length, 2, weights_train=weights_train)
    assert fwd.get_total_flops() == b * want["forward"]
    assert fwd.get_total_flops() + bwd.get_total_flops() == b * want["total"]


def test_peak_ceiling_is_the_achieved_share_over_the_matmul_share():
    """The ceiling line: a step whose non-matmul ops were free runs at the matmul rate, i.e.
    (achieved fraction of the peak) / (matmul share of the step's time)."""
    rows = [
        {"length": 28, "arm": a, "precision": p, "cpu_s_per_step": t, "achieved_gflops_cpu": g,
         "saved_mb": 10.0}
        for a, p, t, g in (("dp-bitfit", "fp32", 2.0, 50.0), ("dp-bitfit", "bf16", 1.0, 150.0),
                           ("nonprivate-bias", "bf16", 0.98, 153.0))
    ]  # fmt: skip
    res = {
        "lengths": [28],
        "rows": rows,
        "peaks": {"bf16": {"gflops_cpu": 1000.0}},
        "profiles": {"28": {"bf16": {"matrix products": 0.25}}},
    }
    text = "\n".join(throughput.render_targets(res, ["dp-bitfit"]))
    assert "15.0% / 0.25 = 60% of the peak" in text
    del res["profiles"]
    assert "of the peak; a step" not in "\n".join(throughput.render_targets(res, ["dp-bitfit"]))


def test_overhead_profile_finds_the_op_one_arm_adds():
    """profile_overhead on two toy arms, one of which also runs an extra upcast-and-sum: that
    op is on top with its extra calls, and the table renders it."""
    # a tiny product both arms run, large extra ops: on a loaded machine the product's own
    # timing noise must not outrank what one arm adds
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    w = torch.randn(16, 16, dtype=torch.bfloat16)
    big = torch.randn(512, 2048, dtype=torch.bfloat16)

    def base(prec):
        x @ w

    def extra(prec):
        x @ w
        for _ in range(4):
            big.float().sum(0)

    out = throughput.profile_overhead(
        throughput.Arm("nonprivate-bias", base, None), throughput.Arm("dp-bitfit", extra, None),
        "bf16", steps=3, top=2,
    )  # fmt: skip
    top = out["top"][0]
    assert top["op"] in ("aten::sum", "aten::copy_"), out["top"]
    assert top["arm_calls"] >= 4 and top["base_calls"] == 0, out["top"]
    lines = "\n".join(
        line for line in throughput.render_overheads({"28": {"bf16": out}}) if "`aten::" in line
    )
    assert "| bf16 | `aten::" in lines
