//! `cargo bench`: every available backend on the named problems (sdpa_harness::problems), timed on
//! the GPU with CUDA events through `iter_custom` (not host clocks). Without a GPU it benches the
//! f64 CPU reference on the mission problem and says so. e4m3 rows: per-head scales, f16 output
//! (the native kernel where built, else each backend's simulated path), accurate and fast FP8
//! modes (`e4m3-fast`: backends without an e4m3 P·V run it as accurate). First, the host cost of
//! a call through tensors and through views (`call_overhead`).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use cudarc::driver::CudaSlice;
use half::f16;
use sdpa::{Backend, DType, Device, Fp8Mode, Problem, Tensor, View, ViewMut, Views};
use sdpa_harness::NAMED_PROBLEMS;
use std::time::{Duration, Instant};

fn gpu_benches(c: &mut Criterion, dev: &Device) {
    for name in NAMED_PROBLEMS.iter().map(|n| n.name) {
        let base = sdpa_harness::named_problem(name).unwrap();
        let mut group = c.benchmark_group(name);
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(200));
        group.measurement_time(Duration::from_secs(1));
        for dtype in DType::INPUTS {
            let p = base.with_dtype(dtype);
            // Throughput in "elements" = floating-point operations: criterion then prints FLOP/s.
            group.throughput(Throughput::Elements(p.flops() as u64));
            let inputs =
                sdpa_harness::inputs::random_inputs(&p, sdpa_harness::inputs::fresh_seed())
                    .unwrap();
            let [q, k, v] = inputs.upload(dev, dtype).unwrap();
            let mut out = Tensor::poisoned(dev, p.output_dtype(), p.out_len().unwrap()).unwrap();
            // e4m3 in both FP8 modes, on the same inputs.
            let modes = match dtype {
                DType::E4m3 => &Fp8Mode::ALL[..],
                _ => &[Fp8Mode::Accurate][..],
            };
            for &mode in modes {
                let p = p.with_fp8_mode(mode);
                let label = match mode {
                    Fp8Mode::Fast => format!("{dtype}-fast"),
                    Fp8Mode::Accurate => dtype.to_string(),
                };
                for backend in Backend::GPU {
                    if let Err(e) = backend.supports(Some(dev), &p) {
                        eprintln!("{name} {label} {backend}: skipped ({e})");
                        continue;
                    }
                    let id = BenchmarkId::new(backend.name(), &label);
                    group.bench_function(id, |b| {
                        b.iter_custom(|iters| {
                            gpu_time(dev, iters, &p, backend, &q, &k, &v, &mut out)
                        })
                    });
                }
            }
        }
        group.finish();
    }
}

/// `iters` calls between two CUDA events on the device's stream.
#[allow(clippy::too_many_arguments)]
fn gpu_time(
    dev: &Device,
    iters: u64,
    p: &Problem,
    backend: Backend,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &mut Tensor,
) -> Duration {
    let plan = sdpa::Plan::new(dev, p, backend).unwrap();
    sdpa_harness::timing::elapsed(dev, || {
        (0..iters).try_for_each(|_| {
            let ops = sdpa::Tensors { q, k, v, out };
            plan.run(ops, sdpa::Extras::default())
        })
    })
    .unwrap()
}

fn cpu_benches(c: &mut Criterion) {
    let p = sdpa_harness::named_problem("mission").unwrap();
    let inputs = sdpa_harness::inputs::random_inputs(&p, 1).unwrap();
    let [q, k, v] = &inputs.values;
    let mut group = c.benchmark_group("mission");
    group
        .sample_size(10)
        .throughput(Throughput::Elements(p.flops() as u64));
    group.bench_function("cpu", |b| b.iter(|| sdpa::reference(&p, q, k, v).unwrap()));
    group.finish();
}

/// Views of Q, K, V and the output at the layout's strides (`qs` for Q and out, `ks` for K, V),
/// made afresh for each call as a framework would.
fn views_of<'a>(
    [q, k, v]: [&'a CudaSlice<f16>; 3],
    out: &'a mut CudaSlice<f16>,
    (qs, ks): (sdpa::Strides, sdpa::Strides),
) -> Views<'a, 'a, f16> {
    Views {
        q: View::new(q.as_view(), qs),
        k: View::new(k.as_view(), ks),
        v: View::new(v.as_view(), ks),
        out: ViewMut::new(out.as_view_mut(), qs),
    }
}

