// Decode products (1-8 tokens) with row-major weights on tensor cores, compiled at run time by NVRTC:
// python/ferrox/kernels/dense_gemv_cuda.py builds it and says when it runs instead of the Triton GEMVs
// (gemv.py for bf16 / fp16 weights, w8a8_dot_gemv.py for FP8 W8A8).
//
// Why: a decode step reads each weight once, so a product should cost its weight bytes over the read
// bandwidth. The Triton GEMVs widen every weight on CUDA cores (an fp8 byte: two conversions before its
// FMA) or, for FP8 W8A8, run Hopper's warpgroup MMA over 64-128-row programs that need split-K and a
// second reduction to fill 132 SMs. Here a block owns 16 output rows and one mma.sync takes the weights
// as they lie in memory: bf16 / fp16 weights through m16n8k16 against the 16-bit activations, E4M3
// weights through m16n8k32 against the token's fp8 codes (quantized in the prologue, as vLLM's W8A8
// layers quantize every input). Nothing is converted per weight and nothing is repacked: the layer's
// own [N, K] weight is read.
//
// The fragment trick. A lane (g = lane / 4, t = lane % 4) holds A elements of rows g and g + 8 only,
// 8 bytes of each per MMA. The MMA's k columns are a permutation of the product's k (any permutation
// works when A and B use the same one), chosen so that a lane's bytes for two MMAs are 16 consecutive
// bytes of its row: per "unit" of 64 bytes a row, lane t takes the unit's 16-byte chunk t of rows g and
// g + 8.
//   E4M3, m16n8k32: MMA j of a unit, A columns 4t + i and 16 + 4t + i (i < 4) are k = 16t + 8j + i and
//   16t + 8j + 4 + i: the lane's bytes 8j .. 8j + 7 of its 16, B the token codes at the same k.
//   16-bit, m16n8k16: A columns 2t + i and 8 + 2t + i (i < 2) are k = 8t + 4j + i and 8t + 4j + 2 + i:
//   the lane's elements 4j .. 4j + 3 of its 8, B the activations at the same k.
// Either way a lane's B fragments for a unit are 16 consecutive bytes of the staged token: one shared-
// memory load. (PTX's fragment layouts: mma.m16n8k32 / m16n8k16, A row-major, B column-major.)
//
// The weights reach shared memory by cp.async (a ring of STAGES stages per warp, so the bytes in flight
// are bounded by shared memory, not registers), copied in whole runs of each row: the copy layout is
// memory's, not the fragments' (the loop's comments say why and how the fragments are read back).
//
// The token(s) are staged in shared memory by a prologue: E4M3 codes at the token's scale (its absmax /
// 448 after the input norm, or the static input scale; BLOCK_SCALES: each group of 128 inputs' absmax /
// 448, the group scales staged beside the codes), or the 16-bit activations (times the norm
// weight with NORM; rstd then scales the row sums). The weights do not depend on the previous kernel,
// so with programmatic dependent launch (kernels/pdl.py) each warp requests its first stages before
// `griddepcontrol.wait` and the prologue runs while they arrive.
//
// Work split: a tile is 16 rows (with SILU_MUL the gate tile and its up tile N rows further on; with
// ROPE 8 rotary pairs of a head, their first halves in MMA rows 0-7 and second halves in rows 8-15, so
// a lane's two rows g and g + 8 are one pair) for every token. Blocks are persistent (the launcher sizes the
// grid so every block gets the same number of tiles) and stream their tiles back to back; a block's
// WARPS warps take stages of CHUNKS units of the tile's rows in turn. After each tile the epilogue sums
// the warps' fragments in shared memory and applies the one-token path's fusions (Fuse) while the next
// tile's first stages are in flight.
//
// FP8 sums: each MMA starts from zero and its result is added into fp32 registers: Hopper's FP8 MMAs
// keep a shortened accumulator (w8a8_dot_gemv.py's docstring), so no chain runs through them.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// d += a b for one m16n8k16 step, fp32 accumulation; TYPE the PTX name of the 16-bit inputs.
#define FERROX_DENSE_MMA16(TYPE)                                                                              \
    static __device__ __forceinline__ void mma16(float* d, const u32* a, u32 b0, u32 b1) {                   \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                                 \
                     ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"                  \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                        \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                        \
    }

// The activation dtypes (16-bit floats as bit patterns converted by PTX; no headers under NVRTC).
struct Bf16 {
    static __device__ __forceinline__ float to_float(u16 v) { return __uint_as_float(((u32)v) << 16); }
    static __device__ __forceinline__ u16 round(float f) {
        u16 r;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
        return r;
    }
    FERROX_DENSE_MMA16("bf16")
};

struct F16 {
    static __device__ __forceinline__ float to_float(u16 v) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
        return f;
    }
    static __device__ __forceinline__ u16 round(float f) {
        u16 r;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
        return r;
    }
    FERROX_DENSE_MMA16("f16")
};

