//! MLA decode in the absorbed form on the GPU: 576-wide query heads against one latent K/V head
//! whose first 512 columns are V (`Problem::with_v_in_k`), against the float64 reference: one
//! token and several (MTP, speculative decode, causal), dense and paged latent caches (pages of
//! 16 and 64: cutlass's cp.async and TMA paths), one split and several, 128 query heads and
//! fewer, sinks and the log-sum-exp, owned tensors and views; pages of NaN past seqused_k; and
//! the typed refusals when V is not K's rows. Fresh inputs every run, outputs poisoned first.
//!
//! Backends: cutlass (sm_90a: the MLA decode kernel) and scalar (any 576-wide problem, the GPU
//! reference path).

mod common;

use half::bf16;
use sdpa::{Backend, DType, Device, Error, Extras, Problem, View, ViewMut, Views};
use sdpa_harness::check::check_output;
use sdpa_harness::inputs::{Inputs, fresh_seed, random_inputs};
use sdpa_harness::seqs::paged;

/// The backends that run MLA decode here: scalar, and cutlass on sm_90a.
fn mla_backends(dev: &Device) -> Vec<Backend> {
    common::expected_backends(dev)
        .into_iter()
        .filter(|b| matches!(b, Backend::Scalar | Backend::Cutlass))
        .collect()
}

/// A latent-cache decode problem: `heads` query heads of 576 on one K/V head, V its first 512.
fn latent(batch: usize, heads: usize, tokens: usize, keys: usize) -> Problem {
    Problem::new(batch, heads, tokens, keys, 576)
        .with_kv_heads(1)
        .with_head_dim_v(512)
        .with_v_in_k(true)
        .with_causal(tokens > 1)
}

