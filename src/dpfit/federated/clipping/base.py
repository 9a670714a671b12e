"""What every federated clip rule shares: errors, norms, the config, the base class, the registry.

A rule holds the current C; the server asks it how to clip an update (``clip``), which
Gaussian releases the next round makes (``current_multipliers``, in sensitivity units) and
moves it after the round (``observe``). Calibration asks the class for the multipliers of a
whole run (``schedule``), so rules whose noise changes by round are accounted round by round.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np


class ClipRuleError(ValueError):
    """A clip rule was asked for something its configuration cannot provide."""


class UnknownClipRule(KeyError):
    """No clip rule is registered under the requested name."""


# --------------------------------------------------------------------------------------------
# Pure helpers
# --------------------------------------------------------------------------------------------


def global_norm(arrays: Sequence[np.ndarray]) -> float:
    """L2 norm of a model update given as a list of arrays (one flat vector), in float64 and
    scaled by the largest |x|, so that squaring a large finite entry cannot overflow (1e200
    squared is inf in float64); inf only when the norm itself passes float64's range."""
    arrays = [np.asarray(a, dtype=np.float64) for a in arrays]
    big = max((float(np.max(np.abs(a))) for a in arrays if a.size), default=0.0)
    if big == 0.0 or not math.isfinite(big):
        return big
    return big * math.sqrt(sum(float(np.sum(np.square(a / big))) for a in arrays))


def scale_update(arrays: Sequence[np.ndarray], factor: float) -> list[np.ndarray]:
    """``factor`` times the update, as float32: multiplied in float64 first, so an entry
    beyond float32's range is scaled before the cast (not cast to inf, then inf x 0 = NaN)."""
    return [(np.asarray(a, dtype=np.float64) * float(factor)).astype(np.float32) for a in arrays]


def clip_update(arrays: Sequence[np.ndarray], clip_norm: float) -> tuple[list[np.ndarray], float]:
    """Scale an update to L2 norm at most ``clip_norm``; returns (clipped, unclipped norm)."""
    norm = global_norm(arrays)
    factor = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    return scale_update(arrays, factor), norm


def combine_multipliers(multipliers: Sequence[float]) -> float:
    """Noise multiplier of one Gaussian equivalent to several on the same data."""
    if any(z <= 0 for z in multipliers):
        return 0.0
    return float(sum(z**-2 for z in multipliers) ** -0.5)


def split_multiplier(z: float, aux_share: float) -> tuple[float, float]:
    """Split combined multiplier ``z`` into (update, auxiliary) with ``aux_share`` of 1/z^2."""
    if not 0.0 < aux_share < 1.0:
        raise ClipRuleError(f"aux budget share must be in (0, 1), got {aux_share}")
    if z == 0:
        return 0.0, 0.0
    return z / math.sqrt(1.0 - aux_share), z / math.sqrt(aux_share)


