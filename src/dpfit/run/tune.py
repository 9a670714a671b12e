"""``dpfit train --tune``: pick the learning rate and epochs on the user's data, privately.

The recipe's defaults come from public quantities; on an unseen task they can be off. Trying
settings and keeping the best leaks through the choice, unless the choice is itself private.
This runs Papernot & Steinke's random-stopping selection (:mod:`dpfit.selection`):

1. Carve a validation split out of the training rows by each row's keyed hash (purpose
   :data:`VALIDATION`, :mod:`dpfit.data.rowhash`): a row and all its windows on one side, and
   adding or removing one row changes one side by that row alone. Under ``--privacy-unit
   user`` the split is by the keyed hash of the user id: a user and all their rows on one
   side, so adding or removing one user changes one side by that user alone.
2. Draw K from a distribution fixed in advance (:data:`DEFAULT_RUNS`; OS randomness unless
   --insecure-reproducible-noise). K times: draw a point of :func:`grid` uniformly, train it
   privately on the rest of the rows, and score it on the validation split as the number of
   validation texts it gets right plus Gaussian noise (std :data:`SCORE_NOISE`; one text
   moves the count by at most 1). Under the user unit the score is the sum over validation
   users of the fraction of their rows it gets right (one user moves it by at most 1, however
   many rows they have), and each candidate trains at the user level (Poisson over users).
   Keep the best.
3. Release the best run's model, trained as it was. Papernot & Steinke's theorems bound the
   best run's whole output (model, grid point, score), so its learning rate and epochs are
   released too (metrics.json's lr and epochs); K, the other runs and every score are not.

Accounting (RDP, add-or-remove neighbours, dp-accounting's RepeatAndSelectDpEvent): one
candidate is its training steps composed with its score's Gaussian. Grid points with fewer
steps get the smallest noise multiplier whose RDP curve stays under the longest point's at
every order (:func:`dpfit.selection.dominating_multiplier`), so a uniform draw over the grid
is bounded by the longest point's event (Renyi divergence is jointly quasi-convex). The
longest point's multiplier is solved so the whole selection meets the target epsilon: the
released model is the selection's output, nothing is composed after it. Sequential
composition of training and score is conservative (the two read disjoint rows).

Costs: E[K] training runs of compute; each candidate trains on (1 - VALIDATION_FRACTION) of
the rows with more noise than an untuned run (the selection's overhead).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import dp_accounting as dpa

from dpfit.accounting import calibrate, dp_sgd_event, epsilon_of
from dpfit.data.rowhash import SPLIT_RULE, held_out_mask
from dpfit.data.text import LabeledTexts, UserTexts
from dpfit.errors import DPFitError, InfeasibleTargetError
from dpfit.recipe import default_delta
from dpfit.reporting import StepRow
from dpfit.run.config import TrainConfig, TrainResult
from dpfit.run.prepare import prepare
from dpfit.run.release import save_outputs
from dpfit.run.resolve import check_paths, device_for, insecure_seed, seed_everything
from dpfit.selection import (
    RunCount,
    SelectionError,
    dominating_multiplier,
    select_best,
    selection_event,
    selection_rng,
)
from dpfit.tasks import Prepared, get_task
from dpfit.tasks.classification import predict

logger = logging.getLogger(__name__)

LR_FACTORS = (1 / 3, 1.0, 3.0)  # times the recipe's (or --lr's) learning rate
EPOCH_FACTORS = (0.5, 1.0, 2.0)  # times the recipe's (or --epochs') epochs, rounded, >= 1
VALIDATION_FRACTION = 0.2  # of the training rows, by row hash
VALIDATION = "validation"  # the row-hash purpose: keys independent of the test hold-out's
SCORE_NOISE = 5.0  # std of the Gaussian on the count of correct validation texts
DEFAULT_RUNS = RunCount(mean_runs=3.0, shape=0.0)  # logarithmic K, E[K] = 3
BLUR_WARNING = 0.02  # warn when the score's noise std exceeds 2 points of accuracy


# what a candidate's metrics keep: nothing here reads the validation rows (an allow-list, so
# a score added to a task's evaluation later is never carried over by mistake)
KEPT = (
    "trainable_params", "total_params", "trainable_fraction", "peak_memory_mb",
    "head_first_steps", "recipe", "overridden_by_flags", "train_time_s", "wall_time_s",
)  # fmt: skip


class TuneError(DPFitError):
    """A --tune run asked for something the selection does not cover."""


@dataclass(frozen=True)
class Candidate:
    """One grid point and what its run spends (public: a function of the grid and n)."""

    lr: float
    epochs: int
    steps: int  # private steps, head-first included
    noise_multiplier: float = math.nan

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class TunePlan:
    """The grid with each point's noise, and the selection it is accounted as."""

    grid: tuple[Candidate, ...]
    sample_rate: float
    delta: float
    runs: RunCount
    score_noise: float
    target_epsilon: float
    unit: str = "example"  # "user": split, score and sampling count users

    @property
    def reference(self) -> Candidate:
        return max(self.grid, key=lambda c: c.steps)

    def candidate_event(self, c: Candidate | None = None) -> dpa.DpEvent:
        """One candidate: its training steps, then its noisy score (composed)."""
        c = c or self.reference
        train = dp_sgd_event(c.noise_multiplier, self.sample_rate, c.steps)
        return dpa.ComposedDpEvent([train, dpa.GaussianDpEvent(self.score_noise)])

    def event(self) -> dpa.DpEvent:
        return selection_event(self.candidate_event(), self.runs.mean_runs, self.runs.shape)

    def epsilon(self) -> float:
        return epsilon_of(self.event(), self.delta, "rdp")

    def record(self) -> dict:
        """What metrics.json says about the tuning: all public (the grid, K's distribution,
        the split and the score's noise), nothing about which runs were drawn."""
        return {
            "method": "Papernot & Steinke random stopping (RepeatAndSelect, RDP)",
            "grid": [c.as_dict() for c in self.grid],
            "lr_factors": list(LR_FACTORS),
            "epoch_factors": list(EPOCH_FACTORS),
            "runs": self.runs.describe(),
            "mean_runs": self.runs.mean_runs,
            "runs_shape": self.runs.shape,
            "validation_fraction": VALIDATION_FRACTION,
            "validation_split": (
                f"by user: keyed hash of the user id, purpose {VALIDATION!r}"
                if self.unit == "user"
                else f"{SPLIT_RULE}, purpose {VALIDATION!r}"
            ),
            "score": (
                "sum over validation users of the fraction of their rows right"
                if self.unit == "user"
                else "correct validation texts"
            )
            + f" + N(0, {self.score_noise:g}^2)",
            "score_noise": self.score_noise,
            "epsilon_one_candidate": epsilon_of(self.candidate_event(), self.delta, "rdp"),
            "epsilon": self.epsilon(),
            "released": (
                "the selected run's model, learning rate and epochs (covered by the "
                "selection's bound); not K, the other runs or any score"
            ),
        }