// d = a b for one m16n8k32 E4M3 step, from a zero accumulator (the header's "FP8 sums").
static __device__ __forceinline__ void mma_e4m3(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%10, %11, %12, %13};"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f), "f"(0.f), "f"(0.f),
                   "f"(0.f));
}

// Two fp32 values as E4M3 codes, rounded to nearest even, saturating at +-448: lo in the low byte.
static __device__ __forceinline__ u32 e4m3x2(float lo, float hi) {
    u16 r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// x / d correctly rounded, as IEEE division (and the torch quantizers) divide, from r = __frcp_rn(d):
// Markstein's correction (q = x r, then q + (x - q d) r with the remainder exact by FMA) in three
// instructions where `/` calls a division subroutine per element -- the prologue's cost grew with the
// tokens it quantizes (Llama-3.1-8B FP8 qkv, 8 tokens: 17.7 -> 14.7 us; codes bit-identical). Exact
// away from overflow and underflow: here |x / d| <= 448 and d >= 1e-12 / 448, and quotients small
// enough to be inexact round to a zero code either way.
static __device__ __forceinline__ float div_by(float x, float d, float r) {
    const float q = x * r;
    return fmaf(fmaf(-q, d, x), r, q);
}

// 16 bytes copied global -> shared without passing through registers (cp.async; L2 evict-first), so the
// bytes in flight are bounded by shared memory rather than by registers. dst: a shared-space address.
static __device__ __forceinline__ void copy_async16(u32 dst, const void* src, unsigned long long policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "l"(policy)
                 : "memory");
}

