"""Load a sequence-classification model and its tokenizer from a folder or a hub id.

Why a module of its own: the CLI, the benchmarks and the Trainer examples must load the
bundled MiniLM, a user's local folder, a GGUF file or a hub id the same way, and must fail
with a message that says what to do when the hub cannot be reached (it never can in CI).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dpfit.errors import DPFitError
from dpfit.saving import save_plain  # noqa: F401 - re-exported

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Names transformers gives the newly initialised classification head, per architecture
# family (BERT/RoBERTa/ELECTRA: classifier; DistilBERT adds pre_classifier; GPT-2/LLaMA: score).
HEAD_NAMES = ("pre_classifier", "classifier", "score", "head")  # "head": dpfit's PooledClassifier


class ModelLoadError(DPFitError, OSError):
    """The model or tokenizer could not be loaded; the message says why and what to try."""


@dataclass(frozen=True)
class LoadedModel:
    model: object  # transformers PreTrainedModel
    tokenizer: object
    source: str
    head_names: tuple[str, ...]
    pooling: str = "native"  # cls | pooler | mean | last, or the folder's own head
    pooling_reason: str = ""
    head_trained: bool = False  # a dpfit-saved classifier's own head, for the same classes
    dropout_note: str = ""  # what load_classifier(dropout=...) set (dpfit.dropout)


def hub_offline() -> bool:
    return any(
        os.environ.get(var, "").lower() in ("1", "true", "yes", "on")
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def default_model_path() -> Path:
    from dpfit.data.bundled import minilm_path

    return minilm_path()


def _resolve(name_or_path: str | os.PathLike | None) -> tuple[str, dict, bool]:
    """(what to pass to from_pretrained, extra kwargs, is_local)."""
    if name_or_path is None:
        return str(default_model_path()), {}, True
    p = Path(name_or_path).expanduser()
    if not p.exists():  # an existing path wins over a bundled model's short name
        from dpfit.data.bundled import bundled_model

        bundled = bundled_model(str(name_or_path))
        if bundled is not None:
            return str(bundled), {}, True
    if p.is_file() and p.suffix == ".gguf":
        return str(p.parent), {"gguf_file": p.name}, True
    if p.is_dir():
        return str(p), {}, True
    s = str(name_or_path)
    looks_like_path = s.startswith((".", "/", "~")) or s.count("/") > 1 or "\\" in s
    if p.exists() or looks_like_path:
        raise ModelLoadError(
            f"model {s!r} is not a folder with a transformers model (config.json + weights); "
            "check the path, or pass a hub id like 'org/name'"
        )
    _check_hub_name(s)
    return s, {}, False


def check_model_name(name_or_path: str | os.PathLike | None) -> None:
    """Refuse at once a --model that names nothing loadable (a typo of a bundled name, a
    missing path, a hub id while offline and not cached), before any data is read. Loads
    nothing: an existing path, a bundled name or a possible hub id passes."""
    if not name_or_path:
        return
    from dpfit.data.bundled import BUNDLED_MODELS

    p = Path(name_or_path).expanduser()
    if p.exists() or str(name_or_path).strip().lower() in BUNDLED_MODELS:
        return
    _resolve(name_or_path)  # raises for a path that is not there and for a name as above


def _check_hub_name(name: str) -> None:
    """Fail at once, listing the bundled names, for a name that cannot be a model we can
    get: not in the hub cache and either offline (nothing to download) or a near miss of a
    bundled name (a typo would otherwise wait on the network, then blame it)."""
    import difflib

    from dpfit.data.bundled import BUNDLED_MODELS

    if _hub_cached(name):
        return
    near = difflib.get_close_matches(name.strip().lower(), BUNDLED_MODELS, n=1, cutoff=0.6)
    if not near and not hub_offline():
        return
    bundled = ", ".join(BUNDLED_MODELS)
    hint = f"did you mean {near[0]!r}? " if near else ""
    where = "" if near else " and the hub is off (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE set)"
    raise ModelLoadError(
        f"model {name!r} is not a bundled model ({bundled}), a local folder or a model in "
        f"the hub cache{where}; {hint}pass --model {bundled.replace(', ', ' or --model ')}, "
        "or a folder"
    )


def _hub_cached(name: str) -> bool:
    """Whether `name` is a hub id with a config.json in the local hub cache."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on it
        return False
    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


