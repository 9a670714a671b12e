"""The utility suite: does `dpfit train` with its defaults learn on tasks it was not tuned on?

Tasks (dpfit.data.tasks, all from bundled data, split by movie / speaker / corpus group):
rotten-tomatoes (2 classes), convention-party (2), text-source (6), on which the recipe's
defaults were chosen, and two held-out tasks that only check them (dpfit.data.tasks.HELD_OUT,
marked "held out" in the tables): headline-month (7 classes, split by date) and debate-role
(3, split by debate segment). Rows per task:

  majority class             always the training split's most frequent label
  TF-IDF + LR                1-2 gram TF-IDF + logistic regression, C by CV on train
  DP hashed n-gram LR eps=E  its private counterpart (E in 1, 8): hashed 1-2 grams (no
                             vocabulary read from the data), LR trained by dpfit's engine with
                             the recipe of dpfit's own private head; see baselines.dp_hashed_lr
  ... 20 epochs             the same at eps 8 with dpfit's largest epoch count (cheap for LR)
  frozen probe (pooling)     frozen MiniLM features + LR; pooler output, [CLS], token mean
  non-private bias-only      `dpfit train --non-private`            (defaults only)
  non-private full           `dpfit train --non-private --mode full`
  DP-BiTFiT eps=E            `dpfit train --epsilon E`  for E in 1, 3, 8
  ... no head-first         the same two rows with `--no-head-first` (the head-first phase,
                             a linear probe on frozen features before BiTFiT, is the default)
  DP full eps=8              `dpfit train --mode full`
  DP LoRA-only eps=8         `dpfit train --mode lora`      (peft LoRA r=8 on query/value)
  DP bias+LoRA eps=E         `dpfit train --mode bias+lora --no-lora-freeze-a` for E in 1, 8
                             (both LoRA matrices, as before lora_A was frozen by default)
  DP bias+FFA-LoRA eps=E     `dpfit train --mode bias+lora` for E in 1, 8 (lora_A frozen:
                             the private default)

Each dpfit run with a head-first phase also records what the phase after the probe did to the
probe's model (test predictions newly right / newly wrong, weight change, training loss by
epoch: benchmarks/phase_record.py), so an accuracy left exactly as the probe's is told apart
from a phase that did not train.

dpfit rows pass NO recipe flags (batch, lr, epochs, clip norm, clipping, max length): the
defaults are what is measured. Every finished run is appended to a JSONL log and skipped when
the suite is run again, so an interrupted suite resumes, and the table is rebuilt from
whatever has finished (`--table-only`). `--quick` trains on a random subset of each training
split and scores a random subset of each test split (the table header says so).

    python benchmarks/utility.py --quick --seeds 0            # a first pass
    python benchmarks/utility.py --seeds 0 1 2                # the full suite
    python benchmarks/utility.py --rows dp-8 np-bias --tasks convention-party
    python benchmarks/utility.py --table-only                 # rebuild md/json/png
    python benchmarks/utility.py --precision bf16 --rows dp-8 --seeds 0

`--precision bf16` runs the dpfit rows under bf16 autocast (`dpfit train --precision bf16`)
into their own log and table (tag `utility_bf16`), and writes `utility_bf16_vs_fp32.md`: each
bf16 run beside the fp32 runs of the same row, task and scale in `utility_runs.jsonl`.
"""

from __future__ import annotations

import os

# Before torch: OpenMP threads spin-wait by default, which on a shared machine is ruinous.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import baselines  # noqa: E402
from doc_block import write_between_markers  # noqa: E402
from paired_t import t_interval  # noqa: E402
from phase_record import PhaseRecorder, phase_record  # noqa: E402

from dpfit.data.tasks import HELD_OUT, TASKS, TaskSplits, load_task, write_csv  # noqa: E402
from dpfit.dropout import parse_rate  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
CACHE = HERE / ".cache"
logger = logging.getLogger("utility")


@dataclass(frozen=True)
class Row:
    key: str  # short name for --rows
    name: str  # table label
    kind: str  # majority | tfidf | dpbow | probe | dpfit
    train: dict = dataclasses.field(default_factory=dict)  # TrainConfig fields (no recipe!)


ROWS = (
    Row("majority", "majority class", "majority"),
    Row("tfidf", "TF-IDF + LR", "tfidf"),
    Row("dp-bow-8", "DP hashed n-gram LR eps=8", "dpbow", {"epsilon": 8.0}),
    Row("dp-bow-1", "DP hashed n-gram LR eps=1", "dpbow", {"epsilon": 1.0}),
    Row(
        "dp-bow-8-long",
        "DP hashed n-gram LR eps=8, 20 epochs",
        "dpbow",
        {"epsilon": 8.0, "epochs": 20},
    ),
    Row("probe", "frozen probe (pooler / cls / mean)", "probe"),
    Row("np-bias", "non-private bias-only", "dpfit", {"non_private": True}),
    Row("dp-8", "DP-BiTFiT eps=8", "dpfit", {"epsilon": 8.0}),
    Row("dp-1", "DP-BiTFiT eps=1", "dpfit", {"epsilon": 1.0}),
    Row("dp-3", "DP-BiTFiT eps=3", "dpfit", {"epsilon": 3.0}),
    Row(
        "np-bias-nohead",
        "non-private bias-only, no head-first",
        "dpfit",
        {"non_private": True, "head_first": False},
    ),
    Row(
        "dp-8-nohead",
        "DP-BiTFiT eps=8, no head-first",
        "dpfit",
        {"epsilon": 8.0, "head_first": False},
    ),
    Row(
        "dp-8-flat",
        "DP-BiTFiT eps=8, flat clipping",
        "dpfit",
        {"epsilon": 8.0, "clipping": "flat"},
    ),
    Row(
        "dp-1-flat",
        "DP-BiTFiT eps=1, flat clipping",
        "dpfit",
        {"epsilon": 1.0, "clipping": "flat"},
    ),
    Row("np-full", "non-private full", "dpfit", {"non_private": True, "mode": "full"}),
    Row(
        "np-full-nohead",
        "non-private full, no head-first",
        "dpfit",
        {"non_private": True, "mode": "full", "head_first": False},
    ),
    Row("dp-full-8", "DP full eps=8", "dpfit", {"epsilon": 8.0, "mode": "full"}),
    Row(
        "dp-full-8-nohead",
        "DP full eps=8, no head-first",
        "dpfit",
        {"epsilon": 8.0, "mode": "full", "head_first": False},
    ),
    # the LoRA modes beside DP-BiTFiT and DP full
    Row("dp-lora-8", "DP LoRA-only eps=8", "dpfit", {"epsilon": 8.0, "mode": "lora"}),
    # both LoRA matrices trained, as every bias+lora run did before private runs froze lora_A
    # by default (dpfit.recipe.PRIVATE_LORA_FREEZE_A): pinned, so the rows keep their meaning
    Row(
        "dp-bias-lora-8",
        "DP bias+LoRA eps=8",
        "dpfit",
        {"epsilon": 8.0, "mode": "bias+lora", "lora_freeze_a": False},
    ),
    Row(
        "dp-bias-lora-1",
        "DP bias+LoRA eps=1",
        "dpfit",
        {"epsilon": 1.0, "mode": "bias+lora", "lora_freeze_a": False},
    ),
    # lora_A frozen (FFA-LoRA): private bias+lora's default since the rows above were run
    Row(
        "dp-bias-ffa-8",
        "DP bias+FFA-LoRA eps=8",
        "dpfit",
        {"epsilon": 8.0, "mode": "bias+lora", "lora_freeze_a": True},
    ),
    Row(
        "dp-bias-ffa-1",
        "DP bias+FFA-LoRA eps=1",
        "dpfit",
        {"epsilon": 1.0, "mode": "bias+lora", "lora_freeze_a": True},
    ),
)
ROW_BY_KEY = {r.key: r for r in ROWS}
QUICK_TRAIN, QUICK_TEST = 1000, 500


