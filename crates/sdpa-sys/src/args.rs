//! The argument blocks of the C++ core, defined once: cxx generates their C++ declarations
//! (`sdpa-sys/src/args.rs.h`, which the build copies to `sdpa/args.h` for the CUDA core; the
//! core's public header includes it), so Rust and C++ cannot disagree on a field.
//!
//! Every device buffer is a `u64` device address (0: none), every stride is in elements, and
//! the Rust layer (`sdpa` crate) has validated every field before a block reaches the core:
//! shapes, strides, alignment, and that the buffers hold what the strides address.

// The upper-case enumerators are the C++ core's names.
#[allow(clippy::upper_case_acronyms)]
#[cxx::bridge(namespace = "sdpa")]
mod blocks {
    /// Element types. E4M3 = FP8 (1 sign, 4 exponent, 3 mantissa bits, "fn": no infinities,
    /// max 448), only as an input type of Q, K, V, always with dequantization scales. F32 only
    /// as an output type: a partial result that is merged with others before it is rounded
    /// (ring attention's steps).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    #[repr(i32)]
    enum Dtype {
        F16 = 0,
        BF16 = 1,
        E4M3 = 2,
        F32 = 3,
    }

    /// Which keys each query row sees. CausalBottomRight: row i sees keys j <= i + seq_k -
    /// seq_q (the causal diagonal aligned to the last key, as FlashAttention for seq_q !=
    /// seq_k). CausalTopLeft: j <= i. Window: i + seq_k - seq_q - window_left <= j <= i + seq_k
    /// - seq_q + window_right (a negative side is unbounded), FlashAttention's window_size.
    /// Chunked: with d = i + seq_k - seq_q, ⌊d / chunk⌋ · chunk <= j <= d (causal within
    /// chunks of keys, Llama 4's local attention).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    #[repr(i32)]
    enum Mask {
        NoMask = 0,
        CausalBottomRight = 1,
        CausalTopLeft = 2,
        Window = 3,
        Chunked = 4,
    }

    /// Strides of a [batch][head][seq][head_dim] tensor in elements; the innermost (head_dim)
    /// stride is 1. A packed or paged tensor (one sequence dimension) has batch stride 0.
    #[derive(Debug, Clone, Copy, Default)]
    struct Strides {
        batch: i64,
        head: i64,
        seq: i64,
    }

    /// Q, K, V in and O out, of `dtype` (O: of `FwdOutput::dtype`). kv_dtype: K's and V's, the
    /// same as `dtype` but for an e4m3 K/V cache (kv_dtype E4M3, dtype F16 or BF16): K and V are
    /// then codes whose scales `FwdFp8::k_scale` and `v_scale` give, Q and O 16-bit.
    #[derive(Debug, Clone, Copy)]
    struct FwdOperands {
        q: u64,
        k: u64,
        v: u64,
        o: u64,
        q_stride: Strides,
        k_stride: Strides,
        v_stride: Strides,
        o_stride: Strides,
        dtype: Dtype,
        kv_dtype: Dtype,
    }

    /// The problem's extents. With sequences of different lengths (`FwdSeqs`) batch is the
    /// number of sequences, seq_q and seq_k the longest one's lengths.
    #[derive(Debug, Clone, Copy, Default)]
    struct FwdDims {
        batch: i64,
        heads: i64,
        kv_heads: i64,
        seq_q: i64,
        seq_k: i64,
        /// Of Q and K.
        head_dim: i64,
        /// Of V and the output.
        head_dim_v: i64,
    }

    /// The mask and, for `Mask::Window`, the keys left and right of the diagonal (negative:
    /// unbounded); for `Mask::Chunked`, the keys of a chunk (0 for the other masks).
    #[derive(Debug, Clone, Copy)]
    struct FwdMask {
        kind: Mask,
        window_left: i64,
        window_right: i64,
        chunk: i64,
    }

