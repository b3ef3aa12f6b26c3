//! f32 outputs of f16 and bf16 inputs (`DType::F32`, a problem made `with_out_dtype`): run
//! through owned tensors and through views on cutlass (sm_90a) and, for tensors, the cpu
//! reference; each output poisoned with NaN first and checked against the float64 reference at
//! a bar for an output that is not rounded to 16 bits; the backends that do not write f32
//! refuse it with a typed error before anything runs.

mod common;

use cudarc::driver::{CudaSlice, CudaStream};
use half::{bf16, f16};
use sdpa::{
    Backend, DType, Device, Element, Extras, Plan, Problem, Strides, Tensor, TensorShape, Tensors,
    View, ViewMut, Views,
};
use sdpa_harness::check::{Report, Tolerance, compare_lse, compare_with};
use sdpa_harness::inputs::{Inputs, fresh_seed, random_inputs};
use std::sync::Arc;

/// f16 and bf16, causal and not, GQA, prefill and decode shapes at the head dims the sm_90a
/// kernel writes f32 at (64 and 128), one with the log-sum-exp.
fn problems() -> Vec<Problem> {
    let mut ps = Vec::new();
    for dtype in DType::ALL {
        for causal in [false, true] {
            ps.push(
                Problem::new(2, 8, 200, 333, 128)
                    .with_kv_heads(2)
                    .with_causal(causal),
            );
        }
        ps.push(
            Problem::new(1, 8, 256, 256, 64)
                .with_kv_heads(4)
                .with_causal(true)
                .with_lse(true),
        );
        ps.push(Problem::new(3, 8, 1, 1000, 64).with_kv_heads(1));
        for p in ps.iter_mut().filter(|p| p.out_dtype.is_none()) {
            *p = p.with_dtype(dtype).with_out_dtype(DType::F32);
        }
    }
    ps
}

/// The bar for an f32 output of inputs of `dtype` (unit roundoff u): the kernels still round P
/// to the input dtype before P·V (about u/√3 relative), but the output's own rounding to 16
/// bits (as much again, which the 16-bit outputs' bar of 2u leaves room for) is gone: 1.5u.
/// One element may be off by at most 8u relative to the largest output, as for 16-bit outputs.
fn f32_tolerance(dtype: DType) -> Tolerance {
    let u = dtype.unit_roundoff();
    Tolerance {
        rel: 1.5 * u,
        max_abs: 8.0 * u,
        min_cosine: None,
    }
}

/// `got` (the output, and the log-sum-exp where the problem asks for it) against the
/// reference; and that the output was written in f32, not rounded to the input dtype and
/// widened: a rounded output holds only values of the input dtype, an f32 one almost none.
fn check(what: &str, p: &Problem, inputs: &Inputs, seed: u64, got: &[f64], lse: Option<&[f64]>) {
    let want = inputs.reference(p).unwrap();
    let mut r: Report = compare_with(got, &want.out, f32_tolerance(p.dtype), seed);
    if let Some(lse) = lse {
        let (err, mismatched) = compare_lse(lse, &want.lse);
        r.lse_err = Some(err);
        r.nan_count += mismatched;
    }
    assert!(r.pass(), "{what} on {p}: {r:?}");
    let narrow = got
        .iter()
        .filter(|&&x| sdpa::decode(p.dtype, &sdpa::encode(p.dtype, &[x as f32]))[0] == x)
        .count();
    assert!(
        narrow * 10 < got.len(),
        "{what} on {p}: {narrow} of {} outputs are {} values; the output was rounded to the \
         input dtype",
        got.len(),
        p.dtype
    );
}

/// The log-sum-exp buffer of `p` (NaN), where it asks for one.
fn lse_buffer(stream: &Arc<CudaStream>, p: &Problem) -> Option<CudaSlice<f32>> {
    p.lse
        .then(|| stream.clone_htod(&vec![f32::NAN; p.lse_len()]).unwrap())
}

/// The log-sum-exp as f64, where there is one.
fn lse_values(stream: &Arc<CudaStream>, lse: &Option<CudaSlice<f32>>) -> Option<Vec<f64>> {
    lse.as_ref().map(|l| {
        let host = stream.clone_dtoh(l).unwrap();
        host.into_iter().map(f64::from).collect()
    })
}

