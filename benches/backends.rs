//! `cargo bench`: every available backend on the named problems (sdpa_harness::problems), timed on
//! the GPU with CUDA events through `iter_custom` (not host clocks). Without a GPU it benches the
//! f64 CPU reference on the mission problem and says so. e4m3 rows: per-head scales, f16 output
//! (the native kernel where built, else each backend's simulated path).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use sdpa::{Backend, DType, Device, Problem, Tensor};
use sdpa_harness::NAMED_PROBLEMS;
use std::time::Duration;

fn gpu_benches(c: &mut Criterion, dev: &Device) {
    for &(name, _, _) in NAMED_PROBLEMS.iter() {
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
                sdpa_harness::check::random_inputs(&p, sdpa_harness::check::fresh_seed()).unwrap();
            let [q, k, v] = inputs.upload(dev, dtype).unwrap();
            let mut out = Tensor::poisoned(dev, p.output_dtype(), p.q_len().unwrap()).unwrap();
            for backend in Backend::GPU {
                if let Err(e) = backend.supports(Some(dev), &p) {
                    eprintln!("{name} {dtype} {backend}: skipped ({e})");
                    continue;
                }
                let id = BenchmarkId::new(backend.name(), dtype);
                group.bench_function(id, |b| {
                    b.iter_custom(|iters| gpu_time(dev, iters, &p, backend, &q, &k, &v, &mut out))
                });
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
    sdpa_harness::timing::elapsed(dev, || {
        (0..iters).try_for_each(|_| sdpa::forward(dev, p, backend, q, k, v, out))
    })
    .unwrap()
}

fn cpu_benches(c: &mut Criterion) {
    let p = sdpa_harness::named_problem("mission").unwrap();
    let inputs = sdpa_harness::check::random_inputs(&p, 1).unwrap();
    let [q, k, v] = &inputs.values;
    let mut group = c.benchmark_group("mission");
    group
        .sample_size(10)
        .throughput(Throughput::Elements(p.flops() as u64));
    group.bench_function("cpu", |b| b.iter(|| sdpa::reference(&p, q, k, v).unwrap()));
    group.finish();
}

fn benches(c: &mut Criterion) {
    match Device::new(0) {
        Ok(dev) => gpu_benches(c, &dev),
        Err(e) => {
            eprintln!("no GPU ({e}): benching the CPU reference on the mission problem only");
            cpu_benches(c);
        }
    }
}

criterion_group!(all, benches);
criterion_main!(all);
