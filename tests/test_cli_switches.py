"""vLLM's other spellings of the flags ferrox has, and its small flags, at the parse level (no model loads):

- every boolean flag takes vLLM's partners (its EnableDisableAction): --x / --no-x, --enable-x / --disable-x
  (and the hidden --no-enable-x), --disable-x / --enable-x (and --no-disable-x), each partner the opposite
  value; a partner ferrox cannot honour is refused by name, never accepted and ignored;
- the short forms -ep, -sc and --device-memory-utilization;
- --spec-method / --spec-model / --spec-tokens (keys of --speculative-config), --hf-token,
  --attention-backend / --moe-backend, --max-num-queued-tokens, --sse-keep-alive-interval, --ssl-ciphers,
  --disable-access-log-for-endpoints, --enable-log-deltas.
Their behaviour in a running server: tests/server/test_frontend_flags.py."""

from __future__ import annotations

import argparse
import json
import logging

import pytest
from ferrox.config import EngineConfig, check_kernel_backends
from ferrox.engine.output_log import OutputLog
from ferrox.entrypoints import cli
from ferrox.outputs import CompletionOutput, RequestOutput


def serve_parser() -> argparse.ArgumentParser:
    return cli._add_serve_parser(argparse.ArgumentParser().add_subparsers())


def args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["serve", *argv])


def parse(*argv: str) -> EngineConfig:
    return cli.engine_config_from_args(args(*argv))


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        args(*argv)
    assert exc.value.code == 2
    return " ".join(capsys.readouterr().err.split())


def switches() -> list[cli.SwitchAction]:
    return [a for a in serve_parser()._actions if isinstance(a, cli.SwitchAction)]


# ---- every boolean's partners -----------------------------------------------------------------------
# Section 3 of the survey of vLLM 0.34's `vllm serve` parser: its spellings of flags ferrox has.
VLLM_PARTNERS = [
    "--disable-prefix-caching", "--disable-chunked-prefill", "--enable-sliding-window", "--disable-prompt-embeds",
    "--disable-sleep-mode", "--disable-lora", "--disable-expert-parallel", "--disable-prompt-tokens-details",
    "--disable-server-load-tracking", "--disable-force-include-usage", "--disable-tokenizer-info-endpoint",
    "--disable-log-outputs", "--enable-uvicorn-access-log", "--enable-fastapi-docs",
    "--no-trust-request-chat-template", "--no-return-tokens-as-token-ids", "--no-exclude-tools-when-tool-choice-none",
    "--no-log-error-stack", "--no-allow-credentials", "--no-enable-log-requests", "--no-enable-log-outputs",
    "--no-enable-force-include-usage", "--no-enable-prompt-tokens-details", "--no-enable-server-load-tracking",
    "--no-enable-tokenizer-info-endpoint", "--no-disable-fastapi-docs", "--no-disable-uvicorn-access-log",
    "--disable-log-requests", "--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--no-async-scheduling",
    "--no-trust-remote-code", "--no-enforce-eager", "--disable-log-deltas",
]
# Partners whose value ferrox cannot honour: refused, naming the spelling and why.
REFUSED_PARTNERS = {
    "--enable-cascade-attn": "no cascade attention", "--no-disable-cascade-attn": "no cascade attention",
    "--enable-custom-all-reduce": "no custom all-reduce",
    "--disable-auto-tool-choice": "always parses tool calls", "--no-enable-auto-tool-choice": "always parses",
    "--disable-request-id-headers": "always sends X-Request-Id",
}


def test_vllm_spellings_are_there():
    strings = {s for a in serve_parser()._actions for s in a.option_strings}
    for flag in [*VLLM_PARTNERS, *REFUSED_PARTNERS, "-ep", "-sc", "--device-memory-utilization", "--spec-method",
                 "--spec-model", "--spec-tokens", "--hf-token", "--attention-backend", "--moe-backend",
                 "--max-num-queued-tokens", "--sse-keep-alive-interval", "--ssl-ciphers",
                 "--disable-access-log-for-endpoints", "--enable-log-deltas", "--no-enable-log-deltas"]:
        assert flag in strings, flag


