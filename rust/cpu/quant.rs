//! `QuantMatrix`: a weight matrix kept in groups of 32 columns, w = scale * q + offset, with q
//! 4 or 8 bits (every GGUF block format maps onto it: python/ferrox/layers/quant/gguf_blocks.py),
//! and its product with float activations.
//!
//! The product quantizes each activation row to int8 per group of 32 (scale = max|x| / 127, as
//! llama.cpp's Q8 activations) and takes integer dot products (`simd`). The product is exactly
//! w . x~ with x~ = d * xq the rounded activations: the offset term takes the sum of x~, never the
//! exact sum of x. Mixing the two (offset * sum(x) beside scale * d * idot) leaves the error
//! sum_k (w_k - offset) * (x~_k - x_k): q runs 0..15 above a group's minimum, so those terms do not
//! cancel as the centred w_k's do, and on the embedded SmolLM2 (Q4_1) it cost 5x the KL against
//! the float model (0.016 nats against 0.003; benches/RESULTS.md). Weight rows are split
//! among the pool's workers; each worker runs all activation rows against its weight rows, so a
//! weight byte is read from memory once per call however many rows the batch has.

use super::pool::{par_ranges, SharedOut};
use super::simd::{self, Dot4Fn, DotFn};

pub const GROUP: usize = 32;

pub struct QuantMatrix {
    rows: usize,
    cols: usize,
    bits: u32,
    q: Vec<u8>,
    scale: Vec<f32>,
    offset: Vec<f32>,
    dot: DotFn,
    dot4: Dot4Fn,
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "QuantMatrix({}x{}, {}-bit)",
            self.rows, self.cols, self.bits
        )
    }
}

/// One activation row as the dot products read it.
#[derive(Clone, Copy)]
pub struct ActRow<'a> {
    pub q: &'a [i8],
    pub d: &'a [f32],
    pub sum: &'a [f32],
}

/// Activation rows quantized to int8 per group of 32.
pub struct QuantizedActs {
    cols: usize,
    q: Vec<i8>,
    d: Vec<f32>,
    sum: Vec<f32>,
}

impl QuantizedActs {
    pub fn new(x: &[f32], cols: usize) -> Self {
        let groups = x.len() / GROUP;
        let mut acts = QuantizedActs {
            cols,
            q: vec![0; x.len()],
            d: vec![0.0; groups],
            sum: vec![0.0; groups],
        };
        for (g, (xg, qg)) in x
            .chunks_exact(GROUP)
            .zip(acts.q.chunks_exact_mut(GROUP))
            .enumerate()
        {
            let amax = xg.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut qsum = 0i32;
            for (q, v) in qg.iter_mut().zip(xg) {
                *q = (v * inv).round() as i8;
                qsum += *q as i32;
            }
            acts.d[g] = d;
            // The sum of the rounded activations, not of x: see the module doc.
            acts.sum[g] = d * qsum as f32;
        }
        acts
    }

    pub fn row(&self, i: usize) -> ActRow<'_> {
        let groups = self.cols / GROUP;
        ActRow {
            q: &self.q[i * self.cols..(i + 1) * self.cols],
            d: &self.d[i * groups..(i + 1) * groups],
            sum: &self.sum[i * groups..(i + 1) * groups],
        }
    }
}

