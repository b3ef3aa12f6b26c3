//! Bad input gets a typed error naming the offending value; nothing is launched or written.

mod common;

use sdpa::{Backend, DType, Error, Problem, Tensor};

#[test]
fn problem_errors_without_a_gpu() {
    let cases: Vec<(Problem, &str)> = vec![
        (Problem::new(0, 1, 4, 4, 64), "batch must be at least 1"),
        (Problem::new(1, 0, 4, 4, 64), "heads must be at least 1"),
        (Problem::new(1, 1, 0, 4, 64), "seq_q must be at least 1"),
        (Problem::new(1, 1, 4, 0, 64), "seq_k must be at least 1"),
        (Problem::new(1, 1, 4, 4, 0), "head_dim must be at least 1"),
        (
            Problem::new(1, 4, 4, 4, 64).with_kv_heads(3),
            "multiple of kv_heads (3)",
        ),
        (
            Problem::new(1, 4, 4, 4, 64).with_kv_heads(0),
            "kv_heads must be at least 1",
        ),
        (
            Problem::new(1, 1, 4, 4, 64).with_scale(-1.0),
            "scale must be finite and positive, got -1",
        ),
        (
            Problem::new(1, 1, 4, 4, 64).with_scale(f32::INFINITY),
            "got inf",
        ),
        (Problem::new(usize::MAX, 2, 4, 4, 64), "2^40"),
    ];
    for (p, fragment) in cases {
        let e = p.validate().unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{p:?}: {e}");
        assert!(
            e.to_string().contains(fragment),
            "{p:?}: {e:?} lacks {fragment:?}"
        );
    }
}

#[test]
fn scalar_names_its_head_dim_limit_with_or_without_a_gpu() {
    // Head dims between its instances run (narrowed); rows of whole 16-byte chunks are its limit.
    let p = Problem::new(1, 1, 4, 4, 84);
    let e = Backend::Scalar.supports(None, &p).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Unsupported {
                backend: "scalar",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("head_dim 84"), "{e}");
    assert!(e.to_string().contains("multiples of 8"), "{e}");
}

#[test]
fn names_parse_or_say_what_is_known() {
    assert_eq!("scalar".parse::<Backend>().unwrap(), Backend::Scalar);
    assert_eq!("BF16".parse::<DType>().unwrap(), DType::Bf16);
    let e = "cudnn9".parse::<Backend>().unwrap_err().to_string();
    assert!(e.contains("\"cudnn9\"") && e.contains("scalar"), "{e}");
    let e = "fp64".parse::<DType>().unwrap_err().to_string();
    assert!(e.contains("\"fp64\""), "{e}");
    let e = sdpa_harness::named_problem("s3k").unwrap_err().to_string();
    assert!(e.contains("\"s3k\"") && e.contains("mission"), "{e}");
}

#[test]
fn no_gpu_is_an_error_value_not_a_crash() {
    match sdpa::Device::new(0) {
        Ok(_) => {} // a GPU machine: covered by the tests below
        Err(e) => assert!(matches!(e, Error::NoDevice(_)), "{e}"),
    }
    // Whatever the machine, a huge ordinal is an error value.
    let e = sdpa::Device::new(1 << 20).expect_err("no machine has 2^20 GPUs");
    assert!(matches!(e, Error::NoDevice(_)), "{e}");
}

