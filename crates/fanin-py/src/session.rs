//! `fanin._native.Session`: a worker's allreduce session, numpy arrays in
//! and out (staged, or lent to the protocol machine without a copy).

use std::net::SocketAddr;
use std::time::Duration;

use numpy::{
    Element, PyArray1, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use fanin_host::{Session as HostSession, SessionOptions};
use fanin_proto::bfp::half::Half;
use fanin_proto::bfp::OutOfRange;
use fanin_proto::host::{Outcome, Prepared, Tensor, TensorMut, TensorRef};

use crate::errors::{host_err, out_of_range_err, python_interrupt};

/// A switch's data address as HOST:PORT, HOST a name or an address
/// (`localhost:9000`, `switch0.lab:9000`, `10.0.0.1:9000`): names are
/// resolved here, once, preferring IPv4 (the data plane's sockets are IPv4).
fn resolve_switch(switch: &str) -> PyResult<SocketAddr> {
    use std::net::ToSocketAddrs;
    let bad = |why: String| PyValueError::new_err(format!("switch address {switch:?} {why}"));
    if let Ok(addr) = switch.parse::<SocketAddr>() {
        return Ok(addr);
    }
    if !switch.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok()) {
        return Err(bad("is not HOST:PORT (e.g. 127.0.0.1:9000 or localhost:9000)".into()));
    }
    let addrs: Vec<SocketAddr> =
        switch.to_socket_addrs().map_err(|e| bad(format!("does not resolve: {e}")))?.collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| bad("resolves to no address".into()))
}

/// [`resolve_switch`], refusing port 0: a socket binds port 0 to take any
/// free port, but nothing can be sent to it ("socket error: Invalid
/// argument (os error 22)" was all a caller learnt).
fn switch_addr(switch: &str) -> PyResult<SocketAddr> {
    let addr = resolve_switch(switch)?;
    if addr.port() == 0 {
        return Err(PyValueError::new_err(format!(
            "switch address {switch:?}: port 0 is not a switch's address (a switch started on port 0 takes a free \
             port: give the one it reports, its data port, e.g. 127.0.0.1:9000)"
        )));
    }
    Ok(addr)
}

/// How a range reads in messages: `(0 to 2**32-1)`, `(0 to 65535; 0 = any)`.
fn range_text(lo: i128, hi: i128, note: &str) -> String {
    let bound = match hi {
        h if h == u32::MAX as i128 => "2**32-1".to_string(),
        h if h == u64::MAX as i128 => "2**64-1".to_string(),
        h => h.to_string(),
    };
    format!("({lo} to {bound}{}{note})", if note.is_empty() { "" } else { "; " })
}

/// An integer argument within `lo..=hi`, or a ValueError naming it, its
/// value and the range: Python's ints are unbounded, and a value outside
/// the Rust type used to raise `OverflowError: out of range integral type
/// conversion attempted`, naming nothing.
fn ranged<T: TryFrom<i128>>(name: &str, v: i128, lo: i128, hi: i128, note: &str) -> PyResult<T> {
    match T::try_from(v) {
        Ok(t) if (lo..=hi).contains(&v) => Ok(t),
        _ => Err(PyValueError::new_err(format!("{name} = {v} is out of range {}", range_text(lo, hi, note)))),
    }
}

/// A duration argument given in `unit` (`"ms"` or `"s"`), checked and
/// reported in that unit, not in the seconds it is converted to (`rto_ms=-5`
/// said "got -0.005").
fn duration_arg(name: &str, v: f64, unit: &str) -> PyResult<Duration> {
    let (word, per_second) = if unit == "ms" { ("milliseconds", 1e3) } else { ("seconds", 1.0) };
    if !(v.is_finite() && v > 0.0) {
        // as Python writes them (Rust: NaN, inf)
        let shown = if v.is_nan() { "nan".to_string() } else { v.to_string() };
        return Err(PyValueError::new_err(format!("{name} must be a positive number of {word}, got {shown}")));
    }
    Duration::try_from_secs_f64(v / per_second)
        .map_err(|_| PyValueError::new_err(format!("{name} = {v:e} is too long (in {word})")))
}

/// A worker's session with a fanin switch for one job (see `fanin.Session`).
#[pyclass(module = "fanin._native", unsendable)]
pub(crate) struct Session {
    inner: HostSession,
    last: Option<Outcome>,
    /// Input staging kept between `allreduce(..., out=...)` calls whose
    /// input cannot be lent (it shares memory with `out`, or is not
    /// C-contiguous).
    staging_f32: Vec<f32>,
    staging_i32: Vec<i32>,
}

