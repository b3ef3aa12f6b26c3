//! Device handles: a GPU, one stream on it, and what is kept per stream (scratch, cuBLAS).

use crate::backend::cublas::state::BlasState;
use crate::error::MemoryKind;
use crate::error::{Error, Result};
use crate::memory::{bytes_of, host_vec, out_of_memory};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, sys};
use sdpa_sys::args::DeviceInfo;
use std::sync::{Arc, Mutex};

/// A GPU and one stream on it. Everything issued through one `Device` runs in order on its
/// stream; [`Device::fork`] gives another stream on the same GPU for concurrent work.
///
/// Streams and tensors: a [`crate::Tensor`] belongs to the stream of the handle that made it (its
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
    /// Scratch the fused kernels ask for (e4m3 inputs: the native kernel's f16 copy of V, the
    /// simulated path's 16-bit Q, K, V), grown on demand and reused: work on one stream runs in
    /// order, so one buffer per stream suffices.
    scratch: Arc<Mutex<Option<CudaSlice<u8>>>>,
    /// `sdpa_sys::ffi::tile_counters()` i32, zero between calls (`FwdArgs::tile_counter`), with
    /// which the cutlass-sm90 masked kernels hand out their work tiles and the decode kernel's
    /// last split finds itself; made on first use outside a stream capture (`reserve` makes
    /// them ahead of one). One set per stream: calls on a stream run in order.
    tile_counter: Arc<Mutex<Option<CudaSlice<i32>>>>,
    /// What the fused kernels are told about the GPU, read once when it is opened.
    info: DeviceInfo,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.ctx.ordinal())
            .field("stream", &self.stream.cu_stream())
            .finish_non_exhaustive()
    }
}

/// Whether the CUDA driver library can be loaded at all. Without it cudarc would panic on
/// first use, so every entry point checks this first.
pub fn driver_present() -> bool {
    loadable(&["libcuda.so.1", "libcuda.so"])
}

/// Whether one of `names` can be opened: checked here rather than through cudarc, whose check
/// exists only when it loads the CUDA libraries at run time (a build that also holds candle
/// links them instead).
pub(crate) fn loadable(names: &[&str]) -> bool {
    names.iter().any(|name| {
        // SAFETY: a CUDA library's initialisers only register it; nothing of it is called here.
        unsafe { libloading::Library::new(*name) }.is_ok()
    })
}

/// The attributes of `ctx`'s GPU the fused kernels are given.
fn device_info(ctx: &CudaContext) -> Result<DeviceInfo> {
    use sys::CUdevice_attribute::*;
    Ok(DeviceInfo {
        cc_major: ctx.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        cc_minor: ctx.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        sms: ctx.attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        smem_optin_per_block: ctx
            .attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
        smem_per_sm: ctx.attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?,
    })
}

