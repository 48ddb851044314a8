"""Timing helpers: intervals summed on CPU; CUDA events read once (exercised by the GPU run)."""

import time

import pytest
import torch

from kvstack.timing import Stopwatch, now


def test_stopwatch_sums_intervals_and_now_is_monotonic():
    clock = Stopwatch()
    for _ in range(3):
        token = clock.start(torch.device("cpu"))
        time.sleep(0.01)
        clock.stop(token)
    assert 0.03 <= clock.seconds < 1.0
    assert now() <= now(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (KVSTACK_TEST_DEVICE=cuda runs)")
def test_stopwatch_on_cuda_reads_events_once():
    clock = Stopwatch()
    device = torch.device("cuda")
    token = clock.start(device)
    torch.ones(4096, 4096, device=device).matmul(torch.ones(4096, 4096, device=device))
    clock.stop(token)
    assert clock.seconds > 0
