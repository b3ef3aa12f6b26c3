// The C++ core's whole public surface: plain structs and functions, no CUDA or cxx types, so
// the Rust bridge (crates/sdpa-sys/src/bridge.cc) can include it with a host compiler alone.
// Every function throws sdpa::Error (a std::runtime_error) on failure; nothing aborts.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace sdpa {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// E4M3 = FP8 (1 sign, 4 exponent, 3 mantissa bits, "fn": no infinities, max 448), only as an
// input type of Q, K, V, always with dequantization scales. F32 only as an output type: a partial
// result that is merged with others before it is rounded (ring attention's steps).
enum class Dtype : int32_t { F16 = 0, BF16 = 1, E4M3 = 2, F32 = 3 };

// Which keys each query row sees. CausalBottomRight: row i sees keys j <= i + seq_k - seq_q (the
// causal diagonal aligned to the last key, as FlashAttention for seq_q != seq_k). CausalTopLeft:
// j <= i. Window: i + seq_k - seq_q - window_left <= j <= i + seq_k - seq_q + window_right
// (FwdArgs; a negative side is unbounded), FlashAttention's window_size.
enum class Mask : int32_t { NoMask = 0, CausalBottomRight = 1, CausalTopLeft = 2, Window = 3 };

// Strides are in elements; the innermost (head_dim) stride is 1. The Rust layer has validated
// every field (shapes, strides, alignment, that the buffers hold what the strides address).
struct Strides {
  int64_t batch, head, seq;
};

struct FwdArgs {
  const void *q, *k, *v;
  void* o;
  int64_t batch, heads, kv_heads, seq_q, seq_k, head_dim;
  Strides q_stride, k_stride, v_stride, o_stride;
  float scale;
  Mask mask;
  int64_t window_left, window_right;  // Window only; negative: unbounded
  // > 0: scores become softcap * tanh(scale * q.k / softcap) before the softmax; 0: off.
  float softcap;
  // ALiBi: (b, h) adds -slope * |i + seq_k - seq_q - j| to row i, key j, slope =
  // alibi_slopes[b * alibi_batch_stride + h] (stride 0: one slope per head), device f32.
  bool alibi;
  const float* alibi_slopes;
  int64_t alibi_batch_stride;
  // The log-sum-exp out: device f32 [batch][heads][seq_q], the natural log of each row's sum of
  // exponentials of its logits (-inf for a row that sees no key).
  bool has_lse;
  float* lse;
  Dtype dtype;      // of q, k, v
  Dtype out_dtype;  // of o: dtype; F16 or BF16 for E4M3; F32 from F16/BF16 on Kernel::Cutlass
  // E4M3 only (null otherwise): dequantization scales, real value = code * scale. Device f32
  // arrays of one entry (per tensor) or, with per_head_scales, one per (batch, head) pair:
  // q_scale[b * heads + h], k_scale[b * kv_heads + hk], v_scale[b * kv_heads + hk].
  const float *q_scale, *k_scale, *v_scale;
  bool per_head_scales;
  // E4M3 only: fast mode, P·V on e4m3 tensor cores (P rounded to e4m3) where the kernel has it
  // (cutlass-sm90); false, and every other kernel: P·V in 16 bit (accurate mode).
  bool fp8_fast;
  // Scratch device memory of workspace_bytes(kernel, args) bytes, owned by the caller (null
  // when that is 0). Valid until the enqueued work is done.
  void* workspace;
  // Two device ints that are zero between calls (null: none), with which a kernel may hand out
  // its work tiles to a persistent grid as they free up (the cutlass-sm90 masked kernels). Such
  // a kernel leaves them zero when it ends; a call may run before the previous one on the same
  // stream has ended only where it waits for it before touching them.
  int32_t* tile_counter;
  // Sequences of different lengths (FlashAttention's varlen and paged cache); all 0 / false /
  // null for dense ones. batch is then the number of sequences, seq_q and seq_k the longest
  // one's lengths. Sequence b's queries: rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of packed
  // Q and O (total_q > 0 rows), else its batch entry's seq_q. Its keys: rows cu_seqlens_k[b] ..
  // cu_seqlens_k[b + 1] of packed K and V (packed_kv), key j at row j % page_size of page
  // block_table[b * pages_per_seq + j / page_size] of a paged cache (page_size > 0, a power of
  // two), else its batch entry's seq_k; with has_seqused_k only the first seqused_k[b] of them.
  // Packed and paged tensors have batch stride 0. The log-sum-exp of packed Q is
  // [heads][total_q]. kv_rows: the rows of packed K/V (total_k) or of a paged cache (pages x
  // page_size), 0 for dense ones. Device i32 metadata (null in a question asked before the
  // buffers exist).
  int64_t total_q;
  bool packed_kv;
  int64_t kv_rows;
  int64_t page_size, pages_per_seq;
  bool has_seqused_k;
  const int32_t *cu_seqlens_q, *cu_seqlens_k, *seqused_k, *block_table;
};

