"""Stage 4, release: what leaves the process, and one rule for it.

A run's outputs (metrics.json first, then steps.csv, plots, the model) and the partial record
of a run stopped by an error or Ctrl-C. Every release claims the older checkpoints of the run
as continued (dpfit.checkpoint.claim_superseded), so that a later resume of one is a fork."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

from dpfit import checkpoint as ckpt
from dpfit import outputs
from dpfit.distributed import is_main_process
from dpfit.reporting import StepRow, peak_memory_mb, plot_steps, write_json, write_steps_csv
from dpfit.run.config import TrainConfig, TrainResult
from dpfit.run.trainables import merge_adapters
from dpfit.tasks import Prepared, Task

OutputError = outputs.OutputError

logger = logging.getLogger(__name__)


def epsilon_by_phase(
    config: TrainConfig, rows: list[StepRow], head_steps: int, head_epsilon: float | None
) -> list[dict]:
    """Epsilon spent by the end of each phase, in order (the last is the run's): shows how
    much of the budget the head-first or full phase took, which the plot marks."""
    phases = []
    if head_steps and head_epsilon is not None:
        phases.append({"phase": "head-first", "steps": head_steps, "epsilon_after": head_epsilon})
    main = [("main", rows)]
    if config.full_epochs:
        full = [r for r in rows if r.epoch <= config.full_epochs]
        main = [("full", full), ("bias", rows[len(full) :])]
    for name, part in main:
        if part:
            phases.append({"phase": name, "steps": len(part), "epsilon_after": part[-1].epsilon})
    return phases


def unit_record(prep: Prepared) -> dict:
    """The run's privacy unit where the engine's record names another: a user's rows are
    summed and clipped as the engine's "document", and epsilon protects the user."""
    if prep.privacy_unit != "user":
        return {}
    return {"privacy_unit": "user", "users": prep.n}


def claim_release(directory: str | Path, step: int, what: str) -> None:
    """One rule wherever a model leaves the process: every older checkpoint of the run is
    claimed as continued (a later resume of one is a fork), and the release is logged (a
    fork's report counts how far the run got)."""
    ckpt.claim_superseded(ckpt.list_checkpoints(directory), step, f"released: {what}")
    ckpt.record_release(directory, step, what)


def released_state(config: TrainConfig, model, engine) -> int:
    """Put the state to release into `model` and `engine`; return how many of the steps
    taken it leaves out.

    A run that checkpoints releases its newest checkpoint: the live state may be partway
    through a step (a Ctrl-C in the progress callback or in a save), and a model released
    past the checkpoint that --resume continues would share its steps with the resumed run,
    an unaccounted fork. Steps after the checkpoint leave the process in no form (their
    epsilon was shown, a public function of the step count), and --resume redraws them.
    """
    found = ckpt.list_checkpoints(config.checkpoint_dir) if config.checkpoint_dir else []
    if not found:
        return 0
    state = ckpt.load_checkpoint(found[-1][1])
    taken = engine.steps_taken
    if sum(int(r["count"]) for r in state["stepper"]["ledger"]["records"]) == taken:
        return 0
    ckpt.load_trainable_state(model, state["trainable"])
    engine.load_state_dict(state["stepper"])
    return taken - engine.steps_taken


def save_partial(
    error: BaseException, config: TrainConfig, task: Task, prep: Prepared, model, engine,
    note: Callable[[str], None], first_step: int,
    continuation: ckpt.Continuation | None = None,
) -> None:  # fmt: skip
    """A run stopped by an error or Ctrl-C after spending privacy: OUTPUT/metrics.json with
    what was spent (status "failed" or "interrupted") and the model so far (a noised model
    is post-processing of the steps taken; with checkpoints, the newest one's, see
    released_state). Best effort: the original error wins."""
    out = Path(config.output)
    status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
    releasable = True
    discarded = 0
    try:
        discarded = released_state(config, model, engine)
        if config.checkpoint_dir:
            what = f"the {status} run's model so far"
            claim_release(config.checkpoint_dir, engine.steps_taken - first_step, what)
    except Exception:  # noqa: BLE001 - then the record of what was spent, and no model
        logger.exception("could not settle the state to release: %s gets no model", out)
        releasable = False
    steps = engine.steps_taken - first_step
    privacy = dict(engine.privacy_record()) | unit_record(prep)
    privacy["insecure_seed"] = bool(config.insecure_reproducible_noise)
    if continuation is not None:
        privacy["continuation"] = ckpt.fork_report(
            continuation, engine.ledger.records, engine.target_delta, engine.ledger.accountant
        )
    record = {
        "status": status,
        # the type only: a message may quote shapes or values of the private batch (it is
        # raised to the caller, who sees it; metrics.json is declared public)
        "error": type(error).__name__,
        "task": config.task,
        "private": True,
        "epsilon": privacy["epsilon"],
        "delta": privacy["delta"],
        "steps": steps,
        # taken after the newest checkpoint and released in no form (--resume redraws them)
        "steps_discarded": discarded,
        "insecure_seed": privacy["insecure_seed"],
        "privacy": privacy,
        "config": dataclasses.asdict(config),
    }
    if "continuation" in privacy:
        record["continuation"] = privacy["continuation"]
    try:
        write_json(out / "metrics.json", record)
        if not releasable:
            return
        merge_adapters(model, config)
        task.save(prep, model, out / "model")
        window = {}  # long texts: how they were cut, so `dpfit evaluate` cuts them alike
        if prep.state.get("stride") is not None:
            window = {"window_length": prep.state["length"], "stride": prep.state["stride"]}
        write_json(
            out / "model" / "dpfit.json",
            {"private": True, "status": status, **privacy, **window},
        )
    except Exception:  # noqa: BLE001 - the error that stopped training is the one to raise
        logger.exception("could not write the record of the %s run to %s", status, out)
        return
    kept = f" (the newest checkpoint's; {discarded} later step(s) discarded)" if discarded else ""
    note(
        f"{status} after {steps} steps, epsilon {privacy['epsilon']:.4g} spent: {out} holds "
        f"its metrics.json and the model so far{kept}"
        + ("; rerun with --resume to continue" if config.checkpoint_dir else "")
    )


def run_metrics(
    config, recipe, overrides, summary, scores, privacy, rows, train_time, t_start, device,
    head_steps, delta,
) -> dict:  # fmt: skip
    private = not config.non_private
    m = {
        "task": config.task,
        **scores,
        "private": private,
        "epsilon": privacy["epsilon"] if privacy else math.inf,
        "delta": privacy["delta"] if privacy else None,
        # "epsilon" is for this relation; both relations' epsilons (docs/threat-model.md)
        "neighbouring": privacy["neighbouring"] if privacy else None,
        "epsilon_add_remove": privacy["epsilon_add_remove"] if privacy else math.inf,
        "epsilon_replace_one": privacy["epsilon_replace_one"] if privacy else math.inf,
        "noise_multiplier": privacy["noise_multiplier"] if privacy else None,
        "sample_rate": privacy["sample_rate"] if privacy else None,
        "max_grad_norm": config.max_grad_norm if private else None,
        "clipping": config.clipping if private else None,
        "steps": len(rows),
        "head_first_steps": head_steps,
        "epochs": config.epochs,
        "batch_size": config.batch_size,
        "lr": config.lr,
        "full_lr": config.full_lr if config.full_epochs else None,
        "lr_schedule": config.lr_schedule,
        # images have no token length: the recipe's value is not what ran
        "max_length": None if config.task == "image-classification" else config.max_length,
        "trainable_params": summary.trainable,
        "total_params": summary.total,
        "trainable_fraction": summary.fraction,
        "mode": config.mode,
        "recipe": recipe.as_dict(),
        "overridden_by_flags": list(overrides),
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - t_start,
        "peak_memory_mb": peak_memory_mb(device.type),
        "final_train_loss": (
            None  # a private run's training loss is not released
            if private
            else next((r.loss for r in reversed(rows) if r.loss is not None), None)
        ),
        "insecure_seed": bool(private and config.insecure_reproducible_noise),
        "config": dataclasses.asdict(config),
    }
    if private and privacy is None:  # pragma: no cover - defensive
        m["delta"] = delta
    return m


def save_outputs(
    result: TrainResult, config: TrainConfig, task: Task, prep: Prepared, errors: list[str]
) -> Path:
    """DIR/metrics.json first (the record of what was spent), then steps.csv, the plot and
    DIR/model (+ dpfit.json). A write that fails for a path reason (OSError: folder removed,
    disk full, permissions) is retried in a fallback folder (dpfit.outputs.fallback_dir);
    every error is recorded in metrics.json and raised as one OutputError line that says
    where each output is, after the rest are written."""
    out = Path(config.output)
    rescue: Path | None = None
    places: dict[str, Path] = {}

    def attempt(what: str, write: Callable[[Path], None]) -> None:
        nonlocal rescue
        try:
            write(out)
            places[what] = out
            return
        except Exception as e:  # noqa: BLE001 - recorded, re-raised as OutputError below
            logger.exception("writing %s to %s failed", what, out)
            errors.append(f"{what}: {type(e).__name__}: {e}")
            if not isinstance(e, OSError):
                return  # not the folder's fault: another folder would fail the same way
        if rescue is None:
            rescue = outputs.fallback_dir(config.output, config.task)
        try:
            write(rescue)
            places[what] = rescue
        except Exception as e:  # noqa: BLE001
            errors.append(f"{what} (fallback {rescue}): {type(e).__name__}: {e}")

    def metrics(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / "metrics.json", result.metrics)

    def steps(folder: Path) -> None:
        write_steps_csv(folder / "steps.csv", result.steps, private=not config.non_private)
        plot_steps(result.steps, folder, result.metrics.get("epsilon_by_phase", ()))

    def model(folder: Path) -> None:
        task.save(prep, result.model, folder / "model")
        write_json(folder / "model" / "dpfit.json", privacy_file(result))

    attempt("metrics.json", metrics)
    attempt("steps.csv/plots", steps)
    attempt("model", model)
    if errors:
        result.metrics["output_errors"] = list(errors)
        if "metrics.json" in places:
            write_json(places["metrics.json"] / "metrics.json", result.metrics)
        where = "; ".join(f"{k} in {v}" for k, v in places.items()) or "nothing was written"
        spent = result.metrics.get("epsilon")
        head = (
            f"training finished (epsilon {spent:.4g} spent) but some outputs failed"
            if isinstance(spent, float) and math.isfinite(spent)
            else "training finished but some outputs failed"
        )
        kept = " (metrics.json there records what was spent)" if "metrics.json" in places else ""
        msg = f"{head}: {'; '.join(errors)}. Written: {where}{kept}"
        raise OutputError(" ".join(msg.split()))  # one line, whatever the errors held
    return out


def privacy_file(result: TrainResult) -> dict:
    m = result.metrics
    record = {"private": result.privacy is not None, **(result.privacy or {})}
    record.setdefault("trainable_fraction", m.get("trainable_fraction"))
    record.setdefault("steps", m.get("steps"))
    record["mode"] = m.get("mode")
    record["insecure_seed"] = m.get("insecure_seed", False)
    if m.get("window_length") is not None:  # long texts: `dpfit evaluate` cuts them alike
        record.update(window_length=m["window_length"], stride=m["stride"])
    config = m.get("config") or {}
    if config.get("task") == "classification" and config.get("data") is None:
        # `dpfit evaluate --model DIR/model` without --data scores the same held-out movies
        record["bundled_split_seed"] = config.get("seed", 0)
    return record


def save_model(
    model, tokenizer, folder: str | Path, privacy: dict | None, metrics: dict | None = None
) -> None:
    """A classifier folder (see dpfit.tasks.pooling) plus dpfit.json with the privacy record."""
    from dpfit.tasks.pooling import PooledClassifier, save_pooled_classifier

    folder = Path(folder)
    if isinstance(model, PooledClassifier):
        save_pooled_classifier(model, tokenizer, folder)
    else:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    result = TrainResult(metrics or {}, [], model, tokenizer, privacy)
    write_json(folder / "dpfit.json", privacy_file(result))


def finish(setup, phases, notes: list[str], t_start: float) -> TrainResult:
    """After the last step: the privacy record, the evaluation, metrics.json and the outputs.
    From here on the privacy is spent: nothing may be lost to an error (metrics.json first).

    `setup`: the run's dpfit.run.prepare.Setup; `phases`: its dpfit.run.loop.Phases.
    """
    s, c, engine = setup, setup.config, phases.engine
    privacy = None
    if engine is not None:
        privacy = dict(engine.privacy_record()) | unit_record(s.prep)
        privacy["insecure_seed"] = bool(c.insecure_reproducible_noise)
        if phases.continuation is not None:
            privacy["continuation"] = ckpt.fork_report(
                phases.continuation, engine.ledger.records, engine.target_delta,
                engine.ledger.accountant,
            )  # fmt: skip
        engine.detach()
    merge_adapters(s.model, c)
    errors: list[str] = []
    try:
        scores = s.task.evaluate(s.prep, s.model, c, s.device)
    except Exception as e:  # noqa: BLE001 - reported in metrics.json, re-raised below
        logger.exception("evaluation failed after training")
        scores = {}
        errors.append(f"evaluation: {type(e).__name__}: {e}")
    rows = phases.rows
    metrics = run_metrics(
        c, s.recipe, s.overrides, s.summary, scores, privacy, rows, phases.train_time, t_start,
        s.device, s.head_steps, s.delta,
    )  # fmt: skip
    metrics["wall_time_s"] += phases.wall_before  # the whole run's, as train_time_s is
    if privacy is not None:  # what one sampled and clipped contribution is
        metrics["privacy_unit"] = s.prep.privacy_unit
        metrics["epsilon_by_phase"] = epsilon_by_phase(c, rows, s.head_steps, phases.head_epsilon)
    if "accuracy" in phases.head_scores:
        metrics["head_first_accuracy"] = phases.head_scores["accuracy"]
    start = phases.start_scores
    if "accuracy" in start:
        metrics["start_accuracy"] = start["accuracy"]
        if "accuracy" in scores and scores["accuracy"] < start["accuracy"]:
            phases.note(
                f"training lowered accuracy on the evaluation data from "
                f"{start['accuracy']:.4f} (the starting model) to {scores['accuracy']:.4f}: "
                "the starting model is the better one here"
            )
    if privacy and "continuation" in privacy:
        metrics["continuation"] = privacy["continuation"]
    result = TrainResult(metrics, rows, s.model, s.prep.tokenizer, privacy, notes)
    if c.output and is_main_process():  # distributed: rank 0 writes
        result.output_dir = save_outputs(result, c, s.task, s.prep, errors)
    elif errors:
        raise OutputError("; ".join(errors))
    return result
