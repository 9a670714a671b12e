"""``dpfit audit``: one training run with canaries, an empirical lower bound on epsilon.

Registered in dpfit.cli by name only; everything about the command lives here.
"""

from __future__ import annotations

import argparse
import logging
import sys

from dpfit.errors import DPFitError

log = logging.getLogger(__name__)

HELP = "empirical privacy audit: a lower bound on epsilon from one training run with canaries"
KINDS = ("white-box", "black-box", "federated")


def _pos_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _pos_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epsilon", type=_pos_float, default=8.0, help="claimed (target) epsilon")
    p.add_argument("--delta", type=_pos_float, default=1e-5, help="target delta (1e-5)")
    p.add_argument("--canaries", choices=KINDS, default="white-box", help="canary kind")
    p.add_argument(
        "--canaries-count", type=_pos_int, help="m (white-box/federated 1000, black-box 300)"
    )
    p.add_argument(
        "--steps", type=_pos_int, help="logical steps / rounds (white-box 1, black-box 4)"
    )
    p.add_argument(
        "--sample-rate", type=float, default=1.0, help="Poisson rate q = B / N (1: every slot)"
    )
    g = p.add_argument_group("model and data (as `dpfit train`)")
    g.add_argument(
        "--model", help="folder / hub id; `toy` for the synthetic model (default MiniLM)"
    )
    g.add_argument("--data", help="CSV/JSONL file (default: bundled Rotten Tomatoes)")
    g.add_argument("--text-column", default="text")
    g.add_argument("--label-column", default="label")
    g.add_argument(
        "--real-examples", type=_pos_int, default=256, help="training examples mixed in (256)"
    )
    g.add_argument("--max-length", type=_pos_int, default=16, help="tokens per example (16)")
    g.add_argument("--targets", help="comma-separated modules for white-box canaries")
    g = p.add_argument_group("mechanism")
    g.add_argument("--max-grad-norm", type=_pos_float, default=1.0)
    g.add_argument("--clipping", choices=("flat", "automatic"), default="flat")
    g.add_argument("--accountant", choices=("rdp", "pld"), default="rdp")
    g.add_argument("--lr", type=_pos_float, default=0.05, help="SGD learning rate")
    g.add_argument("--physical-batch-size", type=_pos_int, default=128)
    g = p.add_argument_group("audit")
    g.add_argument("--score", choices=("llr", "sum", "max"), default="llr")
    g.add_argument("--confidence", type=float, default=0.95)
    g.add_argument(
        "--seed", type=int, default=0, help="public randomness (canary directions, data)"
    )
    g.add_argument(
        "--insecure-seed",
        type=int,
        help="fix noise, sampling and canary inclusion (reproducible, NOT private; tests)",
    )
    p.add_argument("--plot", help="write the score histogram (PNG) here")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")


def _config(args: argparse.Namespace):
    from dpfit.audit.central import AuditConfig

    black = args.canaries == "black-box"
    return AuditConfig(
        epsilon=args.epsilon,
        delta=args.delta,
        canaries=args.canaries_count or (300 if black else 1000),
        steps=args.steps or (4 if black else 1),
        sample_rate=args.sample_rate,
        max_grad_norm=args.max_grad_norm,
        clipping=args.clipping,
        accountant=args.accountant,
        score=args.score,
        confidence=args.confidence,
        lr=args.lr,
        physical_batch_size=args.physical_batch_size,
        seed=args.seed,
        insecure_seed=args.insecure_seed,
    )


def _run_audit(args: argparse.Namespace):
    from dpfit.audit import central

    if args.canaries == "federated":
        from dpfit.audit.federated import FederatedAuditConfig, federated_audit

        return federated_audit(
            FederatedAuditConfig(
                epsilon=args.epsilon,
                delta=args.delta,
                canaries=args.canaries_count or 1000,
                rounds=args.steps or 1,
                sample_rate=args.sample_rate,
                clip=args.max_grad_norm,
                accountant=args.accountant,
                score=args.score,
                confidence=args.confidence,
                seed=args.seed,
                insecure_seed=args.insecure_seed,
            )
        )
    cfg = _config(args)
    targets = [t for t in (args.targets or "").split(",") if t]
    if args.model == "toy":
        from dpfit.audit import toy

        model = toy.toy_model(width=max(64, cfg.canaries), seed=args.seed)
        real = toy.toy_items(args.real_examples, seed=args.seed)
        if args.canaries == "white-box":
            return central.white_box_audit(
                model, real, toy.toy_collate, toy.toy_losses, targets or toy.TOY_TARGETS, cfg
            )
        return central.black_box_audit(
            model, real, toy.toy_canary_items(cfg.canaries), toy.toy_collate, toy.toy_losses, cfg
        )
    from dpfit.audit.text import classifier_losses, prepare_text_audit

    setup = prepare_text_audit(
        args.model,
        args.data,
        args.real_examples,
        cfg.canaries if args.canaries == "black-box" else 0,
        args.max_length,
        args.text_column,
        args.label_column,
        targets or None,
        args.seed,
    )
    for n in setup.notes:
        log.info(n)
    if args.canaries == "white-box":
        return central.white_box_audit(
            setup.model, setup.items, setup.collate, classifier_losses, setup.targets, cfg
        )
    return central.black_box_audit(
        setup.model, setup.items, setup.canary_items, setup.collate, classifier_losses, cfg
    )


def run(args: argparse.Namespace) -> int:
    from dpfit.reporting import format_table, to_json

    if args.insecure_seed is not None:
        print(
            "warning: --insecure-seed fixes the noise and sampling; the audited run is "
            "reproducible and NOT private",
            file=sys.stderr,
        )
    _check(args)
    result = _run_audit(args)
    if args.plot:
        from dpfit.audit.plot import plot_scores

        plot_scores(result, args.plot)
    out = result.to_dict()
    if args.plot:
        out["plot"] = args.plot
    if args.json:
        print(to_json(out, indent=None))
    else:
        rows = [
            ("canaries", f"{result.kind}, m={result.canaries} ({result.included} included)"),
            ("epsilon claimed", result.epsilon_claimed),
            ("epsilon lower bound", result.epsilon_lower_bound),
            ("confidence", result.confidence),
            ("largest certifiable", result.epsilon_ceiling),
            ("guesses (correct)", f"{result.guesses} ({result.correct})"),
            ("bound / claim", result.ratio),
            (
                "sigma, q, steps",
                f"{result.noise_multiplier:.4g}, {result.sample_rate:.4g}, {result.steps}",
            ),
            ("time (s)", result.seconds),
            ("verdict", _verdict(result)),
        ]
        print(format_table(rows, title="dpfit audit"))
    return 3 if result.violated else 0


def _verdict(result) -> str:
    if result.violated:
        return "CLAIM VIOLATED"
    if result.epsilon_ceiling <= result.epsilon_claimed:
        return "consistent; more canaries or a lower --epsilon could refute it"
    return "consistent with the claim"


def _check(args: argparse.Namespace) -> None:
    if not 0 < args.sample_rate <= 1:
        raise DPFitError(f"--sample-rate must be in (0, 1], got {args.sample_rate}")
