// CUTLASS/CuTe backend for sm_80 and later (A100, A10/A40/RTX 30xx = sm_86, L4/L40 = sm_89, and
// Hopper as a fallback and comparison point): FlashAttention-2 style forward on mma.sync.
// Assumes validated arguments (crates/sdpa/src/problem/mod.rs): head_dims <= D, 16-byte aligned
// rows, strides in elements, heads % kv_heads == 0, seq_q, seq_k >= 1, scale > 0.
//
// Shipping configuration (forward() below): one CTA = BM = 64 query rows of one (batch, head), 4
// warps of 16 rows each (one m16n8k16 M strip). Every warp sweeps all key tiles for its own rows,
// so the online softmax never merges state across warps, and 16 rows a warp keep the Q fragments in
// registers for the whole sweep (D = 128: O 64 + Q 32 + S 32 registers + fragments, 214-223 in
// all; D = 96: O 48 + Q 24 + S 32, 188-221). The kernel is templated on warps per CTA (W = 4, 8)
// and strips per warp (MT = 1, 2: MT = 2 is FlashAttention-2's 32 rows a warp); all were checked
// and timed (docs/log/2026-11-notebook.md, "Figures that lived in code comments"). W4 MT1 is best
// or close everywhere and clearly best causal and on small grids: several independent 4-warp CTAs
// per SM (on an H200, D = 64: 3, D = 128: 2) overlap one CTA's softmax with another's mma, where 8
// warps behind one __syncthreads per tile move in lockstep; 64-row CTAs also make twice the CTAs
// for short sequences and cut the causal diagonal waste. At D = 128 a CTA takes 96 KB, so an A100
// (164 KB per SM) or sm_86 / sm_89 (100 KB) SM holds only one, and at D = 96 (72 KB) an sm_86 /
// sm_89 SM: there W8 MT1 (one 8-warp CTA, 128 rows) ships instead, not 4 warps per SM. MT = 2
// reuses each K/V fragment for two strips (half the ldmatrix traffic) but needs 255 registers: at
// D = 128 Q no longer fits and is re-read from its own buffer, with 32-key tiles to avoid spilling.
//
// Keys come in tiles of BN = 64 through a ring of 3 cp.async stages (each stage: the K tile, then
// the V tile, [BN][D] with d contiguous), one __syncthreads per tile. Per tile and warp:
//   S = Q·Kᵀ    mma.sync m16n8k16 (CuTe's SM80_16x8x16_F32{F16,BF16}..._TN atoms): Q fragments
//               (A) loaded once by ldmatrix.x4, K fragments (B) by ldmatrix.x4 from K [key][d],
//               which is exactly the "col" B operand;
//   softmax     on the S accumulator in registers (m16n8 C fragment: each thread holds 2 rows,
//               a row lives in the 4 lanes of a quad), f32, log2 domain, scale·log2(e) folded
//               into one FFMA before exp2; the O rescale is skipped (exactly) when no row max
//               of the strip moved, which is most tiles once the sweep is under way;
//   O += P·V    P converted to f16/bf16 in registers is the A operand as is (two adjacent n8
//               C tiles are one k16 A tile), V fragments by ldmatrix.x4.trans from V [key][d].
// The fragments are indexed by hand (lane -> row/column maps below, from the PTX ISA fragment
// layouts) and the CuTe atoms called directly (SM75_U32x4_LDSM_N, SM75_U16x8_LDSM_T,
// SM80_CP_ASYNC_CACHEGLOBAL_ZFILL, the mma atoms): the same instructions CuTe's TiledMMA /
// TiledCopy partitioning would emit, at a fraction of the front-end time (that partitioning is
// heavy template instantiation in every device pass and file) and with every address register in
// view.
//
// Shared memory tiles are row-major [rows][D] with each row's 16-byte chunks XOR-swizzled
// (Cfg::off: at D = 64 and 128 CuTe's Swizzle<3, 3, log2(D) - 3>, chunk c of row r stored at chunk
// c ^ (r % 8); at D = 96, 192-byte rows, at c ^ ((r / 2) % 4)), so the 16-byte cp.async writes, the
// ldmatrix row reads (plain and transposed: 8 rows of one chunk column) and the epilogue's 4-byte
// writes are all free of bank conflicts. Q is staged through the last stage's buffer (it is in
// registers before that stage is first filled), so shared memory is 3 x 2 x BN x D elements: 48 KB
// (D = 64), 72 KB (D = 96) and 96 KB (D = 128), which still fits the 99 KB per-block limit of sm_86
// / sm_89 (a mask that hides keys adds 3·D bytes, the non-finite V records below). The output is
// staged through the same buffer.
//
// Masks: the kernel is templated on a mask policy of common/mask.cuh (Index int), built in
// forward() from a.mask.kind and passed in Params, and asks it which keys the CTA and each warp
// see, which tiles need masking and each row's visible keys. The general path (mask::Band: windows,
// top-left causal, and any mask with softcap or ALiBi) masks both edges of a row's band, turns
// the scores into log2-domain logits first where a softcap or ALiBi is on (common/score_mods.cuh;
// the softmax then runs with scale 1), and checks V tiles its lower edge crosses too. Every
// instantiation writes the log-sum-exp where asked for.
//
// Sequences of different lengths (packed Q or K/V, a paged cache, seqused_k; common/seqs.cuh) run
// on the general path (mask::needs_band), so the plain kernels keep their registers: each CTA
// finds its sequence's offsets and lengths, rebases the band to them and returns at once past its
// queries; a paged cache's K/V rows come through the block table, one lookup a copy pass.
//
// Head dims of no instance (80, 112, ...) and V of another head dim than Q and K (DeepSeek's
// 192 / 128) run on the general path of the narrowest instance as wide as both (api.cu picks
// it): Q's, K's and V's chunks past their own head dim are zero-filled by the copies (nothing is
// read there), so those columns add 0 to Q·Kᵀ and leave O's columns past head_dim_v 0, which
// the epilogue does not store (Params::cols). The mma work is the instance's.
//
// Head dims 192 and 256 keep O (96 and 128 registers) but not Q in registers: Q has a buffer of
// its own and its fragments are re-read per k-block; two K/V stages (120 and 160 KB with Q) fit
// an A100 or Hopper SM once.
//
// Partial tiles: cp.async with src-size 0 zero-fills rows past seq_q / seq_k (nothing is read
// there); scores of keys >= seq_k and of keys the mask hides are set to -inf before the softmax;
// stores are predicated per row. CTAs load only the key tiles of their rows' key range, each warp
// also skips the tiles past its own rows' range, and under a mask that hides keys CTAs are
// launched last query block first (under a causal mask, the heaviest first). Offsets into
// Q/K/V/O are 64-bit, but seq_q, seq_k and the row and key indices are int and reach up to a tile
// past the end: seq_q, seq_k <= 2^31 - 128; the grid is (query tiles, heads, batch), heads and
// batch <= 65535 (checked by can_implement, below).
//
// The non-finite V check (common/nonfinite.cuh), under a mask that hides keys: a V tile partly
// masked for the CTA (the mask's first_partial_tile on) is checked for Inf/NaN by the threads that
// copied it, the OR folded into the tile's barrier; in the rare case it has some, they are recorded
// per column and zeroed before any P·V reads the tile, and after its P·V every O element adds its
// row's reference term.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include <atomic>
#include <cstdint>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "common/attributes.cuh"
#include "common/check.cuh"
#include "common/ex2.cuh"
#include "common/launch.cuh"
#include "common/limits.cuh"
#include "common/mask.cuh"
#include "common/nonfinite.cuh"
#include "common/score_mods.cuh"
#include "common/seqs.cuh"
#include "common/sinks.cuh"
#include "common/smem.cuh"
#include "cutlass/dtype.cuh"

