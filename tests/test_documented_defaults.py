"""The defaults README.md and docs/*.md state for `dpfit` commands, read from the parser (and
from the pure functions that resolve "recipe" / "auto" values), so that docs and code cannot
drift apart again as `--precision` did (docs said auto, the parser said fp32).

Parser and pure functions only: no training, no model loading, no data beyond a tiny CSV."""

import csv
import math
import re
from pathlib import Path

import pytest
import torch

from dpfit.cli import _evaluation_windows, _output_folder, build_parser
from dpfit.recipe import default_delta, resolve_recipe


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


# -- dpfit train -------------------------------------------------------------------------------


def test_train_precision_defaults_to_auto():
    """README.md Command line / docs/precision.md: `--precision auto|bf16|fp32` (default auto)."""
    assert parse("train").precision == "auto"


def test_train_privacy_defaults():
    """docs/train.md "The default run": epsilon 8 at delta = min(1e-5, 1/n^1.1), RDP accountant."""
    args = parse("train")
    assert args.epsilon == 8.0 and args.delta is None and args.noise_multiplier is None
    assert args.accountant == "rdp"
    for n in (100, 8530, 1_000_000):
        assert default_delta(n) == pytest.approx(min(1e-5, n**-1.1))


def test_train_neighbouring_defaults_to_add_remove():
    """docs/train.md, docs/threat-model.md: `--neighbouring` (default add-remove)."""
    assert parse("train").neighbouring == "add-remove"


def test_train_default_model_is_bundled_minilm_mean_pooled():
    """README.md / docs/train.md: the default model is the bundled all-MiniLM-L6-v2, mean-pooled."""
    from dpfit.data.bundled import minilm_path
    from dpfit.models import _resolve
    from dpfit.tasks.pooling import resolve_pooling

    args = parse("train")
    assert args.model is None and args.data is None and args.task == "classification"
    folder = _resolve(args.model)[0]
    assert folder == str(minilm_path()) and "minilm" in folder.lower()
    assert args.pooling == "auto"
    assert resolve_pooling(args.pooling, folder, None, False)[0] == "mean"


def test_train_mode_and_lora_defaults():
    """docs/vision.md "(default) --mode bias"; docs/bias_lora.md: rank 8, alpha 16."""
    args = parse("train")
    assert args.mode == "bias" and args.full_epochs == 0
    assert args.lora_r == 8 and args.lora_alpha == 16.0 and args.lora_targets is None


def test_train_output_defaults_to_new_run_folder(monkeypatch, tmp_path):
    """README.md Command line: `--output DIR` (default a new `runs/<task>-<date-time>/`)."""
    monkeypatch.setenv("DPFIT_RUNS_DIR", str(tmp_path))
    args = parse("train")
    assert args.output is None and not args.no_output
    out = Path(_output_folder(args))
    assert out.parent == tmp_path and not out.exists()
    assert re.fullmatch(r"classification-\d{8}-\d{6}", out.name)


def test_train_checkpoint_every_defaults_to_one():
    """docs/train.md Checkpoints: written after every `--checkpoint-every` steps (default 1)."""
    assert parse("train").checkpoint_every == 1


def test_train_threads_and_seed_defaults():
    """docs/train.md: `--threads N|auto` (auto), `--seed S` public randomness (0)."""
    args = parse("train")
    assert args.threads == "auto" and args.seed == 0
    assert not args.insecure_reproducible_noise


def test_train_lr_schedule_defaults_to_constant():
    """docs/train.md: `TrainConfig(lr_schedule=...)` (default "constant"; pretrain: cosine)."""
    from dpfit.train import TrainConfig

    assert TrainConfig().lr_schedule == "constant"


def test_train_window_defaults():
    """docs/long_documents.md: `--privacy-unit window` (default); `--stride` S = L; L = 128."""
    from dpfit.windows import window_shape

    args = parse("train")
    assert args.privacy_unit == "window" and args.stride is None and args.max_length is None
    assert window_shape(torch.nn.Linear(1, 1), args) == (128, 128)


def test_causal_lm_task_defaults():
    """docs/train.md Causal LM: two lines an example, 64 held out, 512 training examples."""
    from dpfit.tasks.causal_lm import CausalLMTask

    assert parse("train", "--task", "causal-lm").max_train_examples is None
    task = CausalLMTask()
    assert task.lines_per_example == 2
    assert task.eval_examples == 64 and task.default_train_examples == 512


def test_image_folder_geometry_defaults():
    """docs/vision.md Data: without --channels / --image-size, 3 channels at 32 x 32."""
    from dpfit.vision.data import FOLDER_CHANNELS, FOLDER_IMAGE_SIZE

    args = parse("train", "--task", "image-classification")
    assert args.channels is None and args.image_size is None
    assert (FOLDER_CHANNELS, FOLDER_IMAGE_SIZE) == (3, 32)


