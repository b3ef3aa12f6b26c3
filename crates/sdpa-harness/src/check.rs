//! Accuracy checks against the float64 reference, the same way everywhere: fresh random
//! inputs, the output poisoned with NaN before the run, rel_err and max abs error (and the
//! cosine similarity), at the bar of the problem's dtype and FP8 mode.

use crate::inputs::{Family, Inputs, random_inputs, tensors};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use sdpa::{
    Backend, DType, Device, Error, MemoryKind, Problem, Result, SeqMeta, Tensor, decode, encode,
};

/// Pass/fail thresholds for one dtype (and, for fast FP8, one input family).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// Bound on ‖out − ref‖ / ‖ref‖.
    pub rel: f64,
    /// Bound on max |out − ref|, relative to max(1, max |ref|).
    pub max_abs: f64,
    /// Lower bound on the cosine similarity ⟨out, ref⟩ / (‖out‖·‖ref‖), where one is set.
    pub min_cosine: Option<f64>,
}

/// The tolerances every backend is held to, stated once.
///
/// Why these numbers: with the reference computed on the already-rounded inputs, rounding the
/// output to the dtype alone gives rel_err ≈ u/√3 ≈ 0.58u (u = unit roundoff: 2^-11 for f16, 2^-8
/// for bf16), and torch's own error is the same (docs/perf.md). Tensor-core backends also round P
/// to the dtype before P·V, which adds about as much again. `rel = 2u` leaves room for both
/// (f16 9.8e-4, bf16 7.8e-3) and is still orders of magnitude below what an indexing or masking
/// bug produces (rel_err ~ 1). One element may be off by at most 8u relative to the largest
/// output (rounding of a few large terms), never by O(1).
///
/// e4m3 problems are checked against the reference on the dequantized inputs (the kernel's own
/// error, not the quantization's). The simulated path is exact up to its 16-bit kernel
/// (power-of-two scales: code·scale is exact), so its error is that kernel's. The native kernel
/// runs P·V in f16 in its default, accurate mode (P rounded to e4m3, 3 mantissa bits, is far
/// coarser: the fast mode's bars are [`fast_fp8_tolerance`]), which keeps its error near the
/// 16-bit kernels' (docs/perf.md). `rel = 2e-2` is the FP8 accuracy bar; `max_abs = 2u(e4m3)`
/// catches any element off by O(1).
pub fn tolerance(dtype: DType) -> Tolerance {
    let u = dtype.unit_roundoff();
    match dtype {
        DType::E4m3 => Tolerance {
            rel: 2e-2,
            max_abs: 2.0 * u,
            min_cosine: None,
        },
        _ => Tolerance {
            rel: 2.0 * u,
            max_abs: 8.0 * u,
            min_cosine: None,
        },
    }
}

/// The bar of an e4m3 K/V cache under 16-bit Q ([`sdpa::Problem::with_kv_dtype`]), against the
/// float64 reference on the dequantized cache: the kernels widen the codes exactly and run the
/// 16-bit kernel's arithmetic, so the error is that of Q's dtype ([`tolerance`]), capped at the
/// FP8 K/V cache bar of 5e-3 on N(0, 1) (bf16: 5e-3 instead of 2u = 7.8e-3; f16: its own
/// 9.8e-4).
pub fn fp8_kv_tolerance(dtype: DType) -> Tolerance {
    let t = tolerance(dtype);
    Tolerance {
        rel: t.rel.min(5e-3),
        ..t
    }
}

