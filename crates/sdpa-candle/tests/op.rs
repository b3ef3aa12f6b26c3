//! `flash_attn` against candle's own attention (`attention_unfused`: matmul, softmax, matmul in
//! f32) on the same tensors: on the CPU (sdpa's float64 reference) always, on GPU 0 with the
//! `cuda` feature. f16 and bf16, causal or not, sliding windows, softcap, grouped-query, inputs
//! at non-contiguous strides, V of its own head dim.

mod common;

use candle_core::{DType, Device, Result, Tensor};
use common::rel_diff;
use sdpa_candle::{FlashAttn, attention_unfused_windowed, flash_attn};

/// Q as a transposed `(batch, heads, seq, head_dim)` tensor (strided, head_dim contiguous), K
/// and V contiguous with `kv_heads` heads.
fn inputs(
    dev: &Device,
    dtype: DType,
    (b, h, kv_heads, sq, sk, d): (usize, usize, usize, usize, usize, usize),
) -> Result<(Tensor, Tensor, Tensor)> {
    let q = Tensor::randn(0f32, 1.0, (b, h, sq, d), dev)?
        .to_dtype(dtype)?
        .transpose(1, 2)?;
    let k = Tensor::randn(0f32, 1.0, (b, sk, kv_heads, d), dev)?.to_dtype(dtype)?;
    let v = Tensor::randn(0f32, 1.0, (b, sk, kv_heads, d), dev)?.to_dtype(dtype)?;
    Ok((q, k, v))
}

/// Every case on `dev`: the op's result against candle's own, to within the dtype's rounding.
fn matches_candles_attention(dev: &Device) -> Result<usize> {
    let mut ran = 0;
    // (window left, window right, softcap): whole sequence, causal, a causal sliding window, a
    // two-sided window with a cap.
    let variants = [
        (None, None, None),
        (None, Some(0), None),
        (Some(20), Some(0), None),
        (Some(30), Some(5), Some(8.0)),
    ];
    for dtype in [DType::F16, DType::BF16] {
        for (left, right, cap) in variants {
            // The last: DeepSeek's head dims, V (strided) 128 of Q's and K's 192.
            for (dims, dv) in [
                ((1, 4, 4, 64, 64, 64), 64),
                ((2, 8, 2, 77, 130, 128), 128),
                ((1, 4, 2, 70, 90, 192), 128),
            ] {
                let (q, k, v) = inputs(dev, dtype, dims)?;
                let v = v.narrow(3, 0, dv)?;
                assert!(!q.is_contiguous(), "the test means to pass a strided Q");
                let scale = 1.0 / (dims.5 as f32).sqrt();
                let ours = FlashAttn {
                    softmax_scale: scale,
                    alibi_slopes: None,
                    window_size_left: left,
                    window_size_right: right,
                    softcap: cap,
                }
                .forward(&q, &k, &v)?;
                let theirs = attention_unfused_windowed(&q, &k, &v, scale, cap, left, right)?;
                let (b, sq, h, _) = q.dims4()?;
                assert_eq!(ours.dims(), [b, sq, h, dv]);
                assert_eq!(ours.dtype(), dtype);
                let rel = rel_diff(&ours, &theirs)?;
                let tol = if dtype == DType::F16 { 2e-3 } else { 1.5e-2 };
                assert!(
                    rel < tol,
                    "{dev:?} {dtype:?} window ({left:?}, {right:?}) softcap {cap:?} {dims:?}: \
                     relative difference {rel:e}"
                );
                ran += 1;
            }
        }
    }
    Ok(ran)
}

#[test]
fn cpu_op_matches_candles_attention() -> Result<()> {
    assert_eq!(matches_candles_attention(&Device::Cpu)?, 24);
    Ok(())
}

#[test]
fn windowed_takes_the_whole_sequence_causal_and_sliding_windows() -> Result<()> {
    let (q, k, v) = inputs(&Device::Cpu, DType::BF16, (1, 4, 2, 40, 50, 64))?;
    for (right, causal) in [(None, false), (Some(0), true)] {
        let windowed = sdpa_candle::flash_attn_windowed(&q, &k, &v, 0.125, None, right)?;
        let plain = flash_attn(&q, &k, &v, 0.125, causal)?;
        assert_eq!(rel_diff(&windowed, &plain)?, 0.0, "{right:?}");
    }
    // A sliding window is the band the reference computes.
    let windowed = sdpa_candle::flash_attn_windowed(&q, &k, &v, 0.125, Some(16), Some(0))?;
    let theirs = attention_unfused_windowed(&q, &k, &v, 0.125, None, Some(16), Some(0))?;
    assert!(rel_diff(&windowed, &theirs)? < 1.5e-2);
    let causal = flash_attn(&q, &k, &v, 0.125, true)?;
    assert!(
        rel_diff(&windowed, &causal)? > 1e-2,
        "the window changed nothing"
    );
    Ok(())
}

#[test]
fn bad_inputs_are_errors() -> Result<()> {
    let dev = Device::Cpu;
    let (q, k, v) = inputs(&dev, DType::F16, (1, 4, 4, 8, 8, 64))?;
    let cases = [
        (
            flash_attn(&q.to_dtype(DType::F32)?, &k, &v, 0.125, false),
            "must match",
        ),
        (
            flash_attn(
                &q.to_dtype(DType::F32)?,
                &k.to_dtype(DType::F32)?,
                &v.to_dtype(DType::F32)?,
                0.125,
                false,
            ),
            "F32 tensors are not supported",
        ),
        (
            flash_attn(&q, &k.narrow(3, 0, 32)?, &v.narrow(3, 0, 32)?, 0.125, false),
            "batch and head_dim must match",
        ),
        (
            flash_attn(&q, &k, &v.narrow(1, 0, 4)?, 0.125, false),
            "they must match",
        ),
        (
            flash_attn(
                &Tensor::randn(0f32, 1.0, (1, 8, 64, 4), &dev)?
                    .to_dtype(DType::F16)?
                    .transpose(2, 3)?,
                &k,
                &v,
                0.125,
                false,
            ),
            "must be contiguous",
        ),
        (
            flash_attn(&q, &k.narrow(2, 0, 3)?, &v.narrow(2, 0, 3)?, 0.125, false),
            "must be a multiple of kv_heads",
        ),
    ];
    for (i, (got, fragment)) in cases.into_iter().enumerate() {
        let e = got.expect_err("a bad input was accepted");
        assert!(e.to_string().contains(fragment), "case {i}: {e}");
    }
    Ok(())
}

#[cfg(feature = "cuda")]
#[test]
fn gpu_op_matches_candles_attention() -> Result<()> {
    let Some(dev) = common::gpu("gpu op") else {
        return Ok(());
    };
    assert_eq!(matches_candles_attention(&dev)?, 24);
    // The GPU op and the CPU op (sdpa's float64 reference) on the same inputs.
    let (q, k, v) = inputs(&dev, DType::BF16, (2, 8, 2, 200, 300, 128))?;
    let gpu = flash_attn(&q, &k, &v, 0.08, true)?;
    let cpu = flash_attn(
        &q.to_device(&Device::Cpu)?,
        &k.to_device(&Device::Cpu)?,
        &v.to_device(&Device::Cpu)?,
        0.08,
        true,
    )?;
    let rel = rel_diff(&gpu.to_device(&Device::Cpu)?, &cpu)?;
    assert!(rel < 1e-2, "GPU vs float64 reference: {rel:e}");
    Ok(())
}
