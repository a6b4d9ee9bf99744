"""vLLM's compilation_config, --cudagraph-capture-sizes and --max-cudagraph-capture-size (ferrox/compilation_config.py):
which CUDA graphs each setting asks for, vLLM's overrides, refusals by name, and the flags on the CLI, in a
YAML --config and in LLM(...). The graphs themselves are captured on CUDA (tests/engine/test_gpu_engine.py)."""

from __future__ import annotations

import argparse

import pytest
from ferrox.compilation_config import GraphPlan, graph_plan
from ferrox.config import EngineConfig
from ferrox.entrypoints.cli import add_engine_args, config_file_args, engine_config_from_args


@pytest.mark.parametrize("cc,want", [
    (None, GraphPlan(True, True)),
    ({}, GraphPlan(True, True)),
    ({"cudagraph_mode": "FULL_AND_PIECEWISE", "custom_ops": ["all"]}, GraphPlan(True, True)),
    ({"cudagraph_mode": "full_decode_only"}, GraphPlan(True, False)),
    ({"cudagraph_mode": "PIECEWISE"}, GraphPlan(False, True)),
    ({"cudagraph_mode": "NONE"}, GraphPlan(False, False)),
    ({"mode": 3}, GraphPlan(True, True)),
    ({"mode": "VLLM_COMPILE"}, GraphPlan(True, True)),
    # vLLM: piecewise graphs need VLLM_COMPILE; a mode that asks for them without it resolves to none
    ({"mode": 0}, GraphPlan(False, False)),
    ({"level": 0}, GraphPlan(False, False)),
    ({"level": 0, "mode": 3}, GraphPlan(True, True)),  # mode wins over its deprecated spelling
    ({"mode": "none", "cudagraph_mode": "PIECEWISE"}, GraphPlan(False, False)),
    ({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}, GraphPlan(True, False)),
    (3, GraphPlan(True, True)),  # LLM(compilation_config=3): a mode
    (0, GraphPlan(False, False)),
    ({"cudagraph_capture_sizes": [4, 1, 2, 2]}, GraphPlan(True, True, (1, 2, 4))),
    ({"max_cudagraph_capture_size": 64}, GraphPlan(True, True, None, 64)),
    ({"cudagraph_capture_sizes": [1, 8], "max_cudagraph_capture_size": 8}, GraphPlan(True, True, (1, 8), 8)),
])
def test_plans(cc, want):
    assert graph_plan(cc) == want


def test_cuda_graph_sizes_is_vllms_older_name():
    """One value is the largest size (the ladders up to it), several are the sizes; with the newer names too
    it is refused by name."""
    assert EngineConfig(cuda_graph_sizes=[8]).graph_plan() == EngineConfig(max_cudagraph_capture_size=8).graph_plan()
    assert EngineConfig(cuda_graph_sizes=[4, 1]).graph_plan() == EngineConfig(cudagraph_capture_sizes=[1, 4]).graph_plan()
    with pytest.raises(ValueError, match="cuda_graph_sizes: vLLM's older name"):
        EngineConfig(cuda_graph_sizes=[8], cudagraph_capture_sizes=[1, 8]).graph_plan()


def test_flags_and_enforce_eager():
    assert graph_plan(None, cudagraph_capture_sizes=[2, 1], max_cudagraph_capture_size=2) == GraphPlan(True, True, (1, 2), 2)
    assert graph_plan({"cudagraph_capture_sizes": [1, 2]}, cudagraph_capture_sizes=[2, 1]).sizes == (1, 2)  # the same
    assert graph_plan({"cudagraph_mode": "FULL_DECODE_ONLY"}, enforce_eager=True).any is False  # vLLM's override
    assert not graph_plan(None, enforce_eager=True).any


