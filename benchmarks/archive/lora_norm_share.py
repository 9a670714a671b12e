"""Under one global clip, how much of each example's gradient norm do the LoRA adapters take
from the biases in `--mode bias+lora`?

With automatic clipping every example's gradient is scaled to norm R as a whole, and the noise
per coordinate is the same in every group. So the biases' signal-to-noise in bias+lora is the
bias-only run's times ||g_bias|| / ||g_all||: if the adapters dominate the norm, bias+lora
trains its biases with less signal than DP-BiTFiT does. This measures that ratio on the
bundled MiniLM with the suite's defaults (rank 8, alpha 16, query/value), each example alone
(no per-example machinery involved), where the bias phase starts: lora_B = 0, and the head
(zero at initialisation, so no gradient reaches the backbone) fitted first, here non-privately
on a few thousand examples (the head-first phase's role).

    python benchmarks/archive/lora_norm_share.py --task convention-party --examples 64 --head-steps 30

Budget: about two minutes of one core (load, 30 head steps of 32, 64 single-example passes).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # archived: utility is one up

import utility  # noqa: E402

from dpfit.params import in_peft_head, is_bias, is_lora  # noqa: E402
from dpfit.run.trainables import prepare_trainables as _prepare_trainables  # noqa: E402
from dpfit.tasks import get_task  # noqa: E402
from dpfit.train import TrainConfig  # noqa: E402

GROUPS = ("bias", "lora_A", "lora_B", "head")


def group_of(name: str, heads: tuple[str, ...]) -> str:
    if in_peft_head(name) or any(name == h or name.startswith(h + ".") for h in heads):
        return "head"
    if is_lora(name):
        return "lora_A" if "lora_A" in name else "lora_B"
    if is_bias(name):
        return "bias"
    raise ValueError(f"unexpected trainable parameter {name}")


def per_example_shares(model, task, collate, items, heads) -> dict:
    """Each example alone: squared gradient norm per group, then shares of the total."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sq = {g: [] for g in GROUPS}
    for it in items:
        model.zero_grad(set_to_none=True)
        task.loss(model, collate([it])).backward()
        by = dict.fromkeys(GROUPS, 0.0)
        for n, p in named:
            if p.grad is not None:
                by[group_of(n, heads)] += float(p.grad.double().pow(2).sum())
        for g in GROUPS:
            sq[g].append(by[g])
    total = [sum(sq[g][i] for g in GROUPS) for i in range(len(items))]
    no_head = [t - h for t, h in zip(total, sq["head"], strict=True)]
    return {
        "median_norm": {g: statistics.median(v**0.5 for v in sq[g]) for g in GROUPS},
        # the share of the clipped norm the biases keep (bias-only: the head's share only)
        "median_bias_share_of_norm": statistics.median(
            (b / t) ** 0.5 for b, t in zip(sq["bias"], total, strict=True)
        ),
        "median_bias_share_of_norm_bias_only_mode": statistics.median(
            (b / (b + h)) ** 0.5 for b, h in zip(sq["bias"], sq["head"], strict=True)
        ),
        "median_lora_share_of_backbone_norm": statistics.median(
            ((t - b) / t) ** 0.5 for b, t in zip(sq["bias"], no_head, strict=True)
        ),
    }


def fit_head(model, task, collate, items, heads, steps: int, seed: int) -> None:
    """Non-private AdamW on the head alone (a stand-in for the head-first phase)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    head = [p for n, p in trainable if group_of(n, heads) == "head"]
    keep = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(any(p is q for q in head))
    opt = torch.optim.AdamW(head, lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(len(items), (32,), generator=g).tolist()
        opt.zero_grad(set_to_none=True)
        task.loss(model, collate([items[i] for i in idx])).backward()
        opt.step()
    for p, r in keep.items():
        p.requires_grad_(r)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="convention-party")
    p.add_argument("--examples", type=int, default=64)
    p.add_argument("--head-steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    _, train_csv, _ = utility.task_data(args.task, args.seed, utility.Scale(None, None))
    cfg = TrainConfig(data=str(train_csv), mode="bias+lora", seed=args.seed)
    task = get_task(cfg.task)
    prep = task.prepare(cfg)
    model = prep.model
    _prepare_trainables(model, prep.head_names, cfg, prep.biases_added, prep.head_only)
    model.train()
    items = task.items(prep, 128)
    collate = task.collate(prep, False)
    g = torch.Generator().manual_seed(args.seed + 1)
    sample = [items[i] for i in torch.randperm(len(items), generator=g)[: args.examples]]
    out = {
        "question": __doc__.split("\n\n")[0],
        "command": "python benchmarks/archive/lora_norm_share.py " + " ".join(argv or sys.argv[1:]),
        "task": args.task,
        "examples": args.examples,
        "lora": {"r": cfg.lora_r, "alpha": cfg.lora_alpha, "targets": "peft default (bert)"},
    }
    # the head starts at zero (no gradient reaches the backbone): fit it first
    fit_head(model, task, collate, items, prep.head_names, args.head_steps, args.seed)
    out["after_head_fit"] = per_example_shares(model, task, collate, sample, prep.head_names)
    out["head_steps"] = args.head_steps
    path = utility.RESULTS / "archive" / f"lora_norm_share_{args.task}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
