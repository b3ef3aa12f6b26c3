//! The fused kernels of the C++ core (sdpa-sys/cpp/src/scalar, sdpa-sys/cpp/src/wmma,
//! sdpa-sys/cpp/src/cutlass): one launch computes the whole attention with an online softmax. They
//! share one argument block and one dispatch; `instances` lists which exist
//! (sdpa-sys/cpp/kernels.txt). What a kernel takes beyond its instantiation (its device, its shared
//! memory, its 32-bit and grid limits, TMA addressing) it states itself, next to its tile constants
//! (`can_implement` in its header under sdpa-sys/cpp/src/), and `can_implement` here asks it
//! through the bridge.

use super::Backend;
use crate::buffers::Buffers;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::ffi;
use crate::problem::{Alibi, Checked, DType, KvRows, Problem, Scaling};
use cudarc::driver::{CudaSlice, DevicePtrMut};
use sdpa_sys::INSTANCES;
use sdpa_sys::Kernel;
use sdpa_sys::args::{
    BwdArgs, DeviceInfo, FwdArgs, FwdDims, FwdFp8, FwdOperands, FwdOutput, FwdScoreMods,
    FwdScratch, FwdSeqs, KernelPlan,
};
use std::fmt;
use std::sync::MutexGuard;

/// One fused-kernel instantiation of this build: a line of sdpa-sys/cpp/kernels.txt. A fused
/// backend runs a problem natively only where it has an instance of the problem's dtype and head
/// dim.
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

/// Every fused-kernel instantiation of this build, in the order of sdpa-sys/cpp/kernels.txt: what a
/// test or tool enumerates so that a line added there is covered without a second list. The
/// CUTLASS ones run only in a build with CUTLASS headers ([`Backend::supports`] says so).
///
/// # Panics
///
/// If sdpa-sys/cpp/kernels.txt names a backend without a fused kernel or a dtype [`DType`] does not
/// know: the build is inconsistent (this crate's unit tests fail on it too).
pub fn instances() -> impl Iterator<Item = Instance> {
    INSTANCES.iter().map(|i| {
        let backend = i
            .backend
            .parse::<Backend>()
            .ok()
            .filter(|b| b.fused_kernel().is_some())
            .unwrap_or_else(|| {
                panic!(
                    "sdpa-sys/cpp/kernels.txt: {:?} is not a fused backend",
                    i.backend
                )
            });
        let dtype = i.dtype.parse::<DType>().unwrap_or_else(|e| {
            panic!(
                "sdpa-sys/cpp/kernels.txt: {:?} is not a dtype: {e}",
                i.dtype
            )
        });
        Instance {
            backend,
            dtype,
            head_dim: i.head_dim,
        }
    })
}

/// Whether sdpa-sys/cpp/kernels.txt has an instance of backend `name` for `p`'s dtype as wide as
/// its head dims; the reason names the head dims it has. Which instance runs a problem (the one
/// of its head dim, or for the kernels that read fewer columns than they compute, the narrowest
/// as wide as both) is the core's choice, which `can_implement` asks.
pub(crate) fn instantiated(name: &str, p: &Problem) -> std::result::Result<(), String> {
    let dtype = p.dtype.name();
    let width = p.head_dim.max(p.v_dim());
    if INSTANCES
        .iter()
        .any(|i| i.backend == name && i.dtype == dtype && i.head_dim >= width)
    {
        return Ok(());
    }
    // sdpa-sys/cpp/kernels.txt gives every fused backend an instance: one without any was left out
    // of the build of sdpa-sys (its SDPA_BACKENDS).
    if !INSTANCES.iter().any(|i| i.backend == name) {
        return Err(format!(
            "{name} is not in this build (sdpa-sys was built with SDPA_BACKENDS naming others)"
        ));
    }
    let dims: Vec<String> = INSTANCES
        .iter()
        .filter(|i| i.backend == name && i.dtype == dtype)
        .map(|i| i.head_dim.to_string())
        .collect();
    Err(format!(
        "head_dim {} is not instantiated for {dtype} (instantiated: {}; sdpa-sys/cpp/kernels.txt)",
        p.head_dim,
        if dims.is_empty() {
            "none".to_string()
        } else {
            dims.join(", ")
        }
    ))
}

