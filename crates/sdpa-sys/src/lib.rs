//! The whole Rust/C++ boundary of sdpa: one `#[cxx::bridge]` module.
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
    /// The core's element types: `sdpa::Dtype` of cpp/include/sdpa/sdpa.h, bound by cxx (which
    /// checks at build time that the C++ enum has these names and values).
    #[namespace = "sdpa"]
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    #[repr(i32)]
    enum Dtype {
        F16 = 0,
        BF16 = 1,
        E4M3 = 2,
        /// An output type only: partial results merged before they are rounded.
        F32 = 3,
    }

    /// Which keys each query row sees: `sdpa::Mask`, bound like `Dtype`.
    #[namespace = "sdpa"]
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    #[repr(i32)]
    enum Mask {
        NoMask = 0,
        CausalBottomRight = 1,
        CausalTopLeft = 2,
        Window = 3,
    }

    /// The fused kernels of the core, one per backend folder under cpp/src/: `sdpa::Kernel`,
    /// bound like `Dtype`.
    #[namespace = "sdpa"]
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    #[repr(i32)]
    enum Kernel {
        Scalar = 0,
        Wmma = 1,
        Cutlass = 2,
        CutlassSm80 = 3,
    }

    /// Mirrors `sdpa::FwdArgs` (cpp/include/sdpa/sdpa.h). Strides in elements: [batch, head, seq].
    #[derive(Debug, Clone)]
    pub struct FwdArgs {
        pub q: u64,
        pub k: u64,
        pub v: u64,
        pub o: u64,
        pub batch: i64,
        pub heads: i64,
        pub kv_heads: i64,
        pub seq_q: i64,
        pub seq_k: i64,
        pub head_dim: i64,
        pub q_stride: [i64; 3],
        pub k_stride: [i64; 3],
        pub v_stride: [i64; 3],
        pub o_stride: [i64; 3],
        pub scale: f32,
        pub mask: Mask,
        /// Window only: keys left and right of the diagonal (negative: unbounded).
        pub window_left: i64,
        pub window_right: i64,
        /// > 0: the logit cap; 0: none.
        pub softcap: f32,
        /// ALiBi: device f32 slopes (0 in a question asked before the buffers exist), slope
        /// of (b, h) at `b * alibi_batch_stride + h`.
        pub alibi: bool,
        pub alibi_slopes: u64,
        pub alibi_batch_stride: i64,
        /// The log-sum-exp out: device f32 [batch][heads][seq_q] (0 as for the slopes).
        pub has_lse: bool,
        pub lse: u64,
        /// Of q, k, v
        pub dtype: Dtype,
        /// Of o: F16 or BF16
        pub out_dtype: Dtype,
        /// e4m3 only (0 otherwise): device f32 dequantization scales, one per tensor or one
        /// per (batch, head) pair when `per_head_scales`.
        pub q_scale: u64,
        pub k_scale: u64,
        pub v_scale: u64,
        pub per_head_scales: bool,
        /// e4m3 only: fast mode, P·V on e4m3 tensor cores where the kernel has it.
        pub fp8_fast: bool,
        /// Scratch of `workspace_bytes(kernel, args)` bytes (0 when none is needed).
        pub workspace: u64,
        /// Two device i32, zero between calls (0: none), with which the cutlass-sm90 masked
        /// kernels hand out their work tiles to a persistent grid.
        pub tile_counter: u64,
        /// Sequences of different lengths (0 / false for dense ones; sdpa.h says how): rows
        /// of packed Q, whether K/V are packed, the rows of packed K/V or of a paged cache, a
        /// paged cache's page size and block-table columns, whether seqused_k caps each
        /// sequence's keys, and the device i32 metadata.
        pub total_q: i64,
        pub packed_kv: bool,
        pub kv_rows: i64,
        pub page_size: i64,
        pub pages_per_seq: i64,
        pub has_seqused_k: bool,
        pub cu_seqlens_q: u64,
        pub cu_seqlens_k: u64,
        pub seqused_k: u64,
        pub block_table: u64,
    }

    /// Mirrors `sdpa::DeviceInfo`: what the fused kernels need to know about their GPU, read
    /// once per device. All zero: an unknown device (`can_implement` then checks the problem
    /// alone; `forward` refuses it).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub struct DeviceInfo {
        pub cc_major: i32,
        pub cc_minor: i32,
        /// Multiprocessors.
        pub sms: i32,
        /// Bytes of shared memory a block may opt in to.
        pub smem_optin_per_block: i32,
        /// Bytes of shared memory per multiprocessor.
        pub smem_per_sm: i32,
    }

    /// Mirrors `sdpa::ScaleMap`: element i is in scale group
    /// `(i / per_batch) * heads + (i / inner) % heads`.
    #[derive(Debug, Clone, Copy)]
    pub struct ScaleMap {
        pub heads: i64,
        pub inner: i64,
        pub per_batch: i64,
    }

    /// Mirrors `sdpa::SoftmaxArgs`: S (f32) -> P (dtype), rows = batch * heads * seq_q.
    #[derive(Debug, Clone)]
    pub struct SoftmaxArgs {
        pub s: u64,
        pub p: u64,
        pub rows: i64,
        pub seq_q: i64,
        pub seq_k: i64,
        pub mask: Mask,
        /// F16 or BF16
        pub dtype: Dtype,
    }

    /// Mirrors `sdpa::KvAppendArgs`: new K/V rows appended into a paged cache (device addresses;
    /// sdpa.h says how).
    #[derive(Debug, Clone)]
    pub struct KvAppendArgs {
        pub k_new: u64,
        pub v_new: u64,
        pub k_cache: u64,
        pub v_cache: u64,
        pub block_table: u64,
        pub seqused_k: u64,
        pub batch: i64,
        pub n_new: i64,
        pub kv_heads: i64,
        pub head_dim: i64,
        pub page_size: i64,
        pub pages_per_seq: i64,
        /// Pages of the cache.
        pub pages: i64,
        /// F16 or BF16
        pub dtype: Dtype,
    }

    /// Mirrors `sdpa::NonFiniteVArgs`: the cuBLAS backend's finite copy of V for causal
    /// problems and its records (the non-finite V check). Strides in elements: [batch, head, seq].
    #[derive(Debug, Clone)]
    pub struct NonFiniteVArgs {
        pub v: u64,
        pub v_stride: [i64; 3],
        /// Dense [batch][kv_heads][seq_k][head_dim], of the dtype
        pub v_finite: u64,
        /// u32 [batch * kv_heads][1 + 3 * head_dim]
        pub first_keys: u64,
        pub o: u64,
        pub o_stride: [i64; 3],
        pub batch: i64,
        pub heads: i64,
        pub kv_heads: i64,
        pub seq_q: i64,
        pub seq_k: i64,
        pub head_dim: i64,
        /// Of v and o: F16 or BF16
        pub dtype: Dtype,
    }

    /// Mirrors `sdpa::MergeArgs` (sdpa/merge.h): one partial attention result (16-bit O at its
    /// strides, f32 log-sum-exp) folded into a running f32 one through their log-sum-exps.
    #[derive(Debug, Clone)]
    pub struct MergeArgs {
        /// f32 [batch][heads][acc_seq][head_dim], dense
        pub acc_o: u64,
        /// f32 [batch][heads][acc_seq]
        pub acc_lse: u64,
        pub part_o: u64,
        /// f32 [batch][heads][rows], dense
        pub part_lse: u64,
        /// Of part_o, in elements: [batch, head, seq]
        pub part_stride: [i64; 3],
        pub batch: i64,
        pub heads: i64,
        pub rows: i64,
        pub head_dim: i64,
        pub acc_seq: i64,
        /// The part's rows are the accumulator's positions [row0, row0 + rows)
        pub row0: i64,
        /// Of part_o: F16 or BF16
        pub dtype: Dtype,
    }

    /// Mirrors `sdpa::MergeFinishArgs`: the running f32 result rounded into the output.
    #[derive(Debug, Clone)]
    pub struct MergeFinishArgs {
        /// f32 [batch][heads][seq][head_dim], dense
        pub acc_o: u64,
        pub out: u64,
        /// Of out, in elements: [batch, head, seq]
        pub out_stride: [i64; 3],
        pub batch: i64,
        pub heads: i64,
        pub seq: i64,
        pub head_dim: i64,
        /// Of out: F16 or BF16
        pub dtype: Dtype,
    }

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

    #[namespace = "sdpa"]
    unsafe extern "C++" {
        include!("sdpa/sdpa.h");
        type Dtype;
        type Kernel;
        type Mask;
    }

    unsafe extern "C++" {
        include!("sdpa-sys/src/bridge.h");

        /// Why `kernel` cannot run `args` on the device `dev` describes, or "" where it can:
        /// the kernel's own limits and device requirements (cpp/include/sdpa/sdpa.h). Pointers
        /// in `args` may be 0 (not checked then); device requirements are skipped for an
        /// unknown (all zero) `dev`. Calls nothing on the GPU.
        fn can_implement(kernel: Kernel, args: &FwdArgs, dev: &DeviceInfo) -> Result<String>;
        /// # Safety
        /// `args` must describe live device buffers of the sizes its shape and strides address,
        /// on the device current on this thread, which `dev` describes, and `stream` must be a
        /// valid stream there.
        unsafe fn forward(
            kernel: Kernel,
            args: &FwdArgs,
            dev: &DeviceInfo,
            stream: usize,
        ) -> Result<()>;
        /// Scratch bytes `forward(kernel, args)` on the device `dev` describes needs in
        /// `args.workspace`.
        fn workspace_bytes(kernel: Kernel, args: &FwdArgs, dev: &DeviceInfo) -> Result<i64>;
        /// # Safety
        /// `args.s` and `args.p` must be live device buffers of `rows * seq_k` elements (f32
        /// and the dtype) on the current context; `stream` a valid stream there.
        unsafe fn masked_softmax(args: &SoftmaxArgs, stream: usize) -> Result<()>;
        /// # Safety
        /// The buffers of `args` must be live device buffers of the sizes sdpa.h gives, on the
        /// current context; `stream` a valid stream there.
        unsafe fn kv_append(args: &KvAppendArgs, stream: usize) -> Result<()>;
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
    }
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
}

/// Every instantiation the core was generated with (cpp/kernels.txt; the CUTLASS ones exist
/// only when `ffi::built_with_cutlass()`).
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

    #[test]
    fn the_default_build_holds_sm90a_code() {
        // The default list (build.rs) must keep the Hopper kernel: a list without it builds a
        // library whose cutlass backend refuses every problem.
        let default = env!("SDPA_DEFAULT_CUDA_ARCHS");
        assert!(archs_include_sm90a(default), "{default}");
    }
}
