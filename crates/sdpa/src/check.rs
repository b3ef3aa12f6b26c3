//! Accuracy checks against the float64 reference, the same way everywhere: fresh random
//! inputs, the output poisoned with NaN before the run, rel_err and max abs error.

use crate::backend::{Backend, cpu};
use crate::device::{Device, Tensor, decode, encode};
use crate::error::Result;
use crate::problem::{DType, Problem};
use rand::{RngExt, SeedableRng, rngs::StdRng};

/// Pass/fail thresholds for one dtype.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// Bound on ‖out − ref‖ / ‖ref‖.
    pub rel: f64,
    /// Bound on max |out − ref|, relative to max(1, max |ref|).
    pub max_abs: f64,
}

/// The tolerances every backend is held to, stated once.
///
/// Why these numbers: with the reference computed on the already-rounded inputs, rounding the
/// output to the dtype alone gives rel_err ≈ u/√3 ≈ 0.58u (u = unit roundoff: 2^-11 for f16,
/// 2^-8 for bf16); torch on an H200 measures 2.7e-4 (0.55u) for f16 and 2.2e-3 (0.56u) for
/// bf16 on the mission shape. Tensor-core backends also round P to the dtype before P·V, which
/// adds about as much again. `rel = 2u` leaves room for both (f16 9.8e-4, bf16 7.8e-3) and is
/// still orders of magnitude below what an indexing or masking bug produces (rel_err ~ 1).
/// One element may be off by at most 8u relative to the largest output (rounding of a few
/// large terms), never by O(1).
pub fn tolerance(dtype: DType) -> Tolerance {
    let u = dtype.unit_roundoff();
    Tolerance {
        rel: 2.0 * u,
        max_abs: 8.0 * u,
    }
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
}

impl Report {
    /// Whether the output is within tolerance and fully written.
    pub fn pass(&self) -> bool {
        self.nan_count == 0 && self.rel_err <= self.tol.rel && self.max_err <= self.tol.max_abs
    }
}

/// Compares an output with the reference. Positions where the reference itself is NaN (NaN
/// inputs propagate) must be NaN in the output too and are otherwise left out; a NaN on one
/// side only counts in `nan_count` and fails the check. `max_err` in the report is absolute;
/// the pass test scales the tolerance by max(1, max |ref|).
pub fn compare(out: &[f64], reference: &[f64], dtype: DType, seed: u64) -> Report {
    let (mut num, mut den, mut max_err, mut ref_max, mut nan_count) = (0.0, 0.0, 0.0f64, 1.0f64, 0);
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
        max_err = max_err.max(d.abs());
        ref_max = ref_max.max(r.abs());
    }
    if out.len() != reference.len() {
        nan_count += out.len().abs_diff(reference.len());
    }
    let mut tol = tolerance(dtype);
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
    }
}

/// Random inputs for one problem: standard normal values rounded to the dtype.
pub struct Inputs {
    /// Bit patterns of Q, K, V in the dtype.
    pub bits: [Vec<u16>; 3],
    /// The same values, exactly, as f64 (what the reference sees).
    pub values: [Vec<f64>; 3],
}

impl Inputs {
    /// Inputs from given values (rounded to `dtype`).
    pub fn from_f32(dtype: DType, q: &[f32], k: &[f32], v: &[f32]) -> Inputs {
        let bits = [encode(dtype, q), encode(dtype, k), encode(dtype, v)];
        let values = [
            decode(dtype, &bits[0]),
            decode(dtype, &bits[1]),
            decode(dtype, &bits[2]),
        ];
        Inputs { bits, values }
    }

    /// Uploads Q, K, V to `dev` as tensors of `dtype`.
    pub fn upload(&self, dev: &Device, dtype: DType) -> Result<[Tensor; 3]> {
        let [q, k, v] = &self.bits;
        Ok([
            Tensor::from_bits(dev, dtype, q)?,
            Tensor::from_bits(dev, dtype, k)?,
            Tensor::from_bits(dev, dtype, v)?,
        ])
    }
}

/// Draws fresh N(0, 1) inputs from `seed`, rounded to `p.dtype`.
pub fn random_inputs(p: &Problem, seed: u64) -> Inputs {
    let mut rng = StdRng::seed_from_u64(seed);
    let (ql, kl) = (p.q_len().unwrap_or(0), p.kv_len().unwrap_or(0));
    let mut draw = |n: usize| -> Vec<u16> {
        // Box–Muller, two normals per pair of uniforms.
        let mut v = Vec::with_capacity(n + 1);
        while v.len() < n {
            let u1: f64 = 1.0 - rng.random::<f64>();
            let u2: f64 = rng.random::<f64>();
            let r = (-2.0 * u1.ln()).sqrt();
            let t = std::f64::consts::TAU * u2;
            v.push((r * t.cos()) as f32);
            v.push((r * t.sin()) as f32);
        }
        v.truncate(n);
        encode(p.dtype, &v)
    };
    let bits = [draw(ql), draw(kl), draw(kl)];
    let values = [
        decode(p.dtype, &bits[0]),
        decode(p.dtype, &bits[1]),
        decode(p.dtype, &bits[2]),
    ];
    Inputs { bits, values }
}

/// A seed that differs from run to run (time-based), for "fresh inputs every time".
pub fn fresh_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0x5eed)
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
    p.validate()?;
    let backend = backend.resolve(dev, p)?;
    backend.supports(dev, p)?;
    match (backend, dev) {
        (Backend::Cpu, _) | (_, None) => {
            let owned;
            let want = match reference {
                Some(r) => r,
                None => {
                    let [q, k, v] = &inputs.values;
                    owned = cpu::reference(p, q, k, v)?;
                    &owned
                }
            };
            let o32: Vec<f32> = want.iter().map(|&x| x as f32).collect();
            Ok(decode(p.dtype, &encode(p.dtype, &o32)))
        }
        (_, Some(dev)) => {
            let [q, k, v] = inputs.upload(dev, p.dtype)?;
            let mut out = Tensor::poisoned(dev, p.dtype, p.q_len().unwrap())?;
            crate::forward(dev, p, backend, &q, &k, &v, &mut out)?;
            out.to_f64(dev)
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
    let inputs = random_inputs(p, seed);
    let [q, k, v] = &inputs.values;
    let want = cpu::reference(p, q, k, v)?;
    let got = run_backend(dev, p, backend, &inputs, Some(&want))?;
    Ok(compare(&got, &want, p.dtype, seed))
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn inputs_are_fresh_per_seed_and_normal() {
        let p = Problem::new(1, 1, 64, 64, 64);
        let (a, b) = (random_inputs(&p, 1), random_inputs(&p, 2));
        assert_ne!(a.bits[0], b.bits[0]);
        let x = &a.values[0];
        let mean = x.iter().sum::<f64>() / x.len() as f64;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / x.len() as f64;
        assert!(
            mean.abs() < 0.05 && (var - 1.0).abs() < 0.1,
            "mean {mean} var {var}"
        );
    }
}
