"""Full mode: factored per-example weight gradients against the microbatch-of-one oracle.

Layer level: every full-mode sampler on both branches of mixed ghost clipping (forced by the
`branch` fixture): the factors kept (their ghost and explicit norms, weighted sums,
materialised gradients) and the per-example gradients materialised in the hook. Engine level: mode="full" with sigma=0 and a tiny clip norm must equal
the oracle's clipped sum, for each layer type and for whole transformers models built from
tiny configs with random weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpfit import PrivacyEngine
from dpfit.grad_sample import full
from dpfit.grad_sample.full import OuterGrad, norm_sampler_for
from dpfit.grad_sample.rmsnorm import RMSNormWithBias

torch.set_num_threads(1)
DT = torch.float64
REL = 1e-5


@pytest.fixture(params=["ghost", "explicit"])
def branch(request, monkeypatch):
    """Force mixed ghost clipping's choice: keep the factors, or materialise in the hook."""
    monkeypatch.setattr(full, "ghost_is_cheaper", lambda *shape: request.param == "ghost")
    return request.param


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / (want.double().norm() + 1e-30))


# --------------------------------------------------------------------------- oracle
def oracle_layer_grads(layer: nn.Module, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Per-example weight gradients of sum(layer(x_i) * r_i), one example at a time."""
    out = []
    for i in range(x.shape[0]):
        layer.zero_grad()
        (layer(x[i : i + 1]) * r[i : i + 1]).sum().backward()
        out.append(layer.weight.grad.detach().clone())
    return torch.stack(out)


def check_outer(layer: nn.Module, x: torch.Tensor, branch: str) -> None:
    y = layer(x)
    r = torch.randn_like(y)
    want = oracle_layer_grads(layer, x, r)
    sampler = norm_sampler_for(layer)
    got = sampler(layer, x, r, 0)["weight"]
    want_sq = want.flatten(1).pow(2).sum(1)
    c = torch.rand(x.shape[0], dtype=DT)
    grouped = getattr(layer, "groups", 1) != 1  # grouped convs: always materialised
    assert isinstance(got, OuterGrad) == (branch == "ghost" and not grouped)
    if isinstance(got, OuterGrad):
        assert rel_err(got.materialize(), want) < REL
        for method in ("ghost", "explicit"):
            assert rel_err(got.sq_norms(method), want_sq) < REL, method
        assert rel_err(got.weighted_sum(c), torch.einsum("b,b...->...", c, want)) < REL
        assert rel_err(got.sum(0), want.sum(0)) < REL
    else:
        assert rel_err(got, want) < REL


@pytest.mark.parametrize("shape", [(5, 7), (4, 3, 7), (3, 2, 4, 7)])
def test_linear(shape, branch):
    torch.manual_seed(0)
    check_outer(nn.Linear(7, 6, dtype=DT), torch.randn(*shape, dtype=DT), branch)


def test_hf_conv1d(branch):
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(1)
    layer = Conv1D(6, 5).to(DT)
    nn.init.normal_(layer.weight)
    check_outer(layer, torch.randn(3, 4, 5, dtype=DT), branch)


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding(padding_idx, branch):
    torch.manual_seed(2)
    layer = nn.Embedding(11, 4, padding_idx=padding_idx, dtype=DT)
    ids = torch.randint(0, 11, (4, 9))
    ids[0, :3] = 5  # repeated tokens inside one example
    ids[1, 0] = 0
    y = layer(ids)
    r = torch.randn_like(y)
    want = []
    for i in range(ids.shape[0]):
        layer.zero_grad()
        (layer(ids[i : i + 1]) * r[i : i + 1]).sum().backward()
        want.append(layer.weight.grad.clone())
    want = torch.stack(want)
    got = norm_sampler_for(layer)(layer, ids, r, 0)["weight"]
    assert isinstance(got, OuterGrad) == (branch == "ghost")
    if isinstance(got, OuterGrad):
        for method in ("ghost", "explicit"):
            assert rel_err(got.sq_norms(method), want.flatten(1).pow(2).sum(1)) < REL
        got = got.materialize()
    assert rel_err(got, want) < REL


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(kernel_size=3),
        dict(kernel_size=3, stride=2, padding=1),
        dict(kernel_size=2, dilation=2, padding="same"),
        dict(kernel_size=3, padding=1, padding_mode="reflect"),
        dict(kernel_size=2, padding="same"),  # uneven: one more zero on the right
        dict(kernel_size=3, groups=2),
        dict(kernel_size=3, groups=2, stride=2, padding=2, dilation=2),
    ],
)
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_conv(kwargs, dims, branch):
    torch.manual_seed(3)
    cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    layer = cls(4, 6, dtype=DT, **kwargs)
    x = torch.randn(3, 4, *([7 if dims < 3 else 5] * dims), dtype=DT)
    check_outer(layer, x, branch)


@pytest.mark.parametrize("layout", ["channels_last", "offset_view", "transposed"])
def test_conv_input_layouts(layout, branch):
    """Patches are read as a strided view of the input itself when there is no padding: any
    strides and storage offset of that input must give the same gradients."""
    torch.manual_seed(12)
    layer = nn.Conv2d(3, 5, 2, stride=(1, 2), dilation=(2, 1), dtype=DT)
    base = torch.randn(4, 4, 7, 8, dtype=DT)
    if layout == "channels_last":
        x = base[:, :3].contiguous(memory_format=torch.channels_last)
    elif layout == "offset_view":
        x = base[1:, 1:]  # non-zero storage offset
    else:
        x = base[:, :3].transpose(2, 3)
    check_outer(layer, x, branch)


@pytest.mark.parametrize(
    ("length", "ghost"),
    [(1, True), (2, False), (5, False)],  # O * C * K = 8: ghost while 2 L^2 < 8
)
@pytest.mark.parametrize("layer_type", ["conv", "linear"])
def test_mixed_rule_picks_the_branch(length, ghost, layer_type):
    """Unforced, the sampler keeps the factors exactly when 2 T^2 < p d, and either way its
    per-example gradients are the oracle's."""
    torch.manual_seed(11)
    if layer_type == "conv":
        layer, x = nn.Conv1d(2, 4, 1, dtype=DT), torch.randn(3, 2, length, dtype=DT)
    else:
        layer, x = nn.Linear(2, 4, dtype=DT), torch.randn(3, length, 2, dtype=DT)
    y = layer(x)
    r = torch.randn_like(y)
    got = norm_sampler_for(layer)(layer, x, r, 0)["weight"]
    assert isinstance(got, OuterGrad) == ghost
    got = got.materialize() if isinstance(got, OuterGrad) else got
    assert rel_err(got, oracle_layer_grads(layer, x, r)) < REL


def test_tied_embedding_and_linear_cross_terms(branch):
    """A weight used by an embedding and by an output layer: the norm of the sum, not the sum
    of the norms (the cross Gram terms between one-hot and dense factors)."""
    torch.manual_seed(4)
    emb = nn.Embedding(13, 5, dtype=DT)
    head = nn.Linear(5, 13, bias=False, dtype=DT)
    head.weight = emb.weight
    ids = torch.randint(0, 13, (3, 6))
    h = emb(ids)
    h.retain_grad()
    z = torch.tanh(h)
    z.retain_grad()
    logits = head(z)
    r = torch.randn_like(logits)
    (logits * r).sum().backward()
    g_emb = emb.weight.grad.clone()
    want = []
    for i in range(3):
        emb.weight.grad = None
        (head(torch.tanh(emb(ids[i : i + 1]))) * r[i : i + 1]).sum().backward()
        want.append(emb.weight.grad.clone())
    want = torch.stack(want)
    a = norm_sampler_for(emb)(emb, ids, h.grad, 0)["weight"]
    b = norm_sampler_for(head)(head, z.detach(), r, 0)["weight"]
    both = a + b
    assert rel_err(both.sum(0), g_emb) < REL
    if branch == "explicit":  # materialised in the hooks: a plain sum
        assert not isinstance(both, OuterGrad)
        assert rel_err(both, want) < REL
        return
    for method in ("ghost", "explicit"):
        assert rel_err(both.sq_norms(method), want.flatten(1).pow(2).sum(1)) < REL
    # and an explicit gradient added to a factored one
    mixed = b.materialize() + a
    assert rel_err(mixed, want) < REL


# --------------------------------------------------------------------------- engine level
class Capture(torch.optim.Optimizer):
    """Records the gradient the engine hands to the optimizer."""

    def __init__(self, params):
        super().__init__(list(params), {})
        self.grads: dict[nn.Parameter, torch.Tensor] = {}

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.grads[p] = p.grad.detach().clone()


def _slice(batch, i):
    if isinstance(batch, torch.Tensor):
        return batch[i : i + 1]
    return {k: v[i : i + 1] for k, v in batch.items()}


def oracle_clipped_mean(model, batch, loss_fn, n, max_grad_norm):
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for i in range(n):
        model.zero_grad()
        loss_fn(model, _slice(batch, i)).backward()
        grads.append([p.grad.detach().clone() for p in params])
    norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in gs)) for gs in grads])
    c = (max_grad_norm / norms).clamp(max=1.0)  # min(1, R / ||g||)
    total = [sum(c[i] * grads[i][j] for i in range(n)) / n for j in range(len(params))]
    model.zero_grad()
    return dict(zip(params, total, strict=True)), norms