#[pymethods]
impl Session {
    /// The most elements one packet (one UDP datagram) carries: the top of
    /// `elems_per_packet`'s range.
    #[classattr]
    const MAX_ELEMS_PER_PACKET: usize = fanin_wire::value::MAX_GRAD_CNT;

    #[new]
    // The session's tunables default to None = SessionConfig's value: the
    // Rust config is the one place defaults live (`session_defaults()` shows
    // them to Python, whose `fanin.Session` signature is built from it).
    #[pyo3(signature = (switch, job_id, rank, elems_per_packet=None, window=None, send_drop=0.0, seed=0,
                        rto_ms=None, rto_min_ms=None, rto_max_ms=None, join_timeout_s=None, dead_after_s=None, offload=true,
                        recv_drop=0.0, sync_join=false, align_blocks=0, recv_duplicate=0.0, recv_reorder=0.0, auth_key=None, result_group=None,
                        barrier_timeout_s=None, members=0, lanes=1, switch_gone_after_s=None, ecn=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        switch: &str,
        job_id: i128,
        rank: i128,
        elems_per_packet: Option<i128>,
        window: Option<i128>,
        send_drop: f64,
        seed: i128,
        rto_ms: Option<f64>,
        rto_min_ms: Option<f64>,
        rto_max_ms: Option<f64>,
        join_timeout_s: Option<f64>,
        dead_after_s: Option<f64>,
        offload: bool,
        recv_drop: f64,
        sync_join: bool,
        align_blocks: i128,
        recv_duplicate: f64,
        recv_reorder: f64,
        auth_key: Option<Vec<u8>>,
        result_group: Option<&str>,
        barrier_timeout_s: Option<f64>,
        members: i128,
        lanes: i128,
        switch_gone_after_s: Option<f64>,
        ecn: bool,
    ) -> PyResult<Self> {
        // every integer checked against its type here, by name (Python ints are unbounded)
        let (u16_max, u32_max) = (u16::MAX as i128, u32::MAX as i128);
        let job_id: u32 = ranged("job_id", job_id, 0, u32_max, "")?;
        let rank: u16 = ranged("rank", rank, 0, u16_max, "")?;
        let most = fanin_wire::value::MAX_GRAD_CNT.min(u16::MAX as usize) as i128;
        let elems_per_packet: Option<u16> =
            elems_per_packet.map(|v| ranged("elems_per_packet", v, 0, most, "0 = the job's")).transpose()?;
        let window: Option<u32> = window.map(|v| ranged("window", v, 1, u32_max, "blocks in flight")).transpose()?;
        let seed: u64 = ranged("seed", seed, 0, u64::MAX as i128, "")?;
        let align_blocks: u32 = ranged("align_blocks", align_blocks, 0, u32_max, "")?;
        let members: u16 = ranged("members", members, 0, u16_max, "0 = any")?;
        // (0 and too many: fanin_host says "lanes 0 is not 1 to 16")
        let lanes: usize = if lanes < 0 {
            ranged("lanes", lanes, 1, fanin_host::MAX_LANES as i128, "")?
        } else {
            usize::try_from(lanes).unwrap_or(usize::MAX)
        };
        let addr = switch_addr(switch)?;
        let mut o = SessionOptions::new(addr, job_id, rank);
        let c = &mut o.session;
        c.elems_per_packet = elems_per_packet.unwrap_or(c.elems_per_packet);
        c.window = window.unwrap_or(c.window);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let (rto_ms, rto_min_ms, rto_max_ms) = (
            rto_ms.unwrap_or(ms(c.rto_initial)),
            rto_min_ms.unwrap_or(ms(c.rto_min)),
            rto_max_ms.unwrap_or(ms(c.rto_max)),
        );
        c.rto_initial = duration_arg("rto_ms", rto_ms, "ms")?;
        c.rto_min = duration_arg("rto_min_ms", rto_min_ms, "ms")?;
        c.rto_max = duration_arg("rto_max_ms", rto_max_ms, "ms")?;
        if rto_min_ms > rto_max_ms {
            return Err(PyValueError::new_err(format!(
                "rto_min_ms = {rto_min_ms} must be at most rto_max_ms = {rto_max_ms}"
            )));
        }
        let secs = |name: &str, v: Option<f64>, default: Duration| duration_arg(name, v.unwrap_or(default.as_secs_f64()), "s");
        c.join_timeout = secs("join_timeout_s", join_timeout_s, c.join_timeout)?;
        c.dead_after = secs("dead_after_s", dead_after_s, c.dead_after)?;
        c.barrier_timeout = secs("barrier_timeout_s", barrier_timeout_s, c.barrier_timeout)?;
        c.switch_gone_after = match switch_gone_after_s {
            None => c.switch_gone_after,
            Some(0.0) => Duration::ZERO,
            Some(v) if v.is_finite() && v > 0.0 => duration_arg("switch_gone_after_s", v, "s")?,
            Some(v) => return Err(PyValueError::new_err(format!("switch_gone_after_s must be 0 or more, got {v}"))),
        };
        o.session.expected_members = members;
        o.send_drop = send_drop;
        o.recv_drop = recv_drop;
        o.recv_duplicate = recv_duplicate;
        o.recv_reorder = recv_reorder;
        o.session.sync_join = sync_join;
        o.session.align_blocks = align_blocks;
        o.session.auth_key = auth_key
            .map(|k| fanin_proto::auth::Key::from_slice(&k))
            .transpose()
            .map_err(|e| PyValueError::new_err(format!("auth_key: {e} (the member key the controller issued)")))?;
        o.seed = seed;
        o.offload = offload;
        o.lanes = lanes;
        o.ecn = ecn;
        o.result_group = result_group
            .map(|g| {
                g.parse().map_err(|_| {
                    PyValueError::new_err(format!("result_group {g:?} is not IPV4:PORT (e.g. 239.1.0.7:47001)"))
                })
            })
            .transpose()?;
        let inner = py.detach(|| HostSession::connect_interruptible(o, Some(python_interrupt()))).map_err(host_err)?;
        Ok(Self { inner, last: None, staging_f32: Vec::new(), staging_i32: Vec::new() })
    }

    /// Sum `array` (int32 or float32, any shape) over every member of the job.
    /// Returns a new array of the same shape and dtype, or, with `out`, writes
    /// the sum into `out` (a writable C-contiguous array of the same shape
    /// and dtype; it may be `array` itself) and returns it: the sum is
    /// written into `out` directly, without the GIL, as numpy's own `out=`
    /// does, and `array`, unless it shares memory with `out`, is read in
    /// place rather than copied, so no other thread may use `out`, nor
    /// write `array`, until the call returns (if the call fails, `out`
    /// holds a partial result). With `average`,
    /// each block is divided by the number of sources its result summed
    /// (`src_cnt`; fewer than the job size for a partial result). The GIL is
    /// released while communicating.
    ///
    /// `keep=(start, stop)`: a reduce-scatter. Only the elements
    /// `start..stop` of the flattened result are the sum; the rest are left
    /// as they were (the input's, in place; unspecified in a new array),
    /// and the switch sends this member a header instead of the sum of
    /// every block outside the range.
    #[pyo3(signature = (array, average=false, out=None, keep=None))]
    fn allreduce<'py>(
        &mut self,
        py: Python<'py>,
        array: &Bound<'py, PyAny>,
        average: bool,
        out: Option<&Bound<'py, PyAny>>,
        keep: Option<(usize, usize)>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.keeping(keep, |s| s.allreduce_any(py, array, average, out))
    }

    /// Sum a 16-bit float array given as its bits (`bits`: uint16, any
    /// shape) over every member: `format` "float16" or "bfloat16". It
    /// travels as 2 bytes per element each way (docs/protocol.md §5.6).
    /// Returns a new uint16 array of the result's bits, or writes them into
    /// `out` (uint16, the input's shape, C-contiguous; may be `bits`
    /// itself) and returns it, as `allreduce` does; `average` as there,
    /// each element divided and rounded once; `keep` as there.
    #[pyo3(signature = (bits, format, average=false, out=None, keep=None))]
    fn allreduce_half<'py>(
        &mut self,
        py: Python<'py>,
        bits: &Bound<'py, PyAny>,
        format: &str,
        average: bool,
        out: Option<&Bound<'py, PyAny>>,
        keep: Option<(usize, usize)>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.keeping(keep, |s| s.allreduce_half_any(py, bits, format, average, out))
    }

    /// Statistics of the last allreduce: retransmissions, trimmed (Trimmed
    /// nacks that made this worker resend a block), blocks, gen_id,
    /// degraded_blocks [(block index, src_cnt)], min_src_cnt, missed_blocks,
    /// latency_mean_ms / latency_max_ms (first send of a block to its
    /// result), slow_sources (sources the switch declared permanently slow)
    /// and recoveries (switch restarts recovered from, docs/restart.md);
    /// marked_results (results the switch marked congested) and ecn_ce
    /// (results that arrived CE-marked, docs/congestion.md "ECN").
    fn last_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(o) = &self.last else { return Ok(None) };
        let d = PyDict::new(py);
        d.set_item("retransmissions", o.retransmissions)?;
        d.set_item("trimmed", o.trimmed)?;
        d.set_item("fast_retransmits", o.fast_retransmits)?;
        d.set_item("timeouts", o.timeouts)?;
        d.set_item("marked_results", o.marked_results)?;
        d.set_item("ecn_ce", o.ecn_ce)?;
        d.set_item("window", o.window)?;
        d.set_item("blocks", o.blocks)?;
        d.set_item("gen_id", o.gen_id)?;
        d.set_item("degraded_blocks", o.degraded_blocks.clone())?;
        d.set_item("min_src_cnt", o.min_src_cnt)?;
        d.set_item("missed_blocks", o.missed_blocks)?;
        d.set_item("recoveries", o.recoveries)?;
        d.set_item("latency_mean_ms", o.latency_mean.as_secs_f64() * 1e3)?;
        d.set_item("latency_max_ms", o.latency_max.as_secs_f64() * 1e3)?;
        d.set_item("slow_sources", self.inner.slow_sources().to_vec())?;
        Ok(Some(d))
    }

    /// Number of sources (members) in the job.
    #[getter]
    fn n_sources(&self) -> u16 {
        self.inner.n_sources()
    }

    /// Elements per packet this session sends.
    #[getter]
    fn elems_per_packet(&self) -> u16 {
        self.inner.elems_per_packet()
    }

    /// Elements per packet of a float16/bfloat16 allreduce (int16 lanes:
    /// twice `elems_per_packet` within the job's block_grad_max when the
    /// packet size is the job's).
    #[getter]
    fn half_elems_per_packet(&self) -> u16 {
        self.inner.half_elems_per_packet()
    }

    /// The job parameters the switch announced when this worker joined.
    #[getter]
    fn params<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let p = self.inner.params();
        let d = PyDict::new(py);
        d.set_item("block_cnt_max", p.block_cnt_max)?;
        d.set_item("block_grad_max", p.block_grad_max)?;
        d.set_item("packet_elems", p.packet_elems)?;
        d.set_item("block_exp_ms", p.block_exp_ms)?;
        d.set_item("incarnation", p.incarnation)?;
        d.set_item("shard_count", p.shard_count)?;
        d.set_item("next_block", p.next_block)?;
        d.set_item("results_on_group", p.results_on_group)?;
        Ok(d)
    }

    /// Keep taking part in the job with no allreduce running until the
    /// switch says every member is done, for at most `seconds`, or until
    /// `until()` returns true (called every 20 ms with the GIL; the GIL is
    /// released otherwise). A member that finished its last allreduce
    /// holds contributions the others need if the switch restarts before
    /// they finish theirs (docs/restart.md, "Idle members"); lingering, it
    /// probes the switch every 200 ms, saying it is done, and takes part in
    /// such a recovery. Returns `{"probes", "idle_recoveries", "all_done"}`
    /// (the first two over the session's life; `all_done`: the switch said
    /// every member is done). Raises if the session failed meanwhile (the
    /// results this member already has are not touched), or what `until`
    /// raised.
    #[pyo3(signature = (seconds, until=None))]
    fn linger<'py>(&mut self, py: Python<'py>, seconds: f64, until: Option<Py<PyAny>>) -> PyResult<Bound<'py, PyDict>> {
        if !(seconds.is_finite() && seconds >= 0.0) {
            return Err(PyValueError::new_err(format!("seconds must be 0 or more, got {seconds}")));
        }
        let mut raised: Option<PyErr> = None;
        let end = py
            .detach(|| {
                self.inner.linger(Duration::from_secs_f64(seconds), || {
                    let Some(until) = until.as_ref() else { return false };
                    Python::attach(|py| match until.call0(py).and_then(|v| v.bind(py).is_truthy()) {
                        Ok(done) => done,
                        Err(e) => {
                            raised = Some(e);
                            true
                        }
                    })
                })
            })
            .map_err(host_err)?;
        if let Some(e) = raised {
            return Err(e);
        }
        let d = PyDict::new(py);
        d.set_item("probes", end.stats.probes)?;
        d.set_item("idle_recoveries", end.stats.idle_recoveries)?;
        d.set_item("all_done", end.all_done)?;
        Ok(d)
    }

    /// The error that ended this session (its message), or None while it
    /// can still be used.
    #[getter]
    fn error(&self) -> Option<String> {
        self.inner.error().map(|e| e.to_string())
    }

    /// Datagram counters of this session.
    fn socket_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("datagrams_sent", s.datagrams_sent)?;
        d.set_item("datagrams_received", s.datagrams_received)?;
        d.set_item("bytes_sent", s.bytes_sent)?;
        d.set_item("bytes_received", s.bytes_received)?;
        d.set_item("dropped_by_fault_injection", s.dropped_by_fault_injection)?;
        d.set_item("duplicated_by_fault_injection", s.duplicated_by_fault_injection)?;
        d.set_item("reordered_by_fault_injection", s.reordered_by_fault_injection)?;
        d.set_item("datagrams_from_group", s.datagrams_from_group)?;
        d.set_item("port_unreachable", s.port_unreachable)?;
        d.set_item("other_icmp_errors", s.other_icmp_errors)?;
        d.set_item("lanes", self.inner.lanes())?;
        d.set_item("sent_by_lane", s.sent_by_lane.clone())?;
        d.set_item("received_by_lane", s.received_by_lane.clone())?;
        let a = self.inner.auth_stats();
        d.set_item("auth_bad_tag", a.bad_tag)?;
        d.set_item("auth_replayed", a.replayed)?;
        d.set_item("auth_unsealed", a.unsealed)?;
        d.set_item("auth_before_result_key", a.before_result_key)?;
        d.set_item("auth_result_key_probes", a.result_key_probes)?;
        d.set_item("auth_result_key_changes", a.result_key_changes)?;
        Ok(d)
    }
}

