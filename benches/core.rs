//! Micro-benchmarks of the core's hot primitives: `cargo bench` (criterion).
//! The end-to-end step benchmark through the Python bindings is benches/bench_scheduler.py.

use std::hint::black_box;

use _core::block_pool::BlockPool;
use _core::prefix_cache::{extend_block_hashes, hash_block, root_hash};
use criterion::{criterion_group, criterion_main, Criterion};

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
    let root = root_hash(0, None);
    let block: Vec<u32> = (0..16).map(|i| i * 7919).collect();
    c.bench_function("hash_block 16 tokens", |b| {
        b.iter(|| hash_block(black_box(root), black_box(&block)))
    });
    let prompt: Vec<u32> = (0..4096).map(|i| (i * 2654435761u32) % 49152).collect();
    let mut hashes = Vec::with_capacity(256);
    c.bench_function("block hashes of a 4096-token prompt (256 blocks)", |b| {
        b.iter(|| {
            hashes.clear();
            extend_block_hashes(root, black_box(&prompt), 16, &mut hashes);
        })
    });
}

criterion_group!(benches, block_pool, prefix_hashing);
criterion_main!(benches);
