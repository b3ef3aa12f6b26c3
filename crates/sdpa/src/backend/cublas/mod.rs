//! The unfused cuBLAS backend: S = scale·Q·Kᵀ (one tensor-op GEMM per batch group, f32
//! scores), P = masked row softmax of S (our kernel, sdpa-sys/cpp/src/cublas/softmax.cu), O = P·V
//! (second GEMM, written straight into the output's layout).
//!
//! Causal problems (the non-finite V check): the P·V GEMM spans every key with P = 0 at masked
//! ones, and 0 · NaN = 0 · Inf = NaN, so it reads a finite copy of V instead (one extra read and
//! write of V, which also records where V's NaN and Inf were), and a last kernel adds their
//! reference terms to the rows that see them, near-free when V is finite
//! (sdpa-sys/cpp/src/cublas/nonfinite_v.cu).
//!
//! Scores are f32, not f16: a score of 40 in f16 carries an absolute error of 0.02, which
//! becomes a 2% error in exp(); f32 costs 2 bytes more per score and nothing in GEMM speed
//! (f32 accumulation either way). P is rounded to the input dtype, as the fused kernels do.
//!
//! cuBLAS is loaded at run time (cudarc dynamic loading), so machines without it still build,
//! run the CPU backend and the tests; there this backend reports itself unsupported.

pub(crate) mod state;

use crate::buffers::Buffers;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::ffi;
use crate::problem::{Checked, DType, Problem, Strides};
use cudarc::cublas::{CudaBlas, sys as cb};
use cudarc::driver::DevicePtrMut;
use state::BlasState;
use std::sync::MutexGuard;

/// Byte offsets into the workspace. S (f32 scores) and P (dtype) for every (batch, head);
/// causal problems add V's finite copy and its first-key records (`NonFiniteVArgs`), each
/// 256-byte aligned.
struct WorkspaceLayout {
    p: usize,
    v_finite: usize,
    first_keys: usize,
    total: usize,
}

fn workspace_layout(p: &Problem) -> Option<WorkspaceLayout> {
    let scores = p
        .batch
        .checked_mul(p.heads)?
        .checked_mul(p.seq_q)?
        .checked_mul(p.seq_k)?;
    let s_bytes = scores.checked_mul(4)?;
    let p_end = s_bytes.checked_add(scores.checked_mul(p.dtype.size())?)?;
    if !p.is_causal() {
        return Some(WorkspaceLayout {
            p: s_bytes,
            v_finite: p_end,
            first_keys: p_end,
            total: p_end,
        });
    }
    let align = |x: usize| x.checked_next_multiple_of(256);
    let v_finite = align(p_end)?;
    let first_keys = align(v_finite.checked_add(p.v_len()?.checked_mul(p.dtype.size())?)?)?;
    let records = (p.batch * p.kv_heads).checked_mul(1 + 3 * p.head_dim)?;
    Some(WorkspaceLayout {
        p: s_bytes,
        v_finite,
        first_keys,
        total: first_keys.checked_add(records.checked_mul(4)?)?,
    })
}

