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
use rayon::prelude::*;

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
    let groups = scale_count(shape, scaling);
    // Per block of 2^16 elements on every core, then the blocks' maxima folded.
    const BLOCK: usize = 1 << 16;
    let amax = x
        .par_chunks(BLOCK)
        .enumerate()
        .map(|(b, block)| {
            let mut amax = vec![0f32; groups];
            for (j, &v) in block.iter().enumerate() {
                let g = &mut amax[group(shape, scaling, b * BLOCK + j)];
                if v.abs() > *g {
                    *g = v.abs();
                }
            }
            amax
        })
        .reduce(
            || vec![0f32; groups],
            |a, b| a.iter().zip(&b).map(|(x, y)| x.max(*y)).collect(),
        );
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
        .par_iter()
        .with_min_len(1 << 16)
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
        .par_iter()
        .with_min_len(1 << 16)
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

/// Decodes one E4M3 byte (exact): built from its bits (the exponent rebiased from 7 to f32's
/// 127, the 3 mantissa bits at the top of f32's 23), subnormals as m · 2^-9.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = u32::from(b & 0x80) << 24;
    let (exp, man) = (u32::from((b >> 3) & 0x0F), u32::from(b & 0x07));
    if exp == 0x0F && man == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        // m · 2^-9, exact in f32.
        return f32::from_bits(sign | (man as f32 * (1.0 / 512.0)).to_bits());
    }
    f32::from_bits(sign | (exp + 127 - 7) << 23 | man << 20)
}

/// Encodes one f32 as E4M3: round to nearest even, saturate to ±448, NaN -> 0x7F. From the
/// f32's bits: below 2^-6 the E4M3 grid is uniform in steps of 2^-9 (a · 2^9 is exact, rounded
/// to an integer code); above, the top 3 of the 23 mantissa bits stay, the 20 below round them
/// (a carry out moves the value up a binade).
pub fn e4m3_from_f32(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E; // 448 (inf included: SATFINITE)
    }
    let bits = a.to_bits();
    let exp = (bits >> 23) as i32 - 127;
    if exp < -6 {
        // Codes 0..=8: m · 2^-9 (8 is 2^-6, the smallest normal, whose code is 8 too).
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let (upper, lower) = ((bits >> 20) & 0x07, bits & 0x000F_FFFF);
    let round_up = lower > 0x8_0000 || (lower == 0x8_0000 && upper & 1 == 1);
    // A carry from mantissa 7 lands on the next binade's code: (exp + 7) << 3 | upper, plus one.
    let code = (((exp + 7) as u32) << 3 | upper) + u32::from(round_up);
    // a < 448 rounds to at most 448 (0x7E): no NaN code.
    sign | code as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The arithmetic statement of the encoding (the binade from log2, round to nearest even on
    /// its step): what the bit-level encoder must agree with.
    fn e4m3_from_f32_spec(x: f32) -> u8 {
        if x.is_nan() {
            return 0x7F;
        }
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        let a = f64::from(x.abs());
        if a >= f64::from(E4M3_MAX) {
            return sign | 0x7E;
        }
        let exp = if a < 2f64.powi(-6) {
            -6
        } else {
            a.log2().floor() as i32
        };
        let exp = if a >= 2f64.powi(exp + 1) {
            exp + 1
        } else {
            exp
        };
        let step = 2f64.powi(exp - 3);
        let (n, frac) = ((a / step).floor(), a / step - (a / step).floor());
        let n = if frac > 0.5 || (frac == 0.5 && n % 2.0 == 1.0) {
            n + 1.0
        } else {
            n
        };
        let value = n * step;
        // The code of the exact rounded value, by search over the positive codes.
        let code = (0..=0x7Eu8)
            .find(|&c| f64::from(e4m3_to_f32(c)) == value)
            .expect("on the grid");
        sign | code
    }

    /// The bit-level encoder agrees with the arithmetic statement on every f32 of 2^23 evenly
    /// spread bit patterns (both signs, every binade, subnormals, the ties) and on every midpoint
    /// between neighbouring codes.
    #[test]
    fn the_encoder_agrees_with_its_arithmetic_statement() {
        for i in 0..(1u32 << 23) {
            let x = f32::from_bits(i.wrapping_mul(511));
            assert_eq!(
                e4m3_from_f32(x),
                e4m3_from_f32_spec(x),
                "{x:e} ({:#x})",
                x.to_bits()
            );
        }
        for c in 0..0x7Eu8 {
            let mid = (e4m3_to_f32(c) + e4m3_to_f32(c + 1)) / 2.0;
            for x in [
                mid,
                -mid,
                f32::from_bits(mid.to_bits() + 1),
                f32::from_bits(mid.to_bits() - 1),
            ] {
                assert_eq!(e4m3_from_f32(x), e4m3_from_f32_spec(x), "{x:e}");
            }
        }
    }

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
