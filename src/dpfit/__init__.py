"""dpfit: differentially private fine-tuning (DP-BiTFiT, DP-LAC)."""

from dpfit.accounting import epsilon_for, noise_multiplier_for
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
from dpfit.params import TrainableSummary, make_bias_trainable, summarize

__version__ = "0.1.0"

__all__ = [
    "BatchNormError",
    "BudgetExhaustedError",
    "DPFitError",
    "GradientMismatchError",
    "InfeasibleTargetError",
    "LossReductionError",
    "NoTrainableParametersError",
    "PrivacyConfig",
    "PrivacyEngine",
    "SamplingError",
    "TrainableSummary",
    "UnsupportedLayerError",
    "epsilon_for",
    "make_bias_trainable",
    "noise_multiplier_for",
    "summarize",
]