/// The fast FP8 mode's bar ([`sdpa::Fp8Mode::Fast`]: P rounded to e4m3 before P·V), against the
/// float64 reference on the dequantized inputs, per input family; `emulated` is the error of
/// [`sdpa::reference_fp8_fast`] (P rounded as the kernel rounds it) against the same reference:
/// what rounding P costs by itself. A kernel may differ from the emulation by its running
/// maximum and its f32 sums, not by a coarser rounding: 1.25x it is allowed.
///
/// - [`Family::Normal`] (N(0,1), or inputs of no stated family): each output is an average of
///   zero-mean values, so its error is an average of P's rounding errors, the e4m3 floor of
///   1e-2 to 3e-2 that FlashAttention-3 and cuDNN ship. `rel ≤ 3.5e-2` and `rel ≤ 1.25 ×
///   emulated`, the latter floored at the output dtype's own bar (2u), so a problem where
///   rounding P costs nothing (a single key) still allows the output's rounding.
/// - [`Family::ChannelMean`]: `rel ≤ 5e-3` and cosine ≥ 0.999 (the emulation: 1-2e-3 at 1-2k
///   keys, under 1e-3 from 8k).
/// - [`Family::Outliers`]: cosine ≥ 0.999 and `rel ≤ 5e-3` where the rounding of P allows it;
///   it does not always: the emulation alone gives 6-10e-3 at 1-2k keys and 4-6e-3 at 8k-32k
///   (N(0,1) values still carry most of V's variance), so the bar is max(5e-3, 1.25 ×
///   emulated), at most 3.5e-2.
///
/// `max_abs = 2^-3` of max(1, max |ref|) for every family: one P rounded to e4m3 is off by at
/// most 2^-4 of itself, and the key with the largest score has P = 2^8 exactly, so an element
/// moves by at most 2^-4 of the weighted |V| it averages (the emulation's largest error is
/// 0.2-1.5% of max(1, max |ref|) in the tests' cases); twice that is still far below the O(1)
/// error of a wrong key, row or scale.
pub fn fast_fp8_tolerance(family: Family, emulated: f64, out_dtype: DType) -> Tolerance {
    let max_abs = 2f64.powi(-3);
    let cap = 3.5e-2;
    match family {
        Family::Normal => Tolerance {
            rel: (1.25 * emulated).max(tolerance(out_dtype).rel).min(cap),
            max_abs,
            min_cosine: None,
        },
        Family::ChannelMean => Tolerance {
            rel: 5e-3,
            max_abs,
            min_cosine: Some(0.999),
        },
        Family::Outliers => Tolerance {
            rel: (1.25 * emulated).max(5e-3).min(cap),
            max_abs,
            min_cosine: Some(0.999),
        },
    }
}

/// The bar `p`'s output on `inputs` is held to, with `want` the reference on those inputs:
/// [`tolerance`] of its dtype, or for an e4m3 problem in the fast mode [`fast_fp8_tolerance`]
/// of the inputs' family, with the emulated reference's error (computed here, as costly as the
/// reference; returned too).
pub fn tolerance_for(
    p: &Problem,
    inputs: &Inputs,
    want: &[f64],
) -> Result<(Tolerance, Option<f64>)> {
    if p.is_fp8_kv() {
        return Ok((fp8_kv_tolerance(p.dtype), None));
    }
    if !p.is_fp8_fast() {
        return Ok((tolerance(p.dtype), None));
    }
    let od = p.output_dtype();
    let emulated = inputs.reference_fp8_fast(p)?.out;
    // Rounded to the output dtype, as the kernel writes it.
    let o32: Vec<f32> = emulated.iter().map(|&x| x as f32).collect();
    let emulated = decode(od, &encode(od, &o32));
    let err = compare(&emulated, want, p.dtype, 0).rel_err;
    Ok((fast_fp8_tolerance(inputs.family, err, od), Some(err)))
}

/// Compares `out` (of `p`, run on `inputs`) with `want` at the bar [`tolerance_for`] picks: the
/// check every caller that knows its problem uses, so that a fast FP8 problem is held to the
/// fast mode's bar and every other problem to its dtype's.
pub fn check_output(
    out: &[f64],
    want: &[f64],
    p: &Problem,
    inputs: &Inputs,
    seed: u64,
) -> Result<Report> {
    let (tol, emulated) = tolerance_for(p, inputs, want)?;
    let mut r = compare_with(out, want, tol, seed);
    r.emulated_rel_err = emulated;
    Ok(r)
}

