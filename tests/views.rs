//! Views of the caller's device memory (`sdpa::forward_views`): strided layouts read and written in
//! place and checked against the float64 reference, bad views refused before any launch, and a
//! call on the caller's stream captured into a CUDA graph and replayed on new inputs.

mod common;

use cudarc::driver::sys::CUstreamCaptureMode;
use cudarc::driver::{CudaSlice, CudaStream};
use half::f16;
use sdpa::{
    Backend, DType, Device, Fp8View, Fp8Views, Problem, Scaling, Strides, TensorShape, View,
    ViewMut, Views,
};
use sdpa_harness::check::compare;
use sdpa_harness::inputs::{fresh_seed, random_inputs};
use std::sync::Arc;

/// The caller's own stream on GPU 0 and a handle on it, or `None` (skipped).
fn callers_stream(test: &str) -> Option<(Arc<CudaStream>, Device)> {
    let own = common::device(test)?;
    let stream = own.stream().context().new_stream().expect("a stream");
    Some((stream.clone(), Device::from_stream(stream).unwrap()))
}

/// The strides of a `[b, h, s, d]` tensor stored sequence-major with `pad` spare elements after
/// each sequence position: one head's slice of a fused QKV projection looks like this.
fn padded(shape: TensorShape, pad: usize) -> Strides {
    let row = shape.heads * shape.head_dim + pad;
    Strides {
        batch: shape.seq * row,
        head: shape.head_dim,
        seq: row,
    }
}

/// Elements a buffer needs to hold `shape` at `s`.
fn extent(shape: TensorShape, s: Strides) -> usize {
    (shape.batch - 1) * s.batch
        + (shape.heads - 1) * s.head
        + (shape.seq - 1) * s.seq
        + shape.head_dim
}

/// Every (b, h, s, d) index of `shape`, in BHSD order.
fn indices(shape: TensorShape) -> impl Iterator<Item = (usize, usize, usize, usize)> {
    let TensorShape {
        batch,
        heads,
        seq,
        head_dim,
        ..
    } = shape;
    (0..batch).flat_map(move |b| {
        (0..heads)
            .flat_map(move |h| (0..seq).flat_map(move |s| (0..head_dim).map(move |d| (b, h, s, d))))
    })
}

/// BHSD-ordered `bits` written at strides `s` into a buffer of NaN (so gaps and unwritten
/// output stay visible).
fn scatter(bits: &[u16], shape: TensorShape, s: Strides) -> Vec<f16> {
    let mut buf = vec![f16::NAN; extent(shape, s)];
    for (x, (b, h, i, d)) in bits.iter().zip(indices(shape)) {
        buf[s.offset(b, h, i, d)] = f16::from_bits(*x);
    }
    buf
}

/// The elements at strides `s`, in BHSD order, as f64.
fn gather(buf: &[f16], shape: TensorShape, s: Strides) -> Vec<f64> {
    indices(shape)
        .map(|(b, h, i, d)| f64::from(buf[s.offset(b, h, i, d)].to_f32()))
        .collect()
}