def check_full_mode(model, batch, loss_fn, n, tiny=True):
    model.eval()
    _, norms = oracle_clipped_mean(model, batch, loss_fn, n, 1e9)
    # tiny: below every example's norm (every gradient is clipped); else: nothing is clipped
    r = float(norms.min()) * 1e-3 if tiny else float(norms.max()) * 10
    want, _ = oracle_clipped_mean(model, batch, loss_fn, n, r)
    engine = PrivacyEngine(
        model,
        expected_batch_size=n,
        sample_size=10 * n,
        noise_multiplier=0.0,
        max_grad_norm=r,
        mode="full",
        sampling="user-poisson",
    )
    opt = Capture(engine.parameters())
    try:
        loss_fn(model, batch).backward()
        engine.step(opt, batch_size=n)
    finally:
        engine.detach()
    names = {p: name for name, p in model.named_parameters()}
    assert set(opt.grads) == set(want)
    # Some gradients are zero in exact arithmetic (a key bias under softmax, a bias before an
    # instance norm): they are compared against a floor far below every real gradient.
    scale = torch.sqrt(sum(w.double().pow(2).sum() for w in want.values()))
    err = {names[p]: float((opt.grads[p].double() - w.double()).norm()) for p, w in want.items()}
    bad = {
        k: e
        for (k, e), w in zip(err.items(), want.values(), strict=True)
        if e > REL * float(w.double().norm()) + 1e-9 * float(scale)
    }
    assert not bad, bad


