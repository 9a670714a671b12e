"""privacy_unit="document" scenarios run by each rank of a gloo job (and, with world size 1,
in the test process): a tiny causal LM (tests/long_llama.py, float64, biases trainable) on
documents of 1 to 4 windows of 16 tokens.

Run as `python document_worker.py RANK WORLD PORT OUT SCENARIO [SCENARIO...]`; every rank
writes its results to OUT/rank{RANK}.pt.
"""

from __future__ import annotations

import sys

import torch
from gloo_worker import run_scenarios
from long_llama import tiny_long_llama, token_ids
from oracle import Capture

import dpfit
from dpfit.causal_lm import Window, causal_lm_loss, make_collate, windows

LENGTH, STRIDE = 16, 12
# tokens per document: 3, 1, 4, 2, 1, 4, 3 and 2 windows (20 in all)
UPDATE_DOCS = (40, 16, 52, 28, 16, 41, 29, 17)
# q = 1 on 2 ranks: rank 0 holds documents 0 and 2 (3 + 2 windows, physical batches of 2, so
# document 0 spans two of them), rank 1 document 1. Split by rows instead (every second
# window), documents 0 and 2 would each have windows on both ranks.
STRADDLE_DOCS = (40, 16, 28)

Row = tuple[int, int, Window]  # (document, its k-th window, the window)


def documents(lengths: tuple[int, ...]) -> list[list[Row]]:
    """Each document a list of rows; a row carries its document and place, so each rank can
    report which windows it trained on."""
    out = []
    for d, n in enumerate(lengths):
        out.append([(d, k, w) for k, w in enumerate(windows(token_ids(n, 20 + d), LENGTH, STRIDE))])
    return out


def collate(rows: list[Row]) -> tuple[list[tuple[int, int]], dict]:
    return [(d, k) for d, k, _ in rows], make_collate(0)([w for _, _, w in rows])


def trainable(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat(
        [p.detach().reshape(-1).clone() for p in model.parameters() if p.requires_grad]
    )


def update(world: int, steps: int = 4) -> dict:
    """sigma = 0, q = 1/2 over 8 documents, one insecure seed (the same global sample in 1 and
    2 processes), R = 0.5, which clips some documents and not others, SGD: the parameters after `steps`
    logical steps and, per step, the (document, window) rows this rank trained on."""
    model = tiny_long_llama().train()
    docs = documents(UPDATE_DOCS)
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=4, sample_size=len(docs), noise_multiplier=0.0,
        max_grad_norm=0.5, insecure_seed=11, privacy_unit="document",
    )  # fmt: skip
    opt = torch.optim.SGD(engine.parameters(), lr=0.5)
    loader = engine.data_loader(
        docs, collate, physical_batch_size=3, max_steps=steps, optimizer=opt
    )
    drawn: dict[int, list[tuple[int, int]]] = {}
    current: list[tuple[int, int]] = []
    while engine.steps_taken < steps:
        for rows, batch in loader:
            current.extend(rows)
            causal_lm_loss(model, batch).backward()
            if engine.step(opt):
                drawn[engine.steps_taken] = current
                current = []
    return {"params": trainable(model), "steps": engine.steps_taken, "drawn": drawn}


def straddle(world: int, max_grad_norm: float) -> dict:
    """sigma = 0, q = 1 over STRADDLE_DOCS: the released gradient (sum of clipped documents
    / B) and this rank's rows."""
    model = tiny_long_llama().train()
    docs = documents(STRADDLE_DOCS)
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=len(docs), sample_size=len(docs), noise_multiplier=0.0,
        max_grad_norm=max_grad_norm, privacy_unit="document",
    )  # fmt: skip
    opt = Capture(engine.parameters())
    loader = engine.data_loader(docs, collate, physical_batch_size=2, optimizer=opt)
    rows, batches = [], 0
    for seen, batch in loader:
        rows.extend(seen)
        causal_lm_loss(model, batch).backward()
        batches += 1
        if engine.step(opt):
            break
    released = torch.cat([opt.grads[p].reshape(-1) for p in engine.parameters()])
    return {"released": released, "rows": rows, "batches": batches}


def noise(world: int, steps: int = 32) -> dict:
    """Zero gradients, sigma = 1, R = 1, B = 4, lr = 1: each released update is pure noise of
    std 1/4 per coordinate."""
    model = tiny_long_llama().train()
    docs = documents(UPDATE_DOCS)
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=4, sample_size=len(docs), noise_multiplier=1.0,
        max_grad_norm=1.0, privacy_unit="document",
    )  # fmt: skip
    opt = torch.optim.SGD(engine.parameters(), lr=1.0)
    loader = engine.data_loader(
        docs, collate, physical_batch_size=3, max_steps=steps, optimizer=opt
    )
    deltas = []
    prev, prev_steps = trainable(model), 0
    # the parameters after each step count this rank saw: where a rank's share was empty it
    # steps inside the loader, so two ranks see different counts (and group deltas apart)
    seen = {0: prev}

    def observe() -> None:
        nonlocal prev, prev_steps
        k = engine.steps_taken - prev_steps
        if k:  # an empty share steps inside the loader: k noise draws, std times sqrt(k)
            now = trainable(model)
            deltas.append((now - prev) / k**0.5)
            prev, prev_steps = now, engine.steps_taken
            seen[prev_steps] = now

    while engine.steps_taken < steps:
        for _rows, batch in loader:
            observe()
            (causal_lm_loss(model, batch) * 0.0).backward()
            engine.step(opt)
            observe()
        observe()
    return {
        "deltas": torch.stack(deltas),
        "seen": seen,
        "params": trainable(model),
        "steps": engine.steps_taken,
        "epsilon": engine.epsilon(),
        "record": engine.privacy_record(),
    }


def refused(world: int) -> dict:
    """sampling='user-poisson' with the document unit on a group of 2: the error's message."""
    from dpfit.errors import DistributedError

    try:
        dpfit.PrivacyEngine(
            tiny_long_llama(), expected_batch_size=2, sample_size=8, noise_multiplier=1.0,
            sampling="user-poisson", privacy_unit="document",
        )  # fmt: skip
    except DistributedError as e:
        return {"error": str(e)}
    return {"error": None}


def main(argv: list[str]) -> None:
    run_scenarios(
        argv,
        {
            "update": lambda world, args: update(world),
            "straddle": lambda world, args: straddle(world, float(args[0])),
            "noise": lambda world, args: noise(world),
            "refused": lambda world, args: refused(world),
        },
        timeout_s=60,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
