// Fused top-k / top-p sampling from probabilities, one thread block per row, no vocabulary sort.
//
// 1. Thresholds by radix select on the float bits. Probabilities are >= 0, so their IEEE bit
//    patterns order like the values. Four passes, 8 bits each, build a 256-bin histogram (token
//    count for top-k, probability mass for top-p) of the tokens that still match the bits fixed
//    so far; a scan from the top bin finds the bin where the running count reaches k (or the
//    running mass reaches top_p * mass of the top-k set). After four passes the threshold is the
//    exact value of the token at the cut; every token >= it is kept (ties at the cut kept, as the
//    sort-based path does).
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

struct SharedState {
    unsigned int count[kBins];
    float mass[kBins];
    float warp_sums[kWarps];
    unsigned int prefix;       // threshold bits fixed so far
    float above;               // mass (or count) of tokens strictly above the current prefix range
    int winner;
    int fallback;
};

// Radix select over the tokens with bits >= floor_bits. kByMass: stop where the running mass from
// the top reaches target_mass; else where the running count reaches target_count.
template <bool kByMass>
__device__ unsigned int radix_select(const float* __restrict__ row, int vocab, unsigned int floor_bits,
                                     float target_mass, unsigned int target_count, SharedState& s) {
    if (threadIdx.x == 0) {
        s.prefix = 0u;
        s.above = 0.0f;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < kBins; b += blockDim.x) {
            s.count[b] = 0u;
            s.mass[b] = 0.0f;
        }
        __syncthreads();
        const unsigned int high_mask = shift == 24 ? 0u : ~((1u << (shift + 8)) - 1u);
        const unsigned int prefix = s.prefix;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float p = row[i];
            const unsigned int bits = __float_as_uint(p);
            if (bits >= floor_bits && (bits & high_mask) == prefix) {
                const unsigned int digit = (bits >> shift) & 0xffu;
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
            for (int d = kBins - 1; d >= 0; --d) {
                const float h = kByMass ? s.mass[d] : static_cast<float>(s.count[d]);
                if (h > 0.0f) lowest_nonempty = d;
                const bool reached = kByMass ? (running + h >= target_mass && h > 0.0f)
                                             : (running + h >= static_cast<float>(target_count) && h > 0.0f);
                if (reached) {
                    chosen = d;
                    break;
                }
                running += h;
            }
            if (chosen < 0) {
                // Rounding left the target just out of reach: keep everything that is left.
                chosen = lowest_nonempty;
                const float h = kByMass ? s.mass[chosen] : static_cast<float>(s.count[chosen]);
                running -= h;
            }
            s.prefix = prefix | (static_cast<unsigned int>(chosen) << shift);
            s.above = running;
        }
        __syncthreads();
    }
    return s.prefix;
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

__global__ void __launch_bounds__(kThreads)
top_k_top_p_sample_kernel(const float* __restrict__ probs, int64_t row_stride, const int32_t* __restrict__ top_k,
                          const float* __restrict__ top_p, const float* __restrict__ uniforms,
                          int64_t* __restrict__ out, int vocab) {
    __shared__ SharedState s;
    const int row_id = blockIdx.x;
    const float* row = probs + static_cast<int64_t>(row_id) * row_stride;

    // Top-k threshold (0 bits = keep all).
    unsigned int threshold = 0u;
    const int k = top_k[row_id];
    if (k > 0 && k < vocab) {
        threshold = radix_select<false>(row, vocab, 0u, 0.0f, static_cast<unsigned int>(k), s);
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
        threshold = radix_select<true>(row, vocab, threshold, p * total, 0u, s);
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