// The kernel bodies exist in every device pass from sm_80 on (sm_80 and sm_90a in the default
// "80;90a" build); the host side refuses to launch below sm_80.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define SDPA_SM80_DEVICE 1
#endif

namespace sdpa::cutlass_sm80 {

template <typename T>
struct MmaOp;
template <>
struct MmaOp<cute::half_t> {
  using type = cute::SM80_16x8x16_F32F16F16F32_TN;
};
template <>
struct MmaOp<cute::bfloat16_t> {
  using type = cute::SM80_16x8x16_F32BF16BF16F32_TN;
};

// d += a·b on one m16n8k16 tile (f32 accumulators in place).
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  MmaOp<T>::type::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0], d[1], d[2],
                      d[3]);
}

template <typename T>
__device__ __forceinline__ void ldsm(uint32_t (&r)[4], const T* p) {
  cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(p), r[0], r[1], r[2],
                                r[3]);
}
template <typename T>
__device__ __forceinline__ void ldsm_t(uint32_t (&r)[4], const T* p) {
  cute::SM75_U16x8_LDSM_T::copy(*reinterpret_cast<const cute::uint128_t*>(p), r[0], r[1], r[2],
                                r[3]);
}
// The same by 32-bit shared address, for kernels that form the addresses themselves.
__device__ __forceinline__ void ldsm(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.x4.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.x4.trans.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// 16 bytes global -> shared, zero-filled (and nothing read) when !pred.
template <typename T>
__device__ __forceinline__ void cp_async16(T* smem, const T* gmem, bool pred) {
  cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
      *reinterpret_cast<const cute::uint128_t*>(gmem), *reinterpret_cast<cute::uint128_t*>(smem),
      pred);
}

// 16 bytes of shared memory, ordered after the cp.async.wait_group before it (CuTe's wait has
// no memory clobber; volatile asm statements keep their order).
__device__ __forceinline__ uint4 lds16(const void* p) {
  return ld_shared_128(static_cast<uint32_t>(__cvta_generic_to_shared(p)));
}

// Tile configuration: W warps of MT m16 strips (16·MT query rows) each.
template <typename T, int D, int W, int MT>
struct Cfg {
  static_assert(D == 64 || D == 96 || D == 128 || D == 192 || D == 256,
                "head_dim 64, 96, 128, 192 or 256 (the swizzle below)");
  static_assert((W == 4 || W == 8) && (MT == 1 || MT == 2) && W * MT <= 8, "W x MT");
  static constexpr int kWarps = W;
  static constexpr int kThreads = 32 * W;
  static constexpr int kWM = 16 * MT;  // query rows per warp
  static constexpr int kBM = kWM * W;
  // Q fragments stay in registers unless that would not fit (D = 128 with 32 rows a warp:
  // O 128 + S 64 + Q 64 registers; D = 192 and 256, whose O alone takes 96 and 128); then they
  // are re-read from a Q buffer of their own, and at D = 128 key tiles shrink to 32 (S 32
  // registers) to stay within 255 registers without spilling.
  static constexpr bool kQReg = D <= 128 && (MT == 1 || D == 64);
  static constexpr int kBN = kQReg || D > 128 ? 64 : 32;
  // 3 stages; Q shares the last one when it goes to registers (D = 128: 96 KB), else it has its
  // own buffer (D = 128, 32-key tiles: 80 KB). Both fit the 99 KB per block of sm_86 / sm_89.
  // D = 192 and 256 take 2 stages and Q's buffer (120 and 160 KB): an A100 or a Hopper part
  // holds one such CTA per SM, sm_86 / sm_89 none (can_implement says so).
  static constexpr int kStages = D > 128 ? 2 : 3;
  // CTAs per SM the register budget must allow: W4 MT1 D = 64 three (<= 170 registers; it
  // needs 128-167), the others as many as 255 registers a thread permit. (W4 MT1 D = 96 under
  // the three-CTA cap of 168 registers spills 40 bytes non-causal, so it asks for two.)
  static constexpr int kMinBlocks = W == 8 || D > 128 ? 1 : (MT == 2 ? 2 : (D == 64 ? 3 : 2));

  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  // Threads per row in the copies (global -> shared, and the output's shared -> global): thread
  // i of a row copies its chunks i, i + kRowThreads, ... (kRowReps of them). Every chunk of the
  // row at D = 64 and 128; at D = 96 one chunk of each aligned group of four and at D = 192 of
  // each group of eight, since 12 or 24 threads a row do not divide a warp and the swizzle
  // permutes chunks within such a group; at D = 256 two chunks 16 apart (a pass then still
  // covers 8 rows, one swizzle period).
  static constexpr int kRowThreads = D == 96 ? 4 : D == 192 ? 8 : D == 256 ? 16 : kChunks;
  static constexpr int kRowReps = kChunks / kRowThreads;
  static constexpr int kPassRows = kThreads / kRowThreads;  // rows one cp.async pass covers
  static_assert(kChunks % kRowThreads == 0 && 32 % kRowThreads == 0, "rows of whole threads");
  static_assert(kPassRows % 8 == 0, "a pass must keep each thread's swizzle phase");
  static constexpr int kTileElems = kBN * D;          // one K or V tile
  static constexpr int kStageElems = 2 * kTileElems;  // K then V
  static constexpr int kQOffset = kQReg ? (kStages - 1) * kStageElems : kStages * kStageElems;
  static constexpr int kSmemBytes =
      (kStages * kStageElems + (kQReg ? 0 : kBM * D)) * int(sizeof(T));
  static_assert(!kQReg || kBM * D <= kStageElems, "Q is staged in one K/V stage");
  static_assert(kBM % kPassRows == 0 && kBN % kPassRows == 0, "tiles of whole passes");
  // Launches under a mask that hides keys add the non-finite V check's records of the current V
  // tile after the stages (3·D bytes): they live from before the tile's first P·V to after its
  // last, when every stage is busy. D = 128: 96.4 KB, still within sm_86 / sm_89's 99 KB. A band
  // (mask::Band) also records the last non-finite key of each column (another 3·D bytes).
  static_assert(kBN < kNoKey, "tile-relative keys must fit NonFiniteCols");
  static constexpr int kSmemBytesMasked = kSmemBytes + int(sizeof(NonFiniteCols<D>));
  static constexpr int kSmemBytesBand = kSmemBytes + 2 * int(sizeof(NonFiniteCols<D>));
  static_assert(D > 128 || kSmemBytesBand <= 99 * 1024, "shared memory over sm_86 / sm_89's limit");