def test_each_partner_sets_the_same_field_to_the_opposite_value(capsys):
    """Generic over every switch of the parser (engine fields and server flags alike): each spelling sets its
    field, partners the opposite of the flag's own, and nothing else moves."""
    default = vars(args())
    checked = 0
    for action in switches():
        for spelling in action.option_strings:
            inverse = spelling in action.inverse_option_strings
            if inverse and action.refuse_inverse:
                continue  # test_partners_ferrox_cannot_honour_are_refused_by_name
            got = vars(args(spelling))
            assert got[action.dest] is (not inverse), spelling
            assert {k: v for k, v in got.items() if k != action.dest} == \
                {k: v for k, v in default.items() if k != action.dest}, spelling
            checked += 1
    assert checked > 80, checked
    # ... and the engine fields reach EngineConfig so.
    assert parse("--disable-prefix-caching").enable_prefix_caching is False
    assert parse("--disable-chunked-prefill").enable_chunked_prefill is False
    assert parse("--enable-sliding-window").disable_sliding_window is False
    assert parse("--disable-sliding-window").disable_sliding_window is True
    assert parse("--enable-lora", "--disable-lora").enable_lora is False
    assert parse("-ep").enable_expert_parallel is True
    assert parse("--enable-log-stats").disable_log_stats is False
    assert args("--disable-log-requests").enable_log_requests is False
    assert args("--enable-uvicorn-access-log").disable_uvicorn_access_log is False
    assert args("--enable-log-deltas").enable_log_deltas is True and args().enable_log_deltas is True  # vLLM's default


def test_conflicting_spellings_the_last_one_wins():
    """As in vLLM (argparse): the last spelling of a flag on the command line wins."""
    assert parse("--enable-prefix-caching", "--disable-prefix-caching").enable_prefix_caching is False
    assert parse("--disable-prefix-caching", "--enable-prefix-caching").enable_prefix_caching is True
    assert parse("--no-enable-prefix-caching", "--enable-prefix-caching").enable_prefix_caching is True
    assert parse("-ep", "--disable-expert-parallel").enable_expert_parallel is False
    assert parse("--disable-chunked-mm-input", "--enable-chunked-mm-input").disable_chunked_mm_input is False
    assert parse("--disable-expert-parallel", "-ep").enable_expert_parallel is True
    assert args("--enable-log-requests", "--no-enable-log-requests").enable_log_requests is False
    assert args("--disable-fastapi-docs", "--enable-fastapi-docs").disable_fastapi_docs is False


def test_partners_ferrox_cannot_honour_are_refused_by_name(capsys):
    for spelling, why in REFUSED_PARTNERS.items():
        err = refused(capsys, spelling)
        assert f"error: {spelling}: " in err and why in err, err
    # their own flag stays accepted, as before
    config = parse("--disable-cascade-attn", "--disable-custom-all-reduce", "--disable-chunked-mm-input")
    assert config.disable_cascade_attn and config.disable_custom_all_reduce and config.disable_chunked_mm_input
    assert args("--enable-auto-tool-choice", "--enable-request-id-headers").enable_auto_tool_choice is True


