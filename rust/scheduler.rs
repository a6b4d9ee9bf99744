//! The token-budget scheduler (the vLLM v1 model). There are no prefill or decode phases:
//! every request has `num_computed_tokens` catching up with its token count, under a per-step
//! budget of `max_num_batched_tokens`. Running requests are served first (a decode is one
//! token, a prefill chunk as many as the budget allows), then waiting ones are admitted while
//! the budget, `max_num_seqs` and the free blocks allow. When a running request cannot get a
//! block, another running request is preempted (its blocks freed; it recomputes later).
//! With speculative decoding a decode computes its last token plus drafts (`ngram.rs`, or
//! drafts handed in), and the update rolls the rejected drafts' K/V back (`speculative.rs`).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::batch::{BatchArrays, BatchEntry, IdList, SchedulerOutput};
use crate::block_pool::BlockId;
use crate::cbor_block_hash::{none_hash, BlockExtras, HashSeed, ItemSpan};
use crate::detokenizer::{IncrementalDetokenizer, StopSet, TokenizerInfo};
use crate::error::{invalid, CoreError, CoreResult};
use crate::kv_cache_manager::{KvBlocks, KvCacheManager};
use crate::ngram;
use crate::partial_prefills::{PartialPrefillLimits, PartialPrefills};
use crate::prefix_cache::{BlockHash, BlockHasher, HashAlgo};
use crate::request::{FinishReason, RepetitionRule, Request, RequestStatus, SamplingLimits};
use crate::speculative::{ExternalDrafts, SpecMethod, SpeculativeConfig};
use crate::state_snapshots::{SnapshotSlot, StateSnapshots};
use crate::stats::SchedulerStats;
use crate::step_outputs::{RowInfo, StepOutputs, StepOutputsBuilder};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// First come, first served; the latest running request is preempted first.
    Fcfs,
    /// Lower `priority` value first, then arrival; the lowest-priority, latest request is
    /// preempted first.
    Priority,
}

impl std::str::FromStr for Policy {
    type Err = CoreError;
    fn from_str(s: &str) -> CoreResult<Self> {
        match s {
            "fcfs" => Ok(Policy::Fcfs),
            "priority" => Ok(Policy::Priority),
            other => Err(invalid(
                "policy",
                format!("must be 'fcfs' or 'priority', got {other:?}"),
            )),
        }
    }
}

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_model_len: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub enable_prefix_caching: bool,
    pub policy: Policy,
    pub eos_token_ids: Vec<u32>,
    /// Off by default (`from_signed` leaves it off; set it with `with_speculation`).
    pub spec: SpeculativeConfig,
    /// Most distinct LoRA adapters among the running requests (the runner's GPU slots); 0: no
    /// cap (LoRA off, every request has lora_id 0). A waiting request whose adapter would be one
    /// too many waits, and requests behind it with a running adapter (or none) go ahead.
    pub max_loras: usize,
    /// Prompts may be split across steps. Off (encoder models: attention sees the whole prompt
    /// at once), a waiting request is admitted only when its whole remaining prompt fits the
    /// step's remaining budget, and a prompt longer than the budget is refused at add_request.
    pub chunked_prefill: bool,
    /// vLLM's long_prefill_token_threshold: a prefill chunk takes at most this many of a request's
    /// tokens per step (0: no cap beyond the budget), so one long prompt cannot fill whole steps while
    /// shorter prompts wait. An image computed whole (an atomic span) is never cut by it.
    pub long_prefill_token_threshold: usize,
    /// The prefix cache's block hash (prefix_cache.rs; vLLM's --prefix-caching-hash-algo).
    pub hash_algo: HashAlgo,
    /// The root digest of vLLM's CBOR chains (cbor_block_hash.rs), with those algorithms only.
    pub hash_root: Option<Vec<u8>>,
    /// Blocks of the prefix cache's host tier (host_tier.rs; vLLM's --kv-offloading-size); 0: none.
    pub host_tier_blocks: usize,
    /// vLLM's max_num_partial_prefills / max_long_partial_prefills (partial_prefills.rs); their
    /// long_threshold is `long_prefill_token_threshold`. Off (1) by default.
    pub partial_prefills: PartialPrefillLimits,
    /// A hybrid model's per-request recurrent states (state_snapshots.rs): Some for such a model
    /// (with prefix caching, its snapshot grid -- vLLM's mamba_block_size -- and slots; without,
    /// both 0), None for models without recurrent states.
    pub recurrent: Option<RecurrentStates>,
}

/// How the scheduler serves a model with recurrent states (`SchedulerConfig::recurrent`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecurrentStates {
    /// Snapshots are taken where a step ends on a multiple of this many tokens (0: none).
    pub state_block_size: usize,
    /// Slots of the runner's snapshot pool.
    pub snapshot_slots: usize,
}

impl SchedulerConfig {
    /// Checks sizes given as signed integers (as Python passes them), naming the bad field.
    #[allow(clippy::too_many_arguments)]
    pub fn from_signed(
        num_blocks: i64,
        block_size: i64,
        max_model_len: i64,
        max_num_seqs: i64,
        max_num_batched_tokens: i64,
        enable_prefix_caching: bool,
        policy: &str,
        eos_token_ids: &[i64],
    ) -> CoreResult<Self> {
        fn at_least(field: &str, v: i64, min: i64) -> CoreResult<usize> {
            if v < min {
                return Err(invalid(field, format!("must be >= {min}, got {v}")));
            }
            if v > u32::MAX as i64 / 2 {
                return Err(invalid(field, format!("is unreasonably large ({v})")));
            }
            Ok(v as usize)
        }
        let eos = eos_token_ids
            .iter()
            .enumerate()
            .map(|(i, &t)| token_id(&format!("eos_token_ids[{i}]"), t))
            .collect::<CoreResult<Vec<_>>>()?;
        let block_size = at_least("block_size", block_size, 1)?;
        let num_blocks = at_least("num_blocks", num_blocks, 2)?;
        if num_blocks.saturating_mul(block_size) > u32::MAX as usize / 2 {
            return Err(invalid(
                "num_blocks",
                "num_blocks * block_size must fit the int32 slot mapping",
            ));
        }
        Ok(SchedulerConfig {
            num_blocks,
            block_size,
            max_model_len: at_least("max_model_len", max_model_len, 2)?,
            max_num_seqs: at_least("max_num_seqs", max_num_seqs, 1)?,
            max_num_batched_tokens: at_least("max_num_batched_tokens", max_num_batched_tokens, 1)?,
            enable_prefix_caching,
            policy: policy.parse()?,
            eos_token_ids: eos,
            spec: SpeculativeConfig::default(),
            max_loras: 0,
            chunked_prefill: true,
            long_prefill_token_threshold: 0,
            hash_algo: HashAlgo::default(),
            hash_root: None,
            host_tier_blocks: 0,
            partial_prefills: PartialPrefillLimits::default(),
            recurrent: None,
        })
    }

    /// A model with per-request recurrent states. With prefix caching, `state_block_size` (a
    /// multiple of block_size) sets the snapshot grid and `snapshot_slots` the pool it fills;
    /// without, both must be 0.
    pub fn with_recurrent_states(
        mut self,
        state_block_size: usize,
        snapshot_slots: usize,
    ) -> CoreResult<Self> {
        if self.enable_prefix_caching {
            if state_block_size == 0 || !state_block_size.is_multiple_of(self.block_size) {
                return Err(invalid(
                    "mamba_block_size",
                    format!(
                        "must be a positive multiple of block_size ({}), got {state_block_size}",
                        self.block_size
                    ),
                ));
            }
            if snapshot_slots == 0 {
                return Err(invalid(
                    "state_snapshot_slots",
                    "prefix caching of a hybrid model needs at least one snapshot slot",
                ));
            }
        } else if state_block_size != 0 || snapshot_slots != 0 {
            return Err(invalid(
                "mamba_block_size",
                "state snapshots are the prefix cache's: they need enable_prefix_caching",
            ));
        }
        self.recurrent = Some(RecurrentStates {
            state_block_size,
            snapshot_slots,
        });
        Ok(self)
    }

    /// The snapshot grid in tokens (0: no snapshots).
    fn state_grid(&self) -> usize {
        self.recurrent.map_or(0, |r| r.state_block_size)
    }

    /// The block hash function; vLLM's CBOR chains also take the seed of their root
    /// (PYTHONHASHSEED's value, or random bytes), which the other functions have no use for.
    pub fn with_hash_algo(mut self, algo: HashAlgo, seed: Option<HashSeed>) -> CoreResult<Self> {
        self.hash_root = match (algo.cbor(), seed) {
            (Some(_), Some(HashSeed::Bytes(b))) if b.is_empty() => {
                return Err(invalid(
                    "prefix_hash_seed",
                    "random root bytes must not be empty",
                ));
            }
            (Some(digest), Some(seed)) => Some(none_hash(digest, &seed)),
            (Some(_), None) => {
                return Err(invalid(
                    "prefix_hash_seed",
                    format!("{algo:?} needs one: PYTHONHASHSEED's value, or random bytes"),
                ))
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "prefix_hash_seed",
                    "only the sha256_cbor and xxhash_cbor hashes take a seed",
                ))
            }
            (None, None) => None,
        };
        self.hash_algo = algo;
        Ok(self)
    }

    /// Concurrent partial prefills (partial_prefills.rs), after `with_long_prefill_token_threshold`:
    /// more than one needs chunked prefill and a long-prompt threshold, and `max_long` <= `max_prefills`.
    pub fn with_partial_prefills(
        mut self,
        max_prefills: usize,
        max_long: usize,
    ) -> CoreResult<Self> {
        if max_prefills < 1 || max_long < 1 {
            return Err(invalid(
                if max_prefills < 1 {
                    "max_num_partial_prefills"
                } else {
                    "max_long_partial_prefills"
                },
                "must be >= 1",
            ));
        }
        if max_long > max_prefills {
            return Err(invalid(
                "max_long_partial_prefills",
                format!("must be <= max_num_partial_prefills ({max_prefills}), got {max_long}"),
            ));
        }
        if max_prefills > 1 && (!self.chunked_prefill || self.long_prefill_token_threshold == 0) {
            return Err(invalid(
                "max_num_partial_prefills",
                "more than one needs chunked prefill and a long_prefill_token_threshold",
            ));
        }
        self.partial_prefills = PartialPrefillLimits {
            max_prefills,
            max_long,
            long_threshold: self.long_prefill_token_threshold,
        };
        Ok(self)
    }

    pub fn with_host_tier(mut self, blocks: usize) -> Self {
        self.host_tier_blocks = blocks;
        self
    }

    pub fn with_speculation(mut self, spec: SpeculativeConfig) -> Self {
        self.spec = spec;
        self
    }

    pub fn with_max_loras(mut self, max_loras: usize) -> Self {
        self.max_loras = max_loras;
        self
    }

    pub fn with_chunked_prefill(mut self, on: bool) -> Self {
        self.chunked_prefill = on;
        self
    }

    pub fn with_long_prefill_token_threshold(mut self, tokens: usize) -> Self {
        self.long_prefill_token_threshold = tokens;
        self
    }

    /// How many of a request's `remaining` tokens from `start` to compute this step: within the budget
    /// and the long-prefill cap, never ending inside an image (0: the image does not fit the budget).
    fn chunk_len(&self, r: &Request, start: usize, remaining: usize, budget: usize) -> usize {
        let n = self.budget_chunk_len(r, start, remaining, budget);
        self.align_to_state_grid(r, start, remaining, n)
    }

    /// With state snapshots (state_snapshots.rs), a chunk that would run past the last grid
    /// boundary of the known tokens stops there, and any other chunk short of the end stops at
    /// the last boundary it reaches, so its state can be kept. (vLLM's align mode: a prompt
    /// costs one more, short, step, and the next turn of the conversation resumes there.)
    fn align_to_state_grid(&self, r: &Request, start: usize, remaining: usize, n: usize) -> usize {
        let grid = self.state_grid();
        if grid == 0 || n == 0 || !self.chunked_prefill {
            return n;
        }
        let (end, total) = (start + n, start + remaining);
        let last = total / grid * grid;
        let target = if start < last && end > last {
            last
        } else if end < total && end / grid * grid > start {
            end / grid * grid
        } else {
            return n;
        };
        // (never ending inside an image: then the chunk stays as the budget made it)
        match r.cut_chunk(start, target - start) {
            0 => n,
            k => k,
        }
    }

    fn budget_chunk_len(
        &self,
        r: &Request,
        start: usize,
        remaining: usize,
        budget: usize,
    ) -> usize {
        let whole = remaining.min(budget);
        let cap = self.long_prefill_token_threshold;
        if cap == 0 || cap >= whole {
            return r.cut_chunk(start, whole);
        }
        match r.cut_chunk(start, cap) {
            // The cap ends inside an image that starts here: the image goes whole (if the budget holds it).
            0 => {
                let image_end = r
                    .atomic_spans
                    .iter()
                    .find(|&&(s, e)| s <= start && start < e)
                    .map_or(start, |&(_, e)| e);
                if image_end - start <= whole {
                    image_end - start
                } else {
                    0
                }
            }
            n => n,
        }
    }
}

/// A prefix-cache hit of `kv_blocks` blocks cut back to the last grid boundary (every
/// `blocks_per_state` blocks) whose state snapshot is kept: (blocks, the snapshot's slot).
fn snapshot_hit(
    snaps: &StateSnapshots,
    hashes: &[BlockHash],
    kv_blocks: usize,
    blocks_per_state: usize,
) -> (usize, Option<SnapshotSlot>) {
    let mut j = kv_blocks / blocks_per_state * blocks_per_state;
    while j > 0 {
        if let Some(slot) = snaps.lookup(hashes[j - 1]) {
            return (j, Some(slot));
        }
        j -= blocks_per_state;
    }
    (0, None)
}

/// A token id given as a signed integer, checked to fit int32 (the dtype of the token columns
/// Python reads; no vocabulary comes near 2^31).
pub fn token_id(field: &str, v: i64) -> CoreResult<u32> {
    if is_token_id(v) {
        Ok(v as u32)
    } else {
        Err(invalid(
            field,
            format!("token id {v} is out of range (0..2^31)"),
        ))
    }
}

