// int4 weight-only products for small batches (2-16 tokens: decode steps of 2-16 requests) on tensor
// cores, compiled at run time by NVRTC: python/ferrox/kernels/int4_gemv_cuda.py builds it, packs the
// weights for it and says when it runs instead of int4_matmul.py's Triton kernels.
//
// Why: a decode step of a few requests reads each weight once, so it should cost what a one-token step
// costs. The Triton GEMV runs one program per token (a Llama-3.1-8B layer: 69 us at one token, 214 us
// at four), and from 5 tokens int4_matmul takes its GEMM, whose 16-row tiles dequantize every weight on
// CUDA cores (183 us at eight; H200, benches/RESULTS.md). Here a LOP3 turns two nibbles into two bf16 (fp16) values
// 128 + q (1024 + q) exactly -- the magic-number trick --, one packed add of -(magic + z) leaves q - z
// (an exact small integer), and one mma.sync m16n8k16 multiplies 16 rows x 16 k of those against 8
// token columns (two MMAs for 9-16 tokens): ~1.5 instructions per weight whatever the token count.
// Each group's fp32 sums are scaled once, at the group's end. The weights go in exactly; the
// activations, already in the MMA's dtype, are not rounded again.
//
// Weight layout (int4_gemv_cuda.pack_mma): [N/16 row tiles][K/64 k tiles][32 lanes][4 words]. Lane l's
// 16 bytes of a tile are its A fragments for the tile's four k16 steps: word i, nibbles (0, 4) = row g,
// columns (2t, 2t + 1) of step i; (1, 5) = row g + 8, the same columns; (2, 6) = row g, columns
// (2t + 8, 2t + 9); (3, 7) = row g + 8, those columns (g = l / 4, t = l % 4: PTX's fragment layout for
// mma.m16n8k16 with A row-major). A warp's load of a tile is 512 contiguous bytes.
//
// Work split: a block owns one tile of 16 output rows for every token; its WARPS warps split K by whole
// groups, and each keeps STAGES tiles of loads in flight (issued before converting the current one).
// The epilogue sums the warps' fragments in shared memory and adds the bias. No headers: NVRTC compiles
// this file alone, 16-bit floats are bit patterns converted by PTX.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// c += a b for one m16n8k16 step, fp32 accumulation; TYPE the PTX name of the 16-bit inputs.
#define FERROX_MMA_M16N8K16(TYPE)                                                                              \
    static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {                      \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                                    \
                     ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"                    \
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                          \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                         \
    }

struct Bf16 {
    static constexpr u32 MAGIC2 = 0x43004300u;  // two bf16 128.0: 128 + q for a nibble q in the mantissa
    static constexpr float MAGIC = 128.f;
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
    FERROX_MMA_M16N8K16("bf16")
};

struct F16 {
    static constexpr u32 MAGIC2 = 0x64006400u;  // two fp16 1024.0
    static constexpr float MAGIC = 1024.f;
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
    FERROX_MMA_M16N8K16("f16")
};

struct F32 {  // scales only
    static __device__ __forceinline__ float load(const void* p, long i) { return ((const float*)p)[i]; }
};

// f rounded to A's dtype, in both 16-bit halves.
template <class A>
static __device__ __forceinline__ u32 pair(float f) {
    const u32 h = A::round(f);
    return h | (h << 16);
}

// 16 bytes of weights, read once: no L1 allocation, first out of L2.
static __device__ __forceinline__ uint4 load_stream(const uint4* p, unsigned long long policy) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(policy));
    return v;
}

// The A fragment of one k16 step from its packed word (layout above): (w >> 4i) & 0x000F000F puts nibbles
// i and i + 4 in the two 16-bit halves, OR-ed into two copies of the magic (magic + q exactly), then
// -(magic + z) of the register's row is added: q - z, an exact small integer. nz: rows g, g + 8.
template <class A>
static __device__ __forceinline__ void fragment(u32 w, u32 nz_g, u32 nz_g8, u32* a) {
    a[0] = A::add2((w & 0x000F000Fu) | A::MAGIC2, nz_g);
    a[1] = A::add2(((w >> 4) & 0x000F000Fu) | A::MAGIC2, nz_g8);
    a[2] = A::add2(((w >> 8) & 0x000F000Fu) | A::MAGIC2, nz_g);
    a[3] = A::add2(((w >> 12) & 0x000F000Fu) | A::MAGIC2, nz_g8);
}

