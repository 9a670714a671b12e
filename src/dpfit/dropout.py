"""Dropout rates set where a transformers model reads them: its config, before it is built.

Why not set ``nn.Dropout.p`` on a built model: some architectures keep the attention rate as a
plain float read from the config (LLaMA's ``attention_dropout``), and changing a user's
modules after the fact is monkey-patching. A config attribute is a dropout rate when its name
says so (``*dropout*``, ``*_pdrop``) and its value is a float; ``None`` values (BERT's
``classifier_dropout``: "use the hidden rate") are left alone, so they follow.
"""

from __future__ import annotations

from typing import Any

from torch import nn

MODEL = "model"  # keep the rates the model was saved with


def is_rate_name(name: str) -> bool:
    return "dropout" in name or name.endswith("pdrop")


def config_rates(config: Any) -> dict[str, float]:
    """The config's dropout rates by attribute name (nested sub-configs not included)."""
    return {
        k: float(v)
        for k, v in vars(config).items()
        if is_rate_name(k) and isinstance(v, float | int) and not isinstance(v, bool)
    }


def set_config_rates(config: Any, rate: float) -> tuple[str, ...]:
    """Set every dropout rate of `config` to `rate`, in place; the names set."""
    names = tuple(sorted(config_rates(config)))
    for k in names:
        setattr(config, k, float(rate))
    return names


def modules_off_rate(model: nn.Module, rate: float) -> list[str]:
    """Dropout modules whose rate is not `rate` (built from something other than the config)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p != rate]


def describe(rate: float | str, names: tuple[str, ...], stray: list[str]) -> str:
    """The run note: what was set, and what a config could not reach."""
    if rate == MODEL:
        return "dropout: the model's own rates"
    what = "off" if rate == 0 else f"{rate:g}"
    where = ", ".join(names) if names else "no dropout rate in the model's config"
    msg = f"dropout: {what} ({where})"
    if stray:
        shown = ", ".join(stray[:4]) + (f" and {len(stray) - 4} more" if len(stray) > 4 else "")
        msg += (
            f"; {len(stray)} dropout modules keep their own rate (not set by the config: {shown})"
        )
    return msg


def note(model: nn.Module, config: Any, rate: float | str) -> str:
    """The run note for `model` built from `config` with `rate` (set_config_rates)."""
    if rate == MODEL:
        return describe(MODEL, (), [])
    return describe(rate, tuple(sorted(config_rates(config))), modules_off_rate(model, rate))


def check_rate(value: float | str | None) -> None:
    """A dropout setting is None (the recipe's), "model", or a rate in [0, 1)."""
    if value is None or value == MODEL:
        return
    if isinstance(value, str) or not 0 <= float(value) < 1:
        raise ValueError(f"dropout must be a rate in [0, 1) or {MODEL!r}, got {value!r}")


def parse_rate(text: str) -> float | str:
    """A dropout setting as typed on a command line: "model" or a rate in [0, 1)."""
    if text == MODEL:
        return text
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"expected a rate in [0, 1) or {MODEL!r}, got {text!r}") from None
    check_rate(rate)
    return rate
