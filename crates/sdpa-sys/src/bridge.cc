#include "sdpa-sys/src/bridge.h"

#include "sdpa-sys/src/lib.rs.h"
#include "sdpa/sdpa.h"

namespace sdpa_bridge {
namespace {
sdpa::Strides strides(const std::array<int64_t, 3>& s) { return {s[0], s[1], s[2]}; }

sdpa::FwdArgs convert(const FwdArgs& a) {
  sdpa::FwdArgs r{};
  r.q = reinterpret_cast<const void*>(a.q);
  r.k = reinterpret_cast<const void*>(a.k);
  r.v = reinterpret_cast<const void*>(a.v);
  r.o = reinterpret_cast<void*>(a.o);
  r.batch = a.batch;
  r.heads = a.heads;
  r.kv_heads = a.kv_heads;
  r.seq_q = a.seq_q;
  r.seq_k = a.seq_k;
  r.head_dim = a.head_dim;
  r.q_stride = strides(a.q_stride);
  r.k_stride = strides(a.k_stride);
  r.v_stride = strides(a.v_stride);
  r.o_stride = strides(a.o_stride);
  r.scale = a.scale;
  r.mask = a.mask;
  r.window_left = a.window_left;
  r.window_right = a.window_right;
  r.softcap = a.softcap;
  r.alibi = a.alibi;
  r.alibi_slopes = reinterpret_cast<const float*>(a.alibi_slopes);
  r.alibi_batch_stride = a.alibi_batch_stride;
  r.has_lse = a.has_lse;
  r.lse = reinterpret_cast<float*>(a.lse);
  r.dtype = a.dtype;
  r.out_dtype = a.out_dtype;
  r.q_scale = reinterpret_cast<const float*>(a.q_scale);
  r.k_scale = reinterpret_cast<const float*>(a.k_scale);
  r.v_scale = reinterpret_cast<const float*>(a.v_scale);
  r.per_head_scales = a.per_head_scales;
  r.fp8_fast = a.fp8_fast;
  r.workspace = reinterpret_cast<void*>(a.workspace);
  r.tile_counter = reinterpret_cast<int32_t*>(a.tile_counter);
  r.total_q = a.total_q;
  r.packed_kv = a.packed_kv;
  r.kv_rows = a.kv_rows;
  r.page_size = a.page_size;
  r.pages_per_seq = a.pages_per_seq;
  r.has_seqused_k = a.has_seqused_k;
  r.cu_seqlens_q = reinterpret_cast<const int32_t*>(a.cu_seqlens_q);
  r.cu_seqlens_k = reinterpret_cast<const int32_t*>(a.cu_seqlens_k);
  r.seqused_k = reinterpret_cast<const int32_t*>(a.seqused_k);
  r.block_table = reinterpret_cast<const int32_t*>(a.block_table);
  return r;
}

sdpa::NonFiniteVArgs convert(const NonFiniteVArgs& a) {
  sdpa::NonFiniteVArgs r{};
  r.v = reinterpret_cast<const void*>(a.v);
  r.v_stride = strides(a.v_stride);
  r.v_finite = reinterpret_cast<void*>(a.v_finite);
  r.first_keys = reinterpret_cast<void*>(a.first_keys);
  r.o = reinterpret_cast<void*>(a.o);
  r.o_stride = strides(a.o_stride);
  r.batch = a.batch;
  r.heads = a.heads;
  r.kv_heads = a.kv_heads;
  r.seq_q = a.seq_q;
  r.seq_k = a.seq_k;
  r.head_dim = a.head_dim;
  r.dtype = a.dtype;
  return r;
}

sdpa::DeviceInfo convert(const DeviceInfo& d) {
  return {d.cc_major, d.cc_minor, d.sms, d.smem_optin_per_block, d.smem_per_sm};
}

sdpa::ScaleMap map(const ScaleMap& m) { return {m.heads, m.inner, m.per_batch}; }
}  // namespace

rust::String can_implement(Kernel kernel, const FwdArgs& args, const DeviceInfo& dev) {
  return sdpa::can_implement(kernel, convert(args), convert(dev));
}

void forward(Kernel kernel, const FwdArgs& args, const DeviceInfo& dev, std::size_t stream) {
  sdpa::forward(kernel, convert(args), convert(dev), reinterpret_cast<void*>(stream));
}

int64_t workspace_bytes(Kernel kernel, const FwdArgs& args, const DeviceInfo& dev) {
  return sdpa::workspace_bytes(kernel, convert(args), convert(dev));
}

void absmax(uint64_t x, bool x_is_f32, Dtype dtype, int64_t n, ScaleMap m, uint64_t amax,
            int64_t groups, std::size_t stream) {
  sdpa::absmax(reinterpret_cast<const void*>(x), x_is_f32, dtype, n, map(m),
               reinterpret_cast<float*>(amax), groups, reinterpret_cast<void*>(stream));
}

void e4m3_quantize(uint64_t x, bool x_is_f32, Dtype dtype, uint64_t y, int64_t n, ScaleMap m,
                   uint64_t scale, std::size_t stream) {
  sdpa::e4m3_quantize(reinterpret_cast<const void*>(x), x_is_f32, dtype,
                      reinterpret_cast<uint8_t*>(y), n, map(m),
                      reinterpret_cast<const float*>(scale), reinterpret_cast<void*>(stream));
}

void e4m3_dequantize(uint64_t x, uint64_t y, Dtype out_dtype, int64_t n, ScaleMap m, uint64_t scale,
                     std::size_t stream) {
  sdpa::e4m3_dequantize(reinterpret_cast<const uint8_t*>(x), reinterpret_cast<void*>(y), out_dtype,
                        n, map(m), reinterpret_cast<const float*>(scale),
                        reinterpret_cast<void*>(stream));
}

void masked_softmax(const SoftmaxArgs& a, std::size_t stream) {
  const sdpa::SoftmaxArgs r{reinterpret_cast<const void*>(a.s),
                            reinterpret_cast<void*>(a.p),
                            a.rows,
                            a.seq_q,
                            a.seq_k,
                            a.mask,
                            a.dtype};
  sdpa::masked_softmax(r, reinterpret_cast<void*>(stream));
}

void sanitize_v(const NonFiniteVArgs& a, std::size_t stream) {
  sdpa::sanitize_v(convert(a), reinterpret_cast<void*>(stream));
}

void add_nonfinite_v(const NonFiniteVArgs& a, std::size_t stream) {
  sdpa::add_nonfinite_v(convert(a), reinterpret_cast<void*>(stream));
}

void kv_append(const KvAppendArgs& a, std::size_t stream) {
  sdpa::KvAppendArgs r{};
  r.k_new = reinterpret_cast<const void*>(a.k_new);
  r.v_new = reinterpret_cast<const void*>(a.v_new);
  r.k_cache = reinterpret_cast<void*>(a.k_cache);
  r.v_cache = reinterpret_cast<void*>(a.v_cache);
  r.block_table = reinterpret_cast<const int32_t*>(a.block_table);
  r.seqused_k = reinterpret_cast<int32_t*>(a.seqused_k);
  r.batch = a.batch;
  r.n_new = a.n_new;
  r.kv_heads = a.kv_heads;
  r.head_dim = a.head_dim;
  r.page_size = a.page_size;
  r.pages_per_seq = a.pages_per_seq;
  r.pages = a.pages;
  r.dtype = a.dtype;
  sdpa::kv_append(r, reinterpret_cast<void*>(stream));
}

void e4m3_encode(uint64_t x, uint64_t y, int64_t n, float inv_scale, std::size_t stream) {
  sdpa::e4m3_encode(reinterpret_cast<const float*>(x), reinterpret_cast<uint8_t*>(y), n, inv_scale,
                    reinterpret_cast<void*>(stream));
}

void empty_kernel(int32_t blocks, std::size_t stream) {
  sdpa::empty_kernel(blocks, reinterpret_cast<void*>(stream));
}

void merge_init(uint64_t acc_o, uint64_t acc_lse, int64_t rows, int64_t head_dim,
                std::size_t stream) {
  sdpa::merge_init(reinterpret_cast<float*>(acc_o), reinterpret_cast<float*>(acc_lse), rows,
                   head_dim, reinterpret_cast<void*>(stream));
}

void merge_partial(const MergeArgs& a, std::size_t stream) {
  sdpa::MergeArgs r{};
  r.acc_o = reinterpret_cast<float*>(a.acc_o);
  r.acc_lse = reinterpret_cast<float*>(a.acc_lse);
  r.part_o = reinterpret_cast<const void*>(a.part_o);
  r.part_lse = reinterpret_cast<const float*>(a.part_lse);
  for (int i = 0; i < 3; ++i) r.part_stride[i] = a.part_stride[i];
  r.batch = a.batch;
  r.heads = a.heads;
  r.rows = a.rows;
  r.head_dim = a.head_dim;
  r.acc_seq = a.acc_seq;
  r.row0 = a.row0;
  r.dtype = a.dtype;
  sdpa::merge_partial(r, reinterpret_cast<void*>(stream));
}

void merge_finish(const MergeFinishArgs& a, std::size_t stream) {
  sdpa::MergeFinishArgs r{};
  r.acc_o = reinterpret_cast<const float*>(a.acc_o);
  r.out = reinterpret_cast<void*>(a.out);
  for (int i = 0; i < 3; ++i) r.out_stride[i] = a.out_stride[i];
  r.batch = a.batch;
  r.heads = a.heads;
  r.seq = a.seq;
  r.head_dim = a.head_dim;
  r.dtype = a.dtype;
  sdpa::merge_finish(r, reinterpret_cast<void*>(stream));
}

bool built_with_cutlass() { return sdpa::built_with_cutlass(); }

rust::Vec<KernelAttr> kernel_attributes(const DeviceInfo& dev) {
  rust::Vec<KernelAttr> out;
  for (const auto& k : sdpa::kernel_attributes(convert(dev))) {
    out.push_back(KernelAttr{k.backend, k.name, k.registers, k.static_smem, k.dynamic_smem,
                             k.local_bytes, k.max_threads});
  }
  return out;
}
}  // namespace sdpa_bridge
