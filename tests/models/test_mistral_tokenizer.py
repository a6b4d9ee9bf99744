"""tokenizer_mode "mistral" (loader/mistral_tokenizer.py, loader/tekken.py) against mistral_common itself:
the tokenizers.Tokenizer the Rust core gets has tekken's ids and bytes, text and chats encode to the ids
mistral_common gives, decoding follows vLLM's MistralTokenizer, and an engine answers a chat with them."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest

pytest.importorskip("mistral_common")

from ferrox.errors import ChatTemplateError, ModelLoadError, ModelNotFoundError  # noqa: E402
from ferrox.loader.mistral_tokenizer import MISTRAL_CHAT_TEMPLATE, MistralTokenizer  # noqa: E402
from ferrox.loader.source import ModelSource, resolve_model  # noqa: E402
from ferrox.loader.tokenizer import load_tokenizer  # noqa: E402
from mistral_common.protocol.instruct.request import ChatCompletionRequest  # noqa: E402
from mistral_common.protocol.instruct.validator import ValidationMode  # noqa: E402
from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy  # noqa: E402
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer as MistralCommon  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from tests.helpers.tiny_tekken import real_tekken_path, write_tekken  # noqa: E402

TEXTS = [
    "Hello world!", "  leading spaces\tand\ttabs\n\n\nnewlines  ", "12345 67890 3.14159 1e10 -0.5",
    "naïve café — “quotes” 日本語のテキスト 中文 한국어 Москва", "emoji 😀👍🏽👨‍👩‍👧 flags 🇫🇷",
    "def f(x):\n    return x**2  # comment\n", "Ümlaut ÄÖÜ straße", "[INST] not special [/INST] <s></s> [TOOL_CALLS]",
    "\u200b\u00a0 odd spaces \r\n\r\n", "ALLCAPS lowercase MiXeD CamelCaseWord snake_case_word",
    "https://example.com/path?q=1&r=2", "a" * 300, "", " ", "\n",
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "Ab3dEf9hI", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "Ab3dEf9hI", "content": "sunny, 24 C"},
    {"role": "assistant", "content": "Sunny, 24 C."},
    {"role": "user", "content": [{"type": "text", "text": "And in"}, {"type": "text", "text": "Köln? 🙂"}]},
]


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz ABCXYZ\n\t\r0123456789.,!?'\"éàüß日本語😀👍-_/\\()[]{}<>@#$%^&*"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 120))) for _ in range(n)]


def _reference(folder) -> MistralCommon:
    return MistralCommon.from_file(os.path.join(folder, "tekken.json"), mode=ValidationMode.test)


def _kept_decode(tekken, ids: list[int]) -> str:
    """vLLM's streamed text for a Mistral tokenizer under skip_special_tokens: special tokens dropped, except
    [TOOL_CALLS], [ARGS], [THINK], [/THINK] (MistralTokenizer.convert_ids_to_tokens)."""
    kept = {tekken.id_to_piece(i) for i in range(tekken.num_special_tokens)} & {
        "[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]"}
    ids = [i for i in ids if i >= tekken.num_special_tokens or tekken.id_to_piece(i) in kept]
    return tekken.decode(ids, SpecialTokenPolicy.KEEP)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tekken_v13")
    write_tekken(folder, version="v13")
    return str(folder), load_tokenizer(resolve_model(str(folder)), "mistral"), _reference(folder)


def test_real_tekken_converts_to_the_same_ids_and_bytes(tmp_path):
    """Mistral-Nemo's whole 131k tekken: the tokenizer.json the Rust core gets encodes and decodes as
    mistral_common does, and ferrox's Tokenizer is mistral_common's."""
    os.symlink(real_tekken_path(), tmp_path / "tekken.json")
    tok = load_tokenizer(ModelSource(str(tmp_path), "hf", "nemo"), "mistral")
    assert isinstance(tok, MistralTokenizer)
    # mistral_common's own tokenizer as the file loads (ferrox's Python side encodes and decodes with it), and
    # the tokenizers.Tokenizer whose JSON the Rust core gets (the JSON round trip: the tiny tekken's tests).
    tekken, hf = tok.mistral.instruct_tokenizer.tokenizer, tok.backend
    assert tok.vocab_size == hf.get_vocab_size() == tekken.n_words == 131072
    specials = [tekken.id_to_piece(i) for i in range(tekken.num_special_tokens)]
    for text in TEXTS + _random_texts(150):
        want = tekken.encode(text, bos=False, eos=False)
        if not any(s in text for s in specials):  # (tokenizer.json matches control tokens in text)
            assert hf.encode(text, add_special_tokens=False).ids == want, text
            assert hf.encode(text).ids == [tekken.bos_id, *want]
        assert tok.encode(text, add_special_tokens=False) == want
        assert tok.encode(text) == [tekken.bos_id, *want]
        assert hf.decode(want) == tok.decode(want) == text
    rng = random.Random(1)
    for _ in range(200):  # random ids: split UTF-8 sequences decode to the same replacement characters
        ids = [rng.randrange(tekken.n_words) for _ in range(rng.randint(1, 12))]
        assert hf.decode(ids, skip_special_tokens=False) == tekken.decode(ids, SpecialTokenPolicy.KEEP)
        assert tok.decode(ids, skip_special_tokens=False) == tekken.decode(ids, SpecialTokenPolicy.KEEP)
        assert tok.decode(ids) == tekken.decode(ids, SpecialTokenPolicy.IGNORE)
        assert hf.decode(ids) == _kept_decode(tekken, ids)  # (the Rust core's skip_special_tokens)


def test_plain_prompts_and_special_tokens(tiny):
    _, tok, ref = tiny
    tekken = ref.instruct_tokenizer.tokenizer
    assert isinstance(tok, MistralTokenizer) and tok.encodes_chats
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (tekken.bos_id, [tekken.eos_id], tekken.pad_id)
    assert tok.vocab_size == tekken.n_words == 1040
    # Text that spells a control token stays text, as mistral_common (and vLLM) encode it.
    text = "[INST] hi </s> [TOOL_CALLS]"
    assert tok.encode(text) == tekken.encode(text, bos=True, eos=False)
    assert tok.encode_batch([text, "x"], add_special_tokens=False) == [
        tekken.encode(text, bos=False, eos=False), tekken.encode("x", bos=False, eos=False)]
    for name in ("[INST]", "[TOOL_CALLS]", "[ARGS]", "[THINK]", "<s>", "</s>", "<SPECIAL_39>"):
        assert tok.token_to_id(name) == tekken.get_special_token(name)
        assert tok.id_to_token(tekken.get_special_token(name)) == name
    with pytest.raises(ValueError, match="text pairs"):
        tok.encode_pairs([("a", "b")])
    hf = HFTokenizer.from_str(tok.to_json_str())
    specials = [tekken.id_to_piece(i) for i in range(tekken.num_special_tokens)]
    for text in TEXTS + _random_texts(60, seed=3):  # the small vocabulary: byte pieces and short merges
        want = tekken.encode(text, bos=False, eos=False)
        if not any(s in text for s in specials):
            assert hf.encode(text, add_special_tokens=False).ids == want, text
        assert hf.decode(want) == tok.decode(want) == text


@pytest.mark.parametrize("version", ["v3", "v7", "v11", "v13"])
def test_chat_encoding_is_mistral_commons(tmp_path, version):
    write_tekken(tmp_path, version=version)
    tok = load_tokenizer(resolve_model(str(tmp_path)), "mistral")
    ref = _reference(tmp_path)
    want = ref.encode_chat_completion(ChatCompletionRequest.from_openai(CONVERSATION, tools=TOOLS)).tokens
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS)
    assert tok.encode(text, add_special_tokens=False) == want  # the rendered chat's own ids
    assert text == ref.decode(want, SpecialTokenPolicy.KEEP)
    assert tok.encode_chat(CONVERSATION, tools=TOOLS) == want
    assert "get_weather" in text and text.startswith("<s>") and "[AVAILABLE_TOOLS]" in text
    # The same text as a plain prompt is text: its control-token spellings are not control tokens.
    assert tok.encode(str(text.encode().decode()), add_special_tokens=False) != want
    # An assistant prefix to continue: no </s> after it.
    prefix = [*CONVERSATION[:2], {"role": "assistant", "content": "It is"}]
    cont = tok.encode_chat(prefix, add_generation_prompt=False, continue_final_message=True)
    assert cont == ref.encode_chat_completion(
        ChatCompletionRequest.from_openai(prefix, continue_final_message=True)).tokens
    assert ref.decode(cont, SpecialTokenPolicy.KEEP).endswith("It is")


def test_openai_requests_are_adapted_as_vllm_does(tiny):
    _, tok, ref = tiny
    # OpenAI's long call ids keep their last 9 characters; `strict` and a missing description are fine.
    long_id = "call_0123456789abcdef"
    conv = json.loads(json.dumps(CONVERSATION).replace("Ab3dEf9hI", long_id))
    tools = [{"type": "function", "function": {"name": "get_weather", "strict": True,
                                               "parameters": TOOLS[0]["function"]["parameters"]}}]
    want = ref.encode_chat_completion(ChatCompletionRequest.from_openai(
        json.loads(json.dumps(CONVERSATION).replace("Ab3dEf9hI", long_id[-9:])),
        tools=[{"type": "function", "function": {"name": "get_weather", "description": "",
                                                 "parameters": TOOLS[0]["function"]["parameters"]}}])).tokens
    assert tok.encode_chat(conv, tools=tools) == want
    # The server's reasoning_effort (ignored before v15 tokenizers, as vLLM) and the enable_thinking it implies.
    plain = tok.encode_chat(CONVERSATION[:2])
    assert tok.encode_chat(CONVERSATION[:2], reasoning_effort="high", enable_thinking=True) == plain


def test_chat_refusals_name_the_cause(tiny):
    _, tok, _ = tiny
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(user, chat_template="{{ messages }}")
    with pytest.raises(ChatTemplateError, match=r"chat_template_kwargs \['enable_thinking'\]"):
        tok.apply_chat_template(user, enable_thinking=False)
    with pytest.raises(ChatTemplateError, match="continue_final_message"):
        tok.apply_chat_template([*user, {"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    with pytest.raises(ChatTemplateError, match="function tools only"):
        tok.apply_chat_template(user, tools=[{"type": "code_interpreter"}])
    with pytest.raises(ChatTemplateError, match="mistral_common"):  # its own validation: a role it lacks
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    assert tok.get_chat_template() == tok.get_chat_template(MISTRAL_CHAT_TEMPLATE) == MISTRAL_CHAT_TEMPLATE
    assert tok.chat_template is None  # (no Jinja template to report)


def test_tool_calls_survive_the_core_detokenizer(tiny):
    """The Rust core's tokenizer keeps [TOOL_CALLS] / [ARGS] in the text even under skip_special_tokens (as
    vLLM's Mistral detokenizer), and the mistral tool parser reads the v11+ call format from it."""
    from ferrox.entrypoints.openai.tool_parsers import default_tool_parser, get_tool_parser
    from ferrox.structured.tools import prepare_tool_messages, template_supports_tools

    _, tok, ref = tiny
    tekken = ref.instruct_tokenizer.tokenizer
    call = [tekken.get_special_token("[TOOL_CALLS]"), *tekken.encode("get_weather", False, False),
            tekken.get_special_token("[ARGS]"), *tekken.encode('{"city": "Paris"}', False, False), tekken.eos_id]
    hf = HFTokenizer.from_str(tok.to_json_str())
    for skip in (True, False):
        text = hf.decode(call[:-1], skip_special_tokens=skip)
        assert text == '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
        result = get_tool_parser("mistral")(tools=TOOLS).extract(text)
        assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert hf.decode(call, skip_special_tokens=True).endswith("}")  # </s> dropped
    # The template text that steers the tool machinery: tools stay for mistral_common, the parser is mistral's.
    template = tok.get_chat_template(None, TOOLS)
    assert template_supports_tools(template) and default_tool_parser(template) == "mistral"
    assert prepare_tool_messages(CONVERSATION, TOOLS, template) == (CONVERSATION, TOOLS)


