"""Which label names a run may publish: one rule for every classification task.

Label names are written un-noised into the saved model and metrics.json (per_class). Names the
user gives (``--labels``) or that ship with a bundled data set say nothing about the private
examples; names read from the user's data do, when few examples carry them (a class folder
named after a person). See docs/threat-model.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from dpfit.data.text import DataError


class RareLabelError(DataError):
    """Label names read from the data would be published, and some are rare."""


# Label names inferred from the training data are published. A name carried by many privacy
# units (examples, documents, clients) is not evidence about any one of them; 20 is about the
# count a noisy (stability-based) histogram at epsilon 1, delta 1e-5 needs before it releases
# a key (1 + 2 ln(1/(2 delta)) / epsilon = 22.6), and a class with fewer examples cannot be
# learned under DP noise anyway. It is a heuristic guard, not a DP release: --labels is the
# guarantee.
MIN_PUBLIC_LABEL_COUNT = 20


@dataclass(frozen=True)
class LabelUnits:
    """How many distinct privacy units carry each label name, and what the unit is.

    The gate's stability argument counts the unit that epsilon protects: adding or removing
    one unit must move each count by at most 1. A client with 25 rows of one name is one
    unit, so it counts once; a document cut into windows counts once under the document
    unit. ``unit`` is a plural noun for messages ("training examples", "clients", "users").
    """

    counts: Mapping[str, int]
    unit: str = "training examples"

    @classmethod
    def count(cls, labels: Iterable[str], unit_ids: Iterable[Hashable], unit: str) -> LabelUnits:
        """From each row's label name and the id of the unit holding the row (one pair per
        row): a unit with many rows of a name counts once for it."""
        pairs = set(zip(labels, unit_ids, strict=True))
        return cls(Counter(name for name, _ in pairs), unit)


def parse_labels(labels: str) -> tuple[str, ...] | None:
    """``--labels a,b,c`` as a tuple of names without surrounding spaces (``"a, b"`` is
    ``("a", "b")``, as a user means it); None when no name is given."""
    names = tuple(x.strip() for x in labels.split(",") if x.strip())
    return names or None


def check_data_label_names(
    names: Sequence[str],
    counts: LabelUnits | Mapping[str, int],
    source: str,
    public_labels: bool,
    published_in: str,
) -> str:
    """The note saying why names read from `source` may be published; RareLabelError when
    some name is carried by fewer than MIN_PUBLIC_LABEL_COUNT privacy units and the user has
    not declared the names public. `counts`: distinct units per name (LabelUnits), or a plain
    mapping of rows per name where each row is its own unit (a training example, or a
    document of a run whose unit is the document). A missing name counts 0."""
    units = counts if isinstance(counts, LabelUnits) else LabelUnits(counts)
    rare = sorted(n for n in names if units.counts.get(n, 0) < MIN_PUBLIC_LABEL_COUNT)
    if rare and not public_labels:
        raise RareLabelError(
            f"{source}: {len(rare)} label name(s) appear in fewer than "
            f"{MIN_PUBLIC_LABEL_COUNT} {units.unit} ({', '.join(rare[:10])}"
            f"{f', ... ({len(rare) - 10} more)' if len(rare) > 10 else ''}). Label "
            f"names are written un-noised into {published_in}, so a rare "
            "one can reveal who is in the data. Pass the public label set with --labels "
            "a,b,c, or declare the names in the data public with --public-labels"
        )
    how = (
        "declared public with --public-labels"
        if public_labels
        else f"each carried by >= {MIN_PUBLIC_LABEL_COUNT} {units.unit}"
    )
    return (
        f"label names read from the training data are treated as PUBLIC ({how}): "
        f"{', '.join(names)}; pass --labels to give them yourself"
    )