  static constexpr int kQK = D / 16;    // k-blocks of Q·Kᵀ
  static constexpr int kSN = kBN / 8;   // n8 tiles of S
  static constexpr int kPV = kBN / 16;  // k-blocks of P·V
  static constexpr int kON = D / 8;     // n8 tiles of O
  // ldmatrix fragments issued ahead of the mma that consumes them (x4 loads).
  static constexpr int kAheadK = 2;
  static constexpr int kAheadV = 2;

  // Shared-memory tiles are [rows][D], chunk c of row r stored at chunk c ^ phase(r): ldmatrix
  // reads 8 rows of one chunk column, cp.async writes rows of chunks, and each must hit 8 distinct
  // 16-byte bank groups (of the 8 in a 128-byte line).
  //   D = 64, 128, 192, 256 (rows of a multiple of 128 bytes, every row starting in bank group
  //   0): phase r % 8 spreads the 8 rows over the 8 groups (at D = 64, 128, 256 CuTe's
  //   Swizzle<3, 3, log2(D) - 3> on the element offset).
  //   D = 96 (192-byte rows): row r starts in group 4 (r % 2), so rows r and r + 1 already fall in
  //   opposite halves of the line; phase (r / 2) % 4 then spreads each half's 4 rows over its 4
  //   groups. The XOR only touches a chunk's low two bits, so it stays in its aligned group of four
  //   and a row stays 12 chunks wide. (FlashAttention-2 stores this head dim as 64-byte column
  //   blocks under Swizzle<2, 3, 3>, the same permutation per 8-row block; one [rows][96] tile
  //   keeps this kernel's addressing: a row step is row · D, whatever D.)
  static __device__ __forceinline__ int phase(int row) {
    return D == 96 ? (row >> 1) & 3 : row & 7;
  }
  static_assert(D != 96 || kRowThreads == 4, "the D = 96 phase permutes within groups of four");
  static_assert(D == 96 || kRowThreads % 8 == 0, "the phase permutes within groups of eight");
  // Element offset of (row, col).
  static __device__ __forceinline__ int off(int row, int col) {
    return row * D + (col ^ (phase(row) << 3));
  }
};

// Non-finite V check, step 1, between the cp.async wait and the barrier of a V tile: whether the
// 16-byte chunks of it that load_kv made this thread copy (the first at `v`, the others kRowThreads
// chunks and kPassRows rows apart) hold an Inf or a NaN. wait_group makes a thread's own copies
// visible to it, so the check needs no barrier of its own: the tile's barrier ORs it over the CTA.
// Rows past seq_k are zero-filled: finite.
template <typename T, int D, int W, int MT>
__device__ __forceinline__ bool own_v_chunks_nonfinite(const T* v) {
  using C = Cfg<T, D, W, MT>;
  constexpr bool kBf16 = std::is_same_v<T, cute::bfloat16_t>;
  uint32_t bits = 0;
#pragma unroll
  for (int i = 0; i < C::kBN / C::kPassRows; ++i)
#pragma unroll
    for (int j = 0; j < C::kRowReps; ++j)
      bits |= nonfinite8_bits<kBf16>(lds16(v + i * C::kPassRows * D + j * C::kRowThreads * 8));
  return (bits & kNonFinite2Bits) != 0;
}

// Non-finite V check, step 2 (rare: some thread found a non-finite value in V tile `v`): one thread
// per column records the first NaN, +Inf and -Inf of its column into c (with kLast the last ones
// into last too) and zeroes them, reading V[key][col] where load_kv put it (C::off).
template <typename T, int D, int W, int MT, bool kLast>
__device__ __forceinline__ void record_and_zero(T* v, NonFiniteCols<D>& c, NonFiniteCols<D>& last,
                                                int tid) {
  using C = Cfg<T, D, W, MT>;
  constexpr bool kBf16 = std::is_same_v<T, cute::bfloat16_t>;
  uint16_t* const v16 = reinterpret_cast<uint16_t*>(v);
#pragma unroll 1
  for (int col = tid; col < D; col += C::kThreads) {
    c.first[0][col] = c.first[1][col] = c.first[2][col] = kNoKey;
    if constexpr (kLast) last.first[0][col] = last.first[1][col] = last.first[2][col] = kNoKey;
#pragma unroll 1
    for (int key = 0; key < C::kBN; ++key) {
      uint16_t& x = v16[C::off(key, col)];
      if (record_nonfinite<kBf16, D>(c, key, col, x)) {
        if constexpr (kLast) last.first[nonfinite_kind<kBf16>(x) - 1][col] = uint8_t(key);
        x = 0;
      }
    }
  }
}

// The 16-byte chunks of a row a narrowed problem (mask::narrowed) has of the tile's D: Q's and
// K's, and V's and the output's. The copies zero-fill the others (nothing is read there) and the
// epilogue does not store them.
struct RowChunks {
  int qk, v;
};

// The passes of key tile n (keys n·BN ..) one thread copies: pass(i, k, v) with its row
// crow + i·P of K and V, from the thread's first row's chunk kg, vg. `rows`: the sequence's keys
// from the thread's first row of the tile (pass i is in bounds iff i·P < rows). A paged cache's
// rows come from its block table (a pass out of bounds gets row 0, whose chunks are never read),
// a dense tile's by stepping two pointers. The cache's kind is decided once a tile, not once a
// pass: the dense passes are one straight block of copies.
template <int BN, int P, typename E, class Pass>
__device__ __forceinline__ void tile_passes(bool paged, const E* kg, const E* vg, const Strides& ks,
                                            const Strides& vs, const SeqParams& seqs, int b, int n,
                                            int crow, int rows, const Pass& pass) {
  if (paged) {
#pragma unroll
    for (int i = 0; i < BN / P; ++i) {
      const int64_t row = i * P < rows ? seqs.paged_row(b, n * BN + i * P + crow) : 0;
      pass(i, kg + row * ks.seq, vg + row * vs.seq);
    }
  } else {
    const E* k = kg + int64_t(n * BN) * ks.seq;
    const E* v = vg + int64_t(n * BN) * vs.seq;
#pragma unroll
    for (int i = 0; i < BN / P; ++i, k += P * ks.seq, v += P * vs.seq) pass(i, k, v);
  }
}

