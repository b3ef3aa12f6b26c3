//! The GPU side of the op: candle's buffers as sdpa views, on candle's stream.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{Layout, Result, Shape};
use cudarc::driver::{CudaStream, ValidAsZeroBits};
use sdpa::{Backend, Problem, View, ViewMut, Views};
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
/// contiguous buffer of Q's shape, all on candle's stream.
pub(crate) fn forward<T: sdpa::Element + CudaDType + ValidAsZeroBits>(
    p: &Problem,
    (q, q_l): (&CudaStorage, &Layout),
    (k, k_l): (&CudaStorage, &Layout),
    (v, v_l): (&CudaStorage, &Layout),
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
    sdpa::forward_views(&dev, p, Backend::Auto, views).map_err(candle_core::Error::wrap)?;
    Ok((CudaStorage::wrap_cuda_slice(out, cdev), shape))
}

/// The strides of a `(batch, seq, heads, head_dim)` layout as sdpa names them.
fn strides(l: &Layout) -> sdpa::Strides {
    let s = l.stride();
    sdpa::Strides {
        batch: s[0],
        seq: s[1],
        head: s[2],
    }
}
