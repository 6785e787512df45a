//! Python bindings: `fanin._native`. The Python package `fanin` wraps these
//! in its public API; nothing here makes protocol decisions.

use pyo3::prelude::*;

mod auth;
mod columns;
mod errors;
mod kv;
mod session;
mod switch;

use auth::{derive_member_key, seal_datagram};
use columns::{decode_groups, GroupEncoder};
use errors::{FaninError, FaninRefused, FaninTimeout, InputOutOfRange, MemberFailed, MemberRestarted, StaleResult, SwitchGone};
use kv::{decode_results, encode_tuples, encode_tuples_partitioned, receiver_partition, run_kv_daemon};
use session::{session_defaults, Session};
use switch::{job_defaults, job_schema, load_config, run_switch, Switch};

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Session>()?;
    m.add_function(wrap_pyfunction!(session_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(job_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(job_schema, m)?)?;
    m.add_class::<Switch>()?;
    m.add_function(wrap_pyfunction!(run_switch, m)?)?;
    m.add_function(wrap_pyfunction!(run_kv_daemon, m)?)?;
    m.add_function(wrap_pyfunction!(load_config, m)?)?;
    m.add_function(wrap_pyfunction!(encode_tuples, m)?)?;
    m.add_function(wrap_pyfunction!(encode_tuples_partitioned, m)?)?;
    m.add_function(wrap_pyfunction!(receiver_partition, m)?)?;
    m.add_function(wrap_pyfunction!(decode_results, m)?)?;
    m.add_class::<GroupEncoder>()?;
    m.add_function(wrap_pyfunction!(decode_groups, m)?)?;
    m.add_function(wrap_pyfunction!(derive_member_key, m)?)?;
    m.add_function(wrap_pyfunction!(seal_datagram, m)?)?;
    m.add("FaninError", m.py().get_type::<FaninError>())?;
    m.add("FaninTimeout", m.py().get_type::<FaninTimeout>())?;
    m.add("FaninRefused", m.py().get_type::<FaninRefused>())?;
    m.add("InputOutOfRange", m.py().get_type::<InputOutOfRange>())?;
    m.add("MemberFailed", m.py().get_type::<MemberFailed>())?;
    m.add("MemberRestarted", m.py().get_type::<MemberRestarted>())?;
    m.add("SwitchGone", m.py().get_type::<SwitchGone>())?;
    m.add("StaleResult", m.py().get_type::<StaleResult>())?;
    m.add("InvalidPair", m.py().get_type::<errors::InvalidPair>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // most send lanes a Session takes (fanin_host::MAX_LANES)
    m.add("MAX_LANES", fanin_host::MAX_LANES)?;
    Ok(())
}
