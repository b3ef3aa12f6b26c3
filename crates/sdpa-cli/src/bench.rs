//! `sdpa bench`: named problems x backends, CUDA-event timing (`us_graph`, `us_event`),
//! TFLOP/s, rel_err, and `--json` records in the format of shared/anchors/compare.py.

use crate::energy::{Energy, Meter};
use crate::progress::Progress;
use crate::validate::{ProblemArgs, auto_note, backends, dtype_label, require_runnable};
use crate::{CliResult, chosen_backend, device_for, open_device, output};
use sdpa::{Backend, BackwardPlan, DType, Device, DqReduction, Problem, Result, Tensor};
use sdpa_harness::check::{ExtraBuffers, check_output, kv_bytes};
use sdpa_harness::grad::{BackwardCase, Half};
use sdpa_harness::inputs::{fresh_seed, named_inputs, tensors};
use sdpa_harness::timing::{launch_floor, time_backend, time_gpu};
use serde_json::json;
use std::process::ExitCode;

/// Problems whose f64 reference costs more than this many flops get no rel_err in the bench
/// (minutes of CPU time; fast FP8 problems compute an emulated reference too); `sdpa validate`
/// covers them.
const REFERENCE_FLOP_LIMIT: f64 = 2e11;
/// The same for the backward's check (the reference gradient recomputes the forward and runs
/// five products a score, against the forward's two): its work counted as 2.5x the forward's.
const BACKWARD_REFERENCE_FLOP_LIMIT: f64 = 2e10;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    problems: ProblemArgs,
    /// Backends (comma-separated); default: every GPU backend (cpu when there is no GPU).
    #[arg(long, value_delimiter = ',')]
    backend: Vec<String>,
    /// Write records (JSON list) here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Also draw the records (TFLOP/s per problem and backend) into this SVG file.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// Time budget per measurement, milliseconds.
    #[arg(long, default_value_t = 1000.0, allow_negative_numbers = true)]
    budget_ms: f64,
    /// Also run each problem back to back for this many seconds (the first quarter warm-up)
    /// and report its time per call under sustained load, energy per call (the GPU's energy
    /// counter, NVML), mean power and SM clock.
    #[arg(long, allow_negative_numbers = true)]
    energy_s: Option<f64>,
    /// Time the backward (dQ, dK, dV from the forward's output, its log-sum-exp and dO) instead
    /// of the forward; TFLOP/s count 2.5x the forward's work, as FlashAttention's do.
    #[arg(long, conflicts_with = "energy_s")]
    backward: bool,
    /// With --backward: dQ summed in a fixed order instead of with atomics.
    #[arg(long, requires = "backward")]
    deterministic: bool,
}

/// Refuses a duration that is not a finite number above zero (an infinite `--energy-s` would
/// run forever), naming the flag.
fn positive(flag: &str, x: f64) -> Result<()> {
    if x.is_finite() && x > 0.0 {
        Ok(())
    } else {
        Err(sdpa::Error::InvalidArgument(format!(
            "{flag} {x}: expected a finite number above 0"
        )))
    }
}

