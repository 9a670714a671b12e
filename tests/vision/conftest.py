from pathlib import Path

import pytest
from image_tasks import write_npz


@pytest.fixture
def tiny_npz(tmp_path) -> Path:
    return write_npz(tmp_path / "tiny.npz", 480)