/// What fused kernel `kernel` says of running `p` on `dev`: its own limits, and with a device
/// its device requirements (`None`: an unknown device, whose requirements it skips). Each
/// reason names the value and the limit. Asks the C++ core, which launches nothing.
pub(crate) fn can_implement(
    kernel: Kernel,
    dev: Option<&Device>,
    p: &Problem,
) -> std::result::Result<(), String> {
    can_implement_on(kernel, &dev.map(Device::info).unwrap_or_default(), p)
}

/// `can_implement` on the device `info` describes (all zero: unknown).
fn can_implement_on(
    kernel: Kernel,
    info: &DeviceInfo,
    p: &Problem,
) -> std::result::Result<(), String> {
    let why =
        sdpa_sys::ffi::can_implement(kernel, &problem_args(p), info).map_err(|e| e.to_string())?;
    if why.is_empty() { Ok(()) } else { Err(why) }
}

/// What `kernel` runs for `p` on `dev`, decided once by the core (the instantiation, the
/// scratch bytes): every run of the problem reads it.
pub(crate) fn plan(kernel: Kernel, dev: &Device, p: &Problem) -> Result<KernelPlan> {
    Ok(sdpa_sys::ffi::plan(kernel, &problem_args(p), &dev.info())?)
}

/// Runs the planned kernel on the problem `plan` was made for and `b`'s buffers.
pub(crate) fn forward(plan: &KernelPlan, dev: &Device, p: &Checked, b: &Buffers) -> Result<()> {
    let mut args = fwd_args(p, b);
    // Scratch the kernel asks for (e4m3 inputs: the native kernel's V copy, the simulated
    // path's 16-bit Q, K, V; each written by a pre-pass of the same call before any read): the
    // device's buffer, grown when too small (`reserve` grows it ahead of a capture). The lock is
    // held until the launch is enqueued, so a concurrent grow cannot free it under us; stream
    // order does the rest. Only kernels that asked for scratch take it (the 16-bit ones never
    // do).
    let bytes = plan.workspace_bytes as usize;
    let mut guard = None;
    if bytes > 0 {
        let scratch = guard.insert(lock_scratch(dev)?);
        grow(dev, scratch, bytes)?;
        args.scratch.workspace = scratch.as_mut().unwrap().device_ptr_mut(dev.stream()).0;
    }
    args.scratch.tile_counter = dev.tile_counter()?;
    let stream = dev.raw_stream()?;
    // SAFETY: the plan is the core's for `p`; the caller validated shapes, dtypes, lengths,
    // strides and context of every buffer against `p`; the strides in `args` address only
    // elements inside them; the workspace holds the bytes the plan asked for.
    unsafe { sdpa_sys::ffi::forward(plan, &args, &dev.info(), stream)? };
    drop(guard);
    Ok(())
}

/// Runs the planned backward (`plan_backward`'s plan) on `args`, its workspace the device's
/// scratch (grown when too small; the lock held until the launches are queued, as `forward`).
pub(crate) fn backward(plan: &KernelPlan, dev: &Device, mut args: BwdArgs) -> Result<()> {
    let mut scratch = lock_scratch(dev)?;
    grow(dev, &mut scratch, plan.workspace_bytes as usize)?;
    args.grads.workspace = scratch.as_mut().unwrap().device_ptr_mut(dev.stream()).0;
    let stream = dev.raw_stream()?;
    // SAFETY: the plan is the core's for the problem of `args`; the caller checked every
    // buffer's context, extent at its strides and alignment against it, the gradients apart
    // from every input and each other; the workspace holds the bytes the plan asked for (its
    // pre-pass writes every byte a later launch reads).
    unsafe { sdpa_sys::ffi::backward(plan, &args, &dev.info(), stream)? };
    drop(scratch);
    Ok(())
}

