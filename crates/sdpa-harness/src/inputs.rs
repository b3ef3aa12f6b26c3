//! Random inputs for the checks: Q, K and V drawn from a seed, rounded to the problem's dtype
//! (e4m3: quantized), with the values the float64 reference sees, and the input distributions
//! the FP8 accuracy bars are stated for. Rounding P to e4m3 (the fast mode) costs an error that
//! depends on what each output averages: zero-mean values give an average of rounding errors,
//! relative to an output that is itself small; a channel mean or a few large values give an
//! output the errors are small against. So the fast mode's bar is stated per family
//! ([`crate::check::fast_fp8_tolerance`]).

use rand::{RngExt, SeedableRng, rngs::StdRng};
use rayon::prelude::*;
use sdpa::{
    DType, Device, Error, Problem, Result, Scaling, SeqMeta, Tensor, TensorShape, decode, encode,
    fp8,
};
use std::fmt;

/// ALiBi slopes for `p`'s layout (None without ALiBi): the standard geometric slopes
/// 2^(-8 (h + 1) / heads), scaled by 1 + b / 4 per batch where the layout has one per batch.
pub fn alibi_slopes(p: &Problem) -> Option<Vec<f32>> {
    let a = p.alibi?;
    let n = a.len(p.batch, p.heads);
    Some(
        (0..n)
            .map(|i| {
                let (b, h) = (i / p.heads, i % p.heads);
                let base = 2f32.powf(-8.0 * (h + 1) as f32 / p.heads as f32);
                base * (1.0 + b as f32 / 4.0)
            })
            .collect(),
    )
}

/// Sink logits for `p` (None without sinks), one per query head, spread around the log-sum-exp
/// of N(0, 1) inputs (about ln seq_k + scale²·head_dim / 2 = ln seq_k + 1/2) so that each
/// takes from a tenth to most of its rows' weight: ln seq_k + (h % 4) − 1.5, except every fourth
/// head's, which is -inf (no sink: the path that must leave its rows untouched).
pub fn sink_logits(p: &Problem) -> Option<Vec<f32>> {
    p.sinks.then(|| {
        let base = (p.seq_k.max(1) as f32).ln();
        (0..p.heads)
            .map(|h| match h % 4 {
                3 => f32::NEG_INFINITY,
                r => base + r as f32 - 1.5,
            })
            .collect()
    })
}

/// Random inputs for one problem: standard normal values rounded to the dtype.
pub struct Inputs {
    /// Bit patterns of Q, K, V in the dtype (e4m3: the codes).
    pub bits: [Vec<u16>; 3],
    /// The same values, exactly, as f64 (what the reference sees; e4m3: code · scale).
    pub values: [Vec<f64>; 3],
    /// e4m3 inputs only: the scales and the values before quantization.
    pub fp8: Option<Fp8Inputs>,
    /// The ALiBi slopes of problems with ALiBi ([`alibi_slopes`]).
    pub alibi_slopes: Option<Vec<f32>>,
    /// The sink logits of problems with sinks ([`sink_logits`]).
    pub sinks: Option<Vec<f32>>,
    /// The sequence metadata of packed or paged problems (host copies).
    pub seq_meta: Option<SeqMeta>,
    /// The distribution the values were drawn from (the fast FP8 mode's bar depends on it):
    /// [`Family::Normal`] unless [`family_inputs`] drew them or the caller says
    /// otherwise ([`Inputs::with_family`]).
    pub family: Family,
}

/// What e4m3 inputs carry beyond their codes.
pub struct Fp8Inputs {
    /// Scales of Q, K, V (one, or one per (batch, head) pair of each one's shape; Q's empty
    /// where only K and V are e4m3).
    pub scales: [Vec<f32>; 3],
    /// Whether only K and V are e4m3 (an FP8 K/V cache under 16-bit Q, whose bits are Q's).
    pub kv_only: bool,
    /// Shapes of Q, K, V.
    pub shapes: [TensorShape; 3],
    /// Scale layout.
    pub scaling: Scaling,
    /// The values before quantization (the end-to-end reference's inputs).
    pub unquantized: [Vec<f64>; 3],
}