/// Runs `p` on each of `backends` and on `Auto` with Q, K, V and the output in sequence-major
/// buffers whose rows end in `pads` spare elements (Q, K, V, output) of NaN: checks the result
/// against the float64 reference and that nothing but the output's own elements was written.
/// Returns the backends that ran.
fn padded_views_match_the_reference(
    stream: &Arc<CudaStream>,
    dev: &Device,
    p: &Problem,
    pads: [usize; 4],
    backends: &[Backend],
) -> Vec<Backend> {
    let seed = fresh_seed();
    let inputs = random_inputs(p, seed).unwrap();
    let reference =
        sdpa::reference(p, &inputs.values[0], &inputs.values[1], &inputs.values[2]).unwrap();
    let [qshape, kshape, vshape, oshape] = [p.q_shape(), p.k_shape(), p.v_shape(), p.out_shape()];
    let [qs, ks, vs, os] = [qshape, kshape, vshape, oshape]
        .into_iter()
        .zip(pads)
        .map(|(shape, pad)| padded(shape, pad))
        .collect::<Vec<_>>()
        .try_into()
        .unwrap();
    let up = |t: usize, shape, s| {
        stream
            .clone_htod(&scatter(&inputs.bits[t], shape, s))
            .unwrap()
    };
    let (q, k, v) = (up(0, qshape, qs), up(1, kshape, ks), up(2, vshape, vs));
    let mut ran = Vec::new();
    for &b in backends.iter().chain(&[Backend::Auto]) {
        let mut out: CudaSlice<f16> = stream
            .clone_htod(&vec![f16::NAN; extent(oshape, os)])
            .unwrap();
        let views = Views {
            q: View::new(q.as_view(), qs),
            k: View::new(k.as_view(), ks),
            v: View::new(v.as_view(), vs),
            out: ViewMut::new(out.as_view_mut(), os),
        };
        sdpa::forward(dev, p, b, views, sdpa::Extras::default()).unwrap();
        let host = stream.clone_dtoh(&out).unwrap();
        let r = compare(&gather(&host, oshape, os), &reference, DType::F16, seed);
        assert!(r.pass(), "{b} on {p} with padded views: {r:?}");
        let mut touched = vec![false; host.len()];
        indices(oshape).for_each(|(b, h, i, d)| touched[os.offset(b, h, i, d)] = true);
        assert!(
            host.iter().zip(&touched).all(|(x, &t)| t || x.is_nan()),
            "{b} on {p}: an element outside the output's own was written"
        );
        ran.push(b);
    }
    ran
}

/// Each GPU backend that takes strided views (the fused ones), and `Auto`, on Q, K and V read
/// in place from sequence-major buffers with padding and an output written sequence-major with
/// padding of its own: the float64 reference's result, and the padding untouched.
#[test]
fn strided_views_match_the_reference() {
    let Some((stream, dev)) = callers_stream("strided views") else {
        return;
    };
    let p = Problem::new(2, 4, 130, 77, 64)
        .with_kv_heads(2)
        .with_causal(true);
    let strided: Vec<Backend> = common::expected_backends(&dev)
        .into_iter()
        .filter(|&b| b != Backend::Cublas)
        .collect();
    let ran = padded_views_match_the_reference(&stream, &dev, &p, [8, 16, 16, 24], &strided);
    common::assert_ran("strided views", &ran);
    assert_eq!(
        ran.len(),
        strided.len() + 1,
        "every fused backend and auto ran"
    );
}

/// Head dims narrower than the instance that runs them (Q and K 80, V and the output 48: the 96
/// kernels of scalar and cutlass-sm80, cutlass's 128) read and write only their own columns:
/// each operand sits in a sequence-major buffer whose rows end in NaN padding, so a kernel that
/// read its instance's width would meet the next head's values or NaN; the output's padding stays
/// NaN (a store past 48 columns lands there, or on the next head's columns, which the comparison
/// sees).
#[test]
fn narrowed_head_dims_read_and_write_their_own_columns_only() {
    let Some((stream, dev)) = callers_stream("narrowed views") else {
        return;
    };
    let p = Problem::new(2, 4, 130, 200, 80)
        .with_head_dim_v(48)
        .with_kv_heads(2)
        .with_causal(true);
    let narrowing: Vec<Backend> = common::expected_backends(&dev)
        .into_iter()
        .filter(|b| matches!(b, Backend::Scalar | Backend::CutlassSm80 | Backend::Cutlass))
        .collect();
    let ran = padded_views_match_the_reference(&stream, &dev, &p, [48, 48, 80, 80], &narrowing);
    common::assert_ran("narrowed views", &ran);
    assert_eq!(ran.len(), narrowing.len() + 1);
}

