"""docs/long_documents.md quotes each configuration's committed table as the script rendered
it, not a hand copy; the configurations (2,048 tokens, and 4,096 x physical batch 4) keep
their own commands, results, partial files and docs blocks. The runs here are fakes: no
training."""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import long_document_train as ldt  # noqa: E402


@pytest.mark.parametrize("name", sorted(ldt.CONFIGS))
def test_docs_quote_the_committed_table(name):
    config = ldt.CONFIGS[name]
    md = config.out.with_suffix(".md").read_text()
    docs = ldt.DOCS.read_text()
    begin, end = config.markers
    block = docs.split(begin, 1)[1].split(end, 1)[0].strip()
    assert block == ldt.docs_table(md.splitlines())
    assert block.count("\n") >= 10  # the whole table


@pytest.mark.parametrize("name", sorted(ldt.CONFIGS))
def test_the_committed_result_is_of_the_configs_command(name):
    config = ldt.CONFIGS[name]
    record = json.loads(config.out.with_suffix(".json").read_text())
    assert record["produced_by"] == config.produced_by
    for run, result in record["runs"].items():
        assert result["command"] == f"dpfit train {config.flags}{ldt.RUNS[run]}"


def test_the_default_is_the_2048_command_and_the_4096_one_differs_only_in_its_shape():
    """The 4096 x 4 command is the 2,048 one at another shape, every batch padded to it."""
    assert ldt.FLAGS == ldt.CONFIGS["2048"].flags
    assert ldt.DEFAULT_OUT == ldt.CONFIGS["2048"].out
    short, long = (_flags(ldt.CONFIGS[k].flags) for k in ("2048", "4096x4"))
    assert short["--max-length"] == "2048" and short["--physical-batch-size"] == "1"
    assert long["--max-length"] == "4096" and long["--physical-batch-size"] == "4"
    shape = ("--max-length", "--physical-batch-size", "--pad-to-max-length")
    assert "--pad-to-max-length" in long and "--pad-to-max-length" not in short
    assert {k: v for k, v in short.items() if k not in shape} == {
        k: v for k, v in long.items() if k not in shape
    }
    assert long["--privacy-unit"] == "document" and "--activation-checkpointing" in long
    outs = {c.out for c in ldt.CONFIGS.values()}
    markers = {m for c in ldt.CONFIGS.values() for m in c.markers}
    assert len(outs) == len(ldt.CONFIGS) and len(markers) == 2 * len(ldt.CONFIGS)


def _flags(flags: str) -> dict[str, str | None]:
    words = shlex.split(flags)
    return {
        w: (words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else None)
        for i, w in enumerate(words)
        if w.startswith("--")
    }


def _metrics(flags: str) -> dict:
    f = _flags(flags)
    control = f.get("--noise-multiplier") == "0"
    return {
        "perplexity_before": 20.0,
        "perplexity_after": 19.0 if control else 19.5,
        "privacy_unit": f["--privacy-unit"],
        "epsilon": "inf" if control else 7.99,
        "delta": 1e-5,
        "noise_multiplier": 0.0 if control else 0.45,
        "sample_rate": 0.0234,
        "steps": int(f["--max-steps"]),
        "lr": 5e-4,
        "train_documents": 171,
        "window_length": int(f["--max-length"]),
        "stride": int(f["--max-length"]),
        "eval_n": 9,
        "trainable_params": 190656,
        "peak_memory_mb": 2900.0,
        "wall_time_s": 100.0,
    }


def _fake_profile(flags: str, runs: list[dict]) -> dict:
    """Stands for data_profile (which tokenizes the bundled speeches)."""
    m = runs[0]["metrics"]
    return {
        "window_length": m["window_length"],
        "train_documents": m["train_documents"],
        "full_window_documents": 3,
        "longest_train_document_tokens": 5000,
        "sample_rate": m["sample_rate"],
        "steps": m["steps"],
        "chance_a_step_drew_a_full_window": 0.07,
        "chance_the_steps_drew_a_full_window": 0.25,
        "held_out_windows": m["eval_n"],
        "longest_held_out_window_tokens": 1500,
    }


