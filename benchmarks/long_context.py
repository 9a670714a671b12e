"""Long-context memory and time: where DP full fine-tuning stops fitting and DP-BiTFiT trains.

Question: on SmolLM2-135M (the bundled model's LLaMA configuration, 30 layers, no biases,
causal LM), how do peak memory and seconds per example of DP-BiTFiT grow with the sequence
length T, against non-private bias-only training and DP full fine-tuning (dpfit's, Opacus's)?

    PYTHONPATH=src nice -n 5 python benchmarks/long_context.py            # the committed run
    PYTHONPATH=src python benchmarks/long_context.py --lengths 256 512     # per-token costs first

Arms (every one trains with AdamW, lr 1e-5, SDPA attention, float32, random weights and token
ids, no padding, loss = mean over examples of each example's mean next-token NLL):

* nonpriv-bias: the biases dpfit adds (DP-BiTFiT-Add: zero biases on every linear layer and
  RMSNorm) trained with plain autograd;
* dp-bitfit: the same biases through dpfit.PrivacyEngine (mode "bias", sigma 1, noise and
  sampling from os.urandom);
* dp-bitfit-ckpt: dp-bitfit with activation checkpointing (dpfit.activation_checkpointing,
  transformers' own, non-reentrant): each decoder layer keeps its input only and is
  recomputed in the backward pass; the loss still computes the whole [batch, T, vocabulary]
  logits at once;
* dp-bitfit-chunked: dp-bitfit-ckpt with the loss's output head and cross entropy computed in
  checkpointed chunks of positions (dpfit.chunked_head), so that one chunk's logits exist at a
  time; what `dpfit train --task causal-lm --activation-checkpointing` turns on;
* nonpriv-full, dpfit-full (PrivacyEngine mode "full"), opacus-hooks (Opacus GradSampleModule,
  per-example weight gradients; LlamaRMSNorm has no Opacus grad sampler and runs through its
  functorch fallback), opacus-ghost (Opacus ghost clipping): every weight of the original model
  (no added biases). SmolLM2 ties its input embedding to its LM head and Opacus ghost clipping
  rejects tied parameters, so opacus-ghost is recorded as unsupported; `--arms ...
  opacus-ghost-untied` runs it on a copy whose LM head has its own copy of the embedding
  (28M more parameters; not in the default run, for the CPU budget).

dpfit's engines run with check_gradients=False: `dpfit train` leaves it on, and then the first
step also runs the batch-axis probe (one more forward and backward of the batch and of one
example) and every step compares the per-example rows' sum with autograd's gradient. At 8k
tokens the probe alone would cost more CPU than this benchmark can spend; it is a one-time
self-test, not part of the mechanism whose memory and time are measured here.

Memory safety: each arm's process sets its oom_score_adj to 1000 before it loads the model, so
that if the machine runs out the kernel kills that arm, never another job; an arm that may take
over 12 GiB (its predicted peak, or its cap where there is no prediction) starts only once the
machine has that much + 0.5 GiB available (waiting at most --wait-for-memory-s, else "skipped").
An arm killed by the kernel's OOM killer (a SIGKILL this script did not send, while the kernel's
oom_kill count in /proc/vmstat went up) is recorded as "killed-by-oom-killer", with its RSS and
the memory the other processes held at the last sample before: the machine ran out before the
arm reached its cap, so that is never a measured "does not fit", which only an allocation
failure under the cap is.

Each (T, batch, arm) runs in its own subprocess (one thread by default: on a loaded 2-core
machine two OpenMP threads spent 5-8x the CPU time of one on the same step), batch 1 at every
length first, the arms in a rotating order within each T. The child caps its address space with RLIMIT_AS at
--memory-cap-gib, so an arm that does not fit raises an allocation error that the child catches
and records ("does not fit"), instead of waking the OOM killer; an arm that does not fit at T
is not run at larger T for that batch. The cap bounds address space, which is larger than the
resident memory (libraries, allocator reserves): the base address space is in the JSON.
Memory: the child's peak RSS (ru_maxrss from os.wait4 on that child, so a crash still reports
it) and its RSS once the model is loaded (baseline). Time: median wall and CPU
seconds of the timed steps (forward, backward, clipping and noise where private, optimizer
step) after the warm-up steps; the counts per T are in the table. The optimizer's state is
created before the first step (one AdamW step on zero gradients), so that a lone step's peak
includes it as every later step's does; a step with no warm-up before it still includes other
one-time work in its time (allocator growth, the engine's first-step set-up). An arm is skipped (and said so)
when the CPU seconds of its last two lengths predict a step over --max-step-s (batches > 1)
or warm-up + timed steps over --arm-budget-s, or when its peak RSS, extrapolated linearly in T
from its last two lengths, plus its address space beyond its resident set, exceeds the cap
(recorded as "predicted not to fit", with the predicted peak; never counted as a measured
"does not fit"; --run-predicted-oom runs such arms anyway).

--merge RESULT.json keeps an earlier result's rows beside this run's (a new arm measured beside
the arms it is compared with, without re-running the rest): a row of this run replaces the same
(arm, T, batch) row, every row records its run (command, cap), and time ratios are only taken
between rows of one run.

Writes <out>.json, <out>.md, <out>.png (memory vs T, log-log) and the docs page.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs" / "long_context.md"
GIB = 1024**3

ARMS = {
    "nonpriv-bias": "non-private bias-only",
    "dp-bitfit": "DP-BiTFiT",
    "dp-bitfit-ckpt": "DP-BiTFiT + activation checkpointing",
    "dp-bitfit-chunked": "DP-BiTFiT + activation checkpointing + chunked loss",
    "nonpriv-full": "non-private full",
    "dpfit-full": "dpfit DP full",
    "opacus-hooks": "Opacus DP full (hooks)",
    "opacus-ghost": "Opacus DP full (ghost)",
    "opacus-ghost-untied": "Opacus DP full (ghost, untied head)",
}
BIAS_ARMS = ("nonpriv-bias", "dp-bitfit", "dp-bitfit-ckpt", "dp-bitfit-chunked")
BITFIT_ARMS = ("dp-bitfit", "dp-bitfit-ckpt", "dp-bitfit-chunked")
# each DP-BiTFiT arm's suffix in the targets' keys
BITFIT_KEYS = {"dp-bitfit": "", "dp-bitfit-ckpt": "_ckpt", "dp-bitfit-chunked": "_chunked"}
DP_FULL_ARMS = ("dpfit-full", "opacus-hooks", "opacus-ghost", "opacus-ghost-untied")
# warm-up + timed steps from each length on: a shared 2-core machine affords one step at long T
DEFAULT_SCHEDULE = "256:1+2,1024:0+1"
DEFAULT_ARMS = [a for a in ARMS if a != "opacus-ghost-untied"]
BIG_ARM = 12 * GIB  # an arm that may take more than this waits for the memory to be free
MEMORY_MARGIN = GIB // 2  # kept free beside such an arm (the driver, the kernel's own needs)
OOM_MARKERS = ("can't allocate", "cannot allocate", "out of memory", "bad_alloc", "allocate")


# ----------------------------------------------------------------------------- the child
def _status_bytes(field: str) -> int:
    """A /proc/self/status field (VmRSS, VmSize, VmPeak) in bytes; 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def build_model(name: str, arm: str):
    """SmolLM2-135M (random weights: memory and time do not depend on their values, and
    every weight then sits in the process's own memory, not in a lazily paged file) or a tiny
    LLaMA (tests: narrow, but with a real-size
    vocabulary so that long inputs have big logits), in train mode with SDPA."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    if name == "tiny":
        cfg = T.LlamaConfig(
            vocab_size=32_000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
            tie_word_embeddings=True,
        )  # fmt: skip
        cfg._attn_implementation = "sdpa"
        model = T.LlamaForCausalLM(cfg)
    elif name == "smollm2":  # the bundled model's configuration, random weights
        from dpfit.data.smollm import smollm2_folder

        cfg = T.AutoConfig.from_pretrained(smollm2_folder())
        cfg._attn_implementation = "sdpa"
        model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    else:
        raise ValueError(f"--model {name!r}: choose smollm2 or tiny")
    if arm == "opacus-ghost-untied":
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    return model.train()


def per_example_loss(model, ids, chunked: bool = False):
    """Each example's mean next-token NLL, [B] (dpfit.causal_lm's loss, no padding; with
    `chunked`, dpfit.chunked_head's, which never holds the whole logits)."""
    from dpfit.causal_lm import per_example_token_nll

    if chunked:
        from dpfit.chunked_head import chunked_token_nll

        total, count = chunked_token_nll(model, {"input_ids": ids, "labels": ids})
        return total / count
    logits = model(input_ids=ids, use_cache=False).logits
    total, count = per_example_token_nll(logits, ids)
    return total / count


