//! `sdpa validate`: backend x problem -> rel_err, max_err, pass/fail against the f64 reference.

use crate::progress::Progress;
use crate::{CliResult, chosen_backend, device_for};
use sdpa::{Alibi, Backend, DType, Device, Fp8Mode, Layout, Mask, Problem, Result, Scaling};
use sdpa_harness::check::{
    compare, compare_lse, compare_with, run_backend_with_lse, tolerance_for,
};
use sdpa_harness::inputs::{Inputs, fresh_seed, named_inputs};
use std::process::ExitCode;

/// `--problem`'s help: every named problem (sdpa_harness::NAMED_PROBLEMS), so the list cannot
/// fall behind the table.
fn named_problems_help() -> String {
    let names: Vec<&str> = sdpa_harness::NAMED_PROBLEMS
        .iter()
        .map(|p| p.name)
        .collect();
    format!("Named problems (comma-separated): {}", names.join(", "))
}

/// Arguments shared by `validate` and `bench`: which problems.
#[derive(clap::Args, Clone)]
pub struct ProblemArgs {
    /// Named problems (comma-separated; the help lists every one).
    #[arg(long, value_delimiter = ',', help = named_problems_help())]
    pub problem: Vec<String>,
    /// Extra shapes, BATCH,HEADS,SEQ_Q,SEQ_K,HEAD_DIM (repeatable).
    #[arg(long)]
    pub shape: Vec<String>,
    /// Causal masking: both, yes (only causal), no, or named (as the problem's name says).
    /// Default: both for validate, named for bench.
    #[arg(long)]
    pub causal: Option<String>,
    /// Element types (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "f16,bf16")]
    pub dtype: Vec<String>,
    /// Memory layout: bhsd or bshd.
    #[arg(long, default_value = "bhsd")]
    pub layout: String,
    /// K/V heads (GQA); default: as many as query heads.
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// e4m3 inputs and e4m3 K/V caches (the -fp8kv problems): scales per tensor or per (batch,
    /// head) of each tensor's shape (a paged cache's: per K/V head): tensor or head.
    #[arg(long, default_value = "head")]
    pub scaling: String,
    /// Output dtype, for the input dtypes that can write it: f16 or bf16 for e4m3 inputs
    /// (default f16), f32 for f16/bf16 inputs (cutlass on sm_90a and cpu write it; default: the
    /// input dtype).
    #[arg(long)]
    pub out_dtype: Option<String>,
    /// e4m3 inputs: how P·V runs (comma-separated): accurate (16 bit) or fast (e4m3 tensor
    /// cores where the backend has them, P rounded to e4m3). Default: each e4m3 problem in
    /// both modes, each held to its own bar.
    #[arg(long, value_delimiter = ',')]
    pub fp8_mode: Vec<String>,
    /// A mask instead of --causal: none, causal, causal-top-left, or a sliding window L,R (keys
    /// left and right of the bottom-right diagonal, -1 unbounded; FlashAttention's window_size).
    #[arg(long, allow_hyphen_values = true)]
    pub mask: Option<String>,
    /// Sliding window L,R: the same as --mask L,R.
    #[arg(long, allow_hyphen_values = true)]
    pub window: Option<String>,
    /// Logit cap: scores become softcap · tanh(scores / softcap).
    #[arg(long, allow_negative_numbers = true)]
    pub softcap: Option<f32>,
    /// ALiBi with generated slopes (2^(-8 (h + 1) / heads)): per head (`head`) or per batch and
    /// head (`batch-head`).
    #[arg(long)]
    pub alibi: Option<String>,
    /// Also check (validate) or write (bench) each row's log-sum-exp.
    #[arg(long)]
    pub lse: bool,
}

