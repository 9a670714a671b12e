"""bf16 autocast (dpfit.precision): per-example gradients against the float64 oracle, and the
float32 mechanism around them (rows, norms, clipping, noise, masters)."""

from __future__ import annotations

import copy

import pytest
import torch
from noise_check import assert_std
from oracle import Capture, engine_per_example, make_engine, oracle_per_example
from torch import nn

import dpfit
from dpfit import precision
from dpfit.grad_sample.registry import sum_positions, sum_to_channel

transformers = pytest.importorskip("transformers")

B, T = 4, 9
# bf16 keeps 8 significant bits (eps 2^-7): each product's inputs are rounded by up to 0.4%,
# and a gradient passes through a few dozen such products in these two layers. Measured here
# against the float64 oracle: about 0.5% of each example's gradient norm (the worst parameter
# ~0.9% of its own size). The bound, 3% of the example's norm, leaves room for other seeds and
# shapes while any dropped, doubled or misrouted term (an error of the order of 100%) fails.
BF16_RTOL = 0.03


def _bert() -> nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=200,
        hidden_size=384,
        num_hidden_layers=2,
        num_attention_heads=12,
        intermediate_size=1536,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).train()
    dpfit.make_bias_trainable(model, train_head=("classifier",))
    return model


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 200, (B, T), generator=g), torch.randint(0, 2, (B,), generator=g)


def _bf16_per_example(model: nn.Module, ids, labels) -> dict[str, torch.Tensor]:
    engine = make_engine(model)

    def batch_loss() -> torch.Tensor:
        with precision.autocast("bf16", "cpu"):
            logits = model(input_ids=ids).logits
            return nn.functional.cross_entropy(logits, labels, reduction="sum")

    try:
        return engine_per_example(engine, batch_loss)
    finally:
        engine.detach()


@pytest.mark.parametrize("sliced", [False, True], ids=["whole-upcast", "sliced-upcast"])
def test_bf16_per_example_gradients_are_bounded_by_the_float64_oracle(sliced, monkeypatch):
    """sliced: every sum over positions takes the large-gradient path (UPCAST_SLICE_ABOVE)."""
    if sliced:
        from dpfit.grad_sample import registry

        monkeypatch.setattr(registry, "UPCAST_SLICE_ABOVE", 0)
        monkeypatch.setattr(registry, "UPCAST_SLICE_BYTES", 1)  # one example per slice
    model = _bert()
    ids, labels = _data()
    ref = copy.deepcopy(model).double()

    def loss(i: int) -> torch.Tensor:
        logits = ref(input_ids=ids[i : i + 1]).logits
        return nn.functional.cross_entropy(logits, labels[i : i + 1], reduction="sum")

    want = oracle_per_example(ref, loss, B)
    got = _bf16_per_example(model, ids, labels)
    assert set(got) == set(want)
    for name, g in got.items():
        assert g.dtype == torch.float32, (name, g.dtype)  # float32 rows over bf16 compute
    names = sorted(want)
    w = torch.cat([want[n].reshape(B, -1) for n in names], 1)
    g = torch.cat([got[n].reshape(B, -1).double() for n in names], 1)
    norms = w.norm(dim=1)
    per_example = ((g - w).norm(dim=1) / norms).max().item()
    assert per_example <= BF16_RTOL, f"bf16 per-example error {per_example:.3g} of the norm"
    for n in names:  # no single parameter carries the error either (a key bias is ~0)
        d = (got[n].double() - want[n]).reshape(B, -1).norm(dim=1) / norms
        assert d.max().item() <= BF16_RTOL, f"{n}: {d.max().item():.3g} of the example's norm"
    # and it is bf16 that ran: the rows are not float32-exact (else the bound tests nothing)
    assert per_example > 1e-4


@pytest.mark.parametrize("shape,batch_dim", [((4, 512, 64), 0), ((512, 4, 64), 1)])
def test_bf16_sums_over_positions_accumulate_and_return_float32(shape, batch_dim):
    """A per-example bias gradient of a bf16 output gradient: summed in float32 and kept so
    (a bf16 result would round every element by up to 2^-9)."""
    g = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) + 0.3).bfloat16()
    got = sum_positions(g, batch_dim)
    want = g.double().sum(dim=1 - batch_dim)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("shape,batch_dim", [((7, 33, 24), 0), ((33, 7, 24), 1), ((7, 5, 6, 8), 0)])
