"""Speed and memory of DP-BiTFiT (dpfit) against non-private and Opacus baselines, in one run.

Per (model, sequence length, method) a fresh worker process loads the model, sets the method
up, runs warm-up steps and timed steps (forward + backward + optimizer step, batch 8) and
reports:

* wall time per step (time.perf_counter; median over all timed steps of all repetitions, with
  the spread as the min-max range of those steps),
* CPU time per step (time.process_time; far less sensitive to other jobs on a shared machine),
* peak memory: on CPU the peak RSS of the worker during the steps minus its RSS just before them
  (Linux: the peak is reset through /proc/self/clear_refs, read from VmHWM; elsewhere
  ru_maxrss); on CUDA torch.cuda.max_memory_allocated minus the allocation before the steps,
* activation bytes: tensors autograd saves for backward during forward + loss
  (torch.autograd.graph.saved_tensors_hooks), plus tensors Opacus caches in its forward hooks,
  unique by storage and excluding parameters. Deterministic, so a noise-free memory signal.

Methods: nonpriv-full, nonpriv-bias, dpfit-bitfit, dpfit-full (only if dpfit's mode="full"
accepts the model), opacus-hooks, opacus-ghost (DP full fine-tuning) and opacus-bias (hooks mode,
only biases trainable). Opacus has no grad sampler for transformers' Conv1D, so for GPT-2 the
Opacus rows run on a copy whose Conv1D layers are replaced by the equivalent nn.Linear.
Methods are interleaved within each length, and repetitions rotate their order. The bf16 rows
are the methods nonpriv-full, nonpriv-bias, dpfit-bitfit and dpfit-full with `-bf16`
appended: the forward pass under bf16 autocast (dpfit.precision); ask for them with --methods.

    python benchmarks/speed_memory.py                 # defaults (see --help)
    python benchmarks/speed_memory.py --quick         # smoke run (a few minutes on 2 cores)
    python benchmarks/speed_memory.py --lengths 64 128 256 512 --steps 3 --reps 2
    python benchmarks/speed_memory.py --lengths 64 256 --methods nonpriv-bias \
        nonpriv-bias-bf16 dpfit-bitfit dpfit-bitfit-bf16 --skip 256:nonpriv-bias-bf16

`--skip [LEN:]METHOD ...` leaves rows out (listed as not run; `--note` says why in the header).
A -bf16 row casts the frozen weights to bf16 once (dpfit.frozen_casts), as `dpfit train` does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.memory import peak_rss, reset_peak_rss, rss_now

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
BATCH = 8
NUM_LABELS = 2

METHODS = [
    "nonpriv-full",
    "nonpriv-bias",
    "dpfit-bitfit",
    "dpfit-full",
    "opacus-hooks",
    "opacus-ghost",
    "opacus-bias",
]
LABELS = {
    "nonpriv-full": "non-private full",
    "nonpriv-bias": "non-private bias-only",
    "dpfit-bitfit": "dpfit DP-BiTFiT",
    "dpfit-full": "dpfit DP full",
    "opacus-hooks": "Opacus DP full (hooks)",
    "opacus-ghost": "Opacus DP full (ghost)",
    "opacus-bias": "Opacus bias-only (hooks)",
}
# bf16 autocast rows (dpfit.precision): the same method with its forward under
# torch.autocast(bfloat16); parameters, norms, clipping and noise stay float32
BF16 = "-bf16"
BF16_METHODS = [
    f"{m}{BF16}" for m in ("nonpriv-full", "nonpriv-bias", "dpfit-bitfit", "dpfit-full")
]
LABELS.update({m: f"{LABELS[m[: -len(BF16)]]} (bf16)" for m in BF16_METHODS})
MODELS = ("roberta-base", "gpt2")
NOT_RUN = "not run (--skip)"


# ---------------------------------------------------------------------------- models
def build_model(name: str, seed: int = 0):
    import torch
    import transformers as T

    torch.manual_seed(seed)
    if name == "roberta-base":
        cfg = T.RobertaConfig(num_labels=NUM_LABELS)  # defaults are roberta-base
        model = T.RobertaForSequenceClassification(cfg)
    elif name == "gpt2":
        cfg = T.GPT2Config(num_labels=NUM_LABELS, pad_token_id=0)  # defaults are GPT-2 small
        model = T.GPT2ForSequenceClassification(cfg)
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    return model


def conv1d_to_linear(model):
    """Replace transformers Conv1D (y = x W + b, W: in x out) by the equivalent nn.Linear."""
    import torch
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    for parent in list(model.modules()):
        for cname, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                w = child.weight  # (in, out)
                lin = nn.Linear(w.shape[0], w.shape[1], bias=child.bias is not None)
                with torch.no_grad():
                    lin.weight.copy_(w.t())
                    if child.bias is not None:
                        lin.bias.copy_(child.bias)
                setattr(parent, cname, lin)
    return model


# ---------------------------------------------------------------------------- memory probes
class SavedTensorMeter:
    """Bytes autograd saves for backward (unique storages, parameters excluded: also a frozen
    weight's bf16 copy that dpfit.frozen_casts swaps into its Parameter for the step)."""

    def __init__(self, model):
        self.model = model
        self.storages: dict[int, int] = {}
        self.raw = 0

    def add(self, t) -> None:
        import torch

        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
        except Exception:
            return
        ptr = st.data_ptr()
        self.raw += t.numel() * t.element_size()
        if ptr == 0 or ptr in self.param_ptrs():
            return
        self.storages[ptr] = st.nbytes()

    def param_ptrs(self) -> set[int]:
        """The parameters' storages now (inside a step a frozen weight holds its bf16 copy)."""
        return {p.untyped_storage().data_ptr() for p in self.model.parameters()}

    def pack(self, t):
        self.add(t)
        return t

    @staticmethod
    def unpack(t):
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


# ---------------------------------------------------------------------------- worker
def _metered_loss(model, crit, x, y, meter, precision="fp32"):
    """Forward and loss (under bf16 autocast for a -bf16 method); with a meter, count the
    tensors autograd saves on the way."""
    import contextlib

    import torch

    from dpfit.precision import autocast

    ctx = (
        torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack)
        if meter is not None
        else contextlib.nullcontext()
    )
    with ctx, autocast(precision, next(model.parameters()).device):
        return crit(model(**x).logits, y)