/// A dimension of size one is never stepped, so any stride the caller gives it is valid, even
/// one whose byte size overflows 64 bits or that is no multiple of 16 bytes: every fused backend
/// and `Auto` run such views (cutlass's TMA descriptors get the layout's own stride there) and
/// match the reference.
#[test]
fn strides_of_size_one_dimensions_are_never_used() {
    let Some((stream, dev)) = callers_stream("size-one strides") else {
        return;
    };
    let seed = fresh_seed();
    let p = Problem::new(1, 1, 130, 77, 64).with_causal(true);
    let inputs = random_inputs(&p, seed).unwrap();
    let reference =
        sdpa::reference(&p, &inputs.values[0], &inputs.values[1], &inputs.values[2]).unwrap();
    let (qshape, kshape) = (p.q_shape(), p.k_shape());
    let absurd = Strides {
        batch: usize::MAX / 3,
        head: (1 << 62) + 1,
        seq: 64,
    };
    let q = stream
        .clone_htod(&scatter(&inputs.bits[0], qshape, absurd))
        .unwrap();
    let k = stream
        .clone_htod(&scatter(&inputs.bits[1], kshape, absurd))
        .unwrap();
    let v = stream
        .clone_htod(&scatter(&inputs.bits[2], kshape, absurd))
        .unwrap();
    let mut ran = Vec::new();
    for b in common::expected_backends(&dev)
        .into_iter()
        .chain([Backend::Auto])
    {
        let mut out: CudaSlice<f16> = stream
            .clone_htod(&vec![f16::NAN; extent(qshape, absurd)])
            .unwrap();
        let views = Views {
            q: View::new(q.as_view(), absurd),
            k: View::new(k.as_view(), absurd),
            v: View::new(v.as_view(), absurd),
            out: ViewMut::new(out.as_view_mut(), absurd),
        };
        sdpa::forward(&dev, &p, b, views, sdpa::Extras::default())
            .unwrap_or_else(|e| panic!("{b} refuses size-one strides: {e}"));
        let host = stream.clone_dtoh(&out).unwrap();
        let r = compare(&gather(&host, qshape, absurd), &reference, DType::F16, seed);
        assert!(r.pass(), "{b} on {p} with size-one strides: {r:?}");
        ran.push((b, p));
    }
    common::assert_all_ran("size-one strides", &dev, &ran);
}

