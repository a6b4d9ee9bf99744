"""Two LoRA adapters and the base model in one batch (offline). Adapters are PEFT folders
(adapter_config.json + adapter_model.safetensors); this example writes two random ones for the
embedded SmolLM2 so it runs anywhere, where you would pass your fine-tuned adapters' folders."""

import json
import tempfile
from pathlib import Path

import torch
from ferrox import LLM, SamplingParams
from ferrox.lora.request import LoRARequest
from safetensors.torch import save_file


def random_adapter(folder: Path, seed: int, rank: int = 8) -> str:
    """Rank-`rank` LoRA on q_proj and v_proj of SmolLM2-135M's 30 layers (hidden 576, 3 KV heads of 64)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(30):
        for proj, out in (("q_proj", 576), ("v_proj", 192)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, 576, generator=gen) / 24
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) / 8
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"]}))
    return str(folder)


root = Path(tempfile.mkdtemp())
a = LoRARequest("adapter-a", 1, random_adapter(root / "a", seed=1))
b = LoRARequest("adapter-b", 2, random_adapter(root / "b", seed=2))
llm = LLM(max_model_len=1024, enable_lora=True, max_loras=2, max_lora_rank=8)
prompt = "The three primary colors are"
outs = llm.generate([prompt] * 3, SamplingParams(temperature=0, max_tokens=24), lora_request=[None, a, b])
for name, out in zip(("base", a.lora_name, b.lora_name), outs, strict=True):
    print(f"{name:>10}: {out.outputs[0].text!r}")
