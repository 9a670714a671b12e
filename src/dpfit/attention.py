"""The attention kernel a model that `dpfit train` loads runs: the one measured faster there.

On CPU under bf16 autocast, transformers' eager attention (two products and a softmax) beat
PyTorch's `scaled_dot_product_attention` for the bundled MiniLM with its padding mask at every
length measured, up to 512 tokens, forward and backward; in float32 neither was faster
throughout (`benchmarks/archive/attention_kernels.py`, `benchmarks/results/archive/attention_kernels*.md`). On
a GPU SDPA's fused kernels win, and beyond the lengths measured eager's L x L scores cost
memory, so those keep SDPA. The two compute the same function (dropout on the attention
weights included); only the speed differs. Models a user builds and hands to `PrivacyEngine`
are never changed: this is for the models `dpfit train` loads itself.
"""

from __future__ import annotations

import torch

# the longest padded length at which eager attention was measured faster on CPU in bf16
EAGER_MAX_LENGTH = 512


def eager_is_faster(device: torch.device, max_length: int | None, precision: str) -> bool:
    """Where eager attention was measured faster than SDPA: CPU, bf16 autocast, inputs of at
    most EAGER_MAX_LENGTH tokens."""
    return (
        device.type == "cpu"
        and precision == "bf16"
        and max_length is not None
        and max_length <= EAGER_MAX_LENGTH
    )


def choose_attention(
    model: torch.nn.Module, device: torch.device, max_length: int | None, precision: str
) -> bool:
    """Switch the transformers models inside `model` from SDPA to eager attention where that is
    the faster kernel (`eager_is_faster`). True if it did (the caller reports it)."""
    if not eager_is_faster(device, max_length, precision):
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
    return switched
