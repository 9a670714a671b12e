"""Exception classes: each says what went wrong and what to do about it."""


class DPFitError(Exception):
    """Base class for every error dpfit raises on purpose."""


class UnsupportedLayerError(DPFitError):
    """A trainable parameter sits in a layer with no registered per-example sampler."""


class BatchNormError(UnsupportedLayerError):
    """BatchNorm mixes examples in its statistics, so per-example gradients are undefined."""


class NoTrainableParametersError(DPFitError):
    """Nothing would train: the model has no bias (or the selection matched nothing)."""


class LoraTargetError(DPFitError):
    """The LoRA target modules are unknown for this model type or match no module."""


class BudgetExhaustedError(DPFitError):
    """The next step would spend more privacy than the configured target allows."""


class AccountingError(DPFitError):
    """The accountant could not compute a guarantee for the requested settings."""


class InfeasibleTargetError(AccountingError):
    """No noise multiplier meets the requested (epsilon, delta) for the given steps."""


class SamplingError(DPFitError):
    """The batches were not drawn the way the accountant assumes."""


class GradientMismatchError(DPFitError):
    """Per-example gradients do not add up to autograd's gradient: a use was missed."""


class BatchAxisError(GradientMismatchError):
    """The per-example gradients have another row count than the batch drawn: the model sees
    the batch on another axis than the engine assumes (batch_first / batch_dims)."""


class LossReductionError(DPFitError):
    """The loss reduction is not one dpfit can turn into per-example gradients."""


class DistributedError(DPFitError):
    """The process group or the DistributedDataParallel wrapper cannot give the guarantee."""
