//! The fused kernels of the C++ core (cpp/src/scalar, cpp/src/wmma, cpp/src/cutlass): one launch
//! computes the whole attention with an online softmax. They share one argument block and one
//! dispatch; `instances` lists which exist (cpp/kernels.txt), and `supports` states the 32-bit
//! limits of each.

use super::Backend;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::ffi;
use crate::problem::{Checked, DType, Problem, Scaling};
use crate::tensor::Tensor;
use cudarc::driver::DevicePtrMut;
use sdpa_sys::INSTANCES;
use sdpa_sys::ffi::Kernel;
use std::fmt;

/// One fused-kernel instantiation of this build: a line of cpp/kernels.txt. A fused backend
/// runs a problem natively only where it has an instance of the problem's dtype and head dim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Instance {
    /// The fused backend the kernel belongs to.
    pub backend: Backend,
    /// The element type of Q, K and V it takes.
    pub dtype: DType,
    /// Its head dimension.
    pub head_dim: usize,
}

impl fmt::Display for Instance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} d{}", self.backend, self.dtype, self.head_dim)
    }
}

/// Every fused-kernel instantiation of this build, in the order of cpp/kernels.txt: what a
/// test or tool enumerates so that a line added there is covered without a second list. The
/// CUTLASS ones run only in a build with CUTLASS headers ([`Backend::supports`] says so).
///
/// # Panics
///
/// If cpp/kernels.txt names a backend without a fused kernel or a dtype [`DType`] does not
/// know: the build is inconsistent (this crate's unit tests fail on it too).
pub fn instances() -> impl Iterator<Item = Instance> {
    INSTANCES.iter().map(|i| {
        let backend = i
            .backend
            .parse::<Backend>()
            .ok()
            .filter(|b| b.fused_kernel().is_some())
            .unwrap_or_else(|| panic!("cpp/kernels.txt: {:?} is not a fused backend", i.backend));
        let dtype = i
            .dtype
            .parse::<DType>()
            .unwrap_or_else(|e| panic!("cpp/kernels.txt: {:?} is not a dtype: {e}", i.dtype));
        Instance {
            backend,
            dtype,
            head_dim: i.head_dim,
        }
    })
}

/// Largest value of a C `int`, in which the kernels below hold some counts and indices.
const INT_MAX: usize = i32::MAX as usize;
/// Largest grid y and z dimension of a launch.
const GRID_YZ_MAX: usize = 65535;

/// wmma: `load_kv` computes the offset of key tile t as `t * 2 * kBN * stride`, the first two
/// products in `int` (cpp/src/wmma/wmma_fwd.cuh). For the last tile, t = ceil(seq_k / 64) - 1,
/// t · 128 must fit: seq_k <= 2^30.
const WMMA_MAX_SEQ_K: usize = 1 << 30;

/// cutlass-sm80 and cutlass-sm90 hold seq_q and seq_k as `int` and compute row and key
/// indices up to one 128-row tile past them (tile start + tile size, last row + the causal
/// offset) in `int`: each must be at most 2^31 - 1 - 127.
const CUTLASS_MAX_SEQ: usize = INT_MAX - 127;

/// cutlass-sm90: work tiles (128 query rows of one (batch, head); 64 only where there are no
/// more than SMs) are numbered in `int`, and a causal grid has one CTA per tile whose tile loop
/// steps t += gridDim.x: 2 · tiles - 1 must stay an `int`.
const SM90_MAX_TILES: usize = 1 << 30;

