//! FP8 E4M3 (the "fn" variant of the OCP spec, as NVIDIA GPUs implement it): 1 sign, 4 exponent
//! (bias 7), 3 mantissa bits; no infinities; S.1111.111 is NaN; largest finite ±448; smallest
//! subnormal 2^-9. Host-side encode/decode, bit-exact with the GPU's saturating conversion
//! (`__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`): round to nearest even, magnitudes
//! beyond 448 (infinities included) saturate to ±448, NaN becomes 0x7F.
//!
//! ```
//! use sdpa::{DType, Problem, Scaling, fp8};
//!
//! // Q of 2 heads of 4 rows of 8: head 0 holds -20..=11, head 1 holds 12..=43.
//! let p = Problem::new(1, 2, 4, 4, 8).with_dtype(DType::E4m3);
//! let x: Vec<f32> = (0..64).map(|i| i as f32 - 20.0).collect();
//! let (codes, scales) = fp8::quantize_host(&x, &p.q_shape(), Scaling::PerHead)?;
//! // Each head's scale: the power of two at or above its absmax / 448.
//! assert_eq!(scales, [0.0625, 0.125]);
//! // Three mantissa bits: each value comes back within 2^-4 of itself.
//! let y = fp8::dequantize_host(&codes, &scales, &p.q_shape(), Scaling::PerHead)?;
//! assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() <= a.abs() / 16.0));
//! # Ok::<(), sdpa::Error>(())
//! ```

use crate::error::{Result, invalid};
use crate::problem::{Scaling, TensorShape};

/// Number of scales a tensor of `shape` has under `scaling` (a shape whose size overflows has
/// no per-head count: `usize::MAX`, which no scale vector matches).
pub fn scale_count(shape: &TensorShape, scaling: Scaling) -> usize {
    match scaling {
        Scaling::PerTensor => 1,
        Scaling::PerHead => shape.heads_total().unwrap_or(usize::MAX),
    }
}

/// The scale group of element `i` of a shape `check_len` accepted, with `i` inside it.
pub(crate) fn group(shape: &TensorShape, scaling: Scaling, i: usize) -> usize {
    match scaling {
        Scaling::PerTensor => 0,
        Scaling::PerHead => shape.head_index(i),
    }
}

/// Per-group max |x| (NaN ignored), the statistic the scales are chosen from. `x` must hold
/// exactly the elements of `shape`.
pub fn absmax_host(x: &[f32], shape: &TensorShape, scaling: Scaling) -> Result<Vec<f32>> {
    check_len(x.len(), shape, "absmax_host")?;
    let mut amax = vec![0f32; scale_count(shape, scaling)];
    for (i, &v) in x.iter().enumerate() {
        let g = &mut amax[group(shape, scaling, i)];
        if v.abs() > *g {
            *g = v.abs();
        }
    }
    Ok(amax)
}

/// Each group's scale: the power of two at or above `amax / 448`, so the largest magnitude
/// lands in E4M3's top binade, (224, 448]; an all-zero group gets 1; an infinite (or NaN)
/// amax has no finite scale: error.
///
/// Why a power of two rather than `amax / 448` itself: E4M3's relative precision is the same in
/// every normal binade, so the codes lose nothing, and `code · scale` is then exact in f32 and in
/// bf16 (and in f16 within its range). Dividing by the scale is exact too, so quantizing rounds
/// once. The simulated path depends on it: it feeds `code · scale` to a 16-bit kernel, and with
/// outlier channels (logits in the thousands) one extra rounding of Q or K there moved the softmax
/// by more than the e4m3 tolerance (docs/log/). The OCP MX formats use power-of-two scales for the
/// same reason.
pub fn scales_from_amax(amax: &[f32]) -> Result<Vec<f32>> {
    amax.iter()
        .enumerate()
        .map(|(g, &a)| {
            if !a.is_finite() {
                Err(invalid!(
                    "scale group {g} has absmax {a}: no finite e4m3 scale exists"
                ))
            } else if a == 0.0 {
                Ok(1.0)
            } else {
                Ok(pow2_at_or_above(a / E4M3_MAX))
            }
        })
        .collect()
}

