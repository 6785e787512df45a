//! Job records as the control plane specifies them (Trio-ML's
//! `trio_ml_job_ctx_t`): members, caps and timeout. Validation lives here so
//! the config file, the control API and the Python API reject the same things
//! with the same words.

use fanin_wire::value::MAX_GRAD_CNT;
use serde::{Deserialize, Serialize};

/// Largest source id + 1 a job may use.
pub const MAX_SOURCES: usize = 4096;
/// Most concurrent blocks (slots) one job may hold.
pub const MAX_BLOCK_CNT: u32 = 1 << 20;
/// Longest block timeout a job may ask for (ten minutes).
pub const MAX_BLOCK_EXP_MS: u32 = 600_000;
/// Largest `slow_after_windows` (K) a job may ask for.
pub const MAX_SLOW_AFTER_WINDOWS: u32 = 10_000;
/// Source ids from here up name switches in an aggregation tree (their rank
/// at the parent); ids below name workers. A switch child's contribution
/// counts the workers it sums (`src_cnt`); a worker always counts one, so a
/// worker cannot inflate a result's source count.
pub const SWITCH_RANK_BASE: u16 = 2048;
/// K used when a job does not say (see docs/stragglers.md).
pub const DEFAULT_SLOW_AFTER_WINDOWS: u32 = 2;
/// Slots (concurrent blocks) of a job that does not say: SwitchML's pool
/// size, and the worker's default window (a window never exceeds it).
/// Every layer that describes a job (config file, control API clients,
/// Python, CLI) takes its default from here (`fanin._native.job_defaults`).
pub const DEFAULT_BLOCK_CNT_MAX: u32 = 256;
/// Elements per block of a job that does not say: the worker's default
/// `elems_per_packet` (1024 int32/float32, a 4 KiB payload).
pub const DEFAULT_BLOCK_GRAD_MAX: u32 = 1024;

fn default_slow_after_windows() -> u32 {
    DEFAULT_SLOW_AFTER_WINDOWS
}

/// Member timeout of a job that does not set one (`member_timeout_ms` = 0):
/// half the worker's default `dead_after` (10 s), so the survivors learn of
/// a dead member (a notice, or results without it) before they would give
/// up on a silent switch. See docs/failures.md.
pub const DEFAULT_MEMBER_TIMEOUT_MS: u32 = 5_000;
/// Longest member timeout a job may ask for (ten minutes).
pub const MAX_MEMBER_TIMEOUT_MS: u32 = 600_000;

/// What a job does when a worker dies (goes silent past the member
/// timeout while blocks wait for it). docs/failures.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum FailurePolicy {
    /// Continue without it (the straggler path): it is declared
    /// permanently slow, blocks complete without it and their results say
    /// so (`degraded`, `src_cnt`). It is waited for again if it comes back.
    #[default]
    Degrade,
    /// Fail the job: every member is told which source died, and gets an
    /// error naming it instead of results.
    Fail,
}

impl FailurePolicy {
    /// The policy of a job that does not name one: a job that asked for
    /// straggler aging (`block_exp_ms` > 0) accepts partial results, so a
    /// dead member degrades it too; any other fails loudly, every member
    /// raising with the dead rank's name, instead of getting partial sums
    /// flagged only in its statistics.
    pub fn default_for(block_exp_ms: u32) -> Self {
        if block_exp_ms > 0 {
            Self::Degrade
        } else {
            Self::Fail
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "degrade" => Ok(Self::Degrade),
            "fail" => Ok(Self::Fail),
            other => Err(format!("unknown failure policy {other:?} (use degrade or fail)")),
        }
    }
}

/// A per-source token bucket: each source of a job may send `pps`
/// contributions per second on average and `burst` back to back; the excess
/// is answered with a Trimmed nack (cause `RateLimited`), so a legitimate
/// sender backs off and a flood costs the switch a header read per packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    pub pps: u32,
    pub burst: u32,
}

