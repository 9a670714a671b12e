"""The training recipe: every default of a run from what is public before it starts.

Why a module of its own: defaults tuned on one data set do not transfer, and defaults read
off the private data leak it. :func:`resolve_recipe` is a pure function of public quantities
only (the number of training examples n, the number of classes, epsilon, delta, the model's
size, the training mode): no text, label or length of the training data enters it, so the
recipe itself reveals nothing beyond n. Every value can still be overridden by a flag.

The rule for private runs follows the DP fine-tuning literature:

* **Large logical batches.** Li et al. 2022 ("Large language models can be strong
  differentially private learners") and De et al. 2022 show that the signal-to-noise ratio
  of a DP-SGD step grows with the batch: the noise std on the *mean* gradient is
  sigma R / B while sigma grows only slowly with the sampling rate. We take
  B = BATCH_PER_SQRT_N * sqrt(n) (1,000 for n = 10,000), at most n / MIN_STEPS_PER_EPOCH and
  at least MIN_BATCH. The cap keeps CPU cost at a few passes on small data: at n = 1,000,
  B = n/10 with 3 epochs has about the same sigma/B as B = 316 with 13 epochs, for a quarter
  of the compute (the utility suite's recipe search, benchmarks/results/archive/recipe_search.md).
* **Enough steps, few epochs.** Epochs are the fewest that give MIN_STEPS logical steps,
  between MIN_EPOCHS and MAX_EPOCHS: each extra epoch raises sigma (about as sqrt(epochs)),
  so more passes only pay while there are too few steps to converge.
* **Head first.** A private linear probe on frozen pooled features (one backbone pass) comes
  within about a point of the non-private probe at n = 10k even at epsilon 1, where a
  zero-initialised head inside DP-BiTFiT moves too slowly at the bias learning rate; so
  private classification starts with HEAD_FIRST_EPOCH_FRACTION of the epochs on the head
  alone (lr HEAD_FIRST_LR), under the same budget.
* **Automatic clipping** (Bu et al., R / (||g|| + gamma)): every example contributes a
  gradient of norm about R, so there is no per-task clip norm to tune; with Adam the scale R
  cancels, R = 1.
* **Learning rate by what trains.** Bias terms and a zero-initialised head need a large step
  (Bu et al. BiTFiT: 5e-3 with Adam); all weights a small one (Li et al.: 5e-4).
* **Dropout off** (PRIVATE_DROPOUT, transformers text models): DP noise already regularises
  and a dropout mask adds its own variance to every clipped gradient; on the suite's three
  tasks (3 seeds, eps 8) the runs without it were level with those with the model's 0.1,
  and on CPU the masks' draws cost a large share of a bf16 step
  (benchmarks/results/dropout.md).
* **Max length** is a fixed default (no length statistic of the private data is used);
  examples are sorted by length into physical batches, so short texts pay only for their
  own length.

Non-private reference runs use what a practitioner would use without privacy: shuffled
batches of 32, 3 epochs (more on small data sets, for at least 250 steps), lr 1e-3 for
bias-only + head and 5e-5 for all weights. 1e-3 is the top of BiTFiT's own non-private grid
(Ben Zaken et al. 2022: 1e-4 to 1e-3) and the usual smaller fine-tuning step of LP-FT; at
5e-3, 3 epochs of batch 32 pulled the features toward the training speakers and ended 3-5
points below the starting probe on convention-party, while 1e-3 ends level with it there
(mean of seeds) and as high as 5e-3 or higher on the other suite tasks (benchmarks/results/archive/recipe_variants.jsonl, adopted into
the suite). In every mode
they also start with the head alone (LP-FT, Kumar et al. 2022, "Fine-tuning can distort
pretrained features and underperform out-of-distribution"): NON_PRIVATE_HEAD_EPOCHS epochs of
the head on frozen features at NON_PRIVATE_HEAD_LR, which comes within about 2 points of a
cross-validated logistic regression on the same features on the three suite tasks
(benchmarks/results/utility.md, "probe phase alone"), so the bias phase starts from a probe
instead of a zero head that drags the features toward it; this matters most when the test
distribution shifts (held-out speakers, sources). In full mode it matters more still: from a
zero head at lr 5e-5, non-private full ended at 74.2 on text-source, below the frozen probe
(75.2), and at 82.8 with the head first (seed 0; on the other two suite tasks it moved by
about a point either way, 84.0 -> 82.9 and 65.4 -> 65.7). Where the shift is strong
(convention-party, new speakers) the private bias phase can still end below the probe it
starts from; the suite's table shows it.

**From a checkpoint already trained for the task** (``start="trained"``: a dpfit save whose
head has the data's classes, such as a ``dpfit pretrain`` checkpoint; known from the
checkpoint's own record, never from the private data) the rule above would undo what the
model already fits. Under DP noise Adam's second moment is the noise's, so every coordinate
steps by about lr per step whatever its signal, and over T steps the noise alone walks it
by about lr sqrt(T); the signal of a model that already fits its task is small, so that walk
is what the run risks. So from a trained start:

* no head-first phase (the head is trained; a probe at lr 0.1 would walk it away);
* each phase's rate is the one whose noise walk over that phase's T steps is a fixed small
  distance: lr = TRAINED_WALK[group] / sqrt(T), with a smaller distance for phases that
  train every weight (the full phase of X+BiTFiT, --mode full) than for biases + head.

In every start, a phase that trains every weight gets the full-mode rate and never the
biases' (X+BiTFiT's full epochs run at ``full_lr``, its bias epochs at ``lr``).

**Language modelling** (``num_classes`` 0, ``dpfit train --task causal-lm``) starts trained
in the same sense: there is no new head, the pretrained model's own LM head already predicts
the next token, and DP-BiTFiT-Add only adds zero biases to a model that fits its task. So
its rate follows the trained start's rule, lr = LM_WALK[mode] / sqrt(T) (its own distances,
measured on language models), not the fresh backbone's 5e-3. At 5e-3, Adam moved every added bias of SmolLM2-135M by about 5e-3 per
step and held-out perplexity rose, at epsilon 8 and with the noise off; 1e-4 to 1e-3
lowered it without noise, and a little at epsilon 8 (256-token windows, 12 steps:
benchmarks/results/causal_lm_lr.md). The rule gives about 5e-4 for 30 steps.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

DEFAULT_DELTA = 1e-5

# -- the constants of the private rule (see the module docstring) ----------------------------
BATCH_PER_SQRT_N = 10.0
MIN_BATCH = 64  # (or n/4 on tiny data)
MIN_STEPS_PER_EPOCH = 10  # B <= n/10: a pass costs the same, sigma/B is about the same
MIN_STEPS = 30
MIN_EPOCHS = 3
MAX_EPOCHS = 20
PRIVATE_LR = {"bias": 5e-3, "full": 5e-4}
# LoRA modes: the biases' rate for adapters, biases and head. peft starts
# lora_B at zero, so at the same rate bias+lora's first steps are bias mode's plus the
# adapters: the two modes then differ only in what trains. Not tuned on the suite (items 2-3
# own the rule); --lr overrides it.
PRIVATE_LR.update({"bias+lora": PRIVATE_LR["bias"], "lora": PRIVATE_LR["bias"]})
PRIVATE_CLIPPING = "automatic"
PRIVATE_MAX_GRAD_NORM = 1.0
# head-first: epochs of the private linear probe on frozen features, as a fraction of the
# bias epochs (rounded, at least 1): as many as the bias phase, the probe setting measured
# (3 epochs at B = n/10). Cheap in time (no backbone pass per step) but not free in
# privacy: its steps share the budget.
HEAD_FIRST_EPOCH_FRACTION = 1.0
# A linear probe on fixed features takes a much larger step than biases inside the network:
# under DP noise with automatic clipping and Adam, lr 0.1 reaches the non-private probe's
# accuracy in 3 epochs where 0.01 is still near the majority class
# (benchmarks/results/archive/dp_probe.jsonl of the utility suite).
HEAD_FIRST_LR = 0.1
# Classification starts with the head-first phase unless told otherwise (every mode).
HEAD_FIRST_BY_DEFAULT = True
# -- non-private reference ---------------------------------------------------------------------
NON_PRIVATE_BATCH = 32
NON_PRIVATE_MIN_EPOCHS = 3
NON_PRIVATE_MIN_STEPS = 250  # small data sets get more passes (at most MAX_EPOCHS)
NON_PRIVATE_LR = {"bias": 1e-3, "full": 5e-5}
NON_PRIVATE_LR.update({"bias+lora": NON_PRIVATE_LR["bias"], "lora": NON_PRIVATE_LR["bias"]})
NON_PRIVATE_HEAD_EPOCHS = 3  # LP-FT: the head alone first (classification, any mode)
NON_PRIVATE_HEAD_LR = 1e-2  # AdamW on frozen features, batch 32
# -- from a checkpoint trained for the task (start="trained"; see the module docstring) --------
# the noise walk lr sqrt(T) allowed per coordinate over a phase, for phases that train every
# weight and (ten times that) for biases + head: the rule's first constants (1e-3, 1e-2)
# divided by 100. Chosen on validation splits only (never test), 3 seeds, three image tasks
# from public checkpoints (benchmarks/results/checkpoint_recipe.md): the largest of
# (1e-3, 1e-2) / k, k = 3, 10, 30, 100, 300, whose mean end - start was >= -(seed sd of the
# end) on every task and row (tests/benchmarks/test_checkpoint_recipe.py holds the constant
# to that choice). Each larger walk ended below its start on some FashionMNIST row, at 5,000
# private images alike in every seed (a batch of 500 leaves little noise: the clipped mean
# gradient itself moves the model away). The cost: a private run barely moves from its
# start, and the gains larger walks gave on digits are given up; that is the honest result
# when a few hundred private images at eps 8 cannot improve a strong checkpoint. --lr and
# --full-lr take a larger step, at the risk measured there.
TRAINED_WALK = {"full": 1e-3 / 100, "bias": 1e-2 / 100}
TRAINED_WALK.update({"bias+lora": TRAINED_WALK["bias"], "lora": TRAINED_WALK["bias"]})
# Language modelling (num_classes 0) takes the same walk rule with its own constants, the
# distances its rate check ran with (benchmarks/results/causal_lm_lr.md); TRAINED_WALK was
# chosen on image checkpoints alone and does not move them.
LM_WALK = {"full": 3e-4, "bias": 3e-3}
LM_WALK.update({"bias+lora": LM_WALK["bias"], "lora": LM_WALK["bias"]})
STARTS = ("pretrained", "trained")  # a backbone not yet trained for the task / one that is
# Private runs train with the model's dropout off (dpfit.dropout sets its config's rates): DP
# noise already regularises, a dropout mask adds its own variance to every clipped gradient,
# and on CPU its random draws took 23% (length 28) to 35% (length 128) of a bf16 DP-BiTFiT
# step on 2 threads (benchmarks/results/dropout.md, which also holds the utility check behind
# this choice).
# Non-private reference runs keep the model's own rates ("model").
PRIVATE_DROPOUT = 0.0
# Private bias+lora runs train lora_B only, each lora_A frozen at its random init (FFA-LoRA,
# dpfit.params.make_lora_trainable): by the criterion fixed before the runs (docs/bias_lora.md),
# on the suite's three tasks it was at or above DP-BiTFiT on every task and above bias+LoRA
# with both matrices trained on average (benchmarks/results/utility_bf16_dropout0.md), with
# half the adapters' noised coordinates. LoRA-only (--mode lora) and non-private runs train both.
PRIVATE_LORA_FREEZE_A = True
# The same for a causal LM (num_classes 0), chosen on its own by a criterion fixed before the
# runs: FFA's held-out perplexity of the bundled SmolLM2 at or below that of both matrices
# trained, paired by seed over 3 seeds (benchmarks/results/causal_lm_ffa.md). It was not
# (+0.003, 95% t [-0.57, +0.57]: level), so a private causal-LM bias+lora run trains both.
PRIVATE_LM_LORA_FREEZE_A = False
# -- compute only (no effect on the result or the guarantee) -----------------------------------
MAX_LENGTH = 128
PHYSICAL_TOKENS = 8192  # tokens per physical batch at max length for a ~20M-parameter model


@dataclass(frozen=True)
class Recipe:
    """The resolved defaults of one run; see :func:`resolve_recipe`."""

    batch_size: int  # logical; the expected batch under Poisson sampling when private
    epochs: int
    lr: float  # the main phase's rate (bias mode: biases + head; full mode: every weight)
    max_grad_norm: float | None  # None: non-private (no clipping)
    clipping: str | None
    max_length: int | None  # None: inputs without a token length (images)
    physical_batch_size: int
    optimizer: str = "adamw"
    head_epochs: int = 0  # head-first phase (private linear probe), 0 = off
    head_lr: float = HEAD_FIRST_LR  # its learning rate
    rule: str = ""
    full_epochs: int = 0  # X+BiTFiT: epochs that train every weight, before the bias phase
    full_lr: float | None = None  # their rate (never the biases'); None without that phase
    mode: str = "bias"
    start: str = "pretrained"  # "trained": a checkpoint already trained for the task
    language_model: bool = False  # no new head: the LM's own head does the task (walk rule)
    dropout: float | str = "model"  # the backbone's dropout rate; "model": its own rates
    lora_freeze_a: bool = False  # LoRA modes: lora_A frozen, lora_B trains (FFA-LoRA)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line for the run's notes: only what applies to this run (its phases in order,
        no max length for inputs without one)."""
        parts = [f"logical batch {self.batch_size}", f"{self.epochs} epochs"]
        if self.clipping is not None:
            parts.append(f"{self.clipping} clipping, R={self.max_grad_norm:g}")
        if self.max_length is not None:
            parts.append(f"max length {self.max_length}")
        if self.dropout != "model":
            parts.append("dropout off" if self.dropout == 0 else f"dropout {self.dropout:g}")
        if self.start == "trained" and self.clipping is not None:
            parts.append(
                "from a checkpoint trained for the task: lr = noise walk / sqrt(phase steps)"
                + ("" if self.head_epochs else ", no head-first (the head is trained)")
            )
        elif self.start == "trained":
            parts.append("from a checkpoint trained for the task: no head-first")
        elif self.language_model and self.clipping is not None:
            parts.append(
                "a pretrained language model already does its task: lr = noise walk / sqrt(steps)"
            )
        phases = []
        if self.head_epochs:
            phases.append(f"head-first {self.head_epochs} epochs at lr {self.head_lr:.3g}")
        main = self.epochs
        if self.full_epochs and self.full_lr is not None:
            plural = "s" if self.full_epochs > 1 else ""
            phases.append(f"{self.full_epochs} full epoch{plural} at lr {self.full_lr:.3g}")
            main -= self.full_epochs
        what = "every weight" if self.mode == "full" else _TRAINS.get(self.mode, self.mode)
        if self.lora_freeze_a:
            what = what.replace("LoRA", "LoRA B (A frozen)")
        if phases:
            phases.append(f"{main} epochs of {what} at lr {self.lr:.3g}")
        else:
            phases.append(f"{what} at lr {self.lr:.3g}")
        parts.append(f"{' then '.join(phases)} ({self.optimizer})")
        return ", ".join(parts)


