//! The scalar CUDA backend (cpp/src/scalar): the seeds' baseline, on CUDA cores only.

use crate::device::{Device, Tensor};
use crate::error::Result;
use crate::problem::{DType, Problem};

/// Head dims with an instantiation in cpp/src/scalar/.
pub(crate) const HEAD_DIMS: [usize; 2] = [64, 128];

pub(crate) fn supports(p: &Problem) -> std::result::Result<(), String> {
    if !HEAD_DIMS.contains(&p.head_dim) {
        return Err(format!(
            "head_dim {} is not instantiated (supported: 64, 128)",
            p.head_dim
        ));
    }
    // Grid: x = ceil(seq_q / 32) (2^31 - 1 max), y = heads, z = batch (65535 max each).
    if p.heads > 65535 || p.batch > 65535 {
        return Err(format!(
            "batch ({}) and heads ({}) must each be at most 65535",
            p.batch, p.heads
        ));
    }
    Ok(())
}

pub(crate) fn forward(
    dev: &Device,
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &mut Tensor,
) -> Result<()> {
    let args = crate::ffi_args(dev, p, q, k, v, out);
    let stream = dev.raw_stream()?;
    // SAFETY: `forward` validated shapes, dtypes, lengths and context of every buffer against
    // `p`; the strides in `args` address only elements inside them.
    unsafe { sdpa_sys::ffi::scalar_forward(&args, stream)? };
    Ok(())
}

pub(crate) fn dtype_code(d: DType) -> i32 {
    match d {
        DType::F16 => 0,
        DType::Bf16 => 1,
    }
}
