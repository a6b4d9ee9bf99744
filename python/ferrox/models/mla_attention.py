"""Multi-head latent attention (MLA: DeepSeek-V2 / V3) over ferrox's paged KV cache, in the absorbed form.

DeepSeek's attention compresses a token's keys and values into one latent c_kv (kv_lora_rank dims, 512)
plus one shared rotary key k_pe (qk_rope_head_dim, 64); each head's key is [W_UK_h c_kv | k_pe] and its
value W_UV_h c_kv, W_UK / W_UV being the two halves of kv_b_proj's rows per head. Like vLLM, ferrox never
expands them: W_UK is absorbed into the query and W_UV applied after attention, so

    q_h     = [q_nope_h @ W_UK_h | rope(q_pe_h)]        (kv_lora_rank + qk_rope_head_dim dims)
    k = v   = [kv_a_layernorm(c_kv) | rope(k_pe)]       (the same, one "KV head" shared by all heads)
    out_h   = W_UV_h @ attention(q_h, k, v)[:kv_lora_rank]

with the softmax scale of the unabsorbed scores (q_nope . k_nope + q_pe . k_pe are unchanged). Every
request then attends MQA-style (H query heads over one KV head of 576 dims for V2/V3) through the ordinary
attention backend, in prefill and decode alike.

The cache: the loader shapes it [2, blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]
(loader/model_config.py), and the same latent row is written as K and as V, so that the backends run
unchanged. That costs twice the latent's bytes; it is still ~35x less than V3's full per-head K/V
(128 heads x (192 + 128) dims). A K-only cache (the value read from the K plane) is future work.

Rotary: DeepSeek rotates (x0, x1), (x2, x3), ... pairs ("interleaved": every V2, and V3 unless
config.json says rope_interleave false); ferrox's rotary kernels turn (i, i + d/2) pairs. q_pe and k_pe
are laid out evens-then-odds before rotating: the same permutation of both leaves every q . k unchanged,
and nothing else reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.attention.kv_cache import KVCacheScales
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.linear import Linear, RowParallelLinear
from ferrox.layers.ops import DeviceOps, Rope
from ferrox.model_spec import ModelSpec, UnsupportedModelError


@dataclass(frozen=True, slots=True)
class MlaShape:
    """The MLA dimensions of a config (read and checked by models/deepseek_v2.py)."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: q_proj straight from the hidden state (DeepSeek-V2-Lite)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    interleaved: bool  # rotary pairs (x0, x1), (x2, x3), ... (module docstring)
    scale: float  # softmax scale: qk_head_dim ** -0.5, times YaRN's mscale_all_dim factor squared


def _evens_then_odds(x: torch.Tensor) -> torch.Tensor:
    """[..., d] interleaved rotary pairs -> [x0, x2, ..., x1, x3, ...] (a new tensor)."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)


class MlaAttention(nn.Module):
    """One layer's latent attention; checkpoint names as DeepSeek's (q_proj or q_a_proj / q_a_layernorm /
    q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)."""

    w_uk: torch.Tensor | None  # [H, qk_nope_head_dim, kv_lora_rank]: set by absorb_kv_b()
    w_uv: torch.Tensor | None  # [H, kv_lora_rank, v_head_dim]

    def __init__(self, spec: ModelSpec, mla: MlaShape, backend: AttentionBackend, ops: DeviceOps, dtype, device):
        super().__init__()
        self.mla = mla
        self.num_heads = spec.num_heads
        qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        bias = spec.attention_bias  # (as transformers: q_a_proj, kv_a_proj_with_mqa and o_proj only)
        if mla.q_lora_rank is None:  # DeepSeek-V2-Lite
            self.q_proj: Linear | None = Linear(spec.hidden_size, self.num_heads * qk_head_dim, bias=False,
                                                dtype=dtype, device=device)
            self.q_a_proj = self.q_b_proj = None
            self.q_a_layernorm: RMSNorm | None = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(spec.hidden_size, mla.q_lora_rank, bias=bias, dtype=dtype, device=device)
            # (transformers builds the two latent norms with its default eps, 1e-6, not rms_norm_eps.)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6, dtype, device, ops)
            self.q_b_proj = Linear(mla.q_lora_rank, self.num_heads * qk_head_dim, bias=False, dtype=dtype,
                                   device=device)
        self.kv_a_proj_with_mqa = Linear(spec.hidden_size, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias,
                                         dtype=dtype, device=device)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6, dtype, device, ops)
        # Loaded as a layer (a quantized checkpoint's method takes its tensors), then split into w_uk / w_uv
        # by absorb_kv_b and emptied: it is never run as a projection.
        self.kv_b_proj = Linear(mla.kv_lora_rank, self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                bias=False, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(self.num_heads * mla.v_head_dim, spec.hidden_size, bias=bias, dtype=dtype,
                                        device=device)
        self.register_buffer("w_uk", None, persistent=False)
        self.register_buffer("w_uv", None, persistent=False)
        self.backend = backend
        self.scale = mla.scale
        self.kv_scales = KVCacheScales(device)  # an FP8 cache's scales: 1.0 (checkpoints give MLA none)

    def absorb_kv_b(self, dtype: torch.dtype) -> None:
        """After loading (and the layers' finalize_quantized): kv_b_proj's weight, dequantized if its
        checkpoint was quantized, split per head into W_UK and W_UV; kv_b_proj's own storage is freed."""
        layer = self.kv_b_proj
        if layer.quant is None:
            weight = layer.weight.data
        else:
            dequantize = getattr(layer.quant, "dequantize", None)
            if dequantize is None:
                raise UnsupportedModelError(f"kv_b_proj quantized as {type(layer.quant).__name__} cannot be "
                                            "absorbed into the latent attention (FP8 layouts can)")
            weight = dequantize(dtype)
        mla = self.mla
        per_head = weight.reshape(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        self.w_uk = per_head[:, :mla.qk_nope_head_dim].to(dtype).contiguous()
        self.w_uv = per_head[:, mla.qk_nope_head_dim:].transpose(1, 2).to(dtype).contiguous()
        layer.quant = None
        layer.weight.data = torch.empty(0, dtype=layer.weight.dtype, device=layer.weight.device)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta) -> torch.Tensor:
        if self.w_uk is None or self.w_uv is None:
            raise RuntimeError("MlaAttention.absorb_kv_b was not called after loading the weights")
        t, mla, heads = x.shape[0], self.mla, self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        q_nope, q_pe = q[..., :mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim:]
        latent = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(latent[:, :mla.kv_lora_rank])
        k_pe = latent[:, None, mla.kv_lora_rank:]
        if mla.interleaved:
            q_pe, k_pe = _evens_then_odds(q_pe), _evens_then_odds(k_pe)
        q_pe, k_pe = rope.rotate(q_pe, k_pe)  # (the Triton kernel turns them in place)
        # W_UK absorbed into the query: [H, T, nope] @ [H, nope, rank] -> [H, T, rank].
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        q_full = torch.cat((q_latent, q_pe.to(q_latent.dtype)), dim=-1)  # [T, H, rank + rope]
        kv = torch.cat((c_kv, k_pe[:, 0].to(c_kv.dtype)), dim=-1)[:, None, :]  # [T, 1, rank + rope]
        o = self.backend.forward(q_full, kv, kv, kv_cache, meta, self.scale, self.kv_scales)
        # Values are the latent: each head's output through its W_UV, [H, T, rank] @ [H, rank, v].
        out = torch.bmm(o[..., :mla.kv_lora_rank].transpose(0, 1), self.w_uv)
        return self.o_proj(out.transpose(0, 1).reshape(t, heads * mla.v_head_dim))
