//! A Llama-style attention block in candle on GPU 0: Q, K and V projections, rotary position
//! embeddings, grouped-query causal attention through `sdpa_candle::flash_attn`, and the output
//! projection; the same block with candle's own attention (`attention_unfused`, f32 scores)
//! beside it, their difference and their times.
//!
//!     cargo run --release -p sdpa-candle --features cuda --example llama_attention

use candle_core::{D, DType, Device, Module, Result, Tensor};
use std::time::Instant;

/// Sizes of one Llama-3-8B-like layer, at a short prompt.
const BATCH: usize = 2;
const SEQ: usize = 1024;
const HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const HIDDEN: usize = HEADS * HEAD_DIM;

/// A bias-free linear layer `x · Wᵀ`.
struct Linear(Tensor);

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.broadcast_matmul(&self.0.t()?)
    }
}

fn linear(out: usize, inp: usize, dev: &Device) -> Result<Linear> {
    let w = (Tensor::randn(0f32, 1.0, (out, inp), dev)? / (inp as f64).sqrt())?;
    Ok(Linear(w.to_dtype(DType::BF16)?))
}

/// Rotary embeddings (rotate-half form) of `x`, `(batch, seq, heads, head_dim)`.
fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = HEAD_DIM / 2;
    let (x1, x2) = (
        x.narrow(D::Minus1, 0, half)?,
        x.narrow(D::Minus1, half, half)?,
    );
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

/// cos and sin of the rotary angles, shaped `(seq, 1, head_dim)` to broadcast over heads.
fn rotary_tables(dev: &Device) -> Result<(Tensor, Tensor)> {
    let inv: Vec<f32> = (0..HEAD_DIM / 2)
        .map(|i| 1.0 / 500_000f32.powf(2.0 * i as f32 / HEAD_DIM as f32))
        .collect();
    let inv = Tensor::from_vec(inv, (1, HEAD_DIM / 2), dev)?;
    let pos = Tensor::arange(0u32, SEQ as u32, dev)?
        .to_dtype(DType::F32)?
        .reshape((SEQ, 1))?;
    let angles = pos.broadcast_mul(&inv)?;
    let angles = Tensor::cat(&[&angles, &angles], D::Minus1)?.reshape((SEQ, 1, HEAD_DIM))?;
    Ok((
        angles.cos()?.to_dtype(DType::BF16)?,
        angles.sin()?.to_dtype(DType::BF16)?,
    ))
}

type Attention = fn(&Tensor, &Tensor, &Tensor, f32, bool) -> Result<Tensor>;

struct Block {
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    cos: Tensor,
    sin: Tensor,
}

impl Block {
    fn forward(&self, x: &Tensor, attention: Attention) -> Result<Tensor> {
        let q = self.wq.forward(x)?.reshape((BATCH, SEQ, HEADS, HEAD_DIM))?;
        let k = self
            .wk
            .forward(x)?
            .reshape((BATCH, SEQ, KV_HEADS, HEAD_DIM))?;
        let v = self
            .wv
            .forward(x)?
            .reshape((BATCH, SEQ, KV_HEADS, HEAD_DIM))?;
        let (q, k) = (
            rotary(&q, &self.cos, &self.sin)?,
            rotary(&k, &self.cos, &self.sin)?,
        );
        let scale = 1.0 / (HEAD_DIM as f32).sqrt();
        let o = attention(&q, &k, &v, scale, true)?;
        self.wo.forward(&o.reshape((BATCH, SEQ, HIDDEN))?)
    }
}

/// Milliseconds per call of `f` (after a warm-up call), synchronising the device.
fn time(dev: &Device, mut f: impl FnMut() -> Result<Tensor>) -> Result<f64> {
    f()?;
    dev.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..10 {
        f()?;
    }
    dev.synchronize()?;
    Ok(t0.elapsed().as_secs_f64() * 100.0)
}

fn main() -> Result<()> {
    let dev = Device::new_cuda(0)?;
    let (cos, sin) = rotary_tables(&dev)?;
    let block = Block {
        wq: linear(HIDDEN, HIDDEN, &dev)?,
        wk: linear(KV_HEADS * HEAD_DIM, HIDDEN, &dev)?,
        wv: linear(KV_HEADS * HEAD_DIM, HIDDEN, &dev)?,
        wo: linear(HIDDEN, HIDDEN, &dev)?,
        cos,
        sin,
    };
    let x = Tensor::randn(0f32, 1.0, (BATCH, SEQ, HIDDEN), &dev)?.to_dtype(DType::BF16)?;
    let fused = block.forward(&x, sdpa_candle::flash_attn)?;
    let unfused = block.forward(&x, sdpa_candle::attention_unfused)?;
    let (f, u) = (fused.to_dtype(DType::F32)?, unfused.to_dtype(DType::F32)?);
    let rel =
        ((&f - &u)?.sqr()?.sum_all()?.sqrt()? / u.sqr()?.sum_all()?.sqrt()?)?.to_scalar::<f32>()?;
    println!(
        "Llama-style attention block, batch {BATCH}, seq {SEQ}, {HEADS} heads ({KV_HEADS} KV), \
         head_dim {HEAD_DIM}, bf16, causal"
    );
    println!("relative difference, sdpa vs candle's own attention: {rel:.2e}");
    let t_fused = time(&dev, || block.forward(&x, sdpa_candle::flash_attn))?;
    let t_unfused = time(&dev, || block.forward(&x, sdpa_candle::attention_unfused))?;
    println!("block: {t_fused:.3} ms with sdpa, {t_unfused:.3} ms with candle's own attention");
    // A NaN difference fails too.
    if rel.is_nan() || rel >= 2e-2 {
        candle_core::bail!("the two attentions disagree: relative difference {rel:e}");
    }
    Ok(())
}