_TRAINS = {"bias": "biases + head", "bias+lora": "biases + LoRA + head", "lora": "LoRA + head"}


def default_delta(n: int) -> float:
    """delta = min(1e-5, 1/n^1.1): below 1/n for every n, so "release one example" is not
    within the guarantee; the same rule for every task."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return min(DEFAULT_DELTA, float(n) ** -1.1)


def physical_batch_for(model_params: int, max_length: int) -> int:
    """Examples per forward/backward: a fixed token budget scaled down for larger models."""
    scale = max(1.0, model_params / 20e6)
    return max(1, min(256, int(PHYSICAL_TOKENS / (max_length * scale))))


def default_dropout(private: bool, tokens: bool = True) -> float | str:
    """The backbone's dropout rate for a run (PRIVATE_DROPOUT): off in private runs of a
    transformers text model; the model's own rates without privacy, and for image models,
    whose dpfit builds have none."""
    return PRIVATE_DROPOUT if private and tokens else "model"


def default_lora_freeze_a(private: bool, mode: str, language_model: bool = False) -> bool:
    """Whether a run's lora_A stay frozen (PRIVATE_LORA_FREEZE_A, PRIVATE_LM_LORA_FREEZE_A for a
    language model): in private bias+lora runs, each task family by its own measurement."""
    rule = PRIVATE_LM_LORA_FREEZE_A if language_model else PRIVATE_LORA_FREEZE_A
    return rule and private and mode == "bias+lora"


def trained_lr(mode: str, steps: int, walks: dict[str, float] = TRAINED_WALK) -> float:
    """The rate from a trained checkpoint: the noise walk lr sqrt(T) over the phase's T steps
    held at walks[mode] (TRAINED_WALK, or LM_WALK for a language model; module docstring)."""
    return walks[mode] / math.sqrt(max(1, steps))


def resolve_recipe(
    n: int,
    num_classes: int,
    epsilon: float | None,
    delta: float | None,
    model_params: int,
    mode: str = "bias",
    *,
    private: bool = True,
    head_first: bool | None = None,
    start: str = "pretrained",
    full_epochs: int = 0,
    tokens: bool = True,
) -> Recipe:
    """Every default of a run from public quantities; pure (same inputs, same recipe).

    Args:
        n: training examples. num_classes: classes (0 for language modelling: the
            noise-walk rate, as from a trained start).
        epsilon, delta: the target (None with a fixed noise multiplier); they do not change
            the current rule but are part of its signature so that a rule that uses them
            stays a function of public inputs.
        model_params: total parameters of the model (compute sizing only).
        mode: "bias" (biases + head), "full", "bias+lora" or "lora".
        private: False for the non-private reference.
        head_first: add a linear-probe phase before the main phase; None: the default (on
            for classification in every mode from a pretrained backbone, off from a trained
            checkpoint; see HEAD_FIRST_BY_DEFAULT).
        start: "pretrained" (a backbone not trained for the task, or a new head) or
            "trained" (a checkpoint whose head already has the task's classes: smaller
            steps, no head-first; module docstring). Public: read from the checkpoint.
        full_epochs: X of X+BiTFiT (epochs that train every weight first; 0: none).
        tokens: False for inputs without a token length (images): no max length.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if mode not in PRIVATE_LR:
        raise ValueError(f"mode must be one of {sorted(PRIVATE_LR)}, got {mode!r}")
    if start not in STARTS:
        raise ValueError(f"start must be one of {STARTS}, got {start!r}")
    trained = start == "trained"
    language_model = num_classes == 0  # the model's own head does the task (docstring)
    if head_first is None:  # every mode: a zero head does not move at the backbone's lr
        head_first = HEAD_FIRST_BY_DEFAULT and num_classes >= 2 and not trained
    del epsilon, delta  # public, and (for now) not needed by the rule
    physical = physical_batch_for(model_params, MAX_LENGTH)
    max_length = MAX_LENGTH if tokens else None
    if not private:
        batch = min(NON_PRIVATE_BATCH, n)
        per_epoch = math.ceil(n / batch)
        epochs = min(
            MAX_EPOCHS, max(NON_PRIVATE_MIN_EPOCHS, math.ceil(NON_PRIVATE_MIN_STEPS / per_epoch))
        )
        return Recipe(
            batch_size=batch,
            epochs=epochs,
            lr=NON_PRIVATE_LR[mode],
            max_grad_norm=None,
            clipping=None,
            max_length=max_length,
            physical_batch_size=min(physical, batch),
            head_epochs=NON_PRIVATE_HEAD_EPOCHS if head_first else 0,
            head_lr=NON_PRIVATE_HEAD_LR,
            mode=mode,
            start=start,
            dropout=default_dropout(False, tokens),
            lora_freeze_a=default_lora_freeze_a(False, mode),
            rule=(
                f"non-private reference: batch {NON_PRIVATE_BATCH}, epochs for >= "
                f"{NON_PRIVATE_MIN_STEPS} steps in [{NON_PRIVATE_MIN_EPOCHS}, {MAX_EPOCHS}], "
                "lr by mode" + (", head first (LP-FT)" if head_first else "")
            ),
        )
    cap = max(1, n // MIN_STEPS_PER_EPOCH)
    floor = min(MIN_BATCH, max(1, n // 4))
    batch = min(n, max(floor, min(cap, round(BATCH_PER_SQRT_N * math.sqrt(n)))))
    steps_per_epoch = max(1, round(n / batch))
    epochs = min(MAX_EPOCHS, max(MIN_EPOCHS, math.ceil(MIN_STEPS / steps_per_epoch)))
    head_epochs = max(1, round(HEAD_FIRST_EPOCH_FRACTION * epochs)) if head_first else 0
    full_epochs = max(0, full_epochs)
    main_steps = max(1, epochs - full_epochs) * steps_per_epoch
    full_steps = full_epochs * steps_per_epoch
    if trained or language_model:
        walks = LM_WALK if language_model else TRAINED_WALK  # an LM keeps its own, trained or not
        lr = trained_lr(mode, main_steps, walks)
        full_lr = trained_lr("full", full_steps, walks) if full_epochs else None
        what = "from a trained checkpoint" if trained else "a pretrained language model:"
        how = (
            f"{what} lr = walk / sqrt(phase steps), walk "
            f"{walks['full']:g} for every weight, {walks[mode]:g} otherwise"
        )
    else:
        lr = PRIVATE_LR[mode]
        full_lr = PRIVATE_LR["full"] if full_epochs else None
        how = "lr by mode"
    return Recipe(
        batch_size=batch,
        epochs=epochs,
        lr=lr,
        max_grad_norm=PRIVATE_MAX_GRAD_NORM,
        clipping=PRIVATE_CLIPPING,
        max_length=max_length,
        physical_batch_size=min(physical, batch),
        head_epochs=head_epochs,
        full_epochs=full_epochs,
        full_lr=full_lr,
        mode=mode,
        start=start,
        language_model=language_model,
        dropout=default_dropout(True, tokens),
        lora_freeze_a=default_lora_freeze_a(True, mode, language_model),
        rule=(
            f"private: B = {BATCH_PER_SQRT_N:g} sqrt(n) (<= n/{MIN_STEPS_PER_EPOCH}), "
            f"epochs for >= {MIN_STEPS} steps in [{MIN_EPOCHS}, {MAX_EPOCHS}], "
            f"{PRIVATE_CLIPPING} clipping R={PRIVATE_MAX_GRAD_NORM:g}, {how}"
        ),
    )
