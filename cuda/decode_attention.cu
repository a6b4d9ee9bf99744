// Split-KV decode attention over the paged KV cache on tensor cores, compiled at run time by NVRTC:
// python/ferrox/kernels/decode_attention_cuda.py builds it and says when it runs in place of the Triton
// kernel (kernels/paged_attention.py).
//
// Why: a decode step reads each request's K/V once, so attention should cost its KV bytes over the read
// bandwidth plus one memory latency. The Triton kernel's pipeliner issues KV tile i + 1 only after tile i's
// PV product and waits for it at the next iteration's top, with one buffer (benches/RESULTS.md, thirty-sixth
// session: 37% of its stall samples on that barrier), and its split merge is a second launch. Here:
// - every warp streams its own 16-position tiles through a ring of STAGES shared-memory stages filled by
//   cp.async (STAGES - 1 tiles in flight a warp, no block-wide barrier in the loop), the block table's
//   entries requested 32 tiles ahead;
// - each warp keeps its own online softmax (rows = the GQA group's query heads, up to 16: the MMA's M), so
//   a tile is two m16n8k16 products: S = Q K^T (K as the col-major B operand: ldmatrix of K's rows) and
//   O += P V (P straight from S's accumulator fragments, V by ldmatrix.trans);
// - the block's warps combine in shared memory; a request whose context is split writes a partial (its
//   unnormalised output, max and sum) and the last block of its (token, KV head) to finish -- an atomic
//   counter, reset by that block -- merges the partials: no second launch.
//
// Shared memory rows are K/V rows (HEAD_DIM 16-bit values) with their 16-byte chunks XOR-swizzled by
// the row's low three bits, so the eight rows an ldmatrix phase reads hit eight different bank groups.
//
// An FP8 (E4M3) cache (KV8; head dim 128) streams half the bytes and runs the products in fp16 (E4M3 widens
// to fp16 exactly in one instruction; q narrows to fp16, saturating): ldmatrix cannot widen, so each lane
// loads its own fragments' bytes. Both products' contractions may be taken in any order, so the kernel picks
// orders that make those bytes contiguous: for S = Q K^T, lane t's four K values of k step kk (logical dims
// 16 kk + 2t, +1, +8, +9) are bytes 32 t + 4 kk .. +3 of the row (q's fragments load with the same map);
// for O += P V, n tile nt's column n is output dim 16 n + nt, so lane g's 16 columns are bytes 16 g .. +15
// of a V row, and the output lands permuted back when the warps combine. k_scale folds into the softmax
// scale, v_scale into the output.
//
// Programmatic dependent launch (kernels/pdl.py): the kernel waits (`griddepcontrol.wait`) before its
// first read -- the previous kernel writes q and this step's K/V -- and signals its dependents where the
// `signal` argument says (0 never, 1 at the start, 2 after the KV loop).

typedef unsigned int u32;
typedef unsigned short u16;

#define NEG_INF __int_as_float(0xff800000u)

// A 16-bit element type's conversions and m16n8k16 MMA (fp32 accumulation); TYPE its PTX name.
#define FERROX_ATTN_TYPE(NAME, TYPE)                                                                             \
    struct NAME {                                                                                                \
        static __device__ __forceinline__ u32 pack(float lo, float hi) {                                         \
            u32 r;                                                                                               \
            asm("cvt.rn." TYPE "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));                               \
            return r;                                                                                            \
        }                                                                                                        \
        static __device__ __forceinline__ u16 narrow(float f) {                                                  \
            u16 r;                                                                                               \
            asm("cvt.rn." TYPE ".f32 %0, %1;" : "=h"(r) : "f"(f));                                               \
            return r;                                                                                            \
        }                                                                                                        \
        static __device__ __forceinline__ void mma(float* d, const u32* a, u32 b0, u32 b1) {                    \
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                                \
                         ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"                 \
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                       \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                       \
        }                                                                                                        \
    };

FERROX_ATTN_TYPE(Bf16, "bf16")
FERROX_ATTN_TYPE(F16, "f16")

static __device__ __forceinline__ float widen(Bf16, u16 x) { return __uint_as_float(u32(x) << 16); }
static __device__ __forceinline__ float widen(F16, u16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}

// Two E4M3 values (low byte first) -> fp16x2 (exact).
static __device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 x) {
    u32 r;
    asm("{ .reg .b16 t; cvt.u16.u32 t, %1; cvt.rn.f16x2.e4m3x2 %0, t; }" : "=r"(r) : "r"(x));
    return r;
}

