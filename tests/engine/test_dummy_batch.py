"""Dummy steps (worker/dummy_batch.py): scheduled by a throwaway core scheduler, valid against the
KV cache they are built for, and runnable through the real metadata path (step_inputs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrox.worker.dummy_batch import (
    decode_step,
    min_decode_blocks,
    min_prefill_blocks,
    prefill_lengths,
    prefill_step,
    upload_step,
)
from ferrox.worker.step_inputs import Uploader, attention_metadata

CPU = torch.device("cpu")


def check_step(so, num_blocks: int, block_size: int) -> None:
    """The invariants every step the model runs must hold, whoever scheduled it."""
    n, r = int(so.num_tokens), int(so.num_reqs)
    qlen = np.asarray(so.num_scheduled_tokens)
    computed = np.asarray(so.num_computed_tokens)
    seq_lens = np.asarray(so.seq_lens)
    qsl = np.asarray(so.query_start_loc)
    table = np.asarray(so.block_table)
    slots = np.asarray(so.slot_mapping)
    assert so.input_ids.shape == so.positions.shape == slots.shape == (n,)
    assert qsl.shape == (r + 1,) and qsl[0] == 0 and qsl[-1] == n and (np.diff(qsl) == qlen).all()
    assert (seq_lens == computed + qlen).all() and (qlen >= 1).all()
    assert table.shape[0] == r and table.shape[1] * block_size >= seq_lens.max()
    assert (np.asarray(so.logits_indices) == qsl[1:] - 1).all()
    assert np.asarray(so.sample_mask).all()
    for i in range(r):
        held = -(-int(seq_lens[i]) // block_size)
        assert (table[i, :held] >= 1).all() and (table[i, :held] < num_blocks).all(), "a block outside the cache"
        assert (table[i, held:] == 0).all(), "the block table is not null-padded past seq_len"
        pos = np.asarray(so.positions)[qsl[i] : qsl[i + 1]]
        assert (pos == np.arange(computed[i], seq_lens[i])).all()
        expected = table[i, pos // block_size].astype(np.int64) * block_size + pos % block_size
        assert (slots[qsl[i] : qsl[i + 1]] == expected).all(), "slots disagree with the block table"
    assert (slots >= block_size).all() and (slots < num_blocks * block_size).all(), "a slot outside the cache"
    assert len(set(slots.tolist())) == n, "two tokens write one slot"
    used = table[table != 0]
    assert len(set(used.tolist())) == used.size, "two requests share a block"


@pytest.mark.parametrize(("num_tokens", "num_seqs", "block_size"),
                         [(40, 3, 16), (64, 4, 16), (7, 7, 4), (5, 9, 16), (100, 1, 8), (33, 2, 1)])
def test_prefill_step_shapes_and_validity(num_tokens, num_seqs, block_size):
    step = prefill_step(num_tokens, num_seqs, block_size)
    so = step.so
    lens = prefill_lengths(num_tokens, num_seqs)
    assert sum(lens) == num_tokens and len(lens) == min(num_seqs, num_tokens)
    assert step.num_blocks == min_prefill_blocks(num_tokens, num_seqs, block_size)
    assert so.num_tokens == num_tokens and so.num_reqs == len(lens)
    assert np.asarray(so.num_scheduled_tokens).tolist() == lens
    assert np.asarray(so.num_computed_tokens).tolist() == [0] * len(lens)
    check_step(so, step.num_blocks, block_size)
    assert step.block_ids.tolist() == sorted(set(np.asarray(so.slot_mapping) // block_size))
    meta = attention_metadata(so, Uploader(CPU))
    assert meta.num_actual_tokens == num_tokens and meta.num_reqs == len(lens)
    assert meta.max_query_len == meta.max_seq_len == max(lens)
    assert meta.decode_only == (max(lens) == 1)


@pytest.mark.parametrize(("batch", "context_len", "block_size"),
                         [(1, 2, 16), (4, 2, 16), (3, [6, 18, 41], 16), (2, 17, 16), (5, 3, 1), (1, 16, 16)])
def test_decode_step_shapes_and_validity(batch, context_len, block_size):
    step = decode_step(batch, context_len, block_size)
    so = step.so
    lens = [context_len] * batch if isinstance(context_len, int) else context_len
    assert step.num_blocks == min_decode_blocks(batch, context_len, block_size)
    assert so.num_reqs == batch and so.num_tokens == batch
    assert np.asarray(so.num_scheduled_tokens).tolist() == [1] * batch
    assert np.asarray(so.seq_lens).tolist() == lens
    assert np.asarray(so.positions).tolist() == [n - 1 for n in lens]
    check_step(so, step.num_blocks, block_size)
    meta = attention_metadata(so, Uploader(CPU))
    assert meta.decode_only and meta.max_query_len == 1 and meta.max_seq_len == max(lens)
    assert meta.query_start_loc_cpu.tolist() == list(range(batch + 1))


def test_steps_over_a_given_cache():
    """Built for a real cache, the step uses its first blocks; a cache too small for the step is
    refused with the size it needs."""
    step = decode_step(8, 2, 16, num_blocks=1000)
    assert step.num_blocks == min_decode_blocks(8, 2, 16) == 9  # the first blocks of the cache
    check_step(step.so, 9, 16)
    assert prefill_step(256, 8, 16, num_blocks=50).num_blocks == min_prefill_blocks(256, 8, 16)
    with pytest.raises(ValueError, match=r"at least 9 blocks"):
        decode_step(8, 2, 16, num_blocks=8)
    with pytest.raises(ValueError, match="num_blocks"):
        prefill_step(256, 8, 16, num_blocks=min_prefill_blocks(256, 8, 16) - 1)
    with pytest.raises(ValueError, match="context_len >= 2"):
        decode_step(2, 1, 16)
    with pytest.raises(ValueError, match="2 entries for a batch of 3"):
        decode_step(3, [4, 5], 16)
    with pytest.raises(ValueError, match="num_tokens"):
        prefill_step(0, 1, 16)


def _tiny_llama(device, dtype=torch.float32):
    from ferrox.loader.model_config import spec_from_hf_config
    from ferrox.loader.model_loader import init_dummy_weights
    from ferrox.models.registry import get_model_class

    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 512,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
    }
    spec = spec_from_hf_config(config, "test config")
    with torch.no_grad():
        model = get_model_class(spec.hf_config["architectures"])(spec, dtype, device)
        init_dummy_weights(model, seed=0)
    model.eval()
    return model, spec


def _written_slots(kv: torch.Tensor) -> set[int]:
    """Slots (block * block_size + offset) of a [2, blocks, block_size, heads, dim] cache holding
    anything but zeros in K or V."""
    nonzero = (kv != 0).flatten(3).any(dim=3).any(dim=0)  # [blocks, block_size]
    return set(torch.nonzero(nonzero.flatten()).flatten().tolist())


def test_profile_forward_on_cpu_writes_only_its_slots_of_the_scratch_cache():
    """The profiling pass, run on CPU: forward over the dummy prefill through attention_metadata,
    logits of each request's last token; K/V land exactly at the step's slots of the scratch cache."""
    from ferrox.worker.model_setup import profile_forward

    model, spec = _tiny_llama(CPU)
    block_size, num_tokens, num_seqs = 8, 45, 4
    params = {k: v.clone() for k, v in model.state_dict().items()}
    scratch, hidden, logits = profile_forward(model, spec, torch.float32, CPU, block_size, num_tokens, num_seqs)
    step = prefill_step(num_tokens, num_seqs, block_size)  # the same step (deterministic scheduler)
    assert len(scratch) == spec.num_layers
    assert all(kv.shape[1] == step.num_blocks and kv.shape[2] == block_size for kv in scratch)
    assert hidden.shape == (num_tokens, spec.hidden_size) and logits.shape == (num_seqs, spec.vocab_size)
    assert torch.isfinite(hidden).all() and torch.isfinite(logits).all()
    slots = set(np.asarray(step.so.slot_mapping).tolist())
    for kv in scratch:
        assert _written_slots(kv) == slots
        assert not kv[:, 0].any(), "the null block was written"
    # Nothing else changed: the weights are as they were.
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
    # Each request's logits are those of the same prompt run alone (a batch of one).
    alone = prefill_step(num_tokens // num_seqs, 1, block_size)
    cache = [torch.zeros_like(kv[:, : alone.num_blocks]) for kv in scratch]
    t = upload_step(alone.so, Uploader(CPU))
    with torch.inference_mode():
        one = model.compute_logits(model.forward(t.input_ids, t.positions, cache, t.meta).index_select(0, t.logits_indices))
    torch.testing.assert_close(logits[0], one[0], rtol=1e-4, atol=1e-4)


def test_decode_step_forward_on_cpu():
    """A dummy decode step runs through the model like a real one: after its prompts' step, the
    decode logits equal those of the whole sequence's last token computed in one prefill."""
    model, spec = _tiny_llama(CPU)
    block_size, lens = 4, [6, 11]
    step = decode_step(2, lens, block_size)
    check_step(step.prompt_so, step.num_blocks, block_size)
    assert np.asarray(step.prompt_so.seq_lens).tolist() == [n - 1 for n in lens]
    cache = [torch.zeros(2, step.num_blocks, block_size, spec.num_kv_heads, spec.head_dim) for _ in range(spec.num_layers)]
    upload = Uploader(CPU)
    with torch.inference_mode():
        p = upload_step(step.prompt_so, upload)
        model.forward(p.input_ids, p.positions, cache, p.meta)
        t = upload_step(step.so, upload)
        logits = model.compute_logits(model.forward(t.input_ids, t.positions, cache, t.meta).index_select(0, t.logits_indices))
        for r, n in enumerate(lens):
            full = prefill_step(n, 1, block_size)  # n tokens of id 0, as prompt + the fed-back sample
            c = [torch.zeros(2, full.num_blocks, block_size, spec.num_kv_heads, spec.head_dim) for _ in cache]
            tf = upload_step(full.so, upload)
            ref = model.compute_logits(model.forward(tf.input_ids, tf.positions, c, tf.meta).index_select(0, tf.logits_indices))
            torch.testing.assert_close(logits[r], ref[0], rtol=1e-4, atol=1e-4)


