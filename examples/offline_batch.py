"""Offline batch generation with the embedded SmolLM2 model: `python examples/offline_batch.py`."""

from ferrox import LLM, SamplingParams

prompts = ["Hello, my name is", "The capital of France is", "Write a haiku about the sea."]
llm = LLM()  # the embedded SmolLM2-135M-Instruct; pass model="path/to/folder-or.gguf" for another
params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, seed=0)
for out in llm.generate(prompts, params):
    print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
