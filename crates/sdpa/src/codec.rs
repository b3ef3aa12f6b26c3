//! Element codecs: f32 values to and from the bit patterns of each dtype, on the host.

use crate::error::Result;
use crate::problem::DType;
use half::{bf16, f16};

/// The quiet-NaN bit pattern of a dtype, used to poison outputs before a run.
pub(crate) fn nan_bits(dtype: DType) -> u16 {
    match dtype {
        DType::F16 => f16::NAN.to_bits(),
        DType::Bf16 => bf16::NAN.to_bits(),
        DType::E4m3 => 0x7F,
    }
}

/// One value's bit pattern (see [`encode`]).
fn encode_one(dtype: DType, x: f32) -> u16 {
    match dtype {
        DType::F16 => f16::from_f32(x).to_bits(),
        DType::Bf16 => bf16::from_f32(x).to_bits(),
        DType::E4m3 => u16::from(crate::fp8::e4m3_from_f32(x)),
    }
}

/// One bit pattern's value (see [`decode`]).
pub(crate) fn decode_one(dtype: DType, b: u16) -> f64 {
    match dtype {
        DType::F16 => f16::from_bits(b).to_f64(),
        DType::Bf16 => bf16::from_bits(b).to_f64(),
        DType::E4m3 => f64::from(crate::fp8::e4m3_to_f32(b as u8)),
    }
}

/// Rounds f32 values to `dtype` (round-to-nearest-even) and returns their bit patterns (for
/// e4m3: the unscaled codes, saturating to ±448, in the low byte). The result is allocated as
/// any `Vec` is (the process aborts where the host cannot hold it); for data sized by a user,
/// the crate checks the host's memory first (`try_encode`).
pub fn encode(dtype: DType, data: &[f32]) -> Vec<u16> {
    data.iter().map(|&x| encode_one(dtype, x)).collect()
}

/// [`encode`], with the result's memory checked and reserved first: `Error::OutOfMemory` where
/// the host cannot hold it, instead of an abort.
pub(crate) fn try_encode(dtype: DType, data: &[f32]) -> Result<Vec<u16>> {
    let mut bits = crate::memory::host_vec(data.len(), 0u16)?;
    for (b, &x) in bits.iter_mut().zip(data) {
        *b = encode_one(dtype, x);
    }
    Ok(bits)
}

/// Decodes bit patterns of `dtype` to f64 (exact; e4m3 codes unscaled). Allocated as
/// [`encode`]'s result is.
pub fn decode(dtype: DType, bits: &[u16]) -> Vec<f64> {
    bits.iter().map(|&b| decode_one(dtype, b)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn try_encode_gives_what_encode_gives() {
        let data = [
            0.0,
            -0.0,
            1.0 / 3.0,
            -2.5,
            65504.0,
            70000.0,
            448.0,
            1e-8,
            f32::INFINITY,
            f32::NAN,
        ];
        for dtype in DType::INPUTS {
            let bits = try_encode(dtype, &data).unwrap();
            assert_eq!(bits, encode(dtype, &data), "{dtype}");
            let back = decode(dtype, &bits);
            assert_eq!(back.len(), data.len());
            assert_eq!(back[3], -2.5, "{dtype}");
        }
        assert!(try_encode(DType::F16, &[]).unwrap().is_empty());
    }
}
