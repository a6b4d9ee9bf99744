//! A stack of pre-norm decoder layers (Llama, Mistral, Qwen2, SmolLM2) run for a whole step: T
//! tokens of R requests, each request a prefill chunk or one decode token (the scheduler's flat
//! layout: request r owns tokens query_start_loc[r]..query_start_loc[r + 1], the last of its
//! seq_lens[r] positions).
//!
//! Every token's arithmetic depends on that token alone (its row's norm, int8 activations and
//! dot products; attention over its own causal prefix), never on the batch around it, so a
//! request's output is the same alone, batched, chunked or after a prefix-cache hit.
//!
//!   h += o_proj(attention(rotary(qkv_proj(rms_norm(h)))))
//!   h += down_proj(silu(gate) * up),  [gate | up] = gate_up_proj(rms_norm(h))
//!
//! h is the complete residual stream, updated in place (the residual adds ride in the matmuls'
//! epilogues); the model applies its final norm and LM head afterwards.

use std::sync::Arc;

use super::attention::LayerKv;
use super::ops::{rms_norm, rotary_neox, silu_and_mul};
use super::pool::{par_ranges, SharedOut};
use super::quant::QuantMatrix;

pub struct Projection {
    pub weight: Arc<QuantMatrix>,
    pub bias: Option<Vec<f32>>,
}

impl Projection {
    fn check(&self, what: &str, rows: usize, cols: usize) -> Result<(), String> {
        let (r, c) = (self.weight.rows(), self.weight.cols());
        if (r, c) != (rows, cols) {
            return Err(format!(
                "{what}: weight is {r}x{c}, the layer needs {rows}x{cols}"
            ));
        }
        match &self.bias {
            Some(b) if b.len() != rows => Err(format!(
                "{what}: bias has {} entries, needs {rows}",
                b.len()
            )),
            _ => Ok(()),
        }
    }

    fn apply(&self, x: &[f32], out: &mut [f32], accumulate: bool) {
        self.weight.matmul(x, out, self.bias.as_deref(), accumulate);
    }
}

pub struct DecoderLayer {
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub eps: f32,
    pub qkv: Projection,
    pub o: Projection,
    pub gate_up: Projection,
    pub down: Projection,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Sliding window (a token at p reads positions p - window < k <= p); 0: all before it.
    pub window: usize,
}

impl DecoderLayer {
    /// Checks that the shapes agree with each other and with the head counts.
    pub fn validate(&self) -> Result<(), String> {
        let hidden = self.input_norm.len();
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        if nh == 0 || nkv == 0 || !nh.is_multiple_of(nkv) || !hd.is_multiple_of(2) {
            return Err(format!(
                "heads: {nh} query, {nkv} kv heads of {hd} (query heads must be a multiple)"
            ));
        }
        if self.post_norm.len() != hidden {
            return Err(format!(
                "post_norm has {} entries, input_norm {hidden}",
                self.post_norm.len()
            ));
        }
        self.qkv.check("qkv_proj", (nh + 2 * nkv) * hd, hidden)?;
        self.o.check("o_proj", hidden, nh * hd)?;
        let inter2 = self.gate_up.weight.rows();
        if !inter2.is_multiple_of(2) {
            return Err(format!("gate_up_proj: {inter2} rows is not [gate | up]"));
        }
        self.gate_up.check("gate_up_proj", inter2, hidden)?;
        self.down.check("down_proj", hidden, inter2 / 2)
    }
}

/// What every layer reads about the step's tokens.
pub struct StepBatch<'a> {
    pub rope: &'a [f32],  // [T, head_dim]: [cos | sin] of each token's position
    pub slots: &'a [i64], // [T]: where each token's k/v go
    pub query_start_loc: &'a [i32], // [R + 1]: request r's tokens
    pub block_table: &'a [i32], // [R, block_stride]: each request's blocks
    pub block_stride: usize,
    pub seq_lens: &'a [i32], // [R]: each request's length after this step
}

/// Per token: its request and how many positions it attends to (its own included).
struct TokenPlan {
    request: Vec<usize>,
    context: Vec<usize>,
}

