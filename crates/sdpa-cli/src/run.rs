//! `sdpa run`: attention on .npy files, so PyTorch/NumPy users can check us.

use crate::{CliResult, chosen_backend, device_for, npy, output};
use sdpa::{
    Alibi, Backend, DType, Error, Fp8Mode, Layout, MemoryKind, Problem, Result, Scaling, Tensor,
};
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
    /// V as .npy: K's shape but for its head dim (the last axis), which the output takes.
    #[arg(long, required_unless_present = "v_in_k", conflicts_with = "v_in_k")]
    v: Option<PathBuf>,
    /// Instead of --v: V is the first N columns of K's rows (MLA's latent cache, as FlashMLA
    /// takes it: K 576 wide, V its first 512), read from K itself.
    #[arg(long, value_name = "N")]
    v_in_k: Option<usize>,
    /// Output .npy (float32, Q's shape with V's head dim).
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
    #[arg(long, allow_negative_numbers = true)]
    softcap: Option<f32>,
    /// ALiBi slopes as .npy: [H] or [B, H].
    #[arg(long)]
    alibi: Option<PathBuf>,
    /// Attention sinks as .npy: float32 [H], one logit per query head that joins each row's
    /// softmax and weights no value (gpt-oss, FlashAttention-4's learnable_sink); -inf: none.
    #[arg(long)]
    sinks: Option<PathBuf>,
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
    /// The output dtype the kernel writes: f16 or bf16 for e4m3 inputs (default f16); f32 for
    /// f16/bf16 inputs (cutlass on sm_90a and cpu write it; default: the input dtype).
    #[arg(long)]
    out_dtype: Option<String>,
    /// e4m3: accurate (P·V in 16 bit) or fast (P·V on e4m3 tensor cores where the backend has
    /// them; the cpu reference is exact either way).
    #[arg(long, default_value = "accurate")]
    fp8_mode: String,
    /// Softmax scale; default 1/sqrt(D).
    #[arg(long, allow_negative_numbers = true)]
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

/// Checks `--out` and `--lse` before anything is read or run: each can be written, and neither
/// is an input or the other.
fn check_outputs(a: &Args) -> Result<()> {
    let mut inputs: Vec<output::Named> = vec![("--q", &a.q), ("--k", &a.k)];
    inputs.extend(a.v.as_deref().map(|p| ("--v", p)));
    inputs.extend(a.alibi.as_deref().map(|p| ("--alibi", p)));
    inputs.extend(a.sinks.as_deref().map(|p| ("--sinks", p)));
    let mut outputs: Vec<output::Named> = vec![("--out", &a.out)];
    outputs.extend(a.lse.as_deref().map(|p| ("--lse", p)));
    output::check(&outputs, &inputs)
}

/// Refuses values that the rounding to `dtype` would turn into infinities, which attention
/// turns into NaN rows: an infinity in the file, or a finite value beyond the dtype's range
/// (f16: 65504). e4m3 scales its inputs into range, so only infinities are refused there (its
/// quantization refuses them too); f32, an output type only, is refused by the problem's
/// validation after this. NaN passes through, as it does in every dtype. The error
/// names the input, the first offending element and its value.
fn check_fits(flag: &str, path: &Path, x: &[f32], dtype: DType) -> Result<()> {
    let overflows = |v: f32| match dtype {
        DType::F16 => half::f16::from_f32(v).is_infinite(),
        DType::Bf16 => half::bf16::from_f32(v).is_infinite(),
        DType::E4m3 | DType::F32 => v.is_infinite(),
    };
    let Some(i) = x.iter().position(|&v| overflows(v)) else {
        return Ok(());
    };
    let (v, at) = (x[i], path.display());
    if v.is_infinite() {
        return Err(Error::InvalidArgument(format!(
            "{flag} {at}: element {i} is {v}; infinite inputs are refused (NaN passes through)"
        )));
    }
    let (max, other) = match dtype {
        DType::Bf16 => (f64::from(half::bf16::MAX), "e4m3"),
        _ => (f64::from(half::f16::MAX), "bf16 or e4m3"),
    };
    Err(Error::InvalidArgument(format!(
        "{flag} {at}: element {i} is {v}, which overflows {dtype} (largest finite {max}); \
         scale the inputs, or pass --dtype {other}"
    )))
}

