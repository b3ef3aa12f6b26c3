//! The e4m3 side of `Tensor`: tensors of codes and scales made from host codes, quantized on
//! the GPU from f16/bf16 tensors or f32 values, and dequantized back.

use super::{Buf, Fp8Scales, Tensor, ordered};
use crate::device::Device;
use crate::error::{Result, invalid};
use crate::ffi;
use crate::fp8::{check_len, check_scale_count, scale_count, scales_from_amax};
use crate::problem::{DType, Scaling, TensorShape};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use sdpa_sys::args::ScaleMap;

fn scale_map(shape: &TensorShape, scaling: Scaling) -> ScaleMap {
    let n = shape.len().unwrap_or(0) as i64;
    match scaling {
        Scaling::PerTensor => ScaleMap {
            heads: 1,
            inner: n,
            per_batch: n,
        },
        Scaling::PerHead => ScaleMap {
            heads: shape.heads as i64,
            inner: shape.head_inner() as i64,
            per_batch: (shape.heads * shape.seq * shape.head_dim) as i64,
        },
    }
}

impl Tensor {
    /// An e4m3 tensor from host codes and scales (`scales`: one, or one per (batch, head) pair
    /// with [`Scaling::PerHead`]; each finite and positive).
    pub fn from_e4m3(
        dev: &Device,
        codes: &[u8],
        scales: &[f32],
        shape: TensorShape,
        scaling: Scaling,
    ) -> Result<Tensor> {
        check_len(codes.len(), &shape, "Tensor::from_e4m3")?;
        check_scale_count(scales.len(), &shape, scaling, "Tensor::from_e4m3")?;
        if let Some((g, s)) = scales
            .iter()
            .enumerate()
            .find(|(_, s)| !(s.is_finite() && **s > 0.0))
        {
            return Err(invalid!(
                "Tensor::from_e4m3: scale {g} is {s}; scales must be finite and positive"
            ));
        }
        Ok(Tensor {
            buf: Buf::Byte(dev.upload(codes)?),
            dtype: DType::E4m3,
            fp8: Some(Fp8Scales {
                host: scales.to_vec(),
                dev: dev.upload(scales)?,
                shape,
                scaling,
            }),
        })
    }

    /// Quantizes an f16/bf16 device tensor of `shape` to e4m3 on the GPU, choosing each group's
    /// scale from its absmax (see [`scales_from_amax`]). Synchronizes the stream once (the scales
    /// are read back: the reference and `to_f64` need them on the host). A group holding an
    /// infinity is an error; NaNs become NaN codes.
    pub fn quantize(
        dev: &Device,
        x: &Tensor,
        shape: TensorShape,
        scaling: Scaling,
    ) -> Result<Tensor> {
        if !matches!(x.dtype, DType::F16 | DType::Bf16) {
            return Err(invalid!(
                "Tensor::quantize takes an f16 or bf16 tensor, got {}",
                x.dtype
            ));
        }
        if !x.same_context(dev) {
            return Err(invalid!(
                "Tensor::quantize: the tensor lives on another GPU than the device handle"
            ));
        }
        let n = shape
            .len()
            .filter(|&n| n > 0)
            .ok_or_else(|| invalid!("Tensor::quantize: shape {shape} holds no elements"))?;
        if x.len() < n {
            return Err(invalid!(
                "Tensor::quantize: the tensor holds {} elements, shape {shape} needs {n}",
                x.len()
            ));
        }
        ordered(dev, &[x], || {
            quantize_device(dev, x.ptr(dev), false, x.dtype, shape, scaling)
        })
    }

    /// Uploads f32 values of `shape` and quantizes them on the GPU (see [`Tensor::quantize`]).
    pub fn quantize_f32(
        dev: &Device,
        x: &[f32],
        shape: TensorShape,
        scaling: Scaling,
    ) -> Result<Tensor> {
        check_len(x.len(), &shape, "Tensor::quantize_f32")?;
        let xs = dev.upload(x)?;
        let p = xs.device_ptr(dev.stream()).0;
        let t = quantize_device(dev, p, true, DType::F16, shape, scaling)?;
        drop(xs); // after the quantize pass (ordered on the stream)
        Ok(t)
    }

