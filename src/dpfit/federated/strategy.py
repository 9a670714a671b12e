"""Client-level DP-FedAvg as a Flower Strategy, over a framework-free server core.

``DPFedAvgServer`` holds everything that matters for privacy and can be driven without
Flower: Poisson client sampling (each client independently with q = m / N), validation of
replies, clipping with the rule's C, one Gaussian draw on the sum, division by the expected
m (equal weights, so z * C / m is the true sensitivity), the accountant, the budget stop and
checkpoints. ``DPFedAvg`` adapts it to Flower's Strategy / Grid / Message API.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from flwr.serverapp.strategy import Strategy

from dpfit import checkpoint as ckpt
from dpfit import progress
from dpfit.federated.accounting import (
    BudgetExhausted,
    ClientLevelAccountant,
    calibrate_noise_multiplier,
)
from dpfit.federated.clipping import (
    ClipRuleError,
    LacClip,
    PublicTrialClip,
    RoundObservation,
    VotedStart,
    clip_rule_class,
    make_clip_rule,
)
from dpfit.federated.public_trial import TrialFn
from dpfit.federated.server_config import ServerConfig
from dpfit.federated.tuning import tuning_event

logger = logging.getLogger(__name__)

EvaluateFn = Callable[[Sequence[np.ndarray]], tuple[float, float]]
T = TypeVar("T")


class InvalidReply(ValueError):
    """A client's reply is unusable: it is dropped and counted, and the round goes on."""


class InvalidUpdate(InvalidReply):
    """A client's update is unusable (non-finite values, wrong number or shapes of arrays)."""


class InvalidVote(InvalidReply):
    """A client's vote is not a one-hot vector over the candidates."""


class CheckpointMismatch(RuntimeError):
    """A checkpoint was written by a run with a different privacy configuration."""


class NoClientsAvailable(RuntimeError):
    """No SuperNode registered within the wait time."""


@dataclass(frozen=True)
class ClientReply:
    """One client's answer to a training round, as the server core sees it."""

    node_id: int
    update: list[np.ndarray] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class ClientVote:
    """One client's clip-candidate vote, with the node that sent it (for de-duplication)."""

    node_id: int
    vote: Any


def first_per_node(items: Iterable[T], node: Callable[[T], int], what: str) -> list[T]:
    """At most one item per node: the first to arrive; later ones are dropped with a warning.

    Each sampled client contributes once to a release, which is what its sensitivity (C for
    an update, 1 for a vote) assumes: three copies of one reply would move the sum by 3C.
    The first reply counts whatever it holds (a malformed first reply is not replaced by a
    later one): a copy of it is a retransmission and loses nothing, and a client that sends
    different replies is faulty, so none of its later ones should count. Keeping the first is
    deterministic given the arrival order and needs no comparison of the replies' contents.
    """
    seen: set[int] = set()
    kept: list[T] = []
    for item in items:
        n = node(item)
        if n in seen:
            logger.warning("another %s from client %s dropped: one per client counts", what, n)
            continue
        seen.add(n)
        kept.append(item)
    return kept


@dataclass(frozen=True)
class RoundRecord:
    """What a round releases: functions of the noised model and of public settings only.

    C_t and the noise std are post-processing of earlier noised releases; the validation
    loss and accuracy are measured on the server's public validation split.
    """

    round: int
    clip_norm: float
    next_clip: float
    val_loss: float
    accuracy: float
    epsilon: float
    noise_std: float


@dataclass(frozen=True)
class RoundCounts:
    """Exact per-round client counts, timing and the median update norm: for the operator's
    log, never released.

    How many sampled clients answered, and how large their raw updates were, are statistics
    of who took part with no noise on them; they go to the DEBUG log (``-vv``) and nowhere
    else (a benchmark that is not private anyway may read them from ``last_counts``).
    """

    round: int
    sampled: int
    answered: int
    rejected: int
    seconds: float
    median_update_norm: float = math.nan