def test_llguidance_reads_the_converted_tokenizer(tiny):
    """Structured outputs build llguidance's tokenizer from the same JSON: a JSON-schema matcher takes the ids
    mistral_common encodes, and llguidance tokenizes text (a control token's spelling too) as mistral_common."""
    from ferrox.structured.backend import compile_matcher, get_tokenizer, json_schema_grammar

    _, tok, _ = tiny
    guidance = get_tokenizer(tok.to_json_str(), tok.vocab_size, tok.eos_token_ids)
    matcher = compile_matcher(guidance, json_schema_grammar({"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}))
    ids = tok.encode('{"city": "Paris [TOOL_CALLS] é"}', add_special_tokens=False)
    assert all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()
    assert guidance.tokenize_str("[TOOL_CALLS]x [INST]") == tok.encode("[TOOL_CALLS]x [INST]", False)


def test_server_render_continues_the_final_message(tiny):
    """entrypoints/openai/serving.render_chat with a Mistral tokenizer: continue_final_message reaches
    mistral_common, and encoding the rendered text gives its ids."""
    from types import SimpleNamespace

    from ferrox.entrypoints.openai.serving import render_chat

    _, tok, ref = tiny
    ctx = SimpleNamespace(engine=SimpleNamespace(tokenizer=tok, chat_template=None), reasoning=None,
                          options=SimpleNamespace(chat_template_content_format="auto"),
                          template_kwargs=lambda kwargs: dict(kwargs or {}))
    prefix = [*CONVERSATION[:2], {"role": "assistant", "content": "It is"}]
    text = render_chat(ctx, prefix, add_generation_prompt=False, continue_final_message=True)
    want = ref.encode_chat_completion(ChatCompletionRequest.from_openai(prefix, continue_final_message=True)).tokens
    assert tok.encode(text, add_special_tokens=False) == want


def test_parsers_markers_need_no_special_tokens_kept(tiny):
    """With tokenizer_mode mistral the [TOOL_CALLS] / [THINK] markers stay in decoded text, so the mistral tool and
    reasoning parsers do not turn skip_special_tokens off (vLLM's leave a Mistral tokenizer's request alone):
    <s> and </s> stay out of replies. A Hugging Face tokenizer still needs them kept."""
    from types import SimpleNamespace

    from ferrox.entrypoints.openai.serving import ServingContext

    _, tok, _ = tiny
    from ferrox.loader.tokenizer import Tokenizer

    hf = Tokenizer(tok.backend, name="hf", special_tokens={}, eos_token_ids=[2])  # (the same vocabulary, read as HF)
    for tokenizer, kept in ((tok, False), (hf, True)):
        engine = SimpleNamespace(tokenizer=tokenizer, model_name="m", config=SimpleNamespace(reasoning_parser="mistral"))
        ctx = ServingContext(engine)  # type: ignore[arg-type]
        assert ctx.reasoning_needs_special_tokens
        assert ctx.keeps_special_tokens(True) is kept and ctx.keeps_special_tokens(False) is kept


def test_auto_mode_follows_vllm(tmp_path):
    from tests.helpers.tiny_models import build_tokenizer

    nemo = tmp_path / "nemo"  # Mistral's layout: auto picks mistral_common, even beside a tokenizer.json
    write_tekken(nemo)
    (nemo / "consolidated.safetensors").write_bytes(b"")
    build_tokenizer().save(str(nemo / "tokenizer.json"))
    assert isinstance(load_tokenizer(resolve_model(str(nemo))), MistralTokenizer)
    assert not isinstance(load_tokenizer(resolve_model(str(nemo)), "hf"), MistralTokenizer)
    os.remove(nemo / "consolidated.safetensors")  # an HF repo with both files: the tokenizer.json
    assert not isinstance(load_tokenizer(resolve_model(str(nemo))), MistralTokenizer)
    os.remove(nemo / "tokenizer.json")  # tekken.json alone: nothing else to read
    assert isinstance(load_tokenizer(resolve_model(str(nemo))), MistralTokenizer)
    with pytest.raises(ModelNotFoundError, match="tokenizer_mode 'mistral'"):
        load_tokenizer(resolve_model(str(nemo)), "hf")


def test_load_errors_name_the_file_or_package(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="no tekken.json"):
        load_tokenizer(resolve_model(str(empty)), "mistral")
    (empty / "tokenizer.model.v3").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="sentencepiece tokenizer tokenizer.model.v3"):
        load_tokenizer(resolve_model(str(empty)), "mistral")
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_tokenizer(ModelSource(str(tmp_path / "m.gguf"), "gguf", "m"), "mistral")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tekken.json").write_text('{"config": {"version": "v99"}}')
    with pytest.raises(ModelLoadError, match="tekken.json"):
        load_tokenizer(resolve_model(str(bad)), "mistral")
    write_tekken(bad)
    monkeypatch.setitem(sys.modules, "mistral_common.tokens.tokenizers.mistral", None)
    with pytest.raises(ModelLoadError, match="pip install 'mistral-common"):
        load_tokenizer(resolve_model(str(bad)), "mistral")


def test_config_takes_mode_mistral_and_refuses_a_chat_template():
    from ferrox.config import EngineConfig

    assert EngineConfig(tokenizer_mode="mistral").tokenizer_mode == "mistral"
    with pytest.raises(ValueError, match="chat_template: tokenizer_mode 'mistral'"):
        EngineConfig(tokenizer_mode="mistral", chat_template="{{ x }}")
    with pytest.raises(ValueError, match="tokenizer_mode"):
        EngineConfig(tokenizer_mode="slow")


def test_engine_answers_a_chat_with_mistral_commons_tokens(tmp_path):
    """LLM.chat end to end on a tiny random Llama whose vocabulary is a tekken: the prompt is mistral_common's
    chat encoding and the incrementally detokenized text is vLLM's decode of the generated ids."""
    from ferrox import LLM, SamplingParams

    write_tekken(tmp_path)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 1040, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ref = _reference(tmp_path)
    tekken = ref.instruct_tokenizer.tokenizer
    llm = LLM(str(tmp_path), tokenizer_mode="mistral", load_format="dummy", dtype="float32", seed=3,
              kv_cache_memory=16 << 20, max_model_len=512, max_num_seqs=4)
    conv = CONVERSATION[:2]
    want_prompt = ref.encode_chat_completion(ChatCompletionRequest.from_openai(conv)).tokens
    for skip in (True, False):
        params = SamplingParams(temperature=1.0, seed=7, max_tokens=48, ignore_eos=True, skip_special_tokens=skip)
        (out,) = llm.chat(conv, params, use_tqdm=False)
        ids = list(out.outputs[0].token_ids)
        assert out.prompt_token_ids == want_prompt and len(ids) == 48
        # (seed 7 samples control tokens and the bytes of split UTF-8 characters: both decode rules show)
        assert any(i < tekken.num_special_tokens for i in ids) and any(tekken.is_byte(i) for i in ids)
        want = _kept_decode(tekken, ids) if skip else tekken.decode(ids, SpecialTokenPolicy.KEEP)
        assert out.outputs[0].text == want
    assert llm.get_tokenizer().eos_token_ids == [tekken.eos_id]
