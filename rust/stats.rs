//! Counters a metrics exporter reads after each step.

#[derive(Debug, Default, Clone, PartialEq)]
pub struct SchedulerStats {
    pub num_running: usize,
    pub num_waiting: usize,
    pub num_total_blocks: usize,
    pub num_free_blocks: usize,
    /// Fraction of usable blocks (all but the null block) held by live requests.
    pub kv_cache_usage: f64,
    /// Tokens looked up in / served by the prefix cache (cumulative).
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    /// Tokens the host tier served (cumulative; loaded, not computed) and blocks it holds now.
    pub host_cache_hits: u64,
    pub host_cache_blocks: usize,
    pub num_preemptions: u64,
    /// Tokens scheduled in the last step.
    pub num_scheduled_tokens: usize,
    /// Prompt positions scheduled (prefill work, cumulative; recomputation after preemption counts).
    pub num_prompt_tokens: u64,
    /// Tokens appended by update_from_output (cumulative).
    pub num_generation_tokens: u64,
    /// Speculative decoding (cumulative, vLLM's names): verified steps of a request that had
    /// drafts, their drafts, the drafts accepted, and how often the draft at each position
    /// (0-based, up to num_speculative_tokens) was accepted. Mean acceptance length
    /// = 1 + num_accepted_tokens / num_drafts.
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    pub num_accepted_tokens: u64,
    pub num_accepted_tokens_per_pos: Vec<u64>,
    /// The LoRA adapters (lora_id, nonzero; each once, in queue order) of the running and of the
    /// waiting requests now: vLLM's lora_requests_info gauge, which LoRA-aware routers read.
    pub running_lora_ids: Vec<i64>,
    pub waiting_lora_ids: Vec<i64>,
}
