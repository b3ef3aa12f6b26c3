//! The whole Rust/C++ boundary of sdpa: the argument blocks, defined once in [`args`] (cxx
//! shared structs, whose generated C++ declarations the core includes), the kernel list
//! ([`Kernel`], generated from cpp/kernels.txt), and the functions of [`ffi`].
//!
//! Everything here is raw: pointers are `u64` device addresses, streams are `CUstream` values
//! as `usize`. The safe layer (`sdpa` crate) validates every argument before calling in; a C++
//! exception (a failed CUDA call, an unsupported case) arrives as `Err(cxx::Exception)`.

// cxx re-emits the extern functions without their doc comments; the `# Safety` contracts are
// written on the declarations below. The quantization calls mirror their C signatures (raw
// pointers and sizes), hence more than seven arguments.
#[allow(
    clippy::missing_safety_doc,
    clippy::too_many_arguments,
    clippy::upper_case_acronyms
)]
#[cxx::bridge(namespace = "sdpa_bridge")]
pub mod ffi {
    /// Resource use of one kernel on the current device.
    #[derive(Debug, Clone)]
    pub struct KernelAttr {
        pub backend: String,
        pub name: String,
        pub registers: i32,
        pub static_smem: i32,
        /// Dynamic shared memory the launch requests, bytes.
        pub dynamic_smem: i32,
        pub local_bytes: i32,
        pub max_threads: i32,
    }

    // The argument blocks (src/args.rs) and the kernel list (cpp/kernels.txt), each defined
    // once and shared by value.
    #[namespace = "sdpa"]
    unsafe extern "C++" {
        include!("sdpa/sdpa.h");
        type Dtype = crate::args::Dtype;
        type Kernel = crate::Kernel;
        type FwdArgs = crate::args::FwdArgs;
        type BwdArgs = crate::args::BwdArgs;
        type KernelPlan = crate::args::KernelPlan;
        type DeviceInfo = crate::args::DeviceInfo;
        type SoftmaxArgs = crate::args::SoftmaxArgs;
        type NonFiniteVArgs = crate::args::NonFiniteVArgs;
        type KvWriteArgs = crate::args::KvWriteArgs;
        type MergeArgs = crate::args::MergeArgs;
        type MergeFinishArgs = crate::args::MergeFinishArgs;
        type ScaleMap = crate::args::ScaleMap;
    }

