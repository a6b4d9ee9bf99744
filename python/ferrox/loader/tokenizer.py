"""Tokenizer: a thin wrapper over the `tokenizers` package plus what serving needs around it
(special-token ids, all EOS ids, the chat template).

HF folder: tokenizer.json (+ tokenizer_config.json, special_tokens_map.json, chat_template.jinja,
generation_config.json, config.json for EOS ids). GGUF: rebuilt from metadata (gguf_tokenizer.py).
tokenizer_mode "mistral": Mistral's tekken.json through mistral_common (mistral_tokenizer.py).
`to_json_str()` is handed to the Rust core, which detokenizes with the same `tokenizers` model.

This module must not import torch (directly or through model_config): the API server process
loads only the tokenizer, and torch would add seconds to its start-up for nothing.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from ferrox.config_fields import to_int
from ferrox.loader.chat_template import render_chat_template
from ferrox.loader.errors import ChatTemplateError, ModelLoadError, ModelNotFoundError
from ferrox.loader.json_file import read_json
from ferrox.loader.source import ModelSource

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    # True where the tokenizer's own library encodes chats (tokenizer_mode mistral): apply_chat_template then
    # takes continue_final_message itself, and encode() of the text it returns gives the chat's own ids.
    encodes_chats = False
    # True where decoding keeps the tool / reasoning parsers' markers in the text even under skip_special_tokens
    # (tokenizer_mode mistral's [TOOL_CALLS], [THINK]): those parsers then need no skip_special_tokens=False.
    keeps_markers_in_text = False

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        name: str,
        special_tokens: dict[str, str | None],
        eos_token_ids: list[int],
        chat_template: str | dict[str, str] | None = None,
        config: dict[str, Any] | None = None,
    ):
        self._tok = tokenizer
        self.name = name  # the model's name, used in error messages
        # tokenizer_config.json as the folder has it ({} for a GGUF): what vLLM's /tokenizer_info reports.
        self.config: dict[str, Any] = dict(config or {})
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.pad_token = self.special_tokens.get("pad_token")
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.pad_token_id = self.token_to_id(self.pad_token)
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # A model may ship several named templates ({"default": ..., "tool_use": ...}).
        self.chat_templates: dict[str, str] = (
            dict(chat_template) if isinstance(chat_template, dict) else ({"default": chat_template} if chat_template else {})
        )

    # ---- encoding ---------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"prompt must be a str, got {type(text).__name__}")
        # encode_batch releases the GIL while the Rust side works and `encode` does not, so a
        # long prompt tokenized in the server's prompt threads leaves the event loop running
        # (the ids are the same; a one-item batch costs ~3 us more).
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def encode_pairs(self, pairs: list[tuple[str, str]], add_special_tokens: bool = True, *,
                     join_texts: bool = False) -> list[tuple[list[int], int | None]]:
        """Each (first, second) text pair as ONE sequence, the tokenizer's pair encoding (its post-processor:
        `[CLS] a [SEP] b [SEP]` for BERT, `<s> a </s></s> b </s>` for RoBERTa, `<bos> a <bos> b` for a Llama
        3 tokenizer, the two token runs back to back for Qwen's, which adds no special tokens), as
        transformers' tokenizer(text, text_pair) gives it to a cross-encoder: (token ids, where token type 1
        starts, None when every type is 0). The types are a run of 0s then a run of 1s in every post-processor
        the tokenizers library has for pairs, so one index carries them (vLLM compresses them alike).
        join_texts: the string a + b encoded as one text instead (vLLM's rule for a model whose config.json
        sets use_pad_token false); it has no token types."""
        out: list[tuple[list[int], int | None]] = []
        for a, b in pairs:
            if not isinstance(a, str) or not isinstance(b, str):
                raise TypeError(f"a text pair must be two str, got ({type(a).__name__}, {type(b).__name__})")
        if join_texts:
            return [(ids, None) for ids in self.encode_batch([a + b for a, b in pairs], add_special_tokens)]
        for enc in self._tok.encode_batch(list(pairs), add_special_tokens=add_special_tokens):
            types = enc.type_ids
            start = next((i for i, t in enumerate(types) if t != 0), None)
            if start is not None and any(t != 1 for t in types[start:]):
                raise ValueError(f"tokenizer of {self.name}: its pair encoding's token types {sorted(set(types))} "
                                 "are not a run of 0s then a run of 1s, which ferrox cannot carry")
            out.append((enc.ids, start))
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def to_json_str(self) -> str:
        return self._tok.to_str()

    @property
    def backend(self) -> HFTokenizer:
        """The underlying tokenizers.Tokenizer (for llguidance and tools that want it)."""
        return self._tok

    # ---- chat -------------------------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    def get_chat_template(self, chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        """The template to use: an explicit template string or name, else "tool_use" when tools are
        given and the model has one, else the default."""
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if self.chat_templates:
            raise ChatTemplateError(f"model {self.name} has several chat templates and no default: pass one of "
                                    f"{sorted(self.chat_templates)} as chat_template")
        raise ChatTemplateError(f"model {self.name} has no chat template; pass chat_template=... (a jinja2 string) "
                                "or use plain prompts")

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, chat_template: str | None = None,
                            content_format: str = "auto", **template_kwargs: Any) -> str:
        """content_format: how message contents reach the template ("auto", "string", "openai";
        loader/chat_template.py)."""
        template = self.get_chat_template(chat_template, tools)
        return render_chat_template(template, messages, template_name=self.name,
                                    add_generation_prompt=add_generation_prompt, tools=tools,
                                    special_tokens=self.special_tokens, content_format=content_format,
                                    **template_kwargs)


def load_tokenizer(source: ModelSource, mode: str = "auto") -> Tokenizer:
    """mode: vLLM's tokenizer_mode. "hf": tokenizer.json (or a GGUF's vocabulary); "mistral": tekken.json through
    mistral_common (loader/mistral_tokenizer.py); "auto": "mistral" for a folder in Mistral's layout, else "hf"."""
    if mode == "mistral" or (mode == "auto" and source.format == "hf" and _prefers_mistral(source.path)):
        from ferrox.loader.mistral_tokenizer import load_mistral_tokenizer

        return load_mistral_tokenizer(source)
    if source.format == "gguf":
        return _load_gguf_tokenizer(source)
    return _load_hf_tokenizer(source)


