//! Keyed jobs (docs/security.md): member keys and sealing, for tests and
//! tools that speak the wire protocol from Python.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The member key of source `src_id` in job `job_id` under `job_key` (16
/// bytes each): the one derivation the switch, the controller and workers
/// share (docs/security.md).
#[pyfunction]
pub(crate) fn derive_member_key<'py>(
    py: Python<'py>,
    job_key: &[u8],
    job_id: u32,
    src_id: u16,
) -> PyResult<Bound<'py, PyBytes>> {
    let key = fanin_proto::auth::Key::from_slice(job_key).map_err(|e| PyValueError::new_err(format!("job_key: {e}")))?;
    Ok(PyBytes::new(py, &fanin_proto::auth::derive_member_key(&key, job_id, src_id).0))
}

/// Seal an unsealed fanin datagram with `key` and sequence number `seq`
/// (for tests and tools that speak the wire protocol from Python).
#[pyfunction]
pub(crate) fn seal_datagram<'py>(py: Python<'py>, key: &[u8], seq: u64, datagram: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let key = fanin_proto::auth::Key::from_slice(key).map_err(|e| PyValueError::new_err(format!("key: {e}")))?;
    let mut buf = datagram.to_vec();
    buf.resize(datagram.len() + fanin_wire::auth::TRAILER_LEN, 0);
    fanin_wire::auth::seal(&key, seq, &mut buf).map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(PyBytes::new(py, &buf))
}
