//! `sdpa run`: attention on .npy files, so PyTorch/NumPy users can check us.

use crate::{CliResult, chosen_backend, device_for, npy};
use sdpa::{Alibi, Backend, DType, Error, Fp8Mode, Layout, Problem, Result, Scaling, Tensor};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Q as .npy (float64, float32 or float16), shape [B, H, Sq, D] (or [B, Sq, H, D] with --layout bshd;
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
    /// A mask instead of --causal: none, causal, causal-top-left, or a sliding window L,R.
    #[arg(long, allow_hyphen_values = true)]
    mask: Option<String>,
    /// Sliding window L,R: keys left and right of the bottom-right diagonal a row sees (-1:
    /// unbounded), FlashAttention's window_size; `L,0` is causal with a window.
    #[arg(long, allow_hyphen_values = true)]
    window: Option<String>,
    /// Logit cap: scores become softcap · tanh(scores / softcap).
    #[arg(long)]
    softcap: Option<f32>,
    /// ALiBi slopes as .npy: [H] or [B, H].
    #[arg(long)]
    alibi: Option<PathBuf>,
    /// Also write each row's log-sum-exp here (.npy, float32 [B, H, Sq]).
    #[arg(long)]
    lse: Option<PathBuf>,
    /// Backend; `cpu` is the float64 reference. Default `auto`: the best GPU backend, or the
    /// CPU reference where there is no GPU. A named backend that cannot run is an error.
    #[arg(long)]
    backend: Option<String>,
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
    /// e4m3: accurate (P·V in 16 bit) or fast (P·V on e4m3 tensor cores where the backend has
    /// them; the cpu reference is exact either way).
    #[arg(long, default_value = "accurate")]
    fp8_mode: String,
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

/// Whether `a` and `b` name the same file: the same device and inode where both exist (hard
/// links, symlinks and any spelling of the path), else the same canonical path.
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => (x.dev(), x.ino()) == (y.dev(), y.ino()),
        _ => canonical(a) == canonical(b),
    }
}

/// `path` made absolute and resolved as far as it exists (its folder, for a file not yet
/// written).
fn canonical(path: &Path) -> PathBuf {
    if let Ok(p) = std::fs::canonicalize(path) {
        return p;
    }
    match (path.parent(), path.file_name()) {
        (Some(dir), Some(name)) => canonical_dir(dir).join(name),
        _ => path.to_path_buf(),
    }
}

fn canonical_dir(dir: &Path) -> PathBuf {
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf())
}

/// Refuses an `--out` that names one of the inputs: the result would replace it.
fn refuse_overwriting_inputs(a: &Args) -> Result<()> {
    let mut inputs = vec![("--q", &a.q), ("--k", &a.k), ("--v", &a.v)];
    inputs.extend(a.alibi.as_ref().map(|p| ("--alibi", p)));
    let mut outputs = vec![("--out", &a.out)];
    outputs.extend(a.lse.as_ref().map(|p| ("--lse", p)));
    for (out_flag, out) in &outputs {
        for (flag, input) in &inputs {
            if same_file(out, input) {
                return Err(Error::InvalidArgument(format!(
                    "{out_flag} {} is the same file as {flag} {}; refusing to overwrite an input",
                    out.display(),
                    input.display()
                )));
            }
        }
    }
    if let Some(lse) = &a.lse
        && same_file(lse, &a.out)
    {
        return Err(Error::InvalidArgument(format!(
            "--lse and --out are the same file ({})",
            lse.display()
        )));
    }
    Ok(())
}

/// How the arrays were read, and the flag that reads them the other way.
fn layout_hint(layout: Layout, qshape: &[usize]) -> String {
    let (read, other, flag) = match layout {
        Layout::Bhsd => ("[B, H, S, D] (bhsd)", "[B, S, H, D]", "--layout bshd"),
        Layout::Bshd => ("[B, S, H, D] (bshd)", "[B, H, S, D]", "--layout bhsd"),
    };
    format!("q {qshape:?} was read as {read}; if the arrays are {other}, pass {flag}")
}

