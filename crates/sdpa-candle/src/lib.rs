//! candle ops on [`sdpa`]: attention for candle tensors, with candle-flash-attn's functions and
//! layout, so a model switches by changing the import.
//!
//! Tensors are `(batch, seq, heads, head_dim)`, f16 or bf16, head_dim contiguous; K and V may
//! have fewer heads than Q (grouped-query attention). On a CUDA device (feature `cuda`) the op
//! reads candle's buffers in place at their strides and queues on candle's stream (no copy, no
//! synchronisation); on the CPU it runs sdpa's float64 reference, for tests and small models.
//!
//! Batches of sequences of different lengths go packed, without padding, through
//! [`flash_attn_varlen`] and its windowed and softcapped forms: Q `(total_q, heads, head_dim)`,
//! K and V `(total_k, kv_heads, head_dim)`, and each sequence's rows given by u32 offsets, as
//! candle-flash-attn takes them.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! # fn main() -> candle_core::Result<()> {
//! let q = Tensor::ones((1, 16, 4, 64), DType::F16, &Device::Cpu)?;
//! let kv = Tensor::ones((1, 16, 2, 64), DType::F16, &Device::Cpu)?;
//! let out = sdpa_candle::flash_attn(&q, &kv, &kv, 0.125, true)?;
//! assert_eq!(out.dims(), &[1, 16, 4, 64]);
//! # Ok(())
//! # }
//! ```

#[cfg(feature = "cuda")]
mod cuda;
mod unfused;
mod varlen;

pub use unfused::{attention_unfused, attention_unfused_windowed};
pub use varlen::{
    FlashAttnVarLen, flash_attn_varlen, flash_attn_varlen_windowed,
    flash_attn_varlen_windowed_softcap,
};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, bail};
use half::{bf16, f16};
use sdpa::Problem;

/// Attention over `(batch, seq, heads, head_dim)` tensors: `softmax(softmax_scale · Q·Kᵀ +
/// mask) · V`, with the causal mask aligned bottom-right when `causal` (query row i sees keys
/// j ≤ i + seq_k − seq_q, as FlashAttention 2 and later). K and V have `heads / g` heads for
/// grouped-query attention. Returns a contiguous tensor of Q's shape and dtype.
pub fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let mask = if causal {
        sdpa::Mask::CausalBottomRight
    } else {
        sdpa::Mask::None
    };
    q.apply_op3_no_bwd(
        k,
        v,
        &FlashAttn {
            softmax_scale,
            mask,
            softcap: None,
        },
    )
}

/// [`flash_attn`] with candle-flash-attn's window arguments: query row i sees keys j with
/// `i + seq_k - seq_q - left <= j <= i + seq_k - seq_q + right`, `None` meaning no bound on that
/// side (`None, Some(0)` is causal; Mistral's sliding window is `Some(w), Some(0)`).
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    flash_attn_windowed_softcap(
        q,
        k,
        v,
        softmax_scale,
        None,
        window_size_left,
        window_size_right,
    )
}

/// [`flash_attn_windowed`] with Gemma 2's logit cap: scores become `softcap · tanh(scores /
/// softcap)` before the softmax (`None`: no cap).
pub fn flash_attn_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
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
    q.apply_op3_no_bwd(
        k,
        v,
        &FlashAttn {
            softmax_scale,
            mask,
            softcap,
        },
    )
}

/// The op behind [`flash_attn`]: one call of [`sdpa::forward`] on views on the GPU (backend
/// `Auto`), [`sdpa::reference`] on the CPU.
#[derive(Debug, Clone, Copy)]
pub struct FlashAttn {
    /// The factor of Q·Kᵀ before the softmax (usually `1 / sqrt(head_dim)`).
    pub softmax_scale: f32,
    /// Which keys each query row sees.
    pub mask: sdpa::Mask,
    /// The logit cap, if any.
    pub softcap: Option<f32>,
}

impl FlashAttn {
    /// The sdpa problem of Q, K and V laid out as `q`, `k`, `v` say.
    fn problem(&self, dtype: DType, q: &Layout, k: &Layout, v: &Layout) -> Result<Problem> {
        let dtype = sdpa_dtype(dtype)?;
        let (b, sq, h, d) = q.shape().dims4()?;
        let (bk, sk, hk, dk) = k.shape().dims4()?;
        same_shape_kv(k, v)?;
        if (bk, dk) != (b, d) {
            bail!(
                "sdpa-candle: q is {:?} and k is {:?}: batch and head_dim must match",
                q.shape(),
                k.shape()
            );
        }
        last_dim_contiguous([("q", q), ("k", k), ("v", v)])?;
        let mut p = Problem::new(b, h, sq, sk, d)
            .with_kv_heads(hk)
            .with_scale(self.softmax_scale)
            .with_mask(self.mask)
            .with_dtype(dtype)
            .with_layout(sdpa::Layout::Bshd);
        if let Some(c) = self.softcap {
            p = p.with_softcap(c);
        }
        p.validate().map_err(candle_core::Error::wrap)?;
        Ok(p)
    }
}