# --------------------------------------------------------------------------------------------
# Config, observation, base rule
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClipConfig:
    """Everything a clip rule may need; each rule reads only its own fields.

    ``noise_multiplier`` is the combined per-round multiplier the accountant calibrated (for
    a scheduled rule: the first round's).
    """

    initial_clip: float = 1.0
    noise_multiplier: float = 1.0
    expected_clients: float = 5.0
    total_rounds: int = 1
    # quantile-adaptive (Andrew et al. 2021)
    target_quantile: float = 0.5
    quantile_lr: float = 0.2
    count_noise_std: float | None = None  # sigma_b; None: derived from count_budget_share
    count_budget_share: float = 0.1
    # DP-LAC
    vote_factors: tuple[float, ...] = (0.25, 0.5, 1.0)
    vote_noise_std: float = 10.0  # the server sets it by its budget-share rule
    # DP-CLAC
    loss_bound: float = 2.0
    loss_budget_share: float = 0.1
    clac_significance: float = 2.0  # shrink only on a decrease > k sqrt(2) std of the mean
    # automatic clipping (Bu et al. 2023)
    auto_gamma: float = 0.01
    # dynamic DP-SGD (Du et al. 2021): C and z reach these fractions of C_0, z_0 at round T
    clip_decay: float = 0.5
    noise_decay: float = 0.5

    def __post_init__(self) -> None:
        if self.initial_clip <= 0:
            raise ClipRuleError(f"initial_clip must be > 0, got {self.initial_clip}")
        if self.noise_multiplier < 0:
            raise ClipRuleError(f"noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if self.expected_clients <= 0:
            raise ClipRuleError(f"expected_clients must be > 0, got {self.expected_clients}")
        if self.total_rounds < 1:
            raise ClipRuleError(f"total_rounds must be >= 1, got {self.total_rounds}")
        if not 0.0 < self.target_quantile < 1.0:
            raise ClipRuleError(f"target_quantile must be in (0, 1), got {self.target_quantile}")
        if self.clac_significance < 0:
            raise ClipRuleError(f"clac_significance must be >= 0, got {self.clac_significance}")
        if self.auto_gamma <= 0:
            raise ClipRuleError(f"auto_gamma must be > 0, got {self.auto_gamma}")
        for name in ("clip_decay", "noise_decay"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ClipRuleError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        factors = tuple(self.vote_factors)
        if len(factors) < 2 or len(set(factors)) != len(factors) or min(factors) <= 0:
            raise ClipRuleError(
                f"vote_factors must be two or more distinct positive numbers, got {factors}"
            )


@dataclass(frozen=True)
class RoundObservation:
    """What the server saw in a finished round, as input to the next clip norm."""

    update_norms: tuple[float, ...] = ()
    client_losses: tuple[float, ...] = ()
    val_loss: float | None = None


@dataclass
class ClipRule(ABC):
    """Base: holds the current C and the per-round noise split."""

    config: ClipConfig
    clip_norm: float = field(init=False)
    name: ClassVar[str] = ""
    needs_client_loss: ClassVar[bool] = False
    needs_validation: ClassVar[bool] = False
    needs_votes: ClassVar[bool] = False
    needs_public_trial: ClassVar[bool] = False  # C_0 from the server's trial on public data
    scheduled: ClassVar[bool] = False  # multipliers change by round: calibrate the schedule

    def __post_init__(self) -> None:
        self.clip_norm = self.config.initial_clip

    @classmethod
    def round_multipliers(cls, config: ClipConfig) -> tuple[float, ...]:
        """Multipliers of every Gaussian release per sampled round, in sensitivity units."""
        return (config.noise_multiplier,)

    @classmethod
    def schedule(cls, config: ClipConfig, rounds: int) -> list[tuple[float, ...]]:
        """The multipliers of each of ``rounds`` rounds (identical unless a rule schedules)."""
        return [cls.round_multipliers(config)] * rounds

    @classmethod
    def one_off_multipliers(cls, config: ClipConfig) -> tuple[float, ...]:
        """Multipliers of releases made once, outside the sampled rounds (e.g. the vote)."""
        return ()

    def current_multipliers(self) -> tuple[float, ...]:
        """The releases of the next round (what the accountant records for it)."""
        return self.round_multipliers(self.config)

    @property
    def update_multiplier(self) -> float:
        return self.current_multipliers()[0]

    def update_noise_std(self) -> float:
        """Std of the noise on the SUM of clipped updates for this round: z_update * C."""
        return self.update_multiplier * self.clip_norm

    def clip(self, arrays: Sequence[np.ndarray]) -> tuple[list[np.ndarray], float]:
        """One client's update with L2 norm at most C; returns (clipped, unclipped norm)."""
        return clip_update(arrays, self.clip_norm)

    @abstractmethod
    def observe(self, obs: RoundObservation, rng: np.random.Generator) -> float:
        """Move C after a round; returns the new C. Noise only from ``rng``."""

    def state_dict(self) -> dict[str, Any]:
        return {"clip_norm": self.clip_norm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clip_norm = float(state["clip_norm"])


_REGISTRY: dict[str, type[ClipRule]] = {}


def register_clip_rule(name: str) -> Callable[[type[ClipRule]], type[ClipRule]]:
    """Class decorator: make a rule available to ``make_clip_rule`` under ``name``."""

    def deco(cls: type[ClipRule]) -> type[ClipRule]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def clip_rule_names() -> list[str]:
    return sorted(_REGISTRY)


def clip_rule_class(name: str) -> type[ClipRule]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownClipRule(
            f"unknown clip rule {name!r}; choose one of {', '.join(clip_rule_names())}"
        ) from None


def make_clip_rule(name: str, config: ClipConfig) -> ClipRule:
    """Build the rule registered under ``name``."""
    return clip_rule_class(name)(config)