def grid(lr: float, epochs: int) -> list[tuple[float, int]]:
    """(lr, epochs) around the base: LR_FACTORS x EPOCH_FACTORS, duplicates dropped."""
    points: list[tuple[float, int]] = []
    for e in EPOCH_FACTORS:
        for f in LR_FACTORS:
            p = (lr * f, max(1, round(epochs * e)))
            if p not in points:
                points.append(p)
    return points


def plan(
    points: Sequence[tuple[float, int]], head_steps: int, steps_per_epoch: int,
    sample_rate: float, target_epsilon: float, delta: float,
    runs: RunCount = DEFAULT_RUNS, score_noise: float = SCORE_NOISE, unit: str = "example",
) -> TunePlan:  # fmt: skip
    """Noise multipliers for every grid point so that the whole selection meets the target."""
    bare = tuple(Candidate(lr, e, head_steps + e * steps_per_epoch) for lr, e in points)
    longest = max(c.steps for c in bare)
    draft = TunePlan(bare, sample_rate, delta, runs, score_noise, target_epsilon, unit)

    def whole(z: float) -> dpa.DpEvent:
        ref = dataclasses.replace(draft.reference, noise_multiplier=z)
        return selection_event(draft.candidate_event(ref), runs.mean_runs, runs.shape)

    try:
        z = calibrate(whole, target_epsilon, delta, "rdp", upper=1e4, tolerance=1e-4)
    except InfeasibleTargetError as e:
        raise TuneError(
            f"--tune cannot meet epsilon {target_epsilon}: {e}. Raise --epsilon or drop --tune"
        ) from e
    ref_train = dp_sgd_event(z, sample_rate, longest)
    sigmas: dict[int, float] = {longest: z}
    for steps in sorted({c.steps for c in bare} - {longest}):
        sigmas[steps] = dominating_multiplier(
            lambda s, steps=steps: dp_sgd_event(s, sample_rate, steps), ref_train, upper=z
        )
    done = tuple(dataclasses.replace(c, noise_multiplier=sigmas[c.steps]) for c in bare)
    return dataclasses.replace(draft, grid=done)


