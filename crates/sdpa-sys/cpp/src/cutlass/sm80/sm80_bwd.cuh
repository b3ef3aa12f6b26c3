// cutlass-sm80's backward: the dK/dV pass on mma.sync (m16n8k16, f32 accumulators), inside the
// scalar backward's launches (scalar/scalar_bwd.cuh, run_backward: the D pre-pass, dQ's
// conversion, the sinks' gradient), on the same Params and workspace.
// Head dim 64 (head_dim = head_dim_v = D; kernels.txt's `bwd` lines); can_implement (below)
// sends the others to scalar. The kernel compiles at D = 128 too, but spills there (dK and dV
// take 128 registers a thread beside Sᵀ and dPᵀ): that instance waits for a leaner layout.
//
// A CTA takes 64 keys of one K/V head, 4 warps of 16 keys; K and V stay in shared memory while
// it walks the 64-row query tiles of its group's heads that see them (the scalar kernel's tile
// tests). Per query tile, with Q, dO and the rows' LSE and D in shared memory:
//   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ   the warp's keys the A operand (ldmatrix from K, V [key][d]), Q and
//                           dO the B operand (ldmatrix from [q][d]: the forward's Q·Kᵀ with
//                           the roles swapped); C fragments of 16 keys x 64 queries;
//   Pᵀ, dSᵀ                 per element (scalar::bwd::score_grad); zero where the row does not
//                           see the key, past the sequence, or past its keys;
//   dV += Pᵀ·dO, dK += dSᵀ·Q  Pᵀ and dSᵀ rounded to 16 bit are A fragments as they are (two n8 C
//                           tiles make one k16 A tile, as the forward's P·V), dO and Q the B
//                           operand by ldmatrix.trans;
//   dQ += dS·K               dSᵀ staged in shared memory [key][q], read back transposed as the A
//                           operand (ldmatrix.trans), K by ldmatrix.trans; each warp 16 query
//                           rows, added to the f32 accumulator with atomics.
// The deterministic mode (kOrdered) is the same pass with each query tile's additions ordered
// as cutlass's sm_90a backward orders them (a counter per tile, turns from the last key block
// down, the grid launched in that order), made with plain read-modify-writes while the block
// holds the turn.
//
// Shared memory tiles are [64][D] with each row's 16-byte chunks XOR-swizzled by the row
// (chunk c at c ^ (row % 8)), so ldmatrix (plain and transposed) and the row copies are free
// of bank conflicts. A value a row does not see is zeroed in P and dS, but the products still
// multiply it by the other operand: a non-finite Q, dO, K or V element at a position some row
// does not see reaches gradients the reference keeps finite (the scalar kernel skips those
// pairs; inputs of a training step are finite).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>
#include <type_traits>
#include <vector>

// sm80_fwd.cuh first: it brings CuTe's element types before cutlass/dtype.cuh names them.
#include "common/turns.cuh"
#include "cutlass/sm80/sm80_fwd.cuh"
#include "scalar/scalar_bwd.cuh"

