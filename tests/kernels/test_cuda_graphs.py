"""CudaGraphRunner: a padded, replayed decode step equals the eager forward (GPU only)."""

from __future__ import annotations

import pytest
import torch
from ferrox.worker.cuda_graphs import batch_size_ladder, capturable_batch_sizes
from ferrox.worker.dummy_batch import decode_step, upload_step
from ferrox.worker.step_inputs import Uploader

from tests.kernels.kernel_refs import relative_error

BLOCK = 16


def test_batch_size_ladder():
    assert batch_size_ladder(1) == [1]
    assert batch_size_ladder(6) == [1, 2, 4, 6]
    assert batch_size_ladder(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_size_ladder(30) == [1, 2, 4, 8, 16, 24, 30]
    with pytest.raises(ValueError, match="max_num_seqs"):
        batch_size_ladder(0)


def test_next_captured_size():
    from ferrox.worker.cuda_graphs import next_captured_size

    assert [next_captured_size([1, 2, 4, 8], n, "a batch of") for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="a batch of 9 exceeds the largest captured size 8"):
        next_captured_size([1, 2, 4, 8], 9, "a batch of")


def test_capturable_batch_sizes():
    """A batch is captured only if its dummy decode step (one block per request) fits the cache."""
    assert capturable_batch_sizes(batch_size_ladder(32), 16, 10_000) == batch_size_ladder(32)
    assert capturable_batch_sizes(batch_size_ladder(32), 16, 10) == [1, 2, 4, 8]  # 9 usable blocks
    assert capturable_batch_sizes([4, 1, 2], 1, 8) == [1, 2]  # block_size 1: two blocks per request
    assert capturable_batch_sizes([1], 16, 1) == []


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


@pytest.mark.gpu
def test_graph_replay_matches_eager_decode(cuda_device, seed):
    """Capture on dummy decode steps; replay real-looking decode steps (per-request contexts from a
    throwaway scheduler, random token ids) padded to the ladder, against the eager forward."""
    from ferrox.worker.cuda_graphs import CudaGraphRunner

    model, kv_caches = _tiny_llama(cuda_device)
    runner = CudaGraphRunner(model, kv_caches, max_num_seqs=4, max_model_len=1024, block_size=BLOCK, device=cuda_device)
    assert runner.capture() > 0 and sorted(runner.graphs) == [1, 2, 4]
    assert not any(kv.any() for kv in kv_caches), "capture left its dummy K/V in the cache"
    with torch.inference_mode():
        for kv in kv_caches:  # context for the decode steps below to attend over
            kv.normal_()
    upload = Uploader(cuda_device)
    # 3 pads to 4; then a smaller graph with fresh inputs; then batch 1 (the one-token kernels).
    for lens in ([6, 18, 41], [9, 33], [70]):
        batch = len(lens)
        step = decode_step(batch, lens, BLOCK, num_blocks=kv_caches[0].shape[1])
        upload.next_step()
        t = upload_step(step.so, upload)
        assert runner.can_run(t.meta)
        ids = torch.randint(0, 1000, (batch,), device=cuda_device)
        with torch.inference_mode():
            eager = model.forward(ids, t.positions, kv_caches, t.meta).clone()
        graphed = runner.run(ids, t.positions, t.meta)
        assert graphed.shape == eager.shape and not graphed.isnan().any()
        assert relative_error(graphed, eager) < 2e-2
        assert runner.seq_lens[:batch].tolist() == lens  # staged like any step
        if runner.padded_size(batch) > batch:
            assert runner.slot_mapping[batch : runner.padded_size(batch)].eq(-1).all()


@pytest.mark.gpu
def test_ladder_clipped_to_what_the_cache_holds(cuda_device):
    """A cache too small for max_num_seqs one-block requests: only batches it can hold are captured."""
    from ferrox.worker.cuda_graphs import CudaGraphRunner

    model, kv_caches = _tiny_llama(cuda_device)
    small = [kv[:, :6].contiguous() for kv in kv_caches]  # 5 usable blocks
    runner = CudaGraphRunner(model, small, max_num_seqs=16, max_model_len=64, block_size=BLOCK, device=cuda_device)
    assert runner.batch_sizes == [1, 2, 4, 5] and runner.max_batch == 5


@pytest.mark.gpu
def test_engine_greedy_tokens_same_with_and_without_graphs(cuda_device, tmp_path):
    """LLM with CUDA graphs (default) and with enforce_eager give the same greedy tokens (float32):
    the prompts' step replays piecewise graphs, the decode steps whole ones."""
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
            assert llm.engine.runner.forward.piece_runner is not None, "piecewise graphs were not captured"
        tokens[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        torch.cuda.empty_cache()
    assert tokens[False] == tokens[True]


def _verify_step(context: list[int], drafts: list[int], k: int, num_blocks: int):
    """A speculative verify step from a throwaway core scheduler: request i has context[i] tokens of
    context (its prompt and one sampled token) and verifies drafts[i] <= k draft tokens."""
    import numpy as np
    from ferrox import _core

    sched = _core.Scheduler(num_blocks=num_blocks, max_model_len=1024, block_size=BLOCK, max_num_seqs=8,
                            max_num_batched_tokens=4096, enable_prefix_caching=False, num_speculative_tokens=k,
                            speculative_method="draft_model")
    for i, n in enumerate(context):
        sched.add_request(f"r{i}", np.full(n - 1, 5, dtype=np.int64), max_tokens=64, ignore_eos=True,
                          detokenize=False)
    prefill = sched.schedule()
    sched.update_from_output(np.full(prefill.num_reqs, 7, dtype=np.int64))
    slots = np.asarray(prefill.req_slots, dtype=np.int32)
    tokens = np.concatenate([np.arange(d, dtype=np.int64) + 11 for d in drafts])
    offsets = np.concatenate(([0], np.cumsum(drafts))).astype(np.int32)
    so = sched.schedule(draft_slots=slots, draft_token_ids=tokens, draft_offsets=offsets)
    assert np.asarray(so.num_scheduled_tokens).tolist() == [d + 1 for d in drafts]
    return so


@pytest.mark.gpu
def test_verify_graphs_match_eager(cuda_device, seed):
    """Speculative verify steps (k = 3: up to 4 query tokens a request) replay verify graphs, ragged
    queries padded per request, and give the eager forward's hidden states in the step's order."""
    from ferrox.worker.cuda_graphs import CudaGraphRunner

    model, kv_caches = _tiny_llama(cuda_device)
    runner = CudaGraphRunner(model, kv_caches, max_num_seqs=4, max_model_len=1024, block_size=BLOCK,
                             device=cuda_device, verify_len=4)
    runner.capture()
    assert sorted(runner.graphs) == [1, 2, 4] and sorted(runner.verify_graphs) == [1, 2, 4]
    assert not any(kv.any() for kv in kv_caches), "capture left its dummy K/V in the cache"
    with torch.inference_mode():
        for kv in kv_caches:
            kv.normal_()
    upload = Uploader(cuda_device)
    for context, drafts in (([6, 18, 41], [3, 0, 2]), ([9, 33], [3, 3]), ([70], [1]), ([5, 17, 30, 2], [2, 3, 1, 0])):
        so = _verify_step(context, drafts, 3, kv_caches[0].shape[1])
        upload.next_step()
        t = upload_step(so, upload)
        assert runner.can_run(t.meta) and not t.meta.decode_only
        ids = torch.randint(0, 1000, (t.input_ids.shape[0],), device=cuda_device)
        with torch.inference_mode():
            eager = model.forward(ids, t.positions, kv_caches, t.meta).clone()
            caches_after_eager = [kv.clone() for kv in kv_caches]
        graphed = runner.run(ids, t.positions, t.meta)
        assert graphed.shape == eager.shape and not graphed.isnan().any()
        assert relative_error(graphed, eager) < 2e-2
        # The graph wrote the same K/V, up to bf16 rounding (pad rows write nothing).
        for kv, ref in zip(kv_caches, caches_after_eager, strict=True):
            torch.testing.assert_close(kv, ref, atol=5e-2, rtol=5e-2)