# The server's model is float32: a value beyond its range cannot come from a float32 model,
# and squared in a norm it overflows (1e200 in float64 gives an infinite norm, then inf x 0).
FLOAT32_MAX = float(np.finfo(np.float32).max)


def validate_update(update: Sequence[np.ndarray], shapes: Sequence[tuple[int, ...]]) -> None:
    """Raise InvalidUpdate unless the update matches the model, is finite everywhere and
    fits float32 (so its float64 norm is finite and clipping it cannot give NaN)."""
    if len(update) != len(shapes):
        raise InvalidUpdate(f"expected {len(shapes)} arrays, got {len(update)}")
    for i, (a, s) in enumerate(zip(update, shapes, strict=True)):
        a = np.asarray(a)
        if tuple(a.shape) != tuple(s):
            raise InvalidUpdate(f"array {i} has shape {tuple(a.shape)}, expected {tuple(s)}")
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
            raise InvalidUpdate(f"array {i} has dtype {a.dtype}, expected numbers")
        if not np.all(np.isfinite(a)):
            raise InvalidUpdate(f"array {i} has NaN or Inf values")
        if a.size and float(np.max(np.abs(a.astype(np.float64)))) > FLOAT32_MAX:
            raise InvalidUpdate(
                f"array {i} has values beyond float32's range (|x| up to "
                f"{float(np.max(np.abs(a.astype(np.float64)))):.3g} > {FLOAT32_MAX:.3g}); "
                "the model is float32, so the update is malformed"
            )


