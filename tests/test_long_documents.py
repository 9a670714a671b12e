"""Long documents through the one training loop: windows at a stride, the privacy unit in the
accounting and the record, a document-unit run resumed after SIGKILL, refusals of what is not
built."""

from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch
from safetensors.torch import load_file
from sigkill import assert_resumed_as_uninterrupted, kill_after_checkpoint
from test_causal_lm import CharTokenizer, tiny_llama

from dpfit.causal_lm import IGNORE, Window, make_collate, windows
from dpfit.cli import main
from dpfit.errors import DPFitError
from dpfit.models import TINY_WORDS, save_tiny_random_model
from dpfit.tasks.causal_lm import CausalLMTask
from dpfit.train import TrainConfig, train

# 40 documents of 25 to 150 characters (CharTokenizer: one token a character), 20 speakers
TEXTS = [f"speech {i}: " + "we the people " * (1 + i % 10) for i in range(40)]
GROUPS = [f"speaker {i % 20}" for i in range(40)]


def _targets(ws: list[Window], stride: int) -> list[int]:
    """The document positions each window's labels make targets (after the causal shift)."""
    out, start = [], 0
    for k, w in enumerate(ws):
        labels = make_collate(0)([w])["labels"][0]
        out += [start + j for j in range(1, len(w.ids)) if labels[j] != IGNORE]
        if k + 1 < len(ws):
            start += stride
    return out


@pytest.mark.parametrize("length,stride", [(16, 16), (16, 12), (16, 1), (50, 20), (64, 64)])
def test_windows_cover_the_document_and_no_token_is_a_target_twice(length, stride):
    ids = torch.arange(2, 52)  # 50 tokens
    ws = windows(ids, length, stride)
    assert all(len(w.ids) <= length for w in ws)
    assert torch.equal(ws[-1].ids[-1], ids[-1])  # the last token is covered
    targets = _targets(ws, stride)
    assert len(targets) == len(set(targets))  # never twice
    if stride < length:  # overlapping: every token but the first is a target exactly once
        assert targets == list(range(1, 50))
    else:  # no overlap: each window's first token has nothing before it to predict it
        assert targets == [j for j in range(1, 50) if j % length]


def test_stride_longer_than_the_window_is_refused():
    with pytest.raises(ValueError, match="stride"):
        windows(torch.arange(10), 4, 5)


def _run(unit: str, model=None, **kw):
    model = model if model is not None else tiny_llama()
    task = CausalLMTask(eval_examples=8, sample_prompts=("we",), sample_tokens=2)
    cfg = TrainConfig(
        task="causal-lm", max_length=32, stride=24, privacy_unit=unit, batch_size=4,
        physical_batch_size=3, epochs=1, epsilon=4.0, **kw,
    )  # fmt: skip
    prep = task.prepare_documents(model, CharTokenizer(), TEXTS, GROUPS, cfg, "test speeches")
    return prep, train(cfg, prepared=prep, task=task)


def test_document_unit_samples_and_accounts_documents():
    prep, res = _run("document")
    m = res.metrics
    docs = len(prep.state["docs"])
    assert prep.n == docs < len(TEXTS)  # a tenth held out, by speaker
    assert m["privacy_unit"] == "document" and res.privacy["privacy_unit"] == "document"
    assert m["sample_rate"] == pytest.approx(4 / docs)
    assert m["steps"] == round(docs / 4) and 0 < m["epsilon"] <= 4.0 * 1.001
    assert m["train_documents"] == docs and m["window_length"] == 32 and m["stride"] == 24
    assert math.isfinite(m["perplexity_before"]) and math.isfinite(m["perplexity_after"])
    held = {g for t, g in zip(TEXTS, GROUPS, strict=True) if t not in _train_texts(prep)}
    assert held and not held & {GROUPS[TEXTS.index(t)] for t in _train_texts(prep)}


def _train_texts(prep) -> set[str]:
    tok = CharTokenizer()
    ids = {tuple(x.tolist()) for x in prep.state["docs"]}
    return {t for t in TEXTS if tuple([*tok(t)["input_ids"], 1]) in ids}


def test_window_unit_counts_windows():
    prep, res = _run("window")
    n_windows = sum(len(windows(d, 32, 24)) for d in prep.state["docs"])
    assert prep.n == n_windows > len(prep.state["docs"])
    assert res.metrics["privacy_unit"] == "window"
    assert res.metrics["sample_rate"] == pytest.approx(4 / n_windows)


def test_result_table_names_the_unit():
    from dpfit.cli import summary_rows

    _, res = _run("document", activation_checkpointing=True)
    rows = dict(summary_rows(res.metrics))
    assert rows["privacy unit"].startswith("document")


