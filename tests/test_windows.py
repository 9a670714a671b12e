"""dpfit.windows: the guard shared by the windowed tasks."""

from __future__ import annotations

import pytest

from dpfit.errors import DPFitError
from dpfit.windows import check_cut_length


def test_a_run_at_another_length_than_the_windows_were_cut_at_is_refused():
    check_cut_length(128, 128)
    with pytest.raises(DPFitError, match="windows were cut at 128 tokens, the run asks for 256"):
        check_cut_length(128, 256)