impl CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "sdpa-flash-attn"
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
        let p = self.problem(q.dtype(), q_l, k_l, v_l)?;
        let (qv, kv, vv) = (
            host_values(q, q_l)?,
            host_values(k, k_l)?,
            host_values(v, v_l)?,
        );
        let out = sdpa::reference(&p, &qv, &kv, &vv).map_err(candle_core::Error::wrap)?;
        Ok((cpu_storage(q.dtype(), &out), q_l.shape().clone()))
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
        same_dtype(q.dtype(), k.dtype(), v.dtype())?;
        let p = self.problem(q.dtype(), q_l, k_l, v_l)?;
        // A dense batch takes nothing beyond Q, K and V.
        let extras = sdpa::Extras::default();
        match q.dtype() {
            DType::F16 => cuda::forward::<f16>(&p, (q, q_l), (k, k_l), (v, v_l), extras),
            _ => cuda::forward::<bf16>(&p, (q, q_l), (k, k_l), (v, v_l), extras),
        }
    }
}

/// The sdpa element type of a candle dtype: f16 and bf16 only.
pub(crate) fn sdpa_dtype(dtype: DType) -> Result<sdpa::DType> {
    match dtype {
        DType::F16 => Ok(sdpa::DType::F16),
        DType::BF16 => Ok(sdpa::DType::Bf16),
        other => bail!("sdpa-candle: {other:?} tensors are not supported (f16 or bf16)"),
    }
}

/// That Q, K and V share one dtype.
pub(crate) fn same_dtype(q: DType, k: DType, v: DType) -> Result<()> {
    if q != k || q != v {
        bail!("sdpa-candle: q, k and v are {q:?}, {k:?} and {v:?}; they must match");
    }
    Ok(())
}

/// That K and V have one shape.
pub(crate) fn same_shape_kv(k: &Layout, v: &Layout) -> Result<()> {
    if k.shape() != v.shape() {
        bail!(
            "sdpa-candle: k is {:?} and v is {:?}; they must match",
            k.shape(),
            v.shape()
        );
    }
    Ok(())
}

/// That each named layout has a contiguous last dimension (head_dim), as the kernels read rows.
pub(crate) fn last_dim_contiguous<'a>(
    layouts: impl IntoIterator<Item = (&'a str, &'a Layout)>,
) -> Result<()> {
    for (name, l) in layouts {
        if l.stride().last() != Some(&1) {
            bail!(
                "sdpa-candle: the last dimension of {name} must be contiguous (strides {:?})",
                l.stride()
            );
        }
    }
    Ok(())
}

/// The f16 or bf16 elements `l` addresses in `s`, in row-major order, as f64 (the reference's
/// input).
pub(crate) fn host_values(s: &CpuStorage, l: &Layout) -> Result<Vec<f64>> {
    Ok(match s {
        CpuStorage::F16(x) => gather(x, l, |e| f64::from(e.to_f32())),
        CpuStorage::BF16(x) => gather(x, l, |e| f64::from(e.to_f32())),
        other => bail!("sdpa-candle: {:?} storage", other.dtype()),
    })
}

/// The reference's f64 output as CPU storage of `dtype` (f16, else bf16).
pub(crate) fn cpu_storage(dtype: DType, out: &[f64]) -> CpuStorage {
    match dtype {
        DType::F16 => CpuStorage::F16(out.iter().map(|&x| f16::from_f64(x)).collect()),
        _ => CpuStorage::BF16(out.iter().map(|&x| bf16::from_f64(x)).collect()),
    }
}

/// The elements a layout addresses in `data`, in row-major order, converted by `f`: each row (the
/// last dimension, contiguous) copied whole.
fn gather<T: Copy>(data: &[T], l: &Layout, f: impl Fn(T) -> f64) -> Vec<f64> {
    let (dims, strides) = (l.dims(), l.stride());
    let (leading, row_len) = (&dims[..dims.len() - 1], dims[dims.len() - 1]);
    let rows: usize = leading.iter().product();
    let mut out = Vec::with_capacity(l.shape().elem_count());
    for r in 0..rows {
        // Row r's index in each leading dimension, innermost first, gives its offset.
        let (mut rest, mut at) = (r, l.start_offset());
        for (&n, &stride) in leading.iter().zip(strides).rev() {
            at += (rest % n) * stride;
            rest /= n;
        }
        out.extend(data[at..at + row_len].iter().map(|&x| f(x)));
    }
    out
}
