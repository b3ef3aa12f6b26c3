// CUTLASS/CuTe backend for sm_90a (Hopper): FlashAttention-2 style forward on wgmma, with Q, K
// and V brought into swizzled shared memory by TMA; a TMA producer warpgroup and one to three
// consumer warpgroups of 64 query rows on a ring of K/V stages; e4m3 inputs on the same kernel
// (S on e4m3 wgmma; P·V on f16, or in fast mode on e4m3). The kernel is role dispatch over its
// collectives:
//   tile_config.cuh     element types, the per-head-dim tuning table, layouts, shared storage
//   tile_scheduler.cuh  which work tiles a CTA runs, in what order (the walk every role
//                       takes); the grid size
//   tile_feed.cuh       the masked kernels' tiles handed to a persistent grid as CTAs free up
//   kernel_traits.cuh   what the roles share: the constants that choose the paths, the pipelines
//   mainloop_params.cuh the collectives' parameters, made on the host from FwdArgs
//   tile_keys.cuh       a work tile's sequence, mask and key tiles (order, place, checked ones)
//   producer.cuh        the producer's TMA loads (Q, the K/V ring)
//   v_side.cuh          the spare producer warps' V work (e4m3 conversion, the non-finite V
//                       check) and the consumers' side of the check
//   consumer.cuh        the consumers' wgmma rounds with the online softmax in between
//   pipeline.cuh        the barrier pipelines (K/V ring, the V check's detour, hand-overs)
//   softmax.cuh         the online softmax on the accumulators; the score tile masks apply to
//   score_mod.cuh       score mods policies: none, or softcap and ALiBi as the call asks
//   seq_layout.cuh      sequence layout policies: dense, or the call's (packed, paged, seqused_k)
//   nonfinite_v.cuh     the non-finite V check
//   epilogue.cuh        O to global memory
//   v_prepass.cuh       e4m3: V converted (accurate mode) or transposed (fast mode) before
// and the mask policy (common/mask.cuh) it is templated on, which applies itself to a tile of
// scores. The band kernel is the general path: its score mods and sequence layout are the
// call's (KernelTraits::Mods, Seqs); the plain kernels run dense sequences without mods. With
// sequences of different lengths a work tile's record (TileKeys::record: its sequence, its key
// tiles; none past the sequence's queries) is made once on the tile feed and read by every role,
// and the band is rebased to the sequence's lengths; rows past a sequence's end that a tile's TMA
// copy brings in (the next sequence's) are masked like any key the band hides, and the non-finite V
// check ignores them. docs/design.md describes the tiles,
// roles, register split, overlap and scheduling. Assumes validated arguments
// (crates/sdpa/src/problem/mod.rs): head dims <= D (narrower ones on the general path, their
// columns past the problem's loaded as zeros by TMA and not stored: mainloop_params.cuh,
// epilogue.cuh), 16-byte aligned rows, strides in elements,
// heads % kv_heads == 0, seq_q, seq_k >= 1; and what can_implement (below) checks: the device,
// the 32-bit limits, TMA addressing.
//
// What the compiler needs, said once here: every device function is force-inlined (a call
// anywhere in the kernel makes ptxas serialize every wgmma); the producer warpgroup gives its
// registers to the consumers (setmaxnreg: 24 a producer thread, 240 a consumer thread, which is
// what 2 x 128 x (240 - 168) = 128 x (168 - 24) allows from the 168 x 384 the CTA launches with;
// more makes the consumers' setmaxnreg wait forever; the band kernel's producer, which also
// looks up a paged cache's block table, and the kernels on the tile feed keep 40 or 48; three
// consumer warpgroups share what 128 x 512 leaves: kConsumerRegs); and values the compiler would
// otherwise hoist out of the tile loops and hold across the main loop (addresses, coordinates, the
// grid stride) are recomputed from an opaque copy of their input (`asm volatile("" : "+r"(x))`),
// which keeps the producer within 24 registers and the consumers free of spills.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/attributes.cuh"
#include "common/check.cuh"
#include "common/launch.cuh"
#include "common/limits.cuh"
#include "common/mask.cuh"
#include "cutlass/sm90/consumer.cuh"
#include "cutlass/sm90/epilogue.cuh"
#include "cutlass/sm90/kernel_traits.cuh"
#include "cutlass/sm90/mainloop_params.cuh"
#include "cutlass/sm90/nonfinite_v.cuh"
#include "cutlass/sm90/primitives.cuh"
#include "cutlass/sm90/producer.cuh"
#include "cutlass/sm90/softmax.cuh"
#include "cutlass/sm90/tile_config.cuh"
#include "cutlass/sm90/tile_keys.cuh"
#include "cutlass/sm90/tile_scheduler.cuh"
#include "cutlass/sm90/v_prepass.cuh"
#include "cutlass/sm90/v_side.cuh"

