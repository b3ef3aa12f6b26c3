//! A batch of sequences of one length: candle-flash-attn's `FlashAttn` op and its five functions,
//! on `(batch, seq, heads, head_dim)` tensors.

use crate::call::{self, Call, Meta, Resolve};
use crate::host;
use candle_core::{DType, Layout, Result, Shape, Tensor, bail};
use sdpa::Problem;

/// Attention over `(batch, seq, heads, head_dim)` tensors: `softmax(softmax_scale · Q·Kᵀ +
/// mask) · V`, with the causal mask aligned bottom-right when `causal` (query row i sees keys
/// j ≤ i + seq_k − seq_q, as FlashAttention 2 and later). K and V have `heads / g` heads for
/// grouped-query attention. V may have a head dim of its own (DeepSeek's 192-wide Q and K, 128-wide
/// V), which the output takes. Returns a contiguous tensor of Q's shape (with V's head dim) and
/// Q's dtype.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// // 8 query heads over 2 K/V heads; 6 queries against 10 keys, causal from the end.
/// let randn = |shape: (usize, usize, usize, usize)| {
///     Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?.to_dtype(DType::F16)
/// };
/// let (q, k, v) = (randn((2, 6, 8, 64))?, randn((2, 10, 2, 64))?, randn((2, 10, 2, 64))?);
/// let out = sdpa_candle::flash_attn(&q, &k, &v, 0.125, true)?;
/// // candle's own matmul, softmax, matmul agrees to f16's rounding.
/// let want = sdpa_candle::attention_unfused(&q, &k, &v, 0.125, true)?;
/// let diff = (out.to_dtype(DType::F32)? - want.to_dtype(DType::F32)?)?.abs()?.max_all()?;
/// assert!(diff.to_scalar::<f32>()? < 4e-3);
/// # Ok(())
/// # }
/// ```
pub fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    flash_attn_windowed(q, k, v, softmax_scale, None, causal.then_some(0))
}

/// [`flash_attn`] with a window: query row i sees keys j with `i + seq_k − seq_q − left ≤ j ≤ i +
/// seq_k − seq_q + right`, `None` meaning no bound on that side (`None, Some(0)` is causal;
/// Mistral's sliding window is `Some(w), Some(0)`).
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    FlashAttn {
        softmax_scale,
        alibi_slopes: None,
        window_size_left,
        window_size_right,
        softcap: None,
    }
    .forward(q, k, v)
}

/// [`flash_attn`] with ALiBi: `alibi_slopes`, f32 `(heads)` (or `(batch, heads)`), add
/// `−slope · |i + seq_k − seq_q − j|` to the score of query row i and key j.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// // One query against two keys whose values are 0 and 1; Q is zero, so only ALiBi weighs them:
/// // key 0 is one position back, exp(−ln 3) = 1/3 of key 1's weight.
/// let q = Tensor::zeros((1, 1, 1, 64), DType::F16, &Device::Cpu)?;
/// let v = Tensor::new(&[0f32, 1.0], &Device::Cpu)?
///     .reshape((1, 2, 1, 1))?
///     .broadcast_as((1, 2, 1, 64))?
///     .to_dtype(DType::F16)?
///     .contiguous()?;
/// let slopes = Tensor::new(&[3f32.ln()], &Device::Cpu)?;
/// let out = sdpa_candle::flash_attn_alibi(&q, &v, &v, &slopes, 0.125, true)?;
/// // (1/3 · 0 + 1 · 1) / (1/3 + 1)
/// let out = out.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
/// assert!(out.iter().all(|&x| x == 0.75));
/// # Ok(())
/// # }
/// ```
pub fn flash_attn_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    flash_attn_alibi_windowed(
        q,
        k,
        v,
        alibi_slopes,
        softmax_scale,
        None,
        causal.then_some(0),
    )
}

/// [`flash_attn_alibi`] with [`flash_attn_windowed`]'s window.
pub fn flash_attn_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    FlashAttn {
        softmax_scale,
        alibi_slopes: Some(alibi_slopes.clone()),
        window_size_left,
        window_size_right,
        softcap: None,
    }
    .forward(q, k, v)
}

/// [`flash_attn_alibi_windowed`] with optional slopes and Gemma 2's logit cap: scores become
/// `softcap · tanh(scores / softcap)` before the softmax (`0.0`: no cap, as FlashAttention).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    FlashAttn {
        softmax_scale,
        alibi_slopes: alibi_slopes.cloned(),
        window_size_left,
        window_size_right,
        softcap: Some(softcap),
    }
    .forward(q, k, v)
}