def _mse(model, x):
    return model(x).pow(2).flatten(1).sum(1).mean()


class Twice(nn.Module):
    """A linear applied twice in one forward (weight sharing across calls)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5, dtype=DT)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


LAYER_MODELS = {
    "linear": lambda: nn.Sequential(
        nn.Linear(5, 7, dtype=DT), nn.Tanh(), nn.Linear(7, 3, dtype=DT)
    ),
    "linear_called_twice": Twice,
    "layernorm": lambda: nn.Sequential(nn.Linear(5, 6, dtype=DT), nn.LayerNorm(6, dtype=DT)),
    "rmsnorm_torch": lambda: nn.Sequential(nn.Linear(5, 6, dtype=DT), nn.RMSNorm(6, dtype=DT)),
    "rmsnorm_llama_with_bias": lambda: nn.Sequential(
        nn.Linear(5, 6, dtype=DT),
        RMSNormWithBias(nn.Parameter(torch.rand(6, dtype=DT) + 0.5), 1e-6),
    ),
}


@pytest.mark.parametrize("name", sorted(LAYER_MODELS))
@pytest.mark.parametrize("tiny", [True, False])
def test_engine_full_sequences(name, tiny, branch):
    torch.manual_seed(5)
    model = LAYER_MODELS[name]()
    x = torch.randn(4, 3, 5, dtype=DT)
    check_full_mode(model, x, _mse, 4, tiny)


@pytest.mark.parametrize("tiny", [True, False])
def test_engine_full_conv_groupnorm_embedding(tiny, branch):
    torch.manual_seed(6)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4, dtype=DT)
            self.c1 = nn.Conv1d(4, 6, 3, padding=1, dtype=DT)
            self.c2 = nn.Conv2d(1, 4, 3, stride=2, dtype=DT)
            self.gn = nn.GroupNorm(2, 4, dtype=DT)
            self.inorm = nn.InstanceNorm1d(6, affine=True, dtype=DT)
            self.c3 = nn.Conv3d(1, 2, 2, padding=1, dtype=DT)

        def forward(self, b):
            h = self.inorm(self.c1(self.emb(b["ids"]).transpose(1, 2)))
            z = self.gn(self.c2(b["img"]))
            v = self.c3(b["img"][:, :, :4, :4].unsqueeze(1))  # [B, 1, 1, 4, 4] volume
            return h.pow(2).sum((1, 2)) + z.pow(2).sum((1, 2, 3)) + v.tanh().sum((1, 2, 3, 4))

    def loss(model, b):
        return model(b).mean()

    batch = {"ids": torch.randint(0, 10, (3, 8)), "img": torch.randn(3, 1, 9, 9, dtype=DT)}
    check_full_mode(Net(), batch, loss, 3, tiny)


# --------------------------------------------------------------------------- whole models
def _lm_loss(model, b):
    logits = model(input_ids=b["input_ids"], position_ids=b.get("position_ids")).logits
    per_tok = F.cross_entropy(
        logits[:, :-1].flatten(0, 1), b["input_ids"][:, 1:].flatten(), reduction="none"
    )
    return per_tok.view(logits.shape[0], -1).mean(1).mean()


def _cls_loss(model, b):
    kw = {k: v for k, v in b.items() if k != "labels"}
    return F.cross_entropy(model(**kw).logits, b["labels"])


def _text_batch(n, t, vocab, position_ids=True):
    ids = torch.randint(0, vocab, (n, t))
    b = {"input_ids": ids}
    if position_ids:  # learned position embeddings need a per-example batch axis in full mode
        b["position_ids"] = torch.arange(t).expand(n, t).contiguous()
    return b


def test_bert_full():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(7)
    cfg = BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=16, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = BertForSequenceClassification(cfg).to(DT)
    b = _text_batch(3, 6, 50)
    b["labels"] = torch.tensor([0, 2, 1])
    check_full_mode(model, b, _cls_loss, 3)


def test_gpt2_full_tied_lm_head():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(8)
    cfg = GPT2Config(
        vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = GPT2LMHeadModel(cfg).to(DT)
    assert model.lm_head.weight is model.transformer.wte.weight
    check_full_mode(model, _text_batch(3, 7, 40), _lm_loss, 3)


def test_llama_full_tied():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(9)
    cfg = LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).to(DT)
    check_full_mode(model, _text_batch(3, 7, 40, position_ids=False), _lm_loss, 3)


def test_vit_full():
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(10)
    cfg = ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=24, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = ViTForImageClassification(cfg).to(DT)
    # parameters ViTEmbeddings adds itself (no layer to hook): frozen, as the error says
    model.vit.embeddings.cls_token.requires_grad_(False)
    model.vit.embeddings.position_embeddings.requires_grad_(False)
    b = {"pixel_values": torch.randn(3, 3, 8, 8, dtype=DT), "labels": torch.tensor([0, 1, 2])}
    check_full_mode(model, b, _cls_loss, 3)


def test_full_mode_uses_factored_samplers():
    """The engine really takes the ghost/book-keeping path in full mode (not the explicit)."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3))
    engine = PrivacyEngine(
        model, expected_batch_size=2, sample_size=20, noise_multiplier=0.0, mode="full",
        sampling="user-poisson",
    )  # fmt: skip
    try:
        fns = {plan.name: plan.weight_fn for plan in engine._plans.values()}
    finally:
        engine.detach()
    assert fns["0"] is norm_sampler_for(model[0]) and fns["1"] is norm_sampler_for(model[1])


