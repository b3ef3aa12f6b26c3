//! The host E4M3 codec against the GPU's own conversion, bit for bit: every f16 value (which
//! covers every E4M3 rounding boundary and all subnormals), values around 448, infinities, NaN,
//! and a scale folded in.

mod common;

use sdpa::fp8::{e4m3_from_f32, encode_on_device};

#[test]
fn host_codec_is_bit_exact_with_the_gpu() {
    let Some(dev) = common::device("fp8 codec") else {
        return;
    };
    let mut xs: Vec<f32> = (0..=u16::MAX)
        .map(|b| half::f16::from_bits(b).to_f32())
        .collect();
    xs.extend([
        447.9,
        448.0,
        448.1,
        463.9,
        464.0,
        480.0,
        1e30,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ]);
    xs.extend((0..4096).map(|i| (i as f32 - 2048.0) * 0.37));
    for inv_scale in [1.0f32, 0.25, 3.0] {
        let gpu = encode_on_device(&dev, &xs, inv_scale).unwrap();
        let mismatches: Vec<String> = xs
            .iter()
            .zip(&gpu)
            .filter(|&(&x, &g)| e4m3_from_f32(x * inv_scale) != g)
            .take(10)
            .map(|(&x, &g)| {
                format!(
                    "{x} * {inv_scale}: host {:#04x} gpu {g:#04x}",
                    e4m3_from_f32(x * inv_scale)
                )
            })
            .collect();
        assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
    }
}
