"""PrivacyEngine: DP-SGD on the trainable parameters, coordinating one concern per module.

* dpfit.per_example: which module reports which parameter, and the hooks that read
  per-example gradients from the backward pass (state kept there, removed by `detach()`);
* dpfit.gradient_check: they must add up to autograd's `.grad` (every physical batch);
* dpfit.clipped_sum: clip each example and add it to the logical batch's flat sum;
* dpfit.noise: the Gaussian noise, drawn once per logical step on that sum (here, in
  `_noised_update`, which also divides, reduces across ranks and records the step);
* dpfit.sampling: the Poisson loader, which reports logical batches to a tracker;
* dpfit.schedule, dpfit.distributed, dpfit.accounting: phases, data parallelism, epsilon.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from dpfit.accounting import (
    PrivacyLedger,
    accountant_for,
    max_steps_within,
    noise_multiplier_for,
)
from dpfit.batch_axis import BatchAxisProbe
from dpfit.clipped_sum import ClippedSum, DocumentSums, arrange
from dpfit.clipping import get_clipping
from dpfit.config import PrivacyConfig
from dpfit.distributed import (
    DistContext,
    all_reduce_sum,
    check_identical,
    no_sync_context,
    resolve,
    share_from_main,
    shared_seed,
    unwrap_ddp,
)
from dpfit.errors import (
    AccountingError,
    BatchAxisError,
    BudgetExhaustedError,
    DistributedError,
    SamplingError,
)
from dpfit.flat import FlatLayout
from dpfit.gradient_check import AutogradCheck

# the engine calls gaussian_noise through this module's name: the seam that the audit tests'
# fault injection patches (dpfit.engine.gaussian_noise)
from dpfit.noise import gaussian_noise
from dpfit.params import is_bias
from dpfit.per_example import LayerPlan, PerExampleHooks, batch_rows, plan_layers
from dpfit.rng import make_generator
from dpfit.sampling import LogicalStepTracker, PoissonBatchSampler, PoissonDataLoader, RankPart
from dpfit.schedule import (
    Phase,
    PhaseSpec,
    bias_selection,
    parse_schedule,
    rebuild_optimizer,
    set_trainable,
    total_epochs,
)

log = logging.getLogger(__name__)

_DOCUMENT_IDS_NEEDED = (
    "privacy_unit='document' with sampling='user-poisson': call engine.step(optimizer, "
    "batch_size=rows, documents=[the document id of each row])"
)

__all__ = ["PrivacyEngine", "gaussian_noise", "get_clipping"]


def _check_distributed_unit(config: PrivacyConfig) -> None:
    """A data-parallel job with privacy_unit="document" needs the engine's loader: it splits
    each logical batch among ranks by documents, so every sampled document's rows are summed
    and clipped on one rank. With user-drawn batches the engine cannot see whether a
    document's rows went to several ranks, where each part would be clipped alone."""
    if config.privacy_unit == "document" and config.sampling == "user-poisson":
        raise DistributedError(
            "privacy_unit='document' with sampling='user-poisson' in a data-parallel job: the "
            "engine cannot tell whether one document's rows were given to several ranks, and "
            "each rank would clip its part alone (a document split over W ranks could move "
            "the sum by up to W times max_grad_norm). Use engine.data_loader over the "
            "documents (sampling='poisson'; it keeps every sampled document's rows on one "
            "rank), or train in one process"
        )


