// torch binding of top_k_top_p_sampling.cu (JIT-built by python/ferrox/kernels/cuda_sampling.py).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

void launch_top_k_top_p_sample(const float* probs, int64_t row_stride, const int32_t* top_k, const float* top_p,
                               const float* uniforms, int64_t* out, int batch, int vocab, cudaStream_t stream);

torch::Tensor top_k_top_p_sample(torch::Tensor probs, torch::Tensor top_k, torch::Tensor top_p,
                                 torch::Tensor uniforms) {
    TORCH_CHECK(probs.is_cuda() && probs.dim() == 2 && probs.scalar_type() == torch::kFloat32,
                "probs must be a float32 CUDA tensor [batch, vocab]");
    TORCH_CHECK(probs.stride(1) == 1, "probs needs a contiguous vocab axis");
    const auto batch = probs.size(0);
    TORCH_CHECK(top_k.is_cuda() && top_k.scalar_type() == torch::kInt32 && top_k.numel() == batch,
                "top_k must be int32 CUDA [batch]");
    TORCH_CHECK(top_p.is_cuda() && top_p.scalar_type() == torch::kFloat32 && top_p.numel() == batch,
                "top_p must be float32 CUDA [batch]");
    TORCH_CHECK(uniforms.is_cuda() && uniforms.scalar_type() == torch::kFloat32 && uniforms.numel() == batch,
                "uniforms must be float32 CUDA [batch]");
    const c10::cuda::CUDAGuard guard(probs.device());
    auto top_k_c = top_k.contiguous();
    auto top_p_c = top_p.contiguous();
    auto uniforms_c = uniforms.contiguous();
    auto out = torch::empty({batch}, probs.options().dtype(torch::kInt64));
    launch_top_k_top_p_sample(probs.data_ptr<float>(), probs.stride(0), top_k_c.data_ptr<int32_t>(),
                              top_p_c.data_ptr<float>(), uniforms_c.data_ptr<float>(), out.data_ptr<int64_t>(),
                              static_cast<int>(batch), static_cast<int>(probs.size(1)),
                              at::cuda::getCurrentCUDAStream());
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("top_k_top_p_sample", &top_k_top_p_sample,
          "Sample one token per row from probs after top-k then top-p, without sorting the vocabulary");
}