namespace sdpa::cutlass_sm80::bwd {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBN = 64;  // keys a CTA
constexpr int kBM = 64;  // query rows a step

using scalar::bwd::Params;

template <typename T, int D>
struct Smem {
  T k[kBN * D], v[kBN * D], q[kBM * D], d_o[kBM * D];
  T ds[kBN * kBM];  // dSᵀ [key][q], dQ's operand
  float lse2[kBM], delta[kBM];
};

// Element offset of (row, col) in a swizzled [rows][W] tile (W = 64 or 128: rows of whole
// 128-byte lines, the XOR within each line's 8 chunks).
template <int W>
__device__ __forceinline__ int off(int row, int col) {
  return row * W + (col ^ ((row & 7) << 3));
}

// Rows [0, 64) of a tensor at `base` (row stride `rs` elements, D wide) into a swizzled tile;
// rows at or past `rows` as zeros.
template <int D, typename T>
__device__ __forceinline__ void load_tile(T* tile, const T* base, int64_t rs, int64_t rows) {
  constexpr int CH = D / 8;
  for (int c = threadIdx.x; c < 64 * CH; c += kThreads) {
    const int r = c / CH, ch = c % CH;
    uint4 u = make_uint4(0, 0, 0, 0);
    if (r < rows) u = *reinterpret_cast<const uint4*>(base + r * rs + ch * 8);
    *reinterpret_cast<uint4*>(tile + off<D>(r, ch * 8)) = u;
  }
}

template <typename T, int D, bool kOrdered>
__global__ void __launch_bounds__(kThreads) mma_dkdv_kernel(const __grid_constant__ Params pm) {
#ifdef SDPA_SM80_DEVICE
  const KernelParams& p = pm.base;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<Smem<T, D>*>(smem_raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // kOrdered: key blocks launch last first (the turns below).
  const int64_t nb = kOrdered ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int64_t n0 = nb * kBN, hk = blockIdx.y, b = blockIdx.z;
  const scalar::bwd::SeqView s = scalar::bwd::seq_view(pm, b);
  const int64_t seq_q = s.seq.seq_q, seq_k = s.seq.seq_k;
  const int64_t key_rows = pm.seqs.cu_k != nullptr ? seq_k : p.seq_k;
  if (n0 >= key_rows) return;  // CTA-uniform, before any barrier
  const T* kb = reinterpret_cast<const T*>(p.k) +
                (b * p.ks.batch + hk * p.ks.head + (s.seq.k0 + n0) * p.ks.seq);
  const T* vb = reinterpret_cast<const T*>(p.v) +
                (b * p.vs.batch + hk * p.vs.head + (s.seq.k0 + n0) * p.vs.seq);
  load_tile<D>(sm.k, kb, p.ks.seq, seq_k - n0);
  load_tile<D>(sm.v, vb, p.vs.seq, seq_k - n0);

  const int kr0 = warp * 16;  // the warp's keys in the tile
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  for (int64_t gi = 0; gi < p.group; ++gi) {
    const int64_t h = hk * p.group + gi;
    const float slope2 = scalar::bwd::slope2_of(pm, b, h);
    const T* qb =
        reinterpret_cast<const T*>(p.q) + (b * p.qs.batch + h * p.qs.head + s.seq.q0 * p.qs.seq);
    const T* gb = reinterpret_cast<const T*>(pm.d_o) +
                  (b * pm.dos.batch + h * pm.dos.head + s.seq.q0 * pm.dos.seq);
    for (int64_t m0 = 0; m0 < seq_q; m0 += kBM) {
      if (s.mask.key_end(m0, kBM) <= n0 || s.mask.key_begin(m0, kBM) >= n0 + kBN) continue;
      __syncthreads();  // the previous tile is consumed (and, the first time, K and V stored)
      load_tile<D>(sm.q, qb + m0 * p.qs.seq, p.qs.seq, seq_q - m0);
      load_tile<D>(sm.d_o, gb + m0 * pm.dos.seq, pm.dos.seq, seq_q - m0);
      for (int r = threadIdx.x; r < kBM; r += kThreads) {
        float lse2 = -INFINITY, delta = 0.f;
        if (m0 + r < seq_q) {
          const int64_t at = lse_index(pm.seqs, s.seq, b, h, p.heads, p.seq_q, m0 + r);
          lse2 = pm.lse[at] * kLog2e;
          delta = pm.delta[at];
        }
        sm.lse2[r] = lse2;
        sm.delta[r] = delta;
      }
      __syncthreads();

      // Sᵀ and dPᵀ: 16 keys x 64 queries a warp.
      float sc[8][4] = {}, dp[8][4] = {};
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t ka[4], va[4];
        const int ar = kr0 + (lane % 8) + 8 * ((lane / 8) % 2), ac = kk * 16 + 8 * (lane / 16);
        ldsm(ka, &sm.k[off<D>(ar, ac)]);
        ldsm(va, &sm.v[off<D>(ar, ac)]);
#pragma unroll
        for (int nn = 0; nn < kBM / 16; ++nn) {
          const int br = nn * 16 + (lane % 8) + 8 * (lane / 16),
                    bc = kk * 16 + 8 * ((lane / 8) % 2);
          uint32_t qf[4], gf[4];
          ldsm(qf, &sm.q[off<D>(br, bc)]);
          ldsm(gf, &sm.d_o[off<D>(br, bc)]);
          mma<T>(sc[2 * nn], ka, qf[0], qf[1]);
          mma<T>(sc[2 * nn + 1], ka, qf[2], qf[3]);
          mma<T>(dp[2 * nn], va, gf[0], gf[1]);
          mma<T>(dp[2 * nn + 1], va, gf[2], gf[3]);
        }
      }

      // Pᵀ into sc, scale · dSᵀ into dp.
      const bool masked = s.mask.tile_masked(m0, kBM, n0, kBN);
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = 8 * n + 2 * t + (e & 1);
          const int64_t i = m0 + qi, j = n0 + kr0 + g + 8 * (e / 2);
          const bool visible = i < seq_q && j < seq_k && (!masked || s.mask.sees(i, j));
          const scalar::bwd::ScoreGrad sg =
              scalar::bwd::score_grad(pm, sc[n][e], dp[n][e], sm.lse2[qi], sm.delta[qi], slope2,
                                      llabs(i + seq_k - seq_q - j), visible);
          sc[n][e] = sg.p;
          dp[n][e] = sg.ds;
        }
      }

      // dV += Pᵀ·dO, dK += dSᵀ·Q over the tile's 64 queries.
#pragma unroll
      for (int kk = 0; kk < kBM / 16; ++kk) {
        const uint32_t pa[4] = {pack2<T>(sc[2 * kk][0], sc[2 * kk][1]),
                                pack2<T>(sc[2 * kk][2], sc[2 * kk][3]),
                                pack2<T>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                pack2<T>(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
        const uint32_t da[4] = {pack2<T>(dp[2 * kk][0], dp[2 * kk][1]),
                                pack2<T>(dp[2 * kk][2], dp[2 * kk][3]),
                                pack2<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                                pack2<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
        for (int nn = 0; nn < D / 16; ++nn) {
          const int br = kk * 16 + (lane % 8) + 8 * ((lane / 8) % 2),
                    bc = nn * 16 + 8 * (lane / 16);
          uint32_t gf[4], qf[4];
          ldsm_t(gf, &sm.d_o[off<D>(br, bc)]);
          ldsm_t(qf, &sm.q[off<D>(br, bc)]);
          mma<T>(dv[2 * nn], pa, gf[0], gf[1]);
          mma<T>(dv[2 * nn + 1], pa, gf[2], gf[3]);
          mma<T>(dk[2 * nn], da, qf[0], qf[1]);
          mma<T>(dk[2 * nn + 1], da, qf[2], qf[3]);
        }
      }

      {
        // dSᵀ [key][q] into shared memory, then dQ = dS·K for the warp's 16 query rows.
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          *reinterpret_cast<uint32_t*>(&sm.ds[off<kBM>(kr0 + g, 8 * n + 2 * t)]) =
              pack2<T>(dp[n][0], dp[n][1]);
          *reinterpret_cast<uint32_t*>(&sm.ds[off<kBM>(kr0 + g + 8, 8 * n + 2 * t)]) =
              pack2<T>(dp[n][2], dp[n][3]);
        }
        __syncthreads();
        const int qr0 = warp * 16;
        float dq[D / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk) {
          uint32_t a[4];
          ldsm_t(
              a,
              &sm.ds[off<kBM>(kk * 16 + (lane % 8) + 8 * (lane / 16), qr0 + 8 * ((lane / 8) % 2))]);
#pragma unroll
          for (int nn = 0; nn < D / 16; ++nn) {
            uint32_t kf[4];
            ldsm_t(kf, &sm.k[off<D>(kk * 16 + (lane % 8) + 8 * ((lane / 8) % 2),
                                    nn * 16 + 8 * (lane / 16))]);
            mma<T>(dq[2 * nn], a, kf[0], kf[1]);
            mma<T>(dq[2 * nn + 1], a, kf[2], kf[3]);
          }
        }
        // kOrdered: the tile's key blocks add in turn, from the last down, each with plain
        // read-modify-writes through L2 while it holds the turn.
        // The counter of this tile (recomputed where used: a pointer held across the additions
        // spilled).
        const auto turn = [&]() {
          return pm.dq_order + (b * p.heads + h) * pm.order_tiles + m0 / kBM;
        };
        if constexpr (kOrdered) {
          if (threadIdx.x == 0)
            wait_for_turn(turn(), int((s.mask.key_end(m0, kBM) - 1) / kBN - nb));
          __syncthreads();
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int64_t i = m0 + qr0 + g + 8 * half;
          if (i >= seq_q) continue;
          const int64_t row = lse_index(pm.seqs, s.seq, b, h, p.heads, p.seq_q, i);
#pragma unroll
          for (int n = 0; n < D / 8; ++n) {
            float* at = pm.dq_acc + row * D + scalar::bwd::dq_col(row, 8 * n + 2 * t, D);
            if constexpr (kOrdered) {
              const float2 was = __ldcg(reinterpret_cast<const float2*>(at));
              __stcg(reinterpret_cast<float2*>(at),
                     make_float2(was.x + dq[n][2 * half], was.y + dq[n][2 * half + 1]));
            } else {
              atomicAdd(at, dq[n][2 * half]);
              atomicAdd(at + 1, dq[n][2 * half + 1]);
            }
          }
        }
        if constexpr (kOrdered) {
          __syncthreads();  // every thread's additions done
          if (threadIdx.x == 0) pass_the_turn(turn());
        }
      }
    }
  }

  // dK and dV rows of the warp's keys (zeros past the sequence's keys in dense K/V).
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t j = n0 + kr0 + g + 8 * half;
    if (j >= key_rows) continue;
    T* dk_row = reinterpret_cast<T*>(pm.dk) +
                (b * pm.dks.batch + hk * pm.dks.head + (s.seq.k0 + j) * pm.dks.seq);
    T* dv_row = reinterpret_cast<T*>(pm.dv) +
                (b * pm.dvs.batch + hk * pm.dvs.head + (s.seq.k0 + j) * pm.dvs.seq);
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<uint32_t*>(dk_row + 8 * n + 2 * t) =
          pack2<T>(dk[n][2 * half], dk[n][2 * half + 1]);
      *reinterpret_cast<uint32_t*>(dv_row + 8 * n + 2 * t) =
          pack2<T>(dv[n][2 * half], dv[n][2 * half + 1]);
    }
  }