def head_module_names(model) -> tuple[str, ...]:
    """The top-level head modules this model has, to keep trainable next to the biases."""
    children = dict(model.named_children())
    return tuple(n for n in HEAD_NAMES if n in children)


def load_tokenizer(name_or_path: str | os.PathLike | None = None):
    from transformers import AutoTokenizer

    target, kwargs, local = _resolve(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(
            target, local_files_only=local or hub_offline(), **kwargs
        )
    except (OSError, ValueError) as e:
        raise _load_error(target, local, "tokenizer", e) from e
    _ensure_pad_token(tok)
    return tok


def _ensure_pad_token(tokenizer) -> None:
    # Decoder-only models (GPT-2, LLaMA) ship without a pad token; batching needs one.
    if getattr(tokenizer, "pad_token", None) is None:
        if getattr(tokenizer, "eos_token", None) is None:
            raise ModelLoadError("the tokenizer has neither a pad nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token


def _load_error(target: str, local: bool, what: str, e: Exception) -> ModelLoadError:
    if local:
        return ModelLoadError(f"could not load the {what} from {target!r}: {e}")
    if hub_offline():
        return ModelLoadError(
            f"{target!r} is not a local folder and the hub is off (HF_HUB_OFFLINE / "
            f"TRANSFORMERS_OFFLINE set) and it is not in the local cache; pass a local folder "
            f"(e.g. one written by save_pretrained) with --model. ({e})"
        )
    return ModelLoadError(
        f"could not load the {what} {target!r} from the hub ({e}); if this machine is "
        "offline, pass a local folder with --model"
    )


def load_classifier(
    name_or_path: str | os.PathLike | None = None,
    label_names: Sequence[str] | None = None,
    *,
    seed: int | None = None,
    pooling: str = "auto",
    dropout: float | str | None = None,
) -> LoadedModel:
    """A classifier (backbone -> pooling -> zero-initialised linear head) + tokenizer.

    Args:
        name_or_path: local folder, a ``.gguf`` file, a hub id, a bundled model's short name
            (``minilm``, ``smollm2``), or None for the bundled MiniLM.
        label_names: the task's classes. None keeps a saved model's own labels and head
            (evaluation); a folder dpfit saved keeps its head when the labels are the same.
        seed: seeds torch before the model is built (dropout-free parts are deterministic).
        pooling: auto | cls | pooler | mean | last (dpfit.tasks.pooling.resolve_pooling).
        dropout: a rate for every dropout rate in the backbone's config, set before it is
            built (dpfit.dropout); None or "model": the saved rates.

    A transformers ``*ForSequenceClassification`` folder that dpfit did not write is loaded
    with its own head when `label_names` is None, so ``dpfit evaluate`` scores it as it is.
    """
    import torch
    from transformers import AutoConfig, AutoModel

    from dpfit.dropout import MODEL as MODEL_DROPOUT
    from dpfit.dropout import note as dropout_note
    from dpfit.dropout import set_config_rates
    from dpfit.tasks.pooling import (
        CONFIG_KEY,
        PooledClassifier,
        has_trained_pooler,
        is_pooled_classifier_folder,
        load_head,
        resolve_pooling,
    )

    target, kwargs, local = _resolve(name_or_path)
    offline = local or hub_offline()
    try:
        config = AutoConfig.from_pretrained(target, local_files_only=offline, **kwargs)
    except (OSError, ValueError) as e:
        raise _load_error(target, local, "model config", e) from e
    saved_by_dpfit = local and is_pooled_classifier_folder(target)
    if label_names is None and not saved_by_dpfit:
        return _load_native_classifier(target, kwargs, local, config, name_or_path)
    tokenizer = load_tokenizer(name_or_path)
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id
    own = [str(config.id2label[i]) for i in range(config.num_labels)] if saved_by_dpfit else None
    names = list(label_names) if label_names is not None else own
    rate = MODEL_DROPOUT if dropout is None else dropout
    if rate != MODEL_DROPOUT:
        set_config_rates(config, rate)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        backbone, info = AutoModel.from_pretrained(
            target, config=config, local_files_only=offline, output_loading_info=True, **kwargs
        )
    except (OSError, ValueError) as e:
        raise _load_error(target, local, "model", e) from e
    _restore_added_biases(backbone, target, local)
    if saved_by_dpfit:
        how, why = getattr(config, CONFIG_KEY), "saved with the model"
    else:
        how, why = resolve_pooling(
            pooling,
            target if local else None,
            config,
            has_trained_pooler(backbone, info.get("missing_keys", ())),
        )
    config = backbone.config  # from_pretrained may have copied the one passed in
    config.num_labels = len(names)
    config.id2label = dict(enumerate(names))
    config.label2id = {n: i for i, n in enumerate(names)}
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id
    model = PooledClassifier(backbone, len(names), how)
    head_trained = bool(saved_by_dpfit and names == own)
    if head_trained:
        load_head(model, target)
    logger.info("loaded %s (%s), pooling %s (%s)", target, type(backbone).__name__, how, why)
    return LoadedModel(
        model, tokenizer, target, ("head",), how, why, head_trained,
        dropout_note(backbone, config, rate),
    )  # fmt: skip


def _load_native_classifier(target, kwargs, local, config, name_or_path) -> LoadedModel:
    from transformers import AutoModelForSequenceClassification

    tokenizer = load_tokenizer(name_or_path)
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            target, config=config, local_files_only=local or hub_offline(), **kwargs
        )
    except (OSError, ValueError) as e:
        raise _load_error(target, local, "model", e) from e
    _restore_added_biases(model, target, local)
    return LoadedModel(model, tokenizer, target, head_module_names(model), "native", "its own head")


def _restore_added_biases(model, folder: str, local: bool) -> None:
    """A model saved after BiTFiT-Add records its added biases in its config; re-add them."""
    try:
        from dpfit import biases
    except ImportError:  # pragma: no cover - older builds without BiTFiT-Add
        return
    if local and getattr(model.config, biases.CONFIG_KEY, None):
        biases.restore_added_biases(model, folder)


def count_bias_parameters(model, exclude: Sequence[str] = ()) -> int:
    """Number of bias entries outside the `exclude` top-level modules (e.g. the new head)."""
    total = 0
    for name, p in model.named_parameters():
        if name.split(".", 1)[0] in exclude:
            continue
        if name.endswith("bias"):
            total += p.numel()
    return total


TINY_WORDS = (
    "good bad great awful fine poor nice terrible dull fun boring superb movie film plot "
    "actor story the a is was very not and it this"
).split()


def save_tiny_random_model(
    folder: str | os.PathLike,
    arch: str = "bert",
    seed: int = 0,
    sentence_pooling: str | None = None,
) -> Path:
    """Write a tiny random model + word-level tokenizer to `folder`, for fast smoke tests.

    Offline and in well under a second, so CLI and Trainer tests need no download. `arch`:
    "bert" (encoder with biases), "gpt2" (decoder, Conv1D, biases), "llama" (no biases).
    `sentence_pooling` ("mean" or "cls") also writes the sentence-transformers files
    (modules.json, 1_Pooling/config.json), like the bundled MiniLM.
    """
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertTokenizerFast,
        GPT2Config,
        GPT2ForSequenceClassification,
        LlamaConfig,
        LlamaForSequenceClassification,
        PreTrainedTokenizerFast,
    )

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if arch == "bert":
        vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *TINY_WORDS]
        tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)})
        config = BertConfig(
            vocab_size=len(vocab),
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=64,
        )
        model = BertForSequenceClassification(config)
    elif arch in ("gpt2", "llama"):
        from tokenizers import Tokenizer, models, pre_tokenizers

        vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", *TINY_WORDS])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>"
        )
        if arch == "gpt2":
            config = GPT2Config(
                vocab_size=len(vocab),
                n_embd=16,
                n_layer=2,
                n_head=2,
                n_positions=64,
                eos_token_id=1,
                bos_token_id=1,
                pad_token_id=1,
            )
            model = GPT2ForSequenceClassification(config)
        else:
            config = LlamaConfig(
                vocab_size=len(vocab),
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                max_position_embeddings=64,
                eos_token_id=1,
                bos_token_id=1,
                pad_token_id=1,
            )
            model = LlamaForSequenceClassification(config)
    else:
        raise ValueError(f"arch must be bert, gpt2 or llama, got {arch!r}")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if sentence_pooling is not None:
        _write_sentence_transformers_files(folder, sentence_pooling)
    return folder


