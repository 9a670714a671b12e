"""Sequence classification as a task plug-in: labelled texts, a pooled head, accuracy.

Label names are published (model/config.json, metrics.json), so they come from the user
(``labels``), from the bundled data, or from the training file only when every name is
frequent (or the user declares them public): see docs/threat-model.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dpfit import progress
from dpfit.data.rowhash import FIXED_SIZE_NOTE, FIXED_SIZE_RECORD, SPLIT_RULE, small_test_note
from dpfit.data.text import (
    MAX_ROWS_PER_USER,
    LabeledTexts,
    UserTexts,
    bundled_rotten_tomatoes,
    load_grouped_texts,
    load_texts,
)
from dpfit.errors import DPFitError
from dpfit.models import load_classifier
from dpfit.tasks.base import Prepared
from dpfit.tasks.labels import (  # noqa: F401 - the first two re-exported
    MIN_PUBLIC_LABEL_COUNT,
    LabelUnits,
    RareLabelError,
    check_data_label_names,
)
from dpfit.windows import (
    check_cut_length,
    describe_windows,
    training_items,
    training_n,
    window_metrics,
    window_shape,
    windowed,
    windows,
)

if TYPE_CHECKING:
    from dpfit.run.config import TrainConfig

logger = logging.getLogger(__name__)

HELD_OUT_FRACTION = 0.1  # of a user's file held out as the test set when no --eval-data


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    n: int
    per_class: dict[str, dict[str, int]]  # name -> {"n", "correct", "predicted"}

    def as_dict(self) -> dict:
        return {"accuracy": self.accuracy, "n": self.n, "per_class": self.per_class}


@dataclass(frozen=True)
class PreparedData:
    train: LabeledTexts
    test: LabeledTexts
    notes: tuple[str, ...]
    split: dict = field(default_factory=dict)  # split_record(): the rule, for metrics.json
    users: tuple[str, ...] | None = None  # privacy unit "user": each training row's user


def prepare_data(config: TrainConfig) -> PreparedData:
    """Training and evaluation texts for `config`, with notes on any subsampling or split."""
    if config.privacy_unit == "user":
        return prepare_user_data(config)
    notes: list[str] = []
    if config.data is None:
        splits = bundled_rotten_tomatoes(seed=config.seed)
        train, test = splits.train, splits.test
        notes.append(
            f"data: bundled Rotten Tomatoes, split by movie (seed {config.seed}): "
            f"{len(splits.train)} train / {len(splits.validation)} validation / {len(test)} test"
        )
        notes.append("label names: the bundled data's own (rotten, fresh), public")
    else:
        train = load_texts(
            config.data,
            config.text_column,
            config.label_column,
            label_names=config.labels,
            label_ids=config.labels is not None,  # number k in the file: the k-th --labels name
        )
        label_note_at = len(notes)  # the gate counts the rows that train: after split/subset
        if config.eval_data is None:
            train, test = _hold_out(train, config, "examples", "row", "the row")
            notes.append(
                f"no --eval-data: holding out the rows of {config.data} whose keyed hash "
                f"(--seed {config.seed}) falls below {HELD_OUT_FRACTION:g}, about "
                f"{HELD_OUT_FRACTION:.0%}, as the test set ({len(test)} examples); score on "
                "them again with dpfit evaluate --held-out"
            )
    if config.eval_data is not None:
        test = load_texts(
            config.eval_data, config.text_column, config.label_column, label_names=train.label_names
        )
    subsampled = False
    if config.max_train_examples is not None and config.max_train_examples < len(train):
        notes.append(
            f"training on the {config.max_train_examples} of {len(train)} training examples "
            "with the smallest keyed row hash (--full-data or --max-train-examples to change); "
            f"{FIXED_SIZE_NOTE}"
        )
        train = train.subsample(config.max_train_examples, seed=config.seed)
        subsampled = True
    if config.data is not None:
        notes.insert(label_note_at, _public_label_note(train, config))
    small = small_test_note(len(test))
    if small is not None:
        notes.append(small)
    split = split_record(config.data is not None and config.eval_data is None, subsampled)
    return PreparedData(train, test, tuple(notes), split)


def _hold_out(data, config: TrainConfig, units: str, unit: str, hashed: str):
    """(training, held-out) of `data` (rows or users), each unit's side from a keyed hash of
    `hashed` and --seed; a clear error where too few units or an empty side leave no test set."""
    if len(data) < 10:
        raise DPFitError(
            f"{config.data} has {len(data)} {units}, too few to hold out a test set"
            + (f" by {unit}" if unit != "row" else "")
            + "; pass --eval-data"
        )
    train, held = data.split(HELD_OUT_FRACTION, seed=config.seed)
    if not len(held) or not len(train):
        raise DPFitError(
            f"{config.data}: no {unit} fell on the "
            f"{'held-out' if not len(held) else 'training'} side of the "
            f"{HELD_OUT_FRACTION:.0%} hold-out (each {unit}'s side comes from a hash of "
            f"{hashed} and --seed); pass --eval-data, or another --seed"
        )
    return train, held


def prepare_user_data(config: TrainConfig) -> PreparedData:
    """--privacy-unit user: the file read with each row's user (--user-column); the hold-out,
    --max-train-examples and the label gate count users, and each user keeps at most
    --max-rows-per-user rows (dpfit.data.text.UserTexts). No count of training rows is
    written anywhere: it follows the private users' row counts."""
    loaded, users = load_grouped_texts(
        config.data, config.user_column, config.text_column, config.label_column,
        label_names=config.labels, label_ids=config.labels is not None,
        flag="--user-column", required=True,
    )  # fmt: skip
    data = UserTexts(loaded, users)
    notes: list[str] = []
    if config.eval_data is None:
        data, held = _hold_out(data, config, "users", "user", "the user id")
        test = held.rows
        notes.append(
            f"no --eval-data: holding out the users of {config.data} whose keyed hash of their "
            f"id (--seed {config.seed}) falls below {HELD_OUT_FRACTION:g}, about "
            f"{HELD_OUT_FRACTION:.0%}, with all their rows, as the test set ({len(held)} "
            "users); score on them again with dpfit evaluate --held-out"
        )
    else:
        test = load_texts(
            config.eval_data, config.text_column, config.label_column,
            label_names=loaded.label_names,
        )  # fmt: skip
    subsampled = False
    if config.max_train_examples is not None and config.max_train_examples < len(data):
        notes.append(
            f"training on the {config.max_train_examples} of {len(data)} training users with "
            "the smallest keyed hash of their id (--max-train-examples counts users); adding "
            "or removing one user may take one user in and one out, so for the file the "
            "guarantee is the user-level replace-one epsilon (epsilon_replace_one)"
        )
        data = data.subsample(config.max_train_examples, seed=config.seed)
        subsampled = True
    cap = config.max_rows_per_user or MAX_ROWS_PER_USER
    data = data.capped(cap, seed=config.seed)
    names = data.rows.label_names
    if config.labels is not None:
        label_note = f"label names (public, from --labels): {', '.join(names)}"
    else:
        label_note = check_data_label_names(
            names,
            LabelUnits.count((names[y] for y in data.rows.labels), data.users, "users"),
            str(config.data), config.public_labels, "model/config.json and metrics.json",
        )  # fmt: skip
    notes.insert(0, label_note)
    notes.append(
        f"privacy unit: user (column {config.user_column!r}): {len(data)} training users, "
        f"each with at most {cap} of their rows (--max-rows-per-user; which ones by a keyed "
        "hash of each row, never by label); a sampled user's rows are summed and clipped as "
        "one contribution, so epsilon protects everything one user contributed"
    )
    small = small_test_note(len(test))
    if small is not None:
        notes.append(small)
    split = split_record(config.eval_data is None, subsampled)
    if subsampled:
        split["file_neighbouring"] = (
            "--max-train-examples: adding or removing one user of the file changes the "
            "training users by at most one in and one out; the file-level guarantee is "
            "epsilon_replace_one"
        )
    return PreparedData(data.rows, test, tuple(notes), split, data.users)