# --------------------------------------------------------------------------- bf16
class Bf16Net(nn.Module):
    """Embedding + a Linear on the ghost branch (few positions) and one on the explicit
    branch (many positions), a LayerNorm and a conv: every full-mode norm path."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.ghost = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.conv = nn.Conv1d(32, 8, 3, padding=1)
        self.wide = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.ghost(self.emb(ids)))  # [B, T, 32]
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)  # [B, T, 8]
        return self.wide(h).mean(1)


@pytest.mark.parametrize("clipping", ["flat", "automatic"])
@pytest.mark.parametrize("positions", [3, 40])  # ghost norms / materialised norms
def test_bf16_full_mode_clipped_contributions_stay_within_R(monkeypatch, clipping, positions):
    """Per-example norms and clipping run in float32 even for a bf16 model: each example's
    clipped contribution, measured in float64, is at most R."""
    import dpfit.engine as engine_mod

    torch.manual_seed(0)
    model = Bf16Net().to(torch.bfloat16)
    R = 1e-2
    engine = PrivacyEngine(
        model, expected_batch_size=1, sample_size=100, noise_multiplier=0.0, mode="full",
        max_grad_norm=R, clipping=clipping, sampling="user-poisson", loss_reduction="sum",
    )  # fmt: skip
    sums = []
    real = engine_mod.gaussian_noise

    def spy(shape, std, generator, secure, like):
        sums.append(like.detach().clone())
        return real(shape, std, generator, secure, like)

    monkeypatch.setattr(engine_mod, "gaussian_noise", spy)
    opt = torch.optim.SGD(engine.parameters(), lr=0.0)
    worst = 0.0
    for i in range(24):  # one example per step: the noiseless sum is its clipped contribution
        ids = torch.randint(0, 50, (1, positions))
        y = torch.randint(0, 4, (1,))
        sums.clear()
        F.cross_entropy(model(ids).float(), y, reduction="sum").mul(10.0 + i).backward()
        assert engine.step(opt, batch_size=1)
        # one flat sum over every trainable parameter, not rounded to bf16
        assert sum(s.numel() for s in sums) == sum(p.numel() for p in engine.parameters())
        assert all(s.dtype == torch.float32 for s in sums)
        norm = torch.sqrt(sum(s.double().pow(2).sum() for s in sums)).item()
        worst = max(worst, norm / R)
    assert worst <= 1 + 1e-6, worst
    if clipping == "flat":
        assert worst > 0.99  # the clip did bite
