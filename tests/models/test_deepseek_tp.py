"""DeepSeek-V2 / V3 under tensor parallelism (models/deepseek_v2.py, models/mla_attention.py): the query
heads split across the ranks, the latent replicated, experts sharded or (expert parallel) split.

On the CPU the engine runs 2 rank processes over gloo (as tests/engine/test_tensor_parallel.py) on tiny
random checkpoints (tests/helpers/tiny_deepseek.py): V2-Lite's layout (q_proj, no q LoRA) and V3's (q
LoRA, sigmoid grouped routing with the correction bias), float32, greedy; a 67-token prompt is prefilled in
chunks of a 16-token budget. Tokens must equal the single-process engine's, logprobs agree to rounding
(the sharded sums differ from the whole ones only in rounding). A block-FP8 V3 checkpoint the same way.
A rank's shard is also checked directly against the whole model (its heads' W_UK / W_UV rows), and the
splits that cannot work are refused by name.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ferrox.attention.kv_cache import kv_cache_bytes_per_block
from ferrox.distributed.parallel_state import TPGroup, use_tp_group
from ferrox.loader.model_config import spec_from_hf_config
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.model_spec import ModelLoadError, UnsupportedModelError
from ferrox.models.deepseek_v2 import DeepseekV3ForCausalLM

from tests.helpers.tiny_deepseek import make_tiny_deepseek

pytest.importorskip("transformers")

# A 67-token prompt is prefilled in 5 chunks of max_num_batched_tokens=16 (beside the others' decodes).
PROMPTS = [[1, 5, 9, 33, 7], list(range(3, 70)), [2, 8, 100, 41, 41, 41, 9, 3, 77], [5] * 23]
MAX_TOKENS = 10
KV_BLOCKS = 24  # per rank, 16-token blocks: room for every prompt at once
FP8_BLOCK = (32, 32)

BUILDERS = {
    "v2_lite": lambda d: make_tiny_deepseek(d, version=2, q_lora_rank=None, topk_method="greedy", seed=3),
    # Grouped top-k (2 groups of 3 experts, the best group's experts only): every rank must see all experts.
    "v3": lambda d: make_tiny_deepseek(d, version=3, n_group=2, topk_group=1, routed_scaling_factor=2.5, seed=5),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_deepseek_tp")
    return {name: build(root / name) for name, build in BUILDERS.items()}


def generate(folder: str, tp: int, device: str = "cpu", **kw) -> tuple[list[list[int]], list[list[float]]]:
    """(greedy tokens, their logprobs) of PROMPTS, with the same KV blocks per rank whatever the TP size."""
    from ferrox import LLM, SamplingParams

    spec = load_model_spec(resolve_model(folder))
    kv_bytes = KV_BLOCKS * kv_cache_bytes_per_block(spec, 16, torch.float32, tp)
    llm = LLM(model=folder, device=device, dtype="float32", tensor_parallel_size=tp, kv_cache_memory=kv_bytes,
              max_num_batched_tokens=16, max_num_seqs=4, max_model_len=KV_BLOCKS * 16, block_size=16, **kw)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
                for o in outs]
    return tokens, logprobs


def assert_same(reference, sharded, atol: float = 1e-3) -> None:
    assert sharded[0] == reference[0]
    for want, got in zip(reference[1], sharded[1], strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=atol, rtol=0)


@pytest.fixture(scope="module")
def single(folders):
    """name -> the single-process engine's (tokens, logprobs): the reference of every sharded run."""
    return {name: generate(folder, 1) for name, folder in folders.items()}


# ---- CPU, gloo ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "expert_parallel"), [
    ("v2_lite", False),  # q_proj by heads; every expert's intermediate rows split 16 + 16
    ("v3", False),  # q_b_proj by heads (q_a_proj replicated), grouped routing, sharded experts
    ("v3", True),  # 6 experts split 3 + 3 over the ranks; shared experts and the dense layer still sharded
])
def test_tp2_matches_single_process(folders, single, name, expert_parallel):
    assert_same(single[name], generate(folders[name], 2, enable_expert_parallel=expert_parallel))


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    """A tiny V3 in DeepSeek-V3's block-FP8 layout (every projection E4M3, a scale per 32 x 32 block), its
    sizes chosen so that every rank's share is whole blocks at TP 2: q_b_proj 2 heads x 32 rows, kv_b_proj
    2 x (16 + 32) rows, o_proj's 2 x 32 input columns, the experts' 32 of 64 intermediate rows, the shared
    experts' and the dense MLP's 64 of 128."""
    from safetensors.torch import load_file

    from tests.helpers.fp8_block_checkpoints import quantize_blocks
    from tests.helpers.fp8_moe_checkpoints import fp8_config
    from tests.helpers.quant_checkpoints import write_checkpoint

    root = tmp_path_factory.mktemp("tiny_deepseek_tp_fp8")
    floats = make_tiny_deepseek(root / "float", version=3, n_group=2, topk_group=1, v_head_dim=32,
                                moe_intermediate_size=64, intermediate_size=128, seed=7)
    return write_checkpoint(floats, root / "fp8", fp8_config("block", FP8_BLOCK), _block_fp8(
        load_file(f"{floats}/model.safetensors"), quantize_blocks))


