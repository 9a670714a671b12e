"""Every registered bias sampler against the microbatch-of-one oracle, on generated shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import assert_matches_oracle, engine_per_example, make_engine, oracle_per_example
from torch import nn

import dpfit
from dpfit.grad_sample import lookup

SETTINGS = settings(max_examples=12, deadline=None)


def check(model: nn.Module, x: torch.Tensor, batch_dim: int = 0, **engine_kw) -> None:
    """Per-example bias grads of `model` on batch `x` equal the oracle's, to 1e-5 relative."""
    dpfit.make_bias_trainable(model)
    model = model.double()
    x = x.double()
    target = torch.randn_like(model(x))

    def loss_on(inp: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        out = model(inp)
        return ((out - tgt) ** 2).sum() + out.sin().sum()

    n = x.shape[batch_dim]

    def example(i: int) -> torch.Tensor:
        sl = [slice(None)] * x.dim()
        sl[batch_dim] = slice(i, i + 1)
        out_sl = [slice(None)] * target.dim()
        out_sl[batch_dim] = slice(i, i + 1)
        return loss_on(x[tuple(sl)], target[tuple(out_sl)])

    want = oracle_per_example(model, example, n)
    engine = make_engine(model, **engine_kw)
    got = engine_per_example(engine, lambda: loss_on(x, target))
    assert_matches_oracle(got, want)
    engine.detach()


class Twice(nn.Module):
    """A module applied twice in one forward (weight sharing)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(torch.tanh(self.inner(x)))


dims = st.integers(1, 4)


@SETTINGS
@given(b=st.integers(1, 4), extra=st.lists(dims, min_size=0, max_size=3), i=dims, o=dims)
def test_linear_any_rank(b, extra, i, o):
    check(nn.Linear(i, o), torch.randn(b, *extra, i))


@SETTINGS
@given(b=st.integers(1, 4), t=dims, f=dims)
def test_linear_called_twice(b, t, f):
    check(Twice(nn.Linear(f, f)), torch.randn(b, t, f))


@SETTINGS
@given(b=st.integers(2, 4), t=st.integers(1, 4), f=dims)
def test_linear_batch_second(b, t, f):
    check(nn.Linear(f, 3), torch.randn(t, b, f), batch_dim=1, batch_first=False)


@SETTINGS
@given(
    b=st.integers(1, 3),
    cin=dims,
    cout=dims,
    k=st.integers(1, 3),
    size=st.integers(3, 6),
    stride=st.integers(1, 2),
    nd=st.sampled_from([1, 2, 3]),
    transpose=st.booleans(),
)
def test_conv(b, cin, cout, k, size, stride, nd, transpose):
    if transpose and nd == 3:
        nd = 2
    cls = {
        (1, False): nn.Conv1d,
        (2, False): nn.Conv2d,
        (3, False): nn.Conv3d,
        (1, True): nn.ConvTranspose1d,
        (2, True): nn.ConvTranspose2d,
    }[(nd, transpose)]
    check(cls(cin, cout, k, stride=stride), torch.randn(b, cin, *([size] * nd)))


@SETTINGS
@given(b=st.integers(1, 4), extra=st.lists(dims, min_size=0, max_size=2), f=dims, two=st.booleans())
def test_layer_norm(b, extra, f, two):
    shape = (2, f) if two else (f,)
    check(nn.LayerNorm(shape), torch.randn(b, *extra, *shape))


@SETTINGS
@given(b=st.integers(1, 4), groups=st.integers(1, 3), per=dims, size=st.integers(2, 4))
def test_group_norm(b, groups, per, size):
    check(nn.GroupNorm(groups, groups * per), torch.randn(b, groups * per, size, size))


@SETTINGS
@given(b=st.integers(1, 4), c=dims, size=st.integers(2, 5), nd=st.sampled_from([1, 2, 3]))
def test_instance_norm(b, c, size, nd):
    cls = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[nd]
    check(cls(c, affine=True), torch.randn(b, c, *([size] * nd)))


class MHA(nn.Module):
    def __init__(self, e, heads, batch_first, kind):
        super().__init__()
        self.attn = nn.MultiheadAttention(e, heads, batch_first=batch_first)
        self.kind = kind
        self.batch_first = batch_first

    def forward(self, x):
        cut = slice(None, max(1, x.shape[1 if self.batch_first else 0] - 1))
        kv = x[:, cut] if self.batch_first else x[cut]
        q, k, v = {
            "self": (x, x, x),
            "kv": (x, kv, kv),
            "separate": (x, kv, kv * 2.0),
        }[self.kind]
        return self.attn(q, k, v)[0]


@SETTINGS
@given(
    b=st.integers(1, 3),
    t=st.integers(2, 5),
    heads=st.sampled_from([1, 2]),
    per_head=st.integers(1, 3),
    batch_first=st.booleans(),
    kind=st.sampled_from(["self", "kv", "separate"]),
)
def test_multihead_attention(b, t, heads, per_head, batch_first, kind):
    e = heads * per_head
    x = torch.randn(b, t, e) if batch_first else torch.randn(t, b, e)
    check(
        MHA(e, heads, batch_first, kind),
        x,
        batch_dim=0 if batch_first else 1,
        # only the attention layer is inside; its own batch_first flag drives the sampler
    )


def test_multihead_attention_routes_follow_graph_changes(monkeypatch):
    """The routes to the bias-adding nodes are kept between forwards of a layer. Switching the
    same layer between self-attention (one packed in-projection) and cross-attention (split
    in-projections) changes its graph: every forward must still match the oracle (a stale
    route would miss or misplace a slice), and a graph seen before is not walked again."""
    from dpfit.grad_sample import attention

    walks = []
    real_walk = attention._walk
    monkeypatch.setattr(attention, "_walk", lambda *a: walks.append(1) or real_walk(*a))
    torch.manual_seed(0)
    model, ref = MHA(4, 2, True, "self"), MHA(4, 2, True, "self")
    ref.load_state_dict(model.state_dict())
    for m in (model, ref):
        dpfit.make_bias_trainable(m)
    model, ref = model.double(), ref.double()  # the oracle runs on a copy without hooks
    engine = make_engine(model)
    kinds = ["self", "self", "kv", "kv", "separate", "self", "separate", "kv"]
    for kind in kinds:
        model.kind = ref.kind = kind
        x = torch.randn(3, 4, 4, dtype=torch.double)
        want = oracle_per_example(ref, lambda i, x=x: ref(x[i : i + 1]).sin().sum(), 3)
        got = engine_per_example(engine, lambda x=x: model(x).sin().sum())
        assert_matches_oracle(got, want)
    assert len(walks) == len(set(kinds))
    engine.detach()


def test_hf_conv1d():
    from transformers.pytorch_utils import Conv1D

    layer = Conv1D(5, 3)
    nn.init.normal_(layer.bias)
    assert lookup(layer) is not None
    check(layer, torch.randn(3, 4, 3))


def test_embedding_has_no_bias_and_is_skipped():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    summary = dpfit.make_bias_trainable(model)
    assert summary.names == ("1.bias",)
    engine = make_engine(model)
    assert [p.shape for p in engine.parameters()] == [torch.Size([2])]


@pytest.mark.parametrize("bad", [nn.BatchNorm1d(4), nn.BatchNorm2d(4)])
def test_batchnorm_is_refused(bad):
    model = nn.Sequential(nn.Linear(4, 4), bad)
    dpfit.make_bias_trainable(model)
    with pytest.raises(dpfit.BatchNormError, match="GroupNorm"):
        make_engine(model)
