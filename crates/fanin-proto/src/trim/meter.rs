//! Ingress-pipeline trimming of the paper's Tofino design.
//!
//! Each ingress pipeline keeps, for every egress port, three meters
//! (`meter_optimistic` at line rate, `meter_halftimistic` at 50%,
//! `meter_pessimistic` at 25%) and two soft-state deadlines (`t0_reg`,
//! `t1_reg`). A congestion notification (a deflected packet seen by the DoD
//! recirculation port) sets `t0_reg = now + T0`, `t1_reg = now + T1`. On every
//! data packet all three meters execute; the colour of the meter selected by
//! the port state decides whether the packet is trimmed (paper §5 pseudo-code):
//!
//! ```text
//! now <= t0_reg  -> pessimistic      (25% of line rate)
//! now <= t1_reg  -> half-pessimistic (50%)
//! otherwise      -> optimistic       (100%), registers cleared
//! ```

use core::time::Duration;

use crate::time::Time;

/// Meter output. Two colours suffice: the paper trims on RED.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Color {
    Green,
    Red,
}

/// A single-rate two-colour token bucket.
///
/// Tokens are counted in millibits so that a rate in whole Mbit/s adds an
/// exact integer number of tokens per nanosecond: no drift, no floats, the
/// same decisions on every machine. Rates are taken in whole kbit/s.
#[derive(Debug, Clone)]
pub struct Meter {
    rate_bps: u64,
    burst_mbits: u64,
    tokens_mbits: u64,
    last: Time,
}

impl Meter {
    /// A meter at `rate_bps` with a bucket of `burst_bytes`, starting full.
    pub fn new(rate_bps: u64, burst_bytes: u32) -> Self {
        let burst_mbits = burst_bytes as u64 * 8_000;
        Self { rate_bps, burst_mbits, tokens_mbits: burst_mbits, last: Time::ZERO }
    }

    pub fn rate_bps(&self) -> u64 {
        self.rate_bps
    }

    /// Account a packet of `bytes` arriving at `now`: GREEN (tokens taken) if
    /// it conforms, RED (tokens untouched) if it does not.
    pub fn execute(&mut self, now: Time, bytes: u32) -> Color {
        if now > self.last {
            // kbit/s x ns / 1000 = millibits; dt is capped at 1 s, where any
            // realistic bucket is full anyway, so u64 cannot overflow.
            let dt = (now.as_nanos() - self.last.as_nanos()).min(1_000_000_000);
            let add = self.rate_bps / 1000 * dt / 1000;
            self.tokens_mbits = self.tokens_mbits.saturating_add(add).min(self.burst_mbits);
            self.last = now;
        }
        let need = bytes as u64 * 8_000;
        if self.tokens_mbits >= need {
            self.tokens_mbits -= need;
            Color::Green
        } else {
            Color::Red
        }
    }
}

/// The three states of Fig. 3.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MeterMode {
    Optimistic,
    HalfPessimistic,
    Pessimistic,
}

/// The soft state of one (pipeline, egress port): the paper's `t0_reg` and
/// `t1_reg`. `None` is the register value 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PortModeState {
    pub t0_reg: Option<Time>,
    pub t1_reg: Option<Time>,
}

impl PortModeState {
    /// A congestion notification: pessimistic until `now + t0`, then
    /// half-pessimistic until `now + t1`. A later notification restarts both.
    pub fn notify(&mut self, now: Time, t0: Duration, t1: Duration) {
        self.t0_reg = Some(now + t0);
        self.t1_reg = Some(now + t1.max(t0));
    }

    /// The mode at `now` without changing state.
    pub fn mode(&self, now: Time) -> MeterMode {
        match (self.t0_reg, self.t1_reg) {
            (Some(t0), _) if now <= t0 => MeterMode::Pessimistic,
            (_, Some(t1)) if now <= t1 => MeterMode::HalfPessimistic,
            _ => MeterMode::Optimistic,
        }
    }