/// Views with the layout's own strides run on cublas too; strided ones are refused there, with
/// the reason, and `Auto` never picks it for them.
#[test]
fn cublas_takes_views_in_the_problems_layout_only() {
    let Some((stream, dev)) = callers_stream("views on cublas") else {
        return;
    };
    if Backend::Cublas
        .supports(Some(&dev), &Problem::new(1, 1, 8, 8, 64))
        .is_err()
    {
        return common::skip("views on cublas", "cublas is not usable here");
    }
    let p = Problem::new(1, 2, 64, 96, 128);
    let inputs = random_inputs(&p, fresh_seed()).unwrap();
    let reference =
        sdpa::reference(&p, &inputs.values[0], &inputs.values[1], &inputs.values[2]).unwrap();
    let (qs, ks) = (p.q_strides(), p.k_strides());
    let up = |bits: &[u16]| {
        let h: Vec<f16> = bits.iter().map(|&b| f16::from_bits(b)).collect();
        stream.clone_htod(&h).unwrap()
    };
    let (q, k, v) = (
        up(&inputs.bits[0]),
        up(&inputs.bits[1]),
        up(&inputs.bits[2]),
    );
    let mut out = stream.alloc_zeros::<f16>(p.q_len().unwrap()).unwrap();
    let views = Views {
        q: View::new(q.as_view(), qs),
        k: View::new(k.as_view(), ks),
        v: View::new(v.as_view(), ks),
        out: ViewMut::new(out.as_view_mut(), qs),
    };
    sdpa::forward(&dev, &p, Backend::Cublas, views, sdpa::Extras::default()).unwrap();
    let host = stream.clone_dtoh(&out).unwrap();
    let got: Vec<f64> = host.iter().map(|x| f64::from(x.to_f32())).collect();
    let r = compare(&got, &reference, DType::F16, 0);
    assert!(r.pass(), "cublas on views: {r:?}");

    let wide = Strides {
        seq: 2 * p.head_dim,
        head: 2 * p.head_dim * p.seq_q,
        batch: 2 * p.head_dim * p.seq_q * p.heads,
    };
    let big = stream.alloc_zeros::<f16>(2 * p.q_len().unwrap()).unwrap();
    let views = Views {
        q: View::new(big.as_view(), wide),
        k: View::new(k.as_view(), ks),
        v: View::new(v.as_view(), ks),
        out: ViewMut::new(out.as_view_mut(), qs),
    };
    let e = sdpa::forward(&dev, &p, Backend::Cublas, views, sdpa::Extras::default()).unwrap_err();
    assert!(matches!(e, sdpa::Error::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("layout's own strides"), "{e}");
}

/// Bad views are typed errors before any launch, and the output keeps its contents.
#[test]
fn bad_views_are_refused_and_leave_the_output_alone() {
    let Some((stream, dev)) = callers_stream("bad views") else {
        return;
    };
    let p = Problem::new(1, 2, 16, 16, 64);
    let (n, s) = (p.q_len().unwrap(), p.q_strides());
    let zeros = stream.alloc_zeros::<f16>(n).unwrap();
    let short = stream.alloc_zeros::<f16>(n - 1).unwrap();
    let seven = f16::from_f32(7.0);
    let mut out = stream.clone_htod(&vec![seven; n + 8]).unwrap();
    // V is the same good view in every case: only the named flaw differs.
    let run = |p: &Problem, q: View<'_, f16>, k: View<'_, f16>, out: ViewMut<'_, f16>| {
        let v = View::new(zeros.as_view(), s);
        sdpa::forward(
            &dev,
            p,
            Backend::Auto,
            Views { q, k, v, out },
            sdpa::Extras::default(),
        )
        .unwrap_err()
    };
    let cases = [
        (
            "a short buffer",
            run(
                &p,
                View::new(short.as_view(), s),
                View::new(zeros.as_view(), s),
                ViewMut::new(out.slice_mut(..n), s),
            ),
            "q holds 2047 elements; shape",
        ),
        (
            "a stride off the 16-byte grid",
            run(
                &p,
                View::new(zeros.as_view(), s),
                View::new(zeros.as_view(), Strides { seq: 66, ..s }),
                ViewMut::new(out.slice_mut(..n), s),
            ),
            "k's seq stride 66 is not a multiple of 8 elements",
        ),
        (
            "a misaligned start",
            run(
                &p,
                View::new(zeros.as_view(), s),
                View::new(zeros.as_view(), s),
                ViewMut::new(out.slice_mut(1..n + 1), s),
            ),
            "not 16-byte aligned",
        ),
        (
            "rows written twice",
            run(
                &p,
                View::new(zeros.as_view(), s),
                View::new(zeros.as_view(), s),
                ViewMut::new(out.slice_mut(..n), Strides { head: 0, ..s }),
            ),
            "share addresses",
        ),
        (
            "another dtype",
            run(
                &p.with_dtype(DType::Bf16),
                View::new(zeros.as_view(), s),
                View::new(zeros.as_view(), s),
                ViewMut::new(out.slice_mut(..n), s),
            ),
            "the views are f16, the problem's inputs bf16",
        ),
    ];
    for (what, e, fragment) in cases {
        assert!(
            matches!(e, sdpa::Error::InvalidArgument(_)),
            "{what}: {e:?}"
        );
        assert!(e.to_string().contains(fragment), "{what}: {e}");
    }
    // An output that aliases an input can only be made unsafely; it is refused all the same.
    let (ptr, _) = cudarc::driver::DevicePtr::device_ptr(&out, &stream);
    // SAFETY: a second handle on `out`'s memory, leaked below so that it is freed once.
    let alias = unsafe { stream.upgrade_device_ptr::<f16>(ptr, n) };
    let e = run(
        &p,
        View::new(alias.as_view(), s),
        View::new(zeros.as_view(), s),
        ViewMut::new(out.slice_mut(..n), s),
    );
    alias.leak();
    assert!(e.to_string().contains("out overlaps q"), "{e}");
    let kept = stream.clone_dtoh(&out).unwrap();
    assert!(kept.iter().all(|&x| x == seven), "the output was written");
}

