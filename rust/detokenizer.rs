//! Incremental detokenizer with stop-string detection.
//!
//! One `TokenizerInfo` is built per tokenizer.json and shared (Arc) by every request. When the
//! tokenizer's decoder is ByteLevel (GPT-2 style: SmolLM2, Llama 3, Qwen) it precomputes a
//! token id -> bytes table, so decoding a token is a table lookup plus UTF-8 validation of the
//! new bytes: O(1) amortized per token. Other decoders fall back to the tokenizers crate's
//! own streaming decoder (`step_decode_stream`), which re-decodes a short window of ids.
//!
//! Per request, `IncrementalDetokenizer` keeps the text decoded so far and how much of it has
//! been emitted. Text is held back when it ends in an incomplete UTF-8 sequence or in a prefix
//! of some stop string, so a streamed delta never splits a character and never contains text
//! that a later stop-string match would trim.

use std::sync::Arc;

use tokenizers::{DecoderWrapper, Tokenizer};

use crate::error::{CoreError, CoreResult};

/// What the scheduler needs from a tokenizer, built once and shared across requests.
pub struct TokenizerInfo {
    vocab_size: usize,
    kind: DecodeKind,
}

enum DecodeKind {
    Table(TokenTable),
    /// Any other decoder: the crate's streaming decoder over the full tokenizer.
    Stream(Box<Tokenizer>),
}

/// Which decoder family a token table reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TableStyle {
    /// GPT-2 byte level: every token is bytes; invalid UTF-8 decodes like
    /// `String::from_utf8_lossy` over the whole output.
    ByteLevel,
    /// SentencePiece ("▁" for a space), optionally with byte fallback (`<0xNN>` tokens are raw
    /// bytes, and a run of them that is not valid UTF-8 gives one U+FFFD per byte).
    SentencePiece { byte_fallback: bool },
}

/// Flat token -> bytes table: bytes of token `i` are `bytes[offsets[i]..offsets[i + 1]]`.
struct TokenTable {
    style: TableStyle,
    bytes: Vec<u8>,
    offsets: Vec<u32>,
    special: Vec<bool>,
    /// SentencePiece with byte fallback: token `i` is a `<0xNN>` byte piece.
    is_byte_piece: Vec<bool>,
    /// The decoder drops one leading space of the whole text (SentencePiece's prepended space).
    strip_first_space: bool,
}

impl TokenTable {
    fn token_bytes(&self, id: usize) -> &[u8] {
        &self.bytes[self.offsets[id] as usize..self.offsets[id + 1] as usize]
    }
}

/// GPT-2's reversible byte <-> printable-char mapping, as char -> byte.
fn gpt2_char_to_byte() -> std::collections::HashMap<char, u8> {
    let mut map = std::collections::HashMap::with_capacity(256);
    let mut n = 0u32;
    for b in 0u32..256 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            char::from_u32(b).unwrap()
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap()
        };
        map.insert(c, b as u8);
    }
    map
}

