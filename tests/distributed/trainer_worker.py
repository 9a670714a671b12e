"""DPTrainer scenarios run by each rank of a gloo job, started as torchrun starts its ranks.

Run as `python trainer_worker.py RANK WORLD PORT OUT MODEL SCENARIO [SCENARIO...]`: the rank
learns its place from the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT), so transformers/accelerate initialise the process group themselves. With
WORLD=1 (or `run(1, ...)` in the test process) there is no group: the single-process
reference. Every rank writes OUT/rank{RANK}.pt.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

N = 24  # training examples
# privacy_unit="document" scenarios: the N rows, in order, grouped into documents of these sizes
DOC_ROWS = (1, 4, 2, 5, 3, 1, 2, 6)
R_DOCUMENTS = 0.05  # the documents scenario's clip norm (the test checks that it clips)


def set_env(rank: int, world: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip


def data(model_dir: str):
    """The tiny classifier (dropout off: the 1- and 2-rank updates must match exactly) and N
    short texts of different lengths (each rank pads its own share differently)."""
    import datasets
    from torch import nn
    from transformers import DataCollatorWithPadding

    from dpfit.models import load_classifier

    loaded = load_classifier(model_dir, ["neg", "pos"], seed=0)
    for m in loaded.model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    words = ("good", "bad", "great", "awful", "fine", "poor")
    texts = [f"the film was {w} {w}" if i % 5 else w for i, w in enumerate(words * (N // 6))]
    labels = [int(w not in ("bad", "awful")) for w in words * (N // 6)]  # unbalanced: the
    # features of a tiny random model are alike, so balanced labels would cancel the gradient
    ds = datasets.Dataset.from_dict({"text": texts, "label": labels})
    ds = ds.map(lambda b: loaded.tokenizer(b["text"]), batched=True)
    return loaded.model, ds, DataCollatorWithPadding(loaded.tokenizer)


def documents(ds) -> list[list[dict]]:
    """The N rows grouped into documents of DOC_ROWS rows, each row the collator's fields."""
    keep = [c for c in ds.column_names if c != "text"]
    rows = [{k: ds[i][k] for k in keep} for i in range(len(ds))]
    bounds = [sum(DOC_ROWS[:d]) for d in range(len(DOC_ROWS) + 1)]
    return [rows[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def trainable(model):
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def settings(name: str, world: int):
    """(PrivacyArguments, TrainingArguments keywords) of a scenario."""
    from dpfit.integrations import PrivacyArguments

    if name in ("update", "update_physical"):  # sigma=0, q=1: all N examples, every step;
        # update_physical: each rank's share of 12 in physical batches of 5, 5 and 2
        physical = 5 if name == "update_physical" else None
        return PrivacyArguments(noise_multiplier=0.0, physical_batch_size=physical), dict(
            per_device_train_batch_size=N // world, max_steps=3, save_strategy="no"
        )
    if name.startswith("update_documents"):  # sigma=0, q=1: every document, every step, in
        # physical batches of 3 rows; "update_documents:R" clips at R instead of R_DOCUMENTS
        r = float(name.split(":")[1]) if ":" in name else R_DOCUMENTS
        return PrivacyArguments(
            noise_multiplier=0.0, physical_batch_size=3, privacy_unit="document", max_grad_norm=r
        ), dict(per_device_train_batch_size=len(DOC_ROWS) // world, max_steps=3, save_strategy="no")
    if name.startswith("update_users"):  # as update_documents, from a row dataset with a user
        # column that DPTrainer groups itself (privacy_unit="user"): users = the documents
        r = float(name.split(":")[1]) if ":" in name else R_DOCUMENTS
        return PrivacyArguments(
            noise_multiplier=0.0,
            physical_batch_size=3,
            privacy_unit="user",
            user_column="user",
            max_grad_norm=r,
        ), dict(per_device_train_batch_size=len(DOC_ROWS) // world, max_steps=3, save_strategy="no")
    # sigma=1, q=2/24: each rank expects 2/world examples, so many of its batches are empty;
    # insecure_seed makes which ones fixed (the test asserts there were some)
    return PrivacyArguments(noise_multiplier=1.0, target_delta=1e-4, insecure_seed=11), dict(
        per_device_train_batch_size=2 // world, max_steps=6, save_strategy="steps", save_steps=2
    )


def train(world: int, out: Path, model_dir: str, name: str, stop_at=None, resume=None) -> dict:
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from transformers import TrainerCallback, TrainingArguments

    from dpfit.integrations import DPTrainer
    from dpfit.sampling import EmptyBatch, PhysicalBatches

    rank = int(os.environ.get("RANK", "0")) if world > 1 else 0
    privacy, kw = settings(name, world)
    counts = {"empty_batches": 0, "ddp_reduces": None, "physical_sizes": []}

    class Counting(DPTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            counts["empty_batches"] += isinstance(inputs, EmptyBatch)
            if isinstance(inputs, PhysicalBatches):
                counts["physical_sizes"].append(inputs.sizes)
            return super().training_step(model, inputs, num_items_in_batch)

    class Watch(TrainerCallback):
        """Stops after `stop_at`; counts DDP's own gradient all-reduces (its comm hook)."""

        def on_step_begin(self, args, state, control, **k):
            ddp = trainer.model_wrapped
            if counts["ddp_reduces"] is None and isinstance(
                ddp, torch.nn.parallel.DistributedDataParallel
            ):
                counts["ddp_reduces"] = 0

                def hook(state_, bucket):  # count, then reduce as DDP would
                    counts["ddp_reduces"] += 1
                    return allreduce_hook(state_, bucket)

                ddp.register_comm_hook(None, hook)

        def on_step_end(self, args, state, control, **k):
            if stop_at is not None and state.global_step == stop_at:
                control.should_training_stop = True

    model, ds, collator = data(model_dir)
    if privacy.privacy_unit == "document":
        ds = documents(ds)
    if privacy.privacy_unit == "user":  # the rows of document d belong to user d
        users = [f"user-{d}" for d, n in enumerate(DOC_ROWS) for _ in range(n)]
        ds = ds.remove_columns("text").add_column("user", users)
    targs = TrainingArguments(
        output_dir=str(out / f"rank{rank}"), learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", report_to=[], use_cpu=True, logging_steps=1, seed=0,
        disable_tqdm=True, **kw,
    )  # fmt: skip
    trainer = Counting(model=model, args=targs, train_dataset=ds, data_collator=collator,
                       privacy=privacy, callbacks=[Watch()])  # fmt: skip
    start = trainable(model).clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=resume)
    engine = trainer.privacy_engine
    ddp = trainer.model_wrapped
    syncs = getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None))
    return {
        "delta": trainable(model) - start,
        "params": trainable(model),
        "steps": engine.steps_taken,
        "global_step": trainer.state.global_step,
        "epsilon": engine.epsilon(),
        "sample_rate": engine.sample_rate,
        "noise_multiplier": engine.noise_multiplier,
        "history": engine.privacy_record()["history"],
        "wrapped": type(trainer.model_wrapped).__name__,
        "has_buffers": any(True for _ in model.buffers()),
        "forward_buffer_sync": syncs,
        "deprecation_warnings": [
            str(w.message) for w in caught if "broadcast_buffers" in str(w.message)
        ],
        **counts,
    }


def run(world: int, out: Path, model_dir: str, scenario: str) -> dict:
    """`update`, or `resume`: the noisy run (6 steps) stopped after 4, then a new trainer
    resumes it from rank 0's checkpoint-4."""
    import torch

    from dpfit.integrations.trainer import ENGINE_STATE_NAME

    torch.set_num_threads(1)
    folder = out / scenario
    if scenario != "resume":
        return train(world, folder, model_dir, scenario)
    first = train(world, folder, model_dir, "noisy", stop_at=4)
    written = sorted(str(p.relative_to(folder)) for p in folder.rglob(ENGINE_STATE_NAME))
    resumed = train(world, folder, model_dir, "noisy", resume=str(folder / "rank0/checkpoint-4"))
    return {"first": first, "resumed": resumed, "engine_states": written}


def main(argv: list[str]) -> None:
    rank, world, port, out = int(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    if world > 1:
        set_env(rank, world, port)
    import torch

    results = {s: run(world, out, argv[4], s) for s in argv[5:]}
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