def split_record(held_out: bool, subsampled: bool) -> dict:
    """What metrics.json says about how the user's file was split (public: the rule and the
    fraction; `dpfit evaluate --held-out` re-derives the held-out rows from it). Empty when
    no row-hash split was made (the bundled data is split by movie)."""
    if not held_out and not subsampled:
        return {}
    record: dict = {"split_rule": SPLIT_RULE}
    if held_out:
        record["held_out_fraction"] = HELD_OUT_FRACTION
    if subsampled:
        record["file_neighbouring"] = FIXED_SIZE_RECORD
    return record


def recorded_held_out(model: str | Path, data: str | Path, label_names: Sequence[str]):
    """The rows of `data` that the run which trained `model` held out as its test set,
    re-derived by the same per-row hash from the seed, fraction and rule in the run's
    metrics.json (DIR/metrics.json beside DIR/model): no private row is ever saved.

    Because each row's side is its own, a row the run trained on is never among these even
    if `data` has since gained or lost rows. Raises DPFitError when the run held nothing out
    or made its split by an earlier rule, with what to do instead.
    """
    import json

    run = Path(model).expanduser().parent / "metrics.json"
    if not run.is_file():
        raise DPFitError(
            f"--held-out reads the training run's seed and split rule from {run} (the "
            "metrics.json beside the model folder), which does not exist; keep the run folder "
            "whole, or score on a separate file without --held-out"
        )
    metrics = json.loads(run.read_text())
    config = metrics.get("config") or {}
    if config.get("data") is None:
        raise DPFitError(
            f"{model} was trained on the bundled data: drop --held-out and --data to score "
            "its held-out test split"
        )
    if config.get("eval_data") is not None:
        raise DPFitError(
            f"{model}'s run held nothing out: it scored on --eval-data "
            f"{config['eval_data']}; score on that file with --data and without --held-out"
        )
    fraction = metrics.get("held_out_fraction")
    if metrics.get("split_rule") != SPLIT_RULE or fraction is None:
        raise DPFitError(
            f"{model}'s run held out its test rows by an earlier rule (a seeded permutation "
            f"of row positions), which this dpfit does not reproduce (it splits by a hash of "
            f"each row, {SPLIT_RULE}); retrain with this version, or score on a separate file"
        )
    labels = config.get("labels")
    if config.get("privacy_unit") == "user":  # held out by user: all of a user's rows
        rows, users = load_grouped_texts(
            data, config["user_column"], config.get("text_column", "text"),
            config.get("label_column", "label"), label_names=label_names,
            label_ids=labels is not None, flag="--user-column", required=True,
        )  # fmt: skip
        held = UserTexts(rows, users).split(float(fraction), seed=int(config.get("seed", 0)))
        return held[1].rows
    rows = load_texts(
        data,
        config.get("text_column", "text"),
        config.get("label_column", "label"),
        label_names=label_names,
        label_ids=labels is not None,  # as train read them: number k is the k-th name
    )
    return rows.split(float(fraction), seed=int(config.get("seed", 0)))[1]