/// Bound on |lse − ref| / max(1, |ref|) for the log-sum-exp (f32 out of f32 logits: the
/// logits' own rounding and the approximate exp2, log2 and tanh of the kernels, far below what a
/// wrong row sum or scale gives).
pub const LSE_TOLERANCE: f64 = 2e-3;

/// The log-sum-exp's error against the reference: max |lse − ref| / max(1, |ref|) over the rows
/// where both are finite, and the rows that disagree otherwise (one side NaN or infinite alone,
/// or infinities of different sign).
pub fn compare_lse(got: &[f64], want: &[f64]) -> (f64, usize) {
    let mut worst = 0f64;
    let mut mismatched = got.len().abs_diff(want.len());
    for (&g, &w) in got.iter().zip(want) {
        if g.is_finite() && w.is_finite() {
            worst = worst.max((g - w).abs() / w.abs().max(1.0));
        } else if !(g == w || (g.is_nan() && w.is_nan())) {
            mismatched += 1;
        }
    }
    (worst, mismatched)
}

/// The result of one check.
#[derive(Debug, Clone, Copy)]
pub struct Report {
    /// ‖out − ref‖ / ‖ref‖ over the positions where neither is NaN.
    pub rel_err: f64,
    /// max |out − ref| over the same positions.
    pub max_err: f64,
    /// Elements that are NaN on one side only (unwritten, broken, or a NaN that should have
    /// propagated and did not).
    pub nan_count: usize,
    /// What the dtype is held to.
    pub tol: Tolerance,
    /// The seed that drew the inputs (rerun with it to reproduce).
    pub seed: u64,
    /// Where the log-sum-exp was checked: its error ([`compare_lse`]; its mismatched rows count
    /// in `nan_count`).
    pub lse_err: Option<f64>,
    /// ⟨out, ref⟩ / (‖out‖·‖ref‖) over the same positions as `rel_err` (1 where both are 0).
    pub cosine: f64,
    /// Fast FP8: the emulated reference's own rel_err, the basis of the N(0,1) bar.
    pub emulated_rel_err: Option<f64>,
}

impl Report {
    /// Whether the output (and the log-sum-exp, where checked) is within tolerance and fully
    /// written.
    pub fn pass(&self) -> bool {
        self.nan_count == 0
            && self.rel_err <= self.tol.rel
            && self.max_err <= self.tol.max_abs
            && self.lse_err.is_none_or(|e| e <= LSE_TOLERANCE)
            && self.tol.min_cosine.is_none_or(|c| self.cosine >= c)
    }
}

/// Compares an output with the reference at `dtype`'s bar ([`tolerance`]; a fast FP8 problem
/// needs [`check_output`]). Positions where the reference itself is NaN (NaN inputs propagate)
/// must be NaN in the output too and are otherwise left out; a NaN on one side only counts in
/// `nan_count` and fails the check. `max_err` in the report is absolute; the pass test scales
/// the tolerance by max(1, max |ref|).
pub fn compare(out: &[f64], reference: &[f64], dtype: DType, seed: u64) -> Report {
    compare_with(out, reference, tolerance(dtype), seed)
}

