//! Property tests over Problem construction, argument checking and the host FP8 functions:
//! whatever the fields or lengths, nothing panics, a problem that validates is internally
//! consistent (its strides address exactly its tensors, its scale count matches its scaling),
//! and a length that does not match its shape is an error. One more property runs `supports`
//! and `resolve` against a real GPU where there is one. Bounded (a few thousand cases on the
//! host, a few hundred on the GPU) so it runs in CI.

mod common;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use sdpa::fp8::{absmax_host, dequantize_host, quantize_host, scale_count};
use sdpa::{Backend, DType, Layout, Problem, Scaling, TensorShape};

fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(0usize),
        1usize..300,
        Just(1 << 20),
        Just(1 << 31),
        Just(usize::MAX / 3),
        Just(usize::MAX),
        any::<usize>(),
    ]
}

fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![
        Just(DType::F16),
        Just(DType::Bf16),
        Just(DType::E4m3),
        Just(DType::F32)
    ]
}

fn scaling() -> impl Strategy<Value = Scaling> {
    prop_oneof![Just(Scaling::PerTensor), Just(Scaling::PerHead)]
}

fn layout() -> impl Strategy<Value = Layout> {
    prop_oneof![Just(Layout::Bhsd), Just(Layout::Bshd)]
}

/// Invariants of a problem that validates; `Err` names the one that broke.
fn check_valid(p: &Problem) -> Result<(), TestCaseError> {
    let (b, h, kvh, sq, sk, d) = (p.batch, p.heads, p.kv_heads, p.seq_q, p.seq_k, p.head_dim);
    let (ql, kl) = (p.q_len().unwrap(), p.k_len().unwrap());
    let (qs, ks) = (p.q_strides(), p.k_strides());
    prop_assert_eq!(qs.offset(b - 1, h - 1, sq - 1, d - 1), ql - 1);
    prop_assert_eq!(ks.offset(b - 1, kvh - 1, sk - 1, d - 1), kl - 1);
    prop_assert_eq!(p.q_shape().len(), Some(ql));
    prop_assert_eq!(p.k_shape().len(), Some(kl));
    prop_assert!(p.scale().is_finite() && p.scale() > 0.0);
    prop_assert!(p.flops() >= 0.0);
    prop_assert!(p.visible_keys(sq - 1) <= sk);
    prop_assert!(p.dtype.is_input() && p.output_dtype().is_output());
    // Another output dtype: f16 or bf16 of e4m3 inputs, f32 of f16/bf16 ones.
    let pair_ok = match (p.dtype, p.output_dtype()) {
        (DType::E4m3, o) => matches!(o, DType::F16 | DType::Bf16),
        (i, o) => o == i || o == DType::F32,
    };
    prop_assert!(pair_ok, "{} -> {}", p.dtype, p.output_dtype());
    // One scale per tensor, or one per (batch, head) pair: Q's and K/V's counts.
    for (shape, heads) in [(p.q_shape(), h), (p.k_shape(), kvh)] {
        let n = scale_count(&shape, p.fp8_scaling);
        let want = match p.fp8_scaling {
            Scaling::PerTensor => 1,
            Scaling::PerHead => b * heads,
        };
        prop_assert_eq!(n, want, "{} scaling of {}", p.fp8_scaling.name(), shape);
        prop_assert_eq!(shape.heads_total(), Some(b * heads));
    }
    Ok(())
}

