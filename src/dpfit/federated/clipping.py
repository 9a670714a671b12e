"""Server-side clip rules for client-level DP federated averaging, free of any FL framework.

Every rule answers three questions for a round: which clip norm C clips the client updates,
how much Gaussian noise goes on the sum of clipped updates (always ``z_update * C`` with the C
that clipped that round), and how C moves for the next round. Rules are small state objects
with pure helpers underneath so they can be tested on synthetic norms without Flower.

Per-round noise is expressed as one combined multiplier ``z`` (what the accountant calibrates)
that a rule may split between the model update and an auxiliary release (clipped counts for
the quantile rule, losses for DP-CLAC). Two Gaussian releases on the same sampled clients
with multipliers ``a`` and ``b`` are exactly one Gaussian with ``(a**-2 + b**-2) ** -0.5``,
which is Andrew et al.'s Theorem 1; the split keeps that combined value equal to ``z``.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

logger = logging.getLogger(__name__)


class ClipRuleError(ValueError):
    """A clip rule was asked for something its configuration cannot provide."""


class UnknownClipRule(KeyError):
    """No clip rule is registered under the requested name."""


# --------------------------------------------------------------------------------------------
# Pure helpers
# --------------------------------------------------------------------------------------------


def global_norm(arrays: Sequence[np.ndarray]) -> float:
    """L2 norm of a model update given as a list of arrays (one flat vector)."""
    return float(math.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in arrays)))


def clip_update(arrays: Sequence[np.ndarray], clip_norm: float) -> tuple[list[np.ndarray], float]:
    """Scale an update to L2 norm at most ``clip_norm``; returns (clipped, unclipped norm)."""
    norm = global_norm(arrays)
    factor = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    return [np.asarray(a, dtype=np.float32) * np.float32(factor) for a in arrays], norm


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


def effective_update_multiplier(z: float, count_noise_std: float) -> float:
    """Andrew et al. Theorem 1: z_eff = (z^-2 - (2 sigma_b)^-2)^-1/2 for the update sum.

    The count release sums ``b_i - 1/2`` (sensitivity 1/2), so its multiplier is 2 sigma_b.
    """
    if z == 0:
        return 0.0
    if 2.0 * count_noise_std <= z:
        raise ClipRuleError(
            f"clipped-count noise sigma_b={count_noise_std:.4g} is too small for z={z:.4g}: "
            f"need 2*sigma_b > z; raise count_noise_std or use count_budget_share"
        )
    return float((z**-2 - (2.0 * count_noise_std) ** -2) ** -0.5)


def noised_unclipped_fraction(
    norms: Sequence[float],
    clip_norm: float,
    expected_clients: float,
    count_noise_std: float,
    rng: np.random.Generator,
) -> float:
    """Private fraction of updates with norm <= C (UNclipped), Andrew et al. Algorithm 1.

    Sums ``b_i - 1/2`` so one client moves the sum by at most 1/2, noises it, and divides by
    the expected number of clients (public) rather than by how many answered.
    """
    centred = sum((1.0 if n <= clip_norm else 0.0) - 0.5 for n in norms)
    noise = rng.normal(0.0, count_noise_std) if count_noise_std > 0 else 0.0
    return (centred + noise) / expected_clients + 0.5


def quantile_step(clip_norm: float, unclipped_fraction: float, target: float, lr: float) -> float:
    """Geometric update C <- C * exp(-lr * (b - target)): too many unclipped means C too big."""
    return float(clip_norm * math.exp(-lr * (unclipped_fraction - target)))


def lac_step(clip_norm: float, loss_prev: float, loss_prev2: float) -> float:
    """DP-LAC: C_t = C_{t-1} * min(1, v_{t-1} / v_{t-2}); never increases C.

    Non-finite or non-positive losses carry no information (a noised DP-CLAC loss can be
    clamped to 0), so C is kept rather than collapsed.
    """
    if not (math.isfinite(loss_prev) and math.isfinite(loss_prev2)):
        return clip_norm
    if loss_prev <= 0 or loss_prev2 <= 0:
        return clip_norm
    return float(clip_norm * min(1.0, loss_prev / loss_prev2))


def one_hot_vote(candidate_losses: Sequence[float]) -> list[int]:
    """A client's vote: one-hot on the candidate with the lowest (finite) local loss."""
    losses = [x if math.isfinite(x) else math.inf for x in candidate_losses]
    best = int(np.argmin(losses))
    return [1 if i == best else 0 for i in range(len(losses))]


