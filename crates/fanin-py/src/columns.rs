//! `fanin.spark.aggregate`'s columnar path: Arrow buffers (as numpy uint8
//! views, no copy, no row in Python) into `tuples` inputs, and result files
//! back into Arrow buffers (`fanin_kv::columns` does the work).

use numpy::PyReadonlyArray1;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use fanin_kv::columns::{encode_batch, group_results, Column, KeyFormat, Kind, Part, ValueTasks};
use fanin_proto::kv::ValueType;

use crate::errors::InvalidPair;

/// One Arrow array from Python: (kind, offset, length, validity, offsets,
/// data), the buffers uint8 numpy views or None.
type ColumnSpec<'py> = (
    String,
    usize,
    usize,
    Option<PyReadonlyArray1<'py, u8>>,
    Option<PyReadonlyArray1<'py, u8>>,
    Option<PyReadonlyArray1<'py, u8>>,
);

fn kind(name: &str) -> PyResult<Kind> {
    Kind::parse(name).ok_or_else(|| PyValueError::new_err(format!("column kind {name:?} is not one fanin reads")))
}

fn key_format(columns: Vec<(String, bool)>, tagged: bool) -> PyResult<KeyFormat> {
    let columns = columns.into_iter().map(|(k, n)| Ok((kind(&k)?, n))).collect::<PyResult<Vec<_>>>()?;
    KeyFormat::new(columns, tagged).map_err(|e| PyValueError::new_err(e.to_string()))
}

fn value_tasks(kinds: &[String]) -> PyResult<ValueTasks> {
    let kinds = kinds.iter().map(|k| kind(k)).collect::<PyResult<Vec<_>>>()?;
    ValueTasks::new(&kinds).map_err(|e| PyValueError::new_err(e.to_string()))
}

fn slice<'a>(a: &'a Option<PyReadonlyArray1<'_, u8>>) -> PyResult<Option<&'a [u8]>> {
    a.as_ref().map(|a| a.as_slice().map_err(|e| PyValueError::new_err(format!("buffer: {e}")))).transpose()
}

fn columns<'a>(specs: &'a [ColumnSpec<'_>]) -> PyResult<Vec<Column<'a>>> {
    specs
        .iter()
        .map(|(k, offset, len, validity, offsets, data)| {
            Ok(Column {
                kind: kind(k)?,
                offset: *offset,
                len: *len,
                validity: slice(validity)?,
                offsets: slice(offsets)?.unwrap_or(&[]),
                data: slice(data)?.unwrap_or(&[]),
            })
        })
        .collect()
}

/// `GroupEncoder(key_columns, tagged, receivers, value_kinds)`:
/// ``add(keys, values)`` per record batch, then ``finish()`` gives one
/// `tuples` input per receiver and value task (``receiver * len(value_types)
/// + task``). `key_columns`: [(kind, nullable)] of the group columns;
/// `value_kinds`: the value columns' kinds ("one" for ``count(*)``);
/// ``value_types``: the tasks' value types ("int64", "float64").
#[pyclass(module = "fanin._native")]
pub(crate) struct GroupEncoder {
    format: KeyFormat,
    tasks: ValueTasks,
    outs: Vec<Vec<u8>>,
}

#[pymethods]
impl GroupEncoder {
    #[new]
    fn new(key_columns: Vec<(String, bool)>, tagged: bool, receivers: u32, value_kinds: Vec<String>) -> PyResult<Self> {
        if receivers == 0 {
            return Err(PyValueError::new_err("receivers must be at least 1"));
        }
        let tasks = value_tasks(&value_kinds)?;
        let outs = vec![Vec::new(); receivers as usize * tasks.types.len()];
        Ok(Self { format: key_format(key_columns, tagged)?, tasks, outs })
    }

    #[getter]
    fn value_types(&self) -> Vec<&'static str> {
        self.tasks.types.iter().map(|t| t.name()).collect()
    }

    fn add(&mut self, py: Python<'_>, keys: Vec<ColumnSpec<'_>>, values: Vec<ColumnSpec<'_>>) -> PyResult<()> {
        let keys = columns(&keys)?;
        let values = columns(&values)?;
        let (format, tasks, outs) = (&self.format, &self.tasks, &mut self.outs);
        py.detach(|| encode_batch(format, tasks, &keys, &values, outs)).map_err(|e| InvalidPair::new_err(e.to_string()))
    }

    /// The inputs, per receiver one per value task (the encoder is empty afterwards).
    fn finish<'py>(&mut self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        let n = self.outs.len();
        std::mem::replace(&mut self.outs, vec![Vec::new(); n]).iter().map(|o| PyBytes::new(py, o)).collect()
    }
}