static __device__ __forceinline__ u32 shared_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes the block reads again (the token, the norm weight).
static __device__ __forceinline__ uint4 load_cached(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

static __device__ __forceinline__ u16 half_of(const uint4& v, int i) {
    const u32 w = i < 2 ? v.x : i < 4 ? v.y : i < 6 ? v.z : v.w;
    return (u16)(i & 1 ? w >> 16 : w);
}

// The fusions of the one-token decode path (attention/fused_decode.py), as template flags.
enum Fuse : int {
    PLAIN = 0,
    NORM = 1,      // x -> rms_norm(x) * norm_w first
    SILU_MUL = 2,  // rows [0, N) gate, [N, 2N) up: out = silu(gate) * up (a block owns a tile of each)
    RESIDUAL = 4,  // out = y + residual, y rounded first (as the unfused ops store it)
    OUT_F32 = 8,   // out is float32 (the LM head's logits, the MoE router's)
    ROPE = 16,     // merged q/k/v rows: rotate q and k (neox), store q to out and k, v into the paged cache
    KV_FP8 = 32,   // with ROPE: the cache is E4M3, k and v stored divided by their scales
    // FP8, a block-wise checkpoint (DeepSeek-V3 / Qwen3-FP8): w_scale holds one scale per block of BN rows
    // x 128 inputs ([ceil(N / BN)][K / 128], rows stride_ws apart), each token is quantized per group of
    // 128 inputs (the group's absmax / 448), and each group's MMA sums are folded in times its two scales.
    BLOCK_SCALES = 64,
};

// Where ROPE puts the token's k and v: the paged cache [2, blocks, block_size, kv_heads, head_dim].
struct KvWrite {
    const float* rope;       // the token's [cos | sin] row, float32, head_dim wide
    const long long* slot;   // its cache slot (-1: nowhere)
    void* cache;
    const float* kv_scale;   // (k_scale, v_scale) of an E4M3 cache
    int half, num_q_heads, num_kv_heads, block_size;
    long s_kv, s_block, s_slot, s_head;  // the cache's strides, in elements
};

// The block's sum (SUM) or max of v over its threads; every thread gets it. slot: a [WARPS] array used
// once per launch (no reuse, so one barrier).
template <int WARPS, bool SUM>
static __device__ __forceinline__ float block_reduce(float v, float* slot) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float u = __shfl_xor_sync(0xffffffffu, v, o);
        v = SUM ? v + u : fmaxf(v, u);
    }
    if ((threadIdx.x & 31) == 0) slot[threadIdx.x >> 5] = v;
    __syncthreads();
    v = slot[0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) v = SUM ? v + slot[w] : fmaxf(v, slot[w]);
    return v;
}

// ROPE's epilogue for rotary pair p of `head` (rows `row`, `row + half` of [q | k | v]): lo and hi are the
// projection's fp32 outputs, rounded to the activation dtype as the unfused path stores them, rotated
// (v is not), and stored: q heads to out, k and v heads into the cache at the token's slot (E4M3 with
// KV_FP8: divided by the plane's scale, rounded as torch rounds, saturated).
template <class A, int FUSE>
static __device__ __forceinline__ void rope_store(void* out, float y, float up, int row, int head, int p,
                                                  const KvWrite& kv) {
    const float lo = A::to_float(A::round(y)), hi = A::to_float(A::round(up));
    const bool is_v = head >= kv.num_q_heads + kv.num_kv_heads;
    const float c = is_v ? 1.f : kv.rope[p], s = is_v ? 0.f : kv.rope[kv.half + p];
    const u16 out_lo = A::round(lo * c - hi * s), out_hi = A::round(hi * c + lo * s);
    if (head < kv.num_q_heads) {
        ((u16*)out)[row] = out_lo;
        ((u16*)out)[row + kv.half] = out_hi;
        return;
    }
    const long long slot = *kv.slot;
    if (slot < 0) return;
    const int plane = is_v ? 1 : 0;
    const long at = plane * kv.s_kv + (slot / kv.block_size) * kv.s_block + (slot % kv.block_size) * kv.s_slot +
                    (long)(head - kv.num_q_heads - plane * kv.num_kv_heads) * kv.s_head + p;
    if constexpr ((FUSE & KV_FP8) != 0) {
        const float sc = kv.kv_scale[plane];
        ((u8*)kv.cache)[at] = (u8)e4m3x2(A::to_float(out_lo) / sc, 0.f);
        ((u8*)kv.cache)[at + kv.half] = (u8)e4m3x2(A::to_float(out_hi) / sc, 0.f);
    } else {
        ((u16*)kv.cache)[at] = out_lo;
        ((u16*)kv.cache)[at + kv.half] = out_hi;
    }
}

// Where tile `tile`'s rows start (row0), and for ROPE its head and first rotary pair.
struct TileRows {
    int row0, head, pair0;
};

// ROPE tiles are 8 pairs: 16 rows like every other tile (16-pair tiles, two row tiles a block, gave
// Llama-3.1-8B's qkv 192 tiles for 132 SMs; benches/RESULTS.md).
template <bool HAS_ROPE>
static __device__ __forceinline__ TileRows tile_rows(int tile, const KvWrite& kv) {
    if constexpr (HAS_ROPE) {
        const int tiles_per_head = kv.half >> 3;
        const int head = tile / tiles_per_head;
        const int pair0 = (tile - head * tiles_per_head) * 8;
        return {head * 2 * kv.half + pair0, head, pair0};
    }
    return {tile * 16, 0, 0};
}

