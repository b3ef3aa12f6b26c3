//! `sdpa ring`: ring attention (`sdpa::distributed`) on the long named problems.
//!
//! Where the ranks come from: launched by torchrun (or with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT` set), each process is one rank on GPU `LOCAL_RANK`; otherwise
//! this one process drives `--ranks` GPUs (default: every visible one), or `--ranks` virtual
//! ranks on GPU 0 with `--loopback`. Processes of one ring share a secret, `SDPA_RING_TOKEN`
//! (`export SDPA_RING_TOKEN=$(openssl rand -hex 32)` before torchrun; or, all on one machine
//! with a loopback `MASTER_ADDR`, `SDPA_RING_INSECURE=1`).
//!
//! NVLink multicast stays off (`NCCL_NVLS_ENABLE=0`) unless the environment says otherwise: the
//! ring does not use it (`sdpa::distributed::init_env`).
//!
//! `bench` times the ring (wall clock around each synchronous call, median) and, on rank 0,
//! the single-GPU kernel on the whole problem where it fits, for the scaling efficiency
//! t(1 GPU) / (N · t(N)). `validate` checks the sharded result, O and LSE, against the
//! single-GPU kernel and the float64 reference on a smaller problem.

use crate::CliResult;
use cudarc::driver::{CudaSlice, CudaStream};
use sdpa::distributed::{
    HostShards, Ring, RingOptions, RingReport, Shard, Transport, Zigzag, forward_host, lse_dims,
    q_dims,
};
use sdpa::{Backend, DType, Device, Extras, Problem, Tensor, Tensors};
use sdpa_harness::{check, inputs};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    cmd: Sub,
}

#[derive(clap::Subcommand)]
enum Sub {
    /// Times ring attention on the named long problems.
    Bench(BenchArgs),
    /// Checks ring attention against one GPU and the float64 reference.
    Validate(ValidateArgs),
}

/// Which ranks, for both subcommands.
#[derive(clap::Args)]
struct RankArgs {
    /// Ranks of a single-process ring (default: every visible GPU). Under torchrun: must equal
    /// WORLD_SIZE when given.
    #[arg(long)]
    ranks: Option<usize>,
    /// `--ranks` virtual ranks on GPU 0 (device copies instead of NCCL).
    #[arg(long)]
    loopback: bool,
    /// Seconds any wait for another rank may take before every rank fails (a value past what
    /// the clock holds, such as 18446744073709551615, is no limit).
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
}

#[derive(clap::Args)]
struct BenchArgs {
    #[command(flatten)]
    ranks: RankArgs,
    /// Named problems (comma-separated): s32k-d128-causal, s128k-d128-causal,
    /// s512k-d128-causal, s128k-d128.
    #[arg(long, value_delimiter = ',', default_value = "s128k-d128-causal")]
    problem: Vec<String>,
    /// Timed calls per problem (after one warm-up call).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Also time the single-GPU kernel on the whole problem (rank 0, where it fits).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    baseline: bool,
    /// Write records (JSON list) here (rank 0).
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

#[derive(clap::Args)]
struct ValidateArgs {
    #[command(flatten)]
    ranks: RankArgs,
    /// Named problems (comma-separated): v2k-d128 (1, 16 heads, 2048, 128), v4k-d128-causal-gqa
    /// (1, 16 heads, 4 K/V heads, 4096, 128, causal), or any `bench` problem.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "v4k-d128-causal-gqa,v2k-d128"
    )]
    problem: Vec<String>,
    /// Seed of the random inputs (the same on every rank).
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// The ring's problems: (name, batch, heads, kv_heads, seq, head_dim, causal), bf16. The `v`
/// ones are small enough for the float64 reference; the issue's targets are s128k and s512k.
const PROBLEMS: &[(&str, usize, usize, usize, usize, usize, bool)] = &[
    ("v2k-d128", 1, 16, 16, 2048, 128, false),
    ("v4k-d128-causal-gqa", 1, 16, 4, 4096, 128, true),
    ("s32k-d128-causal", 1, 32, 32, 32768, 128, true),
    ("s128k-d128", 1, 32, 32, 131072, 128, false),
    ("s128k-d128-causal", 1, 32, 32, 131072, 128, true),
    ("s512k-d128-causal", 1, 32, 32, 524288, 128, true),
];