impl Inputs {
    /// Sets element `at` of input `which` (0 Q, 1 K, 2 V) to `value` rounded to `dtype`, bits
    /// and f64 alike (e4m3 takes only NaN here: its other codes depend on the scale).
    pub fn set_value(&mut self, which: usize, at: usize, value: f64, dtype: DType) {
        let bits = match dtype {
            DType::E4m3 => {
                assert!(
                    value.is_nan(),
                    "set_value writes e4m3 NaN only, got {value}"
                );
                0x7f
            }
            _ => encode(dtype, &[value as f32])[0],
        };
        self.bits[which][at] = bits;
        self.values[which][at] = match dtype {
            DType::E4m3 => f64::NAN,
            _ => decode(dtype, &[bits])[0],
        };
    }

    /// Inputs from given values (rounded to `dtype`).
    pub fn from_f32(dtype: DType, q: &[f32], k: &[f32], v: &[f32]) -> Inputs {
        let bits = [encode(dtype, q), encode(dtype, k), encode(dtype, v)];
        let values = [
            decode(dtype, &bits[0]),
            decode(dtype, &bits[1]),
            decode(dtype, &bits[2]),
        ];
        Inputs {
            bits,
            values,
            fp8: None,
            alibi_slopes: None,
            sinks: None,
            seq_meta: None,
            family: Family::Normal,
        }
    }

    /// The same inputs with this sequence metadata (a packed or paged problem's).
    pub fn with_meta(self, meta: SeqMeta) -> Inputs {
        Inputs {
            seq_meta: Some(meta),
            ..self
        }
    }

    /// The same inputs, stated to come from `family` (which picks the fast FP8 mode's bar).
    pub fn with_family(self, family: Family) -> Inputs {
        Inputs { family, ..self }
    }

    /// What the fast FP8 mode computes on these inputs, emulated in f64
    /// ([`sdpa::reference_fp8_fast`]); dense problems only (as every e4m3 problem is).
    pub fn reference_fp8_fast(&self, p: &Problem) -> Result<sdpa::Reference> {
        if self.seq_meta.is_some() {
            return Err(Error::InvalidArgument(format!(
                "the fast FP8 emulation takes dense problems only, {p} has sequence metadata"
            )));
        }
        let [q, k, v] = &self.values;
        sdpa::reference_fp8_fast(
            p,
            q,
            k,
            v,
            self.alibi_slopes.as_deref(),
            self.sinks.as_deref(),
        )
    }

    fn alibi(&self) -> Option<&[f32]> {
        self.alibi_slopes.as_deref()
    }

    /// The float64 reference of `p` on these inputs (output and log-sum-exp).
    pub fn reference(&self, p: &Problem) -> Result<sdpa::Reference> {
        let [q, k, v] = &self.values;
        match &self.seq_meta {
            Some(m) => sdpa::reference_seqs(p, q, k, v, self.alibi(), self.sinks.as_deref(), m),
            None => sdpa::reference_with(p, q, k, v, self.alibi(), self.sinks.as_deref()),
        }
    }

    /// e4m3 inputs of `p` quantized from given values (per `p.fp8_scaling`, amax scales).
    pub fn quantized(p: &Problem, q: &[f32], k: &[f32], v: &[f32]) -> Result<Inputs> {
        let shapes = [p.q_shape(), p.k_shape(), p.v_shape()];
        let mut bits: [Vec<u16>; 3] = Default::default();
        let mut values: [Vec<f64>; 3] = Default::default();
        let mut scales: [Vec<f32>; 3] = Default::default();
        for (i, x) in [q, k, v].into_iter().enumerate() {
            let (codes, s) = fp8::quantize_host(x, &shapes[i], p.fp8_scaling)?;
            values[i] = fp8::dequantize_host(&codes, &s, &shapes[i], p.fp8_scaling)?
                .into_iter()
                .map(f64::from)
                .collect();
            bits[i] = codes.into_iter().map(u16::from).collect();
            scales[i] = s;
        }
        let unquantized = [q, k, v].map(|x| x.iter().map(|&a| f64::from(a)).collect());
        Ok(Inputs {
            bits,
            values,
            fp8: Some(Fp8Inputs {
                scales,
                kv_only: false,
                shapes,
                scaling: p.fp8_scaling,
                unquantized,
            }),
            alibi_slopes: alibi_slopes(p),
            sinks: sink_logits(p),
            seq_meta: None,
            family: Family::Normal,
        })
    }

