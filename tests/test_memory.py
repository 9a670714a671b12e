import subprocess
import sys

import pytest
import torch

from dpfit.memory import tensor_peak


def test_counts_what_the_call_allocates_at_once():
    size = 1 << 20  # floats
    peak = tensor_peak(lambda: torch.ones(size) + torch.ones(size))  # three live at the top
    assert 3 * 4 * size <= peak < 4 * 4 * size


def test_tensors_from_before_the_call_do_not_count():
    before = torch.ones(1 << 22)
    assert tensor_peak(lambda: before.sum()) < before.numel() * before.element_size() // 100


_HOLES = """
import sys, torch
from dpfit.memory import return_freed_memory
if sys.argv[1] == "on":
    assert return_freed_memory()
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
x = torch.ones(2**21); del x  # an 8 MiB block freed: glibc raises its threshold to it
freed, kept = [], []
for i in range(50):  # 2 MiB blocks, every other one freed: holes inside the heap
    freed.append(torch.ones(2**19))
    kept.append(torch.ones(2**19))
before = rss(); del freed
print((before - rss()) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_return_freed_memory_gives_back_holes_the_heap_would_keep():
    returned = {}
    for mode in ("off", "on"):
        out = subprocess.run(
            [sys.executable, "-c", _HOLES, mode], capture_output=True, text=True, check=True
        )
        returned[mode] = float(out.stdout.split()[-1])
    assert returned["off"] < 20, returned  # glibc's default keeps the freed 100 MiB mapped
    assert returned["on"] > 90, returned