def _setup(method: str, model_name: str, model_path: str, device: str):
    """Return (model, step_fn) for a method; step_fn(x, y, meter=None) runs one full step."""
    import torch
    from torch import nn

    import dpfit
    from dpfit.frozen_casts import FrozenWeightCasts

    prec = "fp32"
    if method.endswith(BF16):
        method, prec = method[: -len(BF16)], "bf16"
    model = torch.load(model_path, weights_only=False)
    model.train()
    if method.startswith("opacus") and model_name == "gpt2":
        conv1d_to_linear(model)
    model.to(device)
    ce = nn.CrossEntropyLoss()
    info: dict = {}

    def all_trainable():
        for p in model.parameters():
            p.requires_grad_(True)

    if method in ("nonpriv-full", "dpfit-full", "opacus-hooks", "opacus-ghost"):
        all_trainable()
    else:
        dpfit.make_bias_trainable(model)
    info["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)

    # bf16: frozen weights cast once, as `dpfit train` runs it (a no-op in fp32 and for
    # methods that train every weight)
    casts = FrozenWeightCasts(model, prec, device)

    if method.startswith("nonpriv"):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

        def step(x, y, meter=None):
            with casts.active():
                loss = _metered_loss(model, ce, x, y, meter, prec)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return model, step, info

    if method.startswith("dpfit"):
        engine = dpfit.PrivacyEngine(
            model,
            expected_batch_size=BATCH,
            sample_size=10_000,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            sampling="user-poisson",
            loss_reduction="mean",
            mode="full" if method == "dpfit-full" else "bias",
            insecure_seed=0,  # timing only: reproducible noise is fine here
        )
        opt = torch.optim.AdamW(engine.parameters(), lr=1e-5)

        def step(x, y, meter=None):
            with casts.active():
                loss = _metered_loss(model, ce, x, y, meter, prec)
                loss.backward()
            engine.step(opt, batch_size=y.shape[0])

        return model, step, info

    # Opacus
    import warnings

    from opacus import PrivacyEngine as OpacusEngine

    warnings.filterwarnings("ignore")
    mode = "ghost" if method == "opacus-ghost" else "hooks"
    if method == "opacus-bias":
        dpfit.make_bias_trainable(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    ds = torch.utils.data.TensorDataset(
        torch.zeros(10_000, 1, dtype=torch.long), torch.zeros(10_000, dtype=torch.long)
    )
    dl = torch.utils.data.DataLoader(ds, batch_size=BATCH)
    pe = OpacusEngine(accountant="rdp")
    kw = dict(
        module=model,
        optimizer=opt,
        data_loader=dl,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        grad_sample_mode=mode,
    )
    if mode == "ghost":
        gmodel, gopt, crit, _ = pe.make_private(criterion=ce, **kw)
    else:
        gmodel, gopt, _ = pe.make_private(**kw)
        crit = ce

    def hook_cached(meter):
        for m in gmodel.modules():
            for entry in getattr(m, "activations", None) or []:
                for t in entry if isinstance(entry, (list, tuple)) else [entry]:
                    meter.add(t)

    def step(x, y, meter=None):
        loss = _metered_loss(gmodel, crit, x, y, meter)
        if meter is not None:
            hook_cached(meter)
        loss.backward()
        gopt.step()
        gopt.zero_grad(set_to_none=True)

    return gmodel, step, info


def worker(spec: dict) -> dict:
    import gc

    import torch

    torch.set_num_threads(spec["threads"])
    device = spec["device"]
    cuda = device.startswith("cuda")
    res: dict = {k: spec[k] for k in ("model", "length", "method", "rep")}
    t_setup = time.perf_counter()
    model, step, info = _setup(spec["method"], spec["model"], spec["model_path"], device)
    res.update(info)
    res["setup_s"] = time.perf_counter() - t_setup
    vocab = model.config.vocab_size if hasattr(model, "config") else 50000
    g = torch.Generator().manual_seed(1234 + spec["length"])
    x = torch.randint(5, min(vocab, 30_000), (BATCH, spec["length"]), generator=g).to(device)
    y = torch.randint(0, NUM_LABELS, (BATCH,), generator=g).to(device)
    # GPT-2 builds position_ids of shape (1, L) and broadcasts the position embedding over the
    # batch, which hides per-example gradients of `wpe` from any DP method (Opacus and dpfit
    # both reject it). Every method therefore gets explicit (B, L) position ids.
    pos = spec["model"] == "gpt2"

    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        resettable = reset_peak_rss()
        base = rss_now()
    meter = SavedTensorMeter(model)
    wl = spec.get("warmup_length") or spec["length"]
    xw = x if wl == spec["length"] else x[:, :wl].contiguous()
    walls, cpus = [], []
    for i in range(spec["warmup"] + spec["steps"]):
        if cuda:
            torch.cuda.synchronize()
        w0, c0 = time.perf_counter(), time.process_time()
        timed = i >= spec["warmup"]
        xi = x if timed else xw
        inputs = {"input_ids": xi}
        if pos:
            inputs["position_ids"] = (
                torch.arange(xi.shape[1], device=device).expand_as(xi).contiguous()
            )
        step(inputs, y, meter if i == spec["warmup"] else None)
        if cuda:
            torch.cuda.synchronize()
        w1, c1 = time.perf_counter(), time.process_time()
        if timed:
            walls.append(w1 - w0)
            cpus.append(c1 - c0)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = peak_rss(resettable) - base
    res.update(
        wall_s=walls,
        cpu_s=cpus,
        peak_mem_bytes=int(peak),
        mem_probe="cuda.max_memory_allocated" if cuda else ("VmHWM" if resettable else "ru_maxrss"),
        activation_bytes=meter.bytes,
        saved_raw_bytes=meter.raw,
        ok=True,
    )
    return res


# ---------------------------------------------------------------------------- driver
def run_one(spec: dict, timeout: float) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        out = f.name
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--_worker",
        json.dumps(spec),
        "--_out",
        out,
    ]
    base = {k: spec[k] for k in ("model", "length", "method", "rep")}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**base, "ok": False, "error": f"timeout after {timeout:.0f}s"}
    try:
        with open(out) as f:
            txt = f.read()
        os.unlink(out)
        if txt:
            return json.loads(txt)
    except (OSError, json.JSONDecodeError):
        pass
    err = (p.stderr or "").strip().splitlines()
    tail = [ln for ln in err if ln.strip()][-1:] or [f"exit code {p.returncode}"]
    if p.returncode < 0 or p.returncode == 137:
        tail = [f"killed (signal {-p.returncode if p.returncode < 0 else 9}; out of memory?)"]
    return {**base, "ok": False, "error": tail[0][:300]}