/// `array` copied into `buf` (reusing its memory) in C order: one memcpy for
/// a C-contiguous array, an element gather for any other layout.
fn stage<T: Element + Copy>(array: &PyReadonlyArrayDyn<'_, T>, mut buf: Vec<T>) -> Vec<T> {
    buf.clear();
    match array.as_slice() {
        Ok(s) if array.is_c_contiguous() => buf.extend_from_slice(s),
        _ => buf.extend(array.as_array().iter().copied()),
    }
    buf
}

/// `array`'s elements, if the session may read them in place while the sum
/// is written to an `out` starting at `out_start`: C-contiguous, and no byte
/// shared with `out` (which has the input's shape and is C-contiguous, so
/// it spans as many bytes).
fn lendable<'a, T: Element>(array: &'a PyReadonlyArrayDyn<'_, T>, out_start: usize) -> Option<&'a [T]> {
    let s = array.as_slice().ok().filter(|_| array.is_c_contiguous())?;
    let (start, bytes) = (s.as_ptr() as usize, std::mem::size_of_val(s));
    let shared = start < out_start + bytes && out_start < start + bytes;
    (!shared).then_some(s)
}

/// Whether `out` can take the sum of `array`: same dtype and shape,
/// C-contiguous and writable (numpy's own flag and nobody else borrowing it).
fn check_out<T: Element>(array: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<()> {
    let Ok(o) = out.cast::<PyArrayDyn<T>>() else {
        let dtype = out.getattr("dtype").map(|d| d.to_string()).unwrap_or_else(|_| "not a numpy array".into());
        let want = array.getattr("dtype").map(|d| d.to_string()).unwrap_or_default();
        return Err(PyTypeError::new_err(format!("out must be a numpy array of the input's dtype {want} (got {dtype})")));
    };
    let want = array.cast::<PyUntypedArray>()?.shape().to_vec();
    if o.shape() != want.as_slice() {
        return Err(PyValueError::new_err(format!("out has shape {:?}, the input {:?}: they must match", o.shape(), want)));
    }
    if !o.is_c_contiguous() {
        return Err(PyValueError::new_err("out must be C-contiguous (e.g. np.empty_like(a, order='C'))"));
    }
    o.try_readwrite().map(drop).map_err(|e| PyValueError::new_err(format!("out is not writable: {e}")))
}

impl Session {
    /// An input refused before anything of it was sent: the session takes
    /// no more allreduces (the Rust session keeps that rule, protocol.md
    /// §5.1), and the call raises `InputOutOfRange`.
    fn refuse(&mut self, e: fanin_proto::bfp::OutOfRange) -> PyErr {
        drop(self.inner.refuse_input(e));
        out_of_range_err(e)
    }

    /// Run `call` with `keep` as the range of its allreduce (a
    /// reduce-scatter); a range the call did not use (it was refused before
    /// it began one) ends with it all the same.
    fn keeping<'py>(
        &mut self,
        keep: Option<(usize, usize)>,
        call: impl FnOnce(&mut Self) -> PyResult<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let Some((start, stop)) = keep {
            self.inner.keep_only(start..stop);
        }
        let result = call(self);
        self.inner.keep_all();
        result
    }

    fn allreduce_any<'py>(
        &mut self,
        py: Python<'py>,
        array: &Bound<'py, PyAny>,
        average: bool,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let is_f32 = if array.cast::<PyArrayDyn<f32>>().is_ok() {
            true
        } else if array.cast::<PyArrayDyn<i32>>().is_ok() {
            false
        } else {
            let dtype = array.getattr("dtype").map(|d| d.to_string()).unwrap_or_else(|_| "not an array".into());
            return Err(PyTypeError::new_err(format!(
                "fanin allreduce takes a numpy array of int32, float32 or float16 (got {dtype}); convert it first, e.g. a.astype(np.float32)"
            )));
        };
        if average && !is_f32 {
            return Err(PyTypeError::new_err("average=True needs a float array: float32, float16 or bfloat16 (an int32 mean is not an int32)"));
        }
        let Some(o) = out else {
            return self.allreduce_new(py, array, is_f32, average);
        };
        // `out` is checked before anything is sent: a bad one must not cost
        // a collective the other members are waiting on.
        let outcome = if is_f32 {
            check_out::<f32>(array, o)?;
            self.allreduce_out::<f32>(py, array, o, average)?
        } else {
            check_out::<i32>(array, o)?;
            self.allreduce_out::<i32>(py, array, o, average)?
        };
        self.last = Some(outcome);
        Ok(o.clone())
    }

    fn allreduce_half_any<'py>(
        &mut self,
        py: Python<'py>,
        bits: &Bound<'py, PyAny>,
        format: &str,
        average: bool,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let kind = match format {
            "float16" => Half::F16,
            "bfloat16" => Half::BF16,
            other => return Err(PyValueError::new_err(format!("format {other:?}: give \"float16\" or \"bfloat16\""))),
        };
        if bits.cast::<PyArrayDyn<u16>>().is_err() {
            let dtype = bits.getattr("dtype").map(|d| d.to_string()).unwrap_or_else(|_| "not an array".into());
            return Err(PyTypeError::new_err(format!(
                "allreduce_half takes the bits as a numpy uint16 array (got {dtype}); e.g. a.view(np.uint16)"
            )));
        }
        // `out` is checked before the input is borrowed (it may be the input)
        // and before anything is sent
        if let Some(o) = out {
            check_out::<u16>(bits, o)?;
        }
        let input = bits.extract::<PyReadonlyArrayDyn<'py, u16>>()?;
        // the block size a 16-bit allreduce uses (exponents are taken per block)
        let per = self.inner.half_elems_per_packet().max(1) as usize;
        let shape = input.shape().to_vec();
        if let Some(o) = out {
            // lent as it is when it shares no memory with `out`, else staged
            let outcome = match lendable(&input, o.cast::<PyArrayDyn<u16>>()?.data() as usize) {
                Some(s) => {
                    let prepared = Prepared::borrow(TensorRef::Half(kind, s), per).map_err(|e| self.refuse(e))?;
                    reduce_half_into(py, &mut self.inner, mean_if(prepared, average), o, kind)?
                }
                None => {
                    let prepared = Prepared::new(Tensor::Half(kind, stage(&input, Vec::new())), per).map_err(|e| self.refuse(e))?;
                    drop(input); // `out` may be the input: its read borrow ends before the write borrow
                    reduce_half_into(py, &mut self.inner, mean_if(prepared, average), o, kind)?
                }
            };
            self.last = Some(outcome);
            return Ok(o.clone());
        }
        let prepared = Prepared::new(Tensor::Half(kind, stage(&input, Vec::new())), per).map_err(|e| self.refuse(e))?;
        let prepared = mean_if(prepared, average);
        let mut outcome = py.detach(|| self.inner.allreduce_prepared(prepared)).map_err(host_err)?;
        let tensor = std::mem::replace(&mut outcome.tensor, Tensor::I32(Vec::new()));
        self.last = Some(outcome);
        let Tensor::Half(_, v) = tensor else { unreachable!("a 16-bit allreduce returns its own dtype") };
        Ok(PyArray1::from_vec(py, v).reshape(shape)?.into_any())
    }

    /// `allreduce` without `out`: the input is staged into a fresh vector,
    /// which the result overwrites and which becomes the returned array.
    fn allreduce_new<'py>(
        &mut self,
        py: Python<'py>,
        array: &Bound<'py, PyAny>,
        is_f32: bool,
        average: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let shape = array.cast::<PyUntypedArray>()?.shape().to_vec();
        let per = self.inner.elems_per_packet() as usize;
        let prepared = if is_f32 {
            f32::stage(&array.extract::<PyReadonlyArrayDyn<'py, f32>>()?, Vec::new(), per)
        } else {
            i32::stage(&array.extract::<PyReadonlyArrayDyn<'py, i32>>()?, Vec::new(), per)
        }
        .map_err(|e| self.refuse(e))?;
        let prepared = mean_if(prepared, average);
        let mut outcome = py.detach(|| self.inner.allreduce_prepared(prepared)).map_err(host_err)?;
        // the result vector becomes the array's buffer (no copy); the rest
        // of the outcome stays for last_stats
        let tensor = std::mem::replace(&mut outcome.tensor, Tensor::I32(Vec::new()));
        self.last = Some(outcome);
        match tensor {
            Tensor::F32(v) => Ok(PyArray1::from_vec(py, v).reshape(shape)?.into_any()),
            Tensor::I32(v) => Ok(PyArray1::from_vec(py, v).reshape(shape)?.into_any()),
            Tensor::Half(_, v) => Ok(PyArray1::from_vec(py, v).reshape(shape)?.into_any()),
        }
    }

    /// `allreduce` into `out` (checked by `check_out`): the sum is written
    /// straight into `out`, borrowed for the call and written without the
    /// GIL, as numpy's own `out=` does. The input is lent to the session as
    /// it is when it can be (C-contiguous, no memory shared with `out`):
    /// no copy of it at all. Otherwise it is staged first into a buffer
    /// this session keeps, so repeated calls touch no fresh memory (page
    /// faults cost more than the copy), and `out` may then be the input
    /// itself.
    fn allreduce_out<'py, T: Reducible>(
        &mut self,
        py: Python<'py>,
        array: &Bound<'py, PyAny>,
        o: &Bound<'py, PyAny>,
        average: bool,
    ) -> PyResult<Outcome> {
        let per = self.inner.elems_per_packet() as usize;
        let a = array.extract::<PyReadonlyArrayDyn<'py, T>>()?;
        if let Some(s) = lendable(&a, o.cast::<PyArrayDyn<T>>()?.data() as usize) {
            let prepared = Prepared::borrow(T::view(s), per).map_err(|e| self.refuse(e))?;
            let mut w = o.extract::<PyReadwriteArrayDyn<'py, T>>()?;
            return reduce_into(py, &mut self.inner, mean_if(prepared, average), &mut w);
        }
        let buf = std::mem::take(T::staging(self));
        let prepared = T::stage(&a, buf, per).map_err(|e| self.refuse(e))?;
        drop(a); // `out` may be the input: its read borrow ends before the write borrow
        let mut w = o.extract::<PyReadwriteArrayDyn<'py, T>>()?;
        let mut outcome = reduce_into(py, &mut self.inner, mean_if(prepared, average), &mut w)?;
        // the staged input comes back, to be reused by the next call
        if let Some(v) = T::take_tensor(&mut outcome.tensor) {
            *T::staging(self) = v;
        }
        Ok(outcome)
    }
}

