"""``dpfit`` command line: train | evaluate | accountant | federated.

Human output is a progress bar (stderr) and a short table; ``--json`` prints one JSON object on
stdout instead of the table so scripts can read the result. Errors dpfit raises on purpose are
printed as one line without a traceback and exit with status 2.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

from dpfit.audit import cli as audit_cli
from dpfit.console import quiet_hub_libraries
from dpfit.errors import DPFitError
from dpfit.threads import set_threads as _set_threads

logger = logging.getLogger("dpfit")

EXIT_USAGE = 2
STAGE_UNITS = {"samples": "prompt"}  # what a progress stage counts, if not examples
EXIT_INTERRUPTED = 130


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {s!r}")
    return v


def _dropout_rate(text: str) -> float | str:
    from dpfit.dropout import parse_rate

    try:
        return parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not 0 < v < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s!r}")
    return v


class _Parser(argparse.ArgumentParser):
    """Usage mistakes as one line and a hint, not the whole usage: "dpfit train: error:
    --epsilon must be a positive number, got 'abc'" (argparse's own wording names the
    option as "argument --epsilon:" and a failed type by its function's name)."""

    def error(self, message: str) -> NoReturn:
        message = re.sub(r"^argument ([^:]+): must ", r"\1 must ", message)
        message = re.sub(
            r"^argument ([^:]+): invalid (float|int) value: ",
            lambda m: f"{m[1]} must be a {'whole ' if m[2] == 'int' else ''}number, got ",
            message,
        )
        message = re.sub(r"^argument ([^:]+):", r"\1:", message)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n(see: {self.prog} --help)\n")


# -- train -----------------------------------------------------------------------------------