pub fn main(a: Args) -> CliResult<ExitCode> {
    let requested: Backend = a.backend.as_deref().unwrap_or("auto").parse()?;
    let dtype: DType = a.dtype.parse()?;
    let layout: Layout = a.layout.parse()?;
    let scaling: Scaling = a.scaling.parse()?;
    let out_dtype: DType = a.out_dtype.parse()?;
    let fp8_mode: Fp8Mode = a.fp8_mode.parse()?;
    refuse_overwriting_inputs(&a)?;
    let (q, qshape) = npy::read(&a.q)?;
    let (k, kshape) = npy::read(&a.k)?;
    let (v, vshape) = npy::read(&a.v)?;
    let (qd, kd) = (dims4(&qshape, "q")?, dims4(&kshape, "k")?);
    if vshape != kshape {
        return Err(Error::InvalidArgument(format!(
            "v has shape {vshape:?} but k has {kshape:?}; they must match"
        ))
        .into());
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
            "q {qshape:?} and k {kshape:?} disagree on batch or head_dim; {}",
            layout_hint(layout, &qshape)
        ))
        .into());
    }
    let mut p = Problem::new(b, h, sq, sk, dq)
        .with_kv_heads(hk)
        .with_causal(a.causal)
        .with_dtype(dtype)
        .with_layout(layout)
        .with_lse(a.lse.is_some());
    if usize::from(a.causal) + usize::from(a.mask.is_some()) + usize::from(a.window.is_some()) > 1 {
        return Err(
            Error::InvalidArgument("give one of --causal, --mask and --window".into()).into(),
        );
    }
    if let Some(m) = a.mask.as_ref().or(a.window.as_ref()) {
        p = p.with_mask(m.parse()?);
    }
    if let Some(s) = a.scale {
        p = p.with_scale(s);
    }
    if let Some(c) = a.softcap {
        p = p.with_softcap(c);
    }
    let slopes = match &a.alibi {
        Some(path) => {
            let (s, shape) = npy::read(path)?;
            let layout = match shape[..] {
                [n] if n == h => Alibi::PerHead,
                [nb, n] if nb == b && n == h => Alibi::PerBatchHead,
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "{}: ALiBi slopes of shape {shape:?}; expected [{h}] or [{b}, {h}]",
                        path.display()
                    ))
                    .into());
                }
            };
            p = p.with_alibi(layout);
            Some(s)
        }
        None => None,
    };
    if dtype == DType::E4m3 {
        p = p.with_fp8_scaling(scaling).with_out_dtype(out_dtype);
    }
    p = p.with_fp8_mode(fp8_mode);
    p.validate().map_err(|e| match e {
        // Heads that do not divide are most often arrays of the other layout.
        Error::InvalidArgument(msg) if msg.contains("kv_heads") => {
            Error::InvalidArgument(format!("{msg}; {}", layout_hint(layout, &qshape)))
        }
        other => other,
    })?;
    let od = p.output_dtype();
    let shapes = [p.q_shape(), p.kv_shape(), p.kv_shape()];

    let dev = device_for(&[requested], a.backend.is_some())?;
    let backend = chosen_backend(dev.as_ref(), &p, requested)?;
    let gpu = dev.as_ref().filter(|_| backend != Backend::Cpu);
    let (out, lse): (Vec<f32>, Vec<f32>) = match gpu {
        Some(dev) => {
            let up = |x: &[f32], i: usize| match dtype {
                DType::E4m3 => Tensor::quantize_f32(dev, x, shapes[i], scaling),
                _ => Tensor::from_f32(dev, dtype, x),
            };
            let (qt, kt, vt) = (up(&q, 0)?, up(&k, 1)?, up(&v, 2)?);
            let mut ot = Tensor::poisoned(dev, od, p.q_len().unwrap())?;
            let mut bufs = sdpa_harness::check::ExtraBuffers::new(dev, &p, slopes.as_deref())?;
            let t = sdpa::Operands {
                q: &qt,
                k: &kt,
                v: &vt,
                out: &mut ot,
            };
            sdpa::forward_with(dev, &p, backend, t, bufs.extras())?;
            let lse = bufs.lse(dev)?.unwrap_or_default();
            let lse: Vec<f32> = lse.into_iter().map(|x| x as f32).collect();
            (ot.to_f32(dev)?, lse)
        }
        None => {
            let round = |x: &[f32], i: usize| -> Result<Vec<f64>> {
                Ok(match dtype {
                    DType::E4m3 => {
                        let (codes, s) = sdpa::fp8::quantize_host(x, &shapes[i], scaling)?;
                        let d = sdpa::fp8::dequantize_host(&codes, &s, &shapes[i], scaling)?;
                        d.into_iter().map(f64::from).collect()
                    }
                    _ => sdpa::decode(dtype, &sdpa::encode(dtype, x)),
                })
            };
            let r = sdpa::reference_with(
                &p,
                &round(&q, 0)?,
                &round(&k, 1)?,
                &round(&v, 2)?,
                slopes.as_deref(),
            )?;
            let f32s = |x: Vec<f64>| x.into_iter().map(|x| x as f32).collect();
            (f32s(r.out), f32s(r.lse))
        }
    };
    npy::write(&a.out, &out, &qshape)?;
    if let Some(path) = &a.lse {
        npy::write(path, &lse, &[b, h, sq])?;
    }
    outln!("{p}: wrote {} ({backend} backend)", a.out.display())?;
    Ok(ExitCode::SUCCESS)
}
