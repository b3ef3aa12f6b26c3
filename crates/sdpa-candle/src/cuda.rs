//! The GPU side of the op: candle's buffers as sdpa views, on candle's stream.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{Layout, Result, Shape, Storage, bail};
use cudarc::driver::{CudaStream, CudaView, DeviceRepr, ValidAsZeroBits};
use sdpa::{Backend, Extras, Problem, View, ViewMut, Views};
use std::sync::{Arc, Mutex};

/// One sdpa handle per candle stream, made on first use: it keeps the cuBLAS state and scratch
/// of that stream, and reads the GPU's attributes once.
static HANDLES: Mutex<Vec<(Arc<CudaStream>, sdpa::Device)>> = Mutex::new(Vec::new());

fn handle(stream: &Arc<CudaStream>) -> Result<sdpa::Device> {
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

/// `p` on candle's buffers: Q, K and V read in place at their strides, the output a new
/// contiguous buffer of Q's shape, all on candle's stream; `extras` holds what `p` takes beyond
/// them (the sequence offsets of a packed batch).
pub(crate) fn forward<T: sdpa::Element + CudaDType + ValidAsZeroBits>(
    p: &Problem,
    (q, q_l): (&CudaStorage, &Layout),
    (k, k_l): (&CudaStorage, &Layout),
    (v, v_l): (&CudaStorage, &Layout),
    extras: Extras<'_>,
) -> Result<(CudaStorage, Shape)> {
    let cdev = q.device().clone();
    let stream = cdev.cuda_stream();
    let dev = handle(&stream)?;
    let shape = q_l.shape().clone();
    let out_l = Layout::contiguous(&shape);
    let mut out = cdev.alloc_zeros::<T>(shape.elem_count())?;
    let (qs, ks, vs) = (
        q.as_cuda_slice::<T>()?,
        k.as_cuda_slice::<T>()?,
        v.as_cuda_slice::<T>()?,
    );
    let views = Views {
        q: View::new(qs.slice(q_l.start_offset()..), strides(q_l)),
        k: View::new(ks.slice(k_l.start_offset()..), strides(k_l)),
        v: View::new(vs.slice(v_l.start_offset()..), strides(v_l)),
        out: ViewMut::new(out.as_view_mut(), strides(&out_l)),
    };
    sdpa::forward(&dev, p, Backend::Auto, views, extras).map_err(candle_core::Error::wrap)?;
    Ok((CudaStorage::wrap_cuda_slice(out, cdev), shape))
}

/// A zero-filled contiguous buffer of `shape` on `like`'s device: the output of a packed batch
/// with no queries or no keys, where no kernel runs.
pub(crate) fn zeros<T: CudaDType + DeviceRepr + ValidAsZeroBits>(
    like: &CudaStorage,
    shape: &Shape,
) -> Result<(CudaStorage, Shape)> {
    let cdev = like.device().clone();
    let out = cdev.alloc_zeros::<T>(shape.elem_count())?;
    Ok((CudaStorage::wrap_cuda_slice(out, cdev), shape.clone()))
}

/// The strides of a `(batch, seq, heads, head_dim)` layout as sdpa names them; a packed
/// `(total, heads, head_dim)` one is a single batch entry of `total` rows (its batch stride,
/// never stepped, the one a leading dimension of size 1 would have).
fn strides(l: &Layout) -> sdpa::Strides {
    match (l.dims(), l.stride()) {
        (&[_, _, _, _], &[b, s, h, _]) => sdpa::Strides {
            batch: b,
            seq: s,
            head: h,
        },
        (&[total, _, _], &[s, h, _]) => sdpa::Strides {
            batch: total * s,
            seq: s,
            head: h,
        },
        _ => unreachable!("the op checked the rank of {:?}", l.shape()),
    }
}

/// A u32 offsets tensor (`seqlens_q` or `seqlens_k`, contiguous) as the i32 device view sdpa
/// reads, without a copy: the same bytes, read as i32. Offsets below 2^31 read as themselves; the
/// host cannot see the device values without a copy, so larger ones are not caught here (they read
/// as negative; `FlashAttnVarLen::checked` catches them).
pub(crate) fn offsets_as_i32<'a>(
    name: &str,
    storage: &'a Storage,
    l: &Layout,
) -> Result<CudaView<'a, i32>> {
    let Storage::Cuda(c) = storage else {
        bail!("sdpa-candle: {name} must be on the GPU with q, k and v");
    };
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("sdpa-candle: {name} must be contiguous");
    };
    let offsets = c.as_cuda_slice::<u32>()?.slice(start..end);
    // SAFETY: u32 and i32 have one size and alignment, and every bit pattern is a valid i32.
    match unsafe { offsets.transmute::<i32>(end - start) } {
        Some(view) => Ok(view),
        None => bail!("sdpa-candle: {name} could not be viewed as i32"),
    }
}
