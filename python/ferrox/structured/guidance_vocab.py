"""The tokenizer.json that llguidance reads, rewritten so that its view of tokens matches the engine's.

llguidance builds its token trie from a tokenizer.json and tokenizes a grammar's forced text (a literal
the grammar leaves no choice about) with the same Hugging Face tokenizer. Two mismatches follow, both of
which fail a request: the mask allows a token the matcher then rejects.

1. Added tokens meant as text (Qwen's `<tool_call>` / `<think>`, DeepSeek-R1's `<think>`: `special` false,
   decoding keeps them) are special to llguidance, which treats every `added_tokens` entry as a special
   token that no text matches. Forced text `<tool_call>` tokenizes to that token, which is then refused.
   They move into the model's vocabulary, where their bytes are text.
2. Special tokens (`<|im_start|>`, Kimi's `<|tool_calls_section_begin|>`, Llama 3's `<|python_tag|>`) must
   stay special: a model samples them only where a grammar names them (Lark's `<|name|>` / `<[id]>`) and
   decoding drops them, so as text they would make output that breaks its own grammar. But the Hugging
   Face tokenizer splits their text out of *any* input, so forced text that spells one (a regex
   `x<\\|im_start\\|>y`, a structural tag begun by Kimi's marker) is forced as the special token, which
   the grammar's text then refuses. Their names get a prefix no text contains, so the text tokenizes as
   text (as llguidance's own design intends: bytes are special only behind its 0xFF marker); grammars that
   name a special token are rewritten to its id (`special_tokens_by_id`).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

# Put before each special token's name in llguidance's copy of the tokenizer: U+FFFF is a Unicode
# noncharacter, which no prompt, regex literal or JSON string a grammar forces will contain.
SPECIAL_NAME_PREFIX = "\uffff"


def guidance_tokenizer_json(tokenizer_json: str) -> tuple[str, dict[str, int]]:
    """The tokenizer.json text for llguidance (see the module doc), and the special tokens' names -> ids."""
    data = json.loads(tokenizer_json)
    added = data.get("added_tokens") or []
    model = data.get("model") or {}
    vocab: Any = model.get("vocab")
    special = {t["content"]: int(t["id"]) for t in added if t.get("special", True)}
    if not added:
        return tokenizer_json, special
    spell = _vocab_spelling(data) if model.get("type") == "BPE" and isinstance(vocab, dict) else None
    kept = []
    for token in added:
        if token.get("special", True):
            _rename_special(token, vocab)
            kept.append(token)
            continue
        piece = spell(token["content"]) if spell is not None else None
        if piece is None or vocab.get(piece, token["id"]) != token["id"]:
            kept.append(token)
            continue
        vocab[piece] = token["id"]
    data["added_tokens"] = kept
    return json.dumps(data, ensure_ascii=False), special


def _rename_special(token: dict[str, Any], vocab: Any) -> None:
    """Prefix a special token's name, in the added tokens and where the vocabulary spells it too (a
    GGUF-built tokenizer lists `<|im_start|>` in both), so the tokenizer no longer finds it in text."""
    name, renamed = token["content"], SPECIAL_NAME_PREFIX + token["content"]
    if isinstance(vocab, dict) and vocab.get(name) == token["id"]:
        del vocab[name]
        vocab[renamed] = token["id"]
    elif isinstance(vocab, list) and 0 <= token["id"] < len(vocab) and isinstance(vocab[token["id"]], list) \
            and vocab[token["id"]][0] == name:  # a Unigram vocabulary: [piece, score] by id
        vocab[token["id"]][0] = renamed
    token["content"] = renamed
    token["normalized"] = False


# Lark as llguidance lexes it: comments, JSON-syntax strings, /regexes/, `%json {...}`-style payloads
# (JSON, skipped whole by json.JSONDecoder), and special tokens `<...>`; anything else one character.
_LARK_SKIP = re.compile(r'(?:#|//)[^\n]*|"(?:\\.|[^"\\\n])*"i?|/(?:\\.|[^/\\])+/[imslux]*')
_LARK_PAYLOAD = re.compile(r"%(?:json|regex|llguidance)\s*")
_LARK_SPECIAL = re.compile(r"<[^<>\s]+>")


def special_tokens_by_id(lark: str, special: dict[str, int]) -> str:
    """The Lark grammar with every special-token reference by name (`<|im_end|>`) written by id
    (`<[2]>`), which llguidance resolves whatever the token is called in its copy of the tokenizer.
    Names that are not special tokens are left for llguidance to refuse with its own message."""
    if "<" not in lark or not special:
        return lark
    out, i, decoder = [], 0, json.JSONDecoder()
    while i < len(lark):
        if m := _LARK_SKIP.match(lark, i):
            out.append(m.group())
            i = m.end()
        elif m := _LARK_PAYLOAD.match(lark, i):
            try:
                _, end = decoder.raw_decode(lark, m.end())
            except json.JSONDecodeError:
                end = m.end()  # malformed: llguidance reports it
            out.append(lark[i:end])
            i = end
        elif (m := _LARK_SPECIAL.match(lark, i)) and m.group() in special:
            out.append(f"<[{special[m.group()]}]>")
            i = m.end()
        else:
            out.append(lark[i])
            i += 1
    return "".join(out)


def grammar_with_special_ids(grammar: str, special: dict[str, int]) -> str:
    """An llguidance grammar (Lark text, or a JSON envelope {"grammars": [...]}) with its Lark parts'
    special-token names written by id; JSON-schema and regex parts have no such references."""
    if "<" not in grammar or not special:
        return grammar
    if not grammar.lstrip().startswith("{"):
        return special_tokens_by_id(grammar, special)
    envelope = json.loads(grammar)
    changed = False
    for part in envelope.get("grammars") or []:
        lark = part.get("lark_grammar")
        if isinstance(lark, str):
            rewritten = special_tokens_by_id(lark, special)
            changed |= rewritten != lark
            part["lark_grammar"] = rewritten
    return json.dumps(envelope, ensure_ascii=False) if changed else grammar


def _vocab_spelling(data: dict[str, Any]) -> Any:
    """How the vocabulary spells a text: GPT-2's byte-to-character map for a byte-level BPE, U+2581
    for spaces for a sentencepiece-style one; None for another alphabet."""
    def kinds(part: Any) -> list[str]:
        if not isinstance(part, dict):
            return []
        inner = part.get("decoders") or part.get("pretokenizers") or []
        return [str(part.get("type"))] + [k for p in inner for k in kinds(p)]

    found = set(kinds(data.get("decoder"))) | set(kinds(data.get("pre_tokenizer")))
    if "ByteLevel" in found:
        table = _byte_level_table()
        return lambda text: "".join(table[b] for b in text.encode("utf-8"))
    if "Metaspace" in found or "Replace" in found:
        return lambda text: text.replace(" ", "\u2581")
    return None


@functools.lru_cache(maxsize=1)
def _byte_level_table() -> list[str]:
    """GPT-2's bytes_to_unicode: printable bytes stand for themselves, the other 68 map to U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = [""] * 256
    extra = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table
