"""Chat with the embedded model (its chat template is applied): `python examples/chat.py`."""

from ferrox import LLM, SamplingParams

llm = LLM()
conversation = [{"role": "user", "content": "What is the capital of France?"}]
out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=64))[0]
print(out.outputs[0].text)
conversation += [{"role": "assistant", "content": out.outputs[0].text}, {"role": "user", "content": "And of Italy?"}]
print(llm.chat(conversation, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0].text)