/// The smallest power of two >= `x` (x finite and positive), at least the smallest normal f32.
fn pow2_at_or_above(x: f32) -> f32 {
    let x = x.max(f32::MIN_POSITIVE);
    let bits = x.to_bits();
    let exp_bits = bits & 0x7F80_0000;
    if bits & 0x007F_FFFF == 0 {
        x // already a power of two
    } else {
        // Next binade up; amax <= f32::MAX gives at most 2^119 here, no overflow.
        f32::from_bits(exp_bits + 0x0080_0000)
    }
}

/// Quantizes on the host exactly as [`crate::Tensor::quantize`] does on the GPU: codes
/// `E4M3(x / scale)` (f32 division, round to nearest even, saturating) and the scales.
pub fn quantize_host(
    x: &[f32],
    shape: &TensorShape,
    scaling: Scaling,
) -> Result<(Vec<u8>, Vec<f32>)> {
    let scales = scales_from_amax(&absmax_host(x, shape, scaling)?)?;
    let codes = x
        .iter()
        .enumerate()
        .map(|(i, &v)| e4m3_from_f32(v / scales[group(shape, scaling, i)]))
        .collect();
    Ok((codes, scales))
}

/// `code · scale` per element, in f32 (what the GPU's dequantize computes before rounding to
/// its output dtype). `codes` must hold exactly the elements of `shape`, `scales` one scale
/// per group of `scaling`.
pub fn dequantize_host(
    codes: &[u8],
    scales: &[f32],
    shape: &TensorShape,
    scaling: Scaling,
) -> Result<Vec<f32>> {
    check_len(codes.len(), shape, "dequantize_host")?;
    check_scale_count(scales.len(), shape, scaling, "dequantize_host")?;
    Ok(codes
        .iter()
        .enumerate()
        .map(|(i, &c)| e4m3_to_f32(c) * scales[group(shape, scaling, i)])
        .collect())
}

pub(crate) fn check_scale_count(
    n: usize,
    shape: &TensorShape,
    scaling: Scaling,
    what: &str,
) -> Result<()> {
    let want = scale_count(shape, scaling);
    if n != want {
        return Err(invalid!(
            "{what}: {n} scales given, {} scaling of {shape} needs {want}",
            scaling.name()
        ));
    }
    Ok(())
}

pub(crate) fn check_len(n: usize, shape: &TensorShape, what: &str) -> Result<()> {
    match shape.len() {
        Some(0) | None => Err(invalid!("{what}: shape {shape} holds no elements")),
        Some(len) if len != n => Err(invalid!(
            "{what}: {n} values for shape {shape}, which holds {len}"
        )),
        _ => Ok(()),
    }
}

/// Largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// Decodes one E4M3 byte (exact).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0x0F);
    let man = f32::from(b & 0x07);
    if exp == 0x0F && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man * 2f32.powi(-9) // subnormal: m/8 * 2^-6
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// Encodes one f32 as E4M3: round to nearest even, saturate to ±448, NaN -> 0x7F.
pub fn e4m3_from_f32(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E; // 448 (inf included: SATFINITE)
    }
    // Work in units of the smallest subnormal (2^-9): below 2^-6 the grid is uniform in those
    // units; above, each binade [2^e, 2^(e+1)) has 8 steps of 2^(e-3).
    let exp = if a < 2f32.powi(-6) {
        -6
    } else {
        a.log2().floor() as i32
    };
    // Guard the log2 rounding at binade edges.
    let exp = if a >= 2f32.powi(exp + 1) {
        exp + 1
    } else {
        exp
    };
    let step = 2f64.powi(exp - 3);
    let q = f64::from(a) / step; // exact: a is an f32, step a power of two
    let mut n = q.floor();
    let frac = q - n;
    if frac > 0.5 || (frac == 0.5 && n % 2.0 == 1.0) {
        n += 1.0;
    }
    let value = n * step; // the rounded magnitude
    if value >= f64::from(E4M3_MAX) {
        return sign | 0x7E;
    }
    if value == 0.0 {
        return sign;
    }
    // Re-encode the exact rounded value (it may have moved up a binade).
    let v = value as f32;
    if v < 2f32.powi(-6) {
        return sign | (v / 2f32.powi(-9)) as u8;
    }
    let e = v.log2().floor() as i32;
    let e = if v >= 2f32.powi(e + 1) { e + 1 } else { e };
    let m = ((v / 2f32.powi(e) - 1.0) * 8.0).round() as u8;
    sign | (((e + 7) as u8) << 3) | m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_are_powers_of_two_covering_amax() {
        let s = scales_from_amax(&[448.0, 449.0, 1.0, 0.0, 3e38, 1e-40]).unwrap();
        assert_eq!(s[..4], [1.0, 2.0, 2f32.powi(-8), 1.0]);
        for (a, s) in [(448.0f32, s[0]), (449.0, s[1]), (1.0, s[2]), (3e38, s[4])] {
            assert_eq!(s.to_bits() & 0x007F_FFFF, 0, "{s} is a power of two");
            assert!(a / s <= E4M3_MAX && a / s > E4M3_MAX / 2.0, "{a} / {s}");
        }
        assert_eq!(s[5], f32::MIN_POSITIVE);
        assert!(scales_from_amax(&[f32::INFINITY]).is_err());
        assert!(scales_from_amax(&[f32::NAN]).is_err());
    }

    #[test]
    fn decode_known_values() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
        assert_eq!(e4m3_to_f32(0x77), 240.0); // exponent 14 is finite in E4M3
    }

    #[test]
    fn every_code_round_trips() {
        for b in 0..=255u8 {
            let x = e4m3_to_f32(b);
            if x.is_nan() {
                assert_eq!(e4m3_from_f32(x), 0x7F);
            } else {
                assert_eq!(e4m3_from_f32(x), b, "code {b:#04x} = {x}");
            }
        }
    }

    #[test]
    fn rounds_to_nearest_even_and_saturates() {
        // Exactly halfway between codes rounds to the even mantissa.
        let (lo, hi) = (e4m3_to_f32(0x38), e4m3_to_f32(0x39)); // 1.0, 1.125
        assert_eq!(e4m3_from_f32((lo + hi) / 2.0), 0x38);
        let (lo, hi) = (e4m3_to_f32(0x39), e4m3_to_f32(0x3A)); // 1.125, 1.25
        assert_eq!(e4m3_from_f32((lo + hi) / 2.0), 0x3A);
        assert_eq!(e4m3_from_f32(1.0 + 1e-6), 0x38);
        // Subnormal halfway: 1.5 * 2^-9 rounds to 2 * 2^-9 (even).
        assert_eq!(e4m3_from_f32(1.5 * 2f32.powi(-9)), 0x02);
        assert_eq!(e4m3_from_f32(0.5 * 2f32.powi(-9)), 0x00);
        assert_eq!(e4m3_from_f32(-0.0), 0x80);
        for x in [448.0, 449.0, 464.0, 1e6, f32::INFINITY] {
            assert_eq!(e4m3_from_f32(x), 0x7E, "{x}");
            assert_eq!(e4m3_from_f32(-x), 0xFE, "-{x}");
        }
        // Nearest code, checked against a brute-force search over all finite codes.
        for i in 0..20000 {
            let x = (i as f32 - 10000.0) * 0.0237;
            let got = e4m3_to_f32(e4m3_from_f32(x));
            let best = (0..=255u8)
                .map(e4m3_to_f32)
                .filter(|v| v.is_finite())
                .map(|v| (v - x).abs())
                .fold(f32::INFINITY, f32::min);
            assert!(
                (got - x).abs() <= best * (1.0 + 1e-6) || x.abs() > 448.0,
                "{x} -> {got}"
            );
        }
    }
}
