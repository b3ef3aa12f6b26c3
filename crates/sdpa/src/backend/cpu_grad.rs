//! The float64 reference gradient: dQ, dK, dV (and the sinks' logits' gradient) of the
//! forward's output against a given dO, with the forward's semantics: every mask, softcap,
//! ALiBi (its slopes fixed), sinks, GQA (dK and dV summed over a K/V head's query heads), both
//! layouts. It recomputes the forward itself, so it depends on nothing a kernel wrote.
//!
//! Row i of head h, with s_ij its logits over the keys it sees and P_ij = exp(s_ij - lse_i)
//! (the sink's weight P_i = exp(sink_h - lse_i) joins lse_i, with no value):
//!   dV_j += P_ij dO_i;  dP_ij = dO_i · V_j;  D_i = dO_i · O_i = Σ_j P_ij dP_ij;
//!   dS_ij = P_ij (dP_ij - D_i);  with a softcap c, s = c tanh(x / c) and dX = dS (1 - (s / c)²);
//!   dQ_i += scale Σ_j dX_ij K_j;  dK_j += scale dX_ij Q_i;  dsink_h -= P_i D_i.
//! A row that sees no key has O = 0 and so no gradient (its sink's included: D_i = 0).

use crate::backend::cpu::{SeqRows, check_alibi, check_operand_lens, check_sinks, gather};
use crate::error::{Result, invalid};
use crate::problem::Problem;
use crate::seqs::{SeqMeta, check_metadata};
use rayon::prelude::*;

/// What [`reference_backward`] computes: the gradients of the loss whose gradient against the
/// output is the given dO.
#[derive(Debug, Clone, PartialEq)]
pub struct Gradients {
    /// dL/dQ, in Q's layout.
    pub dq: Vec<f64>,
    /// dL/dK, in K's layout (summed over each K/V head's query heads).
    pub dk: Vec<f64>,
    /// dL/dV, in V's layout (summed likewise).
    pub dv: Vec<f64>,
    /// dL/d(sink logit), one per query head (summed over the batch), where the problem has
    /// sinks.
    pub dsinks: Option<Vec<f64>>,
}