namespace sdpa::cutlass_sm90 {

template <class E, int D, class Mask>
struct KernelParams {
  typename KernelTraits<E, D, Mask>::Params mainloop;
  typename TileScheduler<Mask::kMasksKeys>::Params sched;
  typename Epilogue<E, D>::Params epilogue;
};

// The kernel's collectives for element types E, head dim D and mask Mask: the kernel body
// (fwd_body) is written against these names alone.
template <class E_, int D_, class Mask_>
struct FwdCollectives {
  using E = E_;
  using Mask = Mask_;
  static constexpr int D = D_;
  using Traits = KernelTraits<E, D, Mask>;
  using Keys = TileKeys<E, D, Mask>;
  using Producer = cutlass_sm90::Producer<E, D, Mask>;
  using VSide = cutlass_sm90::VSide<E, D, Mask>;
  using Consumer = cutlass_sm90::Consumer<E, D, Mask>;
  using Epilogue = cutlass_sm90::Epilogue<E, D>;
  using Params = KernelParams<E, D, Mask>;

  // Registers of a producer and of a consumer thread (see the top of this file). Kernels on the
  // tile feed (masked, 16-bit, D <= 128) walk it in the producer's TMA thread: 48. The band
  // kernel's producer also reads a paged cache's block table: 40. The consumers take what the
  // producer gives up, shared among them, up to 240: with two consumer warpgroups 224, 232 or
  // 240, with three 152 or 160.
  static constexpr int kLaunchRegs = 65536 / Traits::C::kThreads / 8 * 8;
  static constexpr int kProducerRegs = Traits::kFeed ? 48 : Traits::kBand ? 40 : 24;
  static constexpr int kConsumerRegs =
      std::min(240, (kLaunchRegs + (kLaunchRegs - kProducerRegs) / Traits::C::kWG) / 8 * 8);
  static_assert(Traits::C::kWG * (kConsumerRegs - kLaunchRegs) <= kLaunchRegs - kProducerRegs,
                "the consumers' setmaxnreg would wait forever");
};

// What a thread of the producer warpgroup (threads 0-127) does.
enum class ProducerRole { kLoad, kConvertV, kCheckV, kIdle };

template <class K>
__device__ __forceinline__ ProducerRole producer_role(int tid) {
  if (tid == 0) return ProducerRole::kLoad;
  if (tid >= 32 && K::E::kConvertV) return ProducerRole::kConvertV;
  if (tid >= 32 && K::Traits::kChecksV) return ProducerRole::kCheckV;
  return ProducerRole::kIdle;
}

template <class C>
__device__ __forceinline__ void init_barriers(typename C::Smem& sm, int consumers, bool convert_v) {
  mbar_init(&sm.bar_q, 1);
  mbar_init(&sm.empty_q, consumers);
  for (int i = 0; i < 2; ++i) {  // the tile feed and the check records' hand-over
    mbar_init(&sm.feed_full[i], 1);
    mbar_init(&sm.feed_empty[i], consumers + C::kConverters);
    mbar_init(&sm.nf_ready[i], C::kConverters);
    mbar_init(&sm.nf_free[i], consumers);
  }
  for (int s = 0; s < C::kStages; ++s) {
    mbar_init(&sm.full_k[s], 1);
    mbar_init(&sm.full_v[s], convert_v ? C::kConverters : 1);
    mbar_init(&sm.empty_k[s], consumers);  // every consumer thread releases
    mbar_init(&sm.empty_v[s], consumers);
    mbar_init(&sm.full_vd[s], 1);
    mbar_init(&sm.checked_v[s], C::kConverters);
  }
  if (convert_v) {
    for (int s = 0; s < C::kV8Stages; ++s) {
      mbar_init(&sm.full_v8[s], 1);
      mbar_init(&sm.empty_v8[s], C::kConverters);
    }
  }
  cutlass::arch::fence_barrier_init();
}

// The kernel, generic over its collectives K (FwdCollectives): role dispatch, the producer
// warpgroup's roles, and each consumer warpgroup's work tiles from the main loop to the epilogue.
template <class K>
__device__ __forceinline__ void fwd_body(const typename K::Params& p) {
  using E = typename K::E;
  using T = typename K::Traits;
  using C = typename T::C;
  using Keys = typename K::Keys;
  using Consumer = typename K::Consumer;
  using VSide = typename K::VSide;
  using Epi = typename K::Epilogue;
  auto& sm = smem_storage<typename C::Smem>();
  const int tid = threadIdx.x;

  if (tid == 0) {
    K::Producer::prefetch_descriptors(p.mainloop);
    init_barriers<C>(sm, 128 * p.sched.wgs, E::kConvertV);
  }
  __syncthreads();  // the last CTA-wide barrier: the roles part here
  // Programmatic launch (launch()): everything above overlapped the previous grid; nothing
  // global is read or written before this. E4M3 with the pre-pass: the grid before is
  // the pre-pass (v_prepass.cuh), itself launched the ordinary way (everything before it has
  // completed), and only V (and fast mode's NaN table) depends on it: the producer waits before
  // its first V load instead (the consumers before reading the table).
  if constexpr (!E::kPrepass) pdl_wait();
  pdl_launch_dependents();

  if (tid < 128) {
    cutlass::arch::warpgroup_reg_dealloc<uint32_t(K::kProducerRegs)>();
    switch (producer_role<K>(tid)) {
      case ProducerRole::kLoad:
        K::Producer::load(p.mainloop, p.sched, sm);
        break;
      case ProducerRole::kConvertV:
        if constexpr (E::kConvertV) VSide::convert_v(p.mainloop, p.sched, sm, tid - 32);
        break;
      case ProducerRole::kCheckV:
        if constexpr (T::kChecksV) VSide::check_v(p.mainloop, p.sched, sm, tid - 32);
        break;
      case ProducerRole::kIdle:
        break;
    }
    return;
  }

  // Consumer warpgroups: the CTA's work tiles as the producer walks them (TileWalk::follow).
  cutlass::arch::warpgroup_reg_alloc<uint32_t(K::kConsumerRegs)>();
  const int ctid = tid - 128;       // 0 .. consumers - 1
  const int wg = ctid / 128;        // this consumer warpgroup: rows [64 wg, 64 wg + 64)
  const int bm = 64 * p.sched.wgs;  // query rows per tile (the Q buffer always holds BM)
  typename C::MmaPV mma_pv;
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<C::kBM>, Int<C::kDV>>{});
  Tensor O = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
  const auto ops = Consumer::consumer_operands(sm, ctid);
  int it = 0, qi = 0;  // ring uses and tiles with queries so far
  PhaseBits v_phase;   // kTracked kernels' V barrier phases (VRing)
  const auto make = [&](int t) { return Keys::record(p.mainloop, p.sched, t); };
  const auto run_tile = [&](const TileRecord& r, uint32_t at) __attribute__((always_inline)) {
    const WorkTile w = r.w;
    const int m0 = w.m_block * bm;
    const KeyTiles kt = r.kt;
    float sl2, o_scale;
    Consumer::scales(p.mainloop, w, sl2, o_scale);
    OnlineSoftmax<decltype(size<0>(O))::value, C::Tune::kOneExpLoop, E::kFp8PV ? 8 : 0, true>
        softmax;
    // The head's sink logit, loaded before the main loop, which hides its latency (one register);
    // loaded after it, the load would stand on each tile's path to the epilogue, which short
    // window rows feel.
    const float sink = p.epilogue.sinks != nullptr ? __ldg(p.epilogue.sinks + w.h) : -INFINITY;
    clear(tOrO);
    Consumer::mma(p.mainloop, sm, ops, m0, kt, it, qi, tOrO, softmax, w, at, sl2, wg, v_phase);
    // The sequence and its mask again, not held across the main loop.
    const Seq<int> seq = Keys::seq(p.mainloop, w, at);
    // On the feed the check runs ahead by up to a tile: its records of this tile are in the
    // slots of the tile's parity, complete once nf_ready says so, and free once read.
    if constexpr (T::kTracked) T::records(sm).wait(qi);
    VSide::add_masked_nonfinite(p.mainloop, w, sm, Keys::mask_of(p.mainloop, seq), m0, kt, tOrO,
                                ctid, (qi & 1) * C::kTileSlots);
    if constexpr (T::kTracked) T::records(sm).release(qi);
    softmax.fold_sink(O, sink, Consumer::step_scale(p.mainloop, sl2));  // none: -inf
    Epi::store_lse(p.epilogue, softmax, ops.coords, seq, w.b, w.h, m0,
                   Consumer::step_scale(p.mainloop, sl2));
    softmax.normalize(O, o_scale);
    // kAliasO: Q's buffer takes O once every consumer warpgroup's last S = Q·Kᵀ is done (a
    // warpgroup's Q rows are spread over the whole buffer).
    if constexpr (C::kAliasO) named_sync(kStagingBarrier, 128 * p.sched.wgs);
    Epi::store(p.epilogue, sm, tOrO, seq, w.b, w.h, m0, wg, ctid, qi, kEpilogueBarrier + wg);
    if constexpr (C::kAliasO) {
      // O was staged in Q's buffer: Q is free once the staging is read, and the next Q's TMA
      // (async proxy) is ordered after these generic-proxy accesses.
      cutlass::arch::fence_view_async_shared();
      T::q_slot(sm).release(qi);
    }
    ++qi;
  };
  T::Walk::follow(p.sched, sm, make, run_tile);
}

