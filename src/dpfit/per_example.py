"""Per-example gradients, read from the backward pass: which module reports which trainable
parameter (`plan_layers`) and the hooks that collect them (`PerExampleHooks`).

Bias gradients are read where the output gradient passes each layer (a tensor hook on the
layer's output, registered by a forward hook that caches nothing). Only layers whose non-bias
parameters train (a new head, full mode) keep their input for the backward pass. All state
lives in `PerExampleHooks`, keyed by parameter; the user's objects are never modified beyond
registering hooks, and `detach()` removes those.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dpfit import grad_sample  # noqa: F401  (registers the samplers)
from dpfit.config import LORA_MODES
from dpfit.errors import (
    BatchNormError,
    GradientMismatchError,
    NoTrainableParametersError,
    SamplingError,
    UnsupportedLayerError,
)
from dpfit.grad_sample.full import norm_sampler_for
from dpfit.grad_sample.registry import HALF_DTYPES, SamplerEntry, lookup, registered_layers
from dpfit.params import in_peft_head, is_bias, is_lora, is_lora_module

log = logging.getLogger(__name__)

_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


@dataclass
class LayerPlan:
    """The trainable parameters one hooked module is responsible for."""

    name: str
    entry: SamplerEntry
    batch_dim: int
    params: dict[str, nn.Parameter] = field(default_factory=dict)  # local name -> param
    needs_input: bool = False
    # full mode: a factored (ghost norm / book-keeping) sampler from grad_sample.full
    weight_fn: Callable | None = None


def find_batchnorms(model: nn.Module) -> list[str]:
    return [n or "<root>" for n, m in model.named_modules() if isinstance(m, _BATCHNORMS)]


def batch_dim_for(
    name: str, entry: SamplerEntry, batch_first: bool, overrides: Mapping[str, int]
) -> int:
    """The axis of a layer's output that holds the batch."""
    if name in overrides:
        return overrides[name]
    if entry.batch_axis_fixed:
        return 0
    return 0 if batch_first else 1


def plan_layers(
    model: nn.Module, mode: str, batch_first: bool, batch_dims: Mapping[str, int]
) -> dict[nn.Module, LayerPlan]:
    """For every module with a registered sampler, the trainable parameters it reports.

    Raises when the model cannot be trained privately: BatchNorm, nothing trainable, or a
    trainable parameter that no registered sampler covers (listing them and the fix).
    """
    bns = find_batchnorms(model)
    if bns:
        raise BatchNormError(
            f"BatchNorm layers {bns} mix examples in their batch statistics, so per-example "
            "gradients (and DP) are undefined. Replace them with GroupNorm "
            "(dpfit.add_biases(model, replace_batchnorm=True) or CLI --replace-batchnorm)."
        )
    trainable = {p: n for n, p in model.named_parameters() if p.requires_grad}
    if not trainable:
        raise NoTrainableParametersError(
            "no parameter of the model requires grad; call dpfit.make_bias_trainable(model) "
            "(and dpfit.add_biases(model) first if the model has no biases)"
        )
    if mode in LORA_MODES:
        check_lora_selection(mode, list(trainable.values()))
    owned: dict[nn.Parameter, str] = {}
    plans: dict[nn.Module, LayerPlan] = {}
    claimed: set[nn.Module] = set()
    for mname, module in model.named_modules():
        if module in claimed:
            continue
        entry = lookup(module)
        if entry is None:
            continue
        plan = LayerPlan(mname, entry, batch_dim_for(mname, entry, batch_first, batch_dims))
        if entry.capture is not None:
            for sub in module.modules():
                if sub is not module:
                    claimed.add(sub)
            for local in entry.capture_params:
                p = module.get_parameter(local)
                if p in trainable:
                    plan.params[local] = p
            other = [n for n, p in module.named_parameters() if p in trainable]
            extra = [n for n in other if n not in entry.capture_params]
            if extra:
                raise UnsupportedLayerError(
                    f"{type(module).__name__} '{mname}' has trainable {extra}; only "
                    f"{list(entry.capture_params)} are supported there. Freeze them."
                )
        else:
            for local, p in module.named_parameters(recurse=False):
                if p not in trainable:
                    continue
                if local in entry.bias_params and entry.bias is not None:
                    plan.params[local] = p
                elif local in entry.weight_params and entry.weight is not None:
                    plan.params[local] = p
                    plan.needs_input = True
        if plan.needs_input and (mode == "full" or (mode in LORA_MODES and is_lora_module(mname))):
            # full mode: every weight; LoRA modes: the adapters (ghost norm or materialised,
            # by the rule in grad_sample.full), while a head keeps the explicit sampler
            plan.weight_fn = norm_sampler_for(module)
        if plan.params:
            plans[module] = plan
            for p in plan.params.values():
                owned.setdefault(p, plan.name)
    missing = [
        f"{name} (in {type(model.get_submodule(name.rsplit('.', 1)[0]) if '.' in name else model).__name__})"
        for p, name in trainable.items()
        if p not in owned
    ]
    if missing:
        raise UnsupportedLayerError(
            "no per-example gradient sampler for trainable parameters: "
            + ", ".join(missing[:20])
            + (f" (+{len(missing) - 20} more)" if len(missing) > 20 else "")
            + ". Freeze them (dpfit.make_bias_trainable), or register a sampler with "
            "dpfit.grad_sample.register_bias_sampler / register_weight_sampler. "
            f"Supported layers: {', '.join(registered_layers())}"
        )
    heavy = [p.name for p in plans.values() if p.needs_input]
    if heavy:
        log.info("per-example weight gradients (input kept for backward) in: %s", heavy)
    return plans


