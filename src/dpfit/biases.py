"""DP-BiTFiT-Add: give bias-free layers a zero-initialised bias so bias-only DP training works.

LLaMA-style models (and ResNets, whose convolutions feed a norm) have no bias terms, so plain
BiTFiT has nothing to train. :func:`add_biases` adds them where they are cheap and expressive:

* ``nn.Linear`` built with ``bias=False`` (q/k/v/o and MLP projections): a ``bias`` parameter is
  registered on the layer itself; ``nn.Linear.forward`` already adds ``self.bias``, so the
  module class, its name and its weight are untouched;
* RMSNorm: replaced by :class:`~dpfit.grad_sample.rmsnorm.RMSNormWithBias` (the same formula
  plus a shift after the scale), after a probe input shows it reproduces the original exactly;
* ``nn.LayerNorm(bias=False)``: a ``bias`` registered like the linear case;
* a convolution with no bias that is directly followed by a norm layer in its parent.

Every new bias is zero, so the model computes the same function at step 0.

``replace_batchnorm=True`` converts BatchNorm to GroupNorm (group count ``gcd(32, C)`` as
Opacus's validator picks; affine weights copied). This changes the architecture, and is logged.

Saving and loading. The added biases are ordinary parameters, so ``model.save_pretrained``
writes them. A plain ``from_pretrained`` builds the original, bias-free classes and would drop
them, so :func:`add_biases` records what it changed in ``model.config.dpfit_added_biases``
(written to config.json) and :func:`load_pretrained_with_biases` (or
:func:`restore_added_biases` on a model already loaded) re-applies the changes and loads the
saved tensors. Models without a transformers config: call ``add_biases`` with the same
``where`` on a fresh model, then ``load_state_dict``.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dpfit.errors import UnsupportedLayerError
from dpfit.grad_sample.rmsnorm import RMSNormWithBias

log = logging.getLogger(__name__)

CONFIG_KEY = "dpfit_added_biases"
# Output heads: a bias there is not part of the method (and lm_head's would be vocabulary-sized).
HEAD_NAMES = ("lm_head", "score", "classifier", "pre_classifier", "fc", "head")
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_NORMS = (nn.GroupNorm, nn.LayerNorm, *_BATCHNORMS, nn.InstanceNorm1d, nn.InstanceNorm2d)

Where = str | Iterable[str] | Callable[[str, nn.Module], bool]


@dataclass(frozen=True)
class AddedBiases:
    """What :func:`add_biases` changed: module names per kind, and the new scalar count."""

    linear: tuple[str, ...] = ()
    rmsnorm: tuple[str, ...] = ()
    layernorm: tuple[str, ...] = ()
    conv: tuple[str, ...] = ()
    batchnorm_to_groupnorm: tuple[tuple[str, int], ...] = ()
    new_parameters: int = 0

    @property
    def modules(self) -> tuple[str, ...]:
        return self.linear + self.rmsnorm + self.layernorm + self.conv

    def as_dict(self) -> dict:
        return {
            "linear": list(self.linear),
            "rmsnorm": list(self.rmsnorm),
            "layernorm": list(self.layernorm),
            "conv": list(self.conv),
            "batchnorm_to_groupnorm": [list(x) for x in self.batchnorm_to_groupnorm],
        }


# --------------------------------------------------------------------------- kinds
def _is_rmsnorm(m: nn.Module) -> bool:
    return isinstance(m, nn.RMSNorm) or type(m).__name__.endswith("RMSNorm")


def _kind(m: nn.Module) -> str | None:
    """The kind of bias this module can take, or None (it has one, or is not supported)."""
    if isinstance(m, RMSNormWithBias):
        return None
    if _is_rmsnorm(m):
        return "rmsnorm"
    if getattr(m, "bias", None) is not None:
        return None
    if isinstance(m, nn.Linear):
        return "linear"
    if isinstance(m, nn.LayerNorm) and m.elementwise_affine:
        return "layernorm"
    if isinstance(m, _CONVS):
        return "conv"
    return None


def _followed_by_norm(model: nn.Module) -> set[str]:
    """Names of modules whose next sibling (in definition order) is a norm layer."""
    out = set()
    for pname, parent in model.named_modules():
        kids = list(parent.named_children())
        for (name, _), (_, nxt) in zip(kids, kids[1:], strict=False):
            if isinstance(nxt, _NORMS) or _is_rmsnorm(nxt):
                out.add(f"{pname}.{name}" if pname else name)
    return out


def _selector(where: Where, model: nn.Module) -> Callable[[str, nn.Module], bool]:
    if callable(where):
        return where
    if isinstance(where, str) and where == "auto":
        before_norm = _followed_by_norm(model)

        def auto(name: str, m: nn.Module) -> bool:
            if name.split(".")[0] in HEAD_NAMES or name.rsplit(".", 1)[-1] in HEAD_NAMES:
                return False
            if isinstance(m, _CONVS):
                return name in before_norm
            return True

        return auto
    patterns = (where,) if isinstance(where, str) else tuple(where)
    return lambda name, m: any(fnmatch.fnmatchcase(name, p) for p in patterns)


# --------------------------------------------------------------------------- changes
def _set_child(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _zero_bias(size: int, like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.zeros(size, dtype=like.dtype, device=like.device))


def _rmsnorm_with_bias(name: str, m: nn.Module) -> RMSNormWithBias:
    eps = getattr(m, "variance_epsilon", None)
    if eps is None:
        eps = getattr(m, "eps", None)
    w = getattr(m, "weight", None)
    if eps is None or not isinstance(w, nn.Parameter) or w.dim() != 1:
        raise UnsupportedLayerError(
            f"RMSNorm '{name}' ({type(m).__name__}) has no 1-D weight and eps dpfit can reuse; "
            "exclude it with add_biases(model, where=...)"
        )
    new = RMSNormWithBias(w, float(eps))
    gen = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(2, 3, w.numel(), generator=gen).to(dtype=w.dtype, device=w.device) * 3
    with torch.no_grad():
        same = torch.equal(m(probe), new(probe))
    if not same:
        raise UnsupportedLayerError(
            f"RMSNorm '{name}' ({type(m).__name__}) does not compute the LLaMA formula "
            "weight * x / rms(x) that RMSNormWithBias reproduces (e.g. Gemma's (1 + weight)); "
            "exclude it with add_biases(model, where=...)"
        )
    return new


def _groups_for(channels: int) -> int:
    return math.gcd(32, channels)  # as opacus.validators.batch_norm picks


def _batchnorm_to_groupnorm(bn: nn.Module, groups: int) -> nn.GroupNorm:
    gn = nn.GroupNorm(groups, bn.num_features, eps=bn.eps, affine=bn.affine)
    if bn.affine:
        with torch.no_grad():
            gn.weight.copy_(bn.weight)
            gn.bias.copy_(bn.bias)
    like = bn.weight if bn.affine else bn.running_mean
    return gn if like is None else gn.to(device=like.device, dtype=like.dtype)


def replace_batchnorms(model: nn.Module, names: Iterable[tuple[str, int]] | None = None) -> list:
    """BatchNorm -> GroupNorm in place; returns [(name, groups)]. Changes the architecture."""
    todo = (
        list(names)
        if names is not None
        else [
            (n, _groups_for(m.num_features))
            for n, m in model.named_modules()
            if isinstance(m, _BATCHNORMS)
        ]
    )
    for name, groups in todo:
        bn = model.get_submodule(name)
        _set_child(model, name, _batchnorm_to_groupnorm(bn, groups))
    if todo:
        log.warning(
            "replaced %d BatchNorm layers with GroupNorm (groups=gcd(32, C)): this changes the "
            "architecture; a pretrained model's accuracy can drop until it is fine-tuned",
            len(todo),
        )
    return todo


def add_biases(
    model: nn.Module, where: Where = "auto", *, replace_batchnorm: bool = False
) -> AddedBiases:
    """Add zero-initialised trainable biases to bias-free layers (DP-BiTFiT-Add), in place.

    where: "auto" (every bias-free Linear, RMSNorm and affine LayerNorm outside the output
    heads, and every bias-free convolution followed by a norm), a list of glob patterns over
    module names (e.g. ``["*.q_proj", "*.v_proj", "*norm"]``), or a predicate
    ``(name, module) -> bool``. Matched modules that cannot take a bias are skipped.

    Returns what changed; the record is also kept in ``model.config`` (if the model has a
    transformers config) so :func:`load_pretrained_with_biases` can restore it.
    """
    bns: list = []
    if replace_batchnorm:
        bns = replace_batchnorms(model)
    select = _selector(where, model)
    found: dict[str, list[str]] = {"linear": [], "rmsnorm": [], "layernorm": [], "conv": []}
    for name, m in list(model.named_modules()):
        kind = _kind(m)
        if kind is not None and name and select(name, m):
            found[kind].append(name)
    return _apply(model, found, bns)


def _apply(model: nn.Module, found: dict[str, list[str]], bns: list) -> AddedBiases:
    before = sum(p.numel() for p in model.parameters())
    replaced: dict[nn.Module, nn.Module] = {}
    for name in found["rmsnorm"]:
        m = model.get_submodule(name)
        if m not in replaced:
            replaced[m] = _rmsnorm_with_bias(name, m)
        _set_child(model, name, replaced[m])
    for kind in ("linear", "layernorm", "conv"):
        for name in found[kind]:
            m = model.get_submodule(name)
            if getattr(m, "bias", None) is not None:
                continue  # shared module, already done
            if kind == "layernorm":
                bias = nn.Parameter(torch.zeros_like(m.weight))
            else:  # Linear: out_features; conv: out_channels
                bias = _zero_bias(m.weight.shape[0], m.weight)
            m.register_parameter("bias", bias)
    added = AddedBiases(
        linear=tuple(found["linear"]),
        rmsnorm=tuple(found["rmsnorm"]),
        layernorm=tuple(found["layernorm"]),
        conv=tuple(found["conv"]),
        batchnorm_to_groupnorm=tuple((n, g) for n, g in bns),
        new_parameters=sum(p.numel() for p in model.parameters()) - before,
    )
    _record(model, added)
    log.info(
        "DP-BiTFiT-Add: %d new bias parameters in %d layers (%d linear, %d RMSNorm, "
        "%d LayerNorm, %d conv)",
        added.new_parameters,
        len(added.modules),
        len(added.linear),
        len(added.rmsnorm),
        len(added.layernorm),
        len(added.conv),
    )
    return added


def _record(model: nn.Module, added: AddedBiases) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return
    old = getattr(config, CONFIG_KEY, None) or {}
    merged = {k: sorted(set(old.get(k, [])) | set(v)) for k, v in added.as_dict().items()}
    merged["batchnorm_to_groupnorm"] = [
        list(x) for x in dict.fromkeys(map(tuple, merged["batchnorm_to_groupnorm"]))
    ]
    setattr(config, CONFIG_KEY, merged)


# --------------------------------------------------------------------------- load
def restore_added_biases(model: nn.Module, folder: str | Path | None = None) -> AddedBiases:
    """Re-apply the recorded BiTFiT-Add changes to a freshly loaded model, then (if `folder`
    is given) load the saved bias and norm tensors from its ``*.safetensors`` files."""
    record = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    if not record:
        raise UnsupportedLayerError(
            f"model.config has no '{CONFIG_KEY}' record: it was not saved after "
            "dpfit.add_biases. Call dpfit.add_biases(model, where=...) and load_state_dict."
        )
    bns = replace_batchnorms(model, [tuple(x) for x in record.get("batchnorm_to_groupnorm", [])])
    found = {k: [n for n in record.get(k, []) if _kind(model.get_submodule(n))] for k in _KINDS}
    added = _apply(model, found, bns)
    if folder is not None:
        _load_changed_tensors(model, Path(folder), added)
    return added


_KINDS = ("linear", "rmsnorm", "layernorm", "conv")


def _load_changed_tensors(model: nn.Module, folder: Path, added: AddedBiases) -> None:
    from safetensors.torch import load_file

    prefixes = tuple(
        f"{n}." for n in (*added.modules, *(n for n, _ in added.batchnorm_to_groupnorm))
    )
    own = dict(model.named_parameters())
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}; save with save_pretrained")
    loaded = set()
    for f in files:
        for key, t in load_file(str(f)).items():
            if key in own and key.startswith(prefixes):
                with torch.no_grad():
                    own[key].copy_(t.to(own[key].dtype))
                loaded.add(key)
    wanted = {k for k in own if k.startswith(prefixes)}
    missing = sorted(wanted - loaded)
    if missing:
        raise UnsupportedLayerError(
            f"{len(missing)} added parameters were not found in {folder} "
            f"(e.g. {missing[:3]}); was the model saved after add_biases?"
        )


def load_pretrained_with_biases(model_class, folder: str | Path, **kwargs):
    """``model_class.from_pretrained(folder, **kwargs)`` plus the recorded BiTFiT-Add changes."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the added keys are "unexpected" until restored
    try:
        model = model_class.from_pretrained(folder, **kwargs)
    finally:
        transformers.logging.set_verbosity(level)
    restore_added_biases(model, folder)
    return model