impl StepBatch<'_> {
    /// The step's indices, checked against the caches before anything is read or written.
    fn plan(&self, tokens: usize, head_dim: usize, kv: &LayerKv<'_>) -> Result<TokenPlan, String> {
        let capacity = kv.k.len() / (kv.num_kv_heads * kv.head_dim);
        let num_blocks = capacity / kv.block_size;
        let reqs = self.seq_lens.len();
        if self.rope.len() != tokens * head_dim || self.slots.len() != tokens {
            return Err(format!(
                "a {tokens}-token step needs {tokens} rope rows and slots"
            ));
        }
        if self.query_start_loc.len() != reqs + 1
            || self.query_start_loc.first() != Some(&0)
            || self.query_start_loc.last().map(|&n| n as usize) != Some(tokens)
        {
            return Err(format!(
                "query_start_loc must run from 0 to {tokens} over {reqs} requests"
            ));
        }
        if self.block_table.len() != reqs * self.block_stride {
            return Err(format!(
                "block_table: {} entries for {reqs} rows of {}",
                self.block_table.len(),
                self.block_stride
            ));
        }
        let mut plan = TokenPlan {
            request: Vec::with_capacity(tokens),
            context: Vec::with_capacity(tokens),
        };
        for r in 0..reqs {
            let (start, end, len) = (
                self.query_start_loc[r],
                self.query_start_loc[r + 1],
                self.seq_lens[r],
            );
            if end < start || len < end - start {
                return Err(format!(
                    "request {r}: {} query tokens, seq_len {len}",
                    end - start
                ));
            }
            let blocks = (len as usize).div_ceil(kv.block_size);
            if blocks > self.block_stride {
                return Err(format!(
                    "seq_lens[{r}] = {len} does not fit {} blocks",
                    self.block_stride
                ));
            }
            let row = &self.block_table[r * self.block_stride..r * self.block_stride + blocks];
            if let Some(b) = row.iter().find(|&&b| b < 0 || b as usize >= num_blocks) {
                return Err(format!(
                    "block_table row {r} names block {b}; the cache has {num_blocks}"
                ));
            }
            let first_pos = (len - (end - start)) as usize;
            for k in 0..(end - start) as usize {
                plan.request.push(r);
                plan.context.push(first_pos + k + 1);
            }
        }
        if let Some((i, s)) = self
            .slots
            .iter()
            .enumerate()
            .find(|(_, &s)| s < 0 || s as usize >= capacity)
        {
            return Err(format!(
                "slot_mapping[{i}] = {s} is outside the cache's {capacity} slots"
            ));
        }
        Ok(plan)
    }
}

/// Run `layers` over the residual stream h [T, hidden] in place. caches: one per layer.
pub fn decode_layers<L: std::borrow::Borrow<DecoderLayer>>(
    layers: &[L],
    h: &mut [f32],
    caches: &mut [LayerKv<'_>],
    batch: &StepBatch<'_>,
) -> Result<(), String> {
    if layers.len() != caches.len() {
        return Err(format!(
            "{} layers but {} KV caches",
            layers.len(),
            caches.len()
        ));
    }
    let Some(first) = layers.first() else {
        return Ok(());
    };
    let hidden = first.borrow().input_norm.len();
    if h.is_empty() || !h.len().is_multiple_of(hidden) {
        return Err(format!(
            "h has {} values, not whole rows of {hidden}",
            h.len()
        ));
    }
    let tokens = h.len() / hidden;
    // Every cache has the first one's geometry, so the step's indices are checked (and the token
    // plan built) once, against the first.
    let first_kv = &caches[0];
    for (layer, kv) in layers.iter().map(L::borrow).zip(caches.iter()) {
        if layer.input_norm.len() != hidden
            || (kv.num_kv_heads, kv.head_dim) != (layer.num_kv_heads, layer.head_dim)
            || (kv.k.len(), kv.v.len(), kv.block_size)
                != (first_kv.k.len(), first_kv.v.len(), first_kv.block_size)
        {
            return Err(
                "the layers and caches disagree on hidden size, kv heads or cache size".into(),
            );
        }
    }
    let plan = batch.plan(tokens, first.borrow().head_dim, first_kv)?;
    for (layer, kv) in layers.iter().map(L::borrow).zip(caches.iter_mut()) {
        layer_forward(layer, h, kv, batch, &plan);
    }
    Ok(())
}

fn norm_rows(h: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    for (x, o) in h.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        rms_norm(x, weight, eps, o);
    }
}

