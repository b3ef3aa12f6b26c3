//! GPU timing, the same way everywhere (docs/perf.md, "How to measure"): CUDA events, warm-up
//! first, medians. `us_graph` is the per-call time inside a CUDA graph of many calls (the kernel
//! without launch gaps); `us_event` is one call between two events (what a caller sees);
//! `us_host` is the host's time to check and enqueue one call (outside graphs: what a decode loop
//! that does not capture pays each step on the CPU).

use crate::inputs::tensors;
use cudarc::driver::{CudaGraph, sys};
use rand::{RngExt, SeedableRng, rngs::StdRng};
use sdpa::{Backend, Device, Error, Problem, Result, Tensor};
use std::time::Instant;

/// Median per-call times in microseconds, with the samples' statistics.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Per call inside a CUDA graph of many calls (median of the replays).
    pub us_graph: f64,
    /// One call between two events, host-side argument checking included (median).
    pub us_event: f64,
    /// The host's time to check and enqueue one call, back to back outside a graph (median).
    pub us_host: f64,
    /// The graph replays' per-call times.
    pub graph: Stats,
    /// The single launches' times.
    pub event: Stats,
}

/// What a set of timing samples says: how many, their spread, and how well the median is known.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stats {
    /// Number of samples.
    pub n: usize,
    /// Median.
    pub median: f64,
    /// Smallest sample.
    pub min: f64,
    /// Largest sample.
    pub max: f64,
    /// 95% bootstrap confidence interval of the median (percentile method, 1000 resamples).
    pub ci95: (f64, f64),
}

impl Stats {
    /// The statistics of `samples` (at least one). The bootstrap draws from a fixed seed, so the
    /// same samples give the same interval.
    pub fn of(samples: &[f64]) -> Stats {
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        let median = median(&sorted);
        let mut rng = StdRng::seed_from_u64(0x5eed);
        let mut medians: Vec<f64> = (0..BOOTSTRAP_RESAMPLES)
            .map(|_| {
                let mut draw: Vec<f64> = (0..sorted.len())
                    .map(|_| sorted[rng.random_range(0..sorted.len())])
                    .collect();
                draw.sort_by(f64::total_cmp);
                self::median(&draw)
            })
            .collect();
        medians.sort_by(f64::total_cmp);
        let at = |q: f64| medians[((q * (medians.len() - 1) as f64).round()) as usize];
        Stats {
            n: sorted.len(),
            median,
            min: sorted[0],
            max: sorted[sorted.len() - 1],
            ci95: (at(0.025), at(0.975)),
        }
    }
}

const BOOTSTRAP_RESAMPLES: usize = 1000;

/// Median of sorted, non-empty samples.
fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        0.5 * (sorted[n / 2 - 1] + sorted[n / 2])
    }
}

impl Timing {
    fn from_samples(graph: &[f64], event: &[f64], host: &[f64]) -> Timing {
        let (graph, event) = (Stats::of(graph), Stats::of(event));
        Timing {
            us_graph: graph.median,
            us_event: event.median,
            us_host: Stats::of(host).median,
            graph,
            event,
        }
    }
}

/// Device time of the work `f` enqueues on `dev`'s stream, between two CUDA events.
pub fn elapsed(dev: &Device, f: impl FnOnce() -> Result<()>) -> Result<std::time::Duration> {
    let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let ctx = dev.stream().context();
    let (start, end) = (ctx.new_event(flags)?, ctx.new_event(flags)?);
    start.record(dev.stream())?;
    f()?;
    end.record(dev.stream())?;
    let ms = f64::from(start.elapsed_ms(&end)?);
    Ok(std::time::Duration::from_secs_f64(ms * 1e-3))
}