impl Device {
    /// Opens GPU `ordinal` (its primary context) and creates a stream on it. The handle's
    /// context has cudarc's event tracking off: see [`Device::stream`] for what that asks of
    /// slices you make through it.
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
        // cudarc's per-slice event tracking would record events into those captures, and cost
        // host time on every call. Ordering across streams is kept by `StreamOrder` instead,
        // only where a buffer crosses streams.
        // SAFETY: cudarc's three obligations for untracked slices, for every slice this crate
        // makes on this context: (1) none is freed before a use on another stream ends, and
        // (2) none is used on another stream before its allocation there ends: every call
        // through a handle makes its stream wait for the streams of the buffers it takes and
        // theirs wait for it (`StreamOrder`), and a `Tensor` is freed on the stream that made
        // it; (3) no two streams write one buffer at once: a call writes only its output, which
        // it orders after that buffer's stream as in (2). Slices the caller makes through
        // `Device::stream()` carry the same obligations, stated there. No other stream of this
        // context exists yet.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let info = device_info(&ctx)?;
        Ok(Device {
            ctx,
            stream,
            blas: Arc::default(),
            scratch: Arc::default(),
            tile_counter: Arc::default(),
            info,
        })
    }

    /// A handle on the caller's `stream` (and the context it belongs to): every call through
    /// it is queued on that stream, in order with the caller's own work there, without host
    /// synchronisation, so a `forward` can be captured into the caller's CUDA graph.
    ///
    /// The context's cudarc event tracking is left as the caller set it. With it on (cudarc's
    /// default), cudarc records an event at each use of a buffer made through this handle;
    /// [`Device::new`] turns it off for its own context instead.
    pub fn from_stream(stream: Arc<CudaStream>) -> Result<Device> {
        if !driver_present() {
            return Err(Error::NoDevice(
                "the CUDA driver library (libcuda.so) is not installed on this machine".into(),
            ));
        }
        let info = device_info(stream.context())?;
        Ok(Device {
            ctx: stream.context().clone(),
            stream,
            blas: Arc::default(),
            scratch: Arc::default(),
            tile_counter: Arc::default(),
            info,
        })
    }

    /// A handle to the same GPU with a new stream of its own.
    pub fn fork(&self) -> Result<Device> {
        Ok(Device {
            ctx: self.ctx.clone(),
            stream: self.ctx.new_stream()?,
            blas: Arc::default(),
            scratch: Arc::default(),
            tile_counter: Arc::default(),
            info: self.info,
        })
    }

    /// The device's marketing name.
    pub fn name(&self) -> Result<String> {
        Ok(self.ctx.name()?)
    }
    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> Result<(u32, u32)> {
        Ok((self.info.cc_major as u32, self.info.cc_minor as u32))
    }
    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> Result<u32> {
        Ok(self.info.sms as u32)
    }
    /// What the C++ core's fused kernels are told about this GPU (read once, when it was
    /// opened): its compute capability, multiprocessors and shared memory.
    pub fn info(&self) -> DeviceInfo {
        self.info
    }
    /// Waits for everything issued on this handle's stream.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }
    /// The cudarc stream, for callers who mix in their own cudarc work.
    ///
    /// On a handle made by [`Device::new`] (and its forks) the context has cudarc's event
    /// tracking off (`CudaContext::disable_event_tracking`): slices you allocate through this
    /// stream record no events, so cudarc does not order them across streams for you. Passing
    /// them to this crate's calls is safe on any handle of the same GPU (each call orders
    /// itself after the streams of the buffers it takes, and those streams after it). Using
    /// them in your own work on another stream is your ordering to keep, as cudarc's
    /// `disable_event_tracking` states: no free before another stream's use ends, no use on
    /// another stream before the allocation ends, no two streams writing at once (record a
    /// `CudaEvent` and `wait` for it, or `join` the streams). To keep cudarc's tracking for your
    /// own slices, make the context and stream yourself and use [`Device::from_stream`].
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
    /// The device address of this stream's tile counter, made (zeroed) on first use; 0 while
    /// the stream captures a graph and there is none yet (the masked kernels then run one work
    /// tile a CTA).
    pub(crate) fn tile_counter(&self) -> Result<u64> {
        let mut counter = self
            .tile_counter
            .lock()
            .map_err(|_| Error::Cuda("tile counter poisoned by a panic".into()))?;
        if counter.is_none() {
            use cudarc::driver::sys::CUstreamCaptureStatus as Capture;
            if self.stream.capture_status()? != Capture::CU_STREAM_CAPTURE_STATUS_NONE {
                return Ok(0);
            }
            let count = sdpa_sys::ffi::tile_counters();
            *counter = Some(self.stream.alloc_zeros::<i32>(count)?);
        }
        let slice = counter.as_ref().expect("made above");
        Ok(slice.device_ptr(&self.stream).0)
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
    /// Makes this stream wait for the work queued on `streams` (those of the tensors a call
    /// uses) other than itself; [`StreamOrder::finish`] makes them wait for this stream in
    /// turn. Streams equal to this one add nothing.
    pub(crate) fn order_after<'a>(
        &self,
        streams: impl IntoIterator<Item = &'a Arc<CudaStream>>,
    ) -> Result<StreamOrder> {
        let mut foreign: Vec<Arc<CudaStream>> = Vec::new();
        for s in streams {
            if **s != *self.stream && !foreign.iter().any(|f| **f == **s) {
                foreign.push(s.clone());
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
/// (by [`Device::order_after`]) after those streams' queued work, and `finish`ed after the
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

#[cfg(test)]
mod tests {
    /// Every public type crosses threads (the crate documentation promises it): a `Device` per
    /// thread or a shared one, tensors and problems moved between threads, errors sent back.
    /// This fails to compile if one ever stops being `Send + Sync`.
    #[test]
    fn public_types_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<super::Device>();
        check::<crate::Plan>();
        check::<crate::Tensor>();
        check::<crate::Error>();
        check::<crate::CudaError>();
        check::<crate::MemoryKind>();
        check::<crate::Problem>();
        check::<crate::Backend>();
        check::<crate::DType>();
        check::<crate::Layout>();
        check::<crate::Mask>();
        check::<crate::Scaling>();
        check::<crate::Fp8Mode>();
        check::<crate::Strides>();
        check::<crate::TensorShape>();
        check::<crate::backend::Instance>();
        check::<crate::backend::auto::Row>();
        check::<crate::backend::auto::SizeClass>();
    }
}
