"""``dpfit federated``: run client-level DP federated fine-tuning and write metrics and plots.

The top-level CLI imports ``add_arguments`` and ``run`` lazily and wires them as a subcommand.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import warnings
from pathlib import Path
from typing import Any

from dpfit.federated.clipping import clip_rule_names
from dpfit.federated.data_cli import (
    add_data_arguments,
    check_user_data,
    data_notes,
    data_options,
)
from dpfit.federated.outputs import (  # noqa: F401 - re-exported: their old home
    ROUND_COLUMNS,
    _jsonable,
    majority_accuracy,
    plot_rounds,
    summary,
    write_files,
    write_outputs,
)

logger = logging.getLogger(__name__)

# The run `dpfit federated` makes with no options (docs/federated.md, "Default run"); these
# override the defaults given with each option below. Chosen by a rule, not on test data:
# - many small clients, the cross-device setting client-level DP is for: the training split
#   cut into N = 1000 IID clients of 10 examples (all but a few of its 10,233);
# - m, the expected clients per round, the smallest multiple of 10 for which the noise on the
#   averaged update is at most half of the largest update, z * sqrt(d) / m <= 1/2 (d = number
#   of trained values, z calibrated to eps = 8 over the rounds; tests/federated/test_cli.py
#   checks it). Local mode `head` (d = 770) meets it at m = 30; `bias` (d ~ 27k) would need
#   m ~ 400 clients a round, far from a few minutes on 2 cores;
# - local training as in benchmarks/federated.py: AdamW lr 1e-2, 2 epochs, batch 16;
# - 10 rounds, in-process (`--engine local`: the same ClientApp and Strategy without Ray; the
#   simulation engine was much slower on 2 cores with 1000 virtual nodes).
# Client learning rate by local mode when --lr is not given: a linear head on frozen features
# takes a large step; BiTFiT clients at 1e-2 learn nothing even centrally, 3e-3 is within
# about a point of central training (benchmarks/results/federated_central_bias*.md); LoRA
# keeps the usual adapter rate.
LOCAL_LR = {"head": 1e-2, "bias": 3e-3, "lora": 1e-3, "lora-top": 1e-3}
# what each local mode trains, in one phrase (the batched engine's refusal lists them)
LOCAL_MODE_SUMMARY = {
    "bias": "BiTFiT: every bias + head",
    "lora": "peft LoRA adapters + head",
    "head": "linear probe on frozen features",
    "lora-top": "LoRA on the top layer's query/value + its biases + head",
}

STAGE_DELAY_S = 2.0  # a stage that ends sooner shows no progress (tiny runs stay terse)

DEFAULT_RUN = {
    "engine": "local",
    "clients": 1000,
    "examples_per_client": 10,
    "clients_per_round": 30.0,
    "rounds": 10,
    "local_mode": "head",
    "local_epochs": 2,
    "local_batch_size": 16,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``dpfit federated``; DEFAULT_RUN's values replace the defaults below."""
    p = parser
    p.add_argument("--method", choices=clip_rule_names(), default="lac")
    p.add_argument("--epsilon", type=float, default=8.0, help="client-level target epsilon")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument(
        "--noise-multiplier",
        type=float,
        default=None,
        help="fix z instead of calibrating to --epsilon; 0 = no noise (epsilon = inf)",
    )
    p.add_argument(
        "--initial-clip",
        "--c-init",
        dest="initial_clip",
        type=float,
        default=1.0,
        help="C_init of every rule: C (fixed), C0 (quantile, dynamic), the vote's centre (lac, "
        "clac: candidates at or below it; lac-2s: 0.1x to 10x it), R (automatic)",
    )
    p.add_argument(
        "--clients", type=int, default=20, help="population N (not with a client column)"
    )
    p.add_argument(
        "--clients-per-round", type=float, default=5, help="expected m (Poisson, q = m/N)"
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--server-lr", type=float, default=1.0)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--local-batch-size", type=int, default=16)
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="client AdamW learning rate (default by --local-mode: "
        + ", ".join(f"{k} {v:g}" for k, v in LOCAL_LR.items())
        + ")",
    )
    p.add_argument(
        "--local-mode",
        choices=("bias", "lora", "head", "lora-top"),
        default="bias",
        help="what clients train: bias = BiTFiT (biases + head), lora = peft LoRA adapters + "
        "head (for models without biases, e.g. smollm2), head = linear probe on frozen "
        "features, lora-top = LoRA on the top layer's q/v + its biases + head; --engine "
        "batched runs lora-top and bias",
    )
    p.add_argument(
        "--local-optimizer",
        choices=("adamw", "sgd"),
        default="adamw",
        help="client optimizer (no weight decay)",
    )
    p.add_argument("--lora-r", type=int, default=4)
    p.add_argument(
        "--partition",
        choices=("iid", "dirichlet", "movie"),
        default=None,
        help="synthetic clients (default iid); movie: the bundled data's natural clients",
    )
    p.add_argument(
        "--alpha", "--dirichlet-alpha", dest="alpha", type=float, default=0.5,
        help="Dirichlet concentration",
    )  # fmt: skip
    p.add_argument(
        "--examples-per-client",
        type=int,
        default=32,
        help="cap; 0 = all (with --client-column: all by default; with --data and a "
        "synthetic partition, also sets N = rows // this unless --clients is given)",
    )
    add_data_arguments(p)
    p.add_argument("--eval-examples", type=int, default=200)
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="public randomness only: data split, partitions, model init, local shuffles",
    )
    p.add_argument(
        "--insecure-reproducible-noise",
        action="store_true",
        help="also draw client sampling and noise from --seed (reproducible, NOT private "
        "against anyone who knows the seed; recorded in metrics.json)",
    )
    p.add_argument(
        "--model",
        default="",
        help="folder, hub id, or a bundled model: minilm (default), smollm2",
    )
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--target-quantile", type=float, default=0.5)
    p.add_argument("--quantile-lr", type=float, default=0.2)
    p.add_argument(
        "--vote-noise",
        type=float,
        default=None,
        help="sigma_h of the LAC/CLAC vote (default: the Gaussian that alone spends "
        "--vote-budget-share of the target epsilon)",
    )
    p.add_argument("--vote-budget-share", type=float, default=0.1)
    p.add_argument(
        "--vote-factors",
        type=float,
        nargs="+",
        default=None,
        metavar="F",
        help="DP-LAC/CLAC: the vote's candidates are these multiples of --initial-clip "
        "(default 0.25 0.5 1, the paper's grid; add a factor above 1 when C_init may be too "
        "small: the vote can never pick above its largest candidate)",
    )
    p.add_argument("--loss-bound", type=float, default=2.0, help="L_max for DP-CLAC")
    p.add_argument("--loss-budget-share", type=float, default=0.1)
    p.add_argument(
        "--clac-significance",
        type=float,
        default=2.0,
        help="DP-CLAC shrinks C only on a loss decrease > k sqrt(2) x the noise std of a mean",
    )
    p.add_argument(
        "--auto-gamma", type=float, default=0.01, help="automatic: R / (||update|| + gamma)"
    )
    p.add_argument(
        "--clip-decay", type=float, default=0.5, help="dynamic: C_T / C_0 (C_t = C_0 rho^(t/T))"
    )
    p.add_argument(
        "--noise-decay", type=float, default=0.5, help="dynamic: z_T / z_0 (z_t = z_0 rho^(t/T))"
    )
    p.add_argument("--accountant", choices=("rdp", "pld"), default="rdp")
    p.add_argument(
        "--engine",
        choices=("simulation", "local", "batched"),
        default="simulation",
        help="Flower simulation engine (Ray), in-process (no Ray), or batched: all of a "
        "round's clients as one computation (needs --local-mode lora-top or bias; same server "
        "core)",
    )
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs for the simulation engine")
    p.add_argument("--checkpoint-dir", default=None, help="checkpoint each round; resume")
    p.add_argument(
        "--fork",
        action="store_true",
        help="continue a checkpoint that was already continued (a fork: releasing both runs "
        "costs the shared rounds plus both continuations' own rounds; refused without it)",
    )
    p.add_argument(
        "--output",
        default=None,
        help="folder for metrics.json, rounds.csv and plots; must not hold an earlier run "
        "(default: a new runs/federated-<date-time>/)",
    )
    p.add_argument(
        "--no-output", action="store_true", help="write no files (only the table or --json)"
    )
    p.add_argument("--json", action="store_true", help="print metrics as JSON")
    p.add_argument(
        "--write-app",
        metavar="DIR",
        default=None,
        help="write the Flower app for `flwr run` to DIR, with these options as its run "
        "config, and exit (docs/federated.md, Deployment)",
    )
    p.set_defaults(**DEFAULT_RUN)
    # None = not given: with --data, N and the per-client cap follow from the data's own
    # rule (data_options); without it, DEFAULT_RUN's values
    p.set_defaults(clients=None, examples_per_client=None)


