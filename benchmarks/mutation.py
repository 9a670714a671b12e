"""Mutation testing of the engine's privacy mechanism: does the suite catch each small bug?

Each mutation is a textual patch on a copy of src/dpfit in a temporary folder that also holds a
snapshot of tests/ (the checkout is never touched, and may change while this runs). The tests
that guard that part of the mechanism run against the copy (PYTHONPATH first); a mutation is *killed* when they fail, and *survives* when they pass. A
surviving mutation is a privacy bug the suite would let through. The unmutated copy runs the
same tests first and must pass, and every patch must apply exactly once (else the script stops:
the source moved and the mutation list needs updating).

    python benchmarks/mutation.py [--only NAME ...] [--out benchmarks/results/mutation]

Writes <out>.json and <out>.md; exits non-zero when a mutation survives.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = "dpfit/engine.py"
CLIPPED_SUM = "dpfit/clipped_sum.py"
PER_EXAMPLE = "dpfit/per_example.py"
GRADIENT_CHECK = "dpfit/gradient_check.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the bug, in words
    patches: tuple[tuple[str, str, str], ...]  # (file under src/, old text, new text)
    tests: tuple[str, ...]  # pytest arguments: files or node ids, optionally "-k expr"


MUTATIONS = (
    Mutation(
        "noise-halved",
        "noise std sigma*R/2 instead of sigma*R",
        (
            (
                ENGINE,
                "std = self.noise_multiplier * self.max_grad_norm",
                "std = 0.5 * self.noise_multiplier * self.max_grad_norm",
            ),
        ),
        ("tests/test_engine.py::test_noise_std_matches_sigma_R_over_B",),
    ),
    Mutation(
        "no-noise-on-empty-batch",
        "an empty logical batch releases no noise",
        (
            (
                ENGINE,
                "noise = gaussian_noise(summed.shape, std,",
                "noise = gaussian_noise(summed.shape, std if bool(summed.any()) else 0.0,",
            ),
        ),
        ("tests/test_sampling.py::test_empty_logical_batches_release_full_noise",),
    ),
    Mutation(
        "no-noise-on-idle-parameter",
        "a parameter without a gradient this step gets no noise",
        (
            (
                ENGINE,
                "total = summed + noise",
                "total = summed + noise * (summed != 0)",
            ),
        ),
        ("tests/test_sampling.py::test_parameter_without_gradient_still_gets_noise",),
    ),
    Mutation(
        "divide-by-actual-batch",
        "noisy sum divided by the actual Poisson batch size instead of the expected one",
        (
            (
                ENGINE,
                "denom = float(self.config.expected_batch_size)",
                "denom = float(self._steps.current.size if self._steps.current is not None else self.config.expected_batch_size)",
            ),
        ),
        ("tests/test_sampling.py", "-k", "noiseless"),
    ),
    Mutation(
        "physical-batches-not-accumulated",
        "each physical batch's clipped sum replaces the running sum instead of adding to it",
        (
            (
                CLIPPED_SUM,
                "self._sum += clipped.to(self._sum.device)",
                "self._sum = clipped.float()",
            ),
        ),
        ("tests/test_engine.py::test_virtual_steps_equal_one_big_batch",),
    ),
    Mutation(
        "noise-on-every-rank",
        "distributed: every rank adds sigma*R noise before the all-reduce (sqrt(W) too much)",
        ((ENGINE, "std = 0.0  # the noise is added exactly once, by rank 0", "pass"),),
        ("tests/distributed/test_engine.py::test_noise_is_added_exactly_once_across_ranks",),
    ),
    Mutation(
        "clip-skipped",
        "per-example gradients summed without clipping",
        (
            (
                CLIPPED_SUM,
                "factors = clip_fn(sq.sqrt(), max_grad_norm)",
                "factors = torch.ones_like(sq)",
            ),
        ),
        ("tests/test_clipping.py", "tests/test_sampling.py", "-k", "clip or noiseless"),
    ),
    Mutation(
        "automatic-clip-at-2R",
        "automatic clipping scaled to 2R",
        (
            (
                "dpfit/clipping.py",
                "return max_grad_norm / (norms + AUTOMATIC_GAMMA)",
                "return 2 * max_grad_norm / (norms + AUTOMATIC_GAMMA)",
            ),
        ),
        ("tests/test_clipping.py",),
    ),
    Mutation(
        "flat-clip-at-2R",
        "flat clipping scaled to 2R",
        (
            (
                "dpfit/clipping.py",
                "return (max_grad_norm / norms",
                "return (2 * max_grad_norm / norms",
            ),
        ),
        ("tests/test_clipping.py",),
    ),
    Mutation(
        "loader-rate-doubled",
        "the engine's loader samples at 2q while the ledger records q",
        (
            (
                ENGINE,
                "            self.sample_rate,\n            self.config.steps_per_epoch,",
                "            2 * self.sample_rate,\n            self.config.steps_per_epoch,",
            ),
        ),
        ("tests/test_sampling.py", "-k", "rate"),
    ),
    Mutation(
        "loader-rate-halved",
        "the engine's loader samples at q/2 while the ledger records q",
        (
            (
                ENGINE,
                "            self.sample_rate,\n            self.config.steps_per_epoch,",
                "            self.sample_rate / 2,\n            self.config.steps_per_epoch,",
            ),
        ),
        ("tests/test_sampling.py", "-k", "rate"),
    ),
    Mutation(
        "rate-doubled-everywhere",
        "q = 2B/N in the config (loader and ledger agree, both wrong)",
        (
            (
                "dpfit/config.py",
                "return self.expected_batch_size / self.sample_size",
                "return 2 * self.expected_batch_size / self.sample_size",
            ),
        ),
        ("tests/test_sampling.py", "-k", "rate"),
    ),
    Mutation(
        "ledger-rate-halved",
        "the accountant is told q/2",
        (
            (
                "dpfit/accounting.py",
                "PoissonSampledDpEvent(\n                self.sample_rate, gauss",
                "PoissonSampledDpEvent(\n                self.sample_rate / 2, gauss",
            ),
        ),
        ("tests/test_accounting.py",),
    ),
    Mutation(
        "default-rng-fixed-seed",
        "noise and sampling generators seeded from a fixed public value by default",
        (
            (
                "dpfit/rng.py",
                "value = secure_seed() if seed is None else",
                "value = 0 if seed is None else",
            ),
        ),
        ("tests/test_engine.py", "-k", "reproducible or insecure_seed or os_urandom"),
    ),
    Mutation(
        "secure-rng-ignored-by-noise",
        "secure_rng=True, but the engine draws noise from a seeded torch generator",
        (
            (ENGINE, "        if self.config.secure_rng:\n            return None, None\n", ""),
            (
                ENGINE,
                "self._noise_rng, self.config.secure_rng, summed",
                "self._noise_rng, False, summed",
            ),
        ),
        ("tests/test_engine.py", "-k", "secure_rng"),
    ),
    Mutation(
        "secure-rng-ignored-by-loader",
        "secure_rng=True, but the engine's loader samples from a seeded torch generator",
        ((ENGINE, "            secure=self.config.secure_rng,\n", "            secure=False,\n"),),
        ("tests/test_engine.py", "-k", "secure_rng"),
    ),
    Mutation(
        "dist-sampling-forked-streams",
        "distributed: each rank draws its own global sample (OS-seeded) and keeps its part of "
        "it, so one example can be in two ranks' parts of one logical batch",
        (
            (
                ENGINE,
                "torch.Generator().manual_seed(shared_seed(self._dist))",
                'make_generator(seed, "sampling")',
            ),
        ),
        ("tests/distributed/test_engine.py::test_the_union_of_rank_parts_is_poisson_at_q",),
    ),
    Mutation(
        "dist-sampling-whole-on-every-rank",
        "distributed: every rank trains on the whole global sample (each example W times)",
        (
            (
                "dpfit/sampling.py",
                "chosen = chosen[self.part.rank :: self.part.world_size]",
                "chosen = chosen",
            ),
        ),
        ("tests/distributed/test_engine.py", "-k", "union or split"),
    ),
    Mutation(
        "dist-secure-draws-not-shared",
        "distributed secure_rng: each rank draws its own sample from os.urandom",
        (
            (
                "dpfit/sampling.py",
                "return self.part.share(mine)",
                "return (os_uniform(self.num_samples) < self.sample_rate).nonzero().flatten()",
            ),
        ),
        ("tests/distributed/test_engine.py::test_secure_draws_are_shared_from_rank_0",),
    ),
    Mutation(
        "batch-axis-unchecked",
        "per-example row count not compared with the batch the loader drew",
        ((ENGINE, "if expected is None or rows == expected:", "if True:"),),
        ("tests/test_engine.py", "-k", "sequence_first or batch_size"),
    ),
    Mutation(
        "forwards-mixed",
        "gradients of two forward passes reach one step (rows of two batches summed)",
        ((PER_EXAMPLE, "if len(fids) > 1:", "if False:"),),
        ("tests/test_engine.py::test_gradients_of_two_forward_passes_in_one_step_are_refused",),
    ),
    Mutation(
        "gradient-check-blind",
        "per-example sums never compared with autograd's gradient (a missed use of a bias passes)",
        ((GRADIENT_CHECK, "if err > tol * size + 1e-6:", "if False:"),),
        (
            "tests/test_engine.py::test_bias_used_outside_its_module_is_caught",
            "tests/test_gradient_check.py",
        ),
    ),
    Mutation(
        "bf16-norms",
        "full-mode norms and sums accumulated in the model's dtype (bf16)",
        (
            (
                "dpfit/grad_sample/full.py",
                "return torch.float64 if dtype == torch.float64 else torch.float32",
                "return dtype",
            ),
        ),
        ("tests/grad_sample/test_full.py", "-k", "bf16"),
    ),
    Mutation(
        "resume-drops-noise-state",
        "the engine's state_dict leaves out the noise generator",
        (
            (
                ENGINE,
                '"noise_rng": None if self._noise_rng is None else self._noise_rng.get_state(),',
                '"noise_rng": None,',
            ),
        ),
        ("tests/test_engine.py", "-k", "resume"),
    ),
    Mutation(
        "empty-batch-not-a-step",
        "an empty logical batch is skipped (neither noised nor accounted)",
        (
            (
                ENGINE,
                "        self._finish_logical_step(self._optimizer)\n        return True\n",
                "        return True\n",
            ),
        ),
        ("tests/test_engine.py", "tests/test_sampling.py", "-k", "empty"),
    ),
    Mutation(
        "rdp-calibration-undershoots",
        "the RDP-calibrated noise multiplier is 5% too small",
        (
            (
                "dpfit/accounting.py",
                "return _calibrate_rdp(make_event, target_epsilon, delta, upper, tolerance)\n    return",
                "return 0.95 * _calibrate_rdp(make_event, target_epsilon, delta, upper, tolerance)\n    return",
            ),
        ),
        ("tests/test_accounting.py", "-k", "tightly and rdp"),
    ),
    Mutation(
        "pld-calibration-undershoots",
        "the PLD-calibrated noise multiplier is 5% too small",
        (
            (
                "dpfit/accounting.py",
                "return _calibrate_pld(make_event",
                "return 0.95 * _calibrate_pld(make_event",
            ),
        ),
        ("tests/test_accounting.py", "-k", "tightly and pld"),
    ),
    # bf16 compute (dpfit.precision): under bf16 autocast the mechanism stays float32
    Mutation(
        "bf16-clip-norms",
        "bf16 autocast: the per-example norms that set the clip factors are taken in bf16, so a "
        "clipped contribution can exceed R by up to 0.4%",
        (
            (
                CLIPPED_SUM,
                "sq = dense.pow(2).sum(1) * scale**2",
                "sq = dense.bfloat16().pow(2).sum(1).float() * scale**2",
            ),
        ),
        ("tests/test_precision.py", "-k", "exceeds_R"),
    ),
    Mutation(
        "bf16-position-sums",
        "bf16 autocast: per-example bias gradients summed over positions into bf16 (every row "
        "rounded to 8 bits before its norm)",
        (
            (
                "dpfit/grad_sample/registry.py",
                "accumulate and return float32 (dpfit.precision)\n"
                "        return g.sum(dim=dims, dtype=torch.float32)",
                "accumulate and return float32 (dpfit.precision)\n        return g.sum(dim=dims)",
            ),
        ),
        ("tests/test_precision.py", "-k", "sums_over_positions"),
    ),
    # the public-label-name gate counts the rows that train, not the file
    Mutation(
        "label-gate-counts-whole-file",
        "the 20-example label-name gate counts the whole file (before hold-out and subsample)",
        (
            (
                "dpfit/tasks/classification.py",
                "notes.insert(label_note_at, _public_label_note(train, config))",
                "notes.insert(label_note_at, _public_label_note(load_texts(config.data, "
                "config.text_column, config.label_column, label_names=config.labels), config))",
            ),
        ),
        ("tests/test_train.py::test_label_gate_counts_the_rows_that_train",),
    ),
    # image task: the same gate counts the images that train
    Mutation(
        "image-label-gate-counts-whole-set",
        "the image task's label-name gate counts every image read (before hold-out and subsets)",
        (
            (
                "dpfit/tasks/image_classification.py",
                "label_source, note = _label_names(data, config, source, all_public)",
                "label_source, note = _label_names(load_images(config.data, 'train', "
                "config.labels, image_size=opts.image_size), config, source, all_public)",
            ),
        ),
        ("tests/vision/test_label_names.py::test_frequent_or_declared_names_pass",),
    ),
    # --resume without a checkpoint must not start over (budget spent twice)
    Mutation(
        "resume-without-checkpoint-starts-over",
        "--resume with a missing or empty checkpoint folder silently trains from scratch",
        (
            (
                "dpfit/checkpoint.py",
                "            return found[-1][1]\n        if not directory.exists():",
                "            return found[-1][1]\n        return None\n        if not directory.exists():",
            ),
        ),
        ("tests/test_run_outputs.py", "-k", "resume_without_a_checkpoint"),
    ),
)


# a SuperNode without a partition id falls back to node_id % N
MUTATIONS += (
    Mutation(
        "partition-from-node-id",
        "a SuperNode started without partition-id trains partition node_id % N (one partition "
        "can sit on several nodes)",
        (
            (
                "dpfit/federated/client.py",
                '    if "partition-id" not in cfg:\n        raise PartitionError(',
                '    if "partition-id" not in cfg:\n        return int(context.node_id) % task.num_clients\n        raise PartitionError(',
            ),
        ),
        ("tests/federated/test_partition_id.py",),
    ),
)


# the batch-axis check back to comparing row counts only
MUTATIONS += (
    Mutation(
        "batch-axis-by-row-count-only",
        "no run-time one-example oracle: a sequence-first model with T == B is clipped per "
        "position",
        ((ENGINE, "            self._probe.check(per_ex, n, self._hooks)\n", ""),),
        ("tests/test_batch_axis.py", "-k", "t_equal_b"),
    ),
    Mutation(
        "user-poisson-without-batch-size",
        "sampling='user-poisson' steps accepted without the batch size (rows unchecked)",
        (
            (
                ENGINE,
                'if self.config.sampling == "user-poisson" and batch_size is None:',
                "if False:",
            ),
        ),
        ("tests/test_batch_axis.py", "-k", "needs_the_batch_size"),
    ),
)


# a continuation restores the saved generator states (two continuations of
# one checkpoint draw the same noise), and a second continuation goes ahead unasked
MUTATIONS += (
    Mutation(
        "continuation-restores-generators",
        "resuming an OS-seeded run restores the checkpoint's noise and sampling generators",
        (
            (
                ENGINE,
                "restore = self.config.insecure_seed is not None",
                "restore = True",
            ),
            (
                ENGINE,
                "if self.config.insecure_seed is None:  # never restored",
                "if False:  # never restored",
            ),
            ("dpfit/sampling.py", "keep = self.reproducible and", "keep ="),
            ("dpfit/sampling.py", "if self.reproducible and self.generator", "if self.generator"),
        ),
        ("tests/test_engine.py", "-k", "continuation"),
    ),
    Mutation(
        "second-continuation-allowed",
        "a checkpoint already continued is continued again without --fork (an unreported fork)",
        (
            (
                "dpfit/checkpoint.py",
                "            if not allow_fork:\n                raise CheckpointForkError",
                "            if False:\n                raise CheckpointForkError",
            ),
        ),
        ("tests/test_checkpoint.py", "-k", "claim_marks"),
    ),
)


# one rule wherever a model leaves the process: a release and a later resume are one fork
_RELEASE_TESTS = ("tests/test_run_outputs.py", "-k", "partial_model_is or older_than_a_release")
MUTATIONS += (
    Mutation(
        "partial-release-past-the-checkpoint",
        "Ctrl-C releases the live model, past the checkpoint --resume continues (a fork "
        "reported as one run)",
        (
            (
                "dpfit/run/release.py",
                "    found = ckpt.list_checkpoints(config.checkpoint_dir) if "
                "config.checkpoint_dir else []\n    if not found:",
                "    found = []\n    if not found:",
            ),
        ),
        _RELEASE_TESTS,
    ),
    Mutation(
        "older-checkpoints-unclaimed",
        "a released or superseded checkpoint is not claimed: resuming it counts as continuation 1",
        (
            (
                "dpfit/checkpoint.py",
                "        if at >= step or continuation_markers(path):",
                "        if True:",
            ),
        ),
        (
            *_RELEASE_TESTS[:2],
            _RELEASE_TESTS[2] + " or released_run_makes",
            "tests/integrations/test_trainer.py",
        ),
    ),
    Mutation(
        "fork-report-ignores-longer-earlier-continuation",
        "a fork's report assumes the earlier continuation as short as this one",
        (
            (
                "dpfit/checkpoint.py",
                "    longer = (continuation.earlier_steps or 0) - ",
                "    longer = 0 * (continuation.earlier_steps or 0) - ",
            ),
        ),
        ("tests/integrations/test_trainer.py", "-k", "released_run_makes"),
    ),
    Mutation(
        "head-first-window-unguarded",
        "Ctrl-C between the head-first steps and the main phase leaves no record of the spend",
        (
            (
                "dpfit/run/loop.py",
                "        except BaseException as e:\n            self.aborted(e, self.head_engine)\n",
                "        except ImportError as e:\n            self.aborted(e, self.head_engine)\n",
            ),
        ),
        ("tests/test_run_outputs.py", "-k", "head_first_steps_and_the_main"),
    ),
    Mutation(
        "trainer-delta-fixed",
        "DPTrainer's delta is 1e-5 whatever the dataset size",
        (
            (
                "dpfit/integrations/trainer.py",
                "p.target_delta if p.target_delta is not None else default_delta(n)",
                "p.target_delta if p.target_delta is not None else 1e-5",
            ),
        ),
        ("tests/integrations/test_trainer.py", "-k", "default_delta"),
    ),
)


# an image folder's architecture read from its images
MUTATIONS += (
    Mutation(
        "folder-channels-from-images",
        "an image folder's channel count is 3 if any image is colour (published architecture "
        "depends on one private image)",
        (
            (
                "dpfit/vision/data.py",
                "mode = FOLDER_MODES[channels]",
                'mode = "L" if all(p.mode in ("L", "1", "I;16", "I") for p in pics) else "RGB"',
            ),
        ),
        ("tests/vision/test_architecture.py",),
    ),
    Mutation(
        "folder-size-from-first-image",
        "an image folder's input size is its first image's",
        (
            (
                "dpfit/vision/data.py",
                "size = (side, side)",
                "size = (image_size, image_size) if image_size else pics[0].size",
            ),
        ),
        ("tests/vision/test_architecture.py",),
    ),
)


# a private run's public steps.csv carries no per-step timing, and each
# row's epsilon is the one after its own step (an empty batch's step must not look like the
# step it was recorded with)
MUTATIONS += (
    Mutation(
        "steps-csv-elapsed-time",
        "a private run's steps.csv records the elapsed time of each step again",
        (
            (
                "dpfit/reporting.py",
                'PRIVATE_STEP_FIELDS = ("step", "epoch", "epsilon")',
                'PRIVATE_STEP_FIELDS = ("step", "epoch", "epsilon", "elapsed_s")',
            ),
            (
                "dpfit/run/loop.py",
                "elapsed_s=elapsed if c.non_private else None,",
                "elapsed_s=elapsed,",
            ),
        ),
        ("tests/test_steps_csv.py",),
    ),
    Mutation(
        "steps-csv-shared-epsilon",
        "a noise-only step's row shows the epsilon of the step it was recorded with",
        (
            (
                "dpfit/run/loop.py",
                "epsilon=math.inf if self.engine is None else self.engine.epsilon(steps=done),",
                "epsilon=stepper.epsilon(),",
            ),
        ),
        ("tests/test_steps_csv.py",),
    ),
)


# the neighbouring relation: the replace-one epsilon is reported (and
# calibrated to, when asked) with dp-accounting's REPLACE_ONE analysis, not add-remove's
MUTATIONS += (
    Mutation(
        "replace-one-accounted-as-add-remove",
        "replace-one is asked, but the accountant is given the add-remove relation",
        (
            (
                "dpfit/accounting.py",
                '"replace-one": dp_accounting.NeighboringRelation.REPLACE_ONE,',
                '"replace-one": dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,',
            ),
        ),
        ("tests/test_neighbouring.py",),
    ),
    Mutation(
        "replace-one-reports-add-remove",
        "the run's record shows the add-remove epsilon as its replace-one epsilon",
        (
            (
                ENGINE,
                '"epsilon_replace_one": self._epsilon_for_record("replace-one"),',
                '"epsilon_replace_one": self._epsilon_for_record("add-remove"),',
            ),
        ),
        ("tests/test_neighbouring.py",),
    ),
    Mutation(
        "replace-one-calibrated-as-add-remove",
        "the engine calibrates its noise to add-remove while it reports replace-one",
        ((ENGINE, "            neighbouring=cfg.neighbouring,\n", ""),),
        ("tests/test_neighbouring.py",),
    ),
)


# DPTrainer virtual steps (PrivacyArguments.physical_batch_size): one noise
# draw per logical step, however many physical batches; no forward larger than the physical size
MUTATIONS += (
    Mutation(
        "noise-per-physical-batch",
        "each physical batch of a logical batch releases its own noised step",
        (
            (
                ENGINE,
                "        if not self._steps.physical_done():\n            return False\n",
                "        if not self._steps.physical_done():\n"
                "            self._release(optimizer)\n            return False\n",
            ),
        ),
        ("tests/integrations/test_trainer_virtual.py", "-k", "noise"),
    ),
    Mutation(
        "trainer-physical-batch-ignored",
        "DPTrainer runs each logical batch as one forward whatever physical_batch_size says",
        (
            (
                "dpfit/integrations/trainer.py",
                "physical_batch_size=self.privacy.physical_batch_size,",
                "physical_batch_size=None,",
            ),
        ),
        ("tests/integrations/test_trainer_virtual.py", "-k", "physical_size"),
    ),
    Mutation(
        "physical-batches-collated-eagerly",
        "the loader collates every physical batch of a logical batch before the first forward",
        (
            (
                "dpfit/sampling.py",
                "yield PhysicalBatches(sizes, self._collated(chunks))",
                "yield PhysicalBatches(sizes, iter(list(self._collated(chunks))))",
            ),
        ),
        ("tests/integrations/test_trainer_virtual.py", "-k", "physical_size"),
    ),
)


# bias+LoRA under one global clip: the adapters' rows (kept factored, ghost
# norms) must enter each example's norm together with the biases and the head
MUTATIONS += (
    Mutation(
        "lora-rows-outside-global-norm",
        "bias+lora: the LoRA adapters' factored rows are left out of the per-example global norm "
        "(clipped by the biases' norm only, so an example's contribution can exceed R)",
        (
            (
                CLIPPED_SUM,
                "sq = sq + batch.factored_sq_norms(p).to(sq.device) * scale**2",
                "sq = sq + 0 * batch.factored_sq_norms(p).to(sq.device)",
            ),
        ),
        ("tests/test_bias_lora.py", "-k", "global_clip"),
    ),
)


# a user's own federated data: the protected unit is a client (every row of one client
# value), label names read from the data pass train's gate, client sizes stay operator-only
MUTATIONS += (
    Mutation(
        "user-client-rows-split",
        "--client-column: the rows are dealt into N IID shards instead of one client per value "
        "(one person's rows spread over several clients, each protected separately)",
        (
            (
                "dpfit/federated/data.py",
                'clients = partition_rows(ys, found, "natural", alpha, seed, natural_ids=client_ids(train))',
                'clients = partition_rows(ys, found, "iid", alpha, seed)',
            ),
        ),
        ("tests/federated/test_user_data.py", "-k", "client_column or datasets_folder"),
    ),
    Mutation(
        "user-label-gate-skipped",
        "label names read from a user's federated data are published without train's gate "
        "(a name carried by one row is released)",
        (
            (
                "dpfit/federated/data.py",
                "    if parse_labels(labels) is not None:",
                "    if True:",
            ),
        ),
        ("tests/federated/test_user_data.py", "-k", "rare_label"),
    ),
    Mutation(
        "client-sizes-on-stdout",
        "the count of small clients, read from the private rows, is printed with the released "
        "output (stdout) instead of the operator's stderr",
        (
            (
                "dpfit/federated/data_cli.py",
                'every client is kept and trains on what it holds",\n            file=sys.stderr,',
                'every client is kept and trains on what it holds",',
            ),
        ),
        ("tests/federated/test_user_data.py", "-k", "client_column_round_trips"),
    ),
)


# long documents: privacy_unit="document" sums a document's windows (across physical batches)
# before one clip; activation checkpointing must read each per-example row once
MUTATIONS += (
    Mutation(
        "document-windows-clipped-separately",
        "privacy_unit='document' clips each window alone (a document of k windows moves the "
        "sum by up to k R)",
        (
            (
                ENGINE,
                "        if document_unit:  # summed per document, clipped at the end",
                "        if False:  # summed per document, clipped at the end",
            ),
        ),
        ("tests/test_document_unit.py", "-k", "clipped_as_one"),
    ),
    Mutation(
        "document-clipped-per-physical-batch",
        "privacy_unit='document' clips a document's sum at the end of each physical batch, so "
        "a document whose windows span physical batches is clipped once per batch",
        (
            (
                ENGINE,
                "            self._documents.add(batch, ids, count, scale)\n",
                "            self._documents.add(batch, ids, count, scale)\n"
                "            self._documents.clip_into(self._clipped, self._clip_fn, "
                "self.max_grad_norm)\n",
            ),
        ),
        ("tests/test_document_unit.py", "-k", "clipped_as_one"),
    ),
    Mutation(
        "per-example-rows-read-twice",
        "each layer's per-example gradient is read twice in one backward (what hooks firing "
        "on both the forward and a recomputed forward would do under activation checkpointing)",
        (
            (
                PER_EXAMPLE,
                "            out.register_hook(on_grad)\n",
                "            out.register_hook(on_grad)\n            out.register_hook(on_grad)\n",
            ),
        ),
        ("tests/test_activation_checkpointing.py", "-k", "oracle and checkpointing"),
    ),
)


# bf16 frozen weights cast once per run (dpfit.frozen_casts): only frozen weights are swapped,
# and their float32 values come back after the step
MUTATIONS += (
    Mutation(
        "frozen-casts-swap-trainable-weights",
        "bf16 copies are swapped in for trainable weights too: a trainable head's float32 master "
        "holds a bf16 copy during the step, so its gradient and per-example rows come from it",
        (
            (
                "dpfit/frozen_casts.py",
                "if key not in elsewhere and not p.requires_grad and p.dtype == torch.float32",
                "if key not in elsewhere and p.dtype == torch.float32",
            ),
        ),
        ("tests/test_frozen_casts.py",),
    ),
    Mutation(
        "frozen-casts-not-restored",
        "the float32 values of the swapped frozen weights are not put back after the step",
        (("dpfit/frozen_casts.py", "                w.data = master\n", "                pass\n"),),
        ("tests/test_frozen_casts.py",),
    ),
)


# a ledger's epsilon from cached one-step RDP curves and PLDs (dpfit.accounting.ledger_epsilon):
# each record composed count times, each with its own mechanism
_CACHED_EPSILON_TESTS = ("tests/test_accounting.py", "-k", "dp_accountings_own")
MUTATIONS += (
    Mutation(
        "rdp-cache-count-minus-one",
        "the cached RDP curve is scaled by steps - 1: every epsilon misses one step",
        (("dpfit/accounting.py", "total += r.count * curve", "total += (r.count - 1) * curve"),),
        _CACHED_EPSILON_TESTS,
    ),
    Mutation(
        "pld-cache-count-minus-one",
        "the cached one-step PLD is self-composed steps - 1 times",
        (
            (
                "dpfit/accounting.py",
                "step.self_compose(r.count)",
                "step.self_compose(max(1, r.count - 1))",
            ),
        ),
        _CACHED_EPSILON_TESTS,
    ),
    Mutation(
        "cache-first-phase-only",
        "every phase is accounted with the first phase's cached mechanism (noise, rate)",
        (
            (
                "dpfit/accounting.py",
                "ones = [dataclasses.replace(r, count=1) for r in records]",
                "ones = [dataclasses.replace(records[0], count=1) for r in records]",
            ),
        ),
        _CACHED_EPSILON_TESTS,
    ),
)


MUTATIONS += (
    Mutation(
        "resume-forgets-spent-steps",
        "a resumed run starts a fresh privacy ledger: the steps spent before the kill are not "
        "accounted (here with --privacy-unit document, whose windows span physical batches)",
        ((ENGINE, "        self.ledger = ledger\n", "        pass\n"),),
        (
            "tests/test_long_documents.py::"
            "test_document_unit_resumes_after_sigkill_as_if_never_killed",
        ),
    ),
)


# DP-LAC without its vote (the benchmark's --lac-c0 arm): the vote's budget goes to the rounds
_NOVOTE = "dpfit/federated/clipping/lac_novote.py"
MUTATIONS += (
    Mutation(
        "lac-c0-budget-not-given-back",
        "the no-vote arm is calibrated as if a vote (sigma_h = 5) were still released: its rounds "
        "get less than the whole target epsilon",
        ((_NOVOTE, "        return ()  # no vote", "        return (5.0,)  # no vote"),),
        ("tests/federated/test_lac_novote.py",),
    ),
    Mutation(
        "lac-c0-vote-spent-anyway",
        "the no-vote arm's ledger records a vote (sigma_h = 5) that was never released",
        (
            (
                _NOVOTE,
                "    server.initialise(None)  # no vote",
                "    server.initialise(None); server.accountant.record_one_off(5.0)  # no vote",
            ),
        ),
        ("tests/federated/test_lac_novote.py",),
    ),
)


# data-parallel with privacy_unit="document": ranks hold whole documents, so each document is
# summed and clipped once, on one rank
_RANK_OF = '__import__("dpfit.distributed").distributed'
# the engine's loader gives no rank whole documents: each keeps every world-th row of the
# whole sample, so a document split over W ranks is clipped in W parts (moving the sum by
# up to W R); the engine and DPTrainer mutations below share it
_DOCUMENTS_SPLIT_AMONG_RANKS = (
    (
        ENGINE,
        "            part=part,\n",
        '            part=None if self.config.privacy_unit == "document" else part,\n',
    ),
    (
        "dpfit/sampling.py",
        "                rows = [(j, x) for j, i in enumerate(idx) for x in self.dataset[i]]\n",
        "                rows = [(j, x) for j, i in enumerate(idx) for x in self.dataset[i]]"
        f"[{_RANK_OF}.get_rank() :: {_RANK_OF}.get_world_size()]\n",
    ),
)
MUTATIONS += (
    Mutation(
        "distributed-document-split-among-ranks",
        "data-parallel privacy_unit='document': every rank takes the whole sample of documents "
        "and keeps every world-th window, so each rank clips its part of a document alone (a "
        "document split over W ranks moves the sum by up to W R)",
        _DOCUMENTS_SPLIT_AMONG_RANKS,
        ("tests/distributed/test_documents.py", "-k", "clipped_once"),
    ),
    Mutation(
        "distributed-document-noise-on-every-rank",
        "data-parallel privacy_unit='document': every rank adds sigma*R noise before the "
        "all-reduce (sqrt(W) too much)",
        ((ENGINE, "std = 0.0  # the noise is added exactly once, by rank 0", "pass"),),
        ("tests/distributed/test_documents.py", "-k", "noise_is_drawn_once"),
    ),
)


# classification of long texts (dpfit.windows, dpfit.tasks.classification): a text's windows
# reach the engine as one document, summed and clipped once, and n counts texts
_CLS_WINDOWS = "tests/test_classification_windows.py"
MUTATIONS += (
    Mutation(
        "classification-document-windows-clipped-separately",
        "--task classification --privacy-unit document clips each window of a text alone (a "
        "text of k windows moves the sum by up to k R)",
        (
            (
                ENGINE,
                "        if document_unit:  # summed per document, clipped at the end",
                "        if False:  # summed per document, clipped at the end",
            ),
        ),
        (_CLS_WINDOWS, "-k", "clipped_as_one"),
    ),
    Mutation(
        "classification-document-n-counts-windows",
        "--privacy-unit document samples texts but n (the sampling rate's denominator) counts "
        "their windows: the rate, and so epsilon, is under-reported",
        (
            (
                "dpfit/windows.py",
                'return len(documents) if unit == "document" else sum(len(ws) for ws in documents)',
                "return sum(len(ws) for ws in documents)",
            ),
        ),
        (_CLS_WINDOWS, "-k", "clipped_as_one or cli_document_unit"),
    ),
)


MUTATIONS += (
    Mutation(
        "chunked-head-drops-last-chunk",
        "the chunked causal-LM loss skips the last, partial chunk of positions: those tokens "
        "are neither trained on nor in the per-example gradients",
        (
            (
                "dpfit/chunked_head.py",
                "    for s in range(0, width, step):",
                "    for s in range(0, width - step, step):",
            ),
        ),
        ("tests/test_chunked_head.py", "-k", "oracle"),
    ),
)


# DPTrainer with PrivacyArguments(privacy_unit="document"): its documents come through the
# engine's document loader, each summed (across physical batches) and clipped once
_TRAINER_DOCS = "tests/integrations/test_trainer_documents.py"
MUTATIONS += (
    Mutation(
        "trainer-document-rows-clipped-separately",
        "DPTrainer with privacy_unit='document' clips each row (window) of a document alone "
        "(a document of k rows moves the sum by up to k R)",
        (
            (
                ENGINE,
                "        if document_unit:  # summed per document, clipped at the end",
                "        if False:  # summed per document, clipped at the end",
            ),
        ),
        (_TRAINER_DOCS, "-k", "oracle"),
    ),
    Mutation(
        "trainer-document-clipped-per-physical-batch",
        "DPTrainer with privacy_unit='document' and physical_batch_size: a document whose rows "
        "straddle physical batches is clipped once per physical batch",
        (
            (
                ENGINE,
                "            self._documents.add(batch, ids, count, scale)\n",
                "            self._documents.add(batch, ids, count, scale)\n"
                "            self._documents.clip_into(self._clipped, self._clip_fn, "
                "self.max_grad_norm)\n",
            ),
        ),
        (_TRAINER_DOCS, "-k", "oracle"),
    ),
    Mutation(
        "document-batch-without-rows-skipped",
        "a logical batch whose sampled documents have no rows is skipped (no noise, not "
        "accounted): the count of released steps then depends on the data",
        (
            (
                "dpfit/sampling.py",
                "            if not idx or (self.documents and not rows):\n",
                "            if not idx:\n",
            ),
        ),
        ("tests/test_document_unit.py", _TRAINER_DOCS, "-k", "noise_only"),
    ),
    Mutation(
        "trainer-distributed-document-split-among-ranks",
        "DPTrainer under torchrun with privacy_unit='document': every rank keeps every "
        "world-th row of the whole sample of documents, so each rank clips its part of a "
        "document alone",
        _DOCUMENTS_SPLIT_AMONG_RANKS,
        ("tests/distributed/test_trainer.py", "-k", "documents"),
    ),
)


# splits of a user's file (dpfit.data.rowhash): each row's side (held out, public, trained,
# a synthetic client) comes from its own keyed hash, so one row added or removed moves only
# that row; a permutation of row positions moves many, and epsilon then protects a group
_ROWHASH = "tests/data/test_rowhash.py"
_IMAGE_SPLITS = "tests/vision/test_split_neighbours.py"
_LM_SPLITS = "tests/test_causal_lm_splits.py"
_FED_SPLITS = "tests/federated/test_partition_neighbours.py"
MUTATIONS += (
    Mutation(
        "split-index-permutation",
        "the hold-out of a user's file is a seeded permutation of row positions: appending one "
        "row moves many others between training and test",
        (
            (
                "dpfit/data/text.py",
                "        held = held_out_mask(self.row_keys(seed, HELD_OUT), fraction)\n",
                "        import random\n\n"
                "        order = list(range(len(self)))\n"
                "        random.Random(seed).shuffle(order)\n"
                "        chosen = set(order[: max(1, round(fraction * len(self)))])\n"
                "        held = [i in chosen for i in range(len(self))]\n",
            ),
        ),
        (_ROWHASH, "-k", "split_adding or prepare_data"),
    ),
    Mutation(
        "subsample-index-permutation",
        "--max-train-examples samples row positions: one row added changes many training rows, "
        "not at most one swap",
        (
            (
                "dpfit/data/text.py",
                "        idx = smallest(self.row_keys(seed, SUBSAMPLE), n).tolist()\n",
                "        import random\n\n"
                "        idx = sorted(random.Random(seed).sample(range(len(self)), n))\n",
            ),
        ),
        (_ROWHASH, "-k", "subsample or prepare_data"),
    ),
    Mutation(
        "split-hashes-label-id",
        "a row's key hashes its label id, which a new label name in the file renumbers: every "
        "row of a renumbered class changes side",
        (
            (
                "dpfit/data/text.py",
                "        rows = (text_row(t, names[y]) for t, y in zip(self.texts, self.labels, "
                "strict=True))\n",
                "        rows = (text_row(t, str(y)) for t, y in zip(self.texts, self.labels, "
                "strict=True))\n",
            ),
        ),
        (_ROWHASH, "-k", "new_label"),
    ),
    Mutation(
        "image-split-index-permutation",
        "the image hold-out / public share is a seeded permutation of positions",
        (
            (
                "dpfit/vision/data.py",
                "        held = held_out_mask(self.row_keys(seed, purpose), fraction)\n",
                "        perm = np.random.default_rng(seed).permutation(len(self))\n"
                "        held = np.zeros(len(self), bool)\n"
                "        held[perm[: max(1, round(fraction * len(self)))]] = True\n",
            ),
        ),
        (_IMAGE_SPLITS, "-k", "moves_only or prepare_images"),
    ),
    Mutation(
        "image-subsample-index-permutation",
        "image --max-train-examples samples positions: one image added changes many",
        (
            (
                "dpfit/vision/data.py",
                "        idx = smallest(self.row_keys(seed, purpose), n)\n",
                "        idx = np.sort(np.random.default_rng(seed).permutation(len(self))[:n])\n",
            ),
        ),
        (_IMAGE_SPLITS, "-k", "subsample"),
    ),
    Mutation(
        "image-old-split-record-accepted",
        "private fine-tuning accepts a public split recorded by the old permutation rule, whose "
        "public images the new rule may put on the private side",
        (
            (
                "dpfit/tasks/image_classification.py",
                '        if recorded_split.get("rule") != SPLIT_RULE:\n',
                "        if False:\n",
            ),
        ),
        (_IMAGE_SPLITS, "-k", "older_split_rule"),
    ),
    Mutation(
        "lm-examples-shuffled",
        "causal-LM training examples: a seeded shuffle of positions, capped",
        (
            (
                "dpfit/causal_lm.py",
                "    return [rest[i] for i in smallest(rest_keys, n_train)], held\n",
                "    import random\n\n"
                "    random.Random(seed).shuffle(rest)\n"
                "    return rest[:n_train], held\n",
            ),
        ),
        (_LM_SPLITS, "-k", "line_examples"),
    ),
    Mutation(
        "jsonl-documents-grouped-by-line-number",
        "a .jsonl document's group is its line number: a line inserted at the top renames, and "
        "so re-splits, every document below it",
        (
            (
                "dpfit/tasks/causal_lm.py",
                '    return texts, [""] * len(texts), str(path)',
                '    return texts, [f"line {i}" for i in range(len(texts))], str(path)',
            ),
        ),
        (_LM_SPLITS, "-k", "jsonl"),
    ),
    Mutation(
        "document-cap-random-sample",
        "causal-LM --max-train-examples over documents: a seeded sample of positions",
        (
            (
                "dpfit/tasks/causal_lm.py",
                "    return [docs[i] for i in smallest(keys, k)]\n",
                "    import random\n\n    return random.Random(seed).sample(list(docs), k)\n",
            ),
        ),
        (_LM_SPLITS, "-k", "document_cap"),
    ),
    Mutation(
        "federated-iid-contiguous-shards",
        "iid clients are contiguous shards of the rows: one row added shifts every later "
        "shard boundary, so many clients change",
        (
            (
                "dpfit/federated/data.py",
                "        owner = np.minimum((keys * num_clients).astype(np.int64), "
                "num_clients - 1)\n",
                "        owner = (np.arange(len(keys)) * num_clients) // max(len(keys), 1)\n",
            ),
        ),
        (_FED_SPLITS, "-k", "one_row"),
    ),
    Mutation(
        "federated-dirichlet-by-position",
        "a Dirichlet client is chosen by the row's position, not its own key",
        (
            (
                "dpfit/federated/data.py",
                '            [np.searchsorted(edges[y], u, side="right") for y, u in '
                "zip(ys, keys, strict=True)],\n",
                '            [np.searchsorted(edges[y], (j + 0.5) / len(ys), side="right") '
                "for j, y in enumerate(ys)],\n",
            ),
        ),
        (_FED_SPLITS, "-k", "one_row and dirichlet"),
    ),
    Mutation(
        "federated-rows-shuffled-first",
        "a user's rows are put in a --seed order before partitioning: one row added reorders "
        "every client's rows, so every client's --examples-per-client cap changes",
        (
            (
                "dpfit/federated/data.py",
                "        for i in range(len(rows))\n    )\n",
                "        for i in random.Random(seed).sample(range(len(rows)), len(rows))\n    )\n",
            ),
        ),
        (_FED_SPLITS, "-k", "one_row"),
    ),
    Mutation(
        "evaluate-held-out-ignores-seed",
        "dpfit evaluate --held-out re-derives the hold-out with seed 0, not the run's: it "
        "scores rows the model trained on",
        (
            (
                "dpfit/tasks/classification.py",
                '    return rows.split(float(fraction), seed=int(config.get("seed", 0)))[1]\n',
                "    return rows.split(float(fraction), seed=0)[1]\n",
            ),
        ),
        ("tests/test_evaluate_held_out.py", "-k", "found_again"),
    ),
    # -- dpfit train --tune (dpfit.run.tune, dpfit.selection) --------------------------------
    Mutation(
        "tune-selection-not-calibrated",
        "--tune calibrates the noise for one candidate run, not for the selection over K",
        (
            (
                "dpfit/run/tune.py",
                "        return selection_event(draft.candidate_event(ref), runs.mean_runs, "
                "runs.shape)\n",
                "        return draft.candidate_event(ref)\n",
            ),
        ),
        ("tests/test_tune.py", "-k", "against_dp_accounting"),
    ),
    Mutation(
        "tune-selection-not-reported",
        "--tune reports one candidate's epsilon, not the selection's",
        (
            (
                "dpfit/run/tune.py",
                "        return selection_event(self.candidate_event(), self.runs.mean_runs, "
                "self.runs.shape)\n",
                "        return self.candidate_event()\n",
            ),
        ),
        ("tests/test_tune.py", "-k", "against_dp_accounting"),
    ),
    Mutation(
        "tune-score-not-accounted",
        "--tune accounts a candidate's training steps but not its validation score",
        (
            (
                "dpfit/run/tune.py",
                "        return dpa.ComposedDpEvent([train, dpa.GaussianDpEvent(self.score_noise)])\n",
                "        return dpa.ComposedDpEvent([train])\n",
            ),
        ),
        ("tests/test_tune.py", "-k", "against_dp_accounting"),
    ),
    Mutation(
        "tune-k-fixed",
        "the number of candidate runs K is its mean, not a draw (the bound needs the draw)",
        (
            (
                "dpfit/selection.py",
                "    mean, shape = runs.mean_runs, runs.shape\n",
                "    mean, shape = runs.mean_runs, runs.shape\n    return int(round(mean))\n",
            ),
        ),
        ("tests/test_tune.py", "-k", "logarithmic_distribution"),
    ),
    Mutation(
        "tune-k-from-public-seed",
        "--tune draws K and the grid points from --seed without --insecure-reproducible-noise",
        (
            (
                "dpfit/run/tune.py",
                "    rng = selection_rng(insecure_seed(config, offset=0x7E))\n",
                "    rng = selection_rng(config.seed + 0x7E)\n",
            ),
        ),
        ("tests/test_tune.py", "-k", "fit_part"),
    ),
    Mutation(
        "tune-validation-not-disjoint",
        "--tune candidates train on the validation rows they are scored on",
        (
            (
                "dpfit/run/tune.py",
                "        prep = _subset(full, copy.deepcopy(pristine), fit, val)\n",
                "        prep = _subset(full, copy.deepcopy(pristine), data.train, val)\n",
            ),
        ),
        ("tests/test_tune.py", "-k", "fit_part"),
    ),
    Mutation(
        "tune-score-without-noise",
        "--tune scores a candidate by its exact count of correct validation texts",
        (
            (
                "dpfit/run/tune.py",
                "    return float(correct) + float(rng.normal(0.0, noise))\n",
                "    return float(correct)\n",
            ),
        ),
        ("tests/test_tune.py", "-k", "gaussian_mechanism"),
    ),
    Mutation(
        "tune-short-points-under-noised",
        "a grid point of fewer steps gets less noise than keeps it under the accounted one",
        (
            (
                "dpfit/selection.py",
                "        lo, hi = (lo, mid) if under(mid) else (mid, hi)\n    return hi\n",
                "        lo, hi = (lo, mid) if under(mid) else (mid, hi)\n    return 0.9 * hi\n",
            ),
        ),
        ("tests/test_tune.py", "-k", "bounded_by_the_accounted"),
    ),
)


# --privacy-unit user: a user's rows are one contribution (sampled and clipped together), n and
# q count users, each user keeps at most --max-rows-per-user rows, the hold-out and the label
# gate go by user
USER_TEST = "tests/test_user_unit.py"
TRAINER_USER_TEST = "tests/integrations/test_trainer_users.py"
MUTATIONS += (
    Mutation(
        "user-rows-sampled-independently",
        "--privacy-unit user makes each row its own unit: a user's rows are sampled and "
        "clipped one by one (a user of k rows moves the sum by up to k R) and n counts rows",
        (
            (
                "dpfit/tasks/classification.py",
                "        groups = UserTexts(rows, tuple(users)).groups()\n",
                "        groups = [[i] for i in range(len(rows))]\n",
            ),
        ),
        (USER_TEST, "-k", "clipped_as_one or unclipped"),
    ),
    Mutation(
        "user-n-counted-in-rows",
        "DPTrainer's user unit sets n (and so q and delta) from the rows, not the users: "
        "the accountant's sampling rate is not the one the loader uses",
        (
            (
                "dpfit/integrations/trainer.py",
                "        n = len(self.train_dataset)\n",
                "        n = len(self.train_dataset)\n"
                '        if self.privacy.privacy_unit == "user":\n'
                "            n = sum(len(u) for u in self.train_dataset)\n",
            ),
        ),
        (TRAINER_USER_TEST, "-k", "epsilon_counts_users"),
    ),
    Mutation(
        "rows-per-user-uncapped",
        "--max-rows-per-user is ignored: a user keeps every row",
        (("dpfit/data/text.py", "        if len(idx) <= k:\n", "        if True:\n"),),
        (USER_TEST, "-k", "at_most_k_rows"),
    ),
    Mutation(
        "user-cap-by-file-position",
        "a user's rows under the cap are the first k in the file: which rows train depends "
        "on the file's order, not on the user's rows alone",
        (
            (
                "dpfit/data/text.py",
                "        kept += [idx[j] for j in smallest(keys, k).tolist()]\n",
                "        kept += idx[:k]\n",
            ),
        ),
        (USER_TEST, "-k", "at_most_k_rows"),
    ),
    Mutation(
        "user-hold-out-by-row",
        "the user unit's hold-out decides each row alone: a user's rows fall on both sides, "
        "and held-out scores include rows of users who trained",
        (
            (
                "dpfit/data/text.py",
                "        held = [keys[u] < fraction for u in self.users]\n",
                "        held = list(held_out_mask(self.rows.row_keys(seed, HELD_OUT), fraction))\n",
            ),
        ),
        (USER_TEST, "-k", "hold_out_keeps_each_user_whole"),
    ),
    Mutation(
        "user-label-gate-counts-rows",
        "the label gate counts rows under the user unit: one user's 25 rows of a name make "
        "it 'common' and it is published",
        (
            (
                "dpfit/tasks/classification.py",
                "            LabelUnits.count((names[y] for y in data.rows.labels), data.users, "
                '"users"),\n',
                "            LabelUnits.count((names[y] for y in data.rows.labels), "
                'range(len(data.users)), "users"),\n',
            ),
        ),
        (USER_TEST, "-k", "label_gate_counts_users"),
    ),
    Mutation(
        "user-record-says-document",
        "a user-unit run's dpfit.json says privacy_unit 'document' (the engine's), without "
        "the users count: the saved model misstates what epsilon protects",
        (
            (
                "dpfit/run/release.py",
                '    return {"privacy_unit": "user", "users": prep.n}\n',
                "    return {}\n",
            ),
        ),
        (USER_TEST, "-k", "cli_user_unit_end_to_end"),
    ),
)


def apply(root: Path, m: Mutation) -> None:
    for rel, old, new in m.patches:
        path = root / "src" / rel
        text = path.read_text()
        n = text.count(old)
        if n != 1:
            raise SystemExit(f"mutation {m.name}: patch text found {n} times in {rel}: {old!r}")
        path.write_text(text.replace(old, new))


def run_tests(root: Path, args: tuple[str, ...], timeout: int) -> tuple[int, list[str], float]:
    env = {
        **os.environ,
        "PYTHONPATH": str(root / "src"),
        "OMP_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *args]
    t0 = time.monotonic()
    try:
        out = subprocess.run(
            cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return -1, ["timeout"], time.monotonic() - t0
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out.stdout, flags=re.M)
    return out.returncode, failed, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="names of mutations to run (default: all)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mutation"))
    ap.add_argument("--timeout", type=int, default=600)
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    results = []
    with tempfile.TemporaryDirectory(prefix="dpfit-mut-") as tmp:
        clean = Path(tmp) / "clean"
        skip = shutil.ignore_patterns("__pycache__", "*.pyc")
        for part in ("src", "tests"):
            shutil.copytree(ROOT / part, clean / part, ignore=skip)
        shutil.copy(ROOT / "pyproject.toml", clean / "pyproject.toml")
        # the mutants must import the copy, not the checkout: check once
        probe = subprocess.run(
            [sys.executable, "-c", "import dpfit; print(dpfit.__file__)"],
            env={**os.environ, "PYTHONPATH": str(clean / "src")}, capture_output=True, text=True,
        )  # fmt: skip
        if not probe.stdout.strip().startswith(str(clean)):
            raise SystemExit(f"PYTHONPATH copy not picked up: {probe.stdout} {probe.stderr}")
        passed: set[tuple[str, ...]] = set()  # test selections that pass unmutated
        for m in chosen:
            if m.tests not in passed:
                rc, failed, secs = run_tests(clean, m.tests, args.timeout)
                if rc != 0:
                    raise SystemExit(f"baseline for {m.name} fails (rc={rc}): {failed}")
                passed.add(m.tests)
            work = Path(tmp) / m.name
            shutil.copytree(clean, work)
            apply(work, m)
            rc, failed, secs = run_tests(work, m.tests, args.timeout)
            status = "killed" if rc not in (0, 5) else "SURVIVED"
            results.append(
                {
                    "mutation": m.name,
                    "bug": m.what,
                    "status": status,
                    "killed_by": failed[:3],
                    "tests": " ".join(m.tests),
                    "seconds": round(secs, 1),
                }
            )
            print(f"{status:9s} {m.name:30s} {', '.join(failed[:2])}", flush=True)
            shutil.rmtree(work)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    survived = [r for r in results if r["status"] != "killed"]
    command = "python benchmarks/mutation.py" + (
        f" --only {' '.join(args.only)}" if args.only else ""
    )
    lines = [
        "# Mutation testing of the privacy mechanism",
        "",
        f"Generated by `{command}`: each row is one small bug patched into a",
        "copy of `src/dpfit`, and the tests run against it. Killed = the tests failed.",
        "",
        f"{len(results) - len(survived)} of {len(results)} mutations killed.",
        "",
        "| mutation | bug | status | first failing test |",
        "|---|---|---|---|",
    ]
    for r in results:
        first = r["killed_by"][0] if r["killed_by"] else ""
        lines.append(f"| {r['mutation']} | {r['bug']} | {r['status']} | `{first}` |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
