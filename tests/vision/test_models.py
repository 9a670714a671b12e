"""Factory models against the microbatch-of-one oracle (float64), in bias and full mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_matches_oracle, engine_per_example, make_engine, oracle_per_example

import dpfit
from dpfit.errors import BatchNormError, UnsupportedLayerError
from dpfit.grad_sample.full import is_factored
from dpfit.vision.models import build_model, load_image_model, save_image_model

B = 3
SMALL = {"resnet-gn": dict(width=8), "vit-tiny": dict(hidden_size=12, num_hidden_layers=2,
                                                      num_attention_heads=2, intermediate_size=16)}  # fmt: skip


def small(arch, channels=1, size=8, classes=4):
    names = [f"c{i}" for i in range(classes)]
    m = build_model(arch, names, channels, size, seed=0, options=SMALL[arch])
    m.module.double().train()
    return m


def batch(channels=1, size=8, classes=4, n=B):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, channels, size, size, generator=g, dtype=torch.double)
    return x, torch.randint(0, classes, (n,), generator=g)


def materialized(got):
    return {k: (v.materialize() if is_factored(v) else v) for k, v in got.items()}


@pytest.mark.parametrize("arch", ["resnet-gn", "vit-tiny"])
@pytest.mark.parametrize("mode", ["bias", "full"])
def test_factory_model_matches_oracle(arch, mode):
    m = small(arch)
    model = m.module
    if mode == "bias":
        dpfit.make_bias_trainable(model, train_head=m.head_names)
    x, y = batch()

    def loss(sl):
        return F.cross_entropy(model(x[sl]), y[sl], reduction="sum")

    want = oracle_per_example(model, lambda i: loss(slice(i, i + 1)), B)
    engine = make_engine(model, mode=mode)
    got = materialized(engine_per_example(engine, lambda: loss(slice(None))))
    engine.detach()
    assert_matches_oracle(got, want)
    names = set(got)
    if mode == "full":  # every parameter, including the ViT's cls token and positions
        assert names == {n for n, _ in model.named_parameters()}
    else:
        assert all(n.endswith("bias") or n.startswith(m.head_names[0]) for n in names)
        assert any(n.endswith("bias") and not n.startswith(m.head_names[0]) for n in names)


def test_vit_embedding_dropout_is_refused_in_full_mode():
    m = small("vit-tiny")
    m.module.net.vit.embeddings.dropout.p = 0.1
    engine = make_engine(m.module, mode="full")
    x, y = batch()
    with pytest.raises(UnsupportedLayerError, match="hidden_dropout_prob=0"):
        F.cross_entropy(m.module(x), y).backward()
    engine.detach()


def test_no_batchnorm_in_factory_models():
    for arch in SMALL:
        m = small(arch)
        assert not any(
            isinstance(x, torch.nn.modules.batchnorm._BatchNorm) for x in m.module.modules()
        )


def test_user_batchnorm_module_refused_then_replaced(tmp_path):
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3),
    )  # fmt: skip
    path = tmp_path / "user.pt"
    torch.save(net, path)
    plain = load_image_model(path, ["a", "b", "c"], 1, 8)
    dpfit.make_bias_trainable(plain.module, train_head=plain.head_names)
    with pytest.raises(BatchNormError, match="replace-batchnorm"):
        make_engine(plain.module)
    fixed = load_image_model(path, ["a", "b", "c"], 1, 8, replace_batchnorm=True)
    dpfit.make_bias_trainable(fixed.module, train_head=fixed.head_names)
    make_engine(fixed.module).detach()
    assert fixed.spec.arch == "torch-module"  # saved whole: the architecture changed


@pytest.mark.parametrize("arch", ["resnet-gn", "vit-tiny"])
def test_save_load_round_trip_and_new_head(tmp_path, arch):
    m = small(arch)
    m.module.float().eval()
    save_image_model(m, tmp_path / "m", {"private": False})
    back = load_image_model(tmp_path / "m")
    assert back.spec == m.spec
    x = batch()[0].float()
    assert torch.equal(m.module(x), back.module.eval()(x))
    other = load_image_model(tmp_path / "m", label_names=["x", "y"], seed=0)
    assert other.module.eval()(x).shape == (B, 2)
    assert other.spec.label_names == ("x", "y")
