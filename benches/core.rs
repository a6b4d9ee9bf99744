//! Micro-benchmarks of the core's hot primitives: `cargo bench` (criterion).
//! The end-to-end step benchmark through the Python bindings is benches/bench_scheduler.py;
//! `scheduler step` here is the same loop without Python (the core's share of it).
//!
//! The step benchmark decodes with the tokenizer.json named by FERROX_BENCH_TOKENIZER, else
//! the one bench_scheduler.py caches (SmolLM2's, in $TMPDIR/ferrox-bench), else a synthetic
//! byte-level BPE vocabulary of 49152 tokens.

use std::hint::black_box;

use _core::block_pool::BlockPool;
use _core::prefix_cache::{extend_block_hashes, hash_block, root_hash, HashAlgo};
use _core::scheduler::{NewRequest, Scheduler, SchedulerConfig};
use criterion::{criterion_group, Criterion};

fn block_pool(c: &mut Criterion) {
    let mut pool = BlockPool::new(16_385);
    let mut blocks = Vec::with_capacity(64);
    c.bench_function("block_pool allocate+free 64 blocks", |b| {
        b.iter(|| {
            blocks.clear();
            assert!(pool.allocate(black_box(64), &mut blocks));
            pool.free(blocks.iter().rev());
        })
    });
    // Cached blocks: allocation evicts hashes, hits pull blocks out of the middle of the queue.
    let mut ids = Vec::new();
    assert!(pool.allocate(1024, &mut ids));
    for (i, &id) in ids.iter().enumerate() {
        pool.cache_block(id, i as u128 + 1);
    }
    pool.free(ids.iter().rev());
    c.bench_function("block_pool touch+free 64 cached blocks (prefix hit)", |b| {
        b.iter(|| {
            blocks.clear();
            for h in 1..=64u128 {
                blocks.push(pool.get_cached_block(black_box(h)).unwrap());
            }
            pool.touch(&blocks);
            pool.free(blocks.iter().rev());
        })
    });
}

fn prefix_hashing(c: &mut Criterion) {
    for (name, algo) in [("sha256", HashAlgo::Sha256), ("xxh3", HashAlgo::Xxh3)] {
        let root = root_hash(algo, 0, None);
        let block: Vec<u32> = (0..16).map(|i| i * 7919).collect();
        c.bench_function(&format!("hash_block 16 tokens ({name})"), |b| {
            b.iter(|| hash_block(algo, black_box(root), black_box(&block)))
        });
        let prompt: Vec<u32> = (0..4096).map(|i| (i * 2654435761u32) % 49152).collect();
        let mut hashes = Vec::with_capacity(256);
        c.bench_function(
            &format!("block hashes of a 4096-token prompt (256 blocks, {name})"),
            |b| {
                b.iter(|| {
                    hashes.clear();
                    extend_block_hashes(algo, root, black_box(&prompt), 16, &mut hashes);
                })
            },
        );
    }
}

/// xorshift64*: a fixed pseudo-random stream, no extra dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A byte-level BPE tokenizer.json: the 256 byte tokens plus random 2-8 letter words (with and
/// without a leading "Ġ" space), 3 special tokens; no merges (decoding never needs them).
fn synthetic_tokenizer_json(vocab: usize) -> String {
    // GPT-2's byte -> printable char map.
    let mut byte_char = Vec::with_capacity(256);
    let mut n = 0u32;
    for b in 0u32..256 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        byte_char.push(if printable {
            char::from_u32(b).unwrap()
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap()
        });
    }
    let mut words: Vec<String> = byte_char.iter().map(|c| c.to_string()).collect();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut seen: std::collections::HashSet<String> = words.iter().cloned().collect();
    while words.len() < vocab - 3 {
        let len = 2 + rng.below(7) as usize;
        let mut w: String = if rng.below(2) == 0 {
            "Ġ".into()
        } else {
            String::new()
        };
        for _ in 0..len {
            w.push((b'a' + rng.below(26) as u8) as char);
        }
        if seen.insert(w.clone()) {
            words.push(w);
        }
    }
    let vocab_json: Vec<String> = words
        .iter()
        .enumerate()
        .map(|(i, w)| format!("{}: {i}", serde_json::to_string(w).unwrap()))
        .collect();
    let added: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .enumerate()
        .map(|(k, t)| {
            format!(
                r#"{{"id":{},"content":"{t}","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}}"#,
                words.len() + k
            )
        })
        .collect();
    format!(
        r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[{}],"normalizer":null,
        "pre_tokenizer":{{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true}},
        "post_processor":null,"decoder":{{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true}},
        "model":{{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,"end_of_word_suffix":null,
        "fuse_unk":false,"byte_fallback":false,"ignore_merges":false,"vocab":{{{}}},"merges":[]}}}}"#,
        added.join(","),
        vocab_json.join(",")
    )
}

