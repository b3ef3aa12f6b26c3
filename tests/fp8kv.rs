//! An FP8 (e4m3) K/V cache under 16-bit Q on the GPU, against the float64 reference on the
//! dequantized cache: decode and speculative decode over dense and paged caches, scales per
//! tensor and per K/V head, GQA, sinks and the log-sum-exp, owned tensors and views; pages of NaN
//! past seqused_k; `write_kv_fp8` and `append_kv` quantizing 16-bit rows bit for bit as the host
//! codec does; and the typed refusals of every backend and problem that does not read such a
//! cache. Fresh inputs every run, outputs poisoned first.
//!
//! The bar: rel_err ≤ 5e-3 (bf16 Q; f16 Q its own 9.8e-4) on each input family, printed per
//! case ([`sdpa_harness::check::fp8_kv_tolerance`]).

mod common;

use cudarc::driver::CudaSlice;
use half::bf16;
use sdpa::{
    Backend, DType, Device, Error, Fp8KvViews, Fp8View, KvScales, Mask, NewRows, PageLayout,
    PagedCache, Placement, Problem, Scaling, Tensor, View, ViewMut, fp8,
};
use sdpa_harness::check::{ExtraBuffers, check_output, fp8_kv_tolerance};
use sdpa_harness::inputs::{Family, Inputs, family_inputs, fresh_seed, random_inputs};
use sdpa_harness::seqs::{paged, varlen};

/// The backends that read an e4m3 K/V cache and run on `dev`: cutlass-sm80 (sm_80 and newer),
/// cutlass (its decode path, sm_90a).
fn fp8kv_backends(dev: &Device) -> Vec<Backend> {
    common::expected_backends(dev)
        .into_iter()
        .filter(|b| matches!(b, Backend::CutlassSm80 | Backend::Cutlass))
        .collect()
}

/// `p` with Q (and the output) of `dtype` over an e4m3 K/V cache with scales of `scaling`.
fn kv(p: Problem, dtype: DType, scaling: Scaling) -> Problem {
    p.with_dtype(dtype)
        .with_kv_dtype(DType::E4m3)
        .with_fp8_scaling(scaling)
}