def summarize(rows: list[dict], models, lengths, methods) -> dict:
    table: dict = {}
    for m in models:
        for L in lengths:
            for meth in methods:
                rs = [r for r in rows if (r["model"], r["length"], r["method"]) == (m, L, meth)]
                good = [r for r in rs if r.get("ok")]
                key = f"{m}|{L}|{meth}"
                if not good:
                    errs = sorted({r.get("error", "?") for r in rs})
                    table[key] = {"ok": False, "error": "; ".join(errs)}
                    continue
                walls = [t for r in good for t in r["wall_s"]]
                cpus = [t for r in good for t in r["cpu_s"]]
                table[key] = {
                    "ok": True,
                    "wall_s": statistics.median(walls),
                    "cpu_s": statistics.median(cpus),
                    "wall_range": [min(walls), max(walls)],
                    "cpu_range": [min(cpus), max(cpus)],
                    "wall_samples": walls,
                    "cpu_samples": cpus,
                    "peak_mem_bytes": int(statistics.median(r["peak_mem_bytes"] for r in good)),
                    "activation_bytes": good[0]["activation_bytes"],
                    "trainable_params": good[0]["trainable_params"],
                }
    return table


def ratios(table: dict, models, lengths) -> dict:
    out: dict = {}

    def get(m, L, meth, k):
        e = table.get(f"{m}|{L}|{meth}")
        return e[k] if e and e.get("ok") else None

    def div(a, b):
        return a / b if a is not None and b else None

    for m in models:
        r: dict = {"dpfit_over_nonpriv_bias": {}, "speedup_vs_nonpriv_full": {}}
        r["dpfit_over_nonpriv_bias_bf16"], r["bf16_speedup"] = {}, {}
        for L in lengths:
            r["dpfit_over_nonpriv_bias_bf16"][L] = {
                k: div(get(m, L, "dpfit-bitfit-bf16", k), get(m, L, "nonpriv-bias-bf16", k))
                for k in ("wall_s", "cpu_s", "activation_bytes", "peak_mem_bytes")
            }
            r["bf16_speedup"][L] = {
                meth: {
                    k: div(get(m, L, meth[: -len(BF16)], k), get(m, L, meth, k))
                    for k in ("wall_s", "cpu_s")
                }
                for meth in BF16_METHODS
            }
            r["dpfit_over_nonpriv_bias"][L] = {
                k: div(get(m, L, "dpfit-bitfit", k), get(m, L, "nonpriv-bias", k))
                for k in ("wall_s", "cpu_s", "activation_bytes")
            }
            r["speedup_vs_nonpriv_full"][L] = {
                k: div(get(m, L, "nonpriv-full", k), get(m, L, "dpfit-bitfit", k))
                for k in ("wall_s", "cpu_s")
            }
        # the longest length where an Opacus DP full row ran (rows may be --skip'ped)
        full_ran = [
            L
            for L in lengths
            for opx in ("opacus-hooks", "opacus-ghost")
            if get(m, L, opx, "cpu_s")
        ]
        L0 = max(full_ran) if full_ran else (256 if 256 in lengths else max(lengths))
        r["ref_length"] = L0
        for opx in ("opacus-hooks", "opacus-ghost", "opacus-bias"):
            r[f"vs_{opx}"] = {
                "speedup_wall": div(
                    get(m, L0, opx, "wall_s"), get(m, L0, "dpfit-bitfit", "wall_s")
                ),
                "speedup_cpu": div(get(m, L0, opx, "cpu_s"), get(m, L0, "dpfit-bitfit", "cpu_s")),
                "peak_mem_ratio": div(
                    get(m, L0, opx, "peak_mem_bytes"), get(m, L0, "dpfit-bitfit", "peak_mem_bytes")
                ),
                "activation_ratio": div(
                    get(m, L0, opx, "activation_bytes"),
                    get(m, L0, "dpfit-bitfit", "activation_bytes"),
                ),
            }
        out[m] = r
    return out