/// TMA descriptors take byte strides below 2^40 (and multiples of 16 bytes: every stride is a
/// multiple of a row, head_dim elements of at least one byte).
const TMA_MAX_BYTES: usize = 1 << 40;
const _: () = {
    let mut i = 0;
    while i < INSTANCES.len() {
        assert!(
            INSTANCES[i].head_dim.is_multiple_of(16),
            "TMA strides must be multiples of 16 bytes"
        );
        i += 1;
    }
};
/// What fused kernel `kernel` (of backend `name`) accepts beyond `Problem::validate`: its
/// instantiations (cpp/kernels.txt) and the 32-bit limits of its launch and index arithmetic
/// (independent of the device). Each reason names the value and the limit.
pub(crate) fn supports(name: &str, kernel: Kernel, p: &Problem) -> std::result::Result<(), String> {
    let dtype = p.dtype.name();
    if !INSTANCES
        .iter()
        .any(|i| i.backend == name && i.dtype == dtype && i.head_dim == p.head_dim)
    {
        let dims: Vec<String> = INSTANCES
            .iter()
            .filter(|i| i.backend == name && i.dtype == dtype)
            .map(|i| i.head_dim.to_string())
            .collect();
        return Err(format!(
            "head_dim {} is not instantiated for {dtype} (instantiated: {}; cpp/kernels.txt)",
            p.head_dim,
            if dims.is_empty() {
                "none".to_string()
            } else {
                dims.join(", ")
            }
        ));
    }
    if kernel == Kernel::Cutlass {
        return sm90_limits(p);
    }
    // Scalar, wmma, cutlass-sm80: grid x = query-row tiles, y = heads, z = batch, each CTA
    // indexing its (batch, head) from blockIdx.
    if p.heads > GRID_YZ_MAX || p.batch > GRID_YZ_MAX {
        return Err(format!(
            "batch ({}) and heads ({}) must each be at most 65535 (grid z and y)",
            p.batch, p.heads
        ));
    }
    // Smallest CTA tile: 32 query rows (scalar), 64 (wmma, cutlass-sm80).
    let rows = if kernel == Kernel::Scalar { 32 } else { 64 };
    let tiles = p.seq_q.div_ceil(rows);
    if tiles > INT_MAX {
        return Err(format!(
            "seq_q = {} makes {tiles} query tiles of {rows} rows; grid x allows 2^31 - 1",
            p.seq_q
        ));
    }
    if kernel == Kernel::Wmma && p.seq_k > WMMA_MAX_SEQ_K {
        return Err(format!(
            "seq_k = {} exceeds 2^30: the wmma kernel computes key-tile offsets in 32-bit int",
            p.seq_k
        ));
    }
    if kernel == Kernel::CutlassSm80 {
        cutlass_seq_limits("cutlass-sm80", p)?;
    }
    Ok(())
}

fn cutlass_seq_limits(name: &str, p: &Problem) -> std::result::Result<(), String> {
    for (what, n) in [("seq_q", p.seq_q), ("seq_k", p.seq_k)] {
        if n > CUTLASS_MAX_SEQ {
            return Err(format!(
                "{what} = {n} exceeds 2^31 - 128: the {name} kernel indexes rows and keys, up \
                 to a tile past the end, in 32-bit int"
            ));
        }
    }
    Ok(())
}

/// The sm_90a kernel (cpp/src/cutlass/sm90): one grid dimension (work tiles), `int` sizes and
/// indices, TMA descriptors for Q, K and V.
fn sm90_limits(p: &Problem) -> std::result::Result<(), String> {
    cutlass_seq_limits("cutlass-sm90", p)?;
    // The causal producer forms row + seq_k before subtracting seq_q.
    if p.is_causal() && p.seq_q + p.seq_k > INT_MAX {
        return Err(format!(
            "causal seq_q + seq_k = {} exceeds 2^31 - 1: the cutlass-sm90 kernel computes the \
             diagonal in 32-bit int",
            p.seq_q + p.seq_k
        ));
    }
    // No overflow: validate caps batch x heads x seq_q at 2^40 / head_dim.
    let tiles = p.seq_q.div_ceil(128) * p.batch * p.heads;
    if tiles > SM90_MAX_TILES {
        return Err(format!(
            "ceil(seq_q / 128) x batch x heads = {tiles} work tiles exceed 2^30: the \
             cutlass-sm90 kernel numbers them in 32-bit int"
        ));
    }
    // Each stride is below its tensor's size (the batch stride is the largest). E4m3 at
    // head_dim 128 reads V through a 16-bit copy (the kernel's pre-pass).
    let v_size = if p.dtype == DType::E4m3 && p.head_dim == 128 {
        2
    } else {
        p.dtype.size()
    };
    for (what, bytes) in [
        ("Q", p.q_len().unwrap() * p.dtype.size()),
        ("K", p.kv_len().unwrap() * p.dtype.size()),
        ("V", p.kv_len().unwrap() * v_size),
    ] {
        if bytes >= TMA_MAX_BYTES {
            return Err(format!(
                "{what} is {bytes} bytes; TMA descriptor strides must stay below 2^40 bytes"
            ));
        }
    }
    Ok(())
}