def test_checkpointed_run_with_chunked_loss_trains_the_same_model():
    """--activation-checkpointing also computes the loss's head in chunks: same sampled
    documents and noise (insecure seed), the same trained biases up to float rounding."""
    runs = [
        _run("document", activation_checkpointing=ckpt, insecure_reproducible_noise=True, seed=5)
        for ckpt in (False, True)
    ]
    (_, plain), (_, ckpt) = runs
    assert any(n.startswith("chunked loss") for n in ckpt.notes)
    assert not any(n.startswith("chunked loss") for n in plain.notes)
    _assert_same_trained_biases(plain, ckpt)


def _assert_same_trained_biases(a, b) -> None:
    """The two runs trained the same biases up to float rounding, and they did train."""
    pa, pb = (dict(r.model.named_parameters()) for r in (a, b))
    moved = 0.0
    for name, p in pa.items():
        if p.requires_grad:
            torch.testing.assert_close(pb[name], p, rtol=1e-5, atol=1e-6)
            moved += float(p.detach().abs().sum())
    assert moved > 0  # the biases (added, from zero) trained


def test_padding_to_the_window_length_gives_every_step_one_shape_and_the_same_model():
    """--pad-to-max-length: every physical batch the model sees is (rows, window length),
    whatever documents were drawn, and the trained biases are those of the run padded to
    each batch's longest window (same draws and noise: insecure seed)."""
    runs, widths = [], []
    for pad in (False, True):
        model = tiny_llama()
        seen: list[int] = []

        def record(m, a, kw, seen=seen):
            if torch.is_grad_enabled():  # training steps, not perplexity or samples
                seen.append(kw["input_ids"].shape[1])

        model.register_forward_pre_hook(record, with_kwargs=True)
        _, res = _run("document", model=model, insecure_reproducible_noise=True, seed=5,
                      pad_to_max_length=pad)  # fmt: skip
        runs.append(res)
        widths.append(seen)
    assert len(set(widths[0])) > 1  # unpadded, the shape follows the sampled documents
    assert set(widths[1]) == {32}
    _assert_same_trained_biases(*runs)


def test_collate_pads_to_the_given_width_and_refuses_longer_items():
    batch = make_collate(0, width=6)([torch.tensor([5, 6, 7]), torch.tensor([8])])
    assert batch["input_ids"].shape == (2, 6)
    assert batch["attention_mask"].sum(1).tolist() == [3, 1]
    assert (batch["labels"][:, 3:] == IGNORE).all()
    with pytest.raises(ValueError, match="longer than the padded width"):
        make_collate(0, width=2)([torch.tensor([5, 6, 7])])


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"task": "classification", "pad_to_max_length": True}, "--task causal-lm"),
        (
            {"task": "image-classification", "privacy_unit": "document"},
            "causal-lm or classification only",
        ),
        ({"task": "image-classification", "stride": 64}, "causal-lm or classification only"),
        ({"task": "causal-lm", "privacy_unit": "document", "mode": "full"}, "--mode bias"),
        ({"task": "causal-lm", "activation_checkpointing": True, "mode": "full"}, "--mode bias"),
    ],
)
def test_unsupported_combinations_are_refused_before_reading_data(changes, match):
    with pytest.raises(DPFitError, match=match):
        train(TrainConfig(**changes))


class _TinyTask(CausalLMTask):
    def _load_model(self, config):
        return tiny_llama(), CharTokenizer()


@pytest.mark.parametrize("flag", [{"privacy_unit": "document"}, {"pad_to_max_length": True}])
def test_document_flags_on_line_data_are_refused(flag):
    cfg = TrainConfig(task="causal-lm", max_length=32, **flag)
    with pytest.raises(DPFitError, match="--data convention-speeches"):
        _TinyTask().prepare(cfg)


def test_rotary_models_are_limited_by_their_position_count():
    """No learned position table (LLaMA): max_position_embeddings is the limit, enforced."""
    from dpfit.models import position_limit
    from dpfit.run.resolve import fit_max_length as _fit_max_length

    model = tiny_llama()  # 64 positions
    assert position_limit(model) == 64
    with pytest.raises(DPFitError, match="64 positions"):
        _fit_max_length(model, TrainConfig(task="causal-lm", max_length=65), True, print)
    assert _fit_max_length(model, TrainConfig(task="causal-lm", max_length=64), True, print)