impl ProblemArgs {
    /// Expands the arguments into concrete problems, `default` names when none are given.
    pub fn problems(
        &self,
        default: &[&str],
        default_causal: &str,
    ) -> Result<Vec<(String, Problem)>> {
        let layout: Layout = self.layout.parse()?;
        let mask: Option<Mask> = match (&self.mask, &self.window) {
            (Some(_), Some(_)) => {
                return Err(sdpa::Error::InvalidArgument(
                    "give --mask or --window, not both".into(),
                ));
            }
            (Some(m), None) | (None, Some(m)) => Some(m.parse()?),
            (None, None) => None,
        };
        let alibi = match self.alibi.as_deref() {
            None => None,
            Some("head") => Some(Alibi::PerHead),
            Some("batch-head") => Some(Alibi::PerBatchHead),
            Some(a) => {
                return Err(sdpa::Error::InvalidArgument(format!(
                    "--alibi {a:?}: expected head or batch-head"
                )));
            }
        };
        let scaling: Scaling = self.scaling.parse()?;
        let out_dtype: Option<DType> = self.out_dtype.as_deref().map(str::parse).transpose()?;
        let fp8_modes: Vec<Fp8Mode> = match self.fp8_mode.is_empty() {
            true => Fp8Mode::ALL.to_vec(),
            false => self
                .fp8_mode
                .iter()
                .map(|m| m.parse())
                .collect::<Result<_>>()?,
        };
        let causal: &[bool] = match self.causal.as_deref().unwrap_or(default_causal) {
            "both" => &[false, true],
            "yes" | "true" | "on" => &[true],
            "no" | "false" | "off" => &[false],
            "named" => &[],
            c => {
                return Err(sdpa::Error::InvalidArgument(format!(
                    "--causal {c:?}: expected both, yes, no or named"
                )));
            }
        };
        let mut bases = Vec::new();
        let defaulted = self.problem.is_empty() && self.shape.is_empty();
        let names: Vec<String> = if defaulted {
            default.iter().map(|s| s.to_string()).collect()
        } else {
            self.problem.clone()
        };
        for n in &names {
            let p = sdpa_harness::named_problem(n)?;
            if causal.is_empty() {
                bases.push((n.clone(), p));
            } else {
                bases.push((n.trim_end_matches("-causal").to_string(), p));
            }
        }
        for s in &self.shape {
            let dims: Vec<usize> = s
                .split(',')
                .map(|x| x.trim().parse::<usize>())
                .collect::<std::result::Result<_, _>>()
                .map_err(|_| sdpa::Error::InvalidArgument(format!("--shape {s:?}: not numbers")))?;
            let [b, h, sq, sk, d] = dims[..] else {
                return Err(sdpa::Error::InvalidArgument(format!(
                    "--shape {s:?}: expected BATCH,HEADS,SEQ_Q,SEQ_K,HEAD_DIM"
                )));
            };
            bases.push((
                format!("B{b}-H{h}-Sq{sq}-Sk{sk}-D{d}"),
                Problem::new(b, h, sq, sk, d),
            ));
        }
        let dtypes: Vec<DType> = self
            .dtype
            .iter()
            .map(|d| d.parse())
            .collect::<Result<_>>()?;
        if let Some(d) = dtypes.iter().find(|d| !d.is_input()) {
            return Err(sdpa::Error::InvalidArgument(format!(
                "--dtype {d}: {d} is an output type only (--out-dtype {d} writes it from f16 or \
                 bf16 inputs)"
            )));
        }
        if !self.fp8_mode.is_empty() && !dtypes.contains(&DType::E4m3) {
            return Err(sdpa::Error::InvalidArgument(
                "--fp8-mode applies to e4m3 problems; add e4m3 to --dtype".into(),
            ));
        }
        if let Some(o) = out_dtype
            && !dtypes.iter().any(|&d| writes(d, o))
        {
            return Err(sdpa::Error::InvalidArgument(format!(
                "--out-dtype {o} applies to none of --dtype's types (e4m3 inputs take f16 or \
                 bf16, f16/bf16 inputs f32)"
            )));
        }
        let mut out: Vec<(String, Problem)> = Vec::new();
        for dtype in dtypes {
            for (name, base) in &bases {
                // A named problem's own band (a window) stays: --causal does not replace it.
                let named = [base.is_causal()];
                let keep = causal.is_empty() || !base.is_plain();
                for &c in if keep { &named[..] } else { causal } {
                    let mut p = base.with_dtype(dtype).with_layout(layout);
                    if !keep {
                        p = p.with_causal(c);
                    }
                    if let Some(m) = mask {
                        p = p.with_mask(m);
                    }
                    if let Some(cap) = self.softcap {
                        p = p.with_softcap(cap);
                    }
                    if let Some(a) = alibi {
                        p = p.with_alibi(a);
                    }
                    p = p.with_lse(self.lse);
                    if let Some(kv) = self.kv_heads {
                        p = p.with_kv_heads(kv);
                    }
                    if dtype == DType::E4m3 || p.is_fp8_kv() {
                        p = p.with_fp8_scaling(scaling);
                    }
                    if let Some(o) = out_dtype.filter(|&o| writes(dtype, o)) {
                        p = p.with_out_dtype(o);
                    }
                    let mut name = name.clone();
                    if !keep && c && !name.ends_with("-causal") {
                        name.push_str("-causal");
                    }
                    if mask.is_some() && !matches!(p.mask.canonical(), Mask::None) {
                        name = format!("{name}-{}", p.mask);
                    }
                    // An e4m3 problem once per mode asked for (the mode is in its dtype label).
                    let modes = match dtype {
                        DType::E4m3 => &fp8_modes[..],
                        _ => &[Fp8Mode::Accurate][..],
                    };
                    for &m in modes {
                        let p = p.with_fp8_mode(m);
                        // A default problem the options do not apply to (e4m3 on a packed
                        // batch) is left out, and said so; one asked for is an error.
                        match p.validate() {
                            Err(e) if defaulted => {
                                note!("{name} {}: left out: {e}", dtype_label(&p));
                                continue;
                            }
                            r => r?,
                        }
                        if !out.iter().any(|(_, q)| *q == p) {
                            out.push((name.clone(), p));
                        }
                    }
                }
            }
        }
        Ok(out)
    }
}

