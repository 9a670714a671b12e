"""Import a script of benchmarks/ as a module: the scripts are not a package, and tests check
their renderings against the committed results."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(script: str, module_name: str | None = None) -> ModuleType:
    """benchmarks/<script>.py, loaded fresh under `module_name` (default: the script's name)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # scripts import their siblings
    spec = importlib.util.spec_from_file_location(
        module_name or script, BENCHMARKS / f"{script}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module
