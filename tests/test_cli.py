"""`dpfit` CLI on a tiny random model and a tiny CSV: outputs, JSON, and one-line errors."""

import csv
import json
import re

import pytest

from dpfit import accounting
from dpfit.cli import build_parser, main
from dpfit.models import save_tiny_random_model, write_tiny_sentiment_csv


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return (
        str(save_tiny_random_model(root / "model")),
        str(write_tiny_sentiment_csv(root / "train.csv", n=160, seed=0)),
        str(write_tiny_sentiment_csv(root / "test.csv", n=40, seed=1)),
    )


def train_args(tiny, *extra):
    model, data, _ = tiny
    return ["train", "--model", model, "--data", data, "--epochs", "1", "--batch-size", "32",
            "--physical-batch-size", "16", "--threads", "1", "--quiet", *extra]  # fmt: skip


def test_train_writes_everything(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        main(train_args(tiny, "--eval-data", tiny[2], "--epsilon", "2", "--output", str(out))) == 0
    )
    table = capsys.readouterr().out
    for word in ("accuracy", "epsilon", "delta", "sigma", "clip norm", "logical steps",
                 "trainable fraction", "wall time", "peak memory"):  # fmt: skip
        assert word in table
    m = json.loads((out / "metrics.json").read_text())
    for key in (
        "accuracy",
        "epsilon",
        "delta",
        "noise_multiplier",
        "max_grad_norm",
        "steps",
        "trainable_fraction",
    ):
        assert key in m
    assert m["eval_n"] == 40 and m["train_examples"] == 160  # --eval-data: no hold-out
    assert 1.9 < m["epsilon"] <= 2.0 + 1e-6 and m["steps"] == 5
    with open(out / "steps.csv") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert [int(r["step"]) for r in rows] == list(range(1, 6))
    assert float(rows[-1]["epsilon"]) == pytest.approx(m["epsilon"])
    # a private run keeps no exact training loss or Poisson batch size per step
    assert not {"loss", "batch_size"} & set(reader.fieldnames)
    assert not (out / "loss.png").exists() and (out / "epsilon.png").stat().st_size > 1000
    assert m["insecure_seed"] is False and m["final_train_loss"] is None
    record = json.loads((out / "model" / "dpfit.json").read_text())
    assert record["epsilon"] == pytest.approx(m["epsilon"]) and record["delta"] == m["delta"]
    assert record["trained_parameters"] and "sample_rate" in record
    assert record["clipping"] == m["clipping"] == m["recipe"]["clipping"]
    assert (out / "model" / "config.json").exists()

    # the saved model is a normal transformers folder: `evaluate` scores it
    assert main(["evaluate", "--model", str(out / "model"), "--data", tiny[2], "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["n"] == 40 and ev["accuracy"] == pytest.approx(m["accuracy"])
    assert sum(c["n"] for c in ev["per_class"].values()) == 40
    assert ev["privacy"]["epsilon"] == pytest.approx(m["epsilon"])

    # evaluation data with a label the model never saw
    bad = tmp_path / "bad.csv"
    bad.write_text("text,label\nthe film was good,pos\nthe film was so-so,mixed\n")
    assert main(["evaluate", "--model", str(out / "model"), "--data", str(bad)]) == 2
    assert "mixed" in capsys.readouterr().err


def test_train_json_non_private(tiny, capsys):
    assert main(train_args(tiny, "--non-private", "--json")) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["private"] is False and m["epsilon"] == "inf" and m["noise_multiplier"] is None
    assert m["steps"] == 5  # ceil(144 / 32)


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--data", "/nonexistent/data.csv"], "does not exist"),
        (["--text-column", "review"], "--text-column"),
        (["--epsilon", "0.0001", "--batch-size", "120"], "epsilon"),
        (["--model", "/nonexistent/model"], "not a folder"),
        (["--threads", "many"], "--threads"),
    ],
)
def test_bad_input_is_one_line_error(tiny, capsys, extra, needle):
    assert main(train_args(tiny, *extra)) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def _bad_file(tmp_path, case):
    if case == "latin-1":
        p = tmp_path / "latin.csv"
        rows = "".join(f"the film was good {i},pos\nthe film was bad {i},neg\n" for i in range(30))
        p.write_bytes(("text,label\n" + rows + "un film rat\xe9,neg\n").encode("latin-1"))
        return p
    if case == "non-text":
        p = tmp_path / "d.jsonl"
        lines = [
            json.dumps({"text": f"a tedious waste of time {i}", "label": i % 2}) for i in range(40)
        ]
        lines.insert(7, json.dumps({"text": 1234, "label": 0}))
        p.write_text("\n".join(lines) + "\n")
        return p
    labels = {
        "mixed": ["neg", "pos", "0", "1"] * 20,
        "float": [f"{i / 7:.3f}" for i in range(80)],
        "many": [str(i) for i in range(1000)],
    }[case]
    p = tmp_path / "d.csv"
    with open(p, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows((f"the film was fine {i}", y) for i, y in enumerate(labels))
    return p


@pytest.mark.parametrize(
    "case,extra,needles",
    [
        ("latin-1", (), ("line 62", "UTF-8", "iconv")),
        ("non-text", (), ("line 8", "1234 (int)")),
        ("mixed", (), ("mixes numbers and names", "--labels")),
        ("float", (), ("looks continuous",)),
        ("many", (), ("1000 distinct values", "--label-column")),
        (None, ("--max-length", "100"), ("--max-length 100", "64 positions")),
        (None, ("--epsilon", "1e-6"), ("epsilon=1e-06", "larger epsilon")),
    ],
    ids=[
        "latin-1",
        "non-text",
        "mixed-labels",
        "float-labels",
        "1000-labels",
        "max-length",
        "tiny-epsilon",
    ],  # fmt: skip
)
def test_newcomer_errors_are_one_actionable_line(tiny, tmp_path, capsys, case, extra, needles):
    """Each case is one line naming the file/row/column or limit and the fix, exit
    code 2, before training (the --output folder holds no run record)."""
    data = ("--data", str(_bad_file(tmp_path, case))) if case else ()
    out = tmp_path / "run"
    assert main(train_args(tiny, *data, *extra, "--output", str(out))) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "Traceback" not in err and "brentq" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert len(lines[0]) < 400
    assert not (out / "metrics.json").exists()


def test_mixed_labels_train_as_two_classes_with_labels(tiny, tmp_path, capsys):
    data = _bad_file(tmp_path, "mixed")
    assert main(train_args(tiny, "--data", str(data), "--labels", "neg,pos", "--json",
                           "--max-steps", "1", "--no-output")) == 0  # fmt: skip
    m = json.loads(capsys.readouterr().out)
    assert sorted(m["per_class"]) == ["neg", "pos"]


def test_max_steps_help_says_the_noise_follows_the_run_length(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-steps" in text and "sigma is set for the steps run" in text


def test_empty_and_single_class_data(tiny, tmp_path, capsys):
    empty = tmp_path / "empty.csv"
    empty.write_text("text,label\n")
    one = tmp_path / "one.csv"
    one.write_text("text,label\n" + "the film was good,pos\n" * 20)
    assert main(train_args(tiny, "--data", str(empty))) == 2
    assert "no rows" in capsys.readouterr().err
    assert main(train_args(tiny, "--data", str(one))) == 2
    assert "two classes" in capsys.readouterr().err


def test_model_without_biases(tiny, tmp_path, capsys):
    llama = save_tiny_random_model(tmp_path / "llama", arch="llama")
    assert main(train_args(tiny, "--model", str(llama))) == 2
    assert "--add-biases" in capsys.readouterr().err


def test_accountant_both_directions(capsys):
    assert (
        main(
            [
                "accountant",
                "--noise-multiplier",
                "1.1",
                "--sample-rate",
                "0.01",
                "--steps",
                "1000",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["epsilon"] == pytest.approx(accounting.epsilon_for(1.1, 0.01, 1000, 1e-5))
    args = ["accountant", "--epsilon", str(out["epsilon"]), "--batch-size", "100", "--dataset-size",
            "10000", "--steps", "1000", "--json"]  # fmt: skip
    assert main(args) == 0
    back = json.loads(capsys.readouterr().out)
    assert back["noise_multiplier"] == pytest.approx(1.1, rel=0.01)
    assert main(["accountant", "--noise-multiplier", "1", "--steps", "10"]) == 2
    assert "--sample-rate" in capsys.readouterr().err


def test_federated_is_wired_or_explains(capsys):
    try:
        from dpfit.federated import cli as _  # noqa: F401
    except ImportError:
        assert main(["federated"]) == 2
        assert "dpfit.federated.cli" in capsys.readouterr().err
    else:
        assert "federated" in build_parser().format_help()


def test_help_lists_the_commands():
    text = build_parser().format_help()
    for cmd in ("train", "evaluate", "accountant", "federated"):
        assert cmd in text
    with pytest.raises(SystemExit):
        main(["train", "--clipping", "per-layer"])


def test_insecure_reproducible_noise_warns_and_records(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_args(tiny, "--insecure-reproducible-noise", "--output", str(out))) == 0
    captured = capsys.readouterr()
    assert "NOT private" in captured.err
    assert "NOT PRIVATE against" in captured.out  # in the result table too
    assert json.loads((out / "metrics.json").read_text())["insecure_seed"] is True


def test_non_private_steps_keep_the_loss(tiny, tmp_path):
    out = tmp_path / "run"
    assert main(train_args(tiny, "--non-private", "--output", str(out))) == 0
    with open(out / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(float(r["loss"]) > 0 for r in rows)
    assert (out / "loss.png").exists()


def test_rare_label_names_are_refused_with_a_hint(tiny, tmp_path, capsys):
    data = tmp_path / "d.csv"
    data.write_text(
        "text,label\n" + "the film was good,pos\n" * 40 + "the film was bad,neg\n" * 40
        + "the film was fine,alice-smith\n"
    )  # fmt: skip
    assert main(train_args(tiny, "--data", str(data))) == 2
    err = capsys.readouterr().err
    assert "--labels" in err and "--public-labels" in err


def test_gguf_classifier_trains_saves_and_evaluates(tmp_path, capsys):
    """A GGUF model (transformers calls it quantised and refuses save_pretrained) trains,
    and its run writes metrics.json and a dequantised model that `evaluate` reloads."""
    pytest.importorskip("gguf")
    from dpfit.models import save_tiny_gguf_model

    model = save_tiny_gguf_model(tmp_path / "gg" / "tiny.gguf")
    data = write_tiny_sentiment_csv(tmp_path / "d.csv", n=100)
    out = tmp_path / "run"
    args = ["train", "--model", str(model), "--add-biases", "--data", str(data), "--max-steps",
            "2", "--batch-size", "20", "--threads", "1", "--quiet", "--output", str(out)]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps"] == 2 and "output_errors" not in m
    config = json.loads((out / "model" / "config.json").read_text())
    assert "quantization_config" not in config and config["dpfit_added_biases"]
    capsys.readouterr()
    assert main(["evaluate", "--model", str(out / "model"), "--data", str(data), "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["n"] == 100 and ev["privacy"]["epsilon"] == pytest.approx(m["epsilon"])


def test_metrics_survive_a_failing_model_save(tiny, tmp_path, monkeypatch, capsys):
    """Privacy spent is never lost: a save error still leaves metrics.json with epsilon."""
    from dpfit.tasks import classification

    def broken(*a, **kw):
        raise ValueError("The model is quantized with gguf and is not serializable")

    monkeypatch.setattr(classification.ClassificationTask, "save", broken)
    out = tmp_path / "run"
    assert main(train_args(tiny, "--max-steps", "1", "--output", str(out))) == 2
    assert "metrics.json" in capsys.readouterr().err
    m = json.loads((out / "metrics.json").read_text())
    assert m["epsilon"] > 0 and "not serializable" in m["output_errors"][0]


def test_defaults_learn_a_learnable_task_non_privately(tmp_path, capsys):
    """End to end with the non-private defaults on a tiny sentence-transformers-style model:
    clearly above the majority class (catches "trains but learns nothing")."""
    model = save_tiny_random_model(tmp_path / "st", sentence_pooling="mean")
    train_csv = write_tiny_sentiment_csv(tmp_path / "train.csv", n=240, seed=0)
    test_csv = write_tiny_sentiment_csv(tmp_path / "test.csv", n=200, seed=1)
    args = ["train", "--model", str(model), "--data", str(train_csv), "--eval-data",
            str(test_csv), "--non-private", "--threads", "1", "--quiet", "--json"]  # fmt: skip
    assert main(args) == 0
    m = json.loads(capsys.readouterr().out)
    majority = max(c["n"] for c in m["per_class"].values()) / m["eval_n"]
    assert m["pooling"] == "mean" and m["overridden_by_flags"] == []
    assert m["accuracy"] >= majority + 0.15


def test_a_run_from_a_dpfit_save_prints_the_checkpoint_recipe(tiny, tmp_path, capsys):
    out = tmp_path / "first"
    assert main(train_args(tiny, "--max-steps", "1", "--output", str(out))) == 0
    first = capsys.readouterr().err
    assert "trained for the task" not in first
    model = str(out / "model")
    args = train_args(tiny, "--max-steps", "1", "--no-output")
    args[args.index("--model") + 1] = model
    assert main(args) == 0
    recipe = next(line for line in capsys.readouterr().err.splitlines() if "note: recipe" in line)
    assert "from a checkpoint trained for the task" in recipe and "no head-first" in recipe
    phase = re.compile(r"head-first \d+ epochs")
    assert phase.search(first) and not phase.search(recipe)
    assert "max length 128" in recipe and "biases + head at lr" in recipe


def test_labels_with_spaces_after_commas_name_the_classes_without_them():
    from dpfit.cli import build_parser, train_config_from_args

    args = build_parser().parse_args(["train", "--labels", "neg, pos ,", "--no-output"])
    assert train_config_from_args(args).labels == ("neg", "pos")


class _Called(Exception):
    pass


@pytest.mark.parametrize("flag", [True, False])
def test_checkpointed_runs_return_freed_memory_at_once(flag, monkeypatch):
    """dpfit train --activation-checkpointing fixes glibc's mmap threshold before the run
    (dpfit.memory.return_freed_memory); other runs leave the allocator alone."""
    import dpfit.cli as cli
    import dpfit.memory as memory

    calls = []
    monkeypatch.setattr(memory, "return_freed_memory", lambda *a: calls.append(a) or True)

    def stop(*args, **kwargs):
        raise _Called

    monkeypatch.setattr(cli, "run_config", stop)
    argv = ["train", "--task", "causal-lm", "--non-private"]
    with pytest.raises(_Called):
        main(argv + (["--activation-checkpointing"] if flag else []))
    assert len(calls) == (1 if flag else 0)


def test_train_runs_auto_precision_by_default(tiny, tmp_path, monkeypatch):
    """README and docs/precision.md promise `--precision auto` as the default: bf16 where it is
    native. Where it is (forced here, so the test means the same on every CPU), a run with no
    --precision flag records bf16; where it is not, fp32."""
    import dpfit.precision

    for native, want in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(dpfit.precision, "bf16_is_fast", lambda device, native=native: native)
        out = tmp_path / want
        assert main(train_args(tiny, "--epsilon", "2", "--output", str(out))) == 0
        assert json.loads((out / "metrics.json").read_text())["config"]["precision"] == want


# -- a new user's second hour: clear messages, honest durations --------------------------------


@pytest.mark.parametrize(
    "argv,line",
    [
        (["train", "--epsilon", "abc"], "--epsilon must be a positive number, got 'abc'"),
        (["train", "--epsilon", "0"], "--epsilon must be a positive number, got '0'"),
        (["train", "--epochs", "two"], "--epochs must be a whole number >= 1, got 'two'"),
        (["train", "--noise-multiplier", "x"], "--noise-multiplier must be a number, got 'x'"),
    ],
)
def test_a_bad_option_value_is_one_line_and_a_hint(capsys, argv, line):
    """No usage dump and no internal function name (_positive_float): the option, the value,
    what it must be, and where to look."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dpfit train: error: {line}", "(see: dpfit train --help)"]


@pytest.mark.parametrize("command", ["train", "evaluate", "federated"])
def test_help_shows_the_default_column_names(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--text-column TEXT_COLUMN the text column (default: text)" in text or (
        "--text-column TEXT_COLUMN your data's text column (default: text)" in text
    )
    assert "(default: label)" in text


@pytest.mark.parametrize("offline", ["1", "0"])
def test_a_misspelled_model_lists_the_bundled_names_at_once(tiny, monkeypatch, capsys, offline):
    """Offline, or a near miss of a bundled name online: refused before any data is read or
    any network call, naming the bundled models."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, offline)
    assert main(train_args(tiny, "--model", "minlm")) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "Traceback" not in err
    assert "(minilm, smollm2)" in lines[0] and "did you mean 'minilm'?" in lines[0]


def test_empty_cells_are_skipped_with_their_line_numbers(tiny, tmp_path, caplog):
    data = tmp_path / "d.csv"
    rows = [f"the film was good {i},pos\nthe film was bad {i},neg\n" for i in range(30)]
    rows[1] = "the film was good 1,\n,neg\n"  # lines 4 and 5 of the file (header is line 1)
    data.write_text("text,label\n" + "".join(rows))
    with caplog.at_level("WARNING", logger="dpfit"):
        assert main(train_args(tiny, "--data", str(data), "--max-steps", "1", "--no-output")) == 0
    (warning,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert "skipped 2 rows with an empty text or label (line 4, line 5)" in warning


def test_progress_in_a_log_is_a_few_plain_lines_with_the_time_left(tiny, capsys):
    """stderr is not a terminal here (as in a captured log): no control codes, no redraws,
    a line per tenth of the run at most (or per 30 s), and an estimate of the time left."""
    model, data, _ = tiny
    argv = ["train", "--model", model, "--data", data, "--epochs", "1", "--batch-size", "8",
            "--physical-batch-size", "8", "--threads", "1", "--no-head-first", "--no-output"]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err
    training = [ln for ln in err.splitlines() if ln.startswith("training:")]
    assert 3 <= len(training) <= 13, training
    estimate = [ln for ln in training if "left at" in ln]
    assert estimate and re.search(r"about \d+ (s|min) left at [\d.]+ (s/step|step/s)", estimate[0])
    assert re.fullmatch(r"training: (\d+)/\1 steps in \d+ s, eps=.*", training[-1]), training[-1]


def test_a_causal_lm_on_own_text_samples_from_held_out_text(tmp_path, capsys):
    """Sample prompts come from the user's held-out examples (never the training ones, never
    the bundled Hamlet), and the recipe note names the task instead of "0 classes"."""
    from dpfit.tasks.causal_lm import HAMLET_PROMPTS, CausalLMTask
    from dpfit.train import TrainConfig

    folder = save_tiny_random_model(tmp_path / "gpt2", arch="gpt2")
    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(f"{i} the good movie was great" for i in range(80)))
    argv = ["train", "--task", "causal-lm", "--model", str(folder), "--data", str(lines),
            "--max-train-examples", "32", "--batch-size", "8", "--max-length", "16",
            "--max-steps", "1", "--threads", "1", "--quiet", "--no-output", "--json"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    note = next(ln for ln in captured.err.splitlines() if "note: recipe" in ln)
    assert "causal LM" in note and "0 classes" not in note
    prompts = [s["prompt"] for s in json.loads(captured.out)["samples"]]
    assert prompts and not set(prompts) & set(HAMLET_PROMPTS)

    config = TrainConfig(task="causal-lm", model=str(folder), data=str(lines),
                         max_train_examples=32)  # fmt: skip
    prep = CausalLMTask().prepare(config)
    assert prep.state["prompts"] and not set(prep.state["prompts"]) & set(HAMLET_PROMPTS)
    for prompt in prep.state["prompts"]:
        assert not any(t.startswith(prompt) for t in prep.state["train"]), prompt