def _public_label_note(train: LabeledTexts, config: TrainConfig) -> str:
    """Label names are released (model/config.json id2label, metrics.json per_class): say
    where they came from, and refuse names read from the data that few examples carry.
    `train` is what trains (after the hold-out and --max-train-examples): rows held out or
    left unsampled do not make a name common among the examples the model learns from."""
    if config.labels is not None:
        return f"label names (public, from --labels): {', '.join(train.label_names)}"
    return check_data_label_names(
        train.label_names,
        train.class_counts(),
        str(config.data),
        config.public_labels,
        "model/config.json and metrics.json",
    )


ENCODE_CHUNK = 4096  # texts per tokenizer call: progress on large files, same result


def encode(data: LabeledTexts, tokenizer, max_length: int) -> list[dict]:
    """Tokenise once up front; items are unpadded so each batch pads only to its own length."""
    items: list[dict] = []
    n = len(data)
    for start in range(0, n, ENCODE_CHUNK):
        progress.report("tokenising", start, n)
        texts = list(data.texts[start : start + ENCODE_CHUNK])
        enc = tokenizer(texts, truncation=True, max_length=max_length)
        keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
        labels = data.labels[start : start + ENCODE_CHUNK]
        items += [{**{k: enc[k][i] for k in keys}, "labels": y} for i, y in enumerate(labels)]
    progress.report("tokenising", n, n)
    return items


