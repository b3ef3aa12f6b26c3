//! candle ops on [`sdpa`]: attention for candle tensors, with candle-flash-attn's functions and
//! layout, so a model switches by changing the import.
//!
//! Tensors are `(batch, seq, heads, head_dim)`, f16 or bf16, head_dim contiguous; K and V may
//! have fewer heads than Q (grouped-query attention). On a CUDA device (feature `cuda`) the op
//! reads candle's buffers in place at their strides and queues on candle's stream (no copy, no
//! synchronisation); on the CPU it runs sdpa's float64 reference, for tests and small models.
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

pub use unfused::{attention_unfused, attention_unfused_windowed};

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

/// The op behind [`flash_attn`]: one call of [`sdpa::forward_views`] on the GPU (backend
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
        let dtype = match dtype {
            DType::F16 => sdpa::DType::F16,
            DType::BF16 => sdpa::DType::Bf16,
            other => bail!("sdpa-candle: {other:?} tensors are not supported (f16 or bf16)"),
        };
        let (b, sq, h, d) = q.shape().dims4()?;
        let (bk, sk, hk, dk) = k.shape().dims4()?;
        if k.shape() != v.shape() {
            bail!(
                "sdpa-candle: k is {:?} and v is {:?}; they must match",
                k.shape(),
                v.shape()
            );
        }
        if (bk, dk) != (b, d) {
            bail!(
                "sdpa-candle: q is {:?} and k is {:?}: batch and head_dim must match",
                q.shape(),
                k.shape()
            );
        }
        for (name, l) in [("q", q), ("k", k), ("v", v)] {
            if l.stride()[3] != 1 {
                bail!(
                    "sdpa-candle: the last dimension of {name} must be contiguous (strides {:?})",
                    l.stride()
                );
            }
        }
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
        if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
            bail!(
                "sdpa-candle: q, k and v are {:?}, {:?} and {:?}; they must match",
                q.dtype(),
                k.dtype(),
                v.dtype()
            );
        }
        let p = self.problem(q.dtype(), q_l, k_l, v_l)?;
        let values = |s: &CpuStorage, l: &Layout| -> Result<Vec<f64>> {
            Ok(match s {
                CpuStorage::F16(x) => gather(x, l, |e| f64::from(e.to_f32())),
                CpuStorage::BF16(x) => gather(x, l, |e| f64::from(e.to_f32())),
                other => bail!("sdpa-candle: {:?} storage", other.dtype()),
            })
        };
        let (qv, kv, vv) = (values(q, q_l)?, values(k, k_l)?, values(v, v_l)?);
        let out = sdpa::reference(&p, &qv, &kv, &vv).map_err(candle_core::Error::wrap)?;
        let storage = match q.dtype() {
            DType::F16 => CpuStorage::F16(out.iter().map(|&x| f16::from_f64(x)).collect()),
            _ => CpuStorage::BF16(out.iter().map(|&x| bf16::from_f64(x)).collect()),
        };
        Ok((storage, q_l.shape().clone()))
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
        if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
            bail!("sdpa-candle: q, k and v must have one dtype");
        }
        let p = self.problem(q.dtype(), q_l, k_l, v_l)?;
        match q.dtype() {
            DType::F16 => cuda::forward::<f16>(&p, (q, q_l), (k, k_l), (v, v_l)),
            _ => cuda::forward::<bf16>(&p, (q, q_l), (k, k_l), (v, v_l)),
        }
    }
}

/// The elements a `(batch, seq, heads, head_dim)` layout addresses in `data`, in that order,
/// converted by `f`.
fn gather<T: Copy>(data: &[T], l: &Layout, f: impl Fn(T) -> f64) -> Vec<f64> {
    let dims = l.dims();
    let st = l.stride();
    let mut out = Vec::with_capacity(l.shape().elem_count());
    for b in 0..dims[0] {
        for s in 0..dims[1] {
            for h in 0..dims[2] {
                let row = l.start_offset() + b * st[0] + s * st[1] + h * st[2];
                out.extend(data[row..row + dims[3]].iter().map(|&x| f(x)));
            }
        }
    }
    out
}