    /// The mode at `now`; clears expired registers as the P4 code does.
    pub fn update(&mut self, now: Time) -> MeterMode {
        let mode = self.mode(now);
        if mode == MeterMode::Optimistic {
            *self = PortModeState::default();
        }
        mode
    }
}

/// Which ingress pipelines a congestion notification reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotifyScope {
    /// No congestion response: meters stay optimistic ("DoD only" in Fig. 5).
    None,
    /// Only the pipeline whose DoD port saw the deflected packet (Fig. 9 what-if).
    OriginPipeline,
    /// Every pipeline, through a multicast group (the paper's design).
    AllPipelines,
}

/// Parameters of the ingress trimmer. Defaults are the paper's §6.2 values.
#[derive(Debug, Clone)]
pub struct TrimControlConfig {
    pub pipelines: usize,
    pub ports_per_pipeline: usize,
    pub line_rate_bps: u64,
    /// Bucket depth of every meter: the virtual output queue it emulates.
    pub meter_burst_bytes: u32,
    /// Pessimistic period after a notification (6 µs in §6.2).
    pub t0: Duration,
    /// End of the half-pessimistic period, measured from the notification
    /// (6 µs + 18 µs = 24 µs in §6.2).
    pub t1: Duration,
    /// Meter rates as fractions of line rate, in per mille.
    pub optimistic_permille: u32,
    pub half_pessimistic_permille: u32,
    pub pessimistic_permille: u32,
    /// Fig. 9 what-if: pessimistic mode trims every packet ("100% trimming").
    pub pessimistic_trims_all: bool,
    pub notify: NotifyScope,
}

impl Default for TrimControlConfig {
    fn default() -> Self {
        Self {
            pipelines: 4,
            ports_per_pipeline: 16,
            line_rate_bps: 100_000_000_000,
            meter_burst_bytes: 15_000,
            t0: Duration::from_micros(6),
            t1: Duration::from_micros(24),
            optimistic_permille: 1000,
            half_pessimistic_permille: 500,
            pessimistic_permille: 250,
            pessimistic_trims_all: false,
            notify: NotifyScope::AllPipelines,
        }
    }
}

/// Decision for one data packet in an ingress pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IngressVerdict {
    /// Send the whole packet to the traffic manager.
    Forward,
    /// Cut the payload here; the header goes to the egress port's header queue.
    Trim(MeterMode),
}

#[derive(Debug, Clone)]
struct Cell {
    meters: [Meter; 3],
    state: PortModeState,
}

/// The ingress trimming of all pipelines of one switch.
///
/// Calling contract: [`IngressTrimmer::on_data`] for every data packet entering
/// ingress pipeline `p` towards egress port `e`, [`IngressTrimmer::on_notify`]
/// when a congestion notification for `e` arrives from pipeline `origin`'s
/// recirculation port. State is soft: no timer needs to be driven.
#[derive(Debug, Clone)]
pub struct IngressTrimmer {
    config: TrimControlConfig,
    cells: Vec<Cell>,
    trims: [u64; 3],
    notifications: u64,
}

impl IngressTrimmer {
    pub fn new(config: TrimControlConfig) -> Self {
        let ports = config.pipelines * config.ports_per_pipeline;
        let rate = |permille: u32| config.line_rate_bps / 1000 * permille as u64;
        let cell = Cell {
            meters: [
                Meter::new(rate(config.optimistic_permille), config.meter_burst_bytes),
                Meter::new(rate(config.half_pessimistic_permille), config.meter_burst_bytes),
                Meter::new(rate(config.pessimistic_permille), config.meter_burst_bytes),
            ],
            state: PortModeState::default(),
        };
        Self { cells: vec![cell; config.pipelines * ports], config, trims: [0; 3], notifications: 0 }
    }

    pub fn config(&self) -> &TrimControlConfig {
        &self.config
    }

    fn ports(&self) -> usize {
        self.config.pipelines * self.config.ports_per_pipeline
    }

    fn cell(&mut self, pipeline: usize, egress_port: usize) -> &mut Cell {
        let ports = self.ports();
        &mut self.cells[pipeline * ports + egress_port]
    }