@dataclass(frozen=True)
class SpecialTokens:
    """How the tokenizer frames one text: `prefix` + text tokens + `suffix` ([CLS] ... [SEP]),
    with the extra keys (attention mask, token types) its encodings carry."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    types: tuple[tuple[int, ...], int, tuple[int, ...]] | None  # prefix, text, suffix
    mask: bool

    @classmethod
    def of(cls, tokenizer, probe: str = "a") -> SpecialTokens:
        """Read from the tokenizer's own encoding of a probe text, with and without them."""
        full = tokenizer(probe)
        bare = tokenizer(probe, add_special_tokens=False)["input_ids"]
        ids, k = full["input_ids"], len(bare)
        at = next((i for i in range(len(ids) - k + 1) if bare and ids[i : i + k] == bare), None)
        if at is None or len(ids) - k != tokenizer.num_special_tokens_to_add(pair=False):
            raise DPFitError(
                "cannot cut texts into windows with this tokenizer: its special tokens do not "
                "frame a text as prefix + text + suffix; drop --stride and --privacy-unit"
            )
        types = full.get("token_type_ids")
        return cls(
            tuple(ids[:at]),
            tuple(ids[at + k :]),
            None if types is None else (tuple(types[:at]), types[at], tuple(types[at + k :])),
            "attention_mask" in full,
        )

    def frame(self, ids: Sequence[int], label: int) -> dict:
        """One window, encoded as the tokenizer encodes a text of these tokens."""
        out = {"input_ids": [*self.prefix, *ids, *self.suffix]}
        if self.mask:
            out["attention_mask"] = [1] * len(out["input_ids"])
        if self.types is not None:
            pre, body, suf = self.types
            out["token_type_ids"] = [*pre, *([body] * len(ids)), *suf]
        return {**out, "labels": label}


def encode_windows(data: LabeledTexts, tokenizer, max_length: int, stride: int) -> list[list[dict]]:
    """Each text cut into windows (dpfit.windows): a list of encoded windows per text, each
    window carrying its text's label.

    A window is `max_length` tokens with the tokenizer's special tokens ([CLS] ... [SEP]),
    so it holds max_length - k text tokens (k special); consecutive windows share
    max_length - stride text tokens, as they would without special tokens. A text that fits
    in one window is encoded exactly as :func:`encode` encodes it.
    """
    special = SpecialTokens.of(tokenizer)
    k = len(special.prefix) + len(special.suffix)
    body, step = max_length - k, stride - k
    if body < 1 or step < 1:
        raise DPFitError(
            f"--max-length {max_length} with --stride {stride}: each window holds {k} "
            f"special tokens, so windows would hold or advance over no text; use --stride (and "
            f"--max-length) above {k}"
        )
    docs: list[list[dict]] = []
    n = len(data)
    for start in range(0, n, ENCODE_CHUNK):
        progress.report("tokenising", start, n)
        texts = list(data.texts[start : start + ENCODE_CHUNK])
        enc = tokenizer(texts, add_special_tokens=False, verbose=False)  # whole: no truncation
        labels = data.labels[start : start + ENCODE_CHUNK]
        for ids, y in zip(enc["input_ids"], labels, strict=True):
            docs.append([special.frame(w.ids, y) for w in windows(ids, body, step)])
    progress.report("tokenising", n, n)
    return docs


def mean_window_logits(logits: torch.Tensor, owner: torch.Tensor, documents: int) -> torch.Tensor:
    """(documents, classes): each document's prediction, the mean of its windows' logits
    (`owner`: each row's document). A one-window document keeps its logits exactly."""
    summed = logits.new_zeros(documents, logits.shape[1]).index_add_(0, owner, logits)
    counts = torch.bincount(owner, minlength=documents).clamp(min=1).to(logits.dtype)
    return summed / counts[:, None]