/// The dtype column: `e4m3>f16/accurate` (or `/fast`) for e4m3 inputs, `f16>f32` for an f32
/// output, the dtype otherwise.
pub fn dtype_label(p: &Problem) -> String {
    if p.is_fp8_kv() {
        format!("{}/kv-e4m3", p.dtype)
    } else if p.dtype == DType::E4m3 {
        format!("e4m3>{}/{}", p.output_dtype(), p.fp8_mode)
    } else if p.output_dtype() != p.dtype {
        format!("{}>{}", p.dtype, p.output_dtype())
    } else {
        p.dtype.name().to_string()
    }
}

/// Whether inputs of `input` can have an output of `out` other than their default: f16 or
/// bf16 for e4m3 inputs, f32 for f16/bf16 ones (what `--out-dtype` applies to).
fn writes(input: DType, out: DType) -> bool {
    match input {
        DType::E4m3 => DType::ALL.contains(&out),
        DType::F16 | DType::Bf16 => out == DType::F32,
        DType::F32 => false,
    }
}

/// Parses a backend list; empty means `cpu` plus every GPU backend.
pub fn backends(names: &[String]) -> Result<Vec<Backend>> {
    if names.is_empty() {
        return Ok([Backend::Cpu].into_iter().chain(Backend::GPU).collect());
    }
    names.iter().map(|n| n.parse()).collect()
}