# -- the recipe (values the parser leaves at None) ---------------------------------------------


def test_private_recipe_defaults():
    """docs/train.md recipe table: B = 10 sqrt(n), >= 30 steps, automatic R = 1, lr 5e-3, 128."""
    args = parse("train")
    for flag in (
        "batch_size", "epochs", "lr", "max_grad_norm", "clipping", "head_first", "dropout"
    ):  # fmt: skip
        assert getattr(args, flag) is None  # left to the recipe
    assert args.optimizer == "adamw"
    r = resolve_recipe(10_000, 2, 8.0, 1e-5, 22_000_000)
    assert r.batch_size == 1000 and r.epochs == 3  # 10 sqrt(n); 30 steps
    assert r.clipping == "automatic" and r.max_grad_norm == 1.0
    assert r.optimizer == "adamw" and r.lr == 5e-3 and r.max_length == 128
    assert r.head_epochs == r.epochs and r.head_lr == 0.1
    assert r.dropout == 0.0  # docs/train.md: dropout off when private
    assert resolve_recipe(10_000, 2, 8.0, 1e-5, 22_000_000, tokens=False).dropout == "model"
    assert resolve_recipe(1_000, 2, 8.0, 1e-5, 22_000_000).batch_size == 100  # at most n/10
    assert resolve_recipe(100, 2, 8.0, 1e-5, 22_000_000).batch_size == 25  # n/4 on tiny data
    for mode in ("bias+lora", "lora"):  # head-first in every mode (docs/train.md)
        lora = resolve_recipe(10_000, 2, 8.0, 1e-5, 22_000_000, mode)
        assert lora.lr == 5e-3 and lora.head_epochs == lora.epochs
    full = resolve_recipe(10_000, 2, 8.0, 1e-5, 22_000_000, "full")
    assert full.lr == 5e-4 and full.head_epochs == full.epochs
    two = resolve_recipe(10_000, 2, 8.0, 1e-5, 22_000_000, full_epochs=1)
    assert two.full_lr == 5e-4 and two.lr == 5e-3


def test_non_private_recipe_defaults():
    """docs/train.md recipe table: non-private batch 32, 3 epochs, lr 1e-3 / 5e-5, LP-FT."""
    r = resolve_recipe(10_000, 2, None, None, 22_000_000, private=False)
    assert r.batch_size == 32 and r.epochs == 3 and r.lr == 1e-3 and r.clipping is None
    assert r.head_epochs == 3 and r.head_lr == 1e-2 and r.max_length == 128
    assert r.dropout == "model"  # the reference keeps the model's own rates
    full = resolve_recipe(10_000, 2, None, None, 22_000_000, "full", private=False)
    assert full.lr == 5e-5 and full.head_epochs == 3


def test_recipe_from_trained_checkpoint_and_language_model():
    """docs/train.md: trained start: no head-first, walk 1e-5 / 1e-4; LM: lr = 3e-3 / sqrt(T)."""
    r = resolve_recipe(10_000, 2, 8.0, 1e-5, 22_000_000, start="trained")
    steps = r.epochs * round(10_000 / r.batch_size)
    assert r.head_epochs == 0 and r.lr == pytest.approx(1e-4 / math.sqrt(steps))
    full = resolve_recipe(10_000, 2, 8.0, 1e-5, 22_000_000, "full", start="trained")
    assert full.lr == pytest.approx(1e-5 / math.sqrt(steps))
    lm = resolve_recipe(10_000, 0, 8.0, 1e-5, 135_000_000)
    assert lm.head_epochs == 0 and lm.lr == pytest.approx(3e-3 / math.sqrt(steps))
    assert resolve_recipe(1, 2, 8.0, 1e-5, 1, tokens=False).max_length is None  # images


# -- dpfit evaluate ----------------------------------------------------------------------------


def test_evaluate_window_defaults():
    """docs/long_documents.md: evaluate reads the model's windows, else truncates at 128."""
    args = parse("evaluate", "--model", "m")
    assert args.max_length is None and args.stride is None and args.data is None
    assert _evaluation_windows(args, None) == (128, None)
    record = {"window_length": 256, "stride": 200}
    assert _evaluation_windows(args, record) == (256, 200)
    other = parse("evaluate", "--model", "m", "--max-length", "64")
    assert _evaluation_windows(other, record) == (64, 64)  # another length: no overlap


# -- dpfit accountant --------------------------------------------------------------------------


def test_accountant_defaults():
    """README.md "RDP default, PLD option"; docs/threat-model.md: the default stays add-remove."""
    args = parse("accountant", "--epsilon", "8")
    assert args.accountant == "rdp" and args.neighbouring == "add-remove"