def make_collate(pad_token_id: int, position_ids: bool = False) -> Callable[[list[dict]], dict]:
    """Pad a list of encoded examples. With `position_ids`, also pass them per example: full
    mode needs every input with its batch axis (a broadcast (1, L) one mixes examples)."""

    def collate(items: list[dict]) -> dict:
        width = max((len(it["input_ids"]) for it in items), default=0)
        out: dict[str, torch.Tensor] = {}
        for key in items[0] if items else ():
            if key == "labels":
                out[key] = torch.tensor([it[key] for it in items], dtype=torch.long)
                continue
            pad = pad_token_id if key == "input_ids" else 0
            out[key] = torch.tensor(
                [it[key] + [pad] * (width - len(it[key])) for it in items], dtype=torch.long
            )
        if position_ids and items:
            out["position_ids"] = torch.arange(width).expand(len(items), width).clone()
        return out

    return collate


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    data: LabeledTexts,
    max_length: int = 128,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
    stride: int | None = None,
) -> EvalResult:
    """Accuracy and per-class counts; batches sorted by length so padding costs little.

    With `stride`, each text is cut into windows as training cut them (encode_windows) and
    predicted from the mean of its windows' logits: accuracy counts texts, not windows.
    """
    preds = predict(model, tokenizer, data, max_length, batch_size, device, stride)
    per_class = {n: {"n": 0, "correct": 0, "predicted": 0} for n in data.label_names}
    correct = 0
    names = data.label_names
    for p, y in zip(preds, data.labels, strict=True):
        per_class[names[y]]["n"] += 1
        if 0 <= p < len(names):
            per_class[names[p]]["predicted"] += 1
        if p == y:
            per_class[names[y]]["correct"] += 1
            correct += 1
    return EvalResult(correct / len(data) if len(data) else float("nan"), len(data), per_class)


def predict(
    model,
    tokenizer,
    data: LabeledTexts,
    max_length: int = 128,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
    stride: int | None = None,
) -> list[int]:
    """The predicted class of each text of `data`, in its order (see evaluate)."""
    if stride is None:
        items = encode(data, tokenizer, max_length)
        owner = list(range(len(items)))
    else:
        docs = encode_windows(data, tokenizer, max_length, stride)
        items = [w for ws in docs for w in ws]
        owner = [d for d, ws in enumerate(docs) for _ in ws]
    order = sorted(range(len(items)), key=lambda i: len(items[i]["input_ids"]))
    collate = make_collate(tokenizer.pad_token_id)
    was_training = model.training
    model.eval()
    rows: torch.Tensor | None = None  # (items, classes), in item order
    progress.report("evaluating", 0, len(order))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = collate([items[i] for i in idx])
        batch.pop("labels")
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits.float().cpu()
        if rows is None:
            rows = logits.new_zeros(len(items), logits.shape[1])
        rows[torch.tensor(idx)] = logits
        progress.report("evaluating", start + len(idx), len(order))
    model.train(was_training)
    if rows is None:
        return [0] * len(data)
    owners = torch.tensor(owner, dtype=torch.long)
    return mean_window_logits(rows, owners, len(data)).argmax(-1).tolist()


def label_source(config) -> str:
    if config.data is None:
        return "bundled"
    if config.labels is not None:
        return "--labels"
    return "--public-labels" if config.public_labels else "training data (each name frequent)"


