//! Where a ring call's time goes on each rank's compute stream, where asked
//! (`RingOptions::timings`): timing events around the attention calls, the merges and the waits
//! for the next K/V shard, summed once the call is done. They explain a scaling figure: the
//! attention is the work one GPU would do too, the rest is the ring's own cost.

use crate::error::Result;
use cudarc::driver::{CudaEvent, CudaStream, sys::CUevent_flags};

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