def add_train_arguments(p: argparse.ArgumentParser) -> None:

    g = p.add_argument_group("model and data")
    g.add_argument(
        "--model",
        help="local folder, .gguf file, hub id, or a bundled model: minilm (default), smollm2",
    )
    g.add_argument(
        "--data",
        help="CSV/JSONL/TSV file or saved `datasets` folder "
        "(default: bundled Rotten Tomatoes, split by movie); --task causal-lm: a text file of "
        "lines (default: Hamlet), or long documents: convention-speeches (bundled) or a "
        ".jsonl file, one document per line",
    )
    g.add_argument(
        "--eval-data", help="file scored at the end (default: test split / 10%% held out)"
    )
    g.add_argument("--text-column", default="text", help="your data's text column (default: text)")
    g.add_argument(
        "--label-column", default="label", help="your data's label column (default: label)"
    )
    g.add_argument("--max-length", type=_positive_int, help="tokens per example (recipe: 128)")
    g.add_argument(
        "--stride",
        type=_positive_int,
        help="long texts (causal LM on documents, classification): a window of --max-length "
        "tokens starts every STRIDE tokens (default: --max-length, no overlap). Causal LM: "
        "overlapping tokens are context for the later window, never a target twice. "
        "Classification: each window carries its text's label; a text is predicted from the "
        "mean of its windows' logits",
    )
    g.add_argument(
        "--privacy-unit",
        choices=("window", "document", "user"),
        default="window",
        help="what epsilon protects. Long texts cut into windows (causal LM on documents, "
        "classification): window: each window is an example (epsilon protects a window, not "
        "a whole text); document: documents are sampled and all windows of one are clipped "
        "as one contribution (--mode bias; docs/long_documents.md). user: users are sampled "
        "and all rows of one (--user-column) are clipped as one contribution (--mode bias; "
        "docs/train.md)",
    )
    g.add_argument(
        "--user-column",
        help="with --privacy-unit user: your data's column that says whose each row is",
    )
    g.add_argument(
        "--max-rows-per-user",
        type=_positive_int,
        help="with --privacy-unit user: rows of one user that train at most, chosen by a "
        "keyed hash of each row (default: 32; epsilon does not depend on it)",
    )
    g.add_argument(
        "--full-data",
        action="store_true",
        help="use all bundled training data (the default now; kept for old scripts)",
    )
    g.add_argument(
        "--max-train-examples", type=_positive_int, help="random subset of the training data"
    )
    g.add_argument(
        "--task",
        choices=("classification", "causal-lm", "image-classification"),  # vision hook
        default="classification",
    )
    g.add_argument(
        "--labels",
        help="comma-separated public label names, e.g. neg,pos (their order fixes the class "
        "ids); label names are published in model/config.json and metrics.json",
    )
    g.add_argument(
        "--public-labels",
        action="store_true",
        help="treat the label names read from the training data as public even if some are "
        "rare (without --labels, each must otherwise appear >= 20 times)",
    )

    g = p.add_argument_group("privacy")
    g.add_argument("--epsilon", type=_positive_float, default=8.0, help="target epsilon (8)")
    g.add_argument(
        "--delta", type=_positive_float, help="target delta (default min(1e-5, 1/n^1.1))"
    )
    g.add_argument("--noise-multiplier", type=float, help="fixed sigma instead of a target epsilon")
    g.add_argument("--max-grad-norm", type=_positive_float, help="clip norm R (recipe)")
    g.add_argument(
        "--clipping", choices=("flat", "automatic"), help="per-example clipping rule (recipe)"
    )
    g.add_argument("--accountant", choices=("rdp", "pld"), default="rdp")
    g.add_argument(
        "--neighbouring",
        choices=("add-remove", "replace-one"),
        default="add-remove",
        help="neighbouring datasets that --epsilon is met for (default: add-remove, one example "
        "more or less; replace-one: one example swapped, the relation that fits a published "
        "dataset size, needs more noise). Both epsilons are reported",
    )
    g.add_argument(
        "--non-private",
        action="store_true",
        help="the non-private reference: same model and data, an ordinary fine-tuning recipe",
    )

    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=_positive_int, help="passes over the data (recipe)")
    g.add_argument(
        "--max-steps",
        type=_positive_int,
        help="run at most this many logical steps; with --epsilon the noise is calibrated to "
        "the run's length, so fewer steps get less noise (sigma is set for the steps run)",
    )
    g.add_argument(
        "--batch-size",
        type=_positive_int,
        help="logical batch, the expected size under Poisson sampling (recipe)",
    )
    g.add_argument(
        "--physical-batch-size",
        type=_positive_int,
        help="examples per forward/backward; bounds memory, not the result (recipe)",
    )
    g.add_argument("--lr", type=_positive_float, help="learning rate (recipe)")
    g.add_argument(
        "--tune",
        action="store_true",
        help="pick lr (x1/3, 1, 3) and epochs (x1/2, 1, 2) privately on a validation split of "
        "the training rows (of the users, with --privacy-unit user) (about 3 runs' compute; "
        "--epsilon covers the selection too; docs/train.md)",
    )
    g.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="public randomness only: data split, head init, non-private shuffles "
        "(DP noise and sampling use OS randomness)",
    )
    g.add_argument(
        "--insecure-reproducible-noise",
        action="store_true",
        help="also seed the DP noise and Poisson sampling from --seed, to reproduce a run "
        "exactly; the run is then NOT private against anyone who knows the seed",
    )
    g.add_argument(
        "--mode",
        choices=("bias", "full", "bias+lora", "lora"),
        default="bias",
        help="what trains: biases + head (bias), every weight (full), peft LoRA adapters + "
        "biases + head under one clip (bias+lora), or LoRA adapters + head (lora)",
    )
    g.add_argument(
        "--lora-r", type=_positive_int, default=8, help="LoRA rank (--mode bias+lora / lora)"
    )
    g.add_argument(
        "--lora-alpha",
        type=_positive_float,
        default=16.0,
        help="LoRA scale numerator: updates scaled by alpha / r (default 16: 2 at r = 8)",
    )
    g.add_argument(
        "--lora-targets",
        nargs="+",
        help="module-name suffixes that get adapters (default: the attention query and value "
        "projections peft knows for the model type)",
    )
    g.add_argument(
        "--lora-freeze-a",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="FFA-LoRA: keep each lora_A at its random initialisation and train lora_B only "
        "(half the adapters' noised coordinates); default: on in private bias+lora runs",
    )
    g.add_argument(
        "--pooling",
        choices=("auto", "cls", "pooler", "mean", "last"),
        default="auto",
        help="how the head reads the backbone: auto = the sentence-transformers pooling, the "
        "last non-pad token for decoders, the trained pooler of other encoders, else mean",
    )
    g.add_argument(
        "--dropout",
        type=_dropout_rate,
        help="the backbone's dropout rate, set in its config before it is built, or 'model' "
        "for its own rates (recipe: off when private, the model's own without privacy)",
    )
    g.add_argument(
        "--head-first",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="first train the head on frozen features (one backbone pass), then biases + "
        "head; when private, both phases share one privacy budget (recipe: on for "
        "classification, in every mode)",
    )
    g.add_argument(
        "--head-epochs", type=_positive_int, help="epochs of the --head-first phase (recipe)"
    )
    g.add_argument(
        "--head-lr", type=_positive_float, help="learning rate of the --head-first phase (recipe)"
    )
    g.add_argument("--add-biases", action="store_true", help="BiTFiT-Add for models without biases")
    g.add_argument(
        "--full-epochs", type=int, default=0, help="two-phase: full fine-tuning epochs first"
    )
    g.add_argument(
        "--full-lr", type=_positive_float, help="learning rate of the --full-epochs phase (recipe)"
    )
    g.add_argument("--device", default="auto", help="auto | cpu | cuda[:i]")
    g.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="--mode bias: recompute layer activations in the backward pass instead of "
        "keeping them (less memory at long lengths, about a third more compute); causal LM: "
        "the output head's logits are also computed in chunks, never all at once",
    )
    g.add_argument(
        "--pad-to-max-length",
        action="store_true",
        help="causal LM on documents: pad every physical batch to the window length, so that "
        "no step's shape, memory or time depends on the sampled documents' lengths (the peak "
        "is reached at the first step; short documents cost as much as long ones)",
    )
    g.add_argument(
        "--precision",
        choices=("fp32", "bf16", "auto"),
        default="auto",
        help="forward/backward dtype: bf16 autocast keeps float32 parameters, norms, clipping "
        "and noise; auto (the default) = bf16 where the CPU has avx512_bf16/amx_bf16 or the GPU "
        "supports it, else fp32",
    )
    g.add_argument(
        "--threads",
        default="auto",
        help="CPU threads for torch: a number, or auto (1 when the CPUs are already "
        "busy, where more threads spin against each other; else torch's default)",
    )

    g = p.add_argument_group("output")
    g.add_argument(
        "--output",
        help="folder for metrics.json, steps.csv, plots and the model, checked before "
        "training; must not hold an earlier run (default: a new runs/<task>-<date-time>/)",
    )
    g.add_argument(
        "--no-output", action="store_true", help="write no files (only the table or --json)"
    )
    g.add_argument(
        "--checkpoint-dir", help="folder for checkpoints (one per --checkpoint-every steps)"
    )
    g.add_argument("--checkpoint-every", type=_positive_int, default=1)
    g.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    g.add_argument(
        "--fork",
        action="store_true",
        help="with --resume: continue a checkpoint that was already continued (a fork; "
        "releasing both costs both continuations' steps, see metrics.json continuation)",
    )
    g.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    from dpfit.vision import cli as vision_cli  # vision hook: image options, own group

    vision_cli.add_train_arguments(p)

    # -- distributed (dpfit.distributed; docs/distributed.md)
    g = p.add_argument_group("distributed")
    g.add_argument(
        "--nproc-per-node",
        type=_positive_int,
        help="data-parallel DP on N processes of this machine, launched through "
        "torch.distributed.run (for several machines run torchrun -m dpfit train ... yourself)",
    )


