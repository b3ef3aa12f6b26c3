//! Device handles and device tensors, owned by Rust through cudarc.

use crate::backend::cublas::BlasState;
use crate::error::MemoryKind;
use crate::error::{Error, Result, invalid};
use crate::memory::{bytes_of, host_vec, out_of_memory};
use crate::problem::{DType, Scaling, TensorShape};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, sys};
use half::{bf16, f16};
use std::sync::{Arc, Mutex};

/// A GPU and one stream on it. Everything issued through one `Device` runs in order on its
/// stream; [`Device::fork`] gives another stream on the same GPU for concurrent work.
///
/// Streams and tensors: a [`Tensor`] belongs to the stream of the handle that made it (its
/// memory is freed on that stream when it is dropped). Using it through a handle with another
/// stream of the same GPU is safe: the call first makes its stream wait for the work queued on
/// the tensor's stream, and afterwards makes the tensor's stream wait for the call, so neither
/// an unfinished upload nor a free can overtake the kernel. Work on one stream needs no such
/// waits (and records no events: a call can be captured into a CUDA graph). A tensor of
/// another GPU is rejected with `Error::InvalidArgument`.
///
/// `Send + Sync`: the context and stream are reference-counted driver handles that the CUDA
/// driver allows any thread to use; each call binds the context to the calling thread first.
#[derive(Clone)]
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// cuBLAS handle and workspace of this stream, made on first use by the cublas backend.
    blas: Arc<Mutex<Option<BlasState>>>,
    /// Scratch the fused kernels ask for (the native e4m3 kernel's Vᵀ), grown on demand and
    /// reused: work on one stream runs in order, so one buffer per stream suffices.
    scratch: Arc<Mutex<Option<CudaSlice<u8>>>>,
}

/// Whether the CUDA driver library can be loaded at all. Without it cudarc would panic on
/// first use, so every entry point checks this first.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda; no other state.
    unsafe { sys::is_culib_present() }
}