/// `prepared`, asking for the mean (decoded as such, block by block)
/// when `average`.
fn mean_if(prepared: Prepared<'_>, average: bool) -> Prepared<'_> {
    if average {
        prepared.averaged()
    } else {
        prepared
    }
}

/// A 16-bit `allreduce_into` of `prepared` into `o` (checked by
/// `check_out`) with the GIL released.
fn reduce_half_into<'py>(
    py: Python<'py>,
    inner: &mut HostSession,
    prepared: Prepared<'_>,
    o: &Bound<'py, PyAny>,
    kind: Half,
) -> PyResult<Outcome> {
    let mut w = o.extract::<PyReadwriteArrayDyn<'py, u16>>()?;
    let dst = w.as_slice_mut().map_err(|e| PyValueError::new_err(format!("out: {e}")))?;
    py.detach(|| inner.allreduce_into(prepared, TensorMut::Half(kind, &mut *dst))).map_err(host_err)
}

/// `allreduce_into` with the GIL released.
fn reduce_into<T: Reducible>(
    py: Python<'_>,
    inner: &mut HostSession,
    prepared: Prepared<'_>,
    out: &mut PyReadwriteArrayDyn<'_, T>,
) -> PyResult<Outcome> {
    let dst = out.as_slice_mut().map_err(|e| PyValueError::new_err(format!("out: {e}")))?;
    py.detach(|| inner.allreduce_into(prepared, T::view_mut(&mut *dst))).map_err(host_err)
}

