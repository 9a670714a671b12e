"""DPTrainer (a transformers Trainer made private) on the bundled MiniLM, with `dpfit train`'s
hyperparameters.

    python examples/trainer.py --output-dir runs/trainer-demo            # train, checkpointing
    python examples/trainer.py --output-dir runs/trainer-demo --resume   # after an interruption
    python examples/trainer.py --quick                                   # a smoke run

Why each choice:
* Model: `dpfit.models.load_classifier("minilm", labels)` loads the bundled
  all-MiniLM-L6-v2 offline, read by the mean of its token states (how this
  sentence-transformers model was trained) into a zero-initialised head, as `dpfit train`
  does. The hub id sentence-transformers/all-MiniLM-L6-v2 needs the network.
* Hyperparameters: `dpfit.recipe.resolve_recipe`, the function `dpfit train` uses, from
  public quantities only. Its learning rate for biases + head is 5e-3 with automatic clipping,
  at a constant rate: Trainer's default, 5e-5 decaying linearly, is a rate for fine-tuning
  every weight without noise, 100 times smaller.
* `dpfit train` also runs a private linear probe of the head first (head-first), which
  DPTrainer does not; `dpfit train --no-head-first` is this script's match.
* Resuming is for a run that stopped before its end (a crash, Ctrl-C, a time limit): run the
  same command again with --resume. The privacy ledger and the Poisson sampler continue from
  the newest checkpoint; a finished run is not resumed to train more (that would be a second,
  separately accounted release). --stop-after-steps N stops a run after step N as a crash
  would, to try it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from pathlib import Path

import torch
from transformers import DataCollatorWithPadding, TrainerCallback, TrainingArguments

from dpfit.data import bundled_rotten_tomatoes
from dpfit.integrations import DPTrainer, PrivacyArguments
from dpfit.models import load_classifier
from dpfit.recipe import default_delta, default_dropout, resolve_recipe


class StopAfter(TrainerCallback):
    """Stops training after a given step (after its checkpoint), as an interruption would."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--output-dir", default=None, help="checkpoints and the model (default: a temp dir)"
    )
    p.add_argument("--resume", action="store_true", help="continue the newest checkpoint")
    p.add_argument("--stop-after-steps", type=int, default=None, help="simulate an interruption")
    p.add_argument("--epsilon", type=float, default=8.0)
    p.add_argument("--train-examples", type=int, default=2000)
    p.add_argument("--test-examples", type=int, default=500)
    p.add_argument("--epochs", type=int, default=None, help="default: the recipe's")
    p.add_argument("--max-length", type=int, default=None, help="default: the recipe's")
    p.add_argument("--save-steps", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--seed", type=int, default=0, help="data split and head init (public)")
    p.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("DPFIT_EXAMPLES_QUICK") == "1",
        help="a smoke run: 64 examples, 1 epoch, short texts (also DPFIT_EXAMPLES_QUICK=1)",
    )
    args = p.parse_args(argv)
    if args.quick:  # small enough for the test suite; the numbers it prints mean nothing
        args.train_examples, args.test_examples, args.save_steps = 64, 64, 2
        args.epochs, args.max_length = args.epochs or 1, args.max_length or 32
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.resume and not args.output_dir:
        raise SystemExit("--resume continues a stopped run: give its --output-dir")
    tmp = tempfile.TemporaryDirectory()
    output_dir = Path(args.output_dir or tmp.name)

    # Data: the bundled reviews, split by movie. Replace with your own lists of texts/labels.
    splits = bundled_rotten_tomatoes(args.seed)
    train = splits.train.subsample(args.train_examples, args.seed)
    test = splits.test.subsample(args.test_examples, args.seed)
    n = len(train)

    # The model: the bundled MiniLM, dropout off (DP noise already regularises).
    loaded = load_classifier(
        "minilm", train.label_names, seed=args.seed, dropout=default_dropout(private=True)
    )
    model, tokenizer = loaded.model, loaded.tokenizer
    params = sum(p.numel() for p in model.parameters())

    # `dpfit train`'s recipe (docs/train.md, "The recipe"), without its head-first phase.
    delta = default_delta(n)
    recipe = resolve_recipe(n, train.num_labels, args.epsilon, delta, params, head_first=False)
    recipe = dataclasses.replace(
        recipe,
        epochs=args.epochs or recipe.epochs,
        max_length=args.max_length or recipe.max_length,
    )
    print(f"recipe: {recipe.describe()}")

    def rows(part) -> list[dict]:
        enc = tokenizer(list(part.texts), truncation=True, max_length=recipe.max_length)
        return [
            {"input_ids": ids, "attention_mask": mask, "label": label}
            for ids, mask, label in zip(
                enc["input_ids"], enc["attention_mask"], part.labels, strict=True
            )
        ]

    training_args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=recipe.batch_size,  # the *expected* Poisson batch
        num_train_epochs=recipe.epochs,
        learning_rate=recipe.lr,  # 5e-3 for biases + head; not Trainer's 5e-5
        lr_scheduler_type="constant",  # as `dpfit train`
        weight_decay=0.0,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=2,  # checkpoints are secret: keep them with the data, delete after
        logging_steps=args.save_steps,
        report_to=[],
        seed=args.seed,  # public randomness only; DP noise and sampling come from the OS
        disable_tqdm=args.quick,
    )
    trainer = DPTrainer(
        model=model,
        args=training_args,
        train_dataset=rows(train),
        data_collator=DataCollatorWithPadding(tokenizer),
        privacy=PrivacyArguments(
            target_epsilon=args.epsilon,
            target_delta=delta,
            clipping=recipe.clipping,  # automatic: no clip norm to tune
            max_grad_norm=recipe.max_grad_norm,
            physical_batch_size=recipe.physical_batch_size,  # memory only; same update
        ),
        callbacks=[StopAfter(args.stop_after_steps)] if args.stop_after_steps else None,
    )
    # resume_from_checkpoint=True: the newest checkpoint in output_dir, privacy ledger included
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    engine = trainer.privacy_engine
    if args.stop_after_steps and trainer.state.global_step < trainer.state.max_steps:
        print(
            f"stopped after step {trainer.state.global_step} of {trainer.state.max_steps} "
            f"(epsilon so far {engine.epsilon():.3f}); continue with the same command and --resume"
        )
        return

    predictions = trainer.predict(rows(test)).predictions
    logits = predictions[0] if isinstance(predictions, tuple) else predictions
    accuracy = float(
        (torch.as_tensor(logits).argmax(-1) == torch.tensor(test.labels)).float().mean()
    )
    trainer.save_model(str(output_dir / "model"))  # also writes dpfit.json, the privacy record
    print(f"epsilon {engine.epsilon():.4f} (target {args.epsilon:g}, delta {delta:.2g})")
    print(f"accuracy {accuracy:.3f} on {len(test)} held-out examples")
    tmp.cleanup()


if __name__ == "__main__":
    main()