def validate_loss(value: Any) -> float:
    """A reported client loss as a float; InvalidReply if it is not a finite number."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise InvalidReply(f"loss {value!r} is not a number") from None
    if not math.isfinite(x):
        raise InvalidReply(f"loss {x} is not finite")
    return x


def validate_vote(vote: Any, num_candidates: int) -> list[int]:
    """The vote as a list of ints; InvalidVote unless it is one-hot over the candidates."""
    try:
        values = [float(x) for x in vote]
    except (TypeError, ValueError):
        raise InvalidVote(f"vote {vote!r} is not a list of numbers") from None
    if len(values) != num_candidates:
        raise InvalidVote(f"vote has {len(values)} entries, expected {num_candidates}")
    if any(x not in (0.0, 1.0) for x in values) or sum(values) != 1.0:
        raise InvalidVote(f"vote {values} is not one-hot")
    return [int(x) for x in values]


def server_generators(
    insecure_seed: int | None,
) -> tuple[np.random.Generator, np.random.Generator]:
    """(sampling, noise) generators: seeded from the OS's CSPRNG unless ``insecure_seed``.

    Two independent streams so that the sampling decisions and the noise never share draws.
    Their state is secret: whoever holds it can regenerate every noise vector.
    """
    if insecure_seed is None:
        root = np.random.SeedSequence(secrets.randbits(128))
    else:
        logger.warning(
            "insecure_seed=%d: client sampling and noise are reproducible from this number; "
            "the run is NOT private against anyone who knows it",
            insecure_seed,
        )
        root = np.random.SeedSequence(int(insecure_seed))
    sampling, noise = root.spawn(2)
    return np.random.default_rng(sampling), np.random.default_rng(noise)


class DPFedAvgServer:
    """Server state and one-round logic, independent of the transport."""

    def __init__(
        self,
        config: ServerConfig,
        initial_arrays: Sequence[np.ndarray],
        evaluate_fn: EvaluateFn | None = None,
        trial_fn: TrialFn | None = None,
    ) -> None:
        self.config = config
        self.trial_fn = trial_fn  # the public trial (public-trial rule); public data only
        self.params = [np.asarray(a, dtype=np.float32).copy() for a in initial_arrays]
        self.shapes = [tuple(a.shape) for a in self.params]
        self.evaluate_fn = evaluate_fn
        rule_cls = clip_rule_class(config.method)
        prior = tuning_event(config)
        if config.noise_multiplier is not None:
            self.noise_multiplier = float(config.noise_multiplier)
            target = None
        else:
            one_offs = rule_cls.one_off_multipliers(config.clip_config(1.0))
            self.noise_multiplier = calibrate_noise_multiplier(
                config.target_epsilon,
                config.delta,
                config.sample_rate,
                config.rounds,
                one_offs,
                config.accountant,
                schedule=(
                    (lambda z: rule_cls.schedule(config.clip_config(z), config.rounds))
                    if rule_cls.scheduled
                    else None
                ),
                prior=prior,
            )
            target = config.target_epsilon
        self.rule = make_clip_rule(config.method, config.clip_config(self.noise_multiplier))
        self.accountant = ClientLevelAccountant(
            num_clients=config.num_clients,
            expected_clients=config.clients_per_round,
            delta=config.delta,
            kind=config.accountant,
            target_epsilon=target,
            prior=prior,
        )
        self.sampling_rng, self.noise_rng = server_generators(config.insecure_seed)
        self.insecure = config.insecure_seed is not None
        self.continuation: ckpt.Continuation | None = None  # set by a secure resume
        self.shared_one_offs = 0  # one-off releases on the ledger of the checkpoint continued
        self.round = 0
        self.initialised = False
        self.initial_clip = self.rule.clip_norm
        self.vote_counts: list[float] = []
        self.votes_rejected = 0  # operator's log only
        self.history: list[RoundRecord] = []
        self.stop_reason: str | None = None
        self.last_counts: RoundCounts | None = None  # operator's log only
        logger.info(
            "method=%s z=%.4f q=%.4f update multiplier=%.4f",
            config.method,
            self.noise_multiplier,
            config.sample_rate,
            self.rule.update_multiplier,
        )

    # -- schedule ------------------------------------------------------------------------

    @property
    def round_multipliers(self) -> tuple[float, ...]:
        """The Gaussian releases of the next round (they change by round for some rules)."""
        return self.rule.current_multipliers()

    def sample_clients(self, node_ids: Sequence[int]) -> list[int]:
        """Poisson sampling: each client independently with probability q = m / N."""
        q = self.config.sample_rate
        draws = self.sampling_rng.random(len(node_ids))
        return [int(n) for n, u in zip(sorted(node_ids), draws, strict=True) if u < q]

    def evaluate(self) -> tuple[float, float]:
        if self.evaluate_fn is None:
            return math.nan, math.nan
        return self.evaluate_fn(self.params)

    # -- initialisation (DP-LAC votes, v_0) ------------------------------------------------

    def vote_query_config(self) -> dict[str, Any]:
        assert isinstance(self.rule, VotedStart)
        return {
            "candidates": self.rule.candidates(),
            "noise_multiplier": self.rule.vote_trial_multiplier(),
            "expected_clients": float(self.config.clients_per_round),
        }

    def initialise(self, votes: Sequence[ClientVote | Sequence[int]] | None = None) -> None:
        """Before round 1: the private vote for C0 (DP-LAC, DP-CLAC) and, for DP-LAC, the
        validation loss v_0. Malformed votes are dropped and counted (operator's log).

        ``votes``: ClientVote (from a transport: one per node counts, the first) or bare
        vectors (an in-process engine that makes exactly one per client)."""
        if isinstance(self.rule, VotedStart):
            good = []
            sent = list(votes or [])
            from_nodes = first_per_node(
                (v for v in sent if isinstance(v, ClientVote)), lambda v: v.node_id, "vote"
            )
            self.votes_rejected = sum(isinstance(v, ClientVote) for v in sent) - len(from_nodes)
            bare = [v for v in sent if not isinstance(v, ClientVote)]
            for v in [c.vote for c in from_nodes] + bare:
                try:
                    good.append(validate_vote(v, len(self.rule.candidates())))
                except InvalidVote as exc:
                    self.votes_rejected += 1
                    logger.warning("vote dropped: %s", exc)
            counts = self.rule.initialise_from_votes(good, self.noise_rng)
            self.vote_counts = [float(c) for c in counts]
            if self.rule.config.vote_noise_std > 0:
                self.accountant.record_one_off(self.rule.config.vote_noise_std)
            else:
                self.accountant.record_one_off(0.0)
            logger.debug(
                "operator only: %d well-formed votes, %d dropped", len(good), self.votes_rejected
            )
            logger.info(
                "vote: sigma_h=%.3g, noised counts %s -> C0=%.4g",
                self.rule.config.vote_noise_std,
                np.round(counts, 2).tolist(),
                self.rule.clip_norm,
            )
        if isinstance(self.rule, PublicTrialClip):
            if self.trial_fn is None:
                raise ClipRuleError(
                    "--method public-trial needs the server's trial on its public validation "
                    "data, which this server was built without; use an engine that provides "
                    "it (batched, local, simulation, deployment) or another --method"
                )
            losses = self.trial_fn(
                self.params, self.rule.candidates(), self.rule.trial_noise_per_clip(),
                self.noise_rng,
            )  # fmt: skip
            self.rule.initialise_from_trial(losses)
        if isinstance(self.rule, LacClip):
            v0, _ = self.evaluate()
            self.rule.observe_validation(v0)
        self.initial_clip = self.rule.clip_norm
        self.initialised = True

    # -- one round ---------------------------------------------------------------------------

    def check_budget(self) -> None:
        """Raise BudgetExhausted if the next round would pass the target epsilon."""
        self.accountant.check_round(self.round_multipliers)

    def can_run_another_round(self) -> bool:
        """False (and the reason kept in ``stop_reason``) once the next round would pass
        the target epsilon: every engine stops the same way."""
        try:
            self.check_budget()
        except BudgetExhausted as exc:
            self.stop_reason = str(exc)
            logger.error("%s", exc)
            return False
        return True

    def aggregate(self, sampled: Sequence[int], replies: Iterable[ClientReply]) -> RoundRecord:
        """Clip, sum, noise once, divide by expected m; account for the sampling performed."""
        t0 = time.perf_counter()
        self.round += 1
        clip = self.rule.clip_norm
        total = [np.zeros_like(p) for p in self.params]
        norms: list[float] = []
        losses: list[float] = []
        answered = rejected = 0
        sampled_set = set(sampled)
        for r in first_per_node(replies, lambda r: r.node_id, f"round {self.round} reply"):
            if r.node_id not in sampled_set:
                logger.warning(
                    "round %d: reply from unsampled node %s ignored", self.round, r.node_id
                )
                continue
            answered += 1
            if r.error is not None or r.update is None:
                rejected += 1
                logger.warning("round %d: client %s failed: %s", self.round, r.node_id, r.error)
                continue
            try:
                validate_update(r.update, self.shapes)
                loss = r.metrics.get("loss_before")
                loss = None if loss is None else validate_loss(loss)
            except InvalidReply as exc:
                rejected += 1
                logger.warning(
                    "round %d: reply of client %s rejected (dropped): %s",
                    self.round,
                    r.node_id,
                    exc,
                )
                continue
            clipped, norm = self.rule.clip(r.update)
            for acc, c in zip(total, clipped, strict=True):
                acc += c
            norms.append(norm)
            if loss is not None:
                losses.append(loss)
        std = self.rule.update_noise_std()
        m = self.config.clients_per_round
        for p, acc in zip(self.params, total, strict=True):
            noise = self.noise_rng.normal(0.0, std, size=p.shape) if std > 0 else 0.0
            p += (self.config.server_lr * (acc + noise) / m).astype(np.float32)
        self.accountant.record_round(self.round_multipliers)
        val_loss, acc = self.evaluate()
        next_clip = self.rule.observe(
            RoundObservation(
                update_norms=tuple(norms), client_losses=tuple(losses), val_loss=val_loss
            ),
            self.noise_rng,
        )
        record = RoundRecord(
            round=self.round,
            clip_norm=clip,
            next_clip=next_clip,
            val_loss=val_loss,
            accuracy=acc,
            epsilon=self.accountant.epsilon(),
            noise_std=std,
        )
        self.last_counts = RoundCounts(
            self.round,
            len(sampled),
            answered,
            rejected,
            time.perf_counter() - t0,
            float(np.median(norms)) if norms else math.nan,
        )
        logger.debug("operator only: %s", self.last_counts)
        self.history.append(record)
        if self.config.checkpoint_dir:
            self.save_checkpoint(self.config.checkpoint_dir)
        return record

    # -- checkpoints ---------------------------------------------------------------------

    def _fingerprint(self) -> dict[str, Any]:
        c = self.config
        return {
            "method": c.method,
            "num_clients": c.num_clients,
            "clients_per_round": c.clients_per_round,
            "delta": c.delta,
            "noise_multiplier": self.noise_multiplier,
            # an insecurely seeded run's generator state stays insecure after a resume
            "insecure_seed": self.insecure,
            "tuning": [c.tuning_noise_multiplier, c.tuning_mean_runs, c.tuning_shape],
            "shapes": [list(s) for s in self.shapes],
        }

    def state(self) -> dict[str, Any]:
        return {
            "fingerprint": self._fingerprint(),
            "round": self.round,
            "initialised": self.initialised,
            "initial_clip": self.initial_clip,
            "vote_counts": self.vote_counts,
            "rule": self.rule.state_dict(),
            "accountant": self.accountant.state_dict(),
            # generator states only for an insecure seed: a secure continuation draws fresh
            # OS randomness, so two continuations of one checkpoint never share noise
            "rng": (
                {
                    "sampling": self.sampling_rng.bit_generator.state,
                    "noise": self.noise_rng.bit_generator.state,
                }
                if self.insecure
                else None
            ),
            "history": [asdict(r) for r in self.history],
        }

    def save_checkpoint(self, directory: str | os.PathLike[str]) -> None:
        """Write params + state atomically: a crash mid-write leaves the previous round.

        A checkpoint holds the un-noised model between rounds and is secret; the generator
        states are in it only for an insecurely seeded run.
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tag = f"round{self.round:05d}"
        with tempfile.NamedTemporaryFile(dir=d, suffix=".npz", delete=False) as f:
            np.savez(f, *self.params)
        os.replace(f.name, d / f"{tag}.npz")
        state = dict(self.state(), params_file=f"{tag}.npz")
        with tempfile.NamedTemporaryFile("w", dir=d, suffix=".json", delete=False) as f:
            json.dump(state, f)
        os.replace(f.name, d / "state.json")
        for old in d.glob("round*.npz"):
            if old.name != f"{tag}.npz":
                old.unlink(missing_ok=True)
                for marker in ckpt.continuation_markers(old):
                    marker.unlink(missing_ok=True)

    def continuation_report(self) -> dict[str, Any] | None:
        """What this run's report says about the checkpoint it continued (None: it continued
        none). A fork also gets the epsilon of releasing every continuation of that
        checkpoint: the shared rounds once, each continuation's own rounds (each assumed as
        long as this one's) once per continuation, as ``dpfit.checkpoint.fork_report``."""
        c = self.continuation
        if c is None:
            return None
        report: dict[str, Any] = {
            "checkpoint": c.checkpoint,
            "continuation": c.number,
            "shared_rounds": c.steps,
            "fork": c.fork,
        }
        if c.fork:
            report["epsilon_if_all_continuations_released"] = (
                self.accountant.epsilon_if_all_continuations_released(
                    c.steps, self.shared_one_offs, c.number
                )
            )
            report["note"] = (
                f"continuation {c.number} of {c.checkpoint}: a fork. This run's epsilon counts "
                "its own rounds once; releasing the outputs of several continuations costs "
                f"the {c.steps} shared rounds composed with every continuation's own rounds "
                "(epsilon_if_all_continuations_released assumes each as long as this one)"
            )
        return report

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> bool:
        """Resume from ``directory`` if it holds a checkpoint; returns whether it did."""
        d = Path(directory)
        if not (d / "state.json").exists():
            return False
        state = json.loads((d / "state.json").read_text())
        mine = json.loads(json.dumps(self._fingerprint()))
        if state["fingerprint"] != mine:
            raise CheckpointMismatch(
                f"checkpoint in {d} was written with {state['fingerprint']}, this run is "
                f"{mine}; use another --checkpoint-dir or the same settings"
            )
        with np.load(d / state["params_file"]) as z:
            self.params = [z[f"arr_{i}"].astype(np.float32) for i in range(len(self.shapes))]
        self.round = int(state["round"])
        self.initialised = bool(state["initialised"])
        self.initial_clip = float(state["initial_clip"])
        self.vote_counts = list(state["vote_counts"])
        self.rule.load_state_dict(state["rule"])
        self.accountant.load_state_dict(state["accountant"])
        if self.insecure:
            self.sampling_rng.bit_generator.state = state["rng"]["sampling"]
            self.noise_rng.bit_generator.state = state["rng"]["noise"]
        else:
            # fresh OS randomness from here on; a second continuation of this round is a fork
            self.shared_one_offs = len(self.accountant.one_offs)
            self.continuation = ckpt.claim_continuation(
                d / state["params_file"], self.round, self.config.allow_fork
            )
        self.history = [RoundRecord(**r) for r in state["history"]]
        logger.info("resumed from %s at round %d (C=%.4g)", d, self.round, self.rule.clip_norm)
        return True


# --------------------------------------------------------------------------------------------
# Flower adapter
# --------------------------------------------------------------------------------------------


class DPFedAvg(Strategy):
    """Flower Strategy around ``DPFedAvgServer``; ``start`` runs vote, rounds and stops."""

    def __init__(
        self,
        server: DPFedAvgServer,
        task_record: dict[str, Any],
        on_round: Callable[[RoundRecord], None] | None = None,
    ) -> None:
        self.server = server
        self.task_record = dict(task_record)
        self.on_round = on_round
        self._sampled: list[int] = []

    # Strategy API ---------------------------------------------------------------------

    def _messages(self, arrays: Any, config: dict[str, Any], node_ids: Iterable[int], kind: str):
        from flwr.app import ConfigRecord, Message, RecordDict

        record = RecordDict({"arrays": arrays, "config": ConfigRecord(config)})
        return [Message(content=record, message_type=kind, dst_node_id=n) for n in node_ids]

    def configure_train(self, server_round: int, arrays: Any, config: Any, grid: Any):
        from flwr.app import MessageType

        self._sampled = self.server.sample_clients(list(grid.get_node_ids()))
        cfg = dict(self.task_record, server_round=server_round)
        cfg.update(dict(config or {}))
        cfg["report_loss"] = type(self.server.rule).needs_client_loss
        if cfg["report_loss"]:  # clients clamp their loss before it leaves them
            cfg["loss_bound"] = float(self.server.rule.config.loss_bound)
        return self._messages(arrays, cfg, self._sampled, MessageType.TRAIN)

    def aggregate_train(self, server_round: int, replies: Iterable[Any]):
        from flwr.app import ArrayRecord, MetricRecord

        parsed = [_parse_reply(m) for m in replies]
        record = self.server.aggregate(self._sampled, parsed)
        if self.on_round is not None:
            self.on_round(record)
        metrics = {k: v for k, v in asdict(record).items() if math.isfinite(float(v))}
        return ArrayRecord(self.server.params), MetricRecord(metrics)

    def configure_evaluate(self, server_round: int, arrays: Any, config: Any, grid: Any):
        return []  # evaluation is server-side, on the public validation set

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Any]):
        return None

    def summary(self) -> None:
        s = self.server
        logger.info(
            "DPFedAvg(%s): N=%d m=%.1f rounds=%d z=%.4f target eps=%s delta=%g",
            s.config.method,
            s.config.num_clients,
            s.config.clients_per_round,
            s.config.rounds,
            s.noise_multiplier,
            s.accountant.target_epsilon,
            s.config.delta,
        )

    # Orchestration --------------------------------------------------------------------

    def _wait_for_nodes(self, grid: Any) -> list[int]:
        deadline = time.monotonic() + self.server.config.node_wait_timeout
        want = self.server.config.num_clients
        nodes: list[int] = []
        while time.monotonic() < deadline:
            nodes = list(grid.get_node_ids())
            if len(nodes) >= want:
                return nodes
            time.sleep(0.5)
        if not nodes:
            raise NoClientsAvailable(
                f"no SuperNode registered within {self.server.config.node_wait_timeout}s"
            )
        logger.warning("only %d of %d clients registered; continuing", len(nodes), want)
        return nodes

    def _vote(self, grid: Any, nodes: list[int]) -> list[ClientVote]:
        from flwr.app import ArrayRecord, MessageType

        cfg = dict(self.task_record, **self.server.vote_query_config())
        msgs = self._messages(ArrayRecord(self.server.params), cfg, nodes, MessageType.QUERY)
        progress.report("clip vote", 0, len(nodes))  # every client scores every candidate
        votes = []
        for reply in gather_replies(grid, msgs, self.server.config.round_timeout, "clip vote"):
            if reply.has_error():
                logger.warning("vote query failed on a client: %s", reply.error)
                continue
            node = int(reply.metadata.src_node_id)
            try:
                votes.append(ClientVote(node, list(reply.content["vote"]["vote"])))
            except Exception as exc:  # malformed content: counted as a dropped vote
                logger.warning("vote reply malformed: %s", exc)
                votes.append(ClientVote(node, []))
        progress.report("clip vote", len(nodes), len(nodes))
        return votes

    def start(self, grid: Any, initial_arrays: Any = None, num_rounds: int | None = None, **_: Any):
        """Run to the configured rounds (resuming if a checkpoint exists) or the budget."""
        from flwr.app import ArrayRecord

        server = self.server
        self.summary()
        if server.config.checkpoint_dir:
            server.load_checkpoint(server.config.checkpoint_dir)
        nodes = self._wait_for_nodes(grid)
        if not server.initialised:
            votes = self._vote(grid, nodes) if type(server.rule).needs_votes else None
            server.initialise(votes)
        total = num_rounds or server.config.rounds
        while server.round < total and server.can_run_another_round():
            arrays = ArrayRecord(server.params)
            msgs = self.configure_train(server.round + 1, arrays, {}, grid)
            replies = grid.send_and_receive(msgs, timeout=server.config.round_timeout)
            self.aggregate_train(server.round + 1, replies)
        return server


def gather_replies(grid: Any, messages: Sequence[Any], timeout: float, stage: str) -> list[Any]:
    """The replies to ``messages``, with ``stage``'s progress moved on per client where the
    grid hands them over one at a time (``deliver``: the local engine's in-process grid).
    Flower's grids answer all at once, so there the stage reports only its start and end."""
    deliver = getattr(grid, "deliver", None)
    if deliver is None:
        return list(grid.send_and_receive(messages, timeout=timeout))
    out = []
    for done, reply in enumerate(deliver(messages), start=1):
        if reply is not None:
            out.append(reply)
        if done < len(messages):  # the end is the caller's report
            progress.report(stage, done, len(messages))
    return out


def _parse_reply(msg: Any) -> ClientReply:
    node = int(msg.metadata.src_node_id)
    if msg.has_error():
        return ClientReply(node, error=f"{msg.error.code}: {msg.error.reason}")
    try:
        update = msg.content["update"].to_numpy_ndarrays()
        metrics = dict(msg.content["metrics"])
    except Exception as exc:  # malformed content from a faulty client
        return ClientReply(node, error=f"malformed reply: {exc}")
    return ClientReply(node, update=update, metrics=metrics)
