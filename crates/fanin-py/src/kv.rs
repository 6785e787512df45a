//! `fanin.kv`: the key-value records encoded and decoded in Rust, and the
//! key-value host daemon.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};

use fanin_proto::kv::{as_float, float_bits, ValueType};

use crate::errors::{FaninError, InvalidPair};

fn value_type(name: &str) -> PyResult<ValueType> {
    ValueType::parse(name)
        .ok_or_else(|| PyValueError::new_err(format!("value_type {name:?}: use \"int64\" or \"float64\"")))
}

/// `fanin.kv.encode_tuples`: (key, int) pairs as `tuples` records
/// (`key_len u16 | value i64 | key`, little-endian). A key is a str (UTF-8)
/// or bytes-like; a value anything `int()` takes. In Rust because the
/// Python loop took 4.5 s for the 5.8 M pairs of a Spark partition.
/// With `value_type="float64"` a value is anything `float()` takes, sent
/// as its float64 bits (for a task created with that value type).
#[pyfunction]
#[pyo3(signature = (pairs, value_type = "int64"))]
pub(crate) fn encode_tuples<'py>(py: Python<'py>, pairs: &Bound<'py, PyAny>, value_type: &str) -> PyResult<Bound<'py, PyBytes>> {
    let vt = self::value_type(value_type)?;
    let mut out = Vec::new();
    for_each_pair(py, pairs, vt, |key, value, _| fanin_kv::records::push_tuple(&mut out, key, value))?;
    Ok(PyBytes::new(py, &out))
}

/// Key types seen by [`encode_tuples_partitioned`] (a bit mask).
const KEYS_STR: u8 = 1;
const KEYS_BYTES: u8 = 2;

/// `fanin.kv.encode_tuples_partitioned(pairs, partitions)`: the pairs as
/// `partitions` `tuples` inputs, a pair going to
/// `fanin_proto::kv::receiver_partition(key, partitions)` (the sender's side
/// of distributed receivers, `fanin.spark`); returns `(inputs, key_types)`,
/// `key_types` a mask of 1 (str keys seen) and 2 (bytes keys seen), so the
/// receivers can give keys back as they were sent. `value_type` as for
/// [`encode_tuples`].
#[pyfunction]
#[pyo3(signature = (pairs, partitions, value_type = "int64"))]
pub(crate) fn encode_tuples_partitioned<'py>(
    py: Python<'py>,
    pairs: &Bound<'py, PyAny>,
    partitions: u32,
    value_type: &str,
) -> PyResult<(Vec<Bound<'py, PyBytes>>, u8)> {
    if partitions == 0 {
        return Err(PyValueError::new_err("partitions must be at least 1"));
    }
    let vt = self::value_type(value_type)?;
    let mut outs = vec![Vec::new(); partitions as usize];
    let mut kinds = 0u8;
    for_each_pair(py, pairs, vt, |key, value, is_str| {
        kinds |= if is_str { KEYS_STR } else { KEYS_BYTES };
        let p = fanin_proto::kv::receiver_partition(key, partitions) as usize;
        fanin_kv::records::push_tuple(&mut outs[p], key, value)
    })?;
    Ok((outs.iter().map(|o| PyBytes::new(py, o)).collect(), kinds))
}

/// `fanin.kv.receiver_partition(key, partitions)`: the receiver a key
/// belongs to among `partitions` (`fanin_proto::kv::receiver_partition`;
/// str keys as UTF-8), so Spark can partition results as the senders did.
#[pyfunction]
pub(crate) fn receiver_partition(key: &Bound<'_, PyAny>, partitions: u32) -> PyResult<u32> {
    if partitions == 0 {
        return Err(PyValueError::new_err("partitions must be at least 1"));
    }
    let p = if let Ok(s) = key.cast::<PyString>() {
        fanin_proto::kv::receiver_partition(s.to_cow()?.as_bytes(), partitions)
    } else {
        fanin_proto::kv::receiver_partition(key.cast::<PyBytes>()?.as_bytes(), partitions)
    };
    Ok(p)
}