    /// The pipeline a front-panel port belongs to.
    pub fn pipeline_of(&self, port: usize) -> usize {
        (port / self.config.ports_per_pipeline).min(self.config.pipelines - 1)
    }

    /// Decide the fate of a data packet of `bytes` (paper §5 pseudo-code).
    pub fn on_data(&mut self, now: Time, pipeline: usize, egress_port: usize, bytes: u32) -> IngressVerdict {
        let trims_all = self.config.pessimistic_trims_all;
        let cell = self.cell(pipeline, egress_port);
        let colors = [
            cell.meters[0].execute(now, bytes),
            cell.meters[1].execute(now, bytes),
            cell.meters[2].execute(now, bytes),
        ];
        let mode = cell.state.update(now);
        let color = match mode {
            MeterMode::Optimistic => colors[0],
            MeterMode::HalfPessimistic => colors[1],
            MeterMode::Pessimistic if trims_all => Color::Red,
            MeterMode::Pessimistic => colors[2],
        };
        if color == Color::Red {
            self.trims[mode as usize] += 1;
            IngressVerdict::Trim(mode)
        } else {
            IngressVerdict::Forward
        }
    }

    /// A congestion notification for `egress_port` from `origin_pipeline`.
    pub fn on_notify(&mut self, now: Time, origin_pipeline: usize, egress_port: usize) {
        let (t0, t1) = (self.config.t0, self.config.t1);
        match self.config.notify {
            NotifyScope::None => return,
            NotifyScope::OriginPipeline => self.cell(origin_pipeline, egress_port).state.notify(now, t0, t1),
            NotifyScope::AllPipelines => {
                for p in 0..self.config.pipelines {
                    self.cell(p, egress_port).state.notify(now, t0, t1);
                }
            }
        }
        self.notifications += 1;
    }

    /// The mode pipeline `pipeline` would use for `egress_port` at `now`.
    pub fn mode(&self, now: Time, pipeline: usize, egress_port: usize) -> MeterMode {
        self.cells[pipeline * self.ports() + egress_port].state.mode(now)
    }

    /// Packets trimmed in ingress, by the mode that trimmed them
    /// (optimistic, half-pessimistic, pessimistic).
    pub fn trims_by_mode(&self) -> [u64; 3] {
        self.trims
    }

