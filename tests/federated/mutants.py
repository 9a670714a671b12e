"""Federated privacy mutants: apply each small bug to a copy of src/, run the fast federated
tests against it, report which mutants the tests kill and which survive.

    PYTHONPATH=src python tests/federated/mutants.py            # all mutants (minutes each)
    PYTHONPATH=src python tests/federated/mutants.py --only 2 4  # some of them

Exit status 1 if any mutant survives. Not collected by pytest (no test_ prefix): it runs the
suite many times over.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FED = "src/dpfit/federated"

# (description, file, original text, mutated text)
MUTANTS: list[tuple[str, str, str, str]] = [
    (
        "sampling and noise seeded from a public constant",
        f"{FED}/strategy.py",
        "root = np.random.SeedSequence(secrets.randbits(128))",
        "root = np.random.SeedSequence(0)",
    ),
    (
        "update noise scaled by the initial C (rule)",
        f"{FED}/clipping/base.py",
        "return self.update_multiplier * self.clip_norm",
        "return self.update_multiplier * self.config.initial_clip",
    ),
    (
        "update noise scaled by the initial C (server)",
        f"{FED}/strategy.py",
        "std = self.rule.update_noise_std()",
        "std = self.rule.update_multiplier * self.initial_clip",
    ),
    (
        "quantile count noise removed",
        f"{FED}/clipping/quantile.py",
        "noise = rng.normal(0.0, count_noise_std) if count_noise_std > 0 else 0.0",
        "noise = 0.0",
    ),
    (
        "DP-CLAC loss noise removed",
        f"{FED}/clipping/clac.py",
        "total += rng.normal(0.0, noise_std)",
        "total += 0.0",
    ),
    (
        "quantile rule draws its noise from a fixed generator",
        f"{FED}/clipping/quantile.py",
        "self.count_noise_std(self.config),\n            rng,",
        "self.count_noise_std(self.config),\n            np.random.default_rng(0),",
    ),
    (
        "DP-CLAC draws its noise from a fixed generator",
        f"{FED}/clipping/clac.py",
        "self.loss_noise_std(),\n            rng,",
        "self.loss_noise_std(),\n            np.random.default_rng(0),",
    ),
    (
        "automatic clipping at 2R",
        f"{FED}/clipping/automatic.py",
        "return bound / (norm + gamma)",
        "return 2 * bound / (norm + gamma)",
    ),
    (
        "ledger records the first round's multipliers every round",
        f"{FED}/strategy.py",
        "return self.rule.current_multipliers()",
        "return type(self.rule).round_multipliers(self.rule.config)",
    ),
    (
        "dynamic schedule stuck at z_0",
        f"{FED}/clipping/dynamic.py",
        "dynamic_multiplier(config.noise_multiplier, config.noise_decay, t, config.total_rounds)",
        "dynamic_multiplier(config.noise_multiplier, config.noise_decay, 0, config.total_rounds)",
    ),
    (
        "average divided by the clients that answered",
        f"{FED}/strategy.py",
        "m = self.config.clients_per_round",
        "m = max(1, len(norms))",
    ),
    (
        "exact client count released in metrics.json",
        f"{FED}/outputs.py",
        '        "insecure_seed": server.insecure,\n',
        '        "insecure_seed": server.insecure,\n'
        '        "clients": server.last_counts.sampled if server.last_counts else 0,\n',
    ),
    (
        "vote reply carries the candidate losses",
        f"{FED}/client.py",
        'MetricRecord({"vote": one_hot_vote(losses)})',
        'MetricRecord({"vote": one_hot_vote(losses), "losses": losses})',
    ),
    (
        "training reply carries the client's example count",
        f"{FED}/client.py",
        "metrics: dict[str, Any] = {}",
        'metrics: dict[str, Any] = {"num_examples": len(texts)}',
    ),
    (
        "DP-CLAC client sends its raw loss",
        f"{FED}/client.py",
        'metrics["loss_before"] = clamp_loss(loss, float(cfg["loss_bound"]))',
        'metrics["loss_before"] = loss',
    ),
    (
        "a second continuation of a checkpoint goes ahead without --fork",
        f"{FED}/strategy.py",
        'd / state["params_file"], self.round, self.config.allow_fork',
        'd / state["params_file"], self.round, True',
    ),
    (
        "a secure continuation reseeds its generators from public state",
        f"{FED}/strategy.py",
        "            self.continuation = ckpt.claim_continuation(",
        "            self.sampling_rng, self.noise_rng = server_generators(self.round)\n"
        "            self.continuation = ckpt.claim_continuation(",
    ),
]

# reply validation and DP-CLAC's significant-decrease rule
MUTANTS += [
    (
        "vote validation accepts any vector summing to 1 (e.g. [1, 1, -1])",
        f"{FED}/strategy.py",
        "if any(x not in (0.0, 1.0) for x in values) or sum(values) != 1.0:",
        "if sum(values) != 1.0:",
    ),
    (
        "DP-CLAC shrinks on any decrease of the noised loss",
        f"{FED}/clipping/clac.py",
        "if anchor - loss > significance * math.sqrt(2.0) * loss_std:",
        "if anchor - loss > 0:",
    ),
    (
        "a non-finite client loss reaches the rule",
        f"{FED}/strategy.py",
        "loss = None if loss is None else validate_loss(loss)",
        "loss = None if loss is None else float(loss)",
    ),
]

# huge and duplicate replies, forks, and the label gate's unit
MUTANTS += [
    (
        "label gate counts rows, not distinct clients",
        f"{FED}/data.py",
        'units = LabelUnits.count(row_labels, row_clients, "clients")',
        'units = LabelUnits.count(row_labels, range(len(row_labels)), "clients")',
    ),
    (
        "update values beyond float32 range accepted",
        f"{FED}/strategy.py",
        "if a.size and float(np.max(np.abs(a.astype(np.float64)))) > FLOAT32_MAX:",
        "if False:",
    ),
    (
        "update norm squared without scaling (overflows to inf)",
        f"{FED}/clipping/base.py",
        "return big * math.sqrt(sum(float(np.sum(np.square(a / big))) for a in arrays))",
        "return math.sqrt(sum(float(np.sum(np.square(a))) for a in arrays))",
    ),
    (
        "clip casts to float32 before scaling (inf x 0 = NaN)",
        f"{FED}/clipping/base.py",
        "return [(np.asarray(a, dtype=np.float64) * float(factor)).astype(np.float32) for a in arrays]",
        "return [np.asarray(a, dtype=np.float32) * np.float32(factor) for a in arrays]",
    ),
    (
        "replies of one node counted as often as they arrive",
        f"{FED}/strategy.py",
        'for r in first_per_node(replies, lambda r: r.node_id, f"round {self.round} reply"):',
        "for r in replies:",
    ),
    (
        "votes of one node counted as often as they arrive",
        f"{FED}/strategy.py",
        "from_nodes = first_per_node(",
        "from_nodes = (lambda items, node, what: list(items))(",
    ),
    (
        "the Flower vote path drops the sender (no de-duplication)",
        f"{FED}/strategy.py",
        'votes.append(ClientVote(node, list(reply.content["vote"]["vote"])))',
        'votes.append(list(reply.content["vote"]["vote"]))',
    ),
    (
        "fork epsilon counts this continuation only",
        f"{FED}/accounting.py",
        "extra = max(0, continuations - 1)",
        "extra = 0",
    ),
]

# two-sided DP-LAC (lac-2s): its noise where drawn and where accounted, and its moves
L2S = f"{FED}/clipping/lac_two_sided.py"
MUTANTS += [
    (
        "lac-2s: vote noise halved when drawn",
        L2S,
        "        return [f * self.config.initial_clip for f in FACTORS]\n",
        "        return [f * self.config.initial_clip for f in FACTORS]\n\n"
        "    def initialise_from_votes(self, votes, rng):\n"
        "        from dataclasses import replace\n\n"
        "        full = self.config\n"
        "        self.config = replace(full, vote_noise_std=full.vote_noise_std / 2)\n"
        "        try:\n"
        "            return super().initialise_from_votes(votes, rng)\n"
        "        finally:\n"
        "            self.config = full\n",
    ),
    (
        "lac-2s: vote noise halved in the accountant only (one_off_multipliers)",
        L2S,
        "        return QuantileClip.round_multipliers(config)\n",
        "        return QuantileClip.round_multipliers(config)\n\n"
        "    @classmethod\n"
        "    def one_off_multipliers(cls, config):\n"
        "        return (config.vote_noise_std / 2,)\n",
    ),
    (
        "lac-2s: count noise halved when drawn",
        L2S,
        "self.count_noise_std(self.config),\n            rng,",
        "self.count_noise_std(self.config) / 2,\n            rng,",
    ),
    (
        "lac-2s: vote trial noise back to one round's",
        L2S,
        "return self.update_multiplier * math.sqrt(self.config.total_rounds)",
        "return self.update_multiplier",
    ),
    (
        "lac-2s: brake on any rise of the smoothed loss",
        L2S,
        "if level > self.best * (1 + RISE) and self.cooldown == 0",
        "if level > self.best and self.cooldown == 0",
    ),
    (
        "lac-2s: one-sided vote grid (C_init and below)",
        L2S,
        "return [f * self.config.initial_clip for f in FACTORS]",
        "return [f * self.config.initial_clip for f in FACTORS if f <= 1.0]",
    ),
    (
        "lac-2s: C grows while the validation loss rises",
        L2S,
        "allow_growth=self._healthy()",
        "allow_growth=True",
    ),
    (
        "a client's capped rows seeded by its position (a new client shifts every later one)",
        f"{FED}/examples.py",
        "    return client_cap(examples, task.examples_per_client, task.seed)",
        "    return subsample(examples, task.examples_per_client, task.seed * 7919 + partition_id)",
    ),
]

TESTS = [
    "tests/federated/test_label_gate.py",
    "tests/federated/test_clipping.py",
    "tests/federated/test_accounting.py",
    "tests/federated/test_strategy.py",
    "tests/federated/test_client.py::test_client_replies_carry_only_what_the_private_releases_use",
    "tests/federated/test_lac_two_sided.py",
    "tests/federated/test_partition_neighbours.py",
]


def run_mutant(index: int, desc: str, rel: str, old: str, new: str) -> bool:
    """True if the tests kill the mutant."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(ROOT / "src", src)
        target = Path(tmp) / rel
        text = target.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"mutant {index} ({desc}): pattern not found once in {rel}")
        target.write_text(text.replace(old, new))
        env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
        cmd += ["-m", "not slow", "-k", "not dirichlet", *TESTS]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    killed = proc.returncode != 0
    lines = proc.stdout.strip().splitlines()
    tail = lines[-1] if lines else ""
    # which test killed it (pytest's short summary names the first failure under -x)
    by = next((ln.split(" - ")[0] for ln in lines if ln.startswith(("FAILED ", "ERROR "))), "")
    print(f"[{index:2d}] {'killed ' if killed else 'SURVIVED'} {desc}  ({tail}) {by}", flush=True)
    return killed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", type=int, nargs="+", default=None)
    args = p.parse_args()
    chosen = [(i, m) for i, m in enumerate(MUTANTS) if args.only is None or i in args.only]
    survived = [i for i, m in chosen if not run_mutant(i, *m)]
    print(f"{len(chosen) - len(survived)}/{len(chosen)} killed; survived: {survived or 'none'}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