impl RateLimit {
    pub fn validate(&self) -> Result<(), String> {
        if self.pps == 0 || self.burst == 0 {
            return Err(format!(
                "rate limit {},{}: both the rate (packets per second) and the burst must be at least 1",
                self.pps, self.burst
            ));
        }
        Ok(())
    }

    /// `"pps,burst"` (as `--rate-limit` takes it).
    pub fn parse(s: &str) -> Result<Self, String> {
        let bad = || format!("rate limit {s:?}: expected PPS,BURST (two positive integers, e.g. 100000,256)");
        let (pps, burst) = s.split_once(',').ok_or_else(bad)?;
        let limit = Self {
            pps: pps.trim().parse().map_err(|_| bad())?,
            burst: burst.trim().parse().map_err(|_| bad())?,
        };
        limit.validate()?;
        Ok(limit)
    }
}

/// What the switch does with a job's contributions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum JobMode {
    /// In-network aggregation.
    #[default]
    Aggregate,
    /// NoAggr baseline (ASK §5.7): the same packets through the same daemon,
    /// each contribution returned to its sender as a result, no aggregation
    /// state and no summation. Measures what aggregation costs over forwarding.
    Forward,
}

/// A job as admitted by the control plane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    pub job_id: u32,
    /// Source ids (ranks) of the members.
    pub members: Vec<u16>,
    /// Concurrent blocks the job may hold (SwitchML's pool size). Every slot
    /// has a shadow copy, so the job's memory is
    /// `2 * block_cnt_max * block_grad_max * 4` bytes.
    pub block_cnt_max: u32,
    /// Most elements per block.
    pub block_grad_max: u32,
    /// Block timeout in milliseconds for straggler aging (Trio's
    /// `block_exp`); 0 disables aging, and the job waits for every member
    /// as SwitchML does.
    #[serde(default)]
    pub block_exp_ms: u32,
    /// K: a source missing from the aged blocks of K consecutive windows
    /// (K x block_cnt_max blocks) is declared permanently slow and no longer
    /// waited for until it catches up or rejoins. 0 keeps every source
    /// temporary (each block waits the full timeout for it).
    #[serde(default = "default_slow_after_windows")]
    pub slow_after_windows: u32,
    #[serde(default)]
    pub mode: JobMode,
    /// Workers in the whole job, 0 = `members.len()`. In an aggregation
    /// tree a switch's members are its children (workers and switches), so
    /// the controller tells every switch the job's worker count: workers
    /// scale block floating point for it (JoinAck's `src_cnt`), and it is
    /// the most a tree can ever sum, so joins up to it cannot overflow.
    #[serde(default)]
    pub workers: u16,
    /// The job key (128 bits): every member seals its datagrams with the
    /// key [`fanin_wire::auth::derive_member_key`] derives from it for its
    /// source id, and the switch refuses what does not verify
    /// (docs/security.md). None: an unauthenticated job.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "crate::auth::hex_key")]
    pub key: Option<fanin_wire::auth::Key>,
    /// What happens when a worker dies (docs/failures.md).
    #[serde(default)]
    pub on_failure: FailurePolicy,
    /// A worker silent this long while a block has waited this long for it
    /// is dead; 0 = [`DEFAULT_MEMBER_TIMEOUT_MS`].
    #[serde(default)]
    pub member_timeout_ms: u32,
    /// Per-source rate limit; none = the switch's default (if any).
    #[serde(default)]
    pub rate_limit: Option<RateLimit>,
    /// An IPv4 multicast group ("239.1.0.7:47001") the switch sends
    /// completion results to, once, for every member whose Join said it
    /// listens there; the others get theirs by unicast as before
    /// (docs/protocol.md §4.5). Unkeyed jobs only: a keyed job's results are
    /// sealed for each member. None: unicast to every member.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_group: Option<std::net::SocketAddrV4>,
    /// GOAT's K (§V, Algorithm 2; docs/goat.md): a block completes with the
    /// first `quorum` of the members it waits for instead of all of them;
    /// the others' contributions arrive late, are never added, and are
    /// answered with the result, as a straggler's after aging. Such a
    /// result sums fewer members than the job has, so it is degraded and
    /// the job's members accept partial results. 0 = every member
    /// (SwitchML). May change while the job runs (`UpdateJob`: a GOAT
    /// controller installs K_t^s every epoch); a block opened before the
    /// change completes by the new K too.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub quorum: u16,
    /// The job ran on this switch of an aggregation tree before the switch
    /// restarted, and the control plane installs it again (it cannot tell
    /// whether the job's stream ran). The switches around it may hold
    /// results of the stream that this life never saw, so: a worker rank
    /// that has not joined this life may join only to recover (or with
    /// sync, into the running stream), and a plain Join is answered with
    /// Nack `TreeSwitchRestarted` (docs/trees.md, "A second run on a live
    /// tree"); and a child switch's partials are refused until it reported
    /// its subtree's lowest block in a recovery (docs/restart.md, "Trees").
    #[serde(default, skip_serializing_if = "is_false")]
    pub resumed: bool,
}