def train_config_from_args(args: argparse.Namespace):
    from dpfit.tasks.labels import parse_labels
    from dpfit.train import TrainConfig

    max_train = args.max_train_examples
    return TrainConfig(
        model=args.model,
        data=args.data,
        eval_data=args.eval_data,
        text_column=args.text_column,
        label_column=args.label_column,
        max_train_examples=max_train,
        epsilon=args.epsilon,
        delta=args.delta,
        noise_multiplier=args.noise_multiplier,
        accountant=args.accountant,
        neighbouring=args.neighbouring,
        epochs=args.epochs,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        physical_batch_size=args.physical_batch_size,
        max_grad_norm=args.max_grad_norm,
        clipping=args.clipping,
        lr=args.lr,
        optimizer=args.optimizer,
        max_length=args.max_length,
        stride=args.stride,
        privacy_unit=args.privacy_unit,
        user_column=args.user_column,
        max_rows_per_user=args.max_rows_per_user,
        activation_checkpointing=args.activation_checkpointing,
        pad_to_max_length=args.pad_to_max_length,
        pooling=args.pooling,
        dropout=args.dropout,
        head_first=args.head_first,
        head_epochs=args.head_epochs,
        head_lr=args.head_lr,
        seed=args.seed,
        insecure_reproducible_noise=args.insecure_reproducible_noise,
        labels=parse_labels(args.labels or ""),
        public_labels=args.public_labels,
        non_private=args.non_private,
        mode=args.mode,
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_targets=tuple(args.lora_targets) if args.lora_targets else None,
        lora_freeze_a=args.lora_freeze_a,
        add_biases=args.add_biases,
        full_epochs=args.full_epochs,
        full_lr=args.full_lr,
        task=args.task,
        task_options=_task_options(args),
        output=_output_folder(args),
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        allow_fork=getattr(args, "fork", False),
        device=args.device,
        precision=args.precision,
    )


