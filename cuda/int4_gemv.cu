// int4 weight-only products for decode steps (1-16 tokens) on tensor cores, compiled at run time by
// NVRTC: python/ferrox/kernels/int4_gemv_cuda.py builds it, packs the weights for it and says when it
// runs instead of int4_matmul.py's Triton kernels.
//
// Why: a decode step reads each weight once, so its cost should be the weight bytes over the read
// bandwidth, whatever the number of requests. A LOP3 turns two nibbles into two bf16 (fp16) values
// 128 + q (1024 + q) exactly -- the magic-number trick --, one packed add of -(magic + z) leaves q - z
// (an exact small integer), and one mma.sync m16n8k16 multiplies 16 rows x 16 k of those against 8
// token columns (two MMAs for 9-16 tokens). Each k tile's fp32 sums are scaled by its group's scale.
// The weights go in exactly; the activations, already in the MMA's dtype, are not rounded again.
//
// What bounds it (ncu on the H200, benches/RESULTS.md): a decode product is short (8-60 MB, a few
// microseconds), so every load whose latency is not hidden shows. Each k tile therefore arrives as one
// unit, STAGES tiles ahead of its use: the weight words, the activations it multiplies and its group's
// scales and zero points. The packing makes each of those one wide load per lane, and the loop does
// no per-step bookkeeping (one fold per tile, no counters).
//
// The stream (int4_gemv_cuda.pack_mma), per 16-row tile, per group of the input: the group's k tiles
// (64 k each) of [32 lanes][4 words], then the group's metadata [8][2] words (g; rows g, g + 8): scale
// bits << 16 | zero point. Lane l's 16 bytes of a k tile are its A fragments for the tile's four k16
// steps: word s, nibbles (0, 4) = row g, MMA columns (2t, 2t + 1) of step s; (1, 5) = row g + 8, those
// columns; (2, 6) = row g, columns (2t + 8, 2t + 9); (3, 7) = row g + 8, those (g = l / 4, t = l % 4:
// PTX's fragment layout for mma.m16n8k16 with A row-major). The MMA's columns are a permutation of the
// tile's k, chosen so that a lane's B fragments for the whole tile are 16 consecutive activations:
// step s, column 2t + i (i < 2) is k = 16t + 4s + i and column 2t + 8 + i is k = 16t + 4s + 2 + i. A
// warp's load of a k tile is 512 contiguous bytes; a lane's activations for it, two 16-byte loads.
//
// Work split: a block owns one tile of 16 output rows for every token; its WARPS warps split the k
// tiles evenly (a warp that ends inside a group folds what it has with that group's scale: the scale
// is linear). The epilogue sums the warps' fragments in shared memory, adds the bias and applies the
// one-token path's fusions (Fuse below). No headers: NVRTC compiles this file alone; 16-bit floats are
// bit patterns converted by PTX.

typedef unsigned int u32;
typedef unsigned short u16;

// d = a b + c for one m16n8k16 step, fp32 accumulation; TYPE the PTX name of the 16-bit inputs.
#define FERROX_MMA_M16N8K16(TYPE)                                                                              \
    static __device__ __forceinline__ void mma(float* d, const u32* a, u32 b0, u32 b1, const float* c) {       \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                                    \
                     ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"                \
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                          \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]),     \
                       "f"(c[2]), "f"(c[3]));                                                                  \
    }

// The activation (and MMA) dtypes. MAGIC2: two copies of the magic, 128 + q for a nibble q in the
// mantissa; NEG_MAGIC2: two copies of -magic, so -(magic + z) is NEG_MAGIC2 | z per half (z < 16 sits in
// the mantissa's low bits).
struct Bf16 {
    static constexpr u32 MAGIC2 = 0x43004300u;
    static constexpr u32 NEG_MAGIC2 = 0xC300C300u;
    static __device__ __forceinline__ float load(const void* p, long i) {
        return __uint_as_float(((u32)((const u16*)p)[i]) << 16);
    }
    static __device__ __forceinline__ u16 round(float f) {
        u16 r;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
        return r;
    }
    static __device__ __forceinline__ u32 add2(u32 a, u32 b) {  // a + b per half (exact here: small integers)
        u32 d;
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(0x3f803f80u), "r"(b));
        return d;
    }
    static __device__ __forceinline__ u32 mul2(u32 a, u32 b) {  // a * b per half, rounded
        u32 d;
        asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
        return d;
    }
    static __device__ __forceinline__ float to_float(u16 v) { return __uint_as_float(((u32)v) << 16); }
    // A metadata word's scale (its top 16 bits) as fp32.
    static __device__ __forceinline__ float scale(u32 meta) { return __uint_as_float(meta & 0xFFFF0000u); }
    FERROX_MMA_M16N8K16("bf16")
};