/// Recognises the decoders a table reproduces exactly, from their serialized configuration:
/// ByteLevel; Metaspace; and the Llama 2 / Mistral chain
/// Sequence[Replace("▁", " "), ByteFallback, Fuse, (Strip(" ", 1, 0))].
/// Returns the style, the space replacement char, and whether a first space is stripped.
fn table_style(decoder: &DecoderWrapper) -> Option<(TableStyle, char, bool)> {
    let v = serde_json::to_value(decoder).ok()?;
    let ty = |x: &serde_json::Value| x.get("type").and_then(|t| t.as_str()).map(str::to_owned);
    match ty(&v)?.as_str() {
        "ByteLevel" => Some((TableStyle::ByteLevel, ' ', false)),
        "Metaspace" => {
            let repl = v.get("replacement")?.as_str()?.chars().next()?;
            let strip = v.get("prepend_scheme").and_then(|p| p.as_str()) != Some("never");
            Some((
                TableStyle::SentencePiece {
                    byte_fallback: false,
                },
                repl,
                strip,
            ))
        }
        "Sequence" => {
            let steps = v.get("decoders")?.as_array()?;
            let names: Vec<String> = steps.iter().filter_map(ty).collect();
            let replace = &steps.first()?;
            let repl_ok = replace
                .get("pattern")
                .and_then(|p| p.get("String"))
                .and_then(|s| s.as_str())
                == Some("▁")
                && replace.get("content").and_then(|c| c.as_str()) == Some(" ");
            let head_ok = names.len() >= 3 && names[..3] == ["Replace", "ByteFallback", "Fuse"];
            let strip = match steps.get(3) {
                None => false,
                Some(st) if steps.len() == 4 && ty(st).as_deref() == Some("Strip") => {
                    let n = |k: &str| st.get(k).and_then(|x| x.as_u64());
                    if st.get("content").and_then(|c| c.as_str()) != Some(" ")
                        || n("start") != Some(1)
                        || n("stop") != Some(0)
                    {
                        return None;
                    }
                    true
                }
                Some(_) => return None,
            };
            (repl_ok && head_ok).then_some((
                TableStyle::SentencePiece {
                    byte_fallback: true,
                },
                '▁',
                strip,
            ))
        }
        _ => None,
    }
}

impl TokenizerInfo {
    /// Parses the text of a tokenizer.json.
    pub fn from_json(json: &str) -> CoreResult<Self> {
        let tok: Tokenizer = json.parse().map_err(|e| {
            CoreError::Tokenizer(format!("tokenizer_json: cannot parse tokenizer.json: {e}"))
        })?;
        let vocab_size = tok.get_vocab_size(true);
        let Some((style, space, strip_first_space)) = tok.get_decoder().and_then(table_style)
        else {
            return Ok(TokenizerInfo {
                vocab_size,
                kind: DecodeKind::Stream(Box::new(tok)),
            });
        };
        let char_to_byte = gpt2_char_to_byte();
        let added = tok.get_added_tokens_decoder();
        // Ids may have holes; the table covers 0..=max id.
        let max_id = added
            .keys()
            .copied()
            .max()
            .unwrap_or(0)
            .max(vocab_size.saturating_sub(1) as u32);
        let n = max_id as usize + 1;
        let mut bytes = Vec::new();
        let mut offsets = Vec::with_capacity(n + 1);
        let mut special = vec![false; n];
        let mut is_byte_piece = vec![false; n];
        offsets.push(0u32);
        for id in 0..n as u32 {
            if let Some(token) = tok.id_to_token(id) {
                match style {
                    TableStyle::ByteLevel => {
                        // The crate's ByteLevel rule: map every char back to its byte; a token
                        // with any unmapped char (an added token like "\n\n") is its raw UTF-8.
                        let mapped: Option<Vec<u8>> = token
                            .chars()
                            .map(|c| char_to_byte.get(&c).copied())
                            .collect();
                        match mapped {
                            Some(b) => bytes.extend_from_slice(&b),
                            None => bytes.extend_from_slice(token.as_bytes()),
                        }
                    }
                    TableStyle::SentencePiece { byte_fallback } => {
                        let piece = (byte_fallback
                            && token.len() == 6
                            && token.starts_with("<0x")
                            && token.ends_with('>'))
                        .then(|| u8::from_str_radix(&token[3..5], 16).ok())
                        .flatten();
                        match piece {
                            Some(b) => {
                                bytes.push(b);
                                is_byte_piece[id as usize] = true;
                            }
                            None => bytes.extend_from_slice(token.replace(space, " ").as_bytes()),
                        }
                    }
                }
            }
            if let Some(a) = added.get(&id) {
                special[id as usize] = a.special;
            }
            offsets.push(bytes.len() as u32);
        }
        let table = TokenTable {
            style,
            bytes,
            offsets,
            special,
            is_byte_piece,
            strip_first_space,
        };
        Ok(TokenizerInfo {
            vocab_size: n.max(vocab_size),
            kind: DecodeKind::Table(table),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Whether an invalid byte run decodes to one U+FFFD per byte (ByteFallback) rather than
    /// one per invalid sequence (byte-level BPE).
    fn per_byte_replacement(&self) -> bool {
        matches!(&self.kind, DecodeKind::Table(t) if matches!(t.style, TableStyle::SentencePiece { .. }))
    }

    /// True when decoding uses the precomputed byte table (the fast path).
    pub fn uses_byte_table(&self) -> bool {
        matches!(self.kind, DecodeKind::Table(_))
    }
}

/// Bytes of a UTF-8 character still incomplete at the end of the decoded text.
#[derive(Default)]
struct Utf8Tail {
    pending: Vec<u8>,
}

impl Utf8Tail {
    /// Appends raw bytes: complete characters go to `out`, an incomplete tail waits here.
    /// Invalid sequences become U+FFFD: one per maximal invalid sequence (like
    /// `String::from_utf8_lossy`, for byte-level BPE) or one per byte (`per_byte`, like the
    /// ByteFallback decoder).
    fn push(&mut self, out: &mut String, bytes: &[u8], per_byte: bool) {
        if self.pending.is_empty() {
            // Fast path: most tokens are complete UTF-8 on their own.
            if let Ok(s) = std::str::from_utf8(bytes) {
                out.push_str(s);
                return;
            }
        }
        self.pending.extend_from_slice(bytes);
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&rest[..valid]).unwrap());
                    match e.error_len() {
                        Some(bad) => {
                            for _ in 0..if per_byte { bad } else { 1 } {
                                out.push('\u{FFFD}');
                            }
                            rest = &rest[valid + bad..];
                        }
                        None => {
                            rest = &rest[valid..];
                            break;
                        }
                    }
                }
            }
        }
        let consumed = self.pending.len() - rest.len();
        self.pending.drain(..consumed);
    }

    /// An incomplete sequence that can no longer complete (end of stream, or a text piece after
    /// byte pieces) becomes U+FFFD, as a full decode writes it.
    fn end(&mut self, out: &mut String, per_byte: bool) {
        if !self.pending.is_empty() {
            for _ in 0..if per_byte { self.pending.len() } else { 1 } {
                out.push('\u{FFFD}');
            }
            self.pending.clear();
        }
    }
}

