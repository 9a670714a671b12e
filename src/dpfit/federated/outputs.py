"""What a federated run releases to files: metrics.json, rounds.csv and the plots.

Every value written is a function of noised releases and public settings (docs/federated.md
classifies each file). Its own module so that the app (a deployment's ServerApp writes them)
and the CLI both write them without importing each other.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dpfit.federated.data import label_names
from dpfit.federated.data_cli import clients_source
from dpfit.federated.examples import eval_split
from dpfit.federated.scoring import make_evaluate_fn

logger = logging.getLogger(__name__)

ROUND_COLUMNS = (
    "round",
    "clip_norm",
    "val_loss",
    "accuracy",
    "epsilon",
    "noise_std",
)


def majority_accuracy(task: Any, which: str = "test") -> float:
    """Accuracy of always predicting the split's most frequent label: the floor to beat."""
    labels = eval_split(task, which)[1]
    if not labels:
        return math.nan
    return max(labels.count(y) for y in set(labels)) / len(labels)


def summary(server: Any, task: Any, test_accuracy: float, test_loss: float) -> dict[str, Any]:
    h = server.history
    return {
        "method": server.config.method,
        "epsilon": server.accountant.epsilon() if h or server.vote_counts else 0.0,
        "target_epsilon": server.accountant.target_epsilon,
        "delta": server.config.delta,
        "noise_multiplier": server.noise_multiplier,
        "update_noise_multiplier": server.rule.update_multiplier,
        "accuracy": test_accuracy,
        "test_loss": test_loss,
        "majority_accuracy": majority_accuracy(task, "test"),
        "val_accuracy": h[-1].accuracy if h else math.nan,
        "val_loss": h[-1].val_loss if h else math.nan,
        "rounds": len(h),
        "rounds_requested": server.config.rounds,
        "initial_clip": server.initial_clip,
        "last_round_clip": h[-1].clip_norm if h else math.nan,  # the round lines' last C
        "final_clip": server.rule.clip_norm,  # after the last round: a next round's C
        "vote_counts": server.vote_counts,
        "num_clients": server.config.num_clients,
        "clients_per_round": server.config.clients_per_round,
        "partition": task.partition,
        "num_clients_from": clients_source(task),
        "data": task.data or "bundled Rotten Tomatoes",
        "client_column": task.client_column or None,
        "eval_data": task.eval_data or None,
        "label_names": list(label_names(task)),
        "local_mode": task.local_mode,
        "stopped": server.stop_reason,
        "insecure_seed": server.insecure,
        "continuation": server.continuation_report(),
    }


def write_outputs(server: Any, task: Any, out: str | Path, plots: bool = True) -> dict[str, Any]:
    """DIR/metrics.json, DIR/rounds.csv and, with matplotlib, DIR/{clip,accuracy,epsilon}.png."""
    test_loss, test_acc = make_evaluate_fn(task, "test")(server.params)
    metrics = summary(server, task, test_acc, test_loss)
    write_files(server.history, metrics, out, plots)
    return metrics


def write_files(
    history: list[Any], metrics: dict[str, Any], out: str | Path, plots: bool = True
) -> None:
    """The released files: every value in them is a function of noised releases and public
    settings (see docs/federated.md for each file's classification)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "rounds.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROUND_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in history:
            w.writerow(asdict(r))
    if plots:
        plot_rounds(history, out)
    # last and atomic: once metrics.json exists, every output of the run is complete
    tmp = out / "metrics.json.tmp"
    tmp.write_text(json.dumps(_jsonable(metrics), indent=2))
    tmp.replace(out / "metrics.json")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)  # "inf" / "nan": JSON has no infinities
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    return obj


def plot_rounds(history: list[Any], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib not installed; no plots (pip install dpfit[plots])")
        return
    rounds = [r.round for r in history]
    for name, key, label in (
        ("clip", "clip_norm", "clip norm C_t"),
        ("accuracy", "accuracy", "validation accuracy"),
        ("epsilon", "epsilon", "client-level epsilon"),
    ):
        fig, ax = plt.subplots(figsize=(4.5, 3))
        ax.plot(rounds, [getattr(r, key) for r in history], marker="o")
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)
