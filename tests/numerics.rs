//! Numerics at the edges, every GPU backend against the f64 reference: NaN and Inf in inputs
//! propagate where the reference's do, rows with no visible key are exactly zero, and scores of
//! ±1e4 keep the softmax finite.

mod common;

use sdpa::check::{Inputs, compare, fresh_seed, random_inputs, run_backend};
use sdpa::{Backend, DType, Device, Problem};

fn check(dev: &Device, p: &Problem, inputs: &Inputs, what: &str) {
    let [q, k, v] = &inputs.values;
    let want = sdpa::reference(p, q, k, v).unwrap();
    for b in Backend::GPU {
        if b.supports(Some(dev), p).is_err() {
            continue; // e.g. the sm_90a kernel on another GPU; tests/fused.rs says so
        }
        let got = run_backend(Some(dev), p, b, inputs, Some(&want)).unwrap();
        let r = compare(&got, &want, p.dtype, 0);
        assert!(r.pass(), "{b} {what} on {p}: {r:?}");
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
    for causal in [false, true] {
        for dtype in DType::ALL {
            let p = Problem::new(1, 2, 70, 70, 64)
                .with_causal(causal)
                .with_dtype(dtype);
            let base = random_inputs(&p, fresh_seed());
            let [q, k, v] = base.values.clone().map(|x| f32s(&x));
            let d = p.head_dim;
            // NaN in one query row: that row is NaN, nothing else.
            let mut qn = q.clone();
            qn[3 * d + 5] = f32::NAN;
            check(&dev, &p, &Inputs::from_f32(dtype, &qn, &k, &v), "NaN in q");
            // NaN in key 40 of head 0: rows that see it are NaN; causal rows before it are not.
            let mut kn = k.clone();
            kn[40 * d] = f32::NAN;
            check(&dev, &p, &Inputs::from_f32(dtype, &q, &kn, &v), "NaN in k");
            // +Inf in a query element: scores of ±inf, some rows NaN (inf - inf), as in f64.
            let mut qi = q.clone();
            qi[10 * d + 1] = f32::INFINITY;
            check(&dev, &p, &Inputs::from_f32(dtype, &qi, &k, &v), "Inf in q");
            if !causal {
                // NaN in a value row every query sees: every row of that head is NaN.
                let mut vn = v.clone();
                vn[7 * d + 2] = f32::NAN;
                check(&dev, &p, &Inputs::from_f32(dtype, &q, &k, &vn), "NaN in v");
            }
        }
    }
}

#[test]
fn rows_without_visible_keys_are_exact_zeros() {
    let Some(dev) = common::device("masked rows") else {
        return;
    };
    // seq_q > seq_k, causal: the first 90 rows see no key.
    let p = Problem::new(1, 2, 100, 10, 128).with_causal(true);
    let inputs = random_inputs(&p, fresh_seed());
    for b in Backend::GPU {
        if b.supports(Some(&dev), &p).is_err() {
            continue;
        }
        let got = run_backend(Some(&dev), &p, b, &inputs, None).unwrap();
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
    check(&dev, &p, &inputs, "masked rows");
}

/// Logits of 1e8-1e10 (entries of 1e4-1e5): far past any trained model, but finite inputs must
/// give finite outputs. Found by the e4m3 tests: a max rounded to nearest, folded into one FMA
/// per score, left exponents of up to +half an ulp of 1e9 (2^64 and beyond: inf, NaN rows).
#[test]
fn scores_of_1e9_keep_the_softmax_finite() {
    let Some(dev) = common::device("huge scores") else {
        return;
    };
    for dtype in DType::ALL {
        for causal in [false, true] {
            let p = Problem::new(1, 2, 80, 80, 64)
                .with_causal(causal)
                .with_dtype(dtype);
            let base = random_inputs(&p, fresh_seed());
            let [q, k, v] = base.values.clone().map(|x| f32s(&x));
            // f16 holds up to 65504: entries of ~1e4 (logits ~1e8, exponents up to +32, and P
            // overflows f16); bf16 entries of ~1e5 (logits ~1e10, exponents past +128).
            let f = if dtype == DType::F16 { 1e4 } else { 1e5 };
            let big = |x: &[f32]| x.iter().map(|v| v * f).collect::<Vec<_>>();
            let inputs = Inputs::from_f32(dtype, &big(&q), &big(&k), &v);
            check(&dev, &p, &inputs, "scores of 1e9");
        }
    }
}

#[test]
fn scores_of_1e4_keep_the_softmax_finite() {
    let Some(dev) = common::device("large scores") else {
        return;
    };
    for dtype in DType::ALL {
        for causal in [false, true] {
            // Entries of ~N(0, 50^2) with D = 64 and scale 1/8 give |scores| up to ~1e4.
            let p = Problem::new(2, 2, 96, 96, 64)
                .with_causal(causal)
                .with_dtype(dtype);
            let base = random_inputs(&p, fresh_seed());
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
            check(&dev, &p, &inputs, "scores of 1e4");
        }
    }
}
