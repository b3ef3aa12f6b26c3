//! The attention variants on the GPU against the float64 reference: sliding windows, chunks,
//! top-left causal, softcap, ALiBi, sinks and the log-sum-exp, on the backends that run them (scalar and
//! cutlass-sm80 everywhere, cutlass on Hopper), and the typed refusals of the others. Fresh inputs
//! every run.

mod common;

use sdpa::{Alibi, Backend, DType, Mask, Problem};
use sdpa_harness::check::{check_backend, compare, run_backend};
use sdpa_harness::inputs::{fresh_seed, random_inputs};

/// The backends that run every variant on `dev`.
fn variant_backends(dev: &sdpa::Device) -> Vec<Backend> {
    common::expected_backends(dev)
        .into_iter()
        .filter(|b| matches!(b, Backend::Scalar | Backend::Cutlass | Backend::CutlassSm80))
        .collect()
}

fn window(left: Option<usize>, right: Option<usize>) -> Mask {
    Mask::Window { left, right }
}

/// Checks `p` against the float64 reference on each of `backends`, recording what ran in `ran`
/// and what failed in `failures`: a refusal fails unless `documented` takes it for one of the
/// backend's stated limits (its reason given).
fn check_each(
    dev: &sdpa::Device,
    p: Problem,
    backends: &[Backend],
    documented: impl Fn(Backend, &str) -> bool,
    ran: &mut Vec<(Backend, Problem)>,
    failures: &mut Vec<String>,
) {
    for &b in backends {
        if let Err(e) = b.supports(Some(dev), &p) {
            if !documented(b, &e.to_string()) {
                failures.push(format!("{b} refused {p}: {e}"));
            }
            continue;
        }
        let rep = check_backend(Some(dev), &p, b, fresh_seed()).unwrap();
        ran.push((b, p));
        if !rep.pass() {
            failures.push(format!("{b} {p}: {rep:?}"));
        }
    }
}

