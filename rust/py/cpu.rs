//! Glue for the CPU kernels (crate::cpu): a quantized matrix, a decoder layer, and a decoder
//! stack that runs a whole decode step in one call. Arrays come as numpy views of torch CPU
//! tensors (no copies); the GIL is released while the kernels run on their own threads.

use std::sync::Arc;

use numpy::{
    PyArray2, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2, PyReadwriteArrayDyn,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::cpu::attention::LayerKv;
use crate::cpu::decoder::{decode_layers, DecoderLayer, Projection, StepBatch};
use crate::cpu::pool;
use crate::cpu::quant::QuantMatrix;

fn value_error(field: &str, what: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("{field}: {what}"))
}

fn contiguous<'a, T: numpy::Element, D: numpy::ndarray::Dimension>(
    field: &str,
    a: &'a numpy::PyReadonlyArray<'_, T, D>,
) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|_| value_error(field, "must be a C-contiguous array"))
}

/// A weight [rows, cols] in groups of 32 columns: w = scale * q + offset, q of 4 or 8 bits.
#[pyclass(name = "CpuQuantMatrix", module = "ferrox._core", frozen)]
pub struct PyCpuQuantMatrix {
    inner: Arc<QuantMatrix>,
}

#[pymethods]
impl PyCpuQuantMatrix {
    /// q: uint8 [rows, cols] (one value a byte); scale, offset: float32 [rows, cols / 32].
    #[new]
    fn new(
        py: Python<'_>,
        q: PyReadonlyArray2<'_, u8>,
        scale: PyReadonlyArray2<'_, f32>,
        offset: PyReadonlyArray2<'_, f32>,
        bits: u32,
    ) -> PyResult<Self> {
        let (rows, cols) = (q.shape()[0], q.shape()[1]);
        let (qs, ss, os) = (
            contiguous("q", &q)?,
            contiguous("scale", &scale)?,
            contiguous("offset", &offset)?,
        );
        let inner = py
            .detach(|| QuantMatrix::new(rows, cols, bits, qs, ss, os))
            .map_err(|e| value_error("CpuQuantMatrix", e))?;
        Ok(PyCpuQuantMatrix {
            inner: Arc::new(inner),
        })
    }

    #[getter]
    fn rows(&self) -> usize {
        self.inner.rows()
    }

    #[getter]
    fn cols(&self) -> usize {
        self.inner.cols()
    }

    #[getter]
    fn bits(&self) -> u32 {
        self.inner.bits()
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    /// out (=, or += with accumulate) x @ w.T (+ bias); x float32 [m, cols], out float32 [m, rows].
    #[pyo3(signature = (x, out, bias=None, accumulate=false))]
    fn matmul(
        &self,
        py: Python<'_>,
        x: PyReadonlyArray2<'_, f32>,
        mut out: PyReadwriteArray2<'_, f32>,
        bias: Option<PyReadonlyArray1<'_, f32>>,
        accumulate: bool,
    ) -> PyResult<()> {
        let m = x.shape()[0];
        if x.shape()[1] != self.inner.cols() || out.shape() != [m, self.inner.rows()] {
            return Err(value_error(
                "matmul",
                format!(
                    "x {:?} and out {:?} do not fit a {:?}",
                    x.shape(),
                    out.shape(),
                    self.inner
                ),
            ));
        }
        let xs = contiguous("x", &x)?;
        let bias = match &bias {
            Some(b) => Some(
                b.as_slice()
                    .map_err(|_| value_error("bias", "must be contiguous"))?,
            ),
            None => None,
        };
        let outs = out
            .as_slice_mut()
            .map_err(|_| value_error("out", "must be a C-contiguous array"))?;
        if bias.is_some_and(|b| b.len() != self.inner.rows()) {
            return Err(value_error(
                "bias",
                format!("needs {} entries", self.inner.rows()),
            ));
        }
        let inner = &self.inner;
        py.detach(|| pool::run(|| inner.matmul(xs, outs, bias, accumulate)));
        Ok(())
    }

    /// float32 [rows, cols]: the weights the product multiplies by.
    fn dequantize<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let inner = &self.inner;
        let w = py.detach(|| pool::run(|| inner.dequantize()));
        let arr = numpy::ndarray::Array2::from_shape_vec((self.inner.rows(), self.inner.cols()), w)
            .map_err(|e| value_error("dequantize", e))?;
        Ok(PyArray2::from_owned_array(py, arr))
    }
}

fn floats(field: &str, a: Option<PyReadonlyArray1<'_, f32>>) -> PyResult<Option<Vec<f32>>> {
    a.map(|a| {
        a.as_slice()
            .map(<[f32]>::to_vec)
            .map_err(|_| value_error(field, "must be contiguous"))
    })
    .transpose()
}

fn projection(
    field: &str,
    w: &PyCpuQuantMatrix,
    bias: Option<PyReadonlyArray1<'_, f32>>,
) -> PyResult<Projection> {
    Ok(Projection {
        weight: w.inner.clone(),
        bias: floats(field, bias)?,
    })
}

/// One pre-norm decoder layer's weights for `CpuDecoder`.
#[pyclass(name = "CpuDecoderLayer", module = "ferrox._core", frozen)]
pub struct PyCpuDecoderLayer {
    inner: Arc<DecoderLayer>,
}