/// Arrow buffers of one output column: (validity or None, offsets or None, data).
type Buffers<'py> = (Option<Bound<'py, PyBytes>>, Option<Bound<'py, PyBytes>>, Bound<'py, PyBytes>);

/// `decode_groups(data, key_columns, tagged, value_kinds, aggs)`: a
/// receiver's result files (its value tasks' files, concatenated) as Arrow
/// buffers: `(rows, key buffers, agg buffers)`. `aggs`: [(value column,
/// "sum" | "count" | "min" | "max")]; each aggregate is 8 bytes a row:
/// int64, or float64 for `sum`/`min`/`max` of a float column; null where
/// the group had no non-null value (count: 0). Key columns keep their kind
/// (integers in their width, bytes with int32 offsets).
#[pyfunction]
pub(crate) fn decode_groups<'py>(
    py: Python<'py>,
    data: &[u8],
    key_columns: Vec<(String, bool)>,
    tagged: bool,
    value_kinds: Vec<String>,
    aggs: Vec<(usize, String)>,
) -> PyResult<(usize, Vec<Buffers<'py>>, Vec<Buffers<'py>>)> {
    let format = key_format(key_columns, tagged)?;
    let tasks = value_tasks(&value_kinds)?;
    // a column's aggregates are of its task's type (count(*) too: only its count is read)
    let types: Vec<ValueType> = tasks.of_column.iter().map(|&t| tasks.types[t]).collect();
    let values = types.len();
    let bad = |e: fanin_kv::columns::ColumnError| PyValueError::new_err(e.to_string());
    let groups = py.detach(|| group_results(data, &format, &types)).map_err(bad)?;
    let rows = groups.len();
    let bitmap = |valid: &dyn Fn(usize) -> bool| {
        let mut bits = vec![0u8; rows.div_ceil(8)];
        let mut all = true;
        for i in 0..rows {
            if valid(i) {
                bits[i / 8] |= 1 << (i % 8);
            } else {
                all = false;
            }
        }
        (!all).then(|| PyBytes::new(py, &bits))
    };
    let split = groups.iter().map(|(k, _)| format.split(k)).collect::<Result<Vec<_>, _>>().map_err(bad)?;
    let mut key_out = Vec::new();
    for (j, &(kind, _)) in format.columns.iter().enumerate() {
        let validity = bitmap(&|i| split[i][j] != Part::Null);
        match kind {
            Kind::Int(w) => {
                let mut out = Vec::with_capacity(rows * w);
                for parts in &split {
                    let v = if let Part::Int(v) = parts[j] { v } else { 0 };
                    out.extend_from_slice(&v.to_le_bytes()[..w]);
                }
                key_out.push((validity, None, PyBytes::new(py, &out)));
            }
            _ => {
                let mut offsets = Vec::with_capacity((rows + 1) * 4);
                let mut bytes = Vec::new();
                offsets.extend_from_slice(&0i32.to_le_bytes());
                for parts in &split {
                    if let Part::Bytes(b) = parts[j] {
                        bytes.extend_from_slice(b);
                    }
                    let end = i32::try_from(bytes.len())
                        .map_err(|_| PyValueError::new_err("group keys over 2 GiB in one result: use more receivers"))?;
                    offsets.extend_from_slice(&end.to_le_bytes());
                }
                key_out.push((validity, Some(PyBytes::new(py, &offsets)), PyBytes::new(py, &bytes)));
            }
        }
    }
    let mut agg_out = Vec::new();
    for (v, name) in &aggs {
        if *v >= values {
            return Err(PyValueError::new_err(format!("aggregate of value column {v}; there are {values}")));
        }
        let pick: fn(&fanin_proto::kv::Aggregate) -> i64 = match name.as_str() {
            "sum" => |a| a.sum,
            "count" => |a| a.count as i64,
            "min" => |a| a.min,
            "max" => |a| a.max,
            other => return Err(PyValueError::new_err(format!("aggregate {other:?}: use sum, count, min or max"))),
        };
        let is_count = name == "count";
        let validity = if is_count { None } else { bitmap(&|i| groups[i].1[*v].is_some()) };
        let mut out = Vec::with_capacity(rows * 8);
        for (_, aggs) in &groups {
            let x = aggs[*v].as_ref().map_or(0, pick);
            out.extend_from_slice(&x.to_le_bytes());
        }
        agg_out.push((validity, None, PyBytes::new(py, &out)));
    }
    Ok((rows, key_out, agg_out))
}
