//! The catalogue of bad input: one table, each case an input, the expected error variant and a
//! fragment of the message that names the offending value. Cases go through the Rust API and
//! through the `sdpa` binary; none may panic, and the CLI must not write its output file. Tensor
//! cases (which need device buffers) run where a GPU is present.

mod common;

use npyz::WriterBuilder;
use sdpa::fp8::quantize_host;
use sdpa::{Backend, DType, Error, Layout, Problem, Scaling, Tensor};
use std::path::PathBuf;
use std::process::Command;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Invalid,
    Unsupported,
    Io,
}

fn kind(e: &Error) -> Kind {
    match e {
        Error::InvalidArgument(_) => Kind::Invalid,
        Error::Unsupported { .. } => Kind::Unsupported,
        Error::Io { .. } => Kind::Io,
        other => panic!("unexpected error variant: {other:?}"),
    }
}

fn p(b: usize, h: usize, sq: usize, sk: usize, d: usize) -> Problem {
    Problem::new(b, h, sq, sk, d)
}

type ApiCase = (
    &'static str,
    Box<dyn Fn() -> Result<(), Error>>,
    Kind,
    &'static str,
);

fn api_cases() -> Vec<ApiCase> {
    let v = |pr: Problem| -> Box<dyn Fn() -> Result<(), Error>> { Box::new(move || pr.validate()) };
    let sup = |b: Backend, pr: Problem| -> Box<dyn Fn() -> Result<(), Error>> {
        Box::new(move || b.supports(None, &pr))
    };
    use Kind::*;
    vec![
        (
            "batch 0",
            v(p(0, 1, 4, 4, 64)),
            Invalid,
            "batch must be at least 1, got 0",
        ),
        (
            "heads 0",
            v(p(1, 0, 4, 4, 64)),
            Invalid,
            "heads must be at least 1",
        ),
        (
            "kv_heads 0",
            v(p(1, 4, 4, 4, 64).with_kv_heads(0)),
            Invalid,
            "kv_heads must be at least 1",
        ),
        (
            "seq_q 0",
            v(p(1, 1, 0, 4, 64)),
            Invalid,
            "seq_q must be at least 1",
        ),
        (
            "seq_k 0",
            v(p(1, 1, 4, 0, 64)),
            Invalid,
            "seq_k must be at least 1",
        ),
        (
            "head_dim 0",
            v(p(1, 1, 4, 4, 0)),
            Invalid,
            "head_dim must be at least 1",
        ),
        (
            "heads 6 kv 4",
            v(p(1, 6, 4, 4, 64).with_kv_heads(4)),
            Invalid,
            "heads (6) must be a multiple of kv_heads (4)",
        ),
        (
            "heads 5 kv 2",
            v(p(1, 5, 4, 4, 64).with_kv_heads(2)),
            Invalid,
            "kv_heads (2)",
        ),
        (
            "kv_heads > heads",
            v(p(1, 2, 4, 4, 64).with_kv_heads(4)),
            Invalid,
            "heads (2)",
        ),
        (
            "scale -1",
            v(p(1, 1, 4, 4, 64).with_scale(-1.0)),
            Invalid,
            "got -1",
        ),
        (
            "scale 0",
            v(p(1, 1, 4, 4, 64).with_scale(0.0)),
            Invalid,
            "got 0",
        ),
        (
            "scale NaN",
            v(p(1, 1, 4, 4, 64).with_scale(f32::NAN)),
            Invalid,
            "got NaN",
        ),
        (
            "scale inf",
            v(p(1, 1, 4, 4, 64).with_scale(f32::INFINITY)),
            Invalid,
            "got inf",
        ),
        (
            "usize overflow",
            v(p(usize::MAX, 2, 4, 4, 64)),
            Invalid,
            "more than 2^40",
        ),
        (
            "Q over 2^40",
            v(p(1 << 13, 1 << 10, 1 << 12, 4, 64)),
            Invalid,
            "Q would hold",
        ),
        (
            "K over 2^40",
            v(p(1, 1, 4, 1 << 40, 64)),
            Invalid,
            "K would hold",
        ),
        (
            "scalar d84",
            sup(Backend::Scalar, p(1, 1, 4, 4, 84)),
            Unsupported,
            "multiples of 8",
        ),
        (
            "wmma d32",
            sup(Backend::Wmma, p(1, 1, 4, 4, 32)),
            Unsupported,
            "head_dim 32",
        ),
        (
            "cutlass d264",
            sup(Backend::Cutlass, p(1, 1, 4, 4, 264)),
            Unsupported,
            "head_dim 264",
        ),
        (
            "wmma batch 70000",
            sup(Backend::Wmma, p(70000, 1, 4, 4, 64)),
            Unsupported,
            "batch (70000)",
        ),
        (
            "scalar heads 70000",
            sup(Backend::Scalar, p(1, 70000, 4, 4, 64)),
            Unsupported,
            "heads (70000)",
        ),
        (
            "cublas without GPU",
            sup(Backend::Cublas, p(1, 1, 4, 4, 64)),
            Unsupported,
            "needs a GPU",
        ),
        (
            "scalar without GPU",
            sup(Backend::Scalar, p(1, 1, 4, 4, 64)),
            Unsupported,
            "needs a GPU",
        ),
        (
            "auto without GPU",
            sup(Backend::Auto, p(1, 1, 4, 4, 64)),
            Unsupported,
            "no GPU backend",
        ),
        (
            "backend cudnn9",
            Box::new(|| "cudnn9".parse::<Backend>().map(|_| ())),
            Invalid,
            "unknown backend \"cudnn9\"",
        ),
        (
            "backend empty",
            Box::new(|| "".parse::<Backend>().map(|_| ())),
            Invalid,
            "unknown backend \"\"",
        ),
        (
            "dtype fp64",
            Box::new(|| "fp64".parse::<DType>().map(|_| ())),
            Invalid,
            "unknown dtype \"fp64\"",
        ),
        (
            "dtype e5m2",
            Box::new(|| "e5m2".parse::<DType>().map(|_| ())),
            Invalid,
            "\"e5m2\"",
        ),
        (
            "layout bsdh",
            Box::new(|| "bsdh".parse::<Layout>().map(|_| ())),
            Invalid,
            "unknown layout \"bsdh\"",
        ),
        (
            "problem s3k",
            Box::new(|| sdpa_harness::named_problem("s3k").map(|_| ())),
            Invalid,
            "unknown problem \"s3k\"",
        ),
        (
            "e4m3 output",
            v(p(1, 1, 4, 4, 64)
                .with_dtype(DType::E4m3)
                .with_out_dtype(DType::E4m3)),
            Invalid,
            "output dtype must be f16, bf16 or f32, got e4m3",
        ),
        (
            "f16 in, bf16 out",
            v(p(1, 1, 4, 4, 64).with_out_dtype(DType::Bf16)),
            Invalid,
            "output dtype bf16 differs from input dtype f16",
        ),
        (
            "f32 in",
            v(p(1, 1, 4, 4, 64).with_dtype(DType::F32)),
            Invalid,
            "f32 is an output type only",
        ),
        (
            "e4m3 in, f32 out",
            v(p(1, 1, 4, 4, 64)
                .with_dtype(DType::E4m3)
                .with_out_dtype(DType::F32)),
            Invalid,
            "the output of e4m3 inputs is f16 or bf16, got f32",
        ),
        (
            "fp8 scaling row",
            Box::new(|| "row".parse::<Scaling>().map(|_| ())),
            Invalid,
            "unknown fp8 scaling \"row\"",
        ),
        (
            "fp8 quantize inf",
            Box::new(|| {
                let s = p(1, 1, 1, 2, 2).q_shape();
                quantize_host(&[1.0, f32::INFINITY], &s, Scaling::PerTensor).map(|_| ())
            }),
            Invalid,
            "absmax inf",
        ),
        (
            "fp8 quantize short",
            Box::new(|| {
                let s = p(1, 2, 3, 3, 4).q_shape();
                quantize_host(&[0.5; 20], &s, Scaling::PerHead).map(|_| ())
            }),
            Invalid,
            "20 values for shape [1, 2, 3, 4] bhsd, which holds 24",
        ),
        (
            "fp8 scale nan",
            Box::new(|| sdpa::fp8::scales_from_amax(&[1.0, f32::NAN]).map(|_| ())),
            Invalid,
            "scale group 1 has absmax NaN",
        ),
        (
            "reference q short",
            Box::new(|| {
                sdpa::reference(&p(1, 1, 2, 2, 2), &[0.0; 3], &[0.0; 4], &[0.0; 4]).map(|_| ())
            }),
            Invalid,
            "q has 3 elements",
        ),
        (
            "reference k long",
            Box::new(|| {
                sdpa::reference(&p(1, 1, 2, 2, 2), &[0.0; 4], &[0.0; 5], &[0.0; 4]).map(|_| ())
            }),
            Invalid,
            "k has 5 elements",
        ),
        (
            "reference v short",
            Box::new(|| {
                sdpa::reference(&p(1, 1, 2, 2, 2), &[0.0; 4], &[0.0; 4], &[0.0; 1]).map(|_| ())
            }),
            Invalid,
            "v has 1 elements",
        ),
    ]
}

