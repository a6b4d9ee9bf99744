"""FP8 KV cache scales measured from the first request (vLLM's `calculate_kv_scales`).

A checkpoint without k_scale / v_scale leaves every layer's FP8 cache at scale 1.0, so keys beyond
+-448 saturate and small ones keep few significant bits. With `calculate_kv_scales`, the first
forward pass that serves requests measures each layer's keys and values instead, as vLLM does:

    k_scale = max |k| / K_SCALE_CONSTANT (200)      v_scale = max |v| / V_SCALE_CONSTANT (100)

over the rows that step writes into the cache (after rotary), once; the scales then hold for the
engine's life (every block is read back with the scale it was written with). The constants leave
headroom (448 / 200 = 2.24x for keys, 4.48x for values) for later tokens larger than the first
prompt's; vLLM's environment variables of the same names change them. Each tensor-parallel rank
measures its own heads, and a DeepSeek latent cache (one plane, read with k_scale) measures its
latent rows for both.

The measuring step runs eagerly on every rank (engine: arm after the warm-up; the driver marks the
step for the other ranks), so the scales are set before the step's K/V writes and outside any
CUDA graph; the graphs read the scales by pointer and see the new values from then on.
"""

from __future__ import annotations

import logging
import os
from types import TracebackType

import torch
from torch import nn

from ferrox.attention.kv_cache import KVCacheScales

logger = logging.getLogger(__name__)


def scale_constants() -> tuple[float, float]:
    """(K_SCALE_CONSTANT, V_SCALE_CONSTANT): vLLM's divisors of a step's largest |k| and |v|."""
    values = []
    for name, default in (("K_SCALE_CONSTANT", "200"), ("V_SCALE_CONSTANT", "100")):
        text = os.environ.get(name, default)
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not value > 0.0 or value == float("inf"):
            raise ValueError(f"{name}={text!r}: must be a positive number (the divisor of the largest |k| or |v| "
                             "measured for calculate_kv_scales)")
        values.append(value)
    return values[0], values[1]


def calibrate_if_armed(kv_scales: KVCacheScales | None, k: torch.Tensor, v: torch.Tensor, num_tokens: int) -> None:
    """Called by every attention backend before it writes a step's K/V rows: a layer armed for
    measuring (KvScaleCalibration) takes its scales from rows [:num_tokens] of k and v."""
    if kv_scales is None or not kv_scales.calibrating:
        return
    kv_scales.calibrating = False
    k_range, v_range = scale_constants()
    rows_k, rows_v = k[:num_tokens], v[:num_tokens]
    if rows_k.numel() == 0:
        return
    k_max = float(rows_k.abs().amax().float())
    v_max = float(rows_v.abs().amax().float())
    # A layer whose rows are all zero (or not finite) keeps the scale it has: 0 would divide by zero.
    if k_max > 0.0 and k_max != float("inf"):
        kv_scales.set_scale("k", k_max / k_range)
    if v_max > 0.0 and v_max != float("inf"):
        kv_scales.set_scale("v", v_max / v_range)
    kv_scales.calibrated = True


class KvScaleCalibration:
    """The scales of one model's attention layers, armed for one forward pass:

        with KvScaleCalibration(model):
            model.forward(...)   # eager: each layer measures its K/V as it writes them

    Leaving says what was measured; a layer the pass never reached keeps its scales (logged)."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, KVCacheScales)]

    def __enter__(self) -> KvScaleCalibration:
        for layer in self.layers:
            layer.calibrating, layer.calibrated = True, False
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        missed = [i for i, layer in enumerate(self.layers) if not layer.calibrated]
        for layer in self.layers:
            layer.calibrating = False
        if exc_type is not None or not self.layers:
            return
        measured = [layer for layer in self.layers if layer.calibrated]
        if measured:
            ks, vs = [m.k_scale for m in measured], [m.v_scale for m in measured]
            logger.info("calculate_kv_scales: %d attention layers measured on the first step: k_scale %.4g-%.4g, "
                        "v_scale %.4g-%.4g", len(measured), min(ks), max(ks), min(vs), max(vs))
        if missed:
            logger.warning("calculate_kv_scales: %d of %d attention layers wrote no K/V in the first step (layers "
                           "%s) and keep their scales", len(missed), len(self.layers), missed[:8])