// The softmax step of the unfused cuBLAS backend: P = softmax(S) per row, causal mask
// aligned bottom-right, P in `dtype`. S is f32 [rows][seq_k], rows = batch*heads*seq_q.
struct SoftmaxArgs {
  const void* s;
  void* p;
  int64_t rows, seq_q, seq_k;
  Mask mask;
  Dtype dtype;
};

// Non-finite V at causally masked keys, for the unfused cuBLAS backend (the non-finite V check).
// Its P·V GEMM spans every key with P = 0 at masked ones, and 0 · NaN = 0 · Inf = NaN, so a NaN or
// an infinity anywhere in V would reach rows that do not see its key. Causal calls therefore run
// the GEMM on a finite copy of V and add the reference's non-finite terms to O afterwards.
struct NonFiniteVArgs {
  const void* v;  // V as given, [batch][kv_heads][seq_k][head_dim] with v_stride
  Strides v_stride;
  // Out: V with its non-finite values set to 0, dense [batch][kv_heads][seq_k][head_dim].
  void* v_finite;
  // Scratch of uint32 [batch * kv_heads][1 + 3 * head_dim], written by sanitize_v, read by
  // add_nonfinite_v: per kv head, the first key holding any non-finite value, then the first
  // key holding a NaN, a +Inf, a -Inf in each column ([kind][column]); all bits set: none.
  void* first_keys;
  void* o;  // O = P · v_finite, [batch][heads][seq_q][head_dim] with o_stride
  Strides o_stride;
  int64_t batch, heads, kv_heads, seq_q, seq_k, head_dim;
  Dtype dtype;  // of V and O: F16 or BF16
};

// Before the P·V GEMM: writes v_finite and first_keys.
void sanitize_v(const NonFiniteVArgs& args, void* stream);

// After it: adds to each O element (row r, column d) what V's non-finite values contribute in
// the reference over the keys k <= r + seq_k - seq_q: NaN (a NaN, or both infinities), +Inf or
// -Inf. Rows that see no key keep their zeros.
void add_nonfinite_v(const NonFiniteVArgs& args, void* stream);

// Resource use of one compiled kernel on the current device (cudaFuncGetAttributes).
struct KernelAttr {
  std::string backend, name;
  int32_t registers, static_smem, dynamic_smem, local_bytes, max_threads;
};

// The fused kernels of the core, one per backend folder under cpp/src/.
enum class Kernel : int32_t { Scalar = 0, Wmma = 1, Cutlass = 2, CutlassSm80 = 3 };

// What the fused kernels need to know about the GPU they run on, read once per device by the
// caller (crates/sdpa/src/device.rs), so that no kernel queries or caches device attributes
// itself. All zero: an unknown device (a question asked without a GPU), for which
// can_implement checks the problem alone.
struct DeviceInfo {
  int32_t cc_major, cc_minor;    // compute capability
  int32_t sms;                   // multiprocessors
  int32_t smem_optin_per_block;  // bytes of shared memory a block may opt in to
  int32_t smem_per_sm;           // bytes of shared memory per multiprocessor
  bool known() const { return cc_major > 0; }
};