# ---- GPU ------------------------------------------------------------------------------------------

@pytest.fixture
def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


@pytest.mark.gpu
def test_gpu_profile_budget_and_warm_up(cuda_device):
    """profile_gpu_kv_budget on a tiny model: the dummy prefill forward, the batch-1 decode warm-up
    (one-token kernels, one-row logits, the sampler's draw) and a budget within the limit."""
    from ferrox.config import EngineConfig
    from ferrox.worker.model_setup import profile_forward, profile_gpu_kv_budget

    model, spec = _tiny_llama(cuda_device, torch.bfloat16)
    config = EngineConfig(gpu_memory_utilization=0.5, block_size=16)
    budget = profile_gpu_kv_budget(model, spec, torch.bfloat16, cuda_device, config, 2048, 64)
    _, total = torch.cuda.mem_get_info(cuda_device)
    assert 0 < budget <= 0.5 * total
    scratch, hidden, logits = profile_forward(model, spec, torch.bfloat16, cuda_device, 16, 300, 7)
    torch.cuda.synchronize()
    assert hidden.shape == (300, spec.hidden_size) and logits.shape == (7, spec.vocab_size)
    assert torch.isfinite(logits).all()
    slots = set(np.asarray(prefill_step(300, 7, 16).so.slot_mapping).tolist())
    assert all(_written_slots(kv.float().cpu()) == slots for kv in scratch)