/// Every mask, softcap, ALiBi (both layouts) and the log-sum-exp, over one and several key
/// tiles, seq_q below and above seq_k, GQA, D = 64, 128, 192 and 256, f16 and bf16.
#[test]
fn variants_match_the_reference() {
    let Some(dev) = common::device("variants") else {
        return;
    };
    let masks = [
        window(Some(200), Some(0)),
        window(Some(130), Some(40)),
        window(Some(300), None),
        window(None, Some(50)),
        Mask::CausalTopLeft,
        Mask::CausalBottomRight,
        Mask::None,
        Mask::Chunked { size: 256 },
        Mask::Chunked { size: 128 },
    ];
    // (heads, kv_heads, seq_q, seq_k, head_dim)
    let shapes = [
        (2, 2, 77, 77, 64),
        (4, 2, 1000, 1000, 128),
        (2, 1, 257, 700, 64),
        (2, 2, 700, 257, 128),
        (2, 1, 300, 520, 256),
        (2, 1, 333, 333, 192),
    ];
    let backends = variant_backends(&dev);
    let (mut ran, mut failures) = (Vec::new(), Vec::new());
    for (i, &mask) in masks.iter().enumerate() {
        for (j, &(h, hk, sq, sk, d)) in shapes.iter().enumerate() {
            let n = i * shapes.len() + j;
            let dtype = DType::ALL[n % 2];
            let mut p = Problem::new(2, h, sq, sk, d)
                .with_kv_heads(hk)
                .with_mask(mask)
                .with_dtype(dtype)
                .with_lse(n % 3 != 1);
            if n % 3 == 0 {
                p = p.with_softcap(if n % 2 == 0 { 5.0 } else { 30.0 });
            }
            if n % 4 == 1 {
                p = p.with_alibi(Alibi::PerHead);
            } else if n % 4 == 3 {
                p = p.with_alibi(Alibi::PerBatchHead);
            }
            // cutlass runs chunks only where they do not split its query tiles.
            let documented = |b: Backend, why: &str| {
                b == Backend::Cutlass
                    && matches!(mask, Mask::Chunked { .. })
                    && why.contains("would split")
            };
            check_each(&dev, p, &backends, documented, &mut ran, &mut failures);
        }
    }
    common::assert_ran("variants", &ran);
    for b in &backends {
        assert!(ran.iter().any(|(r, _)| r == b), "{b} ran no variant");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A window narrower than the cutlass kernels' key tiles runs on scalar; they refuse it with the
/// reason, as wmma and cublas refuse every variant and the log-sum-exp.
#[test]
fn narrow_windows_and_refusals() {
    let Some(dev) = common::device("narrow windows") else {
        return;
    };
    let narrow = Problem::new(1, 2, 300, 300, 64).with_mask(window(Some(20), Some(5)));
    let mut ran = Vec::new();
    for b in variant_backends(&dev) {
        match b {
            Backend::Scalar => {
                let rep = check_backend(Some(&dev), &narrow, b, fresh_seed()).unwrap();
                assert!(rep.pass(), "{b} {narrow}: {rep:?}");
                ran.push((b, narrow));
            }
            _ => {
                let e = b.supports(Some(&dev), &narrow).unwrap_err().to_string();
                assert!(e.contains("narrower than"), "{b}: {e}");
            }
        }
    }
    common::assert_ran("narrow windows", &ran);
    // Chunks that are not whole key tiles: scalar runs them, the cutlass kernels say why not.
    let ragged = Problem::new(1, 2, 300, 300, 64).with_mask(Mask::Chunked { size: 100 });
    for b in variant_backends(&dev) {
        match b {
            Backend::Scalar => {
                let rep = check_backend(Some(&dev), &ragged, b, fresh_seed()).unwrap();
                assert!(rep.pass(), "{b} {ragged}: {rep:?}");
            }
            _ => {
                let e = b.supports(Some(&dev), &ragged).unwrap_err().to_string();
                assert!(
                    e.contains("not a multiple") || e.contains("would split"),
                    "{b}: {e}"
                );
            }
        }
    }
    let plain = Problem::new(1, 2, 64, 64, 64);
    for b in [Backend::Wmma, Backend::Cublas] {
        for p in [
            plain.with_mask(Mask::CausalTopLeft),
            plain.with_mask(Mask::Chunked { size: 32 }),
            plain.with_softcap(10.0),
            plain.with_alibi(Alibi::PerHead),
            plain.with_lse(true),
        ] {
            let e = b.supports(Some(&dev), &p).unwrap_err();
            assert!(
                matches!(e, sdpa::Error::Unsupported { .. }),
                "{b} {p}: {e:?}"
            );
        }
    }
    // Auto picks a backend that runs them.
    let p = plain.with_mask(window(Some(10), Some(0))).with_lse(true);
    let rep = check_backend(Some(&dev), &p, Backend::Auto, fresh_seed()).unwrap();
    assert!(rep.pass(), "auto {p}: {rep:?}");
}

/// NaN, +Inf and -Inf in V at keys below some rows' windows (or chunks) and above others', inside
/// the key tiles the edges cross: each row gets what the reference gives it.
#[test]
fn nonfinite_v_outside_a_window_stays_out() {
    let Some(dev) = common::device("nonfinite v outside a window") else {
        return;
    };
    let mut ran = Vec::new();
    let mut failures = Vec::new();
    for (sq, sk, d, mask) in [
        (600, 600, 128, window(Some(200), Some(0))),
        (500, 700, 64, window(Some(150), Some(30))),
        (700, 500, 128, window(Some(256), None)),
        (400, 400, 256, window(Some(200), Some(0))),
        (640, 640, 128, Mask::Chunked { size: 256 }),
        (512, 768, 64, Mask::Chunked { size: 128 }),
    ] {
        for dtype in DType::ALL {
            let p = Problem::new(1, 2, sq, sk, d)
                .with_kv_heads(1)
                .with_mask(mask)
                .with_dtype(dtype);
            let mut inputs = random_inputs(&p, fresh_seed()).unwrap();
            let keys = [sk / 5, sk / 3, sk / 2, sk - 40];
            let kinds = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, f64::NAN];
            for (i, (&key, &x)) in keys.iter().zip(&kinds).enumerate() {
                for col in [3, 3 + 8 * i] {
                    inputs.set_value(2, key * d + col, x, dtype);
                }
            }
            let [q, k, v] = &inputs.values;
            let want = sdpa::reference(&p, q, k, v).unwrap();
            for b in variant_backends(&dev) {
                let got = run_backend(Some(&dev), &p, b, &inputs, Some(&want)).unwrap();
                ran.push((b, p));
                let r = compare(&got, &want, dtype, 0);
                if !r.pass() {
                    failures.push(format!("{b} on {p}: {r:?}"));
                }
            }
        }
    }
    common::assert_ran("nonfinite v outside a window", &ran);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Rows whose window holds no key (seq_q > seq_k: the first rows' diagonal lies before key 0)
/// output exact zeros and log-sum-exp -inf; the others match the reference.
#[test]
fn empty_windows_give_zeros_and_lse_minus_infinity() {
    let Some(dev) = common::device("empty windows") else {
        return;
    };
    let mut ran = Vec::new();
    for (d, mask) in [
        (64, window(Some(150), Some(0))),
        (128, window(Some(200), Some(10))),
    ] {
        // Rows i with i + 200 - 500 + right < 0 see nothing: 300 of them (d64), 290 (d128).
        let p = Problem::new(1, 2, 500, 200, d)
            .with_mask(mask)
            .with_lse(true);
        let empty = (0..p.seq_q).filter(|&i| p.visible_keys(i) == 0).count();
        assert!(empty > 200, "{p}: the test means rows without keys");
        for b in variant_backends(&dev) {
            let inputs = random_inputs(&p, fresh_seed()).unwrap();
            let want = inputs.reference(&p).unwrap();
            let (got, lse) =
                sdpa_harness::check::run_backend_with_lse(Some(&dev), &p, b, &inputs, Some(&want))
                    .unwrap();
            ran.push((b, p));
            let r = compare(&got, &want.out, p.dtype, 0);
            assert!(r.pass(), "{b} {p}: {r:?}");
            let lse = lse.unwrap();
            for h in 0..2 {
                for i in 0..empty {
                    let row = h * p.seq_q + i;
                    assert_eq!(lse[row], f64::NEG_INFINITY, "{b} {p}: lse of row {i}");
                    assert!(
                        got[row * d..][..d].iter().all(|&x| x == 0.0),
                        "{b} {p}: row {i}"
                    );
                }
            }
            let (err, bad) = sdpa_harness::check::compare_lse(&lse, &want.lse);
            assert!(
                bad == 0 && err < 1e-4,
                "{b} {p}: lse {err} ({bad} rows off)"
            );
        }
    }
    common::assert_ran("empty windows", &ran);
}

/// Softcap with scores of 1e4 and more (entries of 100): every logit is capped to +-softcap, so
/// the output is finite and matches the reference, on a window and causally.
#[test]
fn softcap_caps_huge_logits() {
    let Some(dev) = common::device("softcap huge logits") else {
        return;
    };
    let mut ran = Vec::new();
    for dtype in DType::ALL {
        for mask in [Mask::CausalBottomRight, window(Some(160), Some(0))] {
            let p = Problem::new(1, 2, 300, 300, 128)
                .with_mask(mask)
                .with_softcap(20.0)
                .with_dtype(dtype)
                .with_lse(true);
            let base = random_inputs(&p, fresh_seed()).unwrap();
            let big = |x: &[f64]| x.iter().map(|&v| v as f32 * 100.0).collect::<Vec<_>>();
            let v: Vec<f32> = base.values[2].iter().map(|&x| x as f32).collect();
            let inputs = sdpa_harness::inputs::Inputs::from_f32(
                dtype,
                &big(&base.values[0]),
                &big(&base.values[1]),
                &v,
            );
            let want = inputs.reference(&p).unwrap();
            assert!(want.out.iter().all(|x| x.is_finite()));
            for b in variant_backends(&dev) {
                let (got, lse) = sdpa_harness::check::run_backend_with_lse(
                    Some(&dev),
                    &p,
                    b,
                    &inputs,
                    Some(&want),
                )
                .unwrap();
                ran.push((b, p));
                let r = compare(&got, &want.out, dtype, 0);
                assert!(r.pass(), "{b} {p}: {r:?}");
                let (err, bad) = sdpa_harness::check::compare_lse(&lse.unwrap(), &want.lse);
                assert!(
                    bad == 0 && err < 2e-3,
                    "{b} {p}: lse {err} ({bad} rows off)"
                );
            }
        }
    }
    common::assert_ran("softcap huge logits", &ran);
}

/// Softcap with ALiBi where one head's slope is 0: that head's logits are the capped scores, as
/// the reference has them (the cap is applied whether or not the head's bias is zero).
#[test]
fn softcap_with_a_zero_alibi_slope() {
    let Some(dev) = common::device("softcap with a zero slope") else {
        return;
    };
    let p = Problem::new(1, 2, 200, 260, 128)
        .with_mask(Mask::CausalBottomRight)
        .with_softcap(2.0)
        .with_alibi(Alibi::PerHead)
        .with_lse(true);
    let mut inputs = random_inputs(&p, fresh_seed()).unwrap();
    inputs.alibi_slopes = Some(vec![0.0, 0.25]);
    let want = inputs.reference(&p).unwrap();
    let mut ran = Vec::new();
    for b in variant_backends(&dev) {
        let (got, lse) =
            sdpa_harness::check::run_backend_with_lse(Some(&dev), &p, b, &inputs, Some(&want))
                .unwrap();
        ran.push(b);
        let r = compare(&got, &want.out, p.dtype, 0);
        assert!(r.pass(), "{b} {p}: {r:?}");
        let (err, bad) = sdpa_harness::check::compare_lse(&lse.unwrap(), &want.lse);
        assert!(
            bad == 0 && err < 2e-3,
            "{b} {p}: lse {err} ({bad} rows off)"
        );
    }
    common::assert_ran("softcap with a zero slope", &ran);
}

/// Sinks (one logit a query head, FlashAttention-4's learnable_sink) under every mask kind, with
/// rows that see no key (causal and windows with seq_q > seq_k: output 0, log-sum-exp the sink),
/// GQA, softcap and ALiBi beside them, D = 64 to 256, f16, bf16 and e4m3, the log-sum-exp on
/// most. The drawn sinks (sdpa_harness::inputs::sink_logits) take from a tenth to most of a
/// row's weight, and every fourth head has none (-inf).
#[test]
fn sinks_match_the_reference() {
    let Some(dev) = common::device("sinks") else {
        return;
    };
    let masks = [
        Mask::None,
        Mask::CausalBottomRight,
        window(Some(128), Some(0)),
        Mask::CausalTopLeft,
        window(Some(200), Some(64)),
    ];
    // (heads, kv_heads, seq_q, seq_k, head_dim)
    let shapes = [
        (8, 2, 300, 300, 64),
        (4, 4, 129, 700, 128),
        (4, 1, 500, 200, 64),
        (4, 2, 100, 333, 256),
        (8, 8, 64, 1000, 192),
    ];
    let backends = variant_backends(&dev);
    let (mut ran, mut failures) = (Vec::new(), Vec::new());
    for (i, &mask) in masks.iter().enumerate() {
        for (j, &(h, hk, sq, sk, d)) in shapes.iter().enumerate() {
            let n = i * shapes.len() + j;
            let mut p = Problem::new(2, h, sq, sk, d)
                .with_kv_heads(hk)
                .with_mask(mask)
                .with_dtype(DType::ALL[n % 2])
                .with_sinks(true)
                .with_lse(n % 4 != 3);
            match n % 6 {
                0 => p = p.with_softcap(20.0),
                1 => p = p.with_alibi(Alibi::PerHead),
                _ => {}
            }
            // e4m3 (cutlass natively, the others dequantized) where the kernels take it: no
            // mask but causal, no softcap or ALiBi.
            let fp8 = (mask == Mask::CausalBottomRight || mask == Mask::None) && d <= 128;
            let e4m3 = Problem {
                softcap: None,
                alibi: None,
                ..p.with_dtype(DType::E4m3).with_lse(false)
            };
            let problems = match fp8 {
                true => vec![p, e4m3],
                false => vec![p],
            };
            for p in problems {
                check_each(&dev, p, &backends, |_, _| false, &mut ran, &mut failures);
            }
        }
    }
    common::assert_ran("sinks", &ran);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Hostile sinks: a NaN (and a +inf) sink makes its own head's rows NaN, output and log-sum-exp,
/// and leaves the other heads exact; NaN past the problem's heads in a longer buffer is never
/// read. Backends without sinks (wmma, cublas) refuse them with a typed error, and a call's
/// sinks must be given, long enough, exactly where the problem has them.
#[test]
fn nan_sinks_stay_in_their_head_and_refusals_are_typed() {
    let Some(dev) = common::device("hostile sinks") else {
        return;
    };
    let p = Problem::new(2, 4, 200, 300, 64)
        .with_kv_heads(2)
        .with_causal(true)
        .with_sinks(true)
        .with_lse(true);
    let mut inputs = random_inputs(&p, fresh_seed()).unwrap();
    inputs.sinks = Some(vec![0.5, f32::NAN, f32::NEG_INFINITY, f32::INFINITY]);
    let want = inputs.reference(&p).unwrap();
    let head_rows =
        |h: usize| (0..2).flat_map(move |b| ((b * 4 + h) * 200)..((b * 4 + h + 1) * 200));
    assert!(head_rows(1).all(|i| want.lse[i].is_nan()));
    assert!(head_rows(0).all(|i| want.lse[i].is_finite()));
    let mut ran = Vec::new();
    for b in variant_backends(&dev) {
        let (got, lse) =
            sdpa_harness::check::run_backend_with_lse(Some(&dev), &p, b, &inputs, Some(&want))
                .unwrap();
        let rep = compare(&got, &want.out, p.dtype, 0);
        assert!(rep.pass(), "{b} {p}: {rep:?}");
        let (err, bad) = sdpa_harness::check::compare_lse(&lse.unwrap(), &want.lse);
        assert!(
            bad == 0 && err < sdpa_harness::check::LSE_TOLERANCE,
            "{b}: lse {err}, {bad}"
        );
        ran.push(b);
    }
    common::assert_ran("hostile sinks", &ran);

    // A buffer longer than the heads, NaN past them: the output is the four sinks' alone.
    let mut inputs = random_inputs(&p, fresh_seed()).unwrap();
    let want = inputs.reference(&p).unwrap();
    let mut long = inputs.sinks.clone().unwrap();
    long.extend([f32::NAN; 4]);
    inputs.sinks = Some(long);
    for b in variant_backends(&dev) {
        // The harness uploads what `inputs.sinks` holds; the reference had the first four.
        let (got, _) =
            sdpa_harness::check::run_backend_with_lse(Some(&dev), &p, b, &inputs, Some(&want))
                .unwrap();
        let rep = compare(&got, &want.out, p.dtype, 0);
        assert!(rep.pass(), "{b} {p} with NaN past the heads: {rep:?}");
    }

    let plain = Problem::new(1, 2, 64, 64, 64).with_sinks(true);
    for b in [Backend::Wmma, Backend::Cublas] {
        let e = b.supports(Some(&dev), &plain).unwrap_err();
        assert!(
            matches!(e, sdpa::Error::Unsupported { .. }) && e.to_string().contains("sinks"),
            "{b} {plain}: {e:?}"
        );
    }
    // The call's sinks: missing, too short, or given to a problem without sinks.
    let x = random_inputs(&plain, fresh_seed()).unwrap();
    let [q, k, v] = x.upload(&dev, DType::F16).unwrap();
    let short = dev.stream().clone_htod(&[0.0f32]).unwrap();
    let two = dev.stream().clone_htod(&[0.0f32, 1.0]).unwrap();
    for (p, sinks, says) in [
        (plain, None, "pass sinks"),
        (plain, Some(&short), "one per query head"),
        (plain.with_sinks(false), Some(&two), "without sinks"),
    ] {
        let mut out = sdpa::Tensor::poisoned(&dev, DType::F16, p.q_len().unwrap()).unwrap();
        let t = sdpa::Tensors {
            q: &q,
            k: &k,
            v: &v,
            out: &mut out,
        };
        let extras = sdpa::Extras {
            sinks: sinks.map(|s| s.as_view()),
            ..sdpa::Extras::default()
        };
        let e = sdpa::forward(&dev, &p, Backend::Scalar, t, extras).unwrap_err();
        assert!(
            matches!(e, sdpa::Error::InvalidArgument(_)) && e.to_string().contains(says),
            "{p}: {e:?}"
        );
    }
}

/// Head dims of no instance (32, 80, 112) and V of its own head dim (DeepSeek's 192 / 128, and
/// V narrower or wider than Q·Kᵀ) run on scalar and cutlass-sm80 against the reference, dense,
/// packed and paged, with GQA, masks, sinks and the log-sum-exp (cutlass too, on Hopper); wmma,
/// which runs its own head dims only, and cublas refuse them with the reason.
#[test]
fn head_dims_of_no_instance_and_v_of_its_own() {
    let Some(dev) = common::device("head dims") else {
        return;
    };
    // (head_dim, head_dim_v)
    let dims = [
        (80, 80),
        (112, 112),
        (32, 32),
        (192, 128),
        (128, 64),
        (64, 128),
        (96, 80),
    ];
    let masks = [
        Mask::CausalBottomRight,
        Mask::None,
        window(Some(200), Some(0)),
    ];
    let backends = variant_backends(&dev);
    let (mut ran, mut failures) = (Vec::new(), Vec::new());
    for (i, &(d, dv)) in dims.iter().enumerate() {
        for (j, &mask) in masks.iter().enumerate() {
            let n = i * masks.len() + j;
            let base = Problem::new(2, 8, 300, 333, d)
                .with_head_dim_v(dv)
                .with_kv_heads(if n.is_multiple_of(2) { 2 } else { 8 })
                .with_mask(mask)
                .with_dtype(DType::ALL[n % 2])
                .with_lse(n % 3 != 2)
                .with_sinks(n % 4 == 1);
            let p = match (i + j) % 3 {
                0 => base,
                1 => sdpa_harness::seqs::varlen(base, &[300, 17, 130], &[333, 40, 129]).0,
                _ => sdpa_harness::seqs::paged(base, &[333, 1, 200], 64, fresh_seed()).0,
            };
            // cutlass takes a paged cache in pages of whole key tiles (128 keys below head dim
            // 192).
            let documented = |b: Backend, why: &str| {
                b == Backend::Cutlass && why.contains("pages of 64 keys are smaller")
            };
            check_each(&dev, p, &backends, documented, &mut ran, &mut failures);
        }
    }
    common::assert_ran("head dims", &ran);
    for b in [Backend::Scalar, Backend::CutlassSm80] {
        assert!(
            ran.iter().filter(|(r, _)| *r == b).count() == dims.len() * masks.len(),
            "{b} did not run every case: {ran:?}"
        );
    }
    if backends.contains(&Backend::Cutlass) {
        assert!(
            ran.iter().filter(|(r, _)| *r == Backend::Cutlass).count() >= 12,
            "cutlass ran too few cases: {ran:?}"
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    let p = Problem::new(1, 4, 128, 128, 192).with_head_dim_v(128);
    for b in [Backend::Wmma, Backend::Cublas] {
        let e = b.supports(Some(&dev), &p).unwrap_err();
        assert!(
            matches!(e, sdpa::Error::Unsupported { .. }),
            "{b} {p}: {e:?}"
        );
    }
}