/// Prompt tokens replayed into the streaming fallback as context (enough to settle any
/// decoder's look-behind: a leading-space strip, a byte-fallback sequence of up to 4 bytes).
const PRIME_TOKENS: usize = 6;

/// The streaming decoder's window (fallback path), owned by one request.
#[derive(Default)]
struct StreamState {
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

/// Per-request incremental detokenizer and stop-string matcher.
pub struct IncrementalDetokenizer {
    tok: Arc<TokenizerInfo>,
    skip_special_tokens: bool,
    stream: StreamState,
    utf8: Utf8Tail,
    /// All text decoded so far (truncated at a stop string once one fires).
    output: String,
    /// Bytes of `output` already returned as deltas.
    emitted: usize,
    stops: Vec<String>,
    include_stop_str_in_output: bool,
    stopped: bool,
    /// Nothing decoded yet (and no prompt context): a decoder that strips the text's first
    /// space applies it to the next text.
    at_start: bool,
}

/// What one token changed: the text to stream now and the index of the stop string that fired.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct DetokStep {
    pub delta: String,
    pub stop: Option<usize>,
}

impl IncrementalDetokenizer {
    pub fn new(
        tok: Arc<TokenizerInfo>,
        skip_special_tokens: bool,
        stops: Vec<String>,
        include_stop_str_in_output: bool,
    ) -> CoreResult<Self> {
        if let Some(i) = stops.iter().position(|s| s.is_empty()) {
            return Err(CoreError::InvalidArgument(format!(
                "stop[{i}]: stop strings must not be empty"
            )));
        }
        Ok(IncrementalDetokenizer {
            tok,
            skip_special_tokens,
            stream: StreamState::default(),
            utf8: Utf8Tail::default(),
            output: String::new(),
            emitted: 0,
            stops,
            include_stop_str_in_output,
            stopped: false,
            at_start: true,
        })
    }

