//! The fused GPU kernels against the float64 reference over one grid: odd and even sequence
//! lengths, seq_q != seq_k both ways, layouts, causal both ways, GQA. Fresh inputs every run (the
//! seed is printed with any failure).
//!
//! A custom harness (libtest-mimic), so that the kernels are enumerated, not written out: each
//! instantiation in sdpa-sys/cpp/kernels.txt ([`sdpa::backend::instances`]) is its own trial, named
//! `<backend>_<dtype>_d<head_dim>` with `-` as `_` (`cutlass_sm80_f16_d64`). A line added there
//! is tested with no edit here, `cargo test --test fused cutlass_sm80_f16_d64` runs one kernel,
//! and a failure names it. `fused_kernels_are_deterministic` and `auto_runs_on_the_gpu` are
//! trials too.
//!
//! A trial that cannot run here is reported as *ignored*, with the reason (no GPU; a kernel this
//! GPU is not expected to run, such as the sm_90a one on an A100), not as passed: it checked
//! nothing. With `SDPA_REQUIRE_GPU=1` a missing GPU fails every trial instead, and on a GPU a
//! backend it is expected to run that refuses its kernel's problem fails the trial
//! (`common::backend_runs_here`).

mod common;

use common::Skip;
use libtest_mimic::{Arguments, Completion, Trial};
use sdpa::backend::Instance;
use sdpa::{Backend, Layout, Problem};
use sdpa_harness::check::check_backend;
use sdpa_harness::inputs::fresh_seed;

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

fn main() {
    let args = Arguments::from_args();
    let mut trials: Vec<Trial> = sdpa::backend::instances()
        .map(|k| trial(trial_name(k), move || run_grid(k)))
        .collect();
    trials.push(trial(
        "fused_kernels_are_deterministic",
        fused_kernels_are_deterministic,
    ));
    trials.push(trial("auto_runs_on_the_gpu", auto_runs_on_the_gpu));
    libtest_mimic::run(&args, trials).exit();
}

/// `cutlass-sm80 f16 d64` -> `cutlass_sm80_f16_d64`: a name a test filter takes as it is.
fn trial_name(k: Instance) -> String {
    format!(
        "{}_{}_d{}",
        k.backend.name().replace('-', "_"),
        k.dtype,
        k.head_dim
    )
}

/// A trial whose body returns `Err(Skip)` when it checked nothing here (reported as ignored,
/// with the reason) and fails by panicking, as a `#[test]` does.
fn trial(
    name: impl Into<String>,
    body: impl FnOnce() -> Result<(), Skip> + Send + 'static,
) -> Trial {
    Trial::ignorable_test(name, move || {
        Ok(match body() {
            Ok(()) => Completion::Completed,
            Err(Skip(why)) => Completion::ignored_with(why),
        })
    })
}

/// Kernel `k` on the grid against the reference.
fn run_grid(k: Instance) -> Result<(), Skip> {
    let backend = k.backend;
    let test = format!("{k} grid");
    let dev = common::gpu(&test)?;
    let probe = grid_problem(k, 0, 8, 8, false);
    // E.g. the sm_90a kernel on an A100: say so, do not pass silently. A backend this GPU is
    // expected to run panics in backend_runs_here instead.
    common::backend_runs_here(&test, &dev, backend, &probe)
        .map_err(|e| Skip(format!("not on this GPU: {e}")))?;
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
            let p = grid_problem(k, i, sq, sk, causal).with_layout(layout);
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
    Ok(())
}

/// Grid point `i` of kernel `k`: 2 sequences of sq queries against sk keys, GQA rotating
/// through MHA, 2 and 4 query heads a K/V head. cutlass's 576 kernel runs MLA's absorbed decode
/// only: its points are decode steps of 1, 2 or 16 tokens of 128, 64 or 16 query heads on one
/// latent head whose first 512 columns are V.
fn grid_problem(k: Instance, i: usize, sq: usize, sk: usize, causal: bool) -> Problem {
    if k.backend == Backend::Cutlass && k.head_dim == 576 {
        let (tokens, heads) = [(1, 128), (2, 64), (16, 16)][i % 3];
        return Problem::new(2, heads, tokens.min(sq.max(1)), sk, 576)
            .with_kv_heads(1)
            .with_head_dim_v(512)
            .with_v_in_k(true)
            .with_causal(causal)
            .with_dtype(k.dtype);
    }
    let (heads, kv_heads) = [(2, 2), (4, 2), (4, 1)][i % 3];
    Problem::new(2, heads, sq, sk, k.head_dim)
        .with_kv_heads(kv_heads)
        .with_causal(causal)
        .with_dtype(k.dtype)
}

/// Same inputs twice must give bit-identical output: a moving result is a race.
fn fused_kernels_are_deterministic() -> Result<(), Skip> {
    let dev = common::gpu("determinism")?;
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
    Ok(())
}

fn deterministic(dev: &sdpa::Device, p: &Problem, backend: Backend) {
    let dev = dev.clone();
    let inputs = sdpa_harness::inputs::random_inputs(p, fresh_seed()).unwrap();
    let [q, k, v] = inputs.upload(&dev, p.dtype).unwrap();
    let mut runs = Vec::new();
    for _ in 0..3 {
        let mut out = sdpa::Tensor::poisoned(&dev, p.dtype, p.q_len().unwrap()).unwrap();
        common::forward(&dev, p, backend, [&q, &k, &v], &mut out).unwrap();
        runs.push(out.to_bits(&dev).unwrap());
    }
    assert!(
        runs.windows(2).all(|w| w[0] == w[1]),
        "{backend} output moved between runs"
    );
}

/// Auto resolves to a GPU backend and is as accurate as it.
fn auto_runs_on_the_gpu() -> Result<(), Skip> {
    let dev = common::gpu("auto")?;
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
    Ok(())
}
