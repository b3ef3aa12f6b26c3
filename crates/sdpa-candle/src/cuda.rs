//! The GPU side of the ops: candle's buffers as sdpa views, on candle's stream.

use crate::call::Call;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{DType, Layout, Result, Storage, StorageRef, Tensor, bail};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtrMut, ValidAsZeroBits};
use half::{bf16, f16};
use sdpa::{Backend, BackwardViews, DqReduction, Extras, View, ViewMut, Views};
use std::sync::{Arc, Mutex};

/// One sdpa handle per candle stream, made on first use: it keeps the cuBLAS state and scratch
/// of that stream, and reads the GPU's attributes once.
static HANDLES: Mutex<Vec<(Arc<CudaStream>, sdpa::Device)>> = Mutex::new(Vec::new());

pub(crate) fn handle(stream: &Arc<CudaStream>) -> Result<sdpa::Device> {
    let mut handles = HANDLES
        .lock()
        .map_err(|_| candle_core::Error::Msg("sdpa-candle: handle cache poisoned".into()))?;
    if let Some((_, dev)) = handles.iter().find(|(s, _)| Arc::ptr_eq(s, stream)) {
        return Ok(dev.clone());
    }
    let dev = sdpa::Device::from_stream(stream.clone()).map_err(candle_core::Error::wrap)?;
    handles.push((stream.clone(), dev.clone()));
    Ok(dev)
}

/// `call` on candle's buffers: Q, K and V read in place at their strides, the output a new
/// contiguous buffer of Q's shape (and the log-sum-exp a new f32 one when asked), all on
/// candle's stream.
pub(crate) fn run(
    call: &Call<'_>,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    with_lse: bool,
) -> Result<(CudaStorage, Option<CudaStorage>)> {
    match q.0.dtype() {
        DType::F16 => run_t::<f16>(call, q, k, v, with_lse),
        DType::BF16 => run_t::<bf16>(call, q, k, v, with_lse),
        other => bail!("sdpa-candle: {other:?} tensors are not supported (f16 or bf16)"),
    }
}

fn run_t<T: sdpa::Element + CudaDType + ValidAsZeroBits>(
    call: &Call<'_>,
    (q, q_l): (&CudaStorage, &Layout),
    (k, k_l): (&CudaStorage, &Layout),
    (v, v_l): (&CudaStorage, &Layout),
    with_lse: bool,
) -> Result<(CudaStorage, Option<CudaStorage>)> {
    let cdev = q.device().clone();
    let stream = cdev.cuda_stream();
    let mut out = cdev.alloc_zeros::<T>(call.out_shape.elem_count())?;
    let mut lse = if with_lse {
        Some(neg_inf(&stream, call.lse_shape.elem_count())?)
    } else {
        None
    };
    if let Some(p) = &call.problem {
        let dev = handle(&stream)?;
        let p = p.with_lse(with_lse);
        let lse = lse.as_mut().map(|l| l.as_view_mut());
        with_extras(call, lse, |extras| {
            let (qs, ks, vs) = (
                q.as_cuda_slice::<T>()?,
                k.as_cuda_slice::<T>()?,
                v.as_cuda_slice::<T>()?,
            );
            let [q_s, k_s, v_s] = call.strides;
            let views = Views {
                q: View::new(qs.slice(q_l.start_offset()..), q_s),
                k: View::new(ks.slice(k_l.start_offset()..), k_s),
                v: View::new(vs.slice(v_l.start_offset()..), v_s),
                out: ViewMut::new(out.as_view_mut(), call.out_strides),
            };
            sdpa::forward(&dev, &p, Backend::Auto, views, extras).map_err(candle_core::Error::wrap)
        })?;
    }
    let lse = lse.map(|l| CudaStorage::wrap_cuda_slice(l, cdev.clone()));
    Ok((CudaStorage::wrap_cuda_slice(out, cdev), lse))
}

