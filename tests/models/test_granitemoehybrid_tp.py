"""Tensor parallelism on the Mamba2 hybrids: IBM Granite 4.0-H (models/granitemoehybrid.py, layers/mamba2_mixer.py)
over two gloo rank processes on the CPU.

Two tiny checkpoints (tests/helpers/tiny_granitemoehybrid.py: Mamba2 4 heads of 16, d_state 16) cover vLLM's two
group layouts: dense with 2 B / C groups (each rank takes one, its gated-norm group whole) and MoE with 1 group
(replicated to both ranks, the gated norm's sum of squares all-reduced). Each rank's slices are checked against the
whole model's; then the real engine at tensor_parallel_size 2 -- chunked prefill under a 16-token budget, a prompt
that comes again resuming from the state snapshot (16-token grid) every rank saved -- gets the tokens of the
one-rank engine and of transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.model_spec import UnsupportedModelError

from tests.helpers.tiny_granitemoehybrid import make_tiny_granitemoehybrid
from tests.models.conftest import assert_outputs_match_transformers

transformers = pytest.importorskip("transformers")

# 3 tokens, 40 (three chunks of 16) and 70 (crossing the scan's 64-token chunk); the last comes again.
PROMPTS = [[5, 9, 11], list(range(3, 43)), [(7 * i) % 300 + 3 for i in range(70)]]
FAMILIES = {"dense-2-groups": lambda folder: make_tiny_granitemoehybrid(folder),
            "moe-1-group": lambda folder: make_tiny_granitemoehybrid(folder, experts=4, rope=True, seed=1,
                                                                     mamba_n_groups=1)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (folder, transformers model), float32 on the CPU."""
    root = tmp_path_factory.mktemp("granitemoehybrid_tp")
    out = {}
    for name, build in FAMILIES.items():
        folder = build(root / name)
        out[name] = (folder, transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
    return out


def _load_rank(folder: str, rank: int, size: int):
    """Rank `rank` of `size` loaded as its engine process loads it (lazy safetensors slices), in this process."""
    from ferrox.distributed.parallel_state import TPGroup, use_tp_group
    from ferrox.loader.model_loader import load_model, load_model_spec
    from ferrox.loader.source import resolve_model

    source = resolve_model(folder)
    with use_tp_group(TPGroup(rank=rank, size=size)):
        return load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu")


@pytest.mark.parametrize(("name", "groups"), [("dense-2-groups", 2), ("moe-1-group", 1)])
def test_a_rank_holds_its_heads_and_groups(tiny, name, groups):
    """Rank 1 of 2: Mamba2 heads 2-3 (z and x rows 32-63 of their 64, dt rows 2-3, A_log / dt_bias / D 2-3, the
    gated norm's and out_proj's channels 32-63) and group 1 of 2 (its 16 B and 16 C rows) or the one group whole;
    the conv kernel's matching channels of x, B and C; state pools that wide; attention query heads 2-3, KV head 1."""
    from ferrox.worker.recurrent_states import allocate_recurrent_states

    folder, _ = tiny[name]
    whole, part = _load_rank(folder, 0, 1), _load_rank(folder, 1, 2)
    a, b = whole.model.layers[0].mamba, part.model.layers[0].mamba
    bc = groups * 16
    heads = [*range(32, 64)]
    own_groups = [*range(16, 32)] if groups == 2 else [*range(16)]
    # in_proj rows: z [0, 64) | x [64, 128) | B [128, 128 + bc) | C [128 + bc, 128 + 2 bc) | dt (4 rows)
    rows = [*heads, *(64 + r for r in heads), *(128 + r for r in own_groups), *(128 + bc + r for r in own_groups),
            128 + 2 * bc + 2, 128 + 2 * bc + 3]
    torch.testing.assert_close(b.in_proj.weight, a.in_proj.weight[rows], rtol=0, atol=0)
    conv = [r - 64 for r in rows[32:-2]]  # (the conv's channels are in_proj's x, B and C rows)
    torch.testing.assert_close(b.conv1d.weight, a.conv1d.weight[conv], rtol=0, atol=0)
    torch.testing.assert_close(b.conv1d.bias, a.conv1d.bias[conv], rtol=0, atol=0)
    for param in ("A_log", "dt_bias", "D"):
        torch.testing.assert_close(getattr(b, param), getattr(a, param)[2:], rtol=0, atol=0)
    torch.testing.assert_close(b.norm.weight, a.norm.weight[32:], rtol=0, atol=0)
    assert b.norm.spans_ranks == (groups == 1)
    torch.testing.assert_close(b.out_proj.weight, a.out_proj.weight[:, 32:], rtol=0, atol=0)
    assert a.state_shapes() == ((64 + 2 * bc, 3), (4, 16, 16))
    assert b.state_shapes() == ((32 + 2 * 16, 3), (2, 16, 16))
    fa, fb = whole.model.layers[1].self_attn, part.model.layers[1].self_attn
    assert (fb.num_heads, fb.num_kv_heads) == (2, 1)
    torch.testing.assert_close(fb.o_proj.weight, fa.o_proj.weight[:, 16:], rtol=0, atol=0)
    allocate_recurrent_states(part, 2, 0, torch.float32, torch.float32, torch.device("cpu"))
    assert tuple(b.conv_states.shape) == (3, 64, 3) and tuple(b.ssm_states.shape) == (3, 2, 16, 16)


NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def _outputs(folder: str, tp: int, device: str = "cpu", **kw):
    """(greedy outputs (logprobs=1) of PROMPTS then PROMPTS[2] again, engine stats), chunked under a 16-token
    budget, with state snapshots on a 16-token grid."""
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=16, max_num_seqs=4,
              tensor_parallel_size=tp, mamba_block_size=16, device=device, **kw)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return outs + llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False), llm.engine.stats()
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tensor_parallel_matches_one_rank_and_transformers(tiny, name):
    """Two ranks (gloo) against one: the same greedy tokens, logprobs within rounding; both transformers'. The
    repeated prompt resumes at 64 of its 70 tokens on both. The two ranks also verify n-gram drafts: each keeps the
    accepted draft's conv and SSM state of its heads with the driver's counts."""
    folder, ref = tiny[name]
    (one, _), (two, stats) = _outputs(folder, 1), _outputs(folder, 2, speculative_config=NGRAM)
    assert stats["spec_num_drafts"] > 0
    for a, b in zip(one, two, strict=True):
        sa, sb = a.outputs[0], b.outputs[0]
        assert list(sa.token_ids) == list(sb.token_ids)
        for la, lb, t in zip(sa.logprobs, sb.logprobs, sa.token_ids, strict=True):
            assert abs(la[t].logprob - lb[t].logprob) < 1e-4
    assert one[-1].num_cached_tokens == 64 and two[-1].num_cached_tokens == 64
    assert_outputs_match_transformers(ref, [*PROMPTS, PROMPTS[2]], two)


