//! Element codecs: f32 values to and from the bit patterns of each dtype, on the host, as 16-bit
//! words: one a value for f16, bf16 and e4m3 (the code in the low byte), two for f32 (its low
//! half first, as a little-endian device holds it).

use crate::error::Result;
use crate::problem::DType;
use half::{bf16, f16};
use rayon::prelude::*;

/// The quiet-NaN bit pattern of a dtype, in its low `dtype.size()` bytes: what poisons outputs
/// before a run.
pub(crate) fn nan_bits(dtype: DType) -> u32 {
    match dtype {
        DType::F16 => u32::from(f16::NAN.to_bits()),
        DType::Bf16 => u32::from(bf16::NAN.to_bits()),
        DType::E4m3 => 0x7F,
        DType::F32 => f32::NAN.to_bits(),
    }
}

/// 16-bit words per value of `dtype` in [`encode`]'s patterns.
pub(crate) fn words(dtype: DType) -> usize {
    if dtype == DType::F32 { 2 } else { 1 }
}

/// One value's bit pattern, in `words(dtype)` words (see [`encode`]).
fn encode_one(dtype: DType, x: f32, out: &mut [u16]) {
    match dtype {
        DType::F16 => out[0] = f16::from_f32(x).to_bits(),
        DType::Bf16 => out[0] = bf16::from_f32(x).to_bits(),
        DType::E4m3 => out[0] = u16::from(crate::fp8::e4m3_from_f32(x)),
        DType::F32 => {
            let b = x.to_bits();
            out[0] = b as u16;
            out[1] = (b >> 16) as u16;
        }
    }
}

/// The value of one pattern of `words(dtype)` words (see [`decode`]).
pub(crate) fn decode_one(dtype: DType, b: &[u16]) -> f64 {
    match dtype {
        DType::F16 => f16::from_bits(b[0]).to_f64(),
        DType::Bf16 => bf16::from_bits(b[0]).to_f64(),
        DType::E4m3 => f64::from(crate::fp8::e4m3_to_f32(b[0] as u8)),
        DType::F32 => f64::from(f32::from_bits(u32::from(b[0]) | u32::from(b[1]) << 16)),
    }
}

/// Rounds f32 values to `dtype` (round-to-nearest-even) and returns their bit patterns as
/// 16-bit words: one a value for f16 and bf16, for e4m3 the unscaled code (saturating to ±448)
/// in the low byte, for f32 two (the value unchanged, its low half first). The result is
/// allocated as any `Vec` is (the process aborts where the host cannot hold it); for data sized
/// by a user, the crate checks the host's memory first (`try_encode`).
pub fn encode(dtype: DType, data: &[f32]) -> Vec<u16> {
    let mut bits = vec![0; data.len() * words(dtype)];
    fill(dtype, data, &mut bits);
    bits
}

/// [`encode`], with the result's memory checked and reserved first: `Error::OutOfMemory` where
/// the host cannot hold it, instead of an abort.
pub(crate) fn try_encode(dtype: DType, data: &[f32]) -> Result<Vec<u16>> {
    let n = data.len().saturating_mul(words(dtype));
    let mut bits = crate::memory::host_vec(n, 0u16)?;
    fill(dtype, data, &mut bits);
    Ok(bits)
}

/// Values a thread takes at a time in the codecs (inputs of hundreds of millions of values are
/// encoded and decoded on every core).
const CHUNK: usize = 1 << 16;

fn fill(dtype: DType, data: &[f32], bits: &mut [u16]) {
    let w = words(dtype);
    bits.par_chunks_mut(CHUNK * w)
        .zip(data.par_chunks(CHUNK))
        .for_each(|(bits, data)| {
            for (b, &x) in bits.chunks_exact_mut(w).zip(data) {
                encode_one(dtype, x, b);
            }
        });
}

/// Decodes bit patterns of `dtype` ([`encode`]'s words) to f64 (exact; e4m3 codes unscaled);
/// for f32 a trailing lone word, half a value, is left out. Allocated as [`encode`]'s result
/// is.
pub fn decode(dtype: DType, bits: &[u16]) -> Vec<f64> {
    bits.par_chunks_exact(words(dtype))
        .with_min_len(CHUNK)
        .map(|b| decode_one(dtype, b))
        .collect()
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
        for dtype in [DType::F16, DType::Bf16, DType::E4m3, DType::F32] {
            let bits = try_encode(dtype, &data).unwrap();
            assert_eq!(bits, encode(dtype, &data), "{dtype}");
            let back = decode(dtype, &bits);
            assert_eq!(back.len(), data.len());
            assert_eq!(back[3], -2.5, "{dtype}");
        }
        assert!(try_encode(DType::F16, &[]).unwrap().is_empty());
    }

    /// f32 patterns are two words a value, low half first; they carry every f32 exactly (NaN
    /// included), and a lone trailing word is no value.
    #[test]
    fn f32_patterns_are_two_words_and_exact() {
        let data = [1.0 / 3.0, -0.0, 1e-40, f32::MAX, f32::INFINITY];
        let bits = encode(DType::F32, &data);
        assert_eq!(bits.len(), 2 * data.len());
        let one = 1.0f32.to_bits();
        assert_eq!(encode(DType::F32, &[1.0]), [one as u16, (one >> 16) as u16]);
        let back = decode(DType::F32, &bits);
        for (&x, &y) in data.iter().zip(&back) {
            assert_eq!(y.to_bits(), f64::from(x).to_bits(), "{x}");
        }
        let nan = decode(DType::F32, &encode(DType::F32, &[f32::NAN]));
        assert!(nan[0].is_nan());
        assert_eq!(decode(DType::F32, &bits[..3]).len(), 1);
        let poison = nan_bits(DType::F32);
        assert!(decode(DType::F32, &[poison as u16, (poison >> 16) as u16])[0].is_nan());
    }
}