// Why `kernel` cannot run `args` on `dev`, or "" where it can: that it is instantiated for
// args.dtype and args.head_dim, and what the kernel itself requires (its device, its shared
// memory against dev.smem_optin_per_block, its 32-bit and grid limits, TMA addressing), each
// stated next to the kernel (its header's can_implement). The pointers of `args` may be null
// (a question asked before any buffer exists; `alibi` and `has_lse` say what the call will
// pass); the ones set are checked for what the kernel needs of them. Device requirements are
// skipped for an unknown `dev`.
std::string can_implement(Kernel kernel, const FwdArgs& args, const DeviceInfo& dev);

// Runs `kernel` on `args`, enqueued on `stream` (a CUstream / cudaStream_t) of the device `dev`
// describes; throws can_implement's reason where it is not empty.
void forward(Kernel kernel, const FwdArgs& args, const DeviceInfo& dev, void* stream);

// Bytes of scratch memory `forward(kernel, args)` on the device `dev` describes needs in
// args.workspace (0 for most; decode's split-KV partials depend on the SM count).
int64_t workspace_bytes(Kernel kernel, const FwdArgs& args, const DeviceInfo& dev);

void masked_softmax(const SoftmaxArgs& args, void* stream);

// Appends n_new new key and value rows of each sequence into a paged cache (FlashAttention's
// flash_attn_with_kvcache append): row i of sequence b goes to position seqused_k[b] + i, key j
// living at row j % page_size of page block_table[b * pages_per_seq + j / page_size]; then
// seqused_k[b] grows by n_new, up to pages_per_seq · page_size. Positions outside the table's
// pages_per_seq · page_size are dropped, and entries outside [0, pages) clamped into it. Two
// launches on `stream`, nothing on the host: capturable in a CUDA graph.
struct KvAppendArgs {
  const void *k_new, *v_new;   // [batch][n_new][kv_heads][head_dim], contiguous
  void *k_cache, *v_cache;     // [pages][page_size][kv_heads][head_dim], contiguous
  const int32_t* block_table;  // [batch][pages_per_seq]
  int32_t* seqused_k;          // [batch], in and out
  int64_t batch, n_new, kv_heads, head_dim, page_size, pages_per_seq;
  int64_t pages;  // of the cache
  Dtype dtype;    // F16 or BF16
};
void kv_append(const KvAppendArgs& args, void* stream);

// y[i] = E4M3(x[i] * inv_scale), saturating to +-448, round to nearest even (the GPU's own
// conversion). x: f32 device buffer, y: byte device buffer, both n long.
void e4m3_encode(const float* x, uint8_t* y, int64_t n, float inv_scale, void* stream);

// How E4M3 scales map onto a tensor's elements: element i belongs to scale group
// (i / per_batch) * heads + (i / inner) % heads; per_batch = seq * heads * head_dim, and inner =
// seq * head_dim (BHSD) or head_dim (BSHD). One group for per-tensor scales (heads = 1,
// inner = per_batch = n).
struct ScaleMap {
  int64_t heads, inner, per_batch;
};

// amax[g] = max |x[i]| over the elements of group g (NaN ignored), for `groups` groups; x holds
// f32 when `x_is_f32`, else elements of `dtype` (F16 or BF16). amax must be zeroed first.
void absmax(const void* x, bool x_is_f32, Dtype dtype, int64_t n, ScaleMap map, float* amax,
            int64_t groups, void* stream);

// y[i] = E4M3(x[i] / scale[group(i)]), saturating to +-448, round to nearest even.
void e4m3_quantize(const void* x, bool x_is_f32, Dtype dtype, uint8_t* y, int64_t n, ScaleMap map,
                   const float* scale, void* stream);

// y[i] = out_dtype(decode(x[i]) * scale[group(i)]), round to nearest even.
void e4m3_dequantize(const uint8_t* x, void* y, Dtype out_dtype, int64_t n, ScaleMap map,
                     const float* scale, void* stream);

// Runs an empty kernel on `blocks` CTAs: the launch floor every timing is read against.
void empty_kernel(int32_t blocks, void* stream);

// The kernels forward() launches on the current device, which `dev` describes.
std::vector<KernelAttr> kernel_attributes(const DeviceInfo& dev);

// Whether the CUTLASS kernels were compiled in (CUTLASS headers found at build time).
bool built_with_cutlass();

}  // namespace sdpa