def configs(args: argparse.Namespace):
    from dpfit.federated.server_config import ServerConfig
    from dpfit.federated.task_config import TaskConfig

    data = data_options(args, DEFAULT_RUN)
    task = TaskConfig(
        **data,
        model=args.model,
        local_mode=args.local_mode,
        lora_r=args.lora_r,
        max_length=args.max_length,
        local_epochs=args.local_epochs,
        local_batch_size=args.local_batch_size,
        lr=args.lr if args.lr is not None else LOCAL_LR[args.local_mode],
        alpha=args.alpha,
        eval_examples=args.eval_examples,
        seed=args.seed,
        local_optimizer=args.local_optimizer,
    )
    if task.data:
        check_user_data(task, args.clients_per_round)  # every data error before the server's
    no_target = args.noise_multiplier is not None
    server = ServerConfig(
        method=args.method,
        num_clients=task.num_clients,
        clients_per_round=args.clients_per_round,
        rounds=args.rounds,
        target_epsilon=None if no_target else args.epsilon,
        delta=args.delta,
        noise_multiplier=args.noise_multiplier,
        initial_clip=args.initial_clip,
        server_lr=args.server_lr,
        accountant=args.accountant,
        insecure_seed=args.seed if args.insecure_reproducible_noise else None,
        checkpoint_dir=args.checkpoint_dir,
        allow_fork=args.fork,
        target_quantile=args.target_quantile,
        quantile_lr=args.quantile_lr,
        vote_noise_std=args.vote_noise,
        vote_budget_share=args.vote_budget_share,
        **({"vote_factors": tuple(args.vote_factors)} if args.vote_factors else {}),
        loss_bound=args.loss_bound,
        loss_budget_share=args.loss_budget_share,
        clac_significance=args.clac_significance,
        auto_gamma=args.auto_gamma,
        clip_decay=args.clip_decay,
        noise_decay=args.noise_decay,
    )
    return server, task


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.4g}"


