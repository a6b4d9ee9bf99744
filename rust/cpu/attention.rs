//! The paged KV cache of one layer on the CPU and single-query attention over it.
//!
//! Layout (python/ferrox/attention/backend.py): [2, num_blocks, block_size, num_kv_heads,
//! head_dim] float32, K plane then V plane; a token at slot s (= block * block_size + offset)
//! keeps head g's vector at s * num_kv_heads + g.

use super::attention_simd as simd;

thread_local! {
    static OFFSETS: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One layer's cache, borrowed for a step.
pub struct LayerKv<'a> {
    pub k: &'a mut [f32],
    pub v: &'a mut [f32],
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl LayerKv<'_> {
    fn row(&self, slot: usize, head: usize) -> usize {
        (slot * self.num_kv_heads + head) * self.head_dim
    }

    /// Store one token's k and v (num_kv_heads * head_dim each) at `slot`.
    pub fn write(&mut self, slot: usize, k: &[f32], v: &[f32]) {
        let at = self.row(slot, 0);
        let n = self.num_kv_heads * self.head_dim;
        self.k[at..at + n].copy_from_slice(k);
        self.v[at..at + n].copy_from_slice(v);
    }

    /// One query head against the first `seq_len` cached tokens of a sequence whose blocks are
    /// `block_ids`, reading kv head `kv_head`: out = softmax(q . k * scale) . v. `scores` is
    /// scratch of at least seq_len.
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &self,
        q: &[f32],
        kv_head: usize,
        block_ids: &[i32],
        seq_len: usize,
        scale: f32,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        self.attend_tile(
            &[q],
            &[seq_len],
            0,
            kv_head,
            block_ids,
            scale,
            scores,
            &mut [out],
        );
    }

    /// Several query rows of one sequence that read the same kv head (a prefill chunk's
    /// consecutive tokens times the query heads sharing `kv_head`): row j attends to the first
    /// `lens[j]` cached tokens. Each cached k and v row is read once for all of them (not once
    /// per query row), which is what makes a long prefill's attention compute-bound instead of
    /// bound by re-reading the cache.
    ///
    /// Row j's arithmetic is that of attending alone, in the same order: its scores are the same
    /// dot products, its max, exponentials and their sum run over positions in order, and its
    /// output adds p * v position by position. So a token's output does not depend on which
    /// other rows share its tile: alone, batched, chunked or decoded, it is the same to the bit.
    /// `first`: the tile's positions start there (a sliding window's first visible position, shared
    /// by the tile's rows: one token's query heads); row j then reads positions first .. first +
    /// lens[j]. `scores` is scratch of at least rows * max(lens).
    #[allow(clippy::too_many_arguments)]
    pub fn attend_tile(
        &self,
        queries: &[&[f32]],
        lens: &[usize],
        first: usize,
        kv_head: usize,
        block_ids: &[i32],
        scale: f32,
        scores: &mut [f32],
        outs: &mut [&mut [f32]],
    ) {
        let hd = self.head_dim;
        let longest = lens.iter().copied().max().unwrap_or(0);
        let slot = |t: usize| {
            let t = first + t;
            block_ids[t / self.block_size] as usize * self.block_size + t % self.block_size
        };
        #[cfg(target_arch = "x86_64")]
        if simd::enabled(hd) {
            // Each position's row offset, in a buffer each kernel thread keeps (a decode step
            // runs a tile per request and kv head in every layer: no allocation per tile).
            OFFSETS.with_borrow_mut(|at| {
                at.clear();
                at.extend((0..longest).map(|t| self.row(slot(t), kv_head)));
                // SAFETY: enabled() checked AVX2 + FMA and head_dim; the offsets are rows of this
                // layer's cache (block_ids were checked by StepBatch::plan); the caller sizes scores.
                unsafe {
                    simd::attend_tile(self.k, self.v, at, hd, queries, lens, scale, scores, outs)
                };
            });
            return;
        }
        let row_scores = |j: usize| j * longest..j * longest + lens[j];
        for t in 0..longest {
            let at = self.row(slot(t), kv_head);
            let k = &self.k[at..at + hd];
            for (j, q) in queries.iter().enumerate() {
                if t < lens[j] {
                    scores[j * longest + t] = dot(q, k) * scale;
                }
            }
        }
        let mut totals = Vec::with_capacity(queries.len());
        for j in 0..queries.len() {
            let row = &mut scores[row_scores(j)];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            let mut total = 0.0f32;
            for s in row.iter_mut() {
                *s = (*s - max).exp();
                total += *s;
            }
            totals.push(total);
            outs[j].fill(0.0);
        }
        for t in 0..longest {
            let at = self.row(slot(t), kv_head);
            let v = &self.v[at..at + hd];
            for (j, out) in outs.iter_mut().enumerate() {
                if t < lens[j] {
                    let p = scores[j * longest + t];
                    for (o, x) in out.iter_mut().zip(v) {
                        *o += p * x;
                    }
                }
            }
        }
        for (out, total) in outs.iter_mut().zip(totals) {
            let inv = 1.0 / total;
            out.iter_mut().for_each(|o| *o *= inv);
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut parts = [0.0f32; 8];
    for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for i in 0..8 {
            parts[i] += ca[i] * cb[i];
        }
    }
    let tail: f32 = a
        .chunks_exact(8)
        .remainder()
        .iter()
        .zip(b.chunks_exact(8).remainder())
        .map(|(x, y)| x * y)
        .sum();
    parts.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<'a>(
        k: &'a mut [f32],
        v: &'a mut [f32],
        bs: usize,
        nkv: usize,
        hd: usize,
    ) -> LayerKv<'a> {
        LayerKv {
            k,
            v,
            block_size: bs,
            num_kv_heads: nkv,
            head_dim: hd,
        }
    }

    /// k and v planes of `num_blocks` blocks holding a `len`-token sequence laid out in `blocks`:
    /// token t's row i (over all kv heads) is k_of(t, i) and v_of(t, i).
    #[allow(clippy::too_many_arguments)]
    fn planes(
        num_blocks: usize,
        bs: usize,
        nkv: usize,
        hd: usize,
        blocks: &[i32],
        len: usize,
        k_of: impl Fn(usize, usize) -> f32,
        v_of: impl Fn(usize, usize) -> f32,
    ) -> (Vec<f32>, Vec<f32>) {
        let mut k = vec![0.0f32; num_blocks * bs * nkv * hd];
        let mut v = k.clone();
        let mut kv = view(&mut k, &mut v, bs, nkv, hd);
        for t in 0..len {
            let kt: Vec<f32> = (0..nkv * hd).map(|i| k_of(t, i)).collect();
            let vt: Vec<f32> = (0..nkv * hd).map(|i| v_of(t, i)).collect();
            kv.write(blocks[t / bs] as usize * bs + t % bs, &kt, &vt);
        }
        (k, v)
    }

    /// A tile of rows (consecutive tokens x the query heads of one kv head) gives each row exactly
    /// what it gets alone, and both match a dense f64 softmax: lengths around multiples of 8 (the
    /// vector kernel's position groups), blocks scattered, head_dim 64.
    #[test]
    fn a_tile_gives_each_row_its_result_alone() {
        let (bs, nkv, hd) = (16, 2, 64);
        let lens = [35usize, 36, 37, 38, 39, 40, 41];
        let longest = *lens.iter().max().unwrap();
        let blocks: Vec<i32> = vec![7, 2, 9];
        let val = |t: usize, i: usize, salt: usize| {
            (((t * 31 + i * 17 + salt) % 97) as f32 - 48.0) * 0.021
        };
        let (mut k, mut v) = planes(
            10,
            bs,
            nkv,
            hd,
            &blocks,
            longest,
            |t, i| val(t, i, 1),
            |t, i| val(t, i, 5),
        );
        let kv = view(&mut k, &mut v, bs, nkv, hd);
        let queries: Vec<Vec<f32>> = (0..lens.len())
            .map(|j| (0..hd).map(|i| val(j, i, 3) * 2.0).collect())
            .collect();
        let refs: Vec<&[f32]> = queries.iter().map(|q| q.as_slice()).collect();
        let mut tiled = vec![vec![0.0f32; hd]; lens.len()];
        let mut outs: Vec<&mut [f32]> = tiled.iter_mut().map(|o| o.as_mut_slice()).collect();
        let mut scores = vec![0.0f32; lens.len() * longest];
        kv.attend_tile(&refs, &lens, 0, 1, &blocks, 0.125, &mut scores, &mut outs);
        for (j, &len) in lens.iter().enumerate() {
            let mut alone = vec![0.0f32; hd];
            kv.attend(
                &queries[j],
                1,
                &blocks,
                len,
                0.125,
                &mut vec![0.0; len],
                &mut alone,
            );
            assert_eq!(alone, tiled[j], "row {j}: tile and alone differ");
            let s: Vec<f64> = (0..len)
                .map(|t| {
                    (0..hd)
                        .map(|i| queries[j][i] as f64 * val(t, hd + i, 1) as f64)
                        .sum::<f64>()
                        * 0.125
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            for (i, &got) in tiled[j].iter().enumerate() {
                let want: f64 = (0..len)
                    .map(|t| (s[t] - m).exp() / z * val(t, hd + i, 5) as f64)
                    .sum();
                assert!(
                    (got as f64 - want).abs() < 1e-5,
                    "row {j} dim {i}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn attention_over_scattered_blocks_matches_a_dense_softmax() {
        let (bs, nkv, hd, len) = (4, 2, 8, 7);
        let blocks = [5, 2]; // the sequence lives in blocks 5 then 2
        let tok = |t: usize, h: usize, j: usize| ((t * 7 + h * 3 + j) % 11) as f32 * 0.1 - 0.5;
        let (mut k, mut v) = planes(
            6,
            bs,
            nkv,
            hd,
            &blocks,
            len,
            |t, i| tok(t, i / hd, i % hd),
            |t, i| tok(t, i / hd, i % hd) * 2.0 + 1.0,
        );
        let kv = view(&mut k, &mut v, bs, nkv, hd);
        let q: Vec<f32> = (0..hd).map(|j| j as f32 * 0.2 - 0.6).collect();
        let mut out = vec![0.0; hd];
        kv.attend(&q, 1, &blocks, len, 0.35, &mut vec![0.0; len], &mut out);
        let s: Vec<f64> = (0..len)
            .map(|t| (0..hd).map(|j| (q[j] * tok(t, 1, j)) as f64).sum::<f64>() * 0.35)
            .collect();
        let z: f64 = s.iter().map(|x| x.exp()).sum();
        for (j, &got) in out.iter().enumerate() {
            let want: f64 = (0..len)
                .map(|t| s[t].exp() / z * (tok(t, 1, j) * 2.0 + 1.0) as f64)
                .sum();
            assert!((got as f64 - want).abs() < 1e-5, "{j}: {got} vs {want}");
        }
    }

    #[test]
    fn a_tile_from_a_window_start_reads_only_the_window() {
        // Positions 3..11 of an 11-token sequence over scattered blocks (a sliding window of 8
        // for the token at position 10): the same as a dense softmax over those positions only.
        let (bs, nkv, hd, len, first) = (4, 1, 16, 11, 3);
        let blocks = [7, 1, 4];
        let tok = |t: usize, j: usize| ((t * 5 + j * 3) % 13) as f32 * 0.1 - 0.6;
        let (mut k, mut v) = planes(8, bs, nkv, hd, &blocks, len, tok, |t, j| tok(t, j) - 0.25);
        let kv = view(&mut k, &mut v, bs, nkv, hd);
        let q: Vec<f32> = (0..hd).map(|j| 0.3 - j as f32 * 0.05).collect();
        let mut out = vec![0.0; hd];
        let mut scores = vec![0.0; len];
        kv.attend_tile(
            &[&q],
            &[len - first],
            first,
            0,
            &blocks,
            0.5,
            &mut scores,
            &mut [&mut out],
        );
        let s: Vec<f64> = (first..len)
            .map(|t| (0..hd).map(|j| (q[j] * tok(t, j)) as f64).sum::<f64>() * 0.5)
            .collect();
        let z: f64 = s.iter().map(|x| x.exp()).sum();
        for (j, &got) in out.iter().enumerate() {
            let want: f64 = (first..len)
                .map(|t| s[t - first].exp() / z * (tok(t, j) - 0.25) as f64)
                .sum();
            assert!((got as f64 - want).abs() < 1e-5, "{j}: {got} vs {want}");
        }
    }
}
