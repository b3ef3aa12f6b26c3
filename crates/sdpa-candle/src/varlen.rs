//! Batches of sequences of different lengths, packed without padding: candle-flash-attn's
//! `flash_attn_varlen` functions on sdpa's packed Q and K/V (`Problem::with_packed_q` and
//! `with_packed_kv`), each sequence attended on its own.

use crate::{cpu_storage, host_values, last_dim_contiguous, same_dtype, same_shape_kv, sdpa_dtype};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Error, Layout, Result, Shape, Tensor, bail};
use sdpa::{Problem, SeqMeta};

/// Attention over a packed batch of sequences of different lengths, as candle-flash-attn's
/// `flash_attn_varlen`: Q is `(total_q, heads, head_dim)`, K and V `(total_k, kv_heads,
/// head_dim)` (`heads / kv_heads` query heads share each K/V head), and sequence b holds rows
/// `seqlens_q[b]..seqlens_q[b + 1]` of Q and `seqlens_k[b]..seqlens_k[b + 1]` of K and V.
/// `seqlens_q` and `seqlens_k` are u32 tensors of `batch + 1` cumulative offsets (`0, len_1,
/// len_1 + len_2, ..`) on Q's device; `max_seqlen_q` and `max_seqlen_k` are the longest
/// sequence's lengths. Each sequence is attended on its own, `softmax(softmax_scale · Q·Kᵀ +
/// mask) · V`, its causal mask aligned bottom-right to its own lengths (its query row i sees keys
/// j ≤ i + len_k − len_q, as FlashAttention). Returns a contiguous `(total_q, heads, head_dim)`
/// tensor of Q's dtype; a query row that sees no key (a sequence with no keys, or rows above
/// the causal diagonal) is zeros, and a batch with no query rows or no keys at all runs no
/// attention (its output is empty, or zeros).
///
/// On the CPU the offsets are checked (starting at 0, never decreasing, inside Q and K/V, no
/// sequence longer than its maximum). On the GPU they are read where they lie, unchecked, as
/// FlashAttention reads them: only their count is checked on the host, and each u32 is read as
/// an i32 (offsets must be below 2^31). [`FlashAttnVarLen::checked`] checks them there too.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// // Two sequences: 3 and 5 queries, 4 and 6 keys.
/// let dev = Device::Cpu;
/// let q = Tensor::ones((8, 4, 64), DType::F16, &dev)?;
/// let kv = Tensor::ones((10, 2, 64), DType::F16, &dev)?;
/// let seqlens_q = Tensor::new(&[0u32, 3, 8], &dev)?;
/// let seqlens_k = Tensor::new(&[0u32, 4, 10], &dev)?;
/// let (max_seqlen_q, max_seqlen_k) = (5, 6);
/// let out = sdpa_candle::flash_attn_varlen(
///     &q, &kv, &kv, &seqlens_q, &seqlens_k, max_seqlen_q, max_seqlen_k, 0.125, true,
/// )?;
/// assert_eq!(out.dims(), &[8, 4, 64]);
/// # Ok(())
/// # }
/// ```
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let window_size_right = causal.then_some(0);
    flash_attn_varlen_windowed(
        q,
        k,
        v,
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        None,
        window_size_right,
    )
}

/// [`flash_attn_varlen`] with candle-flash-attn's window arguments, per sequence: its query row
/// i sees keys j with `i + len_k - len_q - left <= j <= i + len_k - len_q + right`, `None`
/// meaning no bound on that side (`None, Some(0)` is causal; Mistral's sliding window is
/// `Some(w), Some(0)`).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    flash_attn_varlen_windowed_softcap(
        q,
        k,
        v,
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        None,
        window_size_left,
        window_size_right,
    )
}

/// [`flash_attn_varlen_windowed`] with Gemma 2's logit cap: scores become `softcap ·
/// tanh(scores / softcap)` before the softmax (`None`: no cap).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    softcap: Option<f32>,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let mask = sdpa::Mask::Window {
        left: window_size_left,
        right: window_size_right,
    }
    .canonical();
    let op = FlashAttnVarLen {
        softmax_scale,
        max_seqlen_q,
        max_seqlen_k,
        seqlens_q: seqlens_q.clone(),
        seqlens_k: seqlens_k.clone(),
        mask,
        softcap,
        checked: false,
    };
    q.apply_op3_no_bwd(k, v, &op)
}

