//! candle-transformers: a cfg-gated shim called from each model's attention with
//! `(batch, heads, seq, head_dim)` tensors transposed to candle-flash-attn's layout.

use candle_core::{Result, Tensor};
use sdpa_candle as candle_flash_attn;

/// The shim each model file carries (behind `#[cfg(feature = "flash-attn")]` there).
fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    candle_flash_attn::flash_attn(q, k, v, softmax_scale, causal)
}

/// A Llama-style attention core: `q`, `k`, `v` are `(b, heads, seq, head_dim)` after rotary
/// embeddings and the KV cache (K and V with their own head count: grouped-query); returns
/// `(b, seq, heads · head_dim)`.
pub fn llama_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (b, heads, seq_len, head_dim) = q.dims4()?;
    let q = q.transpose(1, 2)?;
    let k = k.transpose(1, 2)?;
    let v = v.transpose(1, 2)?;
    let softmax_scale = 1f32 / (head_dim as f32).sqrt();
    let y = flash_attn(&q, &k, &v, softmax_scale, seq_len > 1)?.transpose(1, 2)?;
    y.transpose(1, 2)?.reshape((b, seq_len, heads * head_dim))
}

/// Stable Diffusion's cross-attention: `(batch · heads, seq, head_dim)` tensors of any float
/// dtype, run in f16 as one batch entry of `batch · heads` heads, no mask.
pub fn stable_diffusion_attention(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let init_dtype = query.dtype();
    let query = query
        .to_dtype(candle_core::DType::F16)?
        .unsqueeze(0)?
        .transpose(1, 2)?;
    let key = key
        .to_dtype(candle_core::DType::F16)?
        .unsqueeze(0)?
        .transpose(1, 2)?;
    let value = value
        .to_dtype(candle_core::DType::F16)?
        .unsqueeze(0)?
        .transpose(1, 2)?;
    flash_attn(&query, &key, &value, scale as f32, false)?
        .transpose(1, 2)?
        .squeeze(0)?
        .to_dtype(init_dtype)
}

/// The op held as a struct literal and applied directly, as some model code does.
pub fn struct_literal_causal(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
) -> Result<Tensor> {
    let flash = candle_flash_attn::FlashAttn {
        softmax_scale,
        alibi_slopes: None,
        window_size_left: None,
        window_size_right: Some(0),
        softcap: None,
    };
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    q.apply_op3_no_bwd(&k, &v, &flash)
}