    /// What happens to a score before the softmax: the scale, then with softcap > 0
    /// softcap * tanh(score / softcap) (0: off), then with ALiBi -slope * |i + seq_k - seq_q -
    /// j| added to row i, key j, slope = alibi_slopes[b * alibi_batch_stride + h] (stride 0:
    /// one slope per head; device f32). With sinks every row of query head h counts one more
    /// logit, sink_logits[h] (device f32, natural log, taken raw: no scale, softcap or ALiBi),
    /// in its maximum, its denominator and its log-sum-exp, and weights no value: a row that
    /// sees no key has output 0 and log-sum-exp sink_logits[h]; -inf is no sink; a NaN (or
    /// +inf) makes the head's rows NaN.
    #[derive(Debug, Clone, Copy)]
    struct FwdScoreMods {
        scale: f32,
        softcap: f32,
        alibi: bool,
        alibi_slopes: u64,
        alibi_batch_stride: i64,
        sinks: bool,
        sink_logits: u64,
    }

    /// Sequences of different lengths (FlashAttention's varlen and paged cache); all 0 / false
    /// for dense ones. Sequence b's queries: rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of
    /// packed Q and O (total_q > 0 rows), else its batch entry's seq_q. Its keys: rows
    /// cu_seqlens_k[b] .. cu_seqlens_k[b + 1] of packed K and V (packed_kv), key j at row j %
    /// page_size of page block_table[b * pages_per_seq + j / page_size] of a paged cache
    /// (page_size > 0, a power of two), else its batch entry's seq_k; with has_seqused_k only
    /// the first seqused_k[b] of them. The log-sum-exp of packed Q is [heads][total_q]. kv_rows:
    /// the rows of packed K/V (total_k) or of a paged cache ((pages - 1) x page_rows +
    /// page_size), 0 for dense ones. page_rows: rows of K's and V's sequence dimension from one
    /// page's first row to the next's: page_size for pages stored row after row (NHD), kv_heads x
    /// page_size for pages stored head after head (HND: the operands' seq stride head_dim, head
    /// stride page_size x head_dim). The metadata is device i32 (0 in a question asked before
    /// the buffers exist).
    #[derive(Debug, Clone, Copy, Default)]
    struct FwdSeqs {
        total_q: i64,
        packed_kv: bool,
        kv_rows: i64,
        page_size: i64,
        page_rows: i64,
        pages_per_seq: i64,
        has_seqused_k: bool,
        cu_seqlens_q: u64,
        cu_seqlens_k: u64,
        seqused_k: u64,
        block_table: u64,
    }

    /// E4M3 inputs only (0 / false otherwise): dequantization scales, real value = code *
    /// scale, device f32 arrays of one entry (per tensor) or, with per_head_scales, one per
    /// (batch, head) pair: q_scale[b * heads + h], k_scale[b * kv_heads + hk], v_scale[b *
    /// kv_heads + hk] (packed or paged K/V, one sequence dimension: k_scale[hk], v_scale[hk]).
    /// An e4m3 K/V cache (`FwdOperands::kv_dtype`) has k_scale and v_scale only. fast: P·V on
    /// e4m3 tensor cores (P rounded to e4m3) where the kernel has it (cutlass-sm90); false,
    /// and every other kernel: P·V in 16 bit (accurate mode).
    #[derive(Debug, Clone, Copy, Default)]
    struct FwdFp8 {
        q_scale: u64,
        k_scale: u64,
        v_scale: u64,
        per_head_scales: bool,
        fast: bool,
    }

    /// The output: O's dtype (the inputs' for 16-bit ones; F16 or BF16 for E4M3; F32 from
    /// F16/BF16 on cutlass), and with has_lse the log-sum-exp, device f32
    /// [batch][heads][seq_q]: the natural log of each row's sum of exponentials of its logits
    /// (-inf for a row that sees no key).
    #[derive(Debug, Clone, Copy)]
    struct FwdOutput {
        dtype: Dtype,
        has_lse: bool,
        lse: u64,
    }

    /// Device memory a launch borrows. workspace: workspace_bytes(kernel, args) bytes owned by
    /// the caller (0 when that is 0), valid until the enqueued work is done. tile_counter:
    /// `tile_counters()` device i32 that are zero between calls (0: none), with which a kernel may
    /// hand out its work tiles to a persistent grid as they free up (the cutlass-sm90 masked
    /// kernels) or find the last of its CTAs to finish a piece of work (the decode kernel's
    /// splits); such a kernel leaves them zero when it ends, and a call may run before the
    /// previous one on the same stream has ended only where it waits for it before touching
    /// them.
    #[derive(Debug, Clone, Copy, Default)]
    struct FwdScratch {
        workspace: u64,
        tile_counter: u64,
    }

