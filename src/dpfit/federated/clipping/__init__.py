"""Server-side clip rules for client-level DP federated averaging, free of any FL framework.

Every rule answers three questions for a round: how a client update is clipped (flat to C,
or normalised), how much Gaussian noise goes on the sum of clipped updates (always
``z_update * C`` with the C and z of that round), and how C (and, for a scheduled rule, z)
moves for the next round. Rules are small state objects with pure helpers underneath so they
can be tested on synthetic norms without Flower; one file per rule, registered by name:

- ``fixed``: DP-FedAvg, C constant (``fixed.py``);
- ``adaptive-quantile``: Andrew et al. 2021 (``quantile.py``);
- ``lac``: DP-LAC, vote for C0 then the public validation-loss ratio (``lac.py``);
- ``clac``: DP-CLAC, the vote, then a significant-decrease rule on privately aggregated
  client losses (``clac.py``);
- ``automatic``: Bu et al. 2023, every update normalised to R/(||Delta|| + gamma)
  (``automatic.py``);
- ``dynamic``: Du et al. 2021, C and z decayed on a schedule (``dynamic.py``);
- ``lac-2s``: two-sided DP-LAC, a vote over 0.1x..10x C_init, a clipped-fraction band and a
  validation-loss brake (``lac_two_sided.py``);
- ``public-trial``: C chosen before round 1 by the server's own trial on its public data
  (no privacy cost), then fixed (``public_trial.py``).

Per-round noise is expressed as one combined multiplier ``z`` (what the accountant calibrates)
that a rule may split between the model update and an auxiliary release (clipped counts for
the quantile rule, losses for DP-CLAC). Two Gaussian releases on the same sampled clients
with multipliers ``a`` and ``b`` are exactly one Gaussian with ``(a**-2 + b**-2) ** -0.5``,
which is Andrew et al.'s Theorem 1; the split keeps that combined value equal to ``z``.
"""

from dpfit.federated.clipping.automatic import AutomaticClip, automatic_scale
from dpfit.federated.clipping.base import (
    ClipConfig,
    ClipRule,
    ClipRuleError,
    RoundObservation,
    UnknownClipRule,
    clip_rule_class,
    clip_rule_names,
    clip_update,
    combine_multipliers,
    global_norm,
    make_clip_rule,
    register_clip_rule,
    split_multiplier,
)
from dpfit.federated.clipping.clac import ClacClip, private_mean_loss, significant_decrease_step
from dpfit.federated.clipping.dynamic import DynamicClip, dynamic_clip, dynamic_multiplier
from dpfit.federated.clipping.fixed import FixedClip
from dpfit.federated.clipping.lac import (
    LacClip,
    LossRatioClip,
    VotedStart,
    lac_step,
    noised_histogram,
    one_hot_vote,
)
from dpfit.federated.clipping.lac_two_sided import TwoSidedLacClip
from dpfit.federated.clipping.public_trial import PublicTrialClip
from dpfit.federated.clipping.quantile import (
    QuantileClip,
    effective_update_multiplier,
    noised_unclipped_fraction,
    quantile_step,
)

__all__ = [
    "AutomaticClip",
    "ClacClip",
    "ClipConfig",
    "ClipRule",
    "ClipRuleError",
    "DynamicClip",
    "FixedClip",
    "LacClip",
    "LossRatioClip",
    "PublicTrialClip",
    "QuantileClip",
    "RoundObservation",
    "TwoSidedLacClip",
    "UnknownClipRule",
    "VotedStart",
    "automatic_scale",
    "clip_rule_class",
    "clip_rule_names",
    "clip_update",
    "combine_multipliers",
    "dynamic_clip",
    "dynamic_multiplier",
    "effective_update_multiplier",
    "global_norm",
    "lac_step",
    "make_clip_rule",
    "noised_histogram",
    "noised_unclipped_fraction",
    "one_hot_vote",
    "private_mean_loss",
    "quantile_step",
    "register_clip_rule",
    "significant_decrease_step",
    "split_multiplier",
]