/// The element types a session reduces, and how their arrays meet the
/// protocol machine's tensors.
trait Reducible: Element + Copy + Send + Sync {
    fn view(s: &[Self]) -> TensorRef<'_>;
    fn view_mut(s: &mut [Self]) -> TensorMut<'_>;
    /// A copy of `a` in `buf` (reusing its memory), prepared.
    fn stage(a: &PyReadonlyArrayDyn<'_, Self>, buf: Vec<Self>, per: usize) -> Result<Prepared<'static>, OutOfRange>;
    fn staging(s: &mut Session) -> &mut Vec<Self>;
    fn take_tensor(t: &mut Tensor) -> Option<Vec<Self>>;
}

impl Reducible for f32 {
    fn view(s: &[f32]) -> TensorRef<'_> {
        TensorRef::F32(s)
    }
    fn view_mut(s: &mut [f32]) -> TensorMut<'_> {
        TensorMut::F32(s)
    }
    fn stage(a: &PyReadonlyArrayDyn<'_, f32>, buf: Vec<f32>, per: usize) -> Result<Prepared<'static>, OutOfRange> {
        match a.as_slice() {
            // the block exponents are taken while each block is copied
            Ok(s) if a.is_c_contiguous() => Prepared::copy_f32(s, per, buf),
            _ => Prepared::new(Tensor::F32(stage(a, buf)), per),
        }
    }
    fn staging(s: &mut Session) -> &mut Vec<f32> {
        &mut s.staging_f32
    }
    fn take_tensor(t: &mut Tensor) -> Option<Vec<f32>> {
        match t {
            Tensor::F32(v) if !v.is_empty() => Some(std::mem::take(v)),
            _ => None,
        }
    }
}