impl Device {
    /// Opens GPU `ordinal` (its primary context) and creates a stream on it.
    ///
    /// Returns `Error::NoDevice` when there is no driver, no GPU, or no such ordinal.
    pub fn new(ordinal: usize) -> Result<Device> {
        if !driver_present() {
            return Err(Error::NoDevice(
                "the CUDA driver library (libcuda.so) is not installed on this machine".into(),
            ));
        }
        let count = CudaContext::device_count()
            .map_err(|e| Error::NoDevice(format!("the CUDA driver cannot list GPUs: {e}")))?;
        if count <= 0 {
            return Err(Error::NoDevice("the CUDA driver reports no GPU".into()));
        }
        if ordinal >= count as usize {
            return Err(Error::NoDevice(format!(
                "GPU ordinal {ordinal} does not exist ({count} GPU(s) present)"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        // We hand raw pointers to our own kernels and capture CUDA graphs of forward calls;
        // cudarc's per-slice event tracking would record events into those captures. Ordering
        // across streams is kept by `StreamOrder` instead, only where a tensor crosses streams.
        // SAFETY: no other stream of this context exists yet.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        Ok(Device {
            ctx,
            stream,
            blas: Arc::default(),
            scratch: Arc::default(),
        })
    }

    /// A handle to the same GPU with a new stream of its own.
    pub fn fork(&self) -> Result<Device> {
        Ok(Device {
            ctx: self.ctx.clone(),
            stream: self.ctx.new_stream()?,
            blas: Arc::default(),
            scratch: Arc::default(),
        })
    }

    /// The device's marketing name.
    pub fn name(&self) -> Result<String> {
        Ok(self.ctx.name()?)
    }
    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> Result<(u32, u32)> {
        let (a, b) = self.ctx.compute_capability()?;
        Ok((a as u32, b as u32))
    }
    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> Result<u32> {
        use sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        Ok(self
            .ctx
            .attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32)
    }
    /// Waits for everything issued on this handle's stream.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }
    /// The cudarc stream, for callers who mix in their own cudarc work.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        Ok(self.ctx.mem_get_info()?)
    }
    pub(crate) fn blas_state(&self) -> &Mutex<Option<BlasState>> {
        &self.blas
    }
    pub(crate) fn scratch(&self) -> &Mutex<Option<CudaSlice<u8>>> {
        &self.scratch
    }
    pub(crate) fn ctx(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// `Err(OutOfMemory)` when `bytes` (`None`: overflowed) exceed the GPU's free memory.
    pub(crate) fn check_free(&self, bytes: Option<usize>) -> Result<()> {
        let (free, _) = self.mem_info()?;
        match bytes {
            Some(b) if b <= free => Ok(()),
            b => Err(out_of_memory(
                MemoryKind::Device,
                b.unwrap_or(usize::MAX),
                Some(free),
            )),
        }
    }
    /// `n` uninitialised elements on this stream, after checking the GPU has room for them.
    ///
    /// # Safety
    /// The caller writes every element before anything reads it.
    pub(crate) unsafe fn alloc<T: cudarc::driver::DeviceRepr>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>> {
        self.check_free(bytes_of::<T>(n))?;
        // SAFETY: forwarded to the caller.
        Ok(unsafe { self.stream.alloc::<T>(n)? })
    }
    /// Uploads `data` to a new buffer on this stream, after checking the GPU has room for it.
    pub(crate) fn upload<T: cudarc::driver::DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        self.check_free(bytes_of::<T>(data.len()))?;
        Ok(self.stream.clone_htod(data)?)
    }
    /// Runs `call` (which queues work on this handle's stream using `tensors`) in order with
    /// the other streams those tensors belong to (see [`StreamOrder`]).
    pub(crate) fn ordered<R>(
        &self,
        tensors: &[&Tensor],
        call: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let order = self.order_with(tensors)?;
        order.finish(call())
    }
    /// Makes this stream wait for the work queued on the other streams `tensors` belong to;
    /// [`StreamOrder::finish`] makes them wait for this stream in turn. A tensor of another
    /// GPU is an error before anything is queued.
    pub(crate) fn order_with(&self, tensors: &[&Tensor]) -> Result<StreamOrder> {
        let mut foreign: Vec<Arc<CudaStream>> = Vec::new();
        for t in tensors {
            if !t.same_context(self) {
                return Err(invalid!(
                    "a tensor lives on another GPU than the device handle"
                ));
            }
            for s in t.streams() {
                if **s != *self.stream && !foreign.iter().any(|f| **f == **s) {
                    foreign.push(s.clone());
                }
            }
        }
        for s in &foreign {
            self.stream.join(s)?;
        }
        Ok(StreamOrder {
            stream: self.stream.clone(),
            foreign,
        })
    }
    /// Downloads `b` into a new host vector, after checking the host has room for it.
    pub(crate) fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        b: &CudaSlice<T>,
    ) -> Result<Vec<T>> {
        let mut host = host_vec(b.len(), T::default())?;
        self.stream.memcpy_dtoh(b, &mut host)?;
        self.stream.synchronize()?;
        Ok(host)
    }
    /// Raw stream handle for the C++ core; binds the context to this thread first, because
    /// the CUDA runtime inside the core launches on whatever context is current.
    pub(crate) fn raw_stream(&self) -> Result<usize> {
        self.ctx.bind_to_thread()?;
        Ok(self.stream.cu_stream() as usize)
    }
}

/// Keeps a call on one stream in order with the other streams its tensors belong to: made
/// (by [`Device::order_with`]) after those streams' queued work, and `finish`ed after the
/// call's last launch, so that an upload still running on a tensor's stream cannot be
/// overtaken by the call, nor the call by the tensor's free on its own stream. Tensors of
/// the call's own stream add nothing: no events, nothing recorded into a graph capture.
pub(crate) struct StreamOrder {
    stream: Arc<CudaStream>,
    foreign: Vec<Arc<CudaStream>>,
}

impl StreamOrder {
    /// Makes every other stream wait for what the call queued, then passes `result` on. Runs
    /// on failure too: part of the call's work may already be queued.
    pub(crate) fn finish<R>(self, result: Result<R>) -> Result<R> {
        for s in &self.foreign {
            s.join(&self.stream)?;
        }
        result
    }
}