/// Refuses a backend named on the command line that can run none of `problems` on `dev`: the
/// error is its reason for the first problem. (One that can run some of them runs those, and
/// the others are reported as skipped.)
pub fn require_runnable(
    dev: Option<&Device>,
    backends: &[Backend],
    problems: &[(String, Problem)],
) -> Result<()> {
    for &b in backends {
        let mut first_reason = None;
        for (_, p) in problems {
            match chosen_backend(dev, p, b).and_then(|r| r.supports(dev, p)) {
                Ok(()) => {
                    first_reason = None;
                    break;
                }
                Err(e) => {
                    first_reason.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_reason {
            return Err(e);
        }
    }
    Ok(())
}

/// `auto`'s choice, for the line that reports a result: ` (auto chose X)`; empty otherwise.
pub fn auto_note(requested: Backend, ran: Backend) -> String {
    if requested == Backend::Auto {
        format!(" (auto chose {ran})")
    } else {
        String::new()
    }
}

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    problems: ProblemArgs,
    /// Backends (comma-separated); default: cpu and every GPU backend.
    #[arg(long, value_delimiter = ',')]
    backend: Vec<String>,
    /// Seed for the random inputs; default: fresh every run.
    #[arg(long)]
    seed: Option<u64>,
    /// Check the gradients (dQ, dK, dV, and the sinks') against the float64 reference gradient
    /// instead of the output; the backends default to every GPU backend.
    #[arg(long)]
    backward: bool,
    /// With --backward: dQ summed in a fixed order (bitwise repeatable) instead of with atomics.
    #[arg(long, requires = "backward")]
    deterministic: bool,
}

pub fn main(a: Args) -> CliResult<ExitCode> {
    let problems = a
        .problems
        .problems(&["mission", "s1k-d64", "s2k-d128"], "both")?;
    let named = !a.backend.is_empty();
    if a.backward {
        let backends = match named {
            true => backends(&a.backend)?,
            false => Backend::GPU.to_vec(),
        };
        let dev = Device::new(0).map_err(|e| {
            sdpa::Error::NoDevice(format!("{e}; validate --backward runs on a GPU"))
        })?;
        let reduction = match a.deterministic {
            true => sdpa::DqReduction::Deterministic,
            false => sdpa::DqReduction::Atomic,
        };
        let seed = a.seed.unwrap_or_else(fresh_seed);
        return crate::validate_backward::run(&dev, &problems, &backends, reduction, seed);
    }
    let mut backends = backends(&a.backend)?;
    let dev = device_for(&backends, named)?;
    if named {
        require_runnable(dev.as_ref(), &backends, &problems)?;
    } else if dev.is_none() {
        backends.retain(|b| *b == Backend::Cpu);
    }
    let seed = a.seed.unwrap_or_else(fresh_seed);
    outln!("seed {seed}")?;
    outln!(
        "{:<8} {:<22} {:<18} {:>10} {:>10} {:>10} {:>10}  result",
        "backend",
        "problem",
        "dtype",
        "rel_err",
        "rel_tol",
        "max_err",
        "max_tol"
    )?;
    let (mut failed, mut ran) = (0, 0);
    let progress = Progress::new(problems.len() * backends.len(), "validate");
    for (i, (name, p)) in problems.iter().enumerate() {
        // Both FP8 modes of a case draw the same inputs: their rows compare like for like.
        let case = |q: &Problem| q.with_fp8_mode(Fp8Mode::Accurate);
        let first = problems
            .iter()
            .position(|(n, q)| n == name && case(q) == case(p))
            .unwrap_or(i);
        let inputs: Inputs = named_inputs(name, p, seed.wrapping_add(first as u64))?;
        let want = inputs.reference(p)?;
        // The bar of the problem's dtype and mode (fast FP8: from the emulated reference).
        let (tol, emulated) = tolerance_for(p, &inputs, &want.out)?;
        let e2e_want = match &inputs.fp8 {
            Some(f) => {
                let [q, k, v] = &f.unquantized;
                let (slopes, sinks) = (inputs.alibi_slopes.as_deref(), inputs.sinks.as_deref());
                Some(sdpa::reference_with(p, q, k, v, slopes, sinks)?.out)
            }
            None => None,
        };
        for &b in &backends {
            let line = |r: &str| format!("{:<8} {:<22} {:<18} {r}", b.name(), name, dtype_label(p));
            progress.step(format!("{} {name} {}", b.name(), dtype_label(p)));
            progress.tick();
            let chosen = chosen_backend(dev.as_ref(), p, b);
            let runs = chosen.and_then(|c| c.supports(dev.as_ref(), p).map(|()| c));
            let ran_as = match runs {
                Ok(c) => c,
                Err(e) => {
                    progress
                        .suspend(|| outln!("{}", line(&format!("{:>43}  skipped: {e}", ""))))?;
                    continue;
                }
            };
            let note = auto_note(b, ran_as);
            ran += 1;
            match run_backend_with_lse(dev.as_ref(), p, ran_as, &inputs, Some(&want)) {
                Ok((got, lse)) => {
                    let mut r = compare_with(&got, &want.out, tol, seed);
                    r.emulated_rel_err = emulated;
                    if let Some(lse) = &lse {
                        let (err, mismatched) = compare_lse(lse, &want.lse);
                        r.lse_err = Some(err);
                        r.nan_count += mismatched;
                    }
                    // e4m3: also the error against the unquantized inputs (quantization included).
                    let e2e = match (&inputs.fp8, &e2e_want) {
                        (Some(_), Some(w)) => {
                            format!(
                                " (end to end {:.3e})",
                                compare(&got, w, p.dtype, seed).rel_err
                            )
                        }
                        _ => String::new(),
                    };
                    let e2e = match r.lse_err {
                        Some(e) => format!("{e2e} (lse {e:.1e})"),
                        None => e2e,
                    };
                    let e2e = match r.emulated_rel_err {
                        Some(e) => format!("{e2e} (emulated {e:.3e}, cos {:.5})", r.cosine),
                        None => e2e,
                    };
                    let verdict = if r.pass() { "pass" } else { "FAIL" };
                    failed += usize::from(!r.pass());
                    let text = line(&format!(
                        "{:>10.3e} {:>10.1e} {:>10.3e} {:>10.1e}  {verdict}{}{note}",
                        r.rel_err,
                        r.tol.rel,
                        r.max_err,
                        r.tol.max_abs,
                        if r.nan_count > 0 {
                            format!(" ({} NaN)", r.nan_count)
                        } else {
                            e2e
                        }
                    ));
                    progress.suspend(|| outln!("{text}"))?;
                }
                Err(e) => {
                    failed += 1;
                    progress
                        .suspend(|| outln!("{}", line(&format!("{:>43}  FAIL: {e}{note}", ""))))?;
                }
            }
        }
    }
    drop(progress);
    verdict("checks", ran, failed)
}

/// The last line of a validation, `N of M {what} passed`, and its exit code: failure where any
/// check failed or none ran.
pub fn verdict(what: &str, ran: usize, failed: usize) -> CliResult<ExitCode> {
    outln!("{} of {ran} {what} passed", ran - failed)?;
    Ok(if failed == 0 && ran > 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        problems: ProblemArgs,
    }

    fn expand(args: &[&str], default: &[&str]) -> Result<Vec<(String, Problem)>> {
        let cli = Cli::try_parse_from(std::iter::once("sdpa").chain(args.iter().copied()))
            .expect("arguments parse");
        cli.problems.problems(default, "named")
    }

    /// e4m3 over the default problems leaves out those it cannot take (packed sequences) and
    /// keeps the rest; the same problem asked for by name is an error.
    #[test]
    fn e4m3_leaves_out_default_problems_it_cannot_take() {
        let default = ["s1k-d64", "varlen-16"];
        let kept = expand(&["--dtype", "e4m3", "--fp8-mode", "fast"], &default).unwrap();
        let names: Vec<&str> = kept.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["s1k-d64"]);
        assert!(kept.iter().all(|(_, p)| p.dtype == DType::E4m3));
        let named = expand(&["--dtype", "e4m3", "--problem", "varlen-16"], &default);
        assert!(named.is_err(), "{:?}", named.map(|v| v.len()));
    }

    /// `--out-dtype` applies to the input dtypes that can write it: f32 to f16 and bf16 (their
    /// label says so), f16/bf16 to e4m3; an output none of the dtypes takes is an error.
    #[test]
    fn out_dtype_applies_where_the_inputs_take_it() {
        let default = ["s1k-d64"];
        let args = ["--dtype", "f16,bf16,e4m3", "--out-dtype", "f32"];
        let ps = expand(&args, &default).unwrap();
        let labels: Vec<String> = ps.iter().map(|(_, p)| dtype_label(p)).collect();
        assert!(labels.contains(&"f16>f32".to_string()), "{labels:?}");
        assert!(labels.contains(&"bf16>f32".to_string()), "{labels:?}");
        for (_, p) in &ps {
            let want = match p.dtype {
                DType::E4m3 => DType::F16,
                _ => DType::F32,
            };
            assert_eq!(p.output_dtype(), want, "{p}");
        }
        let ps = expand(&["--dtype", "e4m3", "--out-dtype", "bf16"], &default).unwrap();
        assert!(ps.iter().all(|(_, p)| p.output_dtype() == DType::Bf16));
        let e = expand(&["--dtype", "f16", "--out-dtype", "bf16"], &default).unwrap_err();
        assert!(
            e.to_string().contains("--out-dtype bf16 applies to none"),
            "{e}"
        );
        let e = expand(&["--dtype", "e4m3", "--out-dtype", "f32"], &default).unwrap_err();
        assert!(
            e.to_string().contains("--out-dtype f32 applies to none"),
            "{e}"
        );
    }
}