@dataclass(frozen=True)
class Scale:
    max_train: int | None
    max_test: int | None

    def tag(self) -> str:
        return f"train{self.max_train or 'all'}_test{self.max_test or 'all'}"


def task_data(name: str, seed: int, scale: Scale) -> tuple[TaskSplits, Path, Path]:
    """The task at this scale, and CSVs of (full train, scored test) for `dpfit train`.

    The training subset is drawn by `train` itself (max_train_examples, same seed), so the
    baselines use `LabeledTexts.subsample` with the same seed and get the same examples.
    """
    task = load_task(name, seed)
    test = task.test
    if scale.max_test:
        test = test.subsample(scale.max_test, seed=seed)
    train = task.train.subsample(scale.max_train, seed=seed) if scale.max_train else task.train
    folder = CACHE / "tasks" / f"{name}_s{seed}_{scale.tag()}"
    if not (folder / "test.csv").exists():
        # written aside and renamed into place: parallel workers (utility_workers.py) never
        # read a half-written file
        part = folder.with_name(f"{folder.name}.part{os.getpid()}")
        write_csv(task.train, part / "train.csv")
        write_csv(test, part / "test.csv")
        try:
            part.rename(folder)
        except OSError:  # another worker's copy is in place: the same files
            shutil.rmtree(part)
    return (
        dataclasses.replace(task, train=train, test=test),
        folder / "train.csv",
        folder / "test.csv",
    )


def run_dpfit(
    row: Row,
    train_csv: Path,
    test_csv: Path,
    seed: int,
    scale: Scale,
    precision: str = "fp32",
    dropout: float | str | None = None,
) -> dict:
    from dpfit.train import TrainConfig, train

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    missing = [k for k in row.train if k not in fields]
    if missing:
        raise NotImplementedError(f"this build's TrainConfig has no {missing}")
    cfg = TrainConfig(
        data=str(train_csv),
        eval_data=str(test_csv),
        seed=seed,
        max_train_examples=scale.max_train,
        **row.train,
        **({"precision": precision} if precision != "fp32" else {}),
        **({"dropout": dropout} if dropout is not None else {}),
    )
    recorder = PhaseRecorder()  # the classification task, keeping the probe's predictions
    result = train(cfg, task=recorder)
    m = result.metrics
    keep = (
        "accuracy epsilon delta noise_multiplier steps head_first_steps epochs batch_size lr "
        "max_length train_examples trainable_fraction train_time_s recipe clipping max_grad_norm "
        "head_first_accuracy"
    ).split()
    out = {k: m.get(k) for k in keep if k in m}
    for k in ("lr", "max_length", "pooling", "precision"):  # older builds: only in the config
        out.setdefault(k, m.get("config", {}).get(k))
    if "dropout" in m.get("config", {}):  # builds since the dropout rule: the rate that ran
        out["dropout"] = m["config"]["dropout"]
    phase = phase_record(recorder, result.steps)
    if phase is not None:  # what the main phase did to the head-first probe's model
        out["after_probe"] = phase
    return out


def run_row(
    row: Row,
    task_name: str,
    seed: int,
    scale: Scale,
    precision: str = "fp32",
    dropout: float | str | None = None,
) -> list[dict]:
    """One or more result records (the probe gives one per pooling)."""
    task, train_csv, test_csv = task_data(task_name, seed, scale)
    sizes = {
        "n_train": len(task.train),
        "n_test": len(task.test),
        "n_classes": task.num_labels,
        "median_words": statistics.median(len(t.split()) for t in task.train.texts),
    }
    if row.kind == "majority":
        return [{"row": row.name, "accuracy": task.majority_rate(), **sizes}]
    if row.kind == "tfidf":
        return [{"row": row.name, **baselines.tfidf_lr(task, seed), **sizes}]
    if row.kind == "dpbow":
        res = baselines.dp_hashed_lr(task, row.train["epsilon"], seed, row.train.get("epochs"))
        return [{"row": row.name, **res, **sizes}]
    if row.kind == "probe":
        res = baselines.probe(task, baselines.PROBE_MAX_LENGTH, seed, load_task(task_name, seed))
        return [{"row": f"frozen probe, {p}", **r, **sizes} for p, r in res.items()]
    res = run_dpfit(row, train_csv, test_csv, seed, scale, precision, dropout)
    return [{"row": row.name, **sizes, **res}]


# -- the log, the table, the plot ---------------------------------------------------------------


def run_key(row: Row, task: str, seed: int, scale: Scale) -> str:
    return f"{task}|{row.key}|{seed}|{scale.tag()}"


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "key" in r]  # older formats of this log are ignored