// Global -> shared copies of K/V tiles (the prefill and decode kernels; C: the tile
// configuration): thread tid copies chunks tid % RT + j·RT of rows tid / RT + i·kPassRows. A pass
// moves 8k rows and a chunk stays in its group under the swizzle, so the swizzled destination only
// advances by whole rows and RT chunks. The per-thread base pointers stay live across the sweep;
// a tile's rows come from tile_passes.
// kNarrow: K's and V's rows have the chunks `cols` says, fewer than the tile's.
template <class C, typename T, bool kNarrow = false>
struct KvCopy {
  int crow, c_soff;  // this thread's first row, and its chunk's swizzled offset in that row
  const T *kg, *vg;  // its first row's chunk in K and V (a paged cache: row 0's)
  bool paged;
  int cchunk;
  RowChunks cols;

  __device__ __forceinline__ KvCopy(const T* k, const T* v, const Strides& ks, const Strides& vs,
                                    int b, int hk, int k0, bool paged_, int tid,
                                    RowChunks cols_ = {C::kChunks, C::kChunks})
      : crow(tid / C::kRowThreads), paged(paged_), cchunk(tid % C::kRowThreads), cols(cols_) {
    c_soff = C::off(crow, cchunk * 8);
    const int64_t first_row = paged ? 0 : int64_t(k0) + crow;
    kg = k + (int64_t(b) * ks.batch + int64_t(hk) * ks.head + first_row * ks.seq + cchunk * 8);
    vg = v + (int64_t(b) * vs.batch + int64_t(hk) * vs.head + first_row * vs.seq + cchunk * 8);
  }

  // Key tile n (keys n·BN ..) of sequence b into `stage` (K, then V), rows past seq_k zero-filled
  // (nothing is read there).
  __device__ __forceinline__ void load(T* stage, int n, int seq_k, const Strides& ks,
                                       const Strides& vs, const SeqParams& seqs, int b) const {
    constexpr int BN = C::kBN, P = C::kPassRows, RT = C::kRowThreads, D = C::kChunks * 8;
    const int rows = seq_k - n * BN - crow;  // pass i is in bounds iff i·P < rows
    T* const sk = stage + c_soff;
    // Pass i: the chunks at k and v (this thread's row chunk) into the stage's rows i·P + crow.
    const auto pass = [&](int i, const T* k, const T* v) {
      const bool in = i * P < rows;
#pragma unroll
      for (int j = 0; j < C::kRowReps; ++j) {
        const int c = cchunk + j * RT;
        cp_async16(sk + i * P * D + j * RT * 8, k + j * RT * 8, in && (!kNarrow || c < cols.qk));
        cp_async16(sk + C::kTileElems + i * P * D + j * RT * 8, v + j * RT * 8,
                   in && (!kNarrow || c < cols.v));
      }
    };
    tile_passes<BN, P>(paged, kg, vg, ks, vs, seqs, b, n, crow, rows, pass);
  }
};

// The row state before the first key: O = 0, running max -inf, sum 0 (MT strips, kON n8 tiles).
template <int MT, int kON>
__device__ __forceinline__ void start_rows(float (&o)[MT][kON][4], float (&m_run)[MT][2],
                                           float (&l_run)[MT][2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int j = 0; j < kON; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m_run[mt][r] = -INFINITY;
      l_run[mt][r] = 0.f;
    }
  }
}

// One m16 strip's online-softmax step (the prefill and decode kernels): S (kSN n8 tiles of the
// accumulator, already masked) becomes P = exp2(S·sl2 - max·sl2) in place; the running max m
// (raw units) and this thread's part of the row sum l advance; O (kON n8 tiles) is rescaled.
// r = 0 is row g of the strip, r = 1 row g + 8; a row lives in the 4 lanes of a quad.
template <int kSN, int kON>
__device__ __forceinline__ void softmax_step(float (&sacc)[kSN][4], float (&m_run)[2],
                                             float (&l_run)[2], float (&o)[kON][4], float sl2) {
  float alpha[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = m_run[r];
#pragma unroll
    for (int j = 0; j < kSN; ++j) mx = fmaxf(mx, fmaxf(sacc[j][2 * r], sacc[j][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // A row with nothing visible yet keeps m = -inf: exponents stay -inf, p = 0, not NaN.
    // mx·sl2 carried as hi + lo (rounded product and its exact residual): every exponent
    // fma(x, sl2, -hi) - lo is exact enough at any logit size, the max's exactly 0. A single
    // FMA with a rounded base leaves the max the base's rounding residual: past ~2^24 whole
    // powers of two, p = 0 or inf (tests/numerics.rs, logits 1e8-1e10). The extra FADD is
    // cheap here, where sm90's form (single FMA unless a warp votes for the exact one) and a
    // branch per row cost this kernel far more (measured: docs/log/2026-11-notebook.md,
    // "softmax exponents at huge logits").
    const float hi = mx == -INFINITY ? 0.f : __fmul_rn(mx, sl2);
    const float lo = mx == -INFINITY ? 0.f : fmaf(mx, sl2, -hi);
    // Exactly 1 when the max did not move (also for -inf == -inf: O and l are still 0).
    alpha[r] = mx == m_run[r] ? 1.f : ex2(fmaf(m_run[r], sl2, -hi) - lo);
    m_run[r] = mx;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kSN; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = ex2(fmaf(sacc[j][2 * r + e], sl2, -hi) - lo);
        sacc[j][2 * r + e] = x;
        sum += x;
      }
    }
    l_run[r] = fmaf(l_run[r], alpha[r], sum);  // this thread's part; quad-summed last
  }
  // O *= alpha, skipped (exactly) when no row max of the warp's strip moved.
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int j = 0; j < kON; ++j) {
      o[j][0] *= alpha[0];
      o[j][1] *= alpha[0];
      o[j][2] *= alpha[1];
      o[j][3] *= alpha[1];
    }
  }
}