def quiet_third_party(verbosity: int) -> None:
    """Ray, Flower and transformers speak only with -v: by default the output of a run is its
    round lines and table (errors still show)."""
    flwr_level = (logging.ERROR, logging.INFO, logging.DEBUG)[min(verbosity, 2)]
    logging.getLogger("flwr").setLevel(flwr_level)
    logging.getLogger("flwr").propagate = False  # Flower has its own console handler
    if verbosity > 0:
        return
    logging.getLogger("ray").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"ray(\.|$)")
    from dpfit.console import quiet_hub_libraries

    quiet_hub_libraries()


def _header(server_cfg: Any, task: Any, engine: str) -> str:
    target = (
        f"eps={_fmt(server_cfg.target_epsilon)}"
        if server_cfg.noise_multiplier is None
        else f"z={server_cfg.noise_multiplier:g}"
    )
    clients = (
        f"one per value of {task.client_column!r}" if task.partition == "column" else task.partition
    )
    return (
        f"dpfit federated: {server_cfg.method}, {target} delta={server_cfg.delta:g}, "
        f"{server_cfg.num_clients} clients ({clients}, <= "
        f"{task.examples_per_client or 'all'} examples each), {server_cfg.clients_per_round:g} "
        f"expected per round, {server_cfg.rounds} rounds, local {task.local_mode} "
        f"({engine} engine)" + _first(server_cfg.method)
    )