/// [`compare`] at a given bar.
pub fn compare_with(out: &[f64], reference: &[f64], mut tol: Tolerance, seed: u64) -> Report {
    let (mut num, mut den, mut max_err, mut ref_max, mut nan_count) = (0.0, 0.0, 0.0f64, 1.0f64, 0);
    let (mut dot, mut out_sq) = (0.0, 0.0);
    for (&o, &r) in out.iter().zip(reference) {
        if o.is_nan() || r.is_nan() {
            nan_count += usize::from(o.is_nan() != r.is_nan());
            continue;
        }
        let d = o - r;
        if d.is_nan() {
            // inf - inf: both infinite with the same sign is agreement, else a mismatch.
            nan_count += usize::from(o != r);
            continue;
        }
        num += d * d;
        den += r * r;
        dot += o * r;
        out_sq += o * o;
        max_err = max_err.max(d.abs());
        ref_max = ref_max.max(r.abs());
    }
    if out.len() != reference.len() {
        nan_count += out.len().abs_diff(reference.len());
    }
    tol.max_abs *= ref_max;
    Report {
        rel_err: if den > 0.0 {
            (num / den).sqrt()
        } else {
            num.sqrt()
        },
        max_err,
        nan_count,
        tol,
        seed,
        lse_err: None,
        cosine: match (out_sq > 0.0, den > 0.0) {
            (true, true) => dot / (out_sq * den).sqrt(),
            (false, false) => 1.0,
            _ => 0.0,
        },
        emulated_rel_err: None,
    }
}

/// Bytes of K and V a call reads: each sequence's keys, once per K/V head, at K/V's element size
/// (an e4m3 cache's one byte; a paged cache's spare pages not counted).
pub fn kv_bytes(p: &Problem, meta: Option<&SeqMeta>) -> f64 {
    let keys: usize = match meta.map(|m| sdpa::check_metadata(p, m)) {
        Some(Ok(spans)) => spans.iter().map(|s| s.seq_k).sum(),
        _ => p.batch * p.seq_k,
    };
    // K's columns and V's, which a problem reading V from K's rows does not read again.
    let cols = p.head_dim + if p.v_in_k { 0 } else { p.v_dim() };
    (keys * p.kv_heads * cols * p.kv_dtype().size()) as f64
}

/// Floating-point operations of a call, counting each sequence's visible scores (`Problem::flops`
/// counts every sequence at the longest lengths).
pub fn flops(p: &Problem, meta: Option<&SeqMeta>) -> f64 {
    match meta.map(|m| sdpa::check_metadata(p, m)) {
        Some(Ok(spans)) => spans
            .iter()
            .map(|s| {
                let one = Problem {
                    batch: 1,
                    seq_q: s.seq_q,
                    seq_k: s.seq_k,
                    seqs: sdpa::Seqs::default(),
                    ..*p
                };
                one.flops()
            })
            .sum(),
        _ => p.flops(),
    }
}

/// The device buffers of a problem's extras: its ALiBi slopes and sink logits uploaded, its
/// log-sum-exp output (NaN until a call writes it), its sequence metadata; empty for a problem
/// that has none.
pub struct ExtraBuffers {
    alibi_slopes: Option<cudarc::driver::CudaSlice<f32>>,
    sinks: Option<cudarc::driver::CudaSlice<f32>>,
    lse: Option<cudarc::driver::CudaSlice<f32>>,
    /// cu_seqlens_q, cu_seqlens_k, seqused_k, block_table.
    meta: [Option<cudarc::driver::CudaSlice<i32>>; 4],
}

impl ExtraBuffers {
    /// The buffers `p` asks for, on `dev`: `slopes` and `sinks` uploaded (where `p` has ALiBi,
    /// sinks), the log-sum-exp output.
    pub fn new(
        dev: &Device,
        p: &Problem,
        slopes: Option<&[f32]>,
        sinks: Option<&[f32]>,
    ) -> Result<ExtraBuffers> {
        let stream = dev.stream();
        let up = |x: Option<&[f32]>| x.map(|x| stream.clone_htod(x)).transpose();
        let (alibi_slopes, sinks) = (up(slopes)?, up(sinks)?);
        let lse = match p.lse {
            true => Some(stream.clone_htod(&vec![f32::NAN; p.lse_len()])?),
            false => None,
        };
        Ok(ExtraBuffers {
            alibi_slopes,
            sinks,
            lse,
            meta: Default::default(),
        })
    }

