//! The fused GPU backends (scalar, wmma) against the float64 reference over the grid of issue
//! #2: odd and even sequence lengths, seq_q != seq_k both ways, both head dims, dtypes,
//! layouts, causal both ways, GQA. Fresh inputs every run (the seed is printed with any failure).

mod common;

use sdpa::check::{check_backend, fresh_seed};
use sdpa::{Backend, DType, Layout, Problem};
use std::io::Write;

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
    let Some(dev) = common::device(&format!("{backend} grid")) else {
        return;
    };
    if let Err(e) = backend.supports(Some(&dev), &Problem::new(1, 1, 8, 8, head_dim)) {
        // E.g. the sm_90a kernel on an A100: say so, do not pass silently.
        let _ = writeln!(
            std::io::stderr(),
            "{backend} grid: skipped on this GPU ({e})"
        );
        return;
    }
    let seed = fresh_seed();
    let mut failures = Vec::new();
    let mut n = 0;
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
            let rep = check_backend(Some(&dev), &p, backend, seed + n).unwrap();
            n += 1;
            if !rep.pass() {
                failures.push(format!("{backend} {p}: {rep:?}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {n} failed:\n{}",
        failures.len(),
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
    for backend in Backend::GPU {
        if backend
            .supports(Some(&dev), &Problem::new(1, 1, 8, 8, 64))
            .is_ok()
        {
            deterministic(&dev, backend);
        }
    }
}

fn deterministic(dev: &sdpa::Device, backend: Backend) {
    let dev = dev.clone();
    let p = Problem::new(2, 4, 333, 333, 128).with_causal(true);
    let inputs = sdpa::check::random_inputs(&p, fresh_seed());
    let [q, k, v] = inputs.upload(&dev, p.dtype).unwrap();
    let mut runs = Vec::new();
    for _ in 0..3 {
        let mut out = sdpa::Tensor::poisoned(&dev, p.dtype, p.q_len().unwrap()).unwrap();
        sdpa::forward(&dev, &p, backend, &q, &k, &v, &mut out).unwrap();
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
    assert_ne!(Backend::Auto.resolve(Some(&dev), &p).unwrap(), Backend::Cpu);
    let rep = check_backend(Some(&dev), &p, Backend::Auto, fresh_seed()).unwrap();
    assert!(rep.pass(), "{rep:?}");
}
