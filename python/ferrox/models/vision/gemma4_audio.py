"""Gemma 4's audio tower (a Universal Speech Model conformer) and its embedder into the language model
(transformers' Gemma4AudioModel and Gemma4MultimodalEmbedder), their maths exactly, one clip at a time:

    features [frames, mel bins] (multimodal/gemma4_audio_processing.py: the clip's valid log-mel frames)
    subsampling: two Conv2d (3 x 3, stride 2, padding 1, no bias) over (time, mel), each then a LayerNorm over
        its channels (no bias) and a ReLU; (mel / 4, channels) flattened per time step, then input_proj_linear
        into the conformer's width: ceil(ceil(frames / 2) / 2) rows, one a 40 ms soft token
    per conformer layer (every norm an RMSNorm in float32, scaled by its weight as stored; "clamp" is
    gradient_clipping, at most the dtype's largest value):
        h = ffw(h)                                           half-step feed-forward (below)
        h = h + norm_post_attn(clamp(attention(norm_pre_attn(clamp(h)))))
        h = lconv(h)                                         light convolution (below)
        h = norm_out(clamp(ffw2(h)))
      ffw(x) = x + residual_weight * post_layer_norm(clamp(ffw_layer_2(act(ffw_layer_1(pre_layer_norm(clamp(x)))))))
      lconv(x) = x + linear_end(act(conv_norm(clamp(depthwise causal conv(glu(linear_start(pre_layer_norm(x))))))))
    attention: local and causal, each query over the keys 0..(attention_context_left - 2) steps back (and
        attention_context_right - 1 ahead), in float32: q * head_dim^-0.5 / ln 2 * softplus(per_dim_scale),
        k * ln(1 + e) / ln 2; logit = q.k + q.relative_k_proj(sinusoid(distance)) (Transformer-XL's relative
        term, zero for a distance past the table), soft-capped by attention_logit_cap (tanh), softmax; `post`
        projects the heads back
    output_proj (with bias) into output_proj_dims; the embedder: a weightless RMSNorm, then
        embedding_projection into the text width

transformers pads a batch of clips to its longest and masks the padding out of the convolutions (zeroed
frames, which a padding of zeros also is), the attention (masked keys) and the output rows (dropped); its
causal light convolution never reads ahead. One clip's valid frames alone therefore give the same rows,
which is how ferrox runs it (transformers' blocked attention of attention_chunk_size queries is the same
window computed in blocks: here each query's window is read directly, an unfold of the keys with no copy).
With use_clipped_linears each projection of the conformer clamps its input and output to the bounds the
checkpoint stores beside it. Parameter names are the checkpoint's under `model.audio_tower.` and
`model.embed_audio.`, bounds included (`q_proj.input_min`...). Built and loaded whole on every rank under
tensor parallelism (it is small: E2B's is about 300M parameters).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.errors import UnsupportedModelError
from ferrox.models.load_check import load_tower_tensors
from ferrox.models.vision.gemma4_vision import _Norm, _norm  # (the vision tower's RMSNorm: the same)

# Gemma4AudioConfig's defaults for the keys read here.
CONFIG_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 8, "hidden_act": "silu",
    "subsampling_conv_channels": [128, 32], "conv_kernel_size": 5, "residual_weight": 0.5,
    "attention_chunk_size": 12, "attention_context_left": 13, "attention_context_right": 0,
    "attention_logit_cap": 50.0, "attention_invalid_logits_value": -1.0e9, "use_clipped_linears": True,
    "rms_norm_eps": 1e-6, "gradient_clipping": 1e10, "output_proj_dims": 1536,
}
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
_CHECKPOINT_PREFIX = "model.audio_tower."
# transformers' sinusoid timescales (Gemma4AudioRelPositionalEncoding)
_MIN_TIMESCALE, _MAX_TIMESCALE = 1.0, 10_000.0


class _ClippableLinear(nn.Module):
    """transformers' Gemma4ClippableLinear: a bias-free projection under `.linear`, with use_clipped_linears its
    input and output clamped to the checkpoint's bounds (scalars beside it)."""

    def __init__(self, rows: int, cols: int, clipped: bool, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.linear = nn.Linear(cols, rows, bias=False, dtype=dtype, device=device)
        self.clipped = clipped
        if clipped:
            def bound(value: float) -> nn.Parameter:
                return nn.Parameter(torch.tensor(value, dtype=dtype, device=device), requires_grad=False)

            self.input_min, self.input_max = bound(-math.inf), bound(math.inf)
            self.output_min, self.output_max = bound(-math.inf), bound(math.inf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = torch.clamp(x, self.input_min, self.input_max)
        return torch.clamp(self.linear(x), self.output_min, self.output_max)


class _Clamp:
    """gradient_clipping: values clamped to +-limit, the limit at most the dtype's largest (transformers' guard
    against an overflow in half precision)."""

    def __init__(self, limit: float) -> None:
        self.limit = limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        limit = min(self.limit, torch.finfo(x.dtype).max)
        return torch.clamp(x, -limit, limit)


class Gemma4AudioSubsampleLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, eps: float, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=2, padding=1, bias=False, dtype=dtype,
                              device=device)
        self.norm = nn.LayerNorm(out_channels, eps=eps, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, channels, time, mel] -> [1, out_channels, ceil(time / 2), ceil(mel / 2)]."""
        x = self.conv(x.to(self.conv.weight.dtype))
        return F.relu(self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


class Gemma4AudioSubsample(nn.Module):
    """Named `subsample_conv_projection` as in the checkpoint: layer0, layer1, input_proj_linear."""

    def __init__(self, channels: list[int], hidden: int, eps: float, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.layer0 = Gemma4AudioSubsampleLayer(1, channels[0], eps, dtype, device)
        self.layer1 = Gemma4AudioSubsampleLayer(channels[0], channels[1], eps, dtype, device)
        # transformers sizes the projection as (channels[0] // 4) * channels[1]: with its 128 mel bins and 128 first
        # channels that is the (mel / 4) * channels[1] the convolutions give (check_features refuses other bins).
        self.input_proj_linear = nn.Linear((channels[0] // 4) * channels[1], hidden, bias=False, dtype=dtype,
                                           device=device)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.layer1(self.layer0(features[None, None]))
        _, channels, steps, bins = x.shape
        return self.input_proj_linear(x[0].permute(1, 2, 0).reshape(steps, bins * channels))


class Gemma4AudioFeedForward(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], act: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        hidden, clipped, eps = int(cfg["hidden_size"]), bool(cfg["use_clipped_linears"]), float(cfg["rms_norm_eps"])
        self.ffw_layer_1 = _ClippableLinear(4 * hidden, hidden, clipped, dtype, device)
        self.ffw_layer_2 = _ClippableLinear(hidden, 4 * hidden, clipped, dtype, device)
        self.pre_layer_norm = _Norm(hidden, eps, dtype, device)
        self.post_layer_norm = _Norm(hidden, eps, dtype, device)
        self.act = act
        self.clamp = _Clamp(float(cfg["gradient_clipping"]))
        self.residual_weight = float(cfg["residual_weight"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ffw_layer_2(self.act(self.ffw_layer_1(self.pre_layer_norm(self.clamp(x)))))
        return x + self.post_layer_norm(self.clamp(h)) * self.residual_weight


class Gemma4AudioAttention(nn.Module):
    """Local causal attention with Transformer-XL relative positions (module docstring)."""

    inv_timescales: torch.Tensor  # a registered (non-persistent) buffer: the sinusoid's frequencies

    def __init__(self, cfg: Mapping[str, Any], dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        hidden, clipped = int(cfg["hidden_size"]), bool(cfg["use_clipped_linears"])
        self.num_heads = int(cfg["num_attention_heads"])
        self.head_dim = hidden // self.num_heads
        self.q_proj = _ClippableLinear(self.num_heads * self.head_dim, hidden, clipped, dtype, device)
        self.k_proj = _ClippableLinear(self.num_heads * self.head_dim, hidden, clipped, dtype, device)
        self.v_proj = _ClippableLinear(self.num_heads * self.head_dim, hidden, clipped, dtype, device)
        self.post = _ClippableLinear(hidden, hidden, clipped, dtype, device)
        self.relative_k_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False, dtype=dtype,
                                         device=device)
        self.per_dim_scale = nn.Parameter(torch.zeros(self.head_dim, dtype=dtype, device=device), requires_grad=False)
        self.q_scale = self.head_dim**-0.5 / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)
        self.cap = float(cfg["attention_logit_cap"])
        self.invalid = float(cfg["attention_invalid_logits_value"])
        # transformers' mask: key k is seen by query q when 0 <= q - k < context_left - 1, or when
        # 0 < k - q < context_right: the window's distances, from the farthest back to the farthest ahead.
        back = int(cfg["attention_context_left"]) - 1
        ahead = max(int(cfg["attention_context_right"]) - 1, 0)
        if back < 1:
            raise UnsupportedModelError(f"audio_config.attention_context_left {back + 1}: a query must see itself "
                                        "(at least 2)", param="audio_config.attention_context_left")
        self.back, self.ahead = back - 1, ahead
        self.distances = list(range(back - 1, -ahead - 1, -1))
        # The relative table: transformers' sinusoid at positions context // 2 down to 0, context = chunk +
        # context_left - 1 + context_right; a query-key distance d reads its row (context_left - 1) - d (Transformer-
        # XL's shift), or nothing past the table.
        context = int(cfg["attention_chunk_size"]) + back + int(cfg["attention_context_right"])
        self.table = context // 2 + 1
        self.past = back
        half = hidden // 2
        step = math.log(_MAX_TIMESCALE / _MIN_TIMESCALE) / max(half - 1, 1)
        self.register_buffer("inv_timescales", _MIN_TIMESCALE * torch.exp(
            torch.arange(half, dtype=torch.float32, device=device) * -step), persistent=False)

    def _relative_keys(self, dtype: torch.dtype) -> torch.Tensor:
        """[window, heads, head_dim] float32: the relative key of each window distance (zeros past the table)."""
        device = self.inv_timescales.device
        rows = torch.tensor([self.past - d for d in self.distances], device=device)
        inside = (rows >= 0) & (rows < self.table)
        positions = (self.table - 1 - rows.clamp(0, self.table - 1)).float()
        scaled = positions[:, None] * self.inv_timescales[None, :]
        sinusoid = torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=-1).to(dtype)
        keys = self.relative_k_proj(sinusoid).float() * inside[:, None]
        return keys.view(len(self.distances), self.num_heads, self.head_dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] of one clip."""
        t, heads, d = h.shape[0], self.num_heads, self.head_dim
        q = self.q_proj(h).float().view(t, heads, d)
        k = self.k_proj(h).float().view(t, heads, d)
        v = self.v_proj(h).float().view(t, heads, d)
        q = q * self.q_scale * F.softplus(self.per_dim_scale)
        k = k * self.k_scale
        # Each query's window of keys, farthest back first: padded and unfolded, no copy ([T, heads, d, window]).
        width = len(self.distances)

        def windows(x: torch.Tensor) -> torch.Tensor:
            return F.pad(x, (0, 0, 0, 0, self.back, self.ahead)).unfold(0, width, 1)

        logits = torch.einsum("thd,thdw->thw", q, windows(k))
        logits = logits + torch.einsum("thd,whd->thw", q, self._relative_keys(h.dtype))
        logits = torch.tanh(logits / self.cap) * self.cap
        key_at = torch.arange(t, device=h.device)[:, None] - torch.tensor(self.distances, device=h.device)[None, :]
        outside = (key_at < 0) | (key_at >= t)  # the padding of the window, past the clip's ends
        logits = logits.masked_fill(outside[:, None, :], self.invalid)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32)
        o = torch.einsum("thw,thdw->thd", weights, windows(v))
        return self.post(o.reshape(t, heads * d).to(h.dtype))