template <typename T, class Mask>
struct Params {
  const T *q, *k, *v;
  T* o;
  Strides qs, ks, vs, os;
  // The mask holds seq_q and seq_k, 32-bit: the Rust layer bounds them (see the header). The
  // kernel reads them from it alone, so that its bounds and the mask's tests share their loads.
  Mask mask;
  int group;
  float scale_log2;  // scale * log2(e)
  float* lse;        // null: none; [batch][heads][seq_q]
  int heads;
  // Band only (the general path): softcap · log2 e (0: none), ALiBi slopes (null: none) of
  // (b, h) at b * alibi_bstride + h.
  float cap2;
  const float* alibi;
  int alibi_bstride;
  const float* sinks;  // [heads] sink logits (null: none), folded in at the end
  SeqParams seqs;      // sequences of different lengths (dense: every offset 0)
  RowChunks cols;      // Band only: the problem's own chunks of a row (mask::narrowed)
};

// CTAs per SM a kernel's registers must allow: the Cfg's, but at most two for the general path
// (at D = 64 it needs ~175 registers: the band's edges, score mods and sequences).
template <class C, class Mask>
constexpr int kMinBlocks = mask::kIsBand<Mask> && C::kMinBlocks > 2 ? 2 : C::kMinBlocks;

template <typename T, int D, class Mask, int W, int MT>
__global__ void __launch_bounds__(Cfg<T, D, W, MT>::kThreads, kMinBlocks<Cfg<T, D, W, MT>, Mask>)
    fwd_kernel(const __grid_constant__ Params<T, Mask> p) {
#ifdef SDPA_SM80_DEVICE
  using C = Cfg<T, D, W, MT>;
  constexpr int BM = C::kBM, BN = C::kBN, S = C::kStages, WM = C::kWM;
  constexpr int RT = C::kRowThreads, RR = C::kRowReps;
  constexpr int kQK = C::kQK, kSN = C::kSN, kPV = C::kPV, kON = C::kON;
  constexpr bool kQReg = C::kQReg;
  constexpr bool kBand = mask::kIsBand<Mask>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  T* const smem = reinterpret_cast<T*>(smem_raw);
  T* const sQ = smem + C::kQOffset;  // Q, then the output staging tile

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // mma fragment row group / column pair
  const int m_block = Mask::kMasksKeys ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
  const int h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const int m0 = m_block * BM;
  // Sequence b (common/seqs.cuh; the general path only): its queries from row q0, its keys from
  // k0 or in pages; the grid covers the longest, and the mask is rebased to this one's lengths.
  Seq<int> seq{0, 0, p.mask.seq_q, p.mask.seq_k};
  if constexpr (kBand) {
    seq = seq_of<int>(p.seqs, b, p.mask.seq_q, p.mask.seq_k);
    if (m0 >= seq.seq_q) return;  // CTA-uniform, before any barrier
  }
  const Mask mask = kBand ? p.mask.rebased(seq.seq_q, seq.seq_k) : p.mask;
  const int seq_q = mask.seq_q, seq_k = mask.seq_k;
  // Key tiles [n_begin, n_tiles) hold the keys the CTA's rows see; the warp's rows need those
  // below w_tiles only (none for a warp past seq_q).
  const int n_begin = mask.key_begin(m0, BM) / BN;
  const int n_tiles = (mask.key_end(m0, BM) + BN - 1) / BN;
  const int wrow = WM * warp;  // the warp's first row within the CTA tile
  const int mw0 = m0 + wrow;
  const int w_end = mw0 < seq_q ? mask.key_end(mw0, WM) : 0;
  const int w_tiles = (w_end + BN - 1) / BN;
  // A band's warp also starts at its own first row's first key (0 for the other masks).
  const int w_first = mask.key_begin(mw0, WM) / BN;

  // The general path's score mods for this (batch, head); with them on, the scores become
  // log2-domain logits and the softmax runs with scale 1.
  ScoreMods mods{false, p.scale_log2, 0.f, false, 0.f, seq_k - seq_q};
  if constexpr (kBand) {
    mods.cap2 = p.cap2;
    mods.alibi = p.alibi != nullptr;
    if (mods.alibi) mods.slope2 = __ldg(p.alibi + b * p.alibi_bstride + h) * 1.4426950408889634f;
    mods.on = mods.cap2 > 0.f || mods.alibi;
  }
  const float sl2 = mods.on ? 1.f : p.scale_log2;

  // O accumulators: strip mt, n8 tile j, (row g: cols 2t, 2t+1; row g + 8: the same).
  float o[MT][kON][4], m_run[MT][2], l_run[MT][2];
  start_rows(o, m_run, l_run);

  if (n_begin < n_tiles) {
    const KvCopy<C, T, kBand> kv(p.k, p.v, p.ks, p.vs, b, hk, seq.k0, kBand && p.seqs.paged(), tid,
                                 kBand ? p.cols : RowChunks{C::kChunks, C::kChunks});
    const int crow = kv.crow, cchunk = tid % RT, c_soff = kv.c_soff;
    const auto load_kv = [&](int n, int s) {
      kv.load(smem + s * C::kStageElems, n, seq_k, p.ks, p.vs, p.seqs, b);
    };

    // Prologue: Q with the first K/V tile (group 0), then the next S-2, one commit group each.
    // Key tile n goes to stage (n - n_begin) % S.
    {
      const int rows = seq_q - m0 - crow;
      const int64_t qpass = int64_t(C::kPassRows) * p.qs.seq;
      const T* qp = p.q + int64_t(b) * p.qs.batch + int64_t(h) * p.qs.head +
                    int64_t(seq.q0 + m0 + crow) * p.qs.seq + cchunk * 8;
#pragma unroll
      for (int i = 0; i < BM / C::kPassRows; ++i) {
#pragma unroll
        for (int j = 0; j < RR; ++j)
          cp_async16(sQ + c_soff + i * C::kPassRows * D + j * RT * 8, qp + j * RT * 8,
                     i * C::kPassRows < rows && (!kBand || cchunk + j * RT < p.cols.qk));
        qp += qpass;
      }
    }
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
      if (n_begin + i < n_tiles) load_kv(n_begin + i, i);
      cute::cp_async_fence();
    }

    // ldmatrix lane -> row maps (PTX ISA m16n8k16 fragments; matrix i = lanes 8i .. 8i+7).
    //   A (Q):  matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15) -> a0 a1 a2 a3
    //   B (K):  matrices (k 0-7 | 8-15) x (keys 0-7 | 8-15) -> b0 b1 of key tile 0, then tile 1
    //   B (V, transposed): (keys 0-7 | 8-15) x (d 0-7 | 8-15) -> b0 b1 of d tile 0, then tile 1
    // In all three a lane reads row (lane % 8) + 8i, so its swizzle phase is C::phase(lane)
    // whatever the 8-row step: the address is a row offset (immediates, per step) plus the lane's
    // swizzled chunk, x_chunk(c) = (c ^ phase) · 8 elements = C::off(row, 8c) - row · D.
    // Spelled out like this the row steps become immediate offsets of one chunk address per
    // k-block (the compiler cannot see that a full Swizzle of (row + 16i, c) only adds 16i·D).
    const int swz = C::phase(lane);
    const auto x_chunk = [swz](int c) { return (c ^ swz) << 3; };
    const int q_row = wrow + (lane & 15), q_chunk = lane >> 4;
    const int k_row = (lane & 7) + ((lane >> 4) << 3), k_chunk = (lane >> 3) & 1;
    const int v_row = lane & 15, v_chunk = lane >> 4;
    const auto load_q = [&](uint32_t (&r)[4], int mt, int kb) {
      ldsm(r, sQ + (q_row + 16 * mt) * D + x_chunk(2 * kb + q_chunk));
    };

    uint32_t q[kQReg ? MT : 1][kQReg ? kQK : 1][4];  // Q fragments, for the whole sweep
    // The first key tile holding a key (< seq_k) that some row of the CTA does not see: it and the
    // tiles after it are partly masked (the non-finite V check; under a causal mask the last one
    // or two tiles unless seq_q > seq_k); n_tiles if none. A band's tiles before t_lower are
    // partly masked too (its lower edge). CTA-uniform.
    const int t_diag = mask.first_partial_tile(m0, BN, n_tiles);
    int t_lower = 0;
    if constexpr (kBand) t_lower = mask.lower_partial_end(m0, BM, BN);
    NonFiniteCols<D>* const nf_recs = reinterpret_cast<NonFiniteCols<D>*>(smem_raw + C::kSmemBytes);
    NonFiniteCols<D>& nf = nf_recs[0];
    NonFiniteCols<D>& nf_last = nf_recs[kBand ? 1 : 0];  // a band's last records

    for (int n = n_begin; n < n_tiles; ++n) {
      const int s = (n - n_begin) % S;
      cute::cp_async_wait<S - 2>();  // tile n (and Q) landed for this thread's copies ...
      // ... and everyone's (the barrier); the previous tile's stage is free again. On a partly
      // masked tile the barrier also says whether V holds an Inf or a NaN (CTA-uniform).
      bool nonfinite = false;
      if (Mask::kMasksKeys && (n >= t_diag || n < t_lower))
        nonfinite = __syncthreads_or(own_v_chunks_nonfinite<T, D, W, MT>(
                        smem + s * C::kStageElems + C::kTileElems + c_soff)) != 0;
      else
        __syncthreads();
      if constexpr (kQReg) {
        if (n == n_begin) {
#pragma unroll
          for (int mt = 0; mt < (kQReg ? MT : 1); ++mt)
#pragma unroll
            for (int kb = 0; kb < (kQReg ? kQK : 1); ++kb) load_q(q[mt][kb], mt, kb);
          __syncthreads();  // Q's buffer is stage S - 1, refilled just below
        }
      }
      if (n + S - 1 < n_tiles) load_kv(n + S - 1, (n - n_begin + S - 1) % S);
      cute::cp_async_fence();
      if (Mask::kMasksKeys && nonfinite) {  // rare; CTA-uniform
        record_and_zero<T, D, W, MT, kBand>(smem + s * C::kStageElems + C::kTileElems, nf, nf_last,
                                            tid);
        __syncthreads();  // V is finite before any P·V reads it; nf is complete
      }
      if (n >= w_tiles || n < w_first) continue;  // outside this warp's rows' keys

      const T* const sK = smem + s * C::kStageElems;
      const T* const sV = sK + C::kTileElems;

      // S = Q·Kᵀ. Step i = (kb, key pair kp): one ldmatrix.x4 of K, 2·MT mma; K fragments are
      // issued kAheadK steps ahead, Q fragments (when re-read) at the k-block's first step. All
      // indices are compile-time: the arrays live in registers. (ptxas schedules the ldmatrix
      // freely anyway: the look-ahead changes neither registers nor spills.)
      float sacc[MT][kSN][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < kSN; ++j)
          sacc[mt][j][0] = sacc[mt][j][1] = sacc[mt][j][2] = sacc[mt][j][3] = 0.f;
      {
        constexpr int kKP = kSN / 2;
        constexpr int kSteps = kQK * kKP;
        uint32_t kf[kSteps][4];
        uint32_t qf[kQReg ? 1 : kQK][MT][4];
        const auto load_k = [&](int i) {
          ldsm(kf[i], sK + (k_row + 16 * (i % kKP)) * D + x_chunk(2 * (i / kKP) + k_chunk));
        };
#pragma unroll
        for (int i = 0; i < C::kAheadK; ++i) load_k(i);
#pragma unroll
        for (int i = 0; i < kSteps; ++i) {
          const int kb = i / kKP, kp = i % kKP;
          if constexpr (!kQReg) {
            if (kp == 0) {
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) load_q(qf[kQReg ? 0 : kb][mt], mt, kb);
            }
          }
          if (i + C::kAheadK < kSteps) load_k(i + C::kAheadK);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const uint32_t (&a)[4] = kQReg ? q[mt][kQReg ? kb : 0] : qf[kQReg ? 0 : kb][mt];
            mma<T>(sacc[mt][2 * kp], a, kf[i][0], kf[i][1]);
            mma<T>(sacc[mt][2 * kp + 1], a, kf[i][2], kf[i][3]);
          }
        }
      }

      // Online softmax on the accumulator rows: r = 0 is row g, r = 1 row g + 8 of strip mt.
      const int n0 = n * BN;
      const bool edge = n0 + BN > seq_k || mask.tile_hides(mw0, WM, n0, BN);
      uint32_t pa[MT][kPV][4];  // P in T as the A operand of P·V
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (kBand && mods.on) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = mw0 + 16 * mt + g + 8 * r;
#pragma unroll
            for (int j = 0; j < kSN; ++j)