impl Reducible for i32 {
    fn view(s: &[i32]) -> TensorRef<'_> {
        TensorRef::I32(s)
    }
    fn view_mut(s: &mut [i32]) -> TensorMut<'_> {
        TensorMut::I32(s)
    }
    fn stage(a: &PyReadonlyArrayDyn<'_, i32>, buf: Vec<i32>, per: usize) -> Result<Prepared<'static>, OutOfRange> {
        Prepared::new(Tensor::I32(stage(a, buf)), per)
    }
    fn staging(s: &mut Session) -> &mut Vec<i32> {
        &mut s.staging_i32
    }
    fn take_tensor(t: &mut Tensor) -> Option<Vec<i32>> {
        match t {
            Tensor::I32(v) if !v.is_empty() => Some(std::mem::take(v)),
            _ => None,
        }
    }
}

/// The defaults of `fanin.Session`'s tunables, from the Rust session
/// configuration (the one place they are written), by keyword argument.
#[pyfunction]
pub(crate) fn session_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let c = fanin_proto::host::SessionConfig::new(0, 0);
    let d = PyDict::new(py);
    d.set_item("elems_per_packet", c.elems_per_packet)?;
    d.set_item("window", c.window)?;
    d.set_item("rto_ms", c.rto_initial.as_secs_f64() * 1e3)?;
    d.set_item("rto_min_ms", c.rto_min.as_secs_f64() * 1e3)?;
    d.set_item("rto_max_ms", c.rto_max.as_secs_f64() * 1e3)?;
    d.set_item("join_timeout_s", c.join_timeout.as_secs_f64())?;
    d.set_item("dead_after_s", c.dead_after.as_secs_f64())?;
    d.set_item("barrier_timeout_s", c.barrier_timeout.as_secs_f64())?;
    d.set_item("switch_gone_after_s", c.switch_gone_after.as_secs_f64())?;
    Ok(d)
}
