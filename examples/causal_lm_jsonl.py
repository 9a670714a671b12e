"""Private fine-tuning of a causal language model (the bundled SmolLM2-135M) on a JSONL file of
your own texts, with DP-BiTFiT-Add.

    python examples/causal_lm_jsonl.py                              # bundled Hamlet as JSONL
    python examples/causal_lm_jsonl.py --data notes.jsonl --text-column body
    python examples/causal_lm_jsonl.py --quick                      # a smoke run

Each JSONL line is one object whose --text-column field is one training text (one protected
example); longer texts are cut at the recipe's max length.

Why each choice:
* Model: `dpfit.data.bundled_model("smollm2")` is a plain transformers folder of the bundled
  SmolLM2-135M-Instruct, offline (its 4-bit GGUF is dequantised once, about 40 s, then cached
  in $DPFIT_CACHE or ~/.cache/dpfit). Your own folder goes through the same lines.
* SmolLM2, like most LLaMA-family models, has no biases at all: `dpfit.add_biases` adds zero
  ones (BiTFiT-Add), which leave the model's outputs unchanged until they train.
* Loss: each text's mean next-token loss, then the mean over texts
  (`dpfit.causal_lm.causal_lm_loss`). transformers' own loss averages over every token of the
  batch, so an example's gradient would depend on its neighbours' lengths; DP-SGD clips each
  example's gradient and needs a loss that splits per example.
* Learning rate: `dpfit.recipe.resolve_recipe` with 0 classes, as `dpfit train --task
  causal-lm` does: a pretrained LM already does its task, so the rate is a small noise walk
  spread over the run's steps (about 5e-4 for 30 steps), not the 5e-3 a new head needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import dpfit
from dpfit.causal_lm import TokenizedLines, causal_lm_loss, make_collate, perplexity
from dpfit.data import bundled_model, hamlet_lines
from dpfit.models import load_tokenizer
from dpfit.recipe import default_delta, resolve_recipe


def write_demo_jsonl(path: Path, lines_per_text: int = 2) -> Path:
    """Hamlet, two lines per text, one JSON object per line: a stand-in for your own file."""
    lines = hamlet_lines()
    with open(path, "w", encoding="utf-8") as f:
        for i in range(0, len(lines) - lines_per_text + 1, lines_per_text):
            f.write(json.dumps({"text": "\n".join(lines[i : i + lines_per_text])}) + "\n")
    return path


def read_jsonl(path: str | Path, text_column: str) -> list[str]:
    texts = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get(text_column), str):
            raise SystemExit(f"{path} line {i + 1}: no text field {text_column!r} (--text-column)")
        texts.append(row[text_column])
    return texts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="your JSONL, one text per line (default: bundled Hamlet)")
    p.add_argument("--eval-data", help="held-out JSONL (default: the last --eval-examples texts)")
    p.add_argument("--text-column", default="text")
    p.add_argument("--model", default="smollm2", help="a folder, a hub id, or smollm2 (bundled)")
    p.add_argument("--epsilon", type=float, default=8.0)
    p.add_argument("--train-examples", type=int, default=256)
    p.add_argument("--eval-examples", type=int, default=32)
    p.add_argument("--epochs", type=int, default=None, help="default: the recipe's")
    p.add_argument("--max-length", type=int, default=None, help="default: the recipe's")
    p.add_argument("--seed", type=int, default=0, help="which texts train (public)")
    p.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("DPFIT_EXAMPLES_QUICK") == "1",
        help="a smoke run: 16 texts, 1 epoch, 32 tokens (also DPFIT_EXAMPLES_QUICK=1)",
    )
    args = p.parse_args(argv)
    if args.quick:  # small enough for the test suite; the numbers it prints mean nothing
        args.train_examples, args.eval_examples = 16, 8
        args.epochs, args.max_length = args.epochs or 1, args.max_length or 32
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tmp = tempfile.TemporaryDirectory()
    data = args.data or write_demo_jsonl(Path(tmp.name) / "hamlet.jsonl")
    texts = read_jsonl(data, args.text_column)
    if args.eval_data:
        held_out = read_jsonl(args.eval_data, args.text_column)[: args.eval_examples]
    else:  # the end of the file, so held-out texts do not interleave with training ones
        texts, held_out = texts[: -args.eval_examples], texts[-args.eval_examples :]
    generator = torch.Generator().manual_seed(args.seed)  # public: which texts train
    order = torch.randperm(len(texts), generator=generator).tolist()
    train_texts = [texts[i] for i in order[: args.train_examples]]
    n = len(train_texts)

    folder = bundled_model(args.model) or args.model  # a bundled name, or your folder / hub id
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = load_tokenizer(folder)  # pads with EOS where the model has no pad token
    params = sum(p.numel() for p in model.parameters())

    delta = default_delta(n)
    recipe = resolve_recipe(n, 0, args.epsilon, delta, params)  # 0 classes: language modelling
    recipe = dataclasses.replace(
        recipe,
        epochs=args.epochs or recipe.epochs,
        max_length=args.max_length or recipe.max_length,
    )
    print(f"recipe: {recipe.describe()}")

    train = TokenizedLines(train_texts, tokenizer, recipe.max_length)
    evaluation = TokenizedLines(held_out, tokenizer, recipe.max_length)
    collate = make_collate(tokenizer.pad_token_id)
    before = perplexity(model, evaluation, collate)

    if not any(name.endswith("bias") for name, _ in model.named_parameters()):
        dpfit.add_biases(model)  # zero biases: the same function until they train
    dpfit.make_bias_trainable(model, train_head=())  # the LM head is the pretrained one
    engine = dpfit.PrivacyEngine(
        model,
        expected_batch_size=recipe.batch_size,
        sample_size=n,
        target_epsilon=args.epsilon,
        target_delta=delta,
        epochs=recipe.epochs,
        max_grad_norm=recipe.max_grad_norm,
        clipping=recipe.clipping,
    )
    optimizer = torch.optim.AdamW(engine.parameters(), lr=recipe.lr, weight_decay=0.0)
    model.train()
    for _ in range(recipe.epochs):
        for batch in engine.data_loader(
            train,
            collate_fn=collate,
            physical_batch_size=recipe.physical_batch_size,
            optimizer=optimizer,
        ):
            causal_lm_loss(model, batch).backward()
            engine.step(optimizer)

    after = perplexity(model, evaluation, collate)
    print(f"held-out perplexity {before:.2f} before, {after:.2f} after")
    print(f"epsilon {engine.epsilon():.4f} (target {args.epsilon:g}, delta {delta:.2g})")
    print(f"perplexity {after:.3f} on {len(evaluation)} held-out texts")
    tmp.cleanup()


if __name__ == "__main__":
    main()
