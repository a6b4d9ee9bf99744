//! ferrox's engine bookkeeping: KV block pool, prefix-hash cache, KV cache manager, request
//! state and stop checks, the token-budget scheduler, n-gram draft proposals for speculative
//! decoding, the incremental detokenizer, and the columnar step results; and `cpu`, the CPU
//! kernels that run a quantized model's decode step.
//! The core modules never touch Python; the PyO3 glue lives in `py/` behind the "python"
//! feature, so `cargo test --no-default-features` runs without libpython.

pub mod batch;
pub mod block_pool;
pub mod cbor_block_hash;
pub mod cpu;
pub mod detokenizer;
pub mod error;
pub mod host_tier;
pub mod kv_cache_manager;
pub mod kv_events;
pub mod ngram;
pub mod partial_prefills;
pub mod prefix_cache;
pub mod request;
pub mod scheduler;
pub mod speculative;
pub mod state_snapshots;
pub mod stats;
pub mod step_outputs;

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod proptests_snapshots;

#[cfg(feature = "python")]
mod py;

#[cfg(feature = "python")]
use pyo3::prelude::*;

#[cfg(feature = "python")]
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    py::register(m)
}
