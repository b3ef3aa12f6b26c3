//! The backward on the GPU against the float64 reference gradient (`sdpa::reference_backward`),
//! on each backend with a backward where it runs the case: every variant the forward has (masks,
//! softcap, ALiBi, sinks, GQA, head dims below an instance's, packed sequences, both layouts),
//! both dQ reductions, the gradients poisoned before each run; the deterministic reduction
//! bitwise repeatable; bad operands refused before anything is written.

mod common;

use cudarc::driver::CudaSlice;
use half::bf16;
use sdpa::{
    Alibi, Backend, BackwardPlan, BackwardViews, DType, DqReduction, Extras, Layout, Mask, Problem,
    View, ViewMut,
};
use sdpa_harness::check::compare_with;
use sdpa_harness::grad::{BackwardCase, check_backward, grad_tolerance, poisoned, values};
use sdpa_harness::inputs::fresh_seed;

/// The problems every backward is checked on: one per feature, at lengths that leave partial
/// tiles.
fn cases() -> Vec<(&'static str, Problem)> {
    let base = |sq, sk, d| Problem::new(2, 4, sq, sk, d);
    let (varlen, _) =
        sdpa_harness::seqs::varlen(Problem::new(1, 4, 1, 1, 64), &[5, 64, 33], &[40, 64, 90]);
    vec![
        ("dense d64", base(100, 130, 64)),
        (
            "causal d128, fewer queries",
            base(77, 150, 128).with_causal(true),
        ),
        (
            "causal top-left d64",
            base(90, 60, 64).with_mask(Mask::CausalTopLeft),
        ),
        (
            "gqa 8/2 causal d64",
            Problem::new(2, 8, 96, 96, 64)
                .with_kv_heads(2)
                .with_causal(true),
        ),
        (
            "window 20,5 d64",
            base(120, 120, 64).with_mask(Mask::Window {
                left: Some(20),
                right: Some(5),
            }),
        ),
        (
            "softcap, alibi d128",
            base(64, 80, 128)
                .with_softcap(20.0)
                .with_alibi(Alibi::PerHead),
        ),
        (
            "sinks d64",
            base(70, 70, 64).with_sinks(true).with_causal(true),
        ),
        ("head dim 96 (on 128)", base(50, 70, 96)),
        (
            "d192 / dv128 (on 256)",
            base(40, 65, 192).with_head_dim_v(128),
        ),
        ("d256", base(40, 45, 256).with_causal(true)),
        (
            "bshd gqa 4/1",
            base(60, 70, 64).with_kv_heads(1).with_layout(Layout::Bshd),
        ),
        ("varlen causal", varlen.with_causal(true)),
    ]
}

/// The GPU backends with a backward, each run on every case it can implement (one refusing a
/// case says why: cutlass needs sm_90a, the tensor-core kernels take head dims 64 and 128).
const BACKWARDS: [Backend; 3] = [Backend::Cutlass, Backend::CutlassSm80, Backend::Scalar];

