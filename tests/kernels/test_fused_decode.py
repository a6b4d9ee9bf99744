"""The Triton backend's one-token decode path (attention/fused_decode.py) driven through tiny Llama,
Qwen2, Qwen3, MoE, Granite (a softmax scale of its own), Phi-3 (YaRN, partial rotary) and Ministral 3 (YaRN,
Llama 4's query scaling) models built with the Triton kernel set, against the same weights on the torch
kernel set, and against the Triton set with FERROX_FUSED_DECODE=0. Runs on CUDA, or on CPU in the
Triton interpreter child (see conftest.py), where `kernels="triton"` forces the GPU path."""

from __future__ import annotations

import pytest
import torch
from ferrox.attention.decode_path import DecodePath
from ferrox.attention.fused_decode import FusedOneTokenDecode
from ferrox.attention.kv_cache import allocate_kv_caches
from ferrox.layers.quant.method import use_quant_config
from ferrox.loader.model_config import spec_from_hf_config
from ferrox.loader.model_loader import init_dummy_weights
from ferrox.models.registry import get_model_class

from tests.helpers.driver import StepRequest, build_step
from tests.helpers.interpreter import INTERPRETED, interpreted_or, wide_row_tiles
from tests.kernels.kernel_refs import relative_error

BLOCK = 4
DECODE_TOKENS = [11, 42, 5, 60]


MOE = {
    # Qwen3-MoE: q/k norms and renormalised top-3 (k not a power of two) of 6 experts, a dense
    # first layer; Qwen2-MoE: a shared expert; Mixtral: top-2, always renormalised.
    "Qwen3MoeForCausalLM": {"num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 16,
                            "norm_topk_prob": True, "mlp_only_layers": [0]},
    "Qwen2MoeForCausalLM": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                            "shared_expert_intermediate_size": 24},
    "MixtralForCausalLM": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16},
}


@pytest.fixture(autouse=True)
def _wide_row_tiles_when_interpreted(monkeypatch):
    """The interpreter runs a launch's programs one after another in Python, so the H200's 2-row
    programs make these six models the slowest CPU test in the suite (~85 s on the 2-core CI box).
    Interpreted, the one-token products here take 16 rows a program: the same kernels, ~8x fewer
    programs (with one unfused run a model instead of two, 83 -> 35 s). The production configs keep
    their own interpreted tests (test_gemv.py, test_fused_moe.py) and run here natively on a GPU."""
    if INTERPRETED:
        wide_row_tiles(monkeypatch)