    /// The buffers `p` asks for with `inputs`' slopes, sinks and sequence metadata uploaded.
    pub fn of_inputs(dev: &Device, p: &Problem, inputs: &Inputs) -> Result<ExtraBuffers> {
        let bufs = Self::new(
            dev,
            p,
            inputs.alibi_slopes.as_deref(),
            inputs.sinks.as_deref(),
        )?;
        match &inputs.seq_meta {
            Some(m) => bufs.with_meta(dev, m),
            None => Ok(bufs),
        }
    }

    /// The same buffers with `meta` uploaded too.
    pub fn with_meta(mut self, dev: &Device, meta: &SeqMeta) -> Result<ExtraBuffers> {
        let parts = [
            &meta.cu_seqlens_q,
            &meta.cu_seqlens_k,
            &meta.seqused_k,
            &meta.block_table,
        ];
        for (slot, part) in self.meta.iter_mut().zip(parts) {
            *slot = match part {
                Some(x) => Some(dev.stream().clone_htod(x)?),
                None => None,
            };
        }
        Ok(self)
    }

    /// Views of the buffers for one call.
    pub fn extras(&mut self) -> sdpa::Extras<'_> {
        let [cu_q, cu_k, used_k, table] = self
            .meta
            .each_ref()
            .map(|m| m.as_ref().map(|m| m.as_view()));
        sdpa::Extras {
            alibi_slopes: self.alibi_slopes.as_ref().map(|s| s.as_view()),
            sinks: self.sinks.as_ref().map(|s| s.as_view()),
            lse: self.lse.as_mut().map(|l| l.as_view_mut()),
            cu_seqlens_q: cu_q,
            cu_seqlens_k: cu_k,
            seqused_k: used_k,
            block_table: table,
        }
    }

    /// The log-sum-exp the last call wrote (None where the problem has none).
    pub fn lse(&self, dev: &Device) -> Result<Option<Vec<f64>>> {
        match &self.lse {
            Some(l) => Ok(Some(
                dev.stream()
                    .clone_dtoh(l)?
                    .into_iter()
                    .map(f64::from)
                    .collect(),
            )),
            None => Ok(None),
        }
    }
}

/// Runs `backend` on `inputs` (output poisoned first) and returns its output as f64.
///
/// `Cpu` needs no device: its output is the reference rounded to the dtype (what
/// `forward(Backend::Cpu)` returns), computed from `reference` when given.
pub fn run_backend(
    dev: Option<&Device>,
    p: &Problem,
    backend: Backend,
    inputs: &Inputs,
    reference: Option<&[f64]>,
) -> Result<Vec<f64>> {
    let want = reference.map(|r| sdpa::Reference {
        out: r.to_vec(),
        lse: Vec::new(),
    });
    Ok(run_backend_with_lse(dev, p, backend, inputs, want.as_ref())?.0)
}

/// [`run_backend`] that also returns the log-sum-exp where `p.lse` asks for it (poisoned with
/// NaN before the run, f32 as f64).
pub fn run_backend_with_lse(
    dev: Option<&Device>,
    p: &Problem,
    backend: Backend,
    inputs: &Inputs,
    reference: Option<&sdpa::Reference>,
) -> Result<(Vec<f64>, Option<Vec<f64>>)> {
    p.validate()?;
    let backend = backend.resolve(dev, p)?;
    backend.supports(dev, p)?;
    match (backend, dev) {
        (Backend::Cpu, _) | (_, None) => {
            let owned;
            let want = match reference {
                Some(r) if !p.lse || !r.lse.is_empty() => r,
                _ => {
                    owned = inputs.reference(p)?;
                    &owned
                }
            };
            let o32: Vec<f32> = want.out.iter().map(|&x| x as f32).collect();
            let od = p.output_dtype();
            let lse = p
                .lse
                .then(|| want.lse.iter().map(|&x| f64::from(x as f32)).collect());
            Ok((decode(od, &encode(od, &o32)), lse))
        }
        (_, Some(dev)) => {
            let qkv = inputs.upload(dev, p.dtype)?;
            let mut out = Tensor::poisoned(dev, p.output_dtype(), p.out_len().unwrap())?;
            let mut bufs = ExtraBuffers::of_inputs(dev, p, inputs)?;
            let t = tensors(p, &qkv, &mut out);
            sdpa::forward(dev, p, backend, t, bufs.extras())?;
            Ok((out.to_f64(dev)?, bufs.lse(dev)?))
        }
    }
}