def noised_histogram(
    votes: Sequence[Sequence[int]], num_bins: int, noise_std: float, rng: np.random.Generator
) -> np.ndarray:
    """Gaussian mechanism on the vote sums (L2 sensitivity 1: one client, one one-hot vote)."""
    counts = np.zeros(num_bins, dtype=np.float64)
    for v in votes:
        if len(v) != num_bins or sum(v) != 1 or any(x not in (0, 1) for x in v):
            raise ClipRuleError(f"a vote must be one-hot of length {num_bins}, got {list(v)}")
        counts += np.asarray(v, dtype=np.float64)
    if noise_std > 0:
        counts += rng.normal(0.0, noise_std, size=num_bins)
    return counts


def private_mean_loss(
    losses: Sequence[float],
    loss_bound: float,
    expected_clients: float,
    noise_std: float,
    rng: np.random.Generator,
) -> float:
    """DP-CLAC: mean of losses clipped to [0, L_max], Gaussian noise with std z_loss * L_max.

    Divides by the expected number of clients; the result is clamped to [0, L_max] (post-
    processing) so ratios stay meaningful.
    """
    total = sum(min(max(x, 0.0), loss_bound) for x in losses if math.isfinite(x))
    if noise_std > 0:
        total += rng.normal(0.0, noise_std)
    return float(min(max(total / expected_clients, 0.0), loss_bound))