class FakeRuns:
    """Stands for `_run`: records each command and stops (as a killed run) after `stop_after`."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.flags: list[str] = []
        self.stop_after = stop_after

    def __call__(self, flags: str, folder: Path) -> tuple[dict, float]:
        if self.stop_after is not None and len(self.flags) == self.stop_after:
            raise KeyboardInterrupt  # the run stopped by hand
        self.flags.append(flags)
        return _metrics(flags), 1.0


@pytest.fixture
def docs(tmp_path, monkeypatch):
    """A docs page with every configuration's markers; the configs' committed outs in tmp."""
    page = tmp_path / "long_documents.md"
    page.write_text(
        "".join(
            f"intro {n}\n{b}\nold\n{e}\nafter\n"
            for n, c in ldt.CONFIGS.items()
            for b, e in [c.markers]
        )
    )
    monkeypatch.setattr(ldt, "DOCS", page)
    monkeypatch.setattr(ldt, "data_profile", _fake_profile)
    configs = {n: dataclasses.replace(c, out=tmp_path / c.out.name) for n, c in ldt.CONFIGS.items()}
    monkeypatch.setattr(ldt, "CONFIGS", configs)
    return page


def _block(page: Path, config: ldt.Config) -> str:
    begin, end = config.markers
    return page.read_text().split(begin, 1)[1].split(end, 1)[0].strip()


def test_4096x4_runs_the_private_command_first_into_its_own_result_and_block(docs, monkeypatch):
    fake = FakeRuns()
    monkeypatch.setattr(ldt, "_run", fake)
    assert ldt.main(["--config", "4096x4"]) == 0
    config = ldt.CONFIGS["4096x4"]
    assert fake.flags == [config.flags, config.flags + " --noise-multiplier 0"]
    record = json.loads(config.out.with_suffix(".json").read_text())
    assert record["not_run"] == [] and record["produced_by"] == config.produced_by
    md = config.out.with_suffix(".md").read_text()
    assert md.startswith("# `dpfit train` on long documents: SmolLM2-135M, 4,096-token windows")
    assert "| window length, stride | 4096, 4096 | 4096, 4096 |" in md
    assert _block(docs, config) == ldt.docs_table(md.splitlines())
    assert "| training documents with a full 4096-token window | 3 of 171 |" in md
    assert "| chance that the 4 steps drew at least one | 25% |" in md
    # the runs' table, a blank line, the data's table: two tables in the docs, not one
    assert "| wall time | 100 s | 100 s |\n\n| the data at this window length | |" in (
        _block(docs, config)
    )
    assert json.loads(config.out.with_suffix(".json").read_text())["data"]["steps"] == 4
    assert _block(docs, ldt.CONFIGS["2048"]) == "old"  # the other block is left alone
    assert not config.out.with_suffix(".partial.json").exists()
    assert not ldt.CONFIGS["2048"].out.with_suffix(".json").exists()


def test_2048_still_runs_the_control_first_into_its_own_block(docs, monkeypatch):
    fake = FakeRuns()
    monkeypatch.setattr(ldt, "_run", fake)
    assert ldt.main([]) == 0
    config = ldt.CONFIGS["2048"]
    assert fake.flags == [config.flags + " --noise-multiplier 0", config.flags]
    md = config.out.with_suffix(".md").read_text()
    assert md.startswith("# `dpfit train` on long documents: SmolLM2-135M, 2,048-token windows\n")
    assert _block(docs, config) == ldt.docs_table(md.splitlines())
    assert "not run" not in _block(docs, config)
    assert "data" not in json.loads(config.out.with_suffix(".json").read_text())
    assert "the data at this window length" not in md
    assert _block(docs, ldt.CONFIGS["4096x4"]) == "old"


def test_a_stopped_4096_run_says_the_control_was_not_run_and_resumes_it(docs, monkeypatch):
    config = ldt.CONFIGS["4096x4"]
    monkeypatch.setattr(ldt, "_run", FakeRuns(stop_after=1))
    with pytest.raises(KeyboardInterrupt):
        ldt.main(["--config", "4096x4"])
    partial = json.loads(config.out.with_suffix(".partial.json").read_text())
    assert list(partial) == ["private"]

    assert ldt.main(["--config", "4096x4", "--stopped"]) == 0  # the private run alone
    md = config.out.with_suffix(".md").read_text()
    control = f"* {ldt.CONTROL}: not run (stopped for the CPU budget on a shared machine)"
    assert control in md and "| | private |\n" in md
    block = _block(docs, config)
    assert block.startswith(control) and block == ldt.docs_table(md.splitlines())
    assert config.out.with_suffix(".partial.json").exists()  # kept, to resume

    fake = FakeRuns()
    monkeypatch.setattr(ldt, "_run", fake)
    assert ldt.main(["--config", "4096x4"]) == 0
    assert fake.flags == [config.flags + " --noise-multiplier 0"]  # the private run is kept
    assert "not run" not in _block(docs, config)


def test_a_partial_result_of_one_config_is_not_resumed_by_the_other(docs, monkeypatch):
    short, long = ldt.CONFIGS["2048"], ldt.CONFIGS["4096x4"]
    monkeypatch.setattr(ldt, "_run", FakeRuns(stop_after=1))
    with pytest.raises(KeyboardInterrupt):
        ldt.main([])  # the 2048 control finished
    # even under the other config's partial file, a run of other flags is not taken
    long.out.with_suffix(".partial.json").write_text(
        short.out.with_suffix(".partial.json").read_text()
    )
    fake = FakeRuns()
    monkeypatch.setattr(ldt, "_run", fake)
    assert ldt.main(["--config", "4096x4"]) == 0
    assert fake.flags == [long.flags, long.flags + " --noise-multiplier 0"]


def test_an_unknown_config_is_refused(capsys):
    with pytest.raises(SystemExit):
        ldt.main(["--config", "8192"])
    assert "invalid choice" in capsys.readouterr().err


def test_render_redraws_the_configs_md_from_its_json(docs, monkeypatch):
    monkeypatch.setattr(ldt, "_run", FakeRuns())
    ldt.main(["--config", "4096x4"])
    config = ldt.CONFIGS["4096x4"]
    md = config.out.with_suffix(".md")
    first = md.read_text()
    md.unlink()
    assert ldt.main(["--config", "4096x4", "--render"]) == 0
    assert md.read_text() == first


def test_the_data_profile_reads_the_documents_the_committed_4096_run_read():
    """Computed again from the bundled speeches: the same counts as the run's metrics (the
    profile checks them) and the same figures as the committed record."""
    config = ldt.CONFIGS["4096x4"]
    record = json.loads(config.out.with_suffix(".json").read_text())
    runs = list(record["runs"].values())
    assert ldt.data_profile(config.flags, runs) == record["data"]
    data = record["data"]
    assert 0 < data["full_window_documents"] < data["train_documents"]
    assert data["longest_held_out_window_tokens"] <= data["window_length"]


def test_the_data_profile_refuses_runs_that_read_other_documents():
    config = ldt.CONFIGS["4096x4"]
    record = json.loads(config.out.with_suffix(".json").read_text())
    run = json.loads(json.dumps(record["runs"]["private"]))
    run["metrics"]["eval_n"] += 1
    with pytest.raises(SystemExit, match="no longer reads the data as dpfit train does"):
        ldt.data_profile(config.flags, [run])