/// Call `push(key bytes, value bits, key_was_str)` for every (key, value)
/// pair of `pairs` (the one reading of Python pairs behind both encoders).
fn for_each_pair<'py>(
    py: Python<'py>,
    pairs: &Bound<'py, PyAny>,
    value_type: ValueType,
    mut push: impl FnMut(&[u8], i64, bool) -> Result<(), fanin_kv::records::KeyTooLong>,
) -> PyResult<()> {
    let builtins = py.import("builtins")?;
    let operator = py.import("operator")?;
    for item in pairs.try_iter()? {
        let item = item?;
        let (key, value): (Bound<'py, PyAny>, Bound<'py, PyAny>) = match item.extract() {
            Ok(pair) => pair,
            Err(_) => {
                let parts = item.try_iter()?.collect::<PyResult<Vec<_>>>()?;
                let [key, value]: [Bound<'py, PyAny>; 2] =
                    parts.try_into().map_err(|_| InvalidPair::new_err("expected (key, value) pairs"))?;
                (key, value)
            }
        };
        // float64: anything float() takes (an int too: a float task sums floats).
        if value_type == ValueType::Float64 {
            let v: f64 = value.extract().map_err(|_| {
                let shown = value.repr().map_or_else(|_| "?".to_string(), |r| r.to_string());
                InvalidPair::new_err(format!("value {shown} for key {key} is not a number (a float64 task)"))
            })?;
            let pushed = push_keyed(&builtins, &key, float_bits(v), &mut push)?;
            pushed.map_err(|e| InvalidPair::new_err(e.to_string()))?;
            continue;
        }
        // int64 values: an integer (anything with __index__: int, numpy
        // integers) in range, never a float cut to its integer part or a
        // big int wrapped.
        let value: i64 = match value.extract() {
            Ok(v) => v,
            Err(_) => {
                let refuse = |why: &str| {
                    let shown = value.repr().map_or_else(|_| "?".to_string(), |r| r.to_string());
                    InvalidPair::new_err(format!(
                        "value {shown} for key {key} {why} (an int64 task; value_type=\"float64\" sums floats)"
                    ))
                };
                let Ok(index) = operator.getattr("index")?.call1((&value,)) else {
                    return Err(refuse("is not an integer"));
                };
                index.extract().map_err(|_| refuse("does not fit in int64"))?
            }
        };
        let pushed = push_keyed(&builtins, &key, value, &mut push)?;
        pushed.map_err(|e| InvalidPair::new_err(e.to_string()))?;
    }
    Ok(())
}

/// `push` a key (str as UTF-8, bytes, or another bytes-like object: one
/// with the buffer protocol) with `value`. Anything else is refused, never
/// converted: `bytes(5)` is five zero bytes and `bytes((1, 2))` is
/// `b"\x01\x02"`, so an int or tuple key would come back as another key.
fn push_keyed<'py, E>(
    builtins: &Bound<'py, pyo3::types::PyModule>,
    key: &Bound<'py, PyAny>,
    value: i64,
    push: &mut impl FnMut(&[u8], i64, bool) -> Result<(), E>,
) -> PyResult<Result<(), E>> {
    Ok(if let Ok(s) = key.cast::<PyString>() {
        push(s.to_cow()?.as_bytes(), value, true)
    } else if let Ok(b) = key.cast::<PyBytes>() {
        push(b.as_bytes(), value, false)
    } else {
        let Ok(view) = builtins.getattr("memoryview")?.call1((key,)) else {
            let shown = key.repr().map_or_else(|_| "?".to_string(), |r| r.to_string());
            let type_name = key.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string());
            return Err(InvalidPair::new_err(format!(
                "key {shown} is {type_name}; keys are str or bytes (convert them first, e.g. str(key))"
            )));
        };
        let b = builtins.getattr("bytes")?.call1((view,))?;
        push(b.cast::<PyBytes>()?.as_bytes(), value, false)
    })
}