/// The op behind [`flash_attn_varlen`]: one call of [`sdpa::forward`] on views on the GPU,
/// the offsets in [`sdpa::Extras`]; [`sdpa::reference_seqs`] on the CPU. It holds the offsets
/// tensors and reads their storage when it runs, as candle-flash-attn's op does.
#[derive(Debug, Clone)]
pub struct FlashAttnVarLen {
    /// The factor of Q·Kᵀ before the softmax (usually `1 / sqrt(head_dim)`).
    pub softmax_scale: f32,
    /// The most queries a sequence has.
    pub max_seqlen_q: usize,
    /// The most keys a sequence has.
    pub max_seqlen_k: usize,
    /// u32 `(batch + 1,)`, contiguous, on Q's device: where each sequence's queries start in Q,
    /// then where the last one ends.
    pub seqlens_q: Tensor,
    /// As `seqlens_q`, for each sequence's keys in K and V.
    pub seqlens_k: Tensor,
    /// Which keys each query row sees, aligned to its own sequence's lengths.
    pub mask: sdpa::Mask,
    /// The logit cap, if any.
    pub softcap: Option<f32>,
    /// Whether the GPU op first copies the offsets to the host and checks them (sdpa's
    /// `Seqs::checked`: a synchronization each call, for debugging). The CPU op always checks
    /// them.
    pub checked: bool,
}

/// The sizes of a packed batch, checked against each other.
#[derive(Debug, Clone, Copy)]
struct Packed {
    batch: usize,
    total_q: usize,
    total_k: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Packed {
    /// Whether the batch has no query rows or no keys: its output is all zeros (or empty), and
    /// no attention runs.
    fn is_empty(&self) -> bool {
        self.total_q == 0 || self.total_k == 0
    }
}

impl FlashAttnVarLen {
    /// The sizes Q, K, V and the offsets tensors give, each checked on the host (what needs no
    /// offset's value).
    fn packed(&self, dtype: DType, q: &Layout, k: &Layout, v: &Layout) -> Result<Packed> {
        sdpa_dtype(dtype)?;
        let (total_q, heads, head_dim) = q
            .shape()
            .dims3()
            .map_err(|e| e.context("sdpa-candle: q must be (total_q, heads, head_dim)"))?;
        let (total_k, kv_heads, dk) = k
            .shape()
            .dims3()
            .map_err(|e| e.context("sdpa-candle: k and v must be (total_k, kv_heads, head_dim)"))?;
        same_shape_kv(k, v)?;
        if dk != head_dim {
            bail!(
                "sdpa-candle: q is {:?} and k is {:?}: head_dim must match",
                q.shape(),
                k.shape()
            );
        }
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            bail!("sdpa-candle: k and v have {kv_heads} heads, which must divide q's {heads}");
        }
        last_dim_contiguous([("q", q), ("k", k), ("v", v)])?;
        let offsets_q = offsets_count("seqlens_q", &self.seqlens_q)?;
        let offsets_k = offsets_count("seqlens_k", &self.seqlens_k)?;
        if offsets_q != offsets_k {
            bail!(
                "sdpa-candle: seqlens_q holds {offsets_q} offsets and seqlens_k {offsets_k}; \
                 both hold batch + 1"
            );
        }
        if offsets_q < 2 {
            bail!(
                "sdpa-candle: seqlens_q and seqlens_k hold {offsets_q} offsets; batch + 1 is at \
                 least 2"
            );
        }
        Ok(Packed {
            batch: offsets_q - 1,
            total_q,
            total_k,
            heads,
            kv_heads,
            head_dim,
        })
    }

    /// The sdpa problem of a packed batch: `batch` sequences of at most `max_seqlen_q` queries
    /// and `max_seqlen_k` keys, Q and K/V packed.
    fn problem(&self, dtype: DType, s: &Packed) -> Result<Problem> {
        let mut p = Problem::new(
            s.batch,
            s.heads,
            self.max_seqlen_q,
            self.max_seqlen_k,
            s.head_dim,
        )
        .with_kv_heads(s.kv_heads)
        .with_scale(self.softmax_scale)
        .with_mask(self.mask)
        .with_dtype(sdpa_dtype(dtype)?)
        .with_layout(sdpa::Layout::Bshd)
        .with_packed_q(s.total_q)
        .with_packed_kv(s.total_k);
        p.seqs = p.seqs.with_checked(self.checked);
        if let Some(c) = self.softcap {
            p = p.with_softcap(c);
        }
        p.validate().map_err(Error::wrap)?;
        Ok(p)
    }

