"""Checkpoints that survive SIGKILL: write to a temporary file, fsync, then rename.

A checkpoint holds everything a resumed run needs to continue bit-for-bit: the trainable
parameters (frozen ones are reloaded from the base model), optimizer state, the privacy
engine's state (accountant history, step count, noise generator), the data loader position,
and the global RNG states (dropout draws from torch's default generator). Because files only
appear by ``os.replace`` of a fully written and fsynced file, the newest file in the folder is
always complete; a kill mid-write leaves at most a stray temporary file, ignored and removed.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dpfit.errors import DPFitError

logger = logging.getLogger(__name__)

PREFIX = "ckpt-"
_NAME = re.compile(rf"^{PREFIX}(\d+)\.pt$")


class CheckpointError(DPFitError):
    """A checkpoint cannot be used to resume this run."""


class CheckpointForkError(CheckpointError):
    """A checkpoint that was already continued would be continued again: a fork."""


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"{PREFIX}{step:09d}.pt"


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = _NAME.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(directory: str | Path) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def check_checkpoint_dir(directory: str | Path, resume: bool) -> Path | None:
    """The checkpoint to resume from (None for a new run), checked before any data is read.

    Resuming spends no new budget only if there is a checkpoint to continue from, so
    ``resume`` without one is an error naming the folder and what is in it (a new run needs
    no --resume), never a silent fresh start. A new run refuses a folder that already holds
    another run's checkpoints (mixing them would make its --resume continue the wrong run).
    """
    directory = Path(directory)
    found = list_checkpoints(directory)
    if resume:
        if found:
            return found[-1][1]
        if not directory.exists():
            what = "does not exist"
        elif not directory.is_dir():
            what = "is a file, not a folder"
        else:
            others = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
            what = (
                f"holds no checkpoint ({PREFIX}*.pt) but {len(others)} other file(s): "
                f"{', '.join(others[:3])}{', ...' if len(others) > 3 else ''}"
                if others
                else "is empty"
            )
        raise CheckpointError(
            f"--resume: --checkpoint-dir {directory} {what}, so there is nothing to continue "
            "(a fresh start would spend the privacy budget again); name the folder the "
            "interrupted run wrote to, or drop --resume to start a new run"
        )
    if found:
        raise CheckpointError(
            f"--checkpoint-dir {directory} already holds checkpoints of a run (newest "
            f"{found[-1][1].name}); add --resume to continue it, or name a new folder"
        )
    return None


def save_checkpoint(directory: str | Path, step: int, state: Mapping, keep: int = 2) -> Path:
    """Atomically write `state` as the checkpoint for logical `step`; keep the newest `keep`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, step)
    tmp = directory / f".{final.name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(dict(state), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(directory)
    # the run goes on from every older checkpoint: it is their continuation (a later resume
    # of one is a fork), whether or not this run releases anything
    claim_superseded(list_checkpoints(directory), step, f"superseded by {final.name}")
    for _, old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
        for marker in continuation_markers(old):
            marker.unlink(missing_ok=True)
    for stray in directory.glob(f".{PREFIX}*.tmp-*"):
        if stray != tmp:
            stray.unlink(missing_ok=True)
    return final