def split_validation(train: LabeledTexts, seed: int) -> tuple[LabeledTexts, LabeledTexts]:
    """(fit, validation): a row is validation iff its own keyed hash (purpose VALIDATION,
    independent of the test hold-out's) is below VALIDATION_FRACTION."""
    held = held_out_mask(train.row_keys(seed, VALIDATION), VALIDATION_FRACTION)

    def pick(keep: bool, tag: str) -> LabeledTexts:
        idx = [i for i in range(len(train)) if bool(held[i]) == keep]
        return LabeledTexts(
            tuple(train.texts[i] for i in idx), tuple(train.labels[i] for i in idx),
            train.label_names, f"{train.source} ({tag})",
        )  # fmt: skip

    return pick(False, "tuning: fit part"), pick(True, "tuning: validation part")


def split_validation_users(
    train: LabeledTexts, users: Sequence[str], seed: int
) -> tuple[UserTexts, UserTexts]:
    """(fit, validation) by user: a user is validation iff the keyed hash of their id
    (purpose VALIDATION, independent of the test hold-out's) is below VALIDATION_FRACTION,
    with all their rows."""
    return UserTexts(train, tuple(users)).split(VALIDATION_FRACTION, seed, VALIDATION)


def user_score(preds: Sequence[int], labels: Sequence[int], users: Sequence[Hashable]) -> float:
    """Sum over users of the fraction of their rows predicted right (each row its own user:
    the count right). Each user adds a number in [0, 1], so adding or removing one user
    (with all their rows) moves it by at most 1."""
    right: dict[Hashable, list[bool]] = {}
    for p, y, u in zip(preds, labels, users, strict=True):
        right.setdefault(u, []).append(p == y)
    return float(sum(sum(r) / len(r) for r in right.values()))


def blur_note(noise: float, validation: int, unit: str) -> str | None:
    """A warning when the score's noise hides differences of more than BLUR_WARNING of
    accuracy (too few validation units for the selection to see which candidate is better)."""
    blur = noise / validation  # one noise std, as a share of accuracy
    if blur <= BLUR_WARNING:
        return None
    return (
        f"--tune: the score's noise (std {noise:g}) is {blur:.0%} of accuracy on {validation} "
        f"validation {unit}s, so candidates closer than that are told apart by chance: with "
        f"this few {unit}s the choice is close to random, and the untuned run is likely the "
        "better one (docs/train.md)"
    )


def noisy_score(correct: float, noise: float, rng) -> float:
    """The count of correct validation texts plus N(0, noise^2): one text added or removed
    moves the count by at most 1, so this is the Gaussian mechanism at multiplier `noise`."""
    return float(correct) + float(rng.normal(0.0, noise))


def check_tunable(config: TrainConfig) -> None:
    """What the selection's accounting covers, refused before any data is read."""
    refuse = [
        (config.non_private, "--non-private (a non-private run needs no private selection)"),
        (config.noise_multiplier is not None, "--noise-multiplier (give --epsilon: the "
         "multipliers are solved so the whole selection meets it)"),
        (config.task != "classification", f"--task {config.task} (text classification only)"),
        (config.accountant != "rdp", "--accountant pld (the selection's bound is RDP)"),
        (config.neighbouring != "add-remove", "--neighbouring replace-one (dp-accounting "
         "bounds the selection under RDP, add-or-remove only)"),
        (bool(config.checkpoint_dir) or config.resume, "--checkpoint-dir / --resume (a "
         "restarted selection would draw K again and spend again)"),
        (config.max_steps is not None, "--max-steps"),
        (config.stride is not None or config.privacy_unit not in ("window", "user"),
         "--stride / --privacy-unit document (long texts are not scored per text here yet)"),
        (config.full_epochs > 0, "--full-epochs"),
    ]  # fmt: skip
    bad = [what for cond, what in refuse if cond]
    if bad:
        raise TuneError(f"--tune does not support {'; '.join(bad)}: drop them or drop --tune")


