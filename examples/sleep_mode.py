"""Sleep mode (vLLM's): give the engine's memory back between bursts of work and take it again without
restarting. Level 1 keeps the weights in host memory; level 2 discards them and reads the checkpoint
again (the RL flow: wake the weights, reload or update them, then wake the KV cache). On a GPU this frees
the weights' and the KV cache's device memory; on CPU (the embedded model here, dequantized to float32 so
that its weights can be discarded and reloaded) the same calls free the KV cache and the weights."""

import time

from ferrox import LLM, SamplingParams

llm = LLM(dtype="float32", max_model_len=1024, enable_sleep_mode=True)
greedy = SamplingParams(temperature=0, max_tokens=24)
prompt = "The three primary colors are"
before = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].text

t = time.perf_counter()
llm.sleep(level=1)                        # weights kept, KV cache discarded
print(f"level 1: asleep={llm.is_sleeping()} ({time.perf_counter() - t:.2f} s)")
llm.wake_up()

llm.sleep(level=2)                        # weights discarded too
llm.wake_up(tags=["weights"])             # their memory back, contents not yet
llm.collective_rpc("reload_weights")      # the checkpoint read into it again
llm.wake_up(tags=["kv_cache"])
after = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].text
print(f"same text after level 2 + reload: {after == before}: {after!r}")
