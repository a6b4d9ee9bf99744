"""Messages from the front-end (LLM / AsyncLLM / server) to the engine core.

msgspec structs, so the same objects cross a ZMQ socket (msgpack) when the core runs in its
own process and are passed as-is when it runs in-process. The way back is one
`ferrox.step_types.StepResult` per step (columns, not one object per request).
"""

from __future__ import annotations

import msgspec

from ferrox.multimodal.inputs import MultiModalItem
from ferrox.pooling.params import PoolingParams
from ferrox.sampling_params import SamplingParams
from ferrox.step_types import Logprobs, StepResult, StepRow

__all__ = ["EngineCoreRequest", "Logprobs", "StepResult", "StepRow"]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    # Prefix-cache isolation (vLLM's cache_salt): blocks are shared only between requests with the same salt.
    cache_salt: str | None = None
    # Multi-LoRA (vLLM's LoRARequest, flattened): 0 = the base model. The path lets any engine core
    # load the adapter on first use (each data-parallel core loads what its requests need).
    lora_int_id: int = 0
    lora_name: str | None = None
    lora_path: str | None = None
    # A pooling model's request (LLM.embed, /v1/embeddings): its vector instead of generated text; then
    # sampling_params is ferrox.pooling.params.pooling_sampling_params() (one placeholder token).
    pooling_params: PoolingParams | None = None
    # The prompt's images (vLLM's multi_modal_data), their placeholder runs already expanded in
    # prompt_token_ids by the front-end (multimodal/processing.py).
    mm_inputs: list[MultiModalItem] | None = None