def _output_folder(args: argparse.Namespace) -> str | None:
    """--output, else a new runs/<task>-<date-time>/ (a run that spent privacy keeps its
    result), or None with --no-output. Said on stderr when chosen here."""
    from dpfit.outputs import default_run_dir

    if args.no_output:
        if args.output:
            raise DPFitError("--output and --no-output contradict each other; pick one")
        return None
    if args.output:
        return args.output
    if not hasattr(args, "_default_output"):  # once per run (main() may re-enter)
        from dpfit import distributed

        args._default_output = str(default_run_dir(args.task))
        if distributed.is_main_process():
            _eprint(f"output: {args._default_output} (--output DIR to choose, --no-output: none)")
    return args._default_output


def _task_options(args: argparse.Namespace):
    from dpfit.vision import cli as vision_cli  # vision hook: the image task's own options

    if args.task == "image-classification":
        return vision_cli.image_options_from_args(args)
    if vision_cli.image_flags_given(args):
        raise DPFitError(
            f"{', '.join(vision_cli.image_flags_given(args))}: for --task image-classification"
        )
    return None


def summary_rows(m: dict) -> list[tuple[str, object]]:
    from dpfit.reporting import mechanism_rows, score_rows

    if m.get("task") == "image-classification":  # vision hook
        from dpfit.vision import cli as vision_cli

        return vision_cli.summary_rows(m)
    if m.get("task") == "causal-lm":
        rows: list[tuple[str, object]] = [
            ("held-out perplexity", f"{m['perplexity_before']:.1f} -> {m['perplexity_after']:.1f}"),
            *mechanism_rows(m),
            ("logical steps", m["steps"]),
            *_window_rows(m),
            (
                "trainable fraction",
                f"{100 * m['trainable_fraction']:.3f}% ({m['trainable_params']:,})",
            ),
            ("wall time", f"{m['wall_time_s']:.1f} s"),
            ("peak memory", f"{m['peak_memory_mb']:.0f} MB"),
        ]
        return rows + [(f"sample: {s['prompt']!r}", s["continuation"]) for s in m["samples"]]
    return [
        ("accuracy", m["accuracy"]),
        ("evaluated on", _evaluated_on(m)),
        *mechanism_rows(m),
        ("head", f"{m.get('pooling')} pooling, linear"),
        ("logical steps", m["steps"]),
        *_window_rows(m),
        *([("head-first steps", m["head_first_steps"])] if m.get("head_first_steps") else []),
        *score_rows(
            m,
            {
                "head_first_accuracy": "probe alone (accuracy)",
                "start_accuracy": "starting model (accuracy)",
            },
        ),
        (
            "training users" if m.get("privacy_unit") == "user" else "training examples",
            m["train_examples"],
        ),  # fmt: skip
        ("trainable fraction", f"{100 * m['trainable_fraction']:.3f}% ({m['trainable_params']:,})"),
        ("train time", f"{m['train_time_s']:.1f} s"),
        ("wall time", f"{m['wall_time_s']:.1f} s"),
        ("peak memory", f"{m['peak_memory_mb']:.0f} MB"),
    ]


def _evaluated_on(m: dict) -> str:
    if m.get("window_length"):  # windowed classification: one prediction per text
        return f"{m['eval_n']} texts (each from the mean of its windows' logits)"
    return f"{m['eval_n']} examples"