def _first(method: str) -> str:
    """What happens before round 1, if anything (a vote costs the clients a training run)."""
    from dpfit.federated.clipping import clip_rule_class

    rule = clip_rule_class(method)
    if rule.needs_votes:
        return "; first, every client votes for C_0"
    if rule.needs_public_trial:
        return "; first, the server tries the clip norms on its public data (no privacy cost)"
    return ""


def _table(metrics: dict[str, Any]) -> list[str]:
    # C_0 and the clip the last round ran with, as its round line prints it ("C=");
    # metrics.json's final_clip is the clip after the last round (what a next round would use)
    return [
        "| method | epsilon | delta | z | rounds | C_0 | C last round | test acc "
        "| majority class |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {metrics['method']} | {_fmt(metrics['epsilon'])} | {metrics['delta']:g} | "
        f"{_fmt(metrics['noise_multiplier'])} | {metrics['rounds']} | "
        f"{_fmt(metrics['initial_clip'])} | {_fmt(metrics['last_round_clip'])} | "
        f"{_fmt(metrics['accuracy'])} | {_fmt(metrics['majority_accuracy'])} |",
    ]


def _error(msg: object) -> int:
    """One line on stderr, as `dpfit train` says its errors; the exit code of a usage error."""
    print(f"dpfit federated: error: {msg}", file=sys.stderr)
    return 2


def check_engine(engine: str, local_mode: str) -> None:
    """Refuse, before any model loads, a local mode the batched engine cannot run."""
    from dpfit.federated.batched_layers import LOCAL_MODES

    if engine == "batched" and local_mode not in LOCAL_MODES:
        runs = " or ".join(f"{m} ({LOCAL_MODE_SUMMARY.get(m, m)})" for m in LOCAL_MODES)
        others = " or ".join(m for m in LOCAL_MODE_SUMMARY if m not in LOCAL_MODES)
        raise ValueError(
            f"--engine batched runs local mode {runs}, got --local-mode {local_mode}; "
            f"add --local-mode {LOCAL_MODES[0]}, or use --engine local for {others}"
        )


def output_folder(args: argparse.Namespace) -> Path | None:
    """--output, else a new runs/federated-<date-time>/ (as `dpfit train` names its runs), or
    None with --no-output; created and checked before any round spends privacy."""
    from dpfit.errors import DPFitError
    from dpfit.outputs import check_output_dir, default_run_dir

    if args.no_output:
        if args.output:
            raise DPFitError("--output and --no-output contradict each other; pick one")
        return None
    folder = Path(args.output) if args.output else default_run_dir("federated")
    return check_output_dir(folder, resume=bool(args.checkpoint_dir))


def run(args: argparse.Namespace) -> int:
    """Run the federated job (or write the Flower app); returns a process exit code."""
    from dpfit.errors import DPFitError
    from dpfit.models import check_model_name

    try:
        server_cfg, task = configs(args)
        check_engine(args.engine, task.local_mode)
        check_model_name(task.model)  # a typo fails now, not after the data is read
    except (ValueError, DPFitError) as exc:
        return _error(exc)
    if args.write_app:
        from dpfit.federated.deploy import write_app

        path = write_app(args.write_app, server_cfg, task, output=args.output or "")
        print(f"wrote {path}; deploy with: flwr run {args.write_app} <connection> --stream")
        return 0
    try:
        out = output_folder(args)
    except DPFitError as exc:
        return _error(exc)
    try:
        return _run(args, server_cfg, task, out)
    finally:
        if out is not None and not args.output:  # a run that wrote nothing leaves no folder
            try:
                out.rmdir()  # only if empty
            except OSError:
                pass