    /// Uploads Q, K, V to `dev` as tensors of `dtype` (inputs of an e4m3 K/V cache: Q of
    /// `dtype`, K and V as the e4m3 tensors they were quantized to).
    pub fn upload(&self, dev: &Device, dtype: DType) -> Result<[Tensor; 3]> {
        let [q, k, v] = &self.bits;
        if let Some(f) = self
            .fp8
            .as_ref()
            .filter(|f| f.kv_only && dtype != DType::E4m3)
        {
            let up = |i: usize, b: &[u16]| {
                let codes: Vec<u8> = b.iter().map(|&c| c as u8).collect();
                Tensor::from_e4m3(dev, &codes, &f.scales[i], f.shapes[i], f.scaling)
            };
            return Ok([Tensor::from_bits(dev, dtype, q)?, up(1, k)?, up(2, v)?]);
        }
        if dtype == DType::E4m3 {
            let f = self.fp8.as_ref().ok_or_else(|| {
                Error::InvalidArgument("these inputs were not quantized to e4m3".into())
            })?;
            let up = |i: usize, b: &[u16]| {
                let codes: Vec<u8> = b.iter().map(|&c| c as u8).collect();
                Tensor::from_e4m3(dev, &codes, &f.scales[i], f.shapes[i], f.scaling)
            };
            return Ok([up(0, q)?, up(1, k)?, up(2, v)?]);
        }
        Ok([
            Tensor::from_bits(dev, dtype, q)?,
            Tensor::from_bits(dev, dtype, k)?,
            Tensor::from_bits(dev, dtype, v)?,
        ])
    }
}

/// Uploaded Q, K, V and an output as a call's operands: K itself as V where `p` reads V from K's
/// rows ([`Problem::with_v_in_k`]).
pub fn tensors<'a>(
    p: &Problem,
    [q, k, v]: &'a [Tensor; 3],
    out: &'a mut Tensor,
) -> sdpa::Tensors<'a> {
    let v = if p.v_in_k { k } else { v };
    sdpa::Tensors { q, k, v, out }
}

/// Draws fresh N(0, 1) inputs from `seed`, rounded to `p.dtype` (e4m3: quantized with amax
/// scales per `p.fp8_scaling`). `p` must validate; inputs the host has no memory for are
/// `Error::OutOfMemory` before anything is allocated.
pub fn random_inputs(p: &Problem, seed: u64) -> Result<Inputs> {
    p.validate()?;
    let [ql, kl, vl] = [p.q_len(), p.k_len(), p.v_len()].map(Option::unwrap_or_default);
    // Per element: its bits, its f64 value, and the f32 draw they are made from (e4m3 inputs
    // also keep the unquantized values and the codes as f32 while quantizing).
    let per_element = if p.dtype == DType::E4m3 {
        2 + 8 + 4 + 8 + 4
    } else {
        2 + 8 + 4
    };
    sdpa::memory::check_host(
        kl.checked_add(vl)
            .and_then(|kv| kv.checked_add(ql))
            .and_then(|n| n.checked_mul(per_element)),
    )?;
    if p.is_fp8_kv() {
        return quantize_kv(p, random_inputs(&p.as_dequantized(), seed)?);
    }
    if p.dtype == DType::E4m3 {
        let f = random_inputs(&p.as_dequantized().with_dtype(DType::F16), seed)?;
        let [q, k, v] = f
            .values
            .map(|x| x.into_iter().map(|a| a as f32).collect::<Vec<_>>());
        return Inputs::quantized(p, &q, &k, &v);
    }
    // Q, K and V each from a stream of its own (so a tensor's values do not depend on the
    // sizes of the ones before it).
    let draw = |which: u64, n: usize| encode(p.dtype, &normals_seeded(seed ^ which << 56, n));
    let (q, k) = (draw(1, ql), draw(2, kl));
    // V read from K's rows: its buffer holds K's values (the call passes K itself).
    let v = if p.v_in_k { k.clone() } else { draw(3, vl) };
    let bits = [q, k, v];
    let values = [
        decode(p.dtype, &bits[0]),
        decode(p.dtype, &bits[1]),
        decode(p.dtype, &bits[2]),
    ];
    // Packed or paged problems: their metadata from the same seed.
    let seq_meta = match p.seqs.is_dense() {
        true => None,
        false => Some(crate::seqs::random_meta(p, seed ^ 0x5e95)?),
    };
    Ok(Inputs {
        bits,
        values,
        fp8: None,
        alibi_slopes: alibi_slopes(p),
        sinks: sink_logits(p),
        seq_meta,
        family: Family::Normal,
    })
}