    /// Gives the streaming fallback the prompt's last tokens as context, so the first generated
    /// token decodes as it would mid-text (SentencePiece-style decoders strip the leading space
    /// of a sequence's first token: "▁Paris" must stream as " Paris" after a prompt). The byte
    /// table needs no context.
    pub fn prime(&mut self, prompt: &[u32]) {
        if !prompt.is_empty() {
            self.at_start = false;
        }
        if let DecodeKind::Stream(tok) = &self.tok.kind {
            let s = &mut self.stream;
            for &id in &prompt[prompt.len().saturating_sub(PRIME_TOKENS)..] {
                let _ = tokenizers::tokenizer::step_decode_stream(
                    tok,
                    vec![id],
                    self.skip_special_tokens,
                    &mut s.ids,
                    &mut s.prefix,
                    &mut s.prefix_index,
                );
            }
        }
    }

    pub fn output_text(&self) -> &str {
        &self.output
    }

    pub fn stop_strings(&self) -> &[String] {
        &self.stops
    }

    /// Feeds one token. `check_stops` is false while min_tokens suppresses stops: no match is
    /// reported, but text that could begin a stop string is still held back, so a stop string
    /// that begins before the min_tokens boundary and completes after it is caught (and
    /// trimmed) like any other. Out-of-vocabulary ids decode to nothing (models often pad their
    /// vocabulary past the tokenizer's).
    pub fn step(&mut self, token_id: u32, check_stops: bool) -> DetokStep {
        if self.stopped {
            return DetokStep::default();
        }
        let new_start = self.output.len();
        self.decode_into_output(token_id);
        if self.stops.is_empty() {
            return DetokStep {
                delta: self.take_delta(self.output.len()),
                stop: None,
            };
        }
        if let Some((idx, start)) = check_stops.then(|| self.find_stop(new_start)).flatten() {
            let end = if self.include_stop_str_in_output {
                start + self.stops[idx].len()
            } else {
                start
            };
            self.output.truncate(end);
            self.utf8.pending.clear();
            self.stopped = true;
            return DetokStep {
                delta: self.take_delta(end),
                stop: Some(idx),
            };
        }
        let hold = self.stop_prefix_suffix_len();
        DetokStep {
            delta: self.take_delta(self.output.len() - hold),
            stop: None,
        }
    }

    /// End of stream (finished for a reason other than a stop string): releases held text,
    /// including an incomplete trailing UTF-8 sequence as U+FFFD, as a full decode would.
    pub fn flush(&mut self) -> String {
        if !self.stopped {
            let per_byte = self.tok.per_byte_replacement();
            self.utf8.end(&mut self.output, per_byte);
        }
        self.take_delta(self.output.len())
    }

    fn take_delta(&mut self, upto: usize) -> String {
        if upto <= self.emitted {
            return String::new();
        }
        let d = self.output[self.emitted..upto].to_string();
        self.emitted = upto;
        d
    }

    fn decode_into_output(&mut self, token_id: u32) {
        let before = self.output.len();
        match &self.tok.kind {
            DecodeKind::Table(t) => {
                let i = token_id as usize;
                if i + 1 >= t.offsets.len() || (self.skip_special_tokens && t.special[i]) {
                    return;
                }
                let tb = t.token_bytes(i);
                match t.style {
                    TableStyle::ByteLevel => self.utf8.push(&mut self.output, tb, false),
                    TableStyle::SentencePiece { .. } if t.is_byte_piece[i] => {
                        self.utf8.push(&mut self.output, tb, true)
                    }
                    TableStyle::SentencePiece { .. } => {
                        // A text piece ends any byte run; its own text is always valid UTF-8.
                        self.utf8.end(&mut self.output, true);
                        self.output
                            .push_str(std::str::from_utf8(tb).expect("table built from str"));
                    }
                }
                if self.at_start && self.output.len() > before {
                    self.at_start = false;
                    if t.strip_first_space && self.output[before..].starts_with(' ') {
                        self.output.remove(before);
                    }
                }
            }
            DecodeKind::Stream(tk) => {
                let s = &mut self.stream;
                let r = tokenizers::tokenizer::step_decode_stream(
                    tk,
                    vec![token_id],
                    self.skip_special_tokens,
                    &mut s.ids,
                    &mut s.prefix,
                    &mut s.prefix_index,
                );
                if let Ok(Some(text)) = r {
                    self.output.push_str(&text);
                }
            }
        }
    }