static __device__ __forceinline__ u32 byte_perm(u32 a, u32 b, u32 selector) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
    return r;
}

static __device__ __forceinline__ uint4 load_shared16(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

// The products' element type (the cache's, or fp16 over an FP8 cache: E4M3 widens to it exactly) and the
// cache's element.
template <class T, bool KV8>
struct Mma {
    typedef T type;
    typedef u16 elem;
};
template <class T>
struct Mma<T, true> {
    typedef F16 type;
    typedef unsigned char elem;
};

static __device__ __forceinline__ u32 shared_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared (cp.async, L1 bypassed); bytes = 0 fills the 16 bytes with zeros instead.
static __device__ __forceinline__ void copy_async16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

static __device__ __forceinline__ void ldmatrix_x4(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

static __device__ __forceinline__ void ldmatrix_x4_trans(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

static __device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Arguments (pointers to 16-bit data as u16; strides in elements).
//   out [tokens, heads, HEAD_DIM]; partial_out [tokens, heads, num_splits, HEAD_DIM] fp32 and partial_ml
//   [tokens, heads, num_splits, 2] (max in log2 units, sum); counters [tokens * kv_heads] int32, zero between
//   launches. q [tokens, heads, HEAD_DIM]; cache [2, blocks, block_size, kv_heads, HEAD_DIM] (16-bit T, or
//   E4M3 bytes when KV8); kv_scale: float32 (k_scale, v_scale) of an FP8 cache (unread otherwise);
//   block_table [requests, max_blocks] (token t is request t); seq_lens [requests].
//   Grid: (num_splits, kv_heads, tokens); WARPS * 32 threads.
template <class T, bool KV8, int HEAD_DIM, int WARPS, int STAGES>
static __device__ __forceinline__ void decode_attention(
    u16* __restrict__ out, float* __restrict__ partial_out, float* __restrict__ partial_ml, int* __restrict__ counters,
    const u16* __restrict__ q, const typename Mma<T, KV8>::elem* __restrict__ cache, const float* __restrict__ kv_scale,
    const int* __restrict__ block_table,
    const int* __restrict__ seq_lens, float scale_log2, int group, int log2_block, int min_split, int single_max,
    int signal, long long stride_qt, long long stride_qh, long long stride_ot, long long stride_oh, long long stride_ckv,
    long long stride_cblock, long long stride_cslot, long long stride_chead, long long stride_bt) {
    using M = typename Mma<T, KV8>::type;     // the products' element type
    constexpr int ELEM = KV8 ? 1 : 2;          // bytes a cached value
    constexpr int TILE = 16;                   // KV positions a warp takes per step: one MMA's k (PV)
    constexpr int ROW_BYTES = HEAD_DIM * ELEM;
    constexpr int CHUNKS = ROW_BYTES / 16;     // 16-byte chunks of a row
    constexpr int TILE_BYTES = TILE * ROW_BYTES;
    constexpr int STAGE_BYTES = 2 * TILE_BYTES;  // K rows, then V rows
    constexpr int KSTEPS = HEAD_DIM / 16;
    constexpr int NTILES = HEAD_DIM / 8;
    constexpr int COPIES = TILE * CHUNKS / 32;   // 16-byte copies a lane makes of K (and of V) per tile
    static_assert(CHUNKS >= 8 && COPIES >= 1, "a row must be at least 128 bytes");
    static_assert(!KV8 || HEAD_DIM == 128, "the FP8 fragment maps are for head dim 128");

    extern __shared__ __align__(128) unsigned char smem[];
    const int split = blockIdx.x, kv_head = blockIdx.y, token = blockIdx.z;
    const int num_splits = gridDim.x, kv_heads = gridDim.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;

    asm volatile("griddepcontrol.wait;" ::: "memory");  // (returns at once without PDL)
    if (signal == 1) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

    // The split plan (kernels/decode_attention_cuda.py's `live_splits` is its host twin): a context of up
    // to single_max positions in one split (no merge), a longer one in whole tiles of at least min_split
    // positions, so a short context runs in fewer splits than launched.
    const int seq_len = seq_lens[token];
    int split_len = (seq_len + num_splits - 1) / num_splits;
    split_len = seq_len <= single_max ? max(seq_len, 1) : max((split_len + TILE - 1) / TILE * TILE, min_split);
    const int live = (seq_len + split_len - 1) / split_len;
    if (split >= live) return;
    const int start = split * split_len;
    const int end = min(start + split_len, seq_len);
    const int split_tiles = (end - start + TILE - 1) / TILE;
    const int my_tiles = split_tiles > warp ? (split_tiles - warp + WARPS - 1) / WARPS : 0;

    const int* bt_row = block_table + token * stride_bt;
    const int block_mask = (1 << log2_block) - 1;
    // Lane l holds the block id of the warp's tile (32 j + l); the next 32 arrive while these are used.
    auto tile_pos = [&](int i) { return start + (warp + i * WARPS) * TILE; };
    auto block_of = [&](int i) { return i < my_tiles ? bt_row[tile_pos(i) >> log2_block] : 0; };
    int blocks_now = block_of(lane);
    int blocks_next = block_of(32 + lane);

    unsigned char* ring = smem + warp * STAGES * STAGE_BYTES;
    const u32 ring_addr = shared_address(ring);
    typedef typename Mma<T, KV8>::elem E;  // a cached value
    const E* k_head = cache + kv_head * stride_chead;

    auto issue = [&](int i) {  // tile i of this warp into stage i % STAGES (an empty group past the end)
        if (i < my_tiles) {
            const int pos0 = tile_pos(i);
            const int block = __shfl_sync(0xffffffffu, blocks_now, i % 32);
            const E* base = k_head + block * stride_cblock + (pos0 & block_mask) * stride_cslot;
            const u32 stage = ring_addr + (i % STAGES) * STAGE_BYTES;
#pragma unroll
            for (int j = 0; j < COPIES; ++j) {
                const int c = lane + 32 * j, row = c / CHUNKS, chunk = c % CHUNKS;
                const int bytes = pos0 + row < end ? 16 : 0;
                const E* src = base + (bytes ? row : 0) * stride_cslot + chunk * (16 / ELEM);
                const u32 dst = stage + row * ROW_BYTES + ((chunk ^ (row & 7)) << 4);
                copy_async16(dst, src, bytes);
                copy_async16(dst + TILE_BYTES, src + stride_ckv, bytes);
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };

#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) issue(i);

    // Q as the A operand (rows = the group's heads; rows past the group are zero), all k steps in registers.
    u32 qa[KSTEPS][4];
    {
        const u16* q_tok = q + token * stride_qt;
        const int h0 = kv_head * group;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int row = g + (r & 1) * 8;
                // KV8: the dims lane t's K bytes hold (the header); else the MMA's own columns.
                const int col = KV8 ? 32 * t + 4 * kk + (r >> 1) * 2 : kk * 16 + 2 * t + (r >> 1) * 8;
                u32 v = row < group ? *reinterpret_cast<const u32*>(q_tok + (h0 + row) * stride_qh + col) : 0u;
                if constexpr (KV8) {  // to fp16, saturated (a q beyond fp16's range is not a real model's)
                    const float lo = fminf(fmaxf(widen(T(), u16(v & 0xffffu)), -65504.f), 65504.f);
                    const float hi = fminf(fmaxf(widen(T(), u16(v >> 16)), -65504.f), 65504.f);
                    v = F16::pack(lo, hi);
                }
                qa[kk][r] = v;
            }
        }
    }
    float v_scale = 1.f;
    if constexpr (KV8) {
        scale_log2 *= kv_scale[0];
        v_scale = kv_scale[1];
    }

    float m[2] = {NEG_INF, NEG_INF};  // running max (log2 units) of rows g and g + 8
    float l[2] = {0.f, 0.f};              // this lane's share of their sums (the quad's sum at the end)
    float acc[NTILES][4];
#pragma unroll
    for (int n = 0; n < NTILES; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

    // ldmatrix row addresses: lane l serves row l % 8 of matrix l / 8.
    const int mat = lane / 8, mrow = lane % 8;
    const int k_row = (mat >> 1) * 8 + mrow, k_chunk = mat & 1;  // K: (pos 0-7 | 8-15) x (dims lo | hi)
    const int v_row = (mat & 1) * 8 + mrow, v_chunk = mat >> 1;  // V: (pos 0-7 | 8-15) x (dims lo | hi)

    for (int i = 0; i < my_tiles; ++i) {
        __syncwarp();  // every lane is done reading the stage the next issue refills
        if ((i + STAGES - 1) % 32 == 0 && i + STAGES - 1 > 0) {
            blocks_now = blocks_next;
            blocks_next = block_of(i + STAGES - 1 + 32 + lane);
        }
        issue(i + STAGES - 1);
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1) : "memory");
        __syncwarp();  // tile i's copies by every lane have landed

        const u32 k_stage = ring_addr + (i % STAGES) * STAGE_BYTES;
        const u32 v_stage = k_stage + TILE_BYTES;
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        if constexpr (KV8) {
            // Rows g (positions 0-7's product) and g + 8: bytes 32 t .. +31, word kk = k step kk's four values.
            uint4 k8[2][2];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int row = g + 8 * j;
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    k8[j][h] = load_shared16(k_stage + row * ROW_BYTES + (((2 * t + h) ^ (row & 7)) << 4));
            }
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const uint4& w4 = k8[j][kk / 4];
                    const u32 w = (kk % 4 == 0) ? w4.x : (kk % 4 == 1) ? w4.y : (kk % 4 == 2) ? w4.z : w4.w;
                    M::mma(s[j], qa[kk], e4m3x2_to_f16x2(w), e4m3x2_to_f16x2(w >> 16));
                }
            }
        } else {
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk) {
                u32 b[4];
                ldmatrix_x4(b, k_stage + k_row * ROW_BYTES + (((2 * kk + k_chunk) ^ (k_row & 7)) << 4));
                M::mma(s[0], qa[kk], b[0], b[1]);
                M::mma(s[1], qa[kk], b[2], b[3]);
            }
        }
        // s[j][0..1]: row g, positions 8j + 2t, +1; s[j][2..3]: row g + 8, the same positions.
        const int pos0 = tile_pos(i);
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const bool valid = pos0 + 8 * j + 2 * t + (e & 1) < end;
                s[j][e] = valid ? s[j][e] * scale_log2 : NEG_INF;
                mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
            }
        }
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            const float m_new = fmaxf(m[r], mx[r]);  // finite: a tile has a valid position
            alpha[r] = fast_exp2(m[r] - m_new);
            m[r] = m_new;
        }
        u32 pa[4];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const float p0 = fast_exp2(s[j][0] - m[0]), p1 = fast_exp2(s[j][1] - m[0]);
            const float p2 = fast_exp2(s[j][2] - m[1]), p3 = fast_exp2(s[j][3] - m[1]);
            l[0] = (j ? l[0] : l[0] * alpha[0]) + p0 + p1;
            l[1] = (j ? l[1] : l[1] * alpha[1]) + p2 + p3;
            pa[2 * j] = M::pack(p0, p1);
            pa[2 * j + 1] = M::pack(p2, p3);
        }
