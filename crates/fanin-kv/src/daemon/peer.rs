//! The control channel between daemons (TCP, JSON lines): a sender's daemon
//! joins a task at the receiver's daemon and keeps the connection for the
//! whole send (its liveness), reports progress, finish or failure; the
//! receiver's daemon tells senders when a task is aborted. Also the watch
//! that declares silent senders failed (docs/kv.md §10).

use super::*;
use crate::api::{PeerRequest, PEER_OPS};

/// Tell the daemons of the still active senders (channel, control address)
/// that the task is gone.
pub(super) fn notify_senders(active: &[(u16, String)], task_id: u32, reason: &str) {
    for (channel, control) in active {
        let msg = PeerRequest::Abort { task_id, channel: *channel, reason: reason.into() }.to_json();
        let _ = peer_call(control, &msg);
    }
}

/// Declare a joined sender failed (receiver side): the receiver machine
/// stops waiting for its FIN and the sender's daemon, should it still be
/// there, is told to stop. False if the channel was not active (it finished,
/// failed before, or the task is gone).
fn sender_failed(shared: &Arc<Shared>, task_id: u32, channel: u16, reason: String) -> bool {
    let control = {
        let mut tasks = shared.tasks.lock().expect("tasks");
        let Some(t) = tasks.get_mut(&task_id) else { return false };
        let Some(control) = t.ledger.fail(channel, reason.clone(), machine_time(shared.epoch)) else { return false };
        let _ = shared.receive[t.receive_channel].0.send(ChannelCommand::SenderFailed { task: task_id, channel });
        control
    };
    shared.stats.senders_failed.fetch_add(1, Ordering::Relaxed);
    // Usually the daemon is dead and this fails fast; a hung one may take
    // the connect timeout, so not on the caller's thread.
    let msg = PeerRequest::Abort { task_id, channel, reason: format!("the receiver declared this sender failed: {reason}") }
        .to_json();
    let _ = std::thread::Builder::new().name("fanin-kv-notify".into()).spawn(move || peer_call(&control, &msg));
    true
}

/// Every active sender without progress for its task's silence timeout is
/// declared failed. Checks as often as the most demanding task asks
/// ([`TaskLedger::check_interval`]: five times per timeout, 5..=50 ms).
/// A task still awaiting joins within its `join_ms` has its receiver's
/// silence clock held: its senders are preparing their input, not gone.
pub(super) fn watch_senders(shared: &Arc<Shared>) {
    while !shared.shutdown.load(Ordering::SeqCst) {
        let now = machine_time(shared.epoch);
        let mut overdue = Vec::new();
        let mut missed = Vec::new();
        let mut tick = Duration::from_millis(50);
        for (task, t) in shared.tasks.lock().expect("tasks").iter_mut() {
            tick = tick.min(t.ledger.check_interval());
            overdue.extend(t.ledger.overdue(now).into_iter().map(|(channel, why)| (*task, channel, why)));
            if t.ledger.awaiting_joins(now) {
                let _ = shared.receive[t.receive_channel].0.send(ChannelCommand::SenderProgress { task: *task });
            }
            let never = t.ledger.take_missed_joins(now);
            if !never.is_empty() {
                missed.push((*task, never));
            }
        }
        // a channel that never joined within join_ms: no complete result can come
        for (task, channels) in missed {
            let list = channels.iter().map(u16::to_string).collect::<Vec<_>>().join(", ");
            let reason = format!(
                "sender channels {list} never joined within the task's join_ms (their applications failed before \
                 sending, or took longer to prepare their input: give a longer join_ms)"
            );
            super::app::abort_task(shared, task, &reason, false);
        }
        for (task, channel, why) in overdue {
            sender_failed(shared, task, channel, why);
        }
        std::thread::sleep(tick);
    }
}