// The weight row of a tile's MMA row r (r < 16): consecutive rows, or for ROPE pair r % 8's first (r < 8)
// or second half.
template <bool HAS_ROPE>
static __device__ __forceinline__ int tile_row(int row0, int r, const KvWrite& kv) {
    if constexpr (HAS_ROPE) return row0 + (r & 7) + (r >> 3) * kv.half;
    return row0 + r;
}

template <class A, bool FP8, int WARPS, int CHUNKS, int STAGES, int FUSE>
static __device__ __forceinline__ void dense_gemv(void* __restrict__ out, const u16* __restrict__ x,
                                                  const u8* __restrict__ w, const float* __restrict__ w_scale,
                                                  const u16* __restrict__ bias, int M, int N, int K, int tiles,
                                                  long stride_x, long stride_w, long stride_o,
                                                  const u16* __restrict__ norm_w, float eps,
                                                  const float* __restrict__ in_scale,
                                                  const u16* __restrict__ residual, long stride_r, const KvWrite& kv,
                                                  int block_n, long stride_ws) {
    constexpr bool HAS_NORM = (FUSE & NORM) != 0;
    constexpr bool HAS_ROPE = (FUSE & ROPE) != 0;
    constexpr bool HAS_BLOCK = FP8 && (FUSE & BLOCK_SCALES) != 0;
    static_assert(!(HAS_ROPE && HAS_BLOCK), "a ROPE tile spans both halves of a head: two weight blocks");
    // Row tiles per block: with SILU_MUL, gate and up (N rows apart).
    constexpr int RT = (FUSE & SILU_MUL) ? 2 : 1;
    constexpr int EBYTES = FP8 ? 1 : 2;
    // The row an output pairs with in the epilogue, this many rows on: the up row (SILU_MUL, in the
    // second row tile), the rotary partner (ROPE, MMA row + 8 of the same tile).
    const long second = HAS_ROPE ? kv.half : N;
    constexpr bool PAIRED = RT == 2 || HAS_ROPE;
    // Outputs of a tile per token; the partner's sums lie OUTS rows on in the epilogue's part[][].
    constexpr int OUTS = HAS_ROPE ? 8 : 16;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const long kbytes = (long)K * EBYTES;  // a row's (and a staged token's) bytes
    // The warps take a row's stages in turn (warp w: stages w, w + WARPS, ...), so at any moment the block
    // reads WARPS consecutive stages of its rows: long runs of each row rather than WARPS scattered pieces
    // (DRAM serves runs within a page faster). n_w: this warp's stages of each tile.
    const int stages = (int)(kbytes / (64 * CHUNKS));
    const int n_w = stages > warp ? (stages - warp + WARPS - 1) / WARPS : 0;
    constexpr long STEP = 64L * CHUNKS * WARPS;  // bytes from one of the warp's stages to its next

    // Dynamic shared memory: the staged tokens [M][kbytes], with BLOCK_SCALES their group scales
    // [M][K / 128], each warp's ring of STAGES stages, the epilogue's partial sums [WARPS][RT x 16 rows][8
    // tokens].
    extern __shared__ uint4 smem[];
    u8* xs = (u8*)smem;
    constexpr int STAGE_BYTES = RT * 2 * CHUNKS * 512;  // a warp's stage: [row tile][16 rows][64 CHUNKS bytes]
    const int groups = K >> 7;  // BLOCK_SCALES: groups of 128 inputs a token
    float* gs = (float*)(xs + (((long)M * kbytes + 15) & ~15L));
    u8* rings = (u8*)gs + (HAS_BLOCK ? (((long)M * groups * 4 + 15) & ~15L) : 0);
    u8* ring_s = rings + warp * STAGES * STAGE_BYTES;
    float(*part)[RT * 16][8] = (float(*)[RT * 16][8])(rings + WARPS * STAGES * STAGE_BYTES);
    __shared__ float red[3][8][WARPS];  // the prologue's reductions: sum of squares, absmax (per token)
    __shared__ float stat[8];           // per token: FP8 the input scale, 16-bit with NORM the rstd

    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    // The block is persistent: it takes tiles blockIdx.x, + gridDim.x, ... Each warp's loads run as one
    // stream over all of them (stage ls of tile lt next), so a tile's last stages overlap the next one's
    // first and the loads never drain between tiles.
    int lt = blockIdx.x, ls = 0;
    // The copies follow memory, not the fragments: one copy instruction takes 32 / LPR whole rows of the
    // stage (LPR lanes of 16 bytes each), so every request is a whole 64-256-byte run of a row (copies
    // laid out as the fragments are, 16 rows x 64 bytes an instruction, ran gate_up at 3.5 TB/s against
    // 4.2). The fragments are read back from the row-major stage [row][16-byte chunk], chunks of odd rows
    // swapped by halves (j ^ 4) so that the two rows one phase of a 16-byte shared load reads sit in
    // different banks. Lanes read each other's copies, so the warp syncs around the ring.
    // Stage (lt, ls) goes into ring slot `slot`: one commit group per stage (empty past the last tile),
    // so that "all but the newest STAGES - 1 groups done" always means "the stage about to be used is here".
    constexpr int LPR = 4 * CHUNKS, RPI = 32 / LPR, RB = 64 * CHUNKS;
    const int cr = lane / LPR, cj = lane % LPR;
    int lrow0 = tile_rows<HAS_ROPE>(min(lt, tiles - 1), kv).row0;
    long lcol = (long)warp * RB + 16 * cj;
    auto swz = [](int row, int j) { return LPR >= 8 ? j ^ ((row & 1) << 2) : j; };
    auto issue = [&](int slot) {
        if (lt < tiles && n_w > 0) {
            u8* stage = ring_s + slot * STAGE_BYTES;
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int k = 0; k < 16 / RPI; ++k) {
                    const int row = k * RPI + cr;
                    const long grow = min(tile_row<HAS_ROPE>(lrow0, row, kv), N - 1) + r * second;
                    copy_async16(shared_address(stage + (r * 16 + row) * RB + 16 * swz(row, cj)),
                                 w + grow * stride_w + lcol, policy);
                }
            lcol += STEP;
            if (++ls == n_w) {
                ls = 0;
                lt += gridDim.x;
                lrow0 = tile_rows<HAS_ROPE>(min(lt, tiles - 1), kv).row0;
                lcol = (long)warp * RB + 16 * cj;
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    // The next kernel's blocks may launch now -- but not after the qkv + rotary product, whose next
    // kernel is attention (kernels/pdl.py says why).
    if constexpr (!HAS_ROPE) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(s);
    asm volatile("griddepcontrol.wait;" ::: "memory");  // (returns at once without PDL)

    // Prologue: stage the tokens. Each thread takes 8 inputs (16 bytes of x) at a time.
    const int vecs = K >> 3;
    for (int m = 0; m < M; ++m) {
        const u16* xm = x + (long)m * stride_x;
        float rstd = 1.f;
        if constexpr (HAS_NORM) {
            float ss = 0.f;
            for (int v = threadIdx.x; v < vecs; v += WARPS * 32) {
                const uint4 q = load_cached(xm + 8 * v);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float f = A::to_float(half_of(q, i));
                    ss = fmaf(f, f, ss);
                }
            }
            rstd = rsqrtf(block_reduce<WARPS, true>(ss, red[0][m]) / (float)K + eps);
        }
        if constexpr (FP8) {
            // The input as the unfused path hands it to the quantizer (gemv.py _norm_tile): with NORM,
            // round(norm_w * round(x * rstd)); its codes at the token's scale.
            auto normed = [&](int v, float* f) {
                const uint4 q = load_cached(xm + 8 * v);
                uint4 gw = q;
                if constexpr (HAS_NORM) gw = load_cached(norm_w + 8 * v);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    f[i] = A::to_float(half_of(q, i));
                    if constexpr (HAS_NORM)
                        f[i] = A::to_float(A::round(A::to_float(half_of(gw, i)) * A::to_float(A::round(f[i] * rstd))));
                }
            };
            // 8 inputs' codes at scale sc (rc its reciprocal) into the token's staged row; satfinite clamps
            // to +-448 as the torch quantizer does.
            auto store_codes = [&](int v, const float* f, float sc, float rc) {
                const u32 c0 = e4m3x2(div_by(f[0], sc, rc), div_by(f[1], sc, rc)) |
                               (e4m3x2(div_by(f[2], sc, rc), div_by(f[3], sc, rc)) << 16);
                const u32 c1 = e4m3x2(div_by(f[4], sc, rc), div_by(f[5], sc, rc)) |
                               (e4m3x2(div_by(f[6], sc, rc), div_by(f[7], sc, rc)) << 16);
                *(uint2*)(xs + (long)m * kbytes + 8 * v) = make_uint2(c0, c1);
            };
            float scale = 1.f;
            if constexpr (HAS_BLOCK) {
                // Per group of 128 inputs, as fp8_block_gemm.py's quantizer: a group's 16 vectors are the 16
                // lanes of a half-warp (vecs is a multiple of 16, so both halves of a warp are in or out of
                // the loop together), its absmax one shuffle reduction among them.
                const unsigned half_warp = 0xffffu << (lane & 16);
                for (int v = threadIdx.x; v < vecs; v += WARPS * 32) {
                    float f[8];
                    normed(v, f);
                    float amax = 0.f;
#pragma unroll
                    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
                    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(half_warp, amax, o));
                    const float sc = fmaxf(amax, 1e-12f) / 448.f;
                    store_codes(v, f, sc, __frcp_rn(sc));
                    if ((lane & 15) == 0) gs[m * groups + (v >> 4)] = sc;
                }
            } else if (in_scale != nullptr) {
                scale = *in_scale;
            } else {
                float amax = 0.f;
                for (int v = threadIdx.x; v < vecs; v += WARPS * 32) {
                    float f[8];
                    normed(v, f);
#pragma unroll
                    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
                }
                scale = fmaxf(block_reduce<WARPS, false>(amax, red[1][m]), 1e-12f) / 448.f;
            }
            const float rs = __frcp_rn(scale);
            for (int v = threadIdx.x; v < vecs && !HAS_BLOCK; v += WARPS * 32) {
                float f[8];
                normed(v, f);
                store_codes(v, f, scale, rs);
            }
            if (threadIdx.x == 0) stat[m] = scale;
        } else {
            for (int v = threadIdx.x; v < vecs; v += WARPS * 32) {
                uint4 q = load_cached(xm + 8 * v);
                if constexpr (HAS_NORM) {  // B = round(x * norm_w); rstd scales the row sums
                    const uint4 gw = load_cached(norm_w + 8 * v);
                    u32 p[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const u16 a = A::round(A::to_float(half_of(q, 2 * i)) * A::to_float(half_of(gw, 2 * i)));
                        const u16 b = A::round(A::to_float(half_of(q, 2 * i + 1)) * A::to_float(half_of(gw, 2 * i + 1)));
                        p[i] = (u32)a | ((u32)b << 16);
                    }
                    q = make_uint4(p[0], p[1], p[2], p[3]);
                }
                *(uint4*)(xs + (long)m * kbytes + 16 * v) = q;
            }
            if (threadIdx.x == 0) stat[m] = rstd;
        }
    }
    __syncthreads();

    // The token column this lane feeds to the MMA's B side: token g (lanes past the last token read the
    // last one's codes; their columns are never stored).
    const u8* xw = xs + (long)min(g, M - 1) * kbytes + 16 * t + (long)warp * 64 * CHUNKS;
    float acc[RT][2][4];  // per row tile, two chains (MMA j of a unit)
    // One unit's two MMAs per row tile: lo / hi the lane's 16 bytes of rows g / g + 8, b its token bytes;
    // BLOCK_SCALES: s0 / s1 the unit's group scales for the lane's token columns 2t / 2t + 1 (C fragments
    // 0, 2 / 1, 3), times the tile's weight block scale.
    auto mma_unit = [&](int r, const uint4& lo, const uint4& hi, const uint4& b, float s0, float s1) {
        const u32 a0[4] = {lo.x, hi.x, lo.y, hi.y};
        const u32 a1[4] = {lo.z, hi.z, lo.w, hi.w};
        if constexpr (FP8) {
            float d0[4], d1[4];
            mma_e4m3(d0, a0, b.x, b.y);
            mma_e4m3(d1, a1, b.z, b.w);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if constexpr (HAS_BLOCK) {
                    acc[r][0][i] = fmaf(d0[i], i & 1 ? s1 : s0, acc[r][0][i]);
                    acc[r][1][i] = fmaf(d1[i], i & 1 ? s1 : s0, acc[r][1][i]);
                } else {
                    acc[r][0][i] += d0[i];
                    acc[r][1][i] += d1[i];
                }
            }
        } else {
            A::mma16(acc[r][0], a0, b.x, b.y);
            A::mma16(acc[r][1], a1, b.z, b.w);
        }
    };
    int q = 0;  // this warp's stages consumed so far (all tiles): stage q is in slot q % STAGES
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[r][j][i] = 0.f;
        // BLOCK_SCALES: the row tiles' weight scale rows (a 16-row tile lies in one block of BN rows).
        const float* ws_row[RT];
        if constexpr (HAS_BLOCK) {
            const int row0 = tile_rows<HAS_ROPE>(tile, kv).row0;
#pragma unroll
            for (int r = 0; r < RT; ++r) ws_row[r] = w_scale + (long)((row0 + r * (int)second) / block_n) * stride_ws;
        }
        const float* gs0 = gs + min(2 * t, M - 1) * groups;  // the lane's token columns' group scales
        const float* gs1 = gs + min(2 * t + 1, M - 1) * groups;
        for (int i = 0; i < n_w; ++i, ++q) {
            __syncwarp();  // every lane is done reading the slot about to be refilled
            issue((q + STAGES - 1) % STAGES);
            asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1) : "memory");
            __syncwarp();  // and every lane's copies of this stage have landed
            const u8* st = ring_s + (q % STAGES) * STAGE_BYTES;
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                const uint4 b = *(const uint4*)(xw + i * STEP + 64 * c);
                const int j = 16 * swz(g, 4 * c + t);  // (rows g and g + 8 swizzle alike)
                float a0 = 1.f, a1 = 1.f;
                int grp = 0;
                if constexpr (HAS_BLOCK) {  // this unit's group of 128 inputs (a unit is 64 of them)
                    grp = (int)(((long)warp * 64 * CHUNKS + i * STEP + 64 * c) >> 7);
                    a0 = gs0[grp];
                    a1 = gs1[grp];
                }
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    const float wsc = HAS_BLOCK ? __ldg(ws_row[r] + grp) : 1.f;
                    mma_unit(r, *(const uint4*)(st + (r * 16 + g) * RB + j),
                             *(const uint4*)(st + (r * 16 + g + 8) * RB + j), b, a0 * wsc, a1 * wsc);
                }
            }
        }

        // Epilogue: the warps' fragments in shared memory, summed per (row, token) by one thread each,
        // while the next tile's first stages are in flight.
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            part[warp][16 * r + g][2 * t] = acc[r][0][0] + acc[r][1][0];
            part[warp][16 * r + g][2 * t + 1] = acc[r][0][1] + acc[r][1][1];
            part[warp][16 * r + g + 8][2 * t] = acc[r][0][2] + acc[r][1][2];
            part[warp][16 * r + g + 8][2 * t + 1] = acc[r][0][3] + acc[r][1][3];
        }
        __syncthreads();
        const TileRows tr = tile_rows<HAS_ROPE>(tile, kv);
        for (int idx = threadIdx.x; idx < OUTS * M; idx += WARPS * 32) {
            const int r = idx & (OUTS - 1), m = HAS_ROPE ? idx >> 3 : idx >> 4;
            const int row = tr.row0 + r;
            if (row >= N) continue;
            float y = 0.f, up = 0.f;
#pragma unroll
            for (int v = 0; v < WARPS; ++v) {
                y += part[v][r][m];
                if (PAIRED) up += part[v][OUTS + r][m];
            }
            if constexpr (FP8 && !HAS_BLOCK) {  // the code sums times the input's and the row's scales (w8a8_dot_gemv's order)
                y = y * stat[m] * w_scale[row];
                if (PAIRED) up = up * stat[m] * w_scale[row + second];
            } else if constexpr (HAS_NORM) {
                y *= stat[m];
                up *= stat[m];
            }
            if (bias != nullptr) {
                y += A::to_float(bias[row]);
                if (PAIRED) up += A::to_float(bias[row + second]);
            }
            if constexpr (HAS_ROPE) {  // gemv.py's qkv kernel's epilogue (one token)
                rope_store<A, FUSE>(out, y, up, row, tr.head, tr.pair0 + r, kv);
                continue;
            }
            if constexpr ((FUSE & SILU_MUL) != 0) {  // gate and up rounded first, as the unfused path stores them
                const float gate = A::to_float(A::round(y));
                y = gate / (1.f + __expf(-gate)) * A::to_float(A::round(up));
            }
            if constexpr ((FUSE & RESIDUAL) != 0) y = A::to_float(A::round(y)) + A::to_float(residual[(long)m * stride_r + row]);
            if constexpr ((FUSE & OUT_F32) != 0)
                ((float*)out)[(long)m * stride_o + row] = y;
            else
                ((u16*)out)[(long)m * stride_o + row] = A::round(y);
        }
        __syncthreads();  // (part is written again by the next tile)
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
}