#[test]
fn tensor_mismatches_are_rejected_before_launch() {
    let Some(dev) = common::device("tensor mismatches") else {
        return;
    };
    let p = Problem::new(1, 2, 8, 8, 64);
    let n = p.q_len().unwrap();
    let good = || Tensor::from_f32(&dev, DType::F16, &vec![0.5; n]).unwrap();
    let (q, k, v) = (good(), good(), good());
    let bf = Tensor::from_f32(&dev, DType::Bf16, &vec![0.5; n]).unwrap();
    let short = Tensor::from_f32(&dev, DType::F16, &vec![0.5; n - 1]).unwrap();

    let mut out = Tensor::poisoned(&dev, DType::F16, n).unwrap();
    let e = common::forward(&dev, &p, Backend::Scalar, [&bf, &k, &v], &mut out).unwrap_err();
    assert!(
        e.to_string().contains("q is bf16, the problem says f16"),
        "{e}"
    );
    let e = common::forward(&dev, &p, Backend::Scalar, [&q, &short, &v], &mut out).unwrap_err();
    assert!(
        e.to_string()
            .contains(&format!("k holds {} elements", n - 1)),
        "{e}"
    );
    let mut short_out = Tensor::poisoned(&dev, DType::F16, n - 1).unwrap();
    let e = common::forward(&dev, &p, Backend::Scalar, [&q, &k, &v], &mut short_out).unwrap_err();
    assert!(e.to_string().contains("out holds"), "{e}");
    let e = common::forward(
        &dev,
        &p.with_kv_heads(3),
        Backend::Scalar,
        [&q, &k, &v],
        &mut out,
    )
    .unwrap_err();
    assert!(e.to_string().contains("kv_heads (3)"), "{e}");
    let p84 = Problem::new(1, 1, 8, 8, 84);
    let e = common::forward(&dev, &p84, Backend::Scalar, [&q, &k, &v], &mut out).unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    // Nothing was written: the output is still all NaN.
    assert!(out.to_f32(&dev).unwrap().iter().all(|x| x.is_nan()));
}

/// A launch the driver refuses (an empty grid) comes back as `Err(Error::Cuda)` carrying
/// CUDA's own error name and string, through the path every kernel launch uses (C++ check ->
/// exception -> cxx -> Rust); no abort, and the device stays usable afterwards.
#[test]
fn launch_failure_is_an_error_with_the_cuda_string() {
    let Some(dev) = common::device("launch failure") else {
        return;
    };
    let e = sdpa_harness::timing::launch_floor(&dev, 0).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Cuda(_)), "{e:?}");
    assert!(
        msg.contains("empty kernel launch failed: cudaError"),
        "{msg}"
    );
    let p = Problem::new(1, 2, 40, 40, 64);
    let r = sdpa_harness::check::check_backend(Some(&dev), &p, Backend::Auto, 3).unwrap();
    assert!(r.pass(), "after a failed launch: {r:?}");
}

/// A tensor made on GPU 1 handed to a `Device` of GPU 0: a typed error naming the tensor,
/// nothing launched, the output untouched. Needs two GPUs (skips with the reason otherwise;
/// `SDPA_REQUIRE_MULTI_GPU=1` makes a missing second GPU fail instead).
#[test]
fn tensor_from_another_gpu_is_rejected() {
    let Some(dev0) = common::device("another GPU") else {
        return;
    };
    let dev1 = match sdpa::Device::new(1) {
        Ok(d) => d,
        Err(e) => {
            if std::env::var("SDPA_REQUIRE_MULTI_GPU").is_ok_and(|v| v == "1") {
                panic!("SDPA_REQUIRE_MULTI_GPU=1 but no second GPU: {e}");
            }
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "another GPU: skipped, one GPU only ({e})"
            );
            return;
        }
    };
    let p = Problem::new(1, 2, 16, 16, 64);
    let n = p.q_len().unwrap();
    let on0 = |dtype| Tensor::from_f32(&dev0, dtype, &vec![0.5; n]).unwrap();
    let (q, k, v) = (on0(DType::F16), on0(DType::F16), on0(DType::F16));
    let far = Tensor::from_f32(&dev1, DType::F16, &vec![0.5; n]).unwrap();
    let mut out = Tensor::poisoned(&dev0, DType::F16, n).unwrap();
    for backend in Backend::ALL {
        for (name, r) in [
            (
                "q",
                common::forward(&dev0, &p, backend, [&far, &k, &v], &mut out),
            ),
            (
                "k",
                common::forward(&dev0, &p, backend, [&q, &far, &v], &mut out),
            ),
            (
                "v",
                common::forward(&dev0, &p, backend, [&q, &k, &far], &mut out),
            ),
        ] {
            let e = r.unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument(_)),
                "{backend} {name}: {e:?}"
            );
            assert!(
                e.to_string()
                    .contains(&format!("{name} lives on another GPU")),
                "{backend} {name}: {e}"
            );
        }
        let mut far_out = Tensor::poisoned(&dev1, DType::F16, n).unwrap();
        let e = common::forward(&dev0, &p, backend, [&q, &k, &v], &mut far_out).unwrap_err();
        assert!(
            e.to_string().contains("out lives on another GPU"),
            "{backend}: {e}"
        );
    }
    assert!(
        out.to_f32(&dev0).unwrap().iter().all(|x| x.is_nan()),
        "output written"
    );
    // The tensor methods that take a handle check its GPU too.
    let mut far = far;
    for (what, r) in [
        ("to_bits", far.to_bits(&dev0).map(drop)),
        ("poison", far.poison(&dev0)),
        ("write_bits", far.write_bits(&dev0, &[0; 4])),
    ] {
        let e = r.unwrap_err();
        assert!(e.to_string().contains("another GPU"), "{what}: {e}");
    }
}

