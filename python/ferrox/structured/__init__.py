"""Structured outputs (constrained decoding) with llguidance.

    from ferrox import LLM, SamplingParams, StructuredOutputsParams
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))  # or regex=,
    # choice=[...], grammar=<Lark or GBNF>, json_object=True

Modules, in the order data flows through them:
  params.py   StructuredOutputsParams: the user's constraint (one kind per request)
  backend.py  constraint -> llguidance grammar text (+ cache key); validate_params (-> 400);
              compile_matcher; the shared LLTokenizer per tokenizer.json
  manager.py  StructuredOutputManager: compile off the engine loop, per-request matchers,
              per-step bitmask fill, token accept -> force_stop
  bitmask.py  unpack/apply the int32 allow-bits to logits (numpy on CPU, torch on GPU)
  tools.py    OpenAI tools + tool_choice -> constraint (Hermes <tool_call> format), tool prompts
The matching tool-call parsers live in ferrox/entrypoints/openai/tool_parsers/.

Nothing is imported here, so `import ferrox.structured.params` stays free of torch.
"""