fn is_zero(n: &u16) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobSpecError {
    #[error("job {job_id}: members is empty (a job needs at least one source)")]
    NoMembers { job_id: u32 },
    #[error("job {job_id}: member id {id} is listed twice")]
    DuplicateMember { job_id: u32, id: u16 },
    #[error("job {job_id}: member id {id} is too large (source ids must be below {MAX_SOURCES})")]
    MemberTooLarge { job_id: u32, id: u16 },
    #[error("job {job_id}: block_cnt_max {value} is out of range (1..={MAX_BLOCK_CNT})")]
    BlockCnt { job_id: u32, value: u32 },
    #[error("job {job_id}: block_grad_max {value} is out of range (1..={MAX_GRAD_CNT}, the most elements one UDP datagram carries)")]
    BlockGrad { job_id: u32, value: u32 },
    #[error("job {job_id}: quorum {value} is above the job's {members} members (0 = every member)")]
    Quorum { job_id: u32, value: u16, members: usize },
    #[error("job {job_id}: block_exp_ms {value} is out of range (0 disables aging, at most {MAX_BLOCK_EXP_MS})")]
    BlockExp { job_id: u32, value: u32 },
    #[error("job {job_id}: slow_after_windows {value} is out of range (0 never declares a source permanently slow, at most {MAX_SLOW_AFTER_WINDOWS})")]
    SlowAfter { job_id: u32, value: u32 },
    #[error("job {job_id}: workers {value} is out of range (0 = the member count, at most {SWITCH_RANK_BASE})")]
    Workers { job_id: u32, value: u16 },
    #[error("job {job_id}: workers {workers} is fewer than its {members} worker members (workers is the most the job ever sums: its workers scale block floating point and averages for it, and a sum of more could overflow); set workers to at least {members}, or 0 for the member count")]
    FewerWorkersThanMembers { job_id: u32, workers: u16, members: usize },
    #[error("job {job_id}: member_timeout_ms {value} is out of range (0 = the default {DEFAULT_MEMBER_TIMEOUT_MS}, at most {MAX_MEMBER_TIMEOUT_MS})")]
    MemberTimeout { job_id: u32, value: u32 },
    #[error("job {job_id}: {message}")]
    RateLimit { job_id: u32, message: String },
    #[error("job {job_id}: result_group {group} is not an IPv4 multicast group with a port (use e.g. 239.1.0.7:47001)")]
    ResultGroup { job_id: u32, group: std::net::SocketAddrV4 },
}

impl JobSpec {
    /// A job whose members are sources `0..n`.
    pub fn with_sources(job_id: u32, n: u16, block_cnt_max: u32, block_grad_max: u32) -> Self {
        Self {
            job_id,
            members: (0..n).collect(),
            block_cnt_max,
            block_grad_max,
            block_exp_ms: 0,
            slow_after_windows: DEFAULT_SLOW_AFTER_WINDOWS,
            mode: JobMode::Aggregate,
            workers: 0,
            key: None,
            on_failure: FailurePolicy::Degrade,
            member_timeout_ms: 0,
            rate_limit: None,
            result_group: None,
            quorum: 0,
            resumed: false,
        }
    }

