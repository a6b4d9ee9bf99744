"""One source for configuration: `ferrox serve`'s engine flags are generated from EngineConfig's
fields (same defaults, every value reaches the config, each default shown once in --help, the
device-dependent defaults the engine really uses), and LLM / AsyncLLM fill in the same default
SamplingParams (the model's generation_config) for a request that gives none. No model loads."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ferrox import config as config_module
from ferrox.config import EngineConfig
from ferrox.engine.defaults import GENERATION_DEFAULT_KEYS, default_sampling_params
from ferrox.entrypoints import cli
from ferrox.sampling_params import SamplingParams

FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


def serve_parser() -> argparse.ArgumentParser:
    return cli._add_serve_parser(argparse.ArgumentParser().add_subparsers())


def parse(*argv: str) -> EngineConfig:
    return cli.engine_config_from_args(cli.build_parser().parse_args(["serve", *argv]))


def serve_help(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping (it splits at hyphens)
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["serve", "--help"])
    assert exc.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # undo line wrapping


def actions_by_dest(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions}


# ---- every field is a flag with the same default --------------------------------------------------
def test_every_field_has_a_flag_with_the_same_default():
    actions = actions_by_dest(serve_parser())
    for name, field in FIELDS.items():
        assert name in actions, f"EngineConfig.{name} has no `ferrox serve` flag"
        action = actions[name]
        assert action.default == field.default, name
        if field.metadata.get("positional"):
            assert action.option_strings == [], name
        else:
            assert cli.flag_name(name) in action.option_strings, name
            assert cli.flag_name(name) == "--" + name.replace("_", "-")
        assert field.metadata.get("help"), f"EngineConfig.{name}: no help text"
        if field.default is None:
            assert field.metadata.get("default_help"), f"EngineConfig.{name}: say what None (auto) means"


def test_empty_args_give_the_default_config():
    assert parse() == EngineConfig()


def test_vllm_flag_spellings_and_bool_pairs():
    strings = {s for a in serve_parser()._actions for s in a.option_strings}
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--enforce-eager", "--max-model-len", "--served-model-name",
                 "--load-format", "--dtype", "--seed", "--block-size", "--max-logprobs", "--tokenizer",
                 "--chat-template", "--async-scheduling", "--no-async-scheduling", "--kv-cache-memory",
                 "--num-threads", "--device", "--policy", "--scheduling-policy",
                 # server flags stay hand-written
                 "--host", "--port", "--api-key", "--max-request-body-bytes", "--log-level"):
        assert flag in strings, flag


def test_choices_are_the_validated_tuples():
    actions = actions_by_dest(serve_parser())
    for name, field in FIELDS.items():
        choices = field.metadata.get("choices")
        if choices is None:
            continue
        assert tuple(actions[name].choices) == tuple(choices), name
        for value in choices:
            EngineConfig.from_kwargs(**{name: value})  # every offered choice is accepted
        with pytest.raises(ValueError, match=name):
            EngineConfig.from_kwargs(**{name: "no-such-choice"})
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["serve", cli.flag_name(name), "no-such-choice"])
    assert FIELDS["dtype"].metadata["choices"] is config_module.DTYPES
    assert FIELDS["load_format"].metadata["choices"] is config_module.LOAD_FORMATS


# ---- each flag round-trips ------------------------------------------------------------------------
def _non_default(name: str) -> list[tuple[list[str], Any]]:
    """(argv, expected field value) pairs that set `name` to something other than its default."""
    field = FIELDS[name]
    if field.metadata.get("positional"):
        return [(["/models/some-model"], "/models/some-model")]
    flag = cli.flag_name(name)
    if name == "speculative_config":  # a JSON object on the command line
        return [([flag, '{"method": "ngram", "num_speculative_tokens": 2}'],
                 {"method": "ngram", "num_speculative_tokens": 2})]
    if name == "pooler_config":
        return [([flag, '{"pooling_type": "CLS"}'], {"pooling_type": "CLS"})]
    if name == "hf_overrides":
        return [([flag, '{"rope_theta": 1e6}'], {"rope_theta": 1e6})]
    if name == "limit_mm_per_prompt":
        return [([flag, '{"image": 2}'], {"image": 2})]
    if name == "mm_processor_kwargs":
        return [([flag, '{"max_pixels": 50176}'], {"max_pixels": 50176})]
    if name == "media_io_kwargs":
        return [([flag, '{"video": {"num_frames": -1}}'], {"video": {"num_frames": -1}})]
    if name == "compilation_config":
        return [([flag, '{"cudagraph_mode": "FULL_DECODE_ONLY"}'], {"cudagraph_mode": "FULL_DECODE_ONLY"})]
    if name == "optimization_level":  # 0-3
        return [([flag, "1"], 1), (["-O0"], 0)]
    if name == "allowed_media_domains":  # host names, several (vLLM's nargs)
        return [([flag, "a.example", "b.example"], ["a.example", "b.example"])]
    if name == "kv_transfer_config":
        value = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20}}
        return [([flag, json.dumps(value)], value)]
    if name == "kv_events_config":
        return [([flag, '{"topic": "kv"}'], {"topic": "kv"})]
    if name == "structured_outputs_config":
        return [([flag, '{"backend": "guidance"}'], {"backend": "guidance"})]
    if name == "cuda_graph_sizes":  # vLLM's older name: one value (the largest) or several
        return [([flag, "8"], [8]), ([flag, "1", "4"], [1, 4])]
    if name == "cudagraph_capture_sizes":  # integers, several (vLLM's nargs)
        return [([flag, "1", "2", "4"], [1, 2, 4])]
    if name == "reasoning_parser_plugin":  # a file, run when the config is made
        plugin = os.path.join(os.path.dirname(__file__), "helpers", "reasoning_plugin.py")
        return [([flag, plugin], plugin)]
    if name == "logits_processors":  # class paths, several (vLLM's nargs; imported by the engine)
        return [([flag, "pkg.mod:A", "pkg.mod.B"], ["pkg.mod:A", "pkg.mod.B"])]
    if name == "served_model_name":  # one name, or several (vLLM's nargs)
        return [([flag, "a"], "a"), ([flag, "a", "b"], ["a", "b"])]
    if name == "attention_backend":  # vLLM's names, any case (the device is checked by the engine)
        return [([flag, "TRITON_ATTN"], "TRITON_ATTN"), ([flag, "torch_sdpa"], "TORCH_SDPA")]
    if name == "moe_backend":
        return [([flag, "triton"], "triton"), ([flag, "Triton"], "triton")]
    choices = field.metadata.get("choices")
    if choices:
        value = next(c for c in choices if c != field.default and getattr(EngineConfig(**{name: c}), name) == c)
        return [([flag, value], value)]
    if field.metadata.get("size"):
        return [([flag, "3MiB"], 3 << 20), ([flag, "123456"], 123456)]
    kind = cli._value_type(typing.get_type_hints(EngineConfig)[name])
    if kind is bool:
        no = "--no-" + name.replace("_", "-")
        if field.default is None:
            return [([flag], True), ([no], False)]
        return [([no], False)] if field.default else [([flag], True)]
    if kind is int:
        return [([flag, "7"], 7)]
    if kind is float:
        return [([flag, "0.5"], 0.5)]
    return [([flag, "some-value"], "some-value")]


# Flags ferrox takes with vLLM's spelling but only at their default value: anything else is
# refused by name at start-up (never accepted and ignored).
DEFAULT_ONLY = {"pipeline_parallel_size": "2", "kv_offloading_backend": "lmcache"}
# Flags that mean something only beside another: (its argv, the field it sets).
NEEDS = {"calculate_kv_scales": (("--kv-cache-dtype", "fp8"), {"kv_cache_dtype": "fp8"}),
         "max_long_partial_prefills": (("--max-num-partial-prefills", "8"), {"max_num_partial_prefills": 8})}


@pytest.mark.parametrize("name", list(FIELDS))
def test_each_flag_round_trips(name):
    if name in DEFAULT_ONLY:
        with pytest.raises(ValueError, match=name):
            parse(cli.flag_name(name), DEFAULT_ONLY[name])
        return
    needs_argv, needs_fields = NEEDS.get(name, ((), {}))
    for argv, expected in _non_default(name):
        assert expected != FIELDS[name].default
        config = parse(*argv, *needs_argv)
        assert getattr(config, name) == expected, (argv, getattr(config, name))
        # ... and nothing else moved
        assert dataclasses.replace(config, **{name: FIELDS[name].default}) == EngineConfig(**needs_fields), argv


def test_existing_aliases_and_parsing_kept():
    assert parse("--scheduling-policy", "priority").policy == "priority"
    assert parse("--kv-cache-memory", "4GiB").kv_cache_memory == 4 << 30
    assert parse("--kv-cache-memory-bytes", "1073741824").kv_cache_memory == 1 << 30  # vLLM's spelling
    assert parse("--dtype", "bf16").dtype == "bfloat16"
    assert parse("--enable-prefix-caching").enable_prefix_caching is True
    assert parse("model.gguf", "--max-num-seqs", "8").model == "model.gguf"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--kv-cache-memory", "lots"])


def test_vllm_engine_argument_names():
    """LLM(**kwargs) takes vLLM's names where ferrox's field has another; both at once is refused."""
    config = EngineConfig.from_kwargs(scheduling_policy="priority", kv_cache_memory_bytes=1 << 28)
    assert (config.policy, config.kv_cache_memory) == ("priority", 1 << 28)
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig.from_kwargs(scheduling_policy="priority", policy="fcfs")


# ---- --help: each default once, the real device-dependent numbers ---------------------------------
def test_help_shows_each_default_once(monkeypatch, capsys):
    text = serve_help(monkeypatch, capsys)
    assert not re.search(r"\(default: [^()]*\)\s*\(default:", text), "a default is printed twice"
    shown = [a for a in serve_parser()._actions if not isinstance(a, argparse._HelpAction)]
    assert text.count("(default:") == len(shown)
    for name, field in FIELDS.items():
        help_text = cli.engine_help(field).replace("%%", "%")
        assert help_text.count("(default:") == 1, name
        assert text.count(help_text) == 1, name


def test_help_states_the_device_defaults_the_engine_uses(monkeypatch, capsys):
    text = serve_help(monkeypatch, capsys)
    auto = EngineConfig()
    seqs = f"(default: {auto.resolved_max_num_seqs('cuda')} on GPU, {auto.resolved_max_num_seqs('cpu')} on CPU)"
    assert seqs == "(default: 512 on GPU, 64 on CPU)"
    assert f"most requests in the running batch {seqs}" in text
    tokens = (f"(default: {auto.resolved_max_num_batched_tokens('cuda')} on GPU, "
              f"{auto.resolved_max_num_batched_tokens('cpu')} on CPU)")
    assert tokens == "(default: 8192 on GPU, 2048 on CPU)"
    assert f"token budget of one engine step {tokens}" in text
    assert f"on CPU at most {config_module.CPU_DEFAULT_MAX_MODEL_LEN})" in text
    assert "(default: on CPU 2GiB capped" in text
    assert "(default: on for CUDA, off on CPU)" in text
    assert "256 on GPU" not in text  # the old, wrong GPU max_num_seqs


def test_console_script_help():
    """`ferrox serve --help` in a fresh process (the console script where installed)."""
    script = Path(sys.executable).with_name("ferrox")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "ferrox.entrypoints.cli"]
    env = {k: v for k, v in os.environ.items() if k != "FERROX_API_KEY"} | {"COLUMNS": "100"}
    res = subprocess.run([*command, "serve", "--help"], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert "--async-scheduling, --no-async-scheduling" in text
    assert "(default: 512 on GPU, 64 on CPU)" in text
    assert "(default: $FERROX_API_KEY)" in text


# ---- default SamplingParams: LLM and AsyncLLM share one helper ------------------------------------
GENERATION_CONFIG = {
    "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
    "eos_token_id": [2, 3], "bos_token_id": 1, "do_sample": True, "transformers_version": "4.50.0",
}
EXPECTED = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.1)


def test_default_sampling_params_take_the_generation_config():
    assert default_sampling_params(GENERATION_CONFIG) == EXPECTED
    assert default_sampling_params({}) == SamplingParams()
    assert default_sampling_params(None) == SamplingParams()
    partial = default_sampling_params({"temperature": 0.7, "top_p": None, "top_k": True})
    assert partial == SamplingParams(temperature=0.7)


def test_the_core_handshake_carries_every_default_key():
    """AsyncLLM gets generation_defaults through the engine-core handshake, which keeps only
    SAMPLING_DEFAULT_KEYS: the helper must not depend on any other key."""
    from ferrox.engine.core_process import SAMPLING_DEFAULT_KEYS

    assert set(GENERATION_DEFAULT_KEYS) <= set(SAMPLING_DEFAULT_KEYS)
    handshake = {k: v for k, v in GENERATION_CONFIG.items() if k in SAMPLING_DEFAULT_KEYS}
    assert default_sampling_params(handshake) == default_sampling_params(GENERATION_CONFIG)


def test_llm_and_async_llm_use_the_same_defaults():
    """Both entry points' no-params paths, on stand-ins for their engines (no model load)."""
    from ferrox.engine.async_llm import AsyncLLM
    from ferrox.engine.llm import LLM
    from ferrox.request_rules import RequestLimits

    llm = LLM.__new__(LLM)
    llm.engine = SimpleNamespace(generation_defaults=dict(GENERATION_CONFIG))
    assert llm.get_default_sampling_params() == EXPECTED
    assert llm._params_per_prompt(None, 2) == [EXPECTED, EXPECTED]

    sent: list[Any] = []
    engine = AsyncLLM.__new__(AsyncLLM)
    engine.client = SimpleNamespace(dead=None, add_request=lambda request, cache_key=None: sent.append(request))
    engine.processor = SimpleNamespace(add_request=lambda request, text: [request])
    engine.generation_defaults = {k: v for k, v in GENERATION_CONFIG.items() if isinstance(v, (int, float))}
    engine.max_model_len = 64
    engine.limits = RequestLimits(max_model_len=64, kv_capacity_tokens=1024, vocab_size=100, max_logprobs=20)
    engine._streams, engine._timing = {}, {}
    engine._add_request("hi", [1, 2, 3], None, "r1", 0, 0.0)
    assert len(sent) == 1 and sent[0].sampling_params == EXPECTED