# Granite: a softmax scale (attention_multiplier) far from head_dim ** -0.5, which the fused path
# must read from the layer as the general one does; the other multipliers live in the weights.
# Phi-3 with YaRN over partial rotary: the rope rows carry cos / sin scaled by YaRN's attention factor
# and unturned pairs, which the fused qkv kernel applies as the general path's rotary does.
# Ministral 3: YaRN and Llama 4's query scaling over a 4-position original context, so the prompt and the
# decode steps (positions 0-9) cross its steps: the fused path scales the queries its qkv kernel returns.
FAMILY = {"GraniteForCausalLM": {"attention_multiplier": 0.03, "embedding_multiplier": 12.0,
                                 "residual_multiplier": 0.22, "logits_scaling": 8.0},
          "Phi3ForCausalLM": {"partial_rotary_factor": 0.5, "rope_scaling": {
              "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
          "Ministral3ForCausalLM": {"rope_parameters": {
              "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 4,
              "mscale": 1.0, "mscale_all_dim": 0.0, "llama_4_scaling_beta": 0.5}}}


def _config(arch: str) -> dict:
    return {
        # Small enough for the interpreter (hidden_size != heads x head_dim on purpose).
        "architectures": [arch], "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 48, "num_hidden_layers": 2, "vocab_size": 61,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
        "tie_word_embeddings": arch != "Qwen2ForCausalLM",  # one untied lm_head among the three
        **MOE.get(arch, {}), **FAMILY.get(arch, {}),
    }


def _models(arch: str, device: torch.device, **config):
    """(reference on the torch kernel set, the same weights on the Triton set); config: changes to
    _config's."""
    spec = spec_from_hf_config(_config(arch) | config, "test config")
    cls = get_model_class([arch])
    ref = cls(spec, torch.float32, device, kernels="torch")
    init_dummy_weights(ref, seed=3)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if name.endswith("bias"):  # Qwen2's q/k/v biases: make the fused bias add matter
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            elif not name.endswith("norm.weight"):
                param.mul_(10.0)  # std 0.2: logits far from ties, activations of a trained model's size
            else:
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
    fused = cls(spec, torch.float32, device, kernels="triton")
    fused.load_state_dict(ref.state_dict())
    for model in (ref, fused):
        model.finalize_weights()
        model.eval()
    return ref, fused


@torch.inference_mode()
def _run(model, device: torch.device, prompt: list[int], decode: list[int] | None = None) -> torch.Tensor:
    """float32 logits [1 + len(decode), vocab]: the prompt's last token, then one decode step per token
    of `decode` (DECODE_TOKENS by default; fed, not sampled, so every model sees the same inputs)."""
    caches = allocate_kv_caches(model.spec, 8, BLOCK, torch.float32, device)
    blocks = list(range(1, 8))
    ids, pos, meta = build_step([StepRequest(prompt, 0, blocks)], BLOCK, device)
    rows = [model.compute_logits(model(ids, pos, caches, meta)[-1:])]
    for i, token in enumerate(DECODE_TOKENS if decode is None else decode):
        ids, pos, meta = build_step([StepRequest([token], len(prompt) + i, blocks)], BLOCK, device)
        rows.append(model.compute_logits(model(ids, pos, caches, meta)))
    return torch.cat(rows)


def quantized_models(device: torch.device, quant_config, arch: str = "LlamaForCausalLM"
                     ) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny `arch` built under `quant_config` (a checkpoint method: dummy codes and scales, seeded
    per layer, so both get the same) on the torch kernel set (general path) and on the Triton set."""
    spec = spec_from_hf_config(_config(arch), "test config")
    cls = get_model_class([arch])
    models = []
    for kernels in ("torch", "triton"):
        with use_quant_config(quant_config):
            model = cls(spec, torch.float32, device, kernels=kernels)
        init_dummy_weights(model, seed=3)
        model.finalize_weights()
        models.append(model.eval())
    return models[0], models[1]


def assert_fused_path_matches(ref, fused, device: torch.device, monkeypatch) -> None:
    """The Triton model's one-token steps take the fused path, and its logits match the general
    path's (the quantized-weight tests: fp8, int8, block fp8). Interpreted, two decode steps."""
    path = fused.model.decode_path
    assert isinstance(path, FusedOneTokenDecode) and path.layers is not None
    steps = _count_calls(monkeypatch, "forward")
    prompt, decode = [3, 9, 27, 41, 50, 20], interpreted_or(DECODE_TOKENS, DECODE_TOKENS[:2])
    expected = _run(ref, device, prompt, decode)
    got = _run(fused, device, prompt, decode)
    assert len(steps) == len(decode), "the fused one-token path did not run"
    assert relative_error(got, expected) < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def _count_calls(monkeypatch, name: str) -> list[int]:
    calls: list[int] = []
    original = getattr(FusedOneTokenDecode, name)

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FusedOneTokenDecode, name, counted)
    return calls


# (Qwen2's q/k/v biases and Qwen3's q/k norms run in their MoE siblings' attention, so the dense two are left out.)
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", *MOE, *FAMILY])
def test_one_token_path_matches_the_general_path(kernel_device, monkeypatch, arch):
    ref, fused = _models(arch, kernel_device)
    assert type(ref.model.decode_path) is DecodePath
    path = fused.model.decode_path
    assert isinstance(path, FusedOneTokenDecode)
    assert path.layers is not None  # every family's layers fit (Qwen3's q/k norms, sparse MLPs)
    if arch in MOE:
        sparse = [layer.moe is not None for layer in path.layers]
        assert sparse == ([False, True] if arch == "Qwen3MoeForCausalLM" else [True, True])
    steps = _count_calls(monkeypatch, "forward")
    heads = _count_calls(monkeypatch, "_layer")
    # Interpreted, the one-token prefill's run (what it adds: that step on the fused path, and a decode
    # reading the KV it wrote) and the unfused run take fewer decode steps than the first prompt's run.
    for prompt, decode in (([3, 9, 27, 41, 50, 20], DECODE_TOKENS),  # decodes cross into a third block
                           ([7], interpreted_or(DECODE_TOKENS, DECODE_TOKENS[:1]))):  # fused one-token prefill
        expected = _run(ref, kernel_device, prompt, decode)
        steps.clear()
        got = _run(fused, kernel_device, prompt, decode)
        one_token_steps = len(decode) + (len(prompt) == 1)
        assert len(steps) == one_token_steps
        assert len(heads) == len(steps) * 2  # two decoder layers each step
        heads.clear()
        assert relative_error(got, expected) < 1e-4
        assert torch.equal(got.argmax(-1), expected.argmax(-1))

        if len(prompt) == 1:
            continue  # the unfused Triton path needs one prompt here; it has its own tests
        unfused_decode = interpreted_or(decode, decode[:2])
        rows = 1 + len(unfused_decode)
        monkeypatch.setenv("FERROX_FUSED_DECODE", "0")  # read per step: the same model, unfused
        steps.clear()
        unfused = _run(fused, kernel_device, prompt, unfused_decode)
        monkeypatch.delenv("FERROX_FUSED_DECODE")
        assert not steps
        assert relative_error(unfused, expected[:rows]) < 1e-4
        assert relative_error(got[:rows], unfused) < 1e-4


def test_one_token_path_declines_batches_and_profiling_steps(kernel_device):
    _, fused = _models("LlamaForCausalLM", kernel_device)
    path = fused.model.decode_path
    caches = allocate_kv_caches(fused.spec, 4, BLOCK, torch.float32, kernel_device)
    assert path.takes_step(1, caches)
    assert not path.takes_step(2, caches)  # a batch keeps the GEMMs
    assert not path.takes_step(1, [c[:, :0] for c in caches])  # no KV cache yet (profiling forward)
    assert not path.takes_step(1, [])
