//! `LayerKv::attend_tile` on AVX2 + FMA: the score dot products, the exponentials and the
//! weighted sum of v rows, 8 lanes at a time. A long prefill spends most of its attention in
//! these three loops (per query row and cached position: a 64-128 wide dot, one exp, a 64-128 wide
//! multiply-add); the portable loops run them 4 lanes wide without fused multiply-adds and call the
//! scalar exp once a position.
//!
//! Every row's result still depends on that row alone (its length and its values): a row's dot
//! products, exponentials (8 at a time, then the tail one by one) and sums run in an order fixed by
//! its length, so attention stays the same to the bit alone, batched, chunked and decoded. The
//! results differ in the last bits from the portable kernel's, as different machines' would.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Whether the AVX2 + FMA kernel runs here and was not switched off (`FERROX_CPU_KERNEL=portable`,
/// the variable the quantized matmuls read). Decided once per process.
pub(crate) fn enabled(head_dim: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| {
        let portable = std::env::var(super::simd::KERNEL_ENV).is_ok_and(|v| v == "portable");
        !portable && super::simd::Kernel::Avx2.available()
    });
    on && head_dim.is_multiple_of(8)
}

/// `LayerKv::attend_tile` 8 lanes wide: `at[t]` is position t's row offset in `k` and `v` (head_dim
/// floats each). Scores: 8 positions at a time per query row (its q held in registers, one
/// accumulator per position, summed across lanes together), a position past the last whole 8 of a
/// row's length one at a time; then the row's exponentials and sum (`exp_shifted`); then its output,
/// positions in order, 64 of them at a time so that their v rows stay in cache across the tile's rows.
///
/// # Safety
/// The CPU runs AVX2 and FMA (`enabled`); head_dim is a multiple of 8; every offset in `at` is a
/// row inside `k` and `v`; scores holds rows * max(lens); each query and out is head_dim long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn attend_tile(
    k: &[f32],
    v: &[f32],
    at: &[usize],
    head_dim: usize,
    queries: &[&[f32]],
    lens: &[usize],
    scale: f32,
    scores: &mut [f32],
    outs: &mut [&mut [f32]],
) {
    let longest = at.len();
    let (kp, vp) = (k.as_ptr(), v.as_ptr());
    let s8 = _mm256_set1_ps(scale);
    let mut t = 0;
    while t < longest {
        let n = (longest - t).min(8);
        for (j, q) in queries.iter().enumerate() {
            let len = lens[j];
            if t >= len {
                continue;
            }
            let row = scores.as_mut_ptr().add(j * longest + t);
            if n == 8 && t + 8 <= len {
                let dots = dot8(q, kp, &at[t..t + 8], head_dim);
                _mm256_storeu_ps(row, _mm256_mul_ps(dots, s8));
            } else {
                for u in 0..(len - t).min(n) {
                    *row.add(u) =
                        dot(q, std::slice::from_raw_parts(kp.add(at[t + u]), head_dim)) * scale;
                }
            }
        }
        t += 8;
    }
    let mut totals = [0.0f32; 64];
    let mut totals_vec = Vec::new();
    let totals: &mut [f32] = if queries.len() <= 64 {
        &mut totals[..queries.len()]
    } else {
        totals_vec.resize(queries.len(), 0.0);
        &mut totals_vec
    };
    for (j, total) in totals.iter_mut().enumerate() {
        let row = &mut scores[j * longest..j * longest + lens[j]];
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        *total = exp_shifted(row, max);
        outs[j].fill(0.0);
    }
    const BLOCK: usize = 64;
    let mut t0 = 0;
    while t0 < longest {
        for (j, out) in outs.iter_mut().enumerate() {
            let end = lens[j].min(t0 + BLOCK);
            if end <= t0 {
                continue;
            }
            let p = &scores[j * longest + t0..j * longest + end];
            let mut c = 0;
            while c + 64 <= head_dim {
                add_weighted::<8>(out.as_mut_ptr().add(c), vp.add(c), &at[t0..end], p);
                c += 64;
            }
            while c < head_dim {
                add_weighted::<1>(out.as_mut_ptr().add(c), vp.add(c), &at[t0..end], p);
                c += 8;
            }
        }
        t0 += BLOCK;
    }
    for (out, total) in outs.iter_mut().zip(totals.iter()) {
        let inv = 1.0 / total;
        out.iter_mut().for_each(|o| *o *= inv);
    }
}

/// out[0 .. 8R] += sum over i of p[i] * v[at[i] .. at[i] + 8R], positions in order, the 8R
/// outputs held in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn add_weighted<const R: usize>(out: *mut f32, v: *const f32, at: &[usize], p: &[f32]) {
    let mut acc = [_mm256_setzero_ps(); R];
    for (r, a) in acc.iter_mut().enumerate() {
        *a = _mm256_loadu_ps(out.add(8 * r));
    }
    for (&off, &w) in at.iter().zip(p) {
        let w = _mm256_set1_ps(w);
        for (r, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(w, _mm256_loadu_ps(v.add(off + 8 * r)), *a);
        }
    }
    for (r, a) in acc.iter().enumerate() {
        _mm256_storeu_ps(out.add(8 * r), *a);
    }
}