    /// One attention forward call: the argument block every fused kernel takes. Pointers may
    /// be 0 in a question asked before any buffer exists (`alibi`, `sinks` and `has_lse` then
    /// say what the call will pass).
    #[derive(Debug, Clone, Copy)]
    struct FwdArgs {
        ops: FwdOperands,
        dims: FwdDims,
        mask: FwdMask,
        mods: FwdScoreMods,
        seqs: FwdSeqs,
        fp8: FwdFp8,
        out: FwdOutput,
        scratch: FwdScratch,
    }

    /// The backward's operands beyond the forward's (`BwdArgs::fwd`, whose `ops.o` is the
    /// forward's output, read, and `out.lse` its log-sum-exp, read): dO, the loss's gradient
    /// against the output, at do_stride (the output's dtype and head dim); dQ, dK, dV written
    /// at their strides (Q's, K's and V's dtype and head dims); dsinks, f32 [heads], written
    /// where the problem has sinks (0: not asked for). deterministic: dQ summed in a fixed
    /// order (bitwise the same every run), else with f32 atomics. workspace:
    /// `KernelPlan::workspace_bytes` of `plan_backward`, owned by the caller.
    #[derive(Debug, Clone, Copy)]
    struct BwdGrads {
        d_o: u64,
        do_stride: Strides,
        dq: u64,
        dk: u64,
        dv: u64,
        dq_stride: Strides,
        dk_stride: Strides,
        dv_stride: Strides,
        dsinks: u64,
        deterministic: bool,
        workspace: u64,
    }

    /// One attention backward call: the forward's argument block (its inputs, its output and
    /// log-sum-exp now read) and the gradients'.
    #[derive(Debug, Clone, Copy)]
    struct BwdArgs {
        fwd: FwdArgs,
        grads: BwdGrads,
    }

    /// What `plan` decided for one problem on one device, which every run of that problem
    /// reads: the kernel, the core's index of its instantiation (only `plan` writes it),
    /// whether e4m3 inputs go through the simulated path (dequantized copies and the 16-bit
    /// instantiation), and the scratch bytes a run needs in `FwdScratch::workspace`.
    #[derive(Debug, Clone, Copy)]
    struct KernelPlan {
        kernel: Kernel,
        instance: i32,
        simulated: bool,
        workspace_bytes: i64,
    }

    // The kernel list, generated from cpp/kernels.txt (build.rs).
    unsafe extern "C++" {
        include!("sdpa/kernels.h");
        type Kernel = crate::Kernel;
    }

    /// What the fused kernels need to know about the GPU they run on, read once per device by
    /// the caller (crates/sdpa/src/device.rs), so that no kernel queries or caches device
    /// attributes itself. All zero: an unknown device (a question asked without a GPU), for
    /// which can_implement checks the problem alone.
    #[derive(Debug, Clone, Copy, Default)]
    struct DeviceInfo {
        /// Compute capability.
        cc_major: i32,
        cc_minor: i32,
        /// Multiprocessors.
        sms: i32,
        /// Bytes of shared memory a block may opt in to.
        smem_optin_per_block: i32,
        /// Bytes of shared memory per multiprocessor.
        smem_per_sm: i32,
    }

    /// The softmax step of the unfused cuBLAS backend: P = softmax(S) per row, causal mask
    /// aligned bottom-right, P in `dtype` (F16 or BF16). S is f32 [rows][seq_k], rows =
    /// batch * heads * seq_q.
    #[derive(Debug, Clone, Copy)]
    struct SoftmaxArgs {
        s: u64,
        p: u64,
        rows: i64,
        seq_q: i64,
        seq_k: i64,
        mask: Mask,
        dtype: Dtype,
    }

    /// Non-finite V at causally masked keys, for the unfused cuBLAS backend. Its P·V GEMM spans
    /// every key with P = 0 at masked ones, and 0 · NaN = NaN, so a NaN or an infinity anywhere
    /// in V would reach rows that do not see its key: causal calls run the GEMM on a finite
    /// copy of V and add the reference's non-finite terms to O afterwards. v: V as given,
    /// [batch][kv_heads][seq_k][head_dim] at v_stride. v_finite (out): V with its non-finite
    /// values set to 0, dense. first_keys: scratch of u32 [batch * kv_heads][1 + 3 * head_dim]
    /// (per kv head, the first key holding any non-finite value, then the first key holding a
    /// NaN, a +Inf, a -Inf in each column; all bits set: none). o: O = P · v_finite at
    /// o_stride. dtype: of V and O, F16 or BF16.
    #[derive(Debug, Clone, Copy)]
    struct NonFiniteVArgs {
        v: u64,
        v_stride: Strides,
        v_finite: u64,
        first_keys: u64,
        o: u64,
        o_stride: Strides,
        batch: i64,
        heads: i64,
        kv_heads: i64,
        seq_q: i64,
        seq_k: i64,
        head_dim: i64,
        dtype: Dtype,
    }

