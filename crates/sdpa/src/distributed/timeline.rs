//! Where a ring call's time goes, where asked (`RingOptions::timings`): on each rank's compute
//! stream, timing events around the attention calls, the merges and the waits for the next K/V
//! shard, summed once the call is done; on the host thread, the time between the call's
//! phases. They explain a scaling figure: the attention is the work one GPU would do too, the
//! rest is the ring's own cost, on the GPUs or before and after their work.

use crate::error::Result;
use cudarc::driver::{CudaEvent, CudaStream, sys::CUevent_flags};
use std::time::Instant;

/// Milliseconds of one rank's compute stream in one ring call.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RankTimings {
    /// The rank.
    pub rank: usize,
    /// In the attention calls.
    pub attention_ms: f64,
    /// In folding partial results into the running one, and writing the output.
    pub merge_ms: f64,
    /// Idle, waiting for a K/V shard to arrive from the previous rank.
    pub waiting_ms: f64,
    /// From the first of these to the last: the call on this rank's GPU.
    pub total_ms: f64,
}

/// What a span of a rank's compute stream was spent on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Attention,
    Merge,
    Waiting,
}

/// One rank's spans in one call: pairs of timing events on its compute stream.
pub(crate) struct Timeline {
    spans: Vec<(Phase, CudaEvent, CudaEvent)>,
}

impl Timeline {
    pub(crate) fn new() -> Timeline {
        Timeline { spans: Vec::new() }
    }

    /// A timing event recorded on `stream` now: the start or end of a span.
    pub(crate) fn mark(stream: &CudaStream) -> Result<CudaEvent> {
        Ok(stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
    }

    /// The work `stream` queues between `start` and now, spent on `phase`.
    pub(crate) fn close(
        &mut self,
        phase: Phase,
        start: CudaEvent,
        stream: &CudaStream,
    ) -> Result<()> {
        let end = Timeline::mark(stream)?;
        self.spans.push((phase, start, end));
        Ok(())
    }

    /// Runs `f`, which queues work on `stream`, as a span of `phase` where `timeline` is kept.
    pub(crate) fn span<R>(
        timeline: &mut Option<Timeline>,
        phase: Phase,
        stream: &CudaStream,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let Some(tl) = timeline else { return f() };
        let start = Timeline::mark(stream)?;
        let out = f()?;
        tl.close(phase, start, stream)?;
        Ok(out)
    }

    /// The sums, once every event has completed (it waits for them).
    pub(crate) fn sum(&self, rank: usize) -> Result<RankTimings> {
        let mut t = RankTimings {
            rank,
            ..RankTimings::default()
        };
        for (phase, start, end) in &self.spans {
            let ms = f64::from(start.elapsed_ms(end)?);
            match phase {
                Phase::Attention => t.attention_ms += ms,
                Phase::Merge => t.merge_ms += ms,
                Phase::Waiting => t.waiting_ms += ms,
            }
        }
        if let (Some((_, first, _)), Some((_, _, last))) = (self.spans.first(), self.spans.last()) {
            t.total_ms = f64::from(first.elapsed_ms(last)?);
        }
        Ok(t)
    }
}

/// Milliseconds of the host thread in one ring call, phase by phase: what a call costs around
/// its GPU work (the GPUs idle while the host checks, agrees and sets up, until the first
/// launch).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct HostTimings {
    /// Checking the problem and the shards.
    pub checks_ms: f64,
    /// The ranks' agreement on the problem: an all-reduce and its result back on the host
    /// (NCCL rings; it waits for the slowest rank to arrive).
    pub agree_ms: f64,
    /// Ordering the call after the shards' streams, readying buffers and running results.
    pub setup_ms: f64,
    /// Queueing every step: attention calls, merges and K/V hand-overs (the host waits for
    /// NCCL to take each hand-over).
    pub issue_ms: f64,
    /// Waiting for the GPUs to finish, and reading the timing events.
    pub wait_ms: f64,
}

impl HostTimings {
    /// The whole call on the host.
    pub fn total_ms(&self) -> f64 {
        self.checks_ms + self.agree_ms + self.setup_ms + self.issue_ms + self.wait_ms
    }
}

/// A phase of a ring call on the host thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HostPhase {
    Checks,
    Agree,
    Setup,
    Issue,
    Wait,
}

/// The host thread's clock for one call: each mark ends the span since the previous one.
pub(crate) struct HostClock {
    since: Instant,
    t: HostTimings,
}

impl HostClock {
    pub(crate) fn start() -> HostClock {
        HostClock {
            since: Instant::now(),
            t: HostTimings::default(),
        }
    }

    /// Ends the span since the previous mark (or the start), spent on `phase`, where a clock
    /// is kept.
    pub(crate) fn mark(clock: &mut Option<HostClock>, phase: HostPhase) {
        let Some(c) = clock else { return };
        let now = Instant::now();
        let ms = (now - c.since).as_secs_f64() * 1e3;
        c.since = now;
        let slot = match phase {
            HostPhase::Checks => &mut c.t.checks_ms,
            HostPhase::Agree => &mut c.t.agree_ms,
            HostPhase::Setup => &mut c.t.setup_ms,
            HostPhase::Issue => &mut c.t.issue_ms,
            HostPhase::Wait => &mut c.t.wait_ms,
        };
        *slot += ms;
    }

    pub(crate) fn timings(&self) -> HostTimings {
        self.t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Each mark charges the time since the previous one to its phase; phases add up; without
    /// a clock a mark does nothing.
    #[test]
    fn host_marks_charge_the_time_since_the_last_one() {
        let mut clock = Some(HostClock::start());
        std::thread::sleep(Duration::from_millis(3));
        HostClock::mark(&mut clock, HostPhase::Checks);
        std::thread::sleep(Duration::from_millis(2));
        HostClock::mark(&mut clock, HostPhase::Issue);
        HostClock::mark(&mut clock, HostPhase::Checks);
        let t = clock.as_ref().unwrap().timings();
        assert!(t.checks_ms >= 3.0 && t.checks_ms < 1000.0, "{t:?}");
        assert!(t.issue_ms >= 2.0, "{t:?}");
        assert_eq!((t.agree_ms, t.setup_ms, t.wait_ms), (0.0, 0.0, 0.0));
        assert_eq!(t.total_ms(), t.checks_ms + t.issue_ms);
        let mut none = None;
        HostClock::mark(&mut none, HostPhase::Wait);
        assert!(none.is_none());
    }
}