#pragma unroll
        for (int n = 0; n < NTILES; ++n) {
            acc[n][0] *= alpha[0];
            acc[n][1] *= alpha[0];
            acc[n][2] *= alpha[1];
            acc[n][3] *= alpha[1];
        }
        if constexpr (KV8) {
            // Rows 2t, 2t + 1, 2t + 8, 2t + 9 (the positions of lane t's P values), bytes 16 g .. +15: byte nt
            // of each is column g of n tile nt.
            uint4 v8[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int row = 2 * t + (r & 1) + (r >> 1) * 8;
                v8[r] = load_shared16(v_stage + row * ROW_BYTES + ((g ^ (row & 7)) << 4));
            }
#pragma unroll
            for (int w = 0; w < 4; ++w) {  // word w: n tiles 4w .. 4w + 3
                const u32 a0 = w == 0 ? v8[0].x : w == 1 ? v8[0].y : w == 2 ? v8[0].z : v8[0].w;
                const u32 a1 = w == 0 ? v8[1].x : w == 1 ? v8[1].y : w == 2 ? v8[1].z : v8[1].w;
                const u32 a2 = w == 0 ? v8[2].x : w == 1 ? v8[2].y : w == 2 ? v8[2].z : v8[2].w;
                const u32 a3 = w == 0 ? v8[3].x : w == 1 ? v8[3].y : w == 2 ? v8[3].z : v8[3].w;
#pragma unroll
                for (int half = 0; half < 2; ++half) {  // bytes 2 half, 2 half + 1 of each word: two n tiles
                    const u32 sel = (2 * half) | ((4 + 2 * half) << 4) | ((2 * half + 1) << 8) | ((5 + 2 * half) << 12);
                    const u32 lo = byte_perm(a0, a1, sel), hi = byte_perm(a2, a3, sel);
                    const int nt = 4 * w + 2 * half;
                    M::mma(acc[nt], pa, e4m3x2_to_f16x2(lo), e4m3x2_to_f16x2(hi));
                    M::mma(acc[nt + 1], pa, e4m3x2_to_f16x2(lo >> 16), e4m3x2_to_f16x2(hi >> 16));
                }
            }
        } else {
#pragma unroll
            for (int nn = 0; nn < NTILES / 2; ++nn) {
                u32 b[4];
                ldmatrix_x4_trans(b, v_stage + v_row * ROW_BYTES + (((2 * nn + v_chunk) ^ (v_row & 7)) << 4));
                M::mma(acc[2 * nn], pa, b[0], b[1]);
                M::mma(acc[2 * nn + 1], pa, b[2], b[3]);
            }
        }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    if (signal == 2) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

    // The block's warps combine: [WARPS][16] max and sum, [WARPS][16][HEAD_DIM] outputs, over the rings.
    __syncthreads();
    float* w_m = reinterpret_cast<float*>(smem);
    float* w_l = w_m + WARPS * 16;
    float* w_acc = w_l + WARPS * 16;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        if (t == 0) {
            w_m[warp * 16 + g + 8 * r] = m[r];
            w_l[warp * 16 + g + 8 * r] = l[r];
        }
    }
