"""Layer families of the batched engine, by local mode: adding a model family or a local
mode touches one module here and the table below."""

from __future__ import annotations

from dpfit.federated.batched_layers.base import BatchedEngineError, Linear, TrainedTop
from dpfit.federated.batched_layers.bert import BertTop
from dpfit.federated.batched_layers.bert_bias import BertBias
from dpfit.federated.batched_layers.llama import LlamaTop
from dpfit.federated.client import LocalModel

# local mode -> the families that run it, tried in order (the first that accepts the model)
FAMILIES: dict[str, tuple[type[TrainedTop], ...]] = {
    "lora-top": (BertTop, LlamaTop),
    "bias": (BertBias,),
}
LOCAL_MODES = tuple(FAMILIES)


def trained_top(lm: LocalModel) -> TrainedTop:
    """The family that runs this model in its local mode, or a BatchedEngineError naming
    the modes the engine has."""
    families = FAMILIES.get(lm.local_mode)
    if families is None:
        raise BatchedEngineError(
            f"the batched engine runs local mode {' or '.join(LOCAL_MODES)}, got "
            f"{lm.local_mode!r}; use --engine local for it"
        )
    errors = []
    for family in families:
        try:
            return family(lm)
        except BatchedEngineError as exc:
            errors.append(str(exc))
    raise BatchedEngineError("; ".join(errors))


__all__ = ["FAMILIES", "LOCAL_MODES", "BatchedEngineError", "Linear", "TrainedTop", "trained_top"]