def _run(args: argparse.Namespace, server_cfg: Any, task: Any, out: Path | None) -> int:
    from dpfit.federated.accounting import CalibrationError

    quiet_third_party(getattr(args, "verbose", 0))
    from dpfit import progress as dpfit_progress
    from dpfit.console import PhaseProgress
    from dpfit.federated.app import run_local, run_simulation
    from dpfit.federated.scoring import make_evaluate_fn

    quiet = args.json
    if server_cfg.insecure_seed is not None:
        print(
            f"WARNING: --insecure-reproducible-noise: client sampling and noise come from "
            f"--seed {args.seed}; this run is NOT private against anyone who knows the seed.",
            file=sys.stderr,
        )
    if not quiet:
        print(_header(server_cfg, task, args.engine), flush=True)
        if out is not None and not args.output:
            print(f"output: {out} (--output DIR to choose, --no-output: none)", flush=True)
    if task.data:
        data_notes(task, quiet)
    # no per-round times on stdout: a round's duration depends on how many clients were
    # sampled and answered, which only the operator's log may show (docs/federated.md)

    def progress(r: Any) -> None:
        if not quiet:
            print(
                f"round {r.round:3d}/{server_cfg.rounds}  C={r.clip_norm:.4g}  "
                f"val_loss={_fmt(r.val_loss)}  acc={_fmt(r.accuracy)}  eps={_fmt(r.epsilon)}",
                flush=True,
            )

    bars: dict[str, PhaseProgress] = {}  # stage -> its progress on stderr, while it runs

    def on_stage(stage: str, done: int, total: int) -> None:
        # the vote and other long stretches before round 1 say what they are doing: the vote
        # its start and end on stdout, each stage its progress (and time left) on stderr
        if quiet or total <= 0:
            return
        vote = stage == "clip vote"
        bar = bars.get(stage)
        if bar is None:
            if done >= total:  # an end already reported, or a stage with nothing to do
                return
            if vote:
                print(f"{stage}: {total} clients score the candidates ...", flush=True)
            unit = "client" if vote else "text"
            bar = bars[stage] = PhaseProgress(
                stage, total, unit, initial=done, leave=False, delay=STAGE_DELAY_S
            )
        bar.update_to(done)
        if done >= total:
            bars.pop(stage).close()
            if vote:
                print(f"{stage}: done", flush=True)

    try:
        stages = dpfit_progress.listening(on_stage)
        stages.__enter__()  # left in the finally below, whatever the engine raises
        if args.engine == "local":
            server = run_local(server_cfg, task, on_round=progress)
        elif args.engine == "batched":
            from dpfit.federated.batched import run_batched

            server = run_batched(server_cfg, task, on_round=progress)
        else:
            server = run_simulation(
                server_cfg,
                task,
                on_round=progress,
                num_cpus=args.num_cpus,
                verbose=getattr(args, "verbose", 0),
            )
    except CalibrationError as exc:
        return _error(exc)
    except ValueError as exc:  # e.g. a model the batched engine cannot run
        from dpfit.federated.batched_layers import BatchedEngineError

        if not isinstance(exc, BatchedEngineError):
            raise
        return _error(exc)
    finally:
        stages.__exit__(None, None, None)
        for bar in bars.values():
            bar.close()
    if out is not None:
        metrics = write_outputs(server, task, out)
    else:
        test_loss, test_acc = make_evaluate_fn(task, "test")(server.params)
        metrics = summary(server, task, test_acc, test_loss)
    if args.json:
        print(json.dumps(_jsonable(metrics)))
    else:
        print()
        print("\n".join(_table(metrics)))
        if server.stop_reason:
            print(f"stopped early: {server.stop_reason}")
        if out is not None:
            print(f"wrote {out}/metrics.json, rounds.csv and plots")
    return 0