def test_groups_that_do_not_follow_the_heads_are_refused_by_name(tiny):
    """2 groups over 4 ranks (each group's heads on two ranks): refused before the ranks start, as vLLM refuses it,
    naming the field."""
    folder, _ = tiny["dense-2-groups"]
    with pytest.raises(UnsupportedModelError, match=r"mamba_n_groups \(2\) must be 1 or divisible by "
                                                    r"tensor_parallel_size \(4\)"):
        LLM(model=folder, dtype="float32", tensor_parallel_size=4, kv_cache_memory=1 << 20)


# ---- GPU ------------------------------------------------------------------------------------------
def cuda_answers(folder: str, tp: int) -> list[tuple[list[int], list[float], int]]:
    """(tokens, sampled-token logprobs, cached prompt tokens) of each of _outputs' answers on CUDA."""
    return [(list(s.token_ids), [lp[t].logprob for lp, t in zip(s.logprobs, s.token_ids, strict=True)],
             o.num_cached_tokens) for o in _outputs(folder, tp, "cuda")[0] for s in [o.outputs[0]]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("name", list(FAMILIES))
def test_cuda_tp2_matches_one_gpu(tiny, name):
    """Two GPUs over NCCL (the one-launch recurrence and conv kernels on each rank's heads, decode CUDA graphs with
    the gated norm's all-reduce inside them) against one, float32: the same tokens, logprobs within 1e-3. The
    sharded engine runs in a child process (its NCCL group lives until the process exits)."""
    folder, _ = tiny[name]
    code = ("import json; from tests.models.test_granitemoehybrid_tp import cuda_answers; "
            f"print('RESULT', json.dumps(cuda_answers({folder!r}, 2)))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    sharded = json.loads(lines[-1].removeprefix("RESULT "))
    for (tokens, logprobs, cached), (tp_tokens, tp_logprobs, tp_cached) in zip(cuda_answers(folder, 1), sharded,
                                                                             strict=True):
        assert tokens == tp_tokens and cached == tp_cached
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(tp_logprobs), atol=1e-3), (logprobs, tp_logprobs)