class PrivacyEngine:
    """DP-SGD over the model's trainable parameters, bias-only by design (DP-BiTFiT).

    mode: "bias" (biases + head), "full" (every weight through grad_sample.full),
    "bias+lora" / "lora" (a peft LoRA model after dpfit.make_lora_trainable: the adapters
    through grad_sample.full's ghost norm or materialised rows, biases and head as in bias
    mode, all under one per-example global norm).

    privacy_unit: "example" (each row is a contribution) or "document": the dataset's items
    are documents, each a sequence of rows (the windows of a long text); Poisson sampling is
    over documents (sample_size and expected_batch_size count them), and a document's rows
    are summed, across physical batches, into one gradient clipped once (epsilon protects a
    whole document). Bias mode only. Data-parallel, the engine's loader gives each rank whole
    documents (never part of one), so each document is clipped once, on one rank.

    Construction validates the model (no BatchNorm, a sampler for every trainable parameter),
    fixes the noise multiplier (given, or calibrated to a target epsilon for the planned steps)
    and registers hooks. `step(optimizer)` then clips, sums, noises and applies one logical step.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        expected_batch_size: int,
        sample_size: int,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float = 1e-5,
        epochs: float | None = None,
        steps: int | None = None,
        max_grad_norm: float = 1.0,
        clipping: str = "flat",
        mode: str = "bias",
        loss_reduction: str = "mean",
        accountant: str = "rdp",
        sampling: str = "poisson",
        secure_rng: bool = False,
        insecure_seed: int | None = None,
        batch_first: bool = True,
        batch_dims: dict[str, int] | None = None,
        check_gradients: bool = True,
        schedule: Sequence[PhaseSpec] | None = None,
        process_group: Any = None,
        neighbouring: str = "add-remove",
        privacy_unit: str = "example",
    ) -> None:
        # data parallel (dpfit.distributed): a process group with >1 rank, given or the
        # initialised default one; a DDP wrapper is looked through (its own sync is kept off)
        model, self._ddp = unwrap_ddp(model)
        self._dist: DistContext | None = resolve(process_group)
        # two-phase X+BiTFiT (dpfit.schedule): noise calibrated for all phases together
        self._phases = parse_schedule(schedule) if schedule is not None else ()
        if self._phases:
            mode = self._phases[0].mode
            if epochs is None and steps is None:
                epochs = total_epochs(self._phases)
        self.config = PrivacyConfig(
            expected_batch_size=expected_batch_size,
            sample_size=sample_size,
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            epochs=epochs,
            steps=steps,
            max_grad_norm=max_grad_norm,
            clipping=clipping,
            mode=mode,
            loss_reduction=loss_reduction,
            accountant=accountant,
            sampling=sampling,
            secure_rng=secure_rng,
            insecure_seed=insecure_seed,
            batch_first=batch_first,
            batch_dims=tuple(sorted((batch_dims or {}).items())),
            check_gradients=check_gradients,
            neighbouring=neighbouring,
            privacy_unit=privacy_unit,
        )
        if self._dist is not None:
            _check_distributed_unit(self.config)
        self.model = model
        self._bias_selection = bias_selection(model)
        if self._phases:
            set_trainable(model, mode, self._bias_selection)
        self._clip_fn = get_clipping(clipping)
        self.ledger = PrivacyLedger(target_delta, accountant, neighbouring=neighbouring)
        self._names = {p: n for n, p in model.named_parameters()}
        self._set_trainables()
        self.noise_multiplier = self._resolve_noise_multiplier()
        self._max_steps = self._compute_max_steps()
        self._insecure_seed = insecure_seed is not None
        self._noise_rng, self._sample_rng = self._make_generators()
        if self._dist is not None:
            check_identical(self._params, self._dist)
        # noised updates of empty logical batches reduced before any optimizer was seen
        self._early_updates: list[list[tuple[nn.Parameter, torch.Tensor]]] = []
        self._pending_loader_state: dict | None = None
        self._warned_late_empty = False
        self._hooks.attach()  # last: a construction that fails leaves the model untouched
        # one example's row against its gradient alone, once per phase
        self._probe = BatchAxisProbe(model, self._names)
        if check_gradients:
            self._probe.attach()
        self._steps = LogicalStepTracker(self._empty_logical_step)
        self._optimizer: torch.optim.Optimizer | None = None
        self._eps_cache: dict[tuple[int, float, str], float] = {}
        self._loader: PoissonDataLoader | None = None
        log.info(
            "PrivacyEngine: %d trainable tensors, sigma=%.4f, q=%.5f, R=%g, clipping=%s",
            len(self._params),
            self.noise_multiplier,
            self.sample_rate,
            max_grad_norm,
            clipping,
        )

    # ------------------------------------------------------------------ set-up
    def _make_generators(self) -> tuple[torch.Generator | None, torch.Generator | None]:
        """Noise and sampling generators: none with secure_rng (every draw from os.urandom),
        else seeded from os.urandom, or from insecure_seed (two distinct streams). In a
        data-parallel job the sampling stream is rank 0's on every rank: all ranks draw the
        same global sample and keep their parts of it; only rank 0 draws noise."""
        if self.config.secure_rng:
            return None, None
        seed = self.config.insecure_seed
        if seed is not None:
            log.warning(
                "insecure_seed=%d: noise and Poisson sampling are reproducible from this seed, "
                "so the run is NOT differentially private against anyone who knows it",
                seed,
            )
        if self._dist is not None and seed is None:
            sampling = torch.Generator().manual_seed(shared_seed(self._dist))
        else:
            sampling = make_generator(seed, "sampling")
        return make_generator(seed, "noise"), sampling

    @property
    def sample_rate(self) -> float:
        return self.config.sample_rate

    @property
    def max_grad_norm(self) -> float:
        return self.config.max_grad_norm

    @property
    def target_delta(self) -> float:
        return self.config.target_delta

    @property
    def steps_taken(self) -> int:
        return self.ledger.steps

    def parameters(self) -> list[nn.Parameter]:
        """The trainable parameters, for the optimizer."""
        return list(self._params)

    def _ordered_trainable(self, model: nn.Module) -> list[nn.Parameter]:
        return [p for _, p in model.named_parameters() if p.requires_grad]

    def _set_trainables(self) -> None:
        """Plan the model's trainable parameters (at construction and on a phase switch):
        their hooks (attached by the caller), flat layout, running clipped sum, gradient check."""
        plans = plan_layers(
            self.model, self.config.mode, self.config.batch_first, dict(self.config.batch_dims)
        )
        self._hooks = PerExampleHooks(self.model, plans)
        self._params = self._ordered_trainable(self.model)
        self._layout = FlatLayout(self._params)
        self._clipped = ClippedSum(self._layout)
        self._documents = DocumentSums(self._layout)  # privacy_unit="document"
        self._check = AutogradCheck(self._params, self._layout, self._names)

    # the per-example state, as the tests' oracle and fault injection reach it
    @property
    def _plans(self) -> dict[nn.Module, LayerPlan]:
        return self._hooks.plans

    @property
    def _per_example(self) -> dict[nn.Parameter, dict[int, Any]]:
        return self._hooks.per_example

    def _resolve_noise_multiplier(self) -> float:
        cfg = self.config
        if cfg.noise_multiplier is not None:
            return float(cfg.noise_multiplier)
        steps = cfg.planned_steps
        assert cfg.target_epsilon is not None and steps is not None
        extra = tuple(r.event() for r in self.ledger.records)
        return noise_multiplier_for(
            cfg.target_epsilon,
            cfg.target_delta,
            cfg.sample_rate,
            steps,
            cfg.accountant,
            extra_events=extra,
            neighbouring=cfg.neighbouring,
        )

    def _compute_max_steps(self) -> int | None:
        """Largest total step count whose epsilon stays within target_epsilon."""
        return max_steps_within(
            self.ledger,
            self.config.target_epsilon,
            self.noise_multiplier,
            self.sample_rate,
            self.config.planned_steps,
            self.config.accountant,
        )

    def detach(self) -> None:
        """Remove every hook; the model is left exactly as it was before the engine."""
        self._hooks.detach()
        self._probe.detach()
        self._clipped.clear()
        self._documents.clear()

    # ------------------------------------------------------------------ data
    def data_loader(
        self,
        dataset: Sequence,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        physical_batch_size: int | None = None,
        max_steps: int | None = None,
        yield_empty: bool = False,
        optimizer: torch.optim.Optimizer | None = None,
        group_physical: bool = False,
    ) -> PoissonDataLoader:
        """A Poisson-sampling loader over `dataset` at rate q = expected_batch_size/sample_size.

        max_steps: stop drawing once the engine has taken that many logical steps. Stopping
        training this way (not by breaking out on this rank's step count alone) keeps every
        rank of a distributed job at the same number of collective steps.
        yield_empty: yield `dpfit.sampling.EMPTY_BATCH` for an empty logical batch (call
        `empty_step(optimizer)` for it) instead of taking its step inside the loader.
        optimizer: the optimizer that `step()` will be given. An empty logical batch is a
        noise-only step taken inside the loader, which needs it: without it, empty batches
        drawn before the first `step()` wait for that call, so their noise reaches the
        parameters after the next batch's gradient was already taken at the old ones.
        group_physical: yield one `dpfit.sampling.PhysicalBatches` per logical batch (its
        physical batches, collated as iterated) for loops that take one item per step.
        """
        if isinstance(dataset, torch.utils.data.DataLoader):
            raise SamplingError(
                "got a torch DataLoader: its shuffled fixed-size batches are not the Poisson "
                "sampling the accountant assumes, and dpfit will not report the Poisson figure "
                "for them. Pass the dataset itself: engine.data_loader(loader.dataset, "
                "collate_fn=loader.collate_fn)."
            )
        if len(dataset) != self.config.sample_size:
            raise SamplingError(
                f"dataset has {len(dataset)} examples but the engine was built with "
                f"sample_size={self.config.sample_size}; the sampling rate would be wrong"
            )
        # distributed: this rank's part of the one global Poisson sample
        part = None
        if self._dist is not None:
            ctx = self._dist
            part = RankPart(ctx.rank, ctx.world_size, lambda idx: share_from_main(idx, ctx))
        sampler = PoissonBatchSampler(
            len(dataset),
            self.sample_rate,
            self.config.steps_per_epoch,
            generator=self._sample_rng,
            secure=self.config.secure_rng,
            part=part,
            reproducible=self.config.insecure_seed is not None,
        )
        self._loader = PoissonDataLoader(
            self._steps,
            dataset,
            sampler,
            collate_fn,
            physical_batch_size,
            batch_context=no_sync_context(self._ddp),
            stop=None if max_steps is None else (lambda: self.ledger.steps >= max_steps),
            yield_empty=yield_empty,
            group_physical=group_physical,
            documents=self.config.privacy_unit == "document",
        )
        if self._pending_loader_state is not None:
            self._loader.load_state_dict(self._pending_loader_state)
            self._pending_loader_state = None
        if optimizer is not None:
            self._optimizer = optimizer
        return self._loader

    def _empty_logical_step(self) -> bool:
        """An empty logical batch: a noise-only step, once an optimizer is known."""
        if self._optimizer is None:
            if not self._warned_late_empty:
                self._warned_late_empty = True
                log.warning(
                    "an empty logical batch was drawn before the engine knew the optimizer: "
                    "its noise-only step is applied at the next engine.step(), after that "
                    "batch's gradient was taken. Pass optimizer= to engine.data_loader to keep "
                    "the steps in order"
                )
            if self._dist is None:
                return False
            # the reduce is collective: take part now, apply once the optimizer is known
            self._early_updates.append(self._noised_update())
            return True
        self._finish_logical_step(self._optimizer)
        return True

    def empty_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Take now the noise-only step of a logical batch that came out as EMPTY_BATCH
        (`data_loader(yield_empty=True)`); distributed, it joins the other ranks' reduce."""
        if self._steps.physical_left or self._per_example:
            raise SamplingError(
                "empty_step() in the middle of a logical batch: call it for EMPTY_BATCH only"
            )
        self._optimizer = optimizer
        self._apply_deferred(optimizer)
        self._finish_logical_step(optimizer)
        return True

    # ------------------------------------------------------------------ step
    def _collect(self) -> dict[nn.Parameter, Any]:
        """This physical batch's per-example gradients (a seam for the audit's fault injection)."""
        return self._hooks.collect()

    def _expected_rows(self, batch_size: int | None) -> int | None:
        """How many examples this physical batch holds, as the loader drew it (or as the
        caller of a user-poisson step says)."""
        if self.config.sampling == "user-poisson" and batch_size is None:
            raise SamplingError(
                "sampling='user-poisson' needs the number of examples in each batch: call "
                "engine.step(optimizer, batch_size=len(batch)), so that per-example rows that "
                "are not examples are caught before anything is released"
            )
        if self.config.sampling == "poisson":
            drawn = self._steps.drawn_rows()
            if drawn is not None and batch_size is not None and drawn != batch_size:
                raise SamplingError(
                    f"step(batch_size={batch_size}) but the engine's loader drew {drawn} "
                    "examples for this physical batch"
                )
            return drawn
        return batch_size

    def _check_batch_axis(self, rows: int, expected: int | None) -> None:
        if expected is None or rows == expected:
            return
        raise BatchAxisError(
            f"the per-example gradients have {rows} rows but this physical batch holds "
            f"{expected} examples: the model sees the batch on another axis than the engine "
            f"assumes (batch_first={self.config.batch_first}), so clipping would bound "
            "positions, not examples. For sequence-first models (e.g. "
            "nn.TransformerEncoderLayer(batch_first=False), RNNs) build the engine with "
            "batch_first=False, or give batch_dims={layer_name: axis} for single layers."
        )

    def _document_ids(self, documents: Sequence[int] | None, rows: int) -> tuple[torch.Tensor, int]:
        """privacy_unit="document": each row's document (an index into the logical batch's
        documents) and how many documents the logical batch holds."""
        if self.config.sampling == "poisson":
            drawn = self._steps.drawn_documents()
            if drawn is None:
                raise SamplingError(
                    "privacy_unit='document' needs batches from engine.data_loader over a "
                    "dataset of documents (each item a sequence of rows)"
                )
            ids, count = drawn
            return torch.tensor(ids, dtype=torch.long), count
        if documents is None or len(documents) != rows:
            raise SamplingError(_DOCUMENT_IDS_NEEDED)
        _, ids = torch.unique(torch.as_tensor(list(documents)), return_inverse=True)
        return ids.long(), int(ids.max()) + 1 if rows else 0

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        batch_size: int | None = None,
        documents: Sequence[int] | None = None,
    ) -> bool:
        """Clip this physical batch into the running sum; at the end of a logical batch, add
        noise, divide by the expected batch size, step the optimizer and account.

        batch_size: the number of examples in this physical batch. Batches from
        `engine.data_loader` are known to the engine; with sampling="user-poisson" it is
        required, so that a wrong batch axis (per-example rows that are not examples) is
        caught. On the first step of each phase one example's row is also compared with its
        gradient computed alone (dpfit.batch_axis), whatever the shapes.
        documents: privacy_unit="document" with sampling="user-poisson" only: the document of
        each row (rows with the same id are summed and clipped as one contribution).

        Returns True when a logical (noised) step was taken.
        """
        if self.config.sampling == "poisson" and self._steps.current is None:
            raise SamplingError(
                "engine.step() was called on a batch not drawn by engine.data_loader(...). "
                "Use that loader (Poisson sampling, which the accounting assumes), or, if you "
                "draw Poisson batches at rate q yourself, build the engine with "
                "sampling='user-poisson'."
            )
        if self._ddp is not None and self._ddp.require_backward_grad_sync:
            self._per_example.clear()
            raise DistributedError(
                "the backward pass ran with DistributedDataParallel's gradient all-reduce on: "
                "it averages unclipped gradients across ranks. Use engine.data_loader (it runs "
                "each physical batch under model.no_sync()), or wrap forward and backward in "
                "`with model.no_sync():`; the engine reduces the clipped sums itself"
            )
        document_unit = self.config.privacy_unit == "document"
        if document_unit and self.config.sampling == "user-poisson" and documents is None:
            raise SamplingError(_DOCUMENT_IDS_NEEDED)  # before this batch's rows are taken
        self._optimizer = optimizer
        per_ex = self._collect()
        if not per_ex:
            raise SamplingError(
                "engine.step() was called without a backward pass since the last step"
            )
        n = batch_rows(per_ex, self._names)
        self._check_batch_axis(n, self._expected_rows(batch_size))
        batch = arrange(per_ex, self._params, n, self._layout.dtype)
        low_precision = self._hooks.take_low_precision()  # bf16 autocast (dpfit.precision)
        if self.config.check_gradients:
            self._check(batch, low_precision)
            # rows that add up may still be positions: one example against its gradient
            # alone, before anything of this batch is released
            self._probe.check(per_ex, n, self._hooks)
        self._apply_deferred(optimizer)
        scale = float(n) if self.config.loss_reduction == "mean" else 1.0
        if document_unit:  # summed per document, clipped at the end of the logical batch
            ids, count = self._document_ids(documents, n)
            self._documents.add(batch, ids, count, scale)
        else:
            self._clipped.clip_into(batch, self._clip_fn, self.max_grad_norm, scale)
        for p in per_ex:
            p.grad = None
        if self.config.sampling == "user-poisson":
            return self._finish_logical_step(optimizer)
        if not self._steps.physical_done():
            return False
        return self._finish_logical_step(optimizer)

    def _add_to_sum(self, p: nn.Parameter | None, clipped: torch.Tensor) -> None:
        """Add a clipped contribution to this logical batch's sum (dpfit.clipped_sum)."""
        self._clipped.add(p, clipped)

    def _apply_deferred(self, optimizer: torch.optim.Optimizer) -> None:
        """Steps of empty logical batches drawn before any optimizer was known."""
        for update in self._early_updates:  # reduced before the first step (distributed)
            self._apply(optimizer, update)
        self._early_updates.clear()
        while self._steps.pending_empty:
            self._steps.pending_empty -= 1
            self._release(optimizer)

    def _finish_logical_step(self, optimizer: torch.optim.Optimizer) -> bool:
        # privacy_unit="document": every row of the logical batch is in; clip each document
        self._documents.clip_into(self._clipped, self._clip_fn, self.max_grad_norm)
        self._release(optimizer)
        self._steps.close()
        return True

    def _release(self, optimizer: torch.optim.Optimizer) -> None:
        """Noise the clipped sum, divide by the expected batch size, step, account."""
        self._apply(optimizer, self._noised_update())

    def _apply(
        self, optimizer: torch.optim.Optimizer, update: list[tuple[nn.Parameter, torch.Tensor]]
    ) -> None:
        for p, g in update:
            p.grad = g
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def _noised_update(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """The released gradient of one logical step: (sum of clipped + noise) / B, accounted.

        One noise draw over the flat sum of every trainable parameter (a parameter without
        a gradient this step still gets its share). Distributed: rank 0 adds the noise to its
        local sum and one all-reduce (SUM) of that one buffer adds every rank's, so the global
        sum carries the noise exactly once and every rank gets the same tensor. Empty local
        batches take part with zeros.
        """
        if self._max_steps is not None and self.ledger.steps + 1 > self._max_steps:
            self._clipped.clear()
            self._documents.clear()
            raise BudgetExhaustedError(
                f"the privacy budget epsilon={self.config.target_epsilon} at "
                f"delta={self.target_delta} is spent after {self.ledger.steps} steps "
                f"(epsilon now {self.epsilon():.4f}); stop training, or start a new run with a "
                "larger budget"
            )
        std = self.noise_multiplier * self.max_grad_norm
        denom = float(self.config.expected_batch_size)
        if self._dist is not None and not self._dist.is_main:
            std = 0.0  # the noise is added exactly once, by rank 0
        summed = self._clipped.take()  # zeros for a logical batch with no examples (here)
        noise = gaussian_noise(summed.shape, std, self._noise_rng, self.config.secure_rng, summed)
        total = summed + noise
        if self._dist is not None:
            (total,) = all_reduce_sum([total], self._dist)
        total.div_(denom)
        update = [  # (parameter, gradient) pairs: no dict keyed by tensors on every step
            (p, g if g.dtype == p.dtype else g.to(p.dtype))
            for p, g in zip(self._params, self._layout.views(total), strict=True)
        ]
        self.ledger.record(self.noise_multiplier, self.sample_rate)
        return update

    # ------------------------------------------------------------------ reporting
    def epsilon(
        self,
        delta: float | None = None,
        *,
        steps: int | None = None,
        neighbouring: str | None = None,
    ) -> float:
        """Epsilon spent so far (at target_delta unless given) for the engine's neighbouring
        relation unless given; with `steps`, spent after the first `steps` logical steps (what
        a per-step report shows for that step)."""
        d = self.target_delta if delta is None else delta
        k = self.ledger.steps if steps is None else steps
        rel = self.config.neighbouring if neighbouring is None else neighbouring
        key = (k, d, rel)
        if key not in self._eps_cache:
            ledger = self.ledger if k == self.ledger.steps else self.ledger.prefix(k)
            self._eps_cache[key] = ledger.epsilon(d, neighbouring=rel)
        return self._eps_cache[key]

    def _epsilon_for_record(self, neighbouring: str) -> float:
        """The other relation's epsilon is a report, not the budget: if its accountant fails
        (PLD at a tiny sigma) the record says NaN rather than losing the run's outputs."""
        if neighbouring == self.config.neighbouring:
            return self.epsilon()
        try:
            return self.epsilon(neighbouring=neighbouring)
        except AccountingError as e:
            log.warning("epsilon for %s neighbours not computed: %s", neighbouring, e)
            return math.nan

    def privacy_record(self) -> dict:
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        return {
            "epsilon": self.epsilon(),
            "delta": self.target_delta,
            # which relation "epsilon" is for (and was calibrated to), and both epsilons
            "neighbouring": self.config.neighbouring,
            "epsilon_add_remove": self._epsilon_for_record("add-remove"),
            "epsilon_replace_one": self._epsilon_for_record("replace-one"),
            "accountant_replace_one": accountant_for(self.config.accountant, "replace-one"),
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "expected_batch_size": self.config.expected_batch_size,
            "sample_size": self.config.sample_size,
            "steps": self.steps_taken,
            "max_grad_norm": self.max_grad_norm,
            "clipping": self.config.clipping,
            "mode": self.config.mode,
            "accountant": self.config.accountant,
            "sampling": self.config.sampling,
            # what one contribution is: the unit epsilon protects (a row, or a document)
            "privacy_unit": self.config.privacy_unit,
            "secure_rng": self.config.secure_rng,
            "insecure_seed": self._insecure_seed,
            "trained_parameters": names,
            "trained_biases_only": all(is_bias(n) for n in names),
            "history": self.ledger.state_dict()["records"],
        }

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        sd = {
            "ledger": self.ledger.state_dict(),
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "noise_rng": None if self._noise_rng is None else self._noise_rng.get_state(),
            "sample_rng": None if self._sample_rng is None else self._sample_rng.get_state(),
            "insecure_seed": self._insecure_seed,
            "pending_empty": self._steps.pending_empty,
            "world_size": 1 if self._dist is None else self._dist.world_size,
        }
        if self.config.insecure_seed is None:  # never restored: keep the secret out of files
            sd["noise_rng"] = sd["sample_rng"] = None
        if self._loader is not None:
            sd["loader"] = self._loader.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if not math.isclose(sd["sample_rate"], self.sample_rate, rel_tol=1e-12):
            raise ValueError(
                f"checkpoint was taken with sample rate {sd['sample_rate']}, engine has "
                f"{self.sample_rate}; resume with the same batch size and data"
            )
        ledger = PrivacyLedger.from_state_dict(sd["ledger"])
        if ledger.neighbouring != self.config.neighbouring:
            raise ValueError(
                f"checkpoint was accounted for {ledger.neighbouring} neighbours, engine for "
                f"{self.config.neighbouring}; resume with neighbouring={ledger.neighbouring!r}"
            )
        self.ledger = ledger
        self.noise_multiplier = float(sd["noise_multiplier"])
        # a run that was once reproducible from a seed stays marked so
        self._insecure_seed = self._insecure_seed or bool(sd.get("insecure_seed", False))
        # A continuation draws fresh noise and batches (its generators were seeded from the
        # OS at construction): restoring the saved state would let two continuations of one
        # checkpoint draw the same noise, so that the difference of their models is the
        # noise-free difference of clipped gradients. Only an explicitly
        # insecure-seeded run continues its streams, to resume bit-for-bit.
        restore = self.config.insecure_seed is not None
        for gen, key in ((self._noise_rng, "noise_rng"), (self._sample_rng, "sample_rng")):
            if restore and gen is not None and sd.get(key) is not None:
                gen.set_state(sd[key])
        self._steps.pending_empty = int(sd.get("pending_empty", 0))
        self._eps_cache.clear()
        self._max_steps = self._compute_max_steps()
        if "loader" in sd:
            if self._loader is not None:
                self._loader.load_state_dict(sd["loader"])
            else:  # applied when data_loader() is called
                self._pending_loader_state = sd["loader"]

    # ------------------------------------------------------------------ phases
    @property
    def mode(self) -> str:
        return self.config.mode

    def phases(self) -> Iterator[Phase]:
        """Yield the schedule's phases, switching to each (after the first) before yielding.

        Build a new optimizer over ``engine.parameters()`` at the start of each phase.
        """
        if not self._phases:
            raise ValueError("the engine was built without schedule=[(mode, epochs), ...]")
        for i, phase in enumerate(self._phases):
            if i > 0 and phase.mode != self.config.mode:
                self.switch_phase(phase.mode)
            yield phase

    def switch_phase(
        self,
        mode: str,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        remaining_steps: int | None = None,
    ) -> torch.optim.Optimizer | None:
        """Switch between "full" and "bias" training between two logical steps.

        Hooks are removed and re-registered for the new trainable set; the ledger carries on,
        so epsilon stays the composed one. Given `optimizer`, returns a rebuilt one for the new
        parameters. With `remaining_steps` (and a target epsilon) the noise is re-calibrated so
        that the steps already taken plus these meet the target.
        """
        if (
            self._steps.physical_left
            or self._clipped.started
            or self._documents.started
            or self._per_example
        ):
            raise SamplingError(
                "switch_phase() in the middle of a logical batch; call it between epochs, "
                "after engine.step(optimizer) returned True"
            )
        self.detach()
        set_trainable(self.model, mode, self._bias_selection)
        self.config = replace(self.config, mode=mode)
        self._set_trainables()
        self._hooks.attach()
        if self.config.check_gradients:  # new trainables, new rows: check them again
            self._probe.arm()
        if remaining_steps is not None:
            if self.config.target_epsilon is None:
                raise ValueError("remaining_steps re-calibrates noise: needs target_epsilon")
            self.config = replace(
                self.config, noise_multiplier=None, steps=remaining_steps, epochs=None
            )
            self.noise_multiplier = self._resolve_noise_multiplier()
            self.config = replace(self.config, steps=self.ledger.steps + remaining_steps)
            self._max_steps = self._compute_max_steps()
        log.info(
            "phase switch to %s after %d steps (epsilon so far %.3f): %d trainable tensors",
            mode,
            self.ledger.steps,
            self.epsilon(),
            len(self._params),
        )
        # an empty logical batch before the next step() must not step the old parameter set
        self._optimizer = None if optimizer is None else rebuild_optimizer(optimizer, self._params)
        return self._optimizer

    def with_config(self, **changes: Any) -> PrivacyConfig:
        """A copy of the config with changes (for phase switches built on top of the engine)."""
        return replace(self.config, **changes)
