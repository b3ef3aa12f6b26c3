//! What the op tests share: inputs, offsets, differences, and GPU 0 when there is one.
#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor};

/// ‖a − b‖ / ‖b‖ in f32.
pub fn rel_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
    let num = (&a - &b)?.sqr()?.sum_all()?.sqrt()?;
    (num / b.sqr()?.sum_all()?.sqrt()?)?.to_scalar::<f32>()
}

/// The largest |x| of `t`.
pub fn max_abs(t: &Tensor) -> Result<f32> {
    t.to_dtype(DType::F32)?.abs()?.max_all()?.to_scalar::<f32>()
}

/// `0, l0, l0 + l1, ..` of `lens`.
pub fn offsets(lens: &[usize]) -> Vec<usize> {
    std::iter::once(0)
        .chain(lens.iter().scan(0, |end, &l| {
            *end += l;
            Some(*end)
        }))
        .collect()
}

/// The offsets of `lens` as the u32 tensor the ops take.
pub fn seqlens(lens: &[usize], dev: &Device) -> Result<Tensor> {
    let o: Vec<u32> = offsets(lens).iter().map(|&x| x as u32).collect();
    Tensor::new(o.as_slice(), dev)
}

/// A random normal tensor of `dtype`.
pub fn randn(shape: impl Into<candle_core::Shape>, dtype: DType, dev: &Device) -> Result<Tensor> {
    Tensor::randn(0f32, 1.0, shape, dev)?.to_dtype(dtype)
}

/// GPU 0, or `None` with the reason printed (a failure under `SDPA_REQUIRE_GPU=1`).
pub fn gpu(test: &str) -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) if std::env::var("SDPA_REQUIRE_GPU").as_deref() != Ok("1") => {
            eprintln!("{test}: skipped (no CUDA device: {e})");
            None
        }
        Err(e) => panic!("SDPA_REQUIRE_GPU=1 but candle has no CUDA device: {e}"),
    }
}

/// `t` on the CPU.
pub fn cpu(t: &Tensor) -> Result<Tensor> {
    t.to_device(&Device::Cpu)
}
