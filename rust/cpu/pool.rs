//! The kernels' threads: one rayon pool of `set_num_threads` workers (default: every core).
//!
//! A decode step enters the pool once (`run`) and splits each matrix among the workers from
//! inside it, so the per-matmul cost is a work-stealing split (about a microsecond), not a thread
//! wake-up (tens of microseconds) per product.

use std::sync::{Arc, Mutex};

use rayon::prelude::*;
use rayon::ThreadPool;

static POOL: Mutex<Option<Arc<ThreadPool>>> = Mutex::new(None);

fn build(threads: usize) -> Result<Arc<ThreadPool>, String> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("ferrox-cpu-{i}"))
        .build()
        .map(Arc::new)
        .map_err(|e| format!("could not start {threads} kernel threads: {e}"))
}

/// Use `threads` workers from now on (the engine passes its `num_threads`).
pub fn set_num_threads(threads: usize) -> Result<(), String> {
    if threads == 0 {
        return Err("num_threads must be at least 1".into());
    }
    let mut slot = POOL.lock().unwrap_or_else(|e| e.into_inner());
    if slot.as_ref().map(|p| p.current_num_threads()) != Some(threads) {
        *slot = Some(build(threads)?);
    }
    Ok(())
}

pub fn num_threads() -> usize {
    pool().current_num_threads()
}

fn pool() -> Arc<ThreadPool> {
    let mut slot = POOL.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = slot.as_ref() {
        return p.clone();
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let p = build(threads).expect("starting the CPU kernel threads");
    *slot = Some(p.clone());
    p
}

/// Run `f` on the pool; `par_ranges` inside it splits work among the pool's workers.
pub fn run<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    pool().install(f)
}

/// Call `f(start, end)` over `0..n` split into ranges of at least `min_len` (at most four per
/// worker, so an unlucky split costs little), in parallel on the current pool.
pub fn par_ranges(n: usize, min_len: usize, f: impl Fn(usize, usize) + Sync + Send) {
    let chunks = (n / min_len.max(1)).clamp(1, 4 * rayon::current_num_threads());
    if chunks == 1 {
        f(0, n);
        return;
    }
    (0..chunks)
        .into_par_iter()
        .for_each(|c| f(c * n / chunks, (c + 1) * n / chunks));
}

/// A raw output pointer shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
pub(crate) struct SharedOut(pub *mut f32);
// SAFETY: every user writes only the indices of its own range, so no two tasks touch one element.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// # Safety
    /// `i` is in bounds of the buffer and no other task writes it concurrently.
    #[inline]
    pub unsafe fn at(self, i: usize) -> *mut f32 {
        self.0.add(i)
    }
}
