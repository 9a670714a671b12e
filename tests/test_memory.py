import torch

from dpfit.memory import tensor_peak


def test_counts_what_the_call_allocates_at_once():
    size = 1 << 20  # floats
    peak = tensor_peak(lambda: torch.ones(size) + torch.ones(size))  # three live at the top
    assert 3 * 4 * size <= peak < 4 * 4 * size


def test_tensors_from_before_the_call_do_not_count():
    before = torch.ones(1 << 22)
    assert tensor_peak(lambda: before.sum()) < before.numel() * before.element_size() // 100
