//! The exceptions the bindings raise, the mapping of the host's errors onto
//! them, and how a Ctrl-C in Python reaches a call waiting without the GIL.

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use fanin_host::HostError;
use fanin_proto::host::SessionError;

create_exception!(_native, FaninError, PyRuntimeError, "A fanin operation failed.");
create_exception!(_native, FaninTimeout, FaninError, "The switch did not answer in time.");
create_exception!(_native, FaninRefused, FaninError, "The switch refused the request.");
create_exception!(
    _native,
    SwitchGone,
    FaninTimeout,
    "Nothing listens on the switch's port any more (its host answers ICMP port unreachable): the switch process stopped. Start new sessions once a switch runs there."
);
create_exception!(
    _native,
    MemberFailed,
    FaninError,
    "The job failed because a member (worker) died; the message names its rank (failure policy `fail`)."
);
create_exception!(
    _native,
    MemberRestarted,
    FaninError,
    "A rank of the job joined again as a new process while this round ran: the round is over; start a new Session on every rank."
);
create_exception!(
    _native,
    StaleResult,
    FaninError,
    "The switch no longer holds (or never completed with every member) a result this allreduce needs, and the job does not accept partial results."
);

create_exception!(
    _native,
    InputOutOfRange,
    PyValueError,
    "An allreduce's input holds a finite value too large for block floating point (2^126 or more in magnitude; NaN and infinity are carried, their block's result is NaN): refused before anything was sent, so the other ranks' allreduce cannot complete, and the session takes no more allreduces."
);

/// The error for an input this rank refuses before sending any of it.
pub(crate) fn out_of_range_err(e: fanin_proto::bfp::OutOfRange) -> PyErr {
    InputOutOfRange::new_err(format!(
        "{e}; nothing of this allreduce was sent, so the other ranks' allreduce cannot complete (they will fail) \
         and this session takes no more allreduces: scale the input below 2^126, then start a new session \
         on every rank (in torch: a new process group)"
    ))
}

create_exception!(
    _native,
    InvalidPair,
    PyValueError,
    "A (key, value) pair fanin.kv cannot encode (not a pair, a value that is not an int64, a key too long); not raised for errors of the iterable itself."
);

/// The exception a signal handler raised while a call waited with the GIL
/// released (KeyboardInterrupt for Ctrl-C): the call ends and re-raises it.
static SIGNALLED: std::sync::Mutex<Option<PyErr>> = std::sync::Mutex::new(None);

/// Ask Python whether a signal handler wants the waiting call to stop (runs
/// the handlers; only the main thread receives signals).
pub(crate) fn python_interrupt() -> fanin_host::Interrupt {
    Box::new(|| {
        Python::attach(|py| match py.check_signals() {
            Ok(()) => false,
            Err(e) => {
                *SIGNALLED.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                true
            }
        })
    })
}

pub(crate) fn host_err(e: HostError) -> PyErr {
    if let HostError::Session(SessionError::Interrupted) = &e {
        if let Some(raised) = SIGNALLED.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return raised;
        }
    }
    match &e {
        HostError::Session(SessionError::SwitchUnreachable(_)) | HostError::Session(SessionError::SwitchSilent { .. }) => {
            FaninTimeout::new_err(e.to_string())
        }
        HostError::Session(SessionError::MemberFailed { .. }) => MemberFailed::new_err(e.to_string()),
        HostError::Session(SessionError::SwitchGone { .. }) => SwitchGone::new_err(e.to_string()),
        HostError::Session(SessionError::MemberRestarted { .. }) => MemberRestarted::new_err(e.to_string()),
        HostError::Session(SessionError::MissedBlocks { .. }) | HostError::Session(SessionError::PartialResult { .. }) => {
            StaleResult::new_err(e.to_string())
        }
        HostError::Session(SessionError::JoinBarrier { .. }) => FaninTimeout::new_err(e.to_string()),
        HostError::Session(SessionError::MemberCount { .. }) | HostError::Session(SessionError::LengthMismatch { .. }) => {
            FaninRefused::new_err(e.to_string())
        }
        HostError::Session(SessionError::Refused { .. }) | HostError::Session(SessionError::PacketTooLarge { .. }) => {
            FaninRefused::new_err(e.to_string())
        }
        HostError::Session(SessionError::OutOfRange(refused)) => out_of_range_err(*refused),
        HostError::Session(SessionError::Config(_)) | HostError::Option(_) => {
            PyValueError::new_err(e.to_string())
        }
        _ => FaninError::new_err(e.to_string()),
    }
}
