//! The float64 reference: the truth every other backend is checked against. Any shape, both
//! layouts, GQA, every mask, softcap, ALiBi, and the log-sum-exp of each row; a row with no
//! visible key is all zeros (its log-sum-exp -inf).

use crate::error::{Result, invalid};
use crate::problem::Problem;
use rayon::prelude::*;

/// What the reference computes: the output, in the problem's layout, and the natural-log
/// log-sum-exp of each row's logits, `[batch][heads][seq_q]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    /// The attention output.
    pub out: Vec<f64>,
    /// ln Σ_j exp(logit_ij) over the keys row i sees (-inf where it sees none).
    pub lse: Vec<f64>,
}

/// Computes attention in f64 on the host. `q`, `k`, `v` and the result are in the problem's
/// layout; their lengths must match the problem exactly. A problem with ALiBi needs its slopes:
/// [`reference_with`].
pub fn reference(p: &Problem, q: &[f64], k: &[f64], v: &[f64]) -> Result<Vec<f64>> {
    Ok(reference_with(p, q, k, v, None)?.out)
}

/// [`reference`] with the ALiBi slopes (`p.alibi`'s layout) and the log-sum-exp.
pub fn reference_with(
    p: &Problem,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    alibi_slopes: Option<&[f32]>,
) -> Result<Reference> {
    p.validate()?;
    let (ql, kl) = (p.q_len().unwrap(), p.kv_len().unwrap());
    for (name, len, want) in [("q", q.len(), ql), ("k", k.len(), kl), ("v", v.len(), kl)] {
        if len != want {
            return Err(invalid!(
                "reference: {name} has {len} elements, the problem needs {want}"
            ));
        }
    }
    match (p.alibi, alibi_slopes) {
        (None, None) => {}
        (Some(a), Some(s)) if s.len() == a.len(p.batch, p.heads) => {}
        (Some(a), Some(s)) => {
            return Err(invalid!(
                "reference: {} ALiBi slopes, the problem's {a:?} layout needs {}",
                s.len(),
                a.len(p.batch, p.heads)
            ));
        }
        (Some(_), None) => {
            return Err(invalid!(
                "reference: the problem has ALiBi, no slopes given"
            ));
        }
        (None, Some(_)) => {
            return Err(invalid!(
                "reference: ALiBi slopes given for a problem without ALiBi"
            ));
        }
    }
    // The per-head blocks and the output they are copied into.
    crate::memory::check_host(ql.checked_mul(2 * std::mem::size_of::<f64>()))?;
    let (qs, ks) = (p.q_strides(), p.kv_strides());
    let (d, group, scale) = (p.head_dim, p.heads / p.kv_heads, f64::from(p.scale()));
    let cap = p.softcap.map(f64::from);
    let offset = p.seq_k as f64 - p.seq_q as f64; // row i's diagonal key is i + offset

    // One task per (batch, head); each returns its [seq_q][head_dim] block and its rows' LSE.
    let blocks: Vec<(Vec<f64>, Vec<f64>)> = (0..p.batch * p.heads)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / p.heads, bh % p.heads);
            let hk = h / group;
            let slope = match (p.alibi, alibi_slopes) {
                (Some(a), Some(s)) => f64::from(s[a.index(b, h, p.heads)]),
                _ => 0.0,
            };
            let mut out = vec![0.0; p.seq_q * d];
            let mut lse = vec![f64::NEG_INFINITY; p.seq_q];
            let mut s = vec![0.0; p.seq_k];
            for i in 0..p.seq_q {
                let keys = p.visible_range(i);
                if keys.is_empty() {
                    continue; // nothing visible: zeros
                }
                let qi = &q[qs.offset(b, h, i, 0)..][..d];
                let s = &mut s[keys.clone()];
                for (j, sj) in keys.clone().zip(s.iter_mut()) {
                    let kj = &k[ks.offset(b, hk, j, 0)..][..d];
                    let mut x = scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>();
                    if let Some(c) = cap {
                        x = c * (x / c).tanh();
                    }
                    if slope != 0.0 {
                        x -= slope * (i as f64 + offset - j as f64).abs();
                    }
                    *sj = x;
                }
                // f64::max skips NaN, and exp(NaN - m) then carries the NaN into the row.
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let m = if m == f64::NEG_INFINITY { 0.0 } else { m };
                let mut sum = 0.0;
                let o = &mut out[i * d..][..d];
                for (j, &sj) in keys.zip(s.iter()) {
                    let e = (sj - m).exp();
                    sum += e;
                    let vj = &v[ks.offset(b, hk, j, 0)..][..d];
                    for (od, vd) in o.iter_mut().zip(vj) {
                        *od += e * vd;
                    }
                }
                o.iter_mut().for_each(|x| *x /= sum);
                lse[i] = m + sum.ln();
            }
            (out, lse)
        })
        .collect();

    let mut out = vec![0.0; ql];
    let mut lse = Vec::with_capacity(p.batch * p.heads * p.seq_q);
    for (bh, (block, rows)) in blocks.into_iter().enumerate() {
        let (b, h) = (bh / p.heads, bh % p.heads);
        for i in 0..p.seq_q {
            out[qs.offset(b, h, i, 0)..][..d].copy_from_slice(&block[i * d..][..d]);
        }
        lse.extend(rows);
    }
    Ok(Reference { out, lse })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::Layout;
    use approx::assert_relative_eq;

    /// The textbook formula, written as differently as possible: full score matrix, explicit
    /// mask with -inf, softmax by definition, BHSD indexing by hand.
    fn naive(p: &Problem, q: &[f64], k: &[f64], v: &[f64]) -> Vec<f64> {
        let d = p.head_dim;
        let mut out = vec![0.0; p.q_len().unwrap()];
        for b in 0..p.batch {
            for h in 0..p.heads {
                let hk = h * p.kv_heads / p.heads;
                for i in 0..p.seq_q {
                    let mut w = vec![f64::NEG_INFINITY; p.seq_k];
                    for (j, wj) in w.iter_mut().enumerate() {
                        let masked = match p.mask {
                            crate::Mask::None => false,
                            crate::Mask::CausalBottomRight => {
                                (j as i64) > i as i64 + p.seq_k as i64 - p.seq_q as i64
                            }
                            _ => !p.visible_range(i).contains(&j),
                        };
                        if !masked {
                            let mut dot = 0.0;
                            for t in 0..d {
                                dot += q[((b * p.heads + h) * p.seq_q + i) * d + t]
                                    * k[((b * p.kv_heads + hk) * p.seq_k + j) * d + t];
                            }
                            *wj = dot * f64::from(p.scale());
                        }
                    }
                    if w.iter().all(|x| *x == f64::NEG_INFINITY) {
                        continue;
                    }
                    let mx = w.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = w.iter().map(|x| (x - mx).exp()).sum();
                    for t in 0..d {
                        out[((b * p.heads + h) * p.seq_q + i) * d + t] = (0..p.seq_k)
                            .map(|j| {
                                (w[j] - mx).exp() / z
                                    * v[((b * p.kv_heads + hk) * p.seq_k + j) * d + t]
                            })
                            .sum();
                    }
                }
            }
        }
        out
    }

    fn pseudo_random(n: usize, seed: u64) -> Vec<f64> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
            })
            .collect()
    }

    #[test]
    fn matches_naive_formula_over_shapes() {
        for &(b, h, kvh, sq, sk, d, causal) in &[
            (1, 1, 1, 1, 1, 4, false),
            (2, 3, 3, 5, 7, 8, false),
            (2, 3, 3, 5, 7, 8, true),
            (1, 4, 2, 9, 4, 16, true),
            (1, 4, 1, 6, 6, 8, true),
        ] {
            let p = Problem::new(b, h, sq, sk, d)
                .with_kv_heads(kvh)
                .with_causal(causal);
            let q = pseudo_random(p.q_len().unwrap(), 1);
            let k = pseudo_random(p.kv_len().unwrap(), 2);
            let v = pseudo_random(p.kv_len().unwrap(), 3);
            let got = reference(&p, &q, &k, &v).unwrap();
            let want = naive(&p, &q, &k, &v);
            for (g, w) in got.iter().zip(&want) {
                assert_relative_eq!(g, w, epsilon = 1e-12, max_relative = 1e-12);
            }
        }
    }

    #[test]
    fn hand_computed_two_keys() {
        // d = 1, scale 1: scores 0 and ln 3 give weights 1/4 and 3/4 over v = 2 and 6.
        let p = Problem::new(1, 1, 1, 2, 1).with_scale(1.0);
        let out = reference(&p, &[1.0], &[0.0, 3f64.ln()], &[2.0, 6.0]).unwrap();
        assert_relative_eq!(out[0], 0.25 * 2.0 + 0.75 * 6.0, epsilon = 1e-14);
    }

    #[test]
    fn causal_rows_without_keys_are_zero_and_first_row_copies_v0() {
        // seq_q > seq_k: the first seq_q - seq_k rows see nothing.
        let p = Problem::new(1, 1, 4, 2, 2).with_causal(true);
        let q = pseudo_random(8, 4);
        let k = pseudo_random(4, 5);
        let v = [3.0, -1.0, 7.0, 9.0];
        let out = reference(&p, &q, &k, &v).unwrap();
        assert_eq!(&out[..4], &[0.0; 4]);
        assert_eq!(&out[4..6], &v[..2]); // row 2 sees only key 0
    }

    #[test]
    fn bshd_is_a_permutation_of_bhsd() {
        let base = Problem::new(2, 3, 5, 6, 4).with_causal(true);
        let (ql, kl) = (base.q_len().unwrap(), base.kv_len().unwrap());
        let (q, k, v) = (
            pseudo_random(ql, 6),
            pseudo_random(kl, 7),
            pseudo_random(kl, 8),
        );
        let bhsd = reference(&base, &q, &k, &v).unwrap();
        let t = base.with_layout(Layout::Bshd);
        let permute = |x: &[f64],
                       from: crate::problem::Strides,
                       to: crate::problem::Strides,
                       h: usize,
                       s: usize| {
            let mut y = vec![0.0; x.len()];
            for b in 0..2 {
                for hh in 0..h {
                    for i in 0..s {
                        for d in 0..4 {
                            y[to.offset(b, hh, i, d)] = x[from.offset(b, hh, i, d)];
                        }
                    }
                }
            }
            y
        };
        let (qa, qb) = (base.q_strides(), t.q_strides());
        let (ka, kb) = (base.kv_strides(), t.kv_strides());
        let out = reference(
            &t,
            &permute(&q, qa, qb, 3, 5),
            &permute(&k, ka, kb, 3, 6),
            &permute(&v, ka, kb, 3, 6),
        )
        .unwrap();
        assert_eq!(out, permute(&bhsd, qa, qb, 3, 5));
    }

    #[test]
    fn windows_match_the_naive_formula() {
        use crate::Mask;
        for (sq, sk, mask) in [
            (
                9,
                9,
                Mask::Window {
                    left: Some(2),
                    right: Some(0),
                },
            ),
            (
                5,
                9,
                Mask::Window {
                    left: Some(3),
                    right: Some(1),
                },
            ),
            (
                9,
                4,
                Mask::Window {
                    left: Some(1),
                    right: None,
                },
            ),
            (6, 9, Mask::CausalTopLeft),
            (9, 6, Mask::CausalTopLeft),
        ] {
            let p = Problem::new(1, 2, sq, sk, 8).with_mask(mask);
            let q = pseudo_random(p.q_len().unwrap(), 21);
            let k = pseudo_random(p.kv_len().unwrap(), 22);
            let v = pseudo_random(p.kv_len().unwrap(), 23);
            let got = reference(&p, &q, &k, &v).unwrap();
            let want = naive(&p, &q, &k, &v);
            for (g, w) in got.iter().zip(&want) {
                assert_relative_eq!(g, w, epsilon = 1e-12, max_relative = 1e-12);
            }
        }
    }

    #[test]
    fn softcap_and_alibi_by_hand() {
        // d = 1, scale 1, one row, keys at the diagonal offsets 1 and 0 (sq 1, sk 2).
        let p = Problem::new(1, 1, 1, 2, 1)
            .with_scale(1.0)
            .with_softcap(2.0);
        let r = reference_with(&p, &[1.0], &[1.0, 3.0], &[2.0, 6.0], None).unwrap();
        let (l0, l1) = (2.0 * (0.5f64).tanh(), 2.0 * (1.5f64).tanh());
        let (w0, w1) = (l0.exp(), l1.exp());
        assert_relative_eq!(r.out[0], (w0 * 2.0 + w1 * 6.0) / (w0 + w1), epsilon = 1e-14);
        assert_relative_eq!(r.lse[0], (w0 + w1).ln(), epsilon = 1e-14);
        // ALiBi: key 0 is one step from row 0's diagonal key 1: bias -0.5.
        let p = Problem::new(1, 1, 1, 2, 1)
            .with_scale(1.0)
            .with_alibi(crate::Alibi::PerHead);
        let r = reference_with(&p, &[1.0], &[1.0, 3.0], &[2.0, 6.0], Some(&[0.5])).unwrap();
        let (w0, w1) = ((1.0f64 - 0.5).exp(), 3.0f64.exp());
        assert_relative_eq!(r.out[0], (w0 * 2.0 + w1 * 6.0) / (w0 + w1), epsilon = 1e-14);
        assert_relative_eq!(r.lse[0], (w0 + w1).ln(), epsilon = 1e-14);
        assert!(reference_with(&p, &[1.0], &[1.0, 3.0], &[2.0, 6.0], None).is_err());
    }

    #[test]
    fn rows_without_keys_have_lse_minus_infinity() {
        let p = Problem::new(1, 1, 4, 2, 2).with_causal(true);
        let r = reference_with(&p, &[0.5; 8], &[0.25; 4], &[1.0; 4], None).unwrap();
        assert_eq!(r.lse[..2], [f64::NEG_INFINITY; 2]);
        // Row 2 sees key 0 alone: lse is its logit, 0.5·0.25·2 times the (f32) scale.
        assert_relative_eq!(r.lse[2], 0.25 * f64::from(p.scale()), epsilon = 1e-14);
    }

    #[test]
    fn nan_in_q_poisons_only_its_row() {
        let p = Problem::new(1, 1, 2, 3, 2);
        let mut q = pseudo_random(4, 9);
        q[0] = f64::NAN;
        let out = reference(&p, &q, &pseudo_random(6, 10), &pseudo_random(6, 11)).unwrap();
        assert!(out[..2].iter().all(|x| x.is_nan()));
        assert!(out[2..].iter().all(|x| x.is_finite()));
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let p = Problem::new(1, 1, 2, 2, 2);
        let e = reference(&p, &[0.0; 3], &[0.0; 4], &[0.0; 4]).unwrap_err();
        assert!(e.to_string().contains("q has 3 elements"));
    }
}