/// The gradients of attention in f64 on the host, for `dout` (the loss's gradient against the
/// output, in the output's layout). Arguments as [`crate::reference_with`]; dense sequences
/// ([`reference_backward_seqs`] takes the others), and V in a tensor of its own (not read from
/// K's rows).
///
/// ```
/// // One query, two keys, Q zero: each key weighs 1/2, O = (V_0 + V_1) / 2.
/// let p = sdpa::Problem::new(1, 1, 1, 2, 1);
/// let (q, k, v, dout) = ([0.0], [1.0, -1.0], [2.0, 4.0], [1.0]);
/// let g = sdpa::reference_backward(&p, &q, &k, &v, &dout, None, None)?;
/// assert_eq!(g.dv, [0.5, 0.5]);
/// // dS_j = P_j (V_j - O) = (-1/2, 1/2); dQ = scale Σ_j dS_j K_j = scale · (-1).
/// assert!((g.dq[0] + f64::from(p.scale())).abs() < 1e-15);
/// assert_eq!(g.dk, [0.0, 0.0]); // Q is zero
/// # Ok::<(), sdpa::Error>(())
/// ```
pub fn reference_backward(
    p: &Problem,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    alibi_slopes: Option<&[f32]>,
    sinks: Option<&[f32]>,
) -> Result<Gradients> {
    p.validate()?;
    if !p.seqs.is_dense() {
        return Err(invalid!(
            "reference_backward: {p} has sequences of different lengths; the reference \
             gradient takes dense ones"
        ));
    }
    check_args(p, [q, k, v, dout], alibi_slopes, sinks)?;
    let (ql, kl, vl) = (p.q_len().unwrap(), p.k_len().unwrap(), p.v_len().unwrap());
    crate::memory::check_host((ql + kl + vl).checked_mul(2 * std::mem::size_of::<f64>()))?;

    let (qs, ks, vs, os) = (p.q_strides(), p.k_strides(), p.v_strides(), p.out_strides());
    let (d, dv) = (p.head_dim, p.v_dim());
    let (group, scale) = (p.heads / p.kv_heads, f64::from(p.scale()));
    let cap = p.softcap.map(f64::from);
    let offset = p.seq_k as f64 - p.seq_q as f64; // row i's diagonal key is i + offset

    // One task per (batch, K/V head): it owns that head's dK and dV rows and its query heads'
    // dQ rows, so the tasks write nothing in common.
    let blocks: Vec<Block> = (0..p.batch * p.kv_heads)
        .into_par_iter()
        .map(|bk| {
            let (b, hk) = (bk / p.kv_heads, bk % p.kv_heads);
            let mut blk = Block {
                dq: vec![0.0; group * p.seq_q * d],
                dk: vec![0.0; p.seq_k * d],
                dv: vec![0.0; p.seq_k * dv],
                dsinks: vec![0.0; group],
            };
            let mut s = vec![0.0; p.seq_k];
            let mut pr = vec![0.0; p.seq_k];
            let mut o = vec![0.0; dv];
            for g in 0..group {
                let h = hk * group + g;
                let slope = match (p.alibi, alibi_slopes) {
                    (Some(a), Some(sl)) => f64::from(sl[a.index(b, h, p.heads)]),
                    _ => 0.0,
                };
                let sink = sinks.map_or(f64::NEG_INFINITY, |sl| f64::from(sl[h]));
                for i in 0..p.seq_q {
                    let keys = p.visible_range(i);
                    if keys.is_empty() {
                        continue; // O = 0: no gradient
                    }
                    let qi = &q[qs.offset(b, h, i, 0)..][..d];
                    let doi = &dout[os.offset(b, h, i, 0)..][..dv];
                    for j in keys.clone() {
                        let kj = &k[ks.offset(b, hk, j, 0)..][..d];
                        let mut x = scale * dot(qi, kj);
                        if let Some(c) = cap {
                            x = c * (x / c).tanh();
                        }
                        if slope != 0.0 {
                            x -= slope * (i as f64 + offset - j as f64).abs();
                        }
                        s[j] = x;
                    }
                    // The forward's row: its maximum (the sink's included), sum, P and O.
                    let m = keys.clone().map(|j| s[j]).fold(sink, f64::max);
                    let m = if m == f64::NEG_INFINITY { 0.0 } else { m };
                    let sum =
                        (sink - m).exp() + keys.clone().map(|j| (s[j] - m).exp()).sum::<f64>();
                    let lse = m + sum.ln();
                    o.fill(0.0);
                    for j in keys.clone() {
                        pr[j] = (s[j] - lse).exp();
                        let vj = &v[vs.offset(b, hk, j, 0)..][..dv];
                        o.iter_mut().zip(vj).for_each(|(od, vd)| *od += pr[j] * vd);
                    }
                    let di = dot(doi, &o);
                    blk.dsinks[g] -= (sink - lse).exp() * di;
                    let dqi = &mut blk.dq[(g * p.seq_q + i) * d..][..d];
                    for j in keys {
                        let vj = &v[vs.offset(b, hk, j, 0)..][..dv];
                        let mut dx = pr[j] * (dot(doi, vj) - di);
                        if let Some(c) = cap {
                            let t = s[j] + slope * (i as f64 + offset - j as f64).abs();
                            dx *= 1.0 - (t / c) * (t / c);
                        }
                        let kj = &k[ks.offset(b, hk, j, 0)..][..d];
                        axpy(dqi, scale * dx, kj);
                        axpy(&mut blk.dk[j * d..][..d], scale * dx, qi);
                        axpy(&mut blk.dv[j * dv..][..dv], pr[j], doi);
                    }
                }
            }
            blk
        })
        .collect();

    let mut grads = Gradients {
        dq: vec![0.0; ql],
        dk: vec![0.0; kl],
        dv: vec![0.0; vl],
        dsinks: sinks.map(|_| vec![0.0; p.heads]),
    };
    for (bk, blk) in blocks.into_iter().enumerate() {
        let (b, hk) = (bk / p.kv_heads, bk % p.kv_heads);
        for j in 0..p.seq_k {
            grads.dk[ks.offset(b, hk, j, 0)..][..d].copy_from_slice(&blk.dk[j * d..][..d]);
            grads.dv[vs.offset(b, hk, j, 0)..][..dv].copy_from_slice(&blk.dv[j * dv..][..dv]);
        }
        for g in 0..group {
            let h = hk * group + g;
            for i in 0..p.seq_q {
                grads.dq[qs.offset(b, h, i, 0)..][..d]
                    .copy_from_slice(&blk.dq[(g * p.seq_q + i) * d..][..d]);
            }
            if let Some(ds) = grads.dsinks.as_mut() {
                ds[h] += blk.dsinks[g];
            }
        }
    }
    Ok(grads)
}