template <class E, int D, class Mask>
__global__ void __launch_bounds__(TileConfig<E, D>::kThreads, 1)
    fwd_kernel(const __grid_constant__ KernelParams<E, D, Mask> p) {
#ifdef SDPA_SM90_DEVICE
  fwd_body<FwdCollectives<E, D, Mask>>(p);
#endif
}

// Host side ----------------------------------------------------------------------------------

// SDPA_SM90_CTAS=n in the environment (read once), for tests, sanitizers and measurements: n > 0
// caps the masked kernels' persistent grid at n CTAs (several tiles a CTA on small problems);
// n < 0 leaves it one CTA a tile, as without a tile counter.
inline int forced_ctas() {
  static const int n = [] {
    const char* e = std::getenv("SDPA_SM90_CTAS");
    return e != nullptr ? std::atoi(e) : 0;
  }();
  return n;
}

// The CTAs a persistent grid may have: one an SM, or fewer as SDPA_SM90_CTAS asks.
template <class Params>
int persistent_ctas(const Params& sched, int sms) {
  return sched.counter != nullptr && forced_ctas() > 0 ? std::min(forced_ctas(), sms) : sms;
}

template <class E, int D, class Mask>
KernelParams<E, D, Mask> make_params(const FwdArgs& a, int sms) {
  using Sched = TileScheduler<Mask::kMasksKeys>;
  KernelParams<E, D, Mask> p{};
  p.sched = Sched::make(a.dims.seq_q, a.dims.heads, a.dims.batch, sms, TileConfig<E, D>::kWG,
                        a.seqs.total_q, device_ptr<const int32_t>(a.seqs.cu_seqlens_q));
  // A kernel on the feed is persistent where the caller gave a tile counter (tile_feed.cuh).
  if constexpr (KernelTraits<E, D, Mask>::kFeed)
    p.sched.counter = forced_ctas() < 0 ? nullptr : device_ptr<int32_t>(a.scratch.tile_counter);
  // Non-masked grids are persistent past one wave (Sched::grid_size), as are those on the feed
  // with a counter. Three warpgroups take turns on every grid; two on the masked kernels' (one
  // tile a CTA, or the feed) and where every CTA runs a single tile, not on the unmasked
  // persistent grid, where their waits cost more than the staggered issue gains.
  constexpr int kWG = TileConfig<E, D>::kWG;
  const bool turns =
      p.sched.wgs == kWG && kWG > 1 &&
      (kWG == 3 || Mask::kMasksKeys || p.sched.tiles <= persistent_ctas(p.sched, sms));
  // E4M3 with the pre-pass: V is its copy in the workspace (v_prepass.cuh).
  const void* v = device_ptr<const void>(E::kPrepass ? a.scratch.workspace : a.ops.v);
  const Strides vs = E::kPrepass && !E::kFp8PV ? packed_v_strides(a) : a.ops.v_stride;
  p.mainloop = make_mainloop_params<E, D, Mask>(a, v, vs, turns);
  p.epilogue = {device_ptr<typename Epilogue<E, D>::Stored>(a.ops.o),
                a.ops.o_stride,
                int(a.dims.seq_q),
                a.out.has_lse ? device_ptr<float>(a.out.lse) : nullptr,
                int(a.dims.heads),
                a.seqs.total_q,
                a.mods.sinks ? device_ptr<const float>(a.mods.sink_logits) : nullptr,
                int(a.dims.head_dim_v)};
  return p;
}

