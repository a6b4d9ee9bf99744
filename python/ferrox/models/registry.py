"""Model classes by the `architectures` name of config.json.

Adding a model:
  1. Write `ferrox/models/<family>.py` with a class taking `(spec, dtype, device)` (optionally
     `kernels=` to force a kernel set) and providing
     `forward(input_ids, positions, kv_caches, attn_metadata) -> hidden`, `compute_logits(hidden)`
     and `load_weights(iter of (HF name, tensor))` -- subclass LlamaForCausalLM when the family is a
     Llama variant (see qwen.py: two class attributes); mixture-of-experts families subclass
     MoeForCausalLM (moe.py). A checkpoint laid out differently can be mapped at load time: phi3.py
     cuts fused projections by rows, granite.py folds config scalars into weights. README "Adding a
     model" has the rest.
  2. Register it below under its config.json `architectures` name.
  3. For GGUF files, map `general.architecture` in loader/gguf_file.py (GGUF_ARCHITECTURES) and say
     whether llama.cpp permuted its Q/K rows (_PERMUTED_QK_ARCHS); a family whose models take float
     weights only is read back as its Hugging Face checkpoint in loader/gguf_families.py (names, the
     converter's layout edits undone, config keys), tested through tests/helpers/llama_cpp_export.py.
  4. Test it against transformers on a tiny random checkpoint (tests/helpers/tiny_models.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from ferrox.model_spec import UnsupportedModelError

# name -> "module:Class", imported on first use so listing support stays cheap.
SUPPORTED: dict[str, str] = {
    "LlamaForCausalLM": "ferrox.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "ferrox.models.llama:MistralForCausalLM",
    "Ministral3ForCausalLM": "ferrox.models.ministral3:Ministral3ForCausalLM",
    "MixtralForCausalLM": "ferrox.models.moe:MixtralForCausalLM",
    "Qwen2ForCausalLM": "ferrox.models.qwen:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "ferrox.models.qwen:Qwen3ForCausalLM",
    "Phi3ForCausalLM": "ferrox.models.phi3:Phi3ForCausalLM",
    "GraniteForCausalLM": "ferrox.models.granite:GraniteForCausalLM",
    "GraniteMoeHybridForCausalLM": "ferrox.models.granitemoehybrid:GraniteMoeHybridForCausalLM",
    "NemotronHForCausalLM": "ferrox.models.nemotron_h:NemotronHForCausalLM",
    "Gemma2ForCausalLM": "ferrox.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "ferrox.models.gemma3:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "ferrox.models.gemma3:Gemma3ForConditionalGeneration",
    "Gemma4ForCausalLM": "ferrox.models.gemma4:Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration": "ferrox.models.gemma4:Gemma4ForConditionalGeneration",
    "LlavaForConditionalGeneration": "ferrox.models.llava:LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration": "ferrox.models.llava_next:LlavaNextForConditionalGeneration",
    "LlavaOnevisionForConditionalGeneration": "ferrox.models.llava_onevision:LlavaOnevisionForConditionalGeneration",
    "Mistral3ForConditionalGeneration": "ferrox.models.mistral3:Mistral3ForConditionalGeneration",
    "Qwen2VLForConditionalGeneration": "ferrox.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2AudioForConditionalGeneration": "ferrox.models.qwen2_audio:Qwen2AudioForConditionalGeneration",
    "VoxtralForConditionalGeneration": "ferrox.models.voxtral:VoxtralForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "ferrox.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration": "ferrox.models.qwen3_vl:Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration": "ferrox.models.qwen3_vl_moe:Qwen3VLMoeForConditionalGeneration",
    "InternVLForConditionalGeneration": "ferrox.models.internvl:InternVLForConditionalGeneration",
    "InternVLChatModel": "ferrox.models.internvl_chat:InternVLChatModel",
    "Idefics3ForConditionalGeneration": "ferrox.models.idefics3:Idefics3ForConditionalGeneration",
    "SmolVLMForConditionalGeneration": "ferrox.models.idefics3:SmolVLMForConditionalGeneration",
    "Qwen2MoeForCausalLM": "ferrox.models.moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "ferrox.models.moe:Qwen3MoeForCausalLM",
    "Qwen3_5ForCausalLM": "ferrox.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "ferrox.models.qwen3_5:Qwen3_5MoeForCausalLM",
    "Qwen3NextForCausalLM": "ferrox.models.qwen3_5:Qwen3NextForCausalLM",
    "Qwen3_5ForConditionalGeneration": "ferrox.models.qwen3_5_vl:Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration": "ferrox.models.qwen3_5_vl:Qwen3_5MoeForConditionalGeneration",
    "Glm4ForCausalLM": "ferrox.models.glm4:Glm4ForCausalLM",
    "GlmForCausalLM": "ferrox.models.glm4:GlmForCausalLM",
    "SmolLM3ForCausalLM": "ferrox.models.smollm3:SmolLM3ForCausalLM",
    "Olmo2ForCausalLM": "ferrox.models.olmo2:Olmo2ForCausalLM",
    "OlmoeForCausalLM": "ferrox.models.olmo2:OlmoeForCausalLM",
    "Olmo3ForCausalLM": "ferrox.models.olmo3:Olmo3ForCausalLM",
    "Exaone4ForCausalLM": "ferrox.models.exaone4:Exaone4ForCausalLM",
    "CohereForCausalLM": "ferrox.models.cohere:CohereForCausalLM",
    "Cohere2ForCausalLM": "ferrox.models.cohere2:Cohere2ForCausalLM",
    "HunYuanDenseV1ForCausalLM": "ferrox.models.hunyuan:HunYuanDenseV1ForCausalLM",
    "HunYuanMoEV1ForCausalLM": "ferrox.models.hunyuan:HunYuanMoEV1ForCausalLM",
    "ArceeForCausalLM": "ferrox.models.arcee:ArceeForCausalLM",
    "ApertusForCausalLM": "ferrox.models.apertus:ApertusForCausalLM",
    "GPTNeoXForCausalLM": "ferrox.models.gpt_neox:GPTNeoXForCausalLM",
    "GPT2LMHeadModel": "ferrox.models.gpt2:GPT2LMHeadModel",
    "OPTForCausalLM": "ferrox.models.opt:OPTForCausalLM",
    "PhiForCausalLM": "ferrox.models.phi:PhiForCausalLM",
    "Starcoder2ForCausalLM": "ferrox.models.starcoder2:Starcoder2ForCausalLM",
    "Ernie4_5ForCausalLM": "ferrox.models.ernie4_5:Ernie4_5ForCausalLM",
    "Ernie4_5_MoeForCausalLM": "ferrox.models.ernie4_5_moe:Ernie4_5_MoeForCausalLM",
    "SeedOssForCausalLM": "ferrox.models.seed_oss:SeedOssForCausalLM",
    "Glm4MoeForCausalLM": "ferrox.models.glm4_moe:Glm4MoeForCausalLM",
    "MiniMaxM2ForCausalLM": "ferrox.models.minimax_m2:MiniMaxM2ForCausalLM",
    "DeepseekV2ForCausalLM": "ferrox.models.deepseek_v2:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "ferrox.models.deepseek_v2:DeepseekV3ForCausalLM",
    "Mistral4ForCausalLM": "ferrox.models.mistral4:Mistral4ForCausalLM",
    "GptOssForCausalLM": "ferrox.models.gpt_oss:GptOssForCausalLM",
    "Llama4ForCausalLM": "ferrox.models.llama4:Llama4ForCausalLM",
    "Llama4ForConditionalGeneration": "ferrox.models.llama4:Llama4ForConditionalGeneration",
    "BertModel": "ferrox.models.bert:BertModel",
    "RobertaModel": "ferrox.models.bert:RobertaModel",
    "XLMRobertaModel": "ferrox.models.bert:XLMRobertaModel",
    "BertForSequenceClassification": "ferrox.models.bert_classifier:BertForSequenceClassification",
    "RobertaForSequenceClassification": "ferrox.models.bert_classifier:RobertaForSequenceClassification",
    "XLMRobertaForSequenceClassification": "ferrox.models.bert_classifier:XLMRobertaForSequenceClassification",
    "LlamaForSequenceClassification": "ferrox.models.decoder_classifier:LlamaForSequenceClassification",
    "MistralForSequenceClassification": "ferrox.models.decoder_classifier:MistralForSequenceClassification",
    "Qwen2ForSequenceClassification": "ferrox.models.decoder_classifier:Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification": "ferrox.models.decoder_classifier:Qwen3ForSequenceClassification",
    "Gemma2ForSequenceClassification": "ferrox.models.decoder_classifier:Gemma2ForSequenceClassification",
}

# Sequence classifiers: pooling models of the classify / score kind, which classify a text or score a pair of
# texts read as one sequence (pooling/config.py). The encoders' heads read the first token (cross-encoder
# rerankers), the decoders' the last (reward models, decoder rerankers: models/decoder_classifier.py).
ENCODER_CLASSIFIER_ARCHITECTURES = frozenset({"BertForSequenceClassification", "RobertaForSequenceClassification",
                                              "XLMRobertaForSequenceClassification"})
DECODER_CLASSIFIER_ARCHITECTURES = frozenset({"LlamaForSequenceClassification", "MistralForSequenceClassification",
                                              "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification",
                                              "Gemma2ForSequenceClassification"})
CLASSIFIER_ARCHITECTURES = ENCODER_CLASSIFIER_ARCHITECTURES | DECODER_CLASSIFIER_ARCHITECTURES
# Encoders (bidirectional attention): their default pooling is CLS. The causal LMs above embed too with runner
# "pooling" (pooling/config.py), pooling the last token.
ENCODER_ONLY_ARCHITECTURES = (frozenset({"BertModel", "RobertaModel", "XLMRobertaModel"})
                              | ENCODER_CLASSIFIER_ARCHITECTURES)
# Models without a language-model head: they embed or classify (runner "pooling", chosen by runner "auto")
# and cannot generate.
POOLING_ONLY_ARCHITECTURES = ENCODER_ONLY_ARCHITECTURES | CLASSIFIER_ARCHITECTURES


# (architecture, vision_config.model_type) -> the class, where the tower changes how images are laid out: LLaVA
# over a Pixtral tower (Pixtral-12B) writes Pixtral's rows layout, not a fixed run of image tokens.
VISION_VARIANTS: dict[tuple[str, str], str] = {
    ("LlavaForConditionalGeneration", "pixtral"): "ferrox.models.llava_pixtral:LlavaPixtralForConditionalGeneration",
}


# (architecture, text model_type) -> the class, where the language model is another family's stack: Mistral 3 over
# Mistral 4's (Mistral Small 4: DeepSeek's latent attention and experts under the Pixtral tower).
TEXT_VARIANTS: dict[tuple[str, str], str] = {
    ("Mistral3ForConditionalGeneration", "mistral4"): "ferrox.models.mistral4:Mistral3Mistral4ForConditionalGeneration",
}


def vision_model_type(hf_config: Mapping[str, Any]) -> str | None:
    """vision_config.model_type of a multimodal checkpoint (hf_config: a ModelSpec's or config.json)."""
    vision = (hf_config.get("multimodal") or hf_config).get("vision_config")
    return vision.get("model_type") if isinstance(vision, Mapping) else None


def get_model_class(architectures: list[str], hf_config: Mapping[str, Any] | None = None) -> type:
    """The class of the first supported architecture; hf_config (a ModelSpec's: a multimodal checkpoint's text
    config) picks VISION_VARIANTS and TEXT_VARIANTS."""
    for arch in architectures:
        target = VISION_VARIANTS.get((arch, vision_model_type(hf_config) or "")) if hf_config else None
        target = target or (TEXT_VARIANTS.get((arch, str(hf_config.get("model_type")))) if hf_config else None)
        target = target or SUPPORTED.get(arch)
        if target is not None:
            module, _, cls = target.partition(":")
            return getattr(importlib.import_module(module), cls)
    raise UnsupportedModelError(
        f"architecture {architectures!r} is not supported; supported architectures: {', '.join(sorted(SUPPORTED))}"
    )