/// [`reference_backward`] for a batch of sequences of different lengths (`p.seqs`, as
/// [`crate::reference_seqs`] takes them), its metadata on the host: each sequence's gradients on
/// their own, added into dK and dV where sequences share K/V rows (a paged cache's shared
/// pages). Rows of packed Q past the last sequence get no gradient.
#[allow(clippy::too_many_arguments)]
pub fn reference_backward_seqs(
    p: &Problem,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    alibi_slopes: Option<&[f32]>,
    sinks: Option<&[f32]>,
    meta: &SeqMeta,
) -> Result<Gradients> {
    p.validate()?;
    let spans = check_metadata(p, meta)?;
    check_args(p, [q, k, v, dout], alibi_slopes, sinks)?;
    let (qs, os, ks, vs) = (p.q_strides(), p.out_strides(), p.k_strides(), p.v_strides());
    let (d, dv) = (p.head_dim, p.v_dim());
    let rows = SeqRows { p, meta };
    let mut grads = Gradients {
        dq: vec![0.0; p.q_len().unwrap()],
        dk: vec![0.0; p.k_len().unwrap()],
        dv: vec![0.0; p.v_len().unwrap()],
        dsinks: sinks.map(|_| vec![0.0; p.heads]),
    };
    for (b, sp) in spans.iter().enumerate() {
        if sp.seq_q == 0 || sp.seq_k == 0 {
            continue; // no key seen: O is 0 or the sink's alone, no gradient
        }
        let qb = gather(q, p.heads, sp.seq_q, d, |h, i| rows.q_at(&qs, b, sp, h, i));
        let kb = gather(k, p.kv_heads, sp.seq_k, d, |hk, j| {
            rows.k_at(&ks, b, sp, hk, j)
        });
        let vb = gather(v, p.kv_heads, sp.seq_k, dv, |hk, j| {
            rows.k_at(&vs, b, sp, hk, j)
        });
        let ob = gather(dout, p.heads, sp.seq_q, dv, |h, i| {
            rows.q_at(&os, b, sp, h, i)
        });
        let slopes = rows.slopes(b, alibi_slopes);
        let g = reference_backward(&rows.one(sp), &qb, &kb, &vb, &ob, slopes.as_deref(), sinks)?;
        for i in 0..sp.seq_q {
            for h in 0..p.heads {
                grads.dq[rows.q_at(&qs, b, sp, h, i)..][..d]
                    .copy_from_slice(&g.dq[(i * p.heads + h) * d..][..d]);
            }
        }
        for j in 0..sp.seq_k {
            for hk in 0..p.kv_heads {
                let at = (j * p.kv_heads + hk) * d;
                axpy(
                    &mut grads.dk[rows.k_at(&ks, b, sp, hk, j)..][..d],
                    1.0,
                    &g.dk[at..][..d],
                );
                let at = (j * p.kv_heads + hk) * dv;
                axpy(
                    &mut grads.dv[rows.k_at(&vs, b, sp, hk, j)..][..dv],
                    1.0,
                    &g.dv[at..][..dv],
                );
            }
        }
        if let (Some(ds), Some(gs)) = (grads.dsinks.as_mut(), g.dsinks) {
            axpy(ds, 1.0, &gs);
        }
    }
    Ok(grads)
}

