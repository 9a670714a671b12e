"""What trains: biases, LoRA adapters, everything, or the head alone (one function per mode)."""

from __future__ import annotations

from dpfit.config import LORA_MODES
from dpfit.errors import NoTrainableParametersError
from dpfit.models import count_bias_parameters
from dpfit.run.config import TrainConfig


def prepare_trainables(
    model,
    heads: tuple[str, ...],
    config: TrainConfig,
    biases_added: bool = False,
    head_only: bool = False,
):
    """Select what trains; returns a TrainableSummary."""
    import dpfit
    from dpfit.params import summarize

    if head_only:  # DP last layer: the head modules alone
        for name, p in model.named_parameters():
            p.requires_grad_(any(name == h or name.startswith(h + ".") for h in heads))
        return summarize(model)

    if config.add_biases and not biases_added:
        # on the backbone, so the saved record reloads with the backbone alone
        dpfit.add_biases(getattr(model, "backbone", model))
    if config.mode == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return summarize(model)
    if config.mode in LORA_MODES:
        return prepare_lora(model, heads, config)
    if count_bias_parameters(model, exclude=heads) == 0:
        raise NoTrainableParametersError(
            f"{config.model or 'the model'} has no bias terms outside its head, so bias-only "
            "training would train the head alone; add zero-initialised biases with --add-biases "
            "(dpfit.add_biases), or use --mode full"
        )
    return dpfit.make_bias_trainable(model, train_head=heads)


def prepare_lora(model, heads: tuple[str, ...], config: TrainConfig):
    """--mode bias+lora / lora: peft LoRA adapters injected into the backbone (the head stays
    the task's), then the adapters (+ biases) + head made trainable."""
    import dpfit
    from dpfit.params import add_lora

    backbone = getattr(model, "backbone", model)
    add_lora(backbone, config.lora_r, config.lora_alpha, config.lora_targets)
    with_biases = config.mode == "bias+lora"
    if with_biases and count_bias_parameters(model, exclude=heads) == 0:
        raise NoTrainableParametersError(
            f"{config.model or 'the model'} has no bias terms outside its head; add "
            "zero-initialised biases with --add-biases, or use --mode lora"
        )
    return dpfit.make_lora_trainable(
        model, train_head=heads, biases=with_biases, freeze_a=config.lora_freeze_a
    )


def merge_adapters(model, config: TrainConfig) -> None:
    """Fold the LoRA adapters into the weights before the model is scored and saved: the
    same function, saved as the plain architecture (post-processing of the private steps)."""
    if config.mode in LORA_MODES:
        from dpfit.params import merge_lora

        merge_lora(getattr(model, "backbone", model))
