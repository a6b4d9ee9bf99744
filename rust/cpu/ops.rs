//! The small per-token ops of a decoder layer, in float32 (the CPU model's dtype), written so the
//! compiler vectorizes them.

/// out = x / sqrt(mean(x^2) + eps) * weight, for one row.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    // Eight partial sums: vectorizable, and closer to torch's pairwise sum than one running sum.
    let mut parts = [0.0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for c in chunks {
        for (p, v) in parts.iter_mut().zip(c) {
            *p += v * v;
        }
    }
    let ss = parts.iter().sum::<f32>() + tail;
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * inv * w;
    }
}

/// out = silu(gate) * up for one row of [gate | up].
pub fn silu_and_mul(gate_up: &[f32], out: &mut [f32]) {
    let (gate, up) = gate_up.split_at(out.len());
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

/// Rotate each head of `x` (heads * head_dim) in place, NeoX layout: pair (i, i + head_dim/2)
/// turned by angle i; `cos_sin` = [cos | sin] of the position's angles (head_dim/2 each).
pub fn rotary_neox(x: &mut [f32], head_dim: usize, cos_sin: &[f32]) {
    let half = head_dim / 2;
    let (cos, sin) = cos_sin.split_at(half);
    for head in x.chunks_exact_mut(head_dim) {
        let (a, b) = head.split_at_mut(half);
        for i in 0..half {
            let (x1, x2) = (a[i], b[i]);
            a[i] = x1 * cos[i] - x2 * sin[i];
            b[i] = x2 * cos[i] + x1 * sin[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_the_formula() {
        let x: Vec<f32> = (0..37).map(|i| (i as f32 - 11.0) * 0.37).collect();
        let w: Vec<f32> = (0..37).map(|i| 1.0 + i as f32 * 0.01).collect();
        let mut out = vec![0.0; 37];
        rms_norm(&x, &w, 1e-5, &mut out);
        let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / 37.0;
        for i in 0..37 {
            let want = x[i] as f64 / (ms + 1e-5).sqrt() * w[i] as f64;
            assert!(
                (out[i] as f64 - want).abs() < 1e-5,
                "{i}: {} vs {want}",
                out[i]
            );
        }
    }

    #[test]
    fn rotary_turns_pairs_and_keeps_their_norm() {
        let mut x = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let (c, s) = (0.6f32, 0.8f32);
        rotary_neox(&mut x, 4, &[c, 1.0, s, 0.0]);
        // Head 0: pairs (x0, x2) by angle 0 (cos .6, sin .8), (x1, x3) by angle 1 (identity).
        assert_eq!(x[..4], [1.0 * c - 3.0 * s, 2.0, 3.0 * c + 1.0 * s, 4.0]);
        assert!(((x[4] * x[4] + x[6] * x[6]) - (25.0 + 49.0)).abs() < 1e-4);
    }

    #[test]
    fn silu_and_mul_of_a_row() {
        let mut out = [0.0f32; 2];
        silu_and_mul(&[0.0, 2.0, 3.0, 5.0], &mut out);
        assert_eq!(out[0], 0.0);
        assert!((out[1] - 2.0 / (1.0 + (-2.0f32).exp()) * 5.0).abs() < 1e-6);
    }
}
