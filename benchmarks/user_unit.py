"""What does user-level privacy cost? The same rows trained with each row as the unit and with
each user (all their rows, clipped as one) as the unit, at the same epsilon.

Two questions, for docs/train.md ("One person, many rows: user-level privacy"): on data with
many rows per person, how much test accuracy does `--privacy-unit user` give up against the
row-level run on the same file? And does `--tune` (private selection of lr and epochs, by
user) pay at the same user-level epsilon (arm "user-tune" against "user")? Data: the bundled Rotten Tomatoes snippets, whose movie is the
"user" (about 25 snippets each): the first TRAIN_MOVIES movies by name train, the next
EVAL_MOVIES are the test set of both arms (so both score the same rows). eps 8, the recipe's
defaults otherwise; paired by seed (the seed sets the head's initialisation and the
row-hash keys; noise and sampling are fresh OS draws).

    nice -n 10 python benchmarks/user_unit.py run --seeds 0 1
    python benchmarks/user_unit.py report

Each run is a JSON line in results/user_unit_runs.jsonl (runs already there are skipped);
results/user_unit.md is rendered from it. CPU budget: about 2 CPU-minutes a run (3,000 rows), about 3 times that for "user-tune".
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]

from harness.records import append_jsonl, read_jsonl  # noqa: E402
from harness.render import write_between_markers  # noqa: E402
from harness.stats import t_interval  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
LOG = RESULTS / "user_unit_runs.jsonl"
REPORT = RESULTS / "user_unit.md"
DOCS = ROOT / "docs" / "train.md"
MARKERS = ("<!-- user_unit:begin -->", "<!-- user_unit:end -->")
EPSILON = 8.0
TRAIN_MOVIES, EVAL_MOVIES = 120, 40
ARMS = ("row", "user", "user-tune")
SCORE_NOISE = 5.0  # dpfit.run.tune.SCORE_NOISE (checked by the benchmark's test)
NAMES = ("neg", "pos")


def write_files(folder: Path) -> tuple[Path, Path]:
    """train.csv (text, label, movie) and test.csv from disjoint movies, chosen by name."""
    from dpfit.data.bundled import rotten_tomatoes

    rows = rotten_tomatoes()
    movies = sorted({r.group for r in rows})
    train_movies = set(movies[:TRAIN_MOVIES])
    test_movies = set(movies[TRAIN_MOVIES : TRAIN_MOVIES + EVAL_MOVIES])
    paths = []
    for name, keep in (("train.csv", train_movies), ("test.csv", test_movies)):
        path = folder / name
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(("text", "label", "movie"))
            w.writerows((r.text, NAMES[r.label], r.group) for r in rows if r.group in keep)
        paths.append(path)
    return paths[0], paths[1]


def run_one(seed: int, arm: str, threads: int) -> dict:
    import time

    import torch

    from dpfit.run.config import TrainConfig
    from dpfit.run.tune import tune
    from dpfit.train import train

    torch.set_num_threads(threads)
    start = time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        train_csv, test_csv = write_files(Path(tmp))
        unit = dict(privacy_unit="user", user_column="movie") if arm != "row" else {}
        config = TrainConfig(
            data=str(train_csv), eval_data=str(test_csv), epsilon=EPSILON, seed=seed,
            labels=NAMES, **unit,
        )  # fmt: skip
        m = (tune if arm == "user-tune" else train)(config).metrics
    return {
        "seed": seed, "arm": arm, "epsilon": m["epsilon"], "accuracy": m["accuracy"],
        "privacy_unit": m.get("privacy_unit"), "n": m.get("users", m.get("train_examples")),
        "eval_n": m.get("eval_n"), "threads": threads, "lr": m["lr"], "epochs": m["epochs"],
        "cpu_seconds": time.process_time() - start,
    }  # fmt: skip


def report(rows: list[dict]) -> str:
    by = {(r["seed"], r["arm"]): r for r in rows}
    lines = [
        "# User-level against row-level privacy on the same rows (pilot)",
        "",
        f"Rendered by `python benchmarks/user_unit.py report` from `{LOG.name}`. Rotten "
        f"Tomatoes snippets of {TRAIN_MOVIES} movies (a movie = a user), test set the next "
        f"{EVAL_MOVIES} movies for both arms; eps {EPSILON:g}; paired by seed.",
        "",
        "| seed | row-level (n rows) | user-level (n users) | user - row |",
        "|---|---|---|---|",
    ]
    diffs = []
    for seed, r, u in paired(by, "row", "user"):
        d = u["accuracy"] - r["accuracy"]
        diffs.append(d)
        lines.append(
            f"| {seed} | {r['accuracy']:.3f} (n={r['n']}) | {u['accuracy']:.3f} "
            f"(n={u['n']}) | {d:+.3f} |"
        )
    if diffs:
        lines += ["", f"{mean_text('user - row', diffs)} A pilot: few seeds, one dataset."]
    lines += ["", *tune_lines(by)]
    return "\n".join(lines) + "\n"


def paired(by: dict, a: str, b: str) -> list[tuple[int, dict, dict]]:
    """(seed, run of arm a, run of arm b) for every seed with both, in seed order."""
    seeds = sorted({s for s, _ in by})
    return [(s, by[(s, a)], by[(s, b)]) for s in seeds if (s, a) in by and (s, b) in by]


def tune_lines(by: dict) -> list[str]:
    """`--tune` at the user level against the untuned user-level run, paired by seed."""
    lines = [
        "## `--tune` at the user level",
        "",
        "The whole selection (validation users, candidates, scores) at the same eps; the score "
        "is the sum over validation users of the fraction of their rows right.",
        "",
        "| seed | user-level | user-level --tune (lr, epochs) | tune - untuned | CPU s untuned / tune |",
        "|---|---|---|---|---|",
    ]  # fmt: skip
    diffs = []
    for seed, u, t in paired(by, "user", "user-tune"):
        d = t["accuracy"] - u["accuracy"]
        diffs.append(d)
        cpu = f"{u.get('cpu_seconds', float('nan')):.0f} / {t['cpu_seconds']:.0f}"
        lines.append(
            f"| {seed} | {u['accuracy']:.3f} | {t['accuracy']:.3f} ({t['lr']:g}, "
            f"{t['epochs']}) | {d:+.3f} | {cpu} |"
        )
    if not diffs:
        return [*lines, "", "No paired run yet."]
    return [*lines, "", mean_text("tune - untuned", diffs)]


def mean_text(what: str, diffs: list[float]) -> str:
    """ "Mean <what> ... over n seeds, 95% paired t interval [...]." of paired differences."""
    ci = t_interval(diffs)
    where = f"[{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "no interval below two seeds"
    return (
        f"Mean {what} {statistics.fmean(diffs):+.3f} over {len(diffs)} seeds, 95% paired t "
        f"interval {where}."
    )


def docs_block(rows: list[dict]) -> str:
    """docs/train.md's bullet on what the user unit costs, from the runs (None-safe)."""
    by = {(r["seed"], r["arm"]): r for r in rows}
    costs = paired(by, "row", "user")
    if not costs:
        return "* What it costs: not measured yet (`benchmarks/user_unit.py`)."
    user = " and ".join(f"{u['accuracy']:.3f}" for _, _, u in costs)
    row = " and ".join(f"{r['accuracy']:.3f}" for _, r, _ in costs)
    n_users, n_rows = costs[0][2]["n"], costs[0][1]["n"]
    seeds = [s for s, _, _ in costs]
    tuned = paired(by, "user", "user-tune")
    tune_text = ""
    if tuned:
        pairs = ", ".join(f"{t['accuracy']:.3f} against {u['accuracy']:.3f}" for _, u, t in tuned)
        val = [TRAIN_MOVIES - t["n"] for _, _, t in tuned]  # the rest fit
        tune_text = (
            f"\n* `--tune` at the user level on the same data ({' and '.join(map(str, val))}\n"
            f"  validation users, so one std of the score's noise is {SCORE_NOISE / max(val):.0%}"
            f" or more of\n  accuracy): tuned against untuned {pairs} ({len(tuned)} seed(s),\n"
            "  `benchmarks/results/user_unit.md`)."
        )
    return (
        f"* What it costs: on {TRAIN_MOVIES} movies of Rotten Tomatoes snippets (a movie as the\n"
        f"  user), eps {EPSILON:g}, the user-level run scored {user} where the row-level run on\n"
        f"  the same rows scored {row} ({len(seeds)} seed(s), `benchmarks/results/user_unit.md`;\n"
        f"  n is {n_users} users instead of {n_rows:,} rows). It buys a guarantee for each person\n"
        "  rather than for each row. A pilot on one dataset, not a rule." + tune_text
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    r.add_argument("--threads", type=int, default=1)
    sub.add_parser("report")
    args = p.parse_args(argv)
    if args.cmd == "run":
        done = {(x["seed"], x["arm"]) for x in read_jsonl(LOG)} if LOG.exists() else set()
        for seed in args.seeds:
            for arm in ARMS:
                if (seed, arm) not in done:
                    append_jsonl(LOG, run_one(seed, arm, args.threads))
    rows = read_jsonl(LOG) if LOG.exists() else []
    REPORT.write_text(report(rows))
    write_between_markers(DOCS, MARKERS, docs_block(rows))
    print(REPORT.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