    /// Earliest stop-string match that ends in the text added since `new_start` (a match that
    /// ended earlier was either reported then or completed while min_tokens suppressed stops,
    /// and must not fire late). It may begin in older text, but never in text already emitted:
    /// held-back text always covers the start of a match in progress.
    fn find_stop(&self, new_start: usize) -> Option<(usize, usize)> {
        let hay = self.output.as_bytes();
        let mut best: Option<(usize, usize)> = None;
        for (i, s) in self.stops.iter().enumerate() {
            // A needle is valid UTF-8, so it can only match at a char boundary of the text.
            let from = (new_start + 1).saturating_sub(s.len()).max(self.emitted);
            if let Some(pos) = find_short(&hay[from..], s.as_bytes()) {
                if best.is_none_or(|(_, b)| from + pos < b) {
                    best = Some((i, from + pos));
                }
            }
        }
        best
    }

    /// Length of the longest suffix of the unemitted text that is a proper prefix of a stop
    /// string: that much must be held back until the next token decides it.
    fn stop_prefix_suffix_len(&self) -> usize {
        let tail = &self.output[self.emitted..];
        let mut hold = 0;
        for s in &self.stops {
            let max_k = (s.len() - 1).min(tail.len());
            for k in (hold + 1..=max_k).rev() {
                if s.is_char_boundary(k) && tail.ends_with(&s[..k]) {
                    hold = k;
                    break;
                }
            }
        }
        hold
    }
}

