//! Row dot products of a quantized weight row with an int8-quantized activation row.
//!
//! Both sides are integers within each group of 32 columns, so a group's dot product is exact
//! integer arithmetic (AVX2 `maddubs` + `madd`: unsigned 8-bit x signed 8-bit pairs summed into
//! 32-bit lanes), and floats enter once per group:
//!
//!   row . x = sum_g  scale_g * d_g * idot_g  +  offset_g * xsum_g
//!
//! with w = scale_g * q + offset_g (the weight's groups) and x ~ d_g * xq (the activation's),
//! xsum_g = d_g * sum(xq) the sum of the rounded activations over the group, so that the result
//! is w . (d * xq) whole (quant.rs says why not the exact sum of x).
//!
//! 4-bit rows hold 16 bytes a group: byte j's low nibble is column j, its high nibble column
//! j + 16 (llama.cpp's Q4_0/Q4_1 order). 8-bit rows hold signed bytes (q - 128, the offset
//! shifted to match), because `maddubs` needs one unsigned side: |w| times x with w's sign.

use super::quant::ActRow;

pub(crate) type DotFn = fn(&[u8], &[f32], &[f32], ActRow<'_>) -> f32;
/// Four activation rows against one weight row: the weight bytes are unpacked once for the four.
/// Each row's result is bit-identical to `DotFn`'s (same operations in the same order), so a
/// token's output does not depend on how many rows share its matmul.
pub(crate) type Dot4Fn = fn(&[u8], &[f32], &[f32], [ActRow<'_>; 4]) -> [f32; 4];

/// The fastest dot products this CPU runs: AVX2 + FMA where present, else portable Rust.
pub(crate) fn select(bits: u32) -> (DotFn, Dot4Fn) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        return if bits == 4 {
            (x86::dot4, x86::dot4_rows4)
        } else {
            (x86::dot8, x86::dot8_rows4)
        };
    }
    portable(bits)
}

pub(crate) fn portable(bits: u32) -> (DotFn, Dot4Fn) {
    if bits == 4 {
        (dot4_portable, |q, s, o, x| {
            x.map(|r| dot4_portable(q, s, o, r))
        })
    } else {
        (dot8_portable, |q, s, o, x| {
            x.map(|r| dot8_portable(q, s, o, r))
        })
    }
}

fn offsets_dot(offset: &[f32], xsum: &[f32]) -> f32 {
    offset.iter().zip(xsum).map(|(o, s)| o * s).sum()
}

fn dot4_portable(q: &[u8], scale: &[f32], offset: &[f32], x: ActRow<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (g, (qg, xg)) in q.chunks_exact(16).zip(x.q.chunks_exact(32)).enumerate() {
        let mut idot = 0i32;
        for j in 0..16 {
            idot += (qg[j] & 0x0F) as i32 * xg[j] as i32 + (qg[j] >> 4) as i32 * xg[j + 16] as i32;
        }
        acc += scale[g] * x.d[g] * idot as f32;
    }
    acc + offsets_dot(offset, x.sum)
}

fn dot8_portable(q: &[u8], scale: &[f32], offset: &[f32], x: ActRow<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (g, (qg, xg)) in q.chunks_exact(32).zip(x.q.chunks_exact(32)).enumerate() {
        let idot: i32 = qg
            .iter()
            .zip(xg)
            .map(|(&w, &v)| (w as i8) as i32 * v as i32)
            .sum();
        acc += scale[g] * x.d[g] * idot as f32;
    }
    acc + offsets_dot(offset, x.sum)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::ActRow;

    pub(super) fn dot4(q: &[u8], scale: &[f32], offset: &[f32], x: ActRow<'_>) -> f32 {
        debug_assert!(q.len() == scale.len() * 16 && x.q.len() == scale.len() * 32);
        // SAFETY: chosen by `select` only when AVX2 and FMA are present; lengths as asserted.
        let [v] = unsafe { dot_rows::<4, 1>(q, scale, offset, [x]) };
        v
    }

    pub(super) fn dot8(q: &[u8], scale: &[f32], offset: &[f32], x: ActRow<'_>) -> f32 {
        debug_assert!(q.len() == scale.len() * 32 && x.q.len() == scale.len() * 32);
        // SAFETY: as dot4.
        let [v] = unsafe { dot_rows::<8, 1>(q, scale, offset, [x]) };
        v
    }

    pub(super) fn dot4_rows4(
        q: &[u8],
        scale: &[f32],
        offset: &[f32],
        x: [ActRow<'_>; 4],
    ) -> [f32; 4] {
        // SAFETY: as dot4.
        unsafe { dot_rows::<4, 4>(q, scale, offset, x) }
    }

    pub(super) fn dot8_rows4(
        q: &[u8],
        scale: &[f32],
        offset: &[f32],
        x: [ActRow<'_>; 4],
    ) -> [f32; 4] {
        // SAFETY: as dot4.
        unsafe { dot_rows::<8, 4>(q, scale, offset, x) }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn offsets(offset: &[f32], xsum: &[f32]) -> f32 {
        let n = offset.len();
        let mut acc = _mm256_setzero_ps();
        let mut g = 0;
        while g + 8 <= n {
            acc = _mm256_fmadd_ps(
                _mm256_loadu_ps(offset.as_ptr().add(g)),
                _mm256_loadu_ps(xsum.as_ptr().add(g)),
                acc,
            );
            g += 8;
        }
        let mut total = hsum(acc);
        while g < n {
            total += offset[g] * xsum[g];
            g += 1;
        }
        total
    }

    /// A group's weights as 32 bytes. 4-bit: 16 bytes of nibbles, the low lane the low nibbles
    /// (columns 0..15), the high lane the high ones (16..31). 8-bit: the signed bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn unpack<const BITS: usize>(q: *const u8) -> __m256i {
        if BITS == 4 {
            let raw = _mm_loadu_si128(q as *const __m128i);
            let both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
            _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
        } else {
            _mm256_loadu_si256(q as *const __m256i)
        }
    }

    /// 32 weight bytes against 32 int8 activations -> 8 int32 partial sums.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn group<const BITS: usize>(w: __m256i, x: *const i8) -> __m256i {
        let xv = _mm256_loadu_si256(x as *const __m256i);
        let p = if BITS == 4 {
            _mm256_maddubs_epi16(w, xv) // nibbles are unsigned already
        } else {
            // |w| (unsigned) times x carrying w's sign: maddubs wants its first operand unsigned.
            // |w| <= 128 and |x| <= 127, so a pair sums to at most 32512: no saturation.
            _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w))
        };
        _mm256_madd_epi16(p, _mm256_set1_epi16(1))
    }

    /// ROWS activation rows against one weight row. Per row: two accumulators (even and odd
    /// groups, so consecutive FMAs do not wait on each other), summed at the end, plus the
    /// offsets term: the same operations whatever ROWS is.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_rows<const BITS: usize, const ROWS: usize>(
        q: &[u8],
        scale: &[f32],
        offset: &[f32],
        xs: [ActRow<'_>; ROWS],
    ) -> [f32; ROWS] {
        let n = scale.len();
        let gb = 32 * BITS / 8;
        let qp = q.as_ptr();
        let mut a0 = [_mm256_setzero_ps(); ROWS];
        let mut a1 = [_mm256_setzero_ps(); ROWS];
        let mut g = 0;
        while g + 2 <= n {
            let (w0, w1) = (
                unpack::<BITS>(qp.add(g * gb)),
                unpack::<BITS>(qp.add((g + 1) * gb)),
            );
            let (s0, s1) = (*scale.get_unchecked(g), *scale.get_unchecked(g + 1));
            for r in 0..ROWS {
                let x = xs[r];
                let p0 = group::<BITS>(w0, x.q.as_ptr().add(g * 32));
                let p1 = group::<BITS>(w1, x.q.as_ptr().add((g + 1) * 32));
                a0[r] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(p0),
                    _mm256_set1_ps(s0 * *x.d.get_unchecked(g)),
                    a0[r],
                );
                a1[r] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(p1),
                    _mm256_set1_ps(s1 * *x.d.get_unchecked(g + 1)),
                    a1[r],
                );
            }
            g += 2;
        }
        if g < n {
            let w0 = unpack::<BITS>(qp.add(g * gb));
            let s0 = *scale.get_unchecked(g);
            for r in 0..ROWS {
                let x = xs[r];
                let p0 = group::<BITS>(w0, x.q.as_ptr().add(g * 32));
                a0[r] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(p0),
                    _mm256_set1_ps(s0 * *x.d.get_unchecked(g)),
                    a0[r],
                );
            }
        }
        let mut out = [0.0f32; ROWS];
        for r in 0..ROWS {
            out[r] = hsum(_mm256_add_ps(a0[r], a1[r])) + offsets(offset, xs[r].sum);
        }
        out
    }
}