def _block_fp8(tensors: dict[str, torch.Tensor], quantize_blocks) -> dict[str, torch.Tensor]:
    out = {}
    for name, w in tensors.items():
        if name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            module = name.rsplit(".", 1)[0]
            out[name], out[f"{module}.weight_scale_inv"] = quantize_blocks(w, FP8_BLOCK)
        else:
            out[name] = w
    return out


def test_block_fp8_tp2_matches_single_process(fp8_folder):
    """The block scales cut with their weights (kv_b_proj's dequantized per rank for the absorption). Each
    rank quantizes its row-parallel input in the same 32-wide groups one rank does, so only the sums'
    rounding differs; an activation moved by ~1e-7 may still move an FP8 code, hence logprobs within 0.05
    (as tests/engine/test_tensor_parallel.py's FP8 experts)."""
    assert_same(generate(fp8_folder, 1), generate(fp8_folder, 2), atol=0.05)


# ---- one rank's shard, in this process ------------------------------------------------------------
def _load_rank(folder: str, rank: int, size: int, expert_parallel: bool = False):
    """Rank `rank` of `size` loaded as its engine process loads it (lazy safetensors slices); nothing it
    does at load talks to the other ranks."""
    source = resolve_model(folder)
    with use_tp_group(TPGroup(rank=rank, size=size, expert_parallel=expert_parallel)):
        return load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu")


def test_a_rank_holds_its_heads_and_the_whole_latent(folders):
    folder = folders["v3"]
    whole, rank1 = _load_rank(folder, 0, 1), _load_rank(folder, 1, 2)
    for full, part in zip(whole.model.layers, rank1.model.layers, strict=True):
        a, b = full.self_attn, part.self_attn
        assert b.num_heads == 2 and b.q_b_proj.num_heads == 2
        torch.testing.assert_close(b.w_uk, a.w_uk[2:])  # heads 2 and 3 of W_UK / W_UV
        torch.testing.assert_close(b.w_uv, a.w_uv[2:])
        torch.testing.assert_close(b.q_b_proj.weight, a.q_b_proj.weight[64:])  # 2 heads x (16 + 16) rows
        torch.testing.assert_close(b.o_proj.weight, a.o_proj.weight[:, 48:])  # their 2 x 24 value columns
        # The latent projections and norms are replicated.
        torch.testing.assert_close(b.q_a_proj.weight, a.q_a_proj.weight)
        torch.testing.assert_close(b.kv_a_proj_with_mqa.weight, a.kv_a_proj_with_mqa.weight)
        torch.testing.assert_close(b.kv_a_layernorm.weight, a.kv_a_layernorm.weight)
    moe_whole, moe_rank1 = whole.model.layers[1].mlp, rank1.model.layers[1].mlp
    torch.testing.assert_close(moe_rank1.gate.weight, moe_whole.gate.weight)  # the router: every expert
    torch.testing.assert_close(moe_rank1.gate.e_score_correction_bias, moe_whole.gate.e_score_correction_bias)
    assert tuple(moe_rank1.experts.w13.shape) == (6, 32, 64)  # 16 + 16 of each expert's 32 + 32 rows
    assert moe_rank1.shared_experts.gate_up_proj.out_features == 64  # 32 + 32 of 64 + 64
    ep = _load_rank(folder, 1, 2, expert_parallel=True).model.layers[1].mlp.experts
    torch.testing.assert_close(ep.w13, moe_whole.experts.w13[3:])  # whole experts 3, 4, 5
    # Each rank caches one latent row a token: a block costs a rank what it costs one process.
    spec = load_model_spec(resolve_model(folder))
    assert kv_cache_bytes_per_block(spec, 16, torch.float32, 2) == kv_cache_bytes_per_block(spec, 16, torch.float32, 1)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sharded-experts", "expert-parallel"])
