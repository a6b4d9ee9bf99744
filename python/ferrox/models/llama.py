"""Llama-family decoder (Llama 2/3/3.1, Mistral, SmolLM2), also the base of the Qwen models.

Shapes: every forward takes a flat batch of T tokens (requests concatenated, any mix of prefill
chunks and decodes); attention metadata tells the backend where each request's rows are.
Projections are merged (q/k/v -> qkv_proj, gate/up -> gate_up_proj) so a layer runs 4 matmuls.

No device branches here: the kernel set is chosen once when the model is built (`kernels`,
default from the device), and with it the layers' ops (layers/ops.py), the attention backend and
the decode path the backend gives (attention/decode_path.py), which may run a one-token step in
fused kernels and computes the logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend, get_attention_backend
from ferrox.attention.cpu_decode import CpuQuantizedDecode
from ferrox.attention.decode_path import DecodePath, OneTokenLayer
from ferrox.attention.kv_cache import KVCacheScales, split_kv_scale_name
from ferrox.attention.metadata import AttentionMetadata
from ferrox.distributed.parallel_state import get_tp_group
from ferrox.distributed.sharding import check_tp_shapes, materialize
from ferrox.kernels import select_kernels
from ferrox.layers.activation import SiluAndMul
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.linear import Linear, MergedLinear, QKVLinear, RowParallelLinear
from ferrox.layers.ops import DeviceOps, Rope, for_device
from ferrox.layers.quant import CpuQuantWeight, QuantizedTensor
from ferrox.layers.rotary import RotaryEmbedding, check_rotary_dim
from ferrox.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from ferrox.model_spec import ModelLoadError, ModelSpec, UnsupportedModelError
from ferrox.models.load_check import check_all_loaded, load_into
from ferrox.models.pre_norm import PreNormDecoderLayer, run_pre_norm_layers

# HF checkpoint names folded into a merged layer: (merged module, shard name).
_MERGED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
# Checkpoint entries that carry no weights we need (precomputed rotary tables of old exports).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype, device, *,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool, window: int = 0):
        """window: this layer's sliding window as served (ModelSpec.window_of; 0: full attention)."""
        super().__init__()
        self.head_dim = spec.head_dim
        self.window = window
        # Every attention path (backends, fused one-token, CPU Rust decode, CUDA graphs) takes this.
        self.scale = spec.attention_scale if spec.attention_scale is not None else self.head_dim ** -0.5
        # Under tensor parallelism this rank's heads only (layers/linear.py QKVLinear).
        self.qkv_proj = QKVLinear(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, bias=qkv_bias,
                                  dtype=dtype, device=device)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=o_bias, dtype=dtype,
                                        device=device)
        # Qwen3: RMSNorm over each head's q and k before rotary.
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, dtype, device, ops) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, dtype, device, ops) if qk_norm else None
        self.backend = backend
        # An FP8 KV cache's k/v scales (the checkpoint's k_scale / v_scale, else 1.0).
        self.kv_scales = KVCacheScales(device)

    def forward(self, x, rope: Rope, kv_cache, meta):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        v = qkv[:, q_size + kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None or self.k_norm is None:
            # q and k are adjacent columns of qkv: one rotary pass over both (in place on the GPU).
            q, k = rope.rotate_qk(qkv[:, :q_size + kv_size].view(t, self.num_heads + self.num_kv_heads,
                                                                 self.head_dim), self.num_heads)
        else:
            # Qwen3: each q and k head normed, then rotated, into new q and k (one launch on the
            # Triton set, the same kernel math as the one-token path; the torch formula on CPU).
            q, k = rope.norm_rotate_qk(qkv, self.num_heads, self.num_kv_heads, self.q_norm.weight,
                                       self.k_norm.weight, self.q_norm.eps)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.kv_scales, window=self.window)
        return self.o_proj(o.reshape(t, q_size))


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, ops: DeviceOps, dtype, device):
        super().__init__()
        if spec.hidden_act not in ("silu", "swish"):
            raise UnsupportedModelError(f"config.json: hidden_act {spec.hidden_act!r} is not supported (only silu)")
        inter = spec.intermediate_size
        self.gate_up_proj = MergedLinear(spec.hidden_size, {"gate": inter, "up": inter}, bias=spec.mlp_bias,
                                         dtype=dtype, device=device)
        self.act = SiluAndMul(ops)
        self.down_proj = RowParallelLinear(inter, spec.hidden_size, bias=spec.mlp_bias, dtype=dtype, device=device)

    def forward(self, x, reduce: bool = True):
        """reduce False (a row-parallel down_proj only): this rank's partial sum, not yet all-reduced."""
        h = self.act(self.gate_up_proj(x))
        return self.down_proj(h) if reduce else self.down_proj(h, reduce=False)


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype, device, *, qkv_bias,
                 o_bias, qk_norm, window: int = 0, attention_class: type[LlamaAttention] = LlamaAttention,
                 mlp_class: type[nn.Module] | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.self_attn = attention_class(spec, backend, ops, dtype, device, qkv_bias=qkv_bias, o_bias=o_bias,
                                         qk_norm=qk_norm, window=window)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.mlp: Any = (mlp_class or LlamaMLP)(spec, ops, dtype, device)

    def one_token_view(self) -> OneTokenLayer:
        """This layer as a fused one-token decode path reads it (attention/decode_path.py)."""
        attn, mlp = self.self_attn, self.mlp
        return OneTokenLayer(input_norm=self.input_layernorm, qkv_proj=attn.qkv_proj, o_proj=attn.o_proj,
                             post_norm=self.post_attention_layernorm, gate_up_proj=mlp.gate_up_proj,
                             down_proj=mlp.down_proj, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
                             head_dim=attn.head_dim, scale=attn.scale, tp=attn.o_proj.tp,
                             kv_scales=attn.kv_scales, q_norm=attn.q_norm, k_norm=attn.k_norm, window=attn.window)



