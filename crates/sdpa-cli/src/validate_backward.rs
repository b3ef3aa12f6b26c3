//! `sdpa validate --backward`: backend x problem -> dQ's, dK's and dV's errors against the
//! float64 reference gradient (sdpa_harness::grad), pass/fail at the dtype's bar.

use crate::CliResult;
use crate::validate::dtype_label;
use sdpa::{Backend, Device, DqReduction, Problem};
use sdpa_harness::grad::check_backward;
use std::process::ExitCode;

/// Checks each backend's backward on each problem (fresh inputs from `seed` and the problem's
/// index) in `reduction`'s dQ mode; a backend without a backward for a problem is reported as
/// skipped with its reason.
pub fn run(
    dev: &Device,
    problems: &[(String, Problem)],
    backends: &[Backend],
    reduction: DqReduction,
    seed: u64,
) -> CliResult<ExitCode> {
    outln!("seed {seed}, backward, dQ {reduction:?}")?;
    outln!(
        "{:<8} {:<22} {:<6} {:<4} {:>10} {:>10} {:>10} {:>10}  result",
        "backend",
        "problem",
        "dtype",
        "grad",
        "rel_err",
        "rel_tol",
        "max_err",
        "max_tol"
    )?;
    let (mut failed, mut ran) = (0, 0);
    for (i, (name, p)) in problems.iter().enumerate() {
        for &b in backends {
            let line = |grad: &str, r: &str| {
                format!(
                    "{:<8} {:<22} {:<6} {grad:<4} {r}",
                    b.name(),
                    name,
                    dtype_label(p)
                )
            };
            let seed = seed.wrapping_add(i as u64);
            let r = match check_backward(dev, p, b, reduction, seed) {
                Ok(r) => r,
                Err(e @ sdpa::Error::Unsupported { .. }) => {
                    outln!("{}", line("", &format!("{:>43}  skipped: {e}", "")))?;
                    continue;
                }
                Err(e) => {
                    ran += 1;
                    failed += 1;
                    outln!("{}", line("", &format!("{:>43}  FAIL: {e}", "")))?;
                    continue;
                }
            };
            ran += 1;
            failed += usize::from(!r.pass());
            let note = if b == Backend::Auto {
                format!(" (auto chose {})", r.backend)
            } else {
                String::new()
            };
            for (grad, x) in ["dq", "dk", "dv"].iter().zip(&r.reports) {
                let verdict = if x.pass() { "pass" } else { "FAIL" };
                let nan = match x.nan_count {
                    0 => String::new(),
                    n => format!(" ({n} NaN)"),
                };
                let text = format!(
                    "{:>10.3e} {:>10.1e} {:>10.3e} {:>10.1e}  {verdict}{nan}{note}",
                    x.rel_err, x.tol.rel, x.max_err, x.tol.max_abs
                );
                outln!("{}", line(grad, &text))?;
            }
            if let Some((err, bar)) = r.dsinks {
                let verdict = if err <= bar { "pass" } else { "FAIL" };
                let text = format!("{:>21} {err:>10.3e} {bar:>10.1e}  {verdict}", "");
                outln!("{}", line("ds", &text))?;
            }
        }
    }
    crate::validate::verdict("backward checks", ran, failed)
}
