//! The daemon's requests as types (docs/kv.md §10): the local API, which an
//! application speaks on the Unix socket, and the control channel between
//! daemons. Both are JSON lines; every request is one of these enums,
//! tagged by its `"op"`.
//!
//! Parsing into types instead of reading fields one by one means a request
//! that does not fit is refused whole, in words that name what to change:
//! `missing field "senders"`, `unknown field "aa_sise" (expected one of
//! ...)`. Before, an option the daemon did not know (a typo) was ignored
//! and the task ran with the default.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::liveness::ProgressReport;
use fanin_proto::kv::ValueType;

/// The local API's operations, for the error that names them.
pub const APP_OPS: &[&str] = &["create", "send", "wait", "status", "abort", "stats"];
/// The control channel's operations.
pub const PEER_OPS: &[&str] = &["join", "progress", "finished", "fail", "abort"];

/// A request of an application to its daemon.
#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum AppRequest {
    /// Create a task this daemon receives; the reply carries the ticket.
    Create(CreateTask),
    /// Stream a shared-memory input as one channel of a task.
    Send(SendInput),
    /// Block until the task's results are in the file `path`.
    Wait(WaitTask),
    /// The task's channels and their liveness.
    Status(TaskRef),
    /// Give the task up.
    Abort(TaskRef),
    /// The daemon's counters.
    Stats(NoFields),
}

/// `create`. Unset options take the defaults below (docs/kv.md §10).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateTask {
    /// Sender channels the task waits for, 1..=1024.
    pub senders: u64,
    /// Slot layout (docs/kv.md §3): 16, 8 and 2 when unset.
    pub short_slots: Option<u64>,
    pub medium_groups: Option<u64>,
    pub medium_parts: Option<u64>,
    /// Aggregators per array on the switch (4096).
    pub aa_size: Option<u64>,
    /// Receive window per channel (2048).
    pub window: Option<u64>,
    /// ASK's shadow copies for hot keys (true).
    pub shadow_copies: Option<bool>,
    /// Tuples absorbed before the receiver swaps a copy out (1024; 0 = never).
    pub swap_threshold: Option<u64>,
    /// A sender silent this long is declared failed (the daemon's setting).
    pub silence_ms: Option<u64>,
    /// Channels may take this long to join after `create` (unset: the
    /// receiver waits 2 x silence_ms, as for any silence): for applications
    /// that create the task before their senders' inputs are ready.
    pub join_ms: Option<u64>,
    /// "int64" (unset) or "float64": how the switch and the receiver read
    /// the values' 8 bytes (`fanin_proto::kv::ValueType`).
    pub value_type: Option<String>,
    /// The task key, 32 hex digits; unset: one drawn here unless `auth` is false.
    pub key: Option<Value>,
    /// false: an unkeyed task (docs/security.md). Kept as JSON so that a
    /// non-boolean is refused with the daemon's own words.
    pub auth: Option<Value>,
}

/// What `create` hands the application for its senders.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Ticket {
    pub task_id: u32,
    /// The receiver's daemon's control channel, ip:port.
    pub control: String,
    /// The task's value type as `create` said it; a send checks it against
    /// the task's (unset: not checked; text input is refused for floats anyway).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_type: Option<ValueType>,
}

/// `send`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendInput {
    pub ticket: Ticket,
    pub channel: u16,
    /// A file the daemon maps: `tuples` records or `text`.
    pub path: String,
    /// "tuples" (unset) or "text".
    pub format: Option<String>,
}

/// `wait`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitTask {
    pub task_id: u32,
    /// Where the daemon writes the result records.
    pub path: String,
}

/// `status`, `abort`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskRef {
    pub task_id: u32,
}

/// A request without fields (`stats`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoFields {}

/// A request on the control channel between daemons: a sender's daemon to
/// the receiver's (join, progress, finished, fail) or back (abort).
#[derive(Debug, Deserialize, Serialize)]
#[serde(tag = "op", rename_all = "lowercase", deny_unknown_fields)]
pub enum PeerRequest {
    /// A sender joins `channel` of the task; `control` is its daemon's
    /// control channel (where an abort reaches it). `value_type`: the type
    /// its input's values are of, if it knows (text: int64; a ticket's);
    /// refused before the channel joins when the task's differs.
    Join {
        task_id: u32,
        channel: u16,
        control: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        value_type: Option<ValueType>,
    },
    /// The sender's progress (its liveness, docs/kv.md §10).
    Progress { task_id: u32, channel: u16, progress: ProgressReport },
    /// The channel's FIN was acknowledged.
    Finished { task_id: u32, channel: u16 },
    /// The sender failed (bad input, its machine gave up).
    Fail { task_id: u32, channel: u16, error: String },
    /// The receiver's daemon gave the task (or this channel) up.
    Abort { task_id: u32, channel: u16, reason: String },
}

impl PeerRequest {
    /// The request as a JSON line's value.
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).expect("a PeerRequest is plain data")
    }
}

/// Parse a request of one of the vocabularies: a JSON object whose `op` is
/// one of `ops`. The error names what to change.
pub fn parse<T: serde::de::DeserializeOwned>(req: &Value, ops: &[&str], what: &str) -> Result<T, String> {
    let op = req.get("op").and_then(Value::as_str).unwrap_or("");
    if !ops.contains(&op) {
        return Err(format!("unknown op {op:?} ({})", ops.join(", ")));
    }
    T::deserialize(req).map_err(|e| format!("{what} {op:?}: {}", e.to_string().replace('`', "\"")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn requests_parse_into_their_types_and_refusals_name_the_field() {
        let r: AppRequest = parse(&json!({"op": "create", "senders": 2, "aa_size": 256}), APP_OPS, "request").unwrap();
        assert!(matches!(r, AppRequest::Create(CreateTask { senders: 2, aa_size: Some(256), .. })));
        let r: AppRequest = parse(&json!({"op": "stats"}), APP_OPS, "request").unwrap();
        assert!(matches!(r, AppRequest::Stats(_)));
        let err = |req: Value| parse::<AppRequest>(&req, APP_OPS, "request").unwrap_err();
        assert_eq!(err(json!({"op": "frobnicate"})), "unknown op \"frobnicate\" (create, send, wait, status, abort, stats)");
        assert!(err(json!({"op": "send"})).contains("missing field \"ticket\""), "{}", err(json!({"op": "send"})));
        let typo = err(json!({"op": "create", "senders": 2, "aa_sise": 256}));
        assert!(typo.contains("unknown field \"aa_sise\"") && typo.contains("aa_size"), "{typo}");
        let big = err(json!({"op": "send", "ticket": {"task_id": 1, "control": "x"}, "channel": 70000, "path": "/p"}));
        assert!(big.contains("70000"), "{big}");
    }

    #[test]
    fn peer_requests_round_trip() {
        let join = PeerRequest::Join { task_id: 7, channel: 1, control: "127.0.0.1:5".into(), value_type: None };
        let v = join.to_json();
        assert_eq!(v, json!({"op": "join", "task_id": 7, "channel": 1, "control": "127.0.0.1:5"}));
        assert!(matches!(parse::<PeerRequest>(&v, PEER_OPS, "control request"), Ok(PeerRequest::Join { task_id: 7, .. })));
        let extra = parse::<PeerRequest>(&json!({"op": "finished", "task_id": 7, "channel": 1, "x": 1}), PEER_OPS, "c");
        assert!(extra.unwrap_err().contains("unknown field \"x\""));
    }
}