def _window_rows(m: dict) -> list[tuple[str, object]]:
    """Long texts: how they were cut into windows (causal LM on documents, classification)."""
    if not m.get("window_length"):
        return []
    what = f"{m['window_length']} tokens every {m['stride']}"
    if "train_documents" in m:  # a training run's; dpfit evaluate counts texts in "evaluated on"
        what += f", {m['train_documents']} documents"
    return [("windows", what)]


def run_train(args: argparse.Namespace) -> int:
    from dpfit.models import check_model_name

    if args.task != "image-classification":  # vision hook: image models have their own names
        check_model_name(args.model)  # a typo fails in seconds, not after the data is read
    # -- distributed: re-run through torchrun, or join its process group; rank 0 alone talks
    from dpfit import distributed

    if args.nproc_per_node and not distributed.launched_by_torchrun():
        argv = distributed.strip_option(args._argv, "--nproc-per-node")
        return distributed.launch(args.nproc_per_node, argv)
    distributed.init_from_env()
    if not distributed.is_main_process():
        args.quiet = True
    # -- end distributed

    _set_threads(args.threads)
    if args.activation_checkpointing:  # a run short of memory: freed tensors go back at once
        from dpfit.memory import return_freed_memory

        if return_freed_memory():
            logger.info("malloc: blocks of 1 MiB or more mapped on their own (freed at once)")
    try:
        config = train_config_from_args(args)
        if getattr(args, "tune", False):  # private selection of lr and epochs (run.tune)
            from dpfit.run.tune import tune

            return run_config(config, args, run=tune)
        return run_config(config, args)
    except BaseException:
        _drop_empty_default_output(args)
        raise


def _drop_empty_default_output(args: argparse.Namespace) -> None:
    """A run refused before it wrote anything leaves no empty default run folder behind."""
    folder = getattr(args, "_default_output", None)
    if folder is not None:
        try:
            os.rmdir(folder)  # only if empty
        except OSError:
            pass


def run_config(config, args: argparse.Namespace, command: str = "train", run=None) -> int:
    """Run `config` with a progress bar, then print the result table (or --json): the one
    output path of ``dpfit train`` and ``dpfit pretrain``. `run` replaces
    :func:`dpfit.train.train` (same signature), e.g. pretraining's length rule."""
    from dpfit import distributed, progress
    from dpfit.console import PhaseProgress
    from dpfit.reporting import format_table, to_json
    from dpfit.train import train

    bar: PhaseProgress | None = None  # the training phase: estimate, then bar or plain lines

    def on_note(msg: str) -> None:
        if not distributed.is_main_process():
            return
        (bar.write if bar is not None else _eprint)(f"note: {msg}")

    def on_step(row, total: int) -> None:
        nonlocal bar
        if args.quiet:
            return
        if bar is None:  # resumed runs start part-way
            bar = PhaseProgress("training", total, "step", initial=row.step - 1, estimate=True)
        post = {}
        if row.loss is not None:  # non-private runs only: a private run's loss is not shown
            post["loss"] = f"{row.loss:.4f}"
        if math.isfinite(row.epsilon):
            post["eps"] = f"{row.epsilon:.3f}"
        bar.update_to(row.step, post)

    stages: dict = {}  # stage -> its progress (features, tokenising, evaluating)

    def on_progress(stage: str, done: int, total: int) -> None:
        if args.quiet or not distributed.is_main_process() or total <= 0:
            return
        stage_bar = stages.get(stage)
        if stage_bar is None:
            if done >= total:
                return
            unit = STAGE_UNITS.get(stage, "example")
            stage_bar = stages[stage] = PhaseProgress(
                stage, total, unit, initial=done, leave=False, delay=1.0
            )
        stage_bar.update_to(done)
        if done >= total:
            stages.pop(stage).close()

    try:
        with progress.listening(on_progress):
            result = (run or train)(config, on_step=on_step, on_note=on_note)
    finally:
        if bar is not None:
            bar.close()
        for stage_bar in stages.values():
            stage_bar.close()
    m = result.metrics
    if not distributed.is_main_process():
        return 0
    if args.json:
        print(to_json({k: v for k, v in m.items() if k != "config"}, indent=None))
    else:
        print(format_table(summary_rows(m), title=f"dpfit {command}: result"))
        if result.output_dir is not None:
            print(f"wrote {result.output_dir}/metrics.json, steps.csv, plots and model/")
            if m.get("task") == "classification":
                print(f"score it: dpfit evaluate --model {result.output_dir}/model{_score_data(m)}")
    return 0