def load_checkpoint(path: str | Path) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint`. Only load files you wrote."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # Optimizer or engine states with non-tensor objects need full unpickling.
        logger.debug("weights_only load of %s failed; loading with full unpickling", path)
        return torch.load(path, map_location="cpu", weights_only=False)


# -- pieces of state -------------------------------------------------------------------------


def trainable_state(model: torch.nn.Module, everything: bool = False) -> dict[str, torch.Tensor]:
    """Parameters to checkpoint: those that train, or all (a two-phase run's first phase
    changed weights that are frozen later)."""
    return {
        n: p.detach().cpu().clone()
        for n, p in model.named_parameters()
        if everything or p.requires_grad
    }


def load_trainable_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = [n for n in state if n not in params]
    if missing:
        raise CheckpointError(
            f"checkpoint has parameters the model lacks ({missing[:3]}...); resume with the "
            "same --model as the run that wrote it"
        )
    with torch.no_grad():
        for n, value in state.items():
            if params[n].shape != value.shape:
                raise CheckpointError(
                    f"parameter {n} is {tuple(value.shape)} in the checkpoint but "
                    f"{tuple(params[n].shape)} in the model; resume with the same model and labels"
                )
            params[n].copy_(value)


def rng_state() -> dict:
    import numpy as np

    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype("int64")),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping) -> None:
    import numpy as np

    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            n["keys"].numpy().astype("uint32"),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x):
    """random.setstate needs tuples; a round trip through some loaders turns them to lists."""
    if isinstance(x, list):
        return tuple(_as_tuple(v) for v in x)
    if isinstance(x, tuple):
        return tuple(_as_tuple(v) for v in x)
    return x


def check_compatible(saved: Mapping, current: Mapping, keys: tuple[str, ...]) -> None:
    """Refuse to resume when a setting that changes the run differs from the checkpoint's."""
    diffs = [
        f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
        for k in keys
        if saved.get(k) != current.get(k)
    ]
    if diffs:
        raise CheckpointError(
            "the checkpoint was written with different settings (" + "; ".join(diffs) + "); "
            "resume with the same options, or use a new --checkpoint-dir"
        )


# -- continuations and forks ----------------------------------------------

CONTINUED = ".continued-"


@dataclass(frozen=True)
class Continuation:
    """This run continues `checkpoint`, as its `number`-th continuation (2 and up: a fork).

    `steps`: the privacy steps on the checkpoint's ledger, which every continuation shares.
    """

    checkpoint: str
    number: int
    steps: int
    # an upper bound on the steps every earlier continuation took past the checkpoint (from
    # the newest checkpoint and release of the run's folder when this one claimed it); None
    # where nothing tells (each then assumed as long as this one)
    earlier_steps: int | None = None

    @property
    def fork(self) -> bool:
        return self.number > 1


def continuation_markers(path: str | Path) -> list[Path]:
    """The markers of the continuations of checkpoint `path` so far, oldest first."""
    path = Path(path)
    found = []
    for p in path.parent.glob(f"{path.name}{CONTINUED}*"):
        tail = p.name[len(path.name) + len(CONTINUED) :]
        if tail.isdigit():
            found.append((int(tail), p))
    return [p for _, p in sorted(found)]


def claim_continuation(
    path: str | Path, steps: int, allow_fork: bool = False, *, reach: int | None = None,
    at: int | None = None,
) -> Continuation:  # fmt: skip
    """Record, before anything is drawn, that checkpoint `path` is being continued.

    Each continuation of a checkpoint draws fresh noise and batches, so it is a mechanism of
    its own on the same data: releasing two continuations costs the shared steps composed with
    both continuations' own steps, while each reports one run's epsilon. So the first
    continuation is recorded by a marker file next to the checkpoint (``<name>.continued-1``,
    created with O_EXCL: of two concurrent resumes exactly one gets it), and a second one is
    refused unless `allow_fork`. The usual crash-resume chain is not affected: a continuation
    writes newer checkpoints, and the resume after its crash starts from the newest one.

    `at` / `reach`: the checkpoint's own step and the furthest step the run's folder shows
    (newest checkpoint or release), in one unit: a fork's report then counts every earlier
    continuation as ``reach - at`` steps long when that is longer than its own.
    """
    path = Path(path)
    number = 1
    while True:
        marker = path.with_name(f"{path.name}{CONTINUED}{number}")
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            if not allow_fork:
                raise CheckpointForkError(_fork_refusal(path)) from None
            number += 1
            continue
        with os.fdopen(fd, "w") as f:
            json.dump({"started": time.time(), "pid": os.getpid(), "steps": steps}, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(path.parent)
        if number > 1:
            logger.warning(
                "%s: continuation %d (a fork); releasing the outputs of more than one "
                "continuation costs the first %d steps composed with each one's own steps",
                path.name,
                number,
                steps,
            )
        earlier = None if reach is None or at is None or number == 1 else max(0, reach - at)
        return Continuation(path.name, number, steps, earlier)


def _fork_refusal(path: Path) -> str:
    markers = continuation_markers(path)
    when = ""
    try:
        started = json.loads(markers[0].read_text())["started"]
        when = f" on {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(started))}"
    except (IndexError, OSError, ValueError, KeyError):
        pass
    return (
        f"{path.name} was already continued{when} ({markers[0].name if markers else 'marker'}); "
        "a second continuation draws fresh noise and is a fork: releasing both costs the "
        "shared steps plus both continuations' own steps, while each reports one run's "
        "epsilon. Resume the newer checkpoints of that continuation instead, or pass --fork "
        "(allow_fork=True) to fork knowingly (the report then says so); if the earlier "
        "continuation crashed before writing a checkpoint and released nothing, --fork costs "
        "nothing extra"
    )


def fork_report(continuation: Continuation, records: Sequence, delta: float, accountant: str):
    """What a continuation's report says about the checkpoint it continued.

    `records`: the run's ledger records (dpfit.accounting.StepRecord). For a fork, also the
    epsilon of releasing this run together with the earlier continuations of the checkpoint,
    were each as long as this one (its own steps counted once per continuation).
    """
    from dpfit.accounting import PrivacyLedger, StepRecord

    report: dict = {
        "checkpoint": continuation.checkpoint,
        "continuation": continuation.number,
        "shared_steps": continuation.steps,
        "fork": continuation.fork,
    }
    if not continuation.fork:
        return report
    own: list[StepRecord] = []
    skip = continuation.steps
    for r in records:
        take = max(0, r.count - skip)
        skip = max(0, skip - r.count)
        if take:
            own.append(StepRecord(r.noise_multiplier, r.sample_rate, take, r.sampling))
    earlier = list(own)
    longer = (continuation.earlier_steps or 0) - sum(r.count for r in own)
    if longer > 0 and own:  # an earlier continuation went further: its steps as this one's
        last = own[-1]
        earlier.append(StepRecord(last.noise_multiplier, last.sample_rate, longer, last.sampling))
    ledger = PrivacyLedger(delta, accountant, list(records))
    extra = tuple(earlier) * (continuation.number - 1)
    report["epsilon_if_all_continuations_released"] = ledger.epsilon(extra=extra)
    if continuation.earlier_steps is not None:
        report["earlier_continuation_steps_at_most"] = continuation.earlier_steps
    assumed = (
        f"each earlier one as long as the furthest the run's folder shows "
        f"({continuation.earlier_steps} steps) or this one, whichever is longer"
        if continuation.earlier_steps is not None
        else "each as long as this one"
    )
    report["note"] = (
        f"continuation {continuation.number} of {continuation.checkpoint}: a fork. This run's "
        "epsilon counts its own steps once; releasing the outputs of several continuations "
        f"costs the {continuation.steps} shared steps composed with every continuation's own "
        f"steps (epsilon_if_all_continuations_released assumes {assumed})"
    )
    return report


# -- releases: one rule wherever a model leaves the process ------------------------------

RELEASES = ".releases.jsonl"


def claim_superseded(checkpoints: Sequence[tuple[int, Path]], step: int, why: str) -> list[Path]:
    """Claim every checkpoint older than `step` as continued by the run that wrote it.

    Called before a model of a later state leaves the process (a partial or final save, a
    pushed model) and whenever a newer checkpoint is written: the run that goes on from a
    checkpoint is its first continuation, whether or not anyone resumes it. Without the
    claim, a later resume of the older checkpoint would count as continuation 1 while the
    released later state shares its steps: two releases, one run's epsilon. With it, such a
    resume is a fork that must be asked for (--fork) and is reported with both releases.
    A checkpoint that already has a continuation marker is left as it is.
    """
    claimed = []
    for at, path in checkpoints:
        if at >= step or continuation_markers(path):
            continue
        marker = path.with_name(f"{path.name}{CONTINUED}1")
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as f:
            record = {"started": time.time(), "pid": os.getpid(), "by": why, "reached": step}
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        claimed.append(path)
    for directory in {p.parent for p in claimed}:
        _fsync_dir(directory)
    return claimed


def record_release(directory: str | Path, step: int, what: str) -> None:
    """Append to the folder's release log that a model of `step` left the process: a later
    fork of an older checkpoint reads the furthest release from it (:func:`reach`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"step": step, "what": what, "time": time.time(), "pid": os.getpid()})
    with open(directory / RELEASES, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def reach(directory: str | Path, checkpoints: Sequence[tuple[int, Path]] = ()) -> int | None:
    """The furthest step this folder's run got to that may have left the process: its newest
    checkpoint or recorded release (None for an empty folder)."""
    steps = [at for at, _ in checkpoints]
    log = Path(directory) / RELEASES
    if log.is_file():
        for line in log.read_text().splitlines():
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                logger.warning("%s: unreadable line %r ignored", log, line[:80])
    return max(steps) if steps else None
