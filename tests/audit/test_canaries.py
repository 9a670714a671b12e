"""Gradient canaries: the per-example gradient of a canary row is exactly scale * u_j in its
module's bias and zero in every other trained tensor; an excluded (inert) row has none."""

from __future__ import annotations

import torch

from dpfit.audit.canaries import GradientCanaries, draw_inclusion, scores_from_observations
from dpfit.audit.toy import TOY_TARGETS, toy_collate, toy_items, toy_losses, toy_model


def row_grads(model, canaries, item, cid, live):
    batch = toy_collate([item])
    ids = torch.tensor([cid])
    with canaries.active(ids) as outs:
        task = toy_losses(model, batch)
    loss = torch.where(ids < 0, task, torch.zeros_like(task)) + canaries.loss_terms(
        outs, ids, torch.tensor([live])
    )
    params = [p for p in model.parameters() if p.requires_grad]
    return dict(
        zip(params, torch.autograd.grad(loss.sum(), params, allow_unused=True), strict=True)
    )


def test_canary_gradient_is_its_direction_only():
    model = toy_model(width=32)
    can = GradientCanaries(model, TOY_TARGETS, m=40, scale=7.0, seed=3)
    assert can.target_of.bincount().tolist() == [20, 20]  # equal bias sizes: half each
    u = can.directions
    assert torch.allclose(u[:20, :32] @ u[:20, :32].T, torch.eye(20), atol=1e-5)  # orthonormal
    item = toy_items(1)[0]
    for j in (0, 25):
        k = int(can.target_of[j])
        grads = row_grads(model, can, item, j, 1.0)
        for p, g in grads.items():
            if p is can.bias(k):
                assert torch.allclose(g, 7.0 * u[j, :32], atol=1e-5)
            else:
                assert g is None or torch.count_nonzero(g) == 0, p.shape
        inert = row_grads(model, can, item, j, 0.0)
        assert all(g is None or torch.count_nonzero(g) == 0 for g in inert.values())


def test_inclusion_and_scores():
    inc = draw_inclusion(10_000, seed=0)
    assert abs(inc.float().mean().item() - 0.5) < 0.02
    x = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    assert scores_from_observations(x, "sum", 0.5, 1.0).tolist() == [0.0, 2.0]
    llr = scores_from_observations(x, "llr", 0.5, 1.0)
    # log(1/2 + 1/2 e^{(2x-1)/2}) per step, two steps
    expect = [2 * torch.log(torch.tensor(0.5 + 0.5 * 2.718281828**v)).item() for v in (-0.5, 0.5)]
    assert torch.allclose(llr.float(), torch.tensor(expect), atol=1e-6)