/// What both reference gradients ask of their arguments beyond the problem: V a tensor of its
/// own, Q, K, V and dO of the problem's lengths, the ALiBi slopes and sinks it has.
fn check_args(
    p: &Problem,
    [q, k, v, dout]: [&[f64]; 4],
    alibi_slopes: Option<&[f32]>,
    sinks: Option<&[f32]>,
) -> Result<()> {
    if p.v_in_k {
        return Err(invalid!(
            "reference_backward: V read from K's rows has no gradient of its own; pass V as a \
             tensor"
        ));
    }
    check_operand_lens(p, q, k, v)?;
    let ol = p.out_len().unwrap();
    if dout.len() != ol {
        return Err(invalid!(
            "reference_backward: dout has {} elements, the output {ol}",
            dout.len()
        ));
    }
    check_alibi(p, alibi_slopes)?;
    check_sinks(p, sinks)
}

/// One (batch, K/V head) task's gradients: its query heads' dQ rows `[group][seq_q][d]`, its
/// dK and dV rows, its query heads' sink gradients.
struct Block {
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    dsinks: Vec<f64>,
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// y += a x.
fn axpy(y: &mut [f64], a: f64, x: &[f64]) {
    y.iter_mut().zip(x).for_each(|(yi, xi)| *yi += a * xi);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Alibi, Layout, Mask};

