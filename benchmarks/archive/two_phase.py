"""Two-phase X+BiTFiT vs DP-BiTFiT vs DP full fine-tuning, at one epsilon.

The bundled MiniLM (all-MiniLM-L6-v2, BERT) with a from-scratch classification head on the
bundled Rotten Tomatoes reviews (split by movie). Every run spends the same budget over the
same number of epochs; only the schedule differs:

    0+BiTFiT  [("bias", E)]             DP-BiTFiT throughout (biases + the new head)
    1+BiTFiT  [("full", 1), ("bias", E-1)]
    2+BiTFiT  [("full", 2), ("bias", E-2)]
    full      [("full", E)]             DP full fine-tuning

Scale: a seeded subsample (default 1,000 training reviews, 500 test reviews, 3 epochs,
length 48) so the four runs take minutes on 2 CPU cores; the paper's CIFAR-100 trend
(19.4 / 82.4 / 89.0 / 90.1 at eps=2) comes from full-size runs. Prints a markdown table and
writes JSON under benchmarks/results/archive/.

    python benchmarks/archive/two_phase.py [--train 1000] [--epochs 3] [--epsilon 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import dpfit
from dpfit.data.bundled import minilm_path, rotten_tomatoes, split_by_group

log = logging.getLogger("two_phase")


def encode(tok, examples, max_length):
    enc = tok([e.text for e in examples], truncation=True, max_length=max_length)
    return [(ids, e.label) for ids, e in zip(enc["input_ids"], examples, strict=True)]


def collate(items):
    n = max(len(ids) for ids, _ in items)
    ids = torch.zeros(len(items), n, dtype=torch.long)
    mask = torch.zeros(len(items), n, dtype=torch.long)
    for i, (x, _) in enumerate(items):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        # explicit [B, T] ids: full mode needs a batch axis on the position embeddings' input
        "position_ids": torch.arange(n).expand(len(items), n).contiguous(),
        "token_type_ids": torch.zeros_like(ids),
        "labels": torch.tensor([y for _, y in items]),
    }


def logits(model, b):
    return model(**{k: v for k, v in b.items() if k != "labels"}).logits


@torch.no_grad()
def accuracy(model, data, bs=64):
    model.eval()
    right = 0
    for i in range(0, len(data), bs):
        b = collate(data[i : i + bs])
        right += int((logits(model, b).argmax(-1) == b["labels"]).sum())
    model.train()
    return right / len(data)


def run(name, schedule, train, test, args):
    from transformers import BertForSequenceClassification

    torch.manual_seed(args.seed)
    model = BertForSequenceClassification.from_pretrained(str(minilm_path()), num_labels=2)
    for mod in model.modules():  # dropout off: per-example gradients of one fixed function
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    dpfit.make_bias_trainable(model, train_head=("classifier",))
    engine = dpfit.PrivacyEngine(
        model,
        expected_batch_size=args.batch,
        sample_size=len(train),
        target_epsilon=args.epsilon,
        target_delta=1.0 / len(train) ** 1.1,
        schedule=schedule,
        max_grad_norm=args.clip,
        insecure_seed=args.seed,  # a benchmark comparison, not a release
        check_gradients=False,
    )
    loader = engine.data_loader(train, collate, physical_batch_size=args.physical)
    t0 = time.perf_counter()
    phases = []
    for phase in engine.phases():
        lr = args.lr_full if phase.mode == "full" else args.lr_bias
        opt = torch.optim.AdamW(engine.parameters(), lr=lr, weight_decay=0.0)
        trainable = sum(p.numel() for p in engine.parameters())
        for _ in range(int(phase.epochs)):
            for b in loader:
                F.cross_entropy(logits(model, b), b["labels"]).backward()
                engine.step(opt)
        phases.append(
            {
                "mode": phase.mode,
                "epochs": phase.epochs,
                "trainable": trainable,
                "epsilon_after": engine.epsilon(),
                "accuracy_after": accuracy(model, test),
            }
        )
        log.info("%s: %s phase done, eps=%.3f", name, phase.mode, engine.epsilon())
    res = {
        "name": name,
        "schedule": [list(s) for s in schedule],
        "accuracy": phases[-1]["accuracy_after"],
        "epsilon": engine.epsilon(),
        "noise_multiplier": engine.noise_multiplier,
        "steps": engine.steps_taken,
        "seconds": time.perf_counter() - t0,
        "phases": phases,
    }
    engine.detach()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", type=int, default=1000)
    ap.add_argument("--test", type=int, default=500)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--epsilon", type=float, default=3.0)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--physical", type=int, default=50)
    ap.add_argument("--clip", type=float, default=0.1)
    ap.add_argument("--lr-full", type=float, default=5e-4)
    ap.add_argument("--lr-bias", type=float, default=5e-3)
    ap.add_argument("--max-length", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", help="run only these rows (e.g. 0+BiTFiT full)")
    ap.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parents[1] / "results" / "archive" / "two_phase.json"),
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(2)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(minilm_path()))
    train_ex, _, test_ex = split_by_group(rotten_tomatoes(), (0.8, 0.1, 0.1), seed=args.seed)
    rng = random.Random(args.seed)
    train = encode(tok, rng.sample(train_ex, args.train), args.max_length)
    test = encode(tok, rng.sample(test_ex, args.test), args.max_length)
    e = args.epochs
    rows = {
        "0+BiTFiT": [("bias", e)],
        "1+BiTFiT": [("full", 1), ("bias", e - 1)],
        "2+BiTFiT": [("full", 2), ("bias", e - 2)],
        "full": [("full", e)],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for name, sched in rows.items():
        if not args.only or name in args.only:
            results.append(run(name, sched, train, test, args))
            out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(
        f"\nMiniLM + new head, Rotten Tomatoes subsample ({args.train} train / {args.test} "
        f"test, {e} epochs, batch {args.batch}, eps={args.epsilon}):\n"
    )
    print("| schedule | accuracy | epsilon | sigma | steps | seconds |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['name']} | {100 * r['accuracy']:.1f}% | {r['epsilon']:.3f} | "
            f"{r['noise_multiplier']:.3f} | {r['steps']} | {r['seconds']:.0f} |"
        )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