/// Grows the device's scratch to what `plan` asks for, so that a later run (one captured into
/// a graph, say) allocates nothing.
pub(crate) fn reserve(plan: &KernelPlan, dev: &Device) -> Result<()> {
    let bytes = plan.workspace_bytes as usize;
    if bytes > 0 {
        grow(dev, &mut *lock_scratch(dev)?, bytes)?;
    }
    dev.tile_counter()?;
    Ok(())
}

type Scratch = Option<CudaSlice<u8>>;

fn lock_scratch(dev: &Device) -> Result<MutexGuard<'_, Scratch>> {
    dev.scratch()
        .lock()
        .map_err(|_| Error::Cuda("scratch buffer poisoned by a panic".into()))
}

fn grow(dev: &Device, scratch: &mut Scratch, bytes: usize) -> Result<()> {
    if scratch.as_ref().is_none_or(|w| w.len() < bytes) {
        *scratch = None; // free the old one before asking for the larger
        // SAFETY: the kernel's pre-pass writes every byte it later reads.
        *scratch = Some(unsafe { dev.alloc::<u8>(bytes)? });
    }
    Ok(())
}

/// The argument block the C++ core takes for `p`, with no buffers (every pointer 0).
pub(crate) fn problem_args(p: &Problem) -> FwdArgs {
    let [qs, ks, vs, os] = p.operand_strides().map(|s| s.as_i64());
    let fp8 = p.dtype == DType::E4m3 || p.is_fp8_kv();
    let (page_size, page_rows, pages_per_seq) = match p.seqs.kv {
        KvRows::Paged {
            page_size,
            pages_per_seq,
            ..
        } => (
            page_size,
            p.seqs.page_layout.page_rows(page_size, p.kv_heads),
            pages_per_seq,
        ),
        _ => (0, 0, 0),
    };
    // The rows of packed or paged K/V the kernels address (k_shape's).
    let kv_rows = match p.seqs.kv {
        KvRows::Dense => 0,
        _ => p.k_shape().seq,
    };
    FwdArgs {
        ops: FwdOperands {
            q: 0,
            k: 0,
            v: 0,
            o: 0,
            q_stride: qs.into(),
            k_stride: ks.into(),
            v_stride: vs.into(),
            o_stride: os.into(),
            dtype: ffi::dtype(p.dtype),
            kv_dtype: ffi::dtype(p.kv_dtype()),
        },
        dims: FwdDims {
            batch: p.batch as i64,
            heads: p.heads as i64,
            kv_heads: p.kv_heads as i64,
            seq_q: p.seq_q as i64,
            seq_k: p.seq_k as i64,
            head_dim: p.head_dim as i64,
            head_dim_v: p.v_dim() as i64,
        },
        mask: ffi::mask(p.mask),
        mods: FwdScoreMods {
            scale: p.scale(),
            softcap: p.softcap.unwrap_or(0.0),
            alibi: p.alibi.is_some(),
            alibi_slopes: 0,
            alibi_batch_stride: match p.alibi {
                Some(Alibi::PerBatchHead) => p.heads as i64,
                _ => 0,
            },
            sinks: p.sinks,
            sink_logits: 0,
        },
        seqs: FwdSeqs {
            total_q: p.seqs.packed_q.unwrap_or(0) as i64,
            packed_kv: matches!(p.seqs.kv, KvRows::Packed { .. }),
            kv_rows: kv_rows as i64,
            page_size: page_size as i64,
            page_rows: page_rows as i64,
            pages_per_seq: pages_per_seq as i64,
            has_seqused_k: p.seqs.seqused_k,
            ..FwdSeqs::default()
        },
        fp8: FwdFp8 {
            per_head_scales: fp8 && p.fp8_scaling == Scaling::PerHead,
            // A permission: kernels without an e4m3 P·V (and the simulated path) ignore it.
            fast: p.is_fp8_fast(),
            ..FwdFp8::default()
        },
        out: FwdOutput {
            dtype: ffi::dtype(p.output_dtype()),
            has_lse: p.lse,
            lse: 0,
        },
        scratch: FwdScratch::default(),
    }
}