/// A call on the caller's buffers and stream, captured into a CUDA graph once (after
/// `Plan::reserve`) and replayed: the reference's result, and after the caller overwrites Q in
/// place, the new reference's result from the same graph. For `Auto` and every backend this GPU
/// must run that takes views.
#[test]
fn a_call_on_callers_buffers_is_captured_in_a_graph() {
    let Some((stream, dev)) = callers_stream("graph capture") else {
        return;
    };
    let p = Problem::new(2, 8, 256, 256, 64).with_causal(true);
    let (qs, ks) = (p.q_strides(), p.k_strides());
    let up = |bits: &[u16]| -> Vec<f16> { bits.iter().map(|&b| f16::from_bits(b)).collect() };
    let mut ran = Vec::new();
    for b in common::expected_backends(&dev)
        .into_iter()
        .chain([Backend::Auto])
    {
        let (seed1, seed2) = (fresh_seed(), fresh_seed());
        let first = random_inputs(&p, seed1).unwrap();
        let second = random_inputs(&p, seed2).unwrap();
        let mut q = stream.clone_htod(&up(&first.bits[0])).unwrap();
        let k = stream.clone_htod(&up(&first.bits[1])).unwrap();
        let v = stream.clone_htod(&up(&first.bits[2])).unwrap();
        let mut out = stream
            .clone_htod(&vec![f16::NAN; p.q_len().unwrap()])
            .unwrap();
        let chosen = sdpa::Plan::new(&dev, &p, b)
            .unwrap()
            .reserve()
            .unwrap()
            .backend();
        stream.synchronize().unwrap();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let views = Views {
            q: View::new(q.as_view(), qs),
            k: View::new(k.as_view(), ks),
            v: View::new(v.as_view(), ks),
            out: ViewMut::new(out.as_view_mut(), qs),
        };
        let called = sdpa::forward(&dev, &p, b, views, sdpa::Extras::default());
        let graph = stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        called.unwrap_or_else(|e| panic!("{b} ({chosen}) during capture: {e}"));
        let graph = graph
            .unwrap_or_else(|e| panic!("{b} ({chosen}): capture failed: {e:?}"))
            .expect("the capture recorded the call");
        for (inputs, seed) in [(&first, seed1), (&second, seed2)] {
            stream.memcpy_htod(&up(&inputs.bits[0]), &mut q).unwrap();
            // The second round keeps K and V; its reference sees the new Q with them.
            graph.launch().unwrap();
            let host = stream.clone_dtoh(&out).unwrap();
            let got: Vec<f64> = host.iter().map(|x| f64::from(x.to_f32())).collect();
            let reference =
                sdpa::reference(&p, &inputs.values[0], &first.values[1], &first.values[2]).unwrap();
            let r = compare(&got, &reference, DType::F16, seed);
            assert!(r.pass(), "{b} ({chosen}) replayed: {r:?}");
        }
        if b != Backend::Auto {
            ran.push((b, p));
        }
    }
    common::assert_all_ran("graph capture", &dev, &ran);
}