/// What a call costs the host through owned tensors and through views of the caller's memory
/// (the views made afresh each call, as a framework would), on the mission problem with `Auto`,
/// planned once (`plan_*`: a loop's steps) and planned every call (`forward_*`: the one-shot
/// form): wall time of `iters` calls and one synchronisation. The mission kernel is shorter
/// than a call's host work, so this is the host path; in graph replay all are the same kernel.
fn call_overhead(c: &mut Criterion, dev: &Device) {
    let p = sdpa_harness::named_problem("mission").unwrap();
    let inputs = sdpa_harness::inputs::random_inputs(&p, 1).unwrap();
    let [q, k, v] = inputs.upload(dev, p.dtype).unwrap();
    let mut out = Tensor::poisoned(dev, p.dtype, p.q_len().unwrap()).unwrap();
    let host = |bits: &[u16]| -> Vec<f16> { bits.iter().map(|&b| f16::from_bits(b)).collect() };
    let stream = dev.stream();
    let [qc, kc, vc] = [0, 1, 2].map(|i| stream.clone_htod(&host(&inputs.bits[i])).unwrap());
    let mut oc = stream.alloc_zeros::<f16>(p.q_len().unwrap()).unwrap();
    let (qs, ks) = (p.q_strides(), p.k_strides());
    let mut group = c.benchmark_group("call_overhead");
    group.sample_size(20);
    let wall = |iters: u64, f: &mut dyn FnMut()| {
        let t0 = Instant::now();
        (0..iters).for_each(|_| f());
        dev.synchronize().unwrap();
        t0.elapsed()
    };
    let plan = sdpa::Plan::new(dev, &p, Backend::Auto).unwrap();
    group.bench_function("plan_tensors", |b| {
        b.iter_custom(|iters| {
            wall(iters, &mut || {
                let ops = sdpa::Tensors {
                    q: &q,
                    k: &k,
                    v: &v,
                    out: &mut out,
                };
                plan.run(ops, sdpa::Extras::default()).unwrap()
            })
        })
    });
    group.bench_function("plan_views", |b| {
        b.iter_custom(|iters| {
            wall(iters, &mut || {
                let views = views_of([&qc, &kc, &vc], &mut oc, (qs, ks));
                plan.run(views, sdpa::Extras::default()).unwrap()
            })
        })
    });
    // Parts of a run, for the profile of its host time: the backend's checks of the problem
    // (Rust and the core's can_implement, which the core asks again before each launch), and
    // planning itself.
    group.bench_function("supports_cutlass", |b| {
        b.iter(|| Backend::Cutlass.supports(Some(dev), &p))
    });
    group.bench_function("plan_new", |b| {
        b.iter(|| sdpa::Plan::new(dev, &p, Backend::Auto).unwrap())
    });
    group.bench_function("forward_tensors", |b| {
        b.iter_custom(|iters| {
            wall(iters, &mut || {
                sdpa::forward(
                    dev,
                    &p,
                    Backend::Auto,
                    sdpa::Tensors {
                        q: &q,
                        k: &k,
                        v: &v,
                        out: &mut out,
                    },
                    sdpa::Extras::default(),
                )
                .unwrap()
            })
        })
    });
    group.bench_function("forward_views", |b| {
        b.iter_custom(|iters| {
            wall(iters, &mut || {
                let views = views_of([&qc, &kc, &vc], &mut oc, (qs, ks));
                sdpa::forward(dev, &p, Backend::Auto, views, sdpa::Extras::default()).unwrap()
            })
        })
    });
    group.finish();
}

fn benches(c: &mut Criterion) {
    match Device::new(0) {
        Ok(dev) => {
            call_overhead(c, &dev);
            gpu_benches(c, &dev)
        }
        Err(e) => {
            eprintln!("no GPU ({e}): benching the CPU reference on the mission problem only");
            cpu_benches(c);
        }
    }
}

criterion_group!(all, benches);
criterion_main!(all);