def summarize(records: list[dict], scale: Scale) -> dict:
    """{task: {row label: {mean, sd, seeds, wall_s, ...}}} over finished runs at `scale`."""
    out: dict[str, dict] = {}
    for r in records:
        if r.get("scale") != scale.tag() or "accuracy" not in r:
            continue
        out.setdefault(r["task"], {}).setdefault(r["row"], []).append(r)
    summary: dict[str, dict] = {}
    for task, rows in out.items():
        summary[task] = {}
        for name, rs in rows.items():
            accs = [100 * r["accuracy"] for r in rs]
            summary[task][name] = {
                "mean": statistics.fmean(accs),
                "sd": statistics.stdev(accs) if len(accs) > 1 else None,
                "seeds": sorted(r["seed"] for r in rs),
                "by_seed": {r["seed"]: 100 * r["accuracy"] for r in rs},
                "wall_s": statistics.fmean(r.get("wall_s", 0.0) for r in rs),
                "epsilon": rs[0].get("epsilon"),
                "steps": rs[0].get("steps"),
                "batch_size": rs[0].get("batch_size"),
                "epochs": rs[0].get("epochs"),
                "lr": rs[0].get("lr"),
                "n_train": rs[0].get("n_train"),
                "n_test": rs[0].get("n_test"),
                "head_first_steps": rs[0].get("head_first_steps"),
                # the head-first phase's probe alone, scored before the biases train
                "probe_phase": [
                    100 * r["head_first_accuracy"]
                    for r in rs
                    if r.get("head_first_accuracy") is not None
                ],
                "probe_by_seed": {
                    r["seed"]: 100 * r["head_first_accuracy"]
                    for r in rs
                    if r.get("head_first_accuracy") is not None
                },
                # what the phase after the probe did (runs that recorded it)
                "after_probe_by_seed": {
                    r["seed"]: r["after_probe"] for r in rs if r.get("after_probe")
                },
                "noise_multiplier": rs[0].get("noise_multiplier"),
                "n_classes": rs[0].get("n_classes"),
                "median_words": rs[0].get("median_words"),
                "cpu_s": statistics.fmean(r["cpu_s"] for r in rs) if "cpu_s" in rs[0] else None,
            }
    return summary


def row_order(summary: dict) -> list[str]:
    names: list[str] = []
    for rows in summary.values():
        names += [n for n in rows if n not in names]
    rank = {r.name: i for i, r in enumerate(ROWS)}

    def key(n: str) -> tuple[int, str]:
        return (rank.get(n, rank[ROW_BY_KEY["probe"].name]), n)

    return sorted(names, key=key)


def _cell(s: dict | None, wall: bool = True) -> str:
    if s is None:
        return "not run"
    sd = f" ± {s['sd']:.1f}" if s["sd"] is not None else ""
    return f"{s['mean']:.1f}{sd} ({len(s['seeds'])})" + (f" {s['wall_s']:.0f} s" if wall else "")


def targets(summary: dict) -> list[str]:
    """The suite's targets, checked on what has finished."""
    lines = []
    for task, rows in summary.items():
        np_bias = rows.get("non-private bias-only")
        probes = {n: s for n, s in rows.items() if n.startswith("frozen probe")}
        if np_bias and probes:
            best_name, best = max(probes.items(), key=lambda kv: kv[1]["mean"])
            gap = np_bias["mean"] - best["mean"]
            ok = "met" if gap >= 0 else "MISSED"
            lines.append(
                f"- {task}: non-private bias-only {np_bias['mean']:.1f} vs best {best_name} "
                f"{best['mean']:.1f} ({gap:+.1f}): {ok}"
            )
        dp8 = rows.get("DP-BiTFiT eps=8")
        if np_bias and dp8:
            gap = dp8["mean"] - np_bias["mean"]
            n = np_bias.get("n_train") or 0
            if task in HELD_OUT:
                need = "held-out task: target on every size"
            else:
                need = "target" if n >= 5000 else f"reported only (n={n} < 5000)"
            ok = "met" if gap >= -3 else "MISSED"
            lines.append(
                f"- {task}: DP-BiTFiT eps=8 {dp8['mean']:.1f} vs non-private bias-only "
                f"{np_bias['mean']:.1f} ({gap:+.1f} points, {need}): {ok}"
            )
        dp1, maj = rows.get("DP-BiTFiT eps=1"), rows.get("majority class")
        if dp1 and maj:
            gap = dp1["mean"] - maj["mean"]
            ok = "met" if gap >= 3 else "MISSED"
            lines.append(
                f"- {task}: DP-BiTFiT eps=1 {dp1['mean']:.1f} vs majority {maj['mean']:.1f} "
                f"({gap:+.1f}; 'clearly' read as >= 3 points): {ok}"
            )
    return lines


# (variant row key, the row it departs from by one choice): compared on the seeds both ran
VARIANTS = (
    ("dp-8-flat", "dp-8"),
    ("dp-1-flat", "dp-1"),
    ("dp-8-nohead", "dp-8"),
    ("np-bias-nohead", "np-bias"),
    ("np-full", "np-bias"),
    ("np-full-nohead", "np-full"),
    ("dp-full-8", "dp-8"),
    ("dp-full-8-nohead", "dp-full-8"),
    ("dp-bow-8-long", "dp-bow-8"),
)


# (fine-tune row key, the baseline a practitioner tries first): a fine-tune below it is a fault
# to explain, not a result
AGAINST_TFIDF = tuple((key, "tfidf") for key in ("np-full", "np-bias", "dp-full-8", "dp-8"))
# (DP fine-tune, the DP bag of words at the same epsilon): the bar a DP row must clear
AGAINST_DP_BOW = (
    ("dp-8", "dp-bow-8"),
    ("dp-full-8", "dp-bow-8"),
    ("dp-1", "dp-bow-1"),
    ("dp-8", "dp-bow-8-long"),
    ("dp-full-8", "dp-bow-8-long"),
)


def paired_rows(summary: dict, pairs) -> list[tuple[str, str, str, list[int], list[float]]]:
    """(task, first row's name, second's, seeds both ran, first minus second on each) for each
    pair of row keys and each task where both rows share a seed."""
    out = []
    for vkey, bkey in pairs:
        vname, bname = ROW_BY_KEY[vkey].name, ROW_BY_KEY[bkey].name
        for task, rows in summary.items():
            v, b = rows.get(vname), rows.get(bname)
            if not v or not b:
                continue
            seeds = sorted(set(v["by_seed"]) & set(b["by_seed"]))
            if seeds:
                diffs = [v["by_seed"][k] - b["by_seed"][k] for k in seeds]
                out.append((task, vname, bname, seeds, diffs))
    return out