    /// Deterministic values in [-1, 1) (a fixed LCG), different for each seed.
    fn values(n: usize, seed: u64) -> Vec<f64> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                (x >> 11) as f64 / (1u64 << 52) as f64 - 1.0
            })
            .collect()
    }

    struct Case {
        p: Problem,
        q: Vec<f64>,
        k: Vec<f64>,
        v: Vec<f64>,
        dout: Vec<f64>,
        slopes: Option<Vec<f32>>,
        sinks: Option<Vec<f32>>,
    }

    impl Case {
        fn of(p: Problem, seed: u64) -> Case {
            let slopes = p.alibi.map(|a| {
                (0..a.len(p.batch, p.heads))
                    .map(|i| 0.1 + 0.05 * i as f32)
                    .collect()
            });
            let sinks = p
                .sinks
                .then(|| (0..p.heads).map(|h| 0.3 * h as f32 - 0.4).collect());
            Case {
                q: values(p.q_len().unwrap(), seed),
                k: values(p.k_len().unwrap(), seed + 1),
                v: values(p.v_len().unwrap(), seed + 2),
                dout: values(p.out_len().unwrap(), seed + 3),
                p,
                slopes,
                sinks,
            }
        }

        /// The loss Σ O ∘ dO at these operands.
        fn loss(&self, q: &[f64], k: &[f64], v: &[f64], sinks: Option<&[f32]>) -> f64 {
            let r = crate::reference_with(&self.p, q, k, v, self.slopes.as_deref(), sinks).unwrap();
            dot(&r.out, &self.dout)
        }

        fn grads(&self) -> Gradients {
            reference_backward(
                &self.p,
                &self.q,
                &self.k,
                &self.v,
                &self.dout,
                self.slopes.as_deref(),
                self.sinks.as_deref(),
            )
            .unwrap()
        }

        /// Every gradient against central differences of the loss, element by element.
        fn check_against_differences(&self) {
            let g = self.grads();
            let eps = 1e-6;
            let sinks = self.sinks.as_deref();
            let diff = |which: usize, i: usize| {
                let mut ops = [self.q.clone(), self.k.clone(), self.v.clone()];
                ops[which][i] += eps;
                let up = self.loss(&ops[0], &ops[1], &ops[2], sinks);
                ops[which][i] -= 2.0 * eps;
                let down = self.loss(&ops[0], &ops[1], &ops[2], sinks);
                (up - down) / (2.0 * eps)
            };
            for (which, (name, grad)) in [("dq", &g.dq), ("dk", &g.dk), ("dv", &g.dv)]
                .into_iter()
                .enumerate()
            {
                for (i, &gi) in grad.iter().enumerate() {
                    let fd = diff(which, i);
                    assert!(
                        (gi - fd).abs() <= 1e-7 * (1.0 + fd.abs()),
                        "{}: {name}[{i}] = {gi}, differences give {fd}",
                        self.p
                    );
                }
            }
            // The sinks are f32 logits: step them by a power of two, exact in f32.
            if let (Some(s), Some(ds)) = (&self.sinks, &g.dsinks) {
                let step = 1.0 / 1024.0;
                for h in 0..s.len() {
                    let mut s2 = s.clone();
                    s2[h] += step;
                    let up = self.loss(&self.q, &self.k, &self.v, Some(&s2));
                    s2[h] -= 2.0 * step;
                    let down = self.loss(&self.q, &self.k, &self.v, Some(&s2));
                    let fd = (up - down) / (2.0 * f64::from(step));
                    assert!(
                        (ds[h] - fd).abs() <= 1e-5 * (1.0 + fd.abs()),
                        "{}: dsinks[{h}] = {}, differences give {fd}",
                        self.p,
                        ds[h]
                    );
                }
            }
        }
    }

    #[test]
    fn gradients_match_finite_differences_for_every_variant() {
        let base = || Problem::new(2, 4, 5, 7, 3).with_kv_heads(2);
        let cases = [
            base(),
            base().with_causal(true),
            Problem::new(1, 2, 7, 4, 3).with_causal(true), // rows that see no key
            base().with_mask(Mask::CausalTopLeft),
            base().with_mask(Mask::Window {
                left: Some(2),
                right: Some(1),
            }),
            base().with_mask(Mask::Chunked { size: 3 }),
            base().with_softcap(1.5),
            base().with_causal(true).with_alibi(Alibi::PerHead),
            base().with_alibi(Alibi::PerBatchHead),
            base().with_sinks(true),
            Problem::new(1, 2, 4, 4, 3)
                .with_causal(true)
                .with_sinks(true),
            base().with_head_dim_v(2).with_layout(Layout::Bshd),
            base()
                .with_softcap(2.0)
                .with_causal(true)
                .with_sinks(true)
                .with_kv_heads(1),
        ];
        for (n, p) in cases.into_iter().enumerate() {
            Case::of(p, 10 * n as u64).check_against_differences();
        }
    }

    /// dK and dV of a K/V head are the sums of its query heads' gradients: the same problem
    /// with K and V repeated per query head (no GQA) gives per-head gradients that add up.
    #[test]
    fn gqa_sums_the_group() {
        let gqa = Case::of(Problem::new(1, 4, 3, 5, 2).with_kv_heads(2), 7);
        let rep = |x: &[f64], rows: usize, d: usize| -> Vec<f64> {
            // BHSD [1][2][rows][d] -> [1][4][rows][d], head h reading K/V head h / 2.
            (0..4)
                .flat_map(|h| x[(h / 2) * rows * d..][..rows * d].to_vec())
                .collect()
        };
        let full = Case {
            p: Problem::new(1, 4, 3, 5, 2),
            k: rep(&gqa.k, 5, 2),
            v: rep(&gqa.v, 5, 2),
            q: gqa.q.clone(),
            dout: gqa.dout.clone(),
            slopes: None,
            sinks: None,
        };
        let (g, f) = (gqa.grads(), full.grads());
        assert_eq!(g.dq, f.dq);
        for hk in 0..2 {
            for x in 0..5 * 2 {
                let summed = f.dk[(2 * hk) * 10 + x] + f.dk[(2 * hk + 1) * 10 + x];
                assert!((g.dk[hk * 10 + x] - summed).abs() < 1e-15);
                let summed = f.dv[(2 * hk) * 10 + x] + f.dv[(2 * hk + 1) * 10 + x];
                assert!((g.dv[hk * 10 + x] - summed).abs() < 1e-15);
            }
        }
    }

    /// Packed sequences (one without queries, one whose rows see no key) and a paged cache
    /// whose sequences share a page: the gradients against differences of `reference_seqs`.
    #[test]
    fn sequences_of_different_lengths_match_finite_differences() {
        let packed = Problem::new(3, 4, 4, 5, 2)
            .with_kv_heads(2)
            .with_causal(true)
            .with_sinks(true)
            .with_packed_q(7)
            .with_packed_kv(9);
        let packed_meta = SeqMeta {
            cu_seqlens_q: Some(vec![0, 3, 3, 7]),
            cu_seqlens_k: Some(vec![0, 4, 9, 9]),
            ..SeqMeta::default()
        };
        // Pages of 16 keys; both sequences read page 1 first.
        let paged = Problem::new(2, 2, 3, 20, 2)
            .with_causal(true)
            .with_paged_kv(4, 16, 2);
        let paged_meta = SeqMeta {
            block_table: Some(vec![1, 0, 1, 3]),
            seqused_k: Some(vec![20, 17]),
            ..SeqMeta::default()
        };
        for (n, (p, meta)) in [(packed, packed_meta), (paged, paged_meta)]
            .into_iter()
            .enumerate()
        {
            let c = Case::of(p, 100 + n as u64);
            let sinks = c.sinks.as_deref();
            let loss = |q: &[f64], k: &[f64], v: &[f64]| {
                let r = crate::reference_seqs(&c.p, q, k, v, None, sinks, &meta).unwrap();
                dot(&r.out, &c.dout)
            };
            let g = reference_backward_seqs(&c.p, &c.q, &c.k, &c.v, &c.dout, None, sinks, &meta)
                .unwrap();
            let eps = 1e-6;
            for (which, (name, grad)) in [("dq", &g.dq), ("dk", &g.dk), ("dv", &g.dv)]
                .into_iter()
                .enumerate()
            {
                for (i, &gi) in grad.iter().enumerate() {
                    let mut ops = [c.q.clone(), c.k.clone(), c.v.clone()];
                    ops[which][i] += eps;
                    let up = loss(&ops[0], &ops[1], &ops[2]);
                    ops[which][i] -= 2.0 * eps;
                    let fd = (up - loss(&ops[0], &ops[1], &ops[2])) / (2.0 * eps);
                    assert!(
                        (gi - fd).abs() <= 1e-7 * (1.0 + fd.abs()),
                        "{}: {name}[{i}] = {gi}, differences give {fd}",
                        c.p
                    );
                }
            }
            // Shared page 1 takes both sequences' gradients: non-zero from each.
            if n == 1 {
                assert!(g.dv.iter().any(|&x| x != 0.0));
            }
        }
    }

    #[test]
    fn what_it_refuses() {
        let p = Problem::new(1, 1, 2, 2, 2);
        let (x, y) = (vec![0.0; 4], vec![0.0; 3]);
        let e = reference_backward(&p, &x, &x, &x, &y, None, None).unwrap_err();
        assert!(e.to_string().contains("dout has 3 elements"), "{e}");
        let e = reference_backward(&p, &x, &x, &x, &x, None, Some(&[0.0])).unwrap_err();
        assert!(e.to_string().contains("sinks given"), "{e}");
        let e = reference_backward(&p.with_v_in_k(true), &x, &x, &x, &x, None, None);
        assert!(e.is_err());
        let packed = Problem::new(2, 1, 2, 2, 2).with_packed_q(3);
        let e = reference_backward(
            &packed, &[0.0; 6], &[0.0; 8], &[0.0; 8], &[0.0; 6], None, None,
        );
        assert!(e.unwrap_err().to_string().contains("different lengths"));
    }
}