def _prefers_mistral(folder: str) -> bool:
    if not os.path.isfile(os.path.join(folder, "tekken.json")):  # (the common case, without importing the module)
        return False
    from ferrox.loader.mistral_tokenizer import prefers_mistral_tokenizer

    return prefers_mistral_tokenizer(folder)


def _load_gguf_tokenizer(source: ModelSource) -> Tokenizer:
    from ferrox.loader.gguf_file import open_gguf
    from ferrox.loader.gguf_tokenizer import build_gguf_tokenizer

    gguf = open_gguf(source.path)
    tok = build_gguf_tokenizer(gguf)
    meta = gguf.metadata
    tokens = gguf.array("tokenizer.ggml.tokens") or []

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    specials = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
    eos = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                   "tokenizer.ggml.eom_token_id") if k in meta]
    template = meta.get("tokenizer.chat_template")
    return Tokenizer(tok, name=source.name, special_tokens=specials, eos_token_ids=eos, chat_template=template)


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _load_hf_tokenizer(source: ModelSource) -> Tokenizer:
    folder = source.path
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        hint = ("; it has Mistral's tekken.json: use tokenizer_mode 'mistral'"
                if os.path.isfile(os.path.join(folder, "tekken.json")) else "")
        raise ModelNotFoundError(f"model folder {folder} has no tokenizer.json (ferrox needs the fast-tokenizer "
                                 f"file; convert a slow tokenizer with transformers' save_pretrained){hint}")
    try:
        tok = HFTokenizer.from_file(path)
    except Exception as e:
        raise ModelLoadError(f"cannot parse {path}: {e}") from e
    # A tokenizer.json may keep its training-time padding and truncation (all-MiniLM-L6-v2's pads
    # every encoding to 128 [PAD]s and cuts at 128). `tokenizers` applies them on every encode;
    # transformers' fast tokenizer does not unless asked. A prompt must be its real tokens and never
    # be cut silently (one too long is refused, naming it), so both are off, as in transformers.
    if tok.padding is not None:
        tok.no_padding()
    if tok.truncation is not None:
        tok.no_truncation()

    def optional_json(name: str) -> dict[str, Any]:
        p = os.path.join(folder, name)
        return read_json(p) if os.path.isfile(p) else {}

    tok_config = optional_json("tokenizer_config.json")
    special_map = optional_json("special_tokens_map.json")
    specials = {n: _token_content(tok_config.get(n)) or _token_content(special_map.get(n)) for n in _SPECIAL_NAMES}

    template = _chat_template(tok_config.get("chat_template"), os.path.join(folder, "tokenizer_config.json"))
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):  # transformers >= 4.49 saves the template beside the config
        try:
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"cannot read {jinja_path}: {e}") from e
    elif not template:
        template = _chat_template(optional_json("chat_template.json").get("chat_template"),
                                  os.path.join(folder, "chat_template.json"))

    _apply_bos_eos_flags(tok, tok_config, specials)

    eos: list[int] = []
    for name in ("generation_config.json", "config.json"):
        eos.extend(_eos_token_ids(optional_json(name).get("eos_token_id"), os.path.join(folder, name)))
    eos_token_id = tok.token_to_id(specials["eos_token"]) if specials["eos_token"] else None
    if eos_token_id is not None:
        eos.insert(0, eos_token_id)
    return Tokenizer(tok, name=source.name, special_tokens=specials, eos_token_ids=eos, chat_template=template,
                     config=tok_config)