#[test]
fn api_errors_name_the_offending_value() {
    let cases = api_cases();
    for (name, f, want, fragment) in &cases {
        let e = f().expect_err(name);
        assert_eq!(kind(&e), *want, "{name}: {e}");
        assert!(
            e.to_string().contains(fragment),
            "{name}: {e:?} lacks {fragment:?}"
        );
    }
    assert!(cases.len() >= 33);
}

/// The `sdpa` binary: cargo's path, or (on the GPU machine, where tests run from a staged
/// bundle) `../bin/sdpa` beside the test executable's folder, or $SDPA_BIN.
fn sdpa_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("SDPA_BIN") {
        return p.into();
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_sdpa"));
    if built.exists() {
        return built;
    }
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().join("../bin/sdpa")
}

fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("sdpa-catalogue-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn npy<T: npyz::AutoSerialize + Copy>(name: &str, data: &[T], shape: &[u64]) -> String {
    let path = dir().join(name);
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(shape)
        .writer(std::io::BufWriter::new(
            std::fs::File::create(&path).unwrap(),
        ))
        .begin_nd()
        .unwrap();
    w.extend(data.iter().copied()).unwrap();
    w.finish().unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn cli_errors_are_one_line_and_write_nothing() {
    let good = npy("good.npy", &[0.5f32; 2 * 8 * 64], &[1, 2, 8, 64]);
    let k3 = npy("k3.npy", &[0.5f32; 3 * 8 * 64], &[1, 3, 8, 64]);
    let d32 = npy("d32.npy", &[0.5f32; 2 * 8 * 32], &[1, 2, 8, 32]);
    let flat = npy("flat.npy", &[0.5f32; 16], &[16]);
    let five = npy("five.npy", &[0.5f32; 2 * 8 * 64], &[1, 1, 2, 8, 64]);
    let ints = npy("i32.npy", &[1i32; 2 * 8 * 64], &[1, 2, 8, 64]);
    let garbage = dir().join("garbage.npy");
    std::fs::write(&garbage, b"\x93NUMPY garbage").unwrap();
    let garbage = garbage.to_str().unwrap().to_string();
    let g = good.as_str();
    let run = |q: &str, k: &str, v: &str, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = ["run", "--q", q, "--k", k, "--v", v]
            .map(String::from)
            .to_vec();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let cases: Vec<(Vec<String>, &str)> = vec![
        (run(&garbage, g, g, &[]), "not a .npy file"),
        (run(g, &k3, g, &[]), "must match"),
        (run(&flat, g, g, &[]), "expected 4 dimensions"),
        (run(&five, g, g, &[]), "expected 4 dimensions"),
        (run("/nonexistent/q.npy", g, g, &[]), "/nonexistent/q.npy"),
        (
            run(g, g, g, &["--backend", "tpu"]),
            "unknown backend \"tpu\"",
        ),
        (run(g, g, g, &["--dtype", "f8"]), "unknown dtype \"f8\""),
        (
            run(g, g, g, &["--layout", "sbhd"]),
            "unknown layout \"sbhd\"",
        ),
        (run(g, &d32, &d32, &[]), "disagree on batch or head_dim"),
        (run(g, g, g, &["--scale=-2"]), "got -2"),
        (run(&ints, g, g, &[]), "dtype <i4 is not supported"),
        (run(g, &k3, &k3, &[]), "multiple of kv_heads (3)"),
        (
            ["validate", "--shape", "1,2,3"].map(String::from).to_vec(),
            "expected BATCH,HEADS,SEQ_Q,SEQ_K,HEAD_DIM",
        ),
        (
            ["validate", "--shape", "a,b,c,d,e"]
                .map(String::from)
                .to_vec(),
            "not numbers",
        ),
        (
            ["validate", "--causal", "maybe"].map(String::from).to_vec(),
            "--causal \"maybe\"",
        ),
        (
            ["bench", "--problem", "nope"].map(String::from).to_vec(),
            "unknown problem \"nope\"",
        ),
        (
            ["validate", "--dtype", "f32"].map(String::from).to_vec(),
            "--dtype f32: f32 is an output type only",
        ),
        (
            ["validate", "--kv-heads", "3", "--problem", "mission"]
                .map(String::from)
                .to_vec(),
            "kv_heads (3)",
        ),
    ];
    let out_path = dir().join("out.npy");
    for (args, fragment) in &cases {
        let _ = std::fs::remove_file(&out_path);
        let mut cmd = Command::new(sdpa_bin());
        cmd.args(args);
        if args[0] == "run" {
            cmd.args(["--out", out_path.to_str().unwrap()]);
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(
            err.contains(fragment),
            "{args:?}: {err:?} lacks {fragment:?}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(!out_path.exists(), "{args:?} wrote its output");
    }
    assert!(api_cases().len() + cases.len() >= 40);
}

#[test]
fn tensor_errors_launch_nothing_and_leave_the_output_alone() {
    let Some(dev) = common::device("catalogue tensors") else {
        return;
    };
    let pr = p(1, 2, 8, 8, 64);
    let n = pr.q_len().unwrap();
    let t = |dtype, len| Tensor::from_f32(&dev, dtype, &vec![0.5; len]).unwrap();
    let (q, k, v) = (t(DType::F16, n), t(DType::F16, n), t(DType::F16, n));
    let mut ran = Vec::new();
    for backend in Backend::ALL {
        if backend.supports(Some(&dev), &pr).is_err() {
            continue; // e.g. the sm_90a kernel on another GPU
        }
        let mut out = Tensor::poisoned(&dev, DType::F16, n).unwrap();
        let bf = t(DType::Bf16, n);
        let short = t(DType::F16, n - 1);
        let cases: Vec<(&str, sdpa::Result<()>, &str)> = vec![
            (
                "q bf16",
                common::forward(&dev, &pr, backend, [&bf, &k, &v], &mut out),
                "q is bf16",
            ),
            (
                "k bf16",
                common::forward(&dev, &pr, backend, [&q, &bf, &v], &mut out),
                "k is bf16",
            ),
            (
                "v short",
                common::forward(&dev, &pr, backend, [&q, &k, &short], &mut out),
                "v holds 1023 elements",
            ),
            (
                "k short",
                common::forward(&dev, &pr, backend, [&q, &short, &v], &mut out),
                "k holds 1023",
            ),
            (
                "problem bf16",
                common::forward(
                    &dev,
                    &pr.with_dtype(DType::Bf16),
                    backend,
                    [&q, &k, &v],
                    &mut out,
                ),
                "the problem says bf16",
            ),
            (
                "kv_heads 3",
                common::forward(&dev, &pr.with_kv_heads(3), backend, [&q, &k, &v], &mut out),
                "kv_heads (3)",
            ),
        ];
        for (name, r, fragment) in cases {
            let e = r.expect_err(name);
            assert!(e.to_string().contains(fragment), "{backend} {name}: {e}");
        }
        let mut short_out = Tensor::poisoned(&dev, DType::F16, n - 1).unwrap();
        let e = common::forward(&dev, &pr, backend, [&q, &k, &v], &mut short_out).unwrap_err();
        assert!(e.to_string().contains("out holds 1023"), "{backend}: {e}");
        // A fused kernel refuses a head dim sdpa-sys/cpp/kernels.txt does not instantiate for it
        // (cublas takes any head_dim).
        let kernels: Vec<_> = sdpa::backend::instances()
            .filter(|i| i.backend == backend)
            .collect();
        if !kernels.is_empty() {
            let d = (1..=8)
                .map(|i| 16 * i)
                .find(|&d| {
                    !kernels
                        .iter()
                        .any(|k| k.dtype == DType::F16 && k.head_dim == d)
                })
                .expect("an f16 head dim up to 128 that is not instantiated");
            let e = sdpa::forward(
                &dev,
                &p(1, 1, 8, 8, d),
                backend,
                sdpa::Tensors {
                    q: &q,
                    k: &k,
                    v: &v,
                    out: &mut out,
                },
                sdpa::Extras::default(),
            )
            .unwrap_err();
            assert_eq!(kind(&e), Kind::Unsupported, "{backend} d{d}: {e}");
        }
        assert!(
            out.to_f32(&dev).unwrap().iter().all(|x| x.is_nan()),
            "{backend} wrote output"
        );
        ran.push((backend, pr));
    }
    // The cases must have met every GPU backend this GPU runs, and the host and auto paths.
    common::assert_all_ran("catalogue tensors", &dev, &ran);
    for b in [Backend::Cpu, Backend::Auto] {
        assert!(
            ran.iter().any(|(r, _)| *r == b),
            "catalogue tensors: {b} never ran"
        );
    }
}

/// e4m3 tensors: scales missing, non-finite or of the wrong count; tensors quantized for
/// another shape or scaling than the problem says; 16-bit-only calls on e4m3. Every case an
/// `InvalidArgument` naming the value, and the output untouched.
#[test]
fn fp8_tensor_errors_name_the_value() {
    let Some(dev) = common::device("catalogue fp8") else {
        return;
    };
    let pr = p(1, 2, 8, 8, 64).with_dtype(DType::E4m3);
    let (shape, n) = (pr.q_shape(), pr.q_len().unwrap());
    let codes = vec![0x38u8; n];
    let e4 = |scales: &[f32], sc| Tensor::from_e4m3(&dev, &codes, scales, shape, sc);
    let cases: Vec<(&str, sdpa::Result<Tensor>, &str)> = vec![
        ("no scales", e4(&[], Scaling::PerTensor), "0 scales given"),
        (
            "nan scale",
            e4(&[f32::NAN], Scaling::PerTensor),
            "scale 0 is NaN",
        ),
        (
            "inf scale",
            e4(&[1.0, f32::INFINITY], Scaling::PerHead),
            "scale 1 is inf",
        ),
        ("zero scale", e4(&[0.0], Scaling::PerTensor), "scale 0 is 0"),
        (
            "negative scale",
            e4(&[-2.0, 1.0], Scaling::PerHead),
            "scale 0 is -2",
        ),
        (
            "per-head count",
            e4(&[1.0], Scaling::PerHead),
            "head scaling of [1, 2, 8, 64] bhsd needs 2",
        ),
        (
            "codes short",
            Tensor::from_e4m3(&dev, &codes[1..], &[1.0], shape, Scaling::PerTensor),
            "1023 values for shape",
        ),
        (
            "from_f32 e4m3",
            Tensor::from_f32(&dev, DType::E4m3, &[1.0]),
            "carry scales",
        ),
        (
            "poisoned e4m3",
            Tensor::poisoned(&dev, DType::E4m3, 4),
            "not e4m3",
        ),
        (
            "zeros e4m3",
            Tensor::zeros(&dev, DType::E4m3, 4),
            "carry scales",
        ),
        (
            "zeros empty",
            Tensor::zeros(&dev, DType::Bf16, 0),
            "at least one",
        ),
        (
            "uninit e4m3",
            Tensor::uninit(&dev, DType::E4m3, 4),
            "carry scales",
        ),
        (
            "uninit empty",
            Tensor::uninit(&dev, DType::F16, 0),
            "at least one",
        ),
        (
            "quantize e4m3",
            e4(&[1.0], Scaling::PerTensor)
                .and_then(|t| Tensor::quantize(&dev, &t, shape, Scaling::PerTensor)),
            "takes an f16 or bf16 tensor, got e4m3",
        ),
        (
            "dequantize f16",
            Tensor::from_f32(&dev, DType::F16, &[1.0]).and_then(|t| t.dequantize(&dev, DType::F16)),
            "is f16, not e4m3",
        ),
        (
            "quantize empty",
            Tensor::quantize_f32(&dev, &[], shape, Scaling::PerTensor),
            "0 values for shape",
        ),
    ];
    for (name, r, fragment) in cases {
        let e = r.err().unwrap_or_else(|| panic!("{name}: accepted"));
        assert_eq!(kind(&e), Kind::Invalid, "{name}: {e}");
        assert!(e.to_string().contains(fragment), "{name}: {e}");
    }
    // forward with e4m3 tensors that disagree with the problem.
    let q = e4(&[1.0, 1.0], Scaling::PerHead).unwrap();
    let k = e4(&[1.0, 1.0], Scaling::PerHead).unwrap();
    let other = Tensor::from_e4m3(
        &dev,
        &vec![0x38; 2 * 8 * 64],
        &[1.0],
        p(1, 1, 16, 16, 64).q_shape(),
        Scaling::PerTensor,
    )
    .unwrap();
    let per_tensor = e4(&[1.0], Scaling::PerTensor).unwrap();
    let f16 = Tensor::from_f32(&dev, DType::F16, &vec![0.5; n]).unwrap();
    let mut out = Tensor::poisoned(&dev, DType::F16, n).unwrap();
    let mut ran = Vec::new();
    for backend in Backend::ALL {
        let fwd: Vec<(&str, sdpa::Result<()>, &str)> = vec![
            (
                "v tensor-scaled",
                common::forward(&dev, &pr, backend, [&q, &k, &per_tensor], &mut out),
                "v has tensor scales, the problem says head",
            ),
            (
                "k other shape",
                common::forward(
                    &dev,
                    &pr.with_fp8_scaling(Scaling::PerTensor),
                    backend,
                    [&per_tensor, &other, &per_tensor],
                    &mut out,
                ),
                "k was quantized with shape [1, 1, 16, 64] bhsd, the problem's k is [1, 2, 8, 64] bhsd",
            ),
            (
                "q f16",
                common::forward(&dev, &pr, backend, [&f16, &k, &k], &mut out),
                "q is f16, the problem says e4m3",
            ),
            (
                "out bf16",
                common::forward(
                    &dev,
                    &pr.with_out_dtype(DType::Bf16),
                    backend,
                    [&q, &k, &k],
                    &mut out,
                ),
                "out is f16, the problem says bf16",
            ),
        ];
        for (name, r, fragment) in fwd {
            let e = r.expect_err(name);
            assert_eq!(kind(&e), Kind::Invalid, "{backend} {name}: {e}");
            assert!(e.to_string().contains(fragment), "{backend} {name}: {e}");
        }
        ran.push((backend, pr));
    }
    common::assert_ran("catalogue fp8", &ran);
    assert!(
        out.to_f32(&dev).unwrap().iter().all(|x| x.is_nan()),
        "output written"
    );
}
