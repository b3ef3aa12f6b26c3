//! `sdpa run`: attention on .npy files, so PyTorch/NumPy users can check us.

use crate::npy;
use crate::open_device;
use sdpa::{Backend, DType, Error, Layout, Problem, Result, Scaling, Tensor};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Q as .npy (float32 or float16), shape [B, H, Sq, D] (or [B, Sq, H, D] with --layout bshd;
    /// 3-D arrays mean B = 1).
    #[arg(long)]
    q: PathBuf,
    /// K as .npy, shape [B, H_kv, Sk, D].
    #[arg(long)]
    k: PathBuf,
    /// V as .npy, K's shape.
    #[arg(long)]
    v: PathBuf,
    /// Output .npy (float32, Q's shape).
    #[arg(long)]
    out: PathBuf,
    /// Causal mask (aligned bottom-right when Sq != Sk).
    #[arg(long)]
    causal: bool,
    /// Backend; `cpu` is the float64 reference.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Inputs are rounded to this type before any backend sees them: f16, bf16, or e4m3
    /// (quantized with amax scales, see --scaling).
    #[arg(long, default_value = "f16")]
    dtype: String,
    /// e4m3: scales per tensor or per (batch, head): tensor or head.
    #[arg(long, default_value = "head")]
    scaling: String,
    /// e4m3: the output dtype the kernel writes (f16 or bf16).
    #[arg(long, default_value = "f16")]
    out_dtype: String,
    /// Softmax scale; default 1/sqrt(D).
    #[arg(long)]
    scale: Option<f32>,
    /// bhsd or bshd.
    #[arg(long, default_value = "bhsd")]
    layout: String,
}

fn dims4(shape: &[usize], what: &str) -> Result<[usize; 4]> {
    match *shape {
        [a, b, c, d] => Ok([a, b, c, d]),
        [b, c, d] => Ok([1, b, c, d]),
        _ => Err(Error::InvalidArgument(format!(
            "{what} has shape {shape:?}; expected 4 dimensions (or 3, meaning batch 1)"
        ))),
    }
}

pub fn main(a: Args) -> Result<ExitCode> {
    let backend: Backend = a.backend.parse()?;
    let dtype: DType = a.dtype.parse()?;
    let layout: Layout = a.layout.parse()?;
    let scaling: Scaling = a.scaling.parse()?;
    let out_dtype: DType = a.out_dtype.parse()?;
    let (q, qshape) = npy::read(&a.q)?;
    let (k, kshape) = npy::read(&a.k)?;
    let (v, vshape) = npy::read(&a.v)?;
    let (qd, kd) = (dims4(&qshape, "q")?, dims4(&kshape, "k")?);
    if vshape != kshape {
        return Err(Error::InvalidArgument(format!(
            "v has shape {vshape:?} but k has {kshape:?}; they must match"
        )));
    }
    // Per layout: (batch, heads, seq, head_dim).
    let split = |d: [usize; 4]| match layout {
        Layout::Bhsd => (d[0], d[1], d[2], d[3]),
        Layout::Bshd => (d[0], d[2], d[1], d[3]),
    };
    let (b, h, sq, dq) = split(qd);
    let (bk, hk, sk, dk) = split(kd);
    if b != bk || dq != dk {
        return Err(Error::InvalidArgument(format!(
            "q {qshape:?} and k {kshape:?} disagree on batch or head_dim"
        )));
    }
    let mut p = Problem::new(b, h, sq, sk, dq)
        .with_kv_heads(hk)
        .with_causal(a.causal)
        .with_dtype(dtype)
        .with_layout(layout);
    if let Some(s) = a.scale {
        p = p.with_scale(s);
    }
    if dtype == DType::E4m3 {
        p = p.with_fp8_scaling(scaling).with_out_dtype(out_dtype);
    }
    p.validate()?;
    let od = p.output_dtype();
    let shapes = [p.q_shape(), p.kv_shape(), p.kv_shape()];

    let dev = if backend == Backend::Cpu {
        None
    } else {
        open_device()
    };
    let out: Vec<f32> = match &dev {
        Some(dev) => {
            let up = |x: &[f32], i: usize| match dtype {
                DType::E4m3 => Tensor::quantize_f32(dev, x, shapes[i], scaling),
                _ => Tensor::from_f32(dev, dtype, x),
            };
            let (qt, kt, vt) = (up(&q, 0)?, up(&k, 1)?, up(&v, 2)?);
            let mut ot = Tensor::poisoned(dev, od, p.q_len().unwrap())?;
            sdpa::forward(dev, &p, backend, &qt, &kt, &vt, &mut ot)?;
            ot.to_f32(dev)?
        }
        None => {
            let round = |x: &[f32], i: usize| -> Result<Vec<f64>> {
                Ok(match dtype {
                    DType::E4m3 => {
                        let (codes, s) = sdpa::fp8::quantize_host(x, &shapes[i], scaling)?;
                        let d = sdpa::fp8::dequantize_host(&codes, &s, &shapes[i], scaling);
                        d.into_iter().map(f64::from).collect()
                    }
                    _ => sdpa::decode(dtype, &sdpa::encode(dtype, x)),
                })
            };
            let o = sdpa::reference(&p, &round(&q, 0)?, &round(&k, 1)?, &round(&v, 2)?)?;
            o.into_iter().map(|x| x as f32).collect()
        }
    };
    npy::write(&a.out, &out, &qshape)?;
    let used = match &dev {
        Some(d) => backend.resolve(Some(d), &p)?.name(),
        None => "cpu",
    };
    println!("{p}: wrote {} ({} backend)", a.out.display(), used);
    Ok(ExitCode::SUCCESS)
}