/// `token_id`'s check alone, for hot loops that name the field only on failure (formatting
/// a field name per token costs more than the rest of the work).
#[inline]
pub fn is_token_id(v: i64) -> bool {
    (0..=i32::MAX as i64).contains(&v)
}

/// vLLM's RepetitionDetectionParams rules: sizes >= 0 with min <= max; a rule that is on (max > 0)
/// needs min_count >= 2; min 0 means 1. None for max 0 (off).
fn repetition_rule(
    (min, max, count): (i64, i64, i64),
) -> Result<Option<RepetitionRule>, CoreError> {
    if min < 0 || max < 0 || min > max {
        return Err(invalid(
            "repetition_detection",
            "max_pattern_size and min_pattern_size must be >= 0, with min_pattern_size <= max_pattern_size \
             (both 0 turn detection off)",
        ));
    }
    if max == 0 {
        return Ok(None);
    }
    if count < 2 {
        return Err(invalid(
            "repetition_detection",
            "min_count must be >= 2 when max_pattern_size > 0",
        ));
    }
    Ok(Some(RepetitionRule {
        min_pattern: (min as usize).max(1),
        max_pattern: max as usize,
        min_count: count as usize,
    }))
}

/// A request as submitted (already converted from Python, not yet validated).
#[derive(Debug, Clone)]
pub struct NewRequest {
    pub request_id: String,
    pub prompt_token_ids: Vec<u32>,
    pub max_tokens: i64,
    pub min_tokens: i64,
    pub ignore_eos: bool,
    pub stop_token_ids: Vec<u32>,
    pub stop: Vec<String>,
    pub include_stop_str_in_output: bool,
    /// `repetition_detection` as (min_pattern_size, max_pattern_size, min_count); None: off.
    pub repetition: Option<(i64, i64, i64)>,
    pub skip_special_tokens: bool,
    pub detokenize: bool,
    pub priority: i64,
    pub cache_salt: Option<String>,
    pub lora_id: i64,
    /// The adapter's name (vLLM's CBOR block hashes name the adapter by it; None without one).
    pub lora_name: Option<String>,
    /// The prompt's multimodal items (their identifiers separate blocks with equal placeholder ids).
    pub mm_items: Vec<ItemSpan>,
    pub wait_for_grammar: bool,
    /// Speculative decoding may draft tokens for it (when the scheduler speculates at all).
    pub allow_drafts: bool,
    /// Prompt ranges [start, end) that one step computes whole (an image whose tokens attend to each
    /// other both ways: `Request::cut_chunk`).
    pub atomic_spans: Vec<(usize, usize)>,
}

impl NewRequest {
    /// A request with default options (tests, benchmarks).
    pub fn new(request_id: impl Into<String>, prompt_token_ids: Vec<u32>, max_tokens: i64) -> Self {
        NewRequest {
            request_id: request_id.into(),
            prompt_token_ids,
            max_tokens,
            min_tokens: 0,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            include_stop_str_in_output: false,
            repetition: None,
            skip_special_tokens: true,
            detokenize: true,
            priority: 0,
            cache_salt: None,
            lora_id: 0,
            lora_name: None,
            mm_items: Vec::new(),
            wait_for_grammar: false,
            allow_drafts: true,
            atomic_spans: Vec::new(),
        }
    }
}

/// Live requests' ids by slot, packed in one buffer. The step loops copy each row's id from
/// here (a few KB that stay in cache) rather than from the request's own allocation, which
/// with ~1000 running requests is a cache miss per request, twice per step.
#[derive(Default)]
struct SlotIds {
    text: String,
    /// (start, len) in `text` of each slot's id.
    spans: Vec<(u32, u32)>,
    /// Bytes of `text` that belong to live requests (the rest is garbage until compacted).
    live_bytes: usize,
}

impl SlotIds {
    fn get(&self, slot: usize) -> &str {
        let (start, len) = self.spans[slot];
        &self.text[start as usize..(start + len) as usize]
    }

    fn set(&mut self, slot: usize, id: &str) {
        if self.spans.len() <= slot {
            self.spans.resize(slot + 1, (0, 0));
        }
        self.spans[slot] = (self.text.len() as u32, id.len() as u32);
        self.text.push_str(id);
        self.live_bytes += id.len();
    }

    fn remove(&mut self, slot: usize) {
        self.live_bytes -= self.spans[slot].1 as usize;
        self.spans[slot] = (0, 0);
    }

    /// Rewrites the buffer with only the live ids once garbage dominates (amortized O(1)).
    fn maybe_compact(&mut self) {
        if self.text.len() < 4096 || self.text.len() < 2 * self.live_bytes {
            return;
        }
        let mut text = String::with_capacity(self.live_bytes * 2);
        for span in &mut self.spans {
            let (start, len) = *span;
            if len > 0 {
                let id = &self.text[start as usize..(start + len) as usize];
                *span = (text.len() as u32, len);
                text.push_str(id);
            }
        }
        self.text = text;
    }
}

/// One entry of a scheduled step, remembered for its update_from_output.
#[derive(Debug, Clone)]
struct StepEntry {
    slot: usize,
    serial: u64,
    residency: u32,
    num_tokens: usize,
    /// Of `num_tokens`, drafts after the request's last sampled token.
    num_drafts: u32,
    sample: bool,
    /// The drafts themselves (empty without): the update checks the accepted ones against
    /// them. `Scheduler::drafts` may hold a newer step's by then (async scheduling).
    drafts: Vec<u32>,
}

/// A state save whose block hash was not known when its step was scheduled (`pending_saves`).
struct PendingSave {
    slot: usize,
    serial: u64,
    residency: u32,
    block: usize,
    snapshot: SnapshotSlot,
}