def _write_sentence_transformers_files(folder: Path, pooling: str) -> None:
    import json

    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    flags = {
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_cls_token": pooling == "cls",
    }
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(flags))


def save_tiny_gguf_model(path: str | os.PathLike, seed: int = 0) -> Path:
    """Write a tiny random LLaMA as a ``.gguf`` file (float32 tensors, a SentencePiece-style
    vocabulary of :data:`TINY_WORDS` and letters), for tests of the GGUF path. Needs `gguf`."""
    import gguf
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens = ["<unk>", "<s>", "</s>", *TINY_WORDS, *"abcdefghijklmnopqrstuvwxyz "]
    vocab, width, ffn, layers, heads = len(tokens), 16, 32, 2, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(width)
    w.add_feed_forward_length(ffn)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(width // heads)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [1] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    rng = np.random.default_rng(seed)

    def rand(name: str, shape: tuple[int, ...]) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    rand("token_embd.weight", (vocab, width))
    for i in range(layers):
        for name, shape in (
            ("attn_q", (width, width)),
            ("attn_k", (width, width)),
            ("attn_v", (width, width)),
            ("attn_output", (width, width)),
            ("ffn_gate", (ffn, width)),
            ("ffn_up", (ffn, width)),
            ("ffn_down", (width, ffn)),
        ):
            rand(f"blk.{i}.{name}.weight", shape)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(width, np.float32))
    w.add_tensor("output_norm.weight", np.ones(width, np.float32))
    rand("output.weight", (vocab, width))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_sentiment_csv(
    path: str | os.PathLike, n: int = 200, seed: int = 0, labels: tuple[str, str] = ("neg", "pos")
) -> Path:
    """A learnable toy sentiment CSV (text,label) matching :func:`save_tiny_random_model`'s words."""
    import csv
    import random

    rng = random.Random(seed)
    pos, neg = (
        ("good", "great", "fine", "nice", "superb", "fun"),
        ("bad", "awful", "poor", "terrible", "dull", "boring"),
    )
    path = Path(path)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for _ in range(n):
            y = rng.random() < 0.5
            word = rng.choice(pos if y else neg)
            w.writerow(
                [
                    f"the {rng.choice(('movie', 'film', 'plot'))} was {word} {rng.choice(TINY_WORDS)}",
                    labels[int(y)],
                ]
            )
    return path


def position_limit(model: torch.nn.Module) -> int | None:
    """Tokens the model can read: the size of its learned position table (RoBERTa's starts
    after its padding index); for models without one (rotary), the config's
    max_position_embeddings (SmolLM2: 8,192); else None (relative positions)."""
    import torch

    limits = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in (
            "position_embeddings",
            "wpe",
            "embed_positions",
        ):
            offset = module.padding_idx + 1 if module.padding_idx is not None else 0
            limits.append(module.num_embeddings - offset)
    if limits:
        return min(limits)
    config = getattr(getattr(model, "backbone", model), "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) else None
