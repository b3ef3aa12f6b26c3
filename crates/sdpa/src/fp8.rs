//! FP8 E4M3 (the "fn" variant of the OCP spec, as NVIDIA GPUs implement it): 1 sign, 4 exponent
//! (bias 7), 3 mantissa bits; no infinities; S.1111.111 is NaN; largest finite ±448; smallest
//! subnormal 2^-9. Host-side encode/decode, bit-exact with the GPU's saturating conversion
//! (`__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`): round to nearest even, magnitudes
//! beyond 448 (infinities included) saturate to ±448, NaN becomes 0x7F.

use crate::device::Device;
use crate::error::Result;
use cudarc::driver::{DevicePtr, DevicePtrMut};

/// Encodes `x * inv_scale` on the GPU with its own conversion instruction (the behaviour the
/// host codec must match bit for bit). Synchronizes the device's stream.
pub fn encode_on_device(dev: &Device, x: &[f32], inv_scale: f32) -> Result<Vec<u8>> {
    if x.is_empty() {
        return Ok(Vec::new());
    }
    let stream = dev.stream();
    let xs = stream.clone_htod(x)?;
    let mut ys = stream.alloc_zeros::<u8>(x.len())?;
    {
        let (xp, _gx) = xs.device_ptr(stream);
        let (yp, _gy) = ys.device_ptr_mut(stream);
        let s = dev.raw_stream()?;
        // SAFETY: both buffers hold x.len() elements on this device's context.
        unsafe { sdpa_sys::ffi::e4m3_encode(xp, yp, x.len() as i64, inv_scale, s)? };
    }
    Ok(stream.clone_dtoh(&ys)?)
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