    pub fn notifications(&self) -> u64 {
        self.notifications
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(x: u64) -> Time {
        Time::from_nanos(x * 1000)
    }

    #[test]
    fn meter_passes_its_rate_and_burst_then_marks_red() {
        // 100 Gbit/s, burst of two 1500 B packets: 1500 B refills in 120 ns.
        let mut m = Meter::new(100_000_000_000, 3000);
        let t = Time::from_nanos(1000);
        assert_eq!(m.execute(t, 1500), Color::Green);
        assert_eq!(m.execute(t, 1500), Color::Green);
        assert_eq!(m.execute(t, 1500), Color::Red);
        assert_eq!(m.execute(Time::from_nanos(1119), 1500), Color::Red);
        assert_eq!(m.execute(Time::from_nanos(1120), 1500), Color::Green);
        // Offered at 200 Gbit/s for 1.2 µs (20 packets every 60 ns): about half pass.
        let mut m = Meter::new(100_000_000_000, 1500);
        let green = (0..200).filter(|i| m.execute(Time::from_nanos(i * 60), 1500) == Color::Green).count();
        assert!((100..=102).contains(&green), "{green}");
    }

    #[test]
    fn mode_transitions_follow_t0_then_t1_and_restart_on_notify() {
        let mut s = PortModeState::default();
        let (t0, t1) = (Duration::from_micros(6), Duration::from_micros(24));
        assert_eq!(s.update(us(0)), MeterMode::Optimistic);
        s.notify(us(10), t0, t1);
        assert_eq!(s.mode(us(10)), MeterMode::Pessimistic);
        assert_eq!(s.mode(us(16)), MeterMode::Pessimistic);
        assert_eq!(s.mode(Time::from_nanos(16_001)), MeterMode::HalfPessimistic);
        // A notification during half-pessimistic restarts T0 and T1.
        s.notify(us(20), t0, t1);
        assert_eq!(s.mode(us(25)), MeterMode::Pessimistic);
        assert_eq!(s.mode(us(27)), MeterMode::HalfPessimistic);
        assert_eq!(s.mode(us(44)), MeterMode::HalfPessimistic);
        assert_eq!(s.update(Time::from_nanos(44_001)), MeterMode::Optimistic);
        assert_eq!(s, PortModeState::default(), "expired registers are cleared");
    }

    #[test]
    fn without_half_pessimistic_t1_equal_t0_goes_straight_back() {
        let mut s = PortModeState::default();
        s.notify(us(0), Duration::from_micros(6), Duration::from_micros(6));
        assert_eq!(s.mode(us(6)), MeterMode::Pessimistic);
        assert_eq!(s.mode(Time::from_nanos(6_001)), MeterMode::Optimistic);
    }

    fn offered_pass_fraction(trimmer: &mut IngressTrimmer, pipeline: usize, from_us: u64) -> f64 {
        // 100 Gbit/s of 1500 B packets (one per 120 ns) for 12 µs.
        let mut fwd = 0;
        for i in 0..100u64 {
            let t = Time::from_nanos(from_us * 1000 + i * 120);
            if trimmer.on_data(t, pipeline, 3, 1500) == IngressVerdict::Forward {
                fwd += 1;
            }
        }
        fwd as f64 / 100.0
    }

    #[test]
    fn notify_all_moves_every_pipeline_and_the_meters_follow_the_mode() {
        let cfg = TrimControlConfig { meter_burst_bytes: 1500, ..TrimControlConfig::default() };
        let mut tr = IngressTrimmer::new(cfg);
        // Optimistic: line rate passes.
        assert_eq!(offered_pass_fraction(&mut tr, 1, 0), 1.0);
        tr.on_notify(us(20), 0, 3);
        for p in 0..4 {
            assert_eq!(tr.mode(us(20), p, 3), MeterMode::Pessimistic);
            assert_eq!(tr.mode(us(20), p, 4), MeterMode::Optimistic);
        }
        // Pessimistic passes a quarter; 12 µs of traffic spans T0 (6 µs) and
        // then half-pessimistic.
        let f = offered_pass_fraction(&mut tr, 1, 20);
        assert!((0.35..=0.40).contains(&f), "mixed 25%/50% fraction {f}");
        assert_eq!(tr.notifications(), 1);
        let by_mode = tr.trims_by_mode();
        assert_eq!(by_mode[0], 0);
        assert!(by_mode[1] > 0 && by_mode[2] > 0, "{by_mode:?}");
    }

    #[test]
    fn notify_origin_only_and_none_scopes() {
        let mut tr = IngressTrimmer::new(TrimControlConfig { notify: NotifyScope::OriginPipeline, ..Default::default() });
        tr.on_notify(us(1), 2, 5);
        assert_eq!(tr.mode(us(1), 2, 5), MeterMode::Pessimistic);
        assert_eq!(tr.mode(us(1), 0, 5), MeterMode::Optimistic);
        let mut tr = IngressTrimmer::new(TrimControlConfig { notify: NotifyScope::None, ..Default::default() });
        tr.on_notify(us(1), 2, 5);
        assert_eq!(tr.mode(us(1), 2, 5), MeterMode::Optimistic);
        assert_eq!(tr.notifications(), 0);
    }

    #[test]
    fn pessimistic_trims_all_variant() {
        let mut tr = IngressTrimmer::new(TrimControlConfig { pessimistic_trims_all: true, ..Default::default() });
        tr.on_notify(us(0), 0, 0);
        assert_eq!(tr.on_data(us(1), 0, 0, 64), IngressVerdict::Trim(MeterMode::Pessimistic));
        assert_eq!(tr.on_data(us(7), 0, 0, 64), IngressVerdict::Forward);
    }
}