/// The op behind the functions, candle-flash-attn's `FlashAttn` field for field: apply it with
/// [`FlashAttn::forward`] (or candle's `apply_op3`), or take the log-sum-exp too with
/// [`FlashAttn::forward_with_lse`]. On the GPU one call of [`sdpa::forward`] on views (backend
/// `Auto`); on the CPU [`sdpa::reference_seqs`].
#[derive(Debug, Clone)]
pub struct FlashAttn {
    /// The factor of Q·Kᵀ before the softmax (usually `1 / sqrt(head_dim)`).
    pub softmax_scale: f32,
    /// f32 ALiBi slopes, `(heads)` or `(batch, heads)`, on Q's device.
    pub alibi_slopes: Option<Tensor>,
    /// The keys before a query row's diagonal it sees (`None`: all).
    pub window_size_left: Option<usize>,
    /// The keys after a query row's diagonal it sees (`None`: all; `Some(0)`: causal).
    pub window_size_right: Option<usize>,
    /// The logit cap, if any (`Some(0.0)` is none).
    pub softcap: Option<f32>,
}

impl FlashAttn {
    /// The op on Q, K and V, recorded in candle's graph (a backward through it: sdpa's
    /// backward on a GPU, the float64 reference's gradients on the CPU).
    pub fn forward(self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        q.apply_op3(k, v, self)
    }

    /// The op's output and each query row's log-sum-exp (f32 `(batch, heads, seq_q)`, natural
    /// log; -inf for a row that sees no key), outside candle's graph.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use sdpa_candle::FlashAttn;
    /// # fn main() -> candle_core::Result<()> {
    /// // Q is zero, so every score is 0 and a row's log-sum-exp is ln(the keys it sees).
    /// let q = Tensor::zeros((1, 3, 4, 64), DType::F16, &Device::Cpu)?;
    /// let kv = Tensor::ones((1, 5, 4, 64), DType::F16, &Device::Cpu)?;
    /// let op = FlashAttn {
    ///     softmax_scale: 0.125,
    ///     alibi_slopes: None,
    ///     window_size_left: None,
    ///     window_size_right: Some(0), // causal
    ///     softcap: None,
    /// };
    /// let (out, lse) = op.forward_with_lse(&q, &kv, &kv)?;
    /// assert_eq!((out.dims(), lse.dims()), (q.dims(), &[1, 4, 3][..]));
    /// // Aligned bottom-right: query row i sees keys 0..=i + 2.
    /// let got = lse.get(0)?.get(0)?.to_vec1::<f32>()?;
    /// let want = [3f32, 4.0, 5.0].map(f32::ln);
    /// assert!(got.iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-6));
    /// # Ok(())
    /// # }
    /// ```
    pub fn forward_with_lse(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        call::forward_with_lse(self, q, k, v)
    }
}

/// The sdpa mask of candle-flash-attn's window arguments.
pub(crate) fn window_mask(left: Option<usize>, right: Option<usize>) -> sdpa::Mask {
    sdpa::Mask::Window { left, right }.canonical()
}

/// The cap of candle-flash-attn's `softcap` (0 is none, as FlashAttention reads it).
pub(crate) fn cap(softcap: Option<f32>) -> Option<f32> {
    softcap.filter(|&c| c != 0.0)
}

impl Resolve for FlashAttn {
    fn resolve(&self, dtype: DType, q: &Layout, k: &Layout, v: &Layout) -> Result<Call<'_>> {
        let dtype = host::sdpa_dtype(dtype)?;
        let (b, sq, h, d) = q
            .shape()
            .dims4()
            .map_err(|e| e.context("sdpa-candle: q must be (batch, seq_q, heads, head_dim)"))?;
        let (bk, sk, hk, dk) = k.shape().dims4().map_err(|e| {
            e.context("sdpa-candle: k and v must be (batch, seq_k, kv_heads, head_dim)")
        })?;
        let dv = host::v_head_dim(k, v)?;
        if (bk, dk) != (b, d) {
            bail!(
                "sdpa-candle: q is {:?} and k is {:?}: batch and head_dim must match",
                q.shape(),
                k.shape()
            );
        }
        host::last_dim_contiguous([("q", q), ("k", k), ("v", v)])?;
        let mut p = Problem::new(b, h, sq, sk, d)
            .with_head_dim_v(dv)
            .with_kv_heads(hk)
            .with_scale(self.softmax_scale)
            .with_mask(window_mask(self.window_size_left, self.window_size_right))
            .with_dtype(dtype)
            .with_layout(sdpa::Layout::Bshd);
        if let Some(c) = cap(self.softcap) {
            p = p.with_softcap(c);
        }
        if let Some(s) = &self.alibi_slopes {
            p = p.with_alibi(call::alibi_layout(s, b, h)?);
        }
        p.validate().map_err(candle_core::Error::wrap)?;
        Ok(Call {
            problem: Some(p),
            strides: [q, k, v].map(host::strides_bshd),
            out_shape: host::out_shape(q, dv),
            out_strides: host::strides_bshd(&Layout::contiguous(host::out_shape(q, dv))),
            lse_shape: Shape::from((b, h, sq)),
            meta: Meta::default(),
            alibi: self.alibi_slopes.as_ref(),
            // Field for field candle-flash-attn's op, which has none: sinks go through
            // FlashAttnVarLen.
            sinks: None,
        })
    }
}

crate::call::custom_op3!(FlashAttn, "sdpa-flash-attn");
