"""What every client and the server agree on about the task: ``TaskConfig``.

Its own module so that the data, deployment and CLI modules can name the task without
importing the ClientApp (its model code and torch): they sit below ``client`` and ``app``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

LOCAL_MODES = ("bias", "lora", "head", "lora-top")
# local optimizers by name (weight decay 0: an update is the data's, not a pull to zero)
LOCAL_OPTIMIZERS = ("adamw", "sgd")


class ClientTaskError(ValueError):
    """The task configuration sent to a client is invalid."""


@dataclass(frozen=True)
class TaskConfig:
    """What every client and the server agree on; flat scalars so it fits a ConfigRecord."""

    model: str = ""  # folder, hub id, or bundled name (minilm, smollm2); empty: minilm
    local_mode: str = "bias"
    lora_r: int = 4
    max_length: int = 48
    local_epochs: int = 1
    local_batch_size: int = 16
    lr: float = 1e-3
    num_clients: int = 20
    partition: str = "iid"
    alpha: float = 0.5
    examples_per_client: int = 32
    eval_examples: int = 200
    seed: int = 0
    threads: int = 1
    local_optimizer: str = "adamw"
    # A user's own data (dpfit.federated.data); "" = the bundled Rotten Tomatoes. Every
    # SuperNode reads `data` at this path and keeps its own partition's rows.
    data: str = ""
    eval_data: str = ""  # the server's public validation / test set (needed with `data`)
    client_column: str = ""  # each distinct value one client (partition "column")
    text_column: str = "text"
    label_column: str = "label"
    labels: str = ""  # public label names, comma-separated, in id order ("" = from the data)
    public_labels: bool = False  # names read from the data are public even if rare

    def __post_init__(self) -> None:
        if self.local_mode not in LOCAL_MODES:
            raise ClientTaskError(
                f"local_mode must be one of {LOCAL_MODES}, got {self.local_mode!r}"
            )
        if self.local_optimizer not in LOCAL_OPTIMIZERS:
            raise ClientTaskError(
                f"local_optimizer must be one of {LOCAL_OPTIMIZERS}, got {self.local_optimizer!r}"
            )
        if bool(self.client_column) != (self.partition == "column"):
            raise ClientTaskError(
                "a client column goes with partition 'column' (natural clients), and only "
                f"with it; got client_column={self.client_column!r}, "
                f"partition={self.partition!r}"
            )
        if not self.data and (self.client_column or self.eval_data):
            raise ClientTaskError("--client-column and --eval-data need --data FILE")
        if self.data and self.partition == "movie":
            raise ClientTaskError(
                "--partition movie is the bundled data's natural clients; for your file "
                "name its client column with --client-column, or use --partition iid|dirichlet"
            )

    def to_record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: Any) -> TaskConfig:
        names = {f.name: f.type for f in fields(cls)}
        kwargs = {}
        for name in names:
            if name in record:
                default = getattr(cls, name)
                kwargs[name] = type(default)(record[name])
        return cls(**kwargs)
