"""``ServerConfig``: the privacy and schedule of a federated run, as the server reads them.

Its own module so that the server core (``strategy``), private tuning (``tuning``), the
deployment writer and the CLI all name it without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from dpfit.federated.accounting import epsilon_of, training_event, vote_noise_for_share
from dpfit.federated.clipping import ClipConfig, clip_rule_class
from dpfit.selection import RunCount


@dataclass(frozen=True)
class ServerConfig:
    """Privacy and schedule of a run; ``noise_multiplier`` set overrides calibration."""

    method: str = "lac"
    num_clients: int = 20
    clients_per_round: float = 5.0
    rounds: int = 5
    target_epsilon: float | None = 8.0
    delta: float = 1e-5
    noise_multiplier: float | None = None
    initial_clip: float = 1.0
    server_lr: float = 1.0
    accountant: str = "rdp"
    # None: client sampling and noise come from OS entropy. An int makes them reproducible
    # from that number, and the run is then NOT private against anyone who knows it.
    insecure_seed: int | None = None
    round_timeout: float = 600.0
    node_wait_timeout: float = 120.0
    checkpoint_dir: str | None = None
    # continue a checkpoint that was already continued (a fork: releasing both runs costs the
    # shared rounds plus both continuations' own rounds); off, a second continuation is refused
    allow_fork: bool = False
    # clip-rule settings: same names and defaults as ClipConfig, copied into it by name
    target_quantile: float = ClipConfig.target_quantile
    quantile_lr: float = ClipConfig.quantile_lr
    count_budget_share: float = ClipConfig.count_budget_share
    vote_factors: tuple[float, ...] = ClipConfig.vote_factors
    # sigma_h of the vote; None: the Gaussian that alone spends vote_budget_share of the
    # target epsilon (of the rounds' epsilon when z is fixed); see vote_noise_for_share
    vote_noise_std: float | None = None
    vote_budget_share: float = 0.1
    loss_bound: float = ClipConfig.loss_bound
    loss_budget_share: float = ClipConfig.loss_budget_share
    clac_significance: float = ClipConfig.clac_significance
    auto_gamma: float = ClipConfig.auto_gamma
    clip_decay: float = ClipConfig.clip_decay
    noise_decay: float = ClipConfig.noise_decay
    # Private hyperparameter selection this run was tuned by (``dpfit.federated.tuning``):
    # K ~ D(mean, shape) candidate runs of this config at this multiplier. Set: the ledger
    # starts with the selection, so calibration and every reported epsilon include it.
    tuning_noise_multiplier: float | None = None
    tuning_mean_runs: float = 1.0
    tuning_shape: float = 1.0

    def __post_init__(self) -> None:
        clip_rule_class(self.method)  # fail early with the list of names
        self.clip_config(1.0)  # and on a rule setting out of range
        if self.tuning_noise_multiplier is not None:
            if not self.tuning_noise_multiplier > 0:
                raise ValueError("tuning_noise_multiplier must be > 0 (a private selection)")
            if self.accountant != "rdp":
                raise ValueError("a privately tuned run is accounted with accountant='rdp'")
            RunCount(self.tuning_mean_runs, self.tuning_shape)  # range checks
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError("give a target epsilon or a noise multiplier")
        if not 0 < self.clients_per_round <= self.num_clients:
            raise ValueError(
                f"clients_per_round must be in (0, num_clients={self.num_clients}], "
                f"got {self.clients_per_round}"
            )

    @property
    def sample_rate(self) -> float:
        return self.clients_per_round / self.num_clients

    def vote_noise(self, noise_multiplier: float) -> float:
        """sigma_h: as given, or by the budget-share rule; 0 when the run is not private."""
        if noise_multiplier <= 0:
            return 0.0
        if self.vote_noise_std is not None:
            return float(self.vote_noise_std)
        if not clip_rule_class(self.method).needs_votes:
            return 0.0  # no vote in this run
        if self.target_epsilon is not None:
            eps = self.target_epsilon
        else:  # z fixed: a share of what the rounds alone spend
            rounds = training_event(self.sample_rate, self.rounds, (noise_multiplier,))
            eps = epsilon_of(rounds, self.delta, "rdp")
        return vote_noise_for_share(eps, self.delta, self.vote_budget_share)

    def clip_config(self, noise_multiplier: float) -> ClipConfig:
        derived = {
            "noise_multiplier": noise_multiplier,
            "expected_clients": self.clients_per_round,
            "vote_noise_std": self.vote_noise(noise_multiplier),
            "total_rounds": max(1, self.rounds),
        }
        shared = {f.name for f in fields(ClipConfig)} & {f.name for f in fields(self)}
        return ClipConfig(**{n: getattr(self, n) for n in shared - derived.keys()}, **derived)
