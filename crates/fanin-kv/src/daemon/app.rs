//! The local API (Unix socket, JSON lines): an application creates tasks it
//! receives, waits for their results, asks their status, aborts them, and
//! hands its inputs to this daemon to send (docs/kv.md §10).

use super::*;
use fanin_proto::kv::{check_senders, ValueType};
use crate::api::{AppRequest, CreateTask, PeerRequest, SendInput, WaitTask, APP_OPS};

pub(super) fn serve_app(shared: &Arc<Shared>, stream: UnixStream) {
    let Ok(mut writer) = stream.try_clone() else { return };
    // Tasks this connection created and has not collected: aborted if the
    // application goes away.
    let mut owned: Vec<u32> = Vec::new();
    serve_lines(shared, stream, |s, req| app_request(s, req, &mut owned), &mut writer);
    for task in owned {
        abort_task(shared, task, "the application that created the task disconnected", true);
    }
}

fn app_request(shared: &Arc<Shared>, req: &Value, owned: &mut Vec<u32>) -> Value {
    let result = match crate::api::parse::<AppRequest>(req, APP_OPS, "request").map_err(error) {
        Err(e) => Err(e),
        Ok(AppRequest::Create(create)) => {
            create_task(shared, &create).inspect(|v| owned.extend(v["task_id"].as_u64().map(|t| t as u32)))
        }
        Ok(AppRequest::Send(input)) => send(shared, &input),
        Ok(AppRequest::Wait(wait)) => {
            owned.retain(|&t| t != wait.task_id);
            wait_task(shared, &wait)
        }
        Ok(AppRequest::Abort(task)) => {
            owned.retain(|&o| o != task.task_id);
            let found = abort_task(shared, task.task_id, "aborted by the application", true);
            Ok(json!({"ok": found}))
        }
        Ok(AppRequest::Status(task)) => task_status(shared, task.task_id),
        Ok(AppRequest::Stats(_)) => Ok(stats_json(shared)),
    };
    result.unwrap_or_else(|e| {
        shared.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
        e
    })
}