def _each(seeds: list[int], diffs: list[float]) -> str:
    return ", ".join(f"{d:+.1f} (seed {k})" for k, d in zip(seeds, diffs, strict=True))


def variant_lines(summary: dict, pairs=VARIANTS) -> list[str]:
    """Each first row of a pair minus the second (a variant minus the row it departs from, or
    a fine-tune minus a baseline), paired by seed (the split, the head's initialisation and
    the subsample are the seed's; the private noise is not)."""
    return [
        f"- {task}: {vname} minus {bname}: {statistics.fmean(diffs):+.1f} on average "
        f"over {len(seeds)} seed(s): {_each(seeds, diffs)}"
        for task, vname, bname, seeds, diffs in paired_rows(summary, pairs)
    ]


# (mode row key, DP-BiTFiT at the same epsilon): the LoRA modes against bias-only, paired by
# seed with a 95% t interval on the mean difference
AGAINST_BITFIT = (
    ("dp-bias-lora-8", "dp-8"),
    ("dp-lora-8", "dp-8"),
    ("dp-bias-lora-1", "dp-1"),
    ("dp-bias-ffa-8", "dp-8"),
    ("dp-bias-ffa-8", "dp-bias-lora-8"),
    ("dp-bias-ffa-1", "dp-1"),
)
# the private modes at eps 8 with their defaults: the best of them is held to non-private full
DP8_MODES = ("dp-8", "dp-full-8", "dp-lora-8", "dp-bias-lora-8", "dp-bias-ffa-8")


def paired(v: dict, b: dict) -> tuple[list[int], list[float]]:
    """Seeds both rows ran, and the first row minus the second on each."""
    seeds = sorted(set(v["by_seed"]) & set(b["by_seed"]))
    return seeds, [v["by_seed"][k] - b["by_seed"][k] for k in seeds]


def interval_lines(summary: dict, pairs=AGAINST_BITFIT) -> list[str]:
    """Each first row minus the second, paired by seed: mean, 95% t interval, each seed."""
    lines = []
    for task, vname, bname, seeds, diffs in paired_rows(summary, pairs):
        ci = t_interval(diffs)
        ci_text = f", 95% t interval [{ci[0]:+.1f}, {ci[1]:+.1f}]" if ci else ", no interval"
        lines.append(
            f"- {task}: {vname} minus {bname}: {statistics.fmean(diffs):+.1f} over "
            f"{len(seeds)} pair(s){ci_text}: {_each(seeds, diffs)}"
        )
    return lines


def _short(seeds: int, asked: int = 3) -> str:
    return "" if seeds >= asked else f" (on {seeds} of the {asked} seeds the target asks)"


def mode_targets(summary: dict) -> list[str]:
    """bias+LoRA >= BiTFiT at eps 8 (mean of the seed pairs), and the best private mode at
    eps 8 within 3 points of non-private full fine-tuning."""
    lines = []
    for task, rows in summary.items():
        b = rows.get(ROW_BY_KEY["dp-8"].name)
        for key in ("dp-bias-lora-8", "dp-bias-ffa-8"):  # bias+lora, A trained or frozen
            name = ROW_BY_KEY[key].name
            v = rows.get(name)
            seeds, diffs = paired(v, b) if v and b else ([], [])
            if seeds:
                mean = statistics.fmean(diffs)
                lines.append(
                    f"- {task}: {name} minus DP-BiTFiT eps=8, paired by seed: "
                    f"{mean:+.1f} over {len(seeds)} pair(s): {'met' if mean >= 0 else 'MISSED'}"
                    + _short(len(seeds))
                )
        np_full = rows.get(ROW_BY_KEY["np-full"].name)
        modes = {ROW_BY_KEY[k].name: rows.get(ROW_BY_KEY[k].name) for k in DP8_MODES}
        modes = {n: s for n, s in modes.items() if s}
        if np_full and modes:
            best_name, best = max(modes.items(), key=lambda kv: kv[1]["mean"])
            gap = best["mean"] - np_full["mean"]
            lines.append(
                f"- {task}: best private mode at eps 8 ({best_name}, {len(best['seeds'])} "
                f"seed(s)) {best['mean']:.1f} vs non-private full {np_full['mean']:.1f} "
                f"({gap:+.1f} points; within 3): {'met' if gap >= -3 else 'MISSED'}"
                + _short(min(len(best["seeds"]), len(np_full["seeds"])))
            )
    return lines


def ffa_default_verdict(
    summary: dict, tasks=tuple(t for t in TASKS if t not in HELD_OUT)
) -> bool | None:
    """The criterion fixed before the FFA-LoRA suite runs (docs/bias_lora.md): FFA-LoRA
    becomes bias+lora's default if, paired by seed, its mean is >= DP-BiTFiT's on every suite
    task and its mean over the tasks is above bias+LoRA's. None: some task lacks 3 seeds."""
    ffa, lora, bitfit = (ROW_BY_KEY[k].name for k in ("dp-bias-ffa-8", "dp-bias-lora-8", "dp-8"))
    vs_bitfit, vs_lora = [], []
    for task in tasks:
        rows = summary.get(task, {})
        if not all(rows.get(n) for n in (ffa, lora, bitfit)):
            return None
        s1, d1 = paired(rows[ffa], rows[bitfit])
        s2, d2 = paired(rows[ffa], rows[lora])
        if len(s1) < 3 or len(s2) < 3:
            return None
        vs_bitfit.append(statistics.fmean(d1))
        vs_lora.append(statistics.fmean(d2))
    return all(d >= 0 for d in vs_bitfit) and statistics.fmean(vs_lora) > 0


def task_label(task: str) -> str:
    return f"{task} (held out)" if task in HELD_OUT else task


def _phases(s: dict, seed: int) -> tuple[float, float] | None:
    """(probe phase alone, final) accuracy of one run, or None without a probe phase."""
    probe = s.get("probe_by_seed", {}).get(seed)
    return None if probe is None else (probe, s["by_seed"][seed])