// Work tiles are numbered in `int`, and a causal grid has one CTA per tile whose tile loop
// steps t += gridDim.x: 2 · tiles - 1 must stay an `int`.
constexpr int64_t kMaxTiles = int64_t(1) << 30;

// Sizes, rows, keys and work tiles in `int` (one grid dimension: no grid y or z limit).
template <class E, int D>
std::string int_limits(const FwdArgs& a) {
  using C = TileConfig<E, D>;
  const std::string seqs = limits::int_sequences(a, "cutlass-sm90", std::max(C::kBM, C::kBN));
  if (!seqs.empty()) return seqs;
  // The causal producer forms row + seq_k before subtracting seq_q; a band row +- its sides,
  // clamped to seq_q + seq_k (mask::Band).
  if (a.mask.kind == Mask::CausalBottomRight && a.dims.seq_q + a.dims.seq_k > limits::kIntMax)
    return "causal seq_q + seq_k = " + std::to_string(a.dims.seq_q + a.dims.seq_k) +
           " exceeds 2^31 - 1: the cutlass-sm90 kernel computes the diagonal in 32-bit int";
  if (mask::needs_band(a) && 2 * (a.dims.seq_q + a.dims.seq_k) > limits::kIntMax)
    return "2 (seq_q + seq_k) = " + std::to_string(2 * (a.dims.seq_q + a.dims.seq_k)) +
           " exceeds 2^31 - 1: the cutlass-sm90 kernel computes a band's keys in 32-bit int";
  // Tiles of C::kBM rows (64 only where there are no more than SMs). No overflow: validation
  // caps batch x heads x seq_q at 2^40 / head_dim.
  // Packed Q: ceil(total_q / 64) + batch a head (TileScheduler), at 64-row tiles.
  const int64_t tiles = a.seqs.total_q > 0
                            ? ((a.seqs.total_q + 63) / 64 + a.dims.batch) * a.dims.heads
                            : (a.dims.seq_q + C::kBM - 1) / C::kBM * a.dims.batch * a.dims.heads;
  if (tiles > kMaxTiles)
    return std::to_string(tiles) +
           " work tiles exceed 2^30: the cutlass-sm90 kernel numbers them in 32-bit int";
  return "";
}