/// Workspace bytes (see `workspace_layout`).
pub(crate) fn workspace_bytes(p: &Problem) -> Option<usize> {
    workspace_layout(p).map(|l| l.total)
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

pub(crate) fn library_present() -> bool {
    crate::device::loadable(&["libcublas.so.13", "libcublas.so"])
}

/// Largest value of a C `int`: cuBLAS's m, n, k, leading dimensions and batch count are `int`
/// in the entry point used here (its strides are 64-bit), and so is the softmax's grid size.
const INT_MAX: usize = i32::MAX as usize;

/// How the GEMMs are batched: `outer` calls of `count` matrices each. One call over every
/// (batch, kv_head) pair when the batch stride is uniform over that flattened index (BHSD),
/// else one call per batch entry over its kv heads (BSHD).
fn batching(p: &Problem) -> (usize, usize) {
    let (qs, ks) = (p.q_strides(), p.k_strides());
    if qs.batch == p.heads * qs.head && ks.batch == p.kv_heads * ks.head {
        (1, p.batch * p.kv_heads)
    } else {
        (p.batch, p.kv_heads)
    }
}

/// Checks that every value `forward` hands to cuBLAS or to the softmax launch as a 32-bit
/// `int` fits one; depends on the problem alone, so it applies without a device. Each reason
/// names the value and the limit.
pub(crate) fn limits(p: &Problem) -> std::result::Result<(), String> {
    // Its softmax kernel masks causally (bottom-right) or not at all, and keeps no row sums.
    if !p.is_plain() {
        return Err(format!(
            "runs no mask but causal bottom-right, and no softcap, ALiBi or sinks ({p})"
        ));
    }
    if p.lse {
        return Err("does not write the log-sum-exp".into());
    }
    if p.v_dim() != p.head_dim {
        return Err(format!(
            "takes one head dimension, not head_dim {} with head_dim_v {} (scalar and \
             cutlass-sm80 take both)",
            p.head_dim,
            p.v_dim()
        ));
    }
    // Its P·V GEMM writes the input dtype (e4m3 problems reach here dequantized to theirs).
    if p.output_dtype() != p.dtype {
        return Err(format!(
            "writes its output in the input dtype ({}), not {} (cutlass and cpu write f32)",
            p.dtype,
            p.output_dtype()
        ));
    }
    if !p.seqs.is_dense() {
        return Err(
            "runs dense sequences only, no packed (varlen) Q or K/V, paged cache or seqused_k \
             (scalar runs them)"
                .into(),
        );
    }
    let (qs, ks) = (p.q_strides(), p.k_strides());
    let (_, count) = batching(p);
    for (what, value) in [
        ("seq_q (n of both GEMMs)", p.seq_q),
        (
            "seq_k (m of Q·Kᵀ, k of P·V, leading dimension of S and P)",
            p.seq_k,
        ),
        ("head_dim (k of Q·Kᵀ, m of P·V)", p.head_dim),
        (
            "the row stride of Q and O (their leading dimension: heads x head_dim in BSHD)",
            qs.seq,
        ),
        (
            "the row stride of K and V (their leading dimension: kv_heads x head_dim in BSHD)",
            ks.seq,
        ),
        (
            "the GEMM batch count (batch x kv_heads in BHSD, kv_heads in BSHD)",
            count,
        ),
    ] {
        if value > INT_MAX {
            return Err(format!(
                "{what} = {value} exceeds cuBLAS's 32-bit int arguments (at most 2^31 - 1)"
            ));
        }
    }
    // The softmax kernel runs one CTA per score row, on grid x.
    let rows = p.batch * p.heads * p.seq_q;
    if rows > INT_MAX {
        return Err(format!(
            "batch x heads x seq_q = {rows} score rows; the softmax grid allows 2^31 - 1"
        ));
    }
    Ok(())
}

/// Checks what the device allows: the cuBLAS library and memory for the workspace. `limits`
/// comes first (`Backend::supports`), with or without a device.
pub(crate) fn supports(dev: &Device, p: &Problem) -> std::result::Result<(), String> {
    if !library_present() {
        return Err("the cuBLAS library (libcublas.so.13) was not found".into());
    }
    let need = workspace_bytes(p).ok_or("workspace size overflows")?;
    let held = dev.blas_state().lock().ok().and_then(|s| {
        s.as_ref()
            .and_then(|s| s.workspace.as_ref().map(|w| w.len()))
    });
    let (free, _) = dev.mem_info().map_err(|e| e.to_string())?;
    if need > free + held.unwrap_or(0) {
        return Err(format!(
            "needs {:.2} GiB of workspace for S and P{}, the GPU has {:.2} GiB free",
            gib(need),
            if p.is_causal() {
                " and V's finite copy"
            } else {
                ""
            },
            gib(free + held.unwrap_or(0))
        ));
    }
    Ok(())
}

fn data_type(d: DType) -> cb::cudaDataType {
    match d {
        DType::F16 => cb::cudaDataType::CUDA_R_16F,
        DType::Bf16 => cb::cudaDataType::CUDA_R_16BF,
        // Never reached: e4m3 problems arrive here dequantized (the simulated FP8 path).
        DType::E4m3 => cb::cudaDataType::CUDA_R_8F_E4M3,
        // Never reached: `limits` refuses an output of another dtype than the inputs'.
        DType::F32 => cb::cudaDataType::CUDA_R_32F,
    }
}

fn check(status: cb::cublasStatus_t, what: &str) -> Result<()> {
    if status == cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda(format!("{what}: {status:?}").into()))
    }
}

/// One strided-batched GEMM in cuBLAS's column-major terms; pointers are device addresses.
/// Dimensions, leading dimensions and the batch count are converted to cuBLAS's 32-bit `int`
/// only in `run`, which refuses any that does not fit.
struct Gemm {
    trans_a: bool,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: u64,
    a_type: cb::cudaDataType,
    lda: usize,
    stride_a: i64,
    b: u64,
    b_type: cb::cudaDataType,
    ldb: usize,
    stride_b: i64,
    c: u64,
    c_type: cb::cudaDataType,
    ldc: usize,
    stride_c: i64,
    batch: usize,
}

/// `value` as cuBLAS's 32-bit `int`, or an error naming it (never a truncated value). `limits`
/// has already rejected every problem for which this fails.
fn int(what: &str, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| Error::Unsupported {
        backend: "cublas",
        reason: format!("{what} = {value} does not fit cuBLAS's 32-bit int (at most 2^31 - 1)"),
    })
}

