//! Element codecs: f32 values to and from the bit patterns of each dtype, on the host.

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

/// Rounds f32 values to `dtype` (round-to-nearest-even) and returns their bit patterns (for
/// e4m3: the unscaled codes, saturating to ±448, in the low byte).
pub fn encode(dtype: DType, data: &[f32]) -> Vec<u16> {
    match dtype {
        DType::F16 => data.iter().map(|&x| f16::from_f32(x).to_bits()).collect(),
        DType::Bf16 => data.iter().map(|&x| bf16::from_f32(x).to_bits()).collect(),
        DType::E4m3 => data
            .iter()
            .map(|&x| u16::from(crate::fp8::e4m3_from_f32(x)))
            .collect(),
    }
}

/// Decodes bit patterns of `dtype` to f64 (exact; e4m3 codes unscaled).
pub fn decode(dtype: DType, bits: &[u16]) -> Vec<f64> {
    match dtype {
        DType::F16 => bits.iter().map(|&b| f16::from_bits(b).to_f64()).collect(),
        DType::Bf16 => bits.iter().map(|&b| bf16::from_bits(b).to_f64()).collect(),
        DType::E4m3 => bits
            .iter()
            .map(|&b| f64::from(crate::fp8::e4m3_to_f32(b as u8)))
            .collect(),
    }
}