    /// The member timeout in force (the default for 0).
    pub fn member_timeout(&self) -> std::time::Duration {
        let ms = if self.member_timeout_ms == 0 { DEFAULT_MEMBER_TIMEOUT_MS } else { self.member_timeout_ms };
        std::time::Duration::from_millis(ms as u64)
    }

    pub fn validate(&self) -> Result<(), JobSpecError> {
        let job_id = self.job_id;
        if self.members.is_empty() {
            return Err(JobSpecError::NoMembers { job_id });
        }
        let mut seen = crate::mask::SourceMask::with_capacity(MAX_SOURCES);
        for &id in &self.members {
            if id as usize >= MAX_SOURCES {
                return Err(JobSpecError::MemberTooLarge { job_id, id });
            }
            if !seen.insert(id as usize) {
                return Err(JobSpecError::DuplicateMember { job_id, id });
            }
        }
        if self.block_cnt_max == 0 || self.block_cnt_max > MAX_BLOCK_CNT {
            return Err(JobSpecError::BlockCnt { job_id, value: self.block_cnt_max });
        }
        if self.block_grad_max == 0 || self.block_grad_max as usize > MAX_GRAD_CNT {
            return Err(JobSpecError::BlockGrad { job_id, value: self.block_grad_max });
        }
        if self.quorum as usize > self.members.len() {
            return Err(JobSpecError::Quorum { job_id, value: self.quorum, members: self.members.len() });
        }
        if self.block_exp_ms > MAX_BLOCK_EXP_MS {
            return Err(JobSpecError::BlockExp { job_id, value: self.block_exp_ms });
        }
        if self.slow_after_windows > MAX_SLOW_AFTER_WINDOWS {
            return Err(JobSpecError::SlowAfter { job_id, value: self.slow_after_windows });
        }
        if self.workers > SWITCH_RANK_BASE {
            return Err(JobSpecError::Workers { job_id, value: self.workers });
        }
        // (a tree switch's members also name child switches, which count
        // the workers below them: only its own workers are counted here)
        let worker_members = self.members.iter().filter(|&&m| m < SWITCH_RANK_BASE).count();
        if self.workers != 0 && worker_members > self.workers as usize {
            return Err(JobSpecError::FewerWorkersThanMembers { job_id, workers: self.workers, members: worker_members });
        }
        if self.member_timeout_ms > MAX_MEMBER_TIMEOUT_MS {
            return Err(JobSpecError::MemberTimeout { job_id, value: self.member_timeout_ms });
        }
        if let Some(limit) = &self.rate_limit {
            limit.validate().map_err(|message| JobSpecError::RateLimit { job_id, message })?;
        }
        if let Some(group) = self.result_group {
            if !group.ip().is_multicast() || group.port() == 0 {
                return Err(JobSpecError::ResultGroup { job_id, group });
            }
        }
        Ok(())
    }

    /// Switch memory the job may occupy at most, in bytes (slots and shadow
    /// copies; forwarding jobs hold none).
    pub fn memory_bytes(&self) -> u64 {
        match self.mode {
            JobMode::Aggregate => 2 * self.block_cnt_max as u64 * self.block_grad_max as u64 * 4,
            JobMode::Forward => 0,
        }
    }