#endif
}

template <typename T, int D>
std::string can_implement(const BwdArgs& a, const DeviceInfo& dev) {
  static_assert(D == 64 || D == 128, "the mma backward's instances: head dims 64 and 128");
  const FwdArgs& f = a.fwd;
  if (f.dims.head_dim != D || f.dims.head_dim_v != D)
    return "cutlass-sm80's backward runs head_dim = head_dim_v = " + std::to_string(D) +
           " on this instance (scalar runs the others)";
  return limits::first({scalar::bwd::can_implement<native_t<T>, D>(a, dev),
                        limits::smem_per_block(dev, int(sizeof(Smem<T, D>)))});
}

// The workspace: the scalar backward's, with the ordered mode's accumulator and counters.
inline int64_t workspace_bytes(const BwdArgs& a) { return scalar::bwd::workspace_bytes(a, kBM); }

template <typename T, int D>
void backward(const BwdArgs& a, const DeviceInfo&, cudaStream_t stream) {
  const FwdArgs& f = a.fwd;
  const dim3 grid(unsigned((f.dims.seq_k + kBN - 1) / kBN), unsigned(f.dims.kv_heads),
                  unsigned(f.dims.batch));
  constexpr int kSmem = int(sizeof(Smem<T, D>));
  scalar::bwd::run_backward<native_t<T>, D, kBM>(a, stream, "cutlass-sm80", [&](const Params& pm) {
    if (pm.dq_order != nullptr)
      scalar::bwd::launch<mma_dkdv_kernel<T, D, true>, kSmem>(grid, kThreads, stream, pm);
    else
      scalar::bwd::launch<mma_dkdv_kernel<T, D, false>, kSmem>(grid, kThreads, stream, pm);
    SDPA_LAUNCH_CHECK("cutlass-sm80 dkdv_kernel launch");
  });
}

template <typename T, int D>
void attributes(std::vector<KernelAttr>& out, const DeviceInfo&) {
  constexpr int32_t kSmem = int32_t(sizeof(Smem<T, D>));
  scalar::bwd::push_kernels<T, D>(
      out, "cutlass-sm80",
      {{"bwd_dkdv_ordered_", scalar::bwd::kernel_ptr(mma_dkdv_kernel<T, D, true>), kSmem},
       {"bwd_dkdv_atomic_", scalar::bwd::kernel_ptr(mma_dkdv_kernel<T, D, false>), kSmem}});
}

}  // namespace sdpa::cutlass_sm80::bwd
