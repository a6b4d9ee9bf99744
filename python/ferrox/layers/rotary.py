"""Rotary position embedding in the NeoX / HF `rotate_half` layout (first half pairs with second half).

The angles are computed once per forward from the step's positions (cheap, exact, and no table
sized by max_position_embeddings), then every layer applies them to its queries and keys.
`RotaryEmbedding(positions, dtype)` returns the step's `Rope` in the layout of the op set chosen
when the model was built (layers/ops.py): cos/sin for the torch formula, float32 [cos | sin] rows
for the Triton kernel.

Supported `rope_type`s: default, linear, llama3 (Llama 3.1 long-context scaling), yarn (Qwen2.5 /
Qwen3 beyond 32k, DeepSeek-style mscale), longrope (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini; "su"
is its older name) and freq_factors (GGUF). YaRN and LongRoPE also scale cos and sin by an
"attention factor" (the `amplitude` below), which every kernel gets through the same rows.

Partial rotary (`partial_rotary_factor` < 1, Phi-4-mini): HF rotates the first `rotary_dim` dims of
each head, pairing dim i with i + rotary_dim / 2, and passes the rest through. Every ferrox kernel
pairs i with i + head_dim / 2 over the whole head, so instead of teaching each of them a second
layout, the loader reorders the rows of q_proj and k_proj inside each head (`partial_rotary_order`)
so the rotated pairs land at (i, i + head_dim / 2) and the passed-through dims fill the rest of both
halves with frequency 0 (cos 1, sin 0: unchanged). Attention scores are q . k, which the same
reordering of both leaves unchanged; v and the output are not touched.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from ferrox.layers.ops import DeviceOps, Rope, apply_rotary, for_device
from ferrox.model_spec import (
    ModelLoadError,
    UnsupportedModelError,
    rope_type_of,
    spec_for_context,
    uses_long_rope,
)

if TYPE_CHECKING:
    from ferrox.model_spec import ModelSpec

__all__ = ["SUPPORTED_ROPE_TYPES", "RopeAngles", "RotaryEmbedding", "apply_rotary", "check_rotary_dim",
           "partial_rotary_order",
           "rope_angles", "rope_inv_freq", "rope_type_of", "spec_for_context", "uses_long_rope"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "freq_factors")


class RopeAngles(NamedTuple):
    """What a step's cos / sin are made of: angle = position * inv_freq, times amplitude."""

    inv_freq: torch.Tensor  # float32 [head_dim // 2]; 0 for the pairs partial rotary leaves unrotated
    amplitude: torch.Tensor | None  # float32 [head_dim // 2] multiplying cos and sin; None: 1 everywhere


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32) after the configured scaling."""
    return rope_angles(head_dim, base, scaling).inv_freq


def rope_angles(head_dim: int, base: float, scaling: dict | None, *, rotary_dim: int | None = None,
                max_position_embeddings: int | None = None, long_context: bool = False) -> RopeAngles:
    """The frequencies (and YaRN / LongRoPE amplitude) of every rotary pair of a head. rotary_dim:
    how many dims rotate (partial rotary; default all); the other pairs get frequency 0.
    max_position_embeddings: the config's (LongRoPE's default factor is its ratio to the original
    length). long_context: LongRoPE's long factors (`uses_long_rope`)."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base ** exponents)
    amplitude = 1.0
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        pass
    elif rope_type == "linear":
        # Positions stretched by `factor` == frequencies divided by it.
        inv_freq = inv_freq / float(scaling["factor"])  # type: ignore[index]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)  # type: ignore[arg-type]
    elif rope_type == "yarn":
        inv_freq, amplitude = _yarn(inv_freq, base, rotary_dim, scaling, max_position_embeddings)  # type: ignore[arg-type]
    elif rope_type == "longrope":
        inv_freq, amplitude = _longrope(inv_freq, scaling, max_position_embeddings, long_context)  # type: ignore[arg-type]
    elif rope_type == "freq_factors":
        # GGUF files of Llama 3.1 store the llama3 scaling precomputed as per-frequency divisors
        # (tensor rope_freqs.weight); the GGUF loader puts them here.
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)  # type: ignore[index]
        if factors.shape != inv_freq.shape:
            raise UnsupportedModelError(f"rope_freqs has {factors.numel()} factors, expected {inv_freq.numel()}")
        inv_freq = inv_freq / factors
    else:
        raise UnsupportedModelError(
            f"config.json: rope_scaling.rope_type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    passed = (head_dim - rotary_dim) // 2  # pairs partial rotary leaves as they are
    inv_freq = torch.cat([inv_freq, torch.zeros(passed)])
    if amplitude == 1.0:
        return RopeAngles(inv_freq, None)
    # The pass-through pairs keep amplitude 1: HF scales only the rotated part's cos and sin.
    return RopeAngles(inv_freq, torch.cat([torch.full((rotary_dim // 2,), amplitude), torch.ones(passed)]))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    context = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    slow = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    blend = (context / wavelen - low) / (high - low)
    blended = (1 - blend) * slow / factor + blend * slow
    in_band = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(in_band, blended, slow)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(inv_freq: torch.Tensor, base: float, rotary_dim: int, scaling: dict,
          max_position_embeddings: int | None) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071), as transformers and vLLM compute it: pairs that turn fewer than
    beta_slow times over the original context are interpolated (frequency / factor), pairs that turn
    more than beta_fast times kept, a linear ramp between; cos and sin scaled by 0.1 ln(factor) + 1
    (DeepSeek's mscale / mscale_all_dim ratio when both are set, or an explicit attention_factor)."""
    original = _original_length(scaling, max_position_embeddings, "yarn")
    factor = scaling.get("factor")
    if factor is None:  # DeepSeek-V3 style: the ratio of the extended to the original length
        if max_position_embeddings is None:
            raise ModelLoadError("config.json: rope_scaling (yarn) sets no 'factor'")
        factor = max_position_embeddings / original
    factor = float(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_of(turns: float) -> float:  # the pair index that turns `turns` times over the original context
        return rotary_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a one-pair ramp would divide by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the frequency as trained), 0: interpolate (divided by factor)
    inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep
    amplitude = scaling.get("attention_factor")
    if amplitude is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            amplitude = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
        else:
            amplitude = _yarn_mscale(factor)
    return inv_freq, float(amplitude)


def _longrope(inv_freq: torch.Tensor, scaling: dict, max_position_embeddings: int | None,
              long_context: bool) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): per-pair divisors of the frequencies, one list for
    contexts within the original length and one beyond it; cos and sin scaled by
    sqrt(1 + ln(factor) / ln(original)), factor being the extended over the original length."""
    original = _original_length(scaling, max_position_embeddings, "longrope")
    which = "long_factor" if long_context else "short_factor"
    factors = torch.tensor([float(f) for f in scaling.get(which) or ()], dtype=torch.float32)
    if factors.shape != inv_freq.shape:
        raise ModelLoadError(f"config.json: rope_scaling.{which} has {factors.numel()} entries, the model's "
                             f"rotary dims need {inv_freq.numel()}")
    factor = scaling.get("factor")
    if factor is None:
        factor = (max_position_embeddings or original) / original
    amplitude = scaling.get("attention_factor")
    if amplitude is None:
        factor = float(factor)
        amplitude = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq / factors, float(amplitude)


def _original_length(scaling: dict, max_position_embeddings: int | None, kind: str) -> int:
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    if not original:
        raise ModelLoadError(f"config.json: rope_scaling ({kind}) needs 'original_max_position_embeddings'")
    return int(original)


def check_rotary_dim(spec: ModelSpec, reorders_rows: bool) -> None:
    """Refuse partial rotary for a family whose loader does not reorder q/k rows (partial_rotary_order)."""
    if spec.rotary_dim is not None and not reorders_rows:
        raise UnsupportedModelError(
            f"config.json: partial_rotary_factor ({spec.rotary_dim} of {spec.head_dim} dims rotate) is not "
            f"supported for {spec.architecture}; ferrox takes it for Phi3ForCausalLM (Phi-4-mini)")


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Row order, within one head, that puts HF's partial-rotary layout into ferrox's whole-head pairs:
    new row j takes HF row order[j]. The first half holds the rotated first half, then the first half
    of the passed-through dims; the second half their partners, in the same order."""
    half, passed = rotary_dim // 2, (head_dim - rotary_dim) // 2
    rotated_a, rotated_b = torch.arange(half), torch.arange(half, rotary_dim)
    passed_a = torch.arange(rotary_dim, rotary_dim + passed)
    passed_b = torch.arange(rotary_dim + passed, head_dim)
    return torch.cat([rotated_a, passed_a, rotated_b, passed_b])


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor  # a registered (non-persistent) buffer; declared so it types as a Tensor
    amplitude: torch.Tensor | None
    amplitude_whole: torch.Tensor | None

    def __init__(self, head_dim: int, base: float, scaling: dict | None, device: torch.device | str | None = None,
                 ops: DeviceOps | None = None, *, rotary_dim: int | None = None,
                 max_position_embeddings: int | None = None, long_context: bool = False):
        super().__init__()
        self.head_dim = head_dim
        angles = rope_angles(head_dim, base, scaling, rotary_dim=rotary_dim,
                             max_position_embeddings=max_position_embeddings, long_context=long_context)
        self.register_buffer("inv_freq", angles.inv_freq.to(device), persistent=False)
        amplitude = None if angles.amplitude is None else angles.amplitude.to(device)
        self.register_buffer("amplitude", amplitude, persistent=False)
        # The same over a whole head (cos_sin's layout), made once rather than every step.
        whole = None if amplitude is None else torch.cat((amplitude, amplitude))
        self.register_buffer("amplitude_whole", whole, persistent=False)
        self.ops = ops if ops is not None else for_device(device)

    @classmethod
    def for_spec(cls, spec: ModelSpec, device: torch.device | str | None = None,
                 ops: DeviceOps | None = None) -> RotaryEmbedding:
        """The model's rotary as its config.json (and the served context, for LongRoPE) defines it."""
        section = spec.hf_config.get("mrope_section")
        if section:
            return MRotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling, device, ops,
                                    section=[int(x) for x in section],
                                    interleaved=bool(spec.hf_config.get("mrope_interleaved")),
                                    rotary_dim=spec.rotary_dim)
        return cls(spec.head_dim, spec.rope_theta, spec.rope_scaling, device, ops, rotary_dim=spec.rotary_dim,
                   max_position_embeddings=int(spec.hf_config.get("max_position_embeddings") or 0) or None,
                   long_context=spec.rope_long_context)

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """float32 [T, pairs]: each token's angle for each rotary pair (positions [T])."""
        return positions.to(torch.float32)[:, None] * self.inv_freq[None, :]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """This step's rotary, for every layer to apply to its q and k."""
        return self.ops.rope(self, positions, dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] (broadcast over heads), in the model dtype."""
        freqs = self.angles(positions)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        if self.amplitude_whole is not None:
            cos, sin = cos * self.amplitude_whole, sin * self.amplitude_whole
        return cos.to(dtype), sin.to(dtype)

    def rope_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """The same angles as cos_sin as float32 rows [T, head_dim] = [cos | sin] (head_dim / 2
        each), the layout of the Triton kernels (`rotary_neox_`, and the one-token qkv kernel)."""
        freqs = self.angles(positions)
        cos, sin = freqs.cos(), freqs.sin()
        if self.amplitude is not None:
            cos, sin = cos * self.amplitude, sin * self.amplitude
        return torch.cat((cos, sin), dim=-1)


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen2-VL's multimodal RoPE: positions are [3, T] (temporal, height, width), and rotary pair j turns by
    the row its section names: the first section[0] pairs by the temporal position, the next section[1] by
    the height, the last by the width (transformers' apply_multimodal_rotary_pos_emb). A text token's three
    positions are equal, which is the plain rotary at that position: positions [T] are taken as such, so
    text-only steps (and decode, with the request's position offset added: worker/mrope.py) run every
    kernel path unchanged.

    interleaved (Qwen3-VL, transformers' Qwen3VLTextRotaryEmbedding): the rows take turns over the pairs instead,
    pair j turning by the height when j % 3 == 1 and j < 3 * section[1], by the width when j % 3 == 2 and
    j < 3 * section[2], by the temporal position otherwise; so every axis gets high and low frequencies.

    rotary_dim (partial rotary, Qwen3.5 / Qwen3.6: a quarter of each head): the sections share out the
    rotary_dim / 2 rotated pairs, as transformers' do; the pairs past them are the ones partial rotary passes
    through (frequency 0 in ferrox's row order: `partial_rotary_order`), which turn by no row."""

    section_rows: torch.Tensor  # [pairs] int64: the positions row (0 t, 1 h, 2 w) each pair turns by

    def __init__(self, head_dim: int, base: float, scaling: dict | None, device: torch.device | str | None = None,
                 ops: DeviceOps | None = None, *, section: list[int], interleaved: bool = False,
                 rotary_dim: int | None = None):
        super().__init__(head_dim, base, scaling, device, ops, rotary_dim=rotary_dim)
        pairs = head_dim // 2
        rotated = (head_dim if rotary_dim is None else rotary_dim) // 2
        if sum(section) != rotated or len(section) != 3:
            what = "head_dim / 2" if rotary_dim is None else "the rotary dims / 2 (partial_rotary_factor)"
            raise UnsupportedModelError(f"config.json: mrope_section {section} must be three numbers adding up to "
                                        f"{what} ({rotated})")
        if interleaved:
            j = torch.arange(rotated)
            rows = torch.zeros(rotated, dtype=torch.int64)
            rows[(j % 3 == 1) & (j < 3 * section[1])] = 1
            rows[(j % 3 == 2) & (j < 3 * section[2])] = 2
        else:
            rows = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(section)])
        # The passed-through pairs (frequency 0) read the temporal row: any position gives them angle 0.
        rows = torch.cat([rows, torch.zeros(pairs - rotated, dtype=torch.int64)])
        self.register_buffer("section_rows", rows.to(device), persistent=False)

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        if positions.dim() == 1:
            return super().angles(positions)
        # [3, T] -> each pair's own row of positions: [T, pairs]
        chosen = positions.to(torch.float32).index_select(0, self.section_rows)  # [pairs, T]
        return chosen.t() * self.inv_freq[None, :]
