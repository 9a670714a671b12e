"""DP-BiTFiT with dpfit's library loop, on a model and a CSV of your own.

    python examples/library_loop.py                          # bundled MiniLM, bundled reviews
    python examples/library_loop.py --data my.csv --text-column review --label-column stars
    python examples/library_loop.py --quick                  # a smoke run of a few seconds

The loop is the one in README.md ("Library in ten lines"), made complete: load a model, pick
the hyperparameters, freeze all but the biases (and the new head), train under a
`dpfit.PrivacyEngine`, report epsilon and the held-out accuracy.

Why each choice:
* The hyperparameters come from `dpfit.recipe.resolve_recipe`, the function `dpfit train`
  uses, from public quantities only (number of examples, classes, epsilon, model size):
  5e-3 for biases + head with automatic clipping, 100 times a Trainer's default 5e-5.
* Two phases, as `dpfit train` runs them: a private linear probe of the new head on frozen
  features first (head-first), then biases + head. A zero-initialised head trained at the
  biases' rate moves too slowly. One noise multiplier and one ledger cover both phases, so
  the epsilon printed at the end is the whole run's.
* Without --data the script writes a small CSV from the bundled Rotten Tomatoes reviews
  (split by movie, as `dpfit train` does) so that it runs offline; with --data your file is
  read by the same reader as `dpfit train --data`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import dpfit
from dpfit.data import bundled_rotten_tomatoes, load_texts
from dpfit.models import load_classifier
from dpfit.recipe import default_delta, default_dropout, resolve_recipe


def write_demo_csvs(folder: Path, n_train: int, n_test: int, seed: int) -> tuple[Path, Path]:
    """train.csv and test.csv (columns text,label) from the bundled reviews: a stand-in for
    your own file. The bundled split keeps every movie in one split only."""
    splits = bundled_rotten_tomatoes(seed)
    paths = []
    for name, part, n in (("train", splits.train, n_train), ("test", splits.test, n_test)):
        part = part.subsample(n, seed)
        path = folder / f"{name}.csv"
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["text", "label"])
            for text, label in zip(part.texts, part.labels, strict=True):
                w.writerow([text, part.label_names[label]])
        paths.append(path)
    return paths[0], paths[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="your CSV/JSONL of labelled texts (default: bundled reviews)")
    p.add_argument("--eval-data", help="held-out file (default: 20%% of --data, at random)")
    p.add_argument("--text-column", default="text")
    p.add_argument("--label-column", default="label")
    p.add_argument("--model", default="minilm", help="a folder, a hub id, or minilm (bundled)")
    p.add_argument("--epsilon", type=float, default=8.0)
    p.add_argument("--train-examples", type=int, default=2000, help="demo data only")
    p.add_argument("--test-examples", type=int, default=500, help="demo data only")
    p.add_argument("--epochs", type=int, default=None, help="default: the recipe's")
    p.add_argument("--max-length", type=int, default=None, help="default: the recipe's")
    p.add_argument("--seed", type=int, default=0, help="data split and head init (public)")
    p.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("DPFIT_EXAMPLES_QUICK") == "1",
        help="a smoke run: 64 examples, 1 epoch, short texts (also DPFIT_EXAMPLES_QUICK=1)",
    )
    args = p.parse_args(argv)
    if args.quick:  # small enough for the test suite; the numbers it prints mean nothing
        args.train_examples, args.test_examples = 64, 64
        args.epochs, args.max_length = args.epochs or 1, args.max_length or 32
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)  # public randomness only: the head's initialisation
    tmp = tempfile.TemporaryDirectory()
    if args.data is None:
        args.data, args.eval_data = write_demo_csvs(
            Path(tmp.name), args.train_examples, args.test_examples, args.seed
        )
    train = load_texts(args.data, args.text_column, args.label_column)
    if args.eval_data:
        test = load_texts(args.eval_data, args.text_column, args.label_column, train.label_names)
    else:
        train, test = train.split(0.2, seed=args.seed)
    n = len(train)

    # The model: `minilm` is the bundled all-MiniLM-L6-v2 (offline), read by the mean of its
    # token states into a zero-initialised linear head, as `dpfit train` does. Dropout off:
    # the DP noise already regularises, and a dropout mask adds variance to every gradient.
    loaded = load_classifier(
        args.model, train.label_names, seed=args.seed, dropout=default_dropout(private=True)
    )
    model, tokenizer = loaded.model, loaded.tokenizer
    params = sum(p.numel() for p in model.parameters())

    # Every default of `dpfit train`, from public quantities only (docs/train.md, "The recipe").
    delta = default_delta(n)
    recipe = resolve_recipe(n, train.num_labels, args.epsilon, delta, params)
    recipe = dataclasses.replace(  # flags override single fields, as in `dpfit train`
        recipe,
        epochs=args.epochs or recipe.epochs,
        head_epochs=args.epochs or recipe.head_epochs,
        max_length=args.max_length or recipe.max_length,
    )
    print(f"recipe: {recipe.describe()}")

    examples = list(zip(train.texts, train.labels, strict=True))

    def collate(batch: list[tuple[str, int]]) -> dict:
        inputs = tokenizer(
            [text for text, _ in batch],
            truncation=True,
            max_length=recipe.max_length,
            padding=True,
            return_tensors="pt",
        )
        return {"inputs": inputs, "labels": torch.tensor([y for _, y in batch])}

    # One noise multiplier for every step of both phases, calibrated so that all of them
    # together spend the target epsilon; both phases sample at q = B / n.
    q = recipe.batch_size / n
    steps_per_epoch = max(1, round(1 / q))
    total_steps = (recipe.head_epochs + recipe.epochs) * steps_per_epoch
    sigma = dpfit.noise_multiplier_for(args.epsilon, delta, q, total_steps)
    common = dict(
        expected_batch_size=recipe.batch_size,  # Poisson sampling at q = B / n
        sample_size=n,
        noise_multiplier=sigma,
        target_delta=delta,
        max_grad_norm=recipe.max_grad_norm,
        clipping=recipe.clipping,  # automatic (Bu et al.): no clip norm to tune
    )

    # Phase 1, head-first: a private linear probe of the zero-initialised head on frozen
    # features (one backbone pass). At the biases' rate such a head moves too slowly, and a
    # run ends far below `dpfit train`.
    features = frozen_features(model, collate, examples)
    probe = list(zip(features, train.labels, strict=True))
    head_engine = dpfit.PrivacyEngine(model.head, **common)
    head_optimizer = torch.optim.AdamW(
        head_engine.parameters(), lr=recipe.head_lr, weight_decay=0.0
    )
    for _ in range(recipe.head_epochs):
        for batch in head_engine.data_loader(
            probe, collate_fn=stack, physical_batch_size=n, optimizer=head_optimizer
        ):
            F.cross_entropy(model.head(batch["x"]), batch["y"]).backward()
            head_engine.step(head_optimizer)
    ledger = head_engine.state_dict()
    ledger.pop("loader")  # the next phase has a loader of its own
    head_engine.detach()
    print(f"head-first: epsilon so far {head_engine.epsilon():.3f}")

    # Phase 2, DP-BiTFiT: only the biases and the head train (about 0.1% of MiniLM).
    dpfit.make_bias_trainable(model, train_head=loaded.head_names)
    engine = dpfit.PrivacyEngine(model, **common)
    engine.load_state_dict(ledger)  # one ledger: the head-first steps are composed in
    optimizer = torch.optim.AdamW(engine.parameters(), lr=recipe.lr, weight_decay=0.0)
    model.train()
    for epoch in range(recipe.epochs):
        # Poisson batches of variable size; each logical batch arrives in physical batches of
        # at most physical_batch_size examples. Call engine.step after every backward.
        for batch in engine.data_loader(
            examples,
            collate_fn=collate,
            physical_batch_size=recipe.physical_batch_size,
            optimizer=optimizer,  # an empty Poisson batch is a noise-only step taken in order
        ):
            logits = model(**batch["inputs"]).logits
            loss = F.cross_entropy(logits, batch["labels"])  # the mean of per-example losses
            loss.backward()
            engine.step(optimizer)  # clip each example, sum, add noise once, step, account
        print(f"epoch {epoch + 1}/{recipe.epochs}: epsilon so far {engine.epsilon():.3f}")

    accuracy = evaluate(model, collate, list(zip(test.texts, test.labels, strict=True)))
    print(f"epsilon {engine.epsilon():.4f} (target {args.epsilon:g}, delta {delta:.2g})")
    print(f"accuracy {accuracy:.3f} on {len(test)} held-out examples")
    tmp.cleanup()


@torch.no_grad()
def frozen_features(model, collate, examples: list[tuple[str, int]]) -> torch.Tensor:
    """The pooled features the head reads, for every training example."""
    model.eval()
    out = [
        model.features(**collate(examples[i : i + 64])["inputs"])
        for i in range(0, len(examples), 64)
    ]
    model.train()
    return torch.cat(out)


def stack(batch: list[tuple[torch.Tensor, int]]) -> dict:
    if not batch:  # an empty Poisson batch (the engine takes its noise-only step itself)
        return {"x": torch.zeros(0), "y": torch.zeros(0, dtype=torch.long)}
    return {"x": torch.stack([x for x, _ in batch]), "y": torch.tensor([y for _, y in batch])}


@torch.no_grad()
def evaluate(model: torch.nn.Module, collate, examples: list[tuple[str, int]]) -> float:
    model.eval()
    right = 0
    for i in range(0, len(examples), 64):
        batch = collate(examples[i : i + 64])
        right += int((model(**batch["inputs"]).logits.argmax(-1) == batch["labels"]).sum())
    return right / len(examples)


if __name__ == "__main__":
    main()