#pragma unroll
              for (int e = 0; e < 2; ++e)
                sacc[mt][j][2 * r + e] =
                    modded_logit(mods, sacc[mt][j][2 * r + e], row, n0 + 8 * j + 2 * t + e);
          }
        }
        if (edge) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = mw0 + 16 * mt + g + 8 * r;
            const int last = mask.last_key(row) - n0 - 2 * t;
            // Only a band hides keys below the row's first; its first key is 0 for the others.
            const int first = kBand ? mask.first_key(row) - n0 - 2 * t : 0;
#pragma unroll
            for (int j = 0; j < kSN; ++j) {
#pragma unroll
              for (int e = 0; e < 2; ++e)
                if (8 * j + e > last || (kBand && 8 * j + e < first))
                  sacc[mt][j][2 * r + e] = -INFINITY;
            }
          }
        }
        softmax_step<kSN, kON>(sacc[mt], m_run[mt], l_run[mt], o[mt], sl2);
        // k-block kb of P is S tiles 2kb (a0, a1) and 2kb + 1 (a2, a3).
#pragma unroll
        for (int kb = 0; kb < kPV; ++kb) {
          pa[mt][kb][0] = pack2<T>(sacc[mt][2 * kb][0], sacc[mt][2 * kb][1]);
          pa[mt][kb][1] = pack2<T>(sacc[mt][2 * kb][2], sacc[mt][2 * kb][3]);
          pa[mt][kb][2] = pack2<T>(sacc[mt][2 * kb + 1][0], sacc[mt][2 * kb + 1][1]);
          pa[mt][kb][3] = pack2<T>(sacc[mt][2 * kb + 1][2], sacc[mt][2 * kb + 1][3]);
        }
      }

      // O += P·V. Step i = (kb, d pair dp): one ldmatrix.x4.trans of V, 2·MT mma.
      {
        constexpr int kDP = kON / 2;
        constexpr int kSteps = kPV * kDP;
        uint32_t vf[kSteps][4];
        const auto load_v = [&](int i) {
          ldsm_t(vf[i], sV + (v_row + 16 * (i / kDP)) * D + x_chunk(2 * (i % kDP) + v_chunk));
        };
#pragma unroll
        for (int i = 0; i < C::kAheadV; ++i) load_v(i);
#pragma unroll
        for (int i = 0; i < kSteps; ++i) {
          if (i + C::kAheadV < kSteps) load_v(i + C::kAheadV);
          const int kb = i / kDP, dp = i % kDP;
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma<T>(o[mt][2 * dp], pa[mt][kb], vf[i][0], vf[i][1]);
            mma<T>(o[mt][2 * dp + 1], pa[mt][kb], vf[i][2], vf[i][3]);
          }
        }
      }

      // Non-finite V check, step 3 (rare): every O element adds what its row's visible keys of the
      // tile held before they were zeroed; O's fragment map is the one the mask and the epilogue
      // use. The next tiles' rescales and the final 1/l keep an Inf or a NaN as they are (the
      // factors are positive). nf is rewritten only past the next tile's barrier, when every warp
      // is through here.
      if (Mask::kMasksKeys && nonfinite) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            // The row's visible keys, tile-relative: the last < 0 none (nonfinite_term clamps).
            const int row = mw0 + 16 * mt + g + 8 * r;
            const int last = mask.last_key(row) - n0;
            if constexpr (kBand) {
              const int first = mask.first_key(row) - n0;
              if (last < first || last < 0 || first >= int(kNoKey)) continue;
#pragma unroll
              for (int j = 0; j < kON; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                  o[mt][j][2 * r + e] +=
                      band_nonfinite_term(nf, nf_last, 8 * j + 2 * t + e, first, last);
            } else {
#pragma unroll
              for (int j = 0; j < kON; ++j) {
                o[mt][j][2 * r] += nonfinite_term(nf, 8 * j + 2 * t, last);
                o[mt][j][2 * r + 1] += nonfinite_term(nf, 8 * j + 2 * t + 1, last);
              }
            }
          }
        }
      }
    }
    cute::cp_async_wait<0>();
    __syncthreads();  // every warp is done with every stage and with Q: sQ stages the output
  }

  // The sink joins each row (common/sinks.cuh), then O /= row sum (quad-reduced); a row with no
  // visible key and no sink has l = 0 and outputs zeros. Its log-sum-exp, where asked for:
  // ln 2 · (m · sl2 + log2 l), -inf with l = 0.
  const float sink = p.sinks != nullptr ? __ldg(p.sinks + h) : -INFINITY;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = l_run[mt][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      float m2 = m_run[mt][r] * sl2;
      const float a = fold_sink(m2, l, sink);
      const float inv = l > 0.f ? a / l : 0.f;
      const int row = wrow + 16 * mt + g + 8 * r;
      if (p.lse != nullptr && t == 0 && m0 + row < seq_q)
        p.lse[lse_index(p.seqs, seq, b, h, p.heads, p.mask.seq_q, m0 + row)] =
            l > 0.f ? (m2 + __log2f(l)) * 0.6931471805599453f : -INFINITY;
#pragma unroll
      for (int j = 0; j < kON; ++j)
        *reinterpret_cast<uint32_t*>(sQ + C::off(row, 8 * j + 2 * t)) =
            pack2<T>(o[mt][j][2 * r] * inv, o[mt][j][2 * r + 1] * inv);
    }
  }
  __syncwarp();
  // This warp's rows out, 16 bytes a lane (RT lanes a row, RR chunks each), predicated per row.
  {
    constexpr int kRowsPerStep = 32 / RT;
    static_assert(WM % kRowsPerStep == 0, "a warp's rows in whole steps");
    const int r0 = lane / RT, c = lane % RT;
    T* op = p.o + int64_t(b) * p.os.batch + int64_t(h) * p.os.head +
            int64_t(seq.q0 + mw0 + r0) * p.os.seq + c * 8;
    const int64_t ostep = int64_t(kRowsPerStep) * p.os.seq;
    const int rows = seq_q - mw0 - r0;
#pragma unroll
    for (int i = 0; i < WM / kRowsPerStep; ++i) {
      if (i * kRowsPerStep < rows) {
#pragma unroll
        for (int j = 0; j < RR; ++j)
          if (!kBand || c + j * RT < p.cols.v)
            *reinterpret_cast<uint4*>(op + j * RT * 8) = *reinterpret_cast<const uint4*>(
                sQ + C::off(wrow + r0 + i * kRowsPerStep, (c + j * RT) * 8));
      }
      op += ostep;
    }
  }
