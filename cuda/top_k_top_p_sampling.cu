// Fused top-k / top-p sampling from probabilities, one thread block per row, no vocabulary sort.
//
// 1. Thresholds by radix select on the float bits. Probabilities are >= 0, so their IEEE bit
//    patterns order like the values. A first pass sums, in registers, the count (top-k) or mass
//    (top-p) per octave below the row max; the octave where the running count reaches k (or the
//    running mass reaches top_p * mass of the top-k set) fixes the sign and exponent bits. Three
//    more passes over the 23 mantissa bits (8, 8, 7) build shared-memory histograms of the tokens
//    still matching the bits fixed so far, and a scan from the top bin picks the next digit.
//    The result is the exact value of the token at the cut; every token >= it is kept (ties at
//    the cut kept, as the sort-based path does). Tokens whose octave-sums never reach the target
//    within 15 octaves fall back to four 8-bit passes from the top bit.
// 2. Sample by inverse CDF with one uniform per row: thread t owns tokens t, t + blockDim, ...;
//    a block scan of the per-thread kept mass finds the thread whose range holds u * kept_mass,
//    and that thread walks its own tokens. The order of tokens does not change the distribution.
//
// Host code (the torch binding) lives in top_k_top_p_sampling.cpp so this file compiles without
// torch headers.

#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;
constexpr int kOctaves = 16;  // powers of two below the row max tracked in registers; the last one is "all below"

struct SharedState {
    unsigned int count[kBins];
    float mass[kBins];
    float warp_sums[kWarps];
    float octave[kWarps][kOctaves];
    unsigned int prefix;       // threshold bits fixed so far
    float above;               // mass (or count) of tokens strictly above the current prefix range
    unsigned int max_bits;
    int found;
    int winner;
    int fallback;
};

// Radix select over the tokens with bits >= floor_bits whose top `known_bits` bits equal `prefix`
// (those above it weigh `above`). kByMass: stop where the running mass from the top reaches
// target; else where the running count does. Digits of 8 bits (the last one may be shorter).
template <bool kByMass>
__device__ unsigned int radix_select(const float* __restrict__ row, int vocab, unsigned int floor_bits, float target,
                                     unsigned int prefix, int known_bits, float above, SharedState& s) {
    __syncthreads();  // everyone is done reading s.prefix from a previous select
    if (threadIdx.x == 0) {
        s.prefix = prefix;
        s.above = above;
    }
    for (int low = 32 - known_bits; low > 0;) {
        const int width = low >= 8 ? 8 : low;
        const int shift = low - width;
        const int bins = 1 << width;
        for (int b = threadIdx.x; b < bins; b += blockDim.x) {
            s.count[b] = 0u;
            s.mass[b] = 0.0f;
        }
        __syncthreads();
        const unsigned int high_mask = shift + width >= 32 ? 0u : ~((1u << (shift + width)) - 1u);
        const unsigned int fixed = s.prefix;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float p = row[i];
            const unsigned int bits = __float_as_uint(p);
            if (bits >= floor_bits && (bits & high_mask) == fixed) {
                const unsigned int digit = (bits >> shift) & static_cast<unsigned int>(bins - 1);
                if (kByMass) {
                    atomicAdd(&s.mass[digit], p);
                } else {
                    atomicAdd(&s.count[digit], 1u);
                }
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float running = s.above;
            int chosen = -1;
            int lowest_nonempty = 0;
            for (int d = bins - 1; d >= 0; --d) {
                const float h = kByMass ? s.mass[d] : static_cast<float>(s.count[d]);
                if (h > 0.0f) lowest_nonempty = d;
                if (h > 0.0f && running + h >= target) {
                    chosen = d;
                    break;
                }
                running += h;
            }
            if (chosen < 0) {
                // Rounding left the target just out of reach: keep everything that is left.
                chosen = lowest_nonempty;
                running -= kByMass ? s.mass[chosen] : static_cast<float>(s.count[chosen]);
            }
            s.prefix = fixed | (static_cast<unsigned int>(chosen) << shift);
            s.above = running;
        }
        __syncthreads();
        low = shift;
    }
    return s.prefix;
}

__device__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Coarse first step without atomics: each thread sums count (or mass) per octave below the row
// max in registers, a block reduction merges them, and the octave holding the cut fixes the
// sign and exponent bits (9 of 32) for radix_select. Returns false when the cut lies in the
// "all below" octave (then the full radix select runs).
template <bool kByMass>
__device__ bool octave_prefilter(const float* __restrict__ row, int vocab, unsigned int floor_bits, float target,
                                 unsigned int* prefix, float* above, SharedState& s) {
    const int top_exp = static_cast<int>(s.max_bits >> 23);
    float acc[kOctaves];
#pragma unroll
    for (int j = 0; j < kOctaves; ++j) acc[j] = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float p = row[i];
        const unsigned int bits = __float_as_uint(p);
        if (bits < floor_bits) continue;
        const int d = min(top_exp - static_cast<int>(bits >> 23), kOctaves - 1);
        const float v = kByMass ? p : 1.0f;
#pragma unroll
        for (int j = 0; j < kOctaves; ++j) acc[j] += d == j ? v : 0.0f;
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
#pragma unroll
    for (int j = 0; j < kOctaves; ++j) {
        const float v = warp_sum(acc[j]);
        if (lane == 0) s.octave[warp][j] = v;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float running = 0.0f;
        s.found = 0;
        for (int j = 0; j < kOctaves - 1; ++j) {
            float h = 0.0f;
            for (int w = 0; w < kWarps; ++w) h += s.octave[w][j];
            if (h > 0.0f && running + h >= target) {
                s.found = 1;
                s.prefix = static_cast<unsigned int>(top_exp - j) << 23;
                s.above = running;
                break;
            }
            running += h;
        }
    }
    __syncthreads();
    const bool found = s.found != 0;
    *prefix = s.prefix;
    *above = s.above;
    return found;
}