// One extern "C" entry point per instantiation (dense_gemv_cuda.py appends the lines it needs). A: the
// activations' dtype; FP8: E4M3 weights (else the weights are A's dtype); FUSE: a sum of Fuse flags.
#define FERROX_DENSE_GEMV(NAME, A, FP8, WARPS, CHUNKS, STAGES, FUSE)                                           \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                   \
        NAME(void* out, const u16* x, const u8* w, const float* w_scale, const u16* bias, int M, int N, int K, \
             int tiles, long stride_x, long stride_w, long stride_o, const u16* norm_w, float eps, const float* in_scale,  \
             const u16* residual, long stride_r, const float* rope, const long long* slot, void* cache,        \
             const float* kv_scale, int half, int num_q_heads, int num_kv_heads, int block_size, long s_kv,   \
             long s_block, long s_slot, long s_head, int block_n, long stride_ws) {                            \
        const KvWrite kv = {rope, slot, cache, kv_scale, half, num_q_heads, num_kv_heads, block_size,          \
                            s_kv, s_block, s_slot, s_head};                                                    \
        dense_gemv<A, FP8, WARPS, CHUNKS, STAGES, FUSE>(out, x, w, w_scale, bias, M, N, K, tiles, stride_x, stride_w, \
                                                        stride_o, norm_w, eps, in_scale, residual, stride_r, kv,  \
                                                        block_n, stride_ws);                                   \
    }