#endif
}

// Host side ----------------------------------------------------------------------------------

// Warps per CTA that ship (16 query rows each, MT = 1; why in the header comment): 4, except on
// parts whose SM cannot hold two of the 4-warp CTAs (+1 KB reserved per CTA): D = 128 (96 KB) on
// A100 (164 KB) and sm_86 / sm_89 (100 KB), D = 96 (72 KB) on sm_86 / sm_89. There one CTA of 8
// warps with the same shared memory keeps 8 warps per SM where 4-warp CTAs would leave 4.
template <typename T, int D>
inline int shipping_warps(const DeviceInfo& dev) {
  if constexpr (D == 64 || D > 128) {
    return 4;  // 48 KB: two CTAs fit every sm_80+ part; D = 192, 256: one CTA a SM either way
  } else {
    return dev.smem_per_sm >= 2 * (Cfg<T, D, 4, 1>::kSmemBytesMasked + 1024) ? 4 : 8;
  }
}

// Dynamic shared memory of the kernel of configuration (W, MT) under Mask.
template <typename T, int D, int W, int MT, class Mask>
constexpr int smem_bytes() {
  using C = Cfg<T, D, W, MT>;
  if constexpr (mask::kIsBand<Mask>) return C::kSmemBytesBand;
  return Mask::kMasksKeys ? C::kSmemBytesMasked : C::kSmemBytes;
}

