"""Command-line side of image classification: ``dpfit pretrain``, the image options of
``dpfit train --task image-classification``, and ``dpfit evaluate`` on image models.

The image options and their translation to the task's :class:`ImageOptions` live here;
training itself, its progress bar and its result table are ``dpfit.cli``'s, as for every task.
"""

from __future__ import annotations

import argparse

from dpfit.lr_schedules import LR_SCHEDULES
from dpfit.vision.augment_names import AUGMENTS

TASK = "image-classification"


def _fraction(s: str) -> float:
    v = float(s)
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {v}")
    return v


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _has(p: argparse.ArgumentParser, flag: str) -> bool:
    return flag in p._option_string_actions


def _image_options(g, p: argparse.ArgumentParser) -> None:
    """Options shared by pretrain and train (added only where the parser lacks them)."""
    options: dict[str, dict] = {
        "--public-fraction": dict(
            type=_fraction,
            help="share of the training data declared public (pretrain trains on it, train on "
            "the rest); default: as recorded by a pretrained --model, else none",
        ),
        "--split-seed": dict(
            type=int,
            help="seed of the public/private split (default: as recorded by a pretrained "
            "--model, else 0)",
        ),
        "--image-size": dict(
            type=_positive_int,
            help="square input size of a new model; images are resized to it (default: the "
            "starting model's; for an image folder 32, never read from the images)",
        ),
        "--channels": dict(
            type=int,
            choices=(1, 3),
            help="input channels of a new model; images are converted to them (default: the "
            "starting model's; for an image folder 3, never read from the images)",
        ),
        "--max-eval-examples": dict(type=_positive_int, help="random subset of the test images"),
        "--replace-batchnorm": dict(
            action="store_true",
            help="turn a user model's BatchNorm into GroupNorm (changes the architecture)",
        ),
    }
    for flag, kwargs in options.items():
        if not _has(p, flag):
            g.add_argument(flag, **kwargs)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The image options of ``dpfit train`` (used with --task image-classification)."""
    g = p.add_argument_group(f"image classification (--task {TASK})")
    _image_options(g, p)
    if not _has(p, "--head-only"):
        g.add_argument(
            "--head-only", action="store_true", help="DP last-layer: train the head alone"
        )
    if not _has(p, "--insecure-reproducible-noise"):
        g.add_argument(
            "--insecure-reproducible-noise",
            action="store_true",
            help="seed noise and sampling with --seed: reproducible, NOT private against "
            "anyone who knows the seed",
        )


def add_pretrain_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", choices=(TASK,), default=TASK)
    p.add_argument(
        "--model", default="resnet-gn", help="resnet-gn | vit-tiny | a saved folder (resnet-gn)"
    )
    p.add_argument(
        "--data", help="image folder, .npz or fashion-mnist (default: bundled FashionMNIST)"
    )
    p.add_argument("--eval-data", help="scored at the end (default: test split / 10%% held out)")
    p.add_argument("--max-train-examples", type=_positive_int)
    p.add_argument(
        "--labels",
        help="comma-separated public class names (their order fixes the class ids); class "
        "names are published in the saved model and metrics.json",
    )
    p.add_argument(
        "--public-labels",
        action="store_true",
        help="treat the class names read from the data as public even if some are rare "
        "(without --labels, each must otherwise appear >= 20 times, unless the whole data set "
        "is public: no --public-fraction)",
    )
    g = p.add_argument_group("public split")
    _image_options(g, p)
    g = p.add_argument_group("optimisation (non-private)")
    g.add_argument(
        "--epochs",
        type=_positive_int,
        help="passes over the public data (default: the fewest giving 2,000 steps, between 3 "
        "and 40 epochs, from the number of public images; the run's note gives its steps)",
    )
    g.add_argument("--batch-size", type=_positive_int, help="(128)")
    g.add_argument("--physical-batch-size", type=_positive_int, help="(128)")
    g.add_argument("--lr", type=float, help="peak learning rate (2e-3)")
    g.add_argument(
        "--lr-schedule", choices=sorted(LR_SCHEDULES), help="(cosine: peak lr down to 0)"
    )
    g.add_argument(
        "--augment",
        choices=AUGMENTS,
        help="training augmentation (shift: random moves of up to 1/14 of the side; "
        "shift-flip: also mirror left-right, wrong for digits or text)",
    )
    g.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto")
    g.add_argument("--threads", default="auto", help="CPU threads for torch (a number, or auto)")
    g = p.add_argument_group("output")
    g.add_argument("--output", required=True, help="folder: DIR/model, metrics.json, steps.csv")
    g.add_argument("--checkpoint-dir")
    g.add_argument("--checkpoint-every", type=_positive_int, default=1)
    g.add_argument("--resume", action="store_true")
    g.add_argument("--json", action="store_true")
    g.add_argument("--quiet", action="store_true")


def image_options_from_args(
    args: argparse.Namespace, split: str = "private", augment: str = "none"
):
    """The image task's own options (``TrainConfig.task_options``) from parsed arguments."""
    from dpfit.tasks.image_classification import ImageOptions

    return ImageOptions(
        augment=augment,
        split=split,
        public_fraction=args.public_fraction,
        split_seed=args.split_seed,
        image_size=args.image_size,
        channels=getattr(args, "channels", None),
        max_eval_examples=args.max_eval_examples,
        replace_batchnorm=args.replace_batchnorm,
        head_only=getattr(args, "head_only", False),
    )