fn layer_forward(
    layer: &DecoderLayer,
    h: &mut [f32],
    kv: &mut LayerKv<'_>,
    batch: &StepBatch<'_>,
    plan: &TokenPlan,
) {
    let tokens = plan.request.len();
    let hidden = layer.input_norm.len();
    let (nh, nkv, hd) = (layer.num_heads, layer.num_kv_heads, layer.head_dim);
    let (q_w, kv_w) = (nh * hd, nkv * hd);
    let mut xn = vec![0.0f32; tokens * hidden];
    norm_rows(h, &layer.input_norm, layer.eps, &mut xn);
    let mut qkv = vec![0.0f32; tokens * (q_w + 2 * kv_w)];
    layer.qkv.apply(&xn, &mut qkv, false);
    for (i, row) in qkv.chunks_exact_mut(q_w + 2 * kv_w).enumerate() {
        let rope = &batch.rope[i * hd..(i + 1) * hd];
        let (qk, v) = row.split_at_mut(q_w + kv_w);
        rotary_neox(qk, hd, rope);
        kv.write(batch.slots[i] as usize, &qk[q_w..], v);
    }
    let mut attn = vec![0.0f32; tokens * q_w];
    attend_all(layer, kv, batch, plan, &qkv, &mut attn);
    layer.o.apply(&attn, h, true);
    norm_rows(h, &layer.post_norm, layer.eps, &mut xn);
    let inter = layer.gate_up.weight.rows() / 2;
    let mut gate_up = vec![0.0f32; tokens * 2 * inter];
    layer.gate_up.apply(&xn, &mut gate_up, false);
    let mut act = vec![0.0f32; tokens * inter];
    for (gu, a) in gate_up
        .chunks_exact(2 * inter)
        .zip(act.chunks_exact_mut(inter))
    {
        silu_and_mul(gu, a);
    }
    layer.down.apply(&act, h, true);
}

/// Consecutive tokens of one request attended together (with the query heads of one kv head):
/// each cached k and v row is read once for the tile, not once per token.
const QUERY_TILE: usize = 16;

/// Every (token, query head) pair's attention over the token's causal prefix, in tiles of up to
/// QUERY_TILE consecutive tokens of a request times the query heads that share a kv head, split
/// among the workers. All of the step's k/v are in the cache already; a token reads only positions
/// up to its own, so prefill chunks need no mask. A row's result does not depend on its tile
/// (LayerKv::attend_tile), so tiling changes no output.
fn attend_all(
    layer: &DecoderLayer,
    kv: &LayerKv<'_>,
    batch: &StepBatch<'_>,
    plan: &TokenPlan,
    qkv: &[f32],
    out: &mut [f32],
) {
    let (nh, nkv, hd) = (layer.num_heads, layer.num_kv_heads, layer.head_dim);
    let row_w = (nh + 2 * nkv) * hd;
    let group = nh / nkv;
    // Tiles never cross requests; the costliest (longest context) first, so the workers' last
    // pieces are small ones.
    // A windowed layer's tokens start reading at different positions: one token a tile (its query
    // heads share the start), which a window keeps cheap.
    let tile_len = if layer.window > 0 { 1 } else { QUERY_TILE };
    let mut tiles: Vec<(usize, usize)> = Vec::new();
    let mut i = 0;
    while i < plan.request.len() {
        let mut end = i + 1;
        while end < plan.request.len() && end - i < tile_len && plan.request[end] == plan.request[i]
        {
            end += 1;
        }
        tiles.push((i, end));
        i = end;
    }
    tiles.sort_by_key(|&(_, end)| std::cmp::Reverse(plan.context[end - 1]));
    let longest = plan.context.iter().copied().max().unwrap_or(0);
    let out_ptr = SharedOut(out.as_mut_ptr());
    par_ranges(tiles.len() * nkv, 1, |p0, p1| {
        let mut scores = vec![0.0f32; QUERY_TILE * group * longest];
        let mut lens = Vec::with_capacity(QUERY_TILE * group);
        let mut queries: Vec<&[f32]> = Vec::with_capacity(QUERY_TILE * group);
        for p in p0..p1 {
            let ((first, end), kv_head) = (tiles[p / nkv], p % nkv);
            let r = plan.request[first];
            let blocks = &batch.block_table[r * batch.block_stride..(r + 1) * batch.block_stride];
            lens.clear();
            queries.clear();
            // (a windowed tile is one token: its window's first position)
            let start = if layer.window > 0 {
                plan.context[first].saturating_sub(layer.window)
            } else {
                0
            };
            let mut outs: Vec<&mut [f32]> = Vec::with_capacity((end - first) * group);
            for i in first..end {
                for head in kv_head * group..(kv_head + 1) * group {
                    queries.push(&qkv[i * row_w + head * hd..i * row_w + (head + 1) * hd]);
                    lens.push(plan.context[i] - start);
                    let at = (i * nh + head) * hd;
                    // SAFETY: (token i, head) belongs to this tile and kv head alone, so only this
                    // task writes out[at .. at + hd].
                    outs.push(unsafe { std::slice::from_raw_parts_mut(out_ptr.at(at), hd) });
                }
            }
            kv.attend_tile(
                &queries,
                &lens,
                start,
                kv_head,
                blocks,
                layer.scale,
                &mut scores,
                &mut outs,
            );
        }
    });
}