struct F16 {
    static constexpr u32 MAGIC2 = 0x64006400u;  // two fp16 1024.0
    static constexpr u32 NEG_MAGIC2 = 0xE400E400u;
    static __device__ __forceinline__ float cvt(u16 v) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
        return f;
    }
    static __device__ __forceinline__ float load(const void* p, long i) { return cvt(((const u16*)p)[i]); }
    static __device__ __forceinline__ u16 round(float f) {
        u16 r;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
        return r;
    }
    static __device__ __forceinline__ u32 add2(u32 a, u32 b) {
        u32 d;
        asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
        return d;
    }
    static __device__ __forceinline__ u32 mul2(u32 a, u32 b) {
        u32 d;
        asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
        return d;
    }
    static __device__ __forceinline__ float to_float(u16 v) { return cvt(v); }
    static __device__ __forceinline__ float scale(u32 meta) { return cvt((u16)(meta >> 16)); }
    FERROX_MMA_M16N8K16("f16")
};

// 16 bytes read once (weights): no L1 allocation, first out of L2.
static __device__ __forceinline__ uint4 load_stream(const uint4* p, unsigned long long policy) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(policy));
    return v;
}

// Read-only loads the block's other warps (metadata) or other blocks (activations) read again.
static __device__ __forceinline__ uint4 load_shared16(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
static __device__ __forceinline__ uint2 load_shared8(const void* p) {
    uint2 v;
    asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// The A fragment of one k16 step from its packed word (layout above): (w >> 4i) & 0x000F000F puts
// nibbles i and i + 4 in the two 16-bit halves, OR-ed into two copies of the magic (magic + q exactly),
// then -(magic + z) of the register's row is added: q - z, an exact small integer. nz: rows g, g + 8.
template <class A>
static __device__ __forceinline__ void fragment(u32 w, u32 mask, u32 nz_g, u32 nz_g8, u32* a) {
    a[0] = A::add2((w & mask) | A::MAGIC2, nz_g);
    a[1] = A::add2(((w >> 4) & mask) | A::MAGIC2, nz_g8);
    a[2] = A::add2(((w >> 8) & mask) | A::MAGIC2, nz_g);
    a[3] = A::add2(((w >> 12) & mask) | A::MAGIC2, nz_g8);
}

// -(magic + z) in both halves, from a metadata word (zero point in its low byte).
template <class A>
static __device__ __forceinline__ u32 neg_magic_zero(u32 meta) {
    return ((meta & 0xFFu) * 0x00010001u) | A::NEG_MAGIC2;
}

// The fusions of the one-token decode path (attention/fused_decode.py), as template flags.
enum Fuse : int {
    PLAIN = 0,
    NORM = 1,      // x -> rms_norm(x) * norm_w first: B = x * norm_w, rstd applied to the row sums
    SILU_MUL = 2,  // rows [0, N) gate, [N, 2N) up: out = silu(gate) * up (a block owns a tile of each)
    RESIDUAL = 4,  // out = y + residual, y rounded first (as the unfused ops store it)
};

// One k tile's loads: the lane's weight words and its group's metadata (rows g, g + 8) for each of the
// block's RT row tiles, its activations per token column tile, and with NORM the norm weights (n0, n1:
// never written without it, so never live in registers).
template <int RT, int NT>
struct Stage {
    uint4 w[RT];
    uint2 meta[RT];
    uint4 x0[NT], x1[NT];
    uint4 n0, n1;
};

template <class A, class S, int NT, int WARPS, int STAGES, int FUSE>
static __device__ __forceinline__ void int4_gemv_mma(u16* __restrict__ out, const u16* __restrict__ x,
                                                     const uint4* __restrict__ packed, const u16* __restrict__ bias,
                                                     int M, int N, int K, int group, long stride_x, long stride_o,
                                                     u32 mask, const u16* __restrict__ norm_w, float eps,
                                                     const u16* __restrict__ residual, long stride_r) {
    constexpr bool HAS_NORM = (FUSE & NORM) != 0;
    constexpr int RT = (FUSE & SILU_MUL) ? 2 : 1;  // row tiles per block: with SILU_MUL, gate and up
    static_assert(!HAS_NORM || NT == 1, "the norm's statistic is read off one token column tile");
    const int tile = blockIdx.x;
    const int ktiles = K >> 6;
    const int tpg = group >> 6;  // k tiles per group
    const long gstride = (long)tpg * 32 + 4;  // a group's k tiles and metadata, in 16-byte words
    const long tile_words = (long)(K / group) * gstride;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;

    const int per_warp = (ktiles + WARPS - 1) / WARPS;
    const int kt0 = warp * per_warp;
    const int kt1 = min(ktiles, kt0 + per_warp);
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    // Row tile r of this block: tile, and with SILU_MUL the up rows' tile N / 16 further on.
    const uint4* base = packed + (long)tile * tile_words;
    const long up_words = (long)(N >> 4) * tile_words;

    // The token row this lane feeds to the MMA's B side (token g + 8n; lanes past the last token read
    // the last one's, which costs no extra sectors, and their columns are never stored).
    const u16* xp[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) xp[n] = x + min(g + 8 * n, M - 1) * stride_x + 16 * t + kt0 * 64;
    const u16* np = norm_w + 16 * t + kt0 * 64;

    // Loads run STAGES tiles ahead of use. wp: the next k tile's words (this lane's), mp: its group's
    // metadata (rows g, g + 8), li: its place in the group. Pointers step; nothing is multiplied per tile.
    const int g0 = kt0 / tpg;
    int li = kt0 - g0 * tpg, lkt = kt0;
    const uint4* wp = base + g0 * gstride + li * 32 + lane;
    const uint2* mp = (const uint2*)(base + g0 * gstride + tpg * 32) + g;
    // STAGES + 1 slots: a tile's loads go into the slot the previous tile freed, so no stage is copied
    // between registers (the loop below is unrolled over one turn of the ring).
    Stage<RT, NT> ring[STAGES + 1];
    // A tile's loads in two parts: what no kernel of the step writes (weights, metadata, norm weights),
    // and the activations, which the previous kernel may still be writing under programmatic dependent
    // launch (kernels/pdl.py): the prologue requests its weight tiles first, waits, then the activations.
    auto issue_weights = [&](Stage<RT, NT>& st) {
        if (lkt < kt1) {
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                st.w[r] = load_stream(wp + r * up_words, policy);
                st.meta[r] = load_shared8(mp + r * 2 * up_words);
            }
            if constexpr (HAS_NORM) {
                st.n0 = load_shared16(np);
                st.n1 = load_shared16(np + 8);
                np += 64;
            }
        }
        ++lkt;
        wp += 32;
        if (++li == tpg) li = 0, wp += 4, mp += 2 * gstride;
    };
    int xkt = kt0;
    auto issue_x = [&](Stage<RT, NT>& st) {
        if (xkt < kt1) {
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                st.x0[n] = load_shared16(xp[n]);
                st.x1[n] = load_shared16(xp[n] + 8);
                xp[n] += 64;
            }
        }
        ++xkt;
    };
    auto issue = [&](Stage<RT, NT>& st) {
        issue_weights(st);
        issue_x(st);
    };
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#pragma unroll
    for (int s = 0; s < STAGES; ++s) issue_weights(ring[s]);
    asm volatile("griddepcontrol.wait;" ::: "memory");  // (returns at once without PDL)
#pragma unroll
    for (int s = 0; s < STAGES; ++s) issue_x(ring[s]);

    // Per k16 step one MMA per (row tile, token column tile), on two dependency chains (even and odd
    // steps) that start from zero in each tile; each tile's sums are scaled into acc (its group's scale:
    // a group's tiles could share one fold, but a fold per tile costs no more than the branch and the
    // counter it saves). With NORM, one more MMA per step multiplies the raw activations with
    // themselves: its diagonal is each token's sum of squares (the tensor cores are otherwise idle). It
    // accumulates across tiles, on two chains: one chain put four dependent MMAs on every tile's
    // critical path (Llama-3.1-8B qkv + norm 11.2 us against 7.0 without the norm, H200).
    float acc[RT][NT][4], sq[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[r][n][j] = 0.f;
    const float zero[4] = {0.f, 0.f, 0.f, 0.f};
    for (int kt = kt0; kt < kt1; kt += STAGES + 1) {
#pragma unroll
        for (int s = 0; s <= STAGES; ++s) {
            if (kt + s < kt1) {
                issue(ring[(s + STAGES) % (STAGES + 1)]);
                const Stage<RT, NT>& cur = ring[s];
                // B fragments, per step: words (2 step, 2 step + 1) of the lane's 16 activations.
                u32 xb[NT][8];
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const u32 v[8] = {cur.x0[n].x, cur.x0[n].y, cur.x0[n].z, cur.x0[n].w,
                                      cur.x1[n].x, cur.x1[n].y, cur.x1[n].z, cur.x1[n].w};
#pragma unroll
                    for (int i = 0; i < 8; ++i) xb[n][i] = v[i];
                }
                if constexpr (HAS_NORM) {
                    const u32 nv[8] = {cur.n0.x, cur.n0.y, cur.n0.z, cur.n0.w, cur.n1.x, cur.n1.y, cur.n1.z, cur.n1.w};
#pragma unroll
                    for (int step = 0; step < 4; ++step) {
                        // A = this lane's token in row g (rows g + 8 empty), B = the same token: D[g][g].
                        const u32 a[4] = {xb[0][2 * step], 0u, xb[0][2 * step + 1], 0u};
                        A::mma(sq[step & 1], a, xb[0][2 * step], xb[0][2 * step + 1], sq[step & 1]);
                    }
#pragma unroll
                    for (int i = 0; i < 8; ++i) xb[0][i] = A::mul2(xb[0][i], nv[i]);
                }
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    const u32 nz_g = neg_magic_zero<A>(cur.meta[r].x), nz_g8 = neg_magic_zero<A>(cur.meta[r].y);
                    const u32 words[4] = {cur.w[r].x, cur.w[r].y, cur.w[r].z, cur.w[r].w};
                    float c[2][NT][4];
#pragma unroll
                    for (int step = 0; step < 4; ++step) {
                        u32 a[4];
                        fragment<A>(words[step], mask, nz_g, nz_g8, a);
#pragma unroll
                        for (int n = 0; n < NT; ++n)
                            A::mma(c[step & 1][n], a, xb[n][2 * step], xb[n][2 * step + 1], step < 2 ? zero : c[step & 1][n]);
                    }
                    const float s_g = S::scale(cur.meta[r].x), s_g8 = S::scale(cur.meta[r].y);
#pragma unroll
                    for (int n = 0; n < NT; ++n)
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            const float sc = j < 2 ? s_g : s_g8;
                            acc[r][n][j] = fmaf(sc, c[0][n][j], fmaf(sc, c[1][n][j], acc[r][n][j]));
                        }
                }
            }
        }
    }

    // Epilogue: the warps' fragments [WARPS][RT x 16 rows][8 NT tokens] in shared memory, summed per
    // (row, token) by one thread each; the norm's rstd, bias, SiLU and residual applied, rounded to the
    // activation dtype as the unfused ops round.
    __shared__ float part[WARPS][RT * 16][8 * NT];
    __shared__ float sumsq[WARPS][8];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            part[warp][16 * r + g][8 * n + 2 * t] = acc[r][n][0];
            part[warp][16 * r + g][8 * n + 2 * t + 1] = acc[r][n][1];
            part[warp][16 * r + g + 8][8 * n + 2 * t] = acc[r][n][2];
            part[warp][16 * r + g + 8][8 * n + 2 * t + 1] = acc[r][n][3];
        }
    if (HAS_NORM && t == (g >> 1))  // D[g][g]: row g, column 2t + (g & 1) (selected: no local-memory index)
        sumsq[warp][g] = (g & 1) ? sq[0][1] + sq[1][1] : sq[0][0] + sq[1][0];
    __syncthreads();
    for (int idx = threadIdx.x; idx < 16 * M; idx += WARPS * 32) {
        const int r = idx & 15, m = idx >> 4;
        const int row = tile * 16 + r;
        if (row >= N) continue;
        float y = 0.f, up = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            y += part[w][r][m];
            if (RT == 2) up += part[w][16 + r][m];
        }
        if constexpr (HAS_NORM) {
            float ss = 0.f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) ss += sumsq[w][m];
            const float rstd = rsqrtf(ss / (float)K + eps);
            y *= rstd;
            up *= rstd;
        }
        if (bias != nullptr) {
            y += A::load(bias, row);
            if (RT == 2) up += A::load(bias, N + row);
        }
        if constexpr (RT == 2) {  // gate and up rounded first, as the unfused path stores them
            const float gate = A::to_float(A::round(y));
            y = gate / (1.f + __expf(-gate)) * A::to_float(A::round(up));
        }
        if constexpr ((FUSE & RESIDUAL) != 0) y = A::to_float(A::round(y)) + A::load(residual, (long)m * stride_r + row);
        out[(long)m * stride_o + row] = A::round(y);
    }
}

// One extern "C" entry point per instantiation (int4_gemv_cuda.py appends the lines it needs). A: the
// activations' dtype; S: the scales' (their 16 bits are in the metadata); FUSE: a sum of Fuse flags.
#define FERROX_INT4_GEMV(NAME, A, S, NT, WARPS, STAGES, FUSE)                                                    \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                     \
        NAME(u16* out, const u16* x, const uint4* packed, const u16* bias, int M, int N, int K, int group,     \
             long stride_x, long stride_o, u32 mask, const u16* norm_w, float eps, const u16* residual,          \
             long stride_r) {                                                                                    \
        int4_gemv_mma<A, S, NT, WARPS, STAGES, FUSE>(out, x, packed, bias, M, N, K, group, stride_x, stride_o,   \
                                                     mask, norm_w, eps, residual, stride_r);                     \
    }