/// A contiguous device buffer of `len` elements of `dtype`, owned by Rust and freed on drop.
///
/// f16/bf16 tensors hold bit patterns; e4m3 tensors hold codes plus their dequantization
/// scales and the shape the scales are laid out over (made by [`Tensor::quantize`],
/// [`Tensor::quantize_f32`] or [`Tensor::from_e4m3`]).
pub struct Tensor {
    pub(crate) buf: Buf,
    pub(crate) dtype: DType,
    pub(crate) fp8: Option<Fp8Scales>,
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

/// The quiet-NaN bit pattern of a dtype, used to poison outputs before a run.
fn nan_bits(dtype: DType) -> u16 {
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

fn needs_scales(what: &str) -> Error {
    invalid!(
        "{what}: e4m3 tensors carry scales; make them with Tensor::quantize, \
         Tensor::quantize_f32 or Tensor::from_e4m3"
    )
}

impl Tensor {
    /// Uploads `data`, rounded to `dtype` (f16 or bf16; e4m3 needs scales: see
    /// [`Tensor::quantize_f32`]).
    pub fn from_f32(dev: &Device, dtype: DType, data: &[f32]) -> Result<Tensor> {
        if dtype == DType::E4m3 {
            return Err(needs_scales("Tensor::from_f32"));
        }
        Self::from_bits(dev, dtype, &encode(dtype, data))
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
        let order = dev.order_with(&[&*self])?;
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
    pub fn to_bits(&self, dev: &Device) -> Result<Vec<u16>> {
        dev.ordered(&[self], || {
            Ok(match &self.buf {
                Buf::Half(b) => dev.download(b)?,
                Buf::Byte(b) => dev.download(b)?.into_iter().map(u16::from).collect(),
            })
        })
    }
    /// Downloads as f64 (exact, e4m3 scaled by its scales; synchronizes the stream).
    pub fn to_f64(&self, dev: &Device) -> Result<Vec<f64>> {
        let mut v = decode(self.dtype, &self.to_bits(dev)?);
        if let Some(f) = &self.fp8 {
            for (i, x) in v.iter_mut().enumerate() {
                *x *= f64::from(f.of(i));
            }
        }
        Ok(v)
    }
    /// Downloads as f32 (exact for f16/bf16; e4m3 code·scale rounded to f32).
    pub fn to_f32(&self, dev: &Device) -> Result<Vec<f32>> {
        Ok(self.to_f64(dev)?.into_iter().map(|x| x as f32).collect())
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
        let order = dev.order_with(&[&*self])?;
        let copied = match &mut self.buf {
            Buf::Half(b) => dev.stream.memcpy_htod(bits, &mut b.slice_mut(..bits.len())),
            Buf::Byte(_) => Ok(()),
        };
        order.finish(copied.map_err(Error::from))
    }
    pub(crate) fn ptr(&self, dev: &Device) -> u64 {
        // Event tracking is off (Device::new), so the guard records nothing.
        match &self.buf {
            Buf::Half(b) => b.device_ptr(&dev.stream).0,
            Buf::Byte(b) => b.device_ptr(&dev.stream).0,
        }
    }
    pub(crate) fn ptr_mut(&mut self, dev: &Device) -> u64 {
        match &mut self.buf {
            Buf::Half(b) => b.device_ptr_mut(&dev.stream).0,
            Buf::Byte(b) => b.device_ptr_mut(&dev.stream).0,
        }
    }
    /// Device address of the scales (0 for f16/bf16).
    pub(crate) fn scales_ptr(&self, dev: &Device) -> u64 {
        self.fp8
            .as_ref()
            .map_or(0, |f| f.dev.device_ptr(&dev.stream).0)
    }
    /// The streams this tensor's buffers belong to (where they were made and will be freed).
    fn streams(&self) -> impl Iterator<Item = &Arc<CudaStream>> {
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

#[cfg(test)]
mod tests {
    /// Handles cross threads: a `Device` per thread (or a shared one) and tensors moved between
    /// threads. This fails to compile if a field ever stops being `Send + Sync`.
    #[test]
    fn handles_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<super::Device>();
        check::<super::Tensor>();
    }
}