/// The gradients of `call` on candle's contiguous buffers for `d_out` (contiguous, the output's
/// shape): dQ, dK and dV as new contiguous buffers of Q's, K's and V's shapes. The forward runs
/// again first, for the log-sum-exp the backward reads (candle's op keeps none), then sdpa's
/// backward, both on candle's stream.
pub(crate) fn backward(
    call: &Call<'_>,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    d_out: (&CudaStorage, &Layout),
) -> Result<[CudaStorage; 3]> {
    match q.0.dtype() {
        DType::F16 => backward_t::<f16>(call, q, k, v, d_out),
        DType::BF16 => backward_t::<bf16>(call, q, k, v, d_out),
        other => bail!("sdpa-candle: {other:?} tensors are not supported (f16 or bf16)"),
    }
}

fn backward_t<T: sdpa::Element + CudaDType + ValidAsZeroBits>(
    call: &Call<'_>,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    (g, g_l): (&CudaStorage, &Layout),
) -> Result<[CudaStorage; 3]> {
    let cdev = q.0.device().clone();
    let stream = cdev.cuda_stream();
    let alloc = |l: &Layout| cdev.alloc_zeros::<T>(l.shape().elem_count());
    let (mut dq, mut dk, mut dv) = (alloc(q.1)?, alloc(k.1)?, alloc(v.1)?);
    let wrap = |x| CudaStorage::wrap_cuda_slice(x, cdev.clone());
    // No query rows or no keys: no attention ran, every gradient is zero.
    let Some(p) = &call.problem else {
        return Ok([dq, dk, dv].map(wrap));
    };
    let (out, lse) = run(call, q, k, v, true)?;
    let lse = lse.expect("asked for the log-sum-exp");
    let dev = handle(&stream)?;
    with_extras(call, None, |extras| {
        let [q_s, k_s, v_s] = call.strides;
        let ops = BackwardViews {
            q: View::new(q.0.as_cuda_slice::<T>()?.slice(q.1.start_offset()..), q_s),
            k: View::new(k.0.as_cuda_slice::<T>()?.slice(k.1.start_offset()..), k_s),
            v: View::new(v.0.as_cuda_slice::<T>()?.slice(v.1.start_offset()..), v_s),
            out: View::new(out.as_cuda_slice::<T>()?.as_view(), call.out_strides),
            d_out: View::new(
                g.as_cuda_slice::<T>()?.slice(g_l.start_offset()..),
                call.out_strides,
            ),
            lse: lse.as_cuda_slice::<f32>()?.as_view(),
            dq: ViewMut::new(dq.as_view_mut(), q_s),
            dk: ViewMut::new(dk.as_view_mut(), k_s),
            dv: ViewMut::new(dv.as_view_mut(), v_s),
            dsinks: None,
        };
        sdpa::backward(&dev, p, Backend::Auto, DqReduction::Atomic, ops, extras)
            .map_err(candle_core::Error::wrap)
    })?;
    Ok([dq, dk, dv].map(wrap))
}

