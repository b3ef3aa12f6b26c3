//! The fused GPU backends (scalar, wmma, cutlass, cutlass-sm80) against the float64 reference over
//! one grid: odd and even sequence lengths, seq_q != seq_k both ways, both head dims, dtypes,
//! layouts, causal both ways, GQA. Fresh inputs every run (the seed is printed with any failure).

mod common;

use sdpa::{Backend, DType, Layout, Problem};
use sdpa_harness::check::{check_backend, fresh_seed};

const SEQS: [(usize, usize); 10] = [
    (1, 1),
    (7, 7),
    (77, 77),
    (128, 128),
    (257, 257),
    (1000, 1000),
    (77, 257),
    (257, 77),
    (1, 1000),
    (1000, 1),
];

fn run_grid(backend: Backend, dtype: DType, head_dim: usize) {
    let test = format!("{backend} {dtype} d{head_dim} grid");
    let Some(dev) = common::device(&test) else {
        return;
    };
    let probe = Problem::new(1, 1, 8, 8, head_dim).with_dtype(dtype);
    if let Err(e) = common::backend_runs_here(&test, &dev, backend, &probe) {
        // E.g. the sm_90a kernel on an A100: say so, do not pass silently. A backend this GPU
        // is expected to run panics in backend_runs_here instead.
        common::skip(&test, &format!("not on this GPU: {e}"));
        return;
    }
    let seed = fresh_seed();
    let mut failures = Vec::new();
    let mut ran = Vec::new();
    for (i, &(sq, sk)) in SEQS.iter().enumerate() {
        for causal in [false, true] {
            // Rotate layout and GQA through the grid so each appears with every length.
            let layout = if i % 2 == 0 {
                Layout::Bhsd
            } else {
                Layout::Bshd
            };
            let (heads, kv_heads) = [(2, 2), (4, 2), (4, 1)][i % 3];
            let p = Problem::new(2, heads, sq, sk, head_dim)
                .with_kv_heads(kv_heads)
                .with_causal(causal)
                .with_dtype(dtype)
                .with_layout(layout);
            let rep = check_backend(Some(&dev), &p, backend, seed + ran.len() as u64).unwrap();
            ran.push((backend, p));
            if !rep.pass() {
                failures.push(format!("{backend} {p}: {rep:?}"));
            }
        }
    }
    common::assert_ran(&test, &ran);
    assert!(
        failures.is_empty(),
        "{} of {} failed:\n{}",
        failures.len(),
        ran.len(),
        failures.join("\n")
    );
}

#[test]
fn scalar_f16_d64() {
    run_grid(Backend::Scalar, DType::F16, 64);
}
#[test]
fn scalar_f16_d128() {
    run_grid(Backend::Scalar, DType::F16, 128);
}
#[test]
fn scalar_bf16_d64() {
    run_grid(Backend::Scalar, DType::Bf16, 64);
}
#[test]
fn scalar_bf16_d128() {
    run_grid(Backend::Scalar, DType::Bf16, 128);
}
#[test]
fn wmma_f16_d64() {
    run_grid(Backend::Wmma, DType::F16, 64);
}
#[test]
fn wmma_f16_d128() {
    run_grid(Backend::Wmma, DType::F16, 128);
}
#[test]
fn wmma_bf16_d64() {
    run_grid(Backend::Wmma, DType::Bf16, 64);
}
#[test]
fn wmma_bf16_d128() {
    run_grid(Backend::Wmma, DType::Bf16, 128);
}

#[test]
fn cutlass_f16_d64() {
    run_grid(Backend::Cutlass, DType::F16, 64);
}
#[test]
fn cutlass_f16_d128() {
    run_grid(Backend::Cutlass, DType::F16, 128);
}
#[test]
fn cutlass_bf16_d64() {
    run_grid(Backend::Cutlass, DType::Bf16, 64);
}
#[test]
fn cutlass_bf16_d128() {
    run_grid(Backend::Cutlass, DType::Bf16, 128);
}

#[test]
fn cutlass_sm80_f16_d64() {
    run_grid(Backend::CutlassSm80, DType::F16, 64);
}
#[test]
fn cutlass_sm80_f16_d128() {
    run_grid(Backend::CutlassSm80, DType::F16, 128);
}
#[test]
fn cutlass_sm80_bf16_d64() {
    run_grid(Backend::CutlassSm80, DType::Bf16, 64);
}
#[test]
fn cutlass_sm80_bf16_d128() {
    run_grid(Backend::CutlassSm80, DType::Bf16, 128);
}

/// Same inputs twice must give bit-identical output: a moving result is a race.
#[test]
fn fused_kernels_are_deterministic() {
    let Some(dev) = common::device("determinism") else {
        return;
    };
    let p = Problem::new(2, 4, 333, 333, 128).with_causal(true);
    let mut ran = Vec::new();
    for backend in Backend::GPU {
        if backend.supports(Some(&dev), &p).is_ok() {
            deterministic(&dev, &p, backend);
            ran.push((backend, p));
        }
    }
    // Meant for every GPU backend: each one this GPU should run must have run.
    common::assert_all_ran("determinism", &dev, &ran);
}

fn deterministic(dev: &sdpa::Device, p: &Problem, backend: Backend) {
    let dev = dev.clone();
    let inputs = sdpa_harness::check::random_inputs(p, fresh_seed()).unwrap();
    let [q, k, v] = inputs.upload(&dev, p.dtype).unwrap();
    let mut runs = Vec::new();
    for _ in 0..3 {
        let mut out = sdpa::Tensor::poisoned(&dev, p.dtype, p.q_len().unwrap()).unwrap();
        sdpa::forward(&dev, p, backend, &q, &k, &v, &mut out).unwrap();
        runs.push(out.to_bits(&dev).unwrap());
    }
    assert!(
        runs.windows(2).all(|w| w[0] == w[1]),
        "{backend} output moved between runs"
    );
}

/// Auto resolves to a GPU backend and is as accurate as it.
#[test]
fn auto_runs_on_the_gpu() {
    let Some(dev) = common::device("auto") else {
        return;
    };
    let p = Problem::new(1, 2, 100, 130, 64).with_causal(true);
    let resolved = Backend::Auto.resolve(Some(&dev), &p).unwrap();
    // Straight-line, so it ran if it returned; what can go wrong is auto picking the host or a
    // backend this GPU is not known to run.
    assert!(
        common::expected_backends(&dev).contains(&resolved),
        "auto resolved {p} to {resolved}, not one of this GPU's backends {:?}",
        common::expected_backends(&dev)
    );
    let rep = check_backend(Some(&dev), &p, Backend::Auto, fresh_seed()).unwrap();
    assert!(rep.pass(), "{resolved} (auto) {p}: {rep:?}");
}
