//! mistral.rs: its flash backend takes `(batch, seq, heads, head_dim)` tensors, softcap and
//! sliding window from the model's config, and for batches of mixed lengths flattens them to
//! varlen with offsets made by a cumulative sum; its paged layer calls the paged form on a
//! block table.

use candle_core::{DType, Device, Result, Tensor};
use sdpa_candle as candle_flash_attn;

/// The parameters its attention layers pass.
#[derive(Debug, Clone)]
pub struct SdpaParams {
    /// Gemma 2's `attn_logit_softcapping`.
    pub softcap: Option<f32>,
    /// The model's sliding window, if any.
    pub sliding_window: Option<usize>,
    /// The softmax scale.
    pub softmax_scale: f32,
}

/// Offsets of a varlen batch, as its input metadata holds them.
pub struct FlashParams {
    pub max_q: u32,
    pub max_k: u32,
    pub cumulative_seqlens_q: Tensor,
    pub cumulative_seqlens_k: Tensor,
}

/// Cumulative offsets of `lens`: a cumulative sum in f32 on the device, back to u32.
pub fn cumulative(lens: &[u32], dev: &Device) -> Result<Tensor> {
    let mut seqlens = vec![0u32];
    seqlens.extend_from_slice(lens);
    Tensor::new(seqlens.as_slice(), dev)?
        .to_dtype(DType::F32)?
        .cumsum(0)?
        .to_dtype(DType::U32)
}

/// Its v2 flash backend on `(b, seq, heads, head_dim)` tensors.
pub fn flash_attn_v2(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    flash_params: Option<&FlashParams>,
    sdpa_params: &SdpaParams,
    causal: bool,
) -> Result<Tensor> {
    let window_size_left = sdpa_params.sliding_window;
    let window_size_right = if causal { Some(0) } else { None };
    if let Some(fp) = flash_params {
        let qshape = q.shape();
        let q = q.flatten_to(1)?;
        let k = k.flatten_to(1)?;
        let v = v.flatten_to(1)?;
        if let Some(softcap) = sdpa_params.softcap {
            candle_flash_attn::flash_attn_varlen_alibi_windowed_softcap(
                &q,
                &k,
                &v,
                None,
                &fp.cumulative_seqlens_q,
                &fp.cumulative_seqlens_k,
                fp.max_q as usize,
                fp.max_k as usize,
                sdpa_params.softmax_scale,
                window_size_left,
                window_size_right,
                softcap,
            )?
            .reshape(qshape)
        } else {
            candle_flash_attn::flash_attn_varlen_windowed(
                &q,
                &k,
                &v,
                &fp.cumulative_seqlens_q,
                &fp.cumulative_seqlens_k,
                fp.max_q as usize,
                fp.max_k as usize,
                sdpa_params.softmax_scale,
                window_size_left,
                window_size_right,
            )?
            .reshape(qshape)
        }
    } else if let Some(softcap) = sdpa_params.softcap {
        candle_flash_attn::flash_attn_alibi_windowed_softcap(
            q,
            k,
            v,
            None,
            sdpa_params.softmax_scale,
            window_size_left,
            window_size_right,
            softcap,
        )
    } else {
        candle_flash_attn::flash_attn_windowed(
            q,
            k,
            v,
            sdpa_params.softmax_scale,
            window_size_left,
            window_size_right,
        )
    }
}

/// Its paged layer: `query` `(b, heads, seq, head_dim)`, the caches `(num_blocks, kv_heads,
/// block_size, head_dim)` (each head's rows of a block together), each sequence's blocks in
/// `block_tables` `(b, max_blocks)`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    query: &Tensor,
    key_cache: &Tensor,
    value_cache: &Tensor,
    block_tables: &Tensor,
    query_lens: &[u32],
    kv_lens: &[u32],
    block_size: usize,
    sdpa_params: &SdpaParams,
) -> Result<Tensor> {
    let (b, heads, s, d) = query.dims4()?;
    let dev = query.device();
    let q_flat = query.transpose(1, 2)?.reshape(((), heads, d))?;
    let to_cu = |lens: &[u32]| -> Result<Tensor> {
        let mut cu = vec![0u32];
        for l in lens {
            cu.push(cu.last().unwrap() + l);
        }
        Tensor::new(cu.as_slice(), &Device::Cpu)?.to_device(dev)
    };
    let (cu_q, cu_kv) = (to_cu(query_lens)?, to_cu(kv_lens)?);
    let max_q = *query_lens.iter().max().unwrap() as usize;
    let max_k = *kv_lens.iter().max().unwrap() as usize;
    let causal = s > 1;
    let k_paged = key_cache.transpose(1, 2)?;
    let v_paged = value_cache.transpose(1, 2)?;
    candle_flash_attn::flash_attn_varlen_paged_windowed(
        &q_flat,
        &k_paged,
        &v_paged,
        &cu_q,
        &cu_kv,
        block_tables,
        None,
        max_q,
        max_k,
        sdpa_params.softmax_scale,
        sdpa_params.sliding_window,
        causal.then_some(0),
        block_size,
        sdpa_params.softcap,
    )?
    .reshape((b, s, heads, d))?
    .transpose(1, 2)
}
