"""Multi-LoRA: many PEFT LoRA adapters of one base model served in the same batch.

- request.py      LoRARequest (vLLM's spelling): which adapter a request runs with
- adapter.py      reading a PEFT adapter folder; LoRAAdapterError
- packed.py       an adapter checked against a model and laid out as a GPU slot holds it
- slots.py        GPU slot assignment (LRU) and the per-token slot buffer
- layers.py       LoRALinear: a projection's output plus each token's adapter delta
- torch_delta.py  the delta in plain torch (CPU path, reference of kernels/lora.py)
- moe.py          LoRAExperts: an MoE layer's routed experts with each expert's own adapter pairs
- moe_targets.py  which experts take adapters (the families, the module names) and packing their pairs
- manager.py      LoRAManager: wraps a model, caches adapters, prepares each step

Import the manager from ferrox.lora.manager (it pulls in the model layers); this package's top
level stays light for the front-end.
"""

from ferrox.lora.adapter import LoRAAdapterError, read_peft_adapter
from ferrox.lora.request import LoRARequest

__all__ = ["LoRAAdapterError", "LoRARequest", "read_peft_adapter"]
