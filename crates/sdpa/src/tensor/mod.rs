//! Device tensors: contiguous buffers owned by Rust (cudarc), freed on drop, typed by
//! element (f16, bf16, or e4m3 codes with their scales in `fp8.rs` of this module).

mod fp8;

use crate::codec::{decode_one, nan_bits, try_encode};
use crate::device::{Device, StreamOrder};
use crate::error::{Error, Result, invalid};
use crate::memory::host_vec;
use crate::problem::{DType, Scaling, TensorShape};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, sys};
use std::sync::Arc;

/// A contiguous device buffer of `len` elements of `dtype`, owned by Rust and freed on drop.
///
/// f16/bf16 tensors hold bit patterns; e4m3 tensors hold codes plus their dequantization
/// scales and the shape the scales are laid out over (made by [`Tensor::quantize`],
/// [`Tensor::quantize_f32`] or [`Tensor::from_e4m3`]).
///
/// `Send + Sync`: the buffers are device memory owned through cudarc, used only through a
/// `Device` handle, whose calls order the streams involved (see [`Device`]).
pub struct Tensor {
    pub(crate) buf: Buf,
    pub(crate) dtype: DType,
    pub(crate) fp8: Option<Fp8Scales>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Tensor");
        d.field("dtype", &self.dtype).field("len", &self.len());
        if let Some(s) = &self.fp8 {
            d.field("scaling", &s.scaling).field("shape", &s.shape);
        }
        d.finish_non_exhaustive()
    }
}

pub(crate) enum Buf {
    Half(CudaSlice<u16>),
    Byte(CudaSlice<u8>),
}

/// The scales of an e4m3 tensor: real value = code · scale of the element's group.
pub(crate) struct Fp8Scales {
    pub(crate) host: Vec<f32>,
    pub(crate) dev: CudaSlice<f32>,
    pub(crate) shape: TensorShape,
    pub(crate) scaling: Scaling,
}

impl Fp8Scales {
    /// The scale of element `i`.
    pub(crate) fn of(&self, i: usize) -> f32 {
        match self.scaling {
            Scaling::PerTensor => self.host[0],
            Scaling::PerHead => self.host[self.shape.head_index(i)],
        }
    }
}

fn needs_scales(what: &str) -> Error {
    invalid!(
        "{what}: e4m3 tensors carry scales; make them with Tensor::quantize, \
         Tensor::quantize_f32 or Tensor::from_e4m3"
    )
}