def prime(opt) -> None:
    """Create the optimizer's state now (one step on zero gradients), so that a single measured
    step already holds it through its forward and backward, as every later step does."""
    import torch

    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def setup_arm(arm: str, model, batch: int):
    """A function that runs one training step of `arm` on a [batch, T] tensor of ids."""
    import torch

    import dpfit

    if arm in BIAS_ARMS:
        dpfit.add_biases(model)
        dpfit.make_bias_trainable(model)
        if arm in ("dp-bitfit-ckpt", "dp-bitfit-chunked"):
            from dpfit.activation_checkpointing import enable_activation_checkpointing

            enable_activation_checkpointing(model, "bias")
    else:
        for p in model.parameters():
            p.requires_grad_(True)

    if arm.startswith("nonpriv"):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        prime(opt)

        def step(ids):
            per_example_loss(model, ids).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    if arm in (*BITFIT_ARMS, "dpfit-full"):
        engine = dpfit.PrivacyEngine(
            model,
            expected_batch_size=batch,
            sample_size=10_000,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            sampling="user-poisson",
            mode="full" if arm == "dpfit-full" else "bias",
            check_gradients=False,  # see the module docstring
        )
        opt = torch.optim.AdamW(engine.parameters(), lr=1e-5)
        prime(opt)

        chunked = arm == "dp-bitfit-chunked"

        def step(ids):
            per_example_loss(model, ids, chunked).mean().backward()
            engine.step(opt, batch_size=ids.shape[0])

        return step

    import warnings

    from opacus import PrivacyEngine as OpacusEngine
    from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

    warnings.filterwarnings("ignore")
    ghost = arm.startswith("opacus-ghost")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    prime(opt)
    ds = torch.utils.data.TensorDataset(torch.zeros(10_000, 1, dtype=torch.long))
    kw = dict(
        module=model,
        optimizer=opt,
        data_loader=torch.utils.data.DataLoader(ds, batch_size=batch),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        grad_sample_mode="ghost" if ghost else "hooks",
    )
    pe = OpacusEngine(accountant="rdp")
    if ghost:
        gmodel, gopt, _, _ = pe.make_private(criterion=torch.nn.CrossEntropyLoss(), **kw)
    else:
        gmodel, gopt, _ = pe.make_private(**kw)

    def step(ids):
        losses = per_example_loss(gmodel, ids)
        if ghost:  # Opacus's two backward passes (norms, then the clipped sum)
            DPTensorFastGradientClipping(gmodel, gopt, losses, "mean").backward()
        else:
            losses.mean().backward()
        gopt.step()
        gopt.zero_grad(set_to_none=True)

    return step


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or any(m in str(e).lower() for m in OOM_MARKERS)


def make_expendable() -> int:
    """Make this process the kernel's first choice if it must kill one for memory (so that an
    arm is killed, never another job on the machine); returns the score now in force."""
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    with open("/proc/self/oom_score_adj") as f:
        return int(f.read())