    /// New K/V rows written into a paged cache (sdpa.h, kv_write). k_new, v_new: `rows` rows of
    /// [kv_heads][head_dim] at element strides new_row_stride, new_head_stride; k_cache,
    /// v_cache: `pages` pages of page_size rows, element (page, offset, head, d) at page *
    /// page_stride + offset * row_stride + head * head_stride + d (NHD or HND). Where rows go:
    /// slots (device i64 [rows]) when not 0; else the appends of `batch` sequences, cu_new
    /// (device i32 [batch + 1]: sequence b's rows in k_new) or, when 0, n_new rows each, through
    /// block_table [batch][pages_per_seq] at seqused_k [batch] (in and out). Every stride and
    /// base a multiple of 8 elements (16 for an e4m3 cache). dtype: of the new rows, F16 or
    /// BF16. cache_dtype: the cache's, dtype itself or E4M3: each value then becomes
    /// E4M3(x / scale) (f32 division, round to nearest even, saturating to +-448, NaN kept),
    /// scale k_scale[hk] (v_scale[hk]) with per_head_scales, else k_scale[0] (v_scale[0]):
    /// device f32.
    #[derive(Debug, Clone, Copy)]
    struct KvWriteArgs {
        k_new: u64,
        v_new: u64,
        new_row_stride: i64,
        new_head_stride: i64,
        rows: i64,
        k_cache: u64,
        v_cache: u64,
        pages: i64,
        page_size: i64,
        page_stride: i64,
        row_stride: i64,
        head_stride: i64,
        kv_heads: i64,
        head_dim: i64,
        slots: u64,
        batch: i64,
        cu_new: u64,
        n_new: i64,
        block_table: u64,
        pages_per_seq: i64,
        seqused_k: u64,
        dtype: Dtype,
        cache_dtype: Dtype,
        k_scale: u64,
        v_scale: u64,
        per_head_scales: bool,
    }

    /// One partial attention result folded into a running f32 one through their log-sum-exps
    /// (sdpa/merge.h). acc_o: f32 [batch][heads][acc_seq][head_dim], dense; acc_lse: f32
    /// [batch][heads][acc_seq]; part_o: of dtype (F16, BF16 or F32) at part_stride; part_lse:
    /// f32 [batch][heads][rows], dense. The part's rows are the accumulator's positions [row0,
    /// row0 + rows).
    #[derive(Debug, Clone, Copy)]
    struct MergeArgs {
        acc_o: u64,
        acc_lse: u64,
        part_o: u64,
        part_lse: u64,
        part_stride: Strides,
        batch: i64,
        heads: i64,
        rows: i64,
        head_dim: i64,
        acc_seq: i64,
        row0: i64,
        dtype: Dtype,
    }

    /// The running f32 result (acc_o, f32 [batch][heads][seq][head_dim], dense) rounded to
    /// `dtype` (F16 or BF16) into out at out_stride.
    #[derive(Debug, Clone, Copy)]
    struct MergeFinishArgs {
        acc_o: u64,
        out: u64,
        out_stride: Strides,
        batch: i64,
        heads: i64,
        seq: i64,
        head_dim: i64,
        dtype: Dtype,
    }

    /// How E4M3 scales map onto a tensor's elements: element i belongs to scale group (i /
    /// per_batch) * heads + (i / inner) % heads; per_batch = seq * heads * head_dim, inner =
    /// seq * head_dim (BHSD) or head_dim (BSHD). One group for per-tensor scales (heads = 1,
    /// inner = per_batch = n).
    #[derive(Debug, Clone, Copy)]
    struct ScaleMap {
        heads: i64,
        inner: i64,
        per_batch: i64,
    }
}

pub use blocks::*;

impl From<[i64; 3]> for Strides {
    fn from([batch, head, seq]: [i64; 3]) -> Self {
        Self { batch, head, seq }
    }
}