/// First occurrence of `needle` in `hay`. The window searched per token is a few dozen bytes,
/// where a first-byte scan beats building a two-way searcher (`str::find`) on every call.
/// Byte offsets of a match of a valid UTF-8 needle in valid UTF-8 text are char boundaries.
fn find_short(hay: &[u8], needle: &[u8]) -> Option<usize> {
    let first = *needle.first()?;
    if needle.len() > hay.len() {
        return None;
    }
    (0..=hay.len() - needle.len()).find(|&i| hay[i] == first && hay[i..].starts_with(needle))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny byte-level BPE tokenizer.json: single bytes only (ids 0..=255 in GPT-2 char
    /// order) plus "ab", "Ġhello", and two special tokens.
    pub(crate) fn tiny_byte_level_json() -> String {
        let c2b = gpt2_char_to_byte();
        let mut pairs: Vec<(char, u8)> = c2b.into_iter().collect();
        pairs.sort_by_key(|p| p.1);
        let mut vocab: Vec<String> = pairs
            .iter()
            .map(|(c, b)| format!("{}: {}", serde_str(&c.to_string()), *b as u32))
            .collect();
        vocab.push(format!("{}: 256", serde_str("ab")));
        vocab.push(format!("{}: 257", serde_str("Ġhello")));
        format!(
            r#"{{"version":"1.0","truncation":null,"padding":null,
            "added_tokens":[{{"id":258,"content":"<|im_start|>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}},
                            {{"id":259,"content":"<|im_end|>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}}],
            "normalizer":null,
            "pre_tokenizer":{{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true}},
            "post_processor":null,
            "decoder":{{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true}},
            "model":{{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,"end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"ignore_merges":false,
            "vocab":{{{}}},"merges":[["a","b"]]}}}}"#,
            vocab.join(",")
        )
    }

    fn serde_str(s: &str) -> String {
        let mut out = String::from("\"");
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c => out.push(c),
            }
        }
        out.push('"');
        out
    }

    fn info() -> Arc<TokenizerInfo> {
        Arc::new(TokenizerInfo::from_json(&tiny_byte_level_json()).unwrap())
    }

    fn bytes_of(s: &str) -> Vec<u32> {
        s.bytes().map(|b| b as u32).collect()
    }

    fn run(d: &mut IncrementalDetokenizer, ids: &[u32]) -> (Vec<String>, Option<usize>) {
        let mut deltas = Vec::new();
        for &id in ids {
            let st = d.step(id, true);
            deltas.push(st.delta);
            if st.stop.is_some() {
                return (deltas, st.stop);
            }
        }
        deltas.push(d.flush());
        (deltas, None)
    }

    #[test]
    fn byte_table_is_used_and_decodes_merged_tokens() {
        let t = info();
        assert!(t.uses_byte_table());
        let mut d = IncrementalDetokenizer::new(t, true, vec![], false).unwrap();
        let (deltas, _) = run(&mut d, &[256, 257, 258, 33]);
        assert_eq!(deltas.concat(), "ab hello!");
    }

    #[test]
    fn special_tokens_kept_when_not_skipped() {
        let mut d = IncrementalDetokenizer::new(info(), false, vec![], false).unwrap();
        let (deltas, _) = run(&mut d, &[258, 256, 259]);
        assert_eq!(deltas.concat(), "<|im_start|>ab<|im_end|>");
    }

    #[test]
    fn multibyte_chars_are_never_split() {
        let text = "héllo 世界 🦀!";
        let mut d = IncrementalDetokenizer::new(info(), true, vec![], false).unwrap();
        let (deltas, _) = run(&mut d, &bytes_of(text));
        for x in &deltas {
            assert!(!x.contains('\u{FFFD}'));
        }
        assert_eq!(deltas.concat(), text);
        // The crab's 4 bytes produce exactly one non-empty delta.
        assert!(deltas.iter().any(|x| x == "🦀"));
    }

    #[test]
    fn invalid_utf8_becomes_replacement_like_lossy_decode() {
        let ids = [0xE4, 0xB8, 0x41, 0xFF, 0xE4];
        let raw: Vec<u8> = ids.iter().map(|&b| b as u8).collect();
        let mut d = IncrementalDetokenizer::new(info(), true, vec![], false).unwrap();
        let (deltas, _) = run(&mut d, &ids);
        assert_eq!(deltas.concat(), String::from_utf8_lossy(&raw));
    }

    #[test]
    fn stop_string_across_tokens_is_trimmed_and_never_streamed() {
        let mut d = IncrementalDetokenizer::new(info(), true, vec!["STOP".into()], false).unwrap();
        let (deltas, stop) = run(&mut d, &bytes_of("abcSTxSTOPyz"));
        assert_eq!(stop, Some(0));
        assert_eq!(deltas.concat(), "abcSTx");
        assert_eq!(d.output_text(), "abcSTx");
        // "ST" was held back until "x" proved it was not a stop string.
        assert_eq!(deltas[3], "");
        assert_eq!(deltas[4], "");
        assert_eq!(deltas[5], "STx");
    }

    #[test]
    fn include_stop_str_and_earliest_match_wins() {
        let mut d =
            IncrementalDetokenizer::new(info(), true, vec!["cd".into(), "bcd".into()], true)
                .unwrap();
        let (deltas, stop) = run(&mut d, &bytes_of("abcde"));
        assert_eq!(stop, Some(1));
        assert_eq!(deltas.concat(), "abcd");
    }

    #[test]
    fn held_text_is_released_by_flush() {
        let mut d = IncrementalDetokenizer::new(info(), true, vec!["xyz".into()], false).unwrap();
        let (deltas, stop) = run(&mut d, &bytes_of("abxy"));
        assert_eq!(stop, None);
        assert_eq!(deltas[3], "");
        assert_eq!(deltas.last().unwrap(), "xy");
        assert_eq!(deltas.concat(), "abxy");
    }

    #[test]
    fn stop_string_spanning_the_min_tokens_boundary_is_caught_and_trimmed() {
        let mut d = IncrementalDetokenizer::new(info(), true, vec!["STOP".into()], false).unwrap();
        // "ST" arrives while min_tokens suppresses stops: held back, not streamed.
        let deltas: Vec<String> = bytes_of("xST")
            .into_iter()
            .map(|t| d.step(t, false).delta)
            .collect();
        assert_eq!(deltas, ["x", "", ""]);
        assert_eq!(d.step(b'O' as u32, true), DetokStep::default());
        let st = d.step(b'P' as u32, true);
        assert_eq!((st.delta.as_str(), st.stop), ("", Some(0)));
        assert_eq!(d.output_text(), "x");
    }

    #[test]
    fn boundary_token_completing_a_short_stop_string_fires() {
        let mut d = IncrementalDetokenizer::new(info(), true, vec!["aa".into()], false).unwrap();
        assert_eq!(d.step(b'a' as u32, false).delta, "");
        let st = d.step(b'a' as u32, true);
        assert_eq!((st.delta.as_str(), st.stop), ("", Some(0)));
        assert_eq!(d.output_text(), "");
    }

    #[test]
    fn stop_string_completed_before_min_tokens_never_fires_later() {
        // "b" completes while suppressed, inside text still held for "abc": it must not fire
        // on a later token, and the held text is released once "abc" is ruled out.
        let mut d =
            IncrementalDetokenizer::new(info(), true, vec!["b".into(), "abc".into()], false)
                .unwrap();
        assert_eq!(d.step(b'a' as u32, false).delta, "");
        assert_eq!(d.step(b'b' as u32, false).delta, "");
        let st = d.step(b'x' as u32, true);
        assert_eq!((st.delta.as_str(), st.stop), ("abx", None));
        // A new "b" after the boundary does fire.
        let st = d.step(b'b' as u32, true);
        assert_eq!((st.delta.as_str(), st.stop), ("", Some(0)));
        assert_eq!(d.output_text(), "abx");
    }

    #[test]
    fn empty_stop_string_is_rejected() {
        assert!(IncrementalDetokenizer::new(info(), true, vec!["".into()], false).is_err());
    }

    #[test]
    fn decoders_with_a_token_table_are_recognised() {
        let style =
            |json: &str| table_style(&serde_json::from_str::<DecoderWrapper>(json).unwrap());
        let llama2 = r#"{"type":"Sequence","decoders":[{"type":"Replace","pattern":{"String":"▁"},"content":" "},
            {"type":"ByteFallback"},{"type":"Fuse"},{"type":"Strip","content":" ","start":1,"stop":0}]}"#;
        let sp = TableStyle::SentencePiece {
            byte_fallback: true,
        };
        assert_eq!(style(llama2), Some((sp, '▁', true)));
        let no_strip = r#"{"type":"Sequence","decoders":[{"type":"Replace","pattern":{"String":"▁"},"content":" "},
            {"type":"ByteFallback"},{"type":"Fuse"}]}"#;
        assert_eq!(style(no_strip), Some((sp, '▁', false)));
        let meta =
            r#"{"type":"Metaspace","replacement":"▁","prepend_scheme":"never","split":true}"#;
        assert_eq!(
            style(meta),
            Some((
                TableStyle::SentencePiece {
                    byte_fallback: false
                },
                '▁',
                false
            ))
        );
        let byte_level =
            r#"{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true}"#;
        assert_eq!(style(byte_level), Some((TableStyle::ByteLevel, ' ', false)));
        // Anything else (here a different strip) keeps the crate's streaming decoder.
        let other = r#"{"type":"Sequence","decoders":[{"type":"Replace","pattern":{"String":"▁"},"content":" "},
            {"type":"ByteFallback"},{"type":"Fuse"},{"type":"Strip","content":" ","start":2,"stop":0}]}"#;
        assert_eq!(style(other), None);
        assert_eq!(
            style(r###"{"type":"WordPiece","prefix":"##","cleanup":true}"###),
            None
        );
    }

    #[test]
    fn bad_json_is_a_tokenizer_error() {
        assert!(matches!(
            TokenizerInfo::from_json("{"),
            Err(CoreError::Tokenizer(_))
        ));
    }
}