fn create_task(shared: &Arc<Shared>, req: &CreateTask) -> Result<Value, Value> {
    let senders = check_senders(req.senders).map_err(error)?;
    let byte = |v: Option<u64>, default: u64| v.unwrap_or(default).min(255) as u8;
    let layout = Layout {
        short_slots: byte(req.short_slots, 16),
        medium_groups: byte(req.medium_groups, 8),
        medium_parts: byte(req.medium_parts, 2),
    };
    layout.validate().map_err(error)?;
    let aa_size = req.aa_size.unwrap_or(4096).min(u32::MAX as u64) as u32;
    // 2048, not 256, 1024 or the switch's largest (4096): see docs/kv.md
    // "decision — window" (a full window's round trip here includes waiting
    // for one of 2 shared cores; a 4096 burst overflows socket buffers).
    let window = req.window.unwrap_or(2048).min(u32::MAX as u64) as u32;
    let shadow_copies = req.shadow_copies.unwrap_or(true);
    let swap_threshold = req.swap_threshold.unwrap_or(1024);
    if req.silence_ms == Some(0) {
        // every task would fail at once with "nothing arrived for 0ns"
        return Err(error("silence_ms = 0: give at least 1 ms (how long the task may hear nothing)"));
    }
    let silence = Duration::from_millis(req.silence_ms.unwrap_or(shared.config.silence_ms));
    let key = task_key(req)?;
    let value_type = match req.value_type.as_deref() {
        None => ValueType::Int64,
        Some(name) => ValueType::parse(name)
            .ok_or_else(|| error(format!("value_type {name:?}: give \"int64\" or \"float64\"")))?,
    };
    let idx = (shared.next_send.fetch_add(1, Ordering::Relaxed) as usize) % shared.receive.len();
    let (commands, receiver_addr) = shared.receive[idx].clone();
    // Task ids are unique at the switch across daemons: a random start,
    // then the next free one.
    let mut last = None;
    for _ in 0..8 {
        let task_id = shared.next_task.fetch_add(1, Ordering::Relaxed) as u32;
        let mut ledger = TaskLedger::new(task_id, senders.into(), silence).map_err(error)?;
        if let Some(join_ms) = req.join_ms {
            ledger.expect_joins_until(machine_time(shared.epoch) + Duration::from_millis(join_ms));
        }
        let mut spec = KvTaskSpec::new(task_id, receiver_addr, layout, aa_size);
        spec.tenant = shared.config.tenant;
        spec.shadow_copies = shadow_copies;
        spec.window = window;
        spec.max_channels = senders;
        // The switch frees the region of a task nobody talks to any more
        // (nobody does while its senders may still be joining).
        spec.idle_timeout = silence * 2 + Duration::from_millis(req.join_ms.unwrap_or(0));
        spec.key = key;
        spec.value_type = value_type;
        match shared.switch.alloc(&spec) {
            Ok(switch_addr) => {
                let switch_addr = reachable_switch_addr(switch_addr, &shared.config);
                let progress_ms = progress_interval(silence).as_millis() as u64;
                let params = TaskParams { task_id, short_slots: layout.short_slots, medium_groups: layout.medium_groups, medium_parts: layout.medium_parts, aa_size, shadow_copies, window, senders, switch_addr, progress_ms, value_type };
                let mut rc = ReceiverConfig::new(task_id, layout, aa_size, senders);
                rc.shadow_copies = shadow_copies;
                rc.window = window;
                rc.swap_threshold = (swap_threshold > 0).then_some(swap_threshold);
                // Twice the senders' liveness timeout: a dead sender is found
                // (and named) by its control connection first; this timer is
                // for the switch or the whole path going silent, and for
                // channels that never join.
                rc.idle_timeout = silence * 2;
                rc.max_burst = crate::channel::MAX_BURST;
                rc.rto = Duration::from_micros(shared.config.rto_us.max(1_000));
                rc.auth_key = key.map(|k| receiver_key(&k, task_id));
                rc.seal_clock_us = wall_clock_us();
                rc.max_key_len = shared.config.max_key_len;
                rc.value_type = value_type;
                let now = machine_time(shared.epoch);
                let machine = match KvReceiver::new(rc, now) {
                    Ok(m) => m,
                    Err(e) => {
                        let _ = shared.switch.release(task_id);
                        return Err(error(e));
                    }
                };
                let (done, outcome) = mpsc::sync_channel(1);
                let _ = commands.send(ChannelCommand::Receive { task: task_id, switch: switch_addr, machine: Box::new(machine), done });
                shared.tasks.lock().expect("tasks").insert(
                    task_id,
                    TaskEntry { params, key, ledger, outcome: Some(outcome), receive_channel: idx, started: Instant::now() },
                );
                shared.stats.tasks_created.fetch_add(1, Ordering::Relaxed);
                return Ok(json!({"ok": true, "task_id": task_id, "control": shared.control_addr.to_string(),
                                  "switch_addr": switch_addr.to_string(), "keyed": key.is_some(),
                                  "value_type": value_type.name()}));
            }
            Err(e) if e.already_exists() => last = Some(e),
            Err(e) => return Err(error(e)),
        }
    }
    Err(error(last.map(|e| e.to_string()).unwrap_or_default()))
}

/// The task key of a `create` request: `key` (32 hex digits) if the
/// application passes one, 16 random bytes from the OS with `"auth": true`,
/// else none. Opt-in because sealing costs about 20 % of a word count's time
/// on 2 cores (docs/results.md#security-authentication-cost).
fn task_key(req: &CreateTask) -> Result<Option<Key>, Value> {
    if let Some(hex) = req.key.as_ref().filter(|v| !v.is_null()) {
        let hex = hex.as_str().ok_or_else(|| error("key must be a string of 32 hex digits"))?;
        return Key::from_hex(hex).map(Some).map_err(|e| error(format!("key: {e}")));
    }
    // Keyed unless the application opts out (docs/security.md: safe by
    // default; `"auth": false` is for trusted networks and measurements).
    match &req.auth {
        None | Some(Value::Null) | Some(Value::Bool(true)) => {}
        Some(Value::Bool(false)) => return Ok(None),
        Some(_) => return Err(error("auth must be true or false")),
    }
    let mut key = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut key))
        .map_err(|e| error(format!("cannot draw a task key from /dev/urandom: {e}")))?;
    Ok(Some(Key(key)))
}