// Whether forward() may launch the 8-warp configuration for D (shipping_warps).
template <int D>
constexpr bool kHasW8 = D == 96 || D == 128;

// Query tiles have 16 · W · MT rows with W · MT <= 8 (Cfg's assert): at most 128.
constexpr int kMaxTileRows = 16 * 8;

// What this kernel takes beyond its instantiation: a grid of query tiles with (batch, head) on
// grid z and y (the 4-warp configuration's 64-row tiles are the most), seq_q and seq_k in `int`
// up to a tile past them, an sm_80+ device with the shared memory of the configuration forward()
// picks there (the 4-warp one where the device is unknown: both take the same).
template <typename T, int D>
std::string can_implement(const FwdArgs& a, const DeviceInfo& dev) {
  const int warps = known(dev) ? shipping_warps<T, D>(dev) : 4;
  const int smem = mask::dispatch_band<int>(
      a,
      [&](const auto& m) {
        using Mask = std::decay_t<decltype(m)>;
        if constexpr (kHasW8<D>) {
          if (warps == 8) return smem_bytes<T, D, 8, 1, Mask>();
        }
        return smem_bytes<T, D, 4, 1, Mask>();
      },
      mask::narrowed(a, D));
  return limits::first({limits::narrowed_head_dims(a, D),
                        mask::narrow_window(a, Cfg<T, D, 4, 1>::kBN, "cutlass-sm80"),
                        limits::grid_of_query_tiles(a, Cfg<T, D, 4, 1>::kBM),
                        limits::int_sequences(a, "cutlass-sm80", kMaxTileRows),
                        limits::sm80_or_newer(dev), limits::smem_per_block(dev, smem)});
}

template <typename T, int D, int W, int MT, class Mask>
void launch(const FwdArgs& a, const Mask& mask, cudaStream_t stream) {
  using C = Cfg<T, D, W, MT>;
  constexpr int kSmem = smem_bytes<T, D, W, MT, Mask>();
  if constexpr (kSmem > 48 * 1024) {
    static std::atomic<uint64_t> configured{0};
    opt_in_smem(reinterpret_cast<const void*>(fwd_kernel<T, D, Mask, W, MT>), kSmem, configured);
  }
  Params<T, Mask> p{};
  p.q = device_ptr<const T>(a.ops.q);
  p.k = device_ptr<const T>(a.ops.k);
  p.v = device_ptr<const T>(a.ops.v);
  p.o = device_ptr<T>(a.ops.o);
  p.qs = a.ops.q_stride;
  p.ks = a.ops.k_stride;
  p.vs = a.ops.v_stride;
  p.os = a.ops.o_stride;
  p.mask = mask;
  p.group = int(a.dims.heads / a.dims.kv_heads);
  p.scale_log2 = a.mods.scale * 1.4426950408889634f;
  p.lse = a.out.has_lse ? device_ptr<float>(a.out.lse) : nullptr;
  p.heads = int(a.dims.heads);
  p.cap2 = a.mods.softcap > 0.f ? a.mods.softcap * 1.4426950408889634f : 0.f;
  p.alibi = a.mods.alibi ? device_ptr<const float>(a.mods.alibi_slopes) : nullptr;
  p.alibi_bstride = int(a.mods.alibi_batch_stride);
  p.sinks = a.mods.sinks ? device_ptr<const float>(a.mods.sink_logits) : nullptr;
  p.seqs = SeqParams::of(a);
  p.cols = {int(a.dims.head_dim / 8), int(a.dims.head_dim_v / 8)};
  // Under a mask that hides keys CTAs are launched last query block first (the kernel reverses
  // blockIdx.x).
  const dim3 grid(unsigned((a.dims.seq_q + C::kBM - 1) / C::kBM), unsigned(a.dims.heads),
                  unsigned(a.dims.batch));
  fwd_kernel<T, D, Mask, W, MT><<<grid, C::kThreads, kSmem, stream>>>(p);
  SDPA_LAUNCH_CHECK("cutlass-sm80 fwd_kernel launch");
}

template <typename T, int D>
void forward(const FwdArgs& a, const DeviceInfo& dev, cudaStream_t stream) {
  if ((a.mods.alibi && !a.mods.alibi_slopes) || (a.mods.sinks && !a.mods.sink_logits) ||
      (a.out.has_lse && !a.out.lse))
    throw Error(
        "cutlass-sm80: ALiBi without slopes, sinks without logits or a log-sum-exp "
        "without its buffer");
  const int warps = shipping_warps<T, D>(dev);
  mask::dispatch_band<int>(
      a,
      [&](const auto& mask) {
        if constexpr (kHasW8<D>) {
          if (warps == 8) return launch<T, D, 8, 1>(a, mask, stream);
        }
        launch<T, D, 4, 1>(a, mask, stream);
      },
      mask::narrowed(a, D));
}

template <typename T, int D, int W>
void attributes_of(std::vector<KernelAttr>& out) {
  const void* const fns[3] = {
      reinterpret_cast<const void*>(fwd_kernel<T, D, mask::NoMask<int>, W, 1>),
      reinterpret_cast<const void*>(fwd_kernel<T, D, mask::CausalBottomRight<int>, W, 1>),
      reinterpret_cast<const void*>(fwd_kernel<T, D, mask::Band<int>, W, 1>)};
  push_attributes(out, "cutlass-sm80", dtype_name<T>(), D, fns, Cfg<T, D, W, 1>::kSmemBytes);
  // The causal and band entries: + the non-finite V check's records.
  out[out.size() - 2].dynamic_smem = Cfg<T, D, W, 1>::kSmemBytesMasked;
  out.back().dynamic_smem = Cfg<T, D, W, 1>::kSmemBytesBand;
}

// The kernels forward() launches on the device `dev` describes.
template <typename T, int D>
void attributes(std::vector<KernelAttr>& out, const DeviceInfo& dev) {
  if constexpr (kHasW8<D>) {
    if (shipping_warps<T, D>(dev) == 8) return attributes_of<T, D, 8>(out);
  }
  attributes_of<T, D, 4>(out);
}

}  // namespace sdpa::cutlass_sm80