    unsafe extern "C++" {
        include!("sdpa-sys/src/bridge.h");

        /// Why `kernel` cannot run `args` on the device `dev` describes, or "" where it can:
        /// the kernel's own limits and device requirements (cpp/include/sdpa/sdpa.h). Pointers
        /// in `args` may be 0 (not checked then); device requirements are skipped for an
        /// unknown (all zero) `dev`. Calls nothing on the GPU.
        fn can_implement(kernel: Kernel, args: &FwdArgs, dev: &DeviceInfo) -> Result<String>;
        /// What `kernel` runs for the problem of `args` on the device `dev` describes, decided
        /// once (sdpa.h): the instantiation and the scratch bytes. Pointers in `args` may be 0.
        /// An error with can_implement's reason where the kernel cannot. Calls nothing on the
        /// GPU.
        fn plan(kernel: Kernel, args: &FwdArgs, dev: &DeviceInfo) -> Result<KernelPlan>;
        /// # Safety
        /// `plan` must come from `plan` for the problem of `args`; `args` must describe live
        /// device buffers of the sizes its shape and strides address, its workspace at least
        /// `plan.workspace_bytes`, on the device current on this thread, which `dev` describes,
        /// and `stream` must be a valid stream there.
        unsafe fn forward(
            plan: &KernelPlan,
            args: &FwdArgs,
            dev: &DeviceInfo,
            stream: usize,
        ) -> Result<()>;
        /// Why `kernel`'s backward cannot run `args` on `dev`, or "" where it can (as
        /// `can_implement`; sdpa.h). Calls nothing on the GPU.
        fn can_implement_backward(
            kernel: Kernel,
            args: &BwdArgs,
            dev: &DeviceInfo,
        ) -> Result<String>;
        /// What `kernel`'s backward runs for the problem of `args` on `dev`, decided once: the
        /// instantiation and the workspace bytes. Calls nothing on the GPU.
        fn plan_backward(kernel: Kernel, args: &BwdArgs, dev: &DeviceInfo) -> Result<KernelPlan>;
        /// # Safety
        /// `plan` must come from `plan_backward` for the problem of `args`; `args` must
        /// describe live device buffers of the sizes its shapes and strides address (the
        /// gradients apart from every input and from each other), its workspace at least
        /// `plan.workspace_bytes`, on the device current on this thread, which `dev`
        /// describes; `stream` a valid stream there.
        unsafe fn backward(
            plan: &KernelPlan,
            args: &BwdArgs,
            dev: &DeviceInfo,
            stream: usize,
        ) -> Result<()>;
        /// # Safety
        /// `args.s` and `args.p` must be live device buffers of `rows * seq_k` elements (f32
        /// and the dtype) on the current context; `stream` a valid stream there.
        unsafe fn masked_softmax(args: &SoftmaxArgs, stream: usize) -> Result<()>;
        /// # Safety
        /// The buffers of `args` must be live device buffers of the sizes sdpa.h gives, on the
        /// current context, which `dev` describes; `stream` a valid stream there.
        unsafe fn kv_write(args: &KvWriteArgs, dev: &DeviceInfo, stream: usize) -> Result<()>;
        /// # Safety
        /// `args.v` must hold what its shape and strides address, `args.v_finite` and
        /// `args.first_keys` the elements their comments give; all live device buffers of the
        /// current context, `stream` a valid stream there.
        unsafe fn sanitize_v(args: &NonFiniteVArgs, stream: usize) -> Result<()>;
        /// # Safety
        /// As `sanitize_v`, after it on the same stream; `args.o` must hold what its shape and
        /// strides address.
        unsafe fn add_nonfinite_v(args: &NonFiniteVArgs, stream: usize) -> Result<()>;
        /// # Safety
        /// `x` (f32) and `y` (bytes) must be live device buffers of `n` elements on the current
        /// context; `stream` a valid stream there.
        unsafe fn e4m3_encode(x: u64, y: u64, n: i64, inv_scale: f32, stream: usize) -> Result<()>;
        /// # Safety
        /// `x` must hold `n` elements (f32 if `x_is_f32`, else of `dtype`), `amax` `groups`
        /// zeroed f32s, every group index of `map` below `groups`; all on the current context.
        unsafe fn absmax(
            x: u64,
            x_is_f32: bool,
            dtype: Dtype,
            n: i64,
            map: ScaleMap,
            amax: u64,
            groups: i64,
            stream: usize,
        ) -> Result<()>;
        /// # Safety
        /// As `absmax`; `y` holds `n` bytes, `scale` one f32 per group.
        unsafe fn e4m3_quantize(
            x: u64,
            x_is_f32: bool,
            dtype: Dtype,
            y: u64,
            n: i64,
            map: ScaleMap,
            scale: u64,
            stream: usize,
        ) -> Result<()>;
        /// # Safety
        /// `x` holds `n` bytes, `y` `n` elements of `out_dtype`, `scale` one f32 per group.
        unsafe fn e4m3_dequantize(
            x: u64,
            y: u64,
            out_dtype: Dtype,
            n: i64,
            map: ScaleMap,
            scale: u64,
            stream: usize,
        ) -> Result<()>;
        /// # Safety
        /// `acc_o` (f32, `rows * head_dim`) and `acc_lse` (f32, `rows`) must be live device
        /// buffers of the current context; `stream` a valid stream there.
        unsafe fn merge_init(
            acc_o: u64,
            acc_lse: u64,
            rows: i64,
            head_dim: i64,
            stream: usize,
        ) -> Result<()>;
        /// # Safety
        /// The buffers of `args` must be live device buffers holding what its shape and strides
        /// address (sdpa/merge.h), on the current context; `stream` a valid stream there.
        unsafe fn merge_partial(args: &MergeArgs, stream: usize) -> Result<()>;
        /// # Safety
        /// As `merge_partial`, for the buffers of `args`.
        unsafe fn merge_finish(args: &MergeFinishArgs, stream: usize) -> Result<()>;
        /// # Safety
        /// `stream` must be a valid stream of the current context.
        unsafe fn empty_kernel(blocks: i32, stream: usize) -> Result<()>;
        /// The kernels `forward` launches on the current device, which `dev` describes.
        fn kernel_attributes(dev: &DeviceInfo) -> Result<Vec<KernelAttr>>;
        /// Whether the CUTLASS kernels were compiled in.
        fn built_with_cutlass() -> bool;
        /// How many device i32 `FwdScratch::tile_counter` points at, zero between calls: the
        /// cutlass-sm90 masked kernels hand out their work tiles with the first two, and the
        /// decode kernel's row blocks (up to this many a launch) count their finished splits, so
        /// that the last merges them (the core's `kTileCounters`, sdpa/counters.h).
        fn tile_counters() -> usize;
    }
}