def _subset(
    prep: Prepared, model, train: LabeledTexts, test: LabeledTexts, task, config,
    users: Sequence[str] | None = None,
) -> Prepared:  # fmt: skip
    """`prep` on other training and evaluation rows; under the user unit regrouped by user
    (n counts the users of `train`)."""
    data = prep.state["data"]
    state = {k: v for k, v in prep.state.items() if k not in ("groups", "unit")}
    state["data"] = dataclasses.replace(data, train=train, test=test, users=users)
    out = dataclasses.replace(prep, model=model, n=len(train), notes=[], state=state)
    if users is not None:
        task._group_users(out, config, users)
        out.notes = []
    return out


def _check_spent(privacy: dict, c: Candidate, q: float) -> None:
    """The candidate's ledger is what the plan accounted for: its multiplier and rate, at
    most its steps (a mismatch is a bug; nothing of the run is released)."""
    records = privacy["history"]
    steps = sum(int(r["count"]) for r in records)
    ok = all(
        r.get("sampling", "poisson") == "poisson"
        and r["noise_multiplier"] == c.noise_multiplier
        and math.isclose(r["sample_rate"], q, rel_tol=1e-12)
        for r in records
    )
    if not ok or steps > c.steps:
        raise SelectionError(
            f"a candidate run spent {records}, not the planned {c.steps} steps at "
            f"z={c.noise_multiplier}, q={q}: nothing released"
        )