// Q, K and V through TMA descriptors: byte strides below 2^40 (bounded here by each tensor's
// size, which exceeds every stride of it), 16-byte multiples, and 16-byte aligned bases.
template <class E, int D>
std::string tma_limits(const FwdArgs& a) {
  // E4M3 with the pre-pass reads V through its copy (f16, or e4m3 transposed).
  const int64_t in = sizeof(typename E::QK), v_in = E::kPrepass ? sizeof(typename E::PV) : in;
  const int64_t q_elems = (a.seqs.total_q > 0 ? a.seqs.total_q : a.dims.batch * a.dims.seq_q) *
                          a.dims.heads * a.dims.head_dim;
  const int64_t kv_rows =
      (a.seqs.kv_rows > 0 ? a.seqs.kv_rows : a.dims.batch * a.dims.seq_k) * a.dims.kv_heads;
  for (const auto& [what, bytes] :
       {std::pair{"Q", q_elems * in}, std::pair{"K", kv_rows * a.dims.head_dim * in},
        std::pair{"V", kv_rows * a.dims.head_dim_v * v_in}})
    if (bytes >= (int64_t(1) << 40))
      return std::string(what) + " is " + std::to_string(bytes) +
             " bytes; TMA descriptor strides must stay below 2^40 bytes";
  return limits::first({tma_operand(a.ops.q, a.ops.q_stride, "q", in),
                        tma_operand(a.ops.k, a.ops.k_stride, "k", in),
                        tma_operand(a.ops.v, a.ops.v_stride, "v", in)});
}