fn wait_task(shared: &Arc<Shared>, req: &WaitTask) -> Result<Value, Value> {
    let task_id = req.task_id;
    let path = req.path.as_str();
    let outcome = {
        let mut tasks = shared.tasks.lock().expect("tasks");
        let Some(t) = tasks.get_mut(&task_id) else {
            shared.stats.unknown_task.fetch_add(1, Ordering::Relaxed);
            return Err(error(format!("unknown task {task_id}")));
        };
        t.outcome.take().ok_or_else(|| error(format!("task {task_id} is already being waited for")))?
    };
    let result = outcome.recv().unwrap_or_else(|_| Err("the receiver's data channel stopped".into()));
    let entry = shared.tasks.lock().expect("tasks").remove(&task_id);
    let seconds = entry.as_ref().map_or(0.0, |e| e.started.elapsed().as_secs_f64());
    let value_type = entry.as_ref().map_or(ValueType::Int64, |e| e.params.value_type).name();
    let now = machine_time(shared.epoch);
    // The channels the daemon declared failed, as the application sees them.
    let report = |channels: Vec<u16>| -> Vec<ChannelReport> {
        let one = |c| entry.as_ref().map_or_else(|| ChannelReport::never_joined(c), |e| e.ledger.report(c, now));
        channels.into_iter().map(one).collect()
    };
    match result {
        Ok(Collected { results, stats, failed }) => {
            let keys = write_results(Path::new(path), results.iter()).map_err(|e| error(format!("cannot write {path}: {e}")))?;
            let receiver = json!({"data_packets": stats.data_packets, "duplicate_packets": stats.duplicate_packets,
                                  "tuples_local": stats.tuples_local, "swaps": stats.swaps,
                                  "entries_fetched": stats.entries_fetched, "fetch_requests": stats.fetch_requests,
                                  "overflowed": stats.overflowed, "keys_reassembled": stats.keys_reassembled,
                                  "keys_refused": stats.keys_refused, "undecodable": stats.undecodable});
            if failed.is_empty() {
                shared.stats.tasks_finished.fetch_add(1, Ordering::Relaxed);
                return Ok(json!({"ok": true, "complete": true, "task_id": task_id, "keys": keys, "path": path,
                                 "seconds": seconds, "receiver": receiver, "value_type": value_type}));
            }
            shared.stats.tasks_failed.fetch_add(1, Ordering::Relaxed);
            shared.stats.tasks_incomplete.fetch_add(1, Ordering::Relaxed);
            let failed = report(failed);
            let message = format!(
                "task {task_id} is incomplete: {}; the partial aggregate ({keys} keys: every tuple of the finished \
                 channels, part of the failed ones') is in {path}",
                describe_failed(&failed)
            );
            // Not an error of the request: the reply carries the outcome.
            Ok(json!({"ok": false, "complete": false, "error": message, "task_id": task_id, "failed": failed,
                      "keys": keys, "path": path, "seconds": seconds, "receiver": receiver, "value_type": value_type}))
        }
        Err(reason) => {
            shared.stats.tasks_failed.fetch_add(1, Ordering::Relaxed);
            release_region(shared, task_id);
            let mut failed = Vec::new();
            if let Some(e) = &entry {
                notify_senders(&e.ledger.active(), task_id, &reason);
                failed = report(e.ledger.declared_failed());
            }
            let also = if failed.is_empty() { String::new() } else { format!(" (earlier: {})", describe_failed(&failed)) };
            Err(json!({"ok": false, "error": format!("task {task_id} failed: {reason}{also}"), "failed": failed}))
        }
    }
}

/// "sender channel 1 (daemon 10.0.0.2:4000) failed: reason; ..."
fn describe_failed(failed: &[ChannelReport]) -> String {
    failed.iter().map(ChannelReport::describe).collect::<Vec<_>>().join("; ")
}

/// `status`: the task's joined channels and their liveness (receiver side).
fn task_status(shared: &Arc<Shared>, task_id: u32) -> Result<Value, Value> {
    let tasks = shared.tasks.lock().expect("tasks");
    let Some(t) = tasks.get(&task_id) else {
        shared.stats.unknown_task.fetch_add(1, Ordering::Relaxed);
        return Err(error(format!("unknown task {task_id}")));
    };
    let channels = t.ledger.status(machine_time(shared.epoch));
    Ok(json!({"ok": true, "task_id": task_id, "senders": t.params.senders, "channels": channels}))
}

/// Release the region through the control API (the receiver machine may
/// have released it already; NOT_FOUND is then expected).
fn release_region(shared: &Shared, task_id: u32) {
    if shared.switch.release(task_id).is_ok() {
        shared.stats.regions_released.fetch_add(1, Ordering::Relaxed);
    }
}

