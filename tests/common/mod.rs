//! Shared by the integration tests: how a GPU test gets its device, and how it proves that it
//! ran something (a loop over the backends `supports` accepts passes with zero iterations
//! when `supports` wrongly refuses them all).
#![allow(dead_code)]

use sdpa::{Backend, DType, Device, Extras, Problem, Tensor, Tensors};
use std::fmt::Debug;
use std::io::Write;

/// GPU 0, or `None` after printing why the test is skipped. With `SDPA_REQUIRE_GPU=1` a missing
/// GPU fails the test instead, so a GPU run cannot pass by skipping.
pub fn device(test: &str) -> Option<Device> {
    gpu(test).map_err(|Skip(why)| skip(test, &why)).ok()
}

/// Why a GPU test checked nothing here (no GPU; a kernel this GPU is not expected to run), for
/// a harness that reports the test as skipped rather than passed.
#[derive(Debug)]
pub struct Skip(pub String);

/// [`device`] for a harness that reports skips itself: GPU 0, or why the test is skipped
/// (nothing printed). With `SDPA_REQUIRE_GPU=1` a missing GPU panics instead.
pub fn gpu(test: &str) -> Result<Device, Skip> {
    Device::new(0).map_err(|e| {
        if require_gpu() {
            panic!("{test}: SDPA_REQUIRE_GPU=1 but no GPU is usable: {e}");
        }
        match e {
            sdpa::Error::NoDevice(_) => Skip(e.to_string()), // "no GPU: <why>"
            e => Skip(format!("GPU 0 is not usable: {e}")),
        }
    })
}