fn problem(name: &str) -> sdpa::Result<Problem> {
    let &(_, b, h, hk, s, d, causal) = PROBLEMS.iter().find(|p| p.0 == name).ok_or_else(|| {
        let names: Vec<_> = PROBLEMS.iter().map(|p| p.0).collect();
        sdpa::Error::InvalidArgument(format!(
            "unknown ring problem {name:?}; named: {}",
            names.join(", ")
        ))
    })?;
    Ok(Problem::new(b, h, s, s, d)
        .with_kv_heads(hk)
        .with_causal(causal)
        .with_dtype(DType::Bf16))
}

pub fn main(a: Args) -> CliResult<ExitCode> {
    // SAFETY: `sdpa`'s main has parsed its arguments and started no thread (nor has anything
    // it called) before it hands over to a subcommand, so nothing reads the environment
    // concurrently with this write.
    unsafe { sdpa::distributed::init_env() };
    match a.cmd {
        Sub::Bench(a) => bench(a),
        Sub::Validate(a) => validate(a),
    }
}

/// The ring the arguments and the environment describe; `timings`: each call measures where
/// each local rank's time goes.
fn open_ring(a: &RankArgs, timings: bool) -> sdpa::Result<Ring> {
    let opts = RingOptions {
        timeout: Duration::from_secs(a.timeout_s),
        timings,
        ..RingOptions::default()
    };
    if std::env::var_os("WORLD_SIZE").is_some() && !a.loopback {
        let ring = Ring::from_env(opts)?;
        if let Some(n) = a.ranks.filter(|&n| n != ring.world()) {
            return Err(sdpa::Error::InvalidArgument(format!(
                "--ranks {n}, but WORLD_SIZE is {}",
                ring.world()
            )));
        }
        return Ok(ring);
    }
    if a.loopback {
        return Ring::loopback(&Device::new(0)?, a.ranks.unwrap_or(2), opts);
    }
    // cudarc panics where there is no driver to ask.
    let visible = if sdpa::driver_present() {
        cudarc::driver::CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
    } else {
        0
    };
    let n = a.ranks.unwrap_or(visible);
    if n == 0 || n > visible {
        return Err(sdpa::Error::NoDevice(format!(
            "{n} rank(s) asked for, {visible} GPU(s) visible (--loopback runs virtual ranks on one)"
        )));
    }
    let devices = (0..n).map(Device::new).collect::<sdpa::Result<Vec<_>>>()?;
    Ring::single_process(devices, opts)
}

fn transport_name(r: &Ring) -> String {
    let t = match r.transport() {
        Transport::Nccl => "nccl",
        Transport::Loopback => "loopback",
    };
    format!("ring-{t}-x{}", r.world())
}

/// Whether this process prints the results (rank 0, or the one process of the ring).
fn leads(ring: &Ring) -> bool {
    ring.local_ranks().any(|(r, _)| r == 0)
}

