"""mode="bias+lora" (and "lora"): peft LoRA adapters through the full-mode samplers, biases
from the backward pass, the head as in bias mode, all under one per-example global norm.

Every check is against the microbatch-of-one oracle in float64 (each example alone), for
BERT-, GPT-2- and LLaMA-style tiny random models wrapped by peft, on both branches of the
full-mode rule (ghost norms from the factors, or rows materialised in the hook).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import Capture, make_engine, oracle_per_example
from sigkill import as_if_crashed_after
from torch import nn

import dpfit
from dpfit.errors import NoTrainableParametersError
from dpfit.grad_sample import full
from dpfit.grad_sample.full import OuterGrad, norm_sampler_for
from dpfit.params import in_peft_head, is_bias, is_lora

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

DT = torch.float64
REL = 1e-5
B, T, VOCAB = 3, 6, 50


@pytest.fixture(params=["ghost", "explicit"])
def branch(request, monkeypatch):
    """Force the full-mode rule's choice for the LoRA rows: factors kept, or materialised."""
    monkeypatch.setattr(full, "ghost_is_cheaper", lambda *shape: request.param == "ghost")
    return request.param


def bert():
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=16, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(cfg), ["query", "value"]


def gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    return transformers.GPT2ForSequenceClassification(cfg), ["c_attn"]


def llama():
    # LLaMA has no biases by default; its bias-carrying variant (Qwen-like) keeps the shape
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attention_bias=True, mlp_bias=True, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForSequenceClassification(cfg), ["q_proj", "v_proj"]


MODELS = {"bert": bert, "gpt2": gpt2, "llama": llama}


def lora_model(name: str, mode: str = "bias+lora", r: int = 4, freeze_a: bool = False) -> nn.Module:
    torch.manual_seed(11)
    base, targets = MODELS[name]()
    cfg = peft.LoraConfig(
        task_type="SEQ_CLS", r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=targets,
        fan_in_fan_out=name == "gpt2",  # GPT-2's Conv1D stores its weight transposed
    )  # fmt: skip
    model = peft.get_peft_model(base, cfg)
    # peft starts lora_B at zero, which would leave lora_A's gradient zero: move it off
    for n, p in model.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.2)
    dpfit.make_lora_trainable(model, biases=mode == "bias+lora", freeze_a=freeze_a)
    return model.to(DT).train()


def batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (B, T), generator=g)
    return ids, torch.tensor([0, 2, 1])


def cls_loss(model, ids, y):
    return F.cross_entropy(model(input_ids=ids).logits, y, reduction="sum")


def dense(g) -> torch.Tensor:
    return g.materialize() if isinstance(g, OuterGrad) else g


@pytest.mark.parametrize("freeze_a", [False, True], ids=["lora", "ffa"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_per_example_rows_match_oracle(name, branch, freeze_a):
    model = lora_model(name, freeze_a=freeze_a)
    ids, y = batch()
    want = oracle_per_example(model, lambda i: cls_loss(model, ids[i : i + 1], y[i : i + 1]), B)
    engine = make_engine(model, mode="bias+lora")
    try:
        model.zero_grad(set_to_none=True)
        cls_loss(model, ids, y).backward()
        per = engine._collect()
    finally:
        engine.detach()
    names = {p: n for n, p in model.named_parameters()}
    got = {names[p]: g for p, g in per.items()}
    assert set(got) == set(want)
    lora = [n for n in got if is_lora(n)]
    assert lora and any(is_bias(n) and not in_peft_head(n) for n in got)
    assert any("lora_A" in n for n in lora) != freeze_a  # FFA-LoRA: lora_B rows only
    # the LoRA rows took the full-mode path: kept factored on the ghost branch only
    assert all(isinstance(got[n], OuterGrad) == (branch == "ghost") for n in lora)
    for n, w in want.items():
        err = (dense(got[n]).to(DT) - w).abs().max() / w.abs().max().clamp_min(1e-12)
        assert err <= REL, f"{n}: relative error {err:.2e}"


def oracle_clipped_sum(model, ids, y, r):
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(B):
        model.zero_grad(set_to_none=True)
        cls_loss(model, ids[i : i + 1], y[i : i + 1]).backward()
        rows.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                     for p in params])  # fmt: skip
    model.zero_grad(set_to_none=True)
    norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in gs)) for gs in rows])
    c = (r / norms).clamp(max=1.0)
    return {p: sum(c[i] * rows[i][j] for i in range(B)) for j, p in enumerate(params)}, norms


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_global_clip_over_biases_lora_and_head(name, branch):
    """sigma=0, a clip norm below every example's: the released sum is the oracle's sum of
    examples each clipped to R by its norm over biases, adapters and head together."""
    model = lora_model(name)
    ids, y = batch()
    _, norms = oracle_clipped_sum(model, ids, y, 1e9)
    r = float(norms.min()) * 1e-2
    want, _ = oracle_clipped_sum(model, ids, y, r)
    engine = make_engine(model, mode="bias+lora", max_grad_norm=r, expected_batch_size=B)
    opt = Capture(engine.parameters())
    try:
        cls_loss(model, ids, y).backward()
        engine.step(opt, batch_size=B)
    finally:
        engine.detach()
    assert set(opt.grads) == set(want)
    for p, w in want.items():
        g = opt.grads[p].to(DT) * B  # the engine divides by the expected batch size
        assert (g - w).norm() <= REL * w.norm() + 1e-12 * r, p.shape