def _chat_template(value: Any, path: str) -> str | dict[str, str] | None:
    """tokenizer_config.json's chat_template: one template, or a list of named ones
    ([{"name": "default", "template": "..."}, ...]); transformers fails on any other shape too."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ModelLoadError(f"{path}: chat_template must be a string or a list of {{\"name\": ..., \"template\": ...}} "
                         f"objects, got {json.dumps(value)[:200]}")


def _eos_token_ids(value: Any, path: str) -> list[int]:
    """eos_token_id of generation_config.json / config.json: a token id, a list of them, or null."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    return [to_int(v, f"{path}: eos_token_id", minimum=0) for v in values]


def _apply_bos_eos_flags(tok: HFTokenizer, tok_config: dict[str, Any], specials: dict[str, str | None]) -> None:
    """Honour explicit add_bos_token / add_eos_token of tokenizer_config.json when tokenizer.json's
    post-processor disagrees (transformers rebuilds the post-processor from these flags)."""
    from tokenizers import processors

    want_bos, want_eos = tok_config.get("add_bos_token"), tok_config.get("add_eos_token")
    if want_bos is None and want_eos is None:
        return
    probe = tok.encode("a", add_special_tokens=True).ids
    bos_id = tok.token_to_id(specials["bos_token"]) if specials["bos_token"] else None
    eos_id = tok.token_to_id(specials["eos_token"]) if specials["eos_token"] else None
    has_bos = bos_id is not None and probe[:1] == [bos_id]
    has_eos = eos_id is not None and probe[-1:] == [eos_id]
    bos = has_bos if want_bos is None else bool(want_bos) and bos_id is not None
    eos = has_eos if want_eos is None else bool(want_eos) and eos_id is not None
    if (bos, eos) == (has_bos, has_eos):
        return
    single, pair, special = ["$A:0"], ["$B:1"], []
    if bos:
        single.insert(0, f"{specials['bos_token']}:0")
        pair.insert(0, f"{specials['bos_token']}:1")
        special.append((specials["bos_token"], bos_id))
    if eos:
        single.append(f"{specials['eos_token']}:0")
        pair.append(f"{specials['eos_token']}:1")
        special.append((specials["eos_token"], eos_id))
    # The pair template as transformers builds it with the same flags (a cross-encoder's pair prompt): each
    # text with its own specials, the second typed 1.
    tok.post_processor = processors.TemplateProcessing(single=" ".join(single), pair=" ".join(single + pair),
                                                       special_tokens=special)