// The general path (mask::needs_band: windows, top-left causal, softcap, ALiBi, sequences of
// different lengths; narrowed: head dims below the tiles) for 16-bit inputs, with a window at least
// one key tile wide: the non-finite V check's records of a partly masked tile answer for rows
// whose visible keys there reach one of its ends (nonfinite_v.cuh); and a paged cache whose pages
// hold whole key tiles (one TMA copy a tile).
// Whether the kernel of element types E and head dim D runs `a` on fewer columns than its tiles
// (head_dim below D, or head_dim_v below its V's and O's width): on its general path.
template <class E, int D>
bool narrowed(const FwdArgs& a) {
  return a.dims.head_dim != D || a.dims.head_dim_v != TileConfig<E, D>::kDV;
}

template <class E, int D>
std::string band_limits(const FwdArgs& a) {
  if (narrowed<E, D>(a)) {
    if (E::kFp8 || E::kF32Out)
      return "cutlass-sm90 runs e4m3 inputs and an f32 output at the head dims of its instances "
             "only, not head_dim " +
             std::to_string(a.dims.head_dim) + " with head_dim_v " +
             std::to_string(a.dims.head_dim_v);
    const std::string why = limits::narrowed_head_dims(a, D);
    if (!why.empty()) return why;
  } else if (!mask::needs_band(a)) {
    return "";
  }
  if (E::kFp8)
    return "cutlass-sm90 e4m3 runs no mask but causal bottom-right, no softcap or ALiBi, and "
           "dense sequences only (its simulated path on scalar runs them)";
  if (E::kF32Out)
    return "cutlass-sm90 writes an f32 output for no mask or causal bottom-right over dense "
           "sequences only (no window, softcap, ALiBi, packed or paged K/V)";
  constexpr int kBN = TileConfig<E, D>::kBN;
  if (a.seqs.page_size > 0 && a.seqs.page_size % kBN != 0)
    return "a paged cache's pages of " + std::to_string(a.seqs.page_size) +
           " keys are smaller than the cutlass-sm90 kernel's " + std::to_string(kBN) +
           "-key tile at head_dim " + std::to_string(D) + " (cutlass-sm80 runs them)";
  // The non-finite V check keeps records of a bounded number of partly masked tiles across a
  // query tile's lower edge (TileConfig::kCrossTiles): a query tile whose rows straddle two
  // chunks would have a whole chunk of them. Chunks of whole query tiles (64 or 128 rows) on
  // dense sequences whose diagonal starts on a tile boundary, or one query a sequence, never
  // straddle.
  constexpr int kBM = TileConfig<E, D>::kBM;
  if (a.mask.kind == Mask::Chunked && a.mask.chunk < a.dims.seq_k && a.dims.seq_q > 1) {
    if (!limits::dense(a) || a.mask.chunk % kBM != 0 || (a.dims.seq_k - a.dims.seq_q) % kBM != 0)
      return "chunks of " + std::to_string(a.mask.chunk) +
             " keys would split the cutlass-sm90 kernel's query tiles: it runs chunks of a "
             "multiple of " +
             std::to_string(kBM) + " keys on dense sequences with seq_k - seq_q a multiple of " +
             std::to_string(kBM) + ", or one query a sequence (cutlass-sm80 runs the others)";
  }
  return mask::narrow_window(a, kBN, "cutlass-sm90");
}

// What this kernel (element types E, head dim D) takes beyond its instantiation: the 32-bit
// limits, TMA addressing, an sm_90 device with its TileConfig's shared memory. (The small path
// applies only where it fits too: small_forward.)
template <class E, int D>
std::string can_implement_elems(const FwdArgs& a, const DeviceInfo& dev) {
  // The general path runs on the band kernel's element types.
  if constexpr (!std::is_same_v<BandElems<E, D>, E> && !E::kFp8 && !E::kF32Out)
    if (narrowed<E, D>(a) || mask::needs_band(a))
      return can_implement_elems<BandElems<E, D>, D>(a, dev);
  return limits::first({band_limits<E, D>(a), int_limits<E, D>(a), tma_limits<E, D>(a),
                        sm90_only(dev), limits::smem_per_block(dev, TileConfig<E, D>::kSmemBytes)});
}

