"""Per-example gradient samplers, one module per layer family; importing registers them."""

from dpfit.grad_sample import (  # noqa: F401  (registration)
    attention,
    conv,
    embedding,
    full,
    linear,
    norm,
    rmsnorm,
    vit,  # transformers ViT embeddings (cls token, positions)
)
from dpfit.grad_sample.registry import (
    SamplerEntry,
    lookup,
    register_bias_sampler,
    register_capture,
    register_weight_sampler,
    registered_layers,
)

__all__ = [
    "SamplerEntry",
    "lookup",
    "register_bias_sampler",
    "register_capture",
    "register_weight_sampler",
    "registered_layers",
]
