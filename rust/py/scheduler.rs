use numpy::{PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::extract_token_ids;
use super::scheduler_output::PySchedulerOutput;
use super::stats::PySchedulerStats;
use super::step_outputs::PyStepOutputs;
use crate::cbor_block_hash::{ExtraKey, HashSeed, ItemSpan};
use crate::error::invalid;
use crate::kv_events::KvEvent;
use crate::prefix_cache::HashAlgo;
use crate::scheduler::{NewRequest, Scheduler, SchedulerConfig};
use crate::speculative::{ExternalDrafts, SpeculativeConfig};

/// The engine's scheduler: one `schedule()` and one `update_from_output()` per step.
#[pyclass(name = "Scheduler", module = "ferrox._core")]
pub struct PyScheduler {
    inner: Scheduler,
}

/// add_request releases the GIL for prompts at least this long (hashing their blocks takes
/// ~100 us and up). A short prompt's work is shorter than the wait to take the GIL back from a
/// busy thread, so it keeps the GIL.
const DETACH_MIN_PROMPT_TOKENS: usize = 16 * 1024;

/// Sampled ids as i64: an int64 or int32 numpy array (or a list, for tests).
fn extract_sampled(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    extract_ints("sampled_token_ids", obj)
}

/// A 1-D int64 or int32 numpy array (or a list of ints) as i64.
fn extract_ints(field: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return Ok(match a.as_slice() {
            Ok(s) => s.to_vec(),
            Err(_) => a.as_array().to_vec(),
        });
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return Ok(a.as_array().iter().map(|&x| x as i64).collect());
    }
    if let Ok(a) = obj.cast::<numpy::PyUntypedArray>() {
        return Err(invalid(
            field,
            format!(
                "expected a 1-D int64 array, got dtype {} with {} dims",
                a.dtype(),
                a.ndim()
            ),
        )
        .into());
    }
    obj.extract::<Vec<i64>>()
        .map_err(|_| invalid(field, "expected a 1-D int64 numpy array").into())
}

/// Per-row counts as i32 (values are checked against the step by the core).
fn extract_counts(field: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<i32>> {
    extract_ints(field, obj)?
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            i32::try_from(c).map_err(|_| {
                invalid(&format!("{field}[{i}]"), format!("{c} is out of range")).into()
            })
        })
        .collect()
}

