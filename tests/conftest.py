import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _runs_dir(tmp_path_factory, monkeypatch):
    """`dpfit train` without --output writes a default run folder: never into the checkout."""
    monkeypatch.setenv("DPFIT_RUNS_DIR", str(tmp_path_factory.mktemp("runs")))


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models on a 2-core box: more threads only spin against each other. Restored
    after each test, since the CLI's --threads changes the process-wide count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny random BERT and a 200-review sentiment CSV, as paths a user would pass;
    a test module with other sizes defines its own `tiny`."""
    from dpfit.models import save_tiny_random_model, write_tiny_sentiment_csv

    root = tmp_path_factory.mktemp("tiny")
    return (
        str(save_tiny_random_model(root / "model")),
        str(write_tiny_sentiment_csv(root / "data.csv", n=200)),
    )
