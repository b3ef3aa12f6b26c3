//! text-embeddings-inference: one varlen wrapper over candle-flash-attn for every flash model,
//! called with views of a packed `(tokens, 3 · heads, head_dim)` QKV projection, one offsets
//! tensor for queries and keys, and the batch's longest sequence.

use candle_core::{D, DType, Device, Result, Tensor};
use sdpa_candle as candle_flash_attn;

/// TEI's wrapper: ALiBi or not, causal or a window.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    use candle_flash_attn::{flash_attn_varlen_alibi_windowed, flash_attn_varlen_windowed};
    let window_size_right = if causal { Some(0) } else { window_size_right };
    match alibi_slopes {
        Some(alibi_slopes) => flash_attn_varlen_alibi_windowed(
            q,
            k,
            v,
            alibi_slopes,
            seqlens_q,
            seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            window_size_left,
            window_size_right,
        ),
        None => flash_attn_varlen_windowed(
            q,
            k,
            v,
            seqlens_q,
            seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            window_size_left,
            window_size_right,
        ),
    }
}

/// A batch as TEI's router hands it to a model: each sequence's offset, and the longest.
pub struct Batch {
    /// u32 `(batch + 1)` offsets on the model's device.
    pub cu_seqlens: Tensor,
    /// The longest sequence.
    pub max_s: usize,
}

impl Batch {
    /// The batch of sequences of `lens` tokens on `device`.
    pub fn new(lens: &[u32], device: &Device) -> Result<Batch> {
        let mut cumulative_seq_lengths = vec![0u32];
        for l in lens {
            cumulative_seq_lengths.push(cumulative_seq_lengths.last().unwrap() + l);
        }
        let batch_size = lens.len();
        Ok(Batch {
            cu_seqlens: Tensor::from_vec(cumulative_seq_lengths, batch_size + 1, device)?,
            max_s: *lens.iter().max().unwrap_or(&0) as usize,
        })
    }
}

/// The mask and bias of a flash model's attention layer.
#[derive(Debug, Clone, Copy)]
pub enum Layer {
    /// BERT-like: bidirectional, no bias.
    Bert,
    /// ModernBERT's local layers: a window of `local_attention / 2` on each side.
    ModernBertLocal { local_attention: usize },
    /// A decoder used as an embedder (Mistral, Qwen): causal, with a sliding window.
    Causal { sliding_window: Option<usize> },
}

/// A flash model's attention on a packed QKV projection `(tokens, 3 · heads, head_dim)` (f16):
/// Q, K and V are views of it, as TEI's models split it. Returns `(tokens, heads · head_dim)`.
pub fn attention(
    qkv: &Tensor,
    batch: &Batch,
    layer: Layer,
    alibi_slopes: Option<&Tensor>,
) -> Result<Tensor> {
    let head_size = qkv.dim(D::Minus1)?;
    let softmax_scale = (1. / (head_size as f64).sqrt()) as f32;
    let qkv = qkv.chunk(3, 1)?;
    let (causal, window) = match layer {
        Layer::Bert => (false, None),
        Layer::ModernBertLocal { local_attention } => (false, Some(local_attention / 2)),
        Layer::Causal { sliding_window } => (true, sliding_window),
    };
    let window_right = if causal { None } else { window };
    let attention = flash_attn_varlen(
        &qkv[0],
        &qkv[1],
        &qkv[2],
        alibi_slopes,
        &batch.cu_seqlens,
        &batch.cu_seqlens,
        batch.max_s,
        batch.max_s,
        softmax_scale,
        causal,
        window,
        window_right,
    )?;
    attention.flatten_from(D::Minus2)
}

/// JinaBERT's ALiBi slopes: the geometric sequence of ALiBi's paper for a power of two heads,
/// interleaved with the next power's for others; f32 `(heads)`.
pub fn alibi_head_slopes(num_heads: usize, device: &Device) -> Result<Tensor> {
    fn power_of_two(n: usize) -> Vec<f64> {
        let start = 2f64.powf(-(2f64.powf(-((n as f64).log2() - 3f64))));
        (0..n).map(|i| start * start.powi(i as i32)).collect()
    }
    let slopes = if (num_heads as f64).log2().fract() == 0.0 {
        power_of_two(num_heads)
    } else {
        let closest = 2usize.pow((num_heads as f64).log2().floor() as u32);
        let mut s = power_of_two(closest);
        s.extend(
            power_of_two(2 * closest)
                .into_iter()
                .step_by(2)
                .take(num_heads - closest),
        );
        s
    };
    Tensor::from_vec(slopes, num_heads, device)?.to_dtype(DType::F32)
}
