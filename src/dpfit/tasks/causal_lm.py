"""Causal language modelling as a task plug-in: DP-BiTFiT-Add on lines of text or documents.

Data: a text file's non-empty lines (default: the bundled Hamlet), joined a few at a time into
examples (truncated at the max length); those with the smallest keyed hash of their text are
held out. Or long documents (``--data convention-speeches``, the bundled 2012 convention
speeches, or a .jsonl file with one document per line): each document is cut into windows of
the max length every ``--stride`` tokens, no token a target twice, and about a tenth of the
documents is held out, a speaker's (or an ungrouped document's) side from a keyed hash of it.
The privacy unit (``--privacy-unit``) is then a window, or a whole document: all its windows
sampled and clipped as one contribution (dpfit.clipped_sum.DocumentSums). Model: the bundled SmolLM2 (or any causal LM folder or
.gguf file) with zero-initialised biases added where it has none. Loss: each example's mean
token NLL, averaged over examples (per-example decomposable). Metric: held-out perplexity
before and after, plus a few sampled continuations.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from dpfit.causal_lm import (
    TokenizedLines,
    causal_lm_loss,
    document_ids,
    make_collate,
    make_examples,
    perplexity,
    sample_lines,
    split_examples,
)
from dpfit.data.rowhash import (
    FIXED_SIZE_NOTE,
    FIXED_SIZE_RECORD,
    HELD_OUT,
    SPLIT_RULE,
    SUBSAMPLE,
    row_keys,
    smallest,
)
from dpfit.data.text import MAX_ROWS_PER_USER, rows_within_cap, user_groups, user_keys
from dpfit.dropout import MODEL as MODEL_DROPOUT
from dpfit.dropout import config_rates, set_config_rates
from dpfit.dropout import note as dropout_note
from dpfit.errors import DPFitError
from dpfit.tasks.base import Prepared
from dpfit.windows import (
    check_cut_length,
    describe_windows,
    training_items,
    training_n,
    window_metrics,
    window_shape,
    windows,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

HELD_OUT_DOCUMENTS = 0.1  # the share of documents (by group) held out for perplexity
EVAL_TOKENS = 2048  # tokens per evaluation batch of long windows (logits are vocab x tokens)
DOCUMENT_PROMPTS = {"convention-speeches": ("Four years ago,", "My fellow Americans,", "We")}


HAMLET_PROMPTS = ("To be, or not", "My lord,", "O, what a")
SAMPLE_PROMPTS = 3  # prompts drawn from the held-out texts of the user's own data
PROMPT_WORDS = 4  # each: the opening words of one held-out text


def held_out_prompts(texts: Sequence[str]) -> tuple[str, ...]:
    """Sample prompts for the user's own data: the opening words of the first held-out texts
    (evaluation data, like the perplexity; never the private training texts), or none."""
    prompts = []
    for text in texts:
        words = text.split()[:PROMPT_WORDS]
        if words:
            prompts.append(" ".join(words))
        if len(prompts) == SAMPLE_PROMPTS:
            break
    return tuple(prompts)


def _document_source(data: str | None) -> str | None:
    """What kind of documents `--data` names: a bundled corpus's name, "jsonl", or None
    (lines of a text file: the line-based examples)."""
    if data is None:
        return None
    from dpfit.data.bundled import BUNDLED_DOCUMENTS

    name = str(data).strip().lower()
    if name in BUNDLED_DOCUMENTS and not Path(data).exists():
        return name
    return "jsonl" if str(data).endswith(".jsonl") else None


def read_documents(config) -> tuple[list[str], list[str], str]:
    """(documents, their groups, a description) from `--data`: a bundled corpus or a .jsonl
    file whose `--text-column` field is one document (each line its own group)."""
    import json

    from dpfit.data.bundled import BUNDLED_DOCUMENTS

    source = _document_source(config.data)
    user = config.user_column if config.privacy_unit == "user" else None
    if source in BUNDLED_DOCUMENTS and user is not None:
        raise DPFitError(
            f"--privacy-unit user reads each row's user from --user-column of your own .jsonl "
            f"file; the bundled {source} has no user column: use --privacy-unit document"
        )
    if source in BUNDLED_DOCUMENTS:
        docs = BUNDLED_DOCUMENTS[source]()
        return [d.text for d in docs], [d.group for d in docs], f"bundled {source}"
    path = Path(config.data)
    if not path.is_file():
        raise DPFitError(f"--data {path}: no such file (.jsonl, one document per line)")
    texts, users = [], []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get(config.text_column), str):
            raise DPFitError(
                f"{path} line {i + 1}: no text field {config.text_column!r}; give each line "
                'as {"text": "..."} or name the field with --text-column'
            )
        texts.append(row[config.text_column])
        if user is not None:
            users.append(_user_of(row, user, path, i + 1))
    if user is not None:  # each user a group: held out with all their rows
        return texts, users, str(path)
    return texts, [""] * len(texts), str(path)  # each line its own group, keyed by its text


def _user_of(row: dict, column: str, path: Path, line: int) -> str:
    """A .jsonl row's user id (a string or a number, as text), or a DPFitError saying what
    to fix: a row without a user would belong to nobody, and be protected as nobody's."""
    value = row.get(column)
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 7.0 and 7 are one user
    if (
        isinstance(value, bool)
        or not isinstance(value, str | int | float)
        or not str(value).strip()
    ):
        raise DPFitError(
            f"{path} line {line}: no user in {column!r} (fields: {', '.join(row)}); every "
            "row must say whose it is (--user-column names the field): fill it in, or "
            "remove the row"
        )
    return str(value).strip()


