"""Causal-LM fine-tuning with DP-BiTFiT-Add (the bundled SmolLM2 on the bundled Hamlet lines).

Why this module: a bias-free LLaMA model is the case DP-BiTFiT-Add exists for, and language
modelling needs a loss that DP can use. DP-SGD clips *per example*, so the batch loss must be
a mean (or sum) of per-example losses: here each example's loss is the mean over its own
tokens, and the batch loss the mean over examples. (transformers' default, the mean over all
tokens in the batch, weights examples by their length and is not per-example decomposable with
a fixed scale.)
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpfit.biases import add_biases
from dpfit.engine import PrivacyEngine
from dpfit.params import make_bias_trainable
from dpfit.recipe import default_delta

log = logging.getLogger(__name__)

IGNORE = -100


@dataclass(frozen=True)
class CausalLMConfig:
    """A DP-BiTFiT-Add causal-LM run; defaults sized for a few minutes on a laptop CPU."""

    train_examples: int = 512
    eval_examples: int = 64
    lines_per_example: int = 2
    max_length: int = 48
    expected_batch_size: int = 32
    physical_batch_size: int = 16
    epochs: float = 1.0
    target_epsilon: float = 8.0
    target_delta: float | None = None  # default min(1e-5, 1/n^1.1)
    max_grad_norm: float = 0.1
    lr: float = 5e-3
    seed: int = 0  # public randomness: split, sampling of the generated text
    insecure_seed: int | None = None  # seeds DP noise + Poisson sampling: NOT private
    sample_prompts: tuple[str, ...] = ("To be, or not", "My lord,", "O, what a")
    sample_tokens: int = 20
    check_gradients: bool = False


@dataclass(frozen=True)
class CausalLMResult:
    perplexity_before: float
    perplexity_after: float
    epsilon: float
    delta: float
    steps: int
    trainable: int
    total: int
    samples: tuple[tuple[str, str], ...]
    seconds: float

    @property
    def trainable_fraction(self) -> float:
        return self.trainable / self.total


# --------------------------------------------------------------------------- data
def make_examples(lines: Sequence[str], lines_per_example: int) -> list[str]:
    """Consecutive lines joined into examples (a line of verse alone is very short)."""
    k = max(1, lines_per_example)
    return ["\n".join(lines[i : i + k]) for i in range(0, len(lines) - k + 1, k)]


def split_examples(
    examples: Sequence[str], n_train: int, n_eval: int, seed: int
) -> tuple[list[str], list[str]]:
    """Held-out examples come from the end of the play, training ones from the rest."""
    held = list(examples[-n_eval:]) if n_eval else []
    rest = list(examples[: len(examples) - n_eval])
    random.Random(seed).shuffle(rest)
    return rest[:n_train], held


class TokenizedLines(torch.utils.data.Dataset):
    def __init__(self, texts: Sequence[str], tokenizer, max_length: int):
        eos = tokenizer.eos_token_id
        self.items = []
        for t in texts:
            ids = tokenizer(t, add_special_tokens=False)["input_ids"][: max_length - 1]
            self.items.append(torch.tensor([*ids, eos] if eos is not None else ids))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i]


def make_collate(pad_id: int) -> Callable[[list[torch.Tensor]], dict]:
    def collate(items: list[torch.Tensor]) -> dict:
        n = max(len(x) for x in items)
        ids = torch.full((len(items), n), pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), n), dtype=torch.long)
        for i, x in enumerate(items):
            ids[i, : len(x)] = x
            mask[i, : len(x)] = 1
        labels = ids.masked_fill(mask == 0, IGNORE)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return collate


# --------------------------------------------------------------------------- loss
def per_example_token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple:
    """(sum of next-token NLL per example, number of predicted tokens per example)."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    nll = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]),
        shift_labels.reshape(-1),
        ignore_index=IGNORE,
        reduction="none",
    ).view(shift_labels.shape)
    count = (shift_labels != IGNORE).sum(1)
    return nll.sum(1), count


def causal_lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Mean over examples of each example's mean token NLL: per-example decomposable."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    total, count = per_example_token_nll(logits, batch["labels"])
    return (total / count.clamp(min=1)).mean()


@torch.no_grad()
def perplexity(model: nn.Module, data: TokenizedLines, collate, batch_size: int = 16) -> float:
    """exp(mean NLL per predicted token) over the data set."""
    was_training = model.training
    model.eval()
    nll, tokens = 0.0, 0
    for i in range(0, len(data), batch_size):
        batch = collate([data[j] for j in range(i, min(len(data), i + batch_size))])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        total, count = per_example_token_nll(logits, batch["labels"])
        nll += float(total.sum())
        tokens += int(count.sum())
    model.train(was_training)
    return math.exp(nll / max(tokens, 1))


@torch.no_grad()
def sample_lines(
    model: nn.Module, tokenizer, prompts: Sequence[str], max_new_tokens: int, seed: int
) -> list[tuple[str, str]]:
    """(prompt, continuation) with top-k sampling, seeded."""
    torch.manual_seed(seed)
    model.eval()
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=True,
            top_k=40,
            temperature=0.8,
            pad_token_id=tokenizer.eos_token_id,
        )
        out.append((prompt, tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)))
    return out