/// One connection from another daemon. A sender's daemon joins on it and
/// keeps it for the whole send; if it closes before that channel finished,
/// the sender is declared failed.
pub(super) fn serve_peer(shared: &Arc<Shared>, stream: TcpStream) {
    let Ok(mut writer) = stream.try_clone() else { return };
    let mut joined_here: Vec<(u32, u16)> = Vec::new();
    serve_lines(shared, stream, |s, req| peer_request(s, req, &mut joined_here), &mut writer);
    for (task, channel) in joined_here {
        let reason = "its daemon's control connection closed before its FIN was acknowledged (daemon killed or host gone)";
        sender_failed(shared, task, channel, reason.into());
    }
}

fn peer_request(shared: &Arc<Shared>, req: &Value, joined_here: &mut Vec<(u32, u16)>) -> Value {
    let result = (|| -> Result<Value, Value> {
        match crate::api::parse::<PeerRequest>(req, PEER_OPS, "control request").map_err(error)? {
            PeerRequest::Join { task_id, channel, control, value_type } => {
                let mut tasks = shared.tasks.lock().expect("tasks");
                let Some(t) = tasks.get_mut(&task_id) else {
                    shared.stats.unknown_task.fetch_add(1, Ordering::Relaxed);
                    return Err(error(format!("unknown task {task_id} at the receiver's daemon (never created, finished or aborted)")));
                };
                // Before the channel joins: its values would be read as the wrong type.
                if let Some(input) = value_type.filter(|v| *v != t.params.value_type) {
                    return Err(error(format!(
                        "task {task_id} sums {} values but this input's are {input} (text counts integer ones; \
                         a ticket names its task's type): create the task with value_type=\"{input}\"",
                        t.params.value_type
                    )));
                }
                t.ledger.join(channel, control, machine_time(shared.epoch)).map_err(error)?;
                joined_here.push((task_id, channel));
                // The channel's member key travels in clear on this channel:
                // it must be loopback or a trusted network (docs/security.md).
                let member_key = t.key.map(|k| channel_key(&k, task_id, channel).to_hex());
                Ok(json!({"ok": true, "params": t.params, "member_key": member_key}))
            }
            PeerRequest::Progress { task_id, channel, progress } => {
                let mut tasks = shared.tasks.lock().expect("tasks");
                let gone = || error(format!("task {task_id} is gone at the receiver's daemon (finished or aborted)"));
                let t = tasks.get_mut(&task_id).ok_or_else(gone)?;
                match t.ledger.progress(channel, progress, machine_time(shared.epoch)) {
                    Ok(advanced) => {
                        if advanced {
                            let _ = shared.receive[t.receive_channel].0.send(ChannelCommand::SenderProgress { task: task_id });
                        }
                        Ok(json!({"ok": true}))
                    }
                    // The sender's daemon must stop sending on this channel.
                    Err(e @ ProgressRefused::DeclaredFailed { .. }) => {
                        Err(json!({"ok": false, "error": e.to_string(), "declared_failed": true}))
                    }
                    Err(e) => Err(error(e)),
                }
            }
            PeerRequest::Finished { task_id, channel } => {
                if let Some(t) = shared.tasks.lock().expect("tasks").get_mut(&task_id) {
                    t.ledger.finished(channel);
                }
                Ok(json!({"ok": true}))
            }
            PeerRequest::Fail { task_id, channel, error: why } => {
                let found = sender_failed(shared, task_id, channel, format!("the sender failed: {why}"));
                Ok(json!({"ok": found}))
            }
            PeerRequest::Abort { task_id, channel, reason } => {
                // The receiver's daemon gave up the task (or this channel).
                let reason = format!("the receiver aborted the task: {reason}");
                for s in &shared.send {
                    let _ = s.send(ChannelCommand::AbortSender { task: task_id, channel, reason: reason.clone() });
                }
                Ok(json!({"ok": true}))
            }
        }
    })();
    result.unwrap_or_else(|e| e)
}

/// One request/reply on another daemon's control channel.
pub(super) fn peer_call(addr: &str, msg: &Value) -> std::io::Result<Value> {
    let addr: SocketAddr = addr.parse().map_err(|_| std::io::Error::other(format!("bad address {addr:?}")))?;
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write_line(&mut stream, msg)?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    serde_json::from_str(&line).map_err(std::io::Error::other)
}