pub mod args;

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

// SAFETY: `Kernel` is `#[repr(i32)]` with the enumerators and values of `sdpa::Kernel`
// (`enum class Kernel : int32_t`), both generated from cpp/kernels.txt by build.rs.
unsafe impl cxx::ExternType for Kernel {
    type Id = cxx::type_id!("sdpa::Kernel");
    type Kind = cxx::kind::Trivial;
}

/// The ptxas resource report of every kernel, captured when `cpp/` was compiled
/// (`-Xptxas=-v`, demangled). Parsed by `sdpa_harness::info`.
pub const PTXAS_REPORT: &str = include_str!(concat!(env!("OUT_DIR"), "/ptxas.txt"));

/// One fused-kernel instantiation of the core (a line of cpp/kernels.txt).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Instance {
    /// Backend as `sdpa` names it: scalar, wmma, cutlass, cutlass-sm80.
    pub backend: &'static str,
    /// Element type of Q, K, V: f16, bf16, e4m3.
    pub dtype: &'static str,
    /// Head dimension.
    pub head_dim: usize,
    /// Whether the backend's backward is instantiated for it too.
    pub backward: bool,
}

/// Every instantiation the core was generated with: the lines of cpp/kernels.txt that the
/// crate's features choose (all by default; the CUTLASS ones exist only when
/// `ffi::built_with_cutlass()`).
pub const INSTANCES: &[Instance] = include!(concat!(env!("OUT_DIR"), "/instances.rs"));

/// CUDA architectures the core was compiled for, as CMake names them (e.g. "80;90a-real").
pub const CUDA_ARCHS: &str = env!("SDPA_CUDA_ARCHS");

/// Whether this build holds sm_90a code (machine code or PTX): without it the sm_90a kernels'
/// host side is built but their bodies are empty.
pub fn built_with_sm90a() -> bool {
    archs_include_sm90a(CUDA_ARCHS)
}

/// Whether a CMake CUDA architecture list ("80;90a-real") names sm_90a in any form: "90a",
/// "90a-real" (machine code only) or "90a-virtual" (PTX only).
fn archs_include_sm90a(archs: &str) -> bool {
    archs.split(';').any(|a| {
        let a = a.trim();
        let base = a
            .strip_suffix("-real")
            .or_else(|| a.strip_suffix("-virtual"))
            .unwrap_or(a);
        base == "90a"
    })
}

#[cfg(test)]
mod arch_tests {
    use super::archs_include_sm90a;

    #[test]
    fn sm90a_counts_in_every_form_cmake_writes() {
        for archs in ["90a", "80;90a-real", "80;90a-virtual", "80; 90a"] {
            assert!(archs_include_sm90a(archs), "{archs}");
        }
        for archs in ["80", "80;90", "90-real", "80;100a", "", "90ab"] {
            assert!(!archs_include_sm90a(archs), "{archs}");
        }
    }

    /// Each head dim of cpp/kernels.txt has its feature, and the default features enable it:
    /// a line added there is built by default and can be chosen.
    #[test]
    fn every_head_dim_has_a_default_feature() {
        let manifest = include_str!("../Cargo.toml");
        let default = manifest
            .lines()
            .find(|l| l.starts_with("default = ["))
            .expect("Cargo.toml has default features");
        for line in include_str!("../cpp/kernels.txt").lines() {
            let Some(d) = line
                .split_whitespace()
                .nth(2)
                .filter(|_| !line.starts_with('#'))
            else {
                continue;
            };
            let feature = format!("hdim{d}");
            assert!(
                manifest
                    .lines()
                    .any(|l| l.starts_with(&format!("{feature} = "))),
                "Cargo.toml lacks the feature {feature}"
            );
            assert!(
                default.contains(&format!("\"{feature}\"")),
                "{feature} is not a default"
            );
        }
    }

    #[test]
    fn the_default_build_holds_sm90a_code() {
        // The default features' architectures (build.rs) must keep the Hopper kernel: a list
        // without it builds a library whose cutlass backend refuses every problem.
        let default = env!("SDPA_DEFAULT_CUDA_ARCHS");
        assert!(archs_include_sm90a(default), "{default}");
    }
}

#[cfg(test)]
mod counter_tests {
    #[test]
    fn the_counters_rust_allocates_are_the_cores_count() {
        // One count (sdpa/counters.h) sizes the allocation and bounds the kernels' use: the
        // masked kernels' tile feed takes the first two.
        assert!(super::ffi::tile_counters() >= 2);
    }
}
