"""Mixture-of-experts models on CUDA (skipped without a GPU; the tensor-parallel cases need two):
a GGUF MoE file generates what its safetensors folder generates, and a model sharded over two GPUs
(experts sharded by rows, or split whole with expert parallelism) generates what one GPU does.
float32, so the sharded sums differ from the unsharded ones only in rounding and greedy tokens match."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from ferrox import LLM, SamplingParams

from tests.helpers import tiny_models

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PROMPTS = [[1, 5, 9, 33, 7], list(range(3, 73)), [2, 8, 100, 41, 41, 41, 9, 3, 77], [5] * 23]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
MAKERS = {"qwen2-moe": "make_tiny_qwen2_moe", "qwen3-moe": "make_tiny_qwen3_moe", "mixtral": "make_tiny_mixtral"}


def _generate(model: str, **kw):
    llm = LLM(model=model, device="cuda", dtype="float32", kv_cache_memory=64 << 20, max_num_batched_tokens=32,
              max_model_len=256, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
                for o in outs]
    return tokens, logprobs


def _assert_same(want, got):
    assert got[0] == want[0]
    for a, b in zip(want[1], got[1], strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-3), (a, b)


@pytest.mark.parametrize("family", list(MAKERS))
def test_moe_gguf_on_cuda_equals_safetensors(tmp_path, family):
    folder = getattr(tiny_models, MAKERS[family])(tmp_path / family)
    path = tiny_models.export_gguf(folder, tmp_path / f"{family}.gguf")
    _assert_same(_generate(folder), _generate(path))


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_moe_graphs_equal_eager(tmp_path, family):
    """Chunked prefills, mixed steps and decodes through the CUDA graphs (piecewise for the steps
    that carry prompt tokens, whole for decode-only ones) generate what the eager engine does."""
    folder = getattr(tiny_models, MAKERS[family])(tmp_path / family)
    _assert_same(_generate(folder, enforce_eager=True), _generate(folder))


def _generate_in_new_process(folder: str, **kw):
    """_generate in a child process: a tensor-parallel engine's NCCL group lives until its process exits."""
    code = ("import json, sys; from tests.engine.test_moe_gpu import _generate; "
            f"print('RESULT', json.dumps(_generate({folder!r}, **{kw!r})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return tuple(json.loads(lines[-1].removeprefix("RESULT ")))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize(("family", "expert_parallel"), [("qwen2-moe", False), ("qwen3-moe", True),
                                                         ("mixtral", True), ("qwen3-moe", False)])
def test_moe_tp2_on_cuda_matches_one_gpu(tmp_path, family, expert_parallel):
    folder = str(getattr(tiny_models, MAKERS[family])(tmp_path / family))
    _assert_same(_generate(folder),
                 _generate_in_new_process(folder, tensor_parallel_size=2, enable_expert_parallel=expert_parallel))
