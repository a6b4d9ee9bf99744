"""A stream that waits for the host: one program polls a counter in pinned host memory until it reaches
a target, so the work queued behind it runs as soon as a host thread raises the counter, with no
host round trip in between (worker/mask_gate.py: the grammar mask of a step under async scheduling).

Pinned host memory is mapped into the device's address space (unified addressing), so the program
reads the counter over the bus; the loads are volatile, so each poll sees the host's latest write.
The poll is bounded: after `max_polls` reads the program gives up, so that a host bug cannot hang
the device; it stores the last value it read in `seen` (pinned host memory too), from which the
host learns, once the stream has passed this point, whether the wait ended by the flag or by giving up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ~1-2 us per read over PCIe: some 15-30 s before the device gives up.
DEFAULT_MAX_POLLS = 1 << 24


# The target changes every call: not specialized (by divisibility or == 1), or each would compile anew.
@triton.jit(do_not_specialize=["target", "max_polls"])
def _wait_for_host_flag_kernel(flag_ptr, seen_ptr, target, max_polls):
    value = tl.load(flag_ptr, volatile=True)
    polls = 0
    while (value < target) & (polls < max_polls):
        value = tl.load(flag_ptr, volatile=True)
        polls += 1
    tl.store(seen_ptr, value)


def wait_for_host_flag(flag: torch.Tensor, seen: torch.Tensor, target: int, max_polls: int = DEFAULT_MAX_POLLS) -> None:
    """Queue, on the current stream, a wait until flag[0] >= target. flag and seen: int64 [1] in
    pinned host memory (or on the device, for tests); seen[0] receives the value that ended the wait."""
    for name, t in (("flag", flag), ("seen", seen)):
        if t.dtype != torch.int64 or t.numel() != 1:
            raise ValueError(f"{name} must be one int64, got {t.dtype} {tuple(t.shape)}")
    _wait_for_host_flag_kernel[(1,)](flag, seen, target, max_polls, num_warps=1)
