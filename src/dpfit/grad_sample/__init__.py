"""Per-example gradient samplers, one module per layer family; importing registers them."""

from dpfit.grad_sample import attention, conv, linear, norm  # noqa: F401  (registration)
from dpfit.grad_sample import embedding, full, rmsnorm  # noqa: F401  (registration)
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