# -- dpfit federated ---------------------------------------------------------------------------


def test_federated_default_run():
    """docs/federated.md "Default run": DP-LAC, eps 8, N = 1000 IID x 10, m = 30, head, 10 rounds."""
    from dpfit.federated import cli as fcli

    args = parse("federated")
    assert args.engine == "local" and not args.model  # empty: the bundled MiniLM
    server, task = fcli.configs(args)
    assert server.method == "lac" and server.target_epsilon == 8.0 and server.delta == 1e-5
    assert server.accountant == "rdp"
    assert task.num_clients == server.num_clients == 1000
    assert task.partition == "iid" and task.examples_per_client == 10
    assert server.clients_per_round == 30 and server.rounds == 10
    assert task.local_mode == "head" and task.local_optimizer == "adamw"
    assert task.lr == 1e-2 and task.local_epochs == 2 and task.local_batch_size == 16


def test_federated_clip_rule_defaults():
    """docs/federated.md clip rules: decays 0.5, gamma 0.01, vote 10% over {0.25, 0.5, 1}, k 2."""
    from dpfit.federated import cli as fcli

    server, _ = fcli.configs(parse("federated"))
    assert server.clip_decay == 0.5 and server.noise_decay == 0.5
    assert server.auto_gamma == 0.01 and server.clac_significance == 2.0
    assert server.vote_budget_share == 0.1 and server.vote_noise_std is None
    assert tuple(server.vote_factors) == (0.25, 0.5, 1.0)


def test_federated_lr_by_local_mode():
    """docs/federated.md: without --lr, 1e-2 for head, 3e-3 for bias, 1e-3 for lora."""
    from dpfit.federated import cli as fcli

    for mode, lr in (("head", 1e-2), ("bias", 3e-3), ("lora", 1e-3)):
        _, task = fcli.configs(parse("federated", "--local-mode", mode))
        assert task.lr == lr


@pytest.fixture
def reviews(tmp_path):
    path = tmp_path / "reviews.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label", "user"])
        for i in range(45):
            w.writerow([f"review number {i}", "pos" if i % 2 else "neg", f"u{i % 5}"])
    return str(path)


def test_federated_user_data_defaults(reviews):
    """docs/federated.md: `--partition` (default iid), N = rows // 10; a client column: all rows."""
    from dpfit.federated.cli import DEFAULT_RUN
    from dpfit.federated.data_cli import data_options

    common = ("federated", "--data", reviews, "--eval-data", reviews, "--public-labels")
    synthetic = data_options(parse(*common), DEFAULT_RUN)
    assert synthetic["partition"] == "iid"
    assert synthetic["examples_per_client"] == 10 and synthetic["num_clients"] == 45 // 10
    natural = data_options(parse(*common, "--client-column", "user"), DEFAULT_RUN)
    assert natural["num_clients"] == 5 and natural["examples_per_client"] == 0  # 0: all


# -- dpfit audit -------------------------------------------------------------------------------


def test_audit_defaults():
    """docs/audit.md CPU cost: white-box, m = 1000, 256 real examples, max length 16, q = 1, 1 step."""
    from dpfit.audit import cli as audit_cli

    args = parse("audit")
    assert args.canaries == "white-box" and args.real_examples == 256 and args.max_length == 16
    assert args.score == "llr" and args.epsilon == 8.0 and args.model is None
    cfg = audit_cli._config(args)
    assert cfg.canaries == 1000 and cfg.steps == 1 and cfg.sample_rate == 1.0
    assert cfg.confidence == 0.95 and cfg.accountant == "rdp" and cfg.canary_scale == 10.0


# -- dpfit pretrain ----------------------------------------------------------------------------


def test_pretrain_defaults(tmp_path):
    """docs/vision.md "Pretraining defaults": batch 128, lr 2e-3, cosine, shift, epochs by n."""
    from dpfit.vision.cli import pretrain_config_from_args
    from dpfit.vision.pretrain import pretrain_epochs

    args = parse("pretrain", "--output", str(tmp_path / "pre"))
    assert args.model == "resnet-gn"
    config = pretrain_config_from_args(args)
    assert config.batch_size == 128 and config.physical_batch_size == 128
    assert config.lr == 2e-3 and config.optimizer == "adamw" and config.lr_schedule == "cosine"
    assert config.task_options.augment == "shift" and config.epochs is None
    assert config.non_private and config.mode == "full"
    assert pretrain_epochs(6_000) == 40 and pretrain_epochs(60_000) == 5
    assert 3 * math.ceil(6_000 / 128) == 141  # "3 passes of 6,000 images are 141 steps"
