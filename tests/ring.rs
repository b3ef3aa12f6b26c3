//! Ring attention (`sdpa::distributed`) on the GPU: the sharded result against the single-GPU
//! kernel and the float64 reference, O and the log-sum-exp, with and without the causal mask,
//! GQA, f16 and bf16, both layouts. Loopback rings run any number of virtual ranks on one GPU;
//! NCCL rings run one rank per visible GPU (a ring of one on a one-GPU machine), in one
//! process and through the torchrun-style rendezvous. Each test asserts from the ring's report
//! that the ring ran: its transport, steps, hand-overs and calls.

mod common;

use sdpa::distributed::{
    DistError, RankEnv, Ring, RingAuth, RingOptions, RingReport, Shard, Transport, forward_host,
    nccl_version,
};
use sdpa::{Backend, DType, Device, Layout, Problem};
use sdpa_harness::{check, inputs};
use std::time::Duration;

/// Runs `p` on `ring` and on GPU 0 alone, compares both with the reference, and returns the
/// ring's report.
fn compare(dev: &Device, ring: &mut Ring, p: &Problem, what: &str) -> RingReport {
    // A fixed seed, so a failure reproduces.
    let seed = 1;
    let inputs = inputs::random_inputs(p, seed).unwrap();
    // Already rounded to the dtype, so exact in f32.
    let [q, k, v] = inputs
        .values
        .each_ref()
        .map(|t| t.iter().map(|&x| x as f32).collect::<Vec<_>>());
    let shards = forward_host(ring, p, &q, &k, &v).unwrap_or_else(|e| panic!("{what}: {e}"));
    let (out, lse) = shards.gather(p).expect("every rank is local");
    let r = inputs.reference(p).unwrap();

    // The single-GPU kernel on the whole problem.
    let (out1, lse1) =
        check::run_backend_with_lse(Some(dev), &p.with_lse(true), Backend::Auto, &inputs, None)
            .unwrap();
    let lse1 = lse1.expect("the log-sum-exp was asked for");

    let err = |got: &[f64], want: &[f64]| check::compare(got, want, p.dtype, seed);
    let wide = |t: &[f32]| t.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
    let (e_ring, e_one) = (err(&wide(&out), &r.out).rel_err, err(&out1, &r.out).rel_err);
    let (l_ring, l_one) = (err(&wide(&lse), &r.lse).max_err, err(&lse1, &r.lse).max_err);
    eprintln!(
        "{what}: rel_err ring {e_ring:.3e}, one GPU {e_one:.3e}; LSE max error ring {l_ring:.3e}, \
         one GPU {l_one:.3e}; {:?}",
        shards.report
    );
    // With f32 partial results the ring rounds its output once, as the single-GPU kernel does:
    // no worse than it but for the order of the f32 sums. With partial results in the dtype
    // (another backend or GPU) each adds a rounding: twice its error, or the dtype's rounding,
    // bounds it.
    let u = p.dtype.unit_roundoff();
    let bound = if shards.report.f32_partials {
        1.05 * e_one
    } else {
        (2.0 * e_one).max(2.0 * u)
    };
    assert!(
        e_ring <= bound,
        "{what}: ring {e_ring:e}, one GPU {e_one:e} (f32 partials: {})",
        shards.report.f32_partials
    );
    assert!(
        l_ring <= 1e-4 + 4.0 * l_one,
        "{what}: LSE ring {l_ring:e}, one GPU {l_one:e}"
    );
    assert!(
        out.iter().all(|x| x.is_finite()),
        "{what}: non-finite output"
    );
    shards.report
}

fn problems() -> Vec<(String, Problem)> {
    let mut out = Vec::new();
    for (causal, dtype, layout, d) in [
        (true, DType::Bf16, Layout::Bhsd, 128),
        (false, DType::F16, Layout::Bhsd, 64),
        (true, DType::F16, Layout::Bshd, 64),
        (false, DType::Bf16, Layout::Bshd, 128),
    ] {
        let p = Problem::new(1, 8, 1024, 1024, d)
            .with_kv_heads(2)
            .with_causal(causal)
            .with_dtype(dtype)
            .with_layout(layout);
        out.push((
            format!("causal {causal}, {dtype}, {layout:?}, d {d}, GQA 8/2"),
            p,
        ));
    }
    out
}