def test_trainable_set_is_biases_lora_and_head():
    model = lora_model("bert")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(is_bias(n) or is_lora(n) or in_peft_head(n) for n in names)
    assert not any("original_module" in n for n in names)  # peft's frozen copy of the head
    assert all(p.requires_grad for n, p in model.named_parameters() if is_lora(n))
    frozen_biases = [
        n for n, p in model.named_parameters()
        if is_bias(n) and not p.requires_grad and "original_module" not in n
    ]  # fmt: skip
    assert not frozen_biases
    head = [n for n in names if in_peft_head(n)]
    assert {n.rsplit(".", 1)[-1] for n in head} == {"weight", "bias"}


@pytest.mark.parametrize("mode", ["bias+lora", "lora"])
def test_freeze_a_trains_lora_b_only(mode):
    """FFA-LoRA: every lora_A keeps its initial values frozen, every lora_B trains; the rest
    of the trainable set is the mode's."""
    model = lora_model("bert", mode=mode, freeze_a=True)
    a = [p for n, p in model.named_parameters() if is_lora(n) and "lora_A" in n]
    b = [p for n, p in model.named_parameters() if is_lora(n) and "lora_B" in n]
    assert a and b and not any(p.requires_grad for p in a) and all(p.requires_grad for p in b)
    biases = [n for n, p in model.named_parameters()
              if p.requires_grad and is_bias(n) and not in_peft_head(n)]  # fmt: skip
    assert bool(biases) == (mode == "bias+lora")
    engine = make_engine(model, mode=mode)
    try:
        planned = {plan.name for plan in engine._plans.values()}
    finally:
        engine.detach()
    assert not any(n.endswith("lora_A.default") for n in planned)
    assert any(n.endswith("lora_B.default") for n in planned)


def test_lora_only_mode_trains_adapters_and_head():
    model = lora_model("llama", mode="lora")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(is_lora(n) or in_peft_head(n) for n in names)
    engine = make_engine(model, mode="lora")
    try:
        fns = {plan.name: plan.weight_fn for plan in engine._plans.values()}
    finally:
        engine.detach()
    lora = {k: v for k, v in fns.items() if is_lora(k)}
    assert lora and all(fn is full.linear_outer for fn in lora.values())
    # the head keeps bias mode's explicit sampler, not the factored one
    assert all(fn is None for k, fn in fns.items() if in_peft_head(k))


def test_adapters_use_factored_samplers_and_head_explicit():
    model = lora_model("bert")
    engine = make_engine(model, mode="bias+lora")
    try:
        plans = {plan.name: plan for plan in engine._plans.values()}
    finally:
        engine.detach()
    for name, plan in plans.items():
        module = model.get_submodule(name)
        if is_lora(name):
            assert plan.weight_fn is norm_sampler_for(module), name
        else:
            assert plan.weight_fn is None, name
        if not is_lora(name) and not in_peft_head(name):
            # biases come from the output gradient alone: no input kept for the backward
            assert not plan.needs_input and set(plan.params) == {"bias"}, name