impl QuantMatrix {
    /// q: unsigned values, one byte each, [rows, cols] (each below 2^bits); scale, offset:
    /// [rows, cols / 32]. `bits` 4 or 8.
    pub fn new(
        rows: usize,
        cols: usize,
        bits: u32,
        q: &[u8],
        scale: &[f32],
        offset: &[f32],
    ) -> Result<Self, String> {
        if bits != 4 && bits != 8 {
            return Err(format!("bits: {bits} (4 or 8)"));
        }
        if !cols.is_multiple_of(GROUP) || cols == 0 {
            return Err(format!(
                "cols: {cols} is not a positive multiple of {GROUP}"
            ));
        }
        let groups = rows * cols / GROUP;
        if q.len() != rows * cols || scale.len() != groups || offset.len() != groups {
            return Err(format!(
                "shapes: q has {} values, scale {}, offset {}; a {rows}x{cols} matrix needs {} and {groups}",
                q.len(),
                scale.len(),
                offset.len(),
                rows * cols
            ));
        }
        if let Some(bad) = q.iter().find(|&&v| bits == 4 && v > 15) {
            return Err(format!("q: value {bad} does not fit 4 bits"));
        }
        let (packed, offset) = if bits == 4 {
            let mut packed = Vec::with_capacity(q.len() / 2);
            for g in q.chunks_exact(GROUP) {
                packed.extend((0..16).map(|j| g[j] | (g[j + 16] << 4)));
            }
            (packed, offset.to_vec())
        } else {
            // Signed bytes q - 128 with the offset moved by 128 * scale: the same weights.
            let packed = q.iter().map(|&v| (v as i16 - 128) as i8 as u8).collect();
            (
                packed,
                offset
                    .iter()
                    .zip(scale)
                    .map(|(o, s)| o + 128.0 * s)
                    .collect(),
            )
        };
        let (dot, dot4) = simd::select(bits)?;
        Ok(QuantMatrix {
            rows,
            cols,
            bits,
            q: packed,
            scale: scale.to_vec(),
            offset,
            dot,
            dot4,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn bits(&self) -> u32 {
        self.bits
    }

    /// Bytes a product reads: the packed values, scales and offsets.
    pub fn nbytes(&self) -> usize {
        self.q.len() + 4 * (self.scale.len() + self.offset.len())
    }

    fn row_bytes(&self) -> usize {
        self.cols * self.bits as usize / 8
    }

    /// Use the portable dot products (tests compare them with the SIMD ones).
    pub fn use_portable_kernel(&mut self) {
        (self.dot, self.dot4) = simd::portable(self.bits);
    }

    /// The float weights [rows, cols], exactly the values the product multiplies by.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut w = vec![0.0f32; self.rows * self.cols];
        self.dequantize_into(&mut w);
        w
    }

    /// `dequantize` into `out` [rows, cols], rows split among the pool's workers.
    pub fn dequantize_into(&self, out: &mut [f32]) {
        assert_eq!(
            out.len(),
            self.rows * self.cols,
            "out must be [{}, {}]",
            self.rows,
            self.cols
        );
        let gb = GROUP * self.bits as usize / 8;
        let (cols, groups) = (self.cols, self.cols / GROUP);
        let out_ptr = SharedOut(out.as_mut_ptr());
        par_ranges(self.rows, 64, |r0, r1| {
            // SAFETY: rows r0..r1 of out belong to this task alone.
            let rows_out =
                unsafe { std::slice::from_raw_parts_mut(out_ptr.at(r0 * cols), (r1 - r0) * cols) };
            let first = r0 * groups;
            for (k, (qg, wg)) in self.q[first * gb..r1 * groups * gb]
                .chunks_exact(gb)
                .zip(rows_out.chunks_exact_mut(GROUP))
                .enumerate()
            {
                let (s, o) = (self.scale[first + k], self.offset[first + k]);
                if self.bits == 4 {
                    let (lo, hi) = wg.split_at_mut(16);
                    for ((l, h), &b) in lo.iter_mut().zip(hi.iter_mut()).zip(qg) {
                        *l = s * (b & 0x0F) as f32 + o;
                        *h = s * (b >> 4) as f32 + o;
                    }
                } else {
                    for (w, &b) in wg.iter_mut().zip(qg) {
                        *w = s * (b as i8) as f32 + o;
                    }
                }
            }
        });
    }

    /// out[i, r] = (out[i, r] if accumulate else 0) + x[i, :] . w[r, :] (+ bias[r]), for the m rows
    /// of x [m, cols]; out is [m, rows]. Call inside `pool::run` to use every worker.
    pub fn matmul(&self, x: &[f32], out: &mut [f32], bias: Option<&[f32]>, accumulate: bool) {
        assert_eq!(
            x.len() % self.cols,
            0,
            "x is not a whole number of {}-wide rows",
            self.cols
        );
        let m = x.len() / self.cols;
        assert_eq!(out.len(), m * self.rows, "out must be [{m}, {}]", self.rows);
        if let Some(b) = bias {
            assert_eq!(b.len(), self.rows, "bias must have {} entries", self.rows);
        }
        let acts = QuantizedActs::new(x, self.cols);
        let (groups, rb, rows) = (self.cols / GROUP, self.row_bytes(), self.rows);
        let out_ptr = SharedOut(out.as_mut_ptr());
        par_ranges(rows, 16, |r0, r1| {
            for r in r0..r1 {
                let q = &self.q[r * rb..(r + 1) * rb];
                let (s, o) = (
                    &self.scale[r * groups..(r + 1) * groups],
                    &self.offset[r * groups..(r + 1) * groups],
                );
                let b = bias.map_or(0.0, |b| b[r]);
                let store = |i: usize, v: f32| {
                    // SAFETY: i * rows + r < m * rows = out.len(), and only this task owns row r.
                    unsafe {
                        let p = out_ptr.at(i * rows + r);
                        let v = v + b;
                        *p = if accumulate { *p + v } else { v };
                    }
                };
                let mut i = 0;
                while i + 4 <= m {
                    let v = (self.dot4)(
                        q,
                        s,
                        o,
                        [
                            acts.row(i),
                            acts.row(i + 1),
                            acts.row(i + 2),
                            acts.row(i + 3),
                        ],
                    );
                    v.iter().enumerate().for_each(|(k, &v)| store(i + k, v));
                    i += 4;
                }
                for i in i..m {
                    store(i, (self.dot)(q, s, o, acts.row(i)));
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (no test dependency on rand).
    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32) / (1u64 << 31) as f32
    }

    fn random_matrix(rows: usize, cols: usize, bits: u32, seed: &mut u64) -> QuantMatrix {
        let top = (1u32 << bits) as f32;
        let q: Vec<u8> = (0..rows * cols)
            .map(|_| (lcg(seed) * top).min(top - 1.0) as u8)
            .collect();
        let groups = rows * cols / GROUP;
        let scale: Vec<f32> = (0..groups).map(|_| 0.01 + 0.05 * lcg(seed)).collect();
        let offset: Vec<f32> = (0..groups).map(|_| lcg(seed) - 0.5).collect();
        QuantMatrix::new(rows, cols, bits, &q, &scale, &offset).unwrap()
    }

    /// w . x~ in f64, x~ = d * xq the activations as the kernel rounds them, for each (i, r).
    fn reference(w: &QuantMatrix, x: &[f32]) -> Vec<f64> {
        let (rows, cols) = (w.rows(), w.cols());
        let acts = QuantizedActs::new(x, cols);
        let dense = w.dequantize();
        let m = x.len() / cols;
        let mut out = vec![0.0; m * rows];
        for i in 0..m {
            let a = acts.row(i);
            for r in 0..rows {
                out[i * rows + r] = (0..cols)
                    .map(|k| dense[r * cols + k] as f64 * a.d[k / GROUP] as f64 * a.q[k] as f64)
                    .sum::<f64>();
            }
        }
        out
    }

    #[test]
    fn simd_and_portable_products_match_the_dequantized_reference() {
        let mut seed = 7;
        for bits in [4, 8] {
            for (rows, cols, m) in [(37, 96, 1), (64, 576, 3), (5, 32, 2)] {
                let w = random_matrix(rows, cols, bits, &mut seed);
                let x: Vec<f32> = (0..m * cols).map(|_| lcg(&mut seed) * 4.0 - 2.0).collect();
                let want = reference(&w, &x);
                let mut portable = random_matrix(rows, cols, bits, &mut 7);
                portable.q.clone_from(&w.q);
                portable.scale.clone_from(&w.scale);
                portable.offset.clone_from(&w.offset);
                portable.use_portable_kernel();
                for (name, mat) in [("selected", &w), ("portable", &portable)] {
                    let mut out = vec![1.0f32; m * rows];
                    super::super::pool::run(|| mat.matmul(&x, &mut out, None, false));
                    for (k, (&o, &r)) in out.iter().zip(&want).enumerate() {
                        assert!(
                            (o as f64 - r).abs() < 1e-3 * (1.0 + r.abs()),
                            "{name} {bits}-bit {rows}x{cols} #{k}: {o} vs {r}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_row_gives_the_same_bits_alone_and_in_a_batch() {
        let mut seed = 5;
        for bits in [4, 8] {
            let w = random_matrix(40, 96, bits, &mut seed);
            let x: Vec<f32> = (0..9 * 96).map(|_| lcg(&mut seed) - 0.5).collect();
            let mut batch = vec![0.0f32; 9 * 40];
            w.matmul(&x, &mut batch, None, false);
            for i in 0..9 {
                let mut alone = vec![0.0f32; 40];
                w.matmul(&x[i * 96..(i + 1) * 96], &mut alone, None, false);
                assert_eq!(alone, batch[i * 40..(i + 1) * 40], "{bits}-bit row {i}");
            }
        }
    }

    /// Every kernel this CPU runs (AVX-512 VNNI, AVX2, portable), on group counts that leave
    /// every tail (1, 2, 3 groups, 16 + 1, 16 + 2 = 576 columns, 48 = 1536): each matches the
    /// dequantized reference, and a row's result has the same bits alone and in fours.
    #[test]
    fn every_kernel_matches_the_reference_and_batches_bit_identically() {
        let mut seed = 23;
        let kernels: Vec<_> = simd::Kernel::ALL
            .into_iter()
            .filter(|k| k.available())
            .collect();
        for bits in [4, 8] {
            for groups in [1, 2, 3, 4, 5, 15, 16, 17, 18, 33, 48] {
                let (rows, cols, m) = (6, groups * GROUP, 9);
                let mut w = random_matrix(rows, cols, bits, &mut seed);
                let x: Vec<f32> = (0..m * cols).map(|_| lcg(&mut seed) * 4.0 - 2.0).collect();
                let want = reference(&w, &x);
                for &kernel in &kernels {
                    let name = kernel.name();
                    (w.dot, w.dot4) = kernel.dots(bits);
                    let mut batch = vec![0.0f32; m * rows];
                    w.matmul(&x, &mut batch, None, false);
                    for (k, (&o, &r)) in batch.iter().zip(&want).enumerate() {
                        assert!(
                            (o as f64 - r).abs() < 1e-4 * (1.0 + r.abs()),
                            "{name} {bits}-bit {groups} groups #{k}: {o} vs {r}"
                        );
                    }
                    for i in 0..m {
                        let mut alone = vec![0.0f32; rows];
                        w.matmul(&x[i * cols..(i + 1) * cols], &mut alone, None, false);
                        assert_eq!(
                            alone,
                            batch[i * rows..(i + 1) * rows],
                            "{name} {bits}-bit {groups} groups row {i}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_kernel_variable_picks_a_kernel_or_names_itself() {
        let fastest = simd::Kernel::ALL.into_iter().find(|k| k.available());
        assert_eq!(simd::kernel_named(None).ok(), fastest);
        assert_eq!(
            simd::kernel_named(Some("portable")),
            Ok(simd::Kernel::Portable)
        );
        let err = simd::kernel_named(Some("avx3")).unwrap_err();
        assert!(
            err.contains(simd::KERNEL_ENV) && err.contains("avx2"),
            "{err}"
        );
    }

    #[test]
    fn accumulate_and_bias_add_to_the_output() {
        let mut seed = 3;
        let w = random_matrix(16, 64, 4, &mut seed);
        let x: Vec<f32> = (0..64).map(|_| lcg(&mut seed) - 0.5).collect();
        let bias: Vec<f32> = (0..16).map(|r| r as f32).collect();
        let mut plain = vec![0.0f32; 16];
        w.matmul(&x, &mut plain, None, false);
        let mut acc = vec![10.0f32; 16];
        w.matmul(&x, &mut acc, Some(&bias), true);
        for r in 0..16 {
            assert!((acc[r] - (10.0 + plain[r] + r as f32)).abs() < 1e-4);
        }
    }

    /// Q4_1-like groups (w = scale * q + offset, offset about -8 scales, so q sits 0..15 above a
    /// group's minimum): the product is the dequantized weights times the rounded activations to
    /// float precision, the offset term included. Taking the exact sum of x in the offset term
    /// instead (as this kernel once did) leaves offset * (sum x - d * sum xq) per group: ~0.01
    /// here, 500x the tolerance, and on the embedded SmolLM2 5x the KL of llama.cpp's products.
    #[test]
    fn offset_term_uses_the_rounded_activations() {
        let mut seed = 17;
        let (rows, cols) = (24, 576);
        for bits in [4, 8] {
            let top = (1u32 << bits) as f32;
            let q: Vec<u8> = (0..rows * cols)
                .map(|_| (lcg(&mut seed) * top).min(top - 1.0) as u8)
                .collect();
            let scale: Vec<f32> = (0..rows * cols / GROUP)
                .map(|_| 0.01 + 0.02 * lcg(&mut seed))
                .collect();
            let offset: Vec<f32> = scale.iter().map(|s| -(top / 2.0) * s).collect();
            let w = QuantMatrix::new(rows, cols, bits, &q, &scale, &offset).unwrap();
            let x: Vec<f32> = (0..2 * cols).map(|_| lcg(&mut seed) * 2.0 - 1.0).collect();
            let want = reference(&w, &x);
            let mut portable = QuantMatrix::new(rows, cols, bits, &q, &scale, &offset).unwrap();
            portable.use_portable_kernel();
            for (name, mat) in [("selected", &w), ("portable", &portable)] {
                let mut out = vec![0.0f32; 2 * rows];
                mat.matmul(&x, &mut out, None, false);
                for (k, (&o, &r)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (o as f64 - r).abs() < 2e-5,
                        "{name} {bits}-bit #{k}: {o} vs {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn int8_activations_stay_close_to_the_float_product() {
        let mut seed = 11;
        let w = random_matrix(8, 256, 8, &mut seed);
        let x: Vec<f32> = (0..256).map(|_| lcg(&mut seed) * 2.0 - 1.0).collect();
        let dense = w.dequantize();
        let mut out = vec![0.0f32; 8];
        w.matmul(&x, &mut out, None, false);
        for r in 0..8 {
            let exact: f32 = (0..256).map(|k| dense[r * 256 + k] * x[k]).sum();
            let norm: f32 = (0..256).map(|k| (dense[r * 256 + k] * x[k]).abs()).sum();
            assert!(
                (out[r] - exact).abs() <= 0.01 * norm,
                "{r}: {} vs {exact}",
                out[r]
            );
        }
    }

    #[test]
    fn bad_shapes_and_values_are_refused_by_name() {
        assert!(QuantMatrix::new(1, 30, 4, &[0; 30], &[1.0], &[0.0])
            .unwrap_err()
            .contains("cols"));
        assert!(QuantMatrix::new(1, 32, 4, &[16; 32], &[1.0], &[0.0])
            .unwrap_err()
            .contains("4 bits"));
        assert!(QuantMatrix::new(1, 32, 5, &[0; 32], &[1.0], &[0.0])
            .unwrap_err()
            .contains("bits"));
        assert!(QuantMatrix::new(2, 32, 8, &[0; 32], &[1.0], &[0.0])
            .unwrap_err()
            .contains("shapes"));
    }
}