def held_out_lines(summary: dict) -> list[str]:
    """On each held-out task: DP-BiTFiT eps=8 minus the same run without privacy, paired by
    seed, split into what the head-first probe phase and what the bias phase contributed
    (private minus non-private, each phase), with both runs' resolved schedules."""
    dp_name, np_name = ROW_BY_KEY["dp-8"].name, ROW_BY_KEY["np-bias"].name
    lines = []
    for task in [t for t in summary if t in HELD_OUT]:
        dp, npb = summary[task].get(dp_name), summary[task].get(np_name)
        if not dp or not npb:
            continue
        seeds, diffs = paired(dp, npb)
        if not seeds:
            continue
        gap = statistics.fmean(diffs)
        p = npb["mean"] / 100  # binomial standard error of one run's test accuracy
        se = 100 * (p * (1 - p) / npb["n_test"]) ** 0.5
        lines.append(
            f"- {task} ({dp['n_train']} train / {dp['n_test']} test, {dp.get('n_classes')} "
            f"classes, median {dp.get('median_words'):g} words; standard error of one test "
            f"accuracy {se:.1f} points): {dp_name} minus {np_name}: {gap:+.1f} over "
            f"{len(seeds)} seed(s): {_each(seeds, diffs)}; within 3 points: "
            f"{'met' if gap >= -3 else 'MISSED'}"
        )
        for name, s in ((dp_name, dp), (np_name, npb)):
            sigma = s.get("noise_multiplier")
            noise = f"sigma {sigma:.3f}" if sigma else "no noise, no clipping"
            cpu = f", {s['cpu_s']:.0f} CPU s per run" if s.get("cpu_s") else ""
            lines.append(
                f"  - {name}: batch {s['batch_size']}, {s.get('head_first_steps') or 0} "
                f"head-first steps, then {s['steps']} bias steps at lr {s['lr']:g}, {noise}{cpu}"
            )
        both = [(k, _phases(dp, k), _phases(npb, k)) for k in seeds]
        both = [(k, a, b) for k, a, b in both if a and b]
        if both:
            probe_part = [a[0] - b[0] for _, a, b in both]
            bias_part = [(a[1] - a[0]) - (b[1] - b[0]) for _, a, b in both]
            each = "; ".join(
                f"seed {k}: private probe {a[0]:.1f} -> {a[1]:.1f} ({a[1] - a[0]:+.1f}), "
                f"non-private probe {b[0]:.1f} -> {b[1]:.1f} ({b[1] - b[0]:+.1f})"
                for k, a, b in both
            )
            probe_gap, bias_gap = statistics.fmean(probe_part), statistics.fmean(bias_part)
            lines.append(
                f"  - the gap by phase (private minus non-private, mean over {len(both)} "
                f"seed(s)): probe phase {probe_gap:+.1f}, bias phase {bias_gap:+.1f}; {each}"
            )
            if gap < -3:
                lines.append("  - " + _likely_cause(dp, npb, probe_gap, bias_gap))
        moved = _phase_evidence((("private", dp), ("non-private", npb)), seeds)
        if moved:
            lines.append(
                "  - what each bias phase did to the model its probe left (test predictions "
                "newly right / newly wrong; L2 change of the backbone biases, and of the head; "
                "mean training loss by epoch, non-private runs only): " + moved
            )
        ties = _ties(((dp_name, dp), (np_name, npb)), seeds)
        if ties:
            lines.append(
                f"  - {ties}: an accuracy unchanged by the bias phase with test predictions "
                "changed is a tie (as many newly right as newly wrong), not a phase that did "
                "not train"
            )
    return lines


def _ties(runs, seeds: list[int]) -> str:
    """The runs whose bias phase left the accuracy exactly as its probe's while changing
    predictions, as 'name seed k, ...' ('' if none)."""
    out = []
    for name, s in runs:
        for k in seeds:
            b = s.get("after_probe_by_seed", {}).get(k)
            if b and b["predictions_changed"] and b["newly_right"] == b["newly_wrong"]:
                out.append(f"{name} seed {k}")
    return ", ".join(out)


def _against(v: dict, b: dict) -> str:
    seeds, diffs = paired(v, b)
    return (
        f"{statistics.fmean(diffs):+.1f} over {len(seeds)} seed(s)" if seeds else "no shared seed"
    )


def tfidf_gap_lines(summary: dict) -> list[str]:
    """On each held-out task: where the fine-tunes' loss to TF-IDF + LR comes from. The
    frozen probes show what the bundled encoder's features carry before any training; the
    non-private fine-tunes show what training adds to them (all paired by seed)."""
    tfidf_name = ROW_BY_KEY["tfidf"].name
    np_bias, np_full = ROW_BY_KEY["np-bias"].name, ROW_BY_KEY["np-full"].name
    lines = []
    for task in [t for t in summary if t in HELD_OUT]:
        rows = summary[task]
        tfidf = rows.get(tfidf_name)
        probes = {n: s for n, s in rows.items() if n.startswith("frozen probe")}
        if not tfidf or not probes:
            continue
        p = tfidf["mean"] / 100
        se = 100 * (p * (1 - p) / tfidf["n_test"]) ** 0.5
        named = [*sorted(probes), np_bias, np_full]
        each = "; ".join(
            f"{n} {rows[n]['mean']:.1f} [{len(rows[n]['seeds'])} seed(s)] "
            f"({_against(rows[n], tfidf)})"
            for n in named
            if n in rows
        )
        lines.append(
            f"- {task}: {tfidf_name} {tfidf['mean']:.1f} over {len(tfidf['seeds'])} seed(s) "
            f"(standard error of one test accuracy {se:.1f} points); each row minus it: {each}"
        )
        best_name, best = max(probes.items(), key=lambda kv: kv[1]["mean"])
        seeds, diffs = paired(best, tfidf)
        if not seeds:
            continue
        probe_gap = statistics.fmean(diffs)
        if probe_gap < 0:
            lines.append(
                f"  - the frozen embedding alone ({best_name}, the best pooling) is "
                f"{-probe_gap:.1f} points below {tfidf_name} before any training: the bundled "
                "22M-parameter encoder's pooled features carry less of this task than word "
                "and bigram counts, so every fine-tune starts behind the baseline (a property "
                "of the encoder, not of the training loop)"
            )
        else:
            lines.append(
                f"  - the frozen embedding alone ({best_name}) is not below {tfidf_name} "
                f"({probe_gap:+.1f}): a fine-tune that ends below it loses in training"
            )
        for name in (np_bias, np_full):
            s = rows.get(name)
            if not s:
                continue
            gain = _against(s, best)
            seeds, diffs = paired(s, tfidf)
            verdict = "ends above" if seeds and statistics.fmean(diffs) >= 0 else "still ends below"
            fits = "; ".join(
                f"seed {k} " + " -> ".join(f"{x:.2f}" for x in b["epoch_losses"])
                for k, b in sorted(s.get("after_probe_by_seed", {}).items())
                if b.get("epoch_losses")
            )
            lines.append(
                f"  - {name} minus {best_name}: {gain}; it {verdict} {tfidf_name} "
                f"({_against(s, tfidf)})"
                + (f"; its training loss by epoch after the probe: {fits}" if fits else "")
            )
    return lines


