"""What trains: bias-only selection (BiTFiT), optionally plus named new heads."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from dpfit.errors import LoraTargetError, NoTrainableParametersError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainableSummary:
    trainable: int
    total: int
    names: tuple[str, ...]

    @property
    def fraction(self) -> float:
        return self.trainable / self.total if self.total else 0.0

    def __str__(self) -> str:
        return (
            f"{self.trainable:,} trainable of {self.total:,} parameters "
            f"({100 * self.fraction:.3f}%) in {len(self.names)} tensors"
        )


def is_bias(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf == "bias" or leaf.endswith("_bias")


def _unique_named_parameters(model: nn.Module):
    return model.named_parameters(remove_duplicate=True)


def summarize(model: nn.Module) -> TrainableSummary:
    named = list(_unique_named_parameters(model))
    train = [(n, p) for n, p in named if p.requires_grad]
    return TrainableSummary(
        trainable=sum(p.numel() for _, p in train),
        total=sum(p.numel() for _, p in named),
        names=tuple(n for n, _ in train),
    )


def make_bias_trainable(model: nn.Module, train_head: Iterable[str] = ()) -> TrainableSummary:
    """Freeze every parameter except biases and those under the named head modules.

    `train_head` holds module-name prefixes (e.g. "classifier", "score"); prefixes that match
    no parameter are an error so a typo cannot silently train nothing.
    """
    heads = tuple(train_head)
    matched = dict.fromkeys(heads, False)
    for name, p in _unique_named_parameters(model):
        in_head = [h for h in heads if name == h or name.startswith(h + ".")]
        for h in in_head:
            matched[h] = True
        p.requires_grad_(bool(in_head) or is_bias(name))
    missing = [h for h, ok in matched.items() if not ok]
    if missing:
        raise NoTrainableParametersError(
            f"train_head names {missing} match no parameter; module names look like "
            f"{[n for n, _ in list(model.named_modules())[1:6]]}"
        )
    summary = summarize(model)
    if not any(is_bias(n) for n in summary.names):
        raise NoTrainableParametersError(
            "the model has no bias terms to train; add zero-initialised biases first with "
            "dpfit.add_biases(model) (DP-BiTFiT-Add, CLI: --add-biases)"
        )
    log.info("bias-only training: %s", summary)
    return summary


# peft's LoRA adapter containers (peft.tuners.lora.LoraLayer.adapter_layer_names): lora_A and
# lora_B hold one nn.Linear / nn.Conv per adapter, through the full-mode samplers; the others
# are bare parameters with no per-example sampler (LoRA on embeddings, DoRA): they are made
# trainable like the rest, so that the engine names them as unsupported rather than a LoRA
# target silently not training
LORA_CONTAINERS = ("lora_A", "lora_B")
LORA_PARAMETERS = (
    *LORA_CONTAINERS,
    "lora_embedding_A",
    "lora_embedding_B",
    "lora_magnitude_vector",
)
# peft keeps a frozen copy of a module it trains in full (the head) under this name
_PEFT_FROZEN_COPY = "original_module"
_PEFT_TRAINED_COPY = "modules_to_save"


def is_lora(name: str) -> bool:
    """Whether a parameter or module name lies inside a peft LoRA adapter."""
    return any(part in LORA_PARAMETERS for part in name.split("."))


def is_lora_module(name: str) -> bool:
    """Whether a module is one adapter's layer: ``....lora_A.<adapter>`` (or lora_B)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in LORA_CONTAINERS


def in_peft_head(name: str) -> bool:
    """Under a module peft trains in full (``modules_to_save``, e.g. a classifier head)."""
    return _PEFT_TRAINED_COPY in name.split(".")


def make_lora_trainable(
    model: nn.Module, train_head: Iterable[str] = (), biases: bool = True, freeze_a: bool = False
) -> TrainableSummary:
    """Freeze every parameter except the peft LoRA adapters, the biases (``biases=True``:
    the bias+lora mode; False: LoRA-only) and the head.

    ``freeze_a``: keep every ``lora_A`` at its random initialisation and train ``lora_B`` only
    (FFA-LoRA, Sun et al., ICLR 2024). Under DP it halves the adapters' noised coordinates, and
    an adaptive optimizer no longer walks the random down-projection with noise.

    The head is whatever peft trains in full (``modules_to_save``, which peft sets for
    sequence classification) plus the module-name prefixes in `train_head`. peft's frozen copy
    of such a head (``original_module``) stays frozen, biases included. Why a helper: peft's
    ``LoraConfig(bias=...)`` covers biases too, but "all" would also train that frozen copy.
    """
    heads = tuple(train_head)
    matched = dict.fromkeys(heads, False)
    lora_found = False
    for name, p in _unique_named_parameters(model):
        parts = name.split(".")
        in_head = [h for h in heads if name == h or name.startswith(h + ".")]
        for h in in_head:
            matched[h] = True
        lora = is_lora(name)
        lora_found |= lora
        frozen_copy = _PEFT_FROZEN_COPY in parts
        adapter = lora and not (freeze_a and "lora_A" in parts)
        train = adapter or bool(in_head) or in_peft_head(name) or (biases and is_bias(name))
        p.requires_grad_(train and not frozen_copy)
    missing = [h for h, ok in matched.items() if not ok]
    if missing:
        raise NoTrainableParametersError(
            f"train_head names {missing} match no parameter; module names look like "
            f"{[n for n, _ in list(model.named_modules())[1:6]]}"
        )
    if not lora_found:
        raise NoTrainableParametersError(
            "the model has no LoRA adapters; wrap it with peft first, e.g. "
            "peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=[...]))"
        )
    summary = summarize(model)
    kind = ("bias+" if biases else "") + ("FFA-LoRA (lora_A frozen)" if freeze_a else "LoRA")
    log.info("%s training: %s", kind, summary)
    return summary


def add_lora(
    model: nn.Module, r: int, alpha: float, targets: Sequence[str] | None = None
) -> nn.Module:
    """Inject peft LoRA adapters in place (the model object and its head stay the caller's).

    targets None: the attention projections peft knows for the model type (BERT query/value,
    GPT-2 c_attn, LLaMA q_proj/v_proj): adapting queries and values is where Hu et al. (2021)
    found a small rank enough. No LoRA dropout: it would only add noise to DP's noise.
    """
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as TARGETS

    if targets is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in TARGETS:
            raise LoraTargetError(
                f"no default LoRA target modules for model type {model_type!r}; name them, "
                "e.g. --lora-targets q_proj v_proj (module-name suffixes)"
            )
        targets = TARGETS[model_type]
    fan_in_fan_out = any(type(m).__name__ == "Conv1D" for m in model.modules())  # GPT-2
    cfg = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets),
        fan_in_fan_out=fan_in_fan_out,
    )  # fmt: skip
    try:
        return inject_adapter_in_model(cfg, model)
    except ValueError as e:  # peft: no module matched the targets
        raise LoraTargetError(f"LoRA targets {list(targets)}: {e}") from e


def merge_lora(model: nn.Module) -> int:
    """Fold every LoRA adapter into its base layer and put the base layer back, so the saved
    model is the plain architecture (loadable without peft); returns the layers merged."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    merged = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, BaseTunerLayer) or not name:
            continue
        module.merge()
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, module.get_base_layer())
        merged += 1
    return merged