/// Element types a [`Tensor`] can take over from, or hand back as, a cudarc buffer:
/// `half::f16` and `half::bf16`. Sealed: e4m3 tensors carry scales and are made by
/// [`Tensor::quantize`] or [`Tensor::from_e4m3`].
pub trait Element: cudarc::driver::DeviceRepr + sealed::Sealed {
    /// The dtype of a tensor of these elements.
    const DTYPE: DType;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::Bf16;
}
mod sealed {
    pub trait Sealed {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

impl Tensor {
    /// Takes over a cudarc buffer of f16 or bf16 elements without copying. The tensor belongs to
    /// the buffer's stream (its memory is freed there), as if made through a handle on that
    /// stream; `dev` only checks that the buffer is on its GPU.
    pub fn from_cuda_slice<T: Element>(dev: &Device, slice: CudaSlice<T>) -> Result<Tensor> {
        if slice.is_empty() {
            return Err(invalid!("a tensor needs at least one element"));
        }
        if slice.context() != dev.ctx() {
            return Err(invalid!(
                "the buffer lives on another GPU than the device handle"
            ));
        }
        let (stream, len) = (slice.stream().clone(), slice.len());
        let ptr = slice.leak();
        // SAFETY: the same allocation of `len` 16-bit elements, now seen as their bit patterns;
        // the new slice owns it and frees it on the same stream.
        let buf = unsafe { stream.upgrade_device_ptr::<u16>(ptr, len) };
        Ok(Tensor {
            buf: Buf::Half(buf),
            dtype: T::DTYPE,
            fp8: None,
        })
    }
    /// Hands the tensor's memory back as a cudarc buffer of `T` without copying (on the stream
    /// the tensor belongs to). `T` must match the tensor's dtype; e4m3 tensors are refused.
    pub fn into_cuda_slice<T: Element>(self) -> Result<CudaSlice<T>> {
        if self.dtype != T::DTYPE {
            return Err(invalid!("the tensor is {}, not {}", self.dtype, T::DTYPE));
        }
        match self.buf {
            Buf::Half(b) => {
                let (stream, len) = (b.stream().clone(), b.len());
                let ptr = b.leak();
                // SAFETY: as in from_cuda_slice, the other way round.
                Ok(unsafe { stream.upgrade_device_ptr::<T>(ptr, len) })
            }
            Buf::Byte(_) => Err(invalid!(
                "e4m3 tensors cannot be handed out as {}",
                T::DTYPE
            )),
        }
    }
    /// Uploads `data`, rounded to `dtype` (f16 or bf16; e4m3 needs scales: see
    /// [`Tensor::quantize_f32`]). The rounded copy is made on the host first: where the host
    /// cannot hold it, `Error::OutOfMemory`.
    pub fn from_f32(dev: &Device, dtype: DType, data: &[f32]) -> Result<Tensor> {
        if dtype == DType::E4m3 {
            return Err(needs_scales("Tensor::from_f32"));
        }
        Self::from_bits(dev, dtype, &try_encode(dtype, data)?)
    }
    /// Uploads raw bit patterns of `dtype` (f16 or bf16).
    pub fn from_bits(dev: &Device, dtype: DType, bits: &[u16]) -> Result<Tensor> {
        if dtype == DType::E4m3 {
            return Err(needs_scales("Tensor::from_bits"));
        }
        if bits.is_empty() {
            return Err(invalid!("a tensor needs at least one element"));
        }
        Ok(Tensor {
            buf: Buf::Half(dev.upload(bits)?),
            dtype,
            fp8: None,
        })
    }
    /// A tensor of `len` zeros (f16 or bf16), filled on the GPU (queued on `dev`'s stream; no
    /// host buffer).
    pub fn zeros(dev: &Device, dtype: DType, len: usize) -> Result<Tensor> {
        if dtype == DType::E4m3 {
            return Err(needs_scales("Tensor::zeros"));
        }
        if len == 0 {
            return Err(invalid!("a tensor needs at least one element"));
        }
        dev.check_free(crate::memory::bytes_of::<u16>(len))?;
        Ok(Tensor {
            buf: Buf::Half(dev.stream().alloc_zeros::<u16>(len)?),
            dtype,
            fp8: None,
        })
    }
    /// A tensor of `len` elements (f16 or bf16) whose contents are whatever the allocation
    /// held: for an output that a call overwrites, without the cost of a fill.
    pub fn uninit(dev: &Device, dtype: DType, len: usize) -> Result<Tensor> {
        if dtype == DType::E4m3 {
            return Err(needs_scales("Tensor::uninit"));
        }
        if len == 0 {
            return Err(invalid!("a tensor needs at least one element"));
        }
        // SAFETY: device memory of any bit pattern is a valid f16/bf16 value; nothing on the
        // host reads it before the caller's writes.
        let buf = unsafe { dev.alloc::<u16>(len)? };
        Ok(Tensor {
            buf: Buf::Half(buf),
            dtype,
            fp8: None,
        })
    }
    /// A tensor of `len` NaNs (f16 or bf16), filled on the GPU: anything a kernel fails to
    /// write stays NaN and fails checks.
    pub fn poisoned(dev: &Device, dtype: DType, len: usize) -> Result<Tensor> {
        if dtype == DType::E4m3 {
            return Err(invalid!("outputs are f16 or bf16, not e4m3"));
        }
        if len == 0 {
            return Err(invalid!("a tensor needs at least one element"));
        }
        // SAFETY: `poison` writes every element before the tensor is handed out.
        let buf = unsafe { dev.alloc::<u16>(len)? };
        let mut t = Tensor {
            buf: Buf::Half(buf),
            dtype,
            fp8: None,
        };
        t.poison(dev)?;
        Ok(t)
    }
    /// Refills the tensor with NaN (on the GPU, queued on `dev`'s stream).
    pub fn poison(&mut self, dev: &Device) -> Result<()> {
        let order = order_on(dev, &[&*self])?;
        let (nan, len, byte_buf) = (
            nan_bits(self.dtype),
            self.len(),
            matches!(self.buf, Buf::Byte(_)),
        );
        let ptr = self.ptr_mut(dev);
        let stream = dev.raw_stream()? as sys::CUstream;
        // SAFETY: `ptr` addresses the `len` elements of this tensor, of the width set here.
        let filled = unsafe {
            if byte_buf {
                cudarc::driver::result::memset_d8_async(ptr, 0x7F, len, stream)
            } else {
                sys::cuMemsetD16Async(ptr, nan, len, stream).result()
            }
        };
        order.finish(filled.map_err(Error::from))
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match &self.buf {
            Buf::Half(b) => b.len(),
            Buf::Byte(b) => b.len(),
        }
    }
    /// Always false: empty tensors cannot be made.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Dequantization scales of an e4m3 tensor (`None` for f16/bf16): one per tensor, or one
    /// per (batch, head) pair in batch-major order.
    pub fn scales(&self) -> Option<&[f32]> {
        self.fp8.as_ref().map(|f| f.host.as_slice())
    }
    /// Scale layout and logical shape of an e4m3 tensor.
    pub fn fp8_layout(&self) -> Option<(Scaling, TensorShape)> {
        self.fp8.as_ref().map(|f| (f.scaling, f.shape))
    }
    /// Downloads the raw bit patterns (e4m3: codes in the low byte; synchronizes the stream).
    /// Every host copy below is checked against the host's memory first: `Error::OutOfMemory`
    /// where it cannot hold it, never an abort.
    pub fn to_bits(&self, dev: &Device) -> Result<Vec<u16>> {
        ordered(dev, &[self], || match &self.buf {
            Buf::Half(b) => dev.download(b),
            Buf::Byte(b) => {
                let codes = dev.download(b)?;
                let mut bits = host_vec(codes.len(), 0u16)?;
                for (w, &c) in bits.iter_mut().zip(&codes) {
                    *w = u16::from(c);
                }
                Ok(bits)
            }
        })
    }
    /// Downloads as f64 (exact, e4m3 scaled by its scales; synchronizes the stream).
    pub fn to_f64(&self, dev: &Device) -> Result<Vec<f64>> {
        self.values(dev, |x| x)
    }
    /// Downloads as f32 (exact for f16/bf16; e4m3 code·scale rounded to f32).
    pub fn to_f32(&self, dev: &Device) -> Result<Vec<f32>> {
        self.values(dev, |x| x as f32)
    }
    /// Each element's value (e4m3: code·scale, in f64) through `to`, into a checked host copy.
    fn values<T: Clone + Default>(&self, dev: &Device, to: impl Fn(f64) -> T) -> Result<Vec<T>> {
        let bits = self.to_bits(dev)?;
        let mut out = host_vec(bits.len(), T::default())?;
        for (i, (o, &b)) in out.iter_mut().zip(&bits).enumerate() {
            let scale = self.fp8.as_ref().map_or(1.0, |f| f64::from(f.of(i)));
            *o = to(decode_one(self.dtype, b) * scale);
        }
        Ok(out)
    }
    /// Overwrites the first `bits.len()` elements with bit patterns of this dtype (f16/bf16).
    pub fn write_bits(&mut self, dev: &Device, bits: &[u16]) -> Result<()> {
        if bits.len() > self.len() {
            return Err(invalid!(
                "write of {} elements into a tensor of {}",
                bits.len(),
                self.len()
            ));
        }
        if matches!(self.buf, Buf::Byte(_)) {
            return Err(needs_scales("Tensor::write_bits"));
        }
        let order = order_on(dev, &[&*self])?;
        let copied = match &mut self.buf {
            Buf::Half(b) => dev
                .stream()
                .memcpy_htod(bits, &mut b.slice_mut(..bits.len())),
            Buf::Byte(_) => Ok(()),
        };
        order.finish(copied.map_err(Error::from))
    }
    pub(crate) fn ptr(&self, dev: &Device) -> u64 {
        // Event tracking is off (Device::new), so the guard records nothing.
        match &self.buf {
            Buf::Half(b) => b.device_ptr(dev.stream()).0,
            Buf::Byte(b) => b.device_ptr(dev.stream()).0,
        }
    }
    pub(crate) fn ptr_mut(&mut self, dev: &Device) -> u64 {
        match &mut self.buf {
            Buf::Half(b) => b.device_ptr_mut(dev.stream()).0,
            Buf::Byte(b) => b.device_ptr_mut(dev.stream()).0,
        }
    }
    /// Device address of the scales (0 for f16/bf16).
    pub(crate) fn scales_ptr(&self, dev: &Device) -> u64 {
        self.fp8
            .as_ref()
            .map_or(0, |f| f.dev.device_ptr(dev.stream()).0)
    }
    /// The device bytes the tensor's elements occupy.
    pub(crate) fn byte_span(&self, dev: &Device) -> std::ops::Range<u64> {
        let start = self.ptr(dev);
        start..start + (self.len() * self.dtype().size()) as u64
    }
    /// The streams this tensor's buffers belong to (where they were made and will be freed).
    pub(crate) fn streams(&self) -> impl Iterator<Item = &Arc<CudaStream>> {
        let data = match &self.buf {
            Buf::Half(b) => b.stream(),
            Buf::Byte(b) => b.stream(),
        };
        std::iter::once(data).chain(self.fp8.as_ref().map(|f| f.dev.stream()))
    }
    pub(crate) fn same_context(&self, dev: &Device) -> bool {
        let ctx = match &self.buf {
            Buf::Half(b) => b.context(),
            Buf::Byte(b) => b.context(),
        };
        ctx == dev.ctx()
    }
}

/// Orders work queued on `dev`'s stream with the other streams `tensors` belong to (see
/// [`StreamOrder`]); a tensor of another GPU is an error before anything is queued.
pub(crate) fn order_on(dev: &Device, tensors: &[&Tensor]) -> Result<StreamOrder> {
    if tensors.iter().any(|t| !t.same_context(dev)) {
        return Err(invalid!(
            "a tensor lives on another GPU than the device handle"
        ));
    }
    dev.order_after(tensors.iter().flat_map(|t| t.streams()))
}

/// Runs `call` (which queues work on `dev`'s stream using `tensors`) in order with the other
/// streams those tensors belong to.
pub(crate) fn ordered<R>(
    dev: &Device,
    tensors: &[&Tensor],
    call: impl FnOnce() -> Result<R>,
) -> Result<R> {
    order_on(dev, tensors)?.finish(call())
}