/// cutlass and cpu write f32 outputs through owned tensors (`Tensor` of `DType::F32`, poisoned
/// first), `Auto` picks cutlass where it runs (and refuses where no GPU backend writes f32),
/// and the other GPU backends refuse with a typed error naming the reason.
#[test]
fn f32_outputs_through_tensors() {
    let test = "f32 outputs through tensors";
    let Some(dev) = common::device(test) else {
        return;
    };
    let stream = dev.stream().clone();
    let mut ran = Vec::new();
    for p in problems() {
        let seed = fresh_seed();
        let inputs = random_inputs(&p, seed).unwrap();
        let [q, k, v] = inputs.upload(&dev, p.dtype).unwrap();
        let cutlass = common::backend_runs_here(test, &dev, Backend::Cutlass, &p);
        let mut backends = vec![Backend::Cpu];
        match &cutlass {
            Ok(()) => backends.extend([Backend::Cutlass, Backend::Auto]),
            Err(why) => common::skip(test, &format!("cutlass on {p}: {why}")),
        }
        for b in backends {
            let plan = Plan::new(&dev, &p, b).unwrap_or_else(|e| panic!("{b} on {p}: {e}"));
            if b == Backend::Auto {
                assert_eq!(plan.backend(), Backend::Cutlass, "auto on {p}");
            }
            let mut out = Tensor::poisoned(&dev, DType::F32, p.q_len().unwrap()).unwrap();
            assert_eq!(out.dtype(), DType::F32);
            let mut lse = lse_buffer(&stream, &p);
            let extras = Extras {
                lse: lse.as_mut().map(|l| l.as_view_mut()),
                ..Extras::default()
            };
            let t = Tensors {
                q: &q,
                k: &k,
                v: &v,
                out: &mut out,
            };
            plan.run(t, extras)
                .unwrap_or_else(|e| panic!("{b} on {p}: {e}"));
            let got = out.to_f64(&dev).unwrap();
            let lse = lse_values(&stream, &lse);
            check(&b.to_string(), &p, &inputs, seed, &got, lse.as_deref());
            ran.push((b, p));
        }
        if cutlass.is_err() {
            let e = Plan::new(&dev, &p, Backend::Auto).unwrap_err();
            assert!(
                matches!(e, sdpa::Error::Unsupported { .. }),
                "auto on {p} without cutlass: {e:?}"
            );
        }
        // A 16-bit output tensor for an f32 problem is the caller's mistake, named.
        let mut narrow = Tensor::poisoned(&dev, p.dtype, p.q_len().unwrap()).unwrap();
        let e = sdpa::forward(
            &dev,
            &p,
            Backend::Cpu,
            Tensors {
                q: &q,
                k: &k,
                v: &v,
                out: &mut narrow,
            },
            Extras::default(),
        )
        .unwrap_err();
        assert!(matches!(e, sdpa::Error::InvalidArgument(_)), "{e:?}");
        assert!(e.to_string().contains("the problem says f32"), "{e}");
        refusals(&dev, &p);
    }
    common::assert_ran(test, &ran);
}

/// cublas, cutlass-sm80, wmma and scalar do not write f32: `supports` and `Plan::new` refuse
/// with `Error::Unsupported`, naming f32 (asked without the log-sum-exp, which cublas refuses
/// first).
fn refusals(dev: &Device, p: &Problem) {
    let p = &p.with_lse(false);
    for b in [
        Backend::Cublas,
        Backend::CutlassSm80,
        Backend::Wmma,
        Backend::Scalar,
    ] {
        for e in [
            b.supports(Some(dev), p).unwrap_err(),
            Plan::new(dev, p, b).unwrap_err(),
        ] {
            match e {
                sdpa::Error::Unsupported { backend, reason } => {
                    assert_eq!(backend, b.name());
                    assert!(reason.contains("f32"), "{b} on {p}: {reason}");
                }
                e => panic!("{b} on {p}: expected Unsupported, got {e:?}"),
            }
        }
    }
}

/// The strides of a `[b, h, s, d]` tensor stored sequence-major with `pad` spare elements after
/// each sequence position.
fn padded(shape: TensorShape, pad: usize) -> Strides {
    let row = shape.heads * shape.head_dim + pad;
    Strides {
        batch: shape.seq * row,
        head: shape.head_dim,
        seq: row,
    }
}

/// Every element offset of `shape` at strides `s`, in BHSD order.
fn offsets(shape: TensorShape, s: Strides) -> Vec<usize> {
    let mut at = Vec::with_capacity(shape.len().unwrap());
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            for i in 0..shape.seq {
                for d in 0..shape.head_dim {
                    at.push(s.offset(b, h, i, d));
                }
            }
        }
    }
    at
}