def _phase_evidence(runs, seeds: list[int]) -> str:
    """Each run's recorded bias phase (phase_record), or '' if none recorded one."""
    parts = []
    for k in seeds:
        for who, s in runs:
            b = s.get("after_probe_by_seed", {}).get(k)
            if not b:
                continue
            share = b["backbone_change_l2"] / b["backbone_norm"] if b["backbone_norm"] else 0.0
            loss = " -> ".join(f"{x:.3f}" for x in b["epoch_losses"])
            parts.append(
                f"seed {k} {who}: {b['newly_right']} / {b['newly_wrong']} of {b['test_n']} "
                f"({b['predictions_changed']} changed), biases moved {b['backbone_change_l2']:.2f}"
                f" ({100 * share:.1f}% of their norm), head {b['head_change_l2']:.2f}"
                + (f", loss {loss}" if loss else "")
            )
    return "; ".join(parts)


def _likely_cause(dp: dict, npb: dict, probe_gap: float, bias_gap: float) -> str:
    """The phase that loses most of a missed gap, and what differs between the two runs in
    it (a reading of the numbers above, not a tested cause)."""
    if bias_gap <= probe_gap:
        return (
            "likely cause (not tested): the bias phase, which loses more than the probe: the "
            f"private run takes {dp['steps']} noised steps of batch {dp['batch_size']} where the "
            f"non-private one takes {npb['steps']} of {npb['batch_size']}" + _moves(dp, npb)
        )
    return (
        "likely cause (not tested): the head-first probe, which loses more than the bias "
        f"phase: {dp.get('head_first_steps')} noised steps of batch {dp['batch_size']} against "
        f"{npb.get('head_first_steps')} non-private steps of {npb['batch_size']}"
    )


def _moves(dp: dict, npb: dict) -> str:
    """How far each run's biases moved from its probe (recorded seeds), or ''."""
    a, b = dp.get("after_probe_by_seed", {}), npb.get("after_probe_by_seed", {})
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return ""
    mean_dp = statistics.fmean(a[k]["backbone_change_l2"] for k in seeds)
    mean_np = statistics.fmean(b[k]["backbone_change_l2"] for k in seeds)
    return (
        f"; measured on seed(s) {', '.join(map(str, seeds))}, the private biases moved "
        f"{mean_dp:.2f} from the probe (L2) against {mean_np:.2f} without privacy, "
        + ("further: the noise moves them, not too few steps" if mean_dp > mean_np else "less")
    )


# the rows docs/bias_lora.md quotes, in this order, and its markers
MODE_ROWS = ("np-full", "np-bias", "dp-full-8", "dp-8", "dp-lora-8", "dp-bias-lora-8",
             "dp-bias-ffa-8", "dp-1", "dp-bias-lora-1", "dp-bias-ffa-1")  # fmt: skip
MODES_DOC_MARKERS = ("<!-- utility modes: begin -->", "<!-- utility modes: end -->")


def modes_doc_markers(tag: str) -> tuple[str, str]:
    """docs/bias_lora.md's markers around the modes block of `tag`'s runs (the GPU runs' block
    keeps its original markers)."""
    if tag == "utility_gpu":
        return MODES_DOC_MARKERS
    return f"<!-- utility modes {tag}: begin -->", f"<!-- utility modes {tag}: end -->"


def modes_block(summary: dict, source: str) -> str:
    """docs/bias_lora.md's block: each mode's accuracy per task, the two mode targets, and each
    LoRA mode minus DP-BiTFiT paired by seed, from `source`'s runs."""
    tasks = list(summary)
    lines = [
        f"From `{source}` (test accuracy %, mean ± sd over seeds, number of seeds):",
        "",
        "| row | " + " | ".join(task_label(t) for t in tasks) + " |",
        "|---|" + "---|" * len(tasks),
    ]
    for key in MODE_ROWS:
        name = ROW_BY_KEY[key].name
        cells = [_cell(summary[t].get(name), wall=False) for t in tasks]
        if any(c != "not run" for c in cells):
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Targets:", "", *mode_targets(summary), "", "Paired by seed:", ""]
    lines += interval_lines(summary)
    return "\n".join(lines)


