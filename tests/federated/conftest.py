import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Share the machine's cores with other engineers and with Ray actors."""
    torch.set_num_threads(1)