pub(crate) fn forward(
    kernel: Kernel,
    dev: &Device,
    p: &Checked,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &mut Tensor,
) -> Result<()> {
    let mut args = fwd_args(dev, p, q, k, v, out);
    // Scratch the kernel asks for (e4m3 inputs: the native kernel's V copy, the simulated
    // path's 16-bit Q, K, V; each written by a pre-pass of the same call before any read): the
    // device's buffer, grown when too small. The lock is held until the launch is enqueued, so a
    // concurrent grow cannot free it under us; stream order does the rest.
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
            **scratch = Some(unsafe { dev.alloc::<u8>(bytes)? });
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

/// The argument block the C++ core takes; built only from checked arguments.
fn fwd_args(
    dev: &Device,
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &mut Tensor,
) -> sdpa_sys::ffi::FwdArgs {
    let (qs, ks) = (p.q_strides().as_i64(), p.kv_strides().as_i64());
    let fp8 = p.dtype == DType::E4m3;
    sdpa_sys::ffi::FwdArgs {
        q: q.ptr(dev),
        k: k.ptr(dev),
        v: v.ptr(dev),
        o: out.ptr_mut(dev),
        batch: p.batch as i64,
        heads: p.heads as i64,
        kv_heads: p.kv_heads as i64,
        seq_q: p.seq_q as i64,
        seq_k: p.seq_k as i64,
        head_dim: p.head_dim as i64,
        q_stride: qs,
        k_stride: ks,
        v_stride: ks,
        o_stride: qs,
        scale: p.scale(),
        mask: ffi::mask(p.mask),
        dtype: ffi::dtype(p.dtype),
        out_dtype: ffi::dtype(p.output_dtype()),
        q_scale: q.scales_ptr(dev),
        k_scale: k.scales_ptr(dev),
        v_scale: v.scales_ptr(dev),
        per_head_scales: fp8 && p.fp8_scaling == Scaling::PerHead,
        workspace: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each line of cpp/kernels.txt names a fused backend and a dtype this crate knows, e4m3
    /// only for a backend with FP8 math (the others never reach an e4m3 kernel: they run e4m3
    /// problems on the simulated path), each line once, and `supports` accepts each.
    #[test]
    fn kernel_list_is_consistent_with_the_backends() {
        let all: Vec<Instance> = instances().collect();
        assert_eq!(all.len(), INSTANCES.len());
        assert!(!all.is_empty(), "cpp/kernels.txt lists no kernel");
        for (n, k) in all.iter().enumerate() {
            assert!(!all[..n].contains(k), "{k} is listed twice");
            assert!(
                k.dtype != DType::E4m3 || k.backend.native_fp8(),
                "{k}: {} has no FP8 math (Backend::native_fp8)",
                k.backend
            );
            let p = Problem::new(1, 1, 8, 8, k.head_dim).with_dtype(k.dtype);
            let kernel = k.backend.fused_kernel().unwrap();
            assert_eq!(supports(k.backend.name(), kernel, &p), Ok(()), "{k}");
        }
    }
}