def markdown(summary: dict, header: str, failures: list[dict]) -> str:
    tasks = list(summary)
    names = row_order(summary)
    lines = [
        header,
        "",
        "Test accuracy (%), mean ± sd over seeds (number of seeds), then wall time per run "
        "(load, train, evaluate; the three probe rows share one run).",
        "",
    ]
    lines.append("| row | " + " | ".join(task_label(t) for t in tasks) + " |")
    lines.append("|---|" + "---|" * len(tasks))
    for name in names:
        cells = [_cell(summary[t].get(name)) for t in tasks]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Training sizes and resolved defaults of the dpfit rows (first seed run; the probe "
        "phase alone is the mean over the seeds run):",
        "",
    ]
    lines.append(
        "| task | row | n train | n test | batch | epochs | steps | head-first steps "
        "| probe phase alone (%) | lr | epsilon |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for t in tasks:
        for name in names:
            s = summary[t].get(name)
            if s is None or s.get("steps") is None:
                continue
            eps = "∞" if s["epsilon"] in (None, float("inf")) else f"{s['epsilon']:.2f}"
            probe = s.get("probe_phase") or []
            probe_cell = f"{statistics.fmean(probe):.1f}" if probe else "-"
            lines.append(
                f"| {t} | {name} | {s['n_train']} | {s['n_test']} | {s['batch_size']} | "
                f"{s['epochs']} | {s['steps']} | {s.get('head_first_steps') or 0} | "
                f"{probe_cell} | {s['lr']} | {eps} |"
            )
    lines += ["", "Targets on what has finished:", "", *(targets(summary) or ["- (none yet)"])]
    lines += mode_targets(summary)
    held_out = held_out_lines(summary)
    if held_out:
        lines += [
            "",
            "Held-out tasks (never used to choose the recipe's defaults): DP-BiTFiT at eps 8 "
            "against the same run without privacy (non-private bias-only: same model, head, "
            "split and seed; noise 0, no clipping, its own reference schedule), paired by seed "
            "(points of test accuracy). The gap is the sum of what each phase adds: the "
            "head-first probe alone (private minus non-private probe) and the bias phase "
            "(private gain over its probe minus the non-private gain over its probe).",
            "",
            *held_out,
        ]
    gaps = tfidf_gap_lines(summary)
    if gaps:
        lines += [
            "",
            "Held-out tasks against TF-IDF + LR: where the fine-tunes' loss to the baseline "
            "comes from (points of test accuracy, paired by seed; the frozen probes are the "
            "encoder's features before any training, fitted by logistic regression):",
            "",
            *gaps,
        ]
    modes = interval_lines(summary)
    if modes:
        lines += [
            "",
            "The LoRA modes against DP-BiTFiT at the same epsilon, paired by seed (points of "
            "test accuracy; mean difference and its 95% t interval where two or more seeds "
            "pair):",
            "",
            *modes,
        ]
    variants = variant_lines(summary)
    if variants:
        lines += [
            "",
            "One choice changed, paired by seed (points of test accuracy):",
            "",
            *variants,
        ]
    against = variant_lines(summary, AGAINST_TFIDF)
    if against:
        lines += [
            "",
            "Against TF-IDF + LR, paired by seed (points of test accuracy; the baseline is "
            "non-private, so a DP row is held to a bar that pays nothing for privacy):",
            "",
            *against,
        ]
    against = variant_lines(summary, AGAINST_DP_BOW)
    if against:
        lines += [
            "",
            "Against the DP bag of words (hashed n-gram LR) at the same epsilon, paired by "
            "seed (points of test accuracy; both rows private):",
            "",
            *against,
        ]
    if failures:
        lines += ["", "Runs that failed:", ""]
        lines += [
            f"- {f['task']} / {f['row']} / seed {f['seed']}: {f['error'][:160]}"
            + (" (run again since; that run is the one in the tables)" if f["rerun"] else "")
            for f in failures
        ]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(summary)
    names = row_order(summary)
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 0.32 * len(names) + 1.6))
    if len(tasks) == 1:
        axes = [axes]
    for ax, t in zip(axes, tasks, strict=True):
        ys, ms, sds, colors = [], [], [], []
        for i, n in enumerate(names):
            s = summary[t].get(n)
            if s is None:
                continue
            ys.append(i)
            ms.append(s["mean"])
            sds.append(s["sd"] or 0.0)
            colors.append("tab:red" if "DP" in n else "tab:blue" if "private" in n else "gray")
        ax.barh(ys, ms, xerr=sds, color=colors, capsize=2)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names if ax is axes[0] else [""] * len(names), fontsize=7)
        ax.invert_yaxis()
        ax.set_title(task_label(t), fontsize=9)
        ax.set_xlabel("test accuracy (%)")
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def failed_runs(records: list[dict], scale: Scale) -> list[dict]:
    """Failed runs at `scale`, each marked with whether its key has since finished."""
    done = {r["key"] for r in records if "error" not in r}
    return [
        {**r, "rerun": r["key"] in done}
        for r in records
        if r.get("scale") == scale.tag() and "error" in r
    ]


def machine() -> dict:
    """Where a run ran: its table's wall times mean nothing without it."""
    import torch

    if torch.cuda.is_available():
        return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    return {"device": f"{platform.machine()} CPU", "torch": torch.__version__}


def where(records: list[dict]) -> str:
    """The header's machine clause: the devices the runs recorded, else this machine's."""
    import torch

    devices = sorted({r["device"] for r in records if r.get("device")})
    if devices and any("CPU" not in d for d in devices):
        versions = sorted({r["torch"] for r in records if r.get("torch")})
        return (
            f"runs on {', '.join(devices)}, torch {', '.join(versions)}: wall times are one "
            "run's, with other runs sharing the device."
        )
    return (
        f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        "shared CPU: wall times are upper bounds."
    )


def dropout_clause(records: list[dict]) -> str:
    """The dropout the dpfit rows ran with: recorded since private runs turned it off
    (dpfit.recipe.PRIVATE_DROPOUT); a run without the field ran the model's own (0.1)."""
    rates = sorted({str(r["dropout"]) for r in records if "dropout" in r})
    if not rates:
        return " dpfit rows ran with the model's dropout (0.1)."
    return (
        f" dpfit rows' dropout rates: {', '.join(rates)} (per run in the log; 'model' = the "
        "model's 0.1, as in runs that record none)."
    )


