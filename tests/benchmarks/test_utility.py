"""The utility suite's rendering of the held-out tasks: the gap to the run without privacy,
paired by seed, and its split into the probe phase and the bias phase."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def utility():
    return load_benchmark("utility", "utility_bench_render")


def _record(task, row, seed, acc, probe, **extra):
    return {
        "key": f"{task}|{row}|{seed}|trainall_testall",
        "task": task,
        "seed": seed,
        "scale": "trainall_testall",
        "row": row,
        "accuracy": acc,
        "head_first_accuracy": probe,
        "n_train": 3000,
        "n_test": 700,
        "n_classes": 3,
        "median_words": 11,
        "cpu_s": 100.0,
        **extra,
    }


def _records(task):
    dp = {"steps": 30, "head_first_steps": 30, "batch_size": 300, "lr": 5e-3}
    npb = {"steps": 282, "head_first_steps": 282, "batch_size": 32, "lr": 1e-3}
    return [
        _record(task, "DP-BiTFiT eps=8", 0, 0.60, 0.58, noise_multiplier=0.9, **dp),
        _record(task, "non-private bias-only", 0, 0.70, 0.59, **npb),
        _record(task, "DP-BiTFiT eps=8", 1, 0.62, 0.60, noise_multiplier=0.9, **dp),
        _record(task, "non-private bias-only", 1, 0.66, 0.61, **npb),
    ]


def _number_after(text, marker):
    return float(text.split(marker, 1)[1].split()[0].rstrip(",;:"))


def test_held_out_gap_is_paired_by_seed_and_split_by_phase(utility):
    summary = utility.summarize(_records("debate-role"), utility.Scale(None, None))
    lines = utility.held_out_lines(summary)
    head = lines[0]
    assert head.startswith("- debate-role (3000 train / 700 test, 3 classes, median 11 words;")
    assert "standard error of one test accuracy 1.8 points" in head  # p = 0.68, n = 700
    assert "-10.0 (seed 0), -4.0 (seed 1)" in head
    assert head.endswith("MISSED")  # mean -7.0
    assert _number_after(head, "non-private bias-only: ") == pytest.approx(-7.0)
    assert "sigma 0.900" in lines[1] and "no noise" in lines[2]
    assert "100 CPU s per run" in lines[1]
    phases = lines[3]
    probe, bias = _number_after(phases, "probe phase "), _number_after(phases, "bias phase ")
    # probe: (58-59 + 60-61)/2 = -1.0; bias: ((2-11) + (2-5))/2 = -6.0; they add up to the gap
    assert probe == pytest.approx(-1.0) and bias == pytest.approx(-6.0)
    assert probe + bias == pytest.approx(-7.0)
    assert "the bias phase" in lines[4] and "30 noised steps" in lines[4]  # a missed gap
    assert "moved" not in lines[4]  # nothing measured, nothing said


def test_the_cause_cites_how_far_the_biases_moved_where_recorded(utility):
    records = _records("debate-role")
    for r, moved in zip(records[:2], (5.0, 2.0), strict=True):  # seed 0: private, non-private
        r["after_probe"] = {**_bias_phase(1, 1, 2), "backbone_change_l2": moved}
    lines = utility.held_out_lines(utility.summarize(records, utility.Scale(None, None)))
    cause = next(x for x in lines if "likely cause" in x)
    assert "on seed(s) 0, the private biases moved 5.00 from the probe (L2) against 2.00" in cause
    assert cause.endswith("further: the noise moves them, not too few steps")


def test_a_met_gap_gets_no_cause(utility):
    records = _records("debate-role")
    for r in records:
        if r["row"] == "non-private bias-only":
            r["accuracy"] = 0.6
    lines = utility.held_out_lines(utility.summarize(records, utility.Scale(None, None)))
    assert lines[0].endswith("met") and not any("likely cause" in x for x in lines)


def test_suite_tasks_get_no_held_out_section_and_held_out_ones_are_marked(utility):
    records = _records("convention-party") + _records("headline-month")
    summary = utility.summarize(records, utility.Scale(None, None))
    lines = utility.held_out_lines(summary)
    assert [x for x in lines if x.startswith("- ")] == [
        x for x in lines if x.startswith("- headline-month")
    ]
    md = utility.markdown(summary, "# header", [])
    assert "| headline-month (held out) |" in md and "| convention-party |" in md
    targets = "\n".join(utility.targets(summary))
    assert "headline-month: DP-BiTFiT eps=8" in targets and "held-out task" in targets
    assert "reported only (n=3000 < 5000)" in targets  # the suite task keeps its own rule


def _bias_phase(right, wrong, changed):
    return {
        "test_n": 700, "predictions_changed": changed, "newly_right": right,
        "newly_wrong": wrong, "backbone_change_l2": 2.0, "backbone_norm": 100.0,
        "head_change_l2": 0.5, "epoch_losses": [1.6, 1.5],
    }  # fmt: skip


def test_held_out_section_shows_what_each_bias_phase_did(utility):
    records = _records("headline-month")
    records[1]["after_probe"] = _bias_phase(40, 40, 90)  # non-private, seed 0
    lines = utility.held_out_lines(utility.summarize(records, utility.Scale(None, None)))
    evidence = [x for x in lines if "newly right / newly wrong" in x]
    assert len(evidence) == 1
    assert (
        "seed 0 non-private: 40 / 40 of 700 (90 changed), biases moved 2.00 (2.0% of"
        in (evidence[0])
    )
    assert "loss 1.600 -> 1.500" in evidence[0] and "seed 1" not in evidence[0]
    assert lines[-1].startswith("  - non-private bias-only seed 0: an accuracy unchanged")
    records[1]["after_probe"] = _bias_phase(40, 39, 90)  # a net gain is no tie
    lines = utility.held_out_lines(utility.summarize(records, utility.Scale(None, None)))
    assert not any("is a tie" in x for x in lines)


def test_tfidf_gap_reads_the_frozen_probe_first(utility):
    records = _records("debate-role")
    for seed, (tfidf, probe) in enumerate(((0.66, 0.60), (0.64, 0.61))):
        records.append(_record("debate-role", "TF-IDF + LR", seed, tfidf, None))
        records.append(_record("debate-role", "frozen probe, mean", seed, probe, None))
    records.append(_record("debate-role", "non-private full", 0, 0.67, 0.59, steps=282))
    lines = utility.tfidf_gap_lines(utility.summarize(records, utility.Scale(None, None)))
    assert lines[0].startswith("- debate-role: TF-IDF + LR 65.0 over 2 seed(s)")
    assert "frozen probe, mean 60.5 [2 seed(s)] (-4.5 over 2 seed(s))" in lines[0]
    assert "4.5 points below TF-IDF + LR before any training" in lines[1]
    # non-private bias-only: 70 and 66 against probes 60 and 61
    assert (
        "non-private bias-only minus frozen probe, mean: +7.5 over 2 seed(s); it ends "
        in (lines[2])
    )
    assert lines[3].endswith("it ends above TF-IDF + LR (+1.0 over 1 seed(s))")
    records[-1]["after_probe"] = _bias_phase(1, 0, 1)
    lines = utility.tfidf_gap_lines(utility.summarize(records, utility.Scale(None, None)))
    assert lines[3].endswith("(+1.0 over 1 seed(s)); its training loss by epoch after the "
                             "probe: seed 0 1.60 -> 1.50")  # fmt: skip


def test_tfidf_gap_says_when_the_embedding_is_not_behind(utility):
    records = [
        _record("headline-month", "TF-IDF + LR", 0, 0.30, None),
        _record("headline-month", "frozen probe, cls", 0, 0.31, None),
        _record("headline-month", "non-private bias-only", 0, 0.28, 0.3, steps=300),
    ]
    lines = utility.tfidf_gap_lines(utility.summarize(records, utility.Scale(None, None)))
    assert "is not below TF-IDF + LR (+1.0): a fine-tune that ends below it loses in " in lines[1]
    assert lines[2].endswith("it still ends below TF-IDF + LR (-2.0 over 1 seed(s))")


def _bf16_and_fp32(bf16_accs):
    fp32 = [_record("t", "DP-BiTFiT eps=8", s, a, 0.5) for s, a in enumerate((0.70, 0.72, 0.74))]
    bf16 = [_record("t", "DP-BiTFiT eps=8", s, a, 0.5) for s, a in enumerate(bf16_accs)]
    return bf16, fp32


def test_precision_verdict_needs_three_bf16_seeds_inside_the_fp32_range(utility):
    scale = utility.Scale(None, None)
    inside = utility.precision_comparison(*_bf16_and_fp32((0.69, 0.73, 0.74)), scale)
    assert "Verdict: met (1 of 1 tasks inside)" in inside  # mean 72.0 within [70, 74]
    assert "| 72.0 |" in inside and "| +0.0 |" in inside
    below = utility.precision_comparison(*_bf16_and_fp32((0.66, 0.69, 0.70)), scale)
    assert "Verdict: not met (0 of 1 tasks inside)" in below  # mean 68.3 below 70
    one_seed = utility.precision_comparison(*_bf16_and_fp32((0.72,)), scale)
    assert "Verdict: not enough bf16 seeds" in one_seed


def test_the_header_says_which_dropout_the_dpfit_rows_ran_with(utility):
    old = _records("text-source")  # logs from before the dropout rule record none
    assert "the model's dropout (0.1)" in utility.dropout_clause(old)
    new = [{**r, "dropout": 0.0 if r["row"].startswith("DP") else "model"} for r in old]
    clause = utility.dropout_clause(new)
    assert "0.0, model" in clause and "per run in the log" in clause
