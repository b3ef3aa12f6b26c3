//! Numerics at the edges, every GPU backend against the f64 reference: NaN and Inf in inputs
//! propagate where the reference's do, rows with no visible key are exactly zero, and scores of
//! ±1e4 keep the softmax finite.

mod common;

use sdpa::{Backend, DType, Device, Problem};
use sdpa_harness::check::{compare, run_backend};
use sdpa_harness::inputs::{Inputs, fresh_seed, random_inputs};

/// Every GPU backend that supports `p` here against the reference; each run is recorded in
/// `ran`, so the test can assert that the backends it means to cover did run.
fn check(
    dev: &Device,
    p: &Problem,
    inputs: &Inputs,
    what: &str,
    ran: &mut Vec<(Backend, Problem)>,
) {
    let [q, k, v] = &inputs.values;
    let want = sdpa::reference(p, q, k, v).unwrap();
    for b in Backend::GPU {
        if b.supports(Some(dev), p).is_err() {
            continue; // e.g. the sm_90a kernel on another GPU; tests/fused.rs says so
        }
        let got = run_backend(Some(dev), p, b, inputs, Some(&want)).unwrap();
        let r = compare(&got, &want, p.dtype, 0);
        assert!(r.pass(), "{b} {what} on {p}: {r:?}");
        ran.push((b, *p));
    }
}

