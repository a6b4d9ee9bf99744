//! The paged KV cache of one layer on the CPU and single-query attention over it.
//!
//! Layout (python/ferrox/attention/backend.py): [2, num_blocks, block_size, num_kv_heads,
//! head_dim] float32, K plane then V plane; a token at slot s (= block * block_size + offset)
//! keeps head g's vector at s * num_kv_heads + g.

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
        let hd = self.head_dim;
        let slot = |t: usize| {
            block_ids[t / self.block_size] as usize * self.block_size + t % self.block_size
        };
        let mut max = f32::NEG_INFINITY;
        for (t, s) in scores[..seq_len].iter_mut().enumerate() {
            let at = self.row(slot(t), kv_head);
            *s = dot(q, &self.k[at..at + hd]) * scale;
            max = max.max(*s);
        }
        let mut total = 0.0f32;
        for s in scores[..seq_len].iter_mut() {
            *s = (*s - max).exp();
            total += *s;
        }
        out.fill(0.0);
        for (t, &p) in scores[..seq_len].iter().enumerate() {
            let at = self.row(slot(t), kv_head);
            for (o, v) in out.iter_mut().zip(&self.v[at..at + hd]) {
                *o += p * v;
            }
        }
        let inv = 1.0 / total;
        out.iter_mut().for_each(|o| *o *= inv);
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

    #[test]
    fn attention_over_scattered_blocks_matches_a_dense_softmax() {
        let (bs, nkv, hd, len) = (4, 2, 8, 7);
        let mut k = vec![0.0f32; 6 * bs * nkv * hd];
        let mut v = k.clone();
        let mut kv = LayerKv {
            k: &mut k,
            v: &mut v,
            block_size: bs,
            num_kv_heads: nkv,
            head_dim: hd,
        };
        let blocks = [5, 2]; // the sequence lives in blocks 5 then 2
        let tok = |t: usize, h: usize, j: usize| ((t * 7 + h * 3 + j) % 11) as f32 * 0.1 - 0.5;
        for t in 0..len {
            let kt: Vec<f32> = (0..nkv * hd).map(|i| tok(t, i / hd, i % hd)).collect();
            let vt: Vec<f32> = kt.iter().map(|x| x * 2.0 + 1.0).collect();
            kv.write(blocks[t / bs] as usize * bs + t % bs, &kt, &vt);
        }
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
}