def test_quantization_choices_are_the_resolvers():
    from ferrox.config import QUANTIZATION_METHODS
    from ferrox.layers.quant.config import QUANTIZATION_METHODS as RESOLVED

    assert set(QUANTIZATION_METHODS) == set(RESOLVED)


def test_served_model_names_and_the_model_after_them(tmp_path):
    """Several names as vLLM takes them; `--served-model-name NAME MODEL` would read MODEL as a name
    (and ferrox serve its embedded model): refused, naming both ways out. YAML lists expand."""
    assert parse("m", "--served-model-name", "a", "b").served_names() == ["a", "b"]
    assert parse("--served-model-name=a", "m").model == "m"
    folder = tmp_path / "model"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"--served-model-name: '.*model' looks like the model path.*put MODEL "
                                         r"before --served-model-name, or write --served-model-name=a"):
        parse("--served-model-name", "a", str(folder))
    with pytest.raises(ValueError, match=r"served_model_name: must be a name or a non-empty list"):
        EngineConfig(served_model_name=[])
    pytest.importorskip("yaml")
    (tmp_path / "c.yaml").write_text("served-model-name: [x, y]\nmax-model-len: 64\n")
    args = cli.expand_config_file(["serve", "--config", str(tmp_path / "c.yaml"), "m"])
    assert args == ["serve", "--served-model-name", "x", "y", "--max-model-len=64", "m"]