/// Inputs of an e4m3 K/V cache problem from inputs of its 16-bit problem: K and V quantized
/// with amax scales per `p.fp8_scaling` over [`Problem::k_shape`] and [`Problem::v_shape`]
/// (spare rows of a paged cache included), Q and the metadata as they are.
pub fn quantize_kv(p: &Problem, mut i: Inputs) -> Result<Inputs> {
    let mut scales: [Vec<f32>; 3] = Default::default();
    // Q is not quantized: its values are its own unquantized ones.
    let mut unquantized: [Vec<f64>; 3] = [i.values[0].clone(), Vec::new(), Vec::new()];
    for t in 1..3 {
        let shape = if t == 1 { p.k_shape() } else { p.v_shape() };
        let x: Vec<f32> = i.values[t].par_iter().map(|&a| a as f32).collect();
        let (codes, s) = fp8::quantize_host(&x, &shape, p.fp8_scaling)?;
        let values = fp8::dequantize_host(&codes, &s, &shape, p.fp8_scaling)?;
        unquantized[t] = std::mem::take(&mut i.values[t]);
        i.values[t] = values.into_par_iter().map(f64::from).collect();
        i.bits[t] = codes.into_par_iter().map(u16::from).collect();
        scales[t] = s;
    }
    i.fp8 = Some(Fp8Inputs {
        scales,
        kv_only: true,
        shapes: [p.q_shape(), p.k_shape(), p.v_shape()],
        scaling: p.fp8_scaling,
        unquantized,
    });
    Ok(i)
}

/// The bits of `n` N(0, 1) draws from `seed`, rounded to `dtype` (f16 or bf16): one block of a
/// timing run's inputs, which the caller repeats to fill buffers too large to draw value by
/// value (the kernels' work and power do not depend on values repeating; accuracy checks use
/// [`random_inputs`]).
pub fn normal_bits(dtype: DType, n: usize, seed: u64) -> Vec<u16> {
    encode(dtype, &normals_seeded(seed, n))
}

/// `n` draws of N(0, 1) from `seed`, drawn on every core: block i of 2^16 values from a
/// generator of its own, seeded from (`seed`, i), so the values depend on the seed alone.
fn normals_seeded(seed: u64, n: usize) -> Vec<f32> {
    const BLOCK: usize = 1 << 16;
    let mut v = vec![0f32; n];
    v.par_chunks_mut(BLOCK).enumerate().for_each(|(i, block)| {
        let mut rng = StdRng::seed_from_u64(
            seed.wrapping_add((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)),
        );
        block.copy_from_slice(&normals(&mut rng, block.len()));
    });
    v
}

/// `n` draws of N(0, 1) from `rng` (Box–Muller, two normals per pair of uniforms), as f32.
pub(crate) fn normals(rng: &mut StdRng, n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n + 1);
    while v.len() < n {
        let u1: f64 = 1.0 - rng.random::<f64>();
        let u2: f64 = rng.random::<f64>();
        let r = (-2.0 * u1.ln()).sqrt();
        let t = std::f64::consts::TAU * u2;
        v.push((r * t.cos()) as f32);
        v.push((r * t.sin()) as f32);
    }
    v.truncate(n);
    v
}

