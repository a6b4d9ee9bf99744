"""The CPU thread governor: all cores on an idle machine, 1 thread when others keep it busy."""

from __future__ import annotations

import torch
from ferrox.worker import cpu_threads
from ferrox.worker.cpu_threads import CpuThreadGovernor


def test_governor_follows_other_load(monkeypatch):
    before = torch.get_num_threads()
    load = [0.0]
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 2)
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (load[0], 0.0, 0.0))
    monkeypatch.setattr(cpu_threads, "_MIN_SWITCH_INTERVAL_S", 0.0)
    monkeypatch.setattr(cpu_threads, "_CHECK_EVERY_S", 0.0)
    try:
        gov = CpuThreadGovernor(None)
        assert torch.get_num_threads() == 2  # idle at start
        load[0] = 2.0 + 1.5  # our 2 threads + 1.5 from other processes
        gov.maybe_adjust()
        assert torch.get_num_threads() == 1
        load[0] = 1.0 + 0.1  # only us now
        gov.maybe_adjust()
        assert torch.get_num_threads() == 2
        load[0] = 5.0
        CpuThreadGovernor(None)
        assert torch.get_num_threads() == 1  # busy at start
        fixed = CpuThreadGovernor(2)
        fixed.maybe_adjust()
        assert torch.get_num_threads() == 2  # an explicit num_threads is never changed
    finally:
        torch.set_num_threads(before)