#[test]
fn mla_decode_matches_the_reference() {
    let Some(dev) = common::device("mla decode") else {
        return;
    };
    let backends = mla_backends(&dev);
    let (mut ran, mut failures) = (Vec::new(), Vec::new());
    let dense = [
        // Several splits (2 sequences fill few SMs), the log-sum-exp.
        latent(2, 128, 1, 1000)
            .with_dtype(DType::Bf16)
            .with_lse(true),
        // One split (140 CTAs), f16, sinks.
        latent(70, 128, 1, 300).with_sinks(true),
        // MTP: 2 causal tokens, 16 query heads (a CTA's 64 rows partly used), BSHD.
        latent(3, 16, 2, 777)
            .with_dtype(DType::Bf16)
            .with_layout(sdpa::Layout::Bshd)
            .with_lse(true),
        // Speculative decode: 16 causal tokens, 128 heads, sinks and several splits.
        latent(1, 128, 16, 520)
            .with_dtype(DType::Bf16)
            .with_sinks(true)
            .with_lse(true),
        // A softmax scale of the caller's (DeepSeek's yarn mscale), keys not a whole tile.
        latent(4, 64, 1, 65).with_scale(0.1147),
    ];
    for p in dense {
        let x = random_inputs(&p, fresh_seed()).unwrap();
        for &b in &backends {
            ran.push((b, p));
            failures.extend(common::check_reference(&dev, &p, b, &x, "dense"));
        }
    }
    // Paged: sequences of 0 keys, of whole pages, of a page and one key; pages of 64 and 16.
    let k_lens: &[usize] = &[300, 64, 0, 1000, 1];
    for (n, &(tokens, page_size)) in [(1, 64), (2, 64), (1, 16)].iter().enumerate() {
        let base = latent(1, 128, tokens, 1)
            .with_dtype(DType::ALL[n % 2])
            .with_sinks(n == 1)
            .with_lse(n != 1);
        let (p, meta) = paged(base, k_lens, page_size, fresh_seed());
        let x = random_inputs(&p, fresh_seed()).unwrap().with_meta(meta);
        for &b in &backends {
            ran.push((b, p));
            failures.extend(common::check_reference(&dev, &p, b, &x, "paged"));
        }
    }
    common::assert_ran("mla decode", &ran);
    assert!(
        ran.iter().any(|(b, _)| *b == Backend::Cutlass) || !backends.contains(&Backend::Cutlass),
        "cutlass did not run"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every latent row past each sequence's seqused_k (the rest of its pages, the pages no sequence
/// holds) is NaN: the output holds none and matches the reference, which reads none of them.
#[test]
fn nan_pages_past_seqused_k_do_not_leak() {
    let Some(dev) = common::device("mla NaN pages") else {
        return;
    };
    let backends = mla_backends(&dev);
    let (mut ran, mut failures) = (Vec::new(), Vec::new());
    let base = latent(1, 128, 1, 1).with_dtype(DType::Bf16);
    let (p, meta) = paged(base, &[300, 17, 0, 257, 1000], 64, fresh_seed());
    let mut x = random_inputs(&p, fresh_seed())
        .unwrap()
        .with_meta(meta.clone());
    let dead = common::rows_past_seqused(&p, &meta);
    assert!(!dead.is_empty(), "{p}: no row past seqused_k");
    for &r in &dead {
        // K's buffer is V's too: both copies of the values say NaN.
        for e in r * 576..(r + 1) * 576 {
            x.set_value(1, e, f64::NAN, p.dtype);
            x.set_value(2, e, f64::NAN, p.dtype);
        }
    }
    let want = x.reference(&p).unwrap();
    assert!(want.out.iter().all(|v| v.is_finite()), "{p}: reference");
    for &b in &backends {
        ran.push((b, p));
        let got = sdpa_harness::check::run_backend(Some(&dev), &p, b, &x, Some(&want.out)).unwrap();
        let nans = got.iter().filter(|v| v.is_nan()).count();
        let r = check_output(&got, &want.out, &p, &x, 0).unwrap();
        eprintln!(
            "{b} {p}: {} NaN rows past seqused_k; {nans} NaN outputs, rel_err {:.2e}",
            dead.len(),
            r.rel_err
        );
        if nans > 0 || !r.pass() {
            failures.push(format!("{b} {p}: {nans} NaN outputs, {r:?}"));
        }
    }
    common::assert_ran("mla NaN pages", &ran);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Views of one latent cache: K and V are the same view (address and strides); the output is
/// the reference's. A V of its own under a v_in_k problem is a typed error, and without
/// v_in_k cutlass refuses the 576/512 problem by name while scalar runs it.
#[test]
fn views_of_one_latent_cache_and_the_refusals() {
    let Some(dev) = common::device("mla views") else {
        return;
    };
    let p = latent(3, 128, 1, 700).with_dtype(DType::Bf16);
    let x = random_inputs(&p, fresh_seed()).unwrap();
    let want = x.reference(&p).unwrap();
    let s = dev.stream();
    let q = s.clone_htod(&bits(&x, 0)).unwrap();
    let cache = s.clone_htod(&bits(&x, 1)).unwrap();
    let mut ran = Vec::new();
    for b in mla_backends(&dev) {
        let mut out = s.alloc_zeros::<bf16>(p.out_len().unwrap()).unwrap();
        let views = Views {
            q: View::new(q.as_view(), p.q_strides()),
            k: View::new(cache.as_view(), p.k_strides()),
            v: View::new(cache.as_view(), p.k_strides()),
            out: ViewMut::new(out.as_view_mut(), p.out_strides()),
        };
        sdpa::forward(&dev, &p, b, views, Extras::default()).unwrap();
        let got: Vec<f64> = s
            .clone_dtoh(&out)
            .unwrap()
            .iter()
            .map(|v| f64::from(v.to_f32()))
            .collect();
        let r = check_output(&got, &want.out, &p, &x, 0).unwrap();
        eprintln!("{b} {p} [views]: rel_err {:.2e}", r.rel_err);
        assert!(r.pass(), "{b} {p} [views]: {r:?}");
        ran.push(b);

        // V of its own (a copy of the cache) under a problem that reads V from K's rows.
        let copy = s.clone_htod(&bits(&x, 1)).unwrap();
        let views = Views {
            q: View::new(q.as_view(), p.q_strides()),
            k: View::new(cache.as_view(), p.k_strides()),
            v: View::new(copy.as_view(), p.k_strides()),
            out: ViewMut::new(out.as_view_mut(), p.out_strides()),
        };
        match sdpa::forward(&dev, &p, b, views, Extras::default()) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("pass K as V"), "{m}"),
            other => panic!("{b}: a V of its own under v_in_k: {other:?}"),
        }
    }
    common::assert_ran("mla views", &ran);
    // Without v_in_k: V is a tensor of its own, which cutlass's MLA kernel does not read.
    let own = p.with_v_in_k(false);
    if mla_backends(&dev).contains(&Backend::Cutlass) {
        let why = Backend::Cutlass.supports(Some(&dev), &own).unwrap_err();
        assert!(why.to_string().contains("with_v_in_k"), "{why}");
    }
    Backend::Scalar.supports(Some(&dev), &own).unwrap();
}

/// Input `which` (0 Q, 1 K) as bf16 values.
fn bits(x: &Inputs, which: usize) -> Vec<bf16> {
    x.bits[which].iter().map(|&b| bf16::from_bits(b)).collect()
}