template <class A, class S, int NT, int WARPS, int STAGES>
static __device__ __forceinline__ void int4_gemv_mma(u16* __restrict__ out, const u16* __restrict__ x,
                                                     const uint4* __restrict__ packed, const void* __restrict__ scales,
                                                     const u8* __restrict__ zeros, const u16* __restrict__ bias, int M,
                                                     int N, int K, int group, long stride_x, long stride_o) {
    constexpr int COLS = 8 * NT;  // token columns: NT MMA column tiles of 8
    const int tile = blockIdx.x;
    const int ktiles = K >> 6;
    const int groups = K / group;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;

    // This warp's k tiles (whole groups: a group's scale applies to its fold), and the first STAGES of
    // their loads, issued before anything else.
    const int tiles_per_group = group >= 64 ? group >> 6 : 1;
    const int per_warp = ((ktiles + WARPS - 1) / WARPS + tiles_per_group - 1) / tiles_per_group * tiles_per_group;
    const int kt0 = warp * per_warp;
    const int kt1 = min(ktiles, kt0 + per_warp);
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    const uint4* src = packed + (long)tile * ktiles * 32 + lane;
    uint4 buf[STAGES];
#pragma unroll
    for (int s = 0; s < STAGES; ++s)
        buf[s] = kt0 + s < kt1 ? load_stream(src + (long)(kt0 + s) * 32, policy) : make_uint4(0, 0, 0, 0);

    // Main loop: per k16 step one MMA per token column tile, into c[0] on even steps and c[1] on odd ones
    // (two dependency chains); at each group's end both are scaled into acc. A group's scale and
    // -(magic + zero) are requested a group ahead (rows g and g + 8; L1 keeps a row's next groups).
    // B fragments (token g + 8n, columns 2t.. of the step) come straight from x, which L1 and L2 hold.
    float acc[NT][4], c[2][NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[n][j] = 0.f, c[0][n][j] = 0.f, c[1][n][j] = 0.f;
    const u16* brow[NT];
    bool live[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const int m = g + 8 * n;
        live[n] = m < M;
        brow[n] = x + (live[n] ? m : 0) * stride_x + 2 * t;
    }
    const int steps_per_group = group >> 4;  // counters: a modulus per step cost ~20 integer instructions
    int grp = (kt0 * 4) / steps_per_group;
    int until_fold = steps_per_group - (kt0 * 4 - grp * steps_per_group);
    const long sz_row[2] = {(long)min(tile * 16 + g, N - 1) * groups, (long)min(tile * 16 + g + 8, N - 1) * groups};
    float sc[2];
    u32 nz[2];
    const int first_grp = min(grp, groups - 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        sc[h] = S::load(scales, sz_row[h] + first_grp);
        nz[h] = pair<A>(-(A::MAGIC + (float)zeros[sz_row[h] + first_grp]));
    }
    for (int kt = kt0; kt < kt1; kt += STAGES) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            if (kt + s < kt1) {
                const uint4 cur = buf[s];
                if (kt + s + STAGES < kt1) buf[s] = load_stream(src + (long)(kt + s + STAGES) * 32, policy);
#pragma unroll
                for (int step = 0; step < 4; ++step) {
                    const int k16 = (kt + s) * 4 + step;
                    u32 a[4];
                    fragment<A>(step == 0 ? cur.x : step == 1 ? cur.y : step == 2 ? cur.z : cur.w, nz[0], nz[1], a);
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        const u32 b0 = live[n] ? *(const u32*)(brow[n] + k16 * 16) : 0u;
                        const u32 b1 = live[n] ? *(const u32*)(brow[n] + k16 * 16 + 8) : 0u;
                        A::mma(c[step & 1][n], a, b0, b1);
                    }
                    if (--until_fold == 0 || k16 == 4 * kt1 - 1) {
                        const int next = min(grp + 1, groups - 1);
#pragma unroll
                        for (int n = 0; n < NT; ++n)
#pragma unroll
                            for (int j = 0; j < 4; ++j) {
                                acc[n][j] = fmaf(sc[j >> 1], c[0][n][j] + c[1][n][j], acc[n][j]);
                                c[0][n][j] = 0.f;
                                c[1][n][j] = 0.f;
                            }
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            sc[h] = S::load(scales, sz_row[h] + next);
                            nz[h] = pair<A>(-(A::MAGIC + (float)zeros[sz_row[h] + next]));
                        }
                        ++grp;
                        until_fold = steps_per_group;
                    }
                }
            }
        }
    }

    // Epilogue: the warps' fragments [WARPS][16 rows][COLS] in shared memory, summed per (row, token) by
    // one thread each; bias added, rounded once to the activation dtype.
    __shared__ float part[WARPS][16][COLS];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        part[warp][g][8 * n + 2 * t] = acc[n][0];
        part[warp][g][8 * n + 2 * t + 1] = acc[n][1];
        part[warp][g + 8][8 * n + 2 * t] = acc[n][2];
        part[warp][g + 8][8 * n + 2 * t + 1] = acc[n][3];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < 16 * M; idx += WARPS * 32) {
        const int r = idx & 15, m = idx >> 4;
        const int row = tile * 16 + r;
        if (row >= N) continue;
        float y = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) y += part[w][r][m];
        if (bias != nullptr) y += A::load(bias, row);
        out[(long)m * stride_o + row] = A::round(y);
    }
}

// One extern "C" entry point per instantiation (int4_gemv_cuda.py appends the lines it needs).
#define FERROX_INT4_GEMV(NAME, A, S, NT, WARPS, STAGES)                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                     \
        NAME(u16* out, const u16* x, const uint4* packed, const void* scales, const u8* zeros, const u16* bias,  \
             int M, int N, int K, int group, long stride_x, long stride_o) {                                     \
        int4_gemv_mma<A, S, NT, WARPS, STAGES>(out, x, packed, scales, zeros, bias, M, N, K, group, stride_x,    \
                                               stride_o);                                                        \
    }