/// Sink logits must be below +inf and not NaN (-inf is no sink): either makes every row of its
/// head NaN.
fn check_sinks(path: &Path, sinks: &[f32]) -> Result<()> {
    match sinks.iter().position(|s| s.is_nan() || *s == f32::INFINITY) {
        Some(i) => Err(Error::InvalidArgument(format!(
            "--sinks {}: sink {i} is {}; sinks must be finite or -inf (no sink)",
            path.display(),
            sinks[i]
        ))),
        None => Ok(()),
    }
}

/// ALiBi slopes must be finite: a NaN or infinite slope makes its head's output NaN.
fn check_slopes(path: &Path, slopes: &[f32]) -> Result<()> {
    match slopes.iter().position(|s| !s.is_finite()) {
        Some(i) => Err(Error::InvalidArgument(format!(
            "--alibi {}: slope {i} is {}; slopes must be finite",
            path.display(),
            slopes[i]
        ))),
        None => Ok(()),
    }
}

/// An empty vector with room for `n` elements of `T`, or `Error::OutOfMemory` where the host
/// cannot give it (checked first, then reserved fallibly): never an abort.
fn host_vec<T>(n: usize) -> Result<Vec<T>> {
    let bytes = n.checked_mul(std::mem::size_of::<T>());
    sdpa::memory::check_host(bytes)?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::OutOfMemory {
        kind: MemoryKind::Host,
        needed: bytes.unwrap_or(usize::MAX),
        available: sdpa::memory::host_available(),
    })?;
    Ok(v)
}

/// `f` of each element of `x`, into a vector from `host_vec`.
fn try_map<T: Copy, U>(x: &[T], f: impl Fn(T) -> U) -> Result<Vec<U>> {
    let mut out = host_vec(x.len())?;
    out.extend(x.iter().map(|&v| f(v)));
    Ok(out)
}

/// Elements rounded per step by `round_to`: the codec's temporaries stay at a few hundred KiB
/// however large the input.
const ROUND_CHUNK: usize = 1 << 16;

/// `x` rounded to `dtype` (f16 or bf16) as f64, what the CPU reference computes on.
fn round_to(dtype: DType, x: &[f32]) -> Result<Vec<f64>> {
    let mut out = host_vec(x.len())?;
    for chunk in x.chunks(ROUND_CHUNK) {
        out.extend(sdpa::decode(dtype, &sdpa::encode(dtype, chunk)));
    }
    Ok(out)
}