/// Whether `SDPA_REQUIRE_GPU=1` is set: skipping for want of a GPU is then a failure.
pub fn require_gpu() -> bool {
    std::env::var("SDPA_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// `sdpa::forward` on owned tensors with no extras, the call most tests make.
pub fn forward(
    dev: &Device,
    p: &Problem,
    backend: Backend,
    [q, k, v]: [&Tensor; 3],
    out: &mut Tensor,
) -> sdpa::Result<()> {
    sdpa::forward(dev, p, backend, Tensors { q, k, v, out }, Extras::default())
}

/// Prints a skip reason where libtest does not swallow it (straight to stderr: libtest would
/// swallow an eprintln! from a passing test).
pub fn skip(test: &str, why: &str) {
    let _ = writeln!(std::io::stderr(), "{test}: skipped ({why})");
}

/// The GPU backends that must run ordinary problems (f16, bf16 or e4m3, head_dim 64 or 128,
/// sizes far from any limit) on `dev`: scalar, wmma, cublas and cutlass-sm80 from compute
/// capability 8.0, and cutlass (the sm_90a kernel) on 9.0 when the build holds sm_90a code.
/// CUTLASS itself is always present (the build fetches it when none is given), so a refusal
/// from one of these is a broken build or install, not a property of the GPU.
pub fn expected_backends(dev: &Device) -> Vec<Backend> {
    let (major, minor) = dev
        .compute_capability()
        .expect("the GPU's compute capability");
    let hopper = (major, minor) == (9, 0) && sdpa_harness::info::built_with_sm90a();
    Backend::GPU
        .into_iter()
        .filter(|&b| match b {
            Backend::Cutlass => hopper,
            _ => major >= 8,
        })
        .collect()
}

/// Panics unless the test recorded at least one GPU run: a GPU test that executed nothing
/// checked nothing, and must not pass.
pub fn assert_ran<T: Debug>(test: &str, ran: &[T]) {
    assert!(
        !ran.is_empty(),
        "{test}: nothing ran on the GPU (every backend or case was skipped), so nothing was checked"
    );
}

/// [`assert_ran`], and every backend this GPU is expected to run ([`expected_backends`]) ran
/// at least once: for tests meant to cover every GPU backend.
pub fn assert_all_ran(test: &str, dev: &Device, ran: &[(Backend, Problem)]) {
    assert_ran(test, ran);
    let missing: Vec<String> = expected_backends(dev)
        .into_iter()
        .filter(|b| !ran.iter().any(|(r, _)| r == b))
        .map(|b| {
            // Why not, on a problem every backend takes, to tell a refusal from a test bug.
            let probe = Problem::new(1, 1, 8, 8, 64);
            match b.supports(Some(dev), &probe) {
                Ok(()) => format!("{b} (it supports {probe}; the test never ran it)"),
                Err(e) => format!("{b} (on {probe}: {e})"),
            }
        })
        .collect();
    assert!(
        missing.is_empty(),
        "{test}: backends this GPU must run did not run: {}; ran {} runs",
        missing.join("; "),
        ran.len()
    );
}

/// [`assert_all_ran`] for each of `dtypes` separately: a backend that refuses one dtype must
/// not hide behind its runs of another.
pub fn assert_all_ran_per_dtype(
    test: &str,
    dev: &Device,
    ran: &[(Backend, Problem)],
    dtypes: &[DType],
) {
    for &dtype in dtypes {
        let of_dtype: Vec<(Backend, Problem)> = ran
            .iter()
            .filter(|(_, p)| p.dtype == dtype)
            .copied()
            .collect();
        assert_all_ran(&format!("{test} ({dtype})"), dev, &of_dtype);
    }
}

/// For a test of one backend: `Ok(())` when it supports `p` on `dev`; `Err` with the reason
/// when it does not and this GPU is not expected to run it (a skip the caller reports); a
/// panic when this GPU is expected to run it and `supports` refuses.
pub fn backend_runs_here(
    test: &str,
    dev: &Device,
    backend: Backend,
    p: &Problem,
) -> Result<(), String> {
    match backend.supports(Some(dev), p) {
        Ok(()) => Ok(()),
        Err(e) if expected_backends(dev).contains(&backend) => {
            panic!("{test}: this GPU must run {backend}, but it refuses {p}: {e}")
        }
        Err(e) => Err(e.to_string()),
    }
}

/// Runs `b` on `x` (owned tensors) against the f64 reference, output and log-sum-exp; a
/// failure's description, or None. Prints rel_err and the bar, tagged `what` and the inputs'
/// family.
pub fn check_reference(
    dev: &Device,
    p: &Problem,
    b: Backend,
    x: &sdpa_harness::inputs::Inputs,
    what: &str,
) -> Option<String> {
    use sdpa_harness::check::{LSE_TOLERANCE, check_output, compare_lse, run_backend_with_lse};
    let want = x.reference(p).unwrap();
    let (got, lse) = run_backend_with_lse(Some(dev), p, b, x, Some(&want)).unwrap();
    let r = check_output(&got, &want.out, p, x, 0).unwrap();
    eprintln!(
        "{b} {p} [{what}, {}]: rel_err {:.2e} (bar {:.1e}), max_err {:.2e}",
        x.family, r.rel_err, r.tol.rel, r.max_err
    );
    if !r.pass() {
        return Some(format!("{b} {p} [{what}, {}]: {r:?}", x.family));
    }
    if let Some(lse) = lse {
        let (err, bad) = compare_lse(&lse, &want.lse);
        if bad > 0 || err > LSE_TOLERANCE {
            return Some(format!("{b} {p} [{what}]: lse {err} ({bad} rows off)"));
        }
    }
    None
}

/// The rows of `p`'s paged cache that no sequence's first `seqused_k` keys hold (the rest of each
/// sequence's pages, and the pages no sequence uses), by row index (page * page_size + slot):
/// the rows a hostile cache fills with NaN to show that no kernel reads them.
pub fn rows_past_seqused(p: &Problem, meta: &sdpa::SeqMeta) -> Vec<usize> {
    let sdpa::KvRows::Paged {
        pages, page_size, ..
    } = p.seqs.kv
    else {
        unreachable!("a paged problem")
    };
    let (used, table) = (
        meta.seqused_k.as_ref().expect("seqused_k"),
        meta.block_table.as_ref().expect("a block table"),
    );
    let per_seq = table.len() / p.batch;
    let mut live = vec![false; pages * page_size];
    for b in 0..p.batch {
        for j in 0..used[b] as usize {
            live[table[b * per_seq + j / page_size] as usize * page_size + j % page_size] = true;
        }
    }
    (0..live.len()).filter(|&r| !live[r]).collect()
}
