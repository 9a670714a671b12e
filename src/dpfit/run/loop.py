"""Stage 3, the private phases: head-first, then the main loop (full and/or bias), one ledger.

:class:`Phases` holds what changes while a run trains (the step rows, the epoch, the engine,
optimizer and loader, the continuation a resume claimed) and guards every stretch from the
first private step on: an error or Ctrl-C anywhere keeps the record of what was spent.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path

from dpfit import checkpoint as ckpt
from dpfit.distributed import is_main_process
from dpfit.dropout import MODEL as DROPOUT_MODEL
from dpfit.errors import BudgetExhaustedError
from dpfit.frozen_casts import FrozenWeightCasts
from dpfit.lr_schedules import lr_factor, set_lr
from dpfit.precision import autocast
from dpfit.reporting import StepRow
from dpfit.run.head_first import head_phase, score_before
from dpfit.run.main_phase import enter_bias_phase, main_setup
from dpfit.run.oom import oom_guard
from dpfit.run.prepare import Setup
from dpfit.run.release import claim_release, save_partial
from dpfit.run.resolve import resolve_sigma


class Phases:
    """The run from its first step to its last, for one :class:`Setup`."""

    def __init__(
        self, setup: Setup, note: Callable[[str], None],
        on_step: Callable[[StepRow, int], None] | None, t_start: float,
    ) -> None:  # fmt: skip
        self.s = setup
        self.note = note
        self.on_step = on_step
        self.t_start = t_start
        self.rows: list[StepRow] = []
        self.epoch = 0
        self.elapsed_before = 0.0
        self.wall_before = 0.0  # wall time of the run's earlier processes (a resumed run)
        self.engine = None
        self.head_engine = None  # the head-first phase's, while its ledger is the run's record
        self.head_scores: dict = {}
        self.head_epsilon: float | None = None  # spent by the head-first phase
        self.start_scores: dict = {}
        self.continuation: ckpt.Continuation | None = None
        self.first_step = 0  # head-first steps already on the ledger
        self.stopped = False
        self.train_time = 0.0
        self._acc_loss, self._acc_n = 0.0, 0

    # -- the guard ---------------------------------------------------------------------------
    def aborted(self, error: BaseException, spent) -> None:
        """The steps taken spent privacy: keep their record (and release what may be)."""
        c = self.s.config
        if spent is not None and spent.steps_taken and c.output and is_main_process():
            s = self.s
            save_partial(
                error, c, s.task, s.prep, s.model, spent, self.note, self.first_step,
                self.continuation,
            )  # fmt: skip

    # -- before the first step ---------------------------------------------------------------
    def start(self, resume_path: Path | None) -> None:
        """Score a trained start, run the head-first phase, build the main phase; resume."""
        s, c = self.s, self.s.config
        if s.prep.starts_trained:  # on resume too: the model is still the one loaded
            self.start_scores = score_before(
                s.task, s.prep, s.model, c, s.device, self.note,
                "the starting model, before training",
            )  # fmt: skip
        self.t_loop = time.perf_counter()
        # bf16 copies of the frozen weights, made once for the run: head-first and main steps
        self.frozen_casts = FrozenWeightCasts(s.model, c.precision, s.device)
        sigma = head_state = None
        if s.head_steps and not c.non_private:
            sigma = resolve_sigma(c, s.batch_size / s.n, s.head_steps + s.total_steps, s.delta)
        if s.head_steps and resume_path is None:
            with oom_guard(c):
                head_state, self.head_engine = head_phase(  # (None, None) when non-private
                    s.model, s.items, s.collate, c, s.n, s.delta, sigma or 0.0, s.head_steps,
                    s.device, self.note, on_abort=self.aborted, casts=self.frozen_casts,
                )  # fmt: skip
        try:  # from the head-first steps on, an error or Ctrl-C keeps the record of the spend
            self.engine, self.optimizer, self.loader, self.stepper, self.first_lr = main_setup(
                s.model, c, s.n, s.total_steps, s.delta, sigma, head_state, s.items, s.collate,
                s.batch_size, s.head_steps,
            )  # fmt: skip
        except BaseException as e:
            self.aborted(e, self.head_engine)
            raise
        if self.engine is not None and head_state is not None:
            self.head_epsilon = self.engine.epsilon()  # one ledger: the head steps composed in
        self.first_step = self.stepper.steps_taken
        if resume_path is not None:
            self.resume(resume_path)
            if s.head_steps and not self.rows and not self.head_scores:
                # stopped before the probe was scored: the model is still the probe
                self.head_scores = self._score_probe()
        if s.head_steps and resume_path is None:
            try:  # the head-first phase's ledger and head: a kill from here on can --resume
                self.save(0)
                self.head_scores = self._score_probe()
                self.save(0)  # with the probe's score, which a resumed run reports
            except BaseException as e:
                self.aborted(e, self.engine or self.head_engine)
                raise

    def _score_probe(self) -> dict:
        """The linear probe alone, before biases train: what the main phase adds over it."""
        s = self.s
        what = "head-first: the linear probe alone"
        return score_before(s.task, s.prep, s.model, s.config, s.device, self.note, what)

    def resume(self, path: Path) -> None:
        s, c = self.s, self.s.config
        state = ckpt.load_checkpoint(path)
        # fields older checkpoints lack, as those runs had them: the model's own dropout, and
        # every LoRA matrix trained
        saved = {"dropout": DROPOUT_MODEL, "lora_freeze_a": False, **state["config"]}
        ckpt.check_compatible(saved, c.fingerprint(), tuple(c.fingerprint()))
        ckpt.load_trainable_state(s.model, state["trainable"])
        if self.engine is not None and c.full_epochs and int(state["epoch"]) >= c.full_epochs:
            self.optimizer = enter_bias_phase(self.engine, self.optimizer, c.lr, self.note)
        self.optimizer.load_state_dict(state["optimizer"])
        self.stepper.load_state_dict(state["stepper"])
        self.loader.load_state_dict(state["loader"])
        ckpt.set_rng_state(state["rng"])
        self.rows = [StepRow(**r) for r in state["rows"]]
        self.epoch = int(state["epoch"])
        self.elapsed_before = float(state["elapsed_s"])
        self.first_step = int(state.get("first_step", 0))
        self.wall_before = float(state.get("wall_s", 0.0))
        self.head_scores = dict(state.get("head_scores") or {})  # the probe's row survives
        self.head_epsilon = state.get("head_epsilon")
        self.note(
            f"resumed from {path.name}: logical step {len(self.rows)}, epoch {self.epoch + 1}"
        )
        if self.engine is not None and len(self.rows) < s.total_steps and is_main_process():
            # fresh noise and batches from here on: a second continuation is a fork
            found = ckpt.list_checkpoints(c.checkpoint_dir)
            self.continuation = ckpt.claim_continuation(
                path, self.engine.steps_taken, c.allow_fork,
                at=len(self.rows), reach=ckpt.reach(c.checkpoint_dir, found),
            )  # fmt: skip
            if self.continuation.fork:
                self.note(
                    f"--fork: continuation {self.continuation.number} of {path.name}; "
                    "releasing the outputs of several continuations costs the shared steps "
                    "plus each continuation's own steps (metrics.json: continuation)"
                )

    # -- checkpoints and step rows -----------------------------------------------------------
    def save(self, epoch_now: int) -> None:
        c = self.s.config
        if not c.checkpoint_dir or not is_main_process():  # distributed: rank 0 writes
            return
        now = time.perf_counter()
        ckpt.save_checkpoint(
            c.checkpoint_dir,
            len(self.rows),  # logical steps of the main phase, as steps.csv counts them
            {
                "config": c.fingerprint(),
                "trainable": ckpt.trainable_state(self.s.model, everything=c.full_epochs > 0),
                "optimizer": self.optimizer.state_dict(),
                "stepper": self.stepper.state_dict(),
                "loader": self.loader.state_dict(),
                "rng": ckpt.rng_state(),
                "rows": [dataclasses.asdict(r) for r in self.rows],
                "epoch": epoch_now,
                "elapsed_s": self.elapsed_before + now - self.t_loop,
                "first_step": self.first_step,
                "wall_s": self.wall_before + now - self.t_start,
                "head_scores": self.head_scores,
                "head_epsilon": self.head_epsilon,
            },
        )

    def record(self, epoch_now: int) -> None:
        # Private runs keep no per-step loss or batch size: both are exact functions of the
        # private batch (see dpfit.reporting.PRIVATE_STEP_FIELDS).
        # Nor its duration, and each row's epsilon is the one after its own step: a noise-only
        # step is recorded with the next one, and must not look like it.
        c, rows, stepper = self.s.config, self.rows, self.stepper
        while len(rows) < stepper.steps_taken - self.first_step:
            current = len(rows) == stepper.steps_taken - self.first_step - 1
            loss = (
                self._acc_loss / self._acc_n
                if (c.non_private and current and self._acc_n)
                else None
            )
            done = self.first_step + len(rows) + 1  # ledger steps after this row's step
            elapsed = self.elapsed_before + time.perf_counter() - self.t_loop
            rows.append(
                StepRow(
                    step=len(rows) + 1,
                    epoch=epoch_now + 1,
                    epsilon=math.inf if self.engine is None else self.engine.epsilon(steps=done),
                    elapsed_s=elapsed if c.non_private else None,
                    loss=loss,
                )
            )
            if self.on_step is not None:
                self.on_step(rows[-1], self.s.total_steps)
        self._acc_loss, self._acc_n = 0.0, 0

    # -- the main loop -----------------------------------------------------------------------
    def train(self) -> None:
        """Step until the main phase's steps are done (or the budget is); then checkpoint the
        state the outputs release."""
        s, c = self.s, self.s.config
        self.stopped = len(self.rows) >= s.total_steps
        try:
            self._loop()
        except BudgetExhaustedError as e:
            self.note(f"stopped early: {e}")
        except BaseException as e:  # the steps taken spent privacy: keep their record
            self.aborted(e, self.engine)
            raise
        self.train_time = self.elapsed_before + time.perf_counter() - self.t_loop
        if self.engine is not None and c.checkpoint_dir and is_main_process():
            # the outputs release this state: checkpoint it first (so --resume continues
            # exactly what was released), claim the older checkpoints and log the release
            try:
                found = ckpt.list_checkpoints(c.checkpoint_dir)
                if not found or found[-1][0] != len(self.rows):
                    self.save(self.epoch)
                claim_release(c.checkpoint_dir, len(self.rows), "the run's outputs")
            except BaseException as e:
                self.aborted(e, self.engine)
                raise

    def _loop(self) -> None:
        s, c = self.s, self.s.config
        rows, stepper, engine = self.rows, self.stepper, self.engine
        while self.epoch < c.epochs and not self.stopped:
            if engine is not None and c.full_epochs and self.epoch >= c.full_epochs:
                self.optimizer = enter_bias_phase(engine, self.optimizer, c.lr, self.note)
            for batch in self.loader:
                weight = batch.pop("_weight", 1.0)
                batch = {k: v.to(s.device) for k, v in batch.items()}
                with oom_guard(c), self.frozen_casts.active():  # bf16 frozen weights
                    with autocast(c.precision, s.device):  # float32 masters, norms, noise
                        loss = s.task.loss(s.model, batch)
                    (loss * weight).backward()
                if c.non_private:
                    bsz = int(next(iter(batch.values())).shape[0])
                    self._acc_loss += float(loss.detach()) * bsz
                    self._acc_n += bsz
                if c.lr_schedule != "constant":  # this logical step's rate
                    base = self.first_lr if engine is not None and engine.mode == "full" else c.lr
                    factor = lr_factor(c.lr_schedule, len(rows), s.total_steps)
                    set_lr(self.optimizer, base * factor)
                if stepper.step(self.optimizer):
                    # empty Poisson batches are noise-only steps the engine takes on its own
                    self.record(self.epoch)
                    if len(rows) % c.checkpoint_every == 0 or len(rows) >= s.total_steps:
                        self.save(self.epoch)
                    if len(rows) >= s.total_steps:
                        self.stopped = True
                        break
            else:
                self.epoch += 1
                self.record(self.epoch - 1)  # trailing empty batches of the pass, if any
                if len(rows) >= s.total_steps:
                    self.stopped = True