template <class E, int D, class Mask>
void launch(const FwdArgs& a, const DeviceInfo& dev, cudaStream_t stream) {
  using C = TileConfig<E, D>;
  constexpr int kSmem = C::kSmemBytes;
  const auto kernel = fwd_kernel<E, D, Mask>;
  static std::atomic<uint64_t> configured{0};
  opt_in_smem(reinterpret_cast<const void*>(kernel), kSmem, configured);
  const int sms = dev.sms;
  if constexpr (E::kFp8) {
    if (!a.fp8.q_scale || !a.fp8.k_scale || !a.fp8.v_scale)
      throw Error("cutlass-sm90 e4m3: q, k and v scales are required");
  }
  launch_v_prepass<E, D>(a, sms, stream);
  const KernelParams<E, D, Mask> p = make_params<E, D, Mask>(a, sms);
  launch_kernel(kernel,
                dim3(unsigned(TileScheduler<Mask::kMasksKeys>::grid_size(
                    p.sched, persistent_ctas(p.sched, sms)))),
                dim3(unsigned(128 * (p.sched.wgs + 1))), kSmem, stream, true, p);
}

// The small-problem path at D = 64 (sm90_small.cuh, instantiated in fwd_small_<dtype>_d64.cu)
// for element types E: launches and returns true where it applies.
template <class E, int D>
bool small_forward(const FwdArgs& a, const DeviceInfo& dev, cudaStream_t stream);
template <class E, int D>
void small_attributes(std::vector<KernelAttr>& out, const char* name);

template <class E, int D>
void forward_elems(const FwdArgs& a, const DeviceInfo& dev, cudaStream_t stream) {
  if ((a.mods.alibi && !a.mods.alibi_slopes) || (a.mods.sinks && !a.mods.sink_logits) ||
      (a.out.has_lse && !a.out.lse))
    throw Error("cutlass-sm90: the ALiBi slopes, the sinks or the log-sum-exp buffer is missing");
  const auto run = [&](auto m) {
    using M = decltype(m);
    if constexpr (mask::kIsBand<M>)
      launch<BandElems<E, D>, D, M>(a, dev, stream);
    else
      launch<E, D, M>(a, dev, stream);
  };
  if constexpr (E::kFp8 || E::kF32Out)
    mask::dispatch_mask(a.mask.kind, int(a.dims.seq_q), int(a.dims.seq_k), run);
  else
    mask::dispatch_band<int>(a, run, narrowed<E, D>(a));
}

// O in f32 from 16-bit inputs (F32Out): kernels of their own, so that the 16-bit output's
// kernels compile as if it did not exist, at the head dims and masks ring attention asks for.
template <int D>
constexpr bool kHasF32Out = D == 64 || D == 128;

// V and O narrower than Q and K with kernels of their own (SameDV): DeepSeek's 192 / 128 (its
// MLA prefill). Other pairs run narrowed on the kernel of the wider head dim.
template <int D>
constexpr int kOwnDV = D == 192 ? 128 : 0;

// Whether `a` is the head-dim pair of the instance's kernels with V of their own width.
template <int D>
bool own_dv(const FwdArgs& a) {
  return kOwnDV<D> > 0 && a.dims.head_dim == D && a.dims.head_dim_v == kOwnDV<D>;
}

template <typename T, int D>
std::string can_implement(const FwdArgs& a, const DeviceInfo& dev) {
  if constexpr (kOwnDV<D> > 0)
    if (a.out.dtype != Dtype::F32 && own_dv<D>(a))
      return can_implement_elems<SameDV<T, kOwnDV<D>>, D>(a, dev);
  if (a.out.dtype != Dtype::F32) return can_implement_elems<Same<T>, D>(a, dev);
  if constexpr (kHasF32Out<D>)
    return can_implement_elems<F32Out<T>, D>(a, dev);
  else
    return "cutlass-sm90 writes an f32 output at head_dim 64 and 128 only, not " +
           std::to_string(D);
}

template <typename T, int D>
void forward(const FwdArgs& a, const DeviceInfo& dev, cudaStream_t stream) {
  if (a.out.dtype == Dtype::F32) {
    if constexpr (kHasF32Out<D>) return forward_elems<F32Out<T>, D>(a, dev, stream);
    throw Error("cutlass-sm90: no f32 output at this head_dim");
  }
  if constexpr (kOwnDV<D> > 0)
    if (own_dv<D>(a)) return forward_elems<SameDV<T, kOwnDV<D>>, D>(a, dev, stream);
  if constexpr (D == 64)
    if (small_forward<Same<T>, D>(a, dev, stream)) return;
  forward_elems<Same<T>, D>(a, dev, stream);
}