    /// One more than the largest member id: the width of the job's masks.
    /// The first field fixed at admission that `new` changes, if any: a
    /// running job may change only its members, worker count (and, on a
    /// switch, its tree role).
    pub fn fixed_field_changed(&self, new: &JobSpec) -> Option<&'static str> {
        [
            ("block_cnt_max", self.block_cnt_max == new.block_cnt_max),
            ("block_grad_max", self.block_grad_max == new.block_grad_max),
            ("block_exp_ms", self.block_exp_ms == new.block_exp_ms),
            ("slow_after_windows", self.slow_after_windows == new.slow_after_windows),
            ("mode", self.mode == new.mode),
            ("key", self.key == new.key),
            ("result_group", self.result_group == new.result_group),
        ]
        .into_iter()
        .find_map(|(field, same)| (!same).then_some(field))
    }

    /// Whether blocks of this job may complete without every member, as
    /// the job asked (docs/protocol.md §6.2): aging, a quorum, degrading on
    /// a failure, or forwarding (NoAggr: each member gets its own data).
    pub fn partial_results(&self) -> bool {
        self.block_exp_ms > 0 || self.quorum > 0 || self.on_failure == FailurePolicy::Degrade || self.mode == JobMode::Forward
    }

    /// Whether `new` would make a job that hands only complete results hand
    /// partial ones: refused while it runs, since its members joined
    /// refusing them (their JoinAck said so). Dropping them is allowed.
    pub fn adds_partial_results(&self, new: &JobSpec) -> bool {
        !self.partial_results() && new.partial_results()
    }

    /// The job's worker count (see [`JobSpec::workers`]).
    pub fn worker_count(&self) -> u16 {
        if self.workers == 0 { self.members.len() as u16 } else { self.workers }
    }

    pub fn source_capacity(&self) -> usize {
        self.members.iter().map(|&m| m as usize + 1).max().unwrap_or(1)
    }
}

/// Which switch shard (data-plane port offset) owns block `block_id` of job
/// `job_id`. A slot's current block and its shadow copy map to the same
/// shard, so a shard owns its slots outright and needs no locks. Workers use
/// the same function to address the right port.
///
/// A job with fewer slots than the switch has shards spreads over its
/// first `block_cnt_max` shards only ([`job_shards`]), so shard 0, which
/// answers every Join and decides where rounds start, always owns one of
/// its slots (spread over all shards from an offset, some jobs left shard
/// 0 without a slot, and it then started rounds below the running stream).
pub fn shard_of(job_id: u32, block_id: u32, block_cnt_max: u32, shard_count: u16) -> u16 {
    let slot = block_id % block_cnt_max.max(1);
    ((slot as u64 + job_id as u64) % job_shards(block_cnt_max, shard_count) as u64) as u16
}

