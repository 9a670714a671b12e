"""Client-level DP federated fine-tuning: clip rules, accounting, and a Flower app.

The clip rules and the accountant need only numpy and dp-accounting; the Flower pieces
(``strategy``, ``client``, ``app``) import flwr and are loaded on demand.
"""

from dpfit.federated.accounting import (
    BudgetExhausted,
    CalibrationError,
    ClientLevelAccountant,
    calibrate_noise_multiplier,
)
from dpfit.federated.clipping import (
    ClipConfig,
    ClipRule,
    ClipRuleError,
    RoundObservation,
    UnknownClipRule,
    clip_rule_names,
    make_clip_rule,
    register_clip_rule,
)

__all__ = [
    "BudgetExhausted",
    "CalibrationError",
    "ClientLevelAccountant",
    "ClipConfig",
    "ClipRule",
    "ClipRuleError",
    "RoundObservation",
    "UnknownClipRule",
    "calibrate_noise_multiplier",
    "clip_rule_names",
    "make_clip_rule",
    "register_clip_rule",
]