def test_a_sparse_layer_sums_routed_and_shared_partials_in_one_all_reduce(folders, monkeypatch, expert_parallel):
    """Each rank's sparse MLP adds its shared experts' partial product to its routed experts' before the one
    all-reduce (experts_with_shared): here all_reduce is recorded and left out, so each rank returns its
    partial, and the two partials sum to the whole layer's output."""
    calls: list[tuple[int, ...]] = []

    def record(self, x):
        calls.append(tuple(x.shape))
        return x

    folder = folders["v2_lite"]
    whole = _load_rank(folder, 0, 1).model.layers[1].mlp
    ranks = [_load_rank(folder, r, 2, expert_parallel).model.layers[1].mlp for r in range(2)]
    x = torch.randn(5, whole.experts.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = whole(x)
    monkeypatch.setattr(TPGroup, "all_reduce", record)
    partials = [mlp(x) for mlp in ranks]
    assert calls == [tuple(x.shape)] * 2  # one a rank: the routed and shared experts' sum
    torch.testing.assert_close(partials[0] + partials[1], expected, atol=1e-5, rtol=1e-5)


def _build_rank0(folder: str, size: int, expert_parallel: bool = False, **changes):
    spec = load_model_spec(resolve_model(folder))
    spec = spec_from_hf_config({**spec.hf_config, **changes}, "config.json")
    with use_tp_group(TPGroup(rank=0, size=size, expert_parallel=expert_parallel)):
        return DeepseekV3ForCausalLM(dataclasses.replace(spec), torch.float32, "cpu")


@pytest.mark.parametrize(("changes", "expert_parallel", "error"), [
    ({"num_attention_heads": 3, "num_key_value_heads": 3}, False,
     r"num_attention_heads \(3\) is not divisible by tensor_parallel_size \(2\)"),
    ({"moe_intermediate_size": 33}, False, r"moe_intermediate_size \(33\)"),
    ({"n_routed_experts": 5, "n_group": 1, "topk_group": 1}, True, r"n_routed_experts \(5\)"),
])
def test_unsplittable_shapes_are_refused_by_name(folders, changes, expert_parallel, error):
    with pytest.raises(UnsupportedModelError, match=error):
        _build_rank0(folders["v3"], 2, expert_parallel, **changes)


def test_engine_refuses_unsplittable_heads_before_starting_ranks(folders):
    from ferrox import LLM

    with pytest.raises(UnsupportedModelError, match=r"num_attention_heads \(4\) is not divisible by "
                                                    r"tensor_parallel_size \(3\)"):
        LLM(model=folders["v3"], dtype="float32", tensor_parallel_size=3, kv_cache_memory=1 << 20)


def _fp8_rank0(floats: str, folder, expert_parallel: bool = False):
    """Rank 0 of 2 loading `floats` written in 32 x 32 block-FP8."""
    from ferrox.layers.quant.config import resolve_quant_config
    from safetensors.torch import load_file

    from tests.helpers.fp8_block_checkpoints import quantize_blocks
    from tests.helpers.fp8_moe_checkpoints import fp8_config
    from tests.helpers.quant_checkpoints import write_checkpoint

    source = resolve_model(write_checkpoint(floats, folder, fp8_config("block", FP8_BLOCK),
                                            _block_fp8(load_file(f"{floats}/model.safetensors"), quantize_blocks)))
    spec = load_model_spec(source)
    with use_tp_group(TPGroup(rank=0, size=2, expert_parallel=expert_parallel)):
        return load_model(source, spec, dtype=torch.float32, device="cpu", quant_config=resolve_quant_config(None, spec))


def test_block_fp8_cut_inside_a_block_is_refused_by_name(folders, tmp_path):
    """At TP 2 in 32 x 32 blocks: the default tiny V3's experts (16 of 32 intermediate rows a rank) are
    refused when the model is built; with wider MLPs but v_head_dim 24, kv_b_proj's 2 x (16 + 24) = 80 rows
    a rank at load, naming the tensor."""
    with pytest.raises(UnsupportedModelError, match=r"moe_intermediate_size 32 \(this rank's 16 rows"):
        _fp8_rank0(folders["v3"], tmp_path / "experts")
    floats = make_tiny_deepseek(tmp_path / "float", version=3, moe_intermediate_size=64, intermediate_size=128,
                                num_layers=2, seed=8)
    with pytest.raises(ModelLoadError, match=r"tensor 'model\.layers\.0\.self_attn\.kv_b_proj\.weight_scale_inv'.*"
                                             r"rows 0\.\.80 of 160 .* do not fall on the 32-row weight blocks"):
        _fp8_rank0(floats, tmp_path / "kv_b")


# ---- GPU, NCCL ------------------------------------------------------------------------------------
def _generate_in_new_process(folder: str, **kw) -> tuple[list[list[int]], list[list[float]]]:
    """generate() in a child process: a tensor-parallel engine's NCCL group lives until its process exits
    (as tests/engine/test_moe_gpu.py)."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json; from tests.models.test_deepseek_tp import generate; "
            f"print('RESULT', json.dumps(generate({folder!r}, 2, device='cuda', **{kw!r})))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    tokens, logprobs = json.loads(lines[-1].removeprefix("RESULT "))
    return tokens, logprobs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize(("name", "expert_parallel"), [("v2_lite", False), ("v3", False), ("v3", True),
                                                       ("fp8", False)])
def test_cuda_tp2_matches_one_gpu(folders, fp8_folder, name, expert_parallel):
    """Two GPUs over NCCL against one, float32: the Triton MLA kernels on each rank's heads (with the decode
    and piecewise CUDA graphs), the fused MoE kernels on its share of the experts (sharded, or split whole),
    the block-FP8 GEMMs on its blocks (logprobs within 0.05, as on the CPU)."""
    folder = fp8_folder if name == "fp8" else folders[name]
    assert_same(generate(folder, 1, device="cuda"),
                _generate_in_new_process(folder, enable_expert_parallel=expert_parallel),
                atol=0.05 if name == "fp8" else 1e-3)