impl StepEntry {
    /// Whether this entry was scheduled for `r` as it is now: the same request in the slot, not
    /// preempted since (a preempted request that resumed is running again, but its earlier steps
    /// are void).
    fn is_current(&self, r: &Request) -> bool {
        r.serial == self.serial
            && r.residency == self.residency
            && r.status == RequestStatus::Running
    }
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvCacheManager,
    tokenizer: Option<Arc<TokenizerInfo>>,
    /// Live requests by slot. A request keeps its slot from add_request until it finishes or
    /// is aborted (waiting, running, preempted); then the slot may go to a later request
    /// (`serial` tells generations apart). Python sees slots as the rows' `slots` column, so
    /// the engine keys its per-request state by a small dense integer instead of a string.
    slab: Vec<Option<Request>>,
    slot_ids: SlotIds,
    /// Drafts of each slot's newest step in flight (empty otherwise): its input ids after the
    /// last sampled token. With async scheduling they are the assumed continuation the next
    /// step's proposal starts from. Kept apart from `Request` so the requests' hot fields stay
    /// as dense as without speculation.
    drafts: Vec<Vec<u32>>,
    /// What each slot's `drafts` assumed when proposed with a step in flight (async
    /// scheduling): the request's token count once that step is delivered and its last token
    /// (the proposal's guess). None: proposed from delivered tokens only. The next proposal
    /// builds on the drafts only while their assumption still holds.
    draft_basis: Vec<Option<(usize, u32)>>,
    /// Reused buffers for the n-gram proposer under async scheduling (the context with the
    /// in-flight drafts appended, and the proposal).
    ngram_context: Vec<u32>,
    ngram_out: Vec<u32>,
    free_slots: Vec<usize>,
    by_id: HashMap<Arc<str>, usize>,
    /// Queue order: FCFS arrival (preempted ones back at the front), or (priority, arrival).
    waiting: VecDeque<usize>,
    running: Vec<usize>,
    next_serial: u64,
    /// Steps scheduled whose update_from_output has not come yet, oldest first: one normally,
    /// two while async scheduling overlaps the next step with the current one.
    in_flight: VecDeque<Vec<StepEntry>>,
    /// Per step in `in_flight` (same order): the hashes its host-tier offloads store and the
    /// device blocks its loads fill, undone if the step is rolled back.
    in_flight_transfers: VecDeque<(Vec<BlockHash>, Vec<BlockId>)>,
    /// A hybrid model's state snapshots (state_snapshots.rs), with prefix caching; and per step
    /// in `in_flight`, the hashes its saves store (forgotten if the step is rolled back).
    snapshots: Option<StateSnapshots>,
    in_flight_snapshots: VecDeque<Vec<BlockHash>>,
    /// Saves of the step in flight whose block ends with a token not sampled yet (async
    /// scheduling): keyed by the next schedule, once that token has arrived.
    pending_saves: Vec<PendingSave>,
    /// Blocks that requests preempted or aborted while a step of theirs was in flight had
    /// registered in the prefix cache for that step. Their K/V exists only if the step
    /// completes: a rollback treats them as unwritten (another request may have adopted one).
    /// Forgotten once no step is in flight.
    unwritten_if_rolled_back: Vec<u32>,
    finished_since_schedule: Vec<Arc<str>>,
    /// Longest prompt + output any request may reach: max_model_len, or less if the whole KV
    /// cache is smaller (otherwise such a request would wait or be preempted forever).
    max_total_len: usize,
    stats: SchedulerStats,
    /// Stop-string sets by their strings, shared by the requests that name the same ones
    /// (usually all of a deployment's): one copy stays in cache instead of one per request.
    stop_sets: HashMap<Vec<String>, Arc<StopSet>>,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, tokenizer_json: Option<&str>) -> CoreResult<Self> {
        let tokenizer = match tokenizer_json {
            Some(j) => Some(Arc::new(TokenizerInfo::from_json(j)?)),
            None => None,
        };
        let mut kv = KvCacheManager::new(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching);
        if cfg.host_tier_blocks > 0 {
            if !cfg.enable_prefix_caching {
                return Err(invalid(
                    "kv_offloading_size",
                    "the host tier holds prefix-cache blocks: it needs enable_prefix_caching",
                ));
            }
            if cfg.recurrent.is_some() {
                return Err(invalid(
                    "kv_offloading_size",
                    "the host tier restores K/V blocks, not a hybrid model's recurrent states",
                ));
            }
            kv.enable_host_tier(cfg.host_tier_blocks);
        }
        let snapshots = cfg
            .recurrent
            .filter(|r| r.snapshot_slots > 0)
            .map(|r| StateSnapshots::new(r.snapshot_slots));
        let max_total_len = cfg.max_model_len.min((cfg.num_blocks - 1) * cfg.block_size);
        let stats = SchedulerStats {
            num_total_blocks: cfg.num_blocks,
            num_free_blocks: cfg.num_blocks - 1,
            num_accepted_tokens_per_pos: vec![0; cfg.spec.num_speculative_tokens],
            ..Default::default()
        };
        Ok(Scheduler {
            cfg,
            kv,
            tokenizer,
            slab: Vec::new(),
            slot_ids: SlotIds::default(),
            drafts: Vec::new(),
            draft_basis: Vec::new(),
            ngram_context: Vec::new(),
            ngram_out: Vec::new(),
            free_slots: Vec::new(),
            by_id: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_serial: 0,
            in_flight: VecDeque::new(),
            in_flight_transfers: VecDeque::new(),
            snapshots,
            in_flight_snapshots: VecDeque::new(),
            pending_saves: Vec::new(),
            unwritten_if_rolled_back: Vec::new(),
            finished_since_schedule: Vec::new(),
            max_total_len,
            stats,
            stop_sets: HashMap::new(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn tokenizer(&self) -> Option<&Arc<TokenizerInfo>> {
        self.tokenizer.as_ref()
    }

    fn req(&self, slot: usize) -> &Request {
        self.slab[slot].as_ref().expect("live slot")
    }

    /// This step's partial-prefill plan from the queues as they stand (partial_prefills.rs).
    fn plan_partial_prefills(&self) -> PartialPrefills {
        let running = self.running.iter().map(|&s| {
            let r = self.req(s);
            r.num_tokens() + r.num_output_placeholders - r.num_computed_tokens
        });
        let waiting = self.waiting.iter().filter_map(|&s| {
            let r = self.req(s);
            (r.status != RequestStatus::WaitingForGrammar)
                .then(|| r.num_tokens() - r.num_computed_tokens)
        });
        PartialPrefills::plan(
            self.cfg.partial_prefills,
            self.cfg.max_num_batched_tokens,
            running,
            waiting,
        )
    }

    fn req_mut(&mut self, slot: usize) -> &mut Request {
        self.slab[slot].as_mut().expect("live slot")
    }

    /// Validates and queues a request; returns its slot (see `Scheduler::slab`). Every error
    /// leaves the scheduler unchanged.
    pub fn add_request(&mut self, r: NewRequest) -> CoreResult<usize> {
        if r.request_id.is_empty() {
            return Err(invalid("request_id", "must not be empty"));
        }
        if self.by_id.contains_key(r.request_id.as_str()) {
            return Err(CoreError::DuplicateRequest(r.request_id));
        }
        let prompt_len = r.prompt_token_ids.len();
        if prompt_len == 0 {
            return Err(invalid("prompt_token_ids", "must not be empty"));
        }
        if r.max_tokens < 1 {
            return Err(invalid(
                "max_tokens",
                format!("must be >= 1, got {}", r.max_tokens),
            ));
        }
        if r.min_tokens < 0 {
            return Err(invalid(
                "min_tokens",
                format!("must be >= 0, got {}", r.min_tokens),
            ));
        }
        if r.min_tokens > r.max_tokens {
            return Err(invalid(
                "min_tokens",
                format!(
                    "must be <= max_tokens ({}), got {}",
                    r.max_tokens, r.min_tokens
                ),
            ));
        }
        if r.lora_id < 0 {
            return Err(invalid(
                "lora_id",
                format!("must be >= 0, got {}", r.lora_id),
            ));
        }
        if r.lora_name.is_some() && r.lora_id == 0 {
            return Err(invalid("lora_name", "given without a lora_id"));
        }
        if r.lora_name.is_none() && r.lora_id != 0 && self.cfg.hash_algo.cbor().is_some() {
            // vLLM's CBOR block hashes name the adapter by its name.
            return Err(invalid(
                "lora_name",
                format!(
                    "needed with lora_id {} under {:?}",
                    r.lora_id, self.cfg.hash_algo
                ),
            ));
        }
        let mut item_end = 0;
        for (i, item) in r.mm_items.iter().enumerate() {
            if item.offset < item_end || item.length == 0 || item.offset + item.length > prompt_len
            {
                return Err(invalid(
                    &format!("mm_items[{i}]"),
                    format!(
                        "[{}, {}) is not a non-empty run of the prompt ({prompt_len} tokens) after the previous item",
                        item.offset,
                        item.offset + item.length
                    ),
                ));
            }
            item_end = item.offset + item.length;
        }
        if !self.cfg.chunked_prefill && prompt_len > self.cfg.max_num_batched_tokens {
            return Err(invalid(
                "max_num_batched_tokens",
                format!(
                    "the prompt has {prompt_len} tokens, more than one step's budget ({}); this model \
                     runs each prompt in one step (no chunked prefill)",
                    self.cfg.max_num_batched_tokens
                ),
            ));
        }
        let mut previous_end = 0;
        for &(start, end) in &r.atomic_spans {
            if start < previous_end || end <= start || end > prompt_len {
                return Err(invalid(
                    "atomic_spans",
                    format!(
                        "span [{start}, {end}) must lie in the {prompt_len}-token prompt, after the one before"
                    ),
                ));
            }
            if end - start > self.cfg.max_num_batched_tokens {
                return Err(invalid(
                    "max_num_batched_tokens",
                    format!(
                        "an image of {} tokens must be computed in one step, more than one step's budget ({})",
                        end - start,
                        self.cfg.max_num_batched_tokens
                    ),
                ));
            }
            previous_end = end;
        }
        if prompt_len >= self.cfg.max_model_len {
            return Err(CoreError::PromptTooLong(format!(
                "request {:?}: the prompt has {prompt_len} tokens but max_model_len is {}; the prompt \
                 must be shorter than max_model_len to leave room for at least one generated token",
                r.request_id, self.cfg.max_model_len
            )));
        }
        if prompt_len >= self.max_total_len {
            return Err(CoreError::PromptTooLong(format!(
                "request {:?}: the prompt has {prompt_len} tokens but the whole KV cache holds only {} \
                 tokens ({} blocks of {}); raise num_blocks or shorten the prompt",
                r.request_id,
                self.max_total_len,
                self.cfg.num_blocks - 1,
                self.cfg.block_size
            )));
        }
        let detok = match (self.tokenizer.clone(), r.detokenize) {
            (Some(t), true) => {
                let stops = self.stop_set(&r.stop)?;
                let mut d = IncrementalDetokenizer::with_stop_set(
                    t,
                    r.skip_special_tokens,
                    stops,
                    r.include_stop_str_in_output,
                )
                .without_output_text();
                d.prime(&r.prompt_token_ids);
                Some(d)
            }
            (None, _) | (_, false) if !r.stop.is_empty() => {
                return Err(invalid(
                    "stop",
                    "stop strings need detokenize=True and a Scheduler built with tokenizer_json",
                ));
            }
            _ => None,
        };
        let repetition = r.repetition.map(repetition_rule).transpose()?.flatten();
        let max_tokens = (r.max_tokens as usize).min(self.max_total_len - prompt_len);
        let extras = BlockExtras {
            lora_name: r.lora_name,
            cache_salt: r.cache_salt,
            items: r.mm_items,
        };
        let mut hasher = BlockHasher::new(
            self.cfg.hash_algo,
            r.lora_id as u64,
            extras,
            self.cfg.hash_root.as_deref(),
        );
        let mut block_hashes = Vec::with_capacity(prompt_len / self.cfg.block_size + 1);
        hasher.extend(&r.prompt_token_ids, self.cfg.block_size, &mut block_hashes);
        let id: Arc<str> = Arc::from(r.request_id.as_str());
        let serial = self.next_serial;
        self.next_serial += 1;
        let req = Request {
            id: id.clone(),
            serial,
            residency: 0,
            priority: r.priority,
            token_ids: r.prompt_token_ids,
            num_prompt_tokens: prompt_len,
            num_computed_tokens: 0,
            num_cached_tokens: None,
            num_external_cached_tokens: 0,
            num_output_placeholders: 0,
            allow_drafts: r.allow_drafts,
            atomic_spans: r.atomic_spans,
            lora_id: r.lora_id,
            limits: SamplingLimits {
                max_tokens,
                min_tokens: r.min_tokens as usize,
                ignore_eos: r.ignore_eos,
                stop_token_ids: r.stop_token_ids,
                include_stop_str_in_output: r.include_stop_str_in_output,
                repetition,
            },
            hasher,
            block_hashes,
            kv: KvBlocks::default(),
            detok,
            status: if r.wait_for_grammar {
                RequestStatus::WaitingForGrammar
            } else {
                RequestStatus::Waiting
            },
        };
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.slab[s] = Some(req);
                s
            }
            None => {
                self.slab.push(Some(req));
                self.slab.len() - 1
            }
        };
        if self.drafts.len() < self.slab.len() {
            self.drafts.resize_with(self.slab.len(), Vec::new);
            self.draft_basis.resize(self.slab.len(), None);
        }
        self.slot_ids.maybe_compact();
        self.slot_ids.set(slot, &id);
        self.by_id.insert(id, slot);
        self.enqueue_waiting(slot, false);
        Ok(slot)
    }

    /// The shared stop set of these strings. Sets no live request uses any more are dropped
    /// whenever the table reaches a power of two (>= 64) entries, so it stays within about
    /// twice the number of distinct sets in use.
    fn stop_set(&mut self, stops: &[String]) -> CoreResult<Arc<StopSet>> {
        if let Some(set) = self.stop_sets.get(stops) {
            return Ok(set.clone());
        }
        let set = Arc::new(StopSet::new(stops)?);
        if self.stop_sets.len() >= 64 && self.stop_sets.len().is_power_of_two() {
            self.stop_sets.retain(|_, s| Arc::strong_count(s) > 1);
        }
        self.stop_sets.insert(stops.to_vec(), set.clone());
        Ok(set)
    }

    /// Puts a request in the waiting queue at its place: FCFS appends new requests and puts
    /// preempted ones back at the front (they arrived before anything still waiting); the
    /// priority policy keeps the queue sorted by (priority, arrival).
    fn enqueue_waiting(&mut self, slot: usize, preempted: bool) {
        match self.cfg.policy {
            Policy::Fcfs if preempted => self.waiting.push_front(slot),
            Policy::Fcfs => self.waiting.push_back(slot),
            Policy::Priority => {
                let key = self.priority_key(slot);
                let pos = self
                    .waiting
                    .partition_point(|&s| self.priority_key(s) <= key);
                self.waiting.insert(pos, slot);
            }
        }
    }

    fn priority_key(&self, slot: usize) -> (i64, u64) {
        let r = self.req(slot);
        (r.priority, r.serial)
    }

    /// Marks waiting requests whose grammar is compiled as schedulable (unknown ids ignored).
    pub fn grammar_ready<S: AsRef<str>>(&mut self, ids: &[S]) {
        for id in ids {
            if let Some(&slot) = self.by_id.get(id.as_ref()) {
                let r = self.req_mut(slot);
                if r.status == RequestStatus::WaitingForGrammar {
                    r.status = RequestStatus::Waiting;
                }
            }
        }
    }

    /// Picks the running request to preempt: the last one (FCFS) or the one with the worst
    /// (priority, arrival) key.
    fn pick_victim(&self) -> usize {
        match self.cfg.policy {
            Policy::Fcfs => self.running.len() - 1,
            Policy::Priority => {
                let mut best = 0;
                for (i, &s) in self.running.iter().enumerate() {
                    if self.priority_key(s) > self.priority_key(self.running[best]) {
                        best = i;
                    }
                }
                best
            }
        }
    }

    /// Frees a running request's blocks and sends it back to the waiting queue. It keeps its
    /// generated tokens; on resume it recomputes prompt + output (minus any prefix-cache hit).
    fn preempt(&mut self, slot: usize) {
        self.note_in_flight_blocks(slot);
        let req = self.slab[slot].as_mut().expect("live slot");
        self.kv.free_preempted(&mut req.kv, req.num_computed_tokens);
        req.num_computed_tokens = 0;
        // Its in-flight samples are dropped (update skips a request that is not running); it
        // samples them again after recomputing.
        req.num_output_placeholders = 0;
        req.residency = req.residency.wrapping_add(1);
        req.status = RequestStatus::Preempted;
        self.drafts[slot].clear();
        self.stats.num_preemptions += 1;
        self.enqueue_waiting(slot, true);
    }

    /// Decides one step. See the module docs for the policy.
    pub fn schedule(&mut self) -> SchedulerOutput {
        self.schedule_step(false)
    }

    /// Async scheduling: decides the next step while the previous one is still computing
    /// (`keep_in_flight`), so the host prepares step N+1 while the device runs step N. The
    /// previous step's sampled tokens count as placeholders: input id -1 in the arrays (the
    /// runner feeds them from the device), and `update_from_output` for step N must still come,
    /// before that of N+1. A request that may finish in step N (by length) is not scheduled
    /// past its limit; one that stops in step N wastes one token of step N+1, which is dropped.
    /// At most one step stays in flight: with two undelivered, both are rolled back.
    pub fn schedule_step(&mut self, keep_in_flight: bool) -> SchedulerOutput {
        self.schedule_with_drafts(keep_in_flight, None)
    }

    /// `schedule_step`, with speculative decoding (when configured): each running request in
    /// the decode state (one known token to compute, no step of it in flight, drafts allowed)
    /// gets up to num_speculative_tokens drafts, from `drafts` if it names the request's slot,
    /// else from the n-gram proposer (method "ngram"). Drafts never take a request past
    /// max_tokens or the length limit (all accepted plus the bonus token must fit), never
    /// exceed the token budget, and never cause a preemption (without room for them the
    /// request is scheduled without).
    ///
    /// Async scheduling (n-gram drafts): the step in flight counts optimistically, as if all its
    /// drafts will be accepted, plus its own sampled token (`num_output_placeholders` grows by
    /// 1 + drafts). The next step's first input for the request is that last token (a
    /// placeholder) at the position the optimistic count gives, followed by drafts proposed
    /// from the known tokens plus the in-flight drafts (the proposal's first token guesses the
    /// placeholder and is dropped). The runner learns on the device how many drafts were
    /// rejected and shifts the row's positions, slots and sequence length back by that many;
    /// the update then takes the rejected drafts out of the count. Drafts handed in (a draft
    /// model) are used only for requests with nothing in flight.
    pub fn schedule_with_drafts(
        &mut self,
        keep_in_flight: bool,
        drafts: Option<&ExternalDrafts>,
    ) -> SchedulerOutput {
        let mut preempted: Vec<usize> = Vec::new();
        if !keep_in_flight || self.in_flight.len() >= 2 {
            preempted = self.roll_back_undelivered_steps();
        }
        if let Some(snaps) = self.snapshots.as_mut() {
            snaps.begin_step();
            // The tokens the pending saves waited for arrived with the last update.
            for p in self.pending_saves.drain(..) {
                let hash = self.slab[p.slot].as_ref().and_then(|r| {
                    let same = r.serial == p.serial && r.residency == p.residency;
                    r.block_hashes.get(p.block).copied().filter(|_| same)
                });
                match hash {
                    Some(h) => snaps.key(p.snapshot, h),
                    None => snaps.release(p.snapshot), // it finished or was preempted
                }
            }
        }
        let spec = self.cfg.spec;
        let spec_on = spec.enabled();
        let external = match drafts {
            Some(d) if spec.enabled() => d.by_slot(self.slab.len()),
            _ => Vec::new(),
        };
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut scheduled: Vec<(usize, usize)> = Vec::with_capacity(self.running.len() + 8);
        // Snapshots restored into the rows of newly scheduled requests: (batch index, slot).
        let mut restores: Vec<(u32, SnapshotSlot)> = Vec::new();
        let mut new_ids = Vec::new();
        let mut resumed_ids = Vec::new();

        // Concurrent partial prefills: the share of the budget each prompt in prefill may take.
        let mut partial = self
            .cfg
            .partial_prefills
            .enabled()
            .then(|| self.plan_partial_prefills());

        // 1. Running requests, in order.
        let mut new_drafts = std::mem::take(&mut self.ngram_out);
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let slot = self.running[i];
            let (mut num_new, max_drafts, pending) = {
                let r = self.req(slot);
                let pending = r.num_output_placeholders;
                // The request's length if everything in flight is accepted.
                let len = r.num_tokens() + pending;
                let at_limit = pending > 0
                    && (r.num_output_tokens() + pending >= r.limits.max_tokens
                        || len >= self.max_total_len);
                if at_limit {
                    (0, 0, pending)
                } else {
                    let remaining = len - r.num_computed_tokens;
                    let budget = partial.map_or(budget, |p| p.chunk_budget(budget, remaining));
                    let n = self
                        .cfg
                        .chunk_len(r, r.num_computed_tokens, remaining, budget);
                    let decode = n == 1
                        && r.num_computed_tokens + 1 == len
                        && r.num_output_tokens() + pending > 0;
                    let d = if spec_on && r.allow_drafts && decode {
                        // All d accepted plus the bonus token must stay within the limits.
                        spec.num_speculative_tokens
                            .min(budget - 1)
                            .min(
                                r.limits
                                    .max_tokens
                                    .saturating_sub(r.num_output_tokens() + pending + 1),
                            )
                            .min(self.max_total_len.saturating_sub(len + 1))
                    } else {
                        0
                    };
                    (n, d, pending)
                }
            };
            if num_new == 0 {
                i += 1;
                continue;
            }
            new_drafts.clear();
            let mut basis = None;
            if max_drafts > 0 {
                let req = self.slab[slot].as_ref().expect("live slot");
                let (min_n, max_n) = (spec.prompt_lookup_min, spec.prompt_lookup_max);
                match external.get(slot).copied().flatten() {
                    Some(d) if pending == 0 => {
                        new_drafts.extend_from_slice(&d[..d.len().min(max_drafts)])
                    }
                    _ if spec.method != SpecMethod::Ngram => {}
                    _ if pending == 0 => {
                        ngram::propose(&req.token_ids, min_n, max_n, max_drafts, &mut new_drafts);
                    }
                    _ => {
                        // The step in flight: its drafts, assumed accepted while what they
                        // were proposed from still holds (else assumed all rejected), then its
                        // own token, which the proposal's first token guesses.
                        let in_flight = &self.drafts[slot];
                        let holds = self.draft_basis[slot].is_none_or(|(len, last)| {
                            req.token_ids.len() == len && req.token_ids.last() == Some(&last)
                        });
                        let ctx = &mut self.ngram_context;
                        ctx.clear();
                        ctx.extend_from_slice(&req.token_ids);
                        if holds {
                            ctx.extend_from_slice(in_flight);
                        }
                        if ngram::propose(ctx, min_n, max_n, max_drafts + 1, &mut new_drafts) > 0 {
                            let guess = new_drafts.remove(0);
                            basis = Some((ctx.len() + 1, guess));
                        }
                    }
                }
                num_new += new_drafts.len();
            }
            let mut ok = false;
            loop {
                let req = self.slab[slot].as_mut().expect("live slot");
                if self.kv.allocate_slots(
                    &mut req.kv,
                    &req.block_hashes,
                    req.num_computed_tokens,
                    num_new,
                    &[],
                    &req.token_ids,
                    req.lora_id,
                    Some(&req.hasher),
                ) {
                    ok = true;
                    break;
                }
                if !new_drafts.is_empty() {
                    // Drafts are a bet, not a need: drop them rather than preempt for them.
                    num_new -= new_drafts.len();
                    new_drafts.clear();
                    continue;
                }
                let vpos = self.pick_victim();
                let victim = self.running.remove(vpos);
                self.preempt(victim);
                preempted.push(victim);
                if vpos < i {
                    // The victim came earlier in the running order: if it was scheduled this
                    // step, take its tokens back. (It may have been passed over: at its length
                    // limit with a step in flight, or with drafts in flight.)
                    i -= 1;
                    if let Some(k) = scheduled.iter().position(|&(s, _)| s == victim) {
                        budget += scheduled.remove(k).1;
                    }
                }
                if victim == slot {
                    break;
                }
            }
            if ok {
                if spec_on {
                    // This step's drafts replace the in-flight step's (whose entry keeps its own).
                    std::mem::swap(&mut self.drafts[slot], &mut new_drafts);
                    self.draft_basis[slot] = basis;
                }
                scheduled.push((slot, num_new));
                budget -= num_new;
                i += 1;
            }
        }
        self.ngram_out = new_drafts;

        // 2. Waiting requests, unless this step had to preempt (then memory is tight).
        if preempted.is_empty() {
            // Adapters of the running requests (only counted when the cap is on).
            let mut loras: Vec<i64> = Vec::new();
            if self.cfg.max_loras > 0 {
                for &s in &self.running {
                    let id = self.req(s).lora_id;
                    if id != 0 && !loras.contains(&id) {
                        loras.push(id);
                    }
                }
            }
            let mut w = 0;
            while w < self.waiting.len() && budget > 0 && self.running.len() < self.cfg.max_num_seqs
            {
                let slot = self.waiting[w];
                let req = self.slab[slot].as_mut().expect("live slot");
                if req.status == RequestStatus::WaitingForGrammar {
                    w += 1;
                    continue;
                }
                let lora = req.lora_id;
                let new_lora = lora != 0 && self.cfg.max_loras > 0 && !loras.contains(&lora);
                if new_lora && loras.len() >= self.cfg.max_loras {
                    w += 1; // its adapter would not get a slot this step; others may go ahead
                    continue;
                }
                let uncomputed = req.num_tokens() - req.num_computed_tokens;
                if partial.is_some_and(|p| !p.may_admit(uncomputed)) {
                    w += 1; // enough long prompts are prefilling: shorter ones behind it go ahead
                    continue;
                }
                let mut hit = self
                    .kv
                    .get_computed_blocks(&req.block_hashes, req.num_tokens());
                // A hybrid model resumes only where a state snapshot was kept.
                let restore = self.snapshots.as_ref().and_then(|snaps| {
                    let per = self.cfg.state_grid() / self.cfg.block_size;
                    let (blocks, slot) =
                        snapshot_hit(snaps, &req.block_hashes, hit.blocks.len(), per);
                    hit.blocks.truncate(blocks);
                    hit.num_tokens = blocks * self.cfg.block_size;
                    slot
                });
                // Blocks after the device's hits that the host tier holds: loaded, not computed.
                let host =
                    self.kv
                        .host_prefix(&req.block_hashes, hit.blocks.len(), req.num_tokens());
                let computed = hit.num_tokens + host.len() * self.cfg.block_size;
                let remaining = req.num_tokens() - computed;
                if !self.cfg.chunked_prefill && remaining > budget {
                    break; // keep the order: it runs whole in a later step
                }
                let chunk_budget = partial.map_or(budget, |p| p.chunk_budget(budget, remaining));
                let num_new = self.cfg.chunk_len(req, computed, remaining, chunk_budget);
                if num_new == 0 {
                    break; // an image that does not fit this step's budget: keep the order
                }
                if !self.kv.allocate_slots(
                    &mut req.kv,
                    &req.block_hashes,
                    computed,
                    num_new,
                    &hit.blocks,
                    &req.token_ids,
                    req.lora_id,
                    Some(&req.hasher),
                ) {
                    break; // head of the queue does not fit: keep the order, try next step
                }
                if !host.is_empty() {
                    // The first blocks allocated after the device hits take the host copies.
                    let first = hit.blocks.len();
                    self.kv
                        .note_loads(&host, &req.kv.blocks[first..first + host.len()]);
                }
                self.kv
                    .record_prefix_lookup(req.num_tokens(), hit.num_tokens);
                req.num_computed_tokens = computed;
                if req.status == RequestStatus::Preempted {
                    resumed_ids.push(req.id.clone());
                } else {
                    new_ids.push(req.id.clone());
                }
                if req.num_cached_tokens.is_none() {
                    req.num_cached_tokens = Some(computed);
                    req.num_external_cached_tokens = host.len() * self.cfg.block_size;
                }
                req.status = RequestStatus::Running;
                if new_lora {
                    loras.push(lora);
                }
                if let Some(p) = partial.as_mut() {
                    p.admitted(uncomputed);
                }
                self.waiting.remove(w);
                self.running.push(slot);
                if let (Some(s), Some(snaps)) = (restore, self.snapshots.as_mut()) {
                    snaps.note_restore(s);
                    restores.push((scheduled.len() as u32, s));
                }
                scheduled.push((slot, num_new));
                budget -= num_new;
            }
        }

        // 3. The flat arrays, then advance num_computed_tokens past this step's tokens.
        let bs = self.cfg.block_size;
        let slab = &self.slab;
        let drafts = &self.drafts;
        let num_tokens: usize = scheduled.iter().map(|&(_, n)| n).sum();
        let max_blocks = scheduled
            .iter()
            .map(|&(slot, _)| slab[slot].as_ref().map_or(0, |r| r.kv.blocks.len()))
            .max()
            .unwrap_or(0);
        let entries = scheduled.iter().map(|&(slot, n)| {
            let r = slab[slot].as_ref().expect("live slot");
            BatchEntry {
                token_ids: &r.token_ids,
                blocks: &r.kv.blocks,
                num_computed_tokens: r.num_computed_tokens,
                num_new_tokens: n,
                num_placeholders: r.num_output_placeholders,
                drafts: if spec_on { &drafts[slot] } else { &[] },
            }
        });
        let arrays = BatchArrays::build_sized(entries, bs, num_tokens, max_blocks);
        let mut req_ids = IdList::with_capacity(scheduled.len());
        let mut req_slots = Vec::with_capacity(scheduled.len());
        let mut step = Vec::with_capacity(scheduled.len());
        // State snapshots saved after the forward: (batch index, slot), and their block hashes.
        let mut saves: Vec<(u32, SnapshotSlot)> = Vec::new();
        let mut saved_hashes: Vec<BlockHash> = Vec::new();
        let grid = self.cfg.state_grid();
        for (idx, &(slot, n)) in scheduled.iter().enumerate() {
            let r = self.slab[slot].as_mut().expect("live slot");
            let prompt_part = (r.num_computed_tokens + n)
                .min(r.num_prompt_tokens)
                .saturating_sub(r.num_computed_tokens);
            self.stats.num_prompt_tokens += prompt_part as u64;
            r.num_computed_tokens += n;
            if let Some(snaps) = self.snapshots.as_mut() {
                // The step ends on the grid, after a block of known tokens (not a placeholder's).
                let end = r.num_computed_tokens;
                if end.is_multiple_of(grid) {
                    let block = end / bs - 1; // (end >= grid >= bs: a step computes a token)
                    if let Some(&h) = r.block_hashes.get(block) {
                        if let Some(s) = snaps.reserve(h) {
                            saves.push((idx as u32, s));
                            saved_hashes.push(h);
                        }
                    } else if end == r.num_tokens() + 1 && r.block_hashes.len() == block {
                        // The block's last token is the sample of the step in flight.
                        if let Some(s) = snaps.reserve_unkeyed() {
                            saves.push((idx as u32, s));
                            self.pending_saves.push(PendingSave {
                                slot,
                                serial: r.serial,
                                residency: r.residency,
                                block,
                                snapshot: s,
                            });
                        }
                    }
                }
            }
            req_ids.push(self.slot_ids.get(slot));
            req_slots.push(slot as i32);
            let num_drafts = if spec_on { self.drafts[slot].len() } else { 0 };
            let sample =
                r.num_computed_tokens == r.num_tokens() + r.num_output_placeholders + num_drafts;
            if sample {
                // Optimistic: every draft accepted, plus the step's own token.
                r.num_output_placeholders += 1 + num_drafts;
            }
            step.push(StepEntry {
                slot,
                serial: r.serial,
                residency: r.residency,
                num_tokens: n,
                num_drafts: num_drafts as u32,
                sample,
                drafts: if num_drafts > 0 {
                    self.drafts[slot].clone()
                } else {
                    Vec::new()
                },
            });
        }
        let transfers = self.kv.take_transfers();
        let step_ran = !step.is_empty();
        if step_ran {
            // An empty step gets no update_from_output that would take it off the queue.
            self.in_flight.push_back(step);
            self.in_flight_transfers.push_back((
                transfers.offload_hashes.clone(),
                transfers.load_blocks.clone(),
            ));
            self.in_flight_snapshots.push_back(saved_hashes);
        } else if !transfers.is_empty() {
            // No step runs, so no copy: what the offloads would have stored is not there.
            self.kv.forget_offloads(&transfers.offload_hashes);
        }
        self.stats.num_scheduled_tokens = num_tokens;
        SchedulerOutput {
            req_ids,
            req_slots,
            new_req_ids: new_ids,
            resumed_req_ids: resumed_ids,
            finished_req_ids: std::mem::take(&mut self.finished_since_schedule),
            preempted_req_ids: preempted.iter().map(|&s| self.req(s).id.clone()).collect(),
            num_tokens,
            arrays,
            transfers: if step_ran {
                transfers
            } else {
                Default::default()
            },
            state_restores: restores,
            state_saves: saves,
        }
    }

    /// Appends the sampled tokens of the oldest undelivered step (one per request), runs stop
    /// checks and detokenization, and frees finished requests. Returns one row per request with
    /// news. With drafts in that step, one token per request means no draft was accepted.
    pub fn update_from_output(
        &mut self,
        sampled_token_ids: &[i64],
        force_stop: Option<&[bool]>,
    ) -> CoreResult<StepOutputs> {
        self.update_from_output_counts(sampled_token_ids, None, force_stop)
    }

    /// `update_from_output` for a step with drafts: request i of the step's batch produced
    /// `num_sampled_tokens[i]` tokens, the next ones of the flat `sampled_token_ids` (its
    /// accepted drafts, then the correction or bonus token: 1..=1 + drafts; 0 or 1, ignored, for
    /// a row that samples nothing). `None`: one token per request.
    ///
    /// Each token is appended, detokenized and stop-checked in order; a stop inside the run
    /// ends the request there (the rest are dropped). The K/V of rejected drafts is un-counted
    /// (their slots are overwritten by the next step) and blocks that only they needed go back
    /// to the free queue; those blocks were never in the prefix cache (a block is cached only
    /// when full of known tokens). `force_stop[i]` applies after request i's last token.
    pub fn update_from_output_counts(
        &mut self,
        sampled_token_ids: &[i64],
        num_sampled_tokens: Option<&[i32]>,
        force_stop: Option<&[bool]>,
    ) -> CoreResult<StepOutputs> {
        let n = self.in_flight.front().map_or(0, Vec::len);
        match num_sampled_tokens {
            None if sampled_token_ids.len() != n => {
                return Err(invalid(
                    "sampled_token_ids",
                    format!(
                        "expected {n} entries (num_reqs of the last schedule()), got {}",
                        sampled_token_ids.len()
                    ),
                ));
            }
            Some(c) if c.len() != n => {
                return Err(invalid(
                    "num_sampled_tokens",
                    format!(
                        "expected {n} entries (num_reqs of the last schedule()), got {}",
                        c.len()
                    ),
                ));
            }
            Some(c) => {
                let total: i64 = c.iter().map(|&x| x as i64).sum();
                if total != sampled_token_ids.len() as i64 {
                    return Err(invalid(
                        "sampled_token_ids",
                        format!(
                            "expected sum(num_sampled_tokens) = {total} entries, got {}",
                            sampled_token_ids.len()
                        ),
                    ));
                }
            }
            None => {}
        }
        if let Some(f) = force_stop {
            if f.len() != n {
                return Err(invalid(
                    "force_stop",
                    format!("expected {n} entries, got {}", f.len()),
                ));
            }
        }
        let count = |i: usize| num_sampled_tokens.map_or(1, |c| c[i] as usize);
        // Validate everything before changing anything.
        let oldest = self.in_flight.front();
        if let (Some(oldest), None) = (oldest, num_sampled_tokens) {
            // One token per request: always a valid count (even with drafts: none accepted).
            for (i, (e, &t)) in oldest.iter().zip(sampled_token_ids).enumerate() {
                if e.sample && !is_token_id(t) {
                    token_id(&format!("sampled_token_ids[{i}]"), t)?;
                }
            }
        } else if let Some(oldest) = oldest {
            let mut off = 0;
            for (i, e) in oldest.iter().enumerate() {
                let c = num_sampled_tokens.map_or(1, |c| c[i] as i64);
                let max = if e.sample { 1 + e.num_drafts as i64 } else { 1 };
                if c < i64::from(e.sample) || c > max {
                    return Err(invalid(
                        &format!("num_sampled_tokens[{i}]"),
                        format!(
                            "row {i} had {} drafts{}: expected {}..={max} tokens, got {c}",
                            e.num_drafts,
                            if e.sample { "" } else { " and samples nothing" },
                            i64::from(e.sample)
                        ),
                    ));
                }
                let c = c as usize;
                let row = &sampled_token_ids[off..off + c];
                off += c;
                if !e.sample {
                    continue;
                }
                if let Some(j) = row.iter().position(|&t| !is_token_id(t)) {
                    token_id(&format!("sampled_token_ids[{}]", off - c + j), row[j])?;
                }
                if c > 1 {
                    // Accepted tokens are the drafts themselves: anything else would leave K/V
                    // computed from the draft under a different token.
                    if let Some(r) = self.slab[e.slot].as_ref() {
                        let live = e.is_current(r);
                        let accepted = row[..c - 1].iter().map(|&t| t as u32);
                        let drafts = &e.drafts[..(c - 1).min(e.drafts.len())];
                        if live && !accepted.eq(drafts.iter().copied()) {
                            return Err(invalid(
                                "sampled_token_ids",
                                format!(
                                    "row {i}: the first {} tokens must be its drafts {drafts:?}, got {:?}",
                                    c - 1,
                                    &row[..c - 1]
                                ),
                            ));
                        }
                    }
                }
            }
        }
        let steps = self.in_flight.pop_front().unwrap_or_default();
        self.in_flight_transfers.pop_front();
        self.in_flight_snapshots.pop_front();
        if self.in_flight.is_empty() {
            self.unwritten_if_rolled_back.clear();
        }
        let mut offsets = Vec::with_capacity(if num_sampled_tokens.is_some() { n } else { 0 });
        if num_sampled_tokens.is_some() {
            let mut off = 0;
            for i in 0..n {
                offsets.push(off);
                off += count(i);
            }
        }
        let row_tokens = |i: usize| -> &[i64] {
            if num_sampled_tokens.is_some() {
                &sampled_token_ids[offsets[i]..offsets[i] + count(i)]
            } else {
                &sampled_token_ids[i..i + 1]
            }
        };
        if let Some(t) = &self.tokenizer {
            // See TokenizerInfo::warm (measured: ~5% of a step at 256-1024 requests).
            if num_sampled_tokens.is_none() {
                let sampled = steps.iter().zip(sampled_token_ids);
                t.warm(sampled.filter(|(e, _)| e.sample).map(|(_, &t)| t as u32));
            } else {
                let sampled = steps.iter().enumerate().filter(|(_, e)| e.sample);
                t.warm(sampled.flat_map(|(i, _)| row_tokens(i).iter().map(|&t| t as u32)));
            }
        }
        let mut outputs = StepOutputsBuilder::with_capacity(n);
        let mut any_finished = false;
        let bs = self.cfg.block_size;
        let max_total_len = self.max_total_len;
        let eos = &self.cfg.eos_token_ids;
        for (i, e) in steps.iter().enumerate() {
            if !e.sample {
                continue;
            }
            // Skip requests aborted (or replaced in their slot) since schedule().
            let Some(req) = self.slab[e.slot].as_mut() else {
                continue;
            };
            if !e.is_current(req) {
                continue;
            }
            req.num_output_placeholders = req
                .num_output_placeholders
                .saturating_sub(1 + e.num_drafts as usize);
            let tokens = row_tokens(i);
            let fs = force_stop.is_some_and(|f| f[i]);
            let finish = if let [t] = tokens {
                // One token (no speculation, or nothing accepted): the plain path.
                outputs.push_token(*t as u32);
                self.stats.num_generation_tokens += 1;
                let text = outputs.text_mut();
                req.append_token(*t as u32, eos, bs, max_total_len, fs, text)
            } else {
                let mut finish = None;
                for (j, &t) in tokens.iter().enumerate() {
                    let token = t as u32;
                    outputs.push_token(token);
                    let last = j + 1 == tokens.len();
                    let text = outputs.text_mut();
                    finish = req.append_token(token, eos, bs, max_total_len, fs && last, text);
                    self.stats.num_generation_tokens += 1;
                    if finish.is_some() {
                        break;
                    }
                }
                finish
            };
            if e.num_drafts > 0 {
                let d = e.num_drafts as usize;
                let accepted = tokens.len() - 1;
                let st = &mut self.stats;
                st.num_drafts += 1;
                st.num_draft_tokens += d as u64;
                st.num_accepted_tokens += accepted as u64;
                for n in st.num_accepted_tokens_per_pos.iter_mut().take(accepted) {
                    *n += 1;
                }
                if req.num_output_placeholders == 0 {
                    // (Otherwise they are a newer step's, still in flight.)
                    self.drafts[e.slot].clear();
                }
                if finish.is_none() {
                    // The rejected drafts' K/V is not the sequence's: count it as not computed.
                    // A step scheduled after this one is shifted back as much on the device.
                    req.num_computed_tokens -= d - accepted;
                    self.kv.truncate(&mut req.kv, req.num_computed_tokens);
                }
            }
            let (finish_reason, stop_reason) = match finish {
                Some((f, s)) => {
                    any_finished = true;
                    (Some(f), s)
                }
                None => (None, None),
            };
            let row = RowInfo {
                slot: e.slot,
                request_id: self.slot_ids.get(e.slot),
                finish: finish_reason,
                num_output_tokens: req.num_output_tokens(),
                num_prompt_tokens: req.num_prompt_tokens,
                num_cached_tokens: req.num_cached_tokens.unwrap_or(0),
                num_external_cached_tokens: req.num_external_cached_tokens,
            };
            outputs.end_row(row, stop_reason);
        }
        if any_finished {
            let slab = &self.slab;
            let mut done = Vec::new();
            self.running.retain(|&s| {
                let fin = slab[s].as_ref().is_some_and(|r| r.is_finished());
                if fin {
                    done.push(s);
                }
                !fin
            });
            for s in done {
                self.release(s);
            }
        }
        Ok(outputs.finish())
    }

    /// Scheduled steps whose results never came (update_from_output was skipped, e.g. the
    /// model step failed): their tokens count as not computed, so each request schedules them
    /// again rather than waiting forever for a sample. Newest first.
    ///
    /// Their K/V was never written, so the blocks those steps filled are taken out of the
    /// prefix cache, a request that adopted one of them as a prefix-cache hit in the same step
    /// counts it as not computed either, and each request keeps only the blocks its computed
    /// tokens need (the rest go back to the free queue).
    ///
    /// A hybrid model's recurrent states may have taken in part of such a step, and nothing
    /// holds the state before it: its requests are preempted (they recompute, from a snapshot
    /// where there is one). Returns them, for the step's `preempted_req_ids`.
    fn roll_back_undelivered_steps(&mut self) -> Vec<usize> {
        if self.in_flight.is_empty() {
            return Vec::new();
        }
        let bs = self.cfg.block_size;
        let mut unwritten = Vec::new();
        let mut touched = Vec::new();
        if let Some(snaps) = self.snapshots.as_mut() {
            for p in self.pending_saves.drain(..) {
                snaps.release(p.snapshot); // (saves of the newest step: it never ran)
            }
        }
        while let Some(step) = self.in_flight.pop_back() {
            // Its copies never ran: nothing was stored in the host tier, no loaded block was filled.
            if let Some((stored, loaded)) = self.in_flight_transfers.pop_back() {
                self.kv.forget_offloads(&stored);
                unwritten.extend_from_slice(&loaded);
            }
            // Nor did its state saves.
            if let (Some(saved), Some(snaps)) =
                (self.in_flight_snapshots.pop_back(), self.snapshots.as_mut())
            {
                snaps.forget(&saved);
            }
            for e in step {
                if let Some(r) = self.slab[e.slot].as_mut() {
                    if e.is_current(r) {
                        r.num_computed_tokens -= e.num_tokens;
                        if e.sample {
                            r.num_output_placeholders -= 1 + e.num_drafts as usize;
                        }
                        if e.num_drafts > 0 {
                            self.drafts[e.slot].clear();
                        }
                        // Blocks that became full in the step (registered in the cache then).
                        let first = r.num_computed_tokens / bs;
                        let end =
                            ((r.num_computed_tokens + e.num_tokens) / bs).min(r.kv.blocks.len());
                        unwritten.extend_from_slice(&r.kv.blocks[first.min(end)..end]);
                        touched.push(e.slot);
                    }
                }
            }
        }
        unwritten.append(&mut self.unwritten_if_rolled_back);
        unwritten.sort_unstable();
        unwritten.dedup();
        for &slot in &touched {
            let r = self.slab[slot].as_mut().expect("live slot");
            let full = (r.num_computed_tokens / bs).min(r.kv.blocks.len());
            if let Some(i) = r.kv.blocks[..full]
                .iter()
                .position(|b| unwritten.binary_search(b).is_ok())
            {
                r.num_computed_tokens = i * bs;
            }
        }
        self.kv.uncache(&unwritten);
        for &slot in &touched {
            let r = self.slab[slot].as_mut().expect("live slot");
            self.kv.truncate(&mut r.kv, r.num_computed_tokens);
        }
        let mut preempted = Vec::new();
        if self.cfg.recurrent.is_some() {
            for slot in touched {
                if let Some(pos) = self.running.iter().position(|&s| s == slot) {
                    self.running.remove(pos);
                    self.preempt(slot);
                    preempted.push(slot);
                }
            }
        }
        preempted
    }

    /// Frees a finished request's blocks and forgets it; the runner hears of it in the next
    /// SchedulerOutput.finished_req_ids.
    /// Before a request leaves the running set with steps in flight (preemption, abort),
    /// remembers the blocks those steps filled: a rollback must not leave them in the prefix
    /// cache, where their K/V would be missing.
    fn note_in_flight_blocks(&mut self, slot: usize) {
        if self.in_flight.is_empty() {
            return;
        }
        let r = self.req(slot);
        let in_flight: usize = self
            .in_flight
            .iter()
            .flatten()
            .filter(|e| e.slot == slot && e.serial == r.serial && e.residency == r.residency)
            .map(|e| e.num_tokens)
            .sum();
        if in_flight == 0 {
            return;
        }
        let bs = self.cfg.block_size;
        let first = (r.num_computed_tokens - in_flight) / bs;
        let end = (r.num_computed_tokens / bs).min(r.kv.blocks.len());
        let blocks = r.kv.blocks[first.min(end)..end].to_vec();
        self.unwritten_if_rolled_back.extend(blocks);
    }

    fn release(&mut self, slot: usize) {
        let mut req = self.slab[slot].take().expect("live slot");
        self.slot_ids.remove(slot);
        self.drafts[slot].clear();
        self.kv.free(&mut req.kv);
        self.by_id.remove(&req.id);
        self.free_slots.push(slot);
        self.finished_since_schedule.push(req.id);
    }

    /// Aborts live requests (unknown ids are ignored), freeing their blocks at once. One row
    /// (finish reason abort, no tokens, no text) per request that was live.
    pub fn abort_requests<S: AsRef<str>>(&mut self, ids: &[S]) -> StepOutputs {
        let mut outputs = StepOutputsBuilder::with_capacity(ids.len());
        for id in ids {
            let Some(&slot) = self.by_id.get(id.as_ref()) else {
                continue;
            };
            let status = self.req(slot).status;
            if status == RequestStatus::Running {
                self.note_in_flight_blocks(slot);
                let pos = self
                    .running
                    .iter()
                    .position(|&s| s == slot)
                    .expect("running request");
                self.running.remove(pos);
            } else {
                let pos = self
                    .waiting
                    .iter()
                    .position(|&s| s == slot)
                    .expect("waiting request");
                self.waiting.remove(pos);
            }
            let r = self.req_mut(slot);
            r.status = RequestStatus::Finished(FinishReason::Abort);
            let r = self.req(slot);
            let row = RowInfo {
                slot,
                request_id: self.slot_ids.get(slot),
                finish: Some(FinishReason::Abort),
                num_output_tokens: r.num_output_tokens(),
                num_prompt_tokens: r.num_prompt_tokens,
                num_cached_tokens: r.num_cached_tokens.unwrap_or(0),
                num_external_cached_tokens: r.num_external_cached_tokens,
            };
            outputs.end_row(row, None);
            self.release(slot);
        }
        outputs.finish()
    }

    pub fn has_unfinished_requests(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn num_unfinished_requests(&self) -> usize {
        self.waiting.len() + self.running.len()
    }

    pub fn reset_prefix_cache(&mut self) -> bool {
        let ok = self.kv.reset_prefix_cache();
        if let (true, Some(snaps)) = (ok, self.snapshots.as_mut()) {
            snaps.clear();
        }
        ok
    }

    /// A hybrid model's state snapshots (None without recurrent states or prefix caching).
    pub fn state_snapshots(&self) -> Option<&StateSnapshots> {
        self.snapshots.as_ref()
    }

    /// Sleep mode's "keep" (the KV cache is about to be discarded): every running request is
    /// preempted by recompute, back to the front of the waiting queue in its running order, its
    /// blocks freed; once scheduled again it recomputes its prompt and output. Only with no step
    /// in flight, so no runner holds a sample of theirs to drop: unlike a preemption inside
    /// schedule(), these are not reported in the next output's `preempted_req_ids`.
    pub fn preempt_all(&mut self) -> CoreResult<usize> {
        if !self.in_flight.is_empty() {
            return Err(CoreError::InvalidArgument {
                param: "preempt_all".into(),
                message: "preempt_all: a step is still in flight (update it first)".into(),
            });
        }
        let running = std::mem::take(&mut self.running);
        for &slot in running.iter().rev() {
            self.preempt(slot);
        }
        Ok(running.len())
    }

    pub fn request_block_ids(&self, id: &str) -> CoreResult<Vec<u32>> {
        match self.by_id.get(id) {
            Some(&slot) => Ok(self.req(slot).kv.blocks.clone()),
            None => Err(CoreError::UnknownRequest(id.to_string())),
        }
    }

    /// Entries of the oldest scheduled step not yet updated (what update_from_output expects).
    pub fn oldest_in_flight_len(&self) -> usize {
        self.in_flight.front().map_or(0, Vec::len)
    }

    pub fn request_status(&self, id: &str) -> Option<RequestStatus> {
        self.by_id.get(id).map(|&s| self.req(s).status)
    }

    /// Records the prefix cache's events (blocks stored, removed, all cleared) from now on, for
    /// `take_kv_events` (vLLM's --kv-events-config; kv_events.rs).
    pub fn record_kv_events(&mut self) {
        self.kv.record_events();
    }

    /// The prefix cache's events since the last call, oldest first.
    pub fn take_kv_events(&mut self) -> Vec<crate::kv_events::KvEvent> {
        self.kv.take_events()
    }

    pub fn stats(&self) -> SchedulerStats {
        let pool = self.kv.pool();
        SchedulerStats {
            num_running: self.running.len(),
            num_waiting: self.waiting.len(),
            num_total_blocks: pool.num_blocks(),
            num_free_blocks: pool.num_free_blocks(),
            kv_cache_usage: pool.usage(),
            prefix_cache_queries: self.kv.prefix_queries,
            prefix_cache_hits: self.kv.prefix_hits,
            host_cache_hits: self.kv.host_hits,
            host_cache_blocks: self.kv.host_tier().map_or(0, |h| h.len()),
            running_lora_ids: self.distinct_loras(self.running.iter()),
            waiting_lora_ids: self.distinct_loras(self.waiting.iter()),
            ..self.stats.clone()
        }
    }

    /// The nonzero lora_ids of these requests, each once, in order (a handful: max_loras caps the
    /// running ones, so the linear `contains` is cheaper than a set).
    fn distinct_loras<'a>(&self, slots: impl Iterator<Item = &'a usize>) -> Vec<i64> {
        let mut ids: Vec<i64> = Vec::new();
        for &slot in slots {
            let id = self.req(slot).lora_id;
            if id != 0 && !ids.contains(&id) {
                ids.push(id);
            }
        }
        ids
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_free_blocks(&self) -> usize {
        self.kv.pool().num_free_blocks()
    }

    /// All tokens (prompt + output) of a live request (tests).
    #[cfg(test)]
    pub fn request_tokens(&self, id: &str) -> Vec<u32> {
        self.req(self.by_id[id]).token_ids.clone()
    }

    /// Checks the cross-layer invariants (tests and property tests); panics on a violation:
    /// every block is free or owned; a block owned by several live requests is a shared
    /// prefix block (it has a hash); ref counts equal owners; waiting requests own nothing;
    /// a running request owns exactly the blocks its computed tokens need.
    pub fn check_invariants(&self) {
        let pool = self.kv.pool();
        pool.check_invariants();
        let mut owners = vec![0u32; pool.num_blocks()];
        for (slot, r) in self.slab.iter().enumerate() {
            let Some(r) = r else { continue };
            assert_eq!(
                self.by_id.get(&r.id),
                Some(&slot),
                "request {} not indexed",
                r.id
            );
            assert_eq!(self.slot_ids.get(slot), &*r.id, "slot {slot}'s id");
            match r.status {
                RequestStatus::Running => {
                    assert!(self.running.contains(&slot));
                    assert_eq!(
                        r.kv.blocks.len(),
                        r.num_computed_tokens.div_ceil(self.cfg.block_size)
                    );
                }
                RequestStatus::Waiting
                | RequestStatus::WaitingForGrammar
                | RequestStatus::Preempted => {
                    assert!(self.waiting.contains(&slot));
                    assert!(
                        r.kv.blocks.is_empty(),
                        "waiting request {} holds blocks",
                        r.id
                    );
                    assert_eq!(r.num_computed_tokens, 0);
                }
                RequestStatus::Finished(_) => panic!("finished request {} still live", r.id),
            }
            assert!(r.num_tokens() <= self.max_total_len);
            let drafts = &self.drafts[slot];
            if !drafts.is_empty() {
                assert_eq!(
                    r.status,
                    RequestStatus::Running,
                    "{}: drafts off the running set",
                    r.id
                );
                assert!(
                    r.num_tokens() + r.num_output_placeholders <= self.max_total_len,
                    "{}: drafts past the length limit",
                    r.id
                );
                assert!(self
                    .in_flight
                    .iter()
                    .flatten()
                    .any(|e| e.slot == slot && e.drafts == *drafts));
            }
            for &b in &r.kv.blocks {
                assert_ne!(b, crate::block_pool::NULL_BLOCK);
                owners[b as usize] += 1;
            }
        }
        for (slot, d) in self.drafts.iter().enumerate() {
            let live = self.slab.get(slot).is_some_and(Option::is_some);
            assert!(
                live || d.is_empty(),
                "slot {slot}: drafts without a request"
            );
        }
        let mut owned = 0;
        for (b, &n) in owners.iter().enumerate().skip(1) {
            assert_eq!(pool.ref_cnt(b as u32), n, "block {b}: ref count vs owners");
            if n > 1 {
                assert!(
                    pool.block_hash(b as u32).is_some(),
                    "block {b} shared without a prefix hash"
                );
            }
            if n > 0 {
                owned += 1;
            }
        }
        assert_eq!(
            owned + pool.num_free_blocks(),
            pool.num_usable_blocks(),
            "leaked blocks"
        );
        assert_eq!(self.running.len() + self.waiting.len(), self.by_id.len());
        assert!(self.running.len() <= self.cfg.max_num_seqs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::StopReason;
    use crate::step_outputs::Row;

    const EOS: u32 = 2;

    fn sched(num_blocks: usize, block_size: usize, budget: usize, policy: &str) -> Scheduler {
        let cfg = SchedulerConfig::from_signed(
            num_blocks as i64,
            block_size as i64,
            256,
            8,
            budget as i64,
            true,
            policy,
            &[EOS as i64],
        )
        .unwrap();
        Scheduler::new(cfg, None).unwrap()
    }

    fn req(id: &str, prompt_len: usize, max_tokens: i64) -> NewRequest {
        let mut r = NewRequest::new(id, (100..100 + prompt_len as u32).collect(), max_tokens);
        r.detokenize = false;
        r
    }

    /// One step feeding token `tok` to every sampled request; returns (output, results).
    fn step(s: &mut Scheduler, tok: i64) -> (SchedulerOutput, Vec<Row>) {
        let out = s.schedule();
        let res = s
            .update_from_output(&vec![tok; out.req_ids.len()], None)
            .unwrap()
            .rows();
        s.check_invariants();
        (out, res)
    }

    fn ids(v: &[Arc<str>]) -> Vec<&str> {
        v.iter().map(|s| &**s).collect()
    }

    #[test]
    fn long_prompt_is_chunked_and_never_stalls_a_decode() {
        let mut s = sched(64, 4, 8, "fcfs");
        s.add_request(req("a", 3, 10)).unwrap();
        let (out, res) = step(&mut s, 7);
        assert_eq!(out.num_tokens, 3);
        assert_eq!(res.len(), 1);
        s.add_request(req("long", 20, 5)).unwrap();
        let mut chunks = Vec::new();
        let mut masks = Vec::new();
        for _ in 0..3 {
            let (out, _) = step(&mut s, 7);
            assert_eq!(out.req_ids.iter().collect::<Vec<_>>(), vec!["a", "long"]);
            assert_eq!(
                out.arrays.num_scheduled_tokens[0], 1,
                "the decode runs every step"
            );
            assert!(out.num_tokens <= 8);
            chunks.push(out.arrays.num_scheduled_tokens[1]);
            masks.push(out.arrays.sample_mask[1]);
        }
        assert_eq!(chunks, vec![7, 7, 6]);
        assert_eq!(masks, vec![false, false, true]);
    }

    #[test]
    fn atomic_spans_are_computed_in_one_step() {
        // Budget 8: a 20-token prompt with an image at [5, 11) and one at [12, 18). The first chunk
        // stops before the first image ([0, 5)), the next takes it whole and stops before the second
        // ([5, 12): 8 tokens would end inside it), the next the second image and the rest ([12, 20)),
        // then a decode.
        let mut s = sched(64, 4, 8, "fcfs");
        let mut r = req("img", 20, 2);
        r.atomic_spans = vec![(5, 11), (12, 18)];
        s.add_request(r).unwrap();
        let mut chunks = Vec::new();
        for _ in 0..4 {
            let (out, _) = step(&mut s, 7);
            chunks.push(out.arrays.num_scheduled_tokens[0]);
        }
        assert_eq!(chunks, vec![5, 7, 8, 1]);
        // Spans outside the prompt, overlapping or past the budget are refused.
        for (spans, field) in [
            (vec![(3, 25)], "atomic_spans"),
            (vec![(4, 9), (8, 12)], "atomic_spans"),
            (vec![(0, 9)], "max_num_batched_tokens"),
        ] {
            let mut bad = req("bad", 20, 2);
            bad.atomic_spans = spans;
            let err = s.add_request(bad).unwrap_err().to_string();
            assert!(err.contains(field), "{err}");
        }
    }

    #[test]
    fn partial_prefill_chunk_produces_no_output() {
        let mut s = sched(64, 4, 4, "fcfs");
        s.add_request(req("a", 10, 3)).unwrap();
        let (_, res) = step(&mut s, 7);
        assert!(res.is_empty());
        let (_, res) = step(&mut s, 7);
        assert!(res.is_empty());
        let (out, res) = step(&mut s, 7);
        assert_eq!(out.arrays.num_scheduled_tokens, vec![2]);
        assert_eq!(res.len(), 1);
        assert_eq!(res[0].new_token_ids, vec![7]);
    }

    #[test]
    fn preempted_request_keeps_its_tokens_and_resumes() {
        // 5 usable blocks of 4 tokens: two requests of 8 prompt tokens use 4 blocks, and
        // growing both past 12 tokens needs 6.
        let mut s = sched(6, 4, 64, "fcfs");
        s.add_request(req("a", 8, 12)).unwrap();
        s.add_request(req("b", 8, 12)).unwrap();
        let mut preempted_at = None;
        let mut resumed = false;
        let mut out_tokens: HashMap<String, Vec<u32>> = HashMap::new();
        for i in 0..40 {
            let out = s.schedule();
            if !out.preempted_req_ids.is_empty() {
                assert_eq!(
                    ids(&out.preempted_req_ids),
                    vec!["b"],
                    "FCFS preempts the latest"
                );
                preempted_at.get_or_insert(i);
                // b keeps its generated tokens while waiting.
                assert!(s.request_status("b") == Some(RequestStatus::Preempted));
            }
            if !out.resumed_req_ids.is_empty() {
                assert_eq!(ids(&out.resumed_req_ids), vec!["b"]);
                let r = s.req(s.by_id["b"]);
                // It recomputes prompt + output (less any prefix hit) in one go.
                assert_eq!(r.num_computed_tokens, r.num_tokens());
                resumed = true;
            }
            let toks: Vec<i64> = out
                .req_ids
                .iter()
                .map(|id| if id == "a" { 10 } else { 11 })
                .collect();
            for o in s.update_from_output(&toks, None).unwrap().rows() {
                out_tokens
                    .entry(o.request_id.to_string())
                    .or_default()
                    .extend(o.new_token_ids);
            }
            s.check_invariants();
            if !s.has_unfinished_requests() {
                break;
            }
        }
        assert!(preempted_at.is_some() && resumed);
        assert_eq!(out_tokens["a"], vec![10; 12]);
        assert_eq!(
            out_tokens["b"],
            vec![11; 12],
            "nothing lost across preemption"
        );
        assert_eq!(s.stats().num_preemptions, 1);
        assert_eq!(s.num_free_blocks(), 5);
    }

    #[test]
    fn priority_policy_orders_waiting_and_preempts_the_least_important() {
        let mut s = sched(6, 4, 64, "priority");
        let mut low = req("low", 8, 12);
        low.priority = 5;
        let mut high = req("high", 8, 12);
        high.priority = -1;
        s.add_request(low).unwrap();
        s.add_request(high).unwrap();
        let (out, _) = step(&mut s, 7);
        assert_eq!(ids(&out.new_req_ids), vec!["high", "low"]);
        let mut victims = Vec::new();
        for _ in 0..30 {
            let (out, _) = step(&mut s, 7);
            victims.extend(out.preempted_req_ids.iter().map(|s| s.to_string()));
            if !s.has_unfinished_requests() {
                break;
            }
        }
        assert!(!victims.is_empty());
        assert!(victims.iter().all(|v| v == "low"));
    }

    #[test]
    fn second_request_reuses_the_shared_prefix() {
        let mut s = sched(64, 4, 64, "fcfs");
        s.add_request(req("a", 10, 1)).unwrap();
        step(&mut s, 7);
        assert!(!s.has_unfinished_requests());
        s.add_request(req("b", 10, 1)).unwrap();
        let out = s.schedule();
        assert_eq!(out.arrays.num_computed_tokens, vec![8]);
        assert_eq!(out.num_tokens, 2);
        let res = s.update_from_output(&[7], None).unwrap().rows();
        assert_eq!(res[0].num_cached_tokens, 8);
        let st = s.stats();
        assert_eq!((st.prefix_cache_queries, st.prefix_cache_hits), (20, 8));
        // Different cache salt: no sharing.
        let mut c = req("c", 10, 1);
        c.cache_salt = Some("tenant-2".into());
        s.add_request(c).unwrap();
        assert_eq!(s.schedule().arrays.num_computed_tokens, vec![0]);
    }

    #[test]
    fn same_step_requests_share_prompt_blocks() {
        let mut s = sched(64, 4, 64, "fcfs");
        s.add_request(req("a", 9, 2)).unwrap();
        s.add_request(req("b", 9, 2)).unwrap();
        let out = s.schedule();
        assert_eq!(out.arrays.num_computed_tokens, vec![0, 8]);
        let a = s.request_block_ids("a").unwrap();
        let b = s.request_block_ids("b").unwrap();
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        s.check_invariants();
    }

    #[test]
    fn stop_conditions() {
        let mut s = sched(64, 4, 64, "fcfs");
        s.add_request(req("eos", 3, 10)).unwrap();
        let mut ign = req("ignore", 3, 2);
        ign.ignore_eos = true;
        s.add_request(ign).unwrap();
        let mut st = req("stop_id", 3, 10);
        st.stop_token_ids = vec![2, 9];
        st.ignore_eos = true;
        s.add_request(st).unwrap();
        let mut mn = req("min", 3, 10);
        mn.min_tokens = 2;
        s.add_request(mn).unwrap();
        let (_, res) = step(&mut s, EOS as i64);
        let by: HashMap<&str, &Row> = res.iter().map(|o| (&*o.request_id, o)).collect();
        assert_eq!(by["eos"].finish_reason, Some(FinishReason::Stop));
        assert_eq!(by["eos"].stop_reason, None);
        assert_eq!(by["ignore"].finish_reason, None);
        assert_eq!(by["stop_id"].stop_reason, Some(StopReason::TokenId(2)));
        assert_eq!(
            by["min"].finish_reason, None,
            "EOS suppressed before min_tokens"
        );
        let (out, res) = step(&mut s, EOS as i64);
        assert_eq!(ids(&out.finished_req_ids), vec!["eos", "stop_id"]);
        let by: HashMap<&str, &Row> = res.iter().map(|o| (&*o.request_id, o)).collect();
        assert_eq!(by["ignore"].finish_reason, Some(FinishReason::Length));
        assert_eq!(by["min"].finish_reason, Some(FinishReason::Stop));
        assert!(!s.has_unfinished_requests());
        assert_eq!(s.num_free_blocks(), 63);
    }

    #[test]
    fn max_tokens_is_clipped_to_max_model_len() {
        let mut s = sched(100, 4, 64, "fcfs");
        s.add_request(req("a", 250, 100)).unwrap();
        let mut n = 0;
        while s.has_unfinished_requests() {
            let (_, res) = step(&mut s, 7);
            n += res.iter().map(|o| o.new_token_ids.len()).sum::<usize>();
            if let Some(o) = res.first() {
                if o.finish_reason.is_some() {
                    assert_eq!(o.finish_reason, Some(FinishReason::Length));
                    assert_eq!(o.num_prompt_tokens + o.num_output_tokens, 256);
                }
            }
        }
        assert_eq!(n, 6);
    }

    #[test]
    fn force_stop_finishes_after_appending() {
        let mut s = sched(64, 4, 64, "fcfs");
        s.add_request(req("a", 3, 10)).unwrap();
        s.add_request(req("b", 3, 10)).unwrap();
        s.schedule();
        let res = s
            .update_from_output(&[7, 7], Some(&[false, true]))
            .unwrap()
            .rows();
        assert_eq!(res[0].finish_reason, None);
        assert_eq!(
            (res[1].finish_reason, res[1].num_output_tokens),
            (Some(FinishReason::Stop), 1)
        );
    }

    #[test]
    fn preempt_all_requeues_running_requests_in_order_and_they_recompute() {
        let mut s = sched(64, 4, 64, "fcfs");
        s.add_request(req("a", 6, 8)).unwrap();
        s.add_request(req("b", 6, 8)).unwrap();
        s.add_request(req("c", 6, 8)).unwrap();
        s.schedule();
        s.update_from_output(&[7, 7, 7], None).unwrap();
        let out = s.schedule();
        assert!(s.preempt_all().is_err(), "refused with a step in flight");
        s.update_from_output(&vec![7; out.req_ids.len()], None)
            .unwrap();
        let free_before = s.stats().num_free_blocks;
        assert_eq!(s.preempt_all().unwrap(), 3);
        s.check_invariants();
        assert!(
            s.stats().num_free_blocks > free_before,
            "their blocks went back"
        );
        assert_eq!(s.stats().num_running, 0);
        assert!(s.reset_prefix_cache(), "nothing holds a block any more");
        // Scheduled again in the old order, each recomputing prompt + the 2 tokens it had.
        let out = s.schedule();
        assert_eq!(out.req_ids.iter().collect::<Vec<_>>(), vec!["a", "b", "c"]);
        assert!(out.preempted_req_ids.is_empty());
        for id in ["a", "b", "c"] {
            let r = s.req(s.by_id[id]);
            assert_eq!(r.num_computed_tokens, 8, "{id} recomputes its 6 + 2 tokens");
        }
    }

    #[test]
    fn abort_frees_at_once_even_between_schedule_and_update() {
        let mut s = sched(64, 4, 64, "fcfs");
        s.add_request(req("a", 10, 10)).unwrap();
        s.add_request(req("b", 10, 10)).unwrap();
        s.schedule();
        let res = s.abort_requests(&["a", "nope"]).rows();
        assert_eq!(res.len(), 1);
        assert_eq!(res[0].finish_reason, Some(FinishReason::Abort));
        s.check_invariants();
        let res = s.update_from_output(&[7, 7], None).unwrap().rows();
        assert_eq!(res.len(), 1, "the aborted request's sample is dropped");
        assert_eq!(&*res[0].request_id, "b");
        let out = s.schedule();
        assert_eq!(ids(&out.finished_req_ids), vec!["a"]);
        s.abort_requests(&["b"]);
        assert_eq!(s.num_free_blocks(), 63);
        s.check_invariants();
    }

    #[test]
    fn max_num_seqs_caps_the_running_set() {
        let mut s = sched(64, 4, 1000, "fcfs");
        for i in 0..12 {
            s.add_request(req(&format!("r{i}"), 2, 3)).unwrap();
        }
        let out = s.schedule();
        assert_eq!(out.req_ids.len(), 8);
        assert_eq!(s.stats().num_waiting, 4);
    }

    #[test]
    fn max_loras_caps_distinct_adapters_and_lets_others_pass() {
        let mut s = Scheduler::new(
            SchedulerConfig::from_signed(64, 4, 256, 16, 1000, true, "fcfs", &[EOS as i64])
                .unwrap()
                .with_max_loras(2),
            None,
        )
        .unwrap();
        for (id, lora) in [("a", 1), ("b", 2), ("c", 3), ("d", 0), ("e", 1)] {
            let mut r = req(id, 3, 2);
            r.lora_id = lora;
            s.add_request(r).unwrap();
        }
        let (out, _) = step(&mut s, 7);
        // c's adapter would be a third: it waits; d (base) and e (adapter 1, running) pass it.
        assert_eq!(ids(&out.new_req_ids), vec!["a", "b", "d", "e"]);
        // The adapters in use (vLLM's lora_requests_info): each once, the base model not named.
        assert_eq!(s.stats().running_lora_ids, vec![1, 2]);
        assert_eq!(s.stats().waiting_lora_ids, vec![3]);
        let (out, _) = step(&mut s, 7); // the second token: all four finish
        assert!(out.new_req_ids.is_empty());
        s.check_invariants();
        let (out, _) = step(&mut s, 7);
        assert_eq!(ids(&out.new_req_ids), vec!["c"]);
        assert_eq!(
            (s.stats().running_lora_ids, s.stats().waiting_lora_ids),
            (vec![3], vec![])
        );
        s.check_invariants();
    }

    #[test]
    fn without_chunked_prefill_prompts_run_whole() {
        let mut s = Scheduler::new(
            SchedulerConfig::from_signed(64, 4, 256, 16, 10, true, "fcfs", &[EOS as i64])
                .unwrap()
                .with_chunked_prefill(false),
            None,
        )
        .unwrap();
        let err = s.add_request(req("long", 11, 1)).unwrap_err();
        assert!(err.to_string().contains("max_num_batched_tokens"), "{err}");
        s.add_request(req("a", 6, 1)).unwrap();
        let mut b = req("b", 6, 1);
        b.prompt_token_ids = (200..206).collect(); // no prefix shared with a
        s.add_request(b).unwrap();
        let out = s.schedule();
        assert_eq!(
            out.req_ids.iter().collect::<Vec<_>>(),
            vec!["a"],
            "b does not fit whole: it waits"
        );
        assert_eq!(out.arrays.num_scheduled_tokens, vec![6]);
        s.update_from_output(&[7], None).unwrap();
        let out = s.schedule();
        assert_eq!(out.req_ids.iter().collect::<Vec<_>>(), vec!["b"]);
        s.check_invariants();
    }

    #[test]
    fn long_prefill_threshold_caps_each_prefill_chunk_but_not_an_image() {
        let mut s = Scheduler::new(
            SchedulerConfig::from_signed(64, 4, 256, 16, 32, true, "fcfs", &[EOS as i64])
                .unwrap()
                .with_long_prefill_token_threshold(6),
            None,
        )
        .unwrap();
        s.add_request(req("long", 20, 2)).unwrap();
        let mut b = req("b", 9, 2);
        b.prompt_token_ids = (200..209).collect();
        s.add_request(b).unwrap();
        // Both prompts share the step, six tokens each (the budget of 32 would take them whole).
        let (out, _) = step(&mut s, 7);
        assert_eq!(out.arrays.num_scheduled_tokens, vec![6, 6]);
        let (out, res) = step(&mut s, 7);
        assert_eq!(out.arrays.num_scheduled_tokens, vec![6, 3]);
        assert_eq!(res.len(), 1, "b's prompt is done: it samples");
        // The running decode takes one token; the long prompt's last chunks stay within the cap.
        let (out, _) = step(&mut s, 7);
        assert_eq!(out.arrays.num_scheduled_tokens, vec![6, 1]);
        let (out, _) = step(&mut s, 7);
        assert_eq!(out.arrays.num_scheduled_tokens, vec![2]);
        // An image of 10 tokens (an atomic span) is computed whole, past the cap of 6.
        let mut img = req("img", 16, 1);
        img.prompt_token_ids = (300..316).collect();
        img.atomic_spans = vec![(2, 12)];
        s.add_request(img).unwrap();
        let (out, _) = step(&mut s, 7);
        assert_eq!(
            out.arrays.num_scheduled_tokens,
            vec![1, 2],
            "long's last token, img's text before the image"
        );
        let (out, _) = step(&mut s, 7);
        assert_eq!(out.arrays.num_scheduled_tokens, vec![10]);
        let (out, _) = step(&mut s, 7);
        assert_eq!(out.arrays.num_scheduled_tokens, vec![4]);
        s.check_invariants();
    }

    /// Two long prompts then a short one, budget 24, chunks of at most 12 (the long threshold).
    fn partial_prefill_queue(max_prefills: usize, max_long: usize) -> Scheduler {
        let cfg = SchedulerConfig::from_signed(128, 4, 256, 16, 24, true, "fcfs", &[EOS as i64])
            .unwrap()
            .with_long_prefill_token_threshold(12)
            .with_partial_prefills(max_prefills, max_long)
            .unwrap();
        let mut s = Scheduler::new(cfg, None).unwrap();
        for (i, (id, len)) in [("long1", 60), ("long2", 60), ("short", 8)]
            .into_iter()
            .enumerate()
        {
            let mut r = req(id, len, 2);
            r.prompt_token_ids = (0..len as u32).map(|t| 100 * (i as u32 + 1) + t).collect();
            s.add_request(r).unwrap();
        }
        s
    }

    #[test]
    fn partial_prefills_let_a_short_prompt_pass_a_long_one() {
        // Off (vLLM V1's scheduler): first come first served, the short prompt waits for the budget.
        let mut s = partial_prefill_queue(1, 1);
        let (out, _) = step(&mut s, 7);
        assert_eq!(
            out.req_ids.iter().collect::<Vec<_>>(),
            vec!["long1", "long2"]
        );
        assert_eq!(out.arrays.num_scheduled_tokens, vec![12, 12]);
        // Two at once, one of them long: long2 waits while long1 prefills, the short prompt goes
        // ahead of it; both share the budget (12 each).
        let mut s = partial_prefill_queue(2, 1);
        let (out, res) = step(&mut s, 7);
        assert_eq!(
            out.req_ids.iter().collect::<Vec<_>>(),
            vec!["long1", "short"]
        );
        assert_eq!(out.arrays.num_scheduled_tokens, vec![12, 8]);
        assert_eq!(res.len(), 1, "the short prompt's first token");
        for _ in 0..3 {
            let (out, _) = step(&mut s, 7);
            assert!(
                !out.req_ids.iter().collect::<Vec<_>>().contains(&"long2"),
                "long1 is still prefilling"
            );
        }
        // long1's last 12 tokens are not more than the threshold: no longer long, so long2 starts.
        let (out, _) = step(&mut s, 7);
        assert_eq!(
            out.req_ids.iter().collect::<Vec<_>>(),
            vec!["long1", "long2"]
        );
        assert_eq!(out.arrays.num_scheduled_tokens, vec![12, 12]);
        s.check_invariants();
    }

    #[test]
    fn partial_prefills_share_the_budget() {
        // Three prompts that may all prefill together (two long allowed): 24 / 3 = 8 tokens each.
        let mut s = partial_prefill_queue(3, 2);
        let (out, _) = step(&mut s, 7);
        assert_eq!(
            out.req_ids.iter().collect::<Vec<_>>(),
            vec!["long1", "long2", "short"]
        );
        assert_eq!(out.arrays.num_scheduled_tokens, vec![8, 8, 8]);
        // The short prompt decodes now; two prompts share: 24 / 2 each (the budget is gone before
        // the decode's turn in the running order, as without partial prefills).
        let (out, _) = step(&mut s, 7);
        assert_eq!(out.arrays.num_scheduled_tokens, vec![12, 12]);
    }

    #[test]
    fn partial_prefill_settings_are_checked_by_name() {
        let base = || {
            SchedulerConfig::from_signed(64, 4, 256, 16, 32, true, "fcfs", &[EOS as i64]).unwrap()
        };
        let err = |r: CoreResult<SchedulerConfig>| r.unwrap_err().to_string();
        assert!(err(base().with_partial_prefills(2, 1)).contains("long_prefill_token_threshold"));
        let t = || base().with_long_prefill_token_threshold(8);
        assert!(err(t().with_partial_prefills(2, 3)).contains("max_long_partial_prefills"));
        assert!(err(t().with_partial_prefills(0, 1)).contains("max_num_partial_prefills"));
        assert!(
            err(t().with_chunked_prefill(false).with_partial_prefills(2, 1))
                .contains("chunked prefill")
        );
        assert!(
            t().with_partial_prefills(4, 4).is_ok() && base().with_partial_prefills(1, 1).is_ok()
        );
    }

    #[test]
    fn grammar_wait_holds_only_that_request() {
        let mut s = sched(64, 4, 64, "fcfs");
        let mut g = req("g", 3, 2);
        g.wait_for_grammar = true;
        s.add_request(g).unwrap();
        s.add_request(req("x", 3, 2)).unwrap();
        let (out, _) = step(&mut s, 7);
        assert_eq!(out.req_ids.iter().collect::<Vec<_>>(), vec!["x"]);
        s.grammar_ready(&["g"]);
        let (out, _) = step(&mut s, 7);
        assert_eq!(out.req_ids.iter().collect::<Vec<_>>(), vec!["x", "g"]);
    }

    #[test]
    fn bad_input_is_rejected_without_side_effects() {
        let mut s = sched(5, 4, 64, "fcfs");
        s.add_request(req("a", 3, 4)).unwrap();
        let e = |r: CoreResult<usize>| r.unwrap_err();
        assert!(matches!(
            e(s.add_request(req("a", 3, 4))),
            CoreError::DuplicateRequest(_)
        ));
        assert!(
            matches!(e(s.add_request(req("b", 0, 4))), CoreError::InvalidArgument { message: m, .. } if m.contains("prompt_token_ids"))
        );
        assert!(
            matches!(e(s.add_request(req("b", 3, 0))), CoreError::InvalidArgument { message: m, .. } if m.contains("max_tokens"))
        );
        // 4 usable blocks of 4 = 16 tokens of KV.
        assert!(
            matches!(e(s.add_request(req("b", 16, 4))), CoreError::PromptTooLong(m) if m.contains("KV cache"))
        );
        let mut r = req("b", 3, 4);
        r.min_tokens = 5;
        assert!(
            matches!(e(s.add_request(r)), CoreError::InvalidArgument { message: m, .. } if m.contains("min_tokens"))
        );
        let mut r = req("b", 3, 4);
        r.stop = vec!["x".into()];
        assert!(
            matches!(e(s.add_request(r)), CoreError::InvalidArgument { message: m, .. } if m.starts_with("stop"))
        );
        let big = sched(1000, 4, 64, "fcfs");
        let mut big = big;
        assert!(
            matches!(e(big.add_request(req("b", 256, 4))), CoreError::PromptTooLong(m) if m.contains("max_model_len"))
        );
        assert_eq!(s.num_unfinished_requests(), 1);
        s.schedule();
        assert!(s.update_from_output(&[1, 2], None).is_err());
        assert!(s.update_from_output(&[-1], None).is_err());
        assert_eq!(s.update_from_output(&[7], None).unwrap().len(), 1);
        s.check_invariants();
        assert!(matches!(
            s.request_block_ids("zz"),
            Err(CoreError::UnknownRequest(_))
        ));
        for (field, args) in [
            ("num_blocks", (1, 4, 8, 8)),
            ("block_size", (4, 0, 8, 8)),
            ("max_num_seqs", (4, 4, 0, 8)),
            ("max_num_batched_tokens", (4, 4, 8, -3)),
        ] {
            let err =
                SchedulerConfig::from_signed(args.0, args.1, 64, args.2, args.3, true, "fcfs", &[])
                    .unwrap_err();
            assert!(err.to_string().starts_with(field), "{err}");
        }
    }

    #[test]
    fn a_step_without_update_is_scheduled_again() {
        let mut s = sched(64, 4, 64, "fcfs");
        s.add_request(req("a", 6, 3)).unwrap();
        let first = s.schedule();
        let again = s.schedule(); // the model step failed; no update_from_output
        assert_eq!(again.arrays.input_ids, first.arrays.input_ids);
        assert_eq!(again.arrays.positions, first.arrays.positions);
        s.check_invariants();
        assert_eq!(s.update_from_output(&[7], None).unwrap().len(), 1);
        let (out, _) = step(&mut s, 7);
        assert_eq!(out.arrays.positions, vec![6]);
    }

    #[test]
    fn a_failed_step_takes_back_its_prefix_cache_entries() {
        let mut s = sched(64, 4, 64, "fcfs");
        s.add_request(req("a", 9, 2)).unwrap();
        s.add_request(req("b", 9, 2)).unwrap();
        // b adopts a's first two blocks, which a computes in this very step.
        let first = s.schedule();
        assert_eq!(first.arrays.num_computed_tokens, vec![0, 8]);
        // The step fails. Its K/V was never written: neither a nor b may count those blocks as
        // computed, and a newcomer must not find them in the prefix cache.
        let again = s.schedule();
        s.check_invariants();
        assert_eq!(again.arrays.num_computed_tokens, vec![0, 0]);
        assert_eq!(again.arrays.num_scheduled_tokens, vec![9, 9]);
        s.update_from_output(&[7, 7], None).unwrap();
        s.add_request(req("c", 9, 1)).unwrap();
        assert_eq!(s.schedule().arrays.num_computed_tokens, vec![9, 9, 8]);
        s.check_invariants();
    }

    #[test]
    fn a_request_aborted_in_a_failed_step_leaves_no_unwritten_block_in_the_cache() {
        for preempt_instead in [false, true] {
            let mut s = sched(64, 4, 64, "fcfs");
            s.add_request(req("a", 9, 2)).unwrap();
            s.schedule_step(true); // registers a's two full blocks; the step then fails
            if preempt_instead {
                // (preemption is internal; the same bookkeeping runs for it)
                let slot = s.by_id["a"];
                s.running.retain(|&x| x != slot);
                s.preempt(slot);
            } else {
                s.abort_requests(&["a"]);
            }
            s.add_request(req("b", 9, 1)).unwrap();
            let out = s.schedule();
            // The first request scheduled (a resumed, or b) finds nothing cached; after a
            // resumed, b shares what a computes in this step.
            assert_eq!(
                out.arrays.num_computed_tokens[0], 0,
                "a's K/V was never written"
            );
            s.check_invariants();
        }
    }

    #[test]
    fn async_steps_use_placeholders_and_stop_at_the_length_limit() {
        let mut s = sched(64, 4, 64, "fcfs");
        s.add_request(req("a", 6, 3)).unwrap();
        let prefill = s.schedule_step(true);
        assert_eq!(prefill.arrays.sample_mask, vec![true]);
        // Step 2 is decided before step 1's sample is known: its input is a placeholder.
        let d1 = s.schedule_step(true);
        assert_eq!(d1.arrays.input_ids, vec![-1]);
        assert_eq!(d1.arrays.positions, vec![6]);
        assert_eq!(d1.arrays.sample_mask, vec![true]);
        s.check_invariants();
        let outs = s.update_from_output(&[7], None).unwrap().rows();
        assert_eq!(outs[0].new_token_ids, vec![7]);
        let d2 = s.schedule_step(true);
        assert_eq!(
            (d2.arrays.input_ids.clone(), d2.arrays.positions.clone()),
            (vec![-1], vec![7])
        );
        assert_eq!(
            s.update_from_output(&[8], None).unwrap().rows()[0].new_token_ids,
            vec![8]
        );
        // Two outputs known, one in flight: the third is max_tokens, so nothing more is scheduled.
        let none = s.schedule_step(true);
        assert_eq!(none.num_tokens, 0);
        let last = s.update_from_output(&[9], None).unwrap().rows();
        assert_eq!(last[0].finish_reason, Some(FinishReason::Length));
        assert_eq!(s.update_from_output(&[], None).unwrap().len(), 0);
        assert!(!s.has_unfinished_requests());
        s.check_invariants();
    }

    #[test]
    fn async_step_after_a_stop_is_dropped_and_blocks_are_freed() {
        let mut s = sched(64, 4, 64, "fcfs");
        s.add_request(req("a", 4, 10)).unwrap();
        s.schedule_step(true);
        let next = s.schedule_step(true);
        assert_eq!(next.num_tokens, 1);
        let outs = s.update_from_output(&[EOS as i64], None).unwrap().rows();
        assert_eq!(outs[0].finish_reason, Some(FinishReason::Stop));
        // The step computed meanwhile belongs to a finished request: its sample is ignored.
        assert!(s.update_from_output(&[5], None).unwrap().is_empty());
        assert_eq!(s.num_free_blocks(), 63);
        s.check_invariants();
    }

    #[test]
    fn two_undelivered_async_steps_are_rolled_back() {
        let mut s = sched(64, 4, 64, "fcfs");
        s.add_request(req("a", 6, 5)).unwrap();
        let first = s.schedule_step(true);
        s.schedule_step(true);
        let again = s.schedule_step(true); // neither update came: start over from the prompt
        assert_eq!(again.arrays.input_ids, first.arrays.input_ids);
        s.check_invariants();
        assert_eq!(
            s.update_from_output(&[7], None).unwrap().rows()[0].new_token_ids,
            vec![7]
        );
    }

    fn host_sched(num_blocks: usize, host_blocks: usize) -> Scheduler {
        let cfg = SchedulerConfig::from_signed(
            num_blocks as i64,
            4,
            256,
            8,
            64,
            true,
            "fcfs",
            &[EOS as i64],
        )
        .unwrap()
        .with_host_tier(host_blocks);
        Scheduler::new(cfg, None).unwrap()
    }

    fn run_alone(s: &mut Scheduler, r: NewRequest) -> Vec<SchedulerOutput> {
        s.add_request(r).unwrap();
        let mut outs = Vec::new();
        while s.has_unfinished_requests() {
            outs.push(step(s, 7).0);
        }
        outs
    }

    #[test]
    fn evicted_blocks_go_to_the_host_tier_and_come_back_as_loads() {
        // 9 usable blocks of 4 tokens; "a" caches 3 prompt blocks, "b" (all 9 blocks) evicts them.
        let mut s = host_sched(10, 16);
        run_alone(&mut s, req("a", 13, 1));
        let b = NewRequest::new("b", (500..533).collect(), 1);
        let outs = run_alone(
            &mut s,
            NewRequest {
                detokenize: false,
                ..b
            },
        );
        let offloaded: usize = outs.iter().map(|o| o.transfers.offload_blocks.len()).sum();
        assert_eq!(offloaded, 3, "a's three cached prompt blocks");
        let stored = outs[0].transfers.offload_slots.clone();
        assert!(outs.iter().all(|o| o.transfers.load_blocks.is_empty()));
        assert_eq!(s.stats().host_cache_blocks, 3);
        // "a" again: the device no longer has its prefix, the host does: 12 tokens loaded, 1 computed.
        s.add_request(req("a2", 13, 1)).unwrap();
        let out = s.schedule();
        assert_eq!(out.arrays.num_computed_tokens, vec![12]);
        assert_eq!(out.num_tokens, 1);
        // (the LRU free queue evicted a's last prompt block first: its slots come back reversed)
        assert_eq!(
            out.transfers.load_slots,
            stored.iter().rev().copied().collect::<Vec<_>>()
        );
        let blocks = s.request_block_ids("a2").unwrap();
        assert_eq!(out.transfers.load_blocks, blocks[..3].to_vec());
        s.update_from_output(&[7], None).unwrap();
        s.check_invariants();
        assert_eq!(s.stats().host_cache_hits, 12);
        // The loaded blocks are device-cache blocks again: a third copy hits them on the device.
        s.add_request(req("a3", 13, 1)).unwrap();
        let out = s.schedule();
        assert_eq!(out.arrays.num_computed_tokens, vec![12]);
        assert!(out.transfers.load_blocks.is_empty());
        s.update_from_output(&[7], None).unwrap();
    }

    #[test]
    fn a_rolled_back_step_undoes_its_loads_and_offloads() {
        let mut s = host_sched(10, 16);
        run_alone(&mut s, req("a", 13, 1));
        run_alone(
            &mut s,
            NewRequest {
                detokenize: false,
                ..NewRequest::new("b", (500..533).collect(), 1)
            },
        );
        s.add_request(req("a2", 13, 2)).unwrap();
        let first = s.schedule();
        assert_eq!(first.transfers.load_blocks.len(), 3);
        // The step never ran (no update_from_output): its loads did not fill the blocks.
        let again = s.schedule();
        assert_eq!(
            again.arrays.num_computed_tokens,
            vec![0],
            "the loaded prefix counts as not computed"
        );
        s.update_from_output(&[7], None).unwrap();
        s.check_invariants();
        // An offload whose step never ran is forgotten by the tier: nothing loads garbage later.
        let mut t = host_sched(6, 16);
        run_alone(&mut t, req("x", 9, 1)); // 2 cached prompt blocks
        t.add_request(NewRequest {
            detokenize: false,
            ..NewRequest::new("y", (600..619).collect(), 1)
        })
        .unwrap();
        let evicting = t.schedule();
        assert_eq!(evicting.transfers.offload_blocks.len(), 2);
        assert_eq!(t.stats().host_cache_blocks, 2);
        let _ = t.schedule(); // rolls the first back
        assert_eq!(t.stats().host_cache_blocks, 0);
    }

    #[test]
    fn reset_prefix_cache_only_when_idle() {
        let mut s = sched(64, 4, 64, "fcfs");
        s.add_request(req("a", 10, 2)).unwrap();
        step(&mut s, 7);
        assert!(!s.reset_prefix_cache());
        step(&mut s, 7);
        assert!(s.reset_prefix_cache());
        s.add_request(req("b", 10, 1)).unwrap();
        assert_eq!(s.schedule().arrays.num_computed_tokens, vec![0]);
    }
}

#[cfg(test)]
#[path = "scheduler_state_tests.rs"]
mod state_tests;