/// [`random_inputs`] for a problem the CLI or a bench names: a named problem's own sequence
/// metadata (the anchor's lengths, its paged cache) in place of random metadata.
pub fn named_inputs(name: &str, p: &Problem, seed: u64) -> Result<Inputs> {
    let inputs = random_inputs(p, seed)?;
    Ok(match crate::problems::named_meta(name, seed) {
        Some(m) if !p.seqs.is_dense() => inputs.with_meta(m),
        _ => inputs,
    })
}

/// A seed that differs from run to run (time-based), for "fresh inputs every time".
pub fn fresh_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0x5eed)
}

/// One input distribution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// Q, K, V ~ N(0, 1) ([`random_inputs`]); also what inputs of no stated family count as.
    Normal,
    /// Q, K ~ N(0, 1); V = μ + N(0, 1) with one mean μ per (batch, K/V head, channel), drawn from
    /// N(0, 1): the channel biases V projections have.
    ChannelMean,
    /// FlashAttention-3's outlier distribution, in Q, K and V alike: N(0, 1) + N(0, 100) ·
    /// Bernoulli(0.001), i.e. with probability 0.001 an entry gets a normal of standard
    /// deviation 10 added.
    Outliers,
}

impl Family {
    /// Every family, in the order tables list them.
    pub const ALL: [Family; 3] = [Family::Normal, Family::ChannelMean, Family::Outliers];

