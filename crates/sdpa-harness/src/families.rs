//! The input distributions the FP8 accuracy bars are stated for. Rounding P to e4m3 (the fast
//! mode) costs an error that depends on what each output averages: zero-mean values give an
//! average of rounding errors, relative to an output that is itself small; a channel mean or a
//! few large values give an output the errors are small against. So the fast mode's bar is
//! stated per family ([`crate::check::fast_fp8_tolerance`]).

use crate::check::{Inputs, alibi_slopes, normals, random_inputs};
use rand::{RngExt, SeedableRng, rngs::StdRng};
use sdpa::{DType, Error, Problem, Result};
use std::fmt;

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
    let (ql, kl) = (p.q_len().unwrap_or(0), p.kv_len().unwrap_or(0));
    // Per element: the f32 draw, and what `Inputs` keeps (as `random_inputs` counts it).
    sdpa::memory::check_host(
        kl.checked_mul(2)
            .and_then(|k2| k2.checked_add(ql))
            .and_then(|n| n.checked_mul(4 + 2 + 8 + 8 + 4)),
    )?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut q = normals(&mut rng, ql);
    let mut k = normals(&mut rng, kl);
    let mut v = normals(&mut rng, kl);
    match family {
        Family::Normal => {}
        Family::ChannelMean => {
            let shape = p.kv_shape();
            let d = p.head_dim;
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
        DType::E4m3 => Inputs::quantized(p, &q, &k, &v)?,
        dtype => {
            let mut i = Inputs::from_f32(dtype, &q, &k, &v);
            i.alibi_slopes = alibi_slopes(p);
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
}
