"""Causal language modelling as a task plug-in: DP-BiTFiT-Add on lines of text.

Data: a text file's non-empty lines (default: the bundled Hamlet), joined a few at a time into
examples; the last ones are held out. Model: the bundled SmolLM2 (or any causal LM folder or
.gguf file) with zero-initialised biases added where it has none. Loss: each example's mean
token NLL, averaged over examples (per-example decomposable). Metric: held-out perplexity
before and after, plus a few sampled continuations.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dpfit.causal_lm import (
    TokenizedLines,
    causal_lm_loss,
    make_collate,
    make_examples,
    perplexity,
    sample_lines,
    split_examples,
)
from dpfit.errors import DPFitError
from dpfit.tasks import Prepared

log = logging.getLogger(__name__)


@dataclass
class CausalLMTask:
    """Options that are not run settings (they shape the data, and are public)."""

    lines_per_example: int = 2
    eval_examples: int = 64
    default_train_examples: int = 512
    sample_prompts: tuple[str, ...] = ("To be, or not", "My lord,", "O, what a")
    sample_tokens: int = 20
    eval_batch_size: int = 16
    name: str = "causal-lm"

    # -- reading -------------------------------------------------------------------------
    def prepare(self, config) -> Prepared:
        model, tokenizer = self._load_model(config)
        return self.prepare_from(model, tokenizer, self._lines(config), config)

    def _load_model(self, config):
        if config.model is None:
            from dpfit.data.smollm import load_smollm2

            lm = load_smollm2()
            return lm.model, lm.tokenizer
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from dpfit.models import _resolve

        target, kwargs, local = _resolve(config.model)
        model = AutoModelForCausalLM.from_pretrained(target, local_files_only=local, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=local, **kwargs)
        return model, tokenizer

    @staticmethod
    def _lines(config) -> list[str]:
        if config.data is None:
            from dpfit.data.bundled import hamlet_lines

            return hamlet_lines()
        path = Path(config.data)
        if not path.is_file():
            raise DPFitError(f"--data {path}: no such file (a text file, one line per row)")
        return [x for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]

    def prepare_from(self, model, tokenizer, lines: Sequence[str], config) -> Prepared:
        """The task for a model object already in memory (Python callers, tests)."""
        from dpfit.biases import add_biases

        examples = make_examples(lines, self.lines_per_example)
        n_train = config.max_train_examples or self.default_train_examples
        train_texts, eval_texts = split_examples(examples, n_train, self.eval_examples, config.seed)
        if not train_texts:
            raise DPFitError("no training examples: the text has too few lines")
        pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        add_biases(model)  # DP-BiTFiT-Add: zero biases, the same function at step 0
        held = TokenizedLines(eval_texts, tokenizer, 128)
        before = perplexity(model, held, make_collate(pad), self.eval_batch_size)
        return Prepared(
            model=model,
            tokenizer=tokenizer,
            n=len(train_texts),
            num_classes=0,
            head_names=(),
            notes=[
                f"causal LM: {len(train_texts)} training examples of {self.lines_per_example} "
                f"lines, {len(eval_texts)} held out from the end; biases added (DP-BiTFiT-Add)"
            ],
            state={"train": train_texts, "held": held, "pad": pad, "before": before},
            biases_added=True,
        )

    # -- the loop's hooks ----------------------------------------------------------------
    def items(self, prep: Prepared, max_length: int) -> list[torch.Tensor]:
        data = TokenizedLines(prep.state["train"], prep.tokenizer, max_length)
        return sorted(data.items, key=len)  # physical batches of similar length pad little

    def collate(self, prep: Prepared, position_ids: bool) -> Callable[[list], dict]:
        base = make_collate(prep.state["pad"])
        if not position_ids:
            return base

        def with_positions(items: list) -> dict:
            out = base(items)
            b, width = out["input_ids"].shape
            out["position_ids"] = torch.arange(width).expand(b, width).clone()
            return out

        return with_positions

    def loss(self, model, batch: dict) -> torch.Tensor:
        return causal_lm_loss(model, batch)

    def evaluate(self, prep: Prepared, model, config, device) -> dict:
        after = perplexity(model, prep.state["held"], make_collate(prep.state["pad"]))
        samples = sample_lines(
            model, prep.tokenizer, self.sample_prompts, self.sample_tokens, config.seed
        )
        return {
            "perplexity_before": prep.state["before"],
            "perplexity_after": after,
            "eval_n": len(prep.state["held"]),
            "train_examples": prep.n,
            "samples": [{"prompt": p, "continuation": c} for p, c in samples],
        }

    def save(self, prep: Prepared, model, folder: Path) -> None:
        from dpfit.models import save_plain

        save_plain(model, folder)
        prep.tokenizer.save_pretrained(folder)


def train_causal_lm(
    model, tokenizer, lines: Sequence[str], config, task: CausalLMTask | None = None
):
    """DP-BiTFiT-Add on `lines` for a model object in memory, through the one training loop.

    `config` is a :class:`dpfit.train.TrainConfig` (task "causal-lm"); returns its TrainResult.
    """
    from dpfit.train import train

    task = task or CausalLMTask()
    prep = task.prepare_from(model, tokenizer, lines, config)
    return train(config, prepared=prep, task=task)
