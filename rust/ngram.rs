//! N-gram (prompt lookup) proposals for speculative decoding: when the text being generated
//! repeats something already in the context (code being edited, a quoted passage, a list), the
//! tokens that followed the earlier occurrence are a cheap guess of what comes next.
//!
//! Semantics are vLLM's `NgramProposer` (v1): the longest suffix of the context, between
//! `min_n` and `max_n` tokens, that also occurs earlier; among occurrences of that length the
//! *earliest* one wins (the one with the most context after it); the proposal is the tokens
//! following it, at most `k`, never past the end of the context.

/// Appends to `out` up to `k` tokens proposed from `tokens` (the request's prompt and output so
/// far); returns how many. `min_n >= 1`.
///
/// One forward pass over the context: at each earlier position equal to the last token, the
/// match is extended backwards (at most `max_n` compares). Most positions differ from the last
/// token, so the pass costs about one (vectorized) compare per token; it stops at the first
/// occurrence of a full `max_n`-token match, which is the earliest longest one.
pub fn propose(tokens: &[u32], min_n: usize, max_n: usize, k: usize, out: &mut Vec<u32>) -> usize {
    let n = tokens.len();
    if k == 0 || max_n == 0 || n < min_n.max(1) + 1 {
        return 0;
    }
    let last = tokens[n - 1];
    let suffix_max = max_n.min(n - 1);
    let (mut best_len, mut best_end) = (0usize, 0usize);
    // An occurrence ends at `end` < n - 1 (the suffix itself does not count); it may overlap
    // the suffix, as in vLLM. The context is scanned in chunks: a branch-free "any equal to the
    // last token?" per chunk vectorizes, and only chunks with a hit are looked at one by one
    // (with a large vocabulary most chunks have none).
    const CHUNK: usize = 32;
    let hay = &tokens[..n - 1];
    'scan: for (c, chunk) in hay.chunks(CHUNK).enumerate() {
        if !chunk.iter().fold(false, |hit, &t| hit | (t == last)) {
            continue;
        }
        for (off, &t) in chunk.iter().enumerate() {
            if t != last {
                continue;
            }
            let end = c * CHUNK + off;
            let limit = suffix_max.min(end + 1);
            let mut len = 1;
            while len < limit && tokens[end - len] == tokens[n - 1 - len] {
                len += 1;
            }
            if len > best_len {
                best_len = len;
                best_end = end;
                if len == suffix_max {
                    break 'scan;
                }
            }
        }
    }
    if best_len < min_n {
        return 0;
    }
    let start = best_end + 1;
    let stop = (start + k).min(n);
    out.extend_from_slice(&tokens[start..stop]);
    stop - start
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        let n = propose(tokens, min_n, max_n, k, &mut out);
        assert_eq!(n, out.len());
        out
    }

    /// A direct transcription of the definition, to compare against.
    fn reference(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
        let n = tokens.len();
        if k == 0 {
            return vec![];
        }
        for len in (min_n.max(1)..=max_n.min(n.saturating_sub(1))).rev() {
            let suffix = &tokens[n - len..];
            // Earliest occurrence ending before the last token.
            for start in 0..n - len {
                if &tokens[start..start + len] == suffix {
                    let from = start + len;
                    return tokens[from..(from + k).min(n)].to_vec();
                }
            }
        }
        vec![]
    }

    #[test]
    fn vllm_docstring_example() {
        // [1,2,3,4,2,3], min 2, max 3, k 4: [4,2,3] has no earlier match, [2,3] does (at 1..3);
        // only three tokens follow it.
        assert_eq!(p(&[1, 2, 3, 4, 2, 3], 2, 3, 4), vec![4, 2, 3]);
    }

    #[test]
    fn longest_match_wins_then_the_earliest_occurrence() {
        // Suffix [7, 8]: [7, 8] occurs at 0 (followed by 1) and at 4 (followed by 2); the longer
        // suffix [5, 7, 8] occurs only at 3..6, followed by 2.
        let t = [7, 8, 1, 5, 7, 8, 2, 5, 7, 8];
        assert_eq!(p(&t, 1, 3, 1), vec![2]);
        assert_eq!(
            p(&t, 1, 2, 1),
            vec![1],
            "same length: the earliest occurrence"
        );
        assert_eq!(p(&t, 3, 3, 2), vec![2, 5]);
    }

    #[test]
    fn nothing_below_min_n_or_without_a_repeat() {
        assert_eq!(p(&[1, 2, 3, 4], 1, 3, 3), Vec::<u32>::new());
        assert_eq!(p(&[1, 2, 9, 2], 2, 3, 3), Vec::<u32>::new());
        assert_eq!(p(&[1, 2, 9, 2], 1, 3, 3), vec![9, 2]);
        assert_eq!(p(&[5], 1, 3, 3), Vec::<u32>::new());
        assert_eq!(p(&[5, 5], 1, 3, 0), Vec::<u32>::new());
        // A run of one token: the match overlaps the suffix.
        assert_eq!(p(&[5, 5, 5, 5], 1, 2, 4), vec![5, 5]);
    }

    #[test]
    fn matches_found_in_any_chunk_of_a_long_context() {
        // Distinct tokens, with the suffix [7, 8] planted at 70 (third chunk) and at the end.
        let mut t: Vec<u32> = (100..200).collect();
        t[70] = 7;
        t[71] = 8;
        t.extend([7, 8]);
        assert_eq!(p(&t, 2, 3, 3), vec![172, 173, 174]);
        t[40] = 8; // an earlier, shorter match does not win
        assert_eq!(p(&t, 1, 3, 1), vec![172]);
    }

    #[test]
    fn agrees_with_the_definition_on_small_alphabets() {
        // Deterministic pseudo-random sequences over 2..5 symbols (many repeats and overlaps).
        let mut x = 0x2545F4914F6CDD1Du64;
        for case in 0..3000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let alphabet = 2 + (x % 4) as u32;
            let len = 1 + (x >> 8) as usize % 100; // several chunks of the scan
            let tokens: Vec<u32> = (0..len)
                .map(|i| ((x >> (i % 50)) as u32 ^ (i as u32).wrapping_mul(2654435761)) % alphabet)
                .collect();
            let min_n = 1 + (x >> 20) as usize % 3;
            let max_n = min_n + (x >> 24) as usize % 4;
            let k = (x >> 28) as usize % 6;
            assert_eq!(
                p(&tokens, min_n, max_n, k),
                reference(&tokens, min_n, max_n, k),
                "case {case}: {tokens:?} min {min_n} max {max_n} k {k}"
            );
        }
    }
}