fn bench(a: BenchArgs) -> CliResult<ExitCode> {
    if let Some(path) = &a.json {
        crate::output::check(&[("--json", path)], &[])?;
    }
    let mut ring = open_ring(&a.ranks, true)?;
    let name = transport_name(&ring);
    let mut records = Vec::new();
    for pname in &a.problem {
        let p = problem(pname)?;
        let z = sdpa::distributed::check_problem(&p, ring.world())?;
        let (times, report) = time_ring(&mut ring, &p, &z, a.iters.max(1))?;
        let t = median(&times);
        // Per GPU: the caller's shards of Q, K, V and the output, and what the ring adds.
        let shard_bytes = 2
            * (p.q_len().unwrap_or(0) * p.dtype.size()
                + p.k_len().unwrap_or(0) * p.kv_dtype().size())
            / ring.world();
        let gib = |b: usize| b as f64 / f64::from(1u32 << 30);
        let tflops = p.flops() / t / 1e12;
        let one = if a.baseline && leads(&ring) {
            time_one_gpu(&p, a.iters.max(1))
        } else {
            None
        };
        // Loopback runs every rank on one GPU: no scaling figure, but the ring's own cost (the
        // shorter calls, the merges, the hand-overs) over the single call on the same work.
        let loopback = ring.transport() == Transport::Loopback;
        let eff = one
            .filter(|_| !loopback)
            .map(|t1| t1 / (ring.world() as f64 * t));
        let overhead = one.filter(|_| loopback).map(|t1| t / t1 - 1.0);
        if leads(&ring) && loopback {
            outln!(
                "{pname}: {name} {:.2} ms/call ({tflops:.1} TFLOP/s, every rank on one GPU); \
                 one GPU {}; the ring's own cost {}",
                t * 1e3,
                one.map_or("n/a".into(), |t1| format!("{:.2} ms", t1 * 1e3)),
                overhead.map_or("n/a".into(), |o| format!("{:+.1}%", 100.0 * o)),
            )?;
        } else if leads(&ring) {
            outln!(
                "{pname}: {name} {:.2} ms/call ({tflops:.1} TFLOP/s, {:.1} a GPU); one GPU {}; \
                 scaling efficiency {}; memory a GPU: shards {:.2} GiB + ring workspace {:.2} GiB",
                t * 1e3,
                tflops / ring.world() as f64,
                one.map_or("n/a".into(), |t1| format!("{:.2} ms", t1 * 1e3)),
                eff.map_or("n/a".into(), |e| format!("{:.1}%", 100.0 * e)),
                gib(shard_bytes),
                gib(report.workspace_bytes),
            )?;
        }
        // Where the last call's time went on each GPU of this process: the attention is the
        // work one GPU would do too; merges and waits for K/V are the ring's own.
        for rt in &report.timings {
            outln!(
                "  rank {}: attention {:.2} ms, merges {:.2} ms, waiting for K/V {:.2} ms, of \
                 {:.2} ms on its GPU",
                rt.rank,
                rt.attention_ms,
                rt.merge_ms,
                rt.waiting_ms,
                rt.total_ms
            )?;
        }
        if let Some(h) = &report.host {
            outln!(
                "  host: checks {:.2} ms, agreement {:.2} ms, setup {:.2} ms, queueing {:.2} ms, \
                 waiting for the GPUs {:.2} ms",
                h.checks_ms,
                h.agree_ms,
                h.setup_ms,
                h.issue_ms,
                h.wait_ms
            )?;
        }
        let host = report.host.map(|h| {
            serde_json::json!({
                "checks_ms": h.checks_ms, "agree_ms": h.agree_ms, "setup_ms": h.setup_ms,
                "issue_ms": h.issue_ms, "wait_ms": h.wait_ms,
            })
        });
        let timings: Vec<_> = report
            .timings
            .iter()
            .map(|rt| {
                serde_json::json!({
                    "rank": rt.rank, "attention_ms": rt.attention_ms, "merge_ms": rt.merge_ms,
                    "waiting_ms": rt.waiting_ms, "total_ms": rt.total_ms,
                })
            })
            .collect();
        records.push(serde_json::json!({
            "name": pname, "batch": p.batch, "heads": p.heads, "kv_heads": p.kv_heads,
            "seq_q": p.seq_q, "seq_k": p.seq_k, "head_dim": p.head_dim, "causal": p.is_causal(),
            "dtype": p.dtype.to_string(), "backend": name, "ranks": ring.world(),
            "us_event": t * 1e6, "tflops": tflops,
            "us_one_gpu": one.map(|t1| t1 * 1e6), "scaling_efficiency": eff,
            "loopback_overhead": overhead,
            "shard_bytes_a_gpu": shard_bytes, "workspace_bytes_a_gpu": report.workspace_bytes,
            "f32_partials": report.f32_partials, "rank_timings": timings, "host_timings": host,
        }));
    }
    if let (Some(path), true) = (&a.json, leads(&ring)) {
        let text = serde_json::to_string_pretty(&records).expect("JSON of plain values");
        crate::output::write_text(path, &text)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Seconds per ring call, and the last call's report: shards of random values made on each
/// local rank (no whole tensor is ever on one host or GPU), one warm-up call, then `iters` timed
/// ones.
fn time_ring(
    ring: &mut Ring,
    p: &Problem,
    z: &Zigzag,
    iters: usize,
) -> sdpa::Result<(Vec<f64>, RingReport)> {
    // A rank's shard holds what a problem of `local_len` query and key positions would.
    let local = z.local_len();
    let shard = Problem::new(p.batch, p.heads, local, local, p.head_dim)
        .with_kv_heads(p.kv_heads)
        .with_dtype(p.dtype);
    let mut bufs = Vec::new();
    for (rank, dev) in ring.local_ranks() {
        let s = dev.stream();
        let (ql, kl) = (shard.q_len().unwrap_or(0), shard.k_len().unwrap_or(0));
        let seed = 3 * rank as u64;
        let q = random_bf16(s, ql, seed)?;
        let k = random_bf16(s, kl, seed + 1)?;
        let v = random_bf16(s, kl, seed + 2)?;
        let out = s.alloc_zeros::<half::bf16>(q.len())?;
        bufs.push((q, k, v, out));
    }
    let mut times = Vec::with_capacity(iters);
    let mut report = None;
    for i in 0..=iters {
        let mut shards: Vec<Shard<'_, half::bf16>> = bufs
            .iter_mut()
            .map(|(q, k, v, o)| Shard {
                q: q.as_view(),
                k: k.as_view(),
                v: v.as_view(),
                out: o.as_view_mut(),
                lse: None,
            })
            .collect();
        let t0 = Instant::now();
        report = Some(ring.forward(p, &mut shards)?);
        if i > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok((times, report.expect("at least one call")))
}

/// Seconds per call of the single-GPU kernel (`Auto`) on the whole problem on GPU 0, or `None`
/// where it does not fit or fails (said on stderr).
fn time_one_gpu(p: &Problem, iters: usize) -> Option<f64> {
    let run = || -> sdpa::Result<f64> {
        let dev = Device::new(0)?;
        let (ql, kl) = (p.q_len().unwrap_or(0), p.k_len().unwrap_or(0));
        // Random values as the ring's (zeros would draw less power, and at these sizes the
        // GPU's clock follows its power).
        let (q, k, v) = (
            Tensor::from_cuda_slice(&dev, random_bf16(dev.stream(), ql, 0)?)?,
            Tensor::from_cuda_slice(&dev, random_bf16(dev.stream(), kl, 1)?)?,
            Tensor::from_cuda_slice(&dev, random_bf16(dev.stream(), kl, 2)?)?,
        );
        let mut out = Tensor::zeros(&dev, p.dtype, ql)?;
        let mut times = Vec::new();
        for i in 0..=iters {
            let t0 = Instant::now();
            let t = Tensors {
                q: &q,
                k: &k,
                v: &v,
                out: &mut out,
            };
            sdpa::forward(&dev, p, Backend::Auto, t, Extras::default())?;
            dev.synchronize()?;
            if i > 0 {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        Ok(median(&times))
    };
    run()
        .map_err(|e| note!("sdpa ring bench: one-GPU baseline not run: {e}"))
        .ok()
}

/// `n` bf16 values on `stream` for a timing run: a block of at most 2^24 N(0, 1) draws from
/// `seed`, repeated to fill, so that a shard of billions of values costs one block's draws.
fn random_bf16(
    stream: &Arc<CudaStream>,
    n: usize,
    seed: u64,
) -> sdpa::Result<CudaSlice<half::bf16>> {
    let block: Vec<half::bf16> = inputs::normal_bits(DType::Bf16, n.min(1 << 24), seed)
        .into_iter()
        .map(half::bf16::from_bits)
        .collect();
    let mut out = stream.alloc_zeros::<half::bf16>(n)?;
    let mut at = 0;
    while at < n {
        let len = block.len().min(n - at);
        stream.memcpy_htod(&block[..len], &mut out.slice_mut(at..at + len))?;
        at += len;
    }
    Ok(out)
}

fn validate(a: ValidateArgs) -> CliResult<ExitCode> {
    let mut ring = open_ring(&a.ranks, false)?;
    let name = transport_name(&ring);
    let mut ok = true;
    for pname in &a.problem {
        let p = problem(pname)?;
        let inputs = inputs::random_inputs(&p, a.seed)?;
        // Already rounded to the dtype, so exact in f32.
        let [q, k, v] = inputs
            .values
            .each_ref()
            .map(|t| t.iter().map(|&x| x as f32).collect::<Vec<_>>());
        let shards = forward_host(&mut ring, &p, &q, &k, &v)?;
        let r = inputs.reference(&p)?;
        let one = one_gpu(&p, &inputs, &shards)?;
        let z = Zigzag::new(p.seq_q, ring.world())?;
        let err = |got: &[f64], want: &[f64]| check::compare(got, want, p.dtype, a.seed);
        let wide = |t: &[f32]| t.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
        for (i, &rank) in shards.ranks.iter().enumerate() {
            let want_o = z.shard(&r.out, q_dims(&p), rank)?;
            let want_l = z.shard(&r.lse, lse_dims(&p), rank)?;
            let ring_o = err(&wide(&shards.out[i]), &want_o);
            let e_ring = ring_o.rel_err;
            let e_one = err(&one.0[i], &want_o).rel_err;
            let l_ring = err(&wide(&shards.lse[i]), &want_l).max_err;
            let l_one = err(&one.1[i], &want_l).max_err;
            // A NaN in the ring's output fails (the error skips NaN positions and counts them).
            // f32 partial results round the output once, as one GPU: no worse than it; partial
            // results in the dtype add a rounding each.
            let bound = if shards.report.f32_partials {
                1.05 * e_one
            } else {
                (2.0 * e_one).max(2.0 * p.dtype.unit_roundoff())
            };
            let pass = ring_o.nan_count == 0 && e_ring <= bound && l_ring <= 1e-4 + 4.0 * l_one;
            ok &= pass;
            outln!(
                "{pname} rank {rank}/{}: {name} rel_err {e_ring:.3e} (one GPU {e_one:.3e}), LSE max \
                 error {l_ring:.3e} (one GPU {l_one:.3e}) {}",
                ring.world(),
                if pass { "ok" } else { "FAIL" }
            )?;
        }
        report_line(&shards.report)?;
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn report_line(r: &RingReport) -> CliResult<()> {
    outln!(
        "  ring: {:?} x{}, {} steps, {} K/V hand-overs of {} bytes each rank, {} attention calls, \
         partial results in {}",
        r.transport,
        r.world,
        r.steps,
        r.exchanges,
        r.bytes_sent,
        r.calls,
        if r.f32_partials { "f32" } else { "the dtype" }
    )
}

/// The single-GPU kernel on the whole problem (GPU 0), cut into the same shards as the ring's
/// local ranks: (outputs, log-sum-exps).
type ShardsOut = (Vec<Vec<f64>>, Vec<Vec<f64>>);
fn one_gpu(p: &Problem, inputs: &inputs::Inputs, like: &HostShards) -> sdpa::Result<ShardsOut> {
    let dev = Device::new(0)?;
    let p1 = p.with_lse(true);
    let (out, lse) = check::run_backend_with_lse(Some(&dev), &p1, Backend::Auto, inputs, None)?;
    let lse = lse.expect("the log-sum-exp was asked for");
    let z = Zigzag::new(p.seq_q, like.report.world)?;
    let mut o = Vec::new();
    let mut l = Vec::new();
    for &rank in &like.ranks {
        o.push(z.shard(&out, q_dims(p), rank)?);
        l.push(z.shard(&lse, lse_dims(p), rank)?);
    }
    Ok((o, l))
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
