//! The switch: its config files, a switch embedded in this process
//! (`Switch`), the foreground daemon (`fanin switch`) and job defaults.

use std::sync::atomic::Ordering;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use fanin_switch::{DaemonConfig, SwitchHandle};

use crate::errors::{FaninError, FaninRefused};

/// Read and validate a TOML or JSON daemon config file; returns it as JSON
/// with every default filled in. Errors name the offending field.
#[pyfunction]
pub(crate) fn load_config(path: &str) -> PyResult<String> {
    let config = DaemonConfig::from_file(path).map_err(|e| PyValueError::new_err(e.to_string()))?;
    serde_json::to_string(&config).map_err(|e| FaninError::new_err(e.to_string()))
}

fn parse_config(config_json: &str) -> PyResult<DaemonConfig> {
    DaemonConfig::from_json_str(config_json).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// A switch running inside this process on its own threads (embedded default,
/// tests). `fanin switch` runs the same code in the foreground.
#[pyclass(module = "fanin._native")]
pub(crate) struct Switch {
    handle: Option<SwitchHandle>,
}

impl Switch {
    fn handle(&self) -> PyResult<&SwitchHandle> {
        self.handle.as_ref().ok_or_else(|| FaninError::new_err("the switch was stopped"))
    }
}

#[pymethods]
impl Switch {
    #[new]
    fn new(py: Python<'_>, config_json: &str) -> PyResult<Self> {
        let config = parse_config(config_json)?;
        let handle = py.detach(|| SwitchHandle::start(config)).map_err(|e| FaninError::new_err(e.to_string()))?;
        Ok(Self { handle: Some(handle) })
    }

    #[getter]
    fn data_addr(&self) -> PyResult<String> {
        Ok(self.handle()?.data_addr().to_string())
    }

    #[getter]
    fn metrics_addr(&self) -> PyResult<Option<String>> {
        Ok(self.handle()?.metrics_addr().map(|a| a.to_string()))
    }

    /// Admit a job: a JSON object with the fields of a config-file job.
    fn admit_job(&self, py: Python<'_>, job_json: &str) -> PyResult<()> {
        let job: fanin_switch::JobConfig =
            serde_json::from_str(job_json).map_err(|e| PyValueError::new_err(format!("invalid job: {e}")))?;
        let spec = job.to_spec().map_err(|m| PyValueError::new_err(format!("invalid job: {m}")))?;
        let core = self.handle()?.core().clone();
        py.detach(|| core.admit_job(fanin_switch::JobEntry { spec, tree: None })).map_err(|e| FaninRefused::new_err(e.to_string()))
    }

    fn remove_job(&self, py: Python<'_>, job_id: u32) -> PyResult<()> {
        let core = self.handle()?.core().clone();
        py.detach(|| core.remove_job(job_id)).map_err(FaninError::new_err)
    }

    /// Counters summed over shards, as {name: value} (malformed by reason as
    /// "malformed.<reason>").
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.handle()?.core().counters();
        let d = PyDict::new(py);
        let mut err = None;
        c.visit(|name, reason, v| {
            let key = match reason {
                Some(r) => format!("{name}.{r}"),
                None => name.to_string(),
            };
            if let Err(e) = d.set_item(key, v) {
                err = Some(e);
            }
        });
        if let Some(e) = err {
            return Err(e);
        }
        d.set_item("malformed", c.malformed_total())?;
        Ok(d)
    }

    fn metrics_text(&self) -> PyResult<String> {
        Ok(self.handle()?.core().render_metrics())
    }

    /// Stop the switch and join its threads.
    fn stop(&mut self, py: Python<'_>) {
        if let Some(h) = self.handle.take() {
            py.detach(|| h.shutdown());
        }
    }
}

/// Run a switch in the foreground until SIGINT or SIGTERM (the `fanin switch`
/// command). `on_ready(info: dict)` is called once the ports are bound.
#[pyfunction]
#[pyo3(signature = (config_json, on_ready=None))]
pub(crate) fn run_switch(py: Python<'_>, config_json: &str, on_ready: Option<Bound<'_, PyAny>>) -> PyResult<()> {
    let config = parse_config(config_json)?;
    let handle = py.detach(|| SwitchHandle::start(config)).map_err(|e| FaninError::new_err(e.to_string()))?;
    let flag = handle.shutdown_flag();
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, flag.clone())
            .map_err(|e| FaninError::new_err(format!("cannot install signal handler: {e}")))?;
    }
    if let Some(cb) = on_ready {
        let info = handle.core().info();
        let d = PyDict::new(py);
        d.set_item("data_addr", info.data_addr.to_string())?;
        d.set_item("shards", info.shard_count)?;
        d.set_item("incarnation", info.incarnation)?;
        d.set_item("data_mtu", handle.core().data_mtu())?;
        let max = handle.core().packet_elems_max();
        d.set_item("packet_elems_max", (max != u32::MAX).then_some(max))?;
        d.set_item("metrics_addr", handle.metrics_addr().map(|a| a.to_string()))?;
        d.set_item("control_addr", handle.control_addr().map(|a| a.to_string()))?;
        cb.call1((d,))?;
    }
    py.detach(|| handle.wait());
    let _ = flag.load(Ordering::SeqCst);
    Ok(())
}

/// A job as the config file describes it: every field of
/// `fanin_switch::JobConfig` with its default (null where unset means
/// "none"), read from the Rust type itself, so a field added there shows up
/// here and the Python layers' agreement test fails until they take it.
/// `job_id` is required; its value here is a placeholder.
#[pyfunction]
pub(crate) fn job_schema(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let job: fanin_switch::JobConfig =
        serde_json::from_str(r#"{"job_id": 0}"#).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let text = serde_json::to_string(&job).map_err(|e| PyValueError::new_err(e.to_string()))?;
    py.import("json")?.call_method1("loads", (text,))
}

/// The defaults of a job's sizing fields (a subset of [`job_schema`]), by
/// the names `fanin.switch.job_config` uses.
#[pyfunction]
pub(crate) fn job_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let schema = job_schema(py)?;
    let d = PyDict::new(py);
    for name in ["block_cnt_max", "block_grad_max", "block_exp_ms", "slow_after_windows"] {
        d.set_item(name, schema.get_item(name)?)?;
    }
    Ok(d)
}