/// Runs `f` on the call's extras (ALiBi slopes, sinks, sequence metadata, and `lse`) as sdpa
/// reads them, their storage read-locked until `f` returns (once the call is queued).
fn with_extras<R>(
    call: &Call<'_>,
    lse: Option<cudarc::driver::CudaViewMut<'_, f32>>,
    f: impl FnOnce(Extras<'_>) -> Result<R>,
) -> Result<R> {
    let seqused = match (call.meta.paged, call.meta.cu_seqlens_k) {
        (true, Some(cu)) => Some(lengths(cu)?),
        _ => None,
    };
    let cu_q = storage(call.meta.cu_seqlens_q);
    let cu_k = storage(call.meta.cu_seqlens_k.filter(|_| !call.meta.paged));
    let used = storage(seqused.as_ref());
    let table = storage(call.meta.block_table);
    let alibi = storage(call.alibi);
    let sinks = storage(call.sinks);
    f(Extras {
        alibi_slopes: view_f32("alibi_slopes", &alibi)?,
        sinks: view_f32("sinks", &sinks)?,
        lse,
        cu_seqlens_q: view_i32("seqlens_q", &cu_q)?,
        cu_seqlens_k: view_i32("seqlens_k", &cu_k)?,
        seqused_k: view_i32("seqlens_k", &used)?,
        block_table: view_i32("block_table", &table)?,
    })
}

/// `n` f32 of -inf (the log-sum-exp of a row that sees no key, which no kernel writes), on
/// `stream`.
fn neg_inf(stream: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<f32>> {
    // SAFETY: every element is written by the memset below before the slice is read.
    let mut lse = unsafe { stream.alloc::<f32>(n) }.map_err(candle_core::Error::wrap)?;
    if n > 0 {
        let (ptr, _guard) = lse.device_ptr_mut(stream);
        // SAFETY: `ptr` addresses the n f32 of `lse`, live on this stream; the fill is queued
        // on it.
        unsafe {
            cudarc::driver::sys::cuMemsetD32Async(
                ptr,
                f32::NEG_INFINITY.to_bits(),
                n,
                stream.cu_stream(),
            )
        }
        .result()
        .map_err(candle_core::Error::wrap)?;
    }
    Ok(lse)
}

/// Each sequence's keys from its u32 offsets: `cu[b + 1] − cu[b]`, on the device (offsets that
/// decrease wrap to lengths past 2^31, which read as negative i32 and are clamped to 0 keys).
fn lengths(cu: &Tensor) -> Result<Tensor> {
    let n = cu.dim(0)?;
    cu.narrow(0, 1, n - 1)?.sub(&cu.narrow(0, 0, n - 1)?)
}

/// The read-locked storage of an optional tensor, with its layout.
fn storage(t: Option<&Tensor>) -> Option<(StorageRef<'_>, &Layout)> {
    t.map(|t| t.storage_and_layout())
}

/// The contiguous elements of a tensor's CUDA storage.
fn contiguous<'a, E: CudaDType>(
    name: &str,
    (s, l): &'a (StorageRef<'_>, &Layout),
) -> Result<CudaView<'a, E>> {
    let Storage::Cuda(c) = &**s else {
        bail!("sdpa-candle: {name} must be on the GPU with q, k and v");
    };
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("sdpa-candle: {name} must be contiguous");
    };
    Ok(c.as_cuda_slice::<E>()?.slice(start..end))
}

/// f32 ALiBi slopes as sdpa reads them.
fn view_f32<'a>(
    name: &str,
    t: &'a Option<(StorageRef<'_>, &Layout)>,
) -> Result<Option<CudaView<'a, f32>>> {
    t.as_ref().map(|t| contiguous::<f32>(name, t)).transpose()
}

/// u32 or i32 metadata as the i32 view sdpa reads, without a copy: u32 values below 2^31 read as
/// themselves; the host cannot see the device values without a copy, so larger ones are not
/// caught here (they read as negative and are clamped; checked mode catches them).
fn view_i32<'a>(
    name: &str,
    t: &'a Option<(StorageRef<'_>, &Layout)>,
) -> Result<Option<CudaView<'a, i32>>> {
    let Some(t) = t else { return Ok(None) };
    let Storage::Cuda(c) = &*t.0 else {
        bail!("sdpa-candle: {name} must be on the GPU with q, k and v");
    };
    if c.dtype() == DType::I32 {
        return contiguous::<i32>(name, t).map(Some);
    }
    let view = contiguous::<u32>(name, t)?;
    let n = view.len();
    // SAFETY: u32 and i32 have one size and alignment, and every bit pattern is a valid i32.
    match unsafe { view.transmute::<i32>(n) } {
        Some(view) => Ok(Some(view)),
        None => bail!("sdpa-candle: {name} could not be viewed as i32"),
    }
}
