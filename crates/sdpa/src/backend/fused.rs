//! The fused kernels of the C++ core (cpp/src/scalar, cpp/src/wmma): one launch computes the
//! whole attention with an online softmax. They share one argument block and one dispatch.

use crate::device::{Device, Tensor};
use crate::error::{Error, Result};
use crate::problem::{DType, Problem};
use cudarc::driver::DevicePtrMut;
use sdpa_sys::ffi::Kernel;

/// Head dims with an instantiation in each fused backend's folder.
pub(crate) const HEAD_DIMS: [usize; 2] = [64, 128];

/// What a fused kernel accepts beyond `Problem::validate`.
pub(crate) fn supports(p: &Problem) -> std::result::Result<(), String> {
    if !HEAD_DIMS.contains(&p.head_dim) {
        return Err(format!(
            "head_dim {} is not instantiated (supported: 64, 128)",
            p.head_dim
        ));
    }
    // Grid: x = query-row tiles (2^31 - 1 max), y = heads, z = batch (65535 max each).
    if p.heads > 65535 || p.batch > 65535 {
        return Err(format!(
            "batch ({}) and heads ({}) must each be at most 65535",
            p.batch, p.heads
        ));
    }
    Ok(())
}

pub(crate) fn forward(
    kernel: Kernel,
    dev: &Device,
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &mut Tensor,
) -> Result<()> {
    let mut args = crate::ffi_args(dev, p, q, k, v, out);
    // Scratch the kernel asks for (e4m3 inputs: the native kernel's V copy, the simulated
    // path's 16-bit Q, K, V; each written by a pre-pass of the same call before any read): the device's buffer, grown when too small. The lock is held until the
    // launch is enqueued, so a concurrent grow cannot free it under us; stream order does the
    // rest.
    let bytes = sdpa_sys::ffi::workspace_bytes(kernel, &args)? as usize;
    // Only kernels that asked for scratch take the lock (the 16-bit ones never do).
    let mut guard = None;
    if bytes > 0 {
        let scratch = guard.insert(
            dev.scratch()
                .lock()
                .map_err(|_| Error::Cuda("scratch buffer poisoned by a panic".into()))?,
        );
        if scratch.as_ref().is_none_or(|w| w.len() < bytes) {
            **scratch = None; // free the old one before asking for the larger
            // SAFETY: the kernel's pre-pass writes every byte it later reads.
            **scratch = Some(unsafe { dev.stream().alloc::<u8>(bytes)? });
        }
        args.workspace = scratch.as_mut().unwrap().device_ptr_mut(dev.stream()).0;
    }
    let stream = dev.raw_stream()?;
    // SAFETY: `forward` validated shapes, dtypes, lengths and context of every buffer against
    // `p`; the strides in `args` address only elements inside them; the workspace holds the
    // bytes the kernel asked for.
    unsafe { sdpa_sys::ffi::forward(kernel, &args, stream)? };
    drop(guard);
    Ok(())
}

pub(crate) fn dtype_code(d: DType) -> i32 {
    match d {
        DType::F16 => 0,
        DType::Bf16 => 1,
        DType::E4m3 => 2,
    }
}