def image_flags_given(args: argparse.Namespace) -> list[str]:
    """The image-only flags set on the command line (refused for other tasks)."""
    names = ("public_fraction", "split_seed", "image_size", "channels", "max_eval_examples")
    given = [n for n in names if getattr(args, n, None) is not None]
    given += [n for n in ("replace_batchnorm", "head_only") if getattr(args, n, False)]
    return ["--" + n.replace("_", "-") for n in given]


def _value(args: argparse.Namespace, name: str, defaults: dict):
    given = getattr(args, name, None)
    return defaults[name] if given is None else given


def pretrain_config_from_args(args: argparse.Namespace):
    """``dpfit pretrain``: the training run, non-private, every weight, on the public split."""
    from dpfit.train import TrainConfig
    from dpfit.vision.pretrain import PRETRAIN_DEFAULTS

    d = PRETRAIN_DEFAULTS
    return TrainConfig(
        task=TASK,
        task_options=image_options_from_args(
            args, split="public", augment=_value(args, "augment", d)
        ),
        model=args.model,
        data=args.data,
        eval_data=args.eval_data,
        max_train_examples=args.max_train_examples,
        labels=tuple(x for x in args.labels.split(",") if x.strip()) if args.labels else None,
        public_labels=args.public_labels,
        epsilon=None,
        non_private=True,
        mode="full",
        epochs=_value(args, "epochs", d),
        batch_size=_value(args, "batch_size", d),
        physical_batch_size=_value(args, "physical_batch_size", d),
        lr=_value(args, "lr", d),
        lr_schedule=_value(args, "lr_schedule", d),
        optimizer=args.optimizer,
        weight_decay=args.weight_decay,
        seed=args.seed,
        output=args.output,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        device=args.device,
    )


def summary_rows(m: dict) -> list[tuple[str, object]]:
    from dpfit.reporting import mechanism_rows, score_rows

    rows: list[tuple[str, object]] = [
        ("accuracy", m["accuracy"]),
        *score_rows(m, {"start_accuracy": "starting model (accuracy)"}),
        ("evaluated on", f"{m['eval_n']} images ({m['eval_source']})"),
        *mechanism_rows(m),
    ]
    rows += [
        ("model", f"{m['model']} at {m['image_size']}x{m['image_size']}"),
        ("trains", m.get("trains", m["mode"])),
        ("trained on", f"{m['train_examples']} images ({m['train_source']})"),
        ("logical steps", m["steps"]),
        ("trainable fraction", f"{100 * m['trainable_fraction']:.3f}% ({m['trainable_params']:,})"),
        ("train time", f"{m['train_time_s']:.1f} s"),
        ("peak memory", f"{m['peak_memory_mb']:.0f} MB"),
    ]
    return rows


def run_evaluate(args: argparse.Namespace) -> int:
    """``dpfit evaluate --model DIR/model --data X`` for an image model folder."""
    from dpfit.reporting import format_table, to_json
    from dpfit.run.resolve import device_for as _device
    from dpfit.tasks.image_classification import evaluate_images
    from dpfit.threads import set_threads
    from dpfit.vision.data import FASHION_MNIST, load_images
    from dpfit.vision.models import load_image_model, read_record

    set_threads(getattr(args, "threads", "auto"))
    model = load_image_model(args.model)
    bundled = args.data in (None, FASHION_MNIST)
    data = load_images(
        args.data,
        "test" if bundled else "train",
        model.spec.label_names,
        image_size=model.spec.image_size,
        channels=model.spec.in_channels,
    )
    device = _device(getattr(args, "device", "auto"))
    model.module.to(device)
    res = evaluate_images(model, data, getattr(args, "batch_size", 256), device)
    record = read_record(args.model)
    out = {**res, "model": str(args.model), "data": data.source, "privacy": record}
    if args.json:
        print(to_json(out, indent=None))
        return 0
    rows: list[tuple[str, object]] = [("accuracy", res["accuracy"]), ("examples", res["n"])]
    rows += [
        (f"class {k}", f"{v['correct']}/{v['n']} correct") for k, v in res["per_class"].items()
    ]
    if record.get("private"):
        rows += [("trained with epsilon", record.get("epsilon")), ("delta", record.get("delta"))]
    print(format_table(rows, title=f"dpfit evaluate: {args.model}"))
    return 0
