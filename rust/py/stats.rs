use pyo3::prelude::*;

use crate::stats::SchedulerStats;

/// Scheduler counters for metrics, read after each step (`Scheduler.stats()`).
#[pyclass(name = "SchedulerStats", module = "ferrox._core", get_all, frozen)]
pub struct PySchedulerStats {
    num_running: usize,
    num_waiting: usize,
    num_total_blocks: usize,
    num_free_blocks: usize,
    kv_cache_usage: f64,
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
    host_cache_hits: u64,
    host_cache_blocks: usize,
    num_preemptions: u64,
    num_scheduled_tokens: usize,
    num_prompt_tokens: u64,
    num_generation_tokens: u64,
    num_drafts: u64,
    num_draft_tokens: u64,
    num_accepted_tokens: u64,
    num_accepted_tokens_per_pos: Vec<u64>,
    running_lora_ids: Vec<i64>,
    waiting_lora_ids: Vec<i64>,
}

impl From<SchedulerStats> for PySchedulerStats {
    fn from(s: SchedulerStats) -> Self {
        PySchedulerStats {
            num_running: s.num_running,
            num_waiting: s.num_waiting,
            num_total_blocks: s.num_total_blocks,
            num_free_blocks: s.num_free_blocks,
            kv_cache_usage: s.kv_cache_usage,
            prefix_cache_queries: s.prefix_cache_queries,
            prefix_cache_hits: s.prefix_cache_hits,
            host_cache_hits: s.host_cache_hits,
            host_cache_blocks: s.host_cache_blocks,
            num_preemptions: s.num_preemptions,
            num_scheduled_tokens: s.num_scheduled_tokens,
            num_prompt_tokens: s.num_prompt_tokens,
            num_generation_tokens: s.num_generation_tokens,
            num_drafts: s.num_drafts,
            num_draft_tokens: s.num_draft_tokens,
            num_accepted_tokens: s.num_accepted_tokens,
            num_accepted_tokens_per_pos: s.num_accepted_tokens_per_pos,
            running_lora_ids: s.running_lora_ids,
            waiting_lora_ids: s.waiting_lora_ids,
        }
    }
}

#[pymethods]
impl PySchedulerStats {
    fn __repr__(&self) -> String {
        format!(
            "SchedulerStats(num_running={}, num_waiting={}, num_free_blocks={}/{}, kv_cache_usage={:.3}, \
             prefix_cache_hits={}/{}, num_preemptions={})",
            self.num_running,
            self.num_waiting,
            self.num_free_blocks,
            self.num_total_blocks,
            self.kv_cache_usage,
            self.prefix_cache_hits,
            self.prefix_cache_queries,
            self.num_preemptions
        )
    }
}