def held_out_documents(
    texts: Sequence[str], groups: Sequence[str], fraction: float, seed: int
) -> list[bool]:
    """Which documents are held out: a group (a speaker) as a whole, by a keyed hash of its
    name; a document without a group by a keyed hash of its text (dpfit.data.rowhash). Each
    side changes by exactly the document (or group) added or removed."""
    names = sorted({g for g in groups if g})
    by_group = dict(
        zip(names, row_keys((b"group\0" + g.encode() for g in names), seed, HELD_OUT), strict=True)
    )
    alone = iter(
        row_keys(
            (b"text\0" + t.encode() for t, g in zip(texts, groups, strict=True) if not g),
            seed,
            HELD_OUT,
        )
    )
    keys = [by_group[g] if g else next(alone) for g in groups]
    return [bool(k < fraction) for k in keys]


def capped_documents(docs: Sequence[T], k: int, seed: int) -> list[T]:
    """The `k` documents (objects with a .text) with the smallest keyed hash of their text:
    one document added changes them by at most one in and one out."""
    keys = row_keys((d.text.encode("utf-8") for d in docs), seed, SUBSAMPLE)
    return [docs[i] for i in smallest(keys, k)]


@dataclass
class CausalLMTask:
    """Options that are not run settings (they shape the data, and are public)."""

    lines_per_example: int = 2
    eval_examples: int = 64
    default_train_examples: int = 512
    # None: the bundled data's own (HAMLET_PROMPTS, DOCUMENT_PROMPTS), else held-out openings
    sample_prompts: tuple[str, ...] | None = None
    sample_tokens: int = 20
    eval_batch_size: int = 16
    name: str = "causal-lm"
    # the loss's output head in checkpointed chunks (dpfit.chunked_head): set for runs with
    # --activation-checkpointing, where the full logits would dominate memory
    chunked_head: bool = False

    # -- reading -------------------------------------------------------------------------
    def prepare(self, config) -> Prepared:
        model, tokenizer = self._load_model(config)
        source = _document_source(config.data)
        if source is not None:
            texts, groups, what = read_documents(config)
            prompts = DOCUMENT_PROMPTS.get(source)  # own documents: from the held-out ones
            prep = self.prepare_documents(model, tokenizer, texts, groups, config, what, prompts)
        else:
            if config.privacy_unit == "user":
                raise DPFitError(
                    "--privacy-unit user on --task causal-lm needs rows that say whose they "
                    "are: give --data FILE.jsonl, one text per line with a user field named "
                    "by --user-column"
                )
            if (
                config.privacy_unit != "window"
                or config.stride is not None
                or config.pad_to_max_length
            ):
                raise DPFitError(
                    "--privacy-unit document, --stride and --pad-to-max-length act on "
                    "documents cut into windows: give documents with --data "
                    "convention-speeches or --data FILE.jsonl (one document per line)"
                )
            # a file of the user's: one line, one example (joining lines would make a line
            # added mid-file change the examples after it); the bundled verse keeps pairs
            per_example = 1 if config.data is not None else None
            prep = self.prepare_from(
                model, tokenizer, self._lines(config), config, lines_per_example=per_example
            )
            if config.data is None and self.sample_prompts is None:  # the bundled Hamlet
                prep.state["prompts"] = HAMLET_PROMPTS
        rate = getattr(config, "dropout", None)
        if rate is not None and rate != MODEL_DROPOUT:
            prep.notes.append(dropout_note(model, model.config, rate))
        return prep

    def _load_model(self, config):
        """(model, tokenizer), the model built with config.dropout's rates (dpfit.dropout)."""
        rate = getattr(config, "dropout", None)
        rate = MODEL_DROPOUT if rate is None else rate
        if config.model is None:
            from dpfit.data.smollm import load_smollm2

            lm = load_smollm2()
            rates = config_rates(lm.model.config)
            if rate != MODEL_DROPOUT and any(v != rate for v in rates.values()):
                raise DPFitError(
                    f"the bundled SmolLM2 has dropout rates {rates}; pass --model smollm2 to "
                    f"build it with dropout {rate}, or --dropout model"
                )
            return lm.model, lm.tokenizer
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from dpfit.models import _resolve

        target, kwargs, local = _resolve(config.model)
        build = dict(kwargs)
        if rate != MODEL_DROPOUT:
            cfg = AutoConfig.from_pretrained(target, local_files_only=local, **kwargs)
            set_config_rates(cfg, rate)
            build["config"] = cfg
        model = AutoModelForCausalLM.from_pretrained(target, local_files_only=local, **build)
        tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=local, **kwargs)
        return model, tokenizer

    @staticmethod
    def _lines(config) -> list[str]:
        if config.data is None:
            from dpfit.data.bundled import hamlet_lines

            return hamlet_lines()
        path = Path(config.data)
        if not path.is_file():
            raise DPFitError(f"--data {path}: no such file (a text file, one line per row)")
        return [x for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]

    def prepare_from(
        self, model, tokenizer, lines: Sequence[str], config, lines_per_example: int | None = None
    ) -> Prepared:
        """The task for a model object already in memory (Python callers, tests)."""
        from dpfit.biases import add_biases

        per_example = lines_per_example or self.lines_per_example
        examples = make_examples(lines, per_example)
        n_train = config.max_train_examples or self.default_train_examples
        train_texts, eval_texts = split_examples(examples, n_train, self.eval_examples, config.seed)
        split = {"split_rule": SPLIT_RULE}
        if len(examples) - len(eval_texts) > n_train:
            split["file_neighbouring"] = FIXED_SIZE_RECORD
        if not train_texts:
            raise DPFitError("no training examples: the text has too few lines")
        pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        add_biases(model)  # DP-BiTFiT-Add: zero biases, the same function at step 0
        held = TokenizedLines(eval_texts, tokenizer, 128)
        before = perplexity(model, held, make_collate(pad), self.eval_batch_size)
        return Prepared(
            model=model,
            tokenizer=tokenizer,
            n=len(train_texts),
            num_classes=0,
            head_names=(),
            notes=[
                f"causal LM: {len(train_texts)} training examples of {per_example} "
                f"line{'s' if per_example > 1 else ''}, {len(eval_texts)} held out (those with the smallest keyed hash of "
                "their text); biases added (DP-BiTFiT-Add)",
                *([FIXED_SIZE_NOTE] if "file_neighbouring" in split else []),
            ],
            state={
                "train": train_texts,
                "held": held,
                "pad": pad,
                "before": before,
                "split": split,
                "prompts": self._prompts(None, eval_texts),
            },  # fmt: skip
            biases_added=True,
        )

    def prepare_documents(
        self,
        model,
        tokenizer,
        texts: Sequence[str],
        groups: Sequence[str],
        config,
        what: str = "documents",
        prompts: Sequence[str] | None = None,
    ) -> Prepared:
        """The task on long documents: split by group, tokenised whole, cut into windows.

        n (what the sampling rate and the recipe count) is the training documents with
        privacy_unit "document", their windows with "window".
        """
        from dpfit.biases import add_biases
        from dpfit.data.bundled import TextExample

        examples = [TextExample(t, 0, g) for t, g in zip(texts, groups, strict=True)]
        held = held_out_documents(texts, groups, HELD_OUT_DOCUMENTS, config.seed)
        train_docs = [e for e, h in zip(examples, held, strict=True) if not h]
        held_docs = [e for e, h in zip(examples, held, strict=True) if h]
        split = {"split_rule": SPLIT_RULE, "held_out_fraction": HELD_OUT_DOCUMENTS}
        unit = config.privacy_unit
        capped = config.max_train_examples is not None
        user_note = ""
        if unit == "user":  # users, each their (capped) rows: n counts users
            train_docs, user_note = self._users(train_docs, config, split)
        elif capped and config.max_train_examples < len(train_docs):
            train_docs = capped_documents(train_docs, config.max_train_examples, config.seed)
            split["file_neighbouring"] = FIXED_SIZE_RECORD
        held_docs = held_docs[: self.eval_examples]
        if not train_docs or not held_docs:
            raise DPFitError(
                f"{what}: {len(examples)} documents are too few to hold out a tenth by group"
            )
        length, stride = window_shape(model, config)
        pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        docs = [document_ids(d.text, tokenizer) for d in train_docs]
        held = [
            w for d in held_docs for w in windows(document_ids(d.text, tokenizer), length, stride)
        ]
        cut = [windows(d, length, stride) for d in docs]
        groups = None
        if unit == "user":  # one item per user: all their rows' windows
            groups = user_groups([d.group for d in train_docs])
            cut = [[w for i in g for w in cut[i]] for g in groups]
        add_biases(model)  # DP-BiTFiT-Add: zero biases, the same function at step 0
        before = perplexity(model, held, make_collate(pad), self._eval_batch(length))
        shape = describe_windows(cut, length, stride, unit)
        return Prepared(
            model=model,
            tokenizer=tokenizer,
            n=training_n(cut, unit),
            num_classes=0,
            head_names=(),
            notes=[
                user_note
                or f"causal LM on {what}: {len(docs)} training documents ({shape}), "
                f"{len(held_docs)} held out by group (each group's side from a keyed hash of "
                f"it and --seed); privacy unit: {unit}; biases added (DP-BiTFiT-Add)",
                *([FIXED_SIZE_NOTE] if "file_neighbouring" in split and not groups else []),
            ],
            state={
                "docs": docs,
                "held": held,
                "pad": pad,
                "before": before,
                "length": length,
                "stride": stride,
                "unit": unit,
                "prompts": self._prompts(prompts, [d.text for d in held_docs]),
                "width": length if config.pad_to_max_length else None,
                "split": split,
                "groups": groups,  # privacy unit "user": each user's rows (indices of docs)
            },
            biases_added=True,
            privacy_unit=unit,
        )

    @staticmethod
    def _users(docs: list, config, split: dict) -> tuple[list, str]:
        """--privacy-unit user: the training users (all of them, or the --max-train-examples
        with the smallest keyed hash of their id), each with at most --max-rows-per-user rows
        chosen by a keyed hash of each row; and the note (it counts users, never rows)."""
        users = [d.group for d in docs]
        names = sorted(set(users))
        k = config.max_train_examples
        if k is not None and k < len(names):
            keys = user_keys(users, config.seed, SUBSAMPLE)
            kept = set(sorted(names, key=keys.__getitem__)[:k])
            docs = [d for d in docs if d.group in kept]
            users = [d.group for d in docs]
            split["file_neighbouring"] = (
                "--max-train-examples: adding or removing one user of the file changes the "
                "training users by at most one in and one out; the file-level guarantee is "
                "epsilon_replace_one"
            )
        cap = config.max_rows_per_user or MAX_ROWS_PER_USER
        rows = rows_within_cap(users, [d.text.encode("utf-8") for d in docs], cap, config.seed)
        docs = [docs[i] for i in rows]
        note = (
            f"causal LM, privacy unit: user (field {config.user_column!r}): "
            f"{len(set(users))} training users, each with at most {cap} of their rows "
            "(--max-rows-per-user; which ones by a keyed hash of each row), every row cut into "
            "windows; about a tenth of the users held out with all their rows (each user's "
            "side from a keyed hash of the id and --seed); a sampled user's windows are summed "
            "and clipped as one contribution; biases added (DP-BiTFiT-Add)"
            + (f"; {split['file_neighbouring']}" if "file_neighbouring" in split else "")
        )
        return docs, note

    def _prompts(self, given: Sequence[str] | None, held: Sequence[str]) -> tuple[str, ...]:
        """The sample prompts: `given` (a bundled corpus's), the task's own, or the opening
        words of held-out texts; never the training texts."""
        for prompts in (given, self.sample_prompts):
            if prompts is not None:
                return tuple(prompts)
        return held_out_prompts(held)

    @staticmethod
    def _eval_batch(length: int) -> int:
        return max(1, min(16, EVAL_TOKENS // length))

    # -- the loop's hooks ----------------------------------------------------------------
    def items(self, prep: Prepared, max_length: int) -> list:
        if "docs" in prep.state:  # long documents, cut into windows
            check_cut_length(prep.state["length"], max_length)
            cut = [windows(d, max_length, prep.state["stride"]) for d in prep.state["docs"]]
            if prep.state.get("groups") is not None:  # one item per user: their rows' windows
                cut = [[w for i in g for w in cut[i]] for g in prep.state["groups"]]
            return training_items(cut, prep.state["unit"], lambda w: len(w.ids))
        data = TokenizedLines(prep.state["train"], prep.tokenizer, max_length)
        return sorted(data.items, key=len)  # physical batches of similar length pad little

    def collate(self, prep: Prepared, position_ids: bool) -> Callable[[list], dict]:
        base = make_collate(prep.state["pad"], prep.state.get("width"))
        if not position_ids:
            return base

        def with_positions(items: list) -> dict:
            out = base(items)
            b, width = out["input_ids"].shape
            out["position_ids"] = torch.arange(width).expand(b, width).clone()
            return out

        return with_positions

    def loss(self, model, batch: dict) -> torch.Tensor:
        if self.chunked_head:
            from dpfit.chunked_head import chunked_token_nll

            total, count = chunked_token_nll(model, batch)
            return (total / count.clamp(min=1)).mean()
        return causal_lm_loss(model, batch)

    def evaluate(self, prep: Prepared, model, config, device) -> dict:
        documents = "docs" in prep.state
        batch = self._eval_batch(prep.state["length"]) if documents else 16
        after = perplexity(model, prep.state["held"], make_collate(prep.state["pad"]), batch)
        prompts = prep.state.get("prompts", self.sample_prompts or ())
        samples = sample_lines(model, prep.tokenizer, prompts, self.sample_tokens, config.seed)
        extra: dict = {}
        if documents and prep.state.get("groups") is not None:  # users: no count of rows
            extra = {
                "users": prep.n,
                "user_column": config.user_column,
                "window_length": prep.state["length"],
                "stride": prep.state["stride"],
            }
        elif documents:
            extra = window_metrics(prep.state["docs"], prep.state["length"], prep.state["stride"])
        return {
            **extra,
            "perplexity_before": prep.state["before"],
            "perplexity_after": after,
            "eval_n": len(prep.state["held"]),
            **prep.state.get("split", {}),
            "train_examples": prep.n,
            "samples": [{"prompt": p, "continuation": c} for p, c in samples],
        }

    def save(self, prep: Prepared, model, folder: Path) -> None:
        from dpfit.saving import save_plain

        save_plain(model, folder)
        prep.tokenizer.save_pretrained(folder)