class Gemma4AudioLightConv(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], act: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        hidden, clipped, eps = int(cfg["hidden_size"]), bool(cfg["use_clipped_linears"]), float(cfg["rms_norm_eps"])
        self.linear_start = _ClippableLinear(2 * hidden, hidden, clipped, dtype, device)
        self.linear_end = _ClippableLinear(hidden, hidden, clipped, dtype, device)
        self.kernel = int(cfg["conv_kernel_size"])
        self.depthwise_conv1d = nn.Conv1d(hidden, hidden, self.kernel, groups=hidden, bias=False, dtype=dtype,
                                          device=device)
        self.pre_layer_norm = _Norm(hidden, eps, dtype, device)
        self.conv_norm = _Norm(hidden, eps, dtype, device)
        self.act = act
        self.clamp = _Clamp(float(cfg["gradient_clipping"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)
        # causal: each step sees the kernel's width of steps up to itself (zeros before the clip)
        h = self.depthwise_conv1d(F.pad(h.T[None], (self.kernel - 1, 0)))[0].T
        return x + self.linear_end(self.act(self.conv_norm(self.clamp(h))))


class Gemma4AudioLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], act: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg["rms_norm_eps"])
        self.feed_forward1 = Gemma4AudioFeedForward(cfg, act, dtype, device)
        self.feed_forward2 = Gemma4AudioFeedForward(cfg, act, dtype, device)
        self.self_attn = Gemma4AudioAttention(cfg, dtype, device)
        self.lconv1d = Gemma4AudioLightConv(cfg, act, dtype, device)
        self.norm_pre_attn = _Norm(hidden, eps, dtype, device)
        self.norm_post_attn = _Norm(hidden, eps, dtype, device)
        self.norm_out = _Norm(hidden, eps, dtype, device)
        self.clamp = _Clamp(float(cfg["gradient_clipping"]))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.feed_forward1(h)
        h = h + self.norm_post_attn(self.clamp(self.self_attn(self.norm_pre_attn(self.clamp(h)))))
        h = self.feed_forward2(self.lconv1d(h))
        return self.norm_out(self.clamp(h))


