//! `forward` from several threads, each on its own stream, gives bit-identical results to
//! serial runs of the same inputs, for every GPU backend.

mod common;

use cudarc::driver::CudaStream;
use sdpa::{Backend, Device, Problem, Tensor};
use sdpa_harness::inputs::{fresh_seed, random_inputs};
use std::sync::Arc;

/// `b` on fresh inputs from `seed`, all on `dev`'s stream: the output's bits.
fn run(dev: &Device, p: &Problem, b: Backend, seed: u64) -> Vec<u16> {
    let [q, k, v] = random_inputs(p, seed)
        .unwrap()
        .upload(dev, p.dtype)
        .unwrap();
    let mut out = Tensor::poisoned(dev, p.dtype, p.q_len().unwrap()).unwrap();
    // Several calls back to back on this stream, so the threads' kernels overlap in time.
    for _ in 0..4 {
        common::forward(dev, p, b, [&q, &k, &v], &mut out).unwrap();
    }
    out.to_bits(dev).unwrap()
}

#[test]
fn threads_on_separate_streams_match_serial_runs() {
    let Some(dev) = common::device("concurrency") else {
        return;
    };
    let seed = fresh_seed();
    let jobs: Vec<(Problem, Backend)> = Backend::GPU
        .iter()
        .flat_map(|&b| {
            [
                (Problem::new(2, 4, 300, 300, 64).with_causal(true), b),
                (Problem::new(1, 8, 257, 513, 128).with_kv_heads(2), b),
            ]
        })
        .filter(|(p, b)| b.supports(Some(&dev), p).is_ok())
        .collect();
    let runs: Vec<(Backend, Problem)> = jobs.iter().map(|&(p, b)| (b, p)).collect();
    common::assert_all_ran("threaded streams", &dev, &runs);
    let serial: Vec<Vec<u16>> = jobs
        .iter()
        .enumerate()
        .map(|(i, (p, b))| run(&dev, p, *b, seed + i as u64))
        .collect();
    let parallel: Vec<Vec<u16>> = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .enumerate()
            .map(|(i, (p, b))| {
                let dev = dev.fork().unwrap();
                s.spawn(move || run(&dev, p, *b, seed + i as u64))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (p, b)) in jobs.iter().enumerate() {
        assert!(
            serial[i] == parallel[i],
            "{b} on {p}: threaded result differs from serial"
        );
    }
}

/// Calls chained on one stream, each call's output the next call's query, the outputs
/// alternating between two buffers (so a call also overwrites what the call before last
/// read): bit-identical to the same chain with a synchronize after every call. The sm_90
/// kernels start before the previous kernel on the stream has finished (programmatic
/// dependent launch); a read or write before their wait would show here.
#[test]
fn chained_calls_match_synchronized_ones() {
    let Some(dev) = common::device("chained calls") else {
        return;
    };
    let seed = fresh_seed();
    let problems = [
        Problem::new(2, 8, 256, 256, 64), // cutlass: small-problem path
        Problem::new(2, 8, 256, 256, 64).with_causal(true), // the same, causal
        Problem::new(1, 4, 300, 300, 128), // persistent grid
        Problem::new(2, 4, 400, 400, 64).with_causal(true), // one CTA per tile
    ];
    let mut ran = Vec::new();
    for (i, p) in problems.iter().enumerate() {
        for b in Backend::GPU {
            if b.supports(Some(&dev), p).is_err() {
                continue;
            }
            let [q, k, v] = random_inputs(p, seed + i as u64)
                .unwrap()
                .upload(&dev, p.dtype)
                .unwrap();
            let chain = |sync: bool| -> Vec<u16> {
                let n = p.q_len().unwrap();
                let mut bufs = [
                    Tensor::poisoned(&dev, p.dtype, n).unwrap(),
                    Tensor::poisoned(&dev, p.dtype, n).unwrap(),
                ];
                common::forward(&dev, p, b, [&q, &k, &v], &mut bufs[0]).unwrap();
                for step in 1..8 {
                    let [a, c] = &mut bufs;
                    let (src, dst) = if step % 2 == 1 { (&*a, c) } else { (&*c, a) };
                    common::forward(&dev, p, b, [src, &k, &v], dst).unwrap();
                    if sync {
                        dev.synchronize().unwrap();
                    }
                }
                bufs[1].to_bits(&dev).unwrap()
            };
            let (fast, synced) = (chain(false), chain(true));
            assert!(
                fast == synced,
                "{b} on {p}: chained calls differ from synchronized ones"
            );
            assert!(
                sdpa::decode(p.dtype, &fast).iter().all(|x| x.is_finite()),
                "{b} on {p}: non-finite output"
            );
            ran.push((b, *p));
        }
    }
    common::assert_all_ran("chained calls", &dev, &ran);
}

/// Tensors made and dropped on one handle's stream and used at once by `forward` on another
/// handle's stream give the same bits as the same call made on one stream. Each round queues
/// a long call on the first stream, then uploads Q, K, V there (so the uploads finish late),
/// runs `forward` on the second stream, drops Q, K, V on the first and at once allocates and
/// NaN-fills buffers of the same size there (the freed memory comes back to them). A call
/// that started before the uploads finished, or a free that overtook the call, shows as a
/// different output.
#[test]
fn tensors_used_across_streams_stay_ordered() {
    let Some(a) = common::device("cross-stream") else {
        return;
    };
    let b = a.fork().unwrap();
    let seed = fresh_seed();
    let p = Problem::new(1, 4, 256, 256, 128).with_causal(true);
    let busy = Problem::new(1, 8, 1024, 1024, 128);
    let mut ran = Vec::new();
    for backend in Backend::GPU {
        if backend.supports(Some(&a), &p).is_err() || backend.supports(Some(&a), &busy).is_err() {
            continue;
        }
        let inputs = random_inputs(&p, seed).unwrap();
        let want = run(&b, &p, backend, seed);
        let [bq, bk, bv] = random_inputs(&busy, seed)
            .unwrap()
            .upload(&a, busy.dtype)
            .unwrap();
        let mut busy_out = Tensor::poisoned(&a, busy.dtype, busy.q_len().unwrap()).unwrap();
        for round in 0..6 {
            common::forward(&a, &busy, backend, [&bq, &bk, &bv], &mut busy_out).unwrap();
            let [q, k, v] = inputs.upload(&a, p.dtype).unwrap();
            // The output alternates between the streams: its own free must wait too.
            let out_dev = if round % 2 == 0 { &a } else { &b };
            let mut out = Tensor::poisoned(out_dev, p.dtype, p.q_len().unwrap()).unwrap();
            for _ in 0..4 {
                common::forward(&b, &p, backend, [&q, &k, &v], &mut out).unwrap();
            }
            drop((q, k, v));
            let reuse: Vec<Tensor> = [p.q_len(), p.k_len(), p.k_len()]
                .into_iter()
                .map(|n| Tensor::poisoned(&a, p.dtype, n.unwrap()).unwrap())
                .collect();
            let got = out.to_bits(&b).unwrap();
            drop(reuse);
            assert!(
                got == want,
                "{backend} round {round}: output differs from the one-stream run"
            );
        }
        ran.push((backend, p));
    }
    common::assert_all_ran("cross-stream", &a, &ran);
}

/// GPU 0 through an own handle, a stream the caller made with cudarc, and a handle on that
/// stream (`None` after printing why, without a GPU).
fn callers_stream(test: &str) -> Option<(Device, Arc<CudaStream>, Device)> {
    let own = common::device(test)?;
    let ctx = cudarc::driver::CudaContext::new(0).expect("the GPU's primary context");
    let stream = ctx.new_stream().expect("a stream of the caller's");
    let theirs = Device::from_stream(stream.clone()).unwrap();
    assert!(
        Arc::ptr_eq(theirs.stream(), &stream),
        "the handle is on the caller's stream"
    );
    Some((own, stream, theirs))
}

/// A handle made from the caller's own stream queues there: the results equal those of a
/// handle `Device::new` made, for every backend this GPU must run, and the caller's stream is
/// the one the handle reports.
#[test]
fn a_device_on_the_callers_stream_matches_an_own_one() {
    let Some((own, _, theirs)) = callers_stream("caller's stream") else {
        return;
    };
    let seed = fresh_seed();
    let p = Problem::new(2, 4, 300, 300, 64).with_causal(true);
    let zeros = Tensor::zeros(&theirs, sdpa::DType::Bf16, 1000).unwrap();
    assert!(zeros.to_f32(&theirs).unwrap().iter().all(|&x| x == 0.0));
    let mut ran = Vec::new();
    for b in common::expected_backends(&own) {
        let expected = run(&own, &p, b, seed);
        let got = run(&theirs, &p, b, seed);
        assert!(
            expected == got,
            "{b} on {p}: the caller's stream gave other bits"
        );
        ran.push((b, p));
    }
    common::assert_all_ran("caller's stream", &own, &ran);
}

/// Caller-owned buffers on the caller's stream: q, k, v made as cudarc slices of `half::f16`,
/// taken over by `Tensor::from_cuda_slice` (no copy), the output handed back by
/// `into_cuda_slice`: the same bits as the same inputs through an own handle.
#[test]
fn caller_owned_buffers_round_trip_without_copies() {
    let Some((own, stream, theirs)) = callers_stream("caller-owned buffers") else {
        return;
    };
    let p = Problem::new(1, 4, 130, 77, 64);
    let n = p.q_len().unwrap();
    let inputs = random_inputs(&p, fresh_seed()).unwrap();
    let wrong = Tensor::zeros(&theirs, p.dtype, 4).unwrap();
    assert!(wrong.into_cuda_slice::<half::bf16>().is_err());
    let mut ran = Vec::new();
    for b in common::expected_backends(&own) {
        let [q, k, v] = inputs.upload(&own, p.dtype).unwrap();
        let mut out = Tensor::poisoned(&own, p.dtype, n).unwrap();
        common::forward(&own, &p, b, [&q, &k, &v], &mut out).unwrap();
        let expected = out.to_bits(&own).unwrap();

        let caller_slice = |t: &Tensor| {
            let h: Vec<half::f16> = t
                .to_bits(&own)
                .unwrap()
                .into_iter()
                .map(half::f16::from_bits)
                .collect();
            stream.clone_htod(&h).unwrap()
        };
        let [q2, k2, v2] =
            [&q, &k, &v].map(|t| Tensor::from_cuda_slice(&theirs, caller_slice(t)).unwrap());
        let mut out2 = Tensor::zeros(&theirs, p.dtype, n).unwrap();
        let named = sdpa::Tensors {
            q: &q2,
            k: &k2,
            v: &v2,
            out: &mut out2,
        };
        sdpa::forward(&theirs, &p, b, named, sdpa::Extras::default()).unwrap();
        let handed_back = out2.into_cuda_slice::<half::f16>().unwrap();
        let got: Vec<u16> = stream
            .clone_dtoh(&handed_back)
            .unwrap()
            .into_iter()
            .map(half::f16::to_bits)
            .collect();
        assert!(
            got == expected,
            "{b} on {p}: caller-owned buffers gave other bits"
        );
        ran.push((b, p));
    }
    common::assert_all_ran("caller-owned buffers", &own, &ran);
}