class ClassificationTask:
    """Texts -> backbone -> pooling -> linear head; cross-entropy; accuracy."""

    name = "classification"

    def prepare(self, config) -> Prepared:
        data = prepare_data(config)
        loaded = load_classifier(
            config.model, data.train.label_names, seed=config.seed, pooling=config.pooling,
            dropout=getattr(config, "dropout", None),
        )  # fmt: skip
        notes = [
            *data.notes,
            f"head: {loaded.pooling} pooling ({loaded.pooling_reason}), "
            + ("the saved model's trained linear layer" if loaded.head_trained
               else "zero-initialised linear layer"),
        ]  # fmt: skip
        if loaded.dropout_note and getattr(config, "dropout", None) not in (None, "model"):
            notes.append(loaded.dropout_note)
        prep = Prepared(
            model=loaded.model,
            tokenizer=loaded.tokenizer,
            n=len(data.train),
            num_classes=data.train.num_labels,
            head_names=loaded.head_names,
            notes=notes,
            state={"data": data, "pooling": loaded.pooling},
            starts_trained=loaded.head_trained,
        )
        if data.users is not None:
            self._group_users(prep, config, data.users)
        elif windowed(config):
            self._cut_into_windows(prep, config)
        return prep

    @staticmethod
    def _group_users(prep: Prepared, config, users: Sequence[str]) -> None:
        """--privacy-unit user: each training item is one user's rows (with --stride, all
        their rows' windows); n is the number of users. Grouped here, before the recipe,
        because n is its input. Rows are encoded in items(), where the max length is known,
        unless --stride cuts them into windows now (the window length is fixed here)."""
        rows = prep.state["data"].train
        groups = UserTexts(rows, tuple(users)).groups()
        prep.n = len(groups)
        prep.privacy_unit = "user"
        prep.state.update(unit="user", groups=groups)
        cut = ""
        if config.stride is not None:
            length, stride = window_shape(prep.model, config)
            per_row = encode_windows(rows, prep.tokenizer, length, stride)
            user_windows = [[w for i in g for w in per_row[i]] for g in groups]
            prep.state.update(user_windows=user_windows, length=length, stride=stride)
            cut = (
                f"; each row cut into windows ({describe_windows(user_windows, length, stride, 'user')}"
                "), each with its row's label; evaluation predicts each text from the mean of "
                "its windows' logits"
            )
        prep.notes.append(f"training items: {prep.n} users, each all of their rows{cut}")

    @staticmethod
    def _cut_into_windows(prep: Prepared, config) -> None:
        """Long texts cut into windows (--stride, --privacy-unit): each window one example,
        or each text one document whose windows are sampled and clipped as one. Cut here,
        before the recipe, because the number of windows is n under the window unit."""
        length, stride = window_shape(prep.model, config)
        docs = encode_windows(prep.state["data"].train, prep.tokenizer, length, stride)
        unit = config.privacy_unit
        prep.n = training_n(docs, unit)
        prep.privacy_unit = unit
        prep.state.update(docs=docs, length=length, stride=stride, unit=unit)
        protects = "one window, not a whole text" if unit == "window" else "one whole text"
        prep.notes.append(
            f"long texts: {len(docs)} training texts ({describe_windows(docs, length, stride, unit)}"
            f"), each window with its text's label; privacy unit: {unit} (epsilon protects "
            f"{protects}); evaluation predicts each text from the mean of its windows' logits"
        )

    def items(self, prep: Prepared, max_length: int) -> list:
        if "groups" in prep.state:  # privacy unit "user": one item per user, their rows
            if "user_windows" in prep.state:
                check_cut_length(prep.state["length"], max_length)
                users = prep.state["user_windows"]
            else:
                rows = encode(prep.state["data"].train, prep.tokenizer, max_length)
                users = [[rows[i] for i in g] for g in prep.state["groups"]]
            return training_items(users, "user", lambda w: len(w["input_ids"]))
        if "docs" in prep.state:  # long texts, cut into windows
            check_cut_length(prep.state["length"], max_length)
            return training_items(
                prep.state["docs"], prep.state["unit"], lambda w: len(w["input_ids"])
            )
        # Sorted by length: the Poisson loader yields each logical batch in index order, so its
        # physical batches hold examples of similar length and pad little (about half the
        # tokens of a random split on short texts). The order never leaves the process.
        items = encode(prep.state["data"].train, prep.tokenizer, max_length)
        return sorted(items, key=lambda item: len(item["input_ids"]))

    def collate(self, prep: Prepared, position_ids: bool) -> Callable[[list[dict]], dict]:
        return make_collate(prep.tokenizer.pad_token_id, position_ids=position_ids)

    def loss(self, model, batch: dict) -> torch.Tensor:
        return model(**batch).loss

    def evaluate(self, prep: Prepared, model, config, device) -> dict:
        data = prep.state["data"]
        stride = prep.state.get("stride")  # windowed: each text from its windows' mean logits
        res = evaluate(
            model, prep.tokenizer, data.test, config.max_length, config.eval_batch_size, device,
            stride=stride,
        )  # fmt: skip
        extra: dict = {}
        if prep.privacy_unit == "user":  # n is the users; no count of their rows is written
            extra = {"users": prep.n, "user_column": config.user_column}
            if stride is not None:
                extra.update(window_length=prep.state["length"], stride=stride)
        elif stride is not None:
            extra = window_metrics(prep.state["docs"], prep.state["length"], stride)
        return {
            "accuracy": res.accuracy,
            "eval_n": res.n,
            "per_class": res.per_class,
            "eval_source": data.test.source,
            **data.split,
            **extra,
            "train_examples": prep.n,
            "pooling": prep.state["pooling"],
            "label_names_public": True,
            "label_names_source": label_source(config),
        }

    def save(self, prep: Prepared, model, folder: Path) -> None:
        from dpfit.tasks.pooling import PooledClassifier, save_pooled_classifier

        if isinstance(model, PooledClassifier):
            save_pooled_classifier(model, prep.tokenizer, folder)
        else:  # pragma: no cover - the loop always builds a PooledClassifier
            model.save_pretrained(folder)
            prep.tokenizer.save_pretrained(folder)
