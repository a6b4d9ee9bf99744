"""worker/tensor_walk.py, on the CPU engine: the walk finds every storage the model uses, moving them
keeps views and tied weights shared and the engine's tokens unchanged (sleep mode moves a loaded CUDA
model's weights into its releasable region this way)."""

from __future__ import annotations

from ferrox import LLM, SamplingParams
from ferrox.worker.tensor_walk import module_tensors, move_storages

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_moved_storages_keep_sharing_and_tokens(llm):
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    # A private copy of the weights (sleep mode keeps an engine's model its own), not yet stepped.
    fresh = LLM(dtype="float32", kv_cache_memory=32 << 20, max_model_len=512, enable_sleep_mode=True)
    model = fresh.engine.runner.model
    # What quantization runners and tied heads look like: a view of a weight, held by a plain object.
    holder = type("Runner", (), {})()
    holder.rows = model.model.embed_tokens.weight[:8]
    model.model.runner_like = [holder]
    tensors = module_tensors(model, "cpu")
    ids = {id(t) for t in tensors}
    assert {id(t) for t in (*model.parameters(), *model.buffers())} <= ids and id(holder.rows) in ids
    old = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}  # held: no address reuse
    moved = move_storages(tensors)
    assert sum(s.nbytes() for s in moved) == sum(s.nbytes() for s in old.values())
    assert not {t.untyped_storage().data_ptr() for t in tensors} & set(old)
    weight = model.model.embed_tokens.weight
    assert holder.rows.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert holder.rows.data_ptr() == weight.data_ptr()  # still a view of the weight's first rows
    assert [o.outputs[0].token_ids for o in fresh.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
