"""Per-example clip factors, in a registry of name -> function(norms, max_grad_norm).

Each factor c_i satisfies c_i * ||g_i|| <= R, which is all the privacy analysis needs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ClipFn = Callable[[torch.Tensor, float], torch.Tensor]

_CLIP_FNS: dict[str, ClipFn] = {}

AUTOMATIC_GAMMA = 0.01


def register_clipping(name: str) -> Callable[[ClipFn], ClipFn]:
    def deco(fn: ClipFn) -> ClipFn:
        _CLIP_FNS[name] = fn
        return fn

    return deco


@register_clipping("flat")
def flat(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """Abadi et al.: min(1, R / ||g||) (1 for a zero gradient)."""
    return (max_grad_norm / norms.clamp_min(torch.finfo(norms.dtype).tiny)).clamp(max=1.0)


@register_clipping("automatic")
def automatic(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """Bu et al. (automatic clipping / normalisation): R / (||g|| + gamma)."""
    return max_grad_norm / (norms + AUTOMATIC_GAMMA)


def get_clipping(name: str) -> ClipFn:
    try:
        return _CLIP_FNS[name]
    except KeyError:
        raise ValueError(f"clipping must be one of {sorted(_CLIP_FNS)}, got {name!r}") from None


def clipping_names() -> list[str]:
    return sorted(_CLIP_FNS)
