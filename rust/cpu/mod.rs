//! CPU kernels for quantized models: the decode step of a GGUF model run from its 4- and 8-bit
//! blocks, in Rust, on every core.
//!
//! A one-token decode step is a walk over all the weights (about 96 MB for the embedded SmolLM2),
//! so it is bound by memory bandwidth and by the overhead between kernels. torch's int4 CPU
//! matmul spent 6 ms a token on the matmuls and eager torch another 12 ms on the 400 small ops
//! around them. Here the whole decoder stack of a decode step is one call (`decoder`): the
//! matrix-vector products read each block's bytes once with int8 SIMD dot products (`quant`,
//! `simd`), and the norms, rotary, KV writes and paged attention in between (`ops`, `attention`)
//! run on the same threads (`pool`) with no allocation churn and no dispatch.
//!
//! Pure Rust: the Python glue is `crate::py::cpu`.

pub mod attention;
mod attention_simd;
pub mod decoder;
pub mod ops;
pub mod pool;
pub mod quant;
mod simd;
