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
//! Three kernels (`Kernel`): AVX-512 VNNI (`vpdpbusd`, several groups a 512-bit register; the
//! default where the CPU has it: on the 2-core Zen 4 box 1.1-2x the AVX2 kernel on the products,
//! end to end ~1.05x a single decode stream, which is memory-bound, ~1.15x eight streams, ~1.09x
//! prefill), AVX2 + FMA, and portable Rust. `FERROX_CPU_KERNEL` picks one.
//!
//! 4-bit rows hold 16 bytes a group: byte j's low nibble is column j, its high nibble column
//! j + 16 (llama.cpp's Q4_0/Q4_1 order). 8-bit rows hold signed bytes (q - 128, the offset
//! shifted to match), because `maddubs` needs one unsigned side: |w| times x with w's sign (the
//! AVX-512 kernel takes w + 128 instead, see `x86_512`).

use super::quant::ActRow;

pub(crate) type DotFn = fn(&[u8], &[f32], &[f32], ActRow<'_>) -> f32;
/// Four activation rows against one weight row: the weight bytes are unpacked once for the four.
/// Each row's result is bit-identical to `DotFn`'s (same operations in the same order), so a
/// token's output does not depend on how many rows share its matmul.
pub(crate) type Dot4Fn = fn(&[u8], &[f32], &[f32], [ActRow<'_>; 4]) -> [f32; 4];

/// The environment variable that picks the kernel (`avx512`, `avx2` or `portable`), read by each
/// `select`: a benchmark can build one matrix with each in one process. Unset: the fastest here.
pub(crate) const KERNEL_ENV: &str = "FERROX_CPU_KERNEL";

/// The dot-product kernels, fastest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// AVX-512 VNNI (`vpdpbusd`): four groups of 4-bit or two of 8-bit weights a 512-bit step.
    Avx512,
    /// AVX2 + FMA (`maddubs` + `madd`): one group a 256-bit step.
    Avx2,
    Portable,
}

impl Kernel {
    pub(crate) const ALL: [Kernel; 3] = [Kernel::Avx512, Kernel::Avx2, Kernel::Portable];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Kernel::Avx512 => "avx512",
            Kernel::Avx2 => "avx2",
            Kernel::Portable => "portable",
        }
    }

    /// Whether this CPU runs it.
    pub(crate) fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            match self {
                Kernel::Avx512 => has!("avx512f") && has!("avx512bw") && has!("avx512vnni"),
                Kernel::Avx2 => has!("avx2") && has!("fma"),
                Kernel::Portable => true,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Kernel::Portable
        }
    }

    /// Its dot products for `bits`-bit rows. Panics if this CPU does not run it.
    pub(crate) fn dots(self, bits: u32) -> (DotFn, Dot4Fn) {
        assert!(
            self.available(),
            "this CPU cannot run the {} kernel",
            self.name()
        );
        #[cfg(target_arch = "x86_64")]
        match (self, bits) {
            (Kernel::Avx512, 4) => return (x86_512::dot4, x86_512::dot4_rows4),
            (Kernel::Avx512, _) => return (x86_512::dot8, x86_512::dot8_rows4),
            (Kernel::Avx2, 4) => return (x86::dot4, x86::dot4_rows4),
            (Kernel::Avx2, _) => return (x86::dot8, x86::dot8_rows4),
            (Kernel::Portable, _) => {}
        }
        portable(bits)
    }
}

/// The kernel `FERROX_CPU_KERNEL` names, else the fastest this CPU runs.
pub(crate) fn select(bits: u32) -> Result<(DotFn, Dot4Fn), String> {
    let kernel = match std::env::var(KERNEL_ENV) {
        Ok(v) => kernel_named(Some(&v)),
        Err(std::env::VarError::NotPresent) => kernel_named(None),
        Err(e) => Err(format!("{KERNEL_ENV}: {e}")),
    }?;
    Ok(kernel.dots(bits))
}