def check_lora_selection(mode: str, names: list[str]) -> None:
    """The LoRA modes need trainable adapters, and bias+lora needs biases outside the head:
    without them the run would silently be another mode."""
    fix = (
        "wrap the model with peft (peft.get_peft_model(model, peft.LoraConfig(...))), then "
        f"call dpfit.make_lora_trainable(model, biases={mode == 'bias+lora'})"
    )
    if not any(is_lora(n) for n in names):
        raise NoTrainableParametersError(f"mode={mode!r} found no trainable LoRA weight: {fix}")
    if mode == "bias+lora" and not any(
        is_bias(n) and not is_lora(n) and not in_peft_head(n) for n in names
    ):
        raise NoTrainableParametersError(
            "mode='bias+lora' found no trainable bias outside the head (peft's default "
            f"LoraConfig(bias='none') freezes them): {fix}, or use mode='lora'"
        )


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


class PerExampleHooks:
    """Collects the per-example gradients of the planned parameters during backward passes.

    Each forward pass of the model gets an id; a gradient is kept under the id of the forward
    that produced it, so that gradients of two forwards reaching one step are an error rather
    than silently mixed rows (`collect`), while a module run twice in one forward adds up.
    """

    def __init__(self, model: nn.Module, plans: dict[nn.Module, LayerPlan]) -> None:
        self.model = model
        self.plans = plans
        # param -> {forward id -> per-example gradient [B, *param.shape] (or an OuterGrad)}
        self.per_example: dict[nn.Parameter, dict[int, Any]] = {}
        self._forward_id = 0
        # the autocast dtype of a forward since the last take_low_precision() (bf16 autocast)
        self.low_precision: torch.dtype | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def attach(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._on_root_forward))
        for module, plan in self.plans.items():
            if plan.entry.capture is not None:
                self._handles.append(module.register_forward_hook(self._capture_hook(plan)))
            else:
                self._handles.append(module.register_forward_hook(self._forward_hook(plan)))

    def detach(self) -> None:
        """Remove every hook and drop what was collected."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.per_example.clear()

    def collect(self) -> dict[nn.Parameter, Any]:
        """The per-example gradients gathered since the last call (which it clears)."""
        per_ex: dict[nn.Parameter, Any] = {}
        fids = {fid for slot in self.per_example.values() for fid in slot}
        if len(fids) > 1:
            self.per_example.clear()
            raise SamplingError(
                "gradients from more than one forward pass reached this step; call "
                "engine.step(optimizer) after every backward (it accumulates physical batches "
                "into one logical step), and run the model once per batch"
            )
        for p, slot in self.per_example.items():
            (g,) = slot.values()
            per_ex[p] = g
        self.per_example.clear()
        return per_ex

    # ------------------------------------------------------------------ hooks
    def _on_root_forward(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._forward_id += 1
            for device_type in ("cpu", "cuda"):
                if torch.is_autocast_enabled(device_type):
                    self.low_precision = torch.get_autocast_dtype(device_type)

    def take_low_precision(self) -> torch.dtype | None:
        """The autocast dtype of the forwards since the last call (None: none ran under
        autocast); the gradient check allows that dtype's rounding."""
        dtype, self.low_precision = self.low_precision, None
        return dtype

    def _forward_hook(self, plan: LayerPlan) -> Callable:
        # resolved once here, not on every forward: these hooks run for every layer and pass
        entry, params, bd = plan.entry, plan.params, plan.batch_dim
        bias_fn = entry.bias if any(local in entry.bias_params for local in params) else None
        weight_fn = (plan.weight_fn or entry.weight) if plan.needs_input else None
        # dense weight samplers (a new head) get float32 factors under bf16 autocast; the
        # factored ones (full mode) compute in float32 themselves
        upcast_weight = plan.needs_input and plan.weight_fn is None
        accumulate = self._accumulate

        def hook(module: nn.Module, inputs: tuple, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            out = output if isinstance(output, torch.Tensor) else _first_tensor(output)
            if out is None or not out.requires_grad:
                return
            act = inputs[0].detach() if weight_fn is not None else None
            fid = self._forward_id

            def on_grad(g: torch.Tensor) -> None:
                if upcast_weight and g.dtype in HALF_DTYPES:
                    g = g.float()
                    a = act.float()
                else:
                    a = act
                if act is None:
                    res = bias_fn(module, g, bd)
                elif bias_fn is None:
                    res = weight_fn(module, a, g, bd)
                else:
                    res = {**bias_fn(module, g, bd), **weight_fn(module, a, g, bd)}
                for local, p in params.items():
                    per = res.get(local)
                    if per is not None:
                        accumulate(p, per, fid)

            out.register_hook(on_grad)

        return hook

    def _capture_hook(self, plan: LayerPlan) -> Callable:
        def hook(module: nn.Module, inputs: tuple, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            fid = self._forward_id

            def emit(local: str, g: torch.Tensor) -> None:
                p = plan.params.get(local)
                if p is not None:
                    self._accumulate(p, g, fid)

            plan.entry.capture(module, inputs, output, emit)

        return hook

    def _accumulate(self, p: nn.Parameter, g: torch.Tensor, fid: int) -> None:
        if isinstance(g, torch.Tensor) and g.dtype in HALF_DTYPES and p.dtype not in HALF_DTYPES:
            g = g.float()  # bf16 autocast over float32 masters: per-example rows in float32
        slot = self.per_example.get(p)
        if slot is None:
            self.per_example[p] = {fid: g}
        elif fid in slot:
            slot[fid] = slot[fid] + g  # the module ran more than once in this forward
        else:
            slot[fid] = g


def batch_rows(per_example: Mapping[nn.Parameter, Any], names: Mapping[nn.Parameter, str]) -> int:
    """The number of examples the per-example gradients agree on (their leading axis)."""
    sizes = {g.shape[0] for g in per_example.values()}
    if len(sizes) == 2 and 1 in sizes:
        ones = [names[p] for p, g in per_example.items() if g.shape[0] == 1]
        raise GradientMismatchError(
            f"{ones[:5]} saw an input with batch size 1 while other layers saw "
            f"{max(sizes)}: that input was broadcast across the batch (e.g. position ids "
            "of shape (1, L)), so its gradient mixes examples. Pass it with the batch "
            "axis expanded, e.g. position_ids=torch.arange(L).expand(B, L)."
        )
    if len(sizes) != 1:
        raise GradientMismatchError(
            f"per-example gradients disagree on the batch size ({sorted(sizes)}): some layer "
            "sees the batch on another axis; set batch_first=False or batch_dims={name: axis}"
        )
    (n,) = sizes
    return n