def test_large_bf16_sums_in_slices_of_examples_equal_the_whole_upcast(
    shape, batch_dim, monkeypatch
):
    """Above UPCAST_SLICE_ABOVE the upcast runs a few examples at a time (in cache): every
    example's float32 sum is exactly the one the whole upcast gives, the last, partial slice
    included (thresholds lowered so that 7 examples make 3 slices)."""
    from dpfit.grad_sample import registry

    g = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) + 0.3).bfloat16()
    per_example = 4 * g.numel() // g.shape[batch_dim]
    monkeypatch.setattr(registry, "UPCAST_SLICE_ABOVE", per_example)  # any 2+ examples slice
    monkeypatch.setattr(registry, "UPCAST_SLICE_BYTES", 3 * per_example)  # 3 + 3 + 1
    dims = [i for i in range(g.dim() - 1) if i != batch_dim]
    got = sum_positions(g, batch_dim)
    assert got.dtype == torch.float32
    assert torch.equal(got, g.float().sum(dim=dims))


def test_bf16_sums_to_channel_return_float32():
    g = (torch.randn(4, 8, 32, 32, generator=torch.Generator().manual_seed(0)) + 0.3).bfloat16()
    got = sum_to_channel(g, 1)
    want = g.double().sum(dim=(2, 3))
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _step_one_example(engine, model, opt, ids, labels, i) -> torch.Tensor:
    with precision.autocast("bf16", "cpu"):
        logits = model(input_ids=ids[i : i + 1]).logits
        loss = nn.functional.cross_entropy(logits, labels[i : i + 1], reduction="sum")
    loss.backward()
    assert engine.step(opt, batch_size=1)
    update = torch.cat([opt.grads[p].reshape(-1) for p in engine.parameters()])
    opt.grads.clear()
    return update


def test_no_clipped_contribution_exceeds_R_under_bf16():
    """Each example alone, noiseless, every gradient far above R: the released update is that
    example's clipped contribution. Its norm is R to float32 precision (norms and factors
    are float32); a bf16 norm would miss by up to 0.4%, above R for some examples."""
    model = _bert()
    g = torch.Generator().manual_seed(2)
    n = 12
    ids, labels = torch.randint(3, 200, (n, T), generator=g), torch.randint(0, 2, (n,), generator=g)
    R = 1e-4  # far below every per-example gradient norm: every example is clipped
    engine = make_engine(model, max_grad_norm=R)
    opt = Capture(engine.parameters())
    try:
        norms = [
            _step_one_example(engine, model, opt, ids, labels, i).double().norm().item()
            for i in range(n)
        ]
    finally:
        engine.detach()
    for norm in norms:
        assert norm <= R * (1 + 1e-5), f"clipped contribution {norm:.9g} > R={R}"
        assert norm >= R * (1 - 1e-5), f"clipped contribution {norm:.9g} < R={R}: not float32"


def test_bf16_noise_and_masters_stay_float32():
    """The released update (noise included) is float32 with std sigma*R/B, and the
    parameters the optimizer steps stay float32 masters."""
    model = _bert()
    ids, labels = _data()
    sigma, R = 1.0, 1e-6  # the clipped part (norm <= R) is negligible next to the noise
    engine = make_engine(model, max_grad_norm=R, noise_multiplier=sigma, insecure_seed=3)
    opt = Capture(engine.parameters())
    try:
        update = _step_one_example(engine, model, opt, ids, labels, 0)
    finally:
        engine.detach()
    assert update.dtype == torch.float32
    assert update.numel() > 5_000
    assert_std(update, sigma * R)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_gradient_check_still_catches_a_missed_term_under_bf16():
    """The check's tolerance widens to bf16's rounding, not to a missing contribution."""
    model = _bert()
    ids, labels = _data()
    engine = make_engine(model)
    opt = Capture(engine.parameters())
    bias = model.bert.pooler.dense.bias
    try:
        with precision.autocast("bf16", "cpu"):
            logits = model(input_ids=ids).logits
            # the bias used a second time outside its module: autograd sees it, the sampler not
            logits = logits + bias[:2]
            loss = nn.functional.cross_entropy(logits, labels, reduction="sum")
        loss.backward()
        with pytest.raises(dpfit.errors.GradientMismatchError):
            engine.step(opt, batch_size=B)
    finally:
        engine.detach()


