"""The training run behind ``dpfit train``: resolve -> prepare -> private phases -> release.

One function, :func:`train`, with one frozen :class:`TrainConfig`, so the CLI, the benchmarks
and a user's script run exactly the same code, for every task (:mod:`dpfit.tasks`: the task
supplies data, model and head, loss and metric). Every default comes from
:func:`dpfit.recipe.resolve_recipe`, a function of public quantities only. The private and
non-private runs share the loop; only the stepper differs (the PrivacyEngine with Poisson
sampling, or a plain optimizer over shuffled fixed-size batches), which is what makes their
comparison meaningful.

This module conducts the stages in :mod:`dpfit.run`, one module each:

- :mod:`dpfit.run.resolve`: options and paths checked before any data is read
- :mod:`dpfit.run.prepare`: data and model through the task, what trains, the recipe
- :mod:`dpfit.run.loop` (with :mod:`~dpfit.run.head_first` and :mod:`~dpfit.run.main_phase`):
  the head-first phase, then full and/or bias steps, one ledger, checkpoints, the guard that
  keeps the record of what was spent whatever stops the run
- :mod:`dpfit.run.release`: what leaves the process (outputs, a stopped run's record), and
  the one rule for it (older checkpoints claimed as continued)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from dpfit.reporting import StepRow
from dpfit.run.config import (  # noqa: F401 - the run's public names live here too
    CLIPPING,
    MODES,
    OPTIMIZERS,
    TASKS,
    WINDOWED_TASKS,
    TrainConfig,
    TrainResult,
)
from dpfit.run.head_first import frozen_features  # noqa: F401 - re-exported for benchmarks
from dpfit.run.loop import Phases
from dpfit.run.oom import PhysicalBatchMemoryError  # noqa: F401 - re-exported
from dpfit.run.plain import PlainStepper, ShuffledBatches  # noqa: F401 - re-exported
from dpfit.run.prepare import prepare
from dpfit.run.release import OutputError, finish, save_model, save_outputs  # noqa: F401
from dpfit.run.resolve import check_options, check_paths, device_for, seed_everything
from dpfit.tasks import Prepared, Task, get_task
from dpfit.tasks.classification import (  # noqa: F401 - re-exported for scripts and benchmarks
    MIN_PUBLIC_LABEL_COUNT,
    EvalResult,
    PreparedData,
    RareLabelError,
    encode,
    evaluate,
    make_collate,
    prepare_data,
)

logger = logging.getLogger(__name__)


def train(
    config: TrainConfig,
    on_step: Callable[[StepRow, int], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    *,
    prepared: Prepared | None = None,
    task: Task | None = None,
    set_by: str = "flags",
) -> TrainResult:
    """Run one training job as configured; see module docstring.

    Args:
        on_step: called after every logical step with (row, total logical steps).
        on_note: called with human-readable notes (recipe, subsampling, split, resume).
        prepared, task: a task and its already built model and data (Python callers that
            hold a model object); by default the task named in `config` prepares them.
        set_by: who set the recipe fields `config` sets, for the recipe note (a program
            such as ``dpfit pretrain`` fills them from its own rule, not from flags).
    """
    t_start = time.perf_counter()
    notes: list[str] = []

    def note(msg: str) -> None:
        notes.append(msg)
        logger.info(msg)
        if on_note is not None:
            on_note(msg)

    check_options(config)  # resolve: before any data is read
    resume_path = check_paths(config)
    if config.insecure_reproducible_noise and not config.non_private:
        msg = (
            f"WARNING: --insecure-reproducible-noise: the DP noise and the Poisson sampling are "
            f"seeded from --seed {config.seed}. Anyone who knows the seed can regenerate every "
            "noise vector and batch, so the run is NOT private against them (metrics.json "
            'records "insecure_seed": true). Use it only to debug or reproduce a run.'
        )
        logger.warning(msg)
        note(msg)
    device = device_for(config.device)
    seed_everything(config.seed)
    task = task if task is not None else get_task(config.task)
    setup = prepare(config, task, prepared, device, note, set_by)  # data, model, recipe
    phases = Phases(setup, note, on_step, t_start)
    phases.start(resume_path)  # head-first, the main phase's engine, or the resumed state
    phases.train()
    try:
        return finish(setup, phases, notes, t_start)  # release
    except KeyboardInterrupt as e:  # in the final evaluation, say: keep the record
        phases.aborted(e, phases.engine)
        raise


def train_causal_lm(model, tokenizer, lines: Sequence[str], config, task=None) -> TrainResult:
    """DP-BiTFiT-Add on `lines` for a causal LM object in memory, through :func:`train`.

    `config` is a :class:`TrainConfig` with task "causal-lm".
    """
    from dpfit.tasks.causal_lm import CausalLMTask

    task = task or CausalLMTask()
    return train(config, prepared=task.prepare_from(model, tokenizer, lines, config), task=task)
