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
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from dpfit import grad_sample  # noqa: F401  (registers the samplers)
from dpfit.accounting import PrivacyLedger, StepRecord, noise_multiplier_for
from dpfit.clipping import get_clipping
from dpfit.config import PrivacyConfig
from dpfit.errors import (
    BatchNormError,
    BudgetExhaustedError,
    GradientMismatchError,
    NoTrainableParametersError,
    SamplingError,
    UnsupportedLayerError,
)
from dpfit.grad_sample.full import is_factored, norm_sampler_for
from dpfit.grad_sample.registry import SamplerEntry, lookup, registered_layers
from dpfit.params import is_bias
from dpfit.sampling import LogicalBatch, PoissonBatchSampler, PoissonDataLoader, secure_seed
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


def gaussian_noise(
    shape: torch.Size, std: float, generator: torch.Generator, secure: bool, like: torch.Tensor
) -> torch.Tensor:
    """N(0, std^2) noise; with `secure`, from os.urandom through Box-Muller in float64."""
    if std == 0:
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    if not secure:
        z = torch.randn(shape, generator=generator, dtype=torch.float32)
        return (z * std).to(device=like.device, dtype=like.dtype)
    n = math.prod(shape)
    m = n + (n % 2)
    raw = torch.frombuffer(bytearray(os.urandom(8 * m)), dtype=torch.int64)
    u = (((raw >> 11) & ((1 << 53) - 1)).to(torch.float64) + 0.5) * 2.0**-53  # uniform (0, 1)
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
    ) -> None:
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
            seed=insecure_seed,
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
        self._names = {p: n for n, p in model.named_parameters()}
        self.noise_multiplier = self._resolve_noise_multiplier()
        self._max_steps = self._compute_max_steps()
        self._noise_rng = torch.Generator().manual_seed(
            secure_seed() if insecure_seed is None or secure_rng else insecure_seed
        )
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._pending_loader_state: dict | None = None
        self._register_hooks()
        # per-step state
        self._forward_id = 0
        self._per_example: dict[nn.Parameter, dict[int, torch.Tensor]] = {}
        self._summed: dict[nn.Parameter, torch.Tensor] = {}
        self._logical: LogicalBatch | None = None
        self._physical_left = 0
        self._pending_empty = 0
        self._optimizer: torch.optim.Optimizer | None = None
        self._eps_cache: dict[tuple[int, float], float] = {}
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

        def fits(k: int) -> bool:
            extra = (StepRecord(self.noise_multiplier, self.sample_rate, k),) if k else ()
            return self.ledger.epsilon(extra=extra) <= target

        if not fits(0):
            return self.ledger.steps
        lo, hi = 0, max(1, self.config.planned_steps or 1)
        while fits(hi):
            lo, hi = hi, hi * 2
            if hi > 10**9:
                return None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
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
        self._summed.clear()

    # ------------------------------------------------------------------ hooks
    def _on_root_forward(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._forward_id += 1

    def _forward_hook(self, plan: _LayerPlan) -> Callable:
        def hook(module: nn.Module, inputs: tuple, output: Any) -> None:
            out = _first_tensor(output)
            if out is None or not out.requires_grad or not torch.is_grad_enabled():
                return
            act = inputs[0].detach() if plan.needs_input else None
            fid = self._forward_id

            def on_grad(g: torch.Tensor) -> None:
                res = {}
                if plan.entry.bias is not None:
                    res.update(plan.entry.bias(module, g, plan.batch_dim))
                if act is not None:
                    res.update(
                        (plan.weight_fn or plan.entry.weight)(module, act, g, plan.batch_dim)
                    )
                for local, p in plan.params.items():
                    if local in res:
                        self._accumulate(p, res[local], fid)

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
        slot = self._per_example.setdefault(p, {})
        if fid in slot:
            slot[fid] = slot[fid] + g  # the module ran more than once in this forward
        else:
            slot[fid] = g

    # ------------------------------------------------------------------ data
    def data_loader(
        self,
        dataset: Sequence,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        physical_batch_size: int | None = None,
    ) -> PoissonDataLoader:
        """A Poisson-sampling loader over `dataset` at rate q = expected_batch_size/sample_size."""
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
        seed = self.config.seed
        gen = torch.Generator().manual_seed(
            secure_seed() if seed is None or self.config.secure_rng else seed + 1
        )
        sampler = PoissonBatchSampler(
            len(dataset),
            self.sample_rate,
            self.config.steps_per_epoch,
            generator=gen,
            secure=self.config.secure_rng,
        )
        self._loader = PoissonDataLoader(self, dataset, sampler, collate_fn, physical_batch_size)
        if self._pending_loader_state is not None:
            self._loader.load_state_dict(self._pending_loader_state)
            self._pending_loader_state = None
        return self._loader

    def _begin_logical_batch(self, batch: LogicalBatch) -> None:
        if self._physical_left:
            raise SamplingError(
                "a new logical batch started before engine.step(optimizer) was called for every "
                "physical batch of the previous one; call it after each backward"
            )
        self._logical = batch
        self._physical_left = batch.physical_batches

    def _end_logical_batch_iteration(self) -> None:
        if self._physical_left:
            raise SamplingError(
                "call engine.step(optimizer) after each backward: "
                f"{self._physical_left} physical batch(es) of the last logical batch were not stepped"
            )

    def _empty_logical_step(self) -> None:
        if self._optimizer is None:
            self._pending_empty += 1
        else:
            self._finish_logical_step(self._optimizer)

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

    def _check_against_autograd(self, per_ex: dict[nn.Parameter, torch.Tensor]) -> None:
        names = self._names
        for p in self._params:
            g = per_ex.get(p)
            if g is None and p.grad is None:
                continue
            if g is None or p.grad is None:
                raise GradientMismatchError(
                    f"parameter '{names.get(p)}' got a gradient dpfit did not see per example "
                    "(used outside its module's forward, e.g. through a functional call)"
                    if g is None
                    else f"parameter '{names.get(p)}' has per-example gradients but no .grad; "
                    "do not zero gradients between backward and engine.step"
                )
            total = g.sum(0).to(p.grad.dtype)
            err = (total - p.grad).norm()
            if err > 1e-3 * p.grad.norm() + 1e-6:
                raise GradientMismatchError(
                    f"per-example gradients of '{names.get(p)}' do not add up to autograd's "
                    f"(relative error {err / (p.grad.norm() + 1e-12):.2e}). The parameter is "
                    "used in a way its sampler does not capture, or the batch axis is not "
                    "where declared (batch_first / batch_dims)."
                )

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Clip this physical batch into the running sum; at the end of a logical batch, add
        noise, divide by the expected batch size, step the optimizer and account.

        Returns True when a logical (noised) step was taken.
        """
        if self.config.sampling == "poisson" and self._logical is None:
            raise SamplingError(
                "engine.step() was called on a batch not drawn by engine.data_loader(...). "
                "Use that loader (Poisson sampling, which the accounting assumes), or, if you "
                "draw Poisson batches at rate q yourself, build the engine with "
                "sampling='user-poisson'."
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
        if self.config.check_gradients:
            self._check_against_autograd(per_ex)
        while self._pending_empty:
            self._pending_empty -= 1
            saved = self._logical, self._physical_left
            self._finish_logical_step(optimizer)
            self._logical, self._physical_left = saved
        scale = float(n) if self.config.loss_reduction == "mean" else 1.0
        sq = torch.zeros(n, dtype=torch.float32, device=next(iter(per_ex.values())).device)
        flat = {}
        for p, g in per_ex.items():
            if is_factored(g):  # full mode: norm from Gram matrices, sum by book-keeping
                flat[p] = g
                sq += g.sq_norms() * scale**2
                continue
            f = g.reshape(n, -1).float() * scale
            flat[p] = f
            sq += f.pow(2).sum(1)
        factors = self._clip_fn(sq.sqrt(), self.max_grad_norm)
        for p, f in flat.items():
            if is_factored(f):
                clipped = f.weighted_sum(factors * scale).float()
            else:
                clipped = (factors @ f).view(p.shape)
            if p in self._summed:
                self._summed[p] += clipped
            else:
                self._summed[p] = clipped
            p.grad = None
        if self.config.sampling == "user-poisson":
            return self._finish_logical_step(optimizer)
        self._physical_left -= 1
        if self._physical_left > 0:
            return False
        return self._finish_logical_step(optimizer)

    def _finish_logical_step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self._max_steps is not None and self.ledger.steps + 1 > self._max_steps:
            self._summed.clear()
            raise BudgetExhaustedError(
                f"the privacy budget epsilon={self.config.target_epsilon} at "
                f"delta={self.target_delta} is spent after {self.ledger.steps} steps "
                f"(epsilon now {self.epsilon():.4f}); stop training, or start a new run with a "
                "larger budget"
            )
        std = self.noise_multiplier * self.max_grad_norm
        denom = float(self.config.expected_batch_size)
        for p in self._params:
            summed = self._summed.get(p)
            if summed is None:
                summed = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            noise = gaussian_noise(p.shape, std, self._noise_rng, self.config.secure_rng, summed)
            p.grad = ((summed + noise) / denom).to(p.dtype)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._summed.clear()
        self._logical = None
        self._physical_left = 0
        self.ledger.record(self.noise_multiplier, self.sample_rate)
        return True

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
            "trained_parameters": names,
            "trained_biases_only": all(is_bias(n) for n in names),
            "history": self.ledger.state_dict()["records"],
            "insecure_seed": self.config.seed is not None and not self.config.secure_rng,
        }

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        sd = {
            "ledger": self.ledger.state_dict(),
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "noise_rng": self._noise_rng.get_state(),
            "pending_empty": self._pending_empty,
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
        self._noise_rng.set_state(sd["noise_rng"])
        self._pending_empty = int(sd.get("pending_empty", 0))
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
        if self._physical_left or self._summed or self._per_example:
            raise SamplingError(
                "switch_phase() in the middle of a logical batch; call it between epochs, "
                "after engine.step(optimizer) returned True"
            )
        self.detach()
        set_trainable(self.model, mode, self._bias_selection)
        self.config = replace(self.config, mode=mode)
        self._plans = self._plan_layers(self.model)
        self._params = self._ordered_trainable(self.model)
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
        return None if optimizer is None else rebuild_optimizer(optimizer, self._params)

    def with_config(self, **changes: Any) -> PrivacyConfig:
        """A copy of the config with changes (for phase switches built on top of the engine)."""
        return replace(self.config, **changes)