impl Gemm {
    fn run(&self, blas: &CudaBlas) -> Result<()> {
        let beta = 0f32;
        let op = |t| {
            if t {
                cb::cublasOperation_t::CUBLAS_OP_T
            } else {
                cb::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (m, n, k) = (int("m", self.m)?, int("n", self.n)?, int("k", self.k)?);
        let (lda, ldb, ldc) = (
            int("lda", self.lda)?,
            int("ldb", self.ldb)?,
            int("ldc", self.ldc)?,
        );
        let batch = int("batch count", self.batch)?;
        // SAFETY: the caller built every pointer, leading dimension and stride from a
        // validated problem and buffers at least that large; every int argument is exact.
        let status = unsafe {
            cb::cublasGemmStridedBatchedEx(
                *blas.handle(),
                op(self.trans_a),
                op(false),
                m,
                n,
                k,
                (&self.alpha as *const f32).cast(),
                self.a as *const _,
                self.a_type,
                lda,
                self.stride_a,
                self.b as *const _,
                self.b_type,
                ldb,
                self.stride_b,
                (&beta as *const f32).cast(),
                self.c as *mut _,
                self.c_type,
                ldc,
                self.stride_c,
                batch,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        check(status, "cublasGemmStridedBatchedEx")
    }
}

/// The workspace layout of `p`, or `Unsupported` when its size overflows.
fn layout_of(p: &Problem) -> Result<WorkspaceLayout> {
    workspace_layout(p).ok_or_else(|| Error::Unsupported {
        backend: "cublas",
        reason: "workspace size overflows".into(),
    })
}

/// Makes the stream's cuBLAS handle and a workspace of `p`'s size ahead of a call, so that the
/// call (one captured into a graph, say) allocates nothing.
pub(crate) fn reserve(dev: &Device, p: &Problem) -> Result<()> {
    prepared(dev, layout_of(p)?.total).map(drop)
}

/// The stream's cuBLAS state, with a handle and a workspace of at least `need` bytes: made or
/// grown here when missing or too small.
fn prepared(dev: &Device, need: usize) -> Result<MutexGuard<'_, Option<BlasState>>> {
    let mut guard = dev
        .blas_state()
        .lock()
        .map_err(|_| Error::Cuda("cuBLAS state poisoned by a panic".into()))?;
    if guard.is_none() {
        let blas = CudaBlas::new(dev.stream().clone())
            .map_err(|e| Error::Cuda(format!("cublasCreate: {e:?}").into()))?;
        *guard = Some(BlasState {
            blas,
            workspace: None,
        });
    }
    let st = guard.as_mut().expect("made above");
    if st.workspace.as_ref().is_none_or(|w| w.len() < need) {
        st.workspace = None; // free the old one before asking for the larger
        // SAFETY: filled right below, before any use.
        let mut w = unsafe { dev.alloc::<u8>(need)? };
        // All bytes 0xFF: NaN as f32 and as f16/bf16. The GEMM writes every score the softmax
        // reads, so a fresh workspace never shows through; if it ever did, the NaN would reach the
        // (validated) output instead of a plausible stale value. It also tells compute-sanitizer's
        // initcheck the memory is defined: initcheck does not see cuBLAS's stores and flagged the
        // softmax's reads of S (docs/log/, compute-sanitizer).
        {
            let (wp, _g) = w.device_ptr_mut(dev.stream());
            // SAFETY: `wp` addresses the `need` bytes just allocated on this stream's context.
            unsafe {
                cudarc::driver::result::memset_d8_async(wp, 0xFF, need, dev.stream().cu_stream())?
            };
        }
        st.workspace = Some(w);
    }
    Ok(guard)
}

/// Runs `p` on buffers laid out as its layout says (`Buffers::in_layout`; the GEMMs are batched
/// over the layout's strides).
pub(crate) fn forward(dev: &Device, p: &Checked, b: &Buffers) -> Result<()> {
    if !b.in_layout(p) {
        return Err(Error::Unsupported {
            backend: "cublas",
            reason: format!(
                "takes operands with the {} layout's own strides only; the fused backends take \
                 any strides",
                p.layout
            ),
        });
    }
    let layout = layout_of(p)?;
    let mut guard = prepared(dev, layout.total)?;
    let st = guard.as_mut().expect("prepared makes the state");
    let ws = st.workspace.as_mut().unwrap();
    let (s_ptr, _g) = ws.device_ptr_mut(dev.stream());
    let scores = (p.batch * p.heads * p.seq_q * p.seq_k) as u64;
    let p_ptr = s_ptr + layout.p as u64;

    let (qs, ks) = (p.q_strides(), p.k_strides());
    let g = p.heads / p.kv_heads;
    let (sq, sk, d) = (p.seq_q as i64, p.seq_k as i64, p.head_dim as i64);
    let es = p.dtype.size() as u64;
    let ty = data_type(p.dtype);
    let (qp, kp, vp, op) = (b.q, b.k, b.v, b.o);
    // `outer` calls of `count` matrices (see `batching`), one per member r of a GQA group:
    // head h = hk * g + r.
    let (outer, count) = batching(p);
    let blas = &st.blas;
    for b in 0..outer {
        for r in 0..g {
            let q_off = (b * qs.batch + r * qs.head) as u64;
            let kv_off = (b * ks.batch) as u64;
            let row0 = ((b * p.heads + r) as i64 * sq) as u64; // first S row of head (b, r)
            // Sᵀ (sk x sq, col-major) = Kᵀ-op(K) · Q  <=>  S = Q·Kᵀ row-major.
            Gemm {
                trans_a: true,
                m: p.seq_k,
                n: p.seq_q,
                k: p.head_dim,
                alpha: p.scale(),
                a: kp + es * kv_off,
                a_type: ty,
                lda: ks.seq,
                stride_a: ks.head as i64,
                b: qp + es * q_off,
                b_type: ty,
                ldb: qs.seq,
                stride_b: (g * qs.head) as i64,
                c: s_ptr + 4 * row0 * sk as u64,
                c_type: cb::cudaDataType::CUDA_R_32F,
                ldc: p.seq_k,
                stride_c: g as i64 * sq * sk,
                batch: count,
            }
            .run(blas)?;
        }
    }
    let args = sdpa_sys::args::SoftmaxArgs {
        s: s_ptr,
        p: p_ptr,
        rows: scores as i64 / sk,
        seq_q: sq,
        seq_k: sk,
        mask: ffi::mask(p.mask).kind,
        dtype: ffi::dtype(p.dtype),
    };
    let stream = dev.raw_stream()?;
    // SAFETY: S and P both hold `scores` elements of the workspace allocated above.
    unsafe { sdpa_sys::ffi::masked_softmax(&args, stream)? };
    // Causal: P = 0 at masked keys, and 0 · NaN = 0 · Inf = NaN inside the GEMM, so it reads a
    // finite copy of V and the non-finite values are put back for the rows that see them.
    let nonfinite = p.is_causal().then(|| sdpa_sys::args::NonFiniteVArgs {
        v: vp,
        v_stride: ks.as_i64().into(),
        v_finite: s_ptr + layout.v_finite as u64,
        first_keys: s_ptr + layout.first_keys as u64,
        o: op,
        o_stride: qs.as_i64().into(),
        batch: p.batch as i64,
        heads: p.heads as i64,
        kv_heads: p.kv_heads as i64,
        seq_q: sq,
        seq_k: sk,
        head_dim: d,
        dtype: ffi::dtype(p.dtype),
    });
    let (v_gemm, vs) = match &nonfinite {
        Some(a) => {
            // SAFETY: V holds what its validated strides address; the finite copy and the
            // records are the workspace regions `workspace_layout` sized for this problem.
            unsafe { sdpa_sys::ffi::sanitize_v(a, stream)? };
            let dense = Strides {
                batch: p.kv_heads * p.seq_k * p.head_dim,
                head: p.seq_k * p.head_dim,
                seq: p.head_dim,
            };
            (a.v_finite, dense)
        }
        None => (vp, ks),
    };
    for b in 0..outer {
        for r in 0..g {
            let o_off = (b * qs.batch + r * qs.head) as u64;
            let v_off = (b * vs.batch) as u64;
            let row0 = ((b * p.heads + r) as i64 * sq) as u64;
            // Oᵀ (d x sq, col-major) = V (d x sk) · P (sk x sq)  <=>  O = P·V row-major.
            Gemm {
                trans_a: false,
                m: p.head_dim,
                n: p.seq_q,
                k: p.seq_k,
                alpha: 1.0,
                a: v_gemm + es * v_off,
                a_type: ty,
                lda: vs.seq,
                stride_a: vs.head as i64,
                b: p_ptr + es * row0 * sk as u64,
                b_type: ty,
                ldb: p.seq_k,
                stride_b: g as i64 * sq * sk,
                c: op + es * o_off,
                c_type: ty,
                ldc: qs.seq,
                stride_c: (g * qs.head) as i64,
                batch: count,
            }
            .run(blas)?;
        }
    }
    if let Some(a) = &nonfinite {
        // SAFETY: as for sanitize_v, after it and the GEMM on this stream; O holds what its
        // validated strides address.
        unsafe { sdpa_sys::ffi::add_nonfinite_v(a, stream)? };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int_arguments_are_exact_or_refused() {
        assert_eq!(int("lda", i32::MAX as usize).unwrap(), i32::MAX);
        let e = int("lda", 1 << 31).unwrap_err();
        assert!(matches!(e, Error::Unsupported { .. }), "{e}");
        assert!(e.to_string().contains("lda = 2147483648"), "{e}");
    }
}