def test_dotted_keys_of_json_flags():
    """vLLM's `--json-flag.key value` spelling: keys gather (nested by dots, values as JSON where they parse)
    over the flag's whole object, into one argument, for the engine's JSON flags and the server's."""
    argv = cli.expand_dotted_json_args([
        "serve", "m", "--compilation-config.cudagraph_mode", "FULL_DECODE_ONLY", "-cc.cudagraph_capture_sizes=[1,2]",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
        "--speculative-config.num_speculative_tokens=3", "--hf-overrides.rope_scaling.factor", "2.0",
        "--override-generation-config.temperature", "0.5", "--port", "9000"])
    args = cli.build_parser().parse_args(argv)
    config = cli.engine_config_from_args(args)
    assert config.compilation_config == {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2]}
    assert config.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert config.hf_overrides == {"rope_scaling": {"factor": 2.0}}
    assert args.override_generation_config == {"temperature": 0.5} and args.port == 9000
    plain = ["serve", "-cc", '{"mode": 3}']
    assert cli.expand_dotted_json_args(plain) == plain  # nothing dotted: untouched
    with pytest.raises(ValueError, match="needs a value"):
        cli.expand_dotted_json_args(["serve", "--compilation-config.mode"])


def test_swap_space_is_checked_as_vllm_checks_it(caplog):
    """vLLM's V1 engine reserves no swap (it preempts by recompute, as ferrox): the setting is validated against
    host memory as vLLM validates it, and reported; an unset one is vLLM's default 4 GiB, unchecked."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    assert parse("--swap-space", "0.5").swap_space == 0.5
    with pytest.raises(ValueError, match="swap_space: must be a number"):
        EngineConfig(swap_space=-1)
    with pytest.raises(ValueError, match=r"swap_space: .* x 2 ranks\) .* is too much"):
        EngineConfig(swap_space=total * 0.4, tensor_parallel_size=2)
    with caplog.at_level("WARNING"):
        EngineConfig(swap_space=total * 0.5)
    assert "possibly too much" in caplog.text
    EngineConfig(tensor_parallel_size=64)  # (unset: no check)


def test_flag_names_with_underscores_are_vllms_spelling_too():
    """vLLM takes `--tokenizer_mode` for `--tokenizer-mode` (Mistral's cards and vLLM's recipes write it so); only a
    flag's name changes, never a value or a dotted JSON key."""
    argv = cli.dashed_flag_names(["serve", "--tokenizer_mode", "hf", "--max_model_len=64", "--served-model-name",
                                  "a_b", "--hf_overrides.rope_scaling.rope_type=linear", "--api-key=x_y"])
    assert argv == ["serve", "--tokenizer-mode", "hf", "--max-model-len=64", "--served-model-name", "a_b",
                    "--hf-overrides.rope_scaling.rope_type=linear", "--api-key=x_y"]
    config = parse(*cli.expand_dotted_json_args(argv)[1:])
    assert (config.tokenizer_mode, config.max_model_len) == ("hf", 64)
    assert config.hf_overrides == {"rope_scaling": {"rope_type": "linear"}}
