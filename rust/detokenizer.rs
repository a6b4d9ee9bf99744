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

/// Flat token -> text table. A token whose bytes are valid UTF-8 on their own (nearly all of
/// them) is stored as text, so decoding it is a copy with no validation; the others (pieces of
/// a multi-byte character) as raw bytes. Everything about a token is in one 8-byte entry, so a
/// random token costs one cache miss for its entry and one for its text.
struct TokenTable {
    style: TableStyle,
    /// Text of the whole-UTF-8 tokens.
    text: String,
    /// Bytes of the other tokens.
    bytes: Vec<u8>,
    entries: Vec<TokenEntry>,
    /// The decoder drops one leading space of the whole text (SentencePiece's prepended space).
    strip_first_space: bool,
}

#[derive(Clone, Copy, Default)]
struct TokenEntry {
    /// Start in `text` (TEXT set) or `bytes`.
    start: u32,
    /// Byte length << 8 | flags.
    len_flags: u32,
}

/// The token is a special (added, special=true) token.
const SPECIAL: u32 = 1;
/// SentencePiece with byte fallback: the token is a `<0xNN>` byte piece.
const BYTE_PIECE: u32 = 2;
/// The token's bytes are valid UTF-8 on their own: they are in `TokenTable::text`.
const TEXT: u32 = 4;

