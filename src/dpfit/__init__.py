"""dpfit: differentially private fine-tuning (DP-BiTFiT, DP-LAC)."""

from dpfit.accounting import epsilon_for, noise_multiplier_for
from dpfit.biases import AddedBiases, add_biases, load_pretrained_with_biases, restore_added_biases
from dpfit.config import PrivacyConfig
from dpfit.engine import PrivacyEngine
from dpfit.errors import (
    BatchNormError,
    BudgetExhaustedError,
    DPFitError,
    GradientMismatchError,
    InfeasibleTargetError,
    LossReductionError,
    NoTrainableParametersError,
    SamplingError,
    UnsupportedLayerError,
)
from dpfit.params import TrainableSummary, make_bias_trainable, make_lora_trainable, summarize
from dpfit.schedule import Phase

__version__ = "0.1.0"

__all__ = [
    "AddedBiases",
    "BatchNormError",
    "BudgetExhaustedError",
    "DPFitError",
    "GradientMismatchError",
    "InfeasibleTargetError",
    "LossReductionError",
    "NoTrainableParametersError",
    "Phase",
    "PrivacyConfig",
    "PrivacyEngine",
    "SamplingError",
    "TrainableSummary",
    "UnsupportedLayerError",
    "add_biases",
    "epsilon_for",
    "load_pretrained_with_biases",
    "make_bias_trainable",
    "make_lora_trainable",
    "noise_multiplier_for",
    "restore_added_biases",
    "summarize",
]
