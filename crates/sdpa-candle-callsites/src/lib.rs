//! Call sites of `candle-flash-attn` written the way its users write them, each module
//! switched to sdpa-candle by its import alone (`use sdpa_candle as candle_flash_attn;`): that
//! this crate compiles is the drop-in's first proof; its tests (CPU, and GPU 0 with the `cuda`
//! feature) check what the calls compute.
//!
//! Written after the public code of candle-transformers (`models/llama.rs` and its siblings,
//! `stable_diffusion/attention.rs`), text-embeddings-inference (`backends/candle/src/
//! flash_attn.rs` and the flash models: BERT, JinaBERT with ALiBi, ModernBERT's local layers,
//! Mistral's sliding window) and mistral.rs (`attention/backends/flash.rs`, its paged layer):
//! the same functions, argument forms and tensor preparation, in our own code.

pub mod candle_transformers;
pub mod mistralrs;
pub mod tei;
