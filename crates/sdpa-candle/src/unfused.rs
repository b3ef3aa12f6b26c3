//! Attention from candle's own ops (matmul, softmax, matmul) in f32: what the fused op is checked
//! against, on any candle device.

use candle_core::{D, DType, Result, Tensor};

/// [`crate::flash_attn`] computed with candle's ops in f32 (the result in the inputs' dtype):
/// scores materialised, K and V heads repeated for grouped-query attention, the causal mask
/// aligned bottom-right.
pub fn attention_unfused(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let right = if causal { Some(0) } else { None };
    attention_unfused_windowed(q, k, v, softmax_scale, None, None, right)
}

/// [`crate::FlashAttn`] (a window and a softcap) computed with candle's ops in f32. Every query
/// row must see at least one key (a row that sees none is NaN here, zeros in the fused op).
pub fn attention_unfused_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    softcap: Option<f32>,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let (_, sq, h, _) = q.dims4()?;
    let (_, sk, hk, _) = k.dims4()?;
    // (batch, heads, seq, head_dim), f32, K and V heads repeated g times each.
    let heads_first = |t: &Tensor, g: usize| -> Result<Tensor> {
        let t = t.to_dtype(DType::F32)?.transpose(1, 2)?.contiguous()?;
        if g == 1 {
            return Ok(t);
        }
        let (b, n, s, d) = t.dims4()?;
        t.unsqueeze(2)?
            .broadcast_as((b, n, g, s, d))?
            .reshape((b, n * g, s, d))
    };
    let (q32, k32, v32) = (
        heads_first(q, 1)?,
        heads_first(k, h / hk)?,
        heads_first(v, h / hk)?,
    );
    let mut scores = (q32.matmul(&k32.t()?)? * f64::from(softmax_scale))?;
    if let Some(c) = softcap {
        scores = ((scores / f64::from(c))?.tanh()? * f64::from(c))?;
    }
    let window = sdpa::Mask::Window {
        left: window_size_left,
        right: window_size_right,
    };
    if window.hides_keys() {
        // Row i sees keys [i + sk - sq - left, i + sk - sq + right].
        let mask: Vec<f32> = (0..sq)
            .flat_map(|i| {
                let keys = window.visible(i, sq, sk);
                (0..sk).map(move |j| {
                    if keys.contains(&j) {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (sq, sk), q.device())?;
        scores = scores.broadcast_add(&mask)?;
    }
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v32)?.transpose(1, 2)?.to_dtype(q.dtype())
}
