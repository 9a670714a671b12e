"""benchmarks/long_context.py on a tiny LLaMA: the result's structure, and an arm that runs out
of its memory cap recorded as "does not fit" (then skipped at larger T) instead of a crash."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import long_context  # noqa: E402

pytest.importorskip("transformers")
GIB = 1024**3


def _run(tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / name
    argv = ["--model", "tiny", "--batches", "1", "--threads", "1", "--schedule", "16:0+1"]
    argv += ["--out", str(out), "--docs", str(tmp_path / f"{name}_doc.md"), *extra]
    assert long_context.main(argv) == 0
    return json.loads(out.with_suffix(".json").read_text())


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, dict]:
    """(folder, result) of the smallest run, DP-BiTFiT and its non-private arm at T=16: read
    by the test of its structure and merged into by the merge test (each arm is a process
    that imports torch, most of a tiny run's time)."""
    folder = tmp_path_factory.mktemp("small")
    return folder, _run(folder, "small", "--lengths", "16", "--arms", "nonpriv-bias", "dp-bitfit")


def test_smallest_run_and_forced_out_of_memory(small, tmp_path):
    folder, res = small
    rows = {(r["arm"], r["length"]): r for r in res["rows"]}
    assert set(rows) == {("nonpriv-bias", 16), ("dp-bitfit", 16)}
    for r in rows.values():
        assert r["status"] == "ok" and r["oom_score_adj"] == 1000, r
        assert r["ran"] and len(r["wall_s"]) == r["timed"] == 1 and r["warmup"] == 0
        assert 0 < r["base_rss_bytes"] <= r["peak_rss_bytes"] < res["memory_cap_gib"] * GIB
        assert r["s_per_example"] > 0
    # the same added biases in both arms, nothing else trains
    assert rows["nonpriv-bias", 16]["trainable_params"] == rows["dp-bitfit", 16]["trainable_params"]
    t = res["targets"]["bitfit_memory_vs_nonpriv_bias"]
    assert t["worst"]["ratio"] == pytest.approx(
        rows["dp-bitfit", 16]["peak_rss_bytes"] / rows["nonpriv-bias", 16]["peak_rss_bytes"]
    )
    md = (folder / "small.md").read_text()
    assert res["command"] in md and "| 16 | 0+1 |" in md
    assert (folder / "small.png").stat().st_size > 0
    assert "do not edit by hand" in (folder / "small_doc.md").read_text()

    # a cap just above what the set-up takes: T=16 fits, T=2048's logits (2048 x 32000 floats,
    # several copies in the loss) do not; T=4096 is then not run
    cap = rows["dp-bitfit", 16]["base_vm_bytes"] / GIB + 0.4
    res = _run(tmp_path, "capped", "--lengths", "16", "2048", "4096", "--arms", "dp-bitfit",
               "--memory-cap-gib", f"{cap:.3f}")  # fmt: skip
    status = {r["length"]: r for r in res["rows"]}
    assert status[16]["status"] == "ok"
    assert status[2048]["status"] == "does-not-fit" and status[2048]["ran"]
    assert "allocate" in status[2048]["reason"].lower() or "memory" in status[2048]["reason"]
    assert status[4096]["status"] == "does-not-fit" and not status[4096]["ran"]
    assert f"does not fit in {float(f'{cap:.3f}'):g} GiB" in (tmp_path / "capped.md").read_text()
    assert res["targets"]["bitfit_fits_where_no_dp_full_does"]["met"] is False


def test_predictions_extrapolate_from_the_last_two_lengths():
    # memory: linear in T through the last two points, never decreasing
    assert long_context.predict_peak([(256, 1.0), (512, 2.0)], 1024) == pytest.approx(4.0)
    assert long_context.predict_peak([(256, 2.0), (512, 1.0)], 1024) == pytest.approx(1.0)
    assert long_context.predict_peak([(256, 1.0)], 1024) is None
    # time: a T + b T^2 through both points (here t = T + T^2 / 1000)
    pts = [(t, t + t * t / 1000) for t in (100, 200)]
    assert long_context.predict_step_s(pts, 400) == pytest.approx(400 + 160)
    assert long_context.predict_step_s([(100, 1.0)], 400) == pytest.approx(4.0)


def test_schedule_takes_the_nearest_listed_length_below():
    sched = long_context.parse_schedule("256:1+2,1024:0+1")
    assert long_context.steps_for(sched, 512) == (1, 2)
    assert long_context.steps_for(sched, 8192) == (0, 1)
    assert long_context.steps_for(sched, 128) == (1, 2)


def _copied_child(real: dict):
    """A run_child that starts no process: every spec gets the record a real child gave
    (``real``, a measured row without the driver's own fields), its peak told apart by T.
    For tests of what the driver does with records; the real children run in the tests of
    the smallest run and of the chunked loss."""
    record = {k: v for k, v in real.items() if k not in ("arm", "length", "batch", "run")}

    def run_child(spec: dict, timeout_s: float) -> dict:
        return {**record, "peak_rss_bytes": record["peak_rss_bytes"] + spec["length"]}

    return run_child


def test_merge_keeps_the_earlier_rows_and_says_which_run_each_came_from(
    small, tmp_path, monkeypatch
):
    folder, first = small  # nonpriv-bias and dp-bitfit at T=16, measured
    (bitfit,) = [r for r in first["rows"] if r["arm"] == "dp-bitfit"]
    monkeypatch.setattr(long_context, "run_child", _copied_child(bitfit))
    res = _run(tmp_path, "second", "--lengths", "16", "32", "--arms", "dp-bitfit",
               "dp-bitfit-ckpt", "--merge", str(folder / "small.json"))  # fmt: skip
    rows = {(r["arm"], r["length"]): r for r in res["rows"]}
    assert set(rows) == {("nonpriv-bias", 16), ("dp-bitfit", 16), ("dp-bitfit", 32),
                         ("dp-bitfit-ckpt", 16), ("dp-bitfit-ckpt", 32)}  # fmt: skip
    assert rows["nonpriv-bias", 16]["run"] == 0 and rows["dp-bitfit", 16]["run"] == 1
    # the replaced measurement is kept, not rendered
    assert [(r["arm"], r["run"]) for r in res["superseded_rows"]] == [("dp-bitfit", 0)]
    assert rows["nonpriv-bias", 16]["peak_rss_bytes"] == first["rows"][0]["peak_rss_bytes"]
    assert all(r["status"] == "ok" for r in rows.values())
    assert res["arms"] == ["nonpriv-bias", "dp-bitfit", "dp-bitfit-ckpt"]
    assert [run["command"] for run in res["runs"]] == [first["command"], res["command"]]
    # memory compares across runs; time only within one run (alternated side by side)
    assert long_context._ratio(res, "dp-bitfit", "nonpriv-bias", 16, 1, "peak_rss_bytes")
    assert long_context._ratio(res, "dp-bitfit", "nonpriv-bias", 16, 1, "median_cpu_s") is None
    assert long_context._ratio(res, "dp-bitfit-ckpt", "dp-bitfit", 32, 1, "median_cpu_s")
    md = (tmp_path / "second.md").read_text()
    assert first["command"] in md and "run 2:" in md and "1 more measured" in md
    assert "DP-BiTFiT + activation checkpointing / DP-BiTFiT, memory" in md
    assert "| 32 | 0+1 |" in md and "non-private bias-only)" in md  # not measured at T=32
    # merging the merged result again keeps both runs
    again = long_context.merge(res, first, "again")
    assert len(again["runs"]) == 3 and {r["run"] for r in again["rows"]} == {1, 2}


def test_merge_of_a_missing_file_is_refused_early(tmp_path, capsys):
    with pytest.raises(SystemExit):
        long_context.main(["--merge", str(tmp_path / "none.json"), "--out", str(tmp_path / "x")])
    assert "--merge" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


# ------------------------------------------------------------------ a child killed from outside
FAKE_CHILD = (  # holds ~64 MiB, then dies the way the OOM killer kills: SIGKILL
    "import os, signal, time; x = bytearray(64 << 20); x[::4096] = b'1' * len(x[::4096]); "
    "time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)"
)
SPEC = {"threads": 1}


def test_a_sigkill_with_the_oom_kill_count_up_is_the_oom_killer_not_a_measurement(monkeypatch):
    counts = iter([7, 8])  # before the child, after it: the kernel killed one process
    monkeypatch.setattr(long_context, "oom_kills", lambda: next(counts))
    res = long_context.run_child(SPEC, 60, cmd=[sys.executable, "-c", FAKE_CHILD])
    assert res["status"] == "killed-by-oom-killer", res
    assert res["peak_rss_bytes"] >= 64 << 20
    assert 0 <= res["others_used_bytes"] < 64 * GIB
    assert res["reason"].startswith("killed by the kernel's OOM killer at ")
    assert "GiB RSS, with" in res["reason"] and "GiB used by other processes" in res["reason"]


def test_a_sigkill_without_an_oom_kill_is_an_error(monkeypatch):
    monkeypatch.setattr(long_context, "oom_kills", lambda: 3)
    res = long_context.run_child(SPEC, 60, cmd=[sys.executable, "-c", FAKE_CHILD])
    assert res["status"] == "error" and "not by the OOM killer" in res["reason"], res


def test_classify_death_keeps_timeouts_and_allocation_failures_apart():
    last = {"used_bytes": 10 * GIB, "child_rss_bytes": 4 * GIB}
    kw = dict(timeout_s=5, last=last, peak_rss=4 * GIB)
    sigkill = -long_context.signal.SIGKILL
    # this script's own SIGKILL at the timeout is a timeout, whatever the kernel did meanwhile
    assert long_context.classify_death(sigkill, True, new_oom_kills=1, stderr_tail="",
                                       **kw)["status"] == "timeout"  # fmt: skip
    r = long_context.classify_death(sigkill, False, new_oom_kills=1, stderr_tail="", **kw)
    assert r["status"] == "killed-by-oom-killer" and r["others_used_bytes"] == 6 * GIB
    assert "at 4.0 GiB RSS, with 6.0 GiB used by other processes" in r["reason"]
    # an allocation failure under the cap that took the interpreter down: does not fit
    tail = "terminate called after throwing an instance of 'std::bad_alloc'"
    assert long_context.classify_death(-6, False, new_oom_kills=0, stderr_tail=tail,
                                       **kw)["status"] == "does-not-fit"  # fmt: skip
    assert long_context.classify_death(1, False, new_oom_kills=0, stderr_tail="KeyError: 'x'",
                                       **kw)["status"] == "error"  # fmt: skip


def test_big_arms_wait_for_memory_and_small_ones_do_not():
    # an arm of at most 12 GiB starts at once, whatever is available
    enough, avail = long_context.wait_for_memory(long_context.BIG_ARM, wait_s=0)
    assert enough and avail > 0
    # more than the machine has: gives up after wait_s, and says what was available
    enough, avail = long_context.wait_for_memory(1024 * GIB, wait_s=0)
    assert not enough and 0 < avail < 1024 * GIB


def _row(arm, status, cap, peak_gib=1.0, ran=True, **kw):
    return {"arm": arm, "length": 2048, "batch": 4, "status": status, "ran": ran, "run": 0,
            "memory_cap_gib": cap, "peak_rss_bytes": int(peak_gib * GIB), "warmup": 0,
            "timed": 1, "base_rss_bytes": GIB // 2, "s_per_example": 1.0, "median_cpu_s": 4.0,
            "median_wall_s": 4.0, **kw}  # fmt: skip


def _result(rows):
    return {"batches": [4], "lengths": [2048], "memory_cap_gib": 16, "rows": rows,
            "arms": ["dp-bitfit-ckpt", "dpfit-full", "opacus-hooks", "opacus-ghost"]}  # fmt: skip


def test_only_allocation_failures_under_a_cap_as_large_count_as_dp_full_not_fitting():
    fits = _row("dp-bitfit-ckpt", "ok", 16, 7.2)
    ghost = _row("opacus-ghost", "unsupported", 16)
    hooks = _row("opacus-hooks", "does-not-fit", 16, 15.5)
    killed = _row("dpfit-full", "killed-by-oom-killer", 16, 9.0, others_used_bytes=8 * GIB,
                  reason="killed by the kernel's OOM killer at 9.0 GiB RSS, with 8.0 GiB ...")  # fmt: skip
    res = _result([fits, ghost, hooks, killed])
    t = long_context.targets(res)["bitfit_fits_where_no_dp_full_does"]
    assert not t["met"] and t["missed"][0]["length"] == 2048
    assert "killed-by-oom-killer" in t["missed"][0]["dp_full"]["dpfit-full"]
    res["targets"] = long_context.targets(res)
    md = long_context.render(res | {"command": "x", "cap_note": "c", "children_cpu_minutes": 1,
                                    "model": "m", "attention": "sdpa", "threads": 1})  # fmt: skip
    assert "killed by the OOM killer at 9.00 (others held 8.0; not a measurement)" in md
    assert "NOT met at this batch" in md
    # failed under a smaller cap than the one DP-BiTFiT fitted in: proves nothing
    small = _row("dpfit-full", "does-not-fit", 12, 11.5)
    t = long_context.targets(_result([fits, ghost, hooks, small]))
    assert not t["bitfit_fits_where_no_dp_full_does"]["met"]
    # out of the same cap: met, at this (T, batch), with the ratio's lower bound left out
    same = _row("dpfit-full", "does-not-fit", 16, 15.4)
    t = long_context.targets(_result([fits, ghost, hooks, same]))[
        "bitfit_fits_where_no_dp_full_does"
    ]
    assert t["met"] and (t["first"][0]["batch"], t["first"][0]["length"]) == (4, 2048)
    assert t["first"][0]["arm"] == "dp-bitfit-ckpt"
    # a cap below the machine's memory is said to show nothing about the machine's 24 GiB
    assert "whether DP full fits in 24 GiB here is not measured" in "\n".join(
        long_context._target_lines({**_result([fits, ghost, hooks, same]), "targets": {
            "bitfit_memory_vs_nonpriv_bias": {"worst": None},
            "bitfit_time_vs_nonpriv_bias": {"worst": None},
            "bitfit_fits_where_no_dp_full_does": t}})
    )  # fmt: skip


def test_a_ratio_between_rows_of_different_steps_says_so():
    rows = [_row("dp-bitfit-ckpt", "ok", 16, 4.0, warmup=1, timed=2),
            _row("dpfit-full", "ok", 16, 10.0)]  # fmt: skip
    (x,) = long_context._longest_common(_result(rows), "dp-bitfit-ckpt")
    assert x["ratio"] == pytest.approx(2.5) and "1+2 steps" in x["rows_differ"]
    rows[0].update(warmup=0, timed=1)
    (x,) = long_context._longest_common(_result(rows), "dp-bitfit-ckpt")
    assert "rows_differ" not in x


def test_a_cap_below_24_gib_names_the_machine_when_it_had_the_cap_free():
    """Why a 21 GiB cap stood for the machine's 24: the machine's own size when the failing
    arms started with at least the cap available; other jobs otherwise."""
    gib = long_context.GIB
    row = {"arm": "dpfit-full", "length": 4096, "batch": 4, "status": "does-not-fit",
           "memory_cap_gib": 21, "mem_available_at_start_bytes": 22 * gib}  # fmt: skip
    res = {"rows": [row], "memory_cap_gib": 21, "machine": {"mem_total_bytes": 23.5 * gib}}
    met = {"dp_full": ["dpfit-full"], "length": 4096, "batch": 4}
    idle = long_context._below_machine(met, res)
    assert "the machine has 23.5 GiB in all and no swap" in idle and "other jobs" not in idle
    row["mem_available_at_start_bytes"] = 15 * gib  # other jobs held memory at the start
    busy = long_context._below_machine(met, res)
    assert "beside the other jobs running" in busy and "23.5" not in busy
    row["memory_cap_gib"] = 24
    assert long_context._below_machine(met, {**res, "memory_cap_gib": 24}) == ""


def test_chunked_loss_arm_runs_and_is_compared_with_checkpointing_alone(tmp_path):
    res = _run(tmp_path, "chunked", "--lengths", "32", "--arms", "dp-bitfit-ckpt",
               "dp-bitfit-chunked")  # fmt: skip
    assert [r["status"] for r in res["rows"]] == ["ok", "ok"]
    md = (tmp_path / "chunked.md").read_text()
    assert (
        "DP-BiTFiT + activation checkpointing + chunked loss / DP-BiTFiT + activation "
        "checkpointing, memory" in md
    )


def test_malloc_note_says_which_allocator_setting_the_rows_ran_under():
    fixed = {"ran": True, "mmap_threshold": 1 << 20}
    default = {"ran": True}
    assert "default settings in every arm" in long_context._malloc_note([default, default])
    assert "1,048,576 bytes" in long_context._malloc_note([fixed, fixed])
    assert "only between rows of one setting" in long_context._malloc_note([fixed, default])
