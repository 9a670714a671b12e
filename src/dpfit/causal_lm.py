"""Causal-LM building blocks: examples from lines, a per-example loss, perplexity, samples.

The training itself runs in the one loop of :mod:`dpfit.train` (task plug-in
:mod:`dpfit.tasks.causal_lm`). Why a loss of our own: language modelling needs a loss that
DP can use. DP-SGD clips *per example*, so the batch loss must be
a mean (or sum) of per-example losses: here each example's loss is the mean over its own
tokens, and the batch loss the mean over examples. (transformers' default, the mean over all
tokens in the batch, weights examples by their length and is not per-example decomposable with
a fixed scale.)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dpfit import progress
from dpfit.windows import Window, windows  # noqa: F401 - re-exported: the cutting lives there

log = logging.getLogger(__name__)

IGNORE = -100


# --------------------------------------------------------------------------- data
def make_examples(lines: Sequence[str], lines_per_example: int) -> list[str]:
    """Consecutive lines joined into examples (a line of verse alone is very short)."""
    k = max(1, lines_per_example)
    return ["\n".join(lines[i : i + k]) for i in range(0, len(lines) - k + 1, k)]


def split_examples(
    examples: Sequence[str], n_train: int, n_eval: int, seed: int
) -> tuple[list[str], list[str]]:
    """(training, held-out): the `n_eval` examples with the smallest keyed hash of their text
    are held out, and the `n_train` of the rest with the smallest (independent) key train
    (dpfit.data.rowhash). Each example's side comes from its own text and the seed, so adding
    one example changes the training ones by one example (by one in and one out when
    `n_train` caps them), whatever its position; a seeded shuffle of positions would move
    many. A text of fewer than 2 `n_eval` examples holds out half of them (never all: the
    held-out examples are never trained on), and there one added example may also swap one
    example in and one out."""
    from dpfit.data.rowhash import HELD_OUT, SUBSAMPLE, row_keys, smallest

    keys = row_keys((e.encode("utf-8") for e in examples), seed, HELD_OUT)
    n_held = min(n_eval, len(examples) // 2)
    held_idx = set(smallest(keys, n_held).tolist()) if n_held > 0 else set()
    held = [e for i, e in enumerate(examples) if i in held_idx]
    rest = [e for i, e in enumerate(examples) if i not in held_idx]
    rest_keys = row_keys((e.encode("utf-8") for e in rest), seed, SUBSAMPLE)
    return [rest[i] for i in smallest(rest_keys, n_train)], held


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


def document_ids(text: str, tokenizer) -> torch.Tensor:
    """A whole document's token ids, ending with EOS (no truncation)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return torch.tensor([*ids, eos] if eos is not None else ids, dtype=torch.long)


def make_collate(
    pad_id: int, width: int | None = None
) -> Callable[[list[torch.Tensor | Window]], dict]:
    """Pad token sequences (or Windows, whose context tokens get no label) into a batch: to
    the longest item, or to `width` for every batch (shapes that do not depend on the data)."""

    def collate(items: list[torch.Tensor | Window]) -> dict:
        items = [x if isinstance(x, Window) else Window(x) for x in items]
        n = max(len(x.ids) for x in items)
        if width is not None:
            if n > width:
                raise ValueError(f"an item of {n} tokens is longer than the padded width {width}")
            n = width
        ids = torch.full((len(items), n), pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), n), dtype=torch.long)
        for i, x in enumerate(items):
            ids[i, : len(x.ids)] = x.ids
            mask[i, : len(x.ids)] = 1
        labels = ids.masked_fill(mask == 0, IGNORE)
        for i, x in enumerate(items):
            labels[i, : x.context] = IGNORE
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
def perplexity(
    model: nn.Module, data: Sequence[torch.Tensor | Window], collate, batch_size: int = 16
) -> float:
    """exp(mean NLL per predicted token) over the data set."""
    was_training = model.training
    model.eval()
    nll, tokens = 0.0, 0
    for i in range(0, len(data), batch_size):
        progress.report("perplexity", i, len(data))
        batch = collate([data[j] for j in range(i, min(len(data), i + batch_size))])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        total, count = per_example_token_nll(logits, batch["labels"])
        nll += float(total.sum())
        tokens += int(count.sum())
    progress.report("perplexity", len(data), len(data))
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
    for k, prompt in enumerate(prompts):
        progress.report("samples", k, len(prompts))
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
    progress.report("samples", len(prompts), len(prompts))
    return out