def test_bf16_step_passes_the_gradient_check():
    model = _bert()
    ids, labels = _data()
    engine = make_engine(model)
    opt = Capture(engine.parameters())
    try:
        with precision.autocast("bf16", "cpu"):
            loss = nn.functional.cross_entropy(model(input_ids=ids).logits, labels, reduction="sum")
        loss.backward()
        assert engine.step(opt, batch_size=B)
    finally:
        engine.detach()


# -- choosing the precision ----------------------------------------------------------------


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    with_bf16 = tmp_path / "bf16"
    with_bf16.write_text("processor : 0\nflags : fpu sse avx512f avx512_bf16 amx_tile\n")
    without = tmp_path / "plain"
    without.write_text("processor : 0\nflags : fpu sse avx2 avx512f\n")
    assert precision.cpu_bf16_flags(str(with_bf16)) == ("avx512_bf16",)
    assert precision.cpu_bf16_flags(str(without)) == ()
    assert precision.cpu_bf16_flags(str(tmp_path / "missing")) == ()


def test_auto_follows_the_cpu_flags(monkeypatch, caplog):
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: ("amx_bf16",))
    assert precision.resolve_precision("auto", "cpu") == "bf16"
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: ())
    assert precision.resolve_precision("auto", "cpu") == "fp32"
    assert precision.resolve_precision("fp32", "cpu") == "fp32"
    with caplog.at_level("WARNING", logger="dpfit.precision"):
        assert precision.resolve_precision("bf16", "cpu") == "bf16"  # asked: honoured, warned
    assert "emulates" in caplog.text


def test_unknown_precision_is_refused():
    with pytest.raises(precision.PrecisionError, match="precision must be one of"):
        precision.resolve_precision("fp16", "cpu")


def test_autocast_is_a_no_op_for_fp32():
    with precision.autocast("fp32", "cpu"):
        assert not torch.is_autocast_enabled("cpu")
    with precision.autocast("bf16", "cpu"):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


# -- dpfit train --precision -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dpfit.models import save_tiny_random_model, write_tiny_sentiment_csv

    root = tmp_path_factory.mktemp("tiny")
    return (
        str(save_tiny_random_model(root / "model")),
        str(write_tiny_sentiment_csv(root / "data.csv", n=120)),
    )


def test_train_runs_in_bf16_and_records_it(tiny, monkeypatch):
    from dpfit.train import TrainConfig, train

    seen: list[torch.dtype] = []
    real = torch.autocast

    def spy(*args, **kw):  # the training forwards run under bf16 autocast
        seen.append(kw.get("dtype"))
        return real(*args, **kw)

    monkeypatch.setattr(torch, "autocast", spy)
    notes: list[str] = []
    model, data = tiny
    res = train(
        TrainConfig(
            model=model, data=data, max_steps=2, batch_size=30, physical_batch_size=8,
            precision="bf16",
        ),
        on_note=notes.append,
    )  # fmt: skip
    assert res.metrics["config"]["precision"] == "bf16"
    assert res.metrics["steps"] == 2
    assert seen and set(seen) == {torch.bfloat16}
    assert any("compute precision: bf16" in n for n in notes)
    assert all(p.dtype == torch.float32 for p in res.model.parameters())


def test_train_config_and_cli_take_the_precision():
    from dpfit.cli import build_parser, train_config_from_args
    from dpfit.train import TrainConfig

    with pytest.raises(ValueError, match="precision must be one of"):
        TrainConfig(precision="fp16")
    assert TrainConfig().precision == "fp32"
    args = build_parser().parse_args(["train", "--precision", "auto"])
    assert train_config_from_args(args).precision == "auto"