/// Times `f` (which must only enqueue work on `dev`'s stream) with events and in a graph.
/// `budget_ms` bounds the total time spent (roughly; at least a few repetitions run).
pub fn time_gpu(dev: &Device, budget_ms: f64, mut f: impl FnMut() -> Result<()>) -> Result<Timing> {
    let ctx = dev.stream().context();
    let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let (start, end) = (ctx.new_event(flags)?, ctx.new_event(flags)?);
    let stream = dev.stream();
    let once = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        start.record(stream)?;
        f()?;
        end.record(stream)?;
        Ok(f64::from(start.elapsed_ms(&end)?) * 1e3)
    };
    for _ in 0..3 {
        f()?;
    }
    dev.synchronize()?;
    let first_us = once(&mut f)?.max(1.0);

    let share_us = budget_ms * 1e3 / 2.0;
    let reps = ((share_us / first_us) as usize).clamp(5, 200);
    let events: Vec<f64> = (0..reps).map(|_| once(&mut f)).collect::<Result<_>>()?;
    // The host's share: calls back to back, each timed on the host clock alone (enqueueing
    // only; the GPU runs behind), then one wait.
    let host: Vec<f64> = (0..reps.max(50))
        .map(|_| {
            let t = Instant::now();
            f().map(|()| t.elapsed().as_secs_f64() * 1e6)
        })
        .collect::<Result<_>>()?;
    dev.synchronize()?;

    let (graph, calls) = capture(dev, first_us, &mut f)?;
    let replays = ((share_us / (first_us * calls as f64)) as usize).clamp(3, 50);
    let mut per_call = Vec::with_capacity(replays);
    for _ in 0..replays {
        start.record(stream)?;
        graph.launch()?;
        end.record(stream)?;
        per_call.push(f64::from(start.elapsed_ms(&end)?) * 1e3 / calls as f64);
    }
    Ok(Timing::from_samples(&per_call, &events, &host))
}

/// `f` captured into a CUDA graph of enough calls that a replay lasts about 2 ms (the graph's
/// own launch amortized), uploaded and replayed once; `call_us` is one call's time.
fn capture(
    dev: &Device,
    call_us: f64,
    f: &mut dyn FnMut() -> Result<()>,
) -> Result<(CudaGraph, usize)> {
    let stream = dev.stream();
    let calls = ((2000.0 / call_us) as usize).clamp(2, 200);
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let captured: Result<()> = (0..calls).try_for_each(|_| f());
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    captured?;
    let graph = graph?.ok_or_else(|| Error::Cuda("stream capture produced no graph".into()))?;
    graph.upload()?;
    graph.launch()?;
    dev.synchronize()?;
    Ok((graph, calls))
}

/// Where a sustained run is when it calls its observer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The warm-up is over and the GPU idle: the measured window starts now.
    Start,
    /// Replays are in flight (called after each batch of replays is enqueued).
    Running,
    /// The last replay has finished: the measured window ends now.
    End,
}

/// What a sustained run measured between `Phase::Start` and `Phase::End`.
#[derive(Debug, Clone, Copy)]
pub struct Sustained {
    /// Calls of `f` that ran in the window.
    pub calls: u64,
    /// The window's length on the host clock.
    pub seconds: f64,
}

impl Sustained {
    /// Wall time per call in the window, microseconds (the launch of each ~2 ms replay
    /// included: a few microseconds in thousands).
    pub fn us_per_call(&self) -> f64 {
        self.seconds * 1e6 / self.calls as f64
    }
}

