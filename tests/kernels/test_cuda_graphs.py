"""CudaGraphRunner: a padded, replayed decode step equals the eager forward (GPU only)."""

from __future__ import annotations

import pytest
import torch
from ferrox.attention.metadata import AttentionMetadata
from ferrox.worker.cuda_graphs import batch_size_ladder

from tests.kernels.kernel_refs import relative_error

BLOCK = 16


def test_batch_size_ladder():
    assert batch_size_ladder(1) == [1]
    assert batch_size_ladder(6) == [1, 2, 4, 6]
    assert batch_size_ladder(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_size_ladder(30) == [1, 2, 4, 8, 16, 24, 30]
    with pytest.raises(ValueError, match="max_num_seqs"):
        batch_size_ladder(0)


def _tiny_llama(device):
    from ferrox.loader.model_config import spec_from_hf_config
    from ferrox.loader.model_loader import init_dummy_weights
    from ferrox.models.registry import get_model_class

    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 512, "num_hidden_layers": 3, "vocab_size": 1000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    }
    spec = spec_from_hf_config(config, "test config")
    model = get_model_class(spec.hf_config["architectures"])(spec, torch.bfloat16, device)
    init_dummy_weights(model, seed=int(torch.randint(0, 1 << 30, ())))
    kv_caches = [torch.zeros(2, 64, BLOCK, 2, 32, dtype=torch.bfloat16, device=device) for _ in range(3)]
    return model, kv_caches


def _meta(query_lens, seq_lens, block_table, device) -> AttentionMetadata:
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    slots = []
    for r, (ql, sl) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for pos in range(sl - ql, sl):
            slots.append(int(block_table[r, pos // BLOCK]) * BLOCK + pos % BLOCK)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=sum(query_lens), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        slot_mapping=torch.tensor(slots, device=device), query_start_loc=qsl.to(device), seq_lens=lens.to(device),
        block_table=block_table.to(device), query_start_loc_cpu=qsl, seq_lens_cpu=lens, decode_only=max(query_lens) == 1,
    )


@pytest.mark.gpu
def test_graph_replay_matches_eager_decode(cuda_device, seed):
    from ferrox.worker.cuda_graphs import CudaGraphRunner

    model, kv_caches = _tiny_llama(cuda_device)
    prompt_lens = [5, 17, 40]
    table = torch.zeros(3, 8, dtype=torch.int32)
    for r in range(3):
        table[r, :4] = torch.arange(1 + 4 * r, 5 + 4 * r)
    with torch.inference_mode():
        prompt = torch.randint(0, 1000, (sum(prompt_lens),), device=cuda_device)
        positions = torch.cat([torch.arange(n) for n in prompt_lens]).to(cuda_device)
        model.forward(prompt, positions, kv_caches, _meta(prompt_lens, prompt_lens, table, cuda_device))

    runner = CudaGraphRunner(model, kv_caches, max_num_seqs=4, max_model_len=1024, block_size=BLOCK, device=cuda_device)
    assert runner.capture() > 0 and sorted(runner.graphs) == [1, 2, 4]

    for batch in (3, 2):  # 3 pads to 4; then a smaller graph with fresh inputs
        lens = [n + 1 for n in prompt_lens[:batch]]
        meta = _meta([1] * batch, lens, table[:batch], cuda_device)
        ids = torch.randint(0, 1000, (batch,), device=cuda_device)
        pos = torch.tensor([n - 1 for n in lens], device=cuda_device)
        with torch.inference_mode():
            eager = model.forward(ids, pos, kv_caches, meta).clone()
        graphed = runner.run(ids, pos, meta)
        assert graphed.shape == eager.shape and not graphed.isnan().any()
        assert relative_error(graphed, eager) < 2e-2


@pytest.mark.gpu
def test_engine_greedy_tokens_same_with_and_without_graphs(cuda_device, tmp_path):
    """LLM with CUDA graphs (default) and with enforce_eager give the same greedy tokens (float32)."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
    import bench_setup
    from ferrox import LLM, SamplingParams

    config = json.loads(bench_setup.LLAMA_8B_CONFIG.read_text())
    config.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(config))
    model_dir = bench_setup.make_model_dir(tmp_path / "cfg" / "config.json", str(tmp_path / "model"))
    prompts = bench_setup.random_prompts(5, 12, 128000, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False)
    tokens = {}
    for eager in (False, True):
        llm = LLM(model=model_dir, load_format="dummy", dtype="float32", max_model_len=256, max_num_seqs=8,
                  enforce_eager=eager, seed=0)
        if not eager:
            assert llm.engine.runner.graph_runner is not None, "CUDA graphs were not captured"
        tokens[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        torch.cuda.empty_cache()
    assert tokens[False] == tokens[True]