pub fn main(a: Args) -> CliResult<ExitCode> {
    positive("--budget-ms", a.budget_ms)?;
    if let Some(s) = a.energy_s {
        positive("--energy-s", s)?;
    }
    // Before anything runs: a bad output path found after the run would cost the run.
    let mut outputs: Vec<output::Named> = Vec::new();
    outputs.extend(a.json.as_deref().map(|p| ("--json", p)));
    outputs.extend(a.plot.as_deref().map(|p| ("--plot", p)));
    output::check(&outputs, &[])?;
    let named = !a.backend.is_empty();
    let (dev, backends) = if named {
        let backends = backends(&a.backend)?;
        (device_for(&backends, true)?, backends)
    } else {
        let dev = open_device();
        let backends = if dev.is_some() {
            Backend::GPU.to_vec()
        } else {
            vec![Backend::Cpu]
        };
        (dev, backends)
    };
    let all: Vec<&str> = sdpa_harness::NAMED_PROBLEMS
        .iter()
        .map(|p| p.name)
        .collect();
    let default: &[&str] = if dev.is_some() { &all } else { &["mission"] };
    let problems = a.problems.problems(default, "named")?;
    if named {
        require_runnable(dev.as_ref(), &backends, &problems)?;
    }

    if let Some(d) = &dev {
        let sms = d.sm_count()? as i32;
        let (one, full) = (launch_floor(d, 1)?, launch_floor(d, 2 * sms)?);
        outln!(
            "{} ({} SMs). launch floor (empty kernel): {:.2} us/call in a graph (1 CTA), {:.2} \
             ({} CTAs); {:.2} us one launch between events; {:.2} us of host time to enqueue one \
             (us_host's floor)",
            d.name()?,
            sms,
            one.us_graph,
            full.us_graph,
            2 * sms,
            one.us_event,
            one.us_host
        )?;
    }
    let (device, sm) = match &dev {
        Some(d) => {
            let (major, minor) = d.compute_capability()?;
            (d.name()?, Some(major * 10 + minor))
        }
        None => ("cpu".to_string(), None),
    };
    // Read before the runs: the clock a run starts from (it falls under sustained load).
    let machine = match &dev {
        Some(_) => crate::machine::metadata(0),
        None => crate::machine::metadata(u32::MAX),
    };
    if dev.is_some() {
        outln!("{}", crate::machine::describe(&machine))?;
    }
    let meter = match (a.energy_s, &dev) {
        (Some(_), Some(d)) => Some(crate::energy::Meter::open(d)?),
        _ => None,
    };
    let energy = a.energy_s.zip(meter.as_ref());
    let mut records = Vec::new();
    let mut failed = false;
    let unix_time = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let reduction = match a.deterministic {
        true => DqReduction::Deterministic,
        false => DqReduction::Atomic,
    };
    let progress = Progress::new(problems.len() * backends.len(), "bench");
    for (name, p) in &problems {
        for &b in &backends {
            // The backward's plan resolves `Auto` itself, among the backends with a backward.
            let chosen = match a.backward {
                true => Ok(b),
                false => chosen_backend(dev.as_ref(), p, b),
            };
            let note = chosen.as_ref().map_or(String::new(), |&c| auto_note(b, c));
            let what = format!("bench {name} {} {}{note} ... ", dtype_label(p), b.name());
            // On a terminal the bar names the run; in a log the line starts before it.
            progress.step(what.clone());
            if !progress.shown() {
                note_start!("{what}");
            }
            let said = |result: String| match progress.shown() {
                true => progress.done(format!("{what}{result}")),
                false => note!("{result}"),
            };
            let measured = chosen.and_then(|c| match a.backward {
                true => bench_backward(dev.as_ref(), name, p, c, a.budget_ms, reduction),
                false => bench_one(dev.as_ref(), name, p, c, a.budget_ms, energy),
            });
            match measured {
                Ok(Measured {
                    t,
                    rel_err,
                    kv,
                    flops,
                    energy,
                }) => {
                    let kv_gbps = kv / (t.us_graph * 1e3);
                    match p.seq_q <= 16 {
                        true => said(format!("{:.2} us, K/V {kv_gbps:.0} GB/s", t.us_graph)),
                        false => said(format!("{:.2} us", t.us_graph)),
                    }
                    let mut record = json!({
                        "name": name, "batch": p.batch, "heads": p.heads, "seq_q": p.seq_q,
                        "seq_k": p.seq_k, "head_dim": p.head_dim, "causal": p.is_causal(),
                        "kv_heads": p.kv_heads, "mask": p.mask.name(), "softcap": p.softcap,
                        "alibi": p.alibi.is_some(), "lse": p.lse,
                        "dtype": p.dtype.name(), "out_dtype": p.output_dtype().name(),
                        "backend": b.name(), "us_graph": t.us_graph,
                        "us_event": t.us_event, "tflops": flops / (t.us_graph * 1e6),
                        "kv_gbps": kv_gbps, "seqs": p.seqs.to_string().trim(),
                        "rel_err": rel_err, "device": device, "sm": sm,
                        "n_graph": t.graph.n, "us_graph_min": t.graph.min,
                        "us_graph_max": t.graph.max,
                        "us_graph_ci95": [t.graph.ci95.0, t.graph.ci95.1],
                        "n_event": t.event.n, "us_event_min": t.event.min,
                        "us_event_max": t.event.max,
                        "us_event_ci95": [t.event.ci95.0, t.event.ci95.1],
                        "commit": env!("SDPA_COMMIT"), "time": unix_time,
                        "driver": machine["driver"], "sm_clock_mhz": machine["sm_clock_mhz"],
                        "sm_clock_max_mhz": machine["sm_clock_max_mhz"],
                        "power_limit_w": machine["power_limit_w"],
                        "sustained_us": energy.map(|e| e.us_per_call),
                        "mj_per_call": energy.map(|e| e.mj_per_call),
                        "sustained_watts": energy.map(|e| e.watts),
                        "sustained_sm_mhz": energy.map(|e| e.sm_mhz),
                    });
                    // K and V's element type (an e4m3 cache under 16-bit Q differs from dtype).
                    record["kv_dtype"] = json!(p.kv_dtype().name());
                    // Which FP8 mode ran (null for f16/bf16), so fast and accurate records of
                    // one problem stay apart (outside the literal: json! recursion limit).
                    record["fp8_mode"] = json!((p.dtype == DType::E4m3).then(|| p.fp8_mode.name()));
                    record["us_host"] = json!(t.us_host);
                    record["direction"] = json!(if a.backward { "backward" } else { "forward" });
                    records.push(record);
                }
                Err(e @ sdpa::Error::Unsupported { .. }) => said(format!("skipped: {e}")),
                Err(e) => {
                    said(format!("FAILED: {e}"));
                    failed = true;
                }
            }
        }
    }
    drop(progress);
    outln!(
        "\n{:<18} {:<9} {:<8} {:>11} {:>21} {:>11} {:>8} {:>8} {:>10}",
        "problem",
        "dtype",
        "backend",
        "us_graph",
        "(95% CI, n)",
        "us_event",
        "us_host",
        "TFLOP/s",
        "rel_err"
    )?;
    for r in &records {
        let ci = &r["us_graph_ci95"];
        outln!(
            "{:<18} {:<9} {:<8} {:>11.2} {:>21} {:>11.2} {:>8.2} {:>8.2} {:>10}",
            r["name"].as_str().unwrap_or(""),
            crate::plot::record_dtype(r),
            r["backend"].as_str().unwrap_or(""),
            r["us_graph"].as_f64().unwrap_or(f64::NAN),
            format!(
                "({:.2}-{:.2}, {})",
                ci[0].as_f64().unwrap_or(f64::NAN),
                ci[1].as_f64().unwrap_or(f64::NAN),
                r["n_graph"].as_u64().unwrap_or(0)
            ),
            r["us_event"].as_f64().unwrap_or(f64::NAN),
            r["us_host"].as_f64().unwrap_or(f64::NAN),
            r["tflops"].as_f64().unwrap_or(f64::NAN),
            r["rel_err"]
                .as_f64()
                .map_or("-".into(), |x| format!("{x:.2e}")),
        )?;
    }
    if energy.is_some() {
        outln!(
            "\nunder sustained load ({} s each, the first quarter warm-up):\n{:<18} {:<9} {:<8} \
             {:>13} {:>12} {:>8} {:>8}",
            a.energy_s.unwrap_or_default(),
            "problem",
            "dtype",
            "backend",
            "us per call",
            "mJ per call",
            "W",
            "SM MHz"
        )?;
        for r in records.iter().filter(|r| r["mj_per_call"].is_f64()) {
            outln!(
                "{:<18} {:<9} {:<8} {:>13.2} {:>12.3} {:>8.1} {:>8.0}",
                r["name"].as_str().unwrap_or(""),
                crate::plot::record_dtype(r),
                r["backend"].as_str().unwrap_or(""),
                r["sustained_us"].as_f64().unwrap_or(f64::NAN),
                r["mj_per_call"].as_f64().unwrap_or(f64::NAN),
                r["sustained_watts"].as_f64().unwrap_or(f64::NAN),
                r["sustained_sm_mhz"].as_f64().unwrap_or(f64::NAN),
            )?;
        }
    }
    if let Some(path) = &a.json {
        let text = serde_json::to_string_pretty(&records).expect("records serialize");
        output::write_text(path, &text)?;
        outln!("wrote {} records to {}", records.len(), path.display())?;
    }
    if let Some(path) = &a.plot {
        let mut bars = Vec::new();
        for (i, r) in records.iter().enumerate() {
            match crate::plot::bar(r, &crate::plot::label(r), false) {
                Ok(b) => bars.extend(b),
                Err(why) => note!("sdpa bench: records[{i}] left out of the chart: {why}"),
            }
        }
        let device = crate::plot::clean(&device);
        // The CPU backend runs no CUDA graph: its "us_graph" is the host's wall time of a call.
        let clock = match records.iter().all(|r| r["backend"] == "cpu") {
            true => "the host's wall time of a call",
            false => "us_graph",
        };
        let title = format!("sdpa bench on {device}: TFLOP/s from {clock} (higher is better)");
        crate::plot::write_svg(path, &title, &bars)?;
        outln!("wrote {}", path.display())?;
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// Checks the backward's gradients once (where the reference gradient is affordable), then
/// times `b`'s backward on `p` (f16 or bf16): the plan's run alone, on the forward's output and
/// log-sum-exp of the scalar kernel.
fn bench_backward(
    dev: Option<&Device>,
    name: &str,
    p: &Problem,
    b: Backend,
    budget_ms: f64,
    reduction: DqReduction,
) -> Result<Measured> {
    let Some(dev) = dev else {
        return Err(sdpa::Error::Unsupported {
            backend: b.name(),
            reason: "bench --backward times GPU backwards".to_string(),
        });
    };
    match p.dtype {
        DType::F16 => bench_backward_t::<half::f16>(dev, name, p, b, budget_ms, reduction),
        DType::Bf16 => bench_backward_t::<half::bf16>(dev, name, p, b, budget_ms, reduction),
        d => Err(sdpa::Error::Unsupported {
            backend: b.name(),
            reason: format!("the backward takes f16 or bf16, not {d}"),
        }),
    }
}

fn bench_backward_t<T: Half>(
    dev: &Device,
    name: &str,
    p: &Problem,
    b: Backend,
    budget_ms: f64,
    reduction: DqReduction,
) -> Result<Measured> {
    let plan = BackwardPlan::new(dev, p, b, reduction)?;
    let seed = fresh_seed();
    let inputs = named_inputs(name, &p.with_lse(true), seed)?;
    let kv = kv_bytes(p, inputs.seq_meta.as_ref());
    let flops = 2.5 * sdpa_harness::check::flops(p, inputs.seq_meta.as_ref());
    let mut case = BackwardCase::<T>::with_inputs(dev, p, inputs, seed)?;
    plan.reserve()?;
    let rel_err = if flops <= BACKWARD_REFERENCE_FLOP_LIMIT {
        let r = case.check(dev, &plan, seed)?;
        if !r.pass() {
            return Err(sdpa::Error::Cuda(
                format!("wrong gradients before timing: {r:?}").into(),
            ));
        }
        r.reports.iter().map(|x| x.rel_err).reduce(f64::max)
    } else {
        None
    };
    let mut grads = case.grad_buffers(dev)?;
    let t = time_gpu(dev, budget_ms, || case.run(&plan, &mut grads))?;
    Ok(Measured {
        t,
        rel_err,
        kv,
        flops,
        energy: None,
    })
}

/// What `bench_one` measured of one backend on one problem.
struct Measured {
    t: sdpa_harness::timing::Timing,
    /// Against the float64 reference, where it is affordable.
    rel_err: Option<f64>,
    /// Bytes of K and V the call reads.
    kv: f64,
    /// Floating-point operations of the call.
    flops: f64,
    /// Under sustained load, where asked for.
    energy: Option<Energy>,
}

/// Checks the output once (when the reference is affordable), then times the backend, and
/// where `energy` gives seconds and a meter, measures it under sustained load too.
fn bench_one(
    dev: Option<&Device>,
    name: &str,
    p: &Problem,
    b: Backend,
    budget_ms: f64,
    energy: Option<(f64, &Meter)>,
) -> Result<Measured> {
    b.supports(dev, p)?;
    let Some(dev) = dev.filter(|_| b != Backend::Cpu) else {
        let t = time_backend(dev, p, b, budget_ms)?;
        return Ok(Measured {
            t,
            rel_err: None,
            kv: kv_bytes(p, None),
            flops: p.flops(),
            energy: None,
        });
    };
    let seed = fresh_seed();
    let inputs = named_inputs(name, p, seed)?;
    let kv = kv_bytes(p, inputs.seq_meta.as_ref());
    let flops = sdpa_harness::check::flops(p, inputs.seq_meta.as_ref());
    let qkv = inputs.upload(dev, p.dtype)?;
    let mut out = Tensor::poisoned(dev, p.output_dtype(), p.out_len().unwrap())?;
    let mut bufs = ExtraBuffers::of_inputs(dev, p, &inputs)?;
    let mut call = |out: &mut Tensor| {
        let t = tensors(p, &qkv, out);
        sdpa::forward(dev, p, b, t, bufs.extras())
    };
    call(&mut out)?;
    let rel_err = if flops <= REFERENCE_FLOP_LIMIT {
        let want = inputs.reference(p)?;
        let r = check_output(&out.to_f64(dev)?, &want.out, p, &inputs, seed)?;
        if !r.pass() {
            return Err(sdpa::Error::Cuda(
                format!("wrong result before timing: {r:?}").into(),
            ));
        }
        Some(r.rel_err)
    } else {
        None
    };
    let t = time_gpu(dev, budget_ms, || call(&mut out))?;
    let energy = match energy {
        Some((seconds, meter)) => Some(meter.measure(dev, seconds, || call(&mut out))?),
        None => None,
    };
    Ok(Measured {
        t,
        rel_err,
        kv,
        flops,
        energy,
    })
}