fn f32s(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

#[test]
fn nan_and_inf_propagate_like_the_reference() {
    let Some(dev) = common::device("nan/inf") else {
        return;
    };
    let mut ran = Vec::new();
    for causal in [false, true] {
        for dtype in DType::ALL {
            let p = Problem::new(1, 2, 70, 70, 64)
                .with_causal(causal)
                .with_dtype(dtype);
            let base = random_inputs(&p, fresh_seed()).unwrap();
            let [q, k, v] = base.values.clone().map(|x| f32s(&x));
            let d = p.head_dim;
            // NaN in one query row: that row is NaN, nothing else.
            let mut qn = q.clone();
            qn[3 * d + 5] = f32::NAN;
            check(
                &dev,
                &p,
                &Inputs::from_f32(dtype, &qn, &k, &v),
                "NaN in q",
                &mut ran,
            );
            // NaN in key 40 of head 0: rows that see it are NaN; causal rows before it are not.
            let mut kn = k.clone();
            kn[40 * d] = f32::NAN;
            check(
                &dev,
                &p,
                &Inputs::from_f32(dtype, &q, &kn, &v),
                "NaN in k",
                &mut ran,
            );
            // +Inf in a query element: scores of ±inf, some rows NaN (inf - inf), as in f64.
            let mut qi = q.clone();
            qi[10 * d + 1] = f32::INFINITY;
            check(
                &dev,
                &p,
                &Inputs::from_f32(dtype, &qi, &k, &v),
                "Inf in q",
                &mut ran,
            );
            if !causal {
                // NaN in a value row every query sees: every row of that head is NaN.
                let mut vn = v.clone();
                vn[7 * d + 2] = f32::NAN;
                check(
                    &dev,
                    &p,
                    &Inputs::from_f32(dtype, &q, &k, &vn),
                    "NaN in v",
                    &mut ran,
                );
            }
        }
    }
    common::assert_all_ran_per_dtype("nan/inf", &dev, &ran, &DType::ALL);
}

#[test]
fn rows_without_visible_keys_are_exact_zeros() {
    let Some(dev) = common::device("masked rows") else {
        return;
    };
    // seq_q > seq_k, causal: the first 90 rows see no key.
    let p = Problem::new(1, 2, 100, 10, 128).with_causal(true);
    let inputs = random_inputs(&p, fresh_seed()).unwrap();
    let mut ran = Vec::new();
    for b in Backend::GPU {
        if b.supports(Some(&dev), &p).is_err() {
            continue;
        }
        let got = run_backend(Some(&dev), &p, b, &inputs, None).unwrap();
        ran.push((b, p));
        for h in 0..2 {
            let head = &got[h * 100 * 128..][..100 * 128];
            assert!(
                head[..90 * 128].iter().all(|&x| x == 0.0),
                "{b}: masked rows not zero"
            );
            assert!(
                head[90 * 128..].iter().all(|x| x.is_finite()),
                "{b}: visible rows"
            );
        }
    }
    common::assert_all_ran("masked rows", &dev, &ran);
    let mut checked = Vec::new();
    check(&dev, &p, &inputs, "masked rows", &mut checked);
    common::assert_all_ran("masked rows against the reference", &dev, &checked);
}

/// Logits of 1e8-1e10 (entries of 1e4-1e5): far past any trained model, but finite inputs must
/// give finite outputs. Found by the e4m3 tests: a max rounded to nearest, folded into one FMA
/// per score, left exponents of up to +half an ulp of 1e9 (2^64 and beyond: inf, NaN rows).
#[test]
fn scores_of_1e9_keep_the_softmax_finite() {
    let Some(dev) = common::device("huge scores") else {
        return;
    };
    let mut ran = Vec::new();
    for dtype in DType::ALL {
        for causal in [false, true] {
            let p = Problem::new(1, 2, 80, 80, 64)
                .with_causal(causal)
                .with_dtype(dtype);
            let base = random_inputs(&p, fresh_seed()).unwrap();
            let [q, k, v] = base.values.clone().map(|x| f32s(&x));
            // f16 holds up to 65504: entries of ~1e4 (logits ~1e8, exponents up to +32, and P
            // overflows f16); bf16 entries of ~1e5 (logits ~1e10, exponents past +128).
            let f = if dtype == DType::F16 { 1e4 } else { 1e5 };
            let big = |x: &[f32]| x.iter().map(|v| v * f).collect::<Vec<_>>();
            let inputs = Inputs::from_f32(dtype, &big(&q), &big(&k), &v);
            check(&dev, &p, &inputs, "scores of 1e9", &mut ran);
        }
    }
    common::assert_all_ran_per_dtype("huge scores", &dev, &ran, &DType::ALL);
}

#[test]
fn scores_of_1e4_keep_the_softmax_finite() {
    let Some(dev) = common::device("large scores") else {
        return;
    };
    let mut ran = Vec::new();
    for dtype in DType::ALL {
        for causal in [false, true] {
            // Entries of ~N(0, 50^2) with D = 64 and scale 1/8 give |scores| up to ~1e4.
            let p = Problem::new(2, 2, 96, 96, 64)
                .with_causal(causal)
                .with_dtype(dtype);
            let base = random_inputs(&p, fresh_seed()).unwrap();
            let [q, k, v] = base.values.clone().map(|x| f32s(&x));
            let big = |x: &[f32]| x.iter().map(|v| v * 50.0).collect::<Vec<_>>();
            let inputs = Inputs::from_f32(dtype, &big(&q), &big(&k), &v);
            let [qv, kv, _] = &inputs.values;
            let max_score = (0..96)
                .flat_map(|i| (0..96).map(move |j| (i, j)))
                .map(|(i, j)| {
                    (0..64)
                        .map(|t| qv[i * 64 + t] * kv[j * 64 + t])
                        .sum::<f64>()
                        .abs()
                        / 8.0
                })
                .fold(0.0, f64::max);
            assert!(max_score > 5e3, "test inputs too small: {max_score}");
            check(&dev, &p, &inputs, "scores of 1e4", &mut ran);
        }
    }
    common::assert_all_ran_per_dtype("large scores", &dev, &ran, &DType::ALL);
}

/// NaN, +Inf and -Inf in V at keys some causal rows see and others do not (the non-finite V check):
/// the rows past each key get what the reference gives them (NaN, ±Inf in that column), the rows
/// before it stay finite. The keys sit inside the key tiles that cross the diagonal (the
/// tensor-core kernels multiply masked keys by P = 0 there, and 0 · NaN is NaN), on every kernel
/// family: one tile and several, seq_q < seq_k, seq_q > seq_k (rows with no visible key stay
/// zeros), D = 64 and 128 (the sm90 small-problem path takes the D = 64 ones of 129-1024 keys),
/// GQA, f16, bf16 and e4m3 (NaN codes only: e4m3 has no infinities).
#[test]
fn nonfinite_v_at_masked_keys_stays_out_of_rows_that_do_not_see_it() {
    let Some(dev) = common::device("nonfinite v at masked keys") else {
        return;
    };
    // (heads, kv_heads, seq_q, seq_k, head_dim)
    let shapes = [
        (2, 2, 70, 70, 64),
        (2, 1, 200, 200, 64),
        (2, 2, 100, 230, 128),
        (2, 2, 300, 150, 128),
        (1, 1, 256, 256, 64),
        (1, 1, 384, 384, 128),
        (1, 1, 300, 300, 256),
    ];
    let mut failures = Vec::new();
    let mut ran = Vec::new();
    for dtype in DType::INPUTS {
        for &(h, hk, sq, sk, d) in &shapes {
            let p = Problem::new(1, h, sq, sk, d)
                .with_kv_heads(hk)
                .with_causal(true)
                .with_dtype(dtype);
            let mut inputs = random_inputs(&p, fresh_seed()).unwrap();
            // Keys spread over the diagonal's range, so that every kernel's tiles have some.
            let keys = [sk / 5, sk / 2, sk - sk / 4, sk - 2];
            let kinds = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, f64::NAN];
            for (i, (&key, &x)) in keys.iter().zip(&kinds).enumerate() {
                // Columns 3 and 3 + 8i: the first shared by all four keys (NaN from both
                // infinities, or from the NaN), the second one key's alone. Every kv head.
                for hv in 0..hk {
                    for col in [3, 3 + 8 * i] {
                        let at = (hv * sk + key) * d + col;
                        let x = if dtype == DType::E4m3 && x.is_infinite() {
                            f64::NAN
                        } else {
                            x
                        };
                        inputs.set_value(2, at, x, dtype);
                    }
                }
            }
            let [q, k, v] = &inputs.values;
            let want = sdpa::reference(&p, q, k, v).unwrap();
            // The inputs are what the test means: the last key's own column is finite in the
            // rows before it and NaN in the rows that see it.
            assert!(want[(sq - 3) * d + 27].is_finite() && want[(sq - 1) * d + 27].is_nan());
            for b in Backend::GPU {
                if b.supports(Some(&dev), &p).is_err() {
                    continue;
                }
                let got = run_backend(Some(&dev), &p, b, &inputs, Some(&want)).unwrap();
                ran.push((b, p));
                let r = compare(&got, &want, dtype, 0);
                if !r.pass() {
                    // Where: the first elements whose NaN-ness or infinity differs.
                    let bad: Vec<String> = got
                        .iter()
                        .zip(&want)
                        .enumerate()
                        .filter(|(_, (g, w))| {
                            g.is_nan() != w.is_nan() || (w.is_infinite() && g != w)
                        })
                        .take(6)
                        .map(|(i, (g, w))| format!("(row {} col {}: {g} vs {w})", i / d, i % d))
                        .collect();
                    failures.push(format!("{b} on {p}: {r:?} {}", bad.join(" ")));
                }
            }
        }
    }
    common::assert_all_ran_per_dtype("nonfinite v at masked keys", &dev, &ran, &DType::INPUTS);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