#pragma unroll
    for (int n = 0; n < NTILES; ++n) {
        float* row0 = w_acc + (warp * 16 + g) * HEAD_DIM;
        if constexpr (KV8) {  // column c of n tile n is dim NTILES c + n (the header); v_scale applies here
            row0[2 * t * NTILES + n] = acc[n][0] * v_scale;
            row0[(2 * t + 1) * NTILES + n] = acc[n][1] * v_scale;
            row0[8 * HEAD_DIM + 2 * t * NTILES + n] = acc[n][2] * v_scale;
            row0[8 * HEAD_DIM + (2 * t + 1) * NTILES + n] = acc[n][3] * v_scale;
        } else {
            *reinterpret_cast<float2*>(row0 + 8 * n + 2 * t) = make_float2(acc[n][0], acc[n][1]);
            *reinterpret_cast<float2*>(row0 + 8 * HEAD_DIM + 8 * n + 2 * t) = make_float2(acc[n][2], acc[n][3]);
        }
    }
    __syncthreads();

    const int heads = kv_heads * group;
    const int h0 = kv_head * group;
    for (int e = threadIdx.x; e < group * HEAD_DIM; e += WARPS * 32) {
        const int row = e / HEAD_DIM, d = e % HEAD_DIM;
        float mm = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, w_m[w * 16 + row]);
        float sum = 0.f, o = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float wt = fast_exp2(w_m[w * 16 + row] - mm);  // 0 for a warp without tiles (-inf)
            sum += w_l[w * 16 + row] * wt;
            o += w_acc[(w * 16 + row) * HEAD_DIM + d] * wt;
        }
        if (live == 1) {
            out[token * stride_ot + (h0 + row) * stride_oh + d] = T::narrow(o / sum);
        } else {
            const long long p = ((long long)token * heads + h0 + row) * num_splits + split;
            partial_out[p * HEAD_DIM + d] = o;
            if (d == 0) {
                partial_ml[2 * p] = mm;
                partial_ml[2 * p + 1] = sum;
            }
        }
    }
    if (live == 1) return;

    // The last block of this (token, KV head) to get here merges the live splits' partials.
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int* counter = counters + token * kv_heads + kv_head;
        const int arrived = atomicAdd(counter, 1) + 1;
        is_last = arrived == live;
        if (is_last) *counter = 0;  // ready for the next launch (no other block of this pair is left)
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();

    // Each output element folds the live splits in with a running max: every split's max, sum and output
    // are independent loads, so one L2 round trip brings several splits (the unrolled loop).
    const long long row_base = (long long)token * heads + h0;
    for (int e = threadIdx.x; e < group * HEAD_DIM; e += WARPS * 32) {
        const int row = e / HEAD_DIM, d = e % HEAD_DIM;
        const float* ml = partial_ml + 2 * (row_base + row) * num_splits;
        const float* src = partial_out + (row_base + row) * num_splits * HEAD_DIM + d;
        float mm = NEG_INF, den = 0.f, o = 0.f;
#pragma unroll 8
        for (int s2 = 0; s2 < live; ++s2) {
            const float ms = __ldcg(ml + 2 * s2), ls = __ldcg(ml + 2 * s2 + 1), os = __ldcg(src + s2 * HEAD_DIM);
            const float m_new = fmaxf(mm, ms);
            const float old_w = fast_exp2(mm - m_new), w = fast_exp2(ms - m_new);
            den = den * old_w + ls * w;
            o = o * old_w + os * w;
            mm = m_new;
        }
        out[token * stride_ot + (h0 + row) * stride_oh + d] = T::narrow(o / den);
    }
}

