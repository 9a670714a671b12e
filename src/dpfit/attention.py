"""The attention kernel a model that `dpfit train` loads runs: the one measured faster there.

On CPU under bf16 autocast, transformers' eager attention (two products and a softmax) beat
PyTorch's `scaled_dot_product_attention` for the bundled MiniLM with its padding mask at every
length measured, up to 512 tokens, forward and backward; in float32 neither was faster
throughout (`benchmarks/attention_kernels.py`, `benchmarks/results/attention_kernels*.md`). On
a GPU SDPA's fused kernels win, and beyond the lengths measured eager's L x L scores cost
memory, so those keep SDPA. The two compute the same function (dropout on the attention
weights included); only the speed differs. Models a user builds and hands to `PrivacyEngine`
are never changed: this is for the models `dpfit train` loads itself.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# the longest padded length at which eager attention was measured faster on CPU in bf16
EAGER_MAX_LENGTH = 512


def choose_attention(
    model: torch.nn.Module, device: torch.device, max_length: int | None, precision: str
) -> bool:
    """Switch the transformers models inside `model` from SDPA to eager attention where that is
    the faster kernel (CPU, bf16 autocast, inputs of at most EAGER_MAX_LENGTH tokens). True if
    it did."""
    if device.type != "cpu" or precision != "bf16":
        return False
    if max_length is None or max_length > EAGER_MAX_LENGTH:
        return False
    switched = False
    for module in model.modules():
        config = getattr(module, "config", None)
        if (
            hasattr(module, "set_attn_implementation")
            and getattr(config, "_attn_implementation", None) == "sdpa"
        ):
            module.set_attn_implementation("eager")
            switched = True
    if switched:
        logger.info("attention: eager (CPU, bf16, inputs of at most %d tokens)", max_length)
    return switched
