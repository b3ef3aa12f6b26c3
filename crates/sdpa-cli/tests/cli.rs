//! The `sdpa` binary end to end, on the CPU paths every machine has: `run` on .npy files
//! against the library's reference, errors for malformed input, `validate` and `bench`
//! falling back to the CPU reference with one line when there is no GPU.

use npyz::WriterBuilder;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The `sdpa` binary: cargo's path, or (on the GPU machine, where tests run from a staged
/// bundle) `../bin/sdpa` beside the test executable's folder, or $SDPA_BIN.
fn sdpa() -> Command {
    if let Some(p) = std::env::var_os("SDPA_BIN") {
        return Command::new(p);
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_sdpa"));
    if built.exists() {
        return Command::new(built);
    }
    let exe = std::env::current_exe().unwrap();
    Command::new(exe.parent().unwrap().join("../bin/sdpa"))
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sdpa-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn write_npy(path: &Path, data: &[f32], shape: &[u64]) {
    let f = std::fs::File::create(path).unwrap();
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(shape)
        .writer(std::io::BufWriter::new(f))
        .begin_nd()
        .unwrap();
    w.extend(data.iter().copied()).unwrap();
    w.finish().unwrap();
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

#[test]
fn run_on_npy_matches_the_reference() {
    // GQA (4 query heads, 2 kv heads), seq_q != seq_k, causal.
    let (b, h, hk, sq, sk, d) = (1, 4, 2, 5, 9, 64);
    let (q, k, v) = (
        values(b * h * sq * d, 1),
        values(b * hk * sk * d, 2),
        values(b * hk * sk * d, 3),
    );
    let paths = [tmp("q.npy"), tmp("k.npy"), tmp("v.npy"), tmp("o.npy")];
    write_npy(&paths[0], &q, &[b as u64, h as u64, sq as u64, d as u64]);
    write_npy(&paths[1], &k, &[b as u64, hk as u64, sk as u64, d as u64]);
    write_npy(&paths[2], &v, &[b as u64, hk as u64, sk as u64, d as u64]);
    let out = sdpa()
        .args(["run", "--backend", "cpu", "--causal", "--dtype", "f16"])
        .args([
            "--q",
            paths[0].to_str().unwrap(),
            "--k",
            paths[1].to_str().unwrap(),
        ])
        .args([
            "--v",
            paths[2].to_str().unwrap(),
            "--out",
            paths[3].to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let bytes = std::fs::read(&paths[3]).unwrap();
    let npy = npyz::NpyFile::new(&bytes[..]).unwrap();
    assert_eq!(npy.shape(), &[1, 4, 5, 64]);
    let got: Vec<f32> = npy.into_vec().unwrap();
    let p = sdpa::Problem::new(b, h, sq, sk, d)
        .with_kv_heads(hk)
        .with_causal(true);
    let round = |x: &[f32]| sdpa::decode(sdpa::DType::F16, &sdpa::encode(sdpa::DType::F16, x));
    let want = sdpa::reference(&p, &round(&q), &round(&k), &round(&v)).unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert!((f64::from(*g) - w).abs() < 1e-6, "{g} vs {w}");
    }
}

/// `run --dtype e4m3`: the CPU reference on the inputs quantized exactly as the library does
/// on the host (and, where a GPU is present, on the device: the same codes and scales), then
/// the GPU path (simulated or native) within the e4m3 tolerance of that reference.
#[test]
fn run_e4m3_matches_the_reference_on_quantized_inputs() {
    let (b, h, hk, sq, sk, d) = (1, 4, 2, 33, 70, 64);
    let (q, k, v) = (
        values(b * h * sq * d, 4),
        values(b * hk * sk * d, 5),
        values(b * hk * sk * d, 6),
    );
    let paths = [tmp("q8.npy"), tmp("k8.npy"), tmp("v8.npy"), tmp("o8.npy")];
    let shape = |hh: usize, s: usize| [b as u64, hh as u64, s as u64, d as u64];
    write_npy(&paths[0], &q, &shape(h, sq));
    write_npy(&paths[1], &k, &shape(hk, sk));
    write_npy(&paths[2], &v, &shape(hk, sk));
    let p = sdpa::Problem::new(b, h, sq, sk, d)
        .with_kv_heads(hk)
        .with_causal(true)
        .with_dtype(sdpa::DType::E4m3)
        .with_fp8_scaling(sdpa::Scaling::PerTensor)
        .with_out_dtype(sdpa::DType::Bf16);
    let deq = |x: &[f32], s: sdpa::TensorShape| -> Vec<f64> {
        let (c, sc) = sdpa::fp8::quantize_host(x, &s, p.fp8_scaling).unwrap();
        sdpa::fp8::dequantize_host(&c, &sc, &s, p.fp8_scaling)
            .into_iter()
            .map(f64::from)
            .collect()
    };
    let want = sdpa::reference(
        &p,
        &deq(&q, p.q_shape()),
        &deq(&k, p.kv_shape()),
        &deq(&v, p.kv_shape()),
    )
    .unwrap();
    let gpu = sdpa::Device::new(0).is_ok();
    for backend in ["cpu", "auto"] {
        if backend == "auto" && !gpu {
            if std::env::var("SDPA_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("SDPA_REQUIRE_GPU=1 but no GPU");
            }
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "run e4m3 on the GPU: skipped, no GPU");
            continue;
        }
        let out = sdpa()
            .args(["run", "--backend", backend, "--causal", "--dtype", "e4m3"])
            .args(["--scaling", "tensor", "--out-dtype", "bf16"])
            .args(["--q", paths[0].to_str().unwrap()])
            .args(["--k", paths[1].to_str().unwrap()])
            .args(["--v", paths[2].to_str().unwrap()])
            .args(["--out", paths[3].to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{backend}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let bytes = std::fs::read(&paths[3]).unwrap();
        let got: Vec<f32> = npyz::NpyFile::new(&bytes[..]).unwrap().into_vec().unwrap();
        let got: Vec<f64> = got.iter().map(|&x| f64::from(x)).collect();
        if backend == "cpu" {
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 1e-6, "{g} vs {w}");
            }
        } else {
            let r = sdpa::check::compare(&got, &want, p.dtype, 0);
            assert!(r.pass(), "{backend}: {r:?}");
        }
    }
}

#[test]
fn malformed_inputs_are_one_line_errors() {
    let bad = tmp("bad.npy");
    std::fs::write(&bad, b"not numpy at all").unwrap();
    let good = tmp("good.npy");
    write_npy(&good, &values(2 * 8 * 64, 4), &[1, 2, 8, 64]);
    let odd = tmp("odd.npy");
    write_npy(&odd, &values(2 * 8 * 32, 5), &[1, 2, 8, 32]);
    let flat = tmp("flat.npy");
    write_npy(&flat, &values(16, 6), &[16]);
    let g = good.to_str().unwrap();
    let cases: [(&[&str], &str); 5] = [
        (
            &["--q", bad.to_str().unwrap(), "--k", g, "--v", g],
            "not a .npy file",
        ),
        (
            &["--q", g, "--k", odd.to_str().unwrap(), "--v", g],
            "must match",
        ),
        (
            &["--q", g, "--k", g, "--v", flat.to_str().unwrap()],
            "must match",
        ),
        (
            &["--q", flat.to_str().unwrap(), "--k", g, "--v", g],
            "expected 4 dimensions",
        ),
        (
            &["--q", "/nonexistent/q.npy", "--k", g, "--v", g],
            "/nonexistent/q.npy",
        ),
    ];
    for (args, fragment) in cases {
        let out = sdpa()
            .arg("run")
            .args(args)
            .args([
                "--out",
                tmp("never.npy").to_str().unwrap(),
                "--backend",
                "cpu",
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(
            err.contains(fragment),
            "{args:?}: {err:?} lacks {fragment:?}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    let out = sdpa()
        .args([
            "run",
            "--q",
            g,
            "--k",
            g,
            "--v",
            g,
            "--out",
            "x.npy",
            "--backend",
            "tpu",
        ])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown backend \"tpu\""));
}

#[test]
fn validate_and_bench_work_with_or_without_a_gpu() {
    let out = sdpa()
        .args([
            "validate",
            "--backend",
            "cpu",
            "--shape",
            "1,2,33,47,64",
            "--dtype",
            "bf16",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("2 of 2 checks passed"), "{text}");

    let json = tmp("bench.json");
    let out = sdpa()
        .args([
            "bench",
            "--backend",
            "cpu",
            "--shape",
            "1,1,64,64,64",
            "--dtype",
            "f16",
        ])
        .args(["--budget-ms", "20", "--json", json.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let records: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let r = &records[0];
    for field in [
        "name", "batch", "heads", "seq_q", "seq_k", "head_dim", "causal", "dtype", "backend",
        "us_graph", "us_event", "tflops",
    ] {
        assert!(!r[field].is_null(), "record lacks {field}: {r}");
    }
    assert!(r["us_graph"].as_f64().unwrap() > 0.0);
}

/// `sdpa run` through the GPU (auto backend) agrees with the reference within the dtype's
/// tolerance; skipped with a printed reason where there is no GPU.
#[test]
fn run_on_the_gpu_matches_the_reference() {
    if let Err(e) = sdpa::Device::new(0) {
        if std::env::var("SDPA_REQUIRE_GPU").is_ok_and(|v| v == "1") {
            panic!("SDPA_REQUIRE_GPU=1 but no GPU: {e}");
        }
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "run on the GPU: skipped, no GPU ({e})");
        return;
    }
    let (b, h, sq, sk, d) = (2, 2, 77, 130, 128);
    let (q, k, v) = (
        values(b * h * sq * d, 7),
        values(b * h * sk * d, 8),
        values(b * h * sk * d, 9),
    );
    let paths = [tmp("gq.npy"), tmp("gk.npy"), tmp("gv.npy"), tmp("go.npy")];
    let shape = |s: usize| [b as u64, h as u64, s as u64, d as u64];
    write_npy(&paths[0], &q, &shape(sq));
    write_npy(&paths[1], &k, &shape(sk));
    write_npy(&paths[2], &v, &shape(sk));
    let out = sdpa()
        .args(["run", "--causal", "--dtype", "bf16"])
        .args([
            "--q",
            paths[0].to_str().unwrap(),
            "--k",
            paths[1].to_str().unwrap(),
        ])
        .args([
            "--v",
            paths[2].to_str().unwrap(),
            "--out",
            paths[3].to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&paths[3]).unwrap();
    let got: Vec<f32> = npyz::NpyFile::new(&bytes[..]).unwrap().into_vec().unwrap();
    let p = sdpa::Problem::new(b, h, sq, sk, d)
        .with_causal(true)
        .with_dtype(sdpa::DType::Bf16);
    let round = |x: &[f32]| sdpa::decode(p.dtype, &sdpa::encode(p.dtype, x));
    let want = sdpa::reference(&p, &round(&q), &round(&k), &round(&v)).unwrap();
    let got: Vec<f64> = got.iter().map(|&x| f64::from(x)).collect();
    let r = sdpa::check::compare(&got, &want, p.dtype, 0);
    assert!(r.pass(), "{r:?}");
}
