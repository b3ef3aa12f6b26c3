//! Training through the op: a small attention block (Q, K and V projections, grouped-query
//! causal attention, the output projection) fitted to a fixed teacher block by plain gradient
//! descent, with `loss.backward()` running through `sdpa_candle::flash_attn`, its first step's
//! gradients checked against the same block on candle's own attention: on the CPU (sdpa's
//! float64 reference gradient) and on a GPU (sdpa's backward; feature `cuda`).

mod common;

use candle_core::{DType, Device, Result, Tensor, Var};
use common::{randn, rel_diff};
use sdpa_candle::{attention_unfused, flash_attn};

const BATCH: usize = 2;
const SEQ: usize = 12;
const HIDDEN: usize = 32;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 8;

/// The block's weights: `x · Wᵀ` projections, f32 (the attention runs in bf16).
struct Block {
    wq: Var,
    wk: Var,
    wv: Var,
    wo: Var,
}

impl Block {
    fn new(dev: &Device) -> Result<Block> {
        let w = |out: usize| -> Result<Var> {
            Var::from_tensor(&(randn((out, HIDDEN), DType::F32, dev)? / (HIDDEN as f64).sqrt())?)
        };
        Ok(Block {
            wq: w(HEADS * HEAD_DIM)?,
            wk: w(KV_HEADS * HEAD_DIM)?,
            wv: w(KV_HEADS * HEAD_DIM)?,
            wo: Var::from_tensor(
                &(randn((HIDDEN, HEADS * HEAD_DIM), DType::F32, dev)?
                    / ((HEADS * HEAD_DIM) as f64).sqrt())?,
            )?,
        })
    }

    fn vars(&self) -> [&Var; 4] {
        [&self.wq, &self.wk, &self.wv, &self.wo]
    }

    /// The block on `x` `(batch, seq, hidden)`, its attention `attend`.
    fn forward(
        &self,
        x: &Tensor,
        attend: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let proj = |w: &Var, heads: usize| -> Result<Tensor> {
            x.broadcast_matmul(&w.as_tensor().t()?)?
                .reshape((BATCH, SEQ, heads, HEAD_DIM))?
                .to_dtype(DType::BF16)
        };
        let (q, k, v) = (
            proj(&self.wq, HEADS)?,
            proj(&self.wk, KV_HEADS)?,
            proj(&self.wv, KV_HEADS)?,
        );
        attend(&q, &k, &v)?
            .to_dtype(DType::F32)?
            .reshape((BATCH, SEQ, HEADS * HEAD_DIM))?
            .broadcast_matmul(&self.wo.as_tensor().t()?)
    }
}

fn fused(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    flash_attn(q, k, v, 1.0 / (HEAD_DIM as f32).sqrt(), true)
}

fn unfused(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    attention_unfused(q, k, v, 1.0 / (HEAD_DIM as f32).sqrt(), true)
}

/// Fits a student block to a teacher block on `dev` by gradient descent through the op.
fn fit(dev: &Device) -> Result<()> {
    let x = randn((BATCH, SEQ, HIDDEN), DType::F32, dev)?;
    let target = Block::new(dev)?.forward(&x, unfused)?;
    let student = Block::new(dev)?;
    let mse = |y: Tensor| (y - &target)?.sqr()?.mean_all();

    // The first step's gradients, through the op and through candle's attention.
    let through_op = mse(student.forward(&x, fused)?)?.backward()?;
    let through_candle = mse(student.forward(&x, unfused)?)?.backward()?;
    for (name, w) in ["wq", "wk", "wv", "wo"].into_iter().zip(student.vars()) {
        let d = rel_diff(through_op.get(w).unwrap(), through_candle.get(w).unwrap())?;
        assert!(
            d < 2e-2,
            "{name}: the op's gradient is {d} from candle's attention's"
        );
    }

    let mut losses = Vec::new();
    for _ in 0..30 {
        let loss = mse(student.forward(&x, fused)?)?;
        losses.push(loss.to_scalar::<f32>()?);
        let grads = loss.backward()?;
        for w in student.vars() {
            w.set(&(w.as_tensor() - (grads.get(w).unwrap() * 0.5)?)?)?;
        }
    }
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    eprintln!(
        "{dev:?}: loss over {} steps: {first} -> {last}",
        losses.len()
    );
    assert!(
        last < 0.5 * first && losses.windows(2).filter(|w| w[1] > w[0]).count() <= 3,
        "the loss went {losses:?}"
    );
    Ok(())
}

#[test]
fn gradient_descent_through_the_op_fits_a_teacher_block() -> Result<()> {
    fit(&Device::Cpu)
}

#[cfg(feature = "cuda")]
#[test]
fn gradient_descent_through_the_op_fits_a_teacher_block_on_the_gpu() -> Result<()> {
    let Some(dev) = common::gpu("gpu training") else {
        return Ok(());
    };
    fit(&dev)
}