class LlamaModel(nn.Module):
    # The layers' attention (Hunyuan norms q/k after rotary: models/hunyuan.py) and MLP (None: LlamaMLP; Arcee's and
    # Apertus's ungated ones: models/ungated_mlp.py), and whether the fused one-token kernels can run its layers.
    attention_class: type[LlamaAttention] = LlamaAttention
    mlp_class: type[nn.Module] | None = None
    fused_one_token = True

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype, device, *, qkv_bias,
                 o_bias, qk_norm):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        layers = [LlamaDecoderLayer(spec, backend, ops, dtype, device, qkv_bias=qkv_bias, o_bias=o_bias,
                                    qk_norm=qk_norm, window=spec.window_of(i), attention_class=self.attention_class,
                                    mlp_class=self.mlp_class)
                  for i in range(spec.num_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        # The model's op set: on the Triton set Qwen3's (qk_norm) q/k norms and rotary are one kernel
        # (Rope.norm_rotate_qk), whose per-head math the one-token path's kernel shares.
        self.rotary = RotaryEmbedding.for_spec(spec, device, ops)
        self.qk_norm = qk_norm
        self.backend = backend
        views = [layer.one_token_view() for layer in layers]
        # Qwen3's q/k-norm layers take the one-token path on one rank only: under tensor parallelism
        # (not yet run on two GPUs) they keep the general layers.
        sharded = qk_norm and views[0].tp is not None and views[0].tp.size > 1
        self.one_token_layers = None if sharded or not self.fused_one_token else views
        self.decode_path = backend.decode_path(self.one_token_layers, self.rotary.rope_rows)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None):
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.decode_path.takes_step(h.shape[0], kv_caches, meta):
            return self.norm(self.decode_path.forward(h, positions, kv_caches, meta))
        return run_pre_norm_layers(self.layers, self.norm, h, self.rotary(positions, h.dtype), kv_caches, meta)


class LlamaForCausalLM(nn.Module):
    # Architecture switches the Qwen subclasses flip.
    qkv_bias_always = False  # Qwen2: q/k/v carry a bias whatever attention_bias says
    o_bias_never = False  # GLM: attention_bias puts a bias on q/k/v only, never on o_proj
    qk_norm = False  # Qwen3: per-head RMSNorm of q and k
    # Every layer is a parallel layer: tensor_parallel_size > 1 shards it (subclasses that add
    # layers of their own, e.g. experts, set False until those are sharded too).
    supports_tensor_parallel = True
    # load_weights takes QuantizedTensors (GGUF blocks kept quantized, layers/quant): the linear
    # layers and the LM head run them packed, the embedding gets dequantized rows.
    supports_quantized_gguf = True
    # Linear layers take a checkpoint quantization method (fp8, AWQ, GPTQ: layers/quant/method.py).
    supports_quantization = True
    # load_weights puts partial-rotary q/k rows in whole-head pairs (Phi-3: layers/rotary.py).
    reorders_partial_rotary = False
    # The decoder stack (a family with its own layer shape, Gemma 2, brings its own; same arguments).
    model_class: type[nn.Module]
    # Submodules a subclass loads itself (a vision tower: models/llava.py); load_weights neither takes nor
    # expects their parameters.
    own_weight_prefixes: tuple[str, ...] = ()

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        """kernels: "torch" | "triton" forces a kernel set (tests run the Triton one on CPU in the
        interpreter); by default the device's (kernels.select_kernels)."""
        super().__init__()
        self.spec = spec
        tp = get_tp_group()
        # (expert_parallel: a family with experts among its layers, gpt-oss and Gemma 4, splits them by count)
        check_tp_shapes(spec, tp.size, expert_parallel=tp.expert_parallel)
        check_rotary_dim(spec, self.reorders_partial_rotary)
        self.kernels = select_kernels(device, kernels)
        self.ops = for_device(device, self.kernels)
        self.backend = get_attention_backend(device, self.kernels)
        bias = spec.attention_bias
        # (Any: LlamaModel or a family's own stack with the same attributes: layers, norm, rotary, decode_path.)
        self.model: Any = self.model_class(spec, self.backend, self.ops, dtype, device,
                                      qkv_bias=bias or self.qkv_bias_always, o_bias=bias and not self.o_bias_never,
                                      qk_norm=self.qk_norm)
        if spec.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)

        # Column-major copy of a tied lm_head on CPU (finalize_weights); a buffer so .to() moves it.
        self.register_buffer("lm_head_colmajor", None, persistent=False)
        # A quantized GGUF's LM head (its output.weight, or the tied token_embd.weight), packed by
        # finalize_weights; the checkpoint tensor waits in _lm_head_blocks until then.
        self.lm_head_quant: CpuQuantWeight | None = None
        self._lm_head_blocks: QuantizedTensor | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.lm_head_colmajor is not None:
            return self.lm_head_colmajor
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def finalize_weights(self) -> None:
        """After loading, where the op set asks for it (torch on CPU): store every projection
        column-major (same logical [out, in] shape, so F.linear is unchanged). One-token decode runs
        matrix-vector products, and the BLAS kernel for that layout reads memory ~1.4x faster
        (measured on the 49152x576 lm_head: 7.4 -> 4.4 ms); batched matmuls run at the same speed
        with identical results. A tied lm_head gets its own column-major copy because the
        embedding lookup wants rows."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.finalize_quantized()
        if any(m.weight_method is not None and not m.weight_method.fused_decode
               for m in self.modules() if isinstance(m, Linear)):
            # The fused one-token kernels read plain, fp8 and int4 (kernels, no act-order) weights;
            # other quantized layers run their own matmuls, so one-token steps take the general path.
            self.model.decode_path = DecodePath()
        linears = [m for m in self.model.layers.modules() if isinstance(m, Linear)]
        if self.model.one_token_layers is not None and not self.model.qk_norm and linears and all(
                isinstance(m.quant, CpuQuantWeight) for m in linears):
            # A quantized GGUF on the CPU: every step runs in the Rust decoder (attention/cpu_decode.py).
            self.model.decode_path = CpuQuantizedDecode(self.model.one_token_layers, self.model.rotary.rope_rows)
        if self._lm_head_blocks is not None:
            self.lm_head_quant = CpuQuantWeight([self._lm_head_blocks.decode()])
            self._lm_head_blocks = None
            if self.lm_head is not None:  # never loaded: the packed copy is the only one
                self.lm_head.weight.data = torch.empty(0, dtype=self.lm_head.weight.dtype)
        if not self.ops.column_major_weights:
            return
        for module in self.modules():
            if isinstance(module, (Linear, ParallelLMHead)) and module.weight.numel() and (
                    getattr(module, "quant", None) is None):
                module.weight.data = module.weight.data.t().contiguous().t()
        if self.lm_head is None and self.lm_head_quant is None:
            self.lm_head_colmajor = self.model.embed_tokens.weight.data.t().contiguous().t()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; logits come from compute_logits on the rows
        that need sampling, so a long prefill never materialises [T, vocab]. inputs_embeds: the step's
        input embeddings when some rows are not token embeddings (an image's: embed_input_ids, then
        those rows replaced; worker/multimodal.py)."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} tensors, the model has {len(self.model.layers)} layers")
        self.backend.begin_forward(attn_metadata)
        if inputs_embeds is None:
            return self.model(input_ids, positions, kv_caches, attn_metadata)
        return self.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds=inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings forward() would start from (a family's embedding scale included)."""
        return self.model.embed(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the given rows (the decode path may run a one-row lm_head fused); under
        tensor parallelism each rank computes its vocabulary rows and every rank gets all of them."""
        if self.lm_head_quant is not None:
            return self.model.embed_tokens.gather_logits(self.lm_head_quant(hidden).float())
        return self.model.embed_tokens.gather_logits(self.model.decode_path.logits(hidden, self.lm_head_weight))

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy HF-named checkpoint tensors in (torch tensors, or safetensors slices read lazily so
        that a tensor-parallel rank reads only its shard); every parameter must be set exactly once."""
        skip = self.own_weight_prefixes
        params = {name: p for name, p in self.named_parameters() if not name.startswith(skip)}
        modules = {name: m for name, m in self.named_modules() if not name.startswith(skip)}
        # Linear layers name what they need (one tensor per shard of a merged layer, a quantized
        # checkpoint's qweight/scales); every other parameter is one tensor of its own name.
        linears = {name: m for name, m in modules.items() if isinstance(m, Linear)}
        expected = {p for p in params if p.rpartition(".")[0] not in linears}
        for name, linear in linears.items():
            expected |= linear.checkpoint_keys(name)
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store the copy anyway
            if load_kv_scale(modules, name, tensor):
                continue
            if isinstance(tensor, QuantizedTensor) and name in ("lm_head.weight", "model.embed_tokens.weight"):
                # The LM head runs packed (finalize_weights); the embedding looks rows up in floats.
                if name == "lm_head.weight" or self.lm_head is None:
                    self._lm_head_blocks = tensor
                if name == "lm_head.weight":
                    loaded.add(name)
                    continue
                tensor = tensor.dequantize()
            prefix, _, leaf = name.rpartition(".")
            parent, _, proj = prefix.rpartition(".")
            shard: str | None = None
            if proj in _MERGED:
                merged, shard = _MERGED[proj]
                module = modules.get(f"{parent}.{merged}")
                if not isinstance(module, MergedLinear) or not linear_takes(module, f"{parent}.{merged}", leaf, shard):
                    unexpected.append(name)
                    continue
                key = f"{parent}.{merged}.{leaf}#{shard}"
            else:
                module = modules.get(prefix)
                if module is None or not (name in params or linear_takes(module, prefix, leaf, None)):
                    unexpected.append(name)
                    continue
                key = name
            try:
                load = getattr(module, "load_weight", None)
                if load is not None:
                    load(leaf, tensor, shard)
                else:  # norms: replicated, loaded whole
                    _copy_whole(params[name], materialize(tensor))
            except ValueError as e:
                raise ModelLoadError(f"tensor {name!r}: {e} (config.json does not match the weights?)") from e
            loaded.add(key)
        check_all_loaded(self.spec.architecture, unexpected, expected, loaded)


def load_kv_scale(modules: dict[str, nn.Module], name: str, tensor: Any) -> bool:
    """Take checkpoint tensor `name` if it is an attention layer's FP8 KV-cache scale
    (attention/kv_cache.py names them); whether it was one."""
    kv_scale = split_kv_scale_name(name)
    if kv_scale is None or not isinstance(attn := modules.get(kv_scale[0]), LlamaAttention):
        return False
    try:
        if kv_scale[1] != "unused":
            attn.kv_scales.load(kv_scale[1], materialize(tensor), name)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    return True


def linear_takes(module: Any, name: str, leaf: str, shard: str | None) -> bool:
    """Whether the linear layer at `name` takes checkpoint tensor `leaf` (of `shard`): one it needs,
    or an optional one of its quantization method (fp8's static input_scale)."""
    if not isinstance(module, Linear):
        return False
    optional = module.weight_method.optional_params if module.weight_method is not None else ()
    return leaf in optional or f"{name}.{leaf}" + (f"#{shard}" if shard else "") in module.checkpoint_keys(name)


def load_dense_tensor(modules: Mapping[str, nn.Module], params: Mapping[str, torch.Tensor], name: str, tensor: Any,
                      merged_names: Mapping[str, tuple[str, str]],
                      rewrite: Callable[[Any, str], Any] | None = None) -> str | None:
    """A checkpoint tensor that is no expert's into its place: a merged layer's shard when its projection is
    one of `merged_names` (proj -> (merged layer, shard); `rewrite(tensor, shard)` first, when given), else the
    module named by its prefix (models/load_check.load_into). Returns the key it loaded under (merged shards
    `layer.leaf#shard`), None when the model has no place for it; ValueError on a shape it does not have."""
    prefix, _, leaf = name.rpartition(".")
    parent, _, proj = prefix.rpartition(".")
    if proj in merged_names:
        merged_name, shard = merged_names[proj]
        merged = modules.get(f"{parent}.{merged_name}")
        if not isinstance(merged, MergedLinear) or not linear_takes(merged, f"{parent}.{merged_name}", leaf, shard):
            return None
        merged.load_weight(leaf, rewrite(tensor, shard) if rewrite is not None else tensor, shard)
        return f"{parent}.{merged_name}.{leaf}#{shard}"
    owner, param = modules.get(prefix), params.get(name)
    if owner is None or not (param is not None or linear_takes(owner, prefix, leaf, None)):
        return None
    load_into(owner, param, leaf, tensor)
    return name


def _copy_whole(param: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}")
    param.data.copy_(tensor)


LlamaForCausalLM.model_class = LlamaModel


class MistralForCausalLM(LlamaForCausalLM):
    """Same weights and maths as Llama (sliding-window attention is not applied; see README)."""