def test_help_lists_each_flag_with_its_partner(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        args("--help")
    text = capsys.readouterr().out
    for pair in ("--enable-prefix-caching, --disable-prefix-caching", "--disable-sliding-window, --enable-sliding-window",
                 "--enable-expert-parallel, -ep, --disable-expert-parallel", "--async-scheduling, --no-async-scheduling",
                 "--enable-log-requests, --disable-log-requests", "--disable-fastapi-docs, --enable-fastapi-docs",
                 "--allow-credentials, --no-allow-credentials", "--speculative-config SPECULATIVE_CONFIG, -sc"):
        assert pair in text, pair
    # vLLM's hidden spellings, and partners that are there only to be refused, stay out of --help
    for hidden in ("--no-enable-prefix-caching", "--no-disable-sliding-window", "--no-enable-log-requests",
                   "--enable-cascade-attn", "--enable-custom-all-reduce", "--disable-auto-tool-choice"):
        assert hidden not in text, hidden


def test_yaml_config_takes_the_partners(tmp_path):
    """vLLM's --config FILE.yaml: a switch's `true` is its spelling, `false` its opposite (none where false is
    the default, so a refused partner is never spelled out for it)."""
    pytest.importorskip("yaml")
    (tmp_path / "c.yaml").write_text("disable-prefix-caching: true\nenable-fastapi-docs: true\n")
    argv = cli.expand_config_file(["serve", "--config", str(tmp_path / "c.yaml")])
    ns = cli.build_parser().parse_args(argv)
    assert cli.engine_config_from_args(ns).enable_prefix_caching is False and ns.disable_fastapi_docs is False
    (tmp_path / "f.yaml").write_text("enable-log-deltas: false\nasync-scheduling: false\nenable-chunked-prefill: false\n"
                                     "disable-sliding-window: false\nenable-cascade-attn: false\n"
                                     "disable-cascade-attn: false\nenable-auto-tool-choice: false\n"
                                     "disable-log-requests: false\nenforce-eager: false\n")
    argv = cli.expand_config_file(["serve", "--config", str(tmp_path / "f.yaml")])
    assert argv == ["serve", "--disable-log-deltas", "--no-async-scheduling", "--disable-chunked-prefill",
                    "--disable-cascade-attn", "--enable-log-requests"], argv
    ns = cli.build_parser().parse_args(argv)
    config = cli.engine_config_from_args(ns)
    assert ns.enable_log_deltas is False and config.async_scheduling is False and not config.enable_chunked_prefill
    assert config.disable_cascade_attn is True and ns.enable_log_requests is True


# ---- short forms ------------------------------------------------------------------------------------
def test_short_forms():
    assert parse("--device-memory-utilization", "0.5").gpu_memory_utilization == 0.5
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    assert parse("-sc", json.dumps(spec)).speculative_config == spec
    argv = cli.expand_dotted_json_args(["serve", "-sc.method", "ngram", "-sc.num_speculative_tokens=3"])
    assert cli.engine_config_from_args(cli.build_parser().parse_args(argv)).speculative_config == {
        "method": "ngram", "num_speculative_tokens": 3}


# ---- --spec-method / --spec-model / --spec-tokens ---------------------------------------------------
def test_spec_shorthands_fill_the_speculative_config():
    assert parse("--spec-method", "ngram", "--spec-tokens", "3").speculative_config == {
        "method": "ngram", "num_speculative_tokens": 3}
    # over the JSON's other keys; a model without a method is a draft model (vLLM infers the method)
    config = parse("--speculative-config", '{"prompt_lookup_max": 4}', "--spec-method", "ngram", "--spec-tokens", "2")
    assert config.speculative_config == {"prompt_lookup_max": 4, "method": "ngram", "num_speculative_tokens": 2}
    assert parse("--spec-model", "/draft", "--spec-tokens", "4").speculative_config == {
        "model": "/draft", "num_speculative_tokens": 4}
    config = EngineConfig.from_kwargs(spec_method="ngram", spec_tokens=5)  # LLM(spec_method=...), as vLLM's
    assert config.speculative_config == {"method": "ngram", "num_speculative_tokens": 5}
    assert EngineConfig.from_kwargs(spec_method=None).speculative_config is None


def test_spec_shorthands_and_the_json_key_are_exclusive_and_methods_are_checked():
    with pytest.raises(ValueError, match=r"spec_tokens \(--spec-tokens\) and speculative_config\['num_speculative_"
                                         r"tokens'\] are mutually exclusive"):
        parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--spec-tokens", "3")
    with pytest.raises(ValueError, match=r"spec_method .* mutually exclusive"):
        cli.engine_config_from_args(cli.build_parser().parse_args(cli.expand_dotted_json_args(
            ["serve", "--speculative-config.method", "ngram", "--spec-method", "ngram"])))
    with pytest.raises(ValueError, match=r"speculative_config.method: 'eagle3' is not one of ngram, draft_model"):
        parse("--spec-method", "eagle3", "--spec-tokens", "2")
    with pytest.raises(ValueError, match="num_speculative_tokens: must be a positive integer"):
        parse("--spec-method", "ngram")


# ---- --hf-token -------------------------------------------------------------------------------------
def test_hf_token_is_accepted_and_not_exported(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert args("--hf-token").hf_token is True  # bare: the stored login's, as vLLM's
    ns = args("--hf-token", "hf_secret")
    assert ns.hf_token == "hf_secret" and parse("--hf-token", "hf_secret") == EngineConfig()
    assert "hf_secret" not in repr(cli.engine_config_from_args(ns))
    assert EngineConfig.from_kwargs(hf_token="hf_secret") == EngineConfig()
    with pytest.raises(ValueError, match="hf_token: must be a token string or a bool"):
        EngineConfig.from_kwargs(hf_token=3)
    import os
    assert "HF_TOKEN" not in os.environ


# ---- --attention-backend / --moe-backend -------------------------------------------------------------
def test_kernel_backends_ferrox_has_are_taken_in_vllm_spelling():
    assert parse("--attention-backend", "triton_attn").attention_backend == "TRITON_ATTN"
    assert parse("--attention-backend", "auto").attention_backend is None
    assert parse("--moe-backend", "TRITON").moe_backend == "triton"
    # on the CPU, the torch backend is what runs
    config = parse("--device", "cpu", "--attention-backend", "TORCH_SDPA", "--moe-backend", "auto")
    assert config.attention_backend == "TORCH_SDPA"
    assert parse("--device", "cpu", "--attention-backend", "cpu_attn").attention_backend == "CPU_ATTN"
    # the engine's check against the kernel set its device runs (model_setup.load_everything)
    check_kernel_backends(EngineConfig(attention_backend="TRITON_ATTN", moe_backend="triton"), "triton", "cuda")
    check_kernel_backends(EngineConfig(attention_backend="TORCH_SDPA"), "torch", "cpu")
    check_kernel_backends(EngineConfig(), "torch", "cpu")


@pytest.mark.parametrize("name, value", [
    ("attention_backend", "FLASH_ATTN"), ("attention_backend", "FLASHINFER"), ("attention_backend", "ROCM_AITER_FA"),
    ("attention_backend", "TRITON_MLA"), ("attention_backend", "no-such-backend"),
    ("moe_backend", "deep_gemm"), ("moe_backend", "aiter"), ("moe_backend", "flashinfer-cutlass"),
    ("moe_backend", "marlin"),
])
def test_other_kernel_backends_are_refused_by_name(name, value):
    accepted = "'TRITON_ATTN'" if name == "attention_backend" else "'triton'"
    with pytest.raises(ValueError, match=rf"{name}: '.*' is not an? .*backend ferrox has; it takes 'auto'.*{accepted}"):
        parse(cli.flag_name(name), value)


def test_a_kernel_backend_the_device_does_not_run_is_refused_by_name():
    with pytest.raises(ValueError, match=r"attention_backend: 'TRITON_ATTN' is ferrox's triton kernels, which it runs "
                                         r"on CUDA .*this engine runs on cpu with its torch kernels \('auto', "
                                         r"'CPU_ATTN', 'TORCH_SDPA'\)"):
        parse("--device", "cpu", "--attention-backend", "TRITON_ATTN")
    with pytest.raises(ValueError, match=r"moe_backend: 'triton' .* on cpu"):
        parse("--device", "cpu", "--moe-backend", "triton")
    with pytest.raises(ValueError, match=r"attention_backend: 'TORCH_SDPA' is ferrox's torch kernels, which it runs on "
                                         r"the CPU; this engine runs on cuda with its triton kernels \('auto', "
                                         r"'TRITON_ATTN'\)"):
        check_kernel_backends(EngineConfig(attention_backend="TORCH_SDPA"), "triton", "cuda")


# ---- small server flags -----------------------------------------------------------------------------
def test_token_counts_and_intervals(capsys):
    assert args().max_num_queued_tokens is None and args().sse_keep_alive_interval == 0
    for text, tokens in (("4096", 4096), ("2k", 2000), ("25.6k", 25600), ("1K", 1024), ("2M", 2 << 20), ("0", 0)):
        assert args("--max-num-queued-tokens", text).max_num_queued_tokens == tokens, text
    assert "takes whole numbers" in refused(capsys, "--max-num-queued-tokens", "1.5K")
    assert "not a token count" in refused(capsys, "--max-num-queued-tokens", "-1")
    assert args("--sse-keep-alive-interval", "15").sse_keep_alive_interval == 15
    assert "must be a non-negative integer" in refused(capsys, "--sse-keep-alive-interval", "-1")


def test_access_log_paths_and_ssl_ciphers_need_tls(tmp_path, capsys):
    ns = args("--disable-access-log-for-endpoints", "/health, /metrics,,/ping")
    assert ns.disable_access_log_for_endpoints == "/health, /metrics,,/ping"  # split by `serve` (ServerOptions)
    assert cli.serve(args("--ssl-ciphers", "ECDHE-RSA-AES256-GCM-SHA384", "--port", "0")) == 1
    assert "--ssl-ciphers needs --ssl-certfile" in capsys.readouterr().err

    from ferrox.entrypoints.openai.server import ssl_context

    from tests.server.test_launch_flags import _self_signed

    cert, key = _self_signed(tmp_path)
    context = ssl_context(str(cert), str(key), ciphers="ECDHE-RSA-AES256-GCM-SHA384")
    assert {c["name"] for c in context.get_ciphers() if c["protocol"] != "TLSv1.3"} == {"ECDHE-RSA-AES256-GCM-SHA384"}
    with pytest.raises(ValueError, match="--ssl-ciphers: no cipher suite matches 'NO-SUCH-CIPHER'"):
        ssl_context(str(cert), str(key), ciphers="NO-SUCH-CIPHER")


def _output(text: str, ids: list[int], finished: bool) -> RequestOutput:
    choice = CompletionOutput(0, text, ids, None, None, "length" if finished else None)
    return RequestOutput("r1", "p", [1], None, [choice], finished)


@pytest.mark.parametrize("log_deltas", [True, False])
def test_log_deltas(caplog, log_deltas):
    """--enable-log-deltas (vLLM's default): each streamed delta gets a line before the whole answer's;
    --disable-log-deltas: only the whole answer, once. Outputs that are not deltas log only the answer."""
    log = OutputLog(max_log_len=None, log_deltas=log_deltas)
    with caplog.at_level(logging.INFO, logger="ferrox.requests"):
        log.observe(_output("Hello", [5], False), delta=True)
        log.observe(_output(" world", [6], True), delta=True)
        log.observe(RequestOutput("r2", "p", [1], None, [CompletionOutput(0, "Hi", [7], None, None, "stop")], True),
                    delta=False)
    lines = [r.getMessage() for r in caplog.records]
    deltas = [line for line in lines if "(streaming delta)" in line]
    assert deltas == (['response r1 (streaming delta): choice 0: "Hello"; output_token_ids: [5]',
                       'response r1 (streaming delta): choice 0: " world"; output_token_ids: [6]'] if log_deltas else [])
    assert 'response r1: choice 0, finish_reason length, 2 tokens: "Hello world"; output_token_ids: [5, 6]' in lines
    assert len([line for line in lines if line.startswith("response r2")]) == 1