/// How many of `shard_count` shards hold slots of a job with
/// `block_cnt_max` slots: shards `0..job_shards` ([`shard_of`]).
pub fn job_shards(block_cnt_max: u32, shard_count: u16) -> u16 {
    (shard_count.max(1) as u32).min(block_cnt_max.max(1)) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_problem() {
        let mut spec = JobSpec::with_sources(3, 4, 64, 1024);
        assert!(spec.validate().is_ok());
        spec.members.push(2);
        assert_eq!(spec.validate().unwrap_err().to_string(), "job 3: member id 2 is listed twice");
        spec.members = vec![];
        assert!(matches!(spec.validate(), Err(JobSpecError::NoMembers { .. })));
        let mut spec = JobSpec::with_sources(3, 4, 0, 1024);
        assert!(spec.validate().unwrap_err().to_string().contains("block_cnt_max 0"));
        spec.block_cnt_max = 8;
        spec.block_grad_max = 100_000;
        assert!(spec.validate().unwrap_err().to_string().contains("block_grad_max 100000"));
        spec.block_grad_max = 16;
        spec.members = vec![5000];
        assert!(matches!(spec.validate(), Err(JobSpecError::MemberTooLarge { id: 5000, .. })));
        spec.members = vec![0, 1];
        spec.block_exp_ms = 600_001;
        assert!(spec.validate().unwrap_err().to_string().contains("block_exp_ms 600001"));
        spec.block_exp_ms = 10;
        spec.slow_after_windows = 10_001;
        assert!(spec.validate().unwrap_err().to_string().contains("slow_after_windows 10001"));
        spec.slow_after_windows = 2;
        spec.member_timeout_ms = 600_001;
        assert!(spec.validate().unwrap_err().to_string().contains("member_timeout_ms 600001"));
        spec.member_timeout_ms = 0;
        assert_eq!(spec.member_timeout(), std::time::Duration::from_millis(DEFAULT_MEMBER_TIMEOUT_MS as u64));
        spec.workers = 1;
        assert_eq!(
            spec.validate().unwrap_err().to_string(),
            "job 3: workers 1 is fewer than its 2 worker members (workers is the most the job ever sums: its workers scale block floating point and averages for it, and a sum of more could overflow); set workers to at least 2, or 0 for the member count"
        );
        spec.members = vec![0, SWITCH_RANK_BASE + 1, SWITCH_RANK_BASE + 2];
        assert!(spec.validate().is_ok(), "child switches count the workers below them");
        spec.members = vec![0, 1];
        spec.workers = 0;
        spec.rate_limit = Some(RateLimit { pps: 0, burst: 4 });
        assert!(spec.validate().unwrap_err().to_string().contains("at least 1"));
        spec.rate_limit = None;
        spec.result_group = Some("127.0.0.1:4000".parse().unwrap());
        assert!(spec.validate().unwrap_err().to_string().contains("result_group 127.0.0.1:4000 is not an IPv4 multicast group"));
        spec.result_group = Some("239.1.0.7:0".parse().unwrap());
        assert!(spec.validate().unwrap_err().to_string().contains("with a port"));
        spec.result_group = Some("239.1.0.7:47001".parse().unwrap());
        assert!(spec.validate().is_ok());
        // a keyed job may have one too: its results are sealed once under
        // the job's result key (docs/security.md)
        spec.key = Some(fanin_wire::auth::Key([7; 16]));
        assert!(spec.validate().is_ok());
    }

    #[test]
    fn a_result_group_reads_from_json_and_stays_fixed() {
        let spec: JobSpec = serde_json::from_str(
            r#"{"job_id": 1, "members": [0, 1], "block_cnt_max": 8, "block_grad_max": 64, "result_group": "239.1.0.7:47001"}"#,
        )
        .unwrap();
        assert_eq!(spec.result_group, Some("239.1.0.7:47001".parse().unwrap()));
        let err = serde_json::from_str::<JobSpec>(
            r#"{"job_id": 1, "members": [0], "block_cnt_max": 8, "block_grad_max": 64, "result_group": "239.1.0.7"}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("socket address"), "{err}");
        let unicast = JobSpec { result_group: None, ..spec.clone() };
        assert_eq!(spec.fixed_field_changed(&unicast), Some("result_group"));
    }

    #[test]
    fn rate_limits_and_policies_parse_or_say_why_not() {
        assert_eq!(RateLimit::parse("1000, 32"), Ok(RateLimit { pps: 1000, burst: 32 }));
        for bad in ["1000", "a,b", "0,5", "5,0", "-1,3"] {
            assert!(RateLimit::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(FailurePolicy::parse("fail"), Ok(FailurePolicy::Fail));
        assert!(FailurePolicy::parse("retry").unwrap_err().contains("degrade or fail"));
    }

    #[test]
    fn shard_0_owns_a_slot_of_every_job_and_no_shard_past_the_slots_owns_one() {
        for slots in 1..10u32 {
            for shards in 1..12u16 {
                for job in 0..20u32 {
                    let owners: std::collections::BTreeSet<u16> =
                        (0..slots).map(|k| shard_of(job, k, slots, shards)).collect();
                    let spread = job_shards(slots, shards);
                    assert_eq!(owners, (0..spread).collect(), "job {job}, {slots} slots, {shards} shards");
                }
            }
        }
    }

    #[test]
    fn slot_and_shadow_share_a_shard_and_shards_balance() {
        for t in 1..5u16 {
            let mut per_shard = vec![0; t as usize];
            for b in 0..64u32 {
                assert_eq!(shard_of(9, b, 16, t), shard_of(9, b + 16, 16, t));
                per_shard[shard_of(9, b, 16, t) as usize] += 1;
            }
            let (lo, hi) = (per_shard.iter().min().unwrap(), per_shard.iter().max().unwrap());
            assert!(hi - lo <= 16, "{per_shard:?}");
        }
    }
}