def fmt_mb(b):
    return "—" if b is None else f"{b / 2**20:,.0f}"


def fmt(x, d=2):
    return "—" if x is None else f"{x:.{d}f}"


def _spread(e: dict, kind: str) -> str:
    lo, hi = e.get(f"{kind}_range") or (e[f"{kind}_s"], e[f"{kind}_s"])
    return f"[{lo:.3f}-{hi:.3f}]"


def markdown(table, rat, models, lengths, methods, meta) -> str:
    lines = [
        f"Batch {BATCH}; {meta['steps']} timed step(s) after {meta['warmup']} warm-up, "
        f"x {meta['reps']} repetition(s); device {meta['device']}, "
        f"{meta['threads']} torch thread(s); medians [min-max over the timed steps]. "
        f"Memory: {meta['mem_probe']}."
        + (
            f" Warm-up steps at length {meta['warmup_length']}."
            if isinstance(meta.get("warmup_length"), int)
            else ""
        )
        + (f" Not run: {', '.join(meta['skipped'])}." if meta.get("skipped") else "")
        + (f" {meta['note']}" if meta.get("note") else ""),
        "",
        "| model | len | method | wall s/step | CPU s/step | peak mem MB | activations MB | trainable |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for m in models:
        for L in lengths:
            for meth in methods:
                e = table[f"{m}|{L}|{meth}"]
                if not e["ok"] and e["error"] == NOT_RUN:
                    lines.append(f"| {m} | {L} | {LABELS[meth]} | not run | | | | |")
                    continue
                if not e["ok"]:
                    lines.append(
                        f"| {m} | {L} | {LABELS[meth]} | failed: {e['error'][:120]} | | | | |"
                    )
                    continue
                lines.append(
                    f"| {m} | {L} | {LABELS[meth]} | {e['wall_s']:.3f} {_spread(e, 'wall')} | "
                    f"{e['cpu_s']:.3f} {_spread(e, 'cpu')} | "
                    f"{fmt_mb(e['peak_mem_bytes'])} | {fmt_mb(e['activation_bytes'])} | "
                    f"{e['trainable_params']:,} |"
                )
    lines += ["", "Target ratios (same run; wall / CPU time):", ""]
    for m in models:
        r = rat[m]
        lines.append(f"**{m}**")
        lines.append("")
        lines.append(
            "| len | dpfit / non-private bias-only (target <= 1.05) | activations ratio | "
            "speedup vs non-private full (target >= 1.4) |"
        )
        lines.append("|---:|---|---:|---|")
        for L in lengths:
            a = r["dpfit_over_nonpriv_bias"][L]
            b = r["speedup_vs_nonpriv_full"][L]
            lines.append(
                f"| {L} | {fmt(a['wall_s'], 3)} / {fmt(a['cpu_s'], 3)} | "
                f"{fmt(a['activation_bytes'], 3)} | {fmt(b['wall_s'])}x / {fmt(b['cpu_s'])}x |"
            )
        lines.append("")
        if any(v["wall_s"] is not None for v in r["dpfit_over_nonpriv_bias_bf16"].values()):
            lines.append(
                "| len | bf16: dpfit / non-private bias-only, wall / CPU (target <= 1.02) | "
                "activations ratio | peak-mem ratio (target <= 1.02) |"
            )
            lines.append("|---:|---|---:|---:|")
            for L in lengths:
                a = r["dpfit_over_nonpriv_bias_bf16"][L]
                lines.append(
                    f"| {L} | {fmt(a['wall_s'], 3)} / {fmt(a['cpu_s'], 3)} | "
                    f"{fmt(a['activation_bytes'], 3)} | {fmt(a['peak_mem_bytes'], 3)} |"
                )
            lines.append("")
            lines.append("| len | method | bf16 speed-up over fp32, wall / CPU |")
            lines.append("|---:|---|---|")
            for L in lengths:
                for meth, v in r["bf16_speedup"][L].items():
                    if v["wall_s"] is not None:
                        lines.append(
                            f"| {L} | {LABELS[meth[: -len(BF16)]]} | "
                            f"{fmt(v['wall_s'])}x / {fmt(v['cpu_s'])}x |"
                        )
            lines.append("")
        L0 = r["ref_length"]
        lines.append(
            f"| at len {L0}: dpfit vs | speedup wall / CPU (target >= 3x) | "
            "peak-mem ratio (target >= 2x) | activations ratio |"
        )
        lines.append("|---|---|---:|---:|")
        for opx in ("opacus-hooks", "opacus-ghost", "opacus-bias"):
            v = r[f"vs_{opx}"]
            lines.append(
                f"| {LABELS[opx]} | {fmt(v['speedup_wall'])}x / {fmt(v['speedup_cpu'])}x | "
                f"{fmt(v['peak_mem_ratio'])}x | {fmt(v['activation_ratio'])}x |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(table, models, lengths, methods, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(models), figsize=(6 * len(models), 12), squeeze=False)
    for j, m in enumerate(models):
        for i, (key, ylabel, scale) in enumerate(
            [
                ("wall_s", "wall time per step (s)", 1),
                ("peak_mem_bytes", "peak memory delta (MB)", 2**20),
                ("activation_bytes", "autograd/hook activations (MB)", 2**20),
            ]
        ):
            ax = axes[i][j]
            for meth in methods:
                xs, ys = [], []
                for L in lengths:
                    e = table[f"{m}|{L}|{meth}"]
                    if e["ok"]:
                        xs.append(L)
                        ys.append(e[key] / scale)
                if xs:
                    ax.plot(xs, ys, marker="o", label=LABELS[meth])
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [str(L) for L in lengths])
            ax.set_xlabel("sequence length")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{m}, batch {BATCH}")
            ax.grid(alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument(
        "--lengths",
        nargs="+",
        type=int,
        default=None,
        help="sequence lengths (default 64 256 on CPU, 64 128 256 512 on CUDA)",
    )
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS + BF16_METHODS)
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per worker (default 5 CPU / 10 CUDA); the table reports their median "
        "and min-max range",
    )
    ap.add_argument(
        "--warmup", type=int, default=None, help="warm-up steps (default 2 CPU / 3 CUDA)"
    )
    ap.add_argument(
        "--warmup-length",
        type=int,
        default=None,
        help="sequence length of the warm-up steps (default 16 on CPU to save time, "
        "the timed length on CUDA); they allocate optimizer state and hooks",
    )
    ap.add_argument(
        "--reps", type=int, default=1, help="repetitions (fresh workers, rotated order)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per worker (1 keeps CPU time meaningful on a shared machine)",
    )
    ap.add_argument(
        "--skip",
        nargs="+",
        default=[],
        metavar="[LEN:]METHOD",
        help="rows not to run (at every length, or at LEN only), listed as not run in the table",
    )
    ap.add_argument(
        "--note", default="", help="a sentence for the table's header (why rows were skipped)"
    )
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker")
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: roberta-base, length 32, 1+1 steps"
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "speed_memory")
    ap.add_argument(
        "--from-json",
        type=Path,
        help="render the md, ratios and png again from a run's json (no measuring)",
    )
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    skip = set()
    for item in a.skip:
        length, _, meth = item.rpartition(":")
        if meth not in METHODS + BF16_METHODS or (length and not length.isdigit()):
            ap.error(
                f"--skip {item!r}: give METHOD or LEN:METHOD, METHOD one of --methods' choices"
            )
        skip.add((int(length) if length else None, meth))

    if a._worker:
        spec = json.loads(a._worker)
        res = worker(spec)
        with open(a._out, "w") as f:
            json.dump(res, f)
        return 0

    if a.from_json:
        run = json.loads(a.from_json.read_text())
        meta, table = run["meta"], run["table"]
        models, lengths, methods = meta["models"], meta["lengths"], meta["methods"]
        rat = ratios(table, models, lengths)
        md = markdown(table, rat, models, lengths, methods, meta)
        write_outputs(a.out, meta, table, rat, run["runs"], md, models, lengths, methods)
        return 0

    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    if a.quick:
        a.models, a.lengths = ["roberta-base"], a.lengths or [32]
        a.steps, a.warmup = a.steps or 1, a.warmup if a.warmup is not None else 1
    lengths = a.lengths or ([64, 128, 256, 512] if cuda else [64, 256])
    steps = a.steps or (10 if cuda else 5)
    warmup_length = a.warmup_length if a.warmup_length is not None else (0 if cuda else 16)
    warmup = a.warmup if a.warmup is not None else (3 if cuda else 2)
    meta = dict(
        device=device,
        threads=a.threads,
        steps=steps,
        warmup=warmup,
        reps=a.reps,
        warmup_length=warmup_length or "same as timed",
        batch=BATCH,
        lengths=lengths,
        models=a.models,
        methods=a.methods,
        torch=torch.__version__,
        python=platform.python_version(),
        cpu_count=os.cpu_count(),
        command=" ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        skipped=sorted(a.skip),
        note=a.note,
        started=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    try:
        import opacus
        import transformers

        meta.update(opacus=opacus.__version__, transformers=transformers.__version__)
    except ImportError:
        pass

    rows: list[dict] = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for m in a.models:
            path = os.path.join(tmp, f"{m}.pt")
            torch.save(build_model(m), path)
            for L in lengths:
                for rep in range(a.reps):
                    order = a.methods[rep % len(a.methods) :] + a.methods[: rep % len(a.methods)]
                    for meth in order:
                        if (L, meth) in skip or (None, meth) in skip:
                            rows.append(
                                {"model": m, "length": L, "method": meth, "rep": rep,
                                 "ok": False, "error": NOT_RUN}
                            )  # fmt: skip
                            continue
                        spec = dict(
                            model=m,
                            model_path=path,
                            length=L,
                            method=meth,
                            rep=rep,
                            steps=steps,
                            warmup=warmup,
                            threads=a.threads,
                            device=device,
                            warmup_length=warmup_length,
                        )
                        r = run_one(spec, a.timeout)
                        rows.append(r)
                        el = time.perf_counter() - t_start
                        if r.get("ok"):
                            print(
                                f"[{el:6.0f}s] {m:12s} L={L:<4d} {meth:13s} rep {rep}: "
                                f"wall {statistics.median(r['wall_s']):7.3f}s "
                                f"cpu {statistics.median(r['cpu_s']):7.3f}s "
                                f"peak {r['peak_mem_bytes'] / 2**20:8.0f} MB "
                                f"act {r['activation_bytes'] / 2**20:7.1f} MB",
                                flush=True,
                            )
                        else:
                            print(
                                f"[{el:6.0f}s] {m:12s} L={L:<4d} {meth:13s} rep {rep}: "
                                f"FAILED {r['error']}",
                                flush=True,
                            )
    meta["elapsed_s"] = time.perf_counter() - t_start
    meta["mem_probe"] = next((r["mem_probe"] for r in rows if r.get("ok")), "n/a")
    table = summarize(rows, a.models, lengths, a.methods)
    rat = ratios(table, a.models, lengths)
    md = markdown(table, rat, a.models, lengths, a.methods, meta)
    print()
    print(md)
    write_outputs(a.out, meta, table, rat, rows, md, a.models, lengths, a.methods)
    return 0


def write_outputs(out: Path, meta, table, rat, rows, md, models, lengths, methods) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".json"), "w") as f:
        json.dump({"meta": meta, "table": table, "ratios": rat, "runs": rows}, f, indent=1)
    with open(out.with_suffix(".md"), "w") as f:
        f.write(f"# Speed and memory (`{meta['command']}`)\n\n{md}\n")
    plot(table, models, lengths, methods, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.json')}, .md, .png in {meta['elapsed_s']:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