/// The host functions of the public API return errors for inputs that do not fit the shape
/// they are given, instead of indexing out of bounds or dividing by zero.
#[test]
fn host_functions_reject_inconsistent_arguments() {
    use sdpa::fp8::{absmax_host, dequantize_host};
    use sdpa::{Layout, Scaling, TensorShape};
    let shape = TensorShape {
        batch: 1,
        heads: 2,
        seq: 3,
        head_dim: 4,
        layout: Layout::Bhsd,
    };
    let scales = [1.0f32, 2.0];
    let e = dequantize_host(&[0x38; 25], &scales, &shape, Scaling::PerHead).unwrap_err();
    assert!(e.to_string().contains("25 values"), "{e}");
    let e = dequantize_host(&[0x38; 24], &scales[..1], &shape, Scaling::PerHead).unwrap_err();
    assert!(e.to_string().contains("1 scales given"), "{e}");
    let ok = dequantize_host(&[0x38; 24], &scales, &shape, Scaling::PerHead).unwrap();
    assert_eq!(
        (ok[0], ok[23]),
        (1.0, 2.0),
        "code 0x38 is 1.0, times each head's scale"
    );
    let e = absmax_host(&[1.0; 30], &shape, Scaling::PerTensor).unwrap_err();
    assert!(e.to_string().contains("30 values"), "{e}");
    assert_eq!(
        absmax_host(&[-3.0; 24], &shape, Scaling::PerHead).unwrap(),
        [3.0, 3.0]
    );

    let headless = TensorShape { heads: 0, ..shape };
    assert_eq!(headless.head_of(0), None);
    assert_eq!(shape.head_of(23), Some(1));
    assert_eq!(shape.head_of(24), None);
    let huge = TensorShape {
        batch: usize::MAX,
        heads: 2,
        ..shape
    };
    assert_eq!(huge.heads_total(), None);
    assert_eq!(huge.head_of(5), None);
}

/// A problem that validates but whose inputs the host cannot hold is `Error::OutOfMemory`
/// before anything is allocated (2^40 elements of Q alone are 8 TiB as f64).
#[test]
fn inputs_larger_than_memory_are_an_error() {
    let p = Problem::new(1, 1, 1 << 20, 1 << 20, 1 << 20);
    p.validate().unwrap();
    let e = sdpa_harness::inputs::random_inputs(&p, 1)
        .err()
        .expect("8 TiB of inputs");
    assert!(
        matches!(e, Error::OutOfMemory { needed, .. } if needed > 1 << 40),
        "{e:?}"
    );
    assert!(e.to_string().starts_with("out of host memory"), "{e}");
    let e = sdpa_harness::check::check_backend(None, &p, Backend::Cpu, 1).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory { .. }), "{e:?}");
    // The reference checks its own output before allocating it.
    let one = vec![0.0; 1];
    let e = sdpa::reference(&Problem::new(1, 1, 1, 1, 1), &one, &one, &one).map(drop);
    assert!(e.is_ok(), "{e:?}");
}

/// On the GPU: a tensor the device has no room for is `Error::OutOfMemory` naming the device.
#[test]
fn tensors_larger_than_the_gpu_are_an_error() {
    let Some(dev) = common::device("device out of memory") else {
        return;
    };
    let (_, total) = dev.mem_info().unwrap();
    let e = Tensor::poisoned(&dev, DType::F16, total)
        .map(drop)
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::OutOfMemory {
                kind: sdpa::MemoryKind::Device,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().starts_with("out of device memory"), "{e}");
}
