//! candle ops on [`sdpa`]: candle-flash-attn's functions, argument for argument, so that a
//! model switches with one line:
//!
//! ```
//! use sdpa_candle as candle_flash_attn;
//! # use candle_core::{DType, Device, Tensor};
//! # fn main() -> candle_core::Result<()> {
//! # let q = Tensor::ones((1, 16, 4, 64), DType::F16, &Device::Cpu)?;
//! # let (k, v) = (Tensor::ones((1, 16, 2, 64), DType::F16, &Device::Cpu)?, q.narrow(2, 0, 2)?);
//! let out = candle_flash_attn::flash_attn(&q, &k, &v, 0.125, true)?;
//! assert_eq!(out.dims(), &[1, 16, 4, 64]);
//! # Ok(())
//! # }
//! ```
//!
//! Each use, its functions and tensors, and an example (doctests on the CPU, which run as tests;
//! the examples under `examples/` need a GPU and the `cuda` feature):
//!
//! | what | functions | tensors | example |
//! |---|---|---|---|
//! | one batch of equal lengths | [`flash_attn`], [`flash_attn_windowed`] | `(batch, seq, heads, head_dim)` | [`flash_attn`] (GQA, against candle's own attention); `examples/llama_attention.rs` |
//! | ALiBi (JinaBERT, MPT, Bloom) | [`flash_attn_alibi`], [`flash_attn_alibi_windowed`], [`flash_attn_alibi_windowed_softcap`] | slopes f32 `(heads)` | [`flash_attn_alibi`] |
//! | sequences of different lengths, packed | [`flash_attn_varlen`], [`flash_attn_varlen_windowed`], [`flash_attn_varlen_alibi`], [`flash_attn_varlen_alibi_windowed`], [`flash_attn_varlen_alibi_windowed_softcap`] | `(total, heads, head_dim)` and u32 offsets | [`flash_attn_varlen`] |
//! | a paged K/V cache (prefill or decode) | [`flash_attn_varlen_paged_windowed`] | `(pages, page_size, kv_heads, head_dim)` and a block table | [`flash_attn_varlen_paged_windowed`] (a decode step) |
//! | new K/V rows into a paged cache, by slot (vLLM's `reshape_and_cache_flash`) | [`write_kv`] | `(rows, kv_heads, head_dim)` and i64 slots | [`write_kv`]; `examples/serve_decoder.rs` (varlen prefill, paged decode, a CUDA graph) |
//! | the log-sum-exp of each row too | [`FlashAttn::forward_with_lse`], [`FlashAttnVarLen::forward_with_lse`] | f32 `(batch, heads, seq_q)` or `(heads, total_q)` | [`FlashAttn::forward_with_lse`] |
//! | every option at once | [`FlashAttn`], [`FlashAttnVarLen`]: the ops, one field per option | | [`FlashAttn::forward_with_lse`] |
//! | check against candle's own attention | [`attention_unfused`], [`attention_unfused_windowed`] | as [`flash_attn`] | [`flash_attn`] |
//!
//! FP8 (e4m3) inputs and ring attention over several GPUs have no candle op here yet: they are
//! [`sdpa`]'s ([`sdpa::Fp8Views`], `sdpa::distributed`), on device buffers.
//!
//! Tensors are f16 or bf16 with head_dim contiguous; K and V may have fewer heads than Q
//! (grouped-query attention). Masks follow FlashAttention: a window `(left, right)` lets query
//! row i see keys j with `i + seq_k − seq_q − left ≤ j ≤ i + seq_k − seq_q + right` (`None`: no
//! bound), so `(None, Some(0))` is causal, aligned bottom-right; ALiBi adds
//! `−slope · |i + seq_k − seq_q − j|` to each score; softcap `c` maps a score `s` to
//! `c · tanh(s / c)` (`0.0`: none). A query row that sees no key is zeros.
//!
//! On a CUDA device (feature `cuda`) the ops read candle's buffers in place at their strides and
//! queue on candle's stream (no copy, no synchronisation); on the CPU they run sdpa's float64
//! reference, for tests and small models (candle-flash-attn has no CPU path). Unlike
//! candle-flash-attn, no function panics or reads out of bounds on bad shapes or metadata: each
//! is an error. The ops record themselves in candle's graph, so `loss.backward()` through them
//! gives dQ, dK and dV (the sinks take none): on a GPU from sdpa's backward (the forward runs
//! again for its log-sum-exp, which the op cannot keep; a paged cache has no backward), on the
//! CPU from sdpa's float64 reference gradient.

mod cache;
mod call;
#[cfg(feature = "cuda")]
mod cuda;
mod dense;
mod host;
mod unfused;
mod varlen;

pub use cache::write_kv;
pub use dense::{
    FlashAttn, flash_attn, flash_attn_alibi, flash_attn_alibi_windowed,
    flash_attn_alibi_windowed_softcap, flash_attn_windowed,
};
pub use unfused::{attention_unfused, attention_unfused_windowed};
pub use varlen::{
    FlashAttnVarLen, flash_attn_varlen, flash_attn_varlen_alibi, flash_attn_varlen_alibi_windowed,
    flash_attn_varlen_alibi_windowed_softcap, flash_attn_varlen_paged_windowed,
    flash_attn_varlen_windowed,
};