def _score_data(m: dict) -> str:
    """The --data part of the `dpfit evaluate` hint: the rows this run held out of its file
    (re-derived by their hash, never saved), its --eval-data, or none (bundled data)."""
    config = m["config"]
    if config.get("data") is None:
        return ""
    if config.get("eval_data") is not None:
        return f" --data {config['eval_data']}"
    if m.get("held_out_fraction") is not None:
        return f" --data {config['data']} --held-out"
    return " --data FILE"


def _eprint(msg: str, file=None) -> None:
    print(msg, file=file or sys.stderr)


# -- evaluate --------------------------------------------------------------------------------

EVAL_MAX_LENGTH = 128  # tokens a text is truncated at when the model has no windows


def add_evaluate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a saved model folder (DIR/model)")
    p.add_argument(
        "--data",
        help="CSV/JSONL/TSV file or saved `datasets` folder (default, for a model trained on "
        "the bundled data: its test split, the same movies held out)",
    )
    p.add_argument(
        "--held-out",
        action="store_true",
        help="score only the rows of --data that the training run held out as its test set, "
        "chosen again by the run's per-row hash (seed and rule from DIR/metrics.json); "
        "nothing private is saved",
    )
    p.add_argument("--text-column", default="text", help="the text column (default: text)")
    p.add_argument("--label-column", default="label", help="the label column (default: label)")
    p.add_argument(
        "--max-length",
        type=_positive_int,
        help="tokens per text (default: a model trained on windows is scored on the same "
        "windows, read from its dpfit.json; any other model on texts truncated at "
        f"{EVAL_MAX_LENGTH}). For a model trained on windows, another length cuts windows of "
        "that length, without overlap unless --stride is given",
    )
    p.add_argument(
        "--stride",
        type=_positive_int,
        help="score long texts on windows of --max-length tokens, one every STRIDE tokens, "
        "each text predicted from the mean of its windows' logits (default: the stride the "
        "model was trained with, if it was trained on windows)",
    )
    p.add_argument("--batch-size", type=_positive_int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", default="auto", help="CPU threads for torch (a number, or auto)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_evaluate(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from dpfit.data.text import load_texts
    from dpfit.models import load_classifier
    from dpfit.reporting import format_table, to_json
    from dpfit.run.resolve import device_for as _device
    from dpfit.train import evaluate
    from dpfit.vision import cli as vision_cli  # vision hook
    from dpfit.vision.models import is_image_model_folder

    if is_image_model_folder(args.model):
        if getattr(args, "held_out", False):  # else the whole --data, training rows too
            raise DPFitError(
                "--held-out re-derives a text classifier's held-out rows; for an image model "
                "score on a separate --data without --held-out"
            )
        return vision_cli.run_evaluate(args)
    _set_threads(args.threads)
    loaded = load_classifier(args.model)
    model = loaded.model
    id2label = model.config.id2label
    names = [str(id2label[i]) for i in range(model.config.num_labels)]
    record_path = Path(args.model) / "dpfit.json"
    privacy = json.loads(record_path.read_text()) if record_path.is_file() else None
    length, stride = _evaluation_windows(args, privacy)  # refused before any data is read
    if getattr(args, "held_out", False):
        if args.data is None:
            raise DPFitError("--held-out picks rows of the training file: give it with --data")
        from dpfit.tasks.classification import recorded_held_out

        data = recorded_held_out(args.model, args.data, names)
    elif args.data is None:
        data = _bundled_test_split(args.model, privacy, names)
    else:
        data = load_texts(args.data, args.text_column, args.label_column, label_names=names)
    device = _device(args.device)
    model.to(device)
    res = evaluate(model, loaded.tokenizer, data, length, args.batch_size, device, stride=stride)
    out = {**res.as_dict(), "model": str(args.model), "data": str(args.data or data.source)}
    # windowed: what was scored, in the words of `dpfit train`'s table
    window = {} if stride is None else {"window_length": length, "stride": stride}
    scored = {"eval_n": res.n, **window}
    if window:
        out.update(window, evaluated_on=_evaluated_on(scored))
    if privacy is not None:
        out["privacy"] = privacy
    if args.json:
        print(to_json(out, indent=None))
    else:
        rows: list[tuple[str, object]] = [("accuracy", res.accuracy)]
        if window:
            rows += [("evaluated on", _evaluated_on(scored)), *_window_rows(scored)]
        else:
            rows.append(("examples", res.n))
        rows += [
            (f"class {k}", f"{v['correct']}/{v['n']} correct") for k, v in res.per_class.items()
        ]
        if privacy is not None and privacy.get("private"):
            from dpfit.reporting import mechanism_rows  # both relations' epsilon, labelled

            rows += [r for r in mechanism_rows(privacy) if r[0].startswith(("epsilon", "neigh"))]
            rows.append(("delta", privacy.get("delta")))
        print(format_table(rows, title=f"dpfit evaluate: {args.model}"))
    return 0


def _evaluation_windows(args: argparse.Namespace, record: dict | None) -> tuple[int, int | None]:
    """(max length, stride or None) to score at. A model trained on windows (its dpfit.json
    has window_length and stride) is scored on the same windows, so that its score is its
    training run's test figure; --max-length and --stride override. Another --max-length
    alone cuts windows of that length without overlap (the recorded stride may not fit it).
    Any other model: texts truncated at --max-length, or windows with --stride."""
    from dpfit.windows import check_stride

    cut = (record or {}).get("window_length")
    if cut is None:
        length, stride = args.max_length or EVAL_MAX_LENGTH, args.stride
    else:
        length = args.max_length or cut
        stride = args.stride
        if stride is None:
            stride = record["stride"] if length == cut else length
    if stride is not None:
        check_stride(stride, length)
    return length, stride


def _bundled_test_split(model: str, privacy: dict | None, names: list[str]):
    """The bundled test split a model trained on the bundled data was not trained on."""
    from dpfit.data.text import bundled_rotten_tomatoes

    seed = (privacy or {}).get("bundled_split_seed")
    if seed is None:
        raise DPFitError(
            f"{model} was not trained on the bundled data (no bundled_split_seed in its "
            "dpfit.json); give the labelled file to score with --data FILE"
        )
    test = bundled_rotten_tomatoes(seed=int(seed)).test
    if list(test.label_names) != names:
        raise DPFitError(f"{model} has classes {names}, not the bundled {list(test.label_names)}")
    return test


# -- accountant ------------------------------------------------------------------------------


def add_accountant_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--noise-multiplier", type=_positive_float, help="sigma -> epsilon spent")
    what.add_argument("--epsilon", type=_positive_float, help="target epsilon -> sigma needed")
    p.add_argument("--delta", type=_positive_float, default=1e-5)
    p.add_argument(
        "--sample-rate", type=_positive_float, help="q (or give --batch-size and --dataset-size)"
    )
    p.add_argument("--batch-size", type=_positive_int)
    p.add_argument("--dataset-size", type=_positive_int)
    p.add_argument("--steps", type=_positive_int, help="logical steps (or give --epochs)")
    p.add_argument("--epochs", type=_positive_float)
    p.add_argument("--accountant", choices=("rdp", "pld"), default="rdp")
    p.add_argument(
        "--neighbouring",
        choices=("add-remove", "replace-one"),
        default="add-remove",
        help="the relation --epsilon is met for (default: add-remove); both epsilons are shown",
    )
    p.add_argument("--json", action="store_true")


def run_accountant(args: argparse.Namespace) -> int:
    from dpfit import accounting
    from dpfit.reporting import format_table, to_json

    q = args.sample_rate
    if q is None:
        if not (args.batch_size and args.dataset_size):
            raise DPFitError("give --sample-rate, or --batch-size and --dataset-size")
        q = args.batch_size / args.dataset_size
    if not 0 < q <= 1:
        raise DPFitError(f"sample rate must be in (0, 1], got {q}")
    steps = args.steps
    if steps is None:
        if args.epochs is None:
            raise DPFitError("give --steps, or --epochs")
        steps = max(1, round(args.epochs / q))
    out = {"sample_rate": q, "steps": steps, "delta": args.delta, "accountant": args.accountant}
    out["neighbouring"] = args.neighbouring
    if args.noise_multiplier is not None:
        out["noise_multiplier"] = args.noise_multiplier
        out["epsilon"] = accounting.epsilon_for(
            args.noise_multiplier, q, steps, args.delta, args.accountant, args.neighbouring
        )
    else:
        out["epsilon"] = args.epsilon
        out["noise_multiplier"] = accounting.noise_multiplier_for(
            args.epsilon, args.delta, q, steps, args.accountant, neighbouring=args.neighbouring
        )
    for rel in accounting.NEIGHBOURING:  # both relations, for the same noise
        out[f"epsilon_{rel.replace('-', '_')}"] = accounting.epsilon_for(
            out["noise_multiplier"], q, steps, args.delta, args.accountant, rel
        )
    out["accountant_replace_one"] = accounting.accountant_for(args.accountant, "replace-one")
    if args.json:
        print(to_json(out, indent=None))
    else:
        print(format_table(list(out.items()), title="dpfit accountant"))
    return 0


# -- federated (another module's arguments; wired lazily) -------------------------------------


def _federated_module():
    try:
        from dpfit.federated import cli as fcli
    except ImportError as e:
        return None, e
    return fcli, None


def add_federated_arguments(p: argparse.ArgumentParser) -> None:
    fcli, _ = _federated_module()
    if fcli is not None:
        fcli.add_arguments(p)
    else:
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def run_federated(args: argparse.Namespace) -> int:
    fcli, err = _federated_module()
    if fcli is None:
        raise DPFitError(
            f"`dpfit federated` is not available: dpfit.federated.cli could not be imported "
            f"({err}); if it exists, install its extra with `pip install 'dpfit[flwr]'`"
        )
    rc = fcli.run(args)
    return int(rc or 0)


# -- main ------------------------------------------------------------------------------------

COMMANDS = {
    "train": ("private (or --non-private) fine-tuning, end to end", add_train_arguments, run_train),
    "evaluate": ("score a saved model on a labelled file", add_evaluate_arguments, run_evaluate),
    "accountant": (
        "epsilon for a noise multiplier, or sigma for a target",
        add_accountant_arguments,
        run_accountant,
    ),
    "federated": ("federated DP fine-tuning (Flower)", add_federated_arguments, run_federated),
    "audit": (audit_cli.HELP, audit_cli.add_arguments, audit_cli.run),
}


def run_pretrain(args: argparse.Namespace) -> int:
    """``dpfit pretrain``: non-private training on a split declared public, run and reported
    as ``dpfit train`` is."""
    from dpfit.vision.pretrain import pretrain

    _set_threads(getattr(args, "threads", "auto"))
    return run_config(_vision_cli().pretrain_config_from_args(args), args, "pretrain", run=pretrain)


def _vision_cli():  # vision hook: `dpfit pretrain` (non-private training on a public split)
    from dpfit.vision import cli

    return cli


COMMANDS["pretrain"] = (
    "non-private pretraining of an image model on public data",
    lambda p: _vision_cli().add_pretrain_arguments(p),
    lambda args: run_pretrain(args),
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dpfit", description="Differentially private fine-tuning (DP-BiTFiT).")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="-v info, -vv debug logs"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_, add, run) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        add(sp)
        sp.set_defaults(_run=run)
    return parser


def _setup_logging(verbosity: int) -> None:
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbosity, 2)]
    logging.basicConfig(
        level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if verbosity < 2:
        # dp-accounting's RDP search logs a warning per skipped order; not actionable for users.
        logging.getLogger("absl").setLevel(logging.ERROR)
        quiet_hub_libraries()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)  # re-launched by --nproc-per-node
    _setup_logging(args.verbose)
    t0 = time.perf_counter()
    try:
        return args._run(args)
    except DPFitError as e:
        print(f"dpfit {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as e:  # bad combinations of options found by the config dataclasses
        if args.verbose:
            raise
        print(f"dpfit {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        hint = " (rerun with --resume to continue)" if getattr(args, "checkpoint_dir", None) else ""
        print(f"\ninterrupted after {time.perf_counter() - t0:.0f} s{hint}", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