def test_bias_lora_without_biases_is_an_error():
    torch.manual_seed(0)
    base, targets = bert()
    model = peft.get_peft_model(
        base, peft.LoraConfig(task_type="SEQ_CLS", r=2, target_modules=targets)
    )  # peft's default: bias="none"
    with pytest.raises(NoTrainableParametersError, match="make_lora_trainable"):
        make_engine(model, mode="bias+lora")
    make_engine(model, mode="lora").detach()  # that selection is LoRA-only


def test_lora_modes_without_adapters_are_an_error():
    base, _ = bert()
    dpfit.make_bias_trainable(base, train_head=("classifier",))
    with pytest.raises(NoTrainableParametersError, match="peft"):
        make_engine(base, mode="bias+lora")
    with pytest.raises(NoTrainableParametersError, match="peft"):
        dpfit.make_lora_trainable(base)


# --------------------------------------------------------------------------- dpfit train
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from dpfit.models import save_tiny_random_model, write_tiny_sentiment_csv

    root = tmp_path_factory.mktemp("lora_cli")
    return (
        str(save_tiny_random_model(root / "model")),
        str(write_tiny_sentiment_csv(root / "train.csv", n=120, seed=0)),
        str(write_tiny_sentiment_csv(root / "test.csv", n=40, seed=1)),
    )


@pytest.mark.parametrize("mode", ["bias+lora", "lora"])
def test_cli_trains_saves_a_merged_model_that_evaluates(tiny_run, tmp_path, capsys, mode):
    import json

    from dpfit.cli import main

    model, data, test = tiny_run
    out = tmp_path / "run"
    args = ["train", "--model", model, "--data", data, "--eval-data", test, "--epochs", "1",
            "--batch-size", "30", "--physical-batch-size", "16", "--threads", "1", "--quiet",
            "--mode", mode, "--lora-r", "2", "--output", str(out)]  # fmt: skip
    assert main(args) == 0
    capsys.readouterr()
    m = json.loads((out / "metrics.json").read_text())
    record = json.loads((out / "model" / "dpfit.json").read_text())
    names = record["trained_parameters"]
    # private bias+lora trains lora_B only by default (FFA-LoRA, dpfit.recipe); lora both
    assert any("lora_A" in n for n in names) == (mode == "lora")
    assert any("lora_B" in n for n in names)
    assert m["recipe"]["lora_freeze_a"] == (mode == "bias+lora")
    assert "head.weight" in names
    biases = [n for n in names if is_bias(n) and not n.startswith("head.")]
    assert bool(biases) == (mode == "bias+lora")
    assert all(is_lora(n) or is_bias(n) or n.startswith("head.") for n in names)
    assert m["epsilon"] <= 8.0 + 1e-6
    # the adapters were folded into the weights: the folder is the plain model again
    assert main(["evaluate", "--model", str(out / "model"), "--data", test, "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["accuracy"] == pytest.approx(m["accuracy"])


def test_cli_freeze_a_trains_lora_b_and_is_refused_outside_the_lora_modes(
    tiny_run, tmp_path, capsys
):
    import json

    from dpfit.cli import main

    model, data, test = tiny_run
    out = tmp_path / "run"
    base = ["train", "--model", model, "--data", data, "--eval-data", test, "--epochs", "1",
            "--batch-size", "30", "--physical-batch-size", "16", "--threads", "1", "--quiet",
            "--lora-r", "2", "--lora-freeze-a"]  # fmt: skip
    assert main([*base, "--mode", "bias+lora", "--output", str(out)]) == 0
    capsys.readouterr()
    m = json.loads((out / "metrics.json").read_text())
    assert m["config"]["lora_freeze_a"] is True
    names = json.loads((out / "model" / "dpfit.json").read_text())["trained_parameters"]
    assert not any("lora_A" in n for n in names) and any("lora_B" in n for n in names)
    assert main([*base, "--mode", "bias", "--output", str(tmp_path / "bias")]) != 0
    assert "--lora-freeze-a applies to --mode bias+lora or lora" in capsys.readouterr().err
    assert not (tmp_path / "bias").exists()


def test_merge_lora_keeps_the_function():
    from dpfit.params import merge_lora

    model = lora_model("gpt2")
    ids, _ = batch()
    model.eval()
    with torch.no_grad():
        before = model(input_ids=ids).logits
        assert merge_lora(model) == 2  # c_attn in each of the two layers
        after = model(input_ids=ids).logits
    assert not any(is_lora(n) for n, _ in model.named_parameters())
    torch.testing.assert_close(after, before, rtol=1e-9, atol=1e-12)


def test_unknown_lora_targets_are_one_clear_error():
    from dpfit.errors import LoraTargetError
    from dpfit.params import add_lora

    base, _ = bert()
    with pytest.raises(LoraTargetError, match="no_such_proj"):
        add_lora(base, 2, 4.0, ["no_such_proj"])


def test_lora_on_embeddings_is_refused_by_name():
    """peft's embedding adapters are bare parameters with no per-example sampler."""
    from dpfit.errors import UnsupportedLayerError

    base, _ = bert()
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=2, target_modules=["query", "word_embeddings"])
    )
    dpfit.make_lora_trainable(model)
    with pytest.raises(UnsupportedLayerError, match="lora_embedding_A"):
        make_engine(model, mode="bias+lora")


