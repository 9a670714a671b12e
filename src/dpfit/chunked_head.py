"""The causal-LM loss with the output head computed in checkpointed chunks of positions, for
bias-only runs at long lengths.

Why: at long T the vocabulary-sized logits dominate a bias-only step's memory (SmolLM2's
49,152 classes x 2,048 positions x 4 examples is 1.6 GB per float32 copy, and the loss keeps
several: logits, log-softmax, their gradients), more than the checkpointed layers themselves.
Here the root forward is asked for the last position's logits only (``logits_to_keep=1``); the
backbone's last hidden state is read by a forward hook on the backbone that lives for one call,
and each chunk of positions goes through the head and the cross entropy under non-reentrant
``torch.utils.checkpoint``, so only one chunk's logits exist at a time, in the forward and in
the backward.

Why the per-example bias gradients stay exact: the head's input gradient is the same sum of
each chunk's gradient that the one-piece loss gives, and every bias sits in the backbone,
which runs once, inside the one root forward (so the engine's forward id and its hooks see one
forward, as with the plain loss). Checked against the microbatch-of-one oracle in float64 at
2,048 tokens (tests/test_chunked_head.py). A model that changes its logits after the head
(soft-capping, a logit scale) would make the chunks wrong: each call compares the root's own
last-position logits with the head applied to the captured hidden state and refuses on a
difference. Bias mode only: a trained head (full and LoRA modes) would be hooked once per chunk.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dpfit.errors import DPFitError

IGNORE = -100
# bytes of float32 logits per chunk: small beside a long step's activations, large enough
# that the head's matrix product stays efficient (hundreds of positions per chunk)
CHUNK_BYTES = 256 * 2**20


def chunk_positions(batch: int, vocab: int, budget: int = CHUNK_BYTES) -> int:
    """Positions per chunk so that a chunk's float32 logits take about `budget` bytes."""
    return max(1, budget // (4 * batch * vocab))


def _parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(backbone, head) of a transformers causal LM that can skip its full logits."""
    get_decoder = getattr(model, "get_decoder", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    backbone = get_decoder() if callable(get_decoder) else None
    takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    if backbone is None or head is None or not takes_keep:
        raise DPFitError(
            f"{type(model).__name__} cannot compute its loss in chunks (it needs a transformers "
            "causal LM with get_decoder(), get_output_embeddings() and logits_to_keep); drop "
            "--activation-checkpointing or lower --physical-batch-size"
        )
    if any(p.requires_grad for p in head.parameters()):
        raise DPFitError(
            "the output head trains in this run, and the chunked loss would hook it once per "
            "chunk; it is for bias-only runs with a frozen head (drop --activation-checkpointing)"
        )
    return backbone, head


def _chunk_nll(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return (
        F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=IGNORE,
            reduction="none",
        )
        .view(labels.shape)
        .sum(1)
    )


def chunked_token_nll(
    model: nn.Module, batch: dict, budget: int = CHUNK_BYTES
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token NLL per example, predicted tokens per example), as
    dpfit.causal_lm.per_example_token_nll gives from the full logits, without holding them."""
    backbone, head = _parts(model)
    seen: list[torch.Tensor] = []

    def grab(module: nn.Module, args: tuple, output) -> None:
        seen.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    handle = backbone.register_forward_hook(grab)
    try:
        kwargs = {k: v for k, v in batch.items() if k != "labels"}
        last = model(**kwargs, logits_to_keep=1, use_cache=False).logits
    finally:
        handle.remove()
    if len(seen) != 1:
        raise DPFitError(f"the backbone ran {len(seen)} times in one forward; expected once")
    hidden = seen[0]
    with torch.no_grad():
        again = head(hidden[:, -1:]).float()
    if not torch.allclose(again, last.float(), rtol=1e-4, atol=1e-5):
        raise DPFitError(
            f"{type(model).__name__} changes its logits after the output head (soft-capping "
            "or a logit scale), so its loss cannot be computed from the head in chunks; drop "
            "--activation-checkpointing"
        )
    labels = batch["labels"][:, 1:]
    hidden = hidden[:, :-1]
    width = hidden.shape[1]
    step = chunk_positions(hidden.shape[0], last.shape[-1], budget)
    total = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for s in range(0, width, step):
        part = checkpoint(
            _chunk_nll, head, hidden[:, s : s + step], labels[:, s : s + step], use_reentrant=False
        )
        total = total + part
    return total, (labels != IGNORE).sum(1)