def test_step_arrays_pack_into_one_aligned_buffer():
    """Uploader.many's layout (its CUDA copy is one of these buffers): each array at a 16-byte
    boundary, read back through views with its own dtype and shape, empty arrays included."""
    import numpy as np
    from ferrox.worker.step_inputs import pack_arrays, packed_offsets, unpack_views

    rng = np.random.default_rng(0)
    arrays = [rng.integers(-5, 1 << 40, size=7, dtype=np.int64), rng.integers(0, 99, size=(3, 5), dtype=np.int32),
              np.zeros((2, 0), dtype=np.int32), np.arange(3, dtype=np.int32)[::-1],
              rng.integers(0, 1 << 30, size=(4, 9), dtype=np.int32)[:, 2:7]]
    offsets = packed_offsets(arrays)
    assert all(off % 16 == 0 for off in offsets) and offsets[-1] >= sum(a.nbytes for a in arrays)
    buf = np.full(offsets[-1], 0xAB, dtype=np.uint8)
    pack_arrays(arrays, offsets, buf)
    views = unpack_views(torch.from_numpy(buf), arrays, offsets)
    for a, v in zip(arrays, views, strict=True):
        assert v.shape == a.shape and v.numpy().dtype == a.dtype and (v.numpy() == a).all()
        assert v.data_ptr() % 16 == 0 or v.numel() == 0
