use std::sync::Arc;

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyList;

use crate::batch::{IdList, SchedulerOutput};

/// Everything the model runner needs for one step. The arrays are created once, by moving the
/// core's Vecs into numpy (no copy), and every property access returns the same array.
#[pyclass(name = "SchedulerOutput", module = "ferrox._core", frozen)]
pub struct PySchedulerOutput {
    req_ids: IdList,
    /// `req_ids` as a Python list, made on first access (the engine mostly uses req_slots).
    req_ids_list: PyOnceLock<Py<PyList>>,
    req_slots: Py<PyArray1<i32>>,
    new_req_ids: Vec<Arc<str>>,
    resumed_req_ids: Vec<Arc<str>>,
    finished_req_ids: Vec<Arc<str>>,
    preempted_req_ids: Vec<Arc<str>>,
    num_tokens: usize,
    input_ids: Py<PyArray1<i64>>,
    positions: Py<PyArray1<i64>>,
    slot_mapping: Py<PyArray1<i64>>,
    query_start_loc: Py<PyArray1<i32>>,
    num_scheduled_tokens: Py<PyArray1<i32>>,
    num_computed_tokens: Py<PyArray1<i32>>,
    seq_lens: Py<PyArray1<i32>>,
    block_table: Py<PyArray2<i32>>,
    logits_indices: Py<PyArray1<i64>>,
    sample_mask: Py<PyArray1<bool>>,
    /// Speculative decoding's arrays, made on first access (a numpy array costs ~2 us to make,
    /// and an engine without speculation never reads them).
    logits_start_loc: Lazy<i32>,
    num_draft_tokens: Lazy<i32>,
    draft_token_ids: Lazy<i64>,
    /// The step's copies between the device cache and the host tier (rust/host_tier.rs): the
    /// runner issues every offload (device block -> host slot), then every load, before the forward.
    kv_offload_blocks: Lazy<i64>,
    kv_offload_slots: Lazy<i64>,
    kv_load_slots: Lazy<i64>,
    kv_load_blocks: Lazy<i64>,
    /// A hybrid model's state snapshots (rust/state_snapshots.rs): batch index and snapshot slot of
    /// each restore (into the request's state row, before the forward) and save (after it).
    state_restore_index: Lazy<i32>,
    state_restore_slots: Lazy<i32>,
    state_save_index: Lazy<i32>,
    state_save_slots: Lazy<i32>,
}

/// (batch index, slot) pairs as two columns.
fn columns(pairs: &[(u32, u32)]) -> (Lazy<i32>, Lazy<i32>) {
    let (a, b) = pairs.iter().map(|&(i, s)| (i as i32, s as i32)).unzip();
    (Lazy::new(a), Lazy::new(b))
}

fn wide(v: Vec<u32>) -> Vec<i64> {
    v.into_iter().map(i64::from).collect()
}

/// A column kept as a Vec until Python first reads it; then copied once into a numpy array.
struct Lazy<T: numpy::Element> {
    data: Vec<T>,
    array: PyOnceLock<Py<PyArray1<T>>>,
}

impl<T: numpy::Element + Copy> Lazy<T> {
    fn new(data: Vec<T>) -> Self {
        Lazy {
            data,
            array: PyOnceLock::new(),
        }
    }

    fn get(&self, py: Python<'_>) -> Py<PyArray1<T>> {
        self.array
            .get_or_init(py, || PyArray1::from_slice(py, &self.data).unbind())
            .clone_ref(py)
    }
}

impl PySchedulerOutput {
    pub fn new(py: Python<'_>, out: SchedulerOutput) -> PyResult<Self> {
        let a = out.arrays;
        let (state_restore_index, state_restore_slots) = columns(&out.state_restores);
        let (state_save_index, state_save_slots) = columns(&out.state_saves);
        let num_reqs = a.seq_lens.len();
        let block_table = PyArray1::from_vec(py, a.block_table)
            .reshape([num_reqs, a.max_blocks])?
            .unbind();
        Ok(PySchedulerOutput {
            req_ids: out.req_ids,
            req_ids_list: PyOnceLock::new(),
            req_slots: PyArray1::from_vec(py, out.req_slots).unbind(),
            new_req_ids: out.new_req_ids,
            resumed_req_ids: out.resumed_req_ids,
            finished_req_ids: out.finished_req_ids,
            preempted_req_ids: out.preempted_req_ids,
            num_tokens: out.num_tokens,
            input_ids: PyArray1::from_vec(py, a.input_ids).unbind(),
            positions: PyArray1::from_vec(py, a.positions).unbind(),
            slot_mapping: PyArray1::from_vec(py, a.slot_mapping).unbind(),
            query_start_loc: PyArray1::from_vec(py, a.query_start_loc).unbind(),
            num_scheduled_tokens: PyArray1::from_vec(py, a.num_scheduled_tokens).unbind(),
            num_computed_tokens: PyArray1::from_vec(py, a.num_computed_tokens).unbind(),
            seq_lens: PyArray1::from_vec(py, a.seq_lens).unbind(),
            block_table,
            logits_indices: PyArray1::from_vec(py, a.logits_indices).unbind(),
            sample_mask: PyArray1::from_vec(py, a.sample_mask).unbind(),
            logits_start_loc: Lazy::new(a.logits_start_loc),
            num_draft_tokens: Lazy::new(a.num_draft_tokens),
            draft_token_ids: Lazy::new(a.draft_token_ids),
            kv_offload_blocks: Lazy::new(wide(out.transfers.offload_blocks)),
            kv_offload_slots: Lazy::new(wide(out.transfers.offload_slots)),
            kv_load_slots: Lazy::new(wide(out.transfers.load_slots)),
            kv_load_blocks: Lazy::new(wide(out.transfers.load_blocks)),
            state_restore_index,
            state_restore_slots,
            state_save_index,
            state_save_slots,
        })
    }
}

