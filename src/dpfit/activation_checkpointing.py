"""Activation checkpointing for bias-only runs: each layer's activations are recomputed in
the backward pass instead of kept from the forward (transformers' own
``activation_checkpointing_enable``, called ``gradient_checkpointing_enable`` before v5.2x,
non-reentrant).

Why it keeps the per-example gradients exact: DP-BiTFiT reads each bias's per-example
gradient from a tensor hook on the layer's output in the forward pass that autograd
differentiates. Non-reentrant checkpointing recomputes a layer only to refill the tensors that
graph saved; the recomputed outputs are never differentiated, so hooks registered on them never
fire and each gradient is read once (tests/test_activation_checkpointing.py checks the rows
against the microbatch-of-one oracle at 2,048 tokens). (Reentrant checkpointing would also read
each once: its first forward runs without gradients, so no hook is registered there, and the
recomputation is what is differentiated. Non-reentrant is torch's recommended form.)

Other modes are refused: full and LoRA modes keep each layer's input for per-example weight
gradients, so recomputation would not free it, and their norms have not been checked under it.
"""

from __future__ import annotations

import logging

from torch import nn

from dpfit.errors import DPFitError

log = logging.getLogger(__name__)

SUPPORTED_MODES = ("bias",)


def enable_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Turn on the model's own (transformers) activation checkpointing, non-reentrant.

    Applies to a task's backbone when the model wraps one (``model.backbone``). Raises a
    one-line DPFitError for a mode or a model that does not support it.
    """
    if mode not in SUPPORTED_MODES:
        raise DPFitError(
            f"--activation-checkpointing is for --mode bias (per-example bias gradients read "
            f"from the backward pass); --mode {mode} keeps layer inputs for per-example weight "
            "gradients. Drop --activation-checkpointing, or lower --physical-batch-size"
        )
    target = getattr(model, "backbone", model)
    if not getattr(target, "supports_gradient_checkpointing", False):
        raise DPFitError(
            f"{type(target).__name__} offers no activation checkpointing (transformers' "
            "activation_checkpointing_enable); drop --activation-checkpointing"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(target, "activation_checkpointing_enable"):
        target.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers before the rename
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    log.info("activation checkpointing on for %s (non-reentrant)", type(target).__name__)