    /// Host copies of the offsets, as sdpa's i32 metadata.
    fn host_metadata(&self) -> Result<SeqMeta> {
        Ok(SeqMeta {
            cu_seqlens_q: Some(host_offsets("seqlens_q", &self.seqlens_q)?),
            cu_seqlens_k: Some(host_offsets("seqlens_k", &self.seqlens_k)?),
            ..SeqMeta::default()
        })
    }
}

/// How many offsets a `seqlens` tensor holds, having checked it is a contiguous u32 vector.
fn offsets_count(name: &'static str, t: &Tensor) -> Result<usize> {
    if t.dtype() != DType::U32 {
        return Err(Error::UnexpectedDType {
            msg: match name {
                "seqlens_q" => "sdpa-candle: seqlens_q holds u32 offsets",
                _ => "sdpa-candle: seqlens_k holds u32 offsets",
            },
            expected: DType::U32,
            got: t.dtype(),
        }
        .bt());
    }
    let n = t
        .dims1()
        .map_err(|e| e.context(format!("sdpa-candle: {name} must be (batch + 1,)")))?;
    if !t.is_contiguous() {
        bail!("sdpa-candle: {name} must be contiguous");
    }
    Ok(n)
}

/// The offsets of a CPU `seqlens` tensor as i32, each checked to fit.
fn host_offsets(name: &str, t: &Tensor) -> Result<Vec<i32>> {
    if !t.device().is_cpu() {
        bail!("sdpa-candle: {name} must be on the CPU with q, k and v");
    }
    t.to_vec1::<u32>()?
        .into_iter()
        .enumerate()
        .map(|(i, x)| {
            i32::try_from(x).map_err(|_| {
                Error::msg(format!(
                    "sdpa-candle: {name}[{i}] = {x} does not fit i32 (offsets are below 2^31)"
                ))
            })
        })
        .collect()
}

impl CustomOp3 for FlashAttnVarLen {
    fn name(&self) -> &'static str {
        "sdpa-flash-attn-varlen"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_l: &Layout,
        k: &CpuStorage,
        k_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        same_dtype(q.dtype(), k.dtype(), v.dtype())?;
        let shape = q_l.shape().clone();
        let packed = self.packed(q.dtype(), q_l, k_l, v_l)?;
        if packed.is_empty() {
            return Ok((
                cpu_storage(q.dtype(), &vec![0.0; shape.elem_count()]),
                shape,
            ));
        }
        let p = self.problem(q.dtype(), &packed)?;
        let meta = self.host_metadata()?;
        let (qv, kv, vv) = (
            host_values(q, q_l)?,
            host_values(k, k_l)?,
            host_values(v, v_l)?,
        );
        let out = sdpa::reference_seqs(&p, &qv, &kv, &vv, None, &meta).map_err(Error::wrap)?;
        Ok((cpu_storage(q.dtype(), &out.out), shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        q_l: &Layout,
        k: &candle_core::CudaStorage,
        k_l: &Layout,
        v: &candle_core::CudaStorage,
        v_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda;
        use half::{bf16, f16};
        same_dtype(q.dtype(), k.dtype(), v.dtype())?;
        let packed = self.packed(q.dtype(), q_l, k_l, v_l)?;
        let is_f16 = q.dtype() == DType::F16;
        if packed.is_empty() {
            return if is_f16 {
                cuda::zeros::<f16>(q, q_l.shape())
            } else {
                cuda::zeros::<bf16>(q, q_l.shape())
            };
        }
        let p = self.problem(q.dtype(), &packed)?;
        // The offsets' storage stays read-locked until the call is queued.
        let (cu_q, cu_q_l) = self.seqlens_q.storage_and_layout();
        let (cu_k, cu_k_l) = self.seqlens_k.storage_and_layout();
        let extras = sdpa::Extras {
            cu_seqlens_q: Some(cuda::offsets_as_i32("seqlens_q", &cu_q, cu_q_l)?),
            cu_seqlens_k: Some(cuda::offsets_as_i32("seqlens_k", &cu_k, cu_k_l)?),
            ..sdpa::Extras::default()
        };
        if is_f16 {
            cuda::forward::<f16>(&p, (q, q_l), (k, k_l), (v, v_l), extras)
        } else {
            cuda::forward::<bf16>(&p, (q, q_l), (k, k_l), (v, v_l), extras)
        }
    }
}