// Threshold bits of the token where the count (or mass) from the top reaches target.
template <bool kByMass>
__device__ unsigned int select_threshold(const float* __restrict__ row, int vocab, unsigned int floor_bits,
                                         float target, SharedState& s) {
    unsigned int prefix = 0u;
    float above = 0.0f;
    if (octave_prefilter<kByMass>(row, vocab, floor_bits, target, &prefix, &above, s)) {
        return radix_select<kByMass>(row, vocab, floor_bits, target, prefix, 9, above, s);
    }
    return radix_select<kByMass>(row, vocab, floor_bits, target, 0u, 0, 0.0f, s);
}

__device__ unsigned int block_max_bits(const float* __restrict__ row, int vocab, SharedState& s) {
    unsigned int m = 0u;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) m = max(m, __float_as_uint(row[i]));
    for (int offset = 16; offset > 0; offset >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if (threadIdx.x == 0) s.max_bits = 0u;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) atomicMax(&s.max_bits, m);
    __syncthreads();
    return s.max_bits;
}

__device__ float block_exclusive_scan(float value, float* total, SharedState& s) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    __syncthreads();  // warp_sums may still be read from a previous scan
    float inclusive = value;
    for (int offset = 1; offset < 32; offset <<= 1) {
        const float other = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += other;
    }
    if (lane == 31) s.warp_sums[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        float w = lane < kWarps ? s.warp_sums[lane] : 0.0f;
        for (int offset = 1; offset < 32; offset <<= 1) {
            const float other = __shfl_up_sync(0xffffffffu, w, offset);
            if (lane >= offset) w += other;
        }
        if (lane < kWarps) s.warp_sums[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const float warp_offset = warp == 0 ? 0.0f : s.warp_sums[warp - 1];
    *total = s.warp_sums[kWarps - 1];
    return warp_offset + inclusive - value;
}

__global__ void __launch_bounds__(kThreads, 2)
top_k_top_p_sample_kernel(const float* __restrict__ probs, int64_t row_stride, const int32_t* __restrict__ top_k,
                          const float* __restrict__ top_p, const float* __restrict__ uniforms,
                          int64_t* __restrict__ out, int vocab) {
    __shared__ SharedState s;
    const int row_id = blockIdx.x;
    const float* row = probs + static_cast<int64_t>(row_id) * row_stride;

    block_max_bits(row, vocab, s);

    // Top-k threshold (0 bits = keep all).
    unsigned int threshold = 0u;
    const int k = top_k[row_id];
    if (k > 0 && k < vocab) {
        threshold = select_threshold<false>(row, vocab, 0u, static_cast<float>(k), s);
    }

    // Top-p threshold inside the top-k set, relative to that set's mass.
    const float p = top_p[row_id];
    if (p < 1.0f) {
        float kept = 0.0f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float v = row[i];
            if (__float_as_uint(v) >= threshold) kept += v;
        }
        float total;
        block_exclusive_scan(kept, &total, s);
        threshold = select_threshold<true>(row, vocab, threshold, p * total, s);
    }

    // Inverse CDF over the kept tokens in this thread-major order.
    float mine = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i];
        if (__float_as_uint(v) >= threshold) mine += v;
    }
    float total;
    const float before = block_exclusive_scan(mine, &total, s);
    const float target = uniforms[row_id] * total;
    if (threadIdx.x == 0) {
        s.winner = kThreads;
        s.fallback = -1;
    }
    __syncthreads();
    if (mine > 0.0f) {
        if (before + mine > target) atomicMin(&s.winner, static_cast<int>(threadIdx.x));
        atomicMax(&s.fallback, static_cast<int>(threadIdx.x));  // target at/after the end: last kept
    }
    __syncthreads();
    const int winner = s.winner < kThreads ? s.winner : s.fallback;
    if (winner < 0) {
        if (threadIdx.x == 0) out[row_id] = 0;  // all-zero row: nothing to sample from
        return;
    }
    if (static_cast<int>(threadIdx.x) == winner) {
        float running = before;
        int64_t chosen = -1;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float v = row[i];
            if (v > 0.0f && __float_as_uint(v) >= threshold) {
                chosen = i;
                running += v;
                if (running > target) break;
            }
        }
        out[row_id] = chosen;
    }
}

}  // namespace

void launch_top_k_top_p_sample(const float* probs, int64_t row_stride, const int32_t* top_k, const float* top_p,
                               const float* uniforms, int64_t* out, int batch, int vocab, cudaStream_t stream) {
    if (batch == 0) return;
    top_k_top_p_sample_kernel<<<batch, kThreads, 0, stream>>>(probs, row_stride, top_k, top_p, uniforms, out, vocab);
}