def tune(
    config: TrainConfig,
    on_step: Callable[[StepRow, int], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    *,
    runs: RunCount = DEFAULT_RUNS,
) -> TrainResult:
    """Private selection of lr and epochs, then the selected run's outputs; see module doc.

    ``on_step`` is not called (the candidates' steps would reveal K); ``on_note`` gets the
    released notes and, for the operator's console only, one line per candidate run.
    """
    from dpfit.train import train

    notes: list[str] = []

    def note(msg: str, released: bool = True) -> None:
        if released:
            notes.append(msg)
        logger.info(msg)
        if on_note is not None:
            on_note(msg)

    check_tunable(config)
    if config.epsilon is None:
        raise TuneError("--tune needs a target --epsilon")
    check_paths(config)
    device = device_for(config.device)
    seed_everything(config.seed)
    task = get_task(config.task)
    full = task.prepare(config)
    for n_ in full.notes:
        note(n_)
    data = full.state["data"]
    fit_users = val_users = None  # the row unit
    if data.users is None:
        fit, val = split_validation(data.train, config.seed)
        sizes, unit = (len(fit), len(val)), "row"
    else:
        fit_u, val_u = split_validation_users(data.train, data.users, config.seed)
        fit, val, fit_users, val_users = fit_u.rows, val_u.rows, fit_u.users, val_u.users
        sizes, unit = (len(fit_u), len(val_u)), "user"
    if not all(sizes):
        raise TuneError(
            f"--tune: no training {unit} fell on the "
            f"{'validation' if not sizes[1] else 'fit'} side of the "
            f"{VALIDATION_FRACTION:.0%} validation split; add {unit}s or drop --tune"
        )
    delta = config.delta if config.delta is not None else default_delta(full.n)
    base = dataclasses.replace(config, delta=delta, output=None)
    pristine = copy.deepcopy(full.model)
    setup = prepare(
        base, task, _subset(full, copy.deepcopy(pristine), fit, val, task, config, fit_users),
        device, lambda m: None, "flags",
    )  # fmt: skip
    resolved = setup.config
    per_epoch = setup.total_steps // resolved.epochs
    q = setup.batch_size / setup.n
    points = grid(resolved.lr, resolved.epochs)
    the_plan = plan(
        points, setup.head_steps, per_epoch, q, config.epsilon, delta, runs,
        unit="user" if fit_users is not None else "example",
    )  # fmt: skip
    epsilon = the_plan.epsilon()
    if epsilon > config.epsilon:  # calibrate returns a multiplier that meets it
        raise SelectionError(f"planned epsilon {epsilon} exceeds the target {config.epsilon}")
    note(
        f"--tune: {len(points)} grid points (lr x {{1/3, 1, 3}}, epochs x {{1/2, 1, 2}} of "
        f"lr {resolved.lr:g}, {resolved.epochs} epochs); {sizes[1]} of {sum(sizes)} "
        f"training {unit}s held for validation by {unit} hash; K ~ {runs.describe()}; whole "
        f"selection epsilon {epsilon:.4g} at delta {delta:.3g}"
    )
    blurred = blur_note(the_plan.score_noise, sizes[1], unit)
    if blurred:
        note(blurred)
    fixed = {
        f: getattr(resolved, f) for f in TrainConfig.RECIPE_FIELDS if f not in ("lr", "epochs")
    }
    fixed["dropout"] = None  # the model was built with it; a prepared model keeps its own
    rng = selection_rng(insecure_seed(config, offset=0x7E))
    no_rows = dataclasses.replace(val, texts=(), labels=())

    def run_candidate(c: Candidate, i: int) -> tuple[float, TrainResult]:
        note(f"tuning: candidate run {i + 1} (lr {c.lr:g}, {c.epochs} epochs)", released=False)
        cand = dataclasses.replace(
            base, **fixed, lr=c.lr, epochs=c.epochs, noise_multiplier=c.noise_multiplier
        )
        # trained with no evaluation rows, so the validation rows are read once, here
        prep = _subset(full, copy.deepcopy(pristine), fit, no_rows, task, config, fit_users)
        result = train(cand, prepared=prep, task=task, set_by="--tune")
        _check_spent(result.privacy, c, q)
        preds = predict(
            result.model, prep.tokenizer, val, cand.max_length, cand.eval_batch_size, device
        )  # fmt: skip
        right = user_score(preds, val.labels, val_users or range(len(val)))
        score = noisy_score(right, the_plan.score_noise, rng)
        # the validation scores (and a probe's or a trained start's) are private: only
        # what does not read the validation rows is kept
        result.metrics = {k: result.metrics[k] for k in KEPT if k in result.metrics}
        result.notes = []
        return score, (cand, result)

    best = select_best(the_plan.grid, run_candidate, runs, rng)
    cand, result = best.output
    final = _subset(full, result.model, fit, data.test, task, config, fit_users)
    return _release(config, cand, result, final, task, device, the_plan, notes)


def _release(
    config, cand, result, final: Prepared, task, device, the_plan: TunePlan, notes
) -> TrainResult:
    """The selected run scored on the test split as an untuned run is, and its outputs: the
    epsilon of the whole selection everywhere one is reported. `final`: the fit part, with
    the test split to score on."""
    released = dataclasses.replace(cand, output=config.output)
    scores = task.evaluate(final, result.model, released, device)
    epsilon = the_plan.epsilon()
    tuning = the_plan.record()
    privacy = dict(result.privacy)
    privacy.update(
        epsilon=epsilon, epsilon_add_remove=epsilon, epsilon_replace_one=None,
        accountant="rdp", tuning=tuning,
    )  # fmt: skip
    metrics = {
        "task": config.task,
        **scores,
        "private": True,
        "epsilon": epsilon,
        "delta": the_plan.delta,
        "neighbouring": "add-remove",
        "epsilon_add_remove": epsilon,
        "epsilon_replace_one": None,  # dp-accounting bounds the selection for add/remove only
        "noise_multiplier": privacy["noise_multiplier"],
        "sample_rate": privacy["sample_rate"],
        "max_grad_norm": cand.max_grad_norm,
        "clipping": cand.clipping,
        "steps": len(result.steps),  # the main phase's, as an untuned run counts them
        "epochs": cand.epochs,
        "batch_size": cand.batch_size,
        "lr": cand.lr,
        "lr_schedule": cand.lr_schedule,
        "max_length": cand.max_length,
        "mode": cand.mode,
        "privacy_unit": final.privacy_unit if final.privacy_unit == "user" else "example",
        "insecure_seed": bool(config.insecure_reproducible_noise),
        "tuning": tuning,
        "train_examples": final.n,  # the fit part's users under the user unit
        **result.metrics,  # KEPT; train_time_s, wall_time_s: the selected run's own (the
        # whole tuning's would reveal K)
        "overridden_by_flags": list(config.overrides()),
        "config": dataclasses.asdict(released) | {"tune": True},
    }
    result.metrics = metrics
    result.privacy = privacy
    result.notes = list(notes)
    rows = [dataclasses.replace(r, epsilon=math.nan) for r in result.steps]
    result.steps = rows  # per-step epsilons of one candidate would understate the whole
    if config.output:
        result.output_dir = save_outputs(result, released, task, final, [])
    return result