/// The kernel of that name (None: the fastest this CPU runs), or why not.
pub(crate) fn kernel_named(name: Option<&str>) -> Result<Kernel, String> {
    let Some(name) = name else {
        return Ok(Kernel::ALL
            .into_iter()
            .find(|k| k.available())
            .unwrap_or(Kernel::Portable));
    };
    let names = Kernel::ALL.map(Kernel::name).join(", ");
    let kernel = Kernel::ALL
        .into_iter()
        .find(|k| k.name() == name)
        .ok_or_else(|| format!("{KERNEL_ENV}={name:?}: not one of {names}"))?;
    if !kernel.available() {
        return Err(format!("{KERNEL_ENV}={name}: this CPU cannot run it"));
    }
    Ok(kernel)
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

/// The four entry points of a SIMD module (`DotFn` / `Dot4Fn` for 4- and 8-bit rows) over its
/// `unsafe fn dot_rows::<BITS, ROWS>`.
macro_rules! row_entry_points {
    () => {
        pub(super) fn dot4(q: &[u8], scale: &[f32], offset: &[f32], x: ActRow<'_>) -> f32 {
            debug_assert!(q.len() == scale.len() * 16 && x.q.len() == scale.len() * 32);
            // SAFETY: `Kernel::dots` hands these out only where the CPU has this module's target
            // features (`Kernel::available`); lengths as asserted.
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
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::ActRow;

    row_entry_points!();

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

/// AVX-512 VNNI: `vpdpbusd` sums four u8 x s8 products into each 32-bit lane, so one instruction
/// takes 64 weight-activation pairs. Floats come 16 groups at a time: one multiply gives
/// scale_g * d_g for 16 groups, and a lane permute spreads each over its group's lanes.
///
/// 4-bit: a step is four groups, 64 bytes of nibbles; the low nibbles (columns 0..15 of each
/// group) and the high ones (16..31) are two registers, and two 128-bit lane shuffles of the
/// activations give the matching halves, so both `vpdpbusd` add into one register whose 128-bit
/// lane g holds group g's four partial sums (nibbles are unsigned, the activations signed: the
/// operand types `vpdpbusd` wants).
///
/// 8-bit: a step is two groups, 64 signed bytes w. `vpdpbusd` needs the weights unsigned, so it
/// takes w + 128 (the original q, one xor) and the 128 * scale * d * sum(xq) = 128 * scale * xsum
/// this adds moves into the offset term, whose offset becomes offset - 128 * scale again.
#[cfg(target_arch = "x86_64")]
mod x86_512 {
    use std::arch::x86_64::*;

    use super::ActRow;

    row_entry_points!();

    /// The first `n` bits set.
    #[inline]
    fn mask(n: usize) -> u64 {
        if n >= 64 {
            !0
        } else {
            (1 << n) - 1
        }
    }

    /// 64 bytes at `p`, only the first `n` when `n` < 64 (the rest read as zeros, and not read:
    /// `p` may point at the end of a slice).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load(p: *const u8, n: usize) -> __m512i {
        if n >= 64 {
            _mm512_loadu_si512(p as *const __m512i)
        } else {
            _mm512_maskz_loadu_epi8(mask(n), p as *const i8)
        }
    }

    /// ROWS activation rows against one weight row, 16 groups a block. Per row: two
    /// accumulators (alternate steps), the offsets term added into the second at each block's
    /// start, summed at the end: the same operations whatever ROWS is.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn dot_rows<const BITS: usize, const ROWS: usize>(
        q: &[u8],
        scale: &[f32],
        offset: &[f32],
        xs: [ActRow<'_>; ROWS],
    ) -> [f32; ROWS] {
        let n = scale.len();
        let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
        let mut g = 0;
        while g + 16 <= n {
            block::<BITS, ROWS, true>(q, scale, offset, &xs, g, 16, &mut acc);
            g += 16;
        }
        if g < n {
            block::<BITS, ROWS, false>(q, scale, offset, &xs, g, n - g, &mut acc);
        }
        let mut out = [0.0f32; ROWS];
        for r in 0..ROWS {
            out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
        }
        out
    }

    /// Groups g..g + k (k = 16 when FULL, else 1..=16; groups past k read as zeros).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn block<const BITS: usize, const ROWS: usize, const FULL: bool>(
        q: &[u8],
        scale: &[f32],
        offset: &[f32],
        xs: &[ActRow<'_>; ROWS],
        g: usize,
        k: usize,
        acc: &mut [[__m512; 2]; ROWS],
    ) {
        let k = if FULL { 16 } else { k };
        let m = mask(k) as __mmask16;
        let s = _mm512_maskz_loadu_ps(m, scale.as_ptr().add(g));
        let mut o = _mm512_maskz_loadu_ps(m, offset.as_ptr().add(g));
        if BITS == 8 {
            o = _mm512_fnmadd_ps(_mm512_set1_ps(128.0), s, o);
        }
        let mut sd = [_mm512_setzero_ps(); ROWS];
        for r in 0..ROWS {
            let x = xs[r];
            sd[r] = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, x.d.as_ptr().add(g)));
            let xsum = _mm512_maskz_loadu_ps(m, x.sum.as_ptr().add(g));
            acc[r][1] = _mm512_fmadd_ps(o, xsum, acc[r][1]);
        }
        // Groups a step, and lane i's group within it: 4-bit i / 4, 8-bit i / 8.
        let (per, lanes) = if BITS == 4 {
            (
                4,
                _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
            )
        } else {
            (
                2,
                _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
            )
        };
        let mut t = 0;
        while t < k {
            let here = (k - t).min(per);
            let gt = g + t;
            let idx = _mm512_add_epi32(lanes, _mm512_set1_epi32(t as i32));
            let slot = (t / per) & 1;
            if BITS == 4 {
                let raw = load(q.as_ptr().wrapping_add(gt * 16), 16 * here);
                let nib = _mm512_set1_epi8(0x0F);
                let lo = _mm512_and_si512(raw, nib);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), nib);
                for r in 0..ROWS {
                    let xp = xs[r].q.as_ptr().wrapping_add(gt * 32) as *const u8;
                    let x0 = load(xp, 32 * here);
                    let x1 = load(xp.wrapping_add(64), (32 * here).saturating_sub(64));
                    // Lane l: group l's columns 0..15 (x0 lanes 0, 2; x1 lanes 0, 2), 16..31.
                    let xlo = _mm512_shuffle_i64x2::<0x88>(x0, x1);
                    let xhi = _mm512_shuffle_i64x2::<0xDD>(x0, x1);
                    let i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo);
                    let i = _mm512_dpbusd_epi32(i, hi, xhi);
                    let f = _mm512_permutexvar_ps(idx, sd[r]);
                    acc[r][slot] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), f, acc[r][slot]);
                }
            } else {
                let raw = load(q.as_ptr().wrapping_add(gt * 32), 32 * here);
                let u = _mm512_xor_si512(raw, _mm512_set1_epi8(-128));
                for r in 0..ROWS {
                    let xp = xs[r].q.as_ptr().wrapping_add(gt * 32) as *const u8;
                    let i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, load(xp, 32 * here));
                    let f = _mm512_permutexvar_ps(idx, sd[r]);
                    acc[r][slot] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), f, acc[r][slot]);
                }
            }
            t += per;
        }
    }
}