#[test]
fn loopback_rings_match_one_gpu_and_the_reference() {
    let Some(dev) = common::device("loopback_rings_match_one_gpu_and_the_reference") else {
        return;
    };
    // Auto runs cutlass on Hopper, which writes the partial results in f32.
    let hopper = dev.compute_capability().unwrap() == (9, 0);
    for world in [1, 2, 4] {
        let mut ring = Ring::loopback(&dev, world, RingOptions::default()).unwrap();
        for (what, p) in problems() {
            let report = compare(&dev, &mut ring, &p, &format!("loopback x{world}, {what}"));
            assert_eq!(report.transport, Transport::Loopback);
            assert_eq!(
                (report.world, report.steps, report.exchanges),
                (world, world, world - 1)
            );
            // One call a step a rank (the causal schedule's off-diagonal steps are one
            // rectangle each), every rank here.
            assert_eq!(report.calls, world * world);
            assert!(
                !hopper || report.f32_partials,
                "{what}: 16-bit partials on Hopper"
            );
        }
    }
}

/// Asked for, each call says where every rank's compute stream spent its time: attention calls
/// (one a step here), merges, waits for K/V; the spans lie within the call on that GPU; and
/// where the host thread did, its phases within the call's wall time.
#[test]
fn loopback_ring_reports_where_the_time_goes() {
    let Some(dev) = common::device("loopback_ring_reports_where_the_time_goes") else {
        return;
    };
    let opts = RingOptions {
        timings: true,
        ..RingOptions::default()
    };
    let mut ring = Ring::loopback(&dev, 2, opts).unwrap();
    let (what, p) = &problems()[0];
    let started = std::time::Instant::now();
    let report = compare(
        &dev,
        &mut ring,
        p,
        &format!("loopback x2 with timings, {what}"),
    );
    let wall_ms = started.elapsed().as_secs_f64() * 1e3;
    let host = report.host.expect("host timings asked for");
    eprintln!("{what}: {host:?}");
    assert!(
        host.issue_ms > 0.0 && host.wait_ms > 0.0 && host.agree_ms >= 0.0,
        "{host:?}"
    );
    assert!(host.total_ms() <= wall_ms, "{host:?} in {wall_ms} ms");
    assert_eq!(report.timings.len(), 2);
    for (rank, t) in report.timings.iter().enumerate() {
        eprintln!("{what}: {t:?}");
        assert_eq!(t.rank, rank);
        assert!(
            t.attention_ms > 0.0 && t.merge_ms > 0.0 && t.waiting_ms >= 0.0,
            "{t:?}"
        );
        let parts = t.attention_ms + t.merge_ms + t.waiting_ms;
        // Event resolution is about half a microsecond a span.
        assert!(parts <= t.total_ms + 0.01, "{t:?}");
    }
    let untimed = compare(
        &dev,
        &mut Ring::loopback(&dev, 2, RingOptions::default()).unwrap(),
        p,
        what,
    );
    assert!(untimed.timings.is_empty() && untimed.host.is_none());
}

/// A backend that writes partial results in the problem's dtype only (cutlass-sm80): the ring
/// merges those, one rounding more each, within the looser bound `compare` allows them.
#[test]
fn loopback_ring_with_partials_in_the_dtype() {
    let Some(dev) = common::device("loopback_ring_with_partials_in_the_dtype") else {
        return;
    };
    let opts = RingOptions {
        backend: Backend::CutlassSm80,
        ..RingOptions::default()
    };
    let mut ring = Ring::loopback(&dev, 2, opts).unwrap();
    for (what, p) in problems() {
        let report = compare(
            &dev,
            &mut ring,
            &p,
            &format!("loopback x2 on cutlass-sm80, {what}"),
        );
        assert!(!report.f32_partials, "{what}");
        assert_eq!(report.calls, 4);
    }
}