/// q . k for the 8 k rows at offsets `at`: one accumulator each, then summed across lanes together.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot8(q: &[f32], k: *const f32, at: &[usize], head_dim: usize) -> __m256 {
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut c = 0;
    while c < head_dim {
        let qv = _mm256_loadu_ps(q.as_ptr().add(c));
        for (u, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k.add(at[u] + c)), *a);
        }
        c += 8;
    }
    // Lane sums of the eight accumulators into one vector (position u in lane u).
    let h01 = _mm256_hadd_ps(acc[0], acc[1]);
    let h23 = _mm256_hadd_ps(acc[2], acc[3]);
    let h45 = _mm256_hadd_ps(acc[4], acc[5]);
    let h67 = _mm256_hadd_ps(acc[6], acc[7]);
    let h0123 = _mm256_hadd_ps(h01, h23);
    let h4567 = _mm256_hadd_ps(h45, h67);
    // h0123 = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low and high 128-bit halves), likewise h4567.
    let lo = _mm256_permute2f128_ps(h0123, h4567, 0x20);
    let hi = _mm256_permute2f128_ps(h0123, h4567, 0x31);
    _mm256_add_ps(lo, hi)
}

/// q . k over head_dim (a multiple of 8).
///
/// # Safety
/// The CPU runs AVX2 and FMA (`enabled`); both slices have the same length, a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 16 <= a.len() {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
        acc1 = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(i + 8)),
            _mm256_loadu_ps(pb.add(i + 8)),
            acc1,
        );
        i += 16;
    }
    if i < a.len() {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
    }
    hsum(_mm256_add_ps(acc0, acc1))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}

// exp(x) for x <= 0 (scores minus their maximum): x = n ln2 + r with |r| <= ln2 / 2, e^r by a
// degree-7 polynomial (its error is below float precision), 2^n through the exponent bits.
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4; // ln 2 split in two, so that n * LN2_HI is exact
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_MIN: f32 = -87.0; // below it e^x underflows; clamped there (e^-87 ~ 1.6e-38, nothing beside 1)
const P: [f32; 6] = [
    1.987_569_2e-4,
    1.398_2e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// The same exp, one value: the tail of a row whose length is not a multiple of 8.
fn exp_scalar(x: f32) -> f32 {
    let x = x.max(EXP_MIN);
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut y = P[0];
    for &c in &P[1..] {
        y = y.mul_add(r, c);
    }
    let y = y.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp8(x: __m256) -> __m256 {
    let x = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN));
    let n = _mm256_floor_ps(_mm256_fmadd_ps(
        x,
        _mm256_set1_ps(LOG2E),
        _mm256_set1_ps(0.5),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    let mut y = _mm256_set1_ps(P[0]);
    for &c in &P[1..] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    let y = _mm256_add_ps(
        _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r),
        _mm256_set1_ps(1.0),
    );
    let pow2 = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
        23,
    );
    _mm256_mul_ps(y, _mm256_castsi256_ps(pow2))
}

/// row[i] = exp(row[i] - max); returns their sum (8 lanes, then the tail in order).
///
/// # Safety
/// The CPU runs AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn exp_shifted(row: &mut [f32], max: f32) -> f32 {
    let p = row.as_mut_ptr();
    let m = _mm256_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    let whole = row.len() / 8 * 8;
    let mut i = 0;
    while i < whole {
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), m));
        _mm256_storeu_ps(p.add(i), e);
        acc = _mm256_add_ps(acc, e);
        i += 8;
    }
    let mut total = hsum(acc);
    for s in &mut row[whole..] {
        *s = exp_scalar(*s - max);
        total += *s;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std_within_float_precision() {
        for i in 0..20_000 {
            let x = -(i as f32) * 0.005; // 0 .. -100, clamped at EXP_MIN
            let (got, want) = (exp_scalar(x), x.max(EXP_MIN).exp());
            let tol = want.abs() * 3e-7 + 1e-38;
            assert!((got - want).abs() <= tol, "exp({x}): {got} vs {want}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_kernels_match_scalar_arithmetic() {
        if !super::super::simd::Kernel::Avx2.available() {
            return;
        }
        let a: Vec<f32> = (0..128)
            .map(|i| ((i * 37 % 19) as f32 - 9.0) * 0.13)
            .collect();
        let b: Vec<f32> = (0..128)
            .map(|i| ((i * 11 % 23) as f32 - 11.0) * 0.07)
            .collect();
        let want: f64 = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (*x as f64) * (*y as f64))
            .sum();
        // SAFETY: AVX2 and FMA checked above; equal lengths, multiples of 8.
        let got = unsafe { dot(&a, &b) };
        assert!((got as f64 - want).abs() < 1e-4, "{got} vs {want}");
        for len in [1, 7, 8, 9, 31, 64, 67] {
            let mut row: Vec<f32> = (0..len).map(|i| -(i as f32) * 0.37).collect();
            let want: Vec<f32> = row.iter().map(|&x| (x - 0.5).exp()).collect();
            // SAFETY: AVX2 and FMA checked above.
            let total = unsafe { exp_shifted(&mut row, 0.5) };
            for (g, w) in row.iter().zip(&want) {
                assert!((g - w).abs() <= w * 3e-7 + 1e-38, "{g} vs {w}");
            }
            assert!((total - want.iter().sum::<f32>()).abs() <= 1e-5 * total);
        }
    }
}