# --------------------------------------------------------------------------- training
def train_causal_lm(
    model: nn.Module,
    tokenizer,
    lines: Sequence[str],
    config: CausalLMConfig = CausalLMConfig(),
    progress: Callable[[int, float], None] | None = None,  # (logical step, epsilon)
) -> CausalLMResult:
    """DP-BiTFiT-Add on `lines`: add zero biases, train only biases, report perplexity."""
    t0 = time.perf_counter()
    torch.manual_seed(config.seed)
    examples = make_examples(lines, config.lines_per_example)
    train_texts, eval_texts = split_examples(
        examples, config.train_examples, config.eval_examples, config.seed
    )
    train = TokenizedLines(train_texts, tokenizer, config.max_length)
    held = TokenizedLines(eval_texts, tokenizer, config.max_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    collate = make_collate(pad)

    add_biases(model)
    summary = make_bias_trainable(model)
    log.info("causal LM, DP-BiTFiT-Add: %s", summary)
    ppl_before = perplexity(model, held, collate)
    delta = config.target_delta or default_delta(len(train))
    engine = PrivacyEngine(
        model,
        expected_batch_size=min(config.expected_batch_size, len(train)),
        sample_size=len(train),
        target_epsilon=config.target_epsilon,
        target_delta=delta,
        epochs=config.epochs,
        max_grad_norm=config.max_grad_norm,
        insecure_seed=config.insecure_seed,
        check_gradients=config.check_gradients,
    )
    optimizer = torch.optim.AdamW(engine.parameters(), lr=config.lr, weight_decay=0.0)
    loader = engine.data_loader(train, collate, physical_batch_size=config.physical_batch_size)
    model.train()
    try:
        for _ in range(max(1, math.ceil(config.epochs))):
            for batch in loader:
                if engine.steps_taken >= (engine.config.planned_steps or 0):
                    break
                loss = causal_lm_loss(model, batch)
                loss.backward()
                # the exact loss of a private batch is not reported (docs/threat-model.md)
                if engine.step(optimizer) and progress is not None:
                    progress(engine.steps_taken, engine.epsilon())
    finally:
        engine.detach()
    ppl_after = perplexity(model, held, collate)
    samples = sample_lines(model, tokenizer, config.sample_prompts, config.sample_tokens, 0)
    return CausalLMResult(
        perplexity_before=ppl_before,
        perplexity_after=ppl_after,
        epsilon=engine.epsilon(),
        delta=delta,
        steps=engine.steps_taken,
        trainable=summary.trainable,
        total=summary.total,
        samples=tuple(samples),
        seconds=time.perf_counter() - t0,
    )


# --------------------------------------------------------------------------- CLI entry
def train_from_config(config) -> Any:
    """`dpfit train --task causal-lm`: DP-BiTFiT-Add on a text file's lines (default: Hamlet).

    Takes the classification CLI's TrainConfig; sizes not given there keep this module's
    defaults (512 training examples, logical batch at most 32). With `output`, writes
    metrics.json and the model (a transformers folder; reload its added biases with
    dpfit.load_pretrained_with_biases).
    """
    from pathlib import Path

    from dpfit.data.bundled import hamlet_lines
    from dpfit.errors import DPFitError
    from dpfit.reporting import peak_memory_mb, write_json
    from dpfit.train import TrainResult

    if config.non_private or config.noise_multiplier is not None:
        raise DPFitError("--task causal-lm takes --epsilon/--delta (no --noise-multiplier)")
    if config.model is None:
        from dpfit.data.smollm import load_smollm2

        lm = load_smollm2()
        model, tokenizer = lm.model, lm.tokenizer
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(config.model)
        tokenizer = AutoTokenizer.from_pretrained(config.model)
    if config.data is None:
        lines = hamlet_lines()
    else:
        path = Path(config.data)
        if not path.is_file():
            raise DPFitError(f"--data {path}: no such file (a text file, one line per row)")
        lines = [x for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    n_train = config.max_train_examples or CausalLMConfig.train_examples
    cfg = CausalLMConfig(
        train_examples=n_train,
        max_length=config.max_length,
        expected_batch_size=min(config.batch_size, CausalLMConfig.expected_batch_size),
        physical_batch_size=config.physical_batch_size,
        epochs=float(config.epochs),
        target_epsilon=config.epsilon,
        target_delta=config.delta,
        max_grad_norm=config.max_grad_norm,
        lr=config.lr,
        seed=config.seed,
        insecure_seed=config.seed if config.insecure_reproducible_noise else None,
    )
    result = train_causal_lm(model, tokenizer, lines, cfg)
    metrics = {
        "task": "causal-lm",
        "perplexity_before": result.perplexity_before,
        "perplexity_after": result.perplexity_after,
        "epsilon": result.epsilon,
        "delta": result.delta,
        "max_grad_norm": cfg.max_grad_norm,
        "steps": result.steps,
        "trainable_fraction": result.trainable_fraction,
        "trainable_params": result.trainable,
        "samples": [{"prompt": p, "continuation": c} for p, c in result.samples],
        "wall_time_s": result.seconds,
        "peak_memory_mb": peak_memory_mb(),
    }
    out = None
    if config.output:
        out = Path(config.output)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "metrics.json", metrics)
        model.save_pretrained(out / "model")
        tokenizer.save_pretrained(out / "model")
    return TrainResult(metrics, [], model, tokenizer, None, [], out)