@pytest.mark.parametrize("kwargs,names", [
    (dict(compilation_config={"backend": "inductor"}), "compilation_config.backend"),
    (dict(compilation_config={"compile_sizes": [1]}), "compilation_config.compile_sizes"),
    (dict(compilation_config={"mode": 1}), "compilation_config.mode"),
    (dict(compilation_config={"level": "DYNAMO_TRACE_ONCE"}), "compilation_config.level"),
    (dict(compilation_config={"mode": 7}), "compilation_config.mode"),
    (dict(compilation_config={"cudagraph_mode": "FULL"}), "compilation_config.cudagraph_mode"),
    (dict(compilation_config={"cudagraph_mode": "SOME"}), "compilation_config.cudagraph_mode"),
    (dict(compilation_config={"custom_ops": ["none", "+rms_norm"]}), "compilation_config.custom_ops"),
    (dict(compilation_config={"cudagraph_capture_sizes": []}), "compilation_config.cudagraph_capture_sizes"),
    (dict(compilation_config={"cudagraph_capture_sizes": [1, 0]}), "compilation_config.cudagraph_capture_sizes"),
    (dict(compilation_config="fast"), "compilation_config"),
    (dict(cudagraph_capture_sizes=[1, 2], compilation_config={"cudagraph_capture_sizes": [1, 4]}),
     "cudagraph_capture_sizes"),
    (dict(cudagraph_capture_sizes=[1, 2], max_cudagraph_capture_size=8), "max_cudagraph_capture_size"),
    (dict(max_cudagraph_capture_size=0), "max_cudagraph_capture_size"),
    (dict(max_cudagraph_capture_size=8, compilation_config={"max_cudagraph_capture_size": 16}),
     "max_cudagraph_capture_size"),
])
def test_refused_by_name(kwargs, names):
    with pytest.raises(ValueError, match=names.replace(".", r"\.")):
        EngineConfig(**kwargs)


def _parse(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, parser.add_argument_group("engine"))
    return engine_config_from_args(parser.parse_args(argv))


def test_cli_flags_as_vllm_spells_them(tmp_path):
    config = _parse(["model", "-cc", '{"cudagraph_mode": "FULL_DECODE_ONLY", "custom_ops": ["all"]}',
                     "--cudagraph-capture-sizes", "1", "2", "4", "--max-cudagraph-capture-size", "4"])
    assert config.graph_plan() == GraphPlan(True, False, (1, 2, 4), 4)
    assert config.model == "model"
    config = _parse(["--compilation-config", '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}', "model"])
    assert config.graph_plan() == GraphPlan(True, False)
    with pytest.raises(ValueError, match=r"compilation_config\.pass_config"):
        _parse(["model", "-cc", '{"pass_config": {"enable_sp": true}}'])
    yaml = tmp_path / "serve.yaml"
    yaml.write_text("compilation-config: {cudagraph_mode: PIECEWISE}\ncudagraph_capture_sizes: [1, 8, 16]\n")
    pytest.importorskip("yaml")
    config = _parse(["model", *config_file_args(str(yaml))])
    assert config.graph_plan() == GraphPlan(False, True, (1, 8, 16))


def test_offline_llm_takes_it_on_the_cpu(tmp_path):
    """On the CPU there are no CUDA graphs: the settings are checked (a refusal names its key) and the
    engine runs as always."""
    from ferrox import LLM, SamplingParams

    from tests.helpers.tiny_models import make_tiny_llama

    model = make_tiny_llama(tmp_path / "m")
    llm = LLM(model, device="cpu", kv_cache_memory=8 << 20, compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"},
              cudagraph_capture_sizes=[1, 2])
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match=r"compilation_config\.cudagraph_mode"):
        LLM(model, device="cpu", compilation_config={"cudagraph_mode": "FULL"})


def test_pooling_models_refuse_graph_settings():
    with pytest.raises(ValueError, match="pooling"):
        EngineConfig(runner="pooling", cudagraph_capture_sizes=[1, 2])
    EngineConfig(runner="pooling", compilation_config={"cudagraph_mode": "NONE"})  # no graphs: as it runs



@pytest.mark.parametrize("argv,want", [
    (["-O0"], GraphPlan(False, False)),
    (["-O1"], GraphPlan(False, True)),
    (["-O2"], GraphPlan(True, True)),
    (["-O", "3"], GraphPlan(True, True)),
    (["--optimization-level", "0", "-cc", '{"cudagraph_mode": "FULL_DECODE_ONLY"}'], GraphPlan(True, False)),
    (["-O1", "-cc", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'], GraphPlan(True, True)),  # what cc says wins
    (["-O0", "-cc", '{"mode": 3}'], GraphPlan(False, False)),  # O0's cudagraph_mode NONE stays
])
def test_optimization_levels(argv, want):
    """vLLM's -O0 ... -O3: defaults for what compilation_config leaves unset (O0: no graphs, O1: piecewise,
    O2 / O3: both kinds)."""
    assert _parse(["model", *argv]).graph_plan() == want


def test_optimization_level_refused_outside_0_to_3():
    with pytest.raises(ValueError, match="optimization_level"):
        EngineConfig(optimization_level=4)
