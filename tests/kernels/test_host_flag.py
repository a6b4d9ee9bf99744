"""The stream's wait for a host counter (kernels/host_flag.py): it passes a counter already at the
target, gives up after its bounded polls (recording what it saw), and on a GPU really holds back
the work queued after it until a host thread raises the counter in pinned memory."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from ferrox.kernels.host_flag import wait_for_host_flag


def _flag(device: torch.device, value: int) -> torch.Tensor:
    if device.type == "cuda":
        t = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        t.fill_(value)
        return t
    return torch.full((1,), value, dtype=torch.int64, device=device)


def test_passes_a_raised_counter(kernel_device):
    flag, seen = _flag(kernel_device, 5), _flag(kernel_device, -1)
    wait_for_host_flag(flag, seen, 5)
    wait_for_host_flag(flag, seen, 3)  # any target at or below the counter
    if kernel_device.type == "cuda":
        torch.cuda.synchronize()
    assert int(seen[0]) == 5


def test_gives_up_after_its_polls_and_says_so(kernel_device):
    flag, seen = _flag(kernel_device, 1), _flag(kernel_device, -1)
    wait_for_host_flag(flag, seen, 2, max_polls=50)
    if kernel_device.type == "cuda":
        torch.cuda.synchronize()
    assert int(seen[0]) == 1  # below the target: the host knows the wait did not end by the flag


def test_rejects_wrong_counters(kernel_device):
    with pytest.raises(ValueError, match="flag must be one int64"):
        wait_for_host_flag(torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_holds_back_the_stream_until_a_host_thread_raises_the_counter():
    flag, seen = _flag(torch.device("cuda"), 0), _flag(torch.device("cuda"), -1)
    data = torch.zeros(1 << 16, dtype=torch.int32, pin_memory=True)
    wait_for_host_flag(flag, seen, 1)
    on_device = data.to("cuda", non_blocking=True)  # reads pinned memory only once the wait passed
    done = torch.cuda.Event()
    done.record()
    time.sleep(0.05)
    assert not done.query()  # still waiting: nothing has raised the counter

    def release() -> None:
        data.fill_(7)  # written before the counter goes up, as the mask thread does
        flag.numpy()[0] = 1

    threading.Thread(target=release).start()
    done.synchronize()
    assert int(seen[0]) == 1
    assert bool((on_device == 7).all())