/// Deterministic test values from a seed (splitmix64): mostly moderate magnitudes, with zeros,
/// subnormals, huge values and NaN mixed in, and infinities only when `inf` is set.
fn values(n: usize, seed: u64, inf: bool) -> Vec<f32> {
    let mut s = seed;
    let mut next = move || {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    (0..n)
        .map(|_| {
            let r = next();
            let unit = (r >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            match r % 64 {
                0 => 0.0,
                1 => f32::NAN,
                2 => 1e-40, // subnormal
                3 => -3e38,
                4 if inf => f32::INFINITY,
                5..=9 => unit * 1e-3,
                10..=14 => unit * 1e4,
                _ => unit * 4.0,
            }
        })
        .collect()
}

/// A problem with fields from the realistic region (so `supports` often says yes) and, less
/// often, zeros and huge values (so it must say no without panicking).
fn gpu_problem() -> impl Strategy<Value = Problem> {
    let size = || {
        prop_oneof![
            8 => 1usize..600,
            1 => Just(0usize),
            1 => Just(1 << 31),
            1 => Just(usize::MAX),
            1 => any::<usize>(),
        ]
    };
    // Few heads, so that the kv_heads choices below mostly divide them; now and then past
    // the fused kernels' grid limit, or zero.
    let heads = prop_oneof![
        8 => 1usize..9,
        1 => Just(0usize),
        1 => Just(70_000usize),
    ];
    let head_dim = prop_oneof![
        4 => Just(64usize),
        4 => Just(128usize),
        2 => 1usize..300,
        1 => Just(0usize),
        1 => any::<usize>(),
    ];
    (
        (size(), heads, size(), size(), head_dim),
        (0usize..4, any::<bool>(), dtype(), prop::option::of(dtype())),
        (scaling(), layout(), prop::option::of(any::<f32>())),
    )
        .prop_map(
            |((b, h, sq, sk, d), (kv_pick, causal, dt, out), (sc, lay, scale))| {
                // kv_heads: heads itself, a divisor of it, or something that need not divide.
                let kvh = match kv_pick {
                    0 => h,
                    1 => 1,
                    2 if h % 2 == 0 => h / 2,
                    _ => kv_pick + 1,
                };
                let mut p = Problem::new(b, h, sq, sk, d)
                    .with_kv_heads(kvh)
                    .with_causal(causal)
                    .with_dtype(dt)
                    .with_fp8_scaling(sc)
                    .with_layout(lay);
                p.out_dtype = out;
                p.scale = scale;
                p
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn checking_never_panics(
        b in dim(), h in dim(), kvh in dim(), sq in dim(), sk in dim(), d in dim(),
        causal in any::<bool>(), scale in prop::option::of(any::<f32>()),
        dt in dtype(), out in prop::option::of(dtype()), sc in scaling(),
        bshd in any::<bool>(),
    ) {
        // Every dtype, output dtype and scaling, the invalid ones (f32 in, e4m3 out, e4m3 in and
        // f32 out, f16 in and bf16 out) included.
        let mut p = Problem::new(b, h, sq, sk, d)
            .with_kv_heads(kvh)
            .with_causal(causal)
            .with_dtype(dt)
            .with_fp8_scaling(sc)
            .with_layout(if bshd { Layout::Bshd } else { Layout::Bhsd });
        p.out_dtype = out;
        p.scale = scale;
        let valid = p.validate();
        let other_out = |o: DType| match dt {
            DType::E4m3 => !matches!(o, DType::F16 | DType::Bf16),
            _ => o != dt && o != DType::F32,
        };
        if dt == DType::F32 || out.is_some_and(other_out) {
            prop_assert!(valid.is_err(), "{p} validated");
        }
        for backend in Backend::ALL {
            let s = backend.supports(None, &p);
            let _ = backend.resolve(None, &p);
            prop_assert!(valid.is_ok() || s.is_err(), "{backend} supports invalid {p}");
        }
        let _ = p.to_string();
        let _ = p.as_dequantized().validate();
        for shape in [p.q_shape(), p.k_shape()] {
            // Huge shapes allocate nothing here: counts and indices only.
            let _ = scale_count(&shape, sc);
            prop_assert_eq!(shape.heads_total(), shape.batch.checked_mul(shape.heads));
            for i in [0, 1, d, usize::MAX] {
                let inside = shape.len().is_some_and(|n| i < n);
                prop_assert_eq!(shape.head_of(i).is_some(), inside, "{} element {}", shape, i);
            }
        }
        if valid.is_ok() {
            check_valid(&p)?;
        }
    }

    /// Packed and paged sequence layouts of any sizes, with metadata of any values and lengths
    /// (the buffers' lengths kept small): `check_metadata`, `lse_len`, `block_table_len` and
    /// the checks never panic, and metadata that `check_metadata` accepts describes spans
    /// inside the problem.
    #[test]
    fn sequence_metadata_checks_never_panic(
        b in dim(), sq in dim(), sk in dim(), d in prop_oneof![Just(64usize), dim()],
        packed_q in prop::option::of(dim()), packed_k in prop::option::of(dim()),
        paged in prop::option::of((dim(), dim(), dim())), used in any::<bool>(),
        cu_q in prop::collection::vec(any::<i32>(), 0..6),
        cu_k in prop::collection::vec(any::<i32>(), 0..6),
        seqused in prop::collection::vec(prop_oneof![any::<i32>(), 0i32..40], 0..6),
        table in prop::collection::vec(prop_oneof![any::<i32>(), 0i32..4], 0..12),
    ) {
        let mut p = Problem::new(b, 2, sq, sk, d);
        p.seqs.packed_q = packed_q;
        p.seqs.seqused_k = used;
        if let Some(t) = packed_k {
            p.seqs.kv = sdpa::KvRows::Packed { total: t };
        }
        if let Some((pages, page_size, pages_per_seq)) = paged {
            p.seqs.kv = sdpa::KvRows::Paged { pages, page_size, pages_per_seq };
            p.seqs.seqused_k = true;
        }
        let _ = (p.lse_len(), p.block_table_len(), p.q_len(), p.k_len(), p.to_string());
        for backend in Backend::ALL {
            let _ = backend.supports(None, &p);
        }
        let m = sdpa::SeqMeta {
            cu_seqlens_q: packed_q.map(|_| cu_q),
            cu_seqlens_k: packed_k.map(|_| cu_k),
            seqused_k: p.seqs.seqused_k.then_some(seqused),
            block_table: paged.map(|_| table),
        };
        if let Ok(spans) = sdpa::check_metadata(&p, &m) {
            prop_assert!(p.validate().is_ok());
            prop_assert_eq!(spans.len(), p.batch);
            for s in spans {
                prop_assert!(s.seq_q <= p.seq_q && s.seq_k <= p.seq_k, "{:?} of {}", s, p);
                if let Some(total) = p.seqs.packed_q {
                    prop_assert!(s.q_start + s.seq_q <= total);
                }
            }
        }
    }

    /// The host FP8 functions on small shapes (every dimension at most 6, so nothing large is
    /// allocated) with right and wrong lengths: none panics, a wrong length is an error, and
    /// what succeeds is consistent with the shape.
    #[test]
    fn fp8_host_functions_never_panic(
        dims in (0usize..=6, 0usize..=6, 0usize..=6, 0usize..=6),
        lay in layout(), sc in scaling(),
        n in prop::option::of(0usize..80), n_scales in prop::option::of(0usize..40),
        seed in any::<u64>(), inf in any::<bool>(),
        probe in prop::collection::vec(any::<usize>(), 4),
    ) {
        let (batch, heads, seq, head_dim) = dims;
        let shape = TensorShape { batch, heads, seq, head_dim, layout: lay };
        let len = shape.len().unwrap();
        // The shape's own length, or another that may happen to match.
        let n = n.unwrap_or(len);
        let x = values(n, seed, inf);
        let fits = n == len && len > 0;
        let groups = scale_count(&shape, sc);
        prop_assert!(groups == 1 || groups == batch * heads);

        let amax = absmax_host(&x, &shape, sc);
        prop_assert_eq!(amax.is_ok(), fits, "absmax_host of {} values for {}", n, shape);
        if let Ok(a) = &amax {
            prop_assert_eq!(a.len(), groups);
            prop_assert!(a.iter().all(|m| *m >= 0.0));
            if sc == Scaling::PerTensor {
                let max = x.iter().filter(|v| !v.is_nan()).fold(0f32, |m, v| m.max(v.abs()));
                prop_assert_eq!(a[0], max);
            }
        }

        let q = quantize_host(&x, &shape, sc);
        let finite = x.iter().all(|v| !v.is_infinite());
        prop_assert_eq!(q.is_ok(), fits && finite, "quantize_host of {} values for {}", n, shape);
        if let Ok((codes, scales)) = &q {
            prop_assert_eq!(codes.len(), len);
            prop_assert_eq!(scales.len(), groups);
            prop_assert!(scales.iter().all(|s| s.is_finite() && *s > 0.0), "{:?}", scales);
            // Round trip: within half an e4m3 step (relative 2^-4, or 2^-10 of the scale
            // among the subnormals); NaN stays NaN.
            let back = dequantize_host(codes, scales, &shape, sc).unwrap();
            for (i, (&v, &w)) in x.iter().zip(&back).enumerate() {
                let s = match sc {
                    Scaling::PerTensor => scales[0],
                    Scaling::PerHead => scales[shape.head_of(i).unwrap()],
                };
                if v.is_nan() {
                    prop_assert!(w.is_nan(), "element {}: NaN became {}", i, w);
                } else {
                    let tol = v.abs() / 16.0 + s / 1024.0;
                    prop_assert!((v - w).abs() <= tol, "element {}: {} became {}", i, v, w);
                }
            }
        }

        // Codes and scales of right and wrong lengths.
        let codes: Vec<u8> = x.iter().map(|&v| sdpa::fp8::e4m3_from_f32(v)).collect();
        let ns = n_scales.unwrap_or(groups);
        let scales = vec![0.5f32; ns];
        let d = dequantize_host(&codes, &scales, &shape, sc);
        prop_assert_eq!(d.is_ok(), fits && ns == groups, "dequantize_host: {} codes, {} scales, {}", n, ns, shape);
        if let Ok(d) = d {
            prop_assert_eq!(d.len(), len);
        }

        // head_of is Some exactly inside the shape, and names a (batch, head) pair that exists.
        let total = shape.heads_total();
        prop_assert_eq!(total, Some(batch * heads));
        for i in probe.into_iter().chain([0, len.saturating_sub(1), len, len + 1]) {
            let i = if i % 2 == 0 { i % (len + 2) } else { i };
            let h = shape.head_of(i);
            prop_assert_eq!(h.is_some(), i < len, "{} element {}", shape, i);
            if let Some(h) = h {
                prop_assert!(h < batch * heads, "{} element {}: head {}", shape, i, h);
            }
        }
    }

    #[test]
    fn names_never_panic(s in ".{0,12}") {
        let _ = s.parse::<Backend>();
        let _ = s.parse::<DType>();
        let _ = s.parse::<Layout>();
        let _ = s.parse::<Scaling>();
        let _ = sdpa_harness::named_problem(&s);
    }
}

/// `supports` and `resolve` with a real device: the device-dependent checks (compute
/// capability, the cuBLAS library, free memory for its workspace) never panic, whatever the
/// problem, and agree with each other. Fewer cases than the host properties: each asks the
/// driver. The device is opened once, outside the cases.
#[test]
fn device_support_never_panics() {
    let test = "supports(Some(dev)) fuzz";
    let Some(dev) = common::device(test) else {
        return;
    };
    let mut runner = TestRunner::new(Config {
        cases: 300,
        failure_persistence: None,
        ..Config::default()
    });
    let supported = std::sync::Mutex::new(Vec::new());
    let result = runner.run(&gpu_problem(), |p| {
        let valid = p.validate();
        for backend in Backend::ALL {
            let s = backend.supports(Some(&dev), &p);
            let r = backend.resolve(Some(&dev), &p);
            prop_assert!(
                valid.is_ok() || s.is_err(),
                "{backend} supports invalid {p}"
            );
            if backend == Backend::Auto {
                // Auto runs what it resolves to, and resolves exactly when it supports.
                prop_assert_eq!(s.is_ok(), r.is_ok(), "auto on {}: {:?} vs {:?}", p, s, r);
                if let Ok(to) = r {
                    prop_assert!(Backend::GPU.contains(&to), "auto resolved {p} to {to}");
                    prop_assert!(
                        to.supports(Some(&dev), &p).is_ok(),
                        "auto chose {to} for {p}"
                    );
                }
            } else {
                prop_assert_eq!(r.ok(), Some(backend));
            }
            if s.is_ok() && backend != Backend::Cpu {
                supported.lock().unwrap().push((backend, p));
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{test}: {e}");
    }
    // The problems were not all refused: the device-dependent branches of supports ran.
    common::assert_ran(test, &supported.into_inner().unwrap());
}