fn id_list<'py>(py: Python<'py>, ids: &[Arc<str>]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, ids.iter().map(|s| &**s))
}

#[pymethods]
impl PySchedulerOutput {
    #[getter]
    fn num_reqs(&self) -> usize {
        self.req_ids.len()
    }
    #[getter]
    fn num_tokens(&self) -> usize {
        self.num_tokens
    }
    #[getter]
    fn req_ids(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        if let Some(l) = self.req_ids_list.get(py) {
            return Ok(l.clone_ref(py));
        }
        let list = PyList::new(py, self.req_ids.iter())?.unbind();
        Ok(self.req_ids_list.get_or_init(py, || list).clone_ref(py))
    }
    #[getter]
    fn req_slots(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.req_slots.clone_ref(py)
    }
    #[getter]
    fn new_req_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        id_list(py, &self.new_req_ids)
    }
    #[getter]
    fn resumed_req_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        id_list(py, &self.resumed_req_ids)
    }
    #[getter]
    fn finished_req_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        id_list(py, &self.finished_req_ids)
    }
    #[getter]
    fn preempted_req_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        id_list(py, &self.preempted_req_ids)
    }
    #[getter]
    fn input_ids(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.input_ids.clone_ref(py)
    }
    #[getter]
    fn positions(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.positions.clone_ref(py)
    }
    #[getter]
    fn slot_mapping(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.slot_mapping.clone_ref(py)
    }
    #[getter]
    fn query_start_loc(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.query_start_loc.clone_ref(py)
    }
    #[getter]
    fn num_scheduled_tokens(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.num_scheduled_tokens.clone_ref(py)
    }
    #[getter]
    fn num_computed_tokens(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.num_computed_tokens.clone_ref(py)
    }
    #[getter]
    fn seq_lens(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.seq_lens.clone_ref(py)
    }
    #[getter]
    fn block_table(&self, py: Python<'_>) -> Py<PyArray2<i32>> {
        self.block_table.clone_ref(py)
    }
    #[getter]
    fn logits_indices(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.logits_indices.clone_ref(py)
    }
    #[getter]
    fn logits_start_loc(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.logits_start_loc.get(py)
    }
    #[getter]
    fn sample_mask(&self, py: Python<'_>) -> Py<PyArray1<bool>> {
        self.sample_mask.clone_ref(py)
    }
    #[getter]
    fn num_draft_tokens(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.num_draft_tokens.get(py)
    }
    #[getter]
    fn draft_token_ids(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.draft_token_ids.get(py)
    }
    /// Offloads + loads this step (0: nothing to copy; the arrays are then never made).
    #[getter]
    fn num_kv_transfers(&self) -> usize {
        self.kv_offload_blocks.data.len() + self.kv_load_blocks.data.len()
    }
    #[getter]
    fn kv_offload_blocks(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.kv_offload_blocks.get(py)
    }
    #[getter]
    fn kv_offload_slots(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.kv_offload_slots.get(py)
    }
    #[getter]
    fn kv_load_slots(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.kv_load_slots.get(py)
    }
    #[getter]
    fn kv_load_blocks(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.kv_load_blocks.get(py)
    }
    /// Snapshot restores + saves this step (0: the four arrays are never made).
    #[getter]
    fn num_state_copies(&self) -> usize {
        self.state_restore_index.data.len() + self.state_save_index.data.len()
    }
    #[getter]
    fn state_restore_index(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.state_restore_index.get(py)
    }
    #[getter]
    fn state_restore_slots(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.state_restore_slots.get(py)
    }
    #[getter]
    fn state_save_index(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.state_save_index.get(py)
    }
    #[getter]
    fn state_save_slots(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.state_save_slots.get(py)
    }
    fn __repr__(&self) -> String {
        format!(
            "SchedulerOutput(num_reqs={}, num_tokens={}, new={}, resumed={}, preempted={}, finished={})",
            self.req_ids.len(),
            self.num_tokens,
            self.new_req_ids.len(),
            self.resumed_req_ids.len(),
            self.preempted_req_ids.len(),
            self.finished_req_ids.len()
        )
    }
}