fn gradients_match(
    dev: &sdpa::Device,
    dtype: DType,
    reduction: DqReduction,
    ran: &mut Vec<String>,
) {
    let mut failed = Vec::new();
    for (name, p) in cases() {
        for backend in BACKWARDS {
            let seed = fresh_seed();
            let r = match check_backward(dev, &p.with_dtype(dtype), backend, reduction, seed) {
                Ok(r) => r,
                Err(sdpa::Error::Unsupported { reason, .. }) => {
                    println!("{name} {dtype} {reduction:?} on {backend}: not run ({reason})");
                    continue;
                }
                Err(e) => panic!("{name} {dtype} {reduction:?} on {backend}: {e}"),
            };
            for (what, x) in ["dq", "dk", "dv"].iter().zip(&r.reports) {
                println!(
                    "{name} {dtype} {reduction:?} on {backend} {what}: rel_err {:.2e} (bar \
                     {:.1e}) max_err {:.2e} (bar {:.1e}) nan {}",
                    x.rel_err, x.tol.rel, x.max_err, x.tol.max_abs, x.nan_count
                );
            }
            if let Some((err, bar)) = r.dsinks {
                println!(
                    "{name} {dtype} {reduction:?} on {backend} dsinks: max_err {err:.2e} (bar \
                     {bar:.1e})"
                );
            }
            if !r.pass() {
                failed.push(format!("{name} {dtype} {reduction:?} (seed {seed}): {r:?}"));
            }
            ran.push(format!("{} {name} {dtype} {reduction:?}", r.backend));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

#[test]
fn gradients_match_the_reference() {
    let Some(dev) = common::device("gradients_match_the_reference") else {
        return;
    };
    let mut ran = Vec::new();
    for reduction in [DqReduction::Atomic, DqReduction::Deterministic] {
        gradients_match(&dev, DType::F16, reduction, &mut ran);
        gradients_match(&dev, DType::Bf16, reduction, &mut ran);
    }
    common::assert_ran("gradients_match_the_reference", &ran);
    // The backend Auto takes on this device ran cases of its own.
    let dense = Problem::new(1, 1, 64, 64, 64).with_dtype(DType::Bf16);
    let auto = BackwardPlan::new(&dev, &dense, Backend::Auto, DqReduction::Atomic)
        .unwrap()
        .backend();
    assert!(
        ran.iter().any(|r| r.starts_with(&format!("{auto} "))),
        "{auto}, Auto's choice here, ran no case"
    );
}

/// The deterministic reduction gives the same bits on every run, on each backend with a
/// backward that runs the problem; the atomic one stays within its bar of it.
#[test]
fn the_deterministic_reduction_repeats_bitwise() {
    let Some(dev) = common::device("the_deterministic_reduction_repeats_bitwise") else {
        return;
    };
    let p = Problem::new(2, 8, 300, 300, 64)
        .with_kv_heads(2)
        .with_causal(true);
    let mut f = BackwardCase::<bf16>::new(&dev, &p, fresh_seed()).unwrap();
    let mut ran = Vec::new();
    for backend in BACKWARDS {
        let det = match BackwardPlan::new(&dev, &f.p, backend, DqReduction::Deterministic) {
            Ok(plan) => plan,
            Err(sdpa::Error::Unsupported { reason, .. }) => {
                println!("{backend}: not run ({reason})");
                continue;
            }
            Err(e) => panic!("{backend}: {e}"),
        };
        let first = f.backward(&dev, &det).unwrap();
        for _ in 0..3 {
            assert_eq!(
                f.backward(&dev, &det).unwrap(),
                first,
                "a deterministic rerun on {backend} differs"
            );
        }
        let atomic = BackwardPlan::new(&dev, &f.p, backend, DqReduction::Atomic).unwrap();
        let a = f.backward(&dev, &atomic).unwrap();
        assert_eq!(
            a.dk, first.dk,
            "{backend}: dK and dV do not depend on the dQ reduction"
        );
        assert_eq!(a.dv, first.dv, "{backend}");
        let r = compare_with(&a.dq, &first.dq, grad_tolerance(DType::Bf16), 0);
        assert!(r.pass(), "{backend}: {r:?}");
        ran.push(format!("{backend} repeats bitwise"));
    }
    common::assert_ran("the_deterministic_reduction_repeats_bitwise", &ran);
}

/// Bad operands and problems no backward takes are refused with a typed error before any
/// launch: every gradient keeps its poison.
#[test]
fn bad_operands_are_refused() {
    let Some(dev) = common::device("bad_operands_are_refused") else {
        return;
    };
    let p = Problem::new(1, 2, 64, 64, 64).with_dtype(DType::Bf16);
    let unsupported = |p: &Problem, b: Backend, fragment: &str| match BackwardPlan::new(
        &dev,
        p,
        b,
        DqReduction::Atomic,
    ) {
        Err(sdpa::Error::Unsupported { reason, .. }) => {
            assert!(reason.contains(fragment), "{p} on {b}: {reason}")
        }
        other => panic!("{p} on {b}: {other:?}, expected Unsupported({fragment})"),
    };
    unsupported(&p, Backend::Cpu, "no GPU backward");
    unsupported(&p, Backend::Cublas, "no GPU backward");
    unsupported(
        &p.with_dtype(DType::E4m3).with_out_dtype(DType::Bf16),
        Backend::Auto,
        "f16 or bf16",
    );
    let (paged, _) = sdpa_harness::seqs::paged(Problem::new(2, 2, 1, 64, 64), &[30, 64], 16, 1);
    unsupported(&paged, Backend::Auto, "paged");

    let mut f = BackwardCase::<bf16>::new(&dev, &p, 7).unwrap();
    let plan = BackwardPlan::new(&dev, &f.p, Backend::Auto, DqReduction::Atomic).unwrap();
    let (qs, n) = (p.q_strides(), p.q_len().unwrap());
    let (mut dq, mut dk, mut dv) = (
        poisoned::<bf16>(&dev, n).unwrap(),
        poisoned::<bf16>(&dev, n).unwrap(),
        poisoned::<bf16>(&dev, n).unwrap(),
    );
    let short_lse = dev.stream().alloc_zeros::<f32>(p.lse_len() - 1).unwrap();
    let mut sinks_grad = dev.stream().alloc_zeros::<f32>(p.heads).unwrap();
    let mut stray_lse = dev.stream().alloc_zeros::<f32>(p.lse_len()).unwrap();
    // Rows of dQ at one address: two CTAs would write one element.
    let shared_rows = sdpa::Strides { seq: 0, ..qs };
    // An f16 plan, which bf16 views do not fit.
    let f16_plan = BackwardPlan::new(
        &dev,
        &f.p.with_dtype(DType::F16),
        Backend::Auto,
        DqReduction::Atomic,
    )
    .unwrap();
    for (what, fragment) in [
        ("short lse", "lse holds"),
        ("dq rows share addresses", "share addresses"),
        ("dsinks without sinks", "without sinks"),
        ("lse in extras", "Extras::lse"),
        ("bf16 views on an f16 plan", "bf16"),
    ] {
        let ops = BackwardViews {
            q: View::new(f.q.as_view(), qs),
            k: View::new(f.k.as_view(), qs),
            v: View::new(f.v.as_view(), qs),
            out: View::new(f.out.as_view(), qs),
            d_out: View::new(f.d_out.as_view(), qs),
            lse: if what == "short lse" {
                short_lse.as_view()
            } else {
                f.lse.as_view()
            },
            dq: ViewMut::new(
                dq.as_view_mut(),
                if what == "dq rows share addresses" {
                    shared_rows
                } else {
                    qs
                },
            ),
            dk: ViewMut::new(dk.as_view_mut(), qs),
            dv: ViewMut::new(dv.as_view_mut(), qs),
            dsinks: (what == "dsinks without sinks").then(|| sinks_grad.as_view_mut()),
        };
        let extras = Extras {
            lse: (what == "lse in extras").then(|| stray_lse.as_view_mut()),
            ..Extras::default()
        };
        let plan = if what == "bf16 views on an f16 plan" {
            &f16_plan
        } else {
            &plan
        };
        match plan.run(ops, extras) {
            Err(sdpa::Error::InvalidArgument(m)) => assert!(m.contains(fragment), "{what}: {m}"),
            other => panic!("{what}: {other:?}, expected InvalidArgument({fragment})"),
        }
    }
    let nan = |x: &CudaSlice<bf16>| values(dev.stream(), x).unwrap().iter().all(|v| v.is_nan());
    assert!(
        nan(&dq) && nan(&dk) && nan(&dv),
        "a refused call wrote a gradient"
    );
    let g = f.backward(&dev, &plan).expect("the well-formed call runs");
    assert!(g.dq.iter().all(|x| x.is_finite()));
}

/// Owned tensors run as views of their buffers: the deterministic reduction gives the same bits
/// through `BackwardTensors` as through `BackwardViews`; a tensor of another dtype is refused.
#[test]
fn owned_tensors_give_what_views_give() {
    let Some(dev) = common::device("owned_tensors_give_what_views_give") else {
        return;
    };
    let p = Problem::new(1, 4, 70, 90, 64)
        .with_kv_heads(2)
        .with_causal(true);
    let mut f = BackwardCase::<bf16>::new(&dev, &p, fresh_seed()).unwrap();
    let plan = BackwardPlan::new(&dev, &f.p, Backend::Auto, DqReduction::Deterministic).unwrap();
    let through_views = f.backward(&dev, &plan).unwrap();
    let own = |x: &CudaSlice<bf16>| sdpa::Tensor::from_cuda_slice(&dev, x.clone()).unwrap();
    let (q, k, v, out, d_out) = (own(&f.q), own(&f.k), own(&f.v), own(&f.out), own(&f.d_out));
    let grad = |n: usize| sdpa::Tensor::poisoned(&dev, DType::Bf16, n).unwrap();
    let (mut dq, mut dk, mut dv) = (
        grad(p.q_len().unwrap()),
        grad(p.k_len().unwrap()),
        grad(p.v_len().unwrap()),
    );
    let ops = sdpa::BackwardTensors {
        q: &q,
        k: &k,
        v: &v,
        out: &out,
        d_out: &d_out,
        lse: f.lse.as_view(),
        dq: &mut dq,
        dk: &mut dk,
        dv: &mut dv,
        dsinks: None,
    };
    plan.run(ops, Extras::default()).unwrap();
    let vals = |t: &sdpa::Tensor| t.to_f64(&dev).unwrap();
    assert_eq!(vals(&dq), through_views.dq);
    assert_eq!(vals(&dk), through_views.dk);
    assert_eq!(vals(&dv), through_views.dv);

    let mut wrong = sdpa::Tensor::zeros(&dev, DType::F16, p.q_len().unwrap()).unwrap();
    let ops = sdpa::BackwardTensors {
        q: &q,
        k: &k,
        v: &v,
        out: &out,
        d_out: &d_out,
        lse: f.lse.as_view(),
        dq: &mut wrong,
        dk: &mut dk,
        dv: &mut dv,
        dsinks: None,
    };
    match plan.run(ops, Extras::default()) {
        Err(sdpa::Error::InvalidArgument(m)) => assert!(m.contains("dq is f16"), "{m}"),
        other => panic!("{other:?}"),
    }
}