/// Runs `f` (which must only enqueue work on `dev`'s stream) back to back, captured in a graph,
/// for about `seconds`: the first quarter warms the GPU up to the clock and power it holds under
/// load, the rest is the measured window, which `observe` brackets (`Phase::Start`, `End`) and
/// is called in (`Running`, between batches of replays: for sampling clocks or power).
pub fn sustain(
    dev: &Device,
    seconds: f64,
    mut f: impl FnMut() -> Result<()>,
    mut observe: impl FnMut(Phase),
) -> Result<Sustained> {
    let call_us = (elapsed(dev, &mut f)?.as_secs_f64() * 1e6).max(1.0);
    let (graph, calls) = capture(dev, call_us, &mut f)?;
    // Replays of ~2 ms enqueued in batches of 8, the host waiting for each batch before the
    // next: the queue stays short and the GPU busy but for one launch gap a batch.
    let batch = |graph: &CudaGraph| -> Result<()> {
        for _ in 0..8 {
            graph.launch()?;
        }
        Ok(())
    };
    let run_for = |secs: f64, observe: &mut dyn FnMut(Phase)| -> Result<u64> {
        let t0 = Instant::now();
        let mut replays = 0u64;
        while replays == 0 || t0.elapsed().as_secs_f64() < secs {
            batch(&graph)?;
            replays += 8;
            observe(Phase::Running);
            dev.synchronize()?;
        }
        Ok(replays)
    };
    run_for(seconds / 4.0, &mut |_| {})?;
    observe(Phase::Start);
    let t0 = Instant::now();
    let replays = run_for(seconds * 3.0 / 4.0, &mut observe)?;
    let elapsed = t0.elapsed().as_secs_f64();
    observe(Phase::End);
    Ok(Sustained {
        calls: replays * calls as u64,
        seconds: elapsed,
    })
}

/// Times one backend on one problem (inputs random, rounded to the dtype). `Cpu` is timed with
/// the host clock, both figures the same.
pub fn time_backend(
    dev: Option<&Device>,
    p: &Problem,
    backend: Backend,
    budget_ms: f64,
) -> Result<Timing> {
    let backend = backend.resolve(dev, p)?;
    backend.supports(dev, p)?;
    let inputs = crate::inputs::random_inputs(p, crate::inputs::fresh_seed())?;
    if backend == Backend::Cpu {
        let mut ts = Vec::new();
        let t0 = Instant::now();
        while ts.is_empty() || (t0.elapsed().as_secs_f64() * 1e3 < budget_ms && ts.len() < 20) {
            let t = Instant::now();
            std::hint::black_box(inputs.reference(p)?);
            ts.push(t.elapsed().as_secs_f64() * 1e6);
        }
        return Ok(Timing::from_samples(&ts, &ts, &ts));
    }
    let dev = dev.expect("supports() requires a device for GPU backends");
    let qkv = inputs.upload(dev, p.dtype)?;
    let mut out = Tensor::poisoned(dev, p.output_dtype(), p.out_len().unwrap())?;
    let mut bufs = crate::check::ExtraBuffers::new(
        dev,
        p,
        inputs.alibi_slopes.as_deref(),
        inputs.sinks.as_deref(),
    )?;
    // Planned once, as a caller who runs a problem repeatedly does.
    let plan = sdpa::Plan::new(dev, p, backend)?;
    time_gpu(dev, budget_ms, || {
        let t = tensors(p, &qkv, &mut out);
        plan.run(t, bufs.extras())
    })
}

/// The launch floor: an empty kernel on `blocks` CTAs in the same harness.
pub fn launch_floor(dev: &Device, blocks: i32) -> Result<Timing> {
    let stream = dev.stream();
    time_gpu(dev, 200.0, || {
        // The CUDA runtime inside the core launches on whatever context is current.
        stream.context().bind_to_thread()?;
        let s = stream.cu_stream() as usize;
        // SAFETY: a valid stream of the context just bound; the kernel touches no memory.
        unsafe { sdpa_sys::ffi::empty_kernel(blocks, s)? };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_bracket_the_median() {
        // 1..=40 and one outlier.
        let samples: Vec<f64> = (1..=40).map(f64::from).chain([1000.0]).collect();
        let s = Stats::of(&samples);
        assert_eq!((s.n, s.median, s.min, s.max), (41, 21.0, 1.0, 1000.0));
        assert!(s.ci95.0 <= s.median && s.median <= s.ci95.1, "{s:?}");
        // The outlier moves the mean, not the interval of the median.
        assert!(s.ci95.0 >= 12.0 && s.ci95.1 <= 30.0, "{s:?}");
        assert_eq!(Stats::of(&samples), s, "the bootstrap is reproducible");
        let one = Stats::of(&[7.0]);
        assert_eq!((one.median, one.ci95), (7.0, (7.0, 7.0)));
    }
}