/// NCCL, or why the test cannot use it: skipped without a GPU machine's NCCL, or without the
/// NVLink multicast choice the NCCL rings require (`NCCL_NVLS_ENABLE`: the test threads cannot
/// set it safely), a failure under `SDPA_REQUIRE_GPU=1` (where both are part of what the run
/// must have).
fn nccl_or_skip(test: &str) -> bool {
    let why = match nccl_version() {
        Ok(_) if std::env::var_os("NCCL_NVLS_ENABLE").is_none() => {
            "NCCL_NVLS_ENABLE is not set (the NCCL rings refuse to start without the choice; \
             set NCCL_NVLS_ENABLE=0)"
                .to_string()
        }
        Ok((v, path)) => {
            eprintln!("{test}: NCCL {v} from {path}");
            return true;
        }
        Err(e) => e.to_string(),
    };
    if common::require_gpu() {
        panic!("{test}: SDPA_REQUIRE_GPU=1 but {why}");
    }
    common::skip(test, &why);
    false
}

fn gpu_count() -> usize {
    cudarc::driver::CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

#[test]
fn nccl_ring_over_every_visible_gpu() {
    let test = "nccl_ring_over_every_visible_gpu";
    let Some(dev) = common::device(test) else {
        return;
    };
    if !nccl_or_skip(test) {
        return;
    }
    let n = gpu_count();
    let devices: Vec<Device> = (0..n).map(|i| Device::new(i).unwrap()).collect();
    let mut ring = Ring::single_process(devices, RingOptions::default()).unwrap();
    assert_eq!(ring.world(), n);
    for (what, p) in problems() {
        let report = compare(&dev, &mut ring, &p, &format!("NCCL x{n}, {what}"));
        assert_eq!(report.transport, Transport::Nccl);
        assert_eq!(
            (report.world, report.steps, report.exchanges),
            (n, n, n - 1)
        );
        assert_eq!(report.calls, n * n);
        let kv = p.k_len().unwrap() / n * 2;
        assert_eq!(report.bytes_sent, 2 * kv * (n - 1));
    }
}

#[test]
fn nccl_ring_of_several_gpus() {
    let test = "nccl_ring_of_several_gpus";
    if common::device(test).is_none() || !nccl_or_skip(test) {
        return;
    }
    let n = gpu_count();
    if n < 2 {
        // Not a failure under SDPA_REQUIRE_GPU=1: the machine decides how many GPUs it has.
        common::skip(test, &format!("{n} GPU visible; this test needs 2 or more"));
        return;
    }
    let devices: Vec<Device> = (0..n).map(|i| Device::new(i).unwrap()).collect();
    let dev0 = devices[0].clone();
    let mut ring = Ring::single_process(devices, RingOptions::default()).unwrap();
    let p = Problem::new(1, 8, 2048, 2048, 128)
        .with_kv_heads(2)
        .with_causal(true)
        .with_dtype(DType::Bf16);
    let report = compare(&dev0, &mut ring, &p, &format!("NCCL x{n}, seq 2048"));
    assert_eq!(
        (report.transport, report.exchanges),
        (Transport::Nccl, n - 1)
    );
}

/// The torchrun form with a world of one: the rendezvous (rank 0 alone), NCCL set up from the
/// id it makes, then a ring call; and a second call of another problem on the same ring.
#[test]
fn rendezvous_ring_of_one_process() {
    let test = "rendezvous_ring_of_one_process";
    let Some(dev) = common::device(test) else {
        return;
    };
    if !nccl_or_skip(test) {
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let env = RankEnv {
        rank: 0,
        world: 1,
        local_rank: 0,
        master_addr: "127.0.0.1".into(),
        port,
        // A ring of one listens nowhere: nothing to authenticate.
        auth: RingAuth::Insecure,
    };
    let opts = RingOptions {
        timeout: Duration::from_secs(60),
        ..RingOptions::default()
    };
    let mut ring = Ring::from_rank_env(&env, dev.clone(), opts).unwrap();
    for (what, p) in problems().into_iter().take(2) {
        let report = compare(&dev, &mut ring, &p, &format!("rendezvous x1, {what}"));
        assert_eq!(
            (report.transport, report.world, report.steps),
            (Transport::Nccl, 1, 1)
        );
    }
}

/// Arguments a ring refuses come back as errors before anything runs, on any machine with a
/// GPU (the loopback ring needs no NCCL).
#[test]
fn bad_shards_are_typed_errors() {
    let Some(dev) = common::device("bad_shards_are_typed_errors") else {
        return;
    };
    let mut ring = Ring::loopback(&dev, 2, RingOptions::default()).unwrap();
    let p = Problem::new(1, 2, 64, 64, 64).with_dtype(DType::F16);
    let short = vec![0.0; 10];
    let e = forward_host(&mut ring, &p, &short, &short, &short).unwrap_err();
    assert!(e.to_string().contains("q holds 10 values"), "{e}");
    let odd = Problem::new(1, 2, 66, 66, 64).with_dtype(DType::F16);
    let n = odd.q_len().unwrap();
    let e = forward_host(&mut ring, &odd, &vec![0.0; n], &vec![0.0; n], &vec![0.0; n]).unwrap_err();
    assert!(e.to_string().contains("multiple of 2 x ranks = 4"), "{e}");
    // Not a distributed failure: nothing reached another rank.
    assert!(!matches!(
        e,
        sdpa::Error::Distributed(DistError::Timeout { .. })
    ));
}

/// An output view one element past an aligned buffer (the merge stores two 16-bit elements at
/// a time: a misaligned store faulted the context before) and a Q view one element in are
/// refused before anything runs, naming the operand; the ring still works after. A timeout of
/// `Duration::MAX` is no limit, not an `Instant` overflow.
#[test]
fn misaligned_shards_are_refused_by_name() {
    let Some(dev) = common::device("misaligned_shards_are_refused_by_name") else {
        return;
    };
    let opts = RingOptions {
        timeout: Duration::MAX,
        ..RingOptions::default()
    };
    let mut ring = Ring::loopback(&dev, 2, opts).unwrap();
    let p = Problem::new(1, 2, 64, 64, 64).with_dtype(DType::F16);
    let local = p.q_len().unwrap() / 2;
    let s = dev.stream();
    let mut bufs: Vec<_> = (0..2)
        .map(|_| {
            (
                s.alloc_zeros::<half::f16>(local + 8).unwrap(),
                s.alloc_zeros::<half::f16>(local + 8).unwrap(),
                s.alloc_zeros::<half::f16>(local + 8).unwrap(),
                s.alloc_zeros::<half::f16>(local + 8).unwrap(),
            )
        })
        .collect();
    // (q offset, out offset, the operand the refusal names); offsets in elements.
    for (q_at, out_at, names) in [
        (0, 1, "rank 0's out starts at"),
        (1, 0, "rank 0's q starts at"),
    ] {
        let mut shards: Vec<Shard<'_, half::f16>> = bufs
            .iter_mut()
            .map(|(q, k, v, o)| Shard {
                q: q.slice(q_at..q_at + local),
                k: k.slice(0..local),
                v: v.slice(0..local),
                out: o.slice_mut(out_at..out_at + local),
                lse: None,
            })
            .collect();
        let e = ring.forward(&p, &mut shards).unwrap_err();
        assert!(matches!(e, sdpa::Error::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains(names), "{e}");
        assert!(e.to_string().contains("aligned"), "{e}");
    }
    let mut shards: Vec<Shard<'_, half::f16>> = bufs
        .iter_mut()
        .map(|(q, k, v, o)| Shard {
            q: q.slice(0..local),
            k: k.slice(0..local),
            v: v.slice(0..local),
            out: o.slice_mut(0..local),
            lse: None,
        })
        .collect();
    let report = ring.forward(&p, &mut shards).unwrap();
    assert_eq!((report.world, report.exchanges), (2, 1));
    dev.synchronize().unwrap();
}
