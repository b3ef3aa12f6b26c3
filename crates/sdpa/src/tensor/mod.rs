//! Device tensors: contiguous buffers owned by Rust (cudarc), freed on drop, typed by
//! element (f16, bf16, f32 outputs, or e4m3 codes with their scales in `fp8.rs` of this
//! module).

mod fp8;

use crate::codec::{decode_one, nan_bits, try_encode, words};
use crate::device::{Device, StreamOrder};
use crate::error::{Error, Result, invalid};
use crate::memory::host_vec;
use crate::problem::{DType, Scaling, TensorShape};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, sys};
use std::sync::Arc;

/// A contiguous device buffer of `len` elements of `dtype`, owned by Rust and freed on drop.
///
/// f16/bf16 tensors hold bit patterns, f32 tensors (outputs only: [`DType::F32`]) their
/// values; e4m3 tensors hold codes plus their dequantization
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
    /// f16 and bf16 bit patterns.
    Half(CudaSlice<u16>),
    /// e4m3 codes.
    Byte(CudaSlice<u8>),
    /// f32 values.
    Single(CudaSlice<f32>),
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

/// Element types a [`Tensor`] can take over from, or hand back as, a cudarc buffer, and that
/// views ([`crate::View`], [`crate::ViewMut`]) hold: `half::f16`, `half::bf16` and `f32` (an
/// output type only). Sealed: e4m3 tensors carry scales and are made by [`Tensor::quantize`]
/// or [`Tensor::from_e4m3`].
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
impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
mod sealed {
    pub trait Sealed {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for f32 {}
}

/// An uninitialized buffer of `len` elements of `dtype` (not e4m3).
///
/// # Safety
///
/// Nothing may read an element before it is written.
unsafe fn alloc_buf(dev: &Device, dtype: DType, len: usize) -> Result<Buf> {
    // SAFETY: the caller writes before reading.
    Ok(unsafe {
        match dtype {
            DType::F32 => Buf::Single(dev.alloc::<f32>(len)?),
            _ => Buf::Half(dev.alloc::<u16>(len)?),
        }
    })
}

impl Tensor {
    /// Takes over a cudarc buffer of f16, bf16 or f32 elements without copying. The tensor
    /// belongs to the buffer's stream (its memory is freed there), as if made through a handle
    /// on that stream; `dev` only checks that the buffer is on its GPU.
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
        // SAFETY: the same allocation of `len` elements, now seen as f32 values or 16-bit bit
        // patterns (the width of `T::DTYPE`); the new slice owns it and frees it on the same
        // stream.
        let buf = unsafe {
            match T::DTYPE {
                DType::F32 => Buf::Single(stream.upgrade_device_ptr::<f32>(ptr, len)),
                _ => Buf::Half(stream.upgrade_device_ptr::<u16>(ptr, len)),
            }
        };
        Ok(Tensor {
            buf,
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
        let (stream, len, ptr) = match self.buf {
            Buf::Half(b) => (b.stream().clone(), b.len(), b.leak()),
            Buf::Single(b) => (b.stream().clone(), b.len(), b.leak()),
            Buf::Byte(_) => {
                return Err(invalid!(
                    "e4m3 tensors cannot be handed out as {}",
                    T::DTYPE
                ));
            }
        };
        // SAFETY: as in from_cuda_slice, the other way round (`T` has the tensor's dtype, so
        // its width).
        Ok(unsafe { stream.upgrade_device_ptr::<T>(ptr, len) })
    }
    /// The tensor's 16-bit or f32 buffer as elements of `T` (which must be its dtype), for the
    /// calls that take views.
    pub(crate) fn typed<T: Element>(&self) -> Result<CudaView<'_, T>> {
        let view = match (&self.buf, self.dtype == T::DTYPE) {
            // SAFETY: the buffer holds `len` elements of the tensor's dtype, `T`'s width.
            (Buf::Half(b), true) => unsafe { b.transmute::<T>(b.len()) },
            (Buf::Single(b), true) => unsafe { b.transmute::<T>(b.len()) },
            _ => None,
        };
        view.ok_or_else(|| invalid!("the tensor is {}, not {}", self.dtype, T::DTYPE))
    }
    /// [`Tensor::typed`], writable.
    pub(crate) fn typed_mut<T: Element>(&mut self) -> Result<CudaViewMut<'_, T>> {
        let dtype = self.dtype;
        let view = match (&mut self.buf, dtype == T::DTYPE) {
            // SAFETY: as in `typed`.
            (Buf::Half(b), true) => {
                let n = b.len();
                unsafe { b.transmute_mut::<T>(n) }
            }
            (Buf::Single(b), true) => {
                let n = b.len();
                unsafe { b.transmute_mut::<T>(n) }
            }
            _ => None,
        };
        view.ok_or_else(|| invalid!("the tensor is {dtype}, not {}", T::DTYPE))
    }
    /// Uploads `data`, rounded to `dtype` (f16 or bf16; f32 as it is; e4m3 needs scales: see
    /// [`Tensor::quantize_f32`]). The rounded copy is made on the host first: where the host
    /// cannot hold it, `Error::OutOfMemory`.
    pub fn from_f32(dev: &Device, dtype: DType, data: &[f32]) -> Result<Tensor> {
        if dtype == DType::E4m3 {
            return Err(needs_scales("Tensor::from_f32"));
        }
        if dtype == DType::F32 {
            if data.is_empty() {
                return Err(invalid!("a tensor needs at least one element"));
            }
            return Ok(Tensor {
                buf: Buf::Single(dev.upload(data)?),
                dtype,
                fp8: None,
            });
        }
        Self::from_bits(dev, dtype, &try_encode(dtype, data)?)
    }
    /// Uploads raw bit patterns of `dtype` as [`crate::encode`] makes them (f16 or bf16: one
    /// word an element; f32: two, the low half first).
    pub fn from_bits(dev: &Device, dtype: DType, bits: &[u16]) -> Result<Tensor> {
        if dtype == DType::E4m3 {
            return Err(needs_scales("Tensor::from_bits"));
        }
        if bits.is_empty() {
            return Err(invalid!("a tensor needs at least one element"));
        }
        if dtype == DType::F32 {
            let values = f32_values(bits)?;
            return Ok(Tensor {
                buf: Buf::Single(dev.upload(&values)?),
                dtype,
                fp8: None,
            });
        }
        Ok(Tensor {
            buf: Buf::Half(dev.upload(bits)?),
            dtype,
            fp8: None,
        })
    }
    /// A tensor of `len` zeros (f16, bf16 or f32), filled on the GPU (queued on `dev`'s stream;
    /// no host buffer).
    pub fn zeros(dev: &Device, dtype: DType, len: usize) -> Result<Tensor> {
        if dtype == DType::E4m3 {
            return Err(needs_scales("Tensor::zeros"));
        }
        if len == 0 {
            return Err(invalid!("a tensor needs at least one element"));
        }
        dev.check_free(len.checked_mul(dtype.size()))?;
        let stream = dev.stream();
        let buf = match dtype {
            DType::F32 => Buf::Single(stream.alloc_zeros::<f32>(len)?),
            _ => Buf::Half(stream.alloc_zeros::<u16>(len)?),
        };
        Ok(Tensor {
            buf,
            dtype,
            fp8: None,
        })
    }
    /// A tensor of `len` elements (f16, bf16 or f32) whose contents are whatever the allocation
    /// held: for an output that a call overwrites, without the cost of a fill.
    pub fn uninit(dev: &Device, dtype: DType, len: usize) -> Result<Tensor> {
        if dtype == DType::E4m3 {
            return Err(needs_scales("Tensor::uninit"));
        }
        if len == 0 {
            return Err(invalid!("a tensor needs at least one element"));
        }
        // SAFETY: device memory of any bit pattern is a valid f16/bf16/f32 value; nothing on
        // the host reads it before the caller's writes.
        let buf = unsafe { alloc_buf(dev, dtype, len)? };
        Ok(Tensor {
            buf,
            dtype,
            fp8: None,
        })
    }
    /// A tensor of `len` NaNs (f16, bf16 or f32), filled on the GPU: anything a kernel fails to
    /// write stays NaN and fails checks.
    pub fn poisoned(dev: &Device, dtype: DType, len: usize) -> Result<Tensor> {
        if dtype == DType::E4m3 {
            return Err(invalid!("outputs are f16, bf16 or f32, not e4m3"));
        }
        if len == 0 {
            return Err(invalid!("a tensor needs at least one element"));
        }
        // SAFETY: `poison` writes every element before the tensor is handed out.
        let buf = unsafe { alloc_buf(dev, dtype, len)? };
        let mut t = Tensor {
            buf,
            dtype,
            fp8: None,
        };
        t.poison(dev)?;
        Ok(t)
    }
    /// Refills the tensor with NaN (on the GPU, queued on `dev`'s stream).
    pub fn poison(&mut self, dev: &Device) -> Result<()> {
        let order = order_on(dev, &[&*self])?;
        let (nan, len) = (nan_bits(self.dtype), self.len());
        let ptr = self.ptr_mut(dev);
        let stream = dev.raw_stream()? as sys::CUstream;
        // SAFETY: `ptr` addresses the `len` elements of this tensor, of the width set here.
        let filled = unsafe {
            match self.dtype.size() {
                1 => cudarc::driver::result::memset_d8_async(ptr, nan as u8, len, stream),
                2 => sys::cuMemsetD16Async(ptr, nan as u16, len, stream).result(),
                _ => sys::cuMemsetD32Async(ptr, nan, len, stream).result(),
            }
        };
        order.finish(filled.map_err(Error::from))
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match &self.buf {
            Buf::Half(b) => b.len(),
            Buf::Byte(b) => b.len(),
            Buf::Single(b) => b.len(),
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
    /// Downloads the raw bit patterns as [`crate::encode`] makes them (e4m3: codes in the low
    /// byte; f32: two words an element, the low half first; synchronizes the stream). Every
    /// host copy below is checked against the host's memory first: `Error::OutOfMemory` where
    /// it cannot hold it, never an abort.
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
            Buf::Single(b) => {
                let values = dev.download(b)?;
                let mut bits = host_vec(values.len().saturating_mul(2), 0u16)?;
                for (w, &x) in bits.chunks_exact_mut(2).zip(&values) {
                    let x = x.to_bits();
                    w.copy_from_slice(&[x as u16, (x >> 16) as u16]);
                }
                Ok(bits)
            }
        })
    }
    /// Downloads as f64 (exact, e4m3 scaled by its scales; synchronizes the stream).
    pub fn to_f64(&self, dev: &Device) -> Result<Vec<f64>> {
        self.values(dev, |x| x)
    }
    /// Downloads as f32 (exact for f16/bf16/f32; e4m3 code·scale rounded to f32).
    pub fn to_f32(&self, dev: &Device) -> Result<Vec<f32>> {
        if let Buf::Single(b) = &self.buf {
            return ordered(dev, &[self], || dev.download(b));
        }
        self.values(dev, |x| x as f32)
    }
    /// Each element's value (e4m3: code·scale, in f64) through `to`, into a checked host copy.
    fn values<T: Clone + Default>(&self, dev: &Device, to: impl Fn(f64) -> T) -> Result<Vec<T>> {
        let bits = self.to_bits(dev)?;
        let w = words(self.dtype);
        let mut out = host_vec(bits.len() / w, T::default())?;
        for (i, (o, b)) in out.iter_mut().zip(bits.chunks_exact(w)).enumerate() {
            let scale = self.fp8.as_ref().map_or(1.0, |f| f64::from(f.of(i)));
            *o = to(decode_one(self.dtype, b) * scale);
        }
        Ok(out)
    }
    /// Overwrites the first elements with bit patterns of this dtype as [`crate::encode`] makes
    /// them (f16/bf16: one word an element; f32: two).
    pub fn write_bits(&mut self, dev: &Device, bits: &[u16]) -> Result<()> {
        match self.dtype {
            DType::E4m3 => Err(needs_scales("Tensor::write_bits")),
            DType::F32 => self.write_f32(dev, &f32_values(bits)?),
            DType::F16 | DType::Bf16 => self.copy_in(dev, bits.len(), |b| match b {
                Buf::Half(b) => dev
                    .stream()
                    .memcpy_htod(bits, &mut b.slice_mut(..bits.len())),
                _ => Ok(()),
            }),
        }
    }
    /// Overwrites the first `values.len()` elements with `values` rounded to this dtype (f16,
    /// bf16; f32 as they are; e4m3 needs scales).
    pub fn write_f32(&mut self, dev: &Device, values: &[f32]) -> Result<()> {
        match self.dtype {
            DType::E4m3 => Err(needs_scales("Tensor::write_f32")),
            DType::F16 | DType::Bf16 => self.write_bits(dev, &try_encode(self.dtype, values)?),
            DType::F32 => self.copy_in(dev, values.len(), |b| match b {
                Buf::Single(b) => dev
                    .stream()
                    .memcpy_htod(values, &mut b.slice_mut(..values.len())),
                _ => Ok(()),
            }),
        }
    }
    /// A host-to-device copy of `n` elements into the buffer, once `n` is checked against the
    /// tensor's length, in order with the tensor's stream.
    fn copy_in(
        &mut self,
        dev: &Device,
        n: usize,
        copy: impl FnOnce(&mut Buf) -> std::result::Result<(), cudarc::driver::DriverError>,
    ) -> Result<()> {
        if n > self.len() {
            return Err(invalid!(
                "write of {n} elements into a tensor of {}",
                self.len()
            ));
        }
        let order = order_on(dev, &[&*self])?;
        order.finish(copy(&mut self.buf).map_err(Error::from))
    }
    pub(crate) fn ptr(&self, dev: &Device) -> u64 {
        // Event tracking is off (Device::new), so the guard records nothing.
        match &self.buf {
            Buf::Half(b) => b.device_ptr(dev.stream()).0,
            Buf::Byte(b) => b.device_ptr(dev.stream()).0,
            Buf::Single(b) => b.device_ptr(dev.stream()).0,
        }
    }
    pub(crate) fn ptr_mut(&mut self, dev: &Device) -> u64 {
        match &mut self.buf {
            Buf::Half(b) => b.device_ptr_mut(dev.stream()).0,
            Buf::Byte(b) => b.device_ptr_mut(dev.stream()).0,
            Buf::Single(b) => b.device_ptr_mut(dev.stream()).0,
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
            Buf::Single(b) => b.stream(),
        };
        std::iter::once(data).chain(self.fp8.as_ref().map(|f| f.dev.stream()))
    }
    pub(crate) fn same_context(&self, dev: &Device) -> bool {
        let ctx = match &self.buf {
            Buf::Half(b) => b.context(),
            Buf::Byte(b) => b.context(),
            Buf::Single(b) => b.context(),
        };
        ctx == dev.ctx()
    }
}

/// f32 values from their bit patterns, two words each (see [`crate::encode`]).
fn f32_values(bits: &[u16]) -> Result<Vec<f32>> {
    if !bits.len().is_multiple_of(2) {
        return Err(invalid!(
            "{} words of f32 bit patterns: each value takes two",
            bits.len()
        ));
    }
    let mut values = host_vec(bits.len() / 2, 0f32)?;
    for (x, w) in values.iter_mut().zip(bits.chunks_exact(2)) {
        *x = f32::from_bits(u32::from(w[0]) | u32::from(w[1]) << 16);
    }
    Ok(values)
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