/// Decode (1 token) and speculative decode (4 tokens, causal) over dense and paged e4m3 caches:
/// bf16 and f16 Q, head_dim 64 and 128, scales per tensor and per K/V head, GQA and MHA, one
/// split and several, seqused_k on a dense cache, sinks and the log-sum-exp; dense problems on
/// each input family.
#[test]
fn fp8_kv_decode_matches_the_reference() {
    let Some(dev) = common::device("fp8 kv decode") else {
        return;
    };
    let backends = fp8kv_backends(&dev);
    let (mut ran, mut failures) = (Vec::new(), Vec::new());
    // Dense: (problem, families).
    let dense = [
        // Several splits (2 K/V heads x 3 sequences fill few SMs).
        kv(
            Problem::new(3, 8, 1, 1000, 128).with_kv_heads(2),
            DType::Bf16,
            Scaling::PerHead,
        ),
        // One split (132 CTAs or more), MHA, D = 64, one scale a tensor.
        kv(
            Problem::new(33, 4, 1, 512, 64),
            DType::F16,
            Scaling::PerTensor,
        ),
        // Speculative decode: 4 causal tokens, GQA 32/8, sinks and the log-sum-exp.
        kv(
            Problem::new(2, 32, 4, 777, 128)
                .with_kv_heads(8)
                .with_causal(true)
                .with_sinks(true)
                .with_lse(true),
            DType::Bf16,
            Scaling::PerHead,
        ),
        // BSHD, 16 tokens (the most a decode step takes), f16.
        kv(
            Problem::new(2, 8, 16, 300, 64)
                .with_kv_heads(1)
                .with_causal(true)
                .with_layout(sdpa::Layout::Bshd),
            DType::F16,
            Scaling::PerHead,
        ),
    ];
    for p in dense {
        for family in Family::ALL {
            let x = family_inputs(&p, family, fresh_seed()).unwrap();
            for &b in &backends {
                ran.push((b, p));
                failures.extend(common::check_reference(&dev, &p, b, &x, "dense"));
            }
        }
    }
    // Dense with seqused_k: each sequence its own keys.
    let p = kv(
        Problem::new(4, 16, 1, 600, 128)
            .with_kv_heads(4)
            .with_seqused_k(true),
        DType::Bf16,
        Scaling::PerHead,
    );
    let x = random_inputs(&p, fresh_seed()).unwrap();
    for &b in &backends {
        ran.push((b, p));
        failures.extend(common::check_reference(&dev, &p, b, &x, "dense, seqused_k"));
    }
    // Paged: sequences of 0 keys, of whole pages, of a page and one key; pages of 16 to 128.
    let k_lens: &[usize] = &[300, 16, 0, 257, 64, 1];
    for (n, &(seq_q, page_size, d)) in [(1, 16, 128), (4, 64, 64), (1, 128, 128), (16, 32, 128)]
        .iter()
        .enumerate()
    {
        let base = Problem::new(1, 8, seq_q, 1, d)
            .with_kv_heads(2)
            .with_causal(seq_q > 1)
            .with_sinks(n == 1)
            .with_lse(n % 2 == 0);
        let (p, meta) = paged(base, k_lens, page_size, fresh_seed());
        let p = kv(
            p,
            DType::ALL[n % 2],
            [Scaling::PerHead, Scaling::PerTensor][n / 2 % 2],
        );
        let x = random_inputs(&p, fresh_seed()).unwrap().with_meta(meta);
        for &b in &backends {
            ran.push((b, p));
            failures.extend(common::check_reference(&dev, &p, b, &x, "paged"));
        }
    }
    common::assert_ran("fp8 kv decode", &ran);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Prefill over an e4m3 cache (the kernels' 16-bit path on widened copies of the cache): dense
/// causal with GQA and the log-sum-exp, chunked prefill of 40 tokens a sequence over a paged
/// cache, packed (varlen) sequences, a sliding window, head_dim 256; scales per K/V head and per
/// tensor.
#[test]
fn fp8_kv_prefill_matches_the_reference() {
    let Some(dev) = common::device("fp8 kv prefill") else {
        return;
    };
    let backends = fp8kv_backends(&dev);
    let (mut ran, mut failures) = (Vec::new(), Vec::new());
    let dense = [
        kv(
            Problem::new(2, 8, 300, 300, 128)
                .with_kv_heads(2)
                .with_causal(true)
                .with_lse(true),
            DType::Bf16,
            Scaling::PerHead,
        ),
        kv(
            Problem::new(1, 4, 200, 700, 64).with_mask(Mask::Window {
                left: Some(256),
                right: Some(0),
            }),
            DType::F16,
            Scaling::PerTensor,
        ),
        kv(
            Problem::new(2, 4, 1, 500, 256).with_kv_heads(2),
            DType::Bf16,
            Scaling::PerHead,
        ),
    ];
    for p in dense {
        let x = random_inputs(&p, fresh_seed()).unwrap();
        for &b in &backends {
            ran.push((b, p));
            failures.extend(common::check_reference(&dev, &p, b, &x, "prefill"));
        }
    }
    let base = Problem::new(1, 8, 40, 1, 128)
        .with_kv_heads(2)
        .with_causal(true);
    let (p, meta) = paged(base, &[300, 128, 41, 1000], 128, fresh_seed());
    let p = kv(p, DType::Bf16, Scaling::PerHead);
    let x = random_inputs(&p, fresh_seed()).unwrap().with_meta(meta);
    for &b in &backends {
        ran.push((b, p));
        failures.extend(common::check_reference(&dev, &p, b, &x, "paged prefill"));
    }
    // Varlen: packed Q and K/V, sequences of their own lengths, causal.
    let base = Problem::new(1, 8, 1, 1, 64)
        .with_kv_heads(4)
        .with_causal(true);
    let (p, meta) = varlen(base, &[100, 1, 257, 30], &[100, 64, 300, 30]);
    let p = kv(p, DType::F16, Scaling::PerHead);
    let x = random_inputs(&p, fresh_seed()).unwrap().with_meta(meta);
    for &b in &backends {
        ran.push((b, p));
        failures.extend(common::check_reference(&dev, &p, b, &x, "varlen prefill"));
    }
    common::assert_ran("fp8 kv prefill", &ran);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Sets every K and V code of a paged NHD cache that no sequence's first `seqused_k` keys hold
/// (the rest of each sequence's pages, and the pages no sequence uses) to NaN.
fn nan_past_seqused(p: &Problem, x: &mut Inputs) -> usize {
    let dead = common::rows_past_seqused(p, x.seq_meta.as_ref().unwrap());
    let row = p.kv_heads * p.head_dim;
    for &r in &dead {
        for e in r * row..(r + 1) * row {
            x.set_value(1, e, f64::NAN, DType::E4m3);
            x.set_value(2, e, f64::NAN, DType::E4m3);
        }
    }
    dead.len()
}

/// The hostile cache: every row past each sequence's seqused_k (the rest of its last page, its
/// unused pages, the pages no sequence holds) is NaN in K and V; the output holds no NaN and
/// matches the reference, which reads none of them. Dense K/V with seqused_k likewise.
#[test]
fn nan_pages_past_seqused_k_do_not_leak() {
    let Some(dev) = common::device("fp8 kv NaN pages") else {
        return;
    };
    let backends = fp8kv_backends(&dev);
    let (mut ran, mut failures) = (Vec::new(), Vec::new());
    for (n, &(seq_q, page_size)) in [(1, 16), (4, 64), (1, 256)].iter().enumerate() {
        let base = Problem::new(1, 8, seq_q, 1, 128)
            .with_kv_heads(2)
            .with_causal(seq_q > 1)
            .with_dtype(DType::Bf16)
            .with_kv_dtype(DType::E4m3)
            .with_fp8_scaling([Scaling::PerHead, Scaling::PerTensor][n % 2]);
        let (p, meta) = paged(base, &[300, 17, 0, 257, 1000], page_size, fresh_seed());
        let mut x = random_inputs(&p, fresh_seed()).unwrap().with_meta(meta);
        let poisoned = nan_past_seqused(&p, &mut x);
        assert!(poisoned > 0, "{p}: no row past seqused_k");
        let want = x.reference(&p).unwrap();
        assert!(want.out.iter().all(|v| v.is_finite()), "{p}: reference");
        for &b in &backends {
            ran.push((b, p));
            let got =
                sdpa_harness::check::run_backend(Some(&dev), &p, b, &x, Some(&want.out)).unwrap();
            let nans = got.iter().filter(|v| v.is_nan()).count();
            let r = check_output(&got, &want.out, &p, &x, 0).unwrap();
            eprintln!(
                "{b} {p}: {poisoned} NaN rows past seqused_k; {nans} NaN outputs, rel_err {:.2e}",
                r.rel_err
            );
            if nans > 0 || !r.pass() {
                failures.push(format!("{b} {p}: {nans} NaN outputs, {r:?}"));
            }
        }
    }
    // Dense: keys past each sequence's seqused_k are NaN.
    let p = Problem::new(3, 8, 1, 700, 64)
        .with_kv_heads(2)
        .with_seqused_k(true)
        .with_dtype(DType::F16)
        .with_kv_dtype(DType::E4m3);
    let mut x = random_inputs(&p, fresh_seed()).unwrap();
    let used = x.seq_meta.as_ref().unwrap().seqused_k.clone().unwrap();
    for (b, &u) in used.iter().enumerate() {
        for h in 0..p.kv_heads {
            for j in u as usize..p.seq_k {
                let at = ((b * p.kv_heads + h) * p.seq_k + j) * p.head_dim;
                for e in at..at + p.head_dim {
                    x.set_value(1, e, f64::NAN, DType::E4m3);
                    x.set_value(2, e, f64::NAN, DType::E4m3);
                }
            }
        }
    }
    let want = x.reference(&p).unwrap();
    for &b in &backends {
        ran.push((b, p));
        let got = sdpa_harness::check::run_backend(Some(&dev), &p, b, &x, Some(&want.out)).unwrap();
        let r = check_output(&got, &want.out, &p, &x, 0).unwrap();
        if got.iter().any(|v| v.is_nan()) || !r.pass() {
            failures.push(format!("{b} {p}: {r:?}"));
        }
    }
    // NaN codes the rows do see propagate as the reference's: a NaN key makes its head's rows
    // NaN, a NaN value the columns it sits in (bf16 Q takes the exact widening for such chunks).
    let p = Problem::new(2, 8, 1, 640, 128)
        .with_kv_heads(2)
        .with_dtype(DType::Bf16)
        .with_kv_dtype(DType::E4m3);
    let mut x = random_inputs(&p, fresh_seed()).unwrap();
    let d = p.head_dim;
    x.set_value(1, (p.seq_k + 300) * d + 5, f64::NAN, DType::E4m3); // batch 0, head 1, key 300
    x.set_value(2, (3 * p.seq_k + 17) * d + 77, f64::NAN, DType::E4m3); // batch 1, head 1, key 17
    let want = x.reference(&p).unwrap();
    let nan_rows = want.out.iter().filter(|v| v.is_nan()).count();
    assert!(nan_rows > 0 && nan_rows < want.out.len() / 2, "{nan_rows}");
    for &b in &backends {
        ran.push((b, p));
        let got = sdpa_harness::check::run_backend(Some(&dev), &p, b, &x, Some(&want.out)).unwrap();
        let r = check_output(&got, &want.out, &p, &x, 0).unwrap();
        eprintln!(
            "{b} {p}: visible NaN codes, {nan_rows} NaN outputs expected, rel_err {:.2e}",
            r.rel_err
        );
        if !r.pass() {
            failures.push(format!("{b} {p} (visible NaN): {r:?}"));
        }
    }
    common::assert_ran("fp8 kv NaN pages", &ran);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The same decode step on views of the caller's memory ([`Fp8KvViews`]): a paged cache with
/// scales per K/V head, bf16 Q and output. The output of views equals the owned tensors' bit for
/// bit, and matches the reference.
#[test]
fn fp8_kv_views_match_the_tensors() {
    let Some(dev) = common::device("fp8 kv views") else {
        return;
    };
    let (p, meta) = paged(
        Problem::new(1, 16, 1, 1, 128).with_kv_heads(4),
        &[900, 33, 512],
        64,
        fresh_seed(),
    );
    let p = p
        .with_dtype(DType::Bf16)
        .with_kv_dtype(DType::E4m3)
        .with_fp8_scaling(Scaling::PerHead);
    let x = random_inputs(&p, fresh_seed())
        .unwrap()
        .with_meta(meta.clone());
    let want = x.reference(&p).unwrap();
    let f = x.fp8.as_ref().unwrap();
    let s = dev.stream();
    let codes = |t: usize| -> CudaSlice<u8> {
        s.clone_htod(&x.bits[t].iter().map(|&c| c as u8).collect::<Vec<_>>())
            .unwrap()
    };
    let (kc, vc) = (codes(1), codes(2));
    let (ks, vs) = (
        s.clone_htod(&f.scales[1]).unwrap(),
        s.clone_htod(&f.scales[2]).unwrap(),
    );
    let q: CudaSlice<bf16> = s
        .clone_htod(
            &x.bits[0]
                .iter()
                .map(|&b| bf16::from_bits(b))
                .collect::<Vec<_>>(),
        )
        .unwrap();
    let mut ran = Vec::new();
    for b in fp8kv_backends(&dev) {
        let mut out: CudaSlice<bf16> = s.clone_htod(&vec![bf16::NAN; p.q_len().unwrap()]).unwrap();
        let mut bufs = ExtraBuffers::new(&dev, &p, None, None)
            .unwrap()
            .with_meta(&dev, &meta)
            .unwrap();
        let views = Fp8KvViews {
            q: View::new(q.as_view(), p.q_strides()),
            k: Fp8View::new(kc.as_view(), ks.as_view(), p.k_strides()),
            v: Fp8View::new(vc.as_view(), vs.as_view(), p.v_strides()),
            out: ViewMut::new(out.as_view_mut(), p.out_strides()),
        };
        sdpa::forward(&dev, &p, b, views, bufs.extras()).unwrap();
        let got: Vec<f64> = s
            .clone_dtoh(&out)
            .unwrap()
            .iter()
            .map(|v| f64::from(v.to_f32()))
            .collect();
        let owned =
            sdpa_harness::check::run_backend(Some(&dev), &p, b, &x, Some(&want.out)).unwrap();
        assert!(
            got.iter()
                .zip(&owned)
                .all(|(a, o)| a.to_bits() == o.to_bits()),
            "{b} {p}: views and tensors differ"
        );
        let r = check_output(&got, &want.out, &p, &x, 0).unwrap();
        eprintln!("{b} {p} (views): rel_err {:.2e}", r.rel_err);
        assert!(r.pass(), "{b} {p}: {r:?}");
        // Too few scales, or a problem without the e4m3 cache: typed errors.
        let short = s.clone_htod(&[1f32]).unwrap();
        let views = Fp8KvViews {
            q: View::new(q.as_view(), p.q_strides()),
            k: Fp8View::new(kc.as_view(), short.as_view(), p.k_strides()),
            v: Fp8View::new(vc.as_view(), vs.as_view(), p.v_strides()),
            out: ViewMut::new(out.as_view_mut(), p.out_strides()),
        };
        let e = sdpa::forward(&dev, &p, b, views, bufs.extras()).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("k's scales"),
            "{e}"
        );
        ran.push(b);
    }
    common::assert_ran("fp8 kv views", &ran);
}

/// `write_kv_fp8` stores E4M3(x / scale) of each new 16-bit value, bit for bit as the host codec
/// rounds it (saturation and NaN included), at the rows its slots name and nowhere else; per
/// tensor and per K/V head, NHD and HND pages.
#[test]
fn write_kv_fp8_quantizes_like_the_host_codec() {
    let Some(dev) = common::device("write_kv_fp8") else {
        return;
    };
    let s = dev.stream();
    let (pages, page_size, heads, d) = (6, 16, 4, 64);
    let len = pages * page_size * heads * d;
    for (layout, scaling) in [
        (PageLayout::Nhd, Scaling::PerHead),
        (PageLayout::Hnd, Scaling::PerTensor),
    ] {
        let rows = 5;
        // Values spread over [-6, 6), a few NaN and beyond e4m3's range.
        let mut new: Vec<f32> = (0..rows * heads * d)
            .map(|i| (i * 7919 % 1201) as f32 / 100.0 - 6.0)
            .collect();
        new[3] = f32::NAN;
        new[10] = 1e4; // saturates at 448 · scale
        new[11] = -1e4;
        let new_bits: Vec<bf16> = new.iter().map(|&v| bf16::from_f32(v)).collect();
        let scales: Vec<f32> = match scaling {
            Scaling::PerTensor => vec![0.0173],
            Scaling::PerHead => (0..heads).map(|h| 0.01 + 0.003 * h as f32).collect(),
        };
        let v_scales: Vec<f32> = scales.iter().map(|s| 2.0 * s).collect();
        let (mut kc, mut vc) = (
            s.clone_htod(&vec![0u8; len]).unwrap(),
            s.clone_htod(&vec![0u8; len]).unwrap(),
        );
        let kn = s.clone_htod(&new_bits).unwrap();
        let (ks, vs) = (
            s.clone_htod(&scales).unwrap(),
            s.clone_htod(&v_scales).unwrap(),
        );
        let slots: Vec<i64> = vec![0, 17, 95, -1, 40];
        let slot_buf = s.clone_htod(&slots).unwrap();
        sdpa::write_kv_fp8(
            &dev,
            PagedCache {
                k: kc.as_view_mut(),
                v: vc.as_view_mut(),
                pages,
                page_size,
                kv_heads: heads,
                head_dim: d,
                layout,
            },
            KvScales {
                k: ks.as_view(),
                v: vs.as_view(),
                scaling,
            },
            NewRows {
                k: kn.as_view(),
                v: kn.as_view(),
                rows,
                row_stride: heads * d,
                head_stride: d,
            },
            Placement::Slots(slot_buf.as_view()),
        )
        .unwrap();
        let (kg, vg) = (s.clone_dtoh(&kc).unwrap(), s.clone_dtoh(&vc).unwrap());
        let [ps, rs, hs] = layout.strides(page_size, heads, d);
        let (mut want_k, mut want_v) = (vec![0u8; len], vec![0u8; len]);
        for (r, &slot) in slots.iter().enumerate() {
            if slot < 0 {
                continue;
            }
            let (page, off) = (slot as usize / page_size, slot as usize % page_size);
            for h in 0..heads {
                let g = if scaling == Scaling::PerHead { h } else { 0 };
                for e in 0..d {
                    let x = new_bits[(r * heads + h) * d + e].to_f32();
                    let at = page * ps + off * rs + h * hs + e;
                    want_k[at] = fp8::e4m3_from_f32(x / scales[g]);
                    want_v[at] = fp8::e4m3_from_f32(x / v_scales[g]);
                }
            }
        }
        let diff = |got: &[u8], want: &[u8]| got.iter().zip(want).filter(|(a, b)| a != b).count();
        assert_eq!(
            diff(&kg, &want_k),
            0,
            "{layout:?} {scaling:?}: K codes differ"
        );
        assert_eq!(
            diff(&vg, &want_v),
            0,
            "{layout:?} {scaling:?}: V codes differ"
        );
        assert!(kg.contains(&0x7f) && kg.contains(&0x7e) && kg.contains(&0xfe));
        // Head_dim not a multiple of 16: refused before anything is written.
        let e = sdpa::write_kv_fp8(
            &dev,
            PagedCache {
                k: kc.as_view_mut(),
                v: vc.as_view_mut(),
                pages,
                page_size,
                kv_heads: heads * 8,
                head_dim: 8,
                layout,
            },
            KvScales {
                k: ks.as_view(),
                v: vs.as_view(),
                scaling: Scaling::PerTensor,
            },
            NewRows {
                k: kn.as_view(),
                v: kn.as_view(),
                rows: 1,
                row_stride: 8,
                head_stride: 8,
            },
            Placement::Slots(slot_buf.as_view()),
        )
        .unwrap_err();
        assert!(e.to_string().contains("multiple of 16"), "{e}");
    }
}

/// A decode loop's two halves over an e4m3 cache: `append_kv` quantizes each sequence's 16-bit
/// keys and values into the cache (e4m3 tensors carrying the cache's scales per K/V head), then
/// decode reads it; the codes equal the host codec's and the output the reference's on them.
#[test]
fn append_kv_then_decode_over_an_e4m3_cache() {
    let Some(dev) = common::device("append_kv fp8") else {
        return;
    };
    let (batch, heads, kv_heads, d, page_size, n_new): (usize, usize, usize, usize, usize, usize) =
        (3, 8, 2, 128, 64, 300);
    let pages_per_seq = n_new.div_ceil(page_size);
    let p = Problem::new(batch, heads, 1, n_new, d)
        .with_kv_heads(kv_heads)
        .with_dtype(DType::Bf16)
        .with_kv_dtype(DType::E4m3)
        .with_layout(sdpa::Layout::Bshd)
        .with_paged_kv(batch * pages_per_seq + 1, page_size, pages_per_seq);
    let shape = p.k_shape();
    let scales: Vec<f32> = (0..kv_heads).map(|h| 0.011 * (h + 1) as f32).collect();
    let zeros = vec![0u8; p.k_len().unwrap()];
    let mk = || Tensor::from_e4m3(&dev, &zeros, &scales, shape, Scaling::PerHead).unwrap();
    let (mut k_cache, mut v_cache) = (mk(), mk());
    // Pages in reverse order, the spare page (0) never named.
    let table: Vec<i32> = (1..=(batch * pages_per_seq) as i32).rev().collect();
    let table_buf = dev.stream().clone_htod(&table).unwrap();
    let mut used = dev.stream().clone_htod(&vec![0i32; batch]).unwrap();
    let x16 = random_inputs(
        &Problem::new(batch, kv_heads, n_new, n_new, d)
            .with_dtype(DType::Bf16)
            .with_layout(sdpa::Layout::Bshd),
        fresh_seed(),
    )
    .unwrap();
    let [_, k_new, v_new] = x16.upload(&dev, DType::Bf16).unwrap();
    sdpa::append_kv(
        &dev,
        &p,
        sdpa::KvAppend {
            k_new: &k_new,
            v_new: &v_new,
            n_new,
            k_cache: &mut k_cache,
            v_cache: &mut v_cache,
            block_table: table_buf.as_view(),
            seqused_k: used.as_view_mut(),
        },
    )
    .unwrap();
    assert_eq!(
        dev.stream().clone_dtoh(&used).unwrap(),
        vec![n_new as i32; batch]
    );
    // The codes the host codec gives, where the table places each key.
    let mut want = [zeros.clone(), zeros.clone()];
    for (t, w) in want.iter_mut().enumerate() {
        for b in 0..batch {
            for j in 0..n_new {
                let page = table[b * pages_per_seq + j / page_size] as usize;
                for h in 0..kv_heads {
                    for e in 0..d {
                        let x = x16.values[t + 1][((b * n_new + j) * kv_heads + h) * d + e];
                        w[((page * page_size + j % page_size) * kv_heads + h) * d + e] =
                            fp8::e4m3_from_f32(x as f32 / scales[h]);
                    }
                }
            }
        }
    }
    for (t, cache) in [&k_cache, &v_cache].into_iter().enumerate() {
        let got: Vec<u8> = cache
            .to_bits(&dev)
            .unwrap()
            .into_iter()
            .map(|c| c as u8)
            .collect();
        assert!(
            got == want[t],
            "cache {t}: codes differ from the host codec's"
        );
    }
    // Decode over the cache, Q fresh.
    let q = random_inputs(&p.as_dequantized(), fresh_seed()).unwrap();
    let dq = |c: &[u8]| -> Vec<f64> {
        fp8::dequantize_host(c, &scales, &shape, Scaling::PerHead)
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect()
    };
    let meta = sdpa::SeqMeta {
        seqused_k: Some(vec![n_new as i32; batch]),
        block_table: Some(table.clone()),
        ..Default::default()
    };
    let want_out = sdpa::reference_seqs(
        &p,
        &q.values[0],
        &dq(&want[0]),
        &dq(&want[1]),
        None,
        None,
        &meta,
    )
    .unwrap();
    let qt = Tensor::from_bits(&dev, DType::Bf16, &q.bits[0]).unwrap();
    let mut ran = Vec::new();
    for b in fp8kv_backends(&dev) {
        let mut out = Tensor::poisoned(&dev, DType::Bf16, p.q_len().unwrap()).unwrap();
        let mut bufs = ExtraBuffers::new(&dev, &p, None, None)
            .unwrap()
            .with_meta(&dev, &meta)
            .unwrap();
        let t = sdpa::Tensors {
            q: &qt,
            k: &k_cache,
            v: &v_cache,
            out: &mut out,
        };
        sdpa::forward(&dev, &p, b, t, bufs.extras()).unwrap();
        let got = out.to_f64(&dev).unwrap();
        let r =
            sdpa_harness::check::compare_with(&got, &want_out.out, fp8_kv_tolerance(p.dtype), 0);
        eprintln!(
            "{b} {p} (append_kv, then decode): rel_err {:.2e}",
            r.rel_err
        );
        assert!(r.pass(), "{b} {p}: {r:?}");
        ran.push(b);
    }
    common::assert_ran("append_kv fp8", &ran);
}

/// Without a GPU: what an e4m3 K/V cache problem may be (typed `InvalidArgument` otherwise), and
/// which backends refuse it, each by name (`Unsupported`): scalar, wmma and cublas read no such
/// cache; cutlass-sm80 and cutlass take decode steps (their decode kernels read the codes) and
/// the rest (prefill, windows, head_dim 256: on 16-bit copies); cpu runs any.
#[test]
fn fp8_kv_problems_and_refusals_are_typed() {
    let decode = Problem::new(4, 32, 1, 4096, 128)
        .with_kv_heads(8)
        .with_dtype(DType::Bf16)
        .with_kv_dtype(DType::E4m3);
    decode.validate().unwrap();
    let invalid = |p: Problem, fragment: &str| {
        let e = p.validate().unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{p}: {e:?}");
        assert!(e.to_string().contains(fragment), "{p}: {e}");
    };
    invalid(
        decode.with_kv_dtype(DType::F16),
        "K/V of f16 under Q of bf16",
    );
    invalid(decode.with_kv_dtype(DType::F32), "K/V of f32");
    invalid(
        decode.with_out_dtype(DType::F32),
        "the output of an e4m3 K/V cache problem is Q's dtype (bf16), got f32",
    );
    invalid(
        decode.with_fp8_mode(sdpa::Fp8Mode::Fast),
        "fp8 mode fast needs e4m3 inputs",
    );
    // e4m3 Q with an e4m3 cache is the e4m3 problem itself.
    assert!(!decode.with_dtype(DType::E4m3).is_fp8_kv());
    assert!(decode.is_fp8_kv() && !decode.is_plain());
    assert_eq!(
        Backend::Cpu
            .supports(None, &decode)
            .map_err(|e| e.to_string()),
        Ok(())
    );
    let refused = |b: Backend, p: &Problem, fragment: &str| match b.supports(None, p) {
        Err(Error::Unsupported { backend, reason }) => {
            assert_eq!(backend, b.name());
            assert!(reason.contains(fragment), "{b} {p}: {reason}");
        }
        other => panic!("{b} {p}: {other:?}"),
    };
    let in_build = |b: Backend| sdpa_sys::INSTANCES.iter().any(|i| i.backend == b.name());
    refused(Backend::Cublas, &decode, "reads no e4m3 K/V cache");
    for b in [Backend::Scalar, Backend::Wmma] {
        if in_build(b) {
            refused(b, &decode, "reads no e4m3 K/V cache");
        }
    }
    if !sdpa_sys::ffi::built_with_cutlass() {
        return;
    }
    let prefill = Problem {
        seq_q: 64,
        ..decode
    };
    let window = decode.with_mask(Mask::Window {
        left: Some(128),
        right: Some(0),
    });
    let d256 = Problem::new(1, 8, 1, 4096, 256)
        .with_dtype(DType::F16)
        .with_kv_dtype(DType::E4m3);
    for b in [Backend::CutlassSm80, Backend::Cutlass] {
        if !in_build(b) {
            continue;
        }
        // Without a device, a problem the kernel takes is refused only for want of a GPU.
        for p in [&decode, &prefill, &window, &d256] {
            refused(b, p, "needs a GPU");
        }
    }
}
