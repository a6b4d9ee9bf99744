"""vLLM's compilation_config (and its --cudagraph-capture-sizes / --max-cudagraph-capture-size flags) as
ferrox reads it: which CUDA graphs the engine captures, and for which sizes.

ferrox runs no torch.compile: its model code calls fused kernels of its own, so of vLLM's compilation
settings only those that say which steps replay CUDA graphs have a meaning here. They are honoured with
vLLM's meaning; every other key is refused by name (not accepted and ignored).

- `cudagraph_mode`: FULL_AND_PIECEWISE (vLLM's default and ferrox's) captures whole decode steps
  (worker/cuda_graphs.py) and piecewise graphs around eager attention for prefill and mixed steps
  (worker/piecewise_graphs.py); FULL_DECODE_ONLY only the former; PIECEWISE only the latter, which then
  serve decode steps too; NONE none. FULL (whole graphs of every step) is refused: ferrox's attention
  plans prefill and mixed steps on the host, so those cannot replay whole.
- `mode` (`level`, its deprecated spelling): VLLM_COMPILE (3, the default) is what ferrox's fused kernels
  and piecewise graphs stand for; NONE (0) turns the piecewise graphs off, as in vLLM, where they need
  VLLM_COMPILE: a mode that asks for them then resolves to no CUDA graphs at all (vLLM's override, logged).
  STOCK_TORCH_COMPILE (1) and DYNAMO_TRACE_ONCE (2) ask for torch.compile and are refused.
- `cudagraph_capture_sizes`: the token counts to capture. Decode graphs take those up to max_num_seqs
  (a decode step's token count is its request count; speculative verify graphs take the same request
  counts), piecewise graphs those from 2 up to max_num_batched_tokens (ferrox's one-token forward is a
  fused path with no attention call to cut a graph around: a one-token step pads to the next size).
  Larger steps run eagerly.
- `max_cudagraph_capture_size`: the largest size captured. With explicit sizes it must be their largest
  (vLLM's consistency check); alone it caps ferrox's own ladders (decode: 1, 2, 4, 8, 16, 24, ...;
  piecewise: 8 ... 512, or 2,048 for MoE models), and raises the piecewise one up to it.
- `custom_ops`: ["all"] is what ferrox does (its kernels are all custom); anything else is refused.
- optimization_level (`-O0` ... `-O3`, vLLM's; 2 the default): the defaults of what compilation_config leaves
  unset -- 0 no torch.compile mode and no CUDA graphs, 1 PIECEWISE, 2 and 3 FULL_AND_PIECEWISE.
- enforce_eager: no graphs, whatever the rest says (vLLM's override).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
COMPILATION_MODES = {"NONE": 0, "STOCK_TORCH_COMPILE": 1, "DYNAMO_TRACE_ONCE": 2, "VLLM_COMPILE": 3}
VLLM_COMPILE = 3
KEYS = ("mode", "level", "cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size", "custom_ops")


@dataclass(frozen=True, slots=True)
class GraphPlan:
    """Which CUDA graphs an engine captures (on CUDA; a CPU engine captures none whatever the plan)."""

    decode: bool = True  # whole decode (and verify) steps
    piecewise: bool = True  # prefill and mixed steps, around eager attention
    sizes: tuple[int, ...] | None = None  # explicit capture sizes (tokens), ascending
    max_size: int | None = None  # the largest size captured (None: ferrox's ladders' own tops)

    @property
    def any(self) -> bool:
        return self.decode or self.piecewise


def _mode(value: Any, key: str) -> int:
    if isinstance(value, str) and value.upper() in COMPILATION_MODES:
        return COMPILATION_MODES[value.upper()]
    if isinstance(value, bool) or not isinstance(value, int) or value not in COMPILATION_MODES.values():
        raise ValueError(f"compilation_config.{key}: {value!r} is not a compilation mode (0-3 or one of "
                         f"{', '.join(COMPILATION_MODES)})")
    return value


def _sizes(value: Any, what: str) -> tuple[int, ...]:
    if (not isinstance(value, (list, tuple)) or not value
            or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in value)):
        raise ValueError(f"{what}: must be a non-empty list of positive integers, got {value!r}")
    return tuple(sorted(set(value)))


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what}: must be a positive integer, got {value!r}")
    return value


# optimization level -> (mode, cudagraph_mode) where compilation_config does not say (vLLM's presets)
LEVEL_DEFAULTS = {0: (0, "NONE"), 1: (VLLM_COMPILE, "PIECEWISE"), 2: (VLLM_COMPILE, "FULL_AND_PIECEWISE"),
                  3: (VLLM_COMPILE, "FULL_AND_PIECEWISE")}


def graph_plan(compilation_config: dict[str, Any] | int | None = None, *,
               cudagraph_capture_sizes: list[int] | None = None, max_cudagraph_capture_size: int | None = None,
               enforce_eager: bool = False, optimization_level: int = 2, log: bool = False) -> GraphPlan:
    """The plan these settings ask for; ValueError naming the key or flag that ferrox cannot honour.
    An int compilation_config is a mode (vLLM's shorthand). log: log vLLM's overrides (once per engine)."""
    cc: dict[str, Any]
    if compilation_config is None:
        cc = {}
    elif isinstance(compilation_config, int) and not isinstance(compilation_config, bool):
        cc = {"mode": compilation_config}
    elif isinstance(compilation_config, dict):
        cc = dict(compilation_config)
    else:
        raise ValueError(f"compilation_config: must be a JSON object (or a compilation mode), got "
                         f"{compilation_config!r}")
    for key in cc:
        if key not in KEYS:
            raise ValueError(
                f"compilation_config.{key}: not supported: ferrox runs no torch.compile (its kernels are fused by "
                f"hand), so it takes only the keys that choose CUDA graphs: {', '.join(KEYS)}")
    if isinstance(optimization_level, bool) or optimization_level not in LEVEL_DEFAULTS:
        raise ValueError(f"optimization_level: must be 0, 1, 2 or 3, got {optimization_level!r}")
    mode, level_cg_mode = LEVEL_DEFAULTS[optimization_level]
    mode_key = "mode"
    for key in ("level", "mode"):  # mode wins over its deprecated spelling, as in vLLM
        if cc.get(key) is not None:
            mode, mode_key = _mode(cc[key], key), key
    if mode in (1, 2):
        raise ValueError(f"compilation_config.{mode_key}: {mode} asks for torch.compile, which ferrox does not run; "
                         "use 3 (VLLM_COMPILE, the default: ferrox's fused kernels and piecewise CUDA graphs) or 0")
    cg_mode = cc.get("cudagraph_mode") or level_cg_mode
    if not isinstance(cg_mode, str) or cg_mode.upper() not in CUDAGRAPH_MODES:
        raise ValueError(f"compilation_config.cudagraph_mode: {cg_mode!r} is not one of {', '.join(CUDAGRAPH_MODES)}")
    cg_mode = cg_mode.upper()
    if cg_mode == "FULL":
        raise ValueError("compilation_config.cudagraph_mode: FULL (whole graphs of every step) is not supported: "
                         "ferrox plans the attention of prefill and mixed steps on the host; use "
                         "FULL_AND_PIECEWISE (the default) or FULL_DECODE_ONLY")
    ops = cc.get("custom_ops")
    if ops is not None and (not isinstance(ops, list) or any(op != "all" for op in ops)):
        raise ValueError(f"compilation_config.custom_ops: {ops!r}: ferrox's kernels are all its own custom ops and "
                         "have no torch-native fallback; only ['all'] is taken")
    sizes = None
    if cc.get("cudagraph_capture_sizes") is not None:
        sizes = _sizes(cc["cudagraph_capture_sizes"], "compilation_config.cudagraph_capture_sizes")
    if cudagraph_capture_sizes is not None:
        flag = _sizes(cudagraph_capture_sizes, "cudagraph_capture_sizes")
        if sizes is not None and flag != sizes:
            raise ValueError(f"cudagraph_capture_sizes: {list(flag)} differs from compilation_config's "
                             f"{list(sizes)}; give them once")
        sizes = flag
    max_size = None
    for value, what in ((cc.get("max_cudagraph_capture_size"), "compilation_config.max_cudagraph_capture_size"),
                        (max_cudagraph_capture_size, "max_cudagraph_capture_size")):
        if value is None:
            continue
        value = _positive(value, what)
        if max_size is not None and value != max_size:
            raise ValueError(f"{what}: {value} differs from {max_size} given elsewhere")
        max_size = value
    if sizes is not None and max_size is not None and max_size != sizes[-1]:
        raise ValueError(f"max_cudagraph_capture_size: {max_size} is not the largest of cudagraph_capture_sizes "
                         f"{list(sizes)}")
    if enforce_eager:
        if log and cg_mode != "NONE" and cc.get("cudagraph_mode") is not None:
            logger.warning("enforce_eager: no CUDA graphs, whatever compilation_config.cudagraph_mode (%s) says",
                           cg_mode)
        return GraphPlan(decode=False, piecewise=False, sizes=sizes, max_size=max_size)
    if cg_mode in ("PIECEWISE", "FULL_AND_PIECEWISE") and mode != VLLM_COMPILE:
        # vLLM's rule: piecewise graphs need piecewise compilation, so it resolves such a mode to none.
        if log:
            logger.info("compilation_config: cudagraph_mode %s needs mode VLLM_COMPILE (3), not %d; no CUDA graphs",
                        cg_mode, mode)
        cg_mode = "NONE"
    return GraphPlan(decode=cg_mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"),
                     piecewise=cg_mode in ("PIECEWISE", "FULL_AND_PIECEWISE"), sizes=sizes, max_size=max_size)
