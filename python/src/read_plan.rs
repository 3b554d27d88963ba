//! kvbridge-pd's KV layout translation, for connectors written in Python: the pair check
//! a decoder makes once per prefiller engine, and the ranged reads of each request.

use kvbridge_pd::{readers_of, LayoutError, ReadPlanner, TpLayout, Translation};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// A prefiller's and a decoder rank's layouts, checked against each other: constructing one
/// raises ``kvbridge.Incompatible`` (naming both layouts) when they cannot be translated,
/// ``ValueError`` when a layout is malformed. Layouts are JSON objects of kvbridge-pd's
/// ``TpLayout``: ``model``, ``layers``, ``total_kv_heads``, ``head_dim``, ``mla``,
/// ``dtype``, ``block_tokens``, ``block_order`` (``"layer"``, ``"kv"``, ``"token"``,
/// ``"head"``), ``tp_rank``, ``tp_size``.
#[pyclass(name = "ReadPlanner", module = "kvbridge", frozen)]
pub struct PyReadPlanner {
    translation: Translation,
    planner: ReadPlanner,
}

/// A read as Python sees it: `(prefiller_rank, src_offset, dst_offset, len)`.
type Read = (u32, u64, u64, u64);

fn layout(which: &str, json: &str) -> PyResult<TpLayout> {
    serde_json::from_str(json).map_err(|e| PyValueError::new_err(format!("{which} layout: {e}")))
}

#[pymethods]
impl PyReadPlanner {
    #[new]
    fn new(py: Python<'_>, prefiller: &str, decoder: &str) -> PyResult<Self> {
        let (p, d) = (layout("prefiller", prefiller)?, layout("decoder", decoder)?);
        let translation = Translation::new(&p, &d).map_err(|e| match e {
            LayoutError::Incompatible { .. } => crate::errors::make(
                py,
                "Incompatible",
                e.to_string(),
                None,
                Some("layout".into()),
                None,
            ),
            _ => PyValueError::new_err(e.to_string()),
        })?;
        let planner = ReadPlanner::new(&translation);
        Ok(Self {
            translation,
            planner,
        })
    }

    /// The prefiller ranks this decoder rank reads from (each head from exactly one).
    fn source_ranks(&self) -> Vec<u32> {
        self.planner.source_ranks()
    }

    /// The decoder ranks that read from prefiller rank ``rank``: it frees a request's
    /// blocks once each of them is done.
    fn readers_of(&self, rank: u32) -> Vec<u32> {
        readers_of(&self.translation, rank)
    }

    /// The bytes this decoder rank needs for ``tokens`` tokens, over all planes.
    fn wanted_bytes(&self, tokens: u64) -> u64 {
        self.planner.wanted_bytes(tokens)
    }

    /// ``(reads, planes)``: each read ``(prefiller_rank, src_offset, dst_offset, len)`` in
    /// bytes from the start of a plane, issued once per plane; ``src_blocks`` and
    /// ``dst_blocks`` in token order. ``ValueError`` when the block lists do not fit
    /// ``tokens``.
    fn plan(
        &self,
        src_blocks: Vec<u32>,
        dst_blocks: Vec<u32>,
        tokens: u64,
    ) -> PyResult<(Vec<Read>, u64)> {
        let plan = self
            .planner
            .plan(&src_blocks, &dst_blocks, tokens)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let reads = plan
            .reads
            .iter()
            .map(|r| (r.prefiller_rank, r.src_offset, r.dst_offset, r.len))
            .collect();
        Ok((reads, plan.planes))
    }
}