/// Abort a task this daemon receives: the receiver machine stops and its
/// waiter gets `reason` (now, or from a later `wait`: the outcome stays
/// buffered), the region is released, the senders' daemons are told. With
/// `forget` (nobody will ever wait: the application is gone) the entry goes
/// too. False if the task is unknown here.
pub(super) fn abort_task(shared: &Arc<Shared>, task_id: u32, reason: &str, forget: bool) -> bool {
    let active = {
        let mut tasks = shared.tasks.lock().expect("tasks");
        let Some(entry) = tasks.get_mut(&task_id) else { return false };
        let _ = shared.receive[entry.receive_channel].0.send(ChannelCommand::Abort { task: task_id, reason: reason.into() });
        let active = entry.ledger.abort();
        if forget && entry.outcome.is_some() {
            tasks.remove(&task_id);
            shared.stats.tasks_failed.fetch_add(1, Ordering::Relaxed);
        }
        active
    };
    release_region(shared, task_id);
    notify_senders(&active, task_id, reason);
    true
}

fn send(shared: &Arc<Shared>, req: &SendInput) -> Result<Value, Value> {
    let (task_id, control, channel) = (req.ticket.task_id, req.ticket.control.clone(), req.channel);
    let format_name = req.format.as_deref().unwrap_or("tuples");
    let format = InputFormat::parse(format_name).ok_or_else(|| error(format!("unknown format {format_name:?} (tuples, text)")))?;
    let path = req.path.as_str();
    let file = InputFile::open(Path::new(path)).map_err(|e| error(format!("cannot open {path}: {e}")))?;
    // Join at the receiver's daemon (control channel): it checks the task
    // and channel and tells us the task's parameters.
    // The session stays open while we send: it is how the receiver's daemon
    // knows this sender is alive (docs/kv.md §10, failed senders).
    // Text counts integer ones; a ticket names its task's value type.
    let value_type = match (format, req.ticket.value_type) {
        (InputFormat::Text, Some(t)) if t != ValueType::Int64 => {
            return Err(error(format!(
                "task {task_id} sums {t} values; text input counts integer ones: create an int64 task for text"
            )))
        }
        (InputFormat::Text, _) => Some(ValueType::Int64),
        // Tuples carry 8-byte values without their type: a ticket that
        // names none means int64 (what `encode_tuples` writes by default),
        // so a float64 task refuses the join instead of summing the bits.
        (_, t) => Some(t.unwrap_or(ValueType::Int64)),
    };
    let join = PeerRequest::Join { task_id, channel, control: shared.control_addr.to_string(), value_type }.to_json();
    let unreachable = |e: std::io::Error| error(format!("cannot reach the receiver's daemon at {control}: {e}"));
    let mut session = ControlSession::connect(&control).map_err(unreachable)?;
    let reply = session.call(&join).map_err(unreachable)?;
    if reply["ok"] != json!(true) {
        shared.stats.unknown_task.fetch_add(1, Ordering::Relaxed);
        return Err(error(reply["error"].as_str().unwrap_or("join refused")));
    }
    let params: TaskParams = serde_json::from_value(reply["params"].clone()).map_err(|e| error(format!("bad join reply: {e}")))?;
    let member_key = match reply.get("member_key").and_then(Value::as_str) {
        Some(hex) => Some(Key::from_hex(hex).map_err(|e| error(format!("bad join reply: member_key: {e}")))?),
        None => None,
    };
    let mut sc = SenderConfig::new(task_id, channel, params.layout());
    sc.window = params.window;
    sc.rto = Duration::from_micros(shared.config.rto_us);
    sc.congestion = shared.config.congestion;
    sc.min_rto = Duration::from_micros(shared.config.min_rto_us.max(1));
    sc.dead_after = Duration::from_millis(shared.config.silence_ms);
    sc.max_key_len = shared.config.max_key_len;
    sc.max_burst = crate::channel::MAX_BURST;
    sc.auth_key = member_key;
    sc.seal_clock_us = wall_clock_us();
    let machine = KvSender::new(sc, machine_time(shared.epoch)).map_err(error)?;
    let (done, outcome) = mpsc::sync_channel::<SenderOutcome>(1);
    let idx = (shared.next_send.fetch_add(1, Ordering::Relaxed) as usize) % shared.send.len();
    let started = Instant::now();
    let input = Input { file, format, offset: 0 };
    let progress = Arc::new(Mutex::new(machine.progress()));
    let cmd = ChannelCommand::Send { task: task_id, channel, switch: params.switch_addr, machine: Box::new(machine), input, progress: progress.clone(), done };
    let _ = shared.send[idx].send(cmd);
    let interval = Duration::from_millis(params.progress_ms.max(10));
    let mut session = Some(session);
    let mut hints_checked = 0;
    let result = loop {
        match outcome.recv_timeout(interval) {
            Ok(r) => break r,
            Err(mpsc::RecvTimeoutError::Disconnected) => break Err("the data channel stopped".into()),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        let now_progress = *progress.lock().expect("progress");
        if now_progress.unknown_task_hints > hints_checked {
            // Unsealed UnknownTask replies: a keyed machine cannot trust them,
            // so ask the switch over its control API (token-authenticated)
            // instead of waiting out the silence bound (docs/kv.md §10).
            hints_checked = now_progress.unknown_task_hints;
            if let Ok(false) = shared.switch.holds(task_id) {
                let reason = format!("the switch no longer holds task {task_id} (it restarted or released the task; \
                                      confirmed over its control API after an UnknownTask reply)");
                let _ = shared.send[idx].send(ChannelCommand::AbortSender { task: task_id, channel, reason });
            }
        }
        let Some(s) = session.as_mut() else { continue };
        let report = ProgressReport::from(now_progress);
        let msg = PeerRequest::Progress { task_id, channel, progress: report }.to_json();
        // Declared failed (we were too slow, or our connection was taken
        // for dead): this channel no longer counts, stop. Any other refusal
        // or a broken session only ends the reports: a task that finished
        // while our FIN-ACK was lost must not fail us, and a vanished
        // receiver is the machine's to notice (no acknowledgements).
        match s.call(&msg) {
            Ok(r) if r["ok"] == json!(true) => {}
            Ok(r) if r["declared_failed"] == json!(true) => {
                let reason = r["error"].as_str().unwrap_or("the receiver declared this sender failed").to_string();
                let _ = shared.send[idx].send(ChannelCommand::AbortSender { task: task_id, channel, reason });
                session = None;
            }
            Ok(_) | Err(_) => session = None,
        }
    };
    match result {
        Ok(st) => {
            if let Some(s) = session.as_mut() {
                let _ = s.call(&PeerRequest::Finished { task_id, channel }.to_json());
            }
            shared.stats.sends_finished.fetch_add(1, Ordering::Relaxed);
            Ok(json!({"ok": true, "task_id": task_id, "channel": channel, "seconds": started.elapsed().as_secs_f64(),
                      "tuples": st.tuples, "long_tuples": st.long_tuples, "packets": st.packets, "first_bytes": st.first_bytes,
                      "retransmissions": st.retransmissions, "acks_from_switch": st.acks_from_switch,
                      "acks_from_receiver": st.acks_from_receiver, "congestion": shared.config.congestion,
                      "timeouts": st.congestion.timeouts, "window_cuts": st.congestion.window_cuts,
                      "cwnd": st.cwnd, "rto_us": st.rto_us}))
        }
        Err(reason) => {
            shared.stats.sends_failed.fetch_add(1, Ordering::Relaxed);
            // The receiver would otherwise wait for this channel's FIN.
            let fail = PeerRequest::Fail { task_id, channel, error: reason.clone() }.to_json();
            if session.as_mut().map(|s| s.call(&fail)).map_or(true, |r| r.is_err()) {
                let _ = peer_call(&control, &fail);
            }
            Err(error(format!("task {task_id} channel {channel}: {reason}")))
        }
    }
}

pub(super) fn stats_json(shared: &Shared) -> Value {
    let s = &shared.stats;
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let sum = |f: fn(&ChannelStats) -> &AtomicU64| shared.channel_stats.iter().map(|c| get(f(c))).sum::<u64>();
    json!({"ok": true,
        "tasks_created": get(&s.tasks_created), "tasks_finished": get(&s.tasks_finished),
        "tasks_failed": get(&s.tasks_failed), "tasks_active": shared.tasks.lock().expect("tasks").len(),
        "sends_finished": get(&s.sends_finished), "sends_failed": get(&s.sends_failed),
        "bad_requests": get(&s.bad_requests), "unknown_task": get(&s.unknown_task),
        "regions_released": get(&s.regions_released),
        "tasks_incomplete": get(&s.tasks_incomplete), "senders_failed": get(&s.senders_failed),
        "connections": get(&s.connections), "connections_refused": get(&s.connections_refused),
        "oversized_requests": get(&s.oversized_requests),
        "rx_datagrams": sum(|c| &c.rx_datagrams), "malformed_datagrams": sum(|c| &c.malformed),
        "unroutable_datagrams": sum(|c| &c.unroutable), "tx_datagrams": sum(|c| &c.tx_datagrams),
        "send_errors": sum(|c| &c.send_errors),
        "control_addr": shared.control_addr.to_string(),
        "data_addrs": shared.receive.iter().map(|(_, a)| a.to_string()).collect::<Vec<_>>()})
}