    /// Dequantizes an e4m3 tensor to `dtype` (f16 or bf16) on the GPU: `code · scale` in f32,
    /// rounded to nearest even.
    pub fn dequantize(&self, dev: &Device, dtype: DType) -> Result<Tensor> {
        let Some(f) = &self.fp8 else {
            return Err(invalid!(
                "Tensor::dequantize: the tensor is {}, not e4m3",
                self.dtype
            ));
        };
        if !DType::ALL.contains(&dtype) {
            return Err(invalid!(
                "Tensor::dequantize: the target must be f16 or bf16, got {dtype}"
            ));
        }
        if !self.same_context(dev) {
            return Err(invalid!(
                "Tensor::dequantize: the tensor lives on another GPU than the device handle"
            ));
        }
        ordered(dev, &[self], || self.dequantize_ordered(dev, f, dtype))
    }

    fn dequantize_ordered(&self, dev: &Device, f: &Fp8Scales, dtype: DType) -> Result<Tensor> {
        let n = self.len();
        // SAFETY: the dequantize kernel writes all n elements before anything reads them.
        let mut out = unsafe { dev.alloc::<u16>(n)? };
        {
            let (yp, _g) = out.device_ptr_mut(dev.stream());
            let s = dev.raw_stream()?;
            // SAFETY: codes, output and scales are live buffers of this context holding n, n
            // and scale_count(shape) elements; the map's groups stay below that count.
            unsafe {
                sdpa_sys::ffi::e4m3_dequantize(
                    self.ptr(dev),
                    yp,
                    ffi::dtype(dtype),
                    n as i64,
                    scale_map(&f.shape, f.scaling),
                    self.scales_ptr(dev),
                    s,
                )?
            };
        }
        Ok(Tensor {
            buf: Buf::Half(out),
            dtype,
            fp8: None,
        })
    }
}

fn quantize_device(
    dev: &Device,
    x: u64,
    x_is_f32: bool,
    dtype: DType,
    shape: TensorShape,
    scaling: Scaling,
) -> Result<Tensor> {
    let n = shape.len().unwrap_or(0);
    let groups = scale_count(&shape, scaling);
    let map = scale_map(&shape, scaling);
    let stream = dev.stream();
    let code = ffi::dtype(dtype);
    let mut amax = stream.alloc_zeros::<f32>(groups)?;
    {
        let (ap, _g) = amax.device_ptr_mut(stream);
        let s = dev.raw_stream()?;
        // SAFETY: x holds n elements of its type, amax `groups` zeroed floats; every group
        // index the map produces for i < n is below `groups`.
        unsafe { sdpa_sys::ffi::absmax(x, x_is_f32, code, n as i64, map, ap, groups as i64, s)? };
    }
    let scales = scales_from_amax(&stream.clone_dtoh(&amax)?)?;
    let dev_scales = stream.clone_htod(&scales)?;
    dev.check_free(Some(n))?;
    let mut codes = stream.alloc_zeros::<u8>(n)?;
    {
        let (yp, _gy) = codes.device_ptr_mut(stream);
        let (sp, _gs) = dev_scales.device_ptr(stream);
        let s = dev.raw_stream()?;
        // SAFETY: as above; `codes` holds n bytes, `dev_scales` one float per group.
        unsafe { sdpa_sys::ffi::e4m3_quantize(x, x_is_f32, code, yp, n as i64, map, sp, s)? };
    }
    Ok(Tensor {
        buf: Buf::Byte(codes),
        dtype: DType::E4m3,
        fp8: Some(Fp8Scales {
            host: scales,
            dev: dev_scales,
            shape,
            scaling,
        }),
    })
}