/// One problem on views: Q, K, V of element `T` at the layout's strides, the output `f32` at
/// padded sequence-major strides in a buffer of NaN; the padding must stay NaN.
fn run_views<T: Element>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    p: &Problem,
    of_bits: fn(u16) -> T,
) {
    let seed = fresh_seed();
    let inputs = random_inputs(p, seed).unwrap();
    let up = |bits: &[u16]| {
        let host: Vec<T> = bits.iter().map(|&b| of_bits(b)).collect();
        stream.clone_htod(&host).unwrap()
    };
    let (q, k, v) = (
        up(&inputs.bits[0]),
        up(&inputs.bits[1]),
        up(&inputs.bits[2]),
    );
    let (qs, ks) = (p.q_strides(), p.k_strides());
    let shape = p.q_shape();
    let os = padded(shape, 8);
    let at = offsets(shape, os);
    let extent = at.iter().max().unwrap() + 1;
    let mut out = stream.clone_htod(&vec![f32::NAN; extent]).unwrap();
    let mut lse = lse_buffer(stream, p);
    let plan = Plan::new(dev, p, Backend::Cutlass).unwrap();
    let views = Views {
        q: View::new(q.as_view(), qs),
        k: View::new(k.as_view(), ks),
        v: View::new(v.as_view(), ks),
        out: ViewMut::new(out.as_view_mut(), os),
    };
    let extras = Extras {
        lse: lse.as_mut().map(|l| l.as_view_mut()),
        ..Extras::default()
    };
    plan.run(views, extras)
        .unwrap_or_else(|e| panic!("cutlass views on {p}: {e}"));
    let host = stream.clone_dtoh(&out).unwrap();
    let got: Vec<f64> = at.iter().map(|&i| f64::from(host[i])).collect();
    let lse = lse_values(stream, &lse);
    check("cutlass views", p, &inputs, seed, &got, lse.as_deref());
    let mut written = vec![false; extent];
    at.iter().for_each(|&i| written[i] = true);
    assert!(
        host.iter().zip(&written).all(|(x, &w)| w || x.is_nan()),
        "cutlass views on {p}: the output's padding was written"
    );
    // Views whose output is of the inputs' dtype do not match an f32 problem.
    let mut narrow = up(&inputs.bits[0]);
    let views = Views {
        q: View::new(q.as_view(), qs),
        k: View::new(k.as_view(), ks),
        v: View::new(v.as_view(), ks),
        out: ViewMut::new(narrow.as_view_mut(), qs),
    };
    let e = plan.run(views, Extras::default()).unwrap_err();
    assert!(matches!(e, sdpa::Error::InvalidArgument(_)), "{e:?}");
    assert!(e.to_string().contains("the problem's output f32"), "{e}");
}

/// cutlass writes f32 outputs through views (`Views<T, f32>`) at strides of the caller's own,
/// and nothing outside them.
#[test]
fn f32_outputs_through_views() {
    let test = "f32 outputs through views";
    let Some(dev) = common::device(test) else {
        return;
    };
    let stream = dev.stream().clone();
    let mut ran = Vec::new();
    for p in problems() {
        if let Err(why) = common::backend_runs_here(test, &dev, Backend::Cutlass, &p) {
            return common::skip(test, &format!("cutlass on {p}: {why}"));
        }
        match p.dtype {
            DType::F16 => run_views(&dev, &stream, &p, f16::from_bits),
            _ => run_views(&dev, &stream, &p, bf16::from_bits),
        }
        ran.push(p);
    }
    common::assert_ran(test, &ran);
}

/// An f32 tensor holds f32 values exactly: made from values, bit patterns (two words each) or a
/// cudarc buffer, read back as values, patterns or a buffer, poisoned with NaN; a 16-bit view of
/// its memory is refused, and f32 inputs are an error of the problem.
#[test]
fn f32_tensors_hold_their_values() {
    let test = "f32 tensors";
    let Some(dev) = common::device(test) else {
        return;
    };
    let x = [1.0 / 3.0, -2.5e-30, 65504.0 * 4.0, 0.0];
    let t = Tensor::from_f32(&dev, DType::F32, &x).unwrap();
    assert_eq!((t.dtype(), t.len()), (DType::F32, 4));
    assert_eq!(t.to_f32(&dev).unwrap(), x);
    let bits = t.to_bits(&dev).unwrap();
    assert_eq!(bits, sdpa::encode(DType::F32, &x));
    let mut u = Tensor::zeros(&dev, DType::F32, 4).unwrap();
    assert!(u.to_f64(&dev).unwrap().iter().all(|&v| v == 0.0));
    u.write_bits(&dev, &bits).unwrap();
    assert_eq!(u.to_f32(&dev).unwrap(), x);
    let e = u.write_bits(&dev, &bits[..3]).unwrap_err();
    assert!(matches!(e, sdpa::Error::InvalidArgument(_)), "{e:?}");
    u.poison(&dev).unwrap();
    assert!(u.to_f32(&dev).unwrap().iter().all(|v| v.is_nan()));
    let back = Tensor::from_bits(&dev, DType::F32, &bits).unwrap();
    let slice: CudaSlice<f32> = back.into_cuda_slice().unwrap();
    assert_eq!(dev.stream().clone_dtoh(&slice).unwrap(), x);
    let again = Tensor::from_cuda_slice(&dev, slice).unwrap();
    assert_eq!(again.dtype(), DType::F32);
    assert!(again.into_cuda_slice::<f16>().is_err());
    let p = Problem::new(1, 1, 8, 8, 64).with_dtype(DType::F32);
    let e = Plan::new(&dev, &p, Backend::Cpu).unwrap_err();
    assert!(e.to_string().contains("f32 is an output type only"), "{e}");
    common::assert_ran(test, &[t.len()]);
}