/// e4m3 codes and per-head scales read in place: on the native kernel (cutlass, sm_90a) at
/// padded sequence-major strides, on the simulated path of the other fused backends at the
/// layout's strides (bf16 output); both against the float64 reference of the dequantized
/// inputs. Padded per-head views and f16 output on the simulated path are refused with the
/// reason.
#[test]
fn e4m3_views_match_the_reference() {
    let Some((stream, dev)) = callers_stream("e4m3 views") else {
        return;
    };
    let seed = fresh_seed();
    let p = Problem::new(2, 4, 130, 77, 128)
        .with_kv_heads(2)
        .with_causal(true)
        .with_dtype(DType::E4m3)
        .with_out_dtype(DType::Bf16)
        .with_fp8_scaling(Scaling::PerHead);
    let inputs = random_inputs(&p, seed).unwrap();
    let fp8 = inputs.fp8.as_ref().unwrap();
    let reference =
        sdpa::reference(&p, &inputs.values[0], &inputs.values[1], &inputs.values[2]).unwrap();
    let (qshape, kshape) = (p.q_shape(), p.k_shape());
    // Codes written at strides `s` into a buffer of 0x7F (an e4m3 NaN) elsewhere.
    let codes = |i: usize, shape: TensorShape, s: Strides| {
        let mut buf = vec![0x7Fu8; extent(shape, s)];
        for (c, (b, h, n, d)) in inputs.bits[i].iter().zip(indices(shape)) {
            buf[s.offset(b, h, n, d)] = *c as u8;
        }
        stream.clone_htod(&buf).unwrap()
    };
    let scales = [0, 1, 2].map(|i| stream.clone_htod(&fp8.scales[i]).unwrap());
    let run = |b: Backend, qs: Strides, ks: Strides, f16_out: bool| {
        let (q, k, v) = (
            codes(0, qshape, qs),
            codes(1, kshape, ks),
            codes(2, kshape, ks),
        );
        let os = p.q_strides();
        if f16_out {
            let p16 = p.with_out_dtype(DType::F16);
            let mut out = stream.alloc_zeros::<f16>(p.q_len().unwrap()).unwrap();
            let views = Fp8Views {
                q: Fp8View::new(q.as_view(), scales[0].as_view(), qs),
                k: Fp8View::new(k.as_view(), scales[1].as_view(), ks),
                v: Fp8View::new(v.as_view(), scales[2].as_view(), ks),
                out: ViewMut::new(out.as_view_mut(), os),
            };
            return sdpa::forward(&dev, &p16, b, views, sdpa::Extras::default())
                .map(|()| Vec::new());
        }
        let mut out = stream
            .clone_htod(&vec![half::bf16::NAN; p.q_len().unwrap()])
            .unwrap();
        let views = Fp8Views {
            q: Fp8View::new(q.as_view(), scales[0].as_view(), qs),
            k: Fp8View::new(k.as_view(), scales[1].as_view(), ks),
            v: Fp8View::new(v.as_view(), scales[2].as_view(), ks),
            out: ViewMut::new(out.as_view_mut(), os),
        };
        sdpa::forward(&dev, &p, b, views, sdpa::Extras::default())?;
        let host = stream.clone_dtoh(&out).unwrap();
        Ok(host
            .iter()
            .map(|x| f64::from(x.to_f32()))
            .collect::<Vec<f64>>())
    };
    let (qp, kp) = (padded(qshape, 16), padded(kshape, 32));
    let (ql, kl) = (p.q_strides(), p.k_strides());
    let mut ran = Vec::new();
    for b in common::expected_backends(&dev) {
        let got = match b {
            Backend::Cublas => {
                let e = run(b, ql, kl, false).unwrap_err();
                assert!(e.to_string().contains("owned tensors only"), "{e}");
                continue;
            }
            Backend::Cutlass => run(b, qp, kp, false),
            _ => {
                let e = run(b, qp, kp, false).unwrap_err();
                assert!(
                    e.to_string().contains("layout's own strides only"),
                    "{b}: {e}"
                );
                let e = run(b, ql, kl, true).unwrap_err();
                assert!(e.to_string().contains("to bf16 only"), "{b}: {e}");
                run(b, ql, kl, false)
            }
        }
        .unwrap_or_else(|e| panic!("{b} on e4m3 views: {e}"));
        let r = compare(&got, &reference, DType::E4m3, seed);
        assert!(r.pass(), "{b} on e4m3 views of {p}: {r:?}");
        ran.push(b);
    }
    common::assert_ran("e4m3 views", &ran);
}