fn extract_force_stop(obj: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, bool>>() {
        return Ok(a.as_array().to_vec());
    }
    obj.extract::<Vec<bool>>()
        .map_err(|_| invalid("force_stop", "expected a 1-D bool numpy array").into())
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (
        *,
        num_blocks,
        max_model_len,
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        enable_prefix_caching=true,
        policy="fcfs",
        tokenizer_json=None,
        eos_token_ids=Vec::new(),
        num_speculative_tokens=0,
        speculative_method="ngram",
        prompt_lookup_min=1,
        prompt_lookup_max=5,
        max_loras=0,
        enable_chunked_prefill=true,
        long_prefill_token_threshold=0,
        max_num_partial_prefills=1,
        max_long_partial_prefills=1,
        prefix_caching_hash_algo="sha256",
        prefix_hash_seed=None,
        host_cache_blocks=0,
        recurrent_states=false,
        mamba_block_size=0,
        state_snapshot_slots=0,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: i64,
        max_model_len: i64,
        block_size: i64,
        max_num_seqs: i64,
        max_num_batched_tokens: i64,
        enable_prefix_caching: bool,
        policy: &str,
        tokenizer_json: Option<&str>,
        eos_token_ids: Vec<i64>,
        num_speculative_tokens: i64,
        speculative_method: &str,
        prompt_lookup_min: i64,
        prompt_lookup_max: i64,
        max_loras: i64,
        enable_chunked_prefill: bool,
        long_prefill_token_threshold: i64,
        max_num_partial_prefills: usize,
        max_long_partial_prefills: usize,
        prefix_caching_hash_algo: &str,
        prefix_hash_seed: Option<&Bound<'_, PyAny>>,
        host_cache_blocks: usize,
        recurrent_states: bool,
        mamba_block_size: usize,
        state_snapshot_slots: usize,
    ) -> PyResult<Self> {
        // The root of vLLM's CBOR chains: PYTHONHASHSEED's value (str) or random bytes.
        let seed = match prefix_hash_seed {
            None => None,
            Some(obj) => Some(if let Ok(text) = obj.extract::<String>() {
                HashSeed::Text(text)
            } else if let Ok(bytes) = obj.extract::<Vec<u8>>() {
                HashSeed::Bytes(bytes)
            } else {
                return Err(invalid("prefix_hash_seed", "must be a str or bytes").into());
            }),
        };
        let hash_algo = HashAlgo::parse(prefix_caching_hash_algo).ok_or_else(|| {
            crate::error::invalid(
                "prefix_caching_hash_algo",
                format!(
                    "{prefix_caching_hash_algo:?} is not one of sha256, sha256_cbor, xxhash, xxhash_cbor"
                ),
            )
        })?;
        if long_prefill_token_threshold < 0 {
            return Err(crate::error::invalid(
                "long_prefill_token_threshold",
                format!("must be >= 0 (0: off), got {long_prefill_token_threshold}"),
            )
            .into());
        }
        if long_prefill_token_threshold > 0 && !enable_chunked_prefill {
            return Err(crate::error::invalid(
                "long_prefill_token_threshold",
                "caps prefill chunks: it needs enable_chunked_prefill",
            )
            .into());
        }
        if max_loras < 0 {
            return Err(crate::error::invalid(
                "max_loras",
                format!("must be >= 0, got {max_loras}"),
            )
            .into());
        }
        let spec = SpeculativeConfig::from_signed(
            num_speculative_tokens,
            speculative_method,
            prompt_lookup_min,
            prompt_lookup_max,
        )?;
        let cfg = SchedulerConfig::from_signed(
            num_blocks,
            block_size,
            max_model_len,
            max_num_seqs,
            max_num_batched_tokens,
            enable_prefix_caching,
            policy,
            &eos_token_ids,
        )?
        .with_speculation(spec)
        .with_max_loras(max_loras as usize)
        .with_chunked_prefill(enable_chunked_prefill)
        .with_long_prefill_token_threshold(long_prefill_token_threshold as usize)
        .with_partial_prefills(max_num_partial_prefills, max_long_partial_prefills)?
        .with_hash_algo(hash_algo, seed)?
        .with_host_tier(host_cache_blocks);
        let cfg = if recurrent_states {
            cfg.with_recurrent_states(mamba_block_size, state_snapshot_slots)?
        } else if mamba_block_size != 0 || state_snapshot_slots != 0 {
            return Err(crate::error::invalid(
                "mamba_block_size",
                "state snapshots are for a model with recurrent states (recurrent_states=True)",
            )
            .into());
        } else {
            cfg
        };
        let inner = py.detach(|| Scheduler::new(cfg, tokenizer_json))?;
        Ok(PyScheduler { inner })
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.config().block_size
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.config().num_blocks
    }

    #[getter]
    fn max_model_len(&self) -> usize {
        self.inner.config().max_model_len
    }

    #[getter]
    fn num_speculative_tokens(&self) -> usize {
        self.inner.config().spec.num_speculative_tokens
    }

    #[pyo3(signature = (
        request_id,
        prompt_token_ids,
        *,
        max_tokens,
        min_tokens=0,
        ignore_eos=false,
        stop_token_ids=Vec::new(),
        stop=Vec::new(),
        include_stop_str_in_output=false,
        repetition_detection=None,
        skip_special_tokens=true,
        detokenize=true,
        priority=0,
        cache_salt=None,
        lora_id=0,
        lora_name=None,
        mm_items=Vec::new(),
        wait_for_grammar=false,
        allow_drafts=true,
        atomic_spans=Vec::new(),
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        py: Python<'_>,
        request_id: String,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: i64,
        min_tokens: i64,
        ignore_eos: bool,
        stop_token_ids: Vec<i64>,
        stop: Vec<String>,
        include_stop_str_in_output: bool,
        repetition_detection: Option<(i64, i64, i64)>,
        skip_special_tokens: bool,
        detokenize: bool,
        priority: i64,
        cache_salt: Option<String>,
        lora_id: i64,
        lora_name: Option<String>,
        mm_items: Vec<(String, usize, usize)>,
        wait_for_grammar: bool,
        allow_drafts: bool,
        atomic_spans: Vec<(usize, usize)>,
    ) -> PyResult<usize> {
        let prompt = extract_token_ids("prompt_token_ids", prompt_token_ids)?;
        let stop_ids = stop_token_ids
            .iter()
            .enumerate()
            .map(|(i, &t)| crate::scheduler::token_id(&format!("stop_token_ids[{i}]"), t))
            .collect::<Result<Vec<_>, _>>()?;
        let long_prompt = prompt.len() >= DETACH_MIN_PROMPT_TOKENS;
        let inner = &mut self.inner;
        let add = move || {
            inner.add_request(NewRequest {
                request_id,
                prompt_token_ids: prompt,
                max_tokens,
                min_tokens,
                ignore_eos,
                stop_token_ids: stop_ids,
                stop,
                include_stop_str_in_output,
                repetition: repetition_detection,
                skip_special_tokens,
                detokenize,
                priority,
                cache_salt,
                lora_id,
                lora_name,
                mm_items: mm_items
                    .into_iter()
                    .map(|(identifier, offset, length)| ItemSpan {
                        identifier,
                        offset,
                        length,
                    })
                    .collect(),
                wait_for_grammar,
                allow_drafts,
                atomic_spans,
            })
        };
        let slot = if long_prompt { py.detach(add)? } else { add()? };
        Ok(slot)
    }

    fn grammar_ready(&mut self, request_ids: Vec<String>) {
        self.inner.grammar_ready(&request_ids);
    }

    fn abort_requests(&mut self, request_ids: Vec<String>) -> PyStepOutputs {
        self.inner.abort_requests(&request_ids).into()
    }

    #[pyo3(signature = (*, keep_in_flight=false, draft_slots=None, draft_token_ids=None, draft_offsets=None))]
    fn schedule(
        &mut self,
        py: Python<'_>,
        keep_in_flight: bool,
        draft_slots: Option<&Bound<'_, PyAny>>,
        draft_token_ids: Option<&Bound<'_, PyAny>>,
        draft_offsets: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PySchedulerOutput> {
        let drafts = match (draft_slots, draft_token_ids, draft_offsets) {
            (None, None, None) => None,
            (Some(s), Some(t), Some(o)) => Some(ExternalDrafts::new(
                &extract_ints("draft_slots", s)?,
                &extract_ints("draft_token_ids", t)?,
                &extract_ints("draft_offsets", o)?,
            )?),
            _ => {
                return Err(invalid(
                    "draft_slots",
                    "draft_slots, draft_token_ids and draft_offsets go together (all or none)",
                )
                .into())
            }
        };
        let inner = &mut self.inner;
        let out = py.detach(|| inner.schedule_with_drafts(keep_in_flight, drafts.as_ref()));
        PySchedulerOutput::new(py, out)
    }

    #[pyo3(signature = (sampled_token_ids, force_stop=None, *, num_sampled_tokens=None))]
    fn update_from_output(
        &mut self,
        py: Python<'_>,
        sampled_token_ids: &Bound<'_, PyAny>,
        force_stop: Option<&Bound<'_, PyAny>>,
        num_sampled_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyStepOutputs> {
        let sampled = extract_sampled(sampled_token_ids)?;
        let force = force_stop.map(extract_force_stop).transpose()?;
        let counts = num_sampled_tokens
            .map(|c| extract_counts("num_sampled_tokens", c))
            .transpose()?;
        let inner = &mut self.inner;
        // Every column is built here, without the GIL; Python objects are made per column,
        // on first access (PyStepOutputs).
        let outs = py.detach(|| {
            inner.update_from_output_counts(&sampled, counts.as_deref(), force.as_deref())
        })?;
        Ok(outs.into())
    }

    fn has_unfinished_requests(&self) -> bool {
        self.inner.has_unfinished_requests()
    }

    fn num_unfinished_requests(&self) -> usize {
        self.inner.num_unfinished_requests()
    }

    fn reset_prefix_cache(&mut self) -> bool {
        self.inner.reset_prefix_cache()
    }

    /// A hybrid model's state snapshots: (restored, saved, held now); None without them.
    #[getter]
    fn state_snapshot_counts(&self) -> Option<(u64, u64, usize)> {
        self.inner
            .state_snapshots()
            .map(|s| (s.num_restored, s.num_saved, s.len()))
    }

    fn preempt_all(&mut self) -> PyResult<usize> {
        Ok(self.inner.preempt_all()?)
    }

    fn stats(&self) -> PySchedulerStats {
        self.inner.stats().into()
    }

    /// Records the prefix cache's events from now on (vLLM's --kv-events-config).
    fn record_kv_events(&mut self) {
        self.inner.record_kv_events();
    }

    /// The prefix cache's events since the last call, oldest first, as tuples:
    /// ("stored", block_hashes, parent_block_hash or None, token_ids, lora_id, extra_keys),
    /// ("removed", block_hashes), ("stored_host", block_hashes) / ("removed_host", block_hashes)
    /// for the host tier, and ("cleared",). Empty unless record_kv_events was called.
    /// extra_keys: under vLLM's CBOR hashes, one tuple (or None) per block, of the adapter's name,
    /// (identifier, offset) pairs and the salt, as vLLM hashes them; otherwise None.
    fn take_kv_events(&mut self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        self.inner
            .take_kv_events()
            .into_iter()
            .map(|event| {
                Ok(match event {
                    KvEvent::Stored {
                        block_hashes,
                        parent_block_hash,
                        token_ids,
                        lora_id,
                        extra_keys,
                    } => (
                        "stored",
                        block_hashes,
                        parent_block_hash,
                        token_ids,
                        lora_id,
                        extra_keys.map(|blocks| {
                            blocks
                                .into_iter()
                                .map(|keys| keys.map(|k| extra_keys_tuple(py, k)))
                                .collect::<Vec<_>>()
                        }),
                    )
                        .into_pyobject(py)?
                        .into_any()
                        .unbind(),
                    KvEvent::Removed { block_hashes } => ("removed", block_hashes)
                        .into_pyobject(py)?
                        .into_any()
                        .unbind(),
                    KvEvent::HostStored { block_hashes } => ("stored_host", block_hashes)
                        .into_pyobject(py)?
                        .into_any()
                        .unbind(),
                    KvEvent::HostRemoved { block_hashes } => ("removed_host", block_hashes)
                        .into_pyobject(py)?
                        .into_any()
                        .unbind(),
                    KvEvent::Cleared => ("cleared",).into_pyobject(py)?.into_any().unbind(),
                })
            })
            .collect()
    }

    fn request_block_ids(&self, request_id: &str) -> PyResult<Vec<u32>> {
        Ok(self.inner.request_block_ids(request_id)?)
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!(
            "Scheduler(num_blocks={}, block_size={}, max_model_len={}, running={}, waiting={})",
            c.num_blocks,
            c.block_size,
            c.max_model_len,
            self.inner.num_running(),
            self.inner.num_unfinished_requests() - self.inner.num_running()
        )
    }
}

/// One block's extra keys as the tuple vLLM hashes: names as str, items as (identifier, offset).
fn extra_keys_tuple(py: Python<'_>, keys: Vec<ExtraKey>) -> Py<pyo3::types::PyTuple> {
    let items = keys.into_iter().map(|key| match key {
        ExtraKey::Text(text) => text.into_pyobject(py).expect("str").into_any().unbind(),
        ExtraKey::Item(identifier, offset) => (identifier, offset)
            .into_pyobject(py)
            .expect("tuple")
            .into_any()
            .unbind(),
    });
    pyo3::types::PyTuple::new(py, items)
        .expect("tuple")
        .unbind()
}
