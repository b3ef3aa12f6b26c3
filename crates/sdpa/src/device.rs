//! Device handles and device tensors, owned by Rust through cudarc.

use crate::backend::cublas::BlasState;
use crate::error::{Error, Result, invalid};
use crate::problem::DType;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, sys};
use half::{bf16, f16};
use std::sync::{Arc, Mutex};

/// A GPU and one stream on it. Everything issued through one `Device` runs in order on its
/// stream; [`Device::fork`] gives another stream on the same GPU for concurrent work.
///
/// `Send + Sync`: the context and stream are reference-counted driver handles that the CUDA
/// driver allows any thread to use; each call binds the context to the calling thread first.
#[derive(Clone)]
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// cuBLAS handle and workspace of this stream, made on first use by the cublas backend.
    blas: Arc<Mutex<Option<BlasState>>>,
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
        // We hand raw pointers to our own kernels on one stream per Device and capture CUDA
        // graphs of forward calls; cudarc's per-slice event tracking would record events into
        // those captures. Ordering across streams is the caller's, as with any CUDA stream.
        // SAFETY: no other stream of this context exists yet.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        Ok(Device {
            ctx,
            stream,
            blas: Arc::default(),
        })
    }

    /// A handle to the same GPU with a new stream of its own.
    pub fn fork(&self) -> Result<Device> {
        Ok(Device {
            ctx: self.ctx.clone(),
            stream: self.ctx.new_stream()?,
            blas: Arc::default(),
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
    pub(crate) fn ctx(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// Raw stream handle for the C++ core; binds the context to this thread first, because
    /// the CUDA runtime inside the core launches on whatever context is current.
    pub(crate) fn raw_stream(&self) -> Result<usize> {
        self.ctx.bind_to_thread()?;
        Ok(self.stream.cu_stream() as usize)
    }
}

/// A contiguous device buffer of `len` elements of `dtype`, owned by Rust and freed on drop.
pub struct Tensor {
    buf: CudaSlice<u16>,
    dtype: DType,
}

/// The quiet-NaN bit pattern of a dtype, used to poison outputs before a run.
fn nan_bits(dtype: DType) -> u16 {
    match dtype {
        DType::F16 => f16::NAN.to_bits(),
        DType::Bf16 => bf16::NAN.to_bits(),
    }
}

/// Rounds f32 values to `dtype` (round-to-nearest-even) and returns their bit patterns.
pub fn encode(dtype: DType, data: &[f32]) -> Vec<u16> {
    match dtype {
        DType::F16 => data.iter().map(|&x| f16::from_f32(x).to_bits()).collect(),
        DType::Bf16 => data.iter().map(|&x| bf16::from_f32(x).to_bits()).collect(),
    }
}

/// Decodes bit patterns of `dtype` to f64 (exact).
pub fn decode(dtype: DType, bits: &[u16]) -> Vec<f64> {
    match dtype {
        DType::F16 => bits.iter().map(|&b| f16::from_bits(b).to_f64()).collect(),
        DType::Bf16 => bits.iter().map(|&b| bf16::from_bits(b).to_f64()).collect(),
    }
}

impl Tensor {
    /// Uploads `data`, rounded to `dtype`.
    pub fn from_f32(dev: &Device, dtype: DType, data: &[f32]) -> Result<Tensor> {
        Self::from_bits(dev, dtype, &encode(dtype, data))
    }
    /// Uploads raw bit patterns of `dtype`.
    pub fn from_bits(dev: &Device, dtype: DType, bits: &[u16]) -> Result<Tensor> {
        if bits.is_empty() {
            return Err(invalid!("a tensor needs at least one element"));
        }
        Ok(Tensor {
            buf: dev.stream.clone_htod(bits)?,
            dtype,
        })
    }
    /// A tensor of `len` NaNs: anything a kernel fails to write stays NaN and fails checks.
    pub fn poisoned(dev: &Device, dtype: DType, len: usize) -> Result<Tensor> {
        Self::from_bits(dev, dtype, &vec![nan_bits(dtype); len])
    }
    /// Refills the tensor with NaN.
    pub fn poison(&mut self, dev: &Device) -> Result<()> {
        let bits = vec![nan_bits(self.dtype); self.len()];
        dev.stream.memcpy_htod(&bits, &mut self.buf)?;
        Ok(())
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.buf.len()
    }
    /// Always false: empty tensors cannot be made.
    pub fn is_empty(&self) -> bool {
        self.buf.len() == 0
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Downloads the raw bit patterns (synchronizes the stream).
    pub fn to_bits(&self, dev: &Device) -> Result<Vec<u16>> {
        Ok(dev.stream.clone_dtoh(&self.buf)?)
    }
    /// Downloads as f64 (exact; synchronizes the stream).
    pub fn to_f64(&self, dev: &Device) -> Result<Vec<f64>> {
        Ok(decode(self.dtype, &self.to_bits(dev)?))
    }
    /// Downloads as f32 (exact; synchronizes the stream).
    pub fn to_f32(&self, dev: &Device) -> Result<Vec<f32>> {
        Ok(self.to_f64(dev)?.into_iter().map(|x| x as f32).collect())
    }
    /// Overwrites the first `bits.len()` elements with bit patterns of this dtype.
    pub fn write_bits(&mut self, dev: &Device, bits: &[u16]) -> Result<()> {
        if bits.len() > self.len() {
            return Err(invalid!(
                "write of {} elements into a tensor of {}",
                bits.len(),
                self.len()
            ));
        }
        dev.stream
            .memcpy_htod(bits, &mut self.buf.slice_mut(..bits.len()))?;
        Ok(())
    }
    pub(crate) fn ptr(&self, dev: &Device) -> u64 {
        // Event tracking is off (Device::new), so the guard records nothing.
        let (p, _guard) = self.buf.device_ptr(&dev.stream);
        p
    }
    pub(crate) fn ptr_mut(&mut self, dev: &Device) -> u64 {
        let (p, _guard) = self.buf.device_ptr_mut(&dev.stream);
        p
    }
    pub(crate) fn same_context(&self, dev: &Device) -> bool {
        self.buf.context() == dev.ctx()
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
