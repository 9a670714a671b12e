"""PrivacyEngine: per-example gradients from the backward pass, clipping, noise, accounting.

Bias gradients are read where the output gradient passes each layer (a tensor hook on the
layer's output, registered by a forward hook that caches nothing). Only layers whose
non-bias parameters train (a new head, full mode) keep their input for the backward pass.
All state lives here, keyed by module or parameter; the user's objects are never modified
beyond registering hooks, and `detach()` removes those.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from dpfit import grad_sample  # noqa: F401  (registers the samplers)
from dpfit.accounting import (
    PLD_DISCRETIZATION,
    PLD_SEARCH_DISCRETIZATION,
    PrivacyLedger,
    StepRecord,
    noise_multiplier_for,
)
from dpfit.clipping import get_clipping
from dpfit.config import PrivacyConfig
from dpfit.distributed import (
    DistContext,
    all_reduce_sum,
    check_identical,
    no_sync_context,
    resolve,
    shard_indices,
    unwrap_ddp,
)
from dpfit.errors import (
    BatchAxisError,
    BatchNormError,
    BudgetExhaustedError,
    DistributedError,
    GradientMismatchError,
    NoTrainableParametersError,
    SamplingError,
    UnsupportedLayerError,
)
from dpfit.flat import FlatLayout
from dpfit.grad_sample.full import is_factored, norm_sampler_for
from dpfit.grad_sample.registry import SamplerEntry, lookup, registered_layers
from dpfit.params import is_bias
from dpfit.rng import make_generator, os_uniform
from dpfit.sampling import LogicalStepTracker, PoissonBatchSampler, PoissonDataLoader
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

_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


@dataclass
class _LayerPlan:
    """The trainable parameters one hooked module is responsible for."""

    name: str
    entry: SamplerEntry
    batch_dim: int
    params: dict[str, nn.Parameter] = field(default_factory=dict)  # local name -> param
    needs_input: bool = False
    # full mode: a factored (ghost norm / book-keeping) sampler from grad_sample.full
    weight_fn: Callable | None = None


def find_batchnorms(model: nn.Module) -> list[str]:
    return [n or "<root>" for n, m in model.named_modules() if isinstance(m, _BATCHNORMS)]


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


def _flat(t: torch.Tensor) -> torch.Tensor:
    """`t` as one row of elements (itself when already 1-D: no reshape call per bias)."""
    return t if t.dim() == 1 else t.reshape(-1)


def gaussian_noise(
    shape: torch.Size,
    std: float,
    generator: torch.Generator | None,
    secure: bool,
    like: torch.Tensor,
) -> torch.Tensor:
    """N(0, std^2) noise; with `secure`, from os.urandom through Box-Muller in float64
    (`generator` is then unused and may be None)."""
    if std == 0:
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    if not secure:
        if generator is None:
            raise ValueError("gaussian_noise needs a generator unless secure=True")
        z = torch.randn(shape, generator=generator, dtype=torch.float32).mul_(std)
        if z.dtype == like.dtype and z.device == like.device:
            return z
        return z.to(device=like.device, dtype=like.dtype)
    n = math.prod(shape)
    m = n + (n % 2)
    u = os_uniform(m)
    u1, u2 = u[: m // 2], u[m // 2 :]
    r = torch.sqrt(-2.0 * torch.log(u1))
    z = torch.cat([r * torch.cos(2 * math.pi * u2), r * torch.sin(2 * math.pi * u2)])[:n]
    return (z.reshape(shape) * std).to(device=like.device, dtype=like.dtype)


class PrivacyEngine:
    """DP-SGD over the model's trainable parameters, bias-only by design (DP-BiTFiT).

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
        )
        self.model = model
        self._bias_selection = bias_selection(model)
        if self._phases:
            set_trainable(model, mode, self._bias_selection)
        self._clip_fn = get_clipping(clipping)
        self.ledger = PrivacyLedger(target_delta, accountant)
        self._plans = self._plan_layers(model)
        self._params = self._ordered_trainable(model)
        self._layout = FlatLayout(self._params)
        self._all_positions = tuple(range(len(self._params)))
        self._names = {p: n for n, p in model.named_parameters()}
        self.noise_multiplier = self._resolve_noise_multiplier()
        self._max_steps = self._compute_max_steps()
        self._insecure_seed = insecure_seed is not None
        self._noise_rng, self._sample_rng = self._make_generators()
        if self._dist is not None:
            check_identical(self._params, self._dist)
        # noised updates of empty logical batches reduced before any optimizer was seen
        self._early_updates: list[dict[nn.Parameter, torch.Tensor]] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._pending_loader_state: dict | None = None
        self._warned_late_empty = False
        self._register_hooks()
        # per-step state
        self._forward_id = 0
        self._per_example: dict[nn.Parameter, dict[int, torch.Tensor]] = {}
        # the running sum of clipped per-example gradients of this logical batch, laid out
        # flat (self._layout); None until its first physical batch
        self._sum: torch.Tensor | None = None
        self._steps = LogicalStepTracker(self._empty_logical_step)
        self._optimizer: torch.optim.Optimizer | None = None
        self._eps_cache: dict[tuple[int, float], float] = {}
        self._tolerances: dict[tuple[torch.dtype, ...], list[float]] = {}  # gradient check
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
        else seeded from os.urandom, or from insecure_seed (two distinct streams)."""
        if self.config.secure_rng:
            return None, None
        seed = self.config.insecure_seed
        if seed is not None:
            log.warning(
                "insecure_seed=%d: noise and Poisson sampling are reproducible from this seed, "
                "so the run is NOT differentially private against anyone who knows it",
                seed,
            )
        return make_generator(seed, "noise"), make_generator(seed, self._sampling_stream())

    def _sampling_stream(self, resumed_at: int | None = None) -> str:
        """Each rank samples its shard from its own stream: shared draws would make the
        inclusions of examples on different ranks dependent (not Poisson)."""
        name = "sampling"
        if self._dist is not None and self._dist.rank > 0:
            name += f":rank{self._dist.rank}"
        if resumed_at is not None:
            name += f":resumed{resumed_at}"
        return name

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

    def _batch_dim(self, name: str, entry: SamplerEntry) -> int:
        overrides = dict(self.config.batch_dims)
        if name in overrides:
            return overrides[name]
        if entry.batch_axis_fixed:
            return 0
        return 0 if self.config.batch_first else 1

    def _plan_layers(self, model: nn.Module) -> dict[nn.Module, _LayerPlan]:
        bns = find_batchnorms(model)
        if bns:
            raise BatchNormError(
                f"BatchNorm layers {bns} mix examples in their batch statistics, so per-example "
                "gradients (and DP) are undefined. Replace them with GroupNorm "
                "(dpfit.add_biases(model, replace_batchnorm=True) or CLI --replace-batchnorm)."
            )
        trainable = {p: n for n, p in model.named_parameters() if p.requires_grad}
        if not trainable:
            raise NoTrainableParametersError(
                "no parameter of the model requires grad; call dpfit.make_bias_trainable(model) "
                "(and dpfit.add_biases(model) first if the model has no biases)"
            )
        owned: dict[nn.Parameter, str] = {}
        plans: dict[nn.Module, _LayerPlan] = {}
        claimed: set[nn.Module] = set()
        for mname, module in model.named_modules():
            if module in claimed:
                continue
            entry = lookup(module)
            if entry is None:
                continue
            plan = _LayerPlan(mname, entry, self._batch_dim(mname, entry))
            if entry.capture is not None:
                for sub in module.modules():
                    if sub is not module:
                        claimed.add(sub)
                for local in entry.capture_params:
                    p = module.get_parameter(local)
                    if p in trainable:
                        plan.params[local] = p
                other = [n for n, p in module.named_parameters() if p in trainable]
                extra = [n for n in other if n not in entry.capture_params]
                if extra:
                    raise UnsupportedLayerError(
                        f"{type(module).__name__} '{mname}' has trainable {extra}; only "
                        f"{list(entry.capture_params)} are supported there. Freeze them."
                    )
            else:
                for local, p in module.named_parameters(recurse=False):
                    if p not in trainable:
                        continue
                    if local in entry.bias_params and entry.bias is not None:
                        plan.params[local] = p
                    elif local in entry.weight_params and entry.weight is not None:
                        plan.params[local] = p
                        plan.needs_input = True
            if plan.needs_input and self.config.mode == "full":
                plan.weight_fn = norm_sampler_for(module)
            if plan.params:
                plans[module] = plan
                for p in plan.params.values():
                    owned.setdefault(p, plan.name)
        missing = [
            f"{name} (in {type(model.get_submodule(name.rsplit('.', 1)[0]) if '.' in name else model).__name__})"
            for p, name in trainable.items()
            if p not in owned
        ]
        if missing:
            raise UnsupportedLayerError(
                "no per-example gradient sampler for trainable parameters: "
                + ", ".join(missing[:20])
                + (f" (+{len(missing) - 20} more)" if len(missing) > 20 else "")
                + ". Freeze them (dpfit.make_bias_trainable), or register a sampler with "
                "dpfit.grad_sample.register_bias_sampler / register_weight_sampler. "
                f"Supported layers: {', '.join(registered_layers())}"
            )
        heavy = [p.name for p in plans.values() if p.needs_input]
        if heavy:
            log.info("per-example weight gradients (input kept for backward) in: %s", heavy)
        return plans

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
        )

    def _compute_max_steps(self) -> int | None:
        """Largest total step count whose epsilon stays within target_epsilon."""
        target = self.config.target_epsilon
        if target is None:
            return None
        if self.noise_multiplier == 0:
            return self.ledger.steps

        def fits(k: int, grid: float = PLD_DISCRETIZATION) -> bool:
            extra = (StepRecord(self.noise_multiplier, self.sample_rate, k),) if k else ()
            return self.ledger.epsilon(extra=extra, pld_discretization=grid) <= target

        # PLD: search on a coarser (pessimistic, so never larger) grid, then settle on the
        # grid epsilon is reported with; RDP ignores the grid
        search = PLD_SEARCH_DISCRETIZATION
        if not fits(0):
            return self.ledger.steps

        def last_fitting(lo: int, hi: int, grid: float) -> int:
            """Given fits(lo) and not fits(hi): the largest k in [lo, hi) that fits."""
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid, grid) else (lo, mid)
            return lo

        lo, hi = 0, max(1, self.config.planned_steps or 1)
        while fits(hi, search):
            lo, hi = hi, hi * 2
            if hi > 10**9:
                return None
        lo = last_fitting(lo, hi, search)
        if self.config.accountant == "pld":  # settle on the reporting grid, O(log) evaluations
            if not fits(lo):
                lo = last_fitting(0, lo, PLD_DISCRETIZATION)
            else:
                step = 1
                while fits(lo + step):
                    lo, step = lo + step, step * 2
                lo = last_fitting(lo, lo + step, PLD_DISCRETIZATION)
        return self.ledger.steps + lo

    def _register_hooks(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._on_root_forward))
        for module, plan in self._plans.items():
            if plan.entry.capture is not None:
                self._handles.append(module.register_forward_hook(self._capture_hook(plan)))
            else:
                self._handles.append(module.register_forward_hook(self._forward_hook(plan)))

    def detach(self) -> None:
        """Remove every hook; the model is left exactly as it was before the engine."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._per_example.clear()
        self._sum = None

    # ------------------------------------------------------------------ hooks
    def _on_root_forward(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._forward_id += 1

    def _forward_hook(self, plan: _LayerPlan) -> Callable:
        # resolved once here, not on every forward: these hooks run for every layer and pass
        entry, params, bd = plan.entry, plan.params, plan.batch_dim
        bias_fn = entry.bias if any(local in entry.bias_params for local in params) else None
        weight_fn = (plan.weight_fn or entry.weight) if plan.needs_input else None
        accumulate = self._accumulate

        def hook(module: nn.Module, inputs: tuple, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            out = output if isinstance(output, torch.Tensor) else _first_tensor(output)
            if out is None or not out.requires_grad:
                return
            act = inputs[0].detach() if weight_fn is not None else None
            fid = self._forward_id

            def on_grad(g: torch.Tensor) -> None:
                if act is None:
                    res = bias_fn(module, g, bd)
                elif bias_fn is None:
                    res = weight_fn(module, act, g, bd)
                else:
                    res = {**bias_fn(module, g, bd), **weight_fn(module, act, g, bd)}
                for local, p in params.items():
                    per = res.get(local)
                    if per is not None:
                        accumulate(p, per, fid)

            out.register_hook(on_grad)

        return hook

    def _capture_hook(self, plan: _LayerPlan) -> Callable:
        def hook(module: nn.Module, inputs: tuple, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            fid = self._forward_id

            def emit(local: str, g: torch.Tensor) -> None:
                p = plan.params.get(local)
                if p is not None:
                    self._accumulate(p, g, fid)

            plan.entry.capture(module, inputs, output, emit)

        return hook

    def _accumulate(self, p: nn.Parameter, g: torch.Tensor, fid: int) -> None:
        slot = self._per_example.get(p)
        if slot is None:
            self._per_example[p] = {fid: g}
        elif fid in slot:
            slot[fid] = slot[fid] + g  # the module ran more than once in this forward
        else:
            slot[fid] = g

    # ------------------------------------------------------------------ data
    def data_loader(
        self,
        dataset: Sequence,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        physical_batch_size: int | None = None,
        max_steps: int | None = None,
        yield_empty: bool = False,
        optimizer: torch.optim.Optimizer | None = None,
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
        # distributed: this rank's shard, sampled at the same q (the union is Poisson at q)
        shard = None
        if self._dist is not None:
            shard = shard_indices(len(dataset), self._dist.rank, self._dist.world_size)
        sampler = PoissonBatchSampler(
            len(dataset) if shard is None else len(shard),
            self.sample_rate,
            self.config.steps_per_epoch,
            generator=self._sample_rng,
            secure=self.config.secure_rng,
            indices=shard,
            # a saved loader state holds rank 0's generator: other ranks keep their own stream
            restores_generator=self._dist is None or self._dist.is_main,
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
    def _collect(self) -> dict[nn.Parameter, torch.Tensor]:
        per_ex: dict[nn.Parameter, torch.Tensor] = {}
        fids = {fid for slot in self._per_example.values() for fid in slot}
        if len(fids) > 1:
            self._per_example.clear()
            raise SamplingError(
                "gradients from more than one forward pass reached this step; call "
                "engine.step(optimizer) after every backward (it accumulates physical batches "
                "into one logical step), and run the model once per batch"
            )
        for p, slot in self._per_example.items():
            (g,) = slot.values()
            per_ex[p] = g
        self._per_example.clear()
        return per_ex

    def _check_against_autograd(
        self,
        per_ex: dict[nn.Parameter, torch.Tensor],
        dense: torch.Tensor | None,
        plain: list[nn.Parameter],
        factored: list[nn.Parameter],
    ) -> None:
        """Per-example gradients must add up to autograd's `.grad` of every parameter.

        dense: the non-factored per-example gradients side by side, (rows, elements), of the
        parameters `plain` in parameter order, not yet scaled; `factored`: those held as
        `OuterGrad`. One fused reduction and one host sync per step: this runs every step.
        """
        names = self._names
        for p in self._params:
            g = per_ex.get(p)
            grad = p.grad
            if (g is None) != (grad is None):
                raise GradientMismatchError(
                    f"parameter '{names.get(p)}' got a gradient dpfit did not see per example "
                    "(used outside its module's forward, e.g. through a functional call)"
                    if g is None
                    else f"parameter '{names.get(p)}' has per-example gradients but no .grad; "
                    "do not zero gradients between backward and engine.step"
                )
        if not plain and not factored:
            return
        # compared in float32; bf16/fp16 gradients carry rounding of a few ulps
        sq_parts, checked = [], []  # rows: squared error norm, squared reference norm
        if plain:
            assert dense is not None
            ref = torch.cat([_flat(p.grad) for p in plain])
            if ref.dtype != torch.float32:
                ref = ref.float()
            if len(plain) == len(self._params):
                positions = self._all_positions
            else:
                positions = tuple(self._layout.position(p) for p in plain)
            ids = self._layout.segment_ids(positions, ref.device)
            both = torch.stack([dense.sum(0).to(ref.device) - ref, ref]).square_()
            sq_parts.append(ref.new_zeros(2, len(plain)).index_add_(1, ids, both))
            checked += plain
        if factored:
            dev = sq_parts[0].device if sq_parts else factored[0].grad.device
            totals = [per_ex[p].sum(0).float() for p in factored]
            refs = [p.grad.float() for p in factored]
            errs = torch.stack(
                [e.to(dev) for e in torch._foreach_norm(torch._foreach_sub(totals, refs))]
            )
            norms = torch.stack([r.to(dev) for r in torch._foreach_norm(refs)])
            sq_parts.append(torch.stack([errs, norms]).pow(2))
            checked += factored
        sq = sq_parts[0] if len(sq_parts) == 1 else torch.cat(sq_parts, 1)
        # compared on the host: one transfer, then a loop over parameters, instead of a few
        # more tensor ops (each costs more than the loop at these sizes)
        sq_errs, sq_refs = sq.tolist()
        dtypes = tuple(p.grad.dtype for p in checked)
        rel_tols = self._tolerances.get(dtypes)
        if rel_tols is None:
            rel_tols = [max(1e-3, 8 * torch.finfo(d).eps) for d in dtypes]
            self._tolerances[dtypes] = rel_tols
        for p, sq_err, sq_ref, tol in zip(checked, sq_errs, sq_refs, rel_tols, strict=True):
            err, ref_norm = math.sqrt(sq_err), math.sqrt(sq_ref)
            if err > tol * ref_norm + 1e-6:
                raise GradientMismatchError(
                    f"per-example gradients of '{names.get(p)}' do not add up to "
                    f"autograd's (relative error {err / (ref_norm + 1e-12):.2e}). The "
                    "parameter is used in a way its sampler does not capture, or the batch "
                    "axis is not where declared (batch_first / batch_dims)."
                )

    def _expected_rows(self, batch_size: int | None) -> int | None:
        """How many examples this physical batch holds, as the loader drew it (or as the
        caller of a user-poisson step says)."""
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

    def step(self, optimizer: torch.optim.Optimizer, batch_size: int | None = None) -> bool:
        """Clip this physical batch into the running sum; at the end of a logical batch, add
        noise, divide by the expected batch size, step the optimizer and account.

        batch_size: the number of examples in this physical batch. Batches from
        `engine.data_loader` are known to the engine; with sampling="user-poisson", pass it so
        that a wrong batch axis (per-example rows that are not examples) is caught.

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
        self._optimizer = optimizer
        per_ex = self._collect()
        if not per_ex:
            raise SamplingError(
                "engine.step() was called without a backward pass since the last step"
            )
        sizes = {g.shape[0] for g in per_ex.values()}
        if len(sizes) == 2 and 1 in sizes:
            ones = [self._names[p] for p, g in per_ex.items() if g.shape[0] == 1]
            raise GradientMismatchError(
                f"{ones[:5]} saw an input with batch size 1 while other layers saw "
                f"{max(sizes)}: that input was broadcast across the batch (e.g. position ids "
                "of shape (1, L)), so its gradient mixes examples. Pass it with the batch "
                "axis expanded, e.g. position_ids=torch.arange(L).expand(B, L)."
            )
        if len(sizes) != 1:
            raise GradientMismatchError(
                f"per-example gradients disagree on the batch size ({sorted(sizes)}): some layer "
                "sees the batch on another axis; set batch_first=False or batch_dims={name: axis}"
            )
        (n,) = sizes
        self._check_batch_axis(n, self._expected_rows(batch_size))
        plain: list[nn.Parameter] = []
        factored: list[nn.Parameter] = []
        for p in self._params:
            g = per_ex.get(p)
            if g is not None:
                (factored if is_factored(g) else plain).append(p)
        # every plain per-example gradient side by side: one norm, one clip, one matmul
        dense = None
        if plain:
            rows = [per_ex[p] for p in plain]
            dense = torch.cat([g if g.dim() == 2 else g.reshape(n, -1) for g in rows], 1)
            if dense.dtype != torch.float32:
                dense = dense.float()
        if self.config.check_gradients:
            self._check_against_autograd(per_ex, dense, plain, factored)
        self._apply_deferred(optimizer)
        scale = float(n) if self.config.loss_reduction == "mean" else 1.0
        # the loss scale multiplies each example's norm and its row: applied to the n norms
        # and n factors, not to every element of `dense`
        if dense is not None:
            sq = dense.pow(2).sum(1) * scale**2
        else:
            sq = torch.zeros(n, dtype=torch.float32, device=per_ex[factored[0]].device)
        for p in factored:  # full mode: norm from Gram matrices, sum by book-keeping
            sq = sq + per_ex[p].sq_norms().to(sq.device) * scale**2
        factors = self._clip_fn(sq.sqrt(), self.max_grad_norm)
        if dense is not None:
            clipped = (factors * scale) @ dense
            if len(plain) == len(self._params):  # the usual case: the whole buffer at once
                self._add_to_sum(None, clipped)
            else:
                offset = 0
                for p in plain:
                    k = p.numel()
                    self._add_to_sum(p, clipped[offset : offset + k])
                    offset += k
        for p in factored:
            self._add_to_sum(p, per_ex[p].weighted_sum(factors * scale).float())
        for p in per_ex:
            p.grad = None
        if self.config.sampling == "user-poisson":
            return self._finish_logical_step(optimizer)
        if not self._steps.physical_done():
            return False
        return self._finish_logical_step(optimizer)

    def _add_to_sum(self, p: nn.Parameter | None, clipped: torch.Tensor) -> None:
        """Add a clipped contribution to this logical batch's flat sum: of parameter `p`, or
        of every trainable parameter (p None, `clipped` laid out as self._layout)."""
        if p is None and self._sum is None:
            # a fresh tensor (the clipping matmul's result), float32 as the flat layout is
            self._sum = clipped if clipped.dtype == torch.float32 else clipped.float()
            return
        if self._sum is None:
            self._sum = self._layout.zeros()
        if p is None:
            self._sum += clipped.to(self._sum.device)
        else:
            self._sum[self._layout.span(p)] += clipped.reshape(-1).to(self._sum.device)

    def _apply_deferred(self, optimizer: torch.optim.Optimizer) -> None:
        """Steps of empty logical batches drawn before any optimizer was known."""
        for update in self._early_updates:  # reduced before the first step (distributed)
            self._apply(optimizer, update)
        self._early_updates.clear()
        while self._steps.pending_empty:
            self._steps.pending_empty -= 1
            self._release(optimizer)

    def _finish_logical_step(self, optimizer: torch.optim.Optimizer) -> bool:
        self._release(optimizer)
        self._steps.close()
        return True

    def _release(self, optimizer: torch.optim.Optimizer) -> None:
        """Noise the clipped sum, divide by the expected batch size, step, account."""
        self._apply(optimizer, self._noised_update())

    def _apply(
        self, optimizer: torch.optim.Optimizer, update: dict[nn.Parameter, torch.Tensor]
    ) -> None:
        for p, g in update.items():
            p.grad = g
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def _noised_update(self) -> dict[nn.Parameter, torch.Tensor]:
        """The released gradient of one logical step: (sum of clipped + noise) / B, accounted.

        One noise draw over the flat sum of every trainable parameter (a parameter without
        a gradient this step still gets its share). Distributed: rank 0 adds the noise to its
        local sum and one all-reduce (SUM) of that one buffer adds every rank's, so the global
        sum carries the noise exactly once and every rank gets the same tensor. Empty local
        batches take part with zeros.
        """
        if self._max_steps is not None and self.ledger.steps + 1 > self._max_steps:
            self._sum = None
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
        summed = self._sum if self._sum is not None else self._layout.zeros()
        noise = gaussian_noise(summed.shape, std, self._noise_rng, self.config.secure_rng, summed)
        total = summed + noise
        if self._dist is not None:
            (total,) = all_reduce_sum([total], self._dist)
        total.div_(denom)
        update = {
            p: g if g.dtype == p.dtype else g.to(p.dtype)
            for p, g in zip(self._params, self._layout.views(total), strict=True)
        }
        self._sum = None
        self.ledger.record(self.noise_multiplier, self.sample_rate)
        return update

    # ------------------------------------------------------------------ reporting
    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far (at target_delta unless given)."""
        d = self.target_delta if delta is None else delta
        key = (self.ledger.steps, d)
        if key not in self._eps_cache:
            self._eps_cache[key] = self.ledger.epsilon(d)
        return self._eps_cache[key]

    def privacy_record(self) -> dict:
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        return {
            "epsilon": self.epsilon(),
            "delta": self.target_delta,
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
        if self._loader is not None:
            sd["loader"] = self._loader.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if not math.isclose(sd["sample_rate"], self.sample_rate, rel_tol=1e-12):
            raise ValueError(
                f"checkpoint was taken with sample rate {sd['sample_rate']}, engine has "
                f"{self.sample_rate}; resume with the same batch size and data"
            )
        self.ledger = PrivacyLedger.from_state_dict(sd["ledger"])
        self.noise_multiplier = float(sd["noise_multiplier"])
        # a run that was once reproducible from a seed stays marked so
        self._insecure_seed = self._insecure_seed or bool(sd.get("insecure_seed", False))
        for gen, key in ((self._noise_rng, "noise_rng"), (self._sample_rng, "sample_rng")):
            if gen is not None and sd.get(key) is not None:
                gen.set_state(sd[key])
        if self._dist is not None and self._dist.rank > 0 and self._sample_rng is not None:
            # the checkpoint holds rank 0's sampling stream; copying it would make this shard's
            # draws equal rank 0's. Poisson steps are independent, so a fresh stream is exact.
            seed = self.config.insecure_seed
            self._sample_rng.set_state(
                make_generator(seed, self._sampling_stream(self.ledger.steps)).get_state()
            )
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
        if self._steps.physical_left or self._sum is not None or self._per_example:
            raise SamplingError(
                "switch_phase() in the middle of a logical batch; call it between epochs, "
                "after engine.step(optimizer) returned True"
            )
        self.detach()
        set_trainable(self.model, mode, self._bias_selection)
        self.config = replace(self.config, mode=mode)
        self._plans = self._plan_layers(self.model)
        self._params = self._ordered_trainable(self.model)
        self._layout = FlatLayout(self._params)
        self._all_positions = tuple(range(len(self._params)))
        self._register_hooks()
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