# --------------------------------------------------------------------------------------------
# Rules
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClipConfig:
    """Everything a clip rule may need; each rule reads only its own fields.

    ``noise_multiplier`` is the combined per-round multiplier the accountant calibrated.
    """

    initial_clip: float = 1.0
    noise_multiplier: float = 1.0
    expected_clients: float = 5.0
    # quantile-adaptive (Andrew et al. 2021)
    target_quantile: float = 0.5
    quantile_lr: float = 0.2
    count_noise_std: float | None = None  # sigma_b; None: derived from count_budget_share
    count_budget_share: float = 0.1
    # DP-LAC
    vote_factors: tuple[float, ...] = (0.25, 0.5, 1.0)
    vote_noise_std: float = 10.0
    # DP-CLAC
    loss_bound: float = 2.0
    loss_budget_share: float = 0.1

    def __post_init__(self) -> None:
        if self.initial_clip <= 0:
            raise ClipRuleError(f"initial_clip must be > 0, got {self.initial_clip}")
        if self.noise_multiplier < 0:
            raise ClipRuleError(f"noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if self.expected_clients <= 0:
            raise ClipRuleError(f"expected_clients must be > 0, got {self.expected_clients}")
        if not 0.0 < self.target_quantile < 1.0:
            raise ClipRuleError(f"target_quantile must be in (0, 1), got {self.target_quantile}")


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

    def __post_init__(self) -> None:
        self.clip_norm = self.config.initial_clip

    @classmethod
    def round_multipliers(cls, config: ClipConfig) -> tuple[float, ...]:
        """Multipliers of every Gaussian release per sampled round, in sensitivity units."""
        return (config.noise_multiplier,)

    @classmethod
    def one_off_multipliers(cls, config: ClipConfig) -> tuple[float, ...]:
        """Multipliers of releases made once, outside the sampled rounds (e.g. the vote)."""
        return ()

    @property
    def update_multiplier(self) -> float:
        return self.round_multipliers(self.config)[0]

    def update_noise_std(self) -> float:
        """Std of the noise on the SUM of clipped updates for this round: z_update * C."""
        return self.update_multiplier * self.clip_norm

    @abstractmethod
    def observe(self, obs: RoundObservation, rng: np.random.Generator) -> float:
        """Move C after a round; returns the new C."""

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


@register_clip_rule("fixed")
@dataclass
class FixedClip(ClipRule):
    """DP-FedAvg (McMahan et al. 2018): C never moves."""

    def observe(self, obs: RoundObservation, rng: np.random.Generator) -> float:
        return self.clip_norm


@register_clip_rule("adaptive-quantile")
@dataclass
class QuantileClip(ClipRule):
    """Andrew et al. 2021: C tracks the target quantile of update norms, privately."""

    @staticmethod
    def count_noise_std(config: ClipConfig) -> float:
        if config.noise_multiplier == 0:
            return 0.0
        if config.count_noise_std is not None:
            return config.count_noise_std
        _, aux = split_multiplier(config.noise_multiplier, config.count_budget_share)
        return aux / 2.0

    @classmethod
    def round_multipliers(cls, config: ClipConfig) -> tuple[float, ...]:
        if config.noise_multiplier == 0:
            return (0.0, 0.0)
        sigma_b = cls.count_noise_std(config)
        return (effective_update_multiplier(config.noise_multiplier, sigma_b), 2.0 * sigma_b)

    def observe(self, obs: RoundObservation, rng: np.random.Generator) -> float:
        frac = noised_unclipped_fraction(
            obs.update_norms,
            self.clip_norm,
            self.config.expected_clients,
            self.count_noise_std(self.config),
            rng,
        )
        self.clip_norm = quantile_step(
            self.clip_norm, frac, self.config.target_quantile, self.config.quantile_lr
        )
        return self.clip_norm


@dataclass
class _LossRatioClip(ClipRule):
    """Shared loss-ratio rule: C_t = C_{t-1} * min(1, v_{t-1}/v_{t-2})."""

    losses: list[float] = field(default_factory=list)

    def _apply(self, loss: float | None) -> float:
        if loss is None or not math.isfinite(loss):
            logger.warning("no usable loss this round; clip norm kept at %.4g", self.clip_norm)
            return self.clip_norm
        self.losses.append(float(loss))
        if len(self.losses) >= 2:
            self.clip_norm = lac_step(self.clip_norm, self.losses[-1], self.losses[-2])
        return self.clip_norm

    def state_dict(self) -> dict[str, Any]:
        return {"clip_norm": self.clip_norm, "losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clip_norm = float(state["clip_norm"])
        self.losses = [float(x) for x in state.get("losses", [])]


@register_clip_rule("lac")
@dataclass
class LacClip(_LossRatioClip):
    """DP-LAC: C0 from a private vote, then the public validation-loss ratio (free)."""

    needs_validation: ClassVar[bool] = True
    needs_votes: ClassVar[bool] = True

    @classmethod
    def one_off_multipliers(cls, config: ClipConfig) -> tuple[float, ...]:
        return (config.vote_noise_std,)

    def candidates(self) -> list[float]:
        return [f * self.config.initial_clip for f in self.config.vote_factors]

    def initialise_from_votes(
        self, votes: Sequence[Sequence[int]], rng: np.random.Generator
    ) -> np.ndarray:
        """Set C0 to the candidate with the most (noised) votes; returns the noised counts."""
        cands = self.candidates()
        counts = noised_histogram(votes, len(cands), self.config.vote_noise_std, rng)
        self.clip_norm = cands[int(np.argmax(counts))]
        return counts

    def observe_validation(self, val_loss: float) -> float:
        """Record v for the current model (call once before round 1 and after each round)."""
        return self._apply(val_loss)

    def observe(self, obs: RoundObservation, rng: np.random.Generator) -> float:
        return self._apply(obs.val_loss)


@register_clip_rule("clac")
@dataclass
class ClacClip(_LossRatioClip):
    """DP-CLAC: no public data; the loss ratio comes from privately aggregated client losses.

    Clients report the loss of the model they received, so the private loss of round t is
    v_{t-1}: the rule lags one round behind DP-LAC.
    """

    needs_client_loss: ClassVar[bool] = True

    @classmethod
    def round_multipliers(cls, config: ClipConfig) -> tuple[float, ...]:
        return split_multiplier(config.noise_multiplier, config.loss_budget_share)

    def loss_noise_std(self) -> float:
        return self.round_multipliers(self.config)[1] * self.config.loss_bound

    def observe(self, obs: RoundObservation, rng: np.random.Generator) -> float:
        loss = private_mean_loss(
            obs.client_losses,
            self.config.loss_bound,
            self.config.expected_clients,
            self.loss_noise_std(),
            rng,
        )
        return self._apply(loss)
