"""SamplingParams and EngineConfig: validation names the field; msgpack round trip is lossless."""

from __future__ import annotations

import msgspec
import pytest
from ferrox.config import EngineConfig
from ferrox.engine.protocol import EngineCoreRequest
from ferrox.sampling_params import RequestOutputKind, SamplingParams
from ferrox.structured.params import StructuredOutputsParams


def test_msgpack_round_trip_inside_engine_core_request():
    params = SamplingParams(
        n=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=7, stop=["\n\n", "END"],
        stop_token_ids=[2], max_tokens=None, min_tokens=3, logprobs=5, prompt_logprobs=1,
        logit_bias={11: -5.0, 12: 2.5}, allowed_token_ids=[1, 2, 3, 11, 12],
        structured_outputs=StructuredOutputsParams(json={"type": "object"}),
        output_kind=RequestOutputKind.DELTA, extra_args={"x": 1},
    )
    req = EngineCoreRequest("r1", [1, 2, 3], params, arrival_time=1.5, priority=2)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    assert back == req
    assert back.sampling_params.output_kind is RequestOutputKind.DELTA
    assert back.sampling_params.structured_outputs == params.structured_outputs


def test_normalization():
    p = SamplingParams(stop="x", top_k=-1, logit_bias={"5": 1})  # type: ignore[dict-item]
    assert p.stop == ["x"] and p.top_k == 0 and p.logit_bias == {5: 1.0}
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=3)
    assert greedy.is_greedy and greedy.top_p == 1.0 and greedy.top_k == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"logit_bias": {1: 500}}, "logit_bias"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_params_rejected_on_decode_too():
    raw = msgspec.msgpack.encode({"temperature": -2.0})
    with pytest.raises(ValueError, match="temperature"):
        msgspec.msgpack.decode(raw, type=SamplingParams)


def test_check_vocab():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={100: 1.0}).check_vocab(50)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"dtype": "float8"}, "dtype"),
        ({"load_format": "pickle"}, "load_format"),
        ({"device": "tpu"}, "device"),
        ({"block_size": 0}, "block_size"),
        ({"max_model_len": -5}, "max_model_len"),
        ({"kv_cache_memory": -1}, "kv_cache_memory"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"policy": "lifo"}, "policy"),
        ({"prefix_caching_hash_algo": "md5"}, "prefix_caching_hash_algo"),
        ({"num_gpu_blocks_override": 1}, "num_gpu_blocks_override"),
    ],
)
def test_bad_engine_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(**kwargs)


def test_engine_config_unknown_argument_and_aliases():
    with pytest.raises(ValueError, match="max_num_sequences"):
        EngineConfig.from_kwargs(max_num_sequences=3)
    assert EngineConfig(dtype="half").dtype == "float16"
    cfg = EngineConfig()
    assert cfg.resolved_max_num_batched_tokens("cpu") == 2048
    assert 0 < cfg.resolved_cpu_kv_cache_memory() <= 2 << 30


def test_load_formats_match_the_loader():
    from ferrox.config import LOAD_FORMATS
    from ferrox.loader.model_loader import LOAD_FORMATS as LOADER_FORMATS

    assert set(LOAD_FORMATS) == set(LOADER_FORMATS)