def audio_tokens(frames: int) -> int:
    """Soft tokens of a clip of `frames` log-mel frames: the two stride-2 convolutions' output length."""
    for _ in range(2):
        frames = (frames - 1) // 2 + 1 if frames > 0 else 0
    return frames


class Gemma4AudioTower(nn.Module):
    """forward(features [frames, mel bins]) -> [audio_tokens(frames), output_proj_dims]."""

    def __init__(self, config: Mapping[str, Any], *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        cfg = {**CONFIG_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        act = _ACTIVATIONS.get(str(cfg["hidden_act"]))
        if act is None:
            raise UnsupportedModelError(f"audio_config.hidden_act {cfg['hidden_act']!r} is not supported (supported: "
                                        f"{', '.join(_ACTIVATIONS)})", param="audio_config.hidden_act")
        channels = [int(c) for c in cfg["subsampling_conv_channels"]]
        if len(channels) != 2:
            raise UnsupportedModelError(f"audio_config.subsampling_conv_channels {channels}: Gemma 4's subsampling has "
                                        "two convolutions", param="audio_config.subsampling_conv_channels")
        hidden = int(cfg["hidden_size"])
        if hidden % int(cfg["num_attention_heads"]):
            raise UnsupportedModelError(f"audio_config.hidden_size {hidden} is not a multiple of num_attention_heads "
                                        f"{cfg['num_attention_heads']}", param="audio_config.num_attention_heads")
        self.hidden_size = hidden
        self.output_dims = int(cfg["output_proj_dims"])
        self.eps = float(cfg["rms_norm_eps"])
        # The mel bins the projection takes: four times its width per channel (two halvings).
        self.mel_bins = 4 * (channels[0] // 4)
        self.subsample_conv_projection = Gemma4AudioSubsample(channels, hidden, self.eps, dtype, device)
        self.layers = nn.ModuleList(Gemma4AudioLayer(cfg, act, dtype, device)
                                    for _ in range(int(cfg["num_hidden_layers"])))
        self.output_proj = nn.Linear(hidden, self.output_dims, bias=True, dtype=dtype, device=device)

    def check_features(self, shape: list[int]) -> str | None:
        """What is wrong with a clip's features of this shape for this tower, or None."""
        if len(shape) != 2 or shape[0] < 1:
            return f"features {shape}: the tower takes [frames, {self.mel_bins}] log-mel frames"
        if shape[1] != self.mel_bins:
            return f"features {shape}: {shape[1]} mel bins, the tower takes {self.mel_bins}"
        return None

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        h = self.subsample_conv_projection(features)
        for layer in self.layers:
            h = layer(h)
        return self.output_proj(h)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Checkpoint names under `model.audio_tower.` (the prefix optional). Every parameter must be set; a name
        the tower does not have is an UnsupportedModelError (a ValueError)."""
        load_tower_tensors(self, weights, "Gemma 4 audio tower", rename=lambda n: n.removeprefix(_CHECKPOINT_PREFIX))


class Gemma4AudioEmbedder(nn.Module):
    """transformers' Gemma4MultimodalEmbedder for audio: a weightless RMSNorm over the tower's output_proj_dims,
    then one matmul into the text width."""

    def __init__(self, audio_dims: int, text_hidden: int, eps: float, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.embedding_projection = nn.Linear(audio_dims, text_hidden, bias=False, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(_norm(rows, None, self.eps))
