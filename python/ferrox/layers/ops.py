"""Device dispatch for the layers' small ops: the implementation is chosen once, when a model is built.

`for_device(device)` returns the op set of a device -- `TritonOps` (the Triton kernels of
ferrox/kernels) on CUDA, `DeviceOps` (plain torch: CPU, and the reference the kernels are tested
against) elsewhere -- and each layer built with it calls through it (`self.ops.rms_norm(...)`),
with no device test per call. The mapping from device to kernel set is `kernels.select_kernels`,
which the attention backend asks too, so a model's norms, rotary and attention agree.

Ops:
  rms_norm(x, weight, eps)                       RMSNorm over the last axis
  fused_add_rms_norm(x, residual, weight, eps)   (RMSNorm(x + residual), x + residual)
  silu_and_mul(gate_up)                          silu(gate) * up of a merged [gate | up]
  rope(tables, positions, dtype) -> Rope         the step's rotary tables, once per forward;
                                                 Rope.rotate_qk / Rope.rotate turn q and k,
                                                 Rope.norm_rotate_qk norms each head first (Qwen3)
  masked_attention(q, k, v, mask)                SDPA over padded [B, H, S, D] with a key mask
                                                 (the encoders' attention)

A Triton op hands an input its kernel does not take (a 3-D view such as Qwen3's per-head q/k
norms, a non-contiguous last axis, a residual of another dtype) to the torch formula: a shape
test, the same on every device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ferrox.kernels import KernelSet, select_kernels

# On Hopper, torch picks cuDNN for a masked SDPA, and cuDNN builds a plan for every new (batch, padded
# length): ~40 ms a first call, up to ~1 s, measured on an H200; every batch of an embedding server is
# a new shape, so requests stalled long after ready. The memory-efficient kernel takes the same mask
# with no per-shape build (~0.03 ms a call slower at MiniLM's sizes). benches/RESULTS.md.
_MASKED_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotate each (i, i + head_dim/2) pair by its position's angle
    (NeoX / HF `rotate_half` layout); cos, sin: [T, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (weight.shape[0],), weight, eps)
    # Half precision: normalise in float32 and round once, as the HF reference does.
    return F.rms_norm(x.float(), (weight.shape[0],), None, eps).to(x.dtype) * weight


def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    return rms_norm_torch(x, weight, eps), x


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RopeTables(Protocol):
    """What `rope` reads from a rotary embedding (layers/rotary.py: RotaryEmbedding)."""

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rope_rows(self, positions: torch.Tensor) -> torch.Tensor: ...


class Rope(Protocol):
    """One step's rotary, shared by every layer. Either method may rotate its input in place (the
    Triton kernel does); use the q, k it returns."""

    def rotate_qk(self, qk: torch.Tensor, num_q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """qk [T, Hq + Hkv, D]: the q heads then the k heads of one tensor (adjacent columns of
        the qkv projection), turned together; returns (q [T, Hq, D], k [T, Hkv, D])."""
        ...

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D] held apart."""
        ...

    def norm_rotate_qk(self, qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, q_norm_weight: torch.Tensor,
                       k_norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3: each q and k head of qkv [T, (Hq + 2 Hkv) * D] (the projection's [q | k | v])
        RMS-normed over its D (weights [D], one eps), then rotated. Returns new q [T, Hq, D] and
        k [T, Hkv, D]; qkv is not changed."""
        ...


class NoRope:
    """The Rope of a NoPE layer (SmolLM3's, Llama 4's, EXAONE 4's and Cohere2's global layers): q and k pass through
    unrotated."""

    def rotate_qk(self, qk: torch.Tensor, num_q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        return qk[:, :num_q_heads], qk[:, num_q_heads:]

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def norm_rotate_qk(self, qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, q_norm_weight: torch.Tensor,
                       k_norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q/k norms (EXAONE 4's NoPE layers: models/exaone4.py), then no rotation."""
        return norm_qk_torch(qkv, num_q_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps, self.rotate)


NO_ROPE = NoRope()


@dataclass(frozen=True, slots=True)
class CosSinRope:
    """The torch formula: cos, sin [T, 1, head_dim] in the model dtype."""

    cos: torch.Tensor
    sin: torch.Tensor

    def rotate_qk(self, qk: torch.Tensor, num_q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        # One pass over q and k together.
        out = apply_rotary(qk, self.cos, self.sin)
        return out[:, :num_q_heads], out[:, num_q_heads:]

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)

    def norm_rotate_qk(self, qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, q_norm_weight: torch.Tensor,
                       k_norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return norm_qk_torch(qkv, num_q_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps, self.rotate)


@dataclass(frozen=True, slots=True)
class KernelRope:
    """The Triton kernel (kernels/rotary.py `rotary_neox_`): one launch per layer rotates q and k
    of every head in place, in float32, instead of five elementwise kernels. Qwen3's q/k norms and
    rotary are one launch too (kernels/qk_norm_rope.py `qk_norm_rope`), instead of ~25."""

    rows: torch.Tensor  # [T, head_dim] float32: [cos | sin] of each token's angles
    index: torch.Tensor  # [T] int64: token t reads rows[index[t]]
    kernel: Callable[..., None]
    norm_kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    def rotate_qk(self, qk: torch.Tensor, num_q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(qk[:, :num_q_heads], qk[:, num_q_heads:])

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.kernel(self.index, q, k, self.rows)
        return q, k

    def norm_rotate_qk(self, qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, q_norm_weight: torch.Tensor,
                       k_norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim = q_norm_weight.shape[0]
        # The kernel holds a head in one program's registers: a power-of-two head_dim up to 256
        # (every Qwen3 has 128). Anything else: torch norms, then this rotary on their copies.
        if qkv.stride(-1) == 1 and 2 <= head_dim <= 256 and not head_dim & (head_dim - 1):
            return self.norm_kernel(qkv, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, eps=eps,
                                    rope_rows=self.rows, rope_index=self.index, num_q_heads=num_q_heads,
                                    num_kv_heads=num_kv_heads, head_dim=head_dim)
        return norm_qk_torch(qkv, num_q_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps, self.rotate)


def norm_qk_torch(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, q_norm_weight: torch.Tensor,
                   k_norm_weight: torch.Tensor, eps: float,
                   rotate: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rope.norm_rotate_qk as separate ops: the torch RMSNorm over 3-D views of each head (new
    tensors, so qkv is not changed), then `rotate`."""
    t, head_dim = qkv.shape[0], q_norm_weight.shape[0]
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    q = rms_norm_torch(qkv[:, :q_size].view(t, num_q_heads, head_dim), q_norm_weight, eps)
    k = rms_norm_torch(qkv[:, q_size:q_size + kv_size].view(t, num_kv_heads, head_dim), k_norm_weight, eps)
    return rotate(q, k)


class DeviceOps:
    """The op set of a device; this base is the plain torch one (TritonOps overrides).

    `column_major_weights`: whether the model stores its projections column-major after loading
    (the CPU BLAS matrix-vector kernel reads that layout ~1.4x faster; see
    LlamaForCausalLM.finalize_weights). Only the torch set on CPU says yes.
    """

    name: KernelSet = "torch"

    def __init__(self, *, column_major_weights: bool = False) -> None:
        self.column_major_weights = column_major_weights

    def __repr__(self) -> str:
        return f"{type(self).__name__}(column_major_weights={self.column_major_weights})"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_torch(x, weight, eps)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_add_rms_norm_torch(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_torch(gate_up)

    def rope(self, tables: RopeTables, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        cos, sin = tables.cos_sin(positions, dtype)
        return CosSinRope(cos, sin)

    def masked_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def gated_delta_rule(self, q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Gated DeltaNet's recurrence over a varlen batch (layers/gated_delta_rule.py gated_delta_rule_varlen's
        arguments): torch's chunked form."""
        from ferrox.layers.gated_delta_rule import gated_delta_rule_varlen

        return gated_delta_rule_varlen(q, *args, **kwargs)

    def causal_conv1d(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The linear-attention layers' short causal convolution over a varlen batch (layers/causal_conv.py
        causal_conv1d_varlen's arguments): torch's shifted multiply-adds."""
        from ferrox.layers.causal_conv import causal_conv1d_varlen

        return causal_conv1d_varlen(x, *args, **kwargs)


class TritonOps(DeviceOps):
    """The Triton kernels: one pass per op instead of eager torch's several (3-5x faster RMSNorm on
    an H200, benches/RESULTS.md). Imports triton, so it is built only when a model asks for it."""

    name: KernelSet = "triton"

    def __init__(self) -> None:
        super().__init__(column_major_weights=False)  # kernels/gemv.py reads row-major weights
        from ferrox.kernels.activation import silu_and_mul
        from ferrox.kernels.qk_norm_rope import qk_norm_rope
        from ferrox.kernels.rmsnorm import fused_add_rms_norm, rms_norm
        from ferrox.kernels.rotary import rotary_neox_

        self._rms_norm = rms_norm
        self._fused_add_rms_norm = fused_add_rms_norm
        self._silu_and_mul = silu_and_mul
        self._rotary_neox = rotary_neox_
        self._qk_norm_rope = qk_norm_rope

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and x.stride(-1) == 1:
            return self._rms_norm(x, weight, eps)
        return rms_norm_torch(x, weight, eps)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # One pass reads x (+ residual) and writes both outputs.
        if x.dim() == 2 and x.stride(-1) == 1 and residual.dtype == x.dtype and residual.stride(-1) == 1:
            return self._fused_add_rms_norm(x, residual, weight, eps)
        return fused_add_rms_norm_torch(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        # One read of [gate | up], one write, silu in fp32.
        if gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            return self._silu_and_mul(gate_up)
        return silu_and_mul_torch(gate_up)

    def rope(self, tables: RopeTables, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        rows = tables.rope_rows(positions)
        return KernelRope(rows, torch.arange(positions.shape[-1], device=positions.device), self._rotary_neox,
                          self._qk_norm_rope)

    def masked_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor | None) -> torch.Tensor:
        with sdpa_kernel(_MASKED_SDPA_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def gated_delta_rule(self, q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """flash-linear-attention's and ferrox's Triton kernels on CUDA tensors (the interpreter's CPU tensors: torch's
        form)."""
        from ferrox.layers.gated_delta_rule import gated_delta_rule_varlen

        return gated_delta_rule_varlen(q, *args, cuda_kernels=q.is_cuda, **kwargs)

    def causal_conv1d(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One launch for decode and verify steps on CUDA tensors (kernels/causal_conv_short.py)."""
        from ferrox.layers.causal_conv import causal_conv1d_varlen

        return causal_conv1d_varlen(x, *args, cuda_kernels=x.is_cuda, **kwargs)


def for_device(device: Any = None, kernels: str | None = None) -> DeviceOps:
    """The op set for `device` (None: CPU). `kernels` ("torch" | "triton") forces a set, as
    `kernels.select_kernels` describes (tests run the Triton set on CPU in the interpreter)."""
    device = torch.device(device if device is not None else "cpu")
    if select_kernels(device, kernels) == "triton":
        return TritonOps()
    return DeviceOps(column_major_weights=device.type == "cpu")