/// `fanin.kv.decode_results`: a result file (`key_len u16 | sum | count |
/// min | max | [key_len u32] | key` records) as {key: sum}, keys bytes or
/// str. In Rust because the Python loop over 10^5 records was most of the
/// time a word count's `wait` took after the task had finished.
///
/// `errors` for str keys: "strict" raises UnicodeDecodeError at the first
/// key that is not UTF-8; "surrogateescape" decodes every key losslessly
/// (the bytes come back with `key.encode("utf-8", "surrogateescape")`).
/// Lossy handlers ("replace", "ignore", ...) are refused: they can map two
/// keys to one str and lose a count.
///
/// `value_type` (the wait reply's): sums are int, or float for "float64".
#[pyfunction]
#[pyo3(signature = (data, as_str = true, errors = "strict", value_type = "int64"))]
pub(crate) fn decode_results<'py>(
    py: Python<'py>,
    data: &[u8],
    as_str: bool,
    errors: &str,
    value_type: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let is_float = self::value_type(value_type)? == ValueType::Float64;
    if !matches!(errors, "strict" | "surrogateescape") {
        return Err(PyValueError::new_err(format!(
            "errors={errors:?} could map two different keys to one str and lose a count; use \"strict\", \
             \"surrogateescape\" (lossless) or bytes keys"
        )));
    }
    let out = PyDict::new(py);
    for record in fanin_kv::records::read_results(data) {
        let (key, agg) = record.map_err(|e| PyValueError::new_err(e.to_string()))?;
        let sum = if is_float { as_float(agg.sum).into_pyobject(py)?.into_any() } else { agg.sum.into_pyobject(py)?.into_any() };
        if !as_str {
            out.set_item(PyBytes::new(py, key), sum)?;
            continue;
        }
        match std::str::from_utf8(key) {
            Ok(text) => out.set_item(PyString::new(py, text), sum)?,
            Err(e) if errors == "strict" => {
                return Err(match pyo3::exceptions::PyUnicodeDecodeError::new_utf8(py, key, e) {
                    Ok(exc) => PyErr::from_value(exc.into_any()),
                    Err(err) => err,
                })
            }
            // the rare key that is not UTF-8: Python's own codec
            Err(_) => out.set_item(PyBytes::new(py, key).call_method1("decode", ("utf-8", errors))?, sum)?,
        }
    }
    Ok(out)
}

/// Run the key-value host daemon in the foreground until SIGINT or SIGTERM
/// (`fanin kv daemon`). `on_ready(info: dict)` is called once it listens.
#[pyfunction]
#[pyo3(signature = (config_json, on_ready=None))]
pub(crate) fn run_kv_daemon(py: Python<'_>, config_json: &str, on_ready: Option<Bound<'_, PyAny>>) -> PyResult<()> {
    let config: fanin_kv::KvDaemonConfig =
        serde_json::from_str(config_json).map_err(|e| PyValueError::new_err(format!("invalid kv daemon config: {e}")))?;
    let daemon = py.detach(|| fanin_kv::KvDaemon::start(config)).map_err(|e| FaninError::new_err(e.to_string()))?;
    let flag = daemon.shutdown_flag();
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, flag.clone())
            .map_err(|e| FaninError::new_err(format!("cannot install signal handler: {e}")))?;
    }
    if let Some(cb) = on_ready {
        let d = PyDict::new(py);
        d.set_item("control_addr", daemon.control_addr().to_string())?;
        d.set_item("socket_path", daemon.socket_path().display().to_string())?;
        d.set_item("data_addrs", daemon.stats_json()["data_addrs"].to_string())?;
        cb.call1((d,))?;
    }
    py.detach(|| daemon.wait());
    Ok(())
}