// E4M3 Q, K, V; O in a.out.dtype. Accurate mode (E4m3: P·V in f16) or fast mode (E4m3Fast:
// P·V in e4m3), each instantiated in its own translation unit (instantiate_e4m3*.cu.in).
template <typename Out, int D, bool kFast>
using E4m3Of = std::conditional_t<kFast, E4m3Fast<Out>, E4m3<Out, D>>;

template <int D, bool kFast>
std::string can_implement_e4m3(const FwdArgs& a, const DeviceInfo& dev) {
  if (a.out.dtype == Dtype::F16)
    return can_implement_elems<E4m3Of<cute::half_t, D, kFast>, D>(a, dev);
  if (a.out.dtype == Dtype::BF16)
    return can_implement_elems<E4m3Of<cute::bfloat16_t, D, kFast>, D>(a, dev);
  return "e4m3: out_dtype must be f16 or bf16";
}

// Accurate mode at D = 64 takes the small-problem path where it applies, as 16-bit inputs do.
template <int D, bool kFast>
void forward_e4m3(const FwdArgs& a, const DeviceInfo& dev, cudaStream_t stream) {
  const auto run = [&](auto elems) {
    using E = decltype(elems);
    if constexpr (D == 64 && !kFast)
      if (small_forward<E, D>(a, dev, stream)) return;
    forward_elems<E, D>(a, dev, stream);
  };
  if (a.out.dtype == Dtype::F16) return run(E4m3Of<cute::half_t, D, kFast>{});
  if (a.out.dtype == Dtype::BF16) return run(E4m3Of<cute::bfloat16_t, D, kFast>{});
  throw Error("cutlass-sm90 e4m3: out_dtype must be f16 or bf16");
}

template <class E, int D>
void push_elems_attributes(std::vector<KernelAttr>& out, const char* name) {
  const auto fn = [](auto m) {
    return reinterpret_cast<const void*>(fwd_kernel<E, D, decltype(m)>);
  };
  if constexpr (E::kFp8 || E::kF32Out) {
    const void* const fns[2] = {fn(mask::NoMask<int>{}), fn(mask::CausalBottomRight<int>{})};
    push_attributes(out, "cutlass-sm90", name, D, fns, TileConfig<E, D>::kSmemBytes);
  } else {
    using B = BandElems<E, D>;
    const void* const fns[3] = {fn(mask::NoMask<int>{}), fn(mask::CausalBottomRight<int>{}),
                                reinterpret_cast<const void*>(fwd_kernel<B, D, mask::Band<int>>)};
    const int32_t smem[3] = {TileConfig<E, D>::kSmemBytes, TileConfig<E, D>::kSmemBytes,
                             TileConfig<B, D>::kSmemBytes};
    push_attributes(out, "cutlass-sm90", name, D, fns, smem);
  }
}

template <typename T, int D>
void attributes(std::vector<KernelAttr>& out, const DeviceInfo&) {
  push_elems_attributes<Same<T>, D>(out, dtype_name<T>());
  if constexpr (kHasF32Out<D>)
    push_elems_attributes<F32Out<T>, D>(out,
                                        std::is_same_v<T, cute::half_t> ? "f16_f32" : "bf16_f32");
  if constexpr (D == 64) small_attributes<Same<T>, D>(out, dtype_name<T>());
  if constexpr (kOwnDV<D> > 0)
    push_elems_attributes<SameDV<T, kOwnDV<D>>, D>(
        out, std::is_same_v<T, cute::half_t> ? "f16_dv128" : "bf16_dv128");
}

template <int D, bool kFast>
void attributes_e4m3(std::vector<KernelAttr>& out, const DeviceInfo&) {
  push_elems_attributes<E4m3Of<cute::half_t, D, kFast>, D>(out,
                                                           kFast ? "e4m3_fast_f16" : "e4m3_f16");
  push_elems_attributes<E4m3Of<cute::bfloat16_t, D, kFast>, D>(
      out, kFast ? "e4m3_fast_bf16" : "e4m3_bf16");
  if constexpr (D == 64 && !kFast) {
    small_attributes<E4m3Of<cute::half_t, D, false>, D>(out, "e4m3_f16");
    small_attributes<E4m3Of<cute::bfloat16_t, D, false>, D>(out, "e4m3_bf16");
  }
}

}  // namespace sdpa::cutlass_sm90