/// A token's decoded form.
enum TokenPiece<'a> {
    Text(&'a str),
    Bytes(&'a [u8]),
}

impl TokenEntry {
    fn has(self, flag: u32) -> bool {
        self.len_flags & flag != 0
    }
    fn range(self) -> std::ops::Range<usize> {
        let start = self.start as usize;
        start..start + (self.len_flags >> 8) as usize
    }
}

impl TokenTable {
    fn new(style: TableStyle, strip_first_space: bool) -> Self {
        TokenTable {
            style,
            text: String::new(),
            bytes: Vec::new(),
            entries: Vec::new(),
            strip_first_space,
        }
    }

    /// Appends the next token id's entry.
    fn push(&mut self, bytes: &[u8], mut flags: u32) -> CoreResult<()> {
        let start = match std::str::from_utf8(bytes) {
            Ok(text) => {
                flags |= TEXT;
                self.text.push_str(text);
                self.text.len() - text.len()
            }
            Err(_) => {
                self.bytes.extend_from_slice(bytes);
                self.bytes.len() - bytes.len()
            }
        };
        if bytes.len() >= 1 << 24 || start > u32::MAX as usize {
            return Err(CoreError::Tokenizer(
                "tokenizer_json: token table too large (a token of 16 MiB or more)".into(),
            ));
        }
        self.entries.push(TokenEntry {
            start: start as u32,
            len_flags: (bytes.len() as u32) << 8 | flags,
        });
        Ok(())
    }

    #[inline]
    fn piece(&self, e: TokenEntry) -> TokenPiece<'_> {
        if e.has(TEXT) {
            TokenPiece::Text(&self.text[e.range()])
        } else {
            TokenPiece::Bytes(&self.bytes[e.range()])
        }
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

/// Parses a tokenizer.json without letting the tokenizers crate panic on a broken file: its
/// deserializers `expect` in places (0.23: a syntax error inside "decoder", a malformed
/// Precompiled normalizer), which would reach Python as pyo3's PanicException.
fn parse_tokenizer(json: &str) -> CoreResult<Tokenizer> {
    let error = |e: &dyn std::fmt::Display| {
        CoreError::Tokenizer(format!("tokenizer_json: cannot parse tokenizer.json: {e}"))
    };
    // A syntax check first (cheap: nothing is built), so a JSON error is reported as one.
    serde_json::from_str::<serde::de::IgnoredAny>(json).map_err(|e| error(&e))?;
    // The last resort for valid JSON the crate still panics on. The panic hook has printed
    // its message by then; the caller gets an error, and no state is shared with the parse.
    match std::panic::catch_unwind(|| json.parse::<Tokenizer>()) {
        Ok(parsed) => parsed.map_err(|e| error(&e)),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(error(&format_args!(
                "the tokenizers crate panicked ({what})"
            )))
        }
    }
}

impl TokenizerInfo {
    /// Parses the text of a tokenizer.json.
    pub fn from_json(json: &str) -> CoreResult<Self> {
        let tok = parse_tokenizer(json)?;
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
        let mut table = TokenTable::new(style, strip_first_space);
        table.entries.reserve_exact(n);
        let mut buf: Vec<u8> = Vec::new();
        for id in 0..n as u32 {
            buf.clear();
            let mut flags = 0;
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
                            Some(b) => buf.extend_from_slice(&b),
                            None => buf.extend_from_slice(token.as_bytes()),
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
                                buf.push(b);
                                flags |= BYTE_PIECE;
                            }
                            None => buf.extend_from_slice(token.replace(space, " ").as_bytes()),
                        }
                    }
                }
            }
            if added.get(&id).is_some_and(|a| a.special) {
                flags |= SPECIAL;
            }
            table.push(&buf, flags)?;
        }
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

    /// Loads the table entries and the text of `tokens` into the CPU cache, so that decoding
    /// them next does not stall on memory. A random token of a large vocabulary costs two
    /// cache misses (its entry, then its text) once the engine's other work has evicted the
    /// table, and while decoding they are waited for one after the other; here the loads of
    /// all the step's tokens are independent, so the CPU overlaps them.
    pub fn warm(&self, tokens: impl Iterator<Item = u32> + Clone) {
        let DecodeKind::Table(t) = &self.kind else {
            return;
        };
        let mut acc = 0u32;
        for id in tokens.clone() {
            if let Some(e) = t.entries.get(id as usize) {
                acc = acc.wrapping_add(e.len_flags);
            }
        }
        for id in tokens {
            if let Some(&e) = t.entries.get(id as usize) {
                let first = match t.piece(e) {
                    TokenPiece::Text(text) => text.as_bytes().first(),
                    TokenPiece::Bytes(b) => b.first(),
                };
                acc = acc.wrapping_add(first.copied().unwrap_or(0) as u32);
            }
        }
        std::hint::black_box(acc);
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

/// A request's stop strings, with lookup tables that make the per-token checks cheap (they
/// run after every token of every request). The scheduler shares one set among the requests
/// that name the same strings, so it stays in cache however many requests use it.
#[derive(Debug, PartialEq, Eq)]
pub struct StopSet {
    text: Box<str>,
    /// End of stop string i in `text` (it starts where i - 1 ends).
    ends: Box<[u32]>,
    /// Bit b set: some stop string ends in byte b (new text without one completes no match).
    last_bytes: [u64; 4],
    /// The distinct last bytes when there are at most 4 (the usual case), for a word-at-a-time
    /// test of the new text.
    few_last_bytes: Option<([u8; 4], usize)>,
    /// For each byte value b, the stop strings ending in b: `by_last[by_last_at[b]..by_last_at[b + 1]]`.
    by_last_at: Box<[u16; 257]>,
    by_last: Box<[u16]>,
    /// For each byte value b, the proper prefixes of stop strings ending in b, as (stop, prefix
    /// length), longest first: `prefixes[prefixes_at[b]..prefixes_at[b + 1]]`.
    prefixes_at: Box<[u32; 257]>,
    prefixes: Box<[(u16, u16)]>,
}

impl StopSet {
    /// Checks that no stop string is empty (naming it: "stop[i]").
    pub fn new(stops: &[String]) -> CoreResult<Self> {
        if let Some(i) = stops.iter().position(|s| s.is_empty()) {
            return Err(crate::error::invalid(
                &format!("stop[{i}]"),
                "stop strings must not be empty",
            ));
        }
        if stops.len() > u16::MAX as usize || stops.iter().any(|s| s.len() > u16::MAX as usize) {
            return Err(crate::error::invalid(
                "stop",
                "at most 65535 stop strings of at most 65535 bytes each",
            ));
        }
        let mut end = 0;
        let ends = stops
            .iter()
            .map(|s| {
                end += s.len() as u32;
                end
            })
            .collect();
        // Bucket by byte value (a counting sort keeps each bucket's order).
        let mut by_last: Vec<(u8, u16)> = stops
            .iter()
            .enumerate()
            .map(|(i, s)| (*s.as_bytes().last().expect("not empty"), i as u16))
            .collect();
        by_last.sort_by_key(|&(b, _)| b);
        let mut by_last_at = Box::new([0u16; 257]);
        let mut last_bytes = [0u64; 4];
        for &(b, _) in &by_last {
            by_last_at[b as usize + 1] += 1;
            last_bytes[(b >> 6) as usize] |= 1 << (b & 63);
        }
        let mut prefixes: Vec<(u8, u16, u16)> = Vec::new();
        for (i, s) in stops.iter().enumerate() {
            for k in 1..s.len() {
                prefixes.push((s.as_bytes()[k - 1], i as u16, k as u16));
            }
        }
        prefixes.sort_by_key(|&(b, _, k)| (b, std::cmp::Reverse(k)));
        let mut prefixes_at = Box::new([0u32; 257]);
        for &(b, _, _) in &prefixes {
            prefixes_at[b as usize + 1] += 1;
        }
        for b in 0..256 {
            by_last_at[b + 1] += by_last_at[b];
            prefixes_at[b + 1] += prefixes_at[b];
        }
        let mut distinct: Vec<u8> = by_last.iter().map(|&(b, _)| b).collect();
        distinct.dedup(); // sorted by byte above
        let few_last_bytes = (distinct.len() <= 4).then(|| {
            let mut few = [0u8; 4];
            few[..distinct.len()].copy_from_slice(&distinct);
            (few, distinct.len())
        });
        Ok(StopSet {
            text: stops.concat().into_boxed_str(),
            ends,
            last_bytes,
            few_last_bytes,
            by_last_at,
            by_last: by_last.into_iter().map(|(_, i)| i).collect(),
            prefixes_at,
            prefixes: prefixes.into_iter().map(|(_, i, k)| (i, k)).collect(),
        })
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    #[inline]
    pub fn get(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.text[start..self.ends[i] as usize]
    }

    /// Earliest-starting match (stop index, start) in `hay` that ends at or after byte
    /// `new_start` (a match that ended earlier was either reported then or completed while
    /// min_tokens suppressed stops, and must not fire late). Only stop strings whose last byte
    /// appears in the new text are tried, and only where it appears.
    #[inline(always)]
    fn find(&self, hay: &str, new_start: usize) -> Option<(usize, usize)> {
        let hay = hay.as_bytes();
        if !self.may_end_a_match(&hay[new_start..]) {
            return None; // most tokens
        }
        let mut best: Option<(usize, usize)> = None;
        for (end, &b) in hay.iter().enumerate().skip(new_start) {
            if self.last_bytes[(b >> 6) as usize] & (1 << (b & 63)) == 0 {
                continue;
            }
            let b = b as usize;
            let (lo, hi) = (self.by_last_at[b] as usize, self.by_last_at[b + 1] as usize);
            for &i in &self.by_last[lo..hi] {
                let s = self.get(i as usize).as_bytes();
                // A needle is valid UTF-8, so a match begins at a char boundary of the text.
                let i = i as usize;
                if let Some(start) = (end + 1).checked_sub(s.len()) {
                    // Earliest start wins; at the same start, the first in the list.
                    let better = best.is_none_or(|(bi, b)| start < b || (start == b && i < bi));
                    if better && hay[start..=end] == *s {
                        best = Some((i, start));
                    }
                }
            }
        }
        best
    }

    /// Whether `new` holds a byte that ends some stop string. With at most 4 distinct such
    /// bytes, 8 bytes of text are tested at a time (SWAR).
    #[inline(always)]
    fn may_end_a_match(&self, new: &[u8]) -> bool {
        const LO: u64 = 0x0101_0101_0101_0101;
        const HI: u64 = 0x8080_8080_8080_8080;
        let Some((few, n)) = self.few_last_bytes else {
            return new
                .iter()
                .any(|&b| self.last_bytes[(b >> 6) as usize] & (1 << (b & 63)) != 0);
        };
        // A zero byte in `word ^ c * LO` marks a byte equal to c; the bits of the candidate
        // bytes are or-ed so one test covers them all.
        let has = |word: u64| {
            let mut any = 0;
            for &c in &few[..n] {
                let x = word ^ (LO * c as u64);
                any |= x.wrapping_sub(LO) & !x;
            }
            any & HI != 0
        };
        let mut chunks = new.chunks_exact(8);
        for chunk in &mut chunks {
            if has(u64::from_le_bytes(chunk.try_into().expect("8 bytes"))) {
                return true;
            }
        }
        let rest = chunks.remainder();
        let Some(&first) = rest.first() else {
            return false;
        };
        // Pad with a byte of the text itself: the padding matches only if that byte does.
        let mut word = [first; 8];
        word[..rest.len()].copy_from_slice(rest);
        has(u64::from_le_bytes(word))
    }

    /// Length of the longest suffix of `text` that is a proper prefix of a stop string: that
    /// much must be held back until the next token decides it. Only prefixes ending in the
    /// text's last byte are tried, longest first.
    #[inline(always)]
    fn held_suffix_len(&self, text: &str) -> usize {
        let tail = text.as_bytes();
        let Some(&last) = tail.last() else {
            return 0;
        };
        let b = last as usize;
        let (lo, hi) = (
            self.prefixes_at[b] as usize,
            self.prefixes_at[b + 1] as usize,
        );
        for &(i, k) in &self.prefixes[lo..hi] {
            // A prefix of a valid UTF-8 needle that matches the end of valid UTF-8 text ends
            // at a char boundary of the needle, so a byte comparison suffices.
            let k = k as usize;
            if k <= tail.len() && tail.ends_with(&self.get(i as usize).as_bytes()[..k]) {
                return k;
            }
        }
        0
    }
}

/// Per-request incremental detokenizer and stop-string matcher.
///
/// Streamed text goes straight into the caller's buffer (the step's text column) and is never
/// read again; the detokenizer keeps only text held back (a possible stop string's beginning,
/// a few bytes), so its state stays small however long the output grows, and in the common
/// case (nothing held) a token's text is decoded and checked in the caller's buffer directly.
pub struct IncrementalDetokenizer {
    tok: Arc<TokenizerInfo>,
    decode: DecodeState,
    /// Decoded text not streamed yet (truncated at a stop string once one fires).
    pending: String,
    /// Everything streamed so far, for `output_text` (the standalone Detokenizer); None in the
    /// scheduler, which never reads it.
    streamed: Option<String>,
    stops: Arc<StopSet>,
    include_stop_str_in_output: bool,
    stopped: bool,
}

/// Decoding state proper (apart from stop strings).
struct DecodeState {
    skip_special_tokens: bool,
    utf8: Utf8Tail,
    /// Nothing decoded yet (and no prompt context): a decoder that strips the text's first
    /// space applies it to the next text.
    at_start: bool,
    /// The streaming fallback's window (boxed: the byte table, the common case, needs none).
    stream: Option<Box<StreamState>>,
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
        let stops = Arc::new(StopSet::new(&stops)?);
        Ok(Self::with_stop_set(
            tok,
            skip_special_tokens,
            stops,
            include_stop_str_in_output,
        ))
    }

    /// `new` with a stop set that may be shared with other requests.
    pub fn with_stop_set(
        tok: Arc<TokenizerInfo>,
        skip_special_tokens: bool,
        stops: Arc<StopSet>,
        include_stop_str_in_output: bool,
    ) -> Self {
        let stream = matches!(tok.kind, DecodeKind::Stream(_)).then(Box::default);
        IncrementalDetokenizer {
            tok,
            decode: DecodeState {
                skip_special_tokens,
                utf8: Utf8Tail::default(),
                at_start: true,
                stream,
            },
            pending: String::new(),
            streamed: Some(String::new()),
            stops,
            include_stop_str_in_output,
            stopped: false,
        }
    }

    /// Stops keeping the streamed text (`output_text` then returns None): the scheduler hands
    /// every delta on and never reads it back.
    pub fn without_output_text(mut self) -> Self {
        self.streamed = None;
        self
    }

    /// Gives the streaming fallback the prompt's last tokens as context, so the first generated
    /// token decodes as it would mid-text (SentencePiece-style decoders strip the leading space
    /// of a sequence's first token: "▁Paris" must stream as " Paris" after a prompt). The byte
    /// table needs no context.
    pub fn prime(&mut self, prompt: &[u32]) {
        if !prompt.is_empty() {
            self.decode.at_start = false;
        }
        if let (DecodeKind::Stream(tok), Some(s)) = (&self.tok.kind, self.decode.stream.as_mut()) {
            for &id in &prompt[prompt.len().saturating_sub(PRIME_TOKENS)..] {
                let _ = tokenizers::tokenizer::step_decode_stream(
                    tok,
                    vec![id],
                    self.decode.skip_special_tokens,
                    &mut s.ids,
                    &mut s.prefix,
                    &mut s.prefix_index,
                );
            }
        }
    }

    /// All text decoded so far, streamed or held back (truncated at a stop string once one
    /// fired); None after `without_output_text`.
    pub fn output_text(&self) -> Option<String> {
        self.streamed
            .as_ref()
            .map(|s| format!("{s}{}", self.pending))
    }

    pub fn stop_strings(&self) -> &StopSet {
        &self.stops
    }

    /// Feeds one token. `check_stops` is false while min_tokens suppresses stops: no match is
    /// reported, but text that could begin a stop string is still held back, so a stop string
    /// that begins before the min_tokens boundary and completes after it is caught (and
    /// trimmed) like any other. Out-of-vocabulary ids decode to nothing (models often pad their
    /// vocabulary past the tokenizer's).
    pub fn step(&mut self, token_id: u32, check_stops: bool) -> DetokStep {
        let mut delta = String::new();
        let stop = self.step_into(token_id, check_stops, &mut delta);
        DetokStep { delta, stop }
    }

    /// `step`, appending the text to stream to `out` (the step's shared text column) instead of
    /// allocating a string per token. Returns the index of the stop string that fired.
    pub fn step_into(
        &mut self,
        token_id: u32,
        check_stops: bool,
        out: &mut String,
    ) -> Option<usize> {
        if self.stopped {
            return None;
        }
        if !self.pending.is_empty() {
            return self.step_held(token_id, check_stops, out);
        }
        // Nothing held back: decode into `out` and check the new text there.
        let start = out.len();
        self.decode.push(&self.tok, token_id, out);
        if self.stops.is_empty() || out.len() == start {
            self.record(&out[start..]);
            return None;
        }
        let new = &out[start..];
        if let Some((idx, at)) = check_stops.then(|| self.stops.find(new, 0)).flatten() {
            let end = if self.include_stop_str_in_output {
                at + self.stops.get(idx).len()
            } else {
                at
            };
            out.truncate(start + end);
            self.record_stop(&out[start..]);
            return Some(idx);
        }
        let keep = new.len() - self.stops.held_suffix_len(new);
        self.pending.push_str(&new[keep..]);
        out.truncate(start + keep);
        self.record(&out[start..]);
        None
    }

    /// `step_into` while text is held back: decode after it, then decide what to release.
    fn step_held(&mut self, token_id: u32, check_stops: bool, out: &mut String) -> Option<usize> {
        let new_start = self.pending.len();
        self.decode.push(&self.tok, token_id, &mut self.pending);
        if self.pending.len() == new_start {
            // Nothing new (a skipped special token, an incomplete character): no new match,
            // and what is held stays held.
            return None;
        }
        if let Some((idx, at)) = check_stops
            .then(|| self.stops.find(&self.pending, new_start))
            .flatten()
        {
            let end = if self.include_stop_str_in_output {
                at + self.stops.get(idx).len()
            } else {
                at
            };
            self.pending.truncate(end);
            self.emit(end, out);
            self.record_stop("");
            return Some(idx);
        }
        let hold = self.stops.held_suffix_len(&self.pending);
        self.emit(self.pending.len() - hold, out);
        None
    }

    /// End of stream (finished for a reason other than a stop string): releases held text,
    /// including an incomplete trailing UTF-8 sequence as U+FFFD, as a full decode would.
    /// That U+FFFD is new text, so it is stop-checked like a token's.
    pub fn flush(&mut self) -> String {
        let mut rest = String::new();
        self.flush_into(&mut rest);
        rest
    }

    /// `flush`, appending to `out`. Returns the index of a stop string that the released
    /// U+FFFD completed (the text is then cut there, as in `step`).
    pub fn flush_into(&mut self, out: &mut String) -> Option<usize> {
        let mut stop = None;
        if !self.stopped {
            let new_start = self.pending.len();
            let per_byte = self.tok.per_byte_replacement();
            self.decode.utf8.end(&mut self.pending, per_byte);
            if let Some((idx, at)) = self.stops.find(&self.pending, new_start) {
                let end = if self.include_stop_str_in_output {
                    at + self.stops.get(idx).len()
                } else {
                    at
                };
                self.pending.truncate(end);
                self.stopped = true;
                stop = Some(idx);
            }
        }
        self.emit(self.pending.len(), out);
        stop
    }

    /// Streams the first `upto` bytes of the held text into `out`.
    fn emit(&mut self, upto: usize, out: &mut String) {
        if upto == 0 {
            return;
        }
        let text = &self.pending[..upto];
        out.push_str(text);
        if let Some(s) = self.streamed.as_mut() {
            s.push_str(text);
        }
        if upto == self.pending.len() {
            self.pending.clear();
        } else {
            self.pending.drain(..upto);
        }
    }

    /// Notes text streamed directly (for `output_text`).
    fn record(&mut self, text: &str) {
        if let Some(s) = self.streamed.as_mut() {
            s.push_str(text);
        }
    }

    /// A stop string fired after `text` was streamed: nothing more comes.
    fn record_stop(&mut self, text: &str) {
        self.record(text);
        self.decode.utf8.pending.clear();
        self.stopped = true;
    }
}

impl DecodeState {
    /// Appends the text of one token to `dst`.
    #[inline(always)]
    fn push(&mut self, tok: &TokenizerInfo, token_id: u32, dst: &mut String) {
        let before = dst.len();
        match &tok.kind {
            DecodeKind::Table(t) => {
                let Some(&e) = t.entries.get(token_id as usize) else {
                    return;
                };
                if self.skip_special_tokens && e.has(SPECIAL) {
                    return;
                }
                match (t.style, t.piece(e)) {
                    // Most tokens: whole characters, nothing incomplete before them.
                    (TableStyle::ByteLevel, TokenPiece::Text(text))
                        if self.utf8.pending.is_empty() =>
                    {
                        dst.push_str(text)
                    }
                    (TableStyle::ByteLevel, TokenPiece::Text(text)) => {
                        self.utf8.push(dst, text.as_bytes(), false)
                    }
                    (TableStyle::ByteLevel, TokenPiece::Bytes(b)) => self.utf8.push(dst, b, false),
                    (TableStyle::SentencePiece { .. }, piece) if e.has(BYTE_PIECE) => {
                        let b = match piece {
                            TokenPiece::Text(text) => text.as_bytes(),
                            TokenPiece::Bytes(b) => b,
                        };
                        self.utf8.push(dst, b, true)
                    }
                    (TableStyle::SentencePiece { .. }, piece) => {
                        // A text piece ends any byte run; its own text is always valid UTF-8.
                        self.utf8.end(dst, true);
                        if let TokenPiece::Text(text) = piece {
                            dst.push_str(text);
                        }
                    }
                }
                if self.at_start && dst.len() > before {
                    self.at_start = false;
                    if t.strip_first_space && dst[before..].starts_with(' ') {
                        dst.remove(before);
                    }
                }
            }
            DecodeKind::Stream(tk) => {
                let s = self
                    .stream
                    .as_mut()
                    .expect("stream state for the fallback decoder");
                let r = tokenizers::tokenizer::step_decode_stream(
                    tk,
                    vec![token_id],
                    self.skip_special_tokens,
                    &mut s.ids,
                    &mut s.prefix,
                    &mut s.prefix_index,
                );
                if let Ok(Some(text)) = r {
                    dst.push_str(&text);
                }
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
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
        assert_eq!(d.output_text().unwrap(), "abcSTx");
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
        assert_eq!(d.output_text().unwrap(), "x");
    }

    #[test]
    fn boundary_token_completing_a_short_stop_string_fires() {
        let mut d = IncrementalDetokenizer::new(info(), true, vec!["aa".into()], false).unwrap();
        assert_eq!(d.step(b'a' as u32, false).delta, "");
        let st = d.step(b'a' as u32, true);
        assert_eq!((st.delta.as_str(), st.stop), ("", Some(0)));
        assert_eq!(d.output_text().unwrap(), "");
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
        assert_eq!(d.output_text().unwrap(), "abx");
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

    #[test]
    fn flushed_replacement_char_is_stop_checked() {
        // "a" then the lead byte 0xC3 (held back): the flush releases it as U+FFFD, which
        // completes the stop string "a\u{FFFD}".
        for include in [false, true] {
            let stops = vec!["a\u{FFFD}".to_string()];
            let mut d = IncrementalDetokenizer::new(info(), true, stops, include).unwrap();
            assert_eq!(d.step(b'a' as u32, true), DetokStep::default()); // held: a stop's prefix
            assert_eq!(d.step(0xC3, true), DetokStep::default());
            let mut out = String::new();
            assert_eq!(d.flush_into(&mut out), Some(0));
            assert_eq!(out, if include { "a\u{FFFD}" } else { "" });
            assert_eq!(d.flush(), "");
        }
    }

    /// tokenizers 0.23 panics on these (`expect("Helper")`, `expect("Precompiled")`).
    #[test]
    fn files_the_tokenizers_crate_panics_on_are_a_tokenizer_error() {
        let json = tiny_byte_level_json();
        let decoder = r#""decoder":{"type":"ByteLevel","add_prefix_space":true,"#;
        assert!(json.contains(decoder));
        let syntax = json.replace(
            decoder,
            r#""decoder":{"type":"ByteLevel","add_prefix_space":true 1,"#,
        );
        let precompiled = json.replace(
            r#""normalizer":null"#,
            r#""normalizer":{"type":"Precompiled","precompiled_charsmap":5}"#,
        );
        for broken in [syntax, precompiled] {
            match TokenizerInfo::from_json(&broken) {
                Err(CoreError::Tokenizer(msg)) => assert!(msg.contains("tokenizer.json"), "{msg}"),
                other => panic!("{:?}", other.err()),
            }
        }
    }
}