fn bench_tokenizer_json() -> (String, &'static str) {
    let cached = std::env::var("FERROX_BENCH_TOKENIZER")
        .ok()
        .unwrap_or_else(|| {
            let dir = std::env::temp_dir()
                .join("ferrox-bench")
                .join("smollm2.tokenizer.json");
            dir.to_string_lossy().into_owned()
        });
    match std::fs::read_to_string(&cached) {
        Ok(json) => (json, "smollm2"),
        Err(_) => (synthetic_tokenizer_json(49152), "synthetic"),
    }
}

/// bench_scheduler.py's loop without Python: `n` running requests (128-token prompts, 3 stop
/// strings, detokenization); each step is one schedule_step + update_from_output with random
/// ordinary tokens, and finished requests are replaced by new prompts.
struct StepLoop {
    s: Scheduler,
    rng: Rng,
    serial: usize,
    stops: Vec<String>,
    sampled: Vec<i64>,
}

/// Ordinary tokens of the vocabulary (special ones sit at the end).
const SAMPLE_VOCAB: u64 = 49152 - 256;

impl StepLoop {
    fn new(n: usize, json: &str) -> Self {
        let max_len = 128 + 4096;
        let cfg = SchedulerConfig::from_signed(
            (1 + n * (max_len / 16) / 4 + 64) as i64,
            16,
            max_len as i64,
            n as i64,
            8192,
            true,
            "fcfs",
            &[],
        )
        .unwrap();
        let mut l = StepLoop {
            s: Scheduler::new(cfg, Some(json)).unwrap(),
            rng: Rng(42),
            serial: 0,
            stops: ["\n\nUser:", "###", "</answer>"].map(String::from).to_vec(),
            sampled: Vec::new(),
        };
        for _ in 0..n {
            l.add();
        }
        while l.s.stats().num_waiting > 0 {
            l.step();
        }
        l
    }

    fn add(&mut self) {
        let prompt: Vec<u32> = (0..128)
            .map(|_| self.rng.below(SAMPLE_VOCAB) as u32)
            .collect();
        let max_tokens = 100 + self.rng.below(600) as i64;
        let mut r = NewRequest::new(format!("req-{}", self.serial), prompt, max_tokens);
        r.stop = self.stops.clone();
        self.serial += 1;
        self.s.add_request(r).unwrap();
    }

    fn step(&mut self) {
        let out = self.s.schedule();
        self.sampled.clear();
        let rng = &mut self.rng;
        self.sampled
            .extend((0..out.req_ids.len()).map(|_| rng.below(SAMPLE_VOCAB) as i64));
        let res = self.s.update_from_output(&self.sampled, None).unwrap();
        let finished = res.finish_reasons.iter().filter(|&&f| f != 0).count();
        for _ in 0..finished {
            self.add();
        }
        black_box((out, res));
    }
}

fn scheduler_step(c: &mut Criterion) {
    let (json, name) = bench_tokenizer_json();
    for n in [256usize, 1024] {
        let mut l = StepLoop::new(n, &json);
        let label = format!("scheduler step, {n} requests ({name} detok, 3 stop strings)");
        c.bench_function(&label, |b| b.iter(|| l.step()));
    }
}

criterion_group!(benches, block_pool, prefix_hashing, scheduler_step);

/// `FERROX_BENCH_STEPS=N [FERROX_BENCH_REQUESTS=n] cargo bench --bench core` runs N steps of the
/// step loop and exits: a fixed amount of work for profilers (perf, valgrind's cachegrind).
fn main() {
    if let Ok(steps) = std::env::var("FERROX_BENCH_STEPS") {
        let steps: usize = steps.parse().expect("FERROX_BENCH_STEPS: a number");
        let n = std::env::var("FERROX_BENCH_REQUESTS").map_or(256, |v| v.parse().unwrap());
        let (json, name) = bench_tokenizer_json();
        let mut l = StepLoop::new(n, &json);
        let t = std::time::Instant::now();
        for _ in 0..steps {
            l.step();
        }
        let per = t.elapsed().as_secs_f64() * 1e6 / steps as f64;
        println!("{steps} steps of {n} requests ({name}): {per:.1} us/step");
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