def test_physical_batch_follows_the_length_unless_given():
    from dpfit.recipe import physical_batch_for, resolve_recipe
    from dpfit.run.resolve import fit_physical_batch as _fit_physical_batch

    recipe = resolve_recipe(10_000, 0, 8.0, 1e-5, 135_000_000)
    cfg = TrainConfig(task="causal-lm", max_length=2048).with_recipe(recipe)
    assert recipe.physical_batch_size > 1
    fitted = _fit_physical_batch(cfg, recipe, 135_000_000, False, lambda s: None)
    assert fitted.physical_batch_size == physical_batch_for(135_000_000, 2048) == 1
    assert fitted.batch_size == cfg.batch_size  # the logical batch is not touched
    assert _fit_physical_batch(cfg, recipe, 135_000_000, True, lambda s: None) == cfg


def test_jsonl_documents_are_read_one_per_line(tmp_path):
    import json

    from dpfit.tasks.causal_lm import read_documents

    path = tmp_path / "notes.jsonl"
    path.write_text("\n".join(json.dumps({"body": t}) for t in TEXTS[:5]) + "\n\n")
    texts, groups, _ = read_documents(
        TrainConfig(task="causal-lm", data=str(path), text_column="body")
    )
    # each line its own unit, keyed by its text (a line number would re-split every document
    # below an inserted line)
    assert texts == TEXTS[:5] and groups == [""] * 5
    with pytest.raises(DPFitError, match="--text-column"):
        read_documents(TrainConfig(task="causal-lm", data=str(path)))


def test_bundled_speeches_are_documents_by_name():
    from dpfit.data.bundled import convention_speeches
    from dpfit.tasks.causal_lm import read_documents

    texts, groups, what = read_documents(TrainConfig(task="causal-lm", data="convention-speeches"))
    assert len(texts) == len(convention_speeches()) == 189 and "convention-speeches" in what
    assert len(set(groups)) < len(texts)  # some speakers gave two speeches: one group each


# -- the document unit survives a kill ----------------------------------------


def _document_run_args(folder, data, out, *extra) -> list[str]:
    return [
        "train", "--task", "causal-lm", "--model", str(folder), "--data", str(data),
        "--max-length", "16", "--stride", "12", "--privacy-unit", "document",
        "--batch-size", "4", "--physical-batch-size", "3", "--epochs", "2", "--epsilon", "8",
        "--seed", "5", "--threads", "1", "--quiet", "--json", "--output", str(out),
        "--insecure-reproducible-noise", *extra,
    ]  # fmt: skip


def test_document_unit_resumes_after_sigkill_as_if_never_killed(tmp_path):
    """Kill a --privacy-unit document run with SIGKILL at a random moment (possibly with a
    logical batch's document sums half filled), resume it from its checkpoint: the ledger, the
    document sampler and the parameters continue as in the uninterrupted run, bit for bit."""
    folder = save_tiny_random_model(tmp_path / "llama", arch="llama")
    words = random.Random(0)
    data = tmp_path / "docs.jsonl"
    # 60 documents of 6 to 50 words: from one window to four, so most documents span windows
    # and a sampled document's windows can fall into different physical batches of 3
    data.write_text(
        "\n".join(
            json.dumps({"text": " ".join(words.choices(TINY_WORDS, k=6 + (i * 7) % 45))})
            for i in range(60)
        )
    )

    def final(out):
        params = load_file(str(out / "model" / "model.safetensors"))
        return params, json.loads((out / "metrics.json").read_text())

    assert main(_document_run_args(folder, data, tmp_path / "ref")) == 0
    ref_params, ref = final(tmp_path / "ref")
    assert ref["privacy_unit"] == "document"
    total = ref["steps"]
    assert total >= 20

    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    kill_at = rng.randint(1, total - 4)
    delay = rng.uniform(0, 0.05)
    ck = tmp_path / "ck"
    argv = _document_run_args(folder, data, tmp_path / "killed", "--checkpoint-dir", str(ck))
    killed_at = kill_after_checkpoint(argv, ck, kill_at, delay)
    assert killed_at < total, "killed after the last step: nothing left to resume"

    resumed_args = _document_run_args(
        folder, data, tmp_path / "resumed", "--checkpoint-dir", str(ck), "--resume"
    )
    assert main(resumed_args) == 0
    params, m = final(tmp_path / "resumed")
    msg = f"kill_at={kill_at}, delay={delay:.3f}, last checkpoint before kill={killed_at}"
    assert m["privacy_unit"] == "document" and m["train_documents"] == ref["train_documents"]
    assert_resumed_as_uninterrupted(
        tmp_path / "resumed", params, m, ref_params, ref, ("perplexity_after",), msg
    )