/// The argument block of a launch; built only from checked arguments.
pub(crate) fn fwd_args(p: &Problem, b: &Buffers) -> FwdArgs {
    let [mut qs, mut ks, mut vs, mut os] = b.strides.map(|s| s.as_i64());
    // Packed and paged tensors are one sequence dimension: the kernels add no batch offset.
    if p.seqs.packed_q.is_some() {
        qs[0] = 0;
        os[0] = 0;
    }
    if p.seqs.kv != KvRows::Dense {
        ks[0] = 0;
        vs[0] = 0;
    }
    let [cu_seqlens_q, cu_seqlens_k, seqused_k, block_table] = b.seqs;
    let [q_scale, k_scale, v_scale] = b.scales;
    let mut args = problem_args(p);
    args.ops = FwdOperands {
        q: b.q,
        k: b.k,
        v: b.v,
        o: b.o,
        q_stride: qs.into(),
        k_stride: ks.into(),
        v_stride: vs.into(),
        o_stride: os.into(),
        ..args.ops
    };
    args.mods.alibi_slopes = b.alibi_slopes;
    args.mods.sink_logits = b.sinks;
    args.seqs = FwdSeqs {
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_k,
        block_table,
        ..args.seqs
    };
    args.fp8 = FwdFp8 {
        q_scale,
        k_scale,
        v_scale,
        ..args.fp8
    };
    args.out.lse = b.lse;
    args
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Fp8Mode, Mask};
    use sdpa_sys::args::Dtype;

    /// Parts as the kernels are told about them (their cudaDeviceGetAttribute values).
    const T4: DeviceInfo = DeviceInfo {
        cc_major: 7,
        cc_minor: 5,
        sms: 40,
        smem_optin_per_block: 64 << 10,
        smem_per_sm: 64 << 10,
    };
    const A100: DeviceInfo = DeviceInfo {
        cc_major: 8,
        cc_minor: 0,
        sms: 108,
        smem_optin_per_block: 163 << 10,
        smem_per_sm: 164 << 10,
    };
    /// sm_86 (A10, RTX 30xx): 99 KB a block, 100 KB an SM.
    const SM86: DeviceInfo = DeviceInfo {
        cc_major: 8,
        cc_minor: 6,
        sms: 82,
        smem_optin_per_block: 99 << 10,
        smem_per_sm: 100 << 10,
    };
    const H100: DeviceInfo = DeviceInfo {
        cc_major: 9,
        cc_minor: 0,
        sms: 132,
        smem_optin_per_block: 227 << 10,
        smem_per_sm: 228 << 10,
    };

    fn kernel(b: Backend) -> Kernel {
        b.fused_kernel().unwrap()
    }

    /// The fused backends whose kernels this build holds (the CUTLASS ones need its headers).
    fn built(b: Backend) -> bool {
        !matches!(b, Backend::Cutlass | Backend::CutlassSm80) || sdpa_sys::ffi::built_with_cutlass()
    }

    fn refuses(b: Backend, info: &DeviceInfo, p: &Problem, fragment: &str) {
        match can_implement_on(kernel(b), info, p) {
            Err(why) => assert!(
                why.contains(fragment),
                "{b} {p}: {why:?} lacks {fragment:?}"
            ),
            Ok(()) => panic!("{b} {p} on {info:?}: accepted, expected {fragment:?}"),
        }
    }

    /// A problem of instance `i`'s head dim and dtype, 2 sequences of seq_q queries against seq_k
    /// keys, 8 heads; cutlass's 576 runs MLA's absorbed decode only: one token of 128 query heads
    /// on one latent head whose first 512 columns are V.
    fn own_problem(i: &Instance, seq_q: usize, seq_k: usize) -> Problem {
        if i.backend == Backend::Cutlass && i.head_dim == 576 {
            return Problem::new(2, 128, 1, seq_k, 576)
                .with_kv_heads(1)
                .with_head_dim_v(512)
                .with_v_in_k(true)
                .with_dtype(i.dtype);
        }
        Problem::new(2, 8, seq_q, seq_k, i.head_dim).with_dtype(i.dtype)
    }

    /// The parts each kernel ships on take every instance of it, causal or not, at a size with
    /// several tiles; the unknown device (no GPU) too.
    #[test]
    fn each_kernel_takes_the_parts_it_ships_on() {
        for i in instances().filter(|i| built(i.backend)) {
            let parts: &[DeviceInfo] = match i.backend {
                Backend::Cutlass => &[H100, DeviceInfo::default()],
                // Head dims 192 and 256 take 120 and 160 KB: an A100's or a Hopper's SM.
                // Scalar at 576 takes 152 KB: not an sm_86's 100.
                Backend::Scalar if i.head_dim > 256 => {
                    let p = own_problem(&i, 1000, 1100);
                    refuses(i.backend, &SM86, &p, "bytes of shared memory per block");
                    &[A100, H100, DeviceInfo::default()]
                }
                Backend::CutlassSm80 if i.head_dim > 128 => {
                    let p = Problem::new(2, 8, 1000, 1100, i.head_dim).with_dtype(i.dtype);
                    refuses(i.backend, &SM86, &p, "bytes of shared memory per block");
                    &[A100, H100, DeviceInfo::default()]
                }
                _ => &[A100, SM86, H100, DeviceInfo::default()],
            };
            for info in parts {
                for causal in [false, true] {
                    let p = own_problem(&i, 1000, 1100).with_causal(causal);
                    assert_eq!(
                        can_implement_on(kernel(i.backend), info, &p),
                        Ok(()),
                        "{i} {p} on {info:?}"
                    );
                }
            }
        }
    }

    /// Head dims of no instance and V of another head dim run on the narrowest instance as wide
    /// as both where the kernel reads only a problem's own columns (scalar, cutlass-sm80,
    /// cutlass); wmma takes its instances' head dims alone, cutlass's e4m3 and f32-output kernels
    /// too, and every kernel wants whole 16-byte rows.
    #[test]
    fn narrowed_head_dims_are_taken_or_refused_by_name() {
        let has = |b: Backend| sdpa_sys::INSTANCES.iter().any(|i| i.backend == b.name());
        let p = |d: usize, dv: usize| Problem::new(2, 8, 300, 300, d).with_head_dim_v(dv);
        for b in [Backend::Scalar, Backend::CutlassSm80, Backend::Cutlass] {
            if !built(b) || !has(b) {
                continue;
            }
            for (d, dv) in [(80, 80), (112, 112), (32, 32), (192, 128), (64, 128)] {
                assert_eq!(can_implement_on(kernel(b), &H100, &p(d, dv)), Ok(()), "{b}");
            }
            refuses(b, &H100, &p(84, 84), "multiples of 8");
            refuses(b, &H100, &p(128, 600), "is not instantiated");
        }
        // Past 256: scalar's 576 takes any pair, cutlass's runs MLA decode only.
        if built(Backend::Scalar) && has(Backend::Scalar) {
            assert_eq!(
                can_implement_on(kernel(Backend::Scalar), &H100, &p(320, 264)),
                Ok(())
            );
        }
        if built(Backend::Cutlass) && has(Backend::Cutlass) {
            refuses(
                Backend::Cutlass,
                &H100,
                &p(320, 264),
                "MLA's absorbed decode only",
            );
        }
        if built(Backend::Wmma) && has(Backend::Wmma) {
            refuses(Backend::Wmma, &H100, &p(80, 80), "is not instantiated");
            refuses(Backend::Wmma, &H100, &p(128, 64), "is not instantiated");
        }
        if built(Backend::Cutlass) && has(Backend::Cutlass) {
            let f32_out = p(80, 80).with_out_dtype(DType::F32);
            refuses(
                Backend::Cutlass,
                &H100,
                &f32_out,
                "head dims of its instances",
            );
        }
    }

    /// Sinks run where the kernel folds them in (scalar, cutlass-sm80 and its decode kernel,
    /// cutlass), prefill and decode alike; wmma refuses them by name.
    #[test]
    fn sinks_are_taken_or_refused_by_name() {
        let prefill = Problem::new(2, 8, 1000, 1100, 64)
            .with_causal(true)
            .with_sinks(true);
        let decode = Problem::new(4, 64, 1, 8192, 64)
            .with_kv_heads(8)
            .with_sinks(true);
        let has = |b: Backend| sdpa_sys::INSTANCES.iter().any(|i| i.backend == b.name());
        for b in [Backend::Scalar, Backend::CutlassSm80, Backend::Cutlass] {
            if !built(b) || !has(b) {
                continue;
            }
            for p in [prefill, decode] {
                assert_eq!(can_implement_on(kernel(b), &H100, &p), Ok(()), "{b} {p}");
            }
        }
        if has(Backend::Wmma) {
            refuses(Backend::Wmma, &H100, &prefill, "wmma has no sinks");
        }
    }

    #[test]
    fn an_sm80_device_refuses_the_sm90_kernel() {
        if !built(Backend::Cutlass) {
            return;
        }
        let p = Problem::new(1, 1, 8, 8, 64);
        for (info, cc) in [(A100, "8.0"), (SM86, "8.6")] {
            refuses(
                Backend::Cutlass,
                &info,
                &p,
                &format!(
                    "the sm_90a kernel runs on compute capability 9.0 (H100/H200), the GPU has {cc}"
                ),
            );
        }
    }

    #[test]
    fn a_device_older_than_sm80_refuses_every_fused_kernel() {
        let p = Problem::new(1, 1, 8, 8, 64);
        for b in [Backend::Scalar, Backend::Wmma, Backend::CutlassSm80] {
            if built(b) {
                refuses(
                    b,
                    &T4,
                    &p,
                    "needs compute capability 8.0 or newer, the GPU has 7.5",
                );
            }
        }
        // Unknown: the device is not checked.
        assert_eq!(
            can_implement_on(Kernel::Scalar, &DeviceInfo::default(), &p),
            Ok(())
        );
    }

    /// A kernel asks for the shared memory of the configuration it launches; more than 48 KB
    /// only where the device lets a block opt in to it.
    #[test]
    fn too_little_opt_in_shared_memory_is_refused() {
        let small = DeviceInfo {
            smem_optin_per_block: 48 << 10,
            smem_per_sm: 64 << 10,
            ..A100
        };
        let fragment = "bytes of shared memory per block, the device offers 49152";
        let d128 = Problem::new(1, 1, 8, 8, 128);
        refuses(Backend::Wmma, &small, &d128, fragment);
        if built(Backend::CutlassSm80) {
            // 96 KB at D = 128. At D = 64 48 KB need no opt-in, but the causal kernel adds the
            // non-finite V check's records.
            refuses(Backend::CutlassSm80, &small, &d128, fragment);
            let d64 = Problem::new(1, 1, 8, 8, 64).with_mask(Mask::None);
            assert_eq!(can_implement_on(Kernel::CutlassSm80, &small, &d64), Ok(()));
            let causal = d64.with_mask(Mask::CausalBottomRight);
            refuses(Backend::CutlassSm80, &small, &causal, fragment);
        }
        // The static 48 KB or less of the scalar kernel fits anywhere.
        assert_eq!(can_implement_on(Kernel::Scalar, &small, &d128), Ok(()));
        if built(Backend::Cutlass) {
            let h100 = DeviceInfo {
                smem_optin_per_block: 48 << 10,
                ..H100
            };
            refuses(Backend::Cutlass, &h100, &d128, fragment);
        }
    }

    /// Limits of the problem come before the device's: both wrong, the limit is named.
    #[test]
    fn limits_come_before_the_device() {
        let p = Problem::new(70000, 1, 4, 4, 64);
        refuses(Backend::Scalar, &T4, &p, "batch (70000)");
    }

    /// e4m3 on a kernel without FP8 math: the core asks the 16-bit instance of the output type
    /// that its simulated path runs (`supports` asks with the dequantized problem instead).
    #[test]
    fn simulated_e4m3_has_the_limits_of_the_16_bit_kernel() {
        let p = Problem::new(1, 1, 1, (1 << 30) + 1, 64).with_dtype(DType::E4m3);
        refuses(Backend::Wmma, &A100, &p, "seq_k = 1073741825 exceeds 2^30");
        refuses(
            Backend::Scalar,
            &T4,
            &p,
            "needs compute capability 8.0 or newer",
        );
    }

    /// An f32 output is cutlass (sm90)'s alone, from 16-bit inputs, prefill and decode shapes
    /// alike; every other kernel, e4m3 inputs, other head dims and the general path's variants
    /// refuse it by name. The output dtype reaches the kernels from the problem.
    #[test]
    fn only_the_sm90_kernel_writes_f32_outputs() {
        let f32_out = |p: &Problem| problem_args(&p.with_out_dtype(DType::F32));
        assert_eq!(f32_out(&Problem::new(1, 1, 8, 8, 64)).out.dtype, Dtype::F32);
        if !built(Backend::Cutlass) {
            return;
        }
        let ask =
            |kernel, p: &Problem| sdpa_sys::ffi::can_implement(kernel, &f32_out(p), &H100).unwrap();
        let prefill = Problem::new(1, 8, 512, 512, 128)
            .with_kv_heads(2)
            .with_causal(true)
            .with_dtype(DType::Bf16)
            .with_lse(true);
        let decode = Problem::new(2, 8, 1, 4096, 64).with_dtype(DType::F16);
        for p in [&prefill, &decode, &prefill.with_causal(false)] {
            assert_eq!(ask(Kernel::Cutlass, p), "", "{p}");
            for other in [Kernel::CutlassSm80, Kernel::Scalar, Kernel::Wmma] {
                let why = ask(other, p);
                assert!(
                    why.contains("only cutlass (sm90) writes"),
                    "{other:?}: {why}"
                );
            }
        }
        let fp8 = ask(Kernel::Cutlass, &prefill.with_dtype(DType::E4m3));
        assert!(fp8.contains("out_dtype must be f16 or bf16"), "{fp8}");
        // Kernels of their own, at head dims 64 and 128, no mask or bottom-right causal.
        let d192 = ask(Kernel::Cutlass, &Problem::new(1, 8, 512, 512, 192));
        assert!(d192.contains("head_dim 64 and 128 only"), "{d192}");
        let capped = ask(Kernel::Cutlass, &prefill.with_softcap(30.0));
        assert!(capped.contains("no window, softcap"), "{capped}");
    }

    /// The pointers, where given, must suit TMA (16-byte aligned bases).
    #[test]
    fn the_sm90_kernel_checks_tma_alignment_of_given_pointers() {
        if !built(Backend::Cutlass) {
            return;
        }
        let p = Problem::new(1, 1, 8, 8, 64);
        let mut args = problem_args(&p);
        args.ops.k = 0x1000 + 8;
        let why = sdpa_sys::ffi::can_implement(Kernel::Cutlass, &args, &H100).unwrap();
        assert!(why.contains("k is not TMA-addressable"), "{why}");
    }

    /// The mode travels in the argument block that both the launch and the workspace query
    /// (`reserve`, `forward`) are built from, so scratch is sized for the mode that runs.
    #[test]
    fn the_fp8_mode_reaches_the_argument_block() {
        let p = Problem::new(1, 1, 8, 8, 64).with_dtype(DType::E4m3);
        assert!(!problem_args(&p).fp8.fast);
        let fast = p.with_fp8_mode(Fp8Mode::Fast);
        assert!(problem_args(&fast).fp8.fast);
        let b = Buffers {
            q: 0,
            k: 0,
            v: 0,
            o: 0,
            scales: [0; 3],
            strides: p.operand_strides(),
            alibi_slopes: 0,
            sinks: 0,
            lse: 0,
            seqs: [0; 4],
        };
        assert!(fwd_args(&fast, &b).fp8.fast);
        assert!(!fwd_args(&p, &b).fp8.fast);
    }

    /// A plan asks `can_implement` first and plans nothing it refuses; it needs a known device
    /// (the launches size their grids by it).
    #[test]
    fn planning_refuses_before_launching() {
        let args = problem_args(&Problem::new(1, 1, 8, 8, 64));
        let e = sdpa_sys::ffi::plan(Kernel::Scalar, &args, &T4).unwrap_err();
        assert!(
            e.what()
                .contains("scalar: needs compute capability 8.0 or newer"),
            "{e}"
        );
        let e = sdpa_sys::ffi::plan(Kernel::Wmma, &args, &DeviceInfo::default()).unwrap_err();
        assert!(
            e.what().contains("wmma: a plan needs a known device"),
            "{e}"
        );
    }

    /// A plan names the instantiation of its problem: a forward with another problem's
    /// arguments, or with a plan the core did not make, is refused before anything is used.
    #[test]
    fn forward_refuses_a_plan_of_another_problem() {
        if !built(Backend::Scalar) {
            return;
        }
        let p = Problem::new(1, 1, 8, 8, 64);
        let plan = sdpa_sys::ffi::plan(Kernel::Scalar, &problem_args(&p), &H100).unwrap();
        assert!(!plan.simulated);
        let other = problem_args(&Problem::new(1, 1, 8, 8, 128));
        // SAFETY: refused before any pointer or stream is used.
        let e = unsafe { sdpa_sys::ffi::forward(&plan, &other, &H100, 0) }.unwrap_err();
        assert!(e.what().contains("the plan is for another problem"), "{e}");
        let forged = KernelPlan {
            instance: i32::MAX,
            ..plan
        };
        // SAFETY: as above.
        let e =
            unsafe { sdpa_sys::ffi::forward(&forged, &problem_args(&p), &H100, 0) }.unwrap_err();
        assert!(e.what().contains("a plan that plan() did not make"), "{e}");
        let e4m3 = p.with_dtype(DType::E4m3);
        let sim = sdpa_sys::ffi::plan(Kernel::Scalar, &problem_args(&e4m3), &H100).unwrap();
        assert!(
            sim.simulated && sim.workspace_bytes >= 3 * 8 * 64 * 2,
            "{sim:?}"
        );
    }

    /// Each line of sdpa-sys/cpp/kernels.txt names a fused backend and a dtype this crate knows,
    /// each line once, and each kernel built takes a small problem of its own. The e4m3 lines say
    /// which backends have FP8 math: cutlass alone (the others run e4m3 problems on the simulated
    /// path).
    #[test]
    fn kernel_list_is_consistent_with_the_backends() {
        let all: Vec<Instance> = instances().collect();
        assert_eq!(all.len(), INSTANCES.len());
        let fp8: Vec<Backend> = Backend::ALL
            .into_iter()
            .filter(|b| b.native_fp8())
            .collect();
        assert_eq!(fp8, [Backend::Cutlass]);
        assert!(!all.is_empty(), "sdpa-sys/cpp/kernels.txt lists no kernel");
        for (n, k) in all.iter().enumerate() {
            assert!(!all[..n].contains(k), "{k} is listed twice");
            let p = own_problem(k, 8, 8);
            let kernel = k.backend.fused_kernel().unwrap();
            assert_eq!(instantiated(k.backend.name(), &p), Ok(()), "{k}");
            let built = !matches!(k.backend, Backend::Cutlass | Backend::CutlassSm80)
                || sdpa_sys::ffi::built_with_cutlass();
            if built {
                assert_eq!(can_implement(kernel, None, &p), Ok(()), "{k}");
            }
        }
    }
}
