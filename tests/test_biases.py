"""DP-BiTFiT-Add: same outputs at step 0, exact per-example gradients, save/load round trip."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import Capture
from torch import nn

import dpfit
from dpfit import PrivacyEngine
from dpfit.biases import add_biases, load_pretrained_with_biases
from dpfit.errors import BatchNormError, UnsupportedLayerError
from dpfit.grad_sample.rmsnorm import RMSNormWithBias

torch.set_num_threads(1)
DT = torch.float64


def tiny_llama(tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tie,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet18's layout (BasicBlocks [2, 2, 2, 2], widths 64..512) at any width multiplier."""

    def __init__(self, width: int = 64, classes: int = 10):
        super().__init__()
        w = [width, 2 * width, 4 * width, 8 * width]
        self.conv1 = nn.Conv2d(3, w[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(w[0])
        blocks, cin = [], w[0]
        for i, c in enumerate(w):
            for j in range(2):
                blocks.append(Block(cin, c, 2 if (i > 0 and j == 0) else 1))
                cin = c
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(w[-1], classes)

    def forward(self, x):
        h = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(h.mean((2, 3)))


# --------------------------------------------------------------------------- step 0
def test_llama_outputs_identical_and_biases_where_expected():
    torch.manual_seed(0)
    model = tiny_llama().to(DT).eval()
    ids = torch.randint(0, 40, (2, 7))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    added = add_biases(model)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)
    cfg = model.config
    d, kv = cfg.hidden_size, cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    # q, k, v, o; gate, up (intermediate each), down (hidden); two RMSNorm shifts
    per_layer = d + 2 * kv + d + 2 * cfg.intermediate_size + d + 2 * d
    assert added.new_parameters == cfg.num_hidden_layers * per_layer + d  # + final norm
    assert "lm_head" not in added.linear
    assert isinstance(model.model.norm, RMSNormWithBias)
    assert all(isinstance(model.get_submodule(n).bias, nn.Parameter) for n in added.linear)


def test_where_patterns_and_predicate():
    model = tiny_llama()
    added = add_biases(model, where=["*.q_proj", "*.v_proj"])
    assert added.linear and all(n.endswith(("q_proj", "v_proj")) for n in added.linear)
    assert not added.rmsnorm
    model = tiny_llama()
    added = add_biases(model, where=lambda name, m: name.endswith("mlp.down_proj"))
    assert len(added.linear) == model.config.num_hidden_layers


def test_rmsnorm_with_other_formula_is_refused():
    class GemmaLikeRMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(d))
            self.eps = 1e-6

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)

    model = nn.Sequential(nn.Linear(4, 4, bias=False), GemmaLikeRMSNorm(4))
    with pytest.raises(UnsupportedLayerError, match="where="):
        add_biases(model)
    add_biases(model, where=["0"])  # excluding it works


# --------------------------------------------------------------------------- gradients


def clipped_oracle(model, xs, loss_fn, r):
    params = [p for p in model.parameters() if p.requires_grad]
    per = []
    for i in range(xs.shape[0]):
        model.zero_grad()
        loss_fn(model, xs[i : i + 1]).backward()
        per.append([p.grad.clone() for p in params])
    norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in gs)) for gs in per])
    c = (r / (norms + 1e-6)).clamp(max=1.0)
    model.zero_grad()
    n = xs.shape[0]
    return {p: sum(c[i] * per[i][j] for i in range(n)) / n for j, p in enumerate(params)}, norms


def check_engine(model, xs, loss_fn):
    _, norms = clipped_oracle(model, xs, loss_fn, 1e9)
    r = float(norms.min()) * 1e-3
    want, _ = clipped_oracle(model, xs, loss_fn, r)
    engine = PrivacyEngine(
        model, expected_batch_size=xs.shape[0], sample_size=100, noise_multiplier=0.0,
        max_grad_norm=r, sampling="user-poisson",
    )  # fmt: skip
    opt = Capture(engine.parameters())
    try:
        loss_fn(model, xs).backward()
        engine.step(opt, batch_size=xs.shape[0])
    finally:
        engine.detach()
    scale = torch.sqrt(sum(w.pow(2).sum() for w in want.values()))
    for p, w in want.items():
        err = (opt.grads[p].double() - w).norm()
        assert err <= 1e-5 * w.norm() + 1e-9 * scale


def _lm_loss(model, ids):
    logits = model(input_ids=ids).logits
    tok = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    return tok.view(ids.shape[0], -1).mean(1).mean()


def test_llama_added_bias_gradients_exact():
    torch.manual_seed(1)
    model = tiny_llama().to(DT).eval()
    add_biases(model)
    summary = dpfit.make_bias_trainable(model)
    assert summary.trainable == sum(p.numel() for n, p in model.named_parameters() if "bias" in n)
    check_engine(model, torch.randint(0, 40, (3, 6)), _lm_loss)


def test_resnet_batchnorm_replaced_and_gradients_exact():
    torch.manual_seed(2)
    model = ResNet(width=4, classes=3).to(DT)
    model.eval()
    with pytest.raises(BatchNormError):
        PrivacyEngine(model, expected_batch_size=2, sample_size=10, noise_multiplier=1.0)
    added = add_biases(model, replace_batchnorm=True)
    gns = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert gns and all(m.num_groups == __import__("math").gcd(32, m.num_channels) for m in gns)
    convs = {n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    assert set(added.conv) == convs  # every conv here feeds a norm
    x = torch.randn(3, 3, 16, 16, dtype=DT)
    dpfit.make_bias_trainable(model, train_head=("fc",))

    def loss(m, xs):
        labels = (xs[:, 0, 0, 0] > 0).long()  # a function of the example, not its position
        return F.cross_entropy(m(xs), labels, reduction="sum")

    with torch.no_grad():
        out_before = model(x)
    for n in added.conv:  # zero at creation: conv biases do not change the function
        assert not model.get_submodule(n).bias.any()
    assert torch.isfinite(out_before).all()

    def mean_loss(m, xs):
        return loss(m, xs) / xs.shape[0]

    check_engine(model, x, mean_loss)


def test_trainable_fraction_resnet18_below_paper_bound():
    model = ResNet(width=64, classes=10)
    add_biases(model, replace_batchnorm=True)
    s = dpfit.make_bias_trainable(model)
    assert s.total > 11_000_000  # ResNet18-sized
    assert s.fraction < 1e-3, s  # the paper: < 0.1% for ResNet18


# --------------------------------------------------------------------------- save / load
def test_save_load_round_trip(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(3)
    model = tiny_llama(tie=False).eval()
    added = add_biases(model)
    with torch.no_grad():
        for name in added.modules:
            model.get_submodule(name).bias.normal_()
    ids = torch.randint(0, 40, (2, 5))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)

    plain = LlamaForCausalLM.from_pretrained(tmp_path).eval()  # the original classes: no biases
    assert not any(n.endswith("q_proj.bias") for n, _ in plain.named_parameters())

    loaded = load_pretrained_with_biases(LlamaForCausalLM, tmp_path).eval()
    sd, want_sd = loaded.state_dict(), model.state_dict()
    assert set(sd) == set(want_sd)
    for k in want_sd:
        assert torch.equal(sd[k], want_sd[k]), k
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, want)