def write_outputs(
    records: list[dict], scale: Scale, out: Path, tag: str, seeds, precision: str = "fp32"
) -> str:
    summary = summarize(records, scale)
    size = (
        f"quick mode: a random {scale.max_train} training examples per task (seeded) and a "
        f"random {scale.max_test} test examples"
        if scale.max_train
        else "full training and test splits"
    )
    header = (
        f"# Utility suite: bundled all-MiniLM-L6-v2, dpfit defaults only\n\n{size}; seeds run: "
        f"{sorted({r['seed'] for r in records if r.get('scale') == scale.tag()})} (asked: "
        f"{list(seeds)}). delta = dpfit's default min(1e-5, 1/n^1.1). {where(records)}"
        + (f" dpfit rows run with `--precision {precision}`." if precision != "fp32" else "")
        + dropout_clause(records)
    )
    md = markdown(summary, header, failed_runs(records, scale))
    (out / f"{tag}.md").write_text(md)
    payload = {"scale": scale.tag(), "summary": summary, "runs": records, "header": header}
    (out / f"{tag}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    if summary:
        plot(summary, out / f"{tag}.png", f"dpfit defaults, {size}")
    return md


def precision_comparison(
    records: list[dict], fp32_records: list[dict], scale: Scale, command: str = ""
) -> str:
    """Each bf16 run beside the fp32 runs of its row, task and scale (their seeds' spread)."""
    low, ref = summarize(records, scale), summarize(fp32_records, scale)
    lines = [
        "# Utility suite: bf16 runs beside the fp32 runs",
        "",
        (f"Generated by `{command}`. " if command else "")
        + f"`dpfit train --precision bf16` (bf16 autocast, float32 mechanism), scale "
        f"{scale.tag()}, against the fp32 runs of the same row in `utility_runs.jsonl`. The bf16 "
        "column has the seeds listed (one seed is one run: no spread of its own); noise is "
        "drawn fresh in every run, so even the same seed is not a paired comparison. Accuracy "
        "in %.",
        "",
        "| task | row | bf16: seeds, accuracy | bf16 mean | fp32: seeds, mean ± sd [min-max] | "
        "bf16 runs against the fp32 range | bf16 mean - fp32 mean |",
        "|---|---|---|---|---|---|---|",
    ]
    verdicts: list[bool] = []
    for task, rows in low.items():
        for name, s in rows.items():
            bf = ", ".join(f"{s['by_seed'][k]:.1f} (seed {k})" for k in sorted(s["by_seed"]))
            bf_mean = sum(s["by_seed"].values()) / len(s["by_seed"])
            r = ref.get(task, {}).get(name)
            if r is None:
                lines.append(f"| {task} | {name} | {bf} | {bf_mean:.1f} | not run | | |")
                continue
            vals = list(r["by_seed"].values())
            sd = f" ± {r['sd']:.1f}" if r["sd"] is not None else ""
            where = {
                "below" if v < min(vals) else "above" if v > max(vals) else "inside"
                for v in s["by_seed"].values()
            }
            lines.append(
                f"| {task} | {name} | {bf} | {bf_mean:.1f} | {r['seeds']}, {r['mean']:.1f}{sd} "
                f"[{min(vals):.1f}-{max(vals):.1f}] | {', '.join(sorted(where))} | "
                f"{bf_mean - r['mean']:+.1f} |"
            )
            if len(s["by_seed"]) >= 3:
                verdicts.append(min(vals) <= bf_mean <= max(vals))
    lines += [
        "",
        "Criterion, fixed before the bf16 seeds 1 and 2 ran: `--precision auto` (bf16 on this "
        "CPU) may be `dpfit train`'s default only if, on every task, the mean of at least 3 "
        "bf16 seeds lies inside the range of the fp32 seeds (the seed spread).",
        "",
        (
            "Verdict: not enough bf16 seeds (fewer than 3 on some task)."
            if len(verdicts) < sum(len(rows) for rows in low.values()) or not verdicts
            else f"Verdict: {'met' if all(verdicts) else 'not met'} "
            f"({sum(verdicts)} of {len(verdicts)} tasks inside)."
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--rows", nargs="+", default=[r.key for r in ROWS], choices=list(ROW_BY_KEY))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--quick", action="store_true", help=f"{QUICK_TRAIN} train / {QUICK_TEST} test")
    p.add_argument("--max-train", type=int, help="random training subset per task")
    p.add_argument("--max-test", type=int, help="random test subset per task")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--tag", default=None, help="log and table name (default utility[_bf16])")
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="dpfit rows' compute precision; bf16 runs get their own log and table",
    )
    p.add_argument(
        "--dropout",
        type=parse_rate,
        help="dpfit rows' dropout rate (or 'model'); default: dpfit's rule",
    )
    p.add_argument("--table-only", action="store_true", help="rebuild outputs from the log")
    p.add_argument(
        "--docs",
        action="store_true",
        help="also write the modes block of docs/bias_lora.md from this tag's log",
    )
    args = p.parse_args(argv)
    if args.tag is None:
        args.tag = "utility" if args.precision == "fp32" else f"utility_{args.precision}"
    if args.precision != "fp32" and any(ROW_BY_KEY[k].kind != "dpfit" for k in args.rows):
        p.error("--precision applies to the dpfit rows only: pass --rows with dpfit rows")
    max_train = args.max_train or (QUICK_TRAIN if args.quick else None)
    max_test = args.max_test or (QUICK_TEST if args.quick else None)
    scale = Scale(max_train, max_test)

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    logging.getLogger("absl").setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / f"{args.tag}_runs.jsonl"  # one log for every scale
    # the tables of a subset scale sit beside the full suite's, not over it
    table_tag = args.tag if scale.max_train is None else f"{args.tag}_{scale.tag()}"
    if not args.table_only:
        done = {r["key"] for r in read_log(log) if "error" not in r}
        # seed-major, then row priority, then task: a partial run covers every task first
        for seed in args.seeds:
            for rk in [r.key for r in ROWS if r.key in args.rows]:
                for task in args.tasks:
                    row = ROW_BY_KEY[rk]
                    key = run_key(row, task, seed, scale)
                    if key in done:
                        continue
                    logger.info("run %s", key)
                    t0, c0 = time.perf_counter(), time.process_time()
                    base = {
                        "key": key,
                        "task": task,
                        "seed": seed,
                        "scale": scale.tag(),
                        **machine(),
                    }
                    try:
                        recs = run_row(row, task, seed, scale, args.precision, args.dropout)
                    except Exception as e:
                        logger.warning("%s failed: %s", key, traceback.format_exc(limit=3))
                        recs = [{"row": row.name, "error": f"{type(e).__name__}: {e}"}]
                    wall = time.perf_counter() - t0
                    cpu = time.process_time() - c0  # user + sys: on a shared machine, the cost
                    with open(log, "a") as f:
                        for r in recs:
                            rec = {**base, "wall_s": wall, "cpu_s": cpu, **r}
                            f.write(json.dumps(rec, default=str) + "\n")
                    logger.info(
                        "done %s in %.0f s: %s", key, wall, [r.get("accuracy") for r in recs]
                    )
                    write_outputs(
                        read_log(log), scale, args.out, table_tag, args.seeds, args.precision
                    )
    print(write_outputs(read_log(log), scale, args.out, table_tag, args.seeds, args.precision))
    if args.docs:
        block = modes_block(summarize(read_log(log), scale), f"benchmarks/results/{table_tag}.md")
        write_between_markers(
            HERE.parent / "docs" / "bias_lora.md", modes_doc_markers(table_tag), block
        )
    if args.precision != "fp32":
        command = (
            f"python benchmarks/utility.py --precision {args.precision} --rows "
            f"{' '.join(args.rows)} --seeds {' '.join(map(str, args.seeds))}"
            + (f" --max-train {scale.max_train}" if scale.max_train else "")
            + (f" --max-test {scale.max_test}" if scale.max_test else "")
        )
        md = precision_comparison(
            read_log(log), read_log(args.out / "utility_runs.jsonl"), scale, command
        )
        (args.out / f"{table_tag}_vs_fp32.md").write_text(md)
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
