"""Long texts cut into windows, for every task that reads them (causal LM, classification).

One place for how a document is cut (`windows`), how long a window is and how far apart they
start (`window_shape`), how the windows become training items for a privacy unit
(`training_items`: one item a window, or one item a document's windows, which the engine
samples and clips as one), and what of this a run may publish (`describe_windows`,
`window_metrics`): the number of windows follows the private documents' lengths, so it is
published only where it is n (privacy unit "window", public by declaration).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from dpfit.errors import DPFitError

PRIVACY_UNITS = ("window", "document", "user")
# units whose training item is a list of rows (a document's windows; a user's rows, or their
# windows): the engine samples the item and sums and clips its rows as one contribution
GROUPED_UNITS = ("document", "user")


class Window(NamedTuple):
    """A stretch of a long document: its tokens, and how many of the first ones are context
    only (they were targets in the window before, and are not targets again)."""

    ids: Any  # a 1-D tensor or a list of token ids
    context: int = 0


def windows(ids: Sequence[int], max_length: int, stride: int | None = None) -> list[Window]:
    """`ids` cut into windows of at most `max_length` tokens, one starting every `stride`
    tokens (default: `max_length`, no overlap), until the last token is covered.

    With an overlap (stride < max_length) the overlapping tokens are context for the later
    window and targets in the earlier one only: each token is a target at most once. (A
    window's first token is never a target: nothing before it in the window predicts it.)
    A text no longer than `max_length` is one window, itself.
    """
    stride = max_length if stride is None else stride
    if not 1 <= stride <= max_length:
        raise ValueError(f"stride must be in [1, max_length={max_length}], got {stride}")
    out: list[Window] = []
    start, covered = 0, 0  # covered: tokens that were already in some window
    while True:
        end = min(start + max_length, len(ids))
        out.append(Window(ids[start:end], covered - start if start else 0))
        if end >= len(ids):
            return out
        covered, start = end, start + stride


def windowed(config) -> bool:
    """Whether a run cuts its texts into windows: asked for with --stride or with the
    document unit (a window every --max-length tokens when no stride is given)."""
    return config.stride is not None or config.privacy_unit == "document"


def check_stride(stride: int, length: int) -> None:
    """A stride longer than the window would skip tokens: refused, saying what to use."""
    if stride > length:
        raise DPFitError(
            f"--stride {stride} is more than --max-length {length}: windows would skip "
            f"tokens; use --stride {length} (no overlap) or less"
        )


def window_shape(model, config) -> tuple[int, int]:
    """(max length, stride) of the windows: --max-length or the recipe's, lowered to the
    model's position limit as the loop does (dpfit.run.resolve.fit_max_length); --stride or
    no overlap. Known before the recipe, since the number of windows can be its n."""
    from dpfit.models import position_limit
    from dpfit.recipe import MAX_LENGTH

    length = config.max_length
    if length is None:
        limit = position_limit(model)
        length = MAX_LENGTH if limit is None else min(MAX_LENGTH, limit)
    stride = config.stride if config.stride is not None else length
    check_stride(stride, length)
    return length, stride


def check_cut_length(cut_at: int, max_length: int) -> None:
    """The windows were cut once, at prepare time; a run at another length would train on
    windows of the wrong size."""
    if max_length != cut_at:
        raise DPFitError(f"windows were cut at {cut_at} tokens, the run asks for {max_length}")


def training_items(documents: Sequence[Sequence], unit: str, size: Callable[[Any], int]) -> list:
    """The items the loop samples: each window (unit "window") or each document's list of
    windows (unit "document": the engine sums and clips a document's windows as one; unit
    "user": `documents` are users, each the list of their rows or of their rows' windows),
    sorted by length so that physical batches pad little (`size`: a window's tokens)."""
    if unit not in PRIVACY_UNITS:
        raise ValueError(f"privacy unit must be one of {PRIVACY_UNITS}, got {unit!r}")
    if unit in GROUPED_UNITS:
        return sorted((list(ws) for ws in documents), key=lambda ws: sum(size(w) for w in ws))
    return sorted((w for ws in documents for w in ws), key=size)


def training_n(documents: Sequence[Sequence], unit: str) -> int:
    """n, what the sampling rate and the recipe count: documents (users) or windows."""
    return len(documents) if unit in GROUPED_UNITS else sum(len(ws) for ws in documents)


def describe_windows(documents: Sequence[Sequence], length: int, stride: int, unit: str) -> str:
    """How the training documents were cut, for a note. The window count follows the
    private documents' lengths: published only where it is n (unit "window"); never for
    held-out or evaluation data."""
    overlap = f", overlap {length - stride}" if stride < length else ", no overlap"
    counted = f"{training_n(documents, unit)} windows of " if unit == "window" else "windows of "
    return f"{counted}<= {length} tokens every {stride}{overlap}"


def window_metrics(documents: Sequence[Sequence], length: int, stride: int) -> dict:
    """The metrics.json keys of a windowed run (the result table's "windows" row)."""
    return {"train_documents": len(documents), "window_length": length, "stride": stride}