def child(spec: dict) -> dict:
    """One arm at one (T, batch): set up, warm up, time; every failure becomes a record."""
    adj = make_expendable()  # before the model takes any memory
    cap = int(spec["cap_gib"] * GIB)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    res: dict = {"status": "ok", "oom_score_adj": adj}
    try:
        import torch

        torch.set_num_threads(spec["threads"])
        if spec.get("mmap_threshold"):  # before any tensor: as dpfit train's checkpointed runs
            from dpfit.memory import return_freed_memory

            res["mmap_threshold"] = (
                spec["mmap_threshold"] if return_freed_memory(spec["mmap_threshold"]) else None
            )
        model = build_model(spec["model"], spec["arm"])
        res["base_rss_bytes"] = _status_bytes("VmRSS")  # the model loaded, nothing else
        step = setup_arm(spec["arm"], model, spec["batch"])
        res["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(spec["length"])
        ids = torch.randint(3, vocab, (spec["batch"], spec["length"]), generator=g)
        import gc

        gc.collect()
        res["setup_rss_bytes"] = _status_bytes("VmRSS")  # and the arm set up
        res["base_vm_bytes"] = _status_bytes("VmSize")
        walls, cpus = [], []
        for i in range(spec["warmup"] + spec["timed"]):
            w0, c0 = time.perf_counter(), time.process_time()
            step(ids)
            w1, c1 = time.perf_counter(), time.process_time()
            if i >= spec["warmup"]:
                walls.append(w1 - w0)
                cpus.append(c1 - c0)
            else:
                res.setdefault("warmup_wall_s", []).append(w1 - w0)
        res.update(wall_s=walls, cpu_s=cpus)
    except Exception as e:  # noqa: BLE001 - every failure is a result here
        if _is_oom(e):
            res.update(status="does-not-fit", reason=f"{type(e).__name__}: {str(e)[:200]}")
        elif isinstance(e, NotImplementedError):
            res.update(status="unsupported", reason=f"{type(e).__name__}: {str(e)[:300]}")
        else:
            res.update(status="error", reason=f"{type(e).__name__}: {str(e)[:300]}")
    res["self_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    res["vm_peak_bytes"] = _status_bytes("VmPeak")
    return res


# ----------------------------------------------------------------------------- the driver
def _meminfo_bytes(field: str) -> int:
    """A /proc/meminfo field (MemTotal, MemAvailable) in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {field}: this benchmark needs Linux")


def _rss_of(pid: int) -> int:
    """VmRSS of a live process in bytes; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def oom_kills() -> int:
    """How many processes the kernel's OOM killer has killed since boot (/proc/vmstat)."""
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return 0


def classify_death(
    returncode: int, timed_out: bool, timeout_s: float, new_oom_kills: int,
    last: dict | None, peak_rss: int, stderr_tail: str,
) -> dict:  # fmt: skip
    """The record of a child that wrote no result. A SIGKILL this script did not send, while the
    kernel's OOM-kill count went up, is the OOM killer: machine memory ran out before the arm
    reached its cap, so it is its own status, never a measured "does not fit"; only an
    allocation failure under the cap is that."""
    if timed_out:
        return {"status": "timeout", "reason": f"over {timeout_s:.0f} s"}
    if returncode == -signal.SIGKILL:
        if new_oom_kills > 0 and last is not None:
            others = max(0, last["used_bytes"] - last["child_rss_bytes"])
            return {
                "status": "killed-by-oom-killer",
                "others_used_bytes": others,
                "reason": f"killed by the kernel's OOM killer at {peak_rss / GIB:.1f} GiB RSS, "
                f"with {others / GIB:.1f} GiB used by other processes",
            }
        return {"status": "error", "reason": "killed by a SIGKILL from outside this script, "
                "not by the OOM killer (the kernel's OOM-kill count did not change)"}  # fmt: skip
    if _is_oom(RuntimeError(stderr_tail)):
        return {"status": "does-not-fit", "reason": f"died: {stderr_tail}"}
    return {"status": "error", "reason": f"died ({returncode}): {stderr_tail}"}


def run_child(spec: dict, timeout_s: float, cmd: list[str] | None = None) -> dict:
    """Run one arm in a fresh interpreter; its peak RSS from os.wait4 (also after a crash).
    While it runs, the machine's used memory and the child's RSS are sampled, so that a kill by
    the OOM killer can say how much the other processes held. `cmd` replaces the child's
    command (tests: a fake child)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "res.json"
        err = Path(tmp) / "stderr"
        if cmd is None:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", json.dumps(spec)]
            cmd += ["--_out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
        kills0 = oom_kills()
        total = _meminfo_bytes("MemTotal")
        last = None
        t0 = time.perf_counter()
        with open(err, "w") as ferr:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=ferr, env=env)
            timed_out = False
            while True:
                pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if time.perf_counter() - t0 > timeout_s:
                    timed_out = True
                    os.kill(proc.pid, signal.SIGKILL)
                    pid, status, ru = os.wait4(proc.pid, 0)
                    break
                rss = _rss_of(proc.pid)
                if rss:
                    used = total - _meminfo_bytes("MemAvailable")
                    last = {"used_bytes": used, "child_rss_bytes": rss}
                time.sleep(0.2)
            proc.returncode = os.waitstatus_to_exitcode(status)
        res = json.loads(out.read_text()) if out.exists() else {}
        if not res:
            tail = [ln for ln in err.read_text().splitlines() if ln.strip()][-1:]
            reason = tail[0][:300] if tail else f"exit code {proc.returncode}"
            res = classify_death(
                proc.returncode, timed_out, timeout_s, oom_kills() - kills0, last,
                ru.ru_maxrss * 1024, reason,
            )  # fmt: skip
    res["peak_rss_bytes"] = ru.ru_maxrss * 1024
    res["child_cpu_s"] = ru.ru_utime + ru.ru_stime
    res["child_wall_s"] = time.perf_counter() - t0
    return res


def parse_schedule(text: str) -> dict[int, tuple[int, int]]:
    """'256:1+3,8192:1+1' -> {256: (1, 3), 8192: (1, 1)}: warm-up + timed steps per length;
    a length not listed takes the entry of the nearest listed length below it."""
    out = {}
    for part in text.split(","):
        length, counts = part.split(":")
        w, t = counts.split("+")
        out[int(length)] = (int(w), int(t))
    return out


def steps_for(schedule: dict[int, tuple[int, int]], length: int) -> tuple[int, int]:
    below = [k for k in schedule if k <= length]
    return schedule[max(below)] if below else schedule[min(schedule)]


def predict_step_s(done: list[tuple[int, float]], length: int) -> float | None:
    """Wall seconds of one step at `length` from the last two measured (T, seconds):
    t = a T + b T^2 through both (b >= 0), else linear in T."""
    if not done:
        return None
    if len(done) == 1:
        (t1, s1) = done[-1]
        return s1 * length / t1
    (t1, s1), (t2, s2) = done[-2:]
    b = (s2 / t2 - s1 / t1) / (t2 - t1)
    if b < 0:
        return s2 * length / t2
    a = s1 / t1 - b * t1
    return a * length + b * length**2


def predict_peak(done: list[tuple[int, float]], length: int) -> float | None:
    """Peak bytes at `length`, linear in T through the last two measured (T, peak): with SDPA's
    fused attention nothing of size T^2 is kept, so memory grows linearly in T."""
    if len(done) < 2:
        return None
    (t1, m1), (t2, m2) = done[-2:]
    return m2 + max(0.0, (m2 - m1) / (t2 - t1)) * (length - t2)


def wait_for_memory(need: float, wait_s: float, poll_s: float = 10.0) -> tuple[bool, int]:
    """Before an arm that may take more than BIG_ARM: wait (at most wait_s) until the machine
    has `need` + MEMORY_MARGIN bytes available, so that the arm reaches its cap (or its peak)
    instead of pushing other jobs' memory out. Returns (whether it may start, bytes available)."""
    t0 = time.perf_counter()
    while True:
        avail = _meminfo_bytes("MemAvailable")
        if need <= BIG_ARM or avail >= need + MEMORY_MARGIN:
            return True, avail
        if time.perf_counter() - t0 >= wait_s:
            return False, avail
        print(f"waiting: {avail / GIB:.1f} GiB available, the next arm may take "
              f"{need / GIB:.1f} (+{MEMORY_MARGIN / GIB:g})", flush=True)  # fmt: skip
        time.sleep(poll_s)


def measure(args) -> dict:
    rows: list[dict] = []
    schedule = parse_schedule(args.schedule)
    failed: dict[tuple[int, str], dict] = {}  # (batch, arm) -> the row that stopped it
    timings: dict[tuple[int, str], list[tuple[int, float]]] = {}
    peaks: dict[tuple[int, str], list[tuple[int, float]]] = {}
    overhead: dict[tuple[int, str], float] = {}  # address space beyond the resident set
    total_cpu = 0.0
    prior = {}  # rows measured by a stopped run of the same configuration (--resume)
    if args.resume:
        for r in json.loads(Path(args.resume).read_text())["rows"]:
            if r.get("ran"):
                prior[(r["arm"], r["length"], r["batch"])] = {**r, "resumed": True}
    # batch-major: all lengths at batch 1 first (what a stopped run should have measured)
    for bi, batch in enumerate(args.batches):
        for li, length in enumerate(args.lengths):
            warmup, timed = steps_for(schedule, length)
            k = (li + bi) % len(args.arms)
            for arm in args.arms[k:] + args.arms[:k]:
                row = {"arm": arm, "length": length, "batch": batch}
                stop = failed.get((batch, arm))
                pred = predict_step_s(timings.get((batch, arm), []), length)
                peak = predict_peak(peaks.get((batch, arm), []), length)
                cap = args.memory_cap_gib * GIB
                if stop is not None:
                    row.update(status=stop["status"], reason=f"as at T={stop['length']}", ran=False)
                elif (
                    peak is not None
                    and not args.run_predicted_oom
                    and peak + overhead[(batch, arm)] > cap
                ):
                    row.update(status="predicted-not-to-fit", ran=False, predicted_peak_bytes=peak,
                               reason=f"peak RSS predicted {peak / GIB:.1f} GiB (linear in T "
                               f"from the last two lengths) + address-space overhead > cap")  # fmt: skip
                elif pred is not None and batch > 1 and pred > args.max_step_s:
                    row.update(status="skipped", ran=False,
                               reason=f"predicted step {pred:.0f} CPU-s > {args.max_step_s:.0f}")  # fmt: skip
                elif pred is not None and (warmup + timed) * pred > args.arm_budget_s:
                    n = (warmup + timed) * pred
                    row.update(status="skipped", ran=False,
                               reason=f"predicted {n:.0f} CPU-s > {args.arm_budget_s:.0f}")  # fmt: skip
                if "status" in row:
                    rows.append(row)
                    print(f"T={length:5d} b={batch} {arm:20s} {row['status']}: {row['reason']}")
                    Path(args.partial).write_text(json.dumps(summary(args, rows, total_cpu)))
                    continue
                spec = {
                    "arm": arm, "length": length, "batch": batch, "warmup": warmup,
                    "timed": timed, "threads": args.threads, "cap_gib": args.memory_cap_gib,
                    "model": args.model, "mmap_threshold": args.malloc_mmap_threshold,
                }  # fmt: skip
                res = prior.get((arm, length, batch))
                if res is None or (res["warmup"], res["timed"]) != (warmup, timed):
                    # what the arm may take: its predicted peak, or its whole cap where unknown
                    need = cap if peak is None else min(cap, peak + overhead[(batch, arm)])
                    enough, avail = wait_for_memory(need, args.wait_for_memory_s)
                    if not enough:
                        row.update(status="skipped", ran=False,
                                   reason=f"waited {args.wait_for_memory_s:.0f} s for "
                                   f"{(need + MEMORY_MARGIN) / GIB:.1f} GiB of available memory; "
                                   f"had {avail / GIB:.1f}")  # fmt: skip
                        rows.append(row)
                        print(f"T={length:5d} b={batch} {arm:20s} skipped: {row['reason']}")
                        continue
                    res = run_child(spec, args.timeout_s)
                    res["mem_available_at_start_bytes"] = avail
                total_cpu += res["child_cpu_s"]
                row.update(res, warmup=warmup, timed=timed, ran=True)
                if row["status"] == "ok":
                    row["median_wall_s"] = statistics.median(row["wall_s"])
                    row["median_cpu_s"] = statistics.median(row["cpu_s"])
                    row["s_per_example"] = row["median_wall_s"] / batch
                    timings.setdefault((batch, arm), []).append((length, row["median_cpu_s"]))
                    peaks.setdefault((batch, arm), []).append((length, row["peak_rss_bytes"]))
                    overhead[(batch, arm)] = max(
                        0, row["base_vm_bytes"] - row.get("setup_rss_bytes", row["base_rss_bytes"])
                    )
                else:
                    failed[(batch, arm)] = row
                rows.append(row)
                print(_progress(row), flush=True)
                # what is done so far, for --from-json if the run has to be stopped
                Path(args.partial).write_text(json.dumps(summary(args, rows, total_cpu)))
    return summary(args, rows, total_cpu)


def summary(args, rows: list[dict], total_cpu: float) -> dict:
    return {
        "question": "peak memory and seconds per example vs sequence length, per arm",
        "command": args.command,
        "model": args.model,
        "attention": "sdpa",
        "dtype": "float32",
        "threads": args.threads,
        "memory_cap_gib": args.memory_cap_gib,
        "cap_note": (
            f"each arm's process is capped at {args.memory_cap_gib:g} GiB of address space "
            "(RLIMIT_AS): the machine has 24 GiB shared with other jobs running at the same time, "
            "so that is what one process can safely take"
        ),
        "lengths": args.lengths,
        "batches": args.batches,
        "arms": args.arms,
        "schedule": args.schedule,
        "max_step_s": args.max_step_s,
        "arm_budget_s": args.arm_budget_s,
        "children_cpu_minutes": total_cpu / 60,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "mem_total_bytes": _meminfo_bytes("MemTotal"),
        },
        "rows": rows,
    }


def _runs(res: dict) -> list[dict]:
    """The runs a result's rows come from: its own, or those listed by an earlier merge."""
    if "runs" in res:
        return res["runs"]
    keys = ("command", "memory_cap_gib", "children_cpu_minutes", "schedule")
    return [{k: res[k] for k in keys}]


def merge(old: dict, new: dict, command: str) -> dict:
    """`old`'s rows with `new`'s: a row of `new` replaces `old`'s for the same (arm, T, batch)
    unless only the old one was measured; every row keeps the run it came from (its command
    and memory cap), so a merged result never mixes runs silently. A measured row that is
    replaced is kept in "superseded_rows" (not rendered)."""
    shift = len(_runs(old))
    runs = _runs(old) + _runs(new)
    rows: dict[tuple, dict] = {}
    superseded = [{**r, "run": r.get("run", 0)} for r in old.get("superseded_rows", [])]
    for part, offset in ((old, 0), (new, shift)):
        for r in part["rows"]:
            r = {**r, "run": r.get("run", 0) + offset}
            key = (r["arm"], r["length"], r["batch"])
            prev = rows.get(key)
            if prev is None or r.get("ran") or not prev.get("ran"):
                rows[key] = r
                if prev is not None and prev.get("ran"):
                    superseded.append(prev)
    for r in rows.values():
        r.setdefault("memory_cap_gib", runs[r["run"]]["memory_cap_gib"])
    merged = {k: v for k, v in old.items() if k not in ("targets", "cap_note", "schedule")}
    merged.update(
        machine={**old.get("machine", {}), **new.get("machine", {})},
        command=command,
        runs=runs,
        rows=list(rows.values()),
        superseded_rows=superseded,
        arms=[a for a in ARMS if a in old["arms"] or a in new["arms"]],
        lengths=sorted({*old["lengths"], *new["lengths"]}),
        batches=sorted({*old["batches"], *new["batches"]}),
        memory_cap_gib=max(run["memory_cap_gib"] for run in runs),
        children_cpu_minutes=sum(run["children_cpu_minutes"] for run in runs),
    )
    return merged


def _progress(row: dict) -> str:
    head = f"T={row['length']:5d} b={row['batch']} {row['arm']:20s}"
    peak = row["peak_rss_bytes"] / GIB
    if row["status"] != "ok":
        return f"{head} {row['status']} (peak {peak:.2f} GiB): {row.get('reason', '')}"
    return (
        f"{head} peak {peak:.2f} GiB (base {row['base_rss_bytes'] / GIB:.2f}), "
        f"{row['median_wall_s']:.2f} s/step wall, {row['median_cpu_s']:.2f} s CPU"
    )


# ----------------------------------------------------------------------------- reporting
def _find(res: dict, arm: str, length: int, batch: int) -> dict | None:
    for r in res["rows"]:
        if (r["arm"], r["length"], r["batch"]) == (arm, length, batch):
            return r
    return None


def _ok(r: dict | None) -> bool:
    return r is not None and r["status"] == "ok"


def _ratio(res, num: str, den: str, length: int, batch: int, key: str) -> float | None:
    """num / den of `key`; a time ratio only between rows of one run (alternated side by side),
    a memory ratio also across the runs of a merged result."""
    a, b = _find(res, num, length, batch), _find(res, den, length, batch)
    if not (_ok(a) and _ok(b)):
        return None
    if key != "peak_rss_bytes" and a.get("run", 0) != b.get("run", 0):
        return None
    return a[key] / b[key]


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _cell_mem(r: dict | None, cap: float) -> str:
    if r is None:
        return "-"
    if r["status"] == "ok":
        return f"{r['peak_rss_bytes'] / GIB:.2f} ({r['base_rss_bytes'] / GIB:.2f})"
    if r["status"] == "predicted-not-to-fit":
        return f"~{r['predicted_peak_bytes'] / GIB:.1f} predicted, not run"
    if r["status"] == "does-not-fit":
        reached = f" (reached {r['peak_rss_bytes'] / GIB:.2f})" if r.get("ran") else ""
        return f"does not fit in {r.get('memory_cap_gib', cap):g} GiB{reached}"
    if r["status"] == "killed-by-oom-killer" and r.get("ran"):
        return (
            f"killed by the OOM killer at {r['peak_rss_bytes'] / GIB:.2f} (others held "
            f"{r['others_used_bytes'] / GIB:.1f}; not a measurement)"
        )
    return r["status"]


def _cell_time(r: dict | None) -> str:
    if r is None:
        return "-"
    if r["status"] == "ok":
        return f"{r['s_per_example']:.2f}"
    return "does not fit" if r["status"] == "does-not-fit" else r["status"]


def targets(res: dict) -> dict:
    """The issue's targets, each computed from the rows (None where nothing measured)."""
    out: dict = {}
    mem, tim = [], []
    for batch in res["batches"]:
        for length in res["lengths"]:
            m = _ratio(res, "dp-bitfit", "nonpriv-bias", length, batch, "peak_rss_bytes")
            t = _ratio(res, "dp-bitfit", "nonpriv-bias", length, batch, "median_cpu_s")
            w = _ratio(res, "dp-bitfit", "nonpriv-bias", length, batch, "median_wall_s")
            if m is not None:
                mem.append({"batch": batch, "length": length, "ratio": m})
            if t is not None and _find(res, "dp-bitfit", length, batch)["warmup"] > 0:
                tim.append({"batch": batch, "length": length, "ratio": t, "wall_ratio": w})
    worst_m = max(mem, key=lambda x: x["ratio"], default=None)
    worst_t = max(tim, key=lambda x: x["ratio"], default=None)
    out["bitfit_memory_vs_nonpriv_bias"] = {
        "target": "<= 1.05 at every T",
        "worst": worst_m,
        "met": None if worst_m is None else worst_m["ratio"] <= 1.05,
    }
    out["bitfit_time_vs_nonpriv_bias"] = {
        "target": "<= 1.05 at every T (CPU seconds, one thread, where the timed steps follow "
        "a warm-up)",
        "worst": worst_t,
        "met": None if worst_t is None else worst_t["ratio"] <= 1.05,
    }
    for bitfit, key in BITFIT_KEYS.items():
        if bitfit not in res["arms"]:
            continue
        longest = _longest_common(res, bitfit)
        out[f"dp_full_vs_bitfit{key}_memory_at_longest_common_T"] = {
            "target": ">= 3",
            "per_arm": longest,
            "met": None if not longest else all(x["ratio"] >= 3 for x in longest),
        }
    met, missed = [], []
    for batch in res["batches"]:
        for bitfit in [a for a in res["arms"] if a in BITFIT_ARMS]:
            found = _fits_where_no_dp_full_does(res, bitfit, batch)
            if found is not None:
                (met if found["met"] else missed).append(found)
    out["bitfit_fits_where_no_dp_full_does"] = {
        "target": "a T where DP-BiTFiT (with or without activation checkpointing) fits and "
        "every DP full arm does not fit under a cap at least as large, or cannot run the model",
        "first": met,
        "missed": missed,
        "met": bool(met),
    }
    return out


def _dp_full_state(r: dict | None, cap: float, res: dict) -> tuple[bool, str]:
    """(counts as "does not fit", what it is) for a DP full arm's row beside a DP-BiTFiT row
    that fitted under `cap`: only an allocation failure under a cap no smaller than `cap`, or
    no support for the model, counts; a kill by the OOM killer or a prediction does not."""
    if r is None:
        return False, "not measured"
    rcap = r.get("memory_cap_gib", res["memory_cap_gib"])
    if r["status"] == "unsupported":
        return True, "unsupported"
    if r["status"] == "does-not-fit":
        reached = f", reached {r['peak_rss_bytes'] / GIB:.1f}" if r.get("ran") else ""
        return rcap >= cap, f"does not fit in {rcap:g} GiB{reached}"
    if r["status"] == "ok":
        return False, f"fits ({r['peak_rss_bytes'] / GIB:.2f} GiB)"
    if r["status"] == "predicted-not-to-fit":
        return False, f"not run (predicted ~{r['predicted_peak_bytes'] / GIB:.1f} GiB)"
    return False, r["status"] if r.get("ran") else f"not run ({r['status']})"


def _fits_where_no_dp_full_does(res: dict, bitfit: str, batch: int) -> dict | None:
    """The first T at `batch` where `bitfit` fits and every DP full arm does not (met), else
    the longest T where `bitfit` fits, with what each DP full arm did there (missed)."""
    dp_full = [a for a in res["arms"] if a in DP_FULL_ARMS]
    last = None
    for length in res["lengths"]:
        fit = _find(res, bitfit, length, batch)
        if not _ok(fit) or not dp_full:
            continue
        cap = fit.get("memory_cap_gib", res["memory_cap_gib"])
        states = [_dp_full_state(_find(res, a, length, batch), cap, res) for a in dp_full]
        last = {
            "batch": batch, "arm": bitfit, "length": length, "cap": cap,
            "peak_gib": fit["peak_rss_bytes"] / GIB,
            "dp_full": {a: what for a, (_, what) in zip(dp_full, states, strict=True)},
            "met": all(counts for counts, _ in states),
        }  # fmt: skip
        if last["met"]:
            return last
    return last


def _steps(r: dict) -> tuple[int, int]:
    return r["warmup"], r["timed"]


def _longest_common(res: dict, bitfit: str) -> list[dict]:
    """Each DP full arm's peak memory / `bitfit`'s at the longest T both fit, per batch; and,
    where the DP full arm then ran out of its cap at a longer T where `bitfit` fits, the lower
    bound that the RSS it reached gives there (not counted toward the target)."""
    longest = []
    for batch in res["batches"]:
        for arm in [a for a in res["arms"] if a in DP_FULL_ARMS]:
            both = [
                L
                for L in res["lengths"]
                if _ok(_find(res, arm, L, batch)) and _ok(_find(res, bitfit, L, batch))
            ]
            if both:
                L = max(both)
                r = _ratio(res, arm, bitfit, L, batch, "peak_rss_bytes")
                d, b = _find(res, arm, L, batch), _find(res, bitfit, L, batch)
                x = {"batch": batch, "arm": arm, "length": L, "ratio": r,
                     "peak_gib": d["peak_rss_bytes"] / GIB,
                     "bitfit_peak_gib": b["peak_rss_bytes"] / GIB}  # fmt: skip
                if _steps(d) != _steps(b):  # a peak after more steps can be higher: say so
                    x["rows_differ"] = (
                        f"{ARMS[bitfit]}: run {b.get('run', 0) + 1}, {b['warmup']}+{b['timed']} "
                        f"steps; {ARMS[arm]}: run {d.get('run', 0) + 1}, "
                        f"{d['warmup']}+{d['timed']} steps"
                    )
                for L2 in [t for t in res["lengths"] if t > L]:
                    d, b = _find(res, arm, L2, batch), _find(res, bitfit, L2, batch)
                    if _ok(b) and d is not None and d["status"] == "does-not-fit" and d.get("ran"):
                        x["beyond"] = {"length": L2, "ratio_at_least": d["peak_rss_bytes"]
                                       / b["peak_rss_bytes"],
                                       "cap": d.get("memory_cap_gib", res["memory_cap_gib"])}  # fmt: skip
                        break
                longest.append(x)
    return longest


def _target_lines(res: dict) -> list[str]:
    t = res["targets"]
    lines = []
    m = t["bitfit_memory_vs_nonpriv_bias"]
    if m["worst"]:
        w = m["worst"]
        lines.append(
            f"- DP-BiTFiT / non-private bias-only peak memory: at most {w['ratio']:.3f}x "
            f"(T={w['length']}, batch {w['batch']}); target <= 1.05x: "
            f"{'met' if m['met'] else 'NOT met'}."
        )
    m = t["bitfit_time_vs_nonpriv_bias"]
    if m["worst"]:
        w = m["worst"]
        lines.append(
            f"- DP-BiTFiT / non-private bias-only time per example (CPU seconds of the one "
            f"thread; where the timed steps follow a warm-up step): at most {w['ratio']:.3f}x "
            f"(T={w['length']}, batch {w['batch']}; wall time {w['wall_ratio']:.3f}x); "
            f"target <= 1.05x: "
            f"{'met' if m['met'] else 'NOT met'}."
        )
    for bitfit, key in BITFIT_KEYS.items():
        ratios = t.get(f"dp_full_vs_bitfit{key}_memory_at_longest_common_T", {})
        for x in ratios.get("per_arm", []):
            verdict = "met" if x["ratio"] >= 3 else "NOT met"
            if x["ratio"] < 3 and "peak_gib" in x:
                verdict += (
                    f", short by {3 - x['ratio']:.2f}x ({ARMS[x['arm']]} would need "
                    f"{3 * x['bitfit_peak_gib']:.1f} GiB; measured {x['peak_gib']:.2f})"
                )
            beyond = x.get("beyond")
            if beyond:
                verdict += (
                    f"; at T={beyond['length']} it does not fit in {beyond['cap']:g} GiB, which "
                    f"bounds its ratio there below by {beyond['ratio_at_least']:.2f}x (the RSS it "
                    "reached before failing; a bound, not counted toward the target)"
                )
            differ = f"; {x['rows_differ']}" if x.get("rows_differ") else ""
            lines.append(
                f"- {ARMS[x['arm']]} / {ARMS[bitfit]} peak memory at the longest T both fit "
                f"(T={x['length']}, batch {x['batch']}{differ}): {x['ratio']:.2f}x; "
                f"target >= 3x: {verdict}."
            )
    m = t["bitfit_fits_where_no_dp_full_does"]
    for x in [*m["first"], *m.get("missed", [])]:
        arms = "; ".join(f"{ARMS[a]}: {what}" for a, what in x["dp_full"].items())
        if x["met"]:
            lines.append(
                f"- Batch {x['batch']}: from T={x['length']} {ARMS[x['arm']]} fits "
                f"({x['peak_gib']:.2f} GiB peak RSS, under a {x['cap']:g} GiB cap) and no DP full "
                f"arm does ({arms}): met{_below_machine(x, res)}."
            )
        else:
            lines.append(
                f"- Batch {x['batch']}: at T={x['length']}, the longest T where {ARMS[x['arm']]} "
                f"fits ({x['peak_gib']:.2f} GiB peak RSS), DP full: {arms}: NOT met at this batch."
            )
    if not m["met"]:
        lines.append(
            "- No measured T where DP-BiTFiT (with or without activation checkpointing) fits "
            "and every DP full arm does not (target NOT met)."
        )
    for batch in res["batches"]:
        shown = [L for L in res["lengths"] if any(
            r["batch"] == batch and r["length"] == L
            and r["status"] in ("ok", "predicted-not-to-fit") for r in res["rows"])]  # fmt: skip
        if not shown:
            continue
        longest = max(shown)
        seen = []
        for arm in res["arms"]:
            r = _find(res, arm, longest, batch)
            if r is None:
                continue
            if r["status"] == "ok":
                seen.append(f"{ARMS[arm]} {r['peak_rss_bytes'] / GIB:.1f} (measured)")
            elif r["status"] == "predicted-not-to-fit":
                seen.append(f"{ARMS[arm]} ~{r['predicted_peak_bytes'] / GIB:.1f} (predicted)")
            elif r["status"] == "does-not-fit":
                rcap = r.get("memory_cap_gib", res["memory_cap_gib"])
                seen.append(
                    f"{ARMS[arm]} over {r['peak_rss_bytes'] / GIB:.1f} (does not fit in {rcap:g} "
                    "GiB)"
                    if r.get("ran")
                    else f"{ARMS[arm]} does not fit in {rcap:g} GiB ({r['reason']})"
                )
        if seen:
            lines.append(
                f"- Against the machine's 24 GiB, peak RSS at T={longest}, batch {batch}, GiB: "
                + "; ".join(seen)
                + "."
            )
    return lines


def _below_machine(met: dict, res: dict) -> str:
    """Where DP full ran out of a cap smaller than the machine: what that does not show."""
    failed = [
        r
        for a in met["dp_full"]
        if (r := _find(res, a, met["length"], met["batch"])) and r["status"] == "does-not-fit"
    ]
    caps = [r.get("memory_cap_gib", res["memory_cap_gib"]) for r in failed]
    if not caps or min(caps) >= 24:
        return ""
    cap = min(caps)
    total = res.get("machine", {}).get("mem_total_bytes")
    avail = [
        r["mem_available_at_start_bytes"] for r in failed if "mem_available_at_start_bytes" in r
    ]
    if total and total / GIB < 24 and avail and min(avail) / GIB >= cap:
        # the arms started with at least their cap free: the machine's size set the cap
        why = (
            f"the machine has {total / GIB:.1f} GiB in all and no swap (available at those "
            f"arms' starts: {min(avail) / GIB:.1f}-{max(avail) / GIB:.1f} GiB), so {cap:g} GiB "
            "was about the most one process could be given and a 24 GiB cap cannot end in a "
            "measured allocation failure on it"
        )
    else:
        why = f"{cap:g} GiB was the most one arm could take beside the other jobs running"
    return (
        f" for a {cap:g} GiB cap, not for the machine's 24 GiB: {why}, so whether DP full fits "
        "in 24 GiB here is not measured"
    )


def _resumed_note(rows: list[dict]) -> str:
    n = sum(bool(r.get("resumed")) for r in rows)
    if not n:
        return ""
    return (
        f" ({n} rows measured by an earlier, stopped run of the same configuration and "
        "reused through --resume)"
    )


def _runs_lines(res: dict) -> list[str]:
    """Where each row of a merged result comes from: its run's command, cap and CPU time."""
    lines = []
    for i, run in enumerate(res["runs"]):
        rows = [r for r in res["rows"] if r.get("run", 0) == i and r.get("ran")]
        what = []
        for batch in res["batches"]:
            mine = [r for r in rows if r["batch"] == batch]
            if mine:
                arms = ", ".join(ARMS[a] for a in res["arms"] if any(r["arm"] == a for r in mine))
                ts = ", ".join(str(t) for t in sorted({r["length"] for r in mine}))
                what.append(f"batch {batch}, T = {ts}: {arms}")
        gone = sum(r.get("run", 0) == i for r in res.get("superseded_rows", []))
        lines.append(
            f"- run {i + 1}: `{run['command']}`; each arm's process capped at "
            f"{run['memory_cap_gib']:g} GiB of address space; {run['children_cpu_minutes']:.1f} "
            f"CPU-minutes{_resumed_note(rows)}{_memory_note(rows)}. Rows: "
            + "; ".join(what) + "."
            + (f" ({gone} more measured, then measured again by a later run: kept in the "
               "JSON's superseded_rows.)" if gone else "")
        )  # fmt: skip
    return lines


def _memory_note(rows: list[dict]) -> str:
    """How much memory the machine had free when a run's arms started (recorded since arms
    that may take over BIG_ARM wait for it), so that a reader can judge the cap."""
    avail = [r["mem_available_at_start_bytes"] for r in rows if "mem_available_at_start_bytes" in r]
    if not avail:
        return ""
    return (
        f"; an arm that might take over {BIG_ARM / GIB:g} GiB (its predicted peak, or its cap "
        f"where none) started only once the machine had that + {MEMORY_MARGIN / GIB:g} GiB "
        f"available (available at its arms' starts: {min(avail) / GIB:.1f}-"
        f"{max(avail) / GIB:.1f} GiB)"
    )


def render(res: dict) -> str:
    cap = res["memory_cap_gib"]
    arms = res["arms"]
    model = (
        f"Model: {res['model']} (causal LM, float32, {res['attention']} attention), random "
        f"token ids, no padding; {res['threads']} torch thread(s) per arm; AdamW in every arm. "
    )
    total = res.get("machine", {}).get("mem_total_bytes")
    if total:
        model += f"The machine has {total / GIB:.1f} GiB of memory in all (MemTotal), no swap. "
    model += _malloc_note(res["rows"])
    if "runs" in res:
        head = [
            model + "Each arm's process is capped (RLIMIT_AS) to what one process can safely "
            "take of the machine's 24 GiB, shared with other jobs running at the same time. "
            f"The rows come from {len(res['runs'])} runs merged with --merge, each row from "
            "one run whose arms alternated within each T; time ratios are only taken between "
            "rows of one run:",
            "",
            *_runs_lines(res),
        ]
    else:
        head = [
            model + f"{res['cap_note'][0].upper()}{res['cap_note'][1:]}. "
            f"All arms' processes together used {res['children_cpu_minutes']:.1f} CPU-minutes"
            + _resumed_note(res["rows"])
            + "."
        ]
    out = [
        "# Long-context memory and time: DP-BiTFiT vs DP full fine-tuning",
        "",
        f"Command: `{res['command']}`",
        "",
        *head,
        "",
        "## Targets",
        "",
        *_target_lines(res),
    ]
    for batch in res["batches"]:
        out += ["", f"## Physical batch {batch}"]
        tables = (
            ("Peak RSS of the arm's process, GiB (in brackets: its RSS with the model loaded)",
             "steps (warm-up+timed)", lambda r: _cell_mem(r, cap)),
            ("Seconds per example (median wall time of the timed steps / batch; with 0 warm-up "
             "steps the one step includes one-time work)", "steps", _cell_time),
        )  # fmt: skip
        for title, steps_header, cell in tables:
            out += [
                "",
                title,
                "",
                f"| T | {steps_header} | " + " | ".join(ARMS[a] for a in arms) + " |",
                "|---" * (len(arms) + 2) + "|",
            ]
            for length in res["lengths"]:
                rows = [_find(res, a, length, batch) for a in arms]
                steps = _steps_cell(res, [r for r in rows if r is not None and r.get("ran")])
                out.append(f"| {length} | {steps} | " + " | ".join(cell(r) for r in rows) + " |")
        full = [a for a in arms if a in DP_FULL_ARMS]
        # (numerator, denominator, what): the ratios of each T's row, left to right
        cols = [("dp-bitfit", "nonpriv-bias", k) for k in ("peak_rss_bytes", "median_cpu_s",
                                                            "median_wall_s")]  # fmt: skip
        heads = ["DP-BiTFiT / non-private bias-only, memory", "same, CPU time", "same, wall time"]
        if "dp-bitfit-ckpt" in arms:
            cols += [("dp-bitfit-ckpt", "dp-bitfit", k) for k in ("peak_rss_bytes", "median_cpu_s")]
            heads += [f"{ARMS['dp-bitfit-ckpt']} / DP-BiTFiT, memory", "same, CPU time"]
        if "dp-bitfit-chunked" in arms:
            cols += [("dp-bitfit-chunked", "dp-bitfit-ckpt", k)
                     for k in ("peak_rss_bytes", "median_cpu_s")]  # fmt: skip
            heads += [f"{ARMS['dp-bitfit-chunked']} / {ARMS['dp-bitfit-ckpt']}, memory",
                      "same, CPU time"]  # fmt: skip
        bitfits = [b for b in BITFIT_ARMS if b in arms]
        cols += [(a, b, "peak_rss_bytes") for b in bitfits for a in full]
        heads += [f"{ARMS[a]} / {ARMS[b]}, memory" for b in bitfits for a in full]
        out += [
            "",
            "Ratios (peak memory; time per step: CPU seconds of the arm's one thread, which other "
            "jobs on the machine disturb less, and wall seconds)",
            "",
            "| T | " + " | ".join(heads) + " |",
            "|---" * (len(heads) + 1) + "|",
        ]
        mixed = False
        for length in res["lengths"]:
            cells = []
            for num, den, key in cols:
                x = _ratio(res, num, den, length, batch, key)
                cell = _fmt(x, ".3f" if den == "nonpriv-bias" else ".2f")
                if x is not None and _steps(_find(res, num, length, batch)) != _steps(
                    _find(res, den, length, batch)
                ):
                    cell, mixed = cell + " \\*", True
                cells.append(cell)
            out.append(f"| {length} | " + " | ".join(cells) + " |")
        if mixed:
            out += [
                "",
                "\\* between rows of different runs with different step counts (warm-up+timed): "
                "a peak after more steps can be higher.",
            ]
    notes = sorted(
        {
            f"{ARMS[r['arm']]}: {r['status']}: {r['reason']}"
            for r in res["rows"]
            if r["status"] not in ("ok",) and r.get("ran") and r.get("reason")
        }
    )
    skipped = [
        f"T={r['length']}, batch {r['batch']}, {ARMS[r['arm']]}: {r['reason']}"
        for r in res["rows"]
        if r["status"] in ("skipped", "predicted-not-to-fit")
    ]
    missing = {}
    for batch in res["batches"]:
        for length in res["lengths"]:
            gone = [ARMS[a] for a in arms if _find(res, a, length, batch) is None]
            if gone:
                which = "" if len(gone) == len(arms) else f" ({', '.join(gone)})"
                missing.setdefault(batch, []).append(f"{length}{which}")
    if missing:
        why = (
            "No run measured these (a run stopped for its CPU and time budget, or one of fewer "
            "arms, lengths or batches: see the runs above):"
            if "runs" in res
            else "The run was stopped (CPU and time budget) before these; rendered with "
            "--from-json from its partial result:"
        )
        out += [
            "",
            "## Not reached",
            "",
            why,
            "",
            *[f"- batch {b}: T = {', '.join(ts)}" for b, ts in missing.items()],
        ]
    if notes:
        out += ["", "## Why arms did not run", "", *[f"- {n}" for n in notes]]
    if skipped:
        out += [
            "",
            "## Not run, to fit the CPU budget (predictions, not measurements)",
            "",
            *[f"- {s}" for s in skipped],
        ]
    return "\n".join(out) + "\n"


def _steps_cell(res: dict, ran: list[dict]) -> str:
    """Warm-up+timed steps of the rows of one T; per run where the merged runs differ."""
    seen = {}
    for r in ran:
        seen.setdefault(f"{r['warmup']}+{r['timed']}", set()).add(r.get("run", 0) + 1)
    if len(seen) <= 1:
        return next(iter(seen), "-")
    return "; ".join(f"{k} (run {', '.join(map(str, sorted(v)))})" for k, v in seen.items())


def _malloc_note(rows: list[dict]) -> str:
    """Which rows ran with glibc's mmap threshold fixed (dpfit.memory.return_freed_memory)."""
    fixed = {r.get("mmap_threshold") for r in rows if r.get("ran")}
    if fixed in (set(), {None}):
        return "glibc's malloc with its default settings in every arm. "
    if None in fixed:
        return (
            "Some rows ran with glibc's mmap threshold fixed (their runs' commands say "
            "--malloc-mmap-threshold), others with glibc's default: compare memory only "
            "between rows of one setting. "
        )
    (size,) = fixed
    return (
        f"Every arm's process gave each block of {size:,} bytes or more its own mapping "
        "(dpfit.memory.return_freed_memory, as `dpfit train --activation-checkpointing` "
        "does), so a freed tensor's pages went back to the system at once and peak RSS "
        "follows the live tensors; with glibc's default the heap keeps freed pages "
        "mapped. "
    )


MALLOC = RESULTS / "long_context_malloc.json"  # rows measured with the threshold fixed
PAIRED = RESULTS / "long_context_paired.md"  # the time target, both arms in one process


def render_docs(res: dict, md: str, png_name: str) -> str:
    return (
        "# Long documents: memory and time against sequence length\n\n"
        "Generated by `benchmarks/long_context.py` from its committed result "
        "(`benchmarks/results/long_context.{md,json,png}`); do not edit by hand.\n\n"
        "What grows with the length T: every arm keeps the activations of its forward pass for "
        "the backward pass (with SDPA's fused attention, linear in T), and the LM head's logits "
        "(T x the vocabulary per example). On top of that, DP-BiTFiT keeps nothing per example but the "
        "bias gradients; DP full keeps every weight's gradient and AdamW state, and per-example "
        "gradients (Opacus hooks: materialised; dpfit: per layer, T x T ghost-norm products or "
        "materialised rows, whichever is smaller). DP-BiTFiT + activation checkpointing "
        "keeps only each decoder layer's input and recomputes the layer in the backward pass: "
        "what still grows with T is then mostly the LM head's logits and the loss's tensors of "
        "their size. DP-BiTFiT + activation checkpointing + chunked loss (what `dpfit train "
        "--task causal-lm --activation-checkpointing` runs) also computes the head and the "
        "cross entropy one chunk of positions at a time, forward and backward "
        "(dpfit.chunked_head), so only one chunk's logits exist at once. The DP full arms "
        "compute the whole logits: their head is trained, and a per-example gradient of a "
        "vocabulary-sized head split over chunks would need each example's full head gradient "
        "or cross-chunk ghost products, which no DP full arm here builds.\n\n"
        f"![peak memory vs T](../benchmarks/results/{png_name})\n\n"
        + md.split("\n", 1)[1].lstrip("\n").replace("## ", "### ")
        + _malloc_section()
        + _paired_section()
    )


def _paired_section() -> str:
    """DP-BiTFiT's time against non-private bias-only training measured with both arms in one
    process, step by step (benchmarks/long_context_paired.py), which answers the time target
    with less of the machine's drift than the rows above, each arm a process of its own."""
    if not PAIRED.is_file():
        return ""
    body = PAIRED.read_text().split("\n", 1)[1].lstrip("\n")
    return (
        "\n\n## Time, both bias-only arms paired step by step in one process\n\n"
        "From `benchmarks/results/long_context_paired.{md,json}` "
        "(`benchmarks/long_context_paired.py`):\n\n" + body
    )


def _malloc_section() -> str:
    """The rows measured with freed memory returned at once, rendered from their own result
    (benchmarks/results/long_context_malloc.json), so that no ratio mixes allocator settings."""
    if not MALLOC.is_file():
        return ""
    res = json.loads(MALLOC.read_text())
    body = render(res).split("\n", 1)[1].lstrip("\n").replace("## ", "#### ")
    return (
        "\n\n## Freed memory returned at once (`dpfit train --activation-checkpointing`)\n\n"
        "Peak RSS above also counts what glibc's heap keeps mapped after tensors are freed, "
        "which can be far more than the live tensors (compare the chunked-loss arm's rows "
        "above with its rows here). `dpfit train --activation-checkpointing` "
        "therefore fixes glibc's mmap threshold at 1 MiB (dpfit.memory.return_freed_memory). "
        "These rows ran every arm, DP full included, with that setting, and their targets "
        "are computed among themselves "
        "(`benchmarks/results/long_context_malloc.{md,json}`):\n\n" + body
    )


def plot(res: dict, path: Path) -> None:
    """Peak RSS vs T, log-log, one panel per batch with measurements; predicted peaks (arms
    not run) as open markers on a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [b for b in res["batches"] if any(
        r["batch"] == b and r["status"] == "ok" for r in res["rows"])]  # fmt: skip
    batches = batches or res["batches"][:1]
    colors = {a: f"C{i}" for i, a in enumerate(res["arms"])}
    fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 4.8), squeeze=False)
    for ax, batch in zip(axes[0], batches, strict=True):
        for arm in res["arms"]:
            rows = [r for r in res["rows"] if r["arm"] == arm and r["batch"] == batch]
            pts = [(r["length"], r["peak_rss_bytes"] / GIB) for r in rows if r["status"] == "ok"]
            pred = [(r["length"], r["predicted_peak_bytes"] / GIB)
                    for r in rows if r["status"] == "predicted-not-to-fit"]  # fmt: skip
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", color=colors[arm], label=ARMS[arm])
            if pts and pred:
                ax.plot(*zip(*([pts[-1]] + pred), strict=True), ls="--", marker="o",
                        mfc="none", color=colors[arm])  # fmt: skip
        for i, c in enumerate(sorted({run["memory_cap_gib"] for run in _runs(res)})):
            ax.axhline(c, color="grey", ls=("--", "-.")[i % 2], lw=1,
                       label=f"cap per arm, {c:g} GiB")  # fmt: skip
        ax.axhline(24, color="black", ls=":", lw=1, label="machine, 24 GiB")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(res["lengths"], [str(t) for t in res["lengths"]])
        ax.set_xlabel("sequence length T (tokens)")
        ax.set_ylabel("peak RSS of the arm's process (GiB)")
        ax.set_title(f"{res['model']}, physical batch {batch} (open: predicted, not run)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(res["command"], fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=list(ARMS))
    ap.add_argument("--schedule", default=DEFAULT_SCHEDULE, help="T:warmup+timed,...")
    ap.add_argument("--memory-cap-gib", type=float, default=12.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-step-s", type=float, default=60.0, help="CPU-s; batches > 1 only")
    ap.add_argument("--arm-budget-s", type=float, default=600.0, help="CPU-s per arm and T")
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument(
        "--wait-for-memory-s",
        type=float,
        default=1800.0,
        help="how long an arm that may take over 12 GiB waits for that much memory to be "
        "available before it is skipped",
    )
    ap.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        help="bytes: every arm's process gives blocks this large their own mapping "
        "(dpfit.memory.return_freed_memory, what dpfit train --activation-checkpointing "
        "does), so its peak RSS counts live tensors rather than the heap's freed pages",
    )
    ap.add_argument("--out", default=str(RESULTS / "long_context"))
    ap.add_argument("--docs", default=str(DOCS), help="'' to write no docs page")
    ap.add_argument("--from-json", help="only render the .md, .png and docs from this JSON")
    ap.add_argument("--resume", help="a stopped run's partial JSON: reuse the rows it measured")
    ap.add_argument(
        "--merge",
        help="a result JSON whose rows to keep beside this run's (or --from-json's): a row of "
        "this run replaces its (arm, T, batch) row; each row records the run it came from",
    )
    ap.add_argument(
        "--run-predicted-oom",
        action="store_true",
        help="run arms whose extrapolated peak exceeds the cap (default: record the prediction)",
    )
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        res = child(json.loads(args._child))
        Path(args._out).write_text(json.dumps(res))
        return 0
    if args.merge and not Path(args.merge).is_file():
        ap.error(f"--merge {args.merge}: no such file (a result JSON of this script)")
    if args.memory_cap_gib <= 0:
        ap.error("--memory-cap-gib must be positive (GiB of address space per arm's process)")
    args.command = shlex.join(
        ["PYTHONPATH=src", "python", "benchmarks/long_context.py"]
        + (sys.argv[1:] if argv is None else argv)
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
    else:
        args.partial = str(out.with_suffix(".partial.json"))
        res = measure(args)
        Path(args.partial).unlink(missing_ok=True)
    if args.merge:
        res = merge(json.loads(Path(args.merge).read_text()), res, args.command)
    res["targets"] = targets(res)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    md = render(res)
    out.with_suffix(".md").write_text(md)
    plot(res, out.with_suffix(".png"))
    if args.docs:
        Path(args.docs).write_text(render_docs(res, md, out.with_suffix(".png").name))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