// The cache argument is typed as its element: as `const void*` it changed the 16-bit kernels' code (188 -> 171
// registers, 0.3-0.8 us a layer slower; benches/RESULTS.md, thirty-eighth session).
#define FERROX_DECODE_ATTENTION(NAME, T, KV8, HEAD_DIM, WARPS, STAGES)                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) NAME(                                              \
        u16* out, float* partial_out, float* partial_ml, int* counters, const u16* q,                           \
        const Mma<T, KV8>::elem* cache, const float* kv_scale,                                                  \
        const int* block_table, const int* seq_lens, float scale_log2, int group, int log2_block,               \
        int min_split, int single_max, int signal, long long stride_qt, long long stride_qh,                    \
        long long stride_ot, long long stride_oh, long long stride_ckv, long long stride_cblock,                \
        long long stride_cslot, long long stride_chead, long long stride_bt) {                                  \
        decode_attention<T, KV8, HEAD_DIM, WARPS, STAGES>(                                                      \
            out, partial_out, partial_ml, counters, q, cache,   \
            kv_scale, block_table, seq_lens, scale_log2, group,                                                 \
            log2_block, min_split, single_max, signal, stride_qt, stride_qh, stride_ot, stride_oh, stride_ckv,  \
            stride_cblock, stride_cslot, stride_chead, stride_bt);                                              \
    }