#[pymethods]
impl PyCpuDecoderLayer {
    #[new]
    #[pyo3(signature = (*, input_norm, post_norm, eps, qkv, o, gate_up, down, num_heads, num_kv_heads, head_dim,
                        scale, qkv_bias=None, o_bias=None, gate_up_bias=None, down_bias=None, window=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        input_norm: PyReadonlyArray1<'_, f32>,
        post_norm: PyReadonlyArray1<'_, f32>,
        eps: f32,
        qkv: PyRef<'_, PyCpuQuantMatrix>,
        o: PyRef<'_, PyCpuQuantMatrix>,
        gate_up: PyRef<'_, PyCpuQuantMatrix>,
        down: PyRef<'_, PyCpuQuantMatrix>,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        scale: f32,
        qkv_bias: Option<PyReadonlyArray1<'_, f32>>,
        o_bias: Option<PyReadonlyArray1<'_, f32>>,
        gate_up_bias: Option<PyReadonlyArray1<'_, f32>>,
        down_bias: Option<PyReadonlyArray1<'_, f32>>,
        window: usize,
    ) -> PyResult<Self> {
        let layer = DecoderLayer {
            input_norm: floats("input_norm", Some(input_norm))?.unwrap_or_default(),
            post_norm: floats("post_norm", Some(post_norm))?.unwrap_or_default(),
            eps,
            qkv: projection("qkv_bias", &qkv, qkv_bias)?,
            o: projection("o_bias", &o, o_bias)?,
            gate_up: projection("gate_up_bias", &gate_up, gate_up_bias)?,
            down: projection("down_bias", &down, down_bias)?,
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
            window,
        };
        layer
            .validate()
            .map_err(|e| value_error("CpuDecoderLayer", e))?;
        Ok(PyCpuDecoderLayer {
            inner: Arc::new(layer),
        })
    }
}

/// A model's decoder layers, run for a whole step (prefill chunks and decodes) in one call.
#[pyclass(name = "CpuDecoder", module = "ferrox._core", frozen)]
pub struct PyCpuDecoder {
    layers: Vec<Arc<DecoderLayer>>,
}

#[pymethods]
impl PyCpuDecoder {
    #[new]
    fn new(layers: Vec<PyRef<'_, PyCpuDecoderLayer>>) -> Self {
        PyCpuDecoder {
            layers: layers.iter().map(|l| l.inner.clone()).collect(),
        }
    }

    /// h: float32 [T, hidden], the residual stream, updated in place. kv_caches: one float32
    /// [2, num_blocks, block_size, num_kv_heads, head_dim] array per layer. rope: float32 [T,
    /// head_dim] ([cos | sin]); slots: int64 [T]; query_start_loc: int32 [R + 1]; block_table:
    /// int32 [R, max_blocks]; seq_lens: int32 [R] (this step's tokens included).
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        mut h: PyReadwriteArray2<'_, f32>,
        mut kv_caches: Vec<PyReadwriteArrayDyn<'_, f32>>,
        rope: PyReadonlyArray2<'_, f32>,
        slots: PyReadonlyArray1<'_, i64>,
        query_start_loc: PyReadonlyArray1<'_, i32>,
        block_table: PyReadonlyArray2<'_, i32>,
        seq_lens: PyReadonlyArray1<'_, i32>,
    ) -> PyResult<()> {
        let block_stride = block_table.shape()[1];
        let batch = StepBatch {
            rope: contiguous("rope", &rope)?,
            slots: contiguous("slots", &slots)?,
            query_start_loc: contiguous("query_start_loc", &query_start_loc)?,
            block_table: contiguous("block_table", &block_table)?,
            block_stride,
            seq_lens: contiguous("seq_lens", &seq_lens)?,
        };
        let mut caches = Vec::with_capacity(kv_caches.len());
        for (i, cache) in kv_caches.iter_mut().enumerate() {
            let shape = cache.shape().to_vec();
            if shape.len() != 5 || shape[0] != 2 {
                return Err(value_error(
                    &format!("kv_caches[{i}]"),
                    format!("shape {shape:?} is not [2, blocks, block_size, kv_heads, head_dim]"),
                ));
            }
            let all = cache
                .as_slice_mut()
                .map_err(|_| value_error(&format!("kv_caches[{i}]"), "must be contiguous"))?;
            let (k, v) = all.split_at_mut(all.len() / 2);
            caches.push(LayerKv {
                k,
                v,
                block_size: shape[2],
                num_kv_heads: shape[3],
                head_dim: shape[4],
            });
        }
        let hs = h
            .as_slice_mut()
            .map_err(|_| value_error("h", "must be a C-contiguous array"))?;
        let layers = &self.layers;
        py.detach(|| pool::run(|| decode_layers(layers, hs, &mut caches, &batch)))
            .map_err(|e| value_error("CpuDecoder", e))
    }
}

/// The kernels' thread count (the engine passes its num_threads).
#[pyfunction]
fn cpu_set_num_threads(threads: usize) -> PyResult<()> {
    pool::set_num_threads(threads).map_err(|e| value_error("num_threads", e))
}

#[pyfunction]
fn cpu_num_threads() -> usize {
    pool::num_threads()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCpuQuantMatrix>()?;
    m.add_class::<PyCpuDecoderLayer>()?;
    m.add_class::<PyCpuDecoder>()?;
    m.add_function(wrap_pyfunction!(cpu_set_num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_num_threads, m)?)?;
    Ok(())
}