@pytest.mark.parametrize("private", [True, False])
def test_recipe_gives_the_lora_modes_bias_modes_rate(private):
    from dpfit.recipe import resolve_recipe

    def lr(mode):
        return resolve_recipe(10_000, 2, 8.0, 1e-5, 22_700_000, mode, private=private).lr

    assert lr("bias+lora") == lr("lora") == lr("bias") != lr("full")


def test_resume_reinjects_the_adapters_and_ends_where_the_run_ends(tiny_run, tmp_path, capsys):
    """A checkpoint holds the unmerged adapters; --resume injects them again and, with the
    noise seeded, finishes with the same merged model as the uninterrupted run."""
    import shutil

    from safetensors.torch import load_file

    from dpfit.cli import main

    model, data, _ = tiny_run

    def run(out, ck, *extra):
        args = ["train", "--model", model, "--data", data, "--batch-size", "16",
                "--physical-batch-size", "16", "--seed", "3", "--epsilon", "4", "--threads",
                "1", "--quiet", "--json", "--insecure-reproducible-noise", "--epochs", "1",
                "--no-head-first", "--mode", "bias+lora", "--lora-r", "2",
                "--output", str(out), "--checkpoint-dir", str(ck), *extra]  # fmt: skip
        assert main(args) == 0, capsys.readouterr().err

    run(tmp_path / "a", tmp_path / "cka")
    from dpfit import checkpoint as ckpt

    (_, first), _ = ckpt.list_checkpoints(tmp_path / "cka")[-2:]  # one step before the end
    (tmp_path / "ckb").mkdir()
    shutil.copy(first, tmp_path / "ckb" / first.name)
    run(tmp_path / "b", tmp_path / "ckb", "--resume")
    a, b = (load_file(str(tmp_path / d / "model" / "model.safetensors")) for d in "ab")
    assert set(a) == set(b) and not any(is_lora(k) for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)


def test_resume_keeps_freeze_a_and_reads_older_checkpoints_as_training_lora_a(
    tiny_run, tmp_path, capsys
):
    """lora_freeze_a is part of the checkpoint's settings; a checkpoint written before it
    existed trained every LoRA matrix: a resume under today's default (A frozen in private
    bias+lora) is refused, not silently changed, and --no-lora-freeze-a resumes it."""
    from dpfit import checkpoint as ckpt
    from dpfit.cli import main

    model, data, _ = tiny_run
    ck = tmp_path / "ck"

    def run(out, *extra):
        args = ["train", "--model", model, "--data", data, "--batch-size", "16",
                "--physical-batch-size", "16", "--epochs", "1", "--max-steps", "2",
                "--no-head-first", "--threads", "1", "--quiet", "--mode", "bias+lora",
                "--lora-r", "2", "--output", str(tmp_path / out), "--checkpoint-dir", str(ck),
                *extra]  # fmt: skip
        return main(args)

    assert run("a", "--no-lora-freeze-a") == 0  # both matrices, as runs before the rule
    as_if_crashed_after(ck, 1)  # killed after step 1: one step left
    assert run("b", "--resume") == 2
    assert "lora_freeze_a: False -> True" in capsys.readouterr().err
    path = ckpt.latest_checkpoint(ck)
    state = ckpt.load_checkpoint(path)
    del state["config"]["lora_freeze_a"]
    torch.save(state, path)
    assert run("c", "--resume") == 2
    assert "lora_freeze_a: False -> True" in capsys.readouterr().err
    assert run("d", "--resume", "--no-lora-freeze-a") == 0, capsys.readouterr().err
