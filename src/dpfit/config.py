"""Immutable settings of a private training run."""

from __future__ import annotations

from dataclasses import dataclass, field

from dpfit.accounting import ACCOUNTANTS, DEFAULT_NEIGHBOURING, NEIGHBOURING
from dpfit.clipping import clipping_names

MODES = ("bias", "full", "bias+lora", "lora")
# modes whose peft LoRA adapters (lora_A / lora_B weights) train through the full-mode samplers
LORA_MODES = ("bias+lora", "lora")
# the modes a two-phase schedule switches between (dpfit.schedule)
PHASE_MODES = ("bias", "full")
LOSS_REDUCTIONS = ("mean", "sum")
SAMPLINGS = ("poisson", "user-poisson")
# what one contribution (sampled and clipped as one) is: a row of the batch, or a document
# whose rows (windows) are summed before the clip (dpfit.clipped_sum.DocumentSums)
PRIVACY_UNITS = ("example", "document")


@dataclass(frozen=True)
class PrivacyConfig:
    """Everything that determines the guarantee and the per-example computation.

    insecure_seed: None (the default) seeds the noise and sampling generators from os.urandom.
    An integer makes them reproducible, and the run is then not private against anyone who
    knows it. secure_rng: draw every noise value and sampling decision from os.urandom itself.
    sampling: "poisson" means batches come from `engine.data_loader` (checked at every step);
    "user-poisson" means the caller draws Poisson batches at rate q itself and vouches for it.
    neighbouring: the relation a target epsilon is calibrated (and the budget kept) for,
    "add-remove" or "replace-one"; both epsilons are reported (dpfit.accounting.NEIGHBOURING).
    privacy_unit: "example" (each row of a batch is one contribution) or "document" (the
    dataset's items are documents of several rows, e.g. the windows of a long text; a sampled
    document's rows are summed into one gradient and clipped together, so sample_size and
    expected_batch_size count documents and epsilon protects a whole document).
    """

    expected_batch_size: int
    sample_size: int
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    target_delta: float = 1e-5
    epochs: float | None = None
    steps: int | None = None
    max_grad_norm: float = 1.0
    clipping: str = "flat"
    mode: str = "bias"
    loss_reduction: str = "mean"
    accountant: str = "rdp"
    sampling: str = "poisson"
    secure_rng: bool = False
    insecure_seed: int | None = None
    batch_first: bool = True
    batch_dims: tuple[tuple[str, int], ...] = field(default_factory=tuple)
    check_gradients: bool = True
    neighbouring: str = DEFAULT_NEIGHBOURING
    privacy_unit: str = "example"

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if self.sample_size < 1:
            bad("sample_size must be >= 1 (the number of training examples)")
        if not 1 <= self.expected_batch_size <= self.sample_size:
            bad(
                f"expected_batch_size must be in [1, sample_size={self.sample_size}], "
                f"got {self.expected_batch_size}"
            )
        if self.max_grad_norm <= 0:
            bad("max_grad_norm must be > 0")
        if self.clipping not in clipping_names():
            bad(f"clipping must be one of {clipping_names()}, got {self.clipping!r}")
        if self.mode not in MODES:
            bad(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.loss_reduction not in LOSS_REDUCTIONS:
            bad(
                f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {self.loss_reduction!r}; "
                "the loss must be a mean or a sum of per-example losses"
            )
        if self.accountant not in ACCOUNTANTS:
            bad(f"accountant must be one of {ACCOUNTANTS}, got {self.accountant!r}")
        if self.neighbouring not in NEIGHBOURING:
            bad(f"neighbouring must be one of {NEIGHBOURING}, got {self.neighbouring!r}")
        if self.sampling not in SAMPLINGS:
            bad(f"sampling must be one of {SAMPLINGS}, got {self.sampling!r}")
        if self.privacy_unit not in PRIVACY_UNITS:
            bad(f"privacy_unit must be one of {PRIVACY_UNITS}, got {self.privacy_unit!r}")
        if self.privacy_unit == "document" and self.mode != "bias":
            bad(
                f"privacy_unit='document' sums dense per-example rows and works with "
                f"mode='bias' only, got mode={self.mode!r}; use privacy_unit='example'"
            )
        if not 0 < self.target_delta < 1:
            bad("target_delta must be in (0, 1); a common choice is 1/n^1.1 or 1e-5")
        if self.noise_multiplier is None:
            if self.target_epsilon is None:
                bad("give noise_multiplier, or target_epsilon with epochs= or steps=")
            if self.epochs is None and self.steps is None:
                bad("target_epsilon needs epochs= or steps= to calibrate the noise")
        elif self.noise_multiplier < 0:
            bad("noise_multiplier must be >= 0")
        if self.epochs is not None and self.steps is not None:
            bad("give epochs= or steps=, not both")
        if self.secure_rng and self.insecure_seed is not None:
            bad(
                "secure_rng=True draws every noise value and sampling decision from os.urandom, "
                "which no seed can reproduce; drop insecure_seed or secure_rng"
            )

    @property
    def sample_rate(self) -> float:
        return self.expected_batch_size / self.sample_size

    @property
    def steps_per_epoch(self) -> int:
        return max(1, round(1 / self.sample_rate))

    @property
    def planned_steps(self) -> int | None:
        if self.steps is not None:
            return self.steps
        if self.epochs is not None:
            return max(1, round(self.epochs * self.steps_per_epoch))
        return None