/// `check_host` for `n` elements of `per_element` bytes: for what the library allocates itself.
fn check_host_elements(n: usize, per_element: usize) -> Result<()> {
    sdpa::memory::check_host(n.checked_mul(per_element))
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
    let out_dtype: Option<DType> = a.out_dtype.as_deref().map(str::parse).transpose()?;
    let fp8_mode: Fp8Mode = a.fp8_mode.parse()?;
    check_outputs(&a)?;
    let (q, qshape) = npy::read(&a.q)?;
    let (k, kshape) = npy::read(&a.k)?;
    // V read from K's rows: K's values, its shape but for the head dim.
    let (v, vshape) = match (&a.v, a.v_in_k) {
        (Some(path), _) => npy::read(path)?,
        (None, n) => {
            let mut shape = kshape.clone();
            if let Some(last) = shape.last_mut() {
                *last = n.unwrap_or(*last);
            }
            (k.clone(), shape)
        }
    };
    let (qd, kd) = (dims4(&qshape, "q")?, dims4(&kshape, "k")?);
    // V is K's shape but for its head dim (the last axis in either layout), which is the
    // output's.
    if vshape.len() != kshape.len()
        || vshape[..vshape.len().saturating_sub(1)] != kshape[..kshape.len().saturating_sub(1)]
    {
        return Err(Error::InvalidArgument(format!(
            "v has shape {vshape:?} but k has {kshape:?}; they must match but for the head dim \
             (the last axis)"
        ))
        .into());
    }
    let dv = dims4(&vshape, "v")?[3];
    check_fits("--q", &a.q, &q, dtype)?;
    check_fits("--k", &a.k, &k, dtype)?;
    if let Some(path) = &a.v {
        check_fits("--v", path, &v, dtype)?;
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
        .with_head_dim_v(dv)
        .with_v_in_k(a.v_in_k.is_some())
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
            check_slopes(path, &s)?;
            p = p.with_alibi(layout);
            Some(s)
        }
        None => None,
    };
    let sinks = match &a.sinks {
        Some(path) => {
            let (s, shape) = npy::read(path)?;
            if shape[..] != [h] {
                return Err(Error::InvalidArgument(format!(
                    "{}: sinks of shape {shape:?}; expected [{h}] (one per query head)",
                    path.display()
                ))
                .into());
            }
            check_sinks(path, &s)?;
            p = p.with_sinks(true);
            Some(s)
        }
        None => None,
    };
    if dtype == DType::E4m3 {
        p = p.with_fp8_scaling(scaling);
    }
    if let Some(out) = out_dtype {
        p = p.with_out_dtype(out);
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
    let shapes = [p.q_shape(), p.k_shape(), p.v_shape()];
    let (out_len, lse_len) = (p.out_len().unwrap_or_default(), p.lse_len());

    let dev = device_for(&[requested], a.backend.is_some())?;
    let backend = chosen_backend(dev.as_ref(), &p, requested)?;
    let gpu = dev.as_ref().filter(|_| backend != Backend::Cpu);
    let (out, lse): (Vec<f32>, Vec<f32>) = match gpu {
        Some(dev) => {
            let up = |x: &[f32], i: usize| match dtype {
                DType::E4m3 => Tensor::quantize_f32(dev, x, shapes[i], scaling),
                _ => Tensor::from_f32(dev, dtype, x),
            };
            let (qt, kt) = (up(&q, 0)?, up(&k, 1)?);
            // V read from K's rows is K itself.
            let vt = if p.v_in_k { None } else { Some(up(&v, 2)?) };
            let mut ot = Tensor::poisoned(dev, od, out_len)?;
            let mut bufs = sdpa_harness::check::ExtraBuffers::new(
                dev,
                &p,
                slopes.as_deref(),
                sinks.as_deref(),
            )?;
            let t = sdpa::Tensors {
                q: &qt,
                k: &kt,
                v: vt.as_ref().unwrap_or(&kt),
                out: &mut ot,
            };
            sdpa::forward(dev, &p, backend, t, bufs.extras())?;
            // Downloads: the LSE as f32 and f64; the output as bits, f64 and f32.
            check_host_elements(lse_len, 4 + 8)?;
            let lse = bufs.lse(dev)?.unwrap_or_default();
            let lse = try_map(&lse, |x| x as f32)?;
            check_host_elements(out_len, 2 + 8 + 4)?;
            (ot.to_f32(dev)?, lse)
        }
        None => {
            let round = |x: &[f32], i: usize| -> Result<Vec<f64>> {
                match dtype {
                    DType::E4m3 => {
                        // The codes and their dequantized f32 values, before the f64 copy.
                        check_host_elements(x.len(), 1 + 4)?;
                        let (codes, s) = sdpa::fp8::quantize_host(x, &shapes[i], scaling)?;
                        let d = sdpa::fp8::dequantize_host(&codes, &s, &shapes[i], scaling)?;
                        try_map(&d, f64::from)
                    }
                    _ => round_to(dtype, x),
                }
            };
            let r = sdpa::reference_with(
                &p,
                &round(&q, 0)?,
                &round(&k, 1)?,
                &round(&v, 2)?,
                slopes.as_deref(),
                sinks.as_deref(),
            )?;
            (
                try_map(&r.out, |x| x as f32)?,
                try_map(&r.lse, |x| x as f32)?,
            )
        }
    };
    // Both files are written in full before either replaces anything: a failure to write one
    // leaves neither (only the two renames come after).
    let mut oshape = qshape.clone();
    oshape[3] = dv;
    let staged_out = npy::stage(&a.out, &out, &oshape)?;
    let staged_lse = match &a.lse {
        Some(path) => Some(npy::stage(path, &lse, &[b, h, sq])?),
        None => None,
    };
    staged_out.commit()?;
    if let Some(s) = staged_lse {
        s.commit()?;
    }
    outln!("{p}: wrote {} ({backend} backend)", a.out.display())?;
    Ok(ExitCode::SUCCESS)
}