    /// Name as test output spells it.
    pub fn name(self) -> &'static str {
        match self {
            Family::Normal => "N(0,1)",
            Family::ChannelMean => "V channel mean",
            Family::Outliers => "outliers",
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Probability that an entry of [`Family::Outliers`] is an outlier.
const OUTLIER_RATE: f64 = 0.001;
/// Standard deviation of the normal added to an outlier (FA3's N(0, 100)).
const OUTLIER_STD: f32 = 10.0;

/// Fresh inputs of `family` for `p`, drawn from `seed`, rounded to `p.dtype` (e4m3: quantized
/// with amax scales per `p.fp8_scaling`, as [`Inputs::quantized`]), the family recorded in them.
/// Dense problems only; [`Family::Normal`] is [`random_inputs`] itself.
pub fn family_inputs(p: &Problem, family: Family, seed: u64) -> Result<Inputs> {
    if family == Family::Normal {
        return random_inputs(p, seed);
    }
    p.validate()?;
    if !p.seqs.is_dense() {
        return Err(Error::InvalidArgument(format!(
            "{family} inputs are drawn for dense problems only, {p} is not"
        )));
    }
    let [ql, kl, vl] = [p.q_len(), p.k_len(), p.v_len()].map(Option::unwrap_or_default);
    // Per element: the f32 draw, and what `Inputs` keeps (as `random_inputs` counts it).
    sdpa::memory::check_host(
        kl.checked_add(vl)
            .and_then(|kv| kv.checked_add(ql))
            .and_then(|n| n.checked_mul(4 + 2 + 8 + 8 + 4)),
    )?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut q = normals(&mut rng, ql);
    let mut k = normals(&mut rng, kl);
    let mut v = normals(&mut rng, vl);
    match family {
        Family::Normal => {}
        Family::ChannelMean => {
            let shape = p.v_shape();
            let d = p.v_dim();
            let mu = normals(&mut rng, shape.heads_total().unwrap_or(0) * d);
            for (i, x) in v.iter_mut().enumerate() {
                *x += mu[shape.head_of(i).unwrap_or(0) * d + i % d];
            }
        }
        Family::Outliers => {
            for x in [&mut q, &mut k, &mut v] {
                for a in x.iter_mut() {
                    if rng.random::<f64>() < OUTLIER_RATE {
                        *a += OUTLIER_STD * normals(&mut rng, 1)[0];
                    }
                }
            }
        }
    }
    let inputs = match p.dtype {
        _ if p.is_fp8_kv() => {
            let mut i = Inputs::from_f32(p.dtype, &q, &k, &v);
            i.alibi_slopes = alibi_slopes(p);
            i.sinks = sink_logits(p);
            quantize_kv(p, i)?
        }
        DType::E4m3 => Inputs::quantized(p, &q, &k, &v)?,
        dtype => {
            let mut i = Inputs::from_f32(dtype, &q, &k, &v);
            i.alibi_slopes = alibi_slopes(p);
            i.sinks = sink_logits(p);
            i
        }
    };
    Ok(inputs.with_family(family))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sdpa::Layout;

    fn mean_var(x: &[f64]) -> (f64, f64) {
        let n = x.len() as f64;
        let mean = x.iter().sum::<f64>() / n;
        (mean, x.iter().map(|a| (a - mean).powi(2)).sum::<f64>() / n)
    }

    /// V's channels have their own means (one per kv head and channel), Q and K stay N(0, 1);
    /// both layouts put a channel at the same place in every row.
    #[test]
    fn channel_means_shift_each_v_channel() {
        for layout in [Layout::Bhsd, Layout::Bshd] {
            let p = Problem::new(1, 2, 8, 4096, 16)
                .with_kv_heads(1)
                .with_layout(layout);
            let i = family_inputs(&p, Family::ChannelMean, 3).unwrap();
            assert_eq!(i.family, Family::ChannelMean);
            let (qm, qv) = mean_var(&i.values[0]);
            assert!(qm.abs() < 0.2 && (qv - 1.0).abs() < 0.3, "q {qm} {qv}");
            let v = &i.values[2];
            let means: Vec<f64> = (0..16)
                .map(|c| {
                    let col: Vec<f64> = v.iter().skip(c).step_by(16).copied().collect();
                    let (m, var) = mean_var(&col);
                    assert!(
                        (var - 1.0).abs() < 0.15,
                        "{layout:?} channel {c}: var {var}"
                    );
                    m
                })
                .collect();
            // 16 means drawn from N(0, 1): spread out, not all near zero.
            let (_, spread) = mean_var(&means);
            assert!(spread > 0.2, "{layout:?}: channel means {means:?}");
        }
    }

    /// About one entry in a thousand gets a normal of standard deviation 10; the rest are
    /// N(0, 1). Quantized to e4m3 the values keep their outliers.
    #[test]
    fn outliers_are_rare_and_large() {
        let p = Problem::new(1, 4, 512, 512, 128).with_dtype(DType::E4m3);
        let i = family_inputs(&p, Family::Outliers, 9).unwrap();
        assert_eq!(i.family, Family::Outliers);
        for t in 0..3 {
            let x = &i.values[t];
            let big = x.iter().filter(|a| a.abs() > 6.0).count();
            // 262144 entries, 262 expected outliers of which ~55% exceed 6 in magnitude.
            assert!(
                (60..300).contains(&big),
                "tensor {t}: {big} entries above 6"
            );
            let f = i.fp8.as_ref().unwrap();
            assert_eq!(f.unquantized[t].len(), x.len());
        }
        // The same seed draws the same inputs.
        let again = family_inputs(&p, Family::Outliers, 9).unwrap();
        assert_eq!(again.bits, i.bits);
    }

    #[test]
    fn normal_is_random_inputs_and_packed_problems_are_refused() {
        let p = Problem::new(1, 1, 16, 16, 64);
        let a = family_inputs(&p, Family::Normal, 4).unwrap();
        assert_eq!(a.bits, random_inputs(&p, 4).unwrap().bits);
        assert_eq!(a.family, Family::Normal);
        let packed = p.with_packed_q(16);
        let Err(e) = family_inputs(&packed, Family::Outliers, 4) else {
            panic!("{packed}: inputs drawn for a packed problem");
        };
        assert!(e.to_string().contains("dense problems only"), "{e}");
    }

    #[test]
    fn inputs_are_fresh_per_seed_and_normal() {
        let p = Problem::new(1, 1, 64, 64, 64);
        let (a, b) = (random_inputs(&p, 1).unwrap(), random_inputs(&p, 2).unwrap());
        assert_ne!(a.bits[0], b.bits[0]);
        let x = &a.values[0];
        let mean = x.iter().sum::<f64>() / x.len() as f64;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / x.len() as f64;
        assert!(
            mean.abs() < 0.05 && (var - 1.0).abs() < 0.1,
            "mean {mean} var {var}"
        );
    }
}