/// Runs `backend` on fresh inputs drawn from `seed` and compares with the f64 reference.
pub fn check_backend(
    dev: Option<&Device>,
    p: &Problem,
    backend: Backend,
    seed: u64,
) -> Result<Report> {
    p.validate()?;
    backend.supports(dev, p)?;
    let inputs = random_inputs(p, seed)?;
    let want = inputs.reference(p)?;
    let (got, lse) = run_backend_with_lse(dev, p, backend, &inputs, Some(&want))?;
    let mut report = check_output(&got, &want.out, p, &inputs, seed)?;
    if let Some(lse) = lse {
        let (err, mismatched) = compare_lse(&lse, &want.lse);
        report.lse_err = Some(err);
        report.nan_count += mismatched;
    }
    Ok(report)
}

/// Encodes `x * inv_scale` on the GPU with its own conversion instruction (the behaviour the
/// host codec must match bit for bit). Synchronizes the device's stream.
pub fn encode_on_device(dev: &Device, x: &[f32], inv_scale: f32) -> Result<Vec<u8>> {
    if x.is_empty() {
        return Ok(Vec::new());
    }
    let (free, _) = dev.mem_info()?;
    if x.len() * 5 > free {
        return Err(Error::OutOfMemory {
            kind: MemoryKind::Device,
            needed: x.len() * 5,
            available: Some(free),
        });
    }
    let stream = dev.stream();
    let xs = stream.clone_htod(x)?;
    let mut ys = stream.alloc_zeros::<u8>(x.len())?;
    {
        let (xp, _gx) = xs.device_ptr(stream);
        let (yp, _gy) = ys.device_ptr_mut(stream);
        stream.context().bind_to_thread()?;
        let s = stream.cu_stream() as usize;
        // SAFETY: both buffers hold x.len() elements on this device's context.
        unsafe { sdpa_sys::ffi::e4m3_encode(xp, yp, x.len() as i64, inv_scale, s)? };
    }
    Ok(stream.clone_dtoh(&ys)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::alibi_slopes;
    use sdpa::{Scaling, fp8};

    #[test]
    fn compare_flags_nan_and_wrong_values() {
        let r = [1.0, -2.0, 0.5];
        assert!(compare(&r, &r, DType::F16, 0).pass());
        let nan = compare(&[1.0, f64::NAN, 0.5], &r, DType::F16, 0);
        assert_eq!(nan.nan_count, 1);
        assert!(!nan.pass());
        let lost = compare(&r, &[1.0, f64::NAN, 0.5], DType::F16, 0);
        assert_eq!(lost.nan_count, 1, "a NaN the reference has must propagate");
        let both = compare(
            &[f64::NAN, -2.0, 0.5],
            &[f64::NAN, -2.0, 0.5],
            DType::F16,
            0,
        );
        assert!(both.pass(), "{both:?}");
        let off = compare(&[1.0, -2.0, 0.6], &r, DType::Bf16, 0);
        assert!(!off.pass(), "{off:?}");
    }

    #[test]
    fn rounding_the_reference_passes_at_about_half_u() {
        for dtype in DType::ALL {
            let p = Problem::new(1, 2, 33, 40, 64).with_dtype(dtype);
            let rep = check_backend(None, &p, Backend::Cpu, 7).unwrap();
            let u = dtype.unit_roundoff();
            assert!(rep.pass(), "{dtype}: {rep:?}");
            assert!(
                rep.rel_err > 0.2 * u && rep.rel_err < 0.8 * u,
                "{dtype}: {rep:?}"
            );
        }
    }

    /// The fast mode's bars by family: N(0,1) at 1.25 x the emulated error, capped at 3.5e-2 and
    /// floored at the output dtype's own bar; the other families at 5e-3 and cosine 0.999.
    #[test]
    fn fast_fp8_bars_follow_the_family() {
        let t = fast_fp8_tolerance(Family::Normal, 0.02, DType::F16);
        assert_eq!((t.rel, t.max_abs, t.min_cosine), (0.025, 0.125, None));
        assert_eq!(
            fast_fp8_tolerance(Family::Normal, 0.05, DType::F16).rel,
            3.5e-2
        );
        let floor = fast_fp8_tolerance(Family::Normal, 0.0, DType::Bf16).rel;
        assert_eq!(floor, 2.0 * DType::Bf16.unit_roundoff());
        for f in [Family::ChannelMean, Family::Outliers] {
            let t = fast_fp8_tolerance(f, 1e-3, DType::F16);
            assert_eq!((t.rel, t.min_cosine), (5e-3, Some(0.999)), "{f}");
        }
        // Outliers: the emulation's own error, where rounding P alone exceeds 5e-3.
        let t = fast_fp8_tolerance(Family::Outliers, 8e-3, DType::F16);
        assert!((t.rel - 1e-2).abs() < 1e-15, "{t:?}");
        assert_eq!(
            fast_fp8_tolerance(Family::ChannelMean, 8e-3, DType::F16).rel,
            5e-3
        );
    }

    /// `check_output` (and so `check_backend`, `sdpa validate`, `sdpa bench`) picks the bar of
    /// the problem's mode: accurate e4m3 the dtype's, fast the emulated one's. The emulation,
    /// rounded to the output dtype, passes its own bar; an output 1.3 x as far from the
    /// reference as the emulation fails it (1.25 x allowed).
    #[test]
    fn the_fast_fp8_bar_is_picked_by_the_problem_and_holds_the_ratio() {
        let p = Problem::new(1, 2, 96, 200, 64).with_dtype(DType::E4m3);
        let fast = p.with_fp8_mode(sdpa::Fp8Mode::Fast);
        let acc = check_backend(None, &p, Backend::Cpu, 11).unwrap();
        assert_eq!((acc.tol.rel, acc.emulated_rel_err), (2e-2, None));
        assert!(acc.pass(), "{acc:?}");
        let inputs = random_inputs(&fast, 11).unwrap();
        let want = inputs.reference(&fast).unwrap().out;
        let emu = inputs.reference_fp8_fast(&fast).unwrap().out;
        let emu16 = decode(
            DType::F16,
            &encode(
                DType::F16,
                &emu.iter().map(|&x| x as f32).collect::<Vec<_>>(),
            ),
        );
        let r = check_output(&emu16, &want, &fast, &inputs, 11).unwrap();
        let e = r.emulated_rel_err.unwrap();
        assert!((5e-3..3e-2).contains(&e), "the e4m3 floor: {r:?}");
        assert_eq!(r.rel_err, e, "the emulation is its own basis");
        assert!((r.tol.rel - 1.25 * e).abs() < 1e-15, "{r:?}");
        assert!(r.pass() && r.cosine > 0.999, "{r:?}");
        let worse: Vec<f64> = want
            .iter()
            .zip(&emu16)
            .map(|(w, x)| w + 1.3 * (x - w))
            .collect();
        let r = check_output(&worse, &want, &fast, &inputs, 11).unwrap();
        assert!(!r.pass() && r.rel_err > r.tol.rel, "{r:?}");
        // The reference itself (what the cpu backend returns) passes the fast bar easily.
        let cpu = check_backend(None, &fast, Backend::Cpu, 11).unwrap();
        assert!(cpu.pass() && cpu.rel_err < 1e-3, "{cpu:?}");
        assert_eq!(cpu.emulated_rel_err, Some(e));
    }

    #[test]
    fn cosine_is_reported_and_bounds_where_set() {
        let r = [1.0, -2.0, 0.5];
        assert_eq!(compare(&r, &r, DType::F16, 0).cosine, 1.0);
        let flipped = compare(&[-1.0, 2.0, -0.5], &r, DType::F16, 0);
        assert!((flipped.cosine + 1.0).abs() < 1e-15, "{flipped:?}");
        let tol = Tolerance {
            rel: 1.0,
            max_abs: 10.0,
            min_cosine: Some(0.999),
        };
        let off = compare_with(&[1.0, -2.0, 1.0], &r, tol, 0);
        assert!(off.cosine < 0.999 && !off.pass(), "{off:?}");
        assert_eq!(compare(&[0.0; 3], &[0.0; 3], DType::F16, 0).cosine, 1.0);
    }

    #[test]
    fn variants_and_lse_check_on_the_reference() {
        let p = Problem::new(2, 3, 33, 40, 64)
            .with_mask(sdpa::Mask::Window {
                left: Some(5),
                right: Some(2),
            })
            .with_softcap(5.0)
            .with_alibi(sdpa::Alibi::PerBatchHead)
            .with_lse(true);
        let rep = check_backend(None, &p, Backend::Cpu, 3).unwrap();
        assert!(rep.pass(), "{rep:?}");
        assert!(rep.lse_err.unwrap() < 1e-6, "{rep:?}");
        let slopes = alibi_slopes(&p).unwrap();
        assert_eq!(slopes.len(), 6);
        assert_eq!(
            (slopes[0], slopes[3]),
            (2f32.powf(-8.0 / 3.0), 1.25 * slopes[0])
        );
    }

    #[test]
    fn lse_comparison_flags_wrong_rows() {
        let want = [0.5, f64::NEG_INFINITY, 3.0];
        assert_eq!(compare_lse(&want, &want), (0.0, 0));
        let (err, bad) = compare_lse(&[0.5, 0.0, 3.3], &want);
        assert_eq!(bad, 1, "a row with keys where the reference has none");
        assert!((err - 0.1).abs() < 1e-12, "{err}");
    }

    #[test]
    fn e4m3_inputs_dequantize_to_their_values() {
        for scaling in [Scaling::PerTensor, Scaling::PerHead] {
            let p = Problem::new(2, 3, 17, 9, 64)
                .with_kv_heads(1)
                .with_dtype(DType::E4m3)
                .with_fp8_scaling(scaling);
            let i = random_inputs(&p, 3).unwrap();
            let f = i.fp8.as_ref().expect("e4m3 inputs carry scales");
            for t in 0..3 {
                assert_eq!(f.scales[t].len(), fp8::scale_count(&f.shapes[t], scaling));
                // The largest value lands in the top binade of the scale: (224, 448].
                let codes: Vec<u8> = i.bits[t].iter().map(|&b| b as u8).collect();
                let top = codes.iter().map(|&c| c & 0x7F).max().unwrap();
                assert!((0x76..=0x7E).contains(&top), "{scaling:?} {t}: {top:#04x}");
                // Quantization error within half an e4m3 step of each value.
                let smax = f.scales[t].iter().fold(0f64, |m, &s| m.max(f64::from(s)));
                for (x, (&d, &c)) in f.unquantized[t].iter().zip(i.values[t].iter().zip(&codes)) {
                    // Half a step: 2^-4 of the value, or of the smallest normal (subnormals).
                    let step = 2f64.powi(-4) * d.abs().max(2f64.powi(-6) * smax) * 1.0001;
                    assert!((x - d).abs() <= step, "{x} -> {d} (code {c:#04x})");
                }
            }
            // The reference on these inputs passes its own check at the output dtype.
            let rep = check_backend(None, &p, Backend::Cpu, 5).unwrap();
            assert!(rep.pass(), "{rep:?}");
        }
    }
}
