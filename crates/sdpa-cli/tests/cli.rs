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
    // GQA (4 query heads, 2 kv heads), seq_q != seq_k, causal; V as wide as Q and K, then
    // narrower (the output takes V's head dim).
    for dv in [64, 32] {
        run_matches_the_reference_with_v_of(dv);
    }
}

fn run_matches_the_reference_with_v_of(dv: usize) {
    let (b, h, hk, sq, sk, d) = (1, 4, 2, 5, 9, 64);
    let (q, k, v) = (
        values(b * h * sq * d, 1),
        values(b * hk * sk * d, 2),
        values(b * hk * sk * dv, 3),
    );
    let paths = [tmp("q.npy"), tmp("k.npy"), tmp("v.npy"), tmp("o.npy")];
    write_npy(&paths[0], &q, &[b as u64, h as u64, sq as u64, d as u64]);
    write_npy(&paths[1], &k, &[b as u64, hk as u64, sk as u64, d as u64]);
    write_npy(&paths[2], &v, &[b as u64, hk as u64, sk as u64, dv as u64]);
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
    assert_success(&out);

    let bytes = std::fs::read(&paths[3]).unwrap();
    let npy = npyz::NpyFile::new(&bytes[..]).unwrap();
    assert_eq!(npy.shape(), &[1, 4, 5, dv as u64]);
    let got: Vec<f32> = npy.into_vec().unwrap();
    let p = sdpa::Problem::new(b, h, sq, sk, d)
        .with_head_dim_v(dv)
        .with_kv_heads(hk)
        .with_causal(true);
    let round = |x: &[f32]| sdpa::decode(sdpa::DType::F16, &sdpa::encode(sdpa::DType::F16, x));
    let want = sdpa::reference(&p, &round(&q), &round(&k), &round(&v)).unwrap();
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert!((f64::from(*g) - w).abs() < 1e-6, "{g} vs {w}");
    }
}

/// `run --v-in-k N`: V is the first N columns of K's rows (MLA's latent cache), no V file; the
/// output is the reference's with V materialized as those columns, and `--v` with it is refused.
#[test]
fn run_reads_v_from_k_rows() {
    let (b, h, sq, sk, d, dv) = (2, 8, 2, 40, 64, 48);
    let (q, k) = (values(b * h * sq * d, 7), values(b * sk * d, 8));
    let v: Vec<f32> = k.chunks(d).flat_map(|row| row[..dv].to_vec()).collect();
    let paths = [tmp("lq.npy"), tmp("lk.npy"), tmp("lo.npy"), tmp("lv.npy")];
    write_npy(&paths[0], &q, &[b as u64, h as u64, sq as u64, d as u64]);
    write_npy(&paths[1], &k, &[b as u64, 1, sk as u64, d as u64]);
    write_npy(&paths[3], &v, &[b as u64, 1, sk as u64, dv as u64]);
    let (q_arg, k_arg) = (paths[0].to_str().unwrap(), paths[1].to_str().unwrap());
    let out = sdpa()
        .args(["run", "--backend", "cpu", "--causal", "--dtype", "bf16"])
        .args(["--q", q_arg, "--k", k_arg, "--v-in-k", &dv.to_string()])
        .args(["--out", paths[2].to_str().unwrap()])
        .output()
        .unwrap();
    assert_success(&out);
    let bytes = std::fs::read(&paths[2]).unwrap();
    let npy = npyz::NpyFile::new(&bytes[..]).unwrap();
    assert_eq!(npy.shape(), &[b as u64, h as u64, sq as u64, dv as u64]);
    let got: Vec<f32> = npy.into_vec().unwrap();
    let p = sdpa::Problem::new(b, h, sq, sk, d)
        .with_kv_heads(1)
        .with_head_dim_v(dv)
        .with_causal(true);
    let round = |x: &[f32]| sdpa::decode(sdpa::DType::Bf16, &sdpa::encode(sdpa::DType::Bf16, x));
    let want = sdpa::reference(&p, &round(&q), &round(&k), &round(&v)).unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert!((f64::from(*g) - w).abs() < 1e-6, "{g} vs {w}");
    }
    let both = sdpa()
        .args(["run", "--backend", "cpu", "--q", q_arg, "--k", k_arg])
        .args([
            "--v",
            paths[3].to_str().unwrap(),
            "--v-in-k",
            &dv.to_string(),
        ])
        .args(["--out", paths[2].to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!both.status.success());
}

/// `run` with a sliding window, softcap, ALiBi slopes from a file and the log-sum-exp written to
/// one: what the library's reference gives on the same rounded inputs.
#[test]
fn run_takes_windows_softcap_alibi_and_writes_the_lse() {
    let (b, h, sq, sk, d) = (2, 3, 6, 9, 8);
    let (q, k, v) = (
        values(b * h * sq * d, 4),
        values(b * h * sk * d, 5),
        values(b * h * sk * d, 6),
    );
    let slopes = [0.5f32, 0.25, 0.125];
    let paths = [
        tmp("wq.npy"),
        tmp("wk.npy"),
        tmp("wv.npy"),
        tmp("wo.npy"),
        tmp("walibi.npy"),
        tmp("wlse.npy"),
    ];
    write_npy(&paths[0], &q, &[b as u64, h as u64, sq as u64, d as u64]);
    write_npy(&paths[1], &k, &[b as u64, h as u64, sk as u64, d as u64]);
    write_npy(&paths[2], &v, &[b as u64, h as u64, sk as u64, d as u64]);
    write_npy(&paths[4], &slopes, &[h as u64]);
    let arg = |i: usize| paths[i].to_str().unwrap().to_string();
    let out = sdpa()
        .args([
            "run",
            "--backend",
            "cpu",
            "--dtype",
            "bf16",
            "--window",
            "2,1",
        ])
        .args(["--softcap", "3", "--alibi", &arg(4), "--lse", &arg(5)])
        .args([
            "--q",
            &arg(0),
            "--k",
            &arg(1),
            "--v",
            &arg(2),
            "--out",
            &arg(3),
        ])
        .output()
        .unwrap();
    assert_success(&out);
    let read = |path: &Path| -> (Vec<u64>, Vec<f32>) {
        let bytes = std::fs::read(path).unwrap();
        let npy = npyz::NpyFile::new(&bytes[..]).unwrap();
        (npy.shape().to_vec(), npy.into_vec().unwrap())
    };
    let p = sdpa::Problem::new(b, h, sq, sk, d)
        .with_mask(sdpa::Mask::Window {
            left: Some(2),
            right: Some(1),
        })
        .with_softcap(3.0)
        .with_alibi(sdpa::Alibi::PerHead);
    let round = |x: &[f32]| sdpa::decode(sdpa::DType::Bf16, &sdpa::encode(sdpa::DType::Bf16, x));
    let want =
        sdpa::reference_with(&p, &round(&q), &round(&k), &round(&v), Some(&slopes), None).unwrap();
    let (shape, got) = read(&paths[3]);
    assert_eq!(shape, [2, 3, 6, 8]);
    for (g, w) in got.iter().zip(&want.out) {
        assert!((f64::from(*g) - w).abs() < 1e-6, "{g} vs {w}");
    }
    let (shape, lse) = read(&paths[5]);
    assert_eq!(shape, [2, 3, 6]);
    for (g, w) in lse.iter().zip(&want.lse) {
        assert!((f64::from(*g) - w).abs() < 1e-5, "lse {g} vs {w}");
    }
    // Slopes of the wrong length are an error before anything runs.
    write_npy(&paths[4], &slopes[..2], &[2]);
    let out = sdpa()
        .args(["run", "--backend", "cpu", "--alibi", &arg(4)])
        .args([
            "--q",
            &arg(0),
            "--k",
            &arg(1),
            "--v",
            &arg(2),
            "--out",
            &arg(3),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("expected [3]"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `run --sinks`: one logit per query head from a file, what the library's reference gives with
/// those sinks (output and log-sum-exp, a row that sees no key included); sinks of the wrong
/// shape, NaN or +inf are errors before anything runs.
#[test]
fn run_takes_sinks() {
    let (b, h, sq, sk, d) = (1, 3, 7, 5, 8);
    let (q, k, v) = (
        values(b * h * sq * d, 7),
        values(b * h * sk * d, 8),
        values(b * h * sk * d, 9),
    );
    let sinks = [0.5f32, f32::NEG_INFINITY, 2.0];
    let paths = [
        tmp("sq.npy"),
        tmp("sk.npy"),
        tmp("sv.npy"),
        tmp("so.npy"),
        tmp("ssinks.npy"),
        tmp("slse.npy"),
    ];
    write_npy(&paths[0], &q, &[b as u64, h as u64, sq as u64, d as u64]);
    write_npy(&paths[1], &k, &[b as u64, h as u64, sk as u64, d as u64]);
    write_npy(&paths[2], &v, &[b as u64, h as u64, sk as u64, d as u64]);
    write_npy(&paths[4], &sinks, &[h as u64]);
    let arg = |i: usize| paths[i].to_str().unwrap().to_string();
    let run = || {
        sdpa()
            .args(["run", "--backend", "cpu", "--causal", "--sinks", &arg(4)])
            .args([
                "--lse",
                &arg(5),
                "--q",
                &arg(0),
                "--k",
                &arg(1),
                "--v",
                &arg(2),
            ])
            .args(["--out", &arg(3)])
            .output()
            .unwrap()
    };
    assert_success(&run());
    let read = |path: &Path| -> Vec<f32> {
        let bytes = std::fs::read(path).unwrap();
        npyz::NpyFile::new(&bytes[..]).unwrap().into_vec().unwrap()
    };
    // Causal with seq_q 7 > seq_k 5: rows 0 and 1 see no key.
    let p = sdpa::Problem::new(b, h, sq, sk, d)
        .with_causal(true)
        .with_sinks(true);
    let round = |x: &[f32]| sdpa::decode(sdpa::DType::F16, &sdpa::encode(sdpa::DType::F16, x));
    let want =
        sdpa::reference_with(&p, &round(&q), &round(&k), &round(&v), None, Some(&sinks)).unwrap();
    for (g, w) in read(&paths[3]).iter().zip(&want.out) {
        assert!((f64::from(*g) - w).abs() < 1e-3, "{g} vs {w}");
    }
    let lse = read(&paths[5]);
    assert_eq!(
        lse[0], 0.5,
        "a row without keys has its sink as log-sum-exp"
    );
    for (g, w) in lse.iter().zip(&want.lse) {
        assert!(
            (f64::from(*g) - w).abs() < 1e-5 || f64::from(*g) == *w,
            "lse {g} vs {w}"
        );
    }
    for (bad, shape, says) in [
        (vec![0.5f32, 1.0], vec![2u64], "expected [3]"),
        (vec![0.5, f32::NAN, 1.0], vec![3], "sink 1 is NaN"),
        (vec![0.5, 1.0, f32::INFINITY], vec![3], "sink 2 is inf"),
    ] {
        write_npy(&paths[4], &bad, &shape);
        let out = run();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{err}");
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
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect()
    };
    let want = sdpa::reference(
        &p,
        &deq(&q, p.q_shape()),
        &deq(&k, p.k_shape()),
        &deq(&v, p.v_shape()),
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
            let r = sdpa_harness::check::compare(&got, &want, p.dtype, 0);
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
    let short = tmp("short.npy");
    write_npy(&short, &values(2 * 4 * 64, 7), &[1, 2, 4, 64]);
    let cases: [(&[&str], &str); 6] = [
        (
            &["--q", bad.to_str().unwrap(), "--k", g, "--v", g],
            "not a .npy file",
        ),
        (
            &["--q", g, "--k", odd.to_str().unwrap(), "--v", g],
            "disagree on batch or head_dim",
        ),
        (
            &["--q", g, "--k", g, "--v", short.to_str().unwrap()],
            "must match but for the head dim",
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
    assert_success(&out);
    let records: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let r = &records[0];
    for field in [
        "name",
        "batch",
        "heads",
        "seq_q",
        "seq_k",
        "head_dim",
        "causal",
        "dtype",
        "backend",
        "us_graph",
        "us_event",
        "tflops",
        "n_graph",
        "us_graph_min",
        "us_graph_max",
        "us_graph_ci95",
        "n_event",
        "us_event_ci95",
        "commit",
        "time",
    ] {
        assert!(!r[field].is_null(), "record lacks {field}: {r}");
    }
    // The machine's state: null where NVML is missing (no driver here), but always recorded.
    for field in [
        "driver",
        "sm_clock_mhz",
        "sm_clock_max_mhz",
        "power_limit_w",
    ] {
        assert!(r.get(field).is_some(), "record lacks {field}: {r}");
    }
    assert!(r["us_graph"].as_f64().unwrap() > 0.0);
    let (lo, hi) = (
        r["us_graph_ci95"][0].as_f64(),
        r["us_graph_ci95"][1].as_f64(),
    );
    let med = r["us_graph"].as_f64().unwrap();
    assert!(
        lo.unwrap() <= med && med <= hi.unwrap(),
        "the interval brackets the median: {r}"
    );
}

/// `validate --dtype e4m3` runs each e4m3 case in both FP8 modes, the mode in the dtype column
/// and each row at its own bar (fast: from the emulated reference, whose error it prints);
/// `--fp8-mode` narrows it, and a mode without e4m3 is refused. `bench` records say which mode
/// ran. On the CPU reference, so it runs anywhere.
#[test]
fn validate_and_bench_report_both_fp8_modes() {
    let run = |extra: &[&str]| {
        let out = sdpa()
            .args(["validate", "--backend", "cpu", "--shape", "1,2,33,47,64"])
            .args(["--dtype", "e4m3", "--seed", "3"])
            .args(extra)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "{extra:?}: {text}");
        text
    };
    let both = run(&[]);
    assert!(both.contains("4 of 4 checks passed"), "{both}");
    let rows = |text: &str, label: &str| text.lines().filter(|l| l.contains(label)).count();
    assert_eq!(rows(&both, "e4m3>f16/accurate"), 2, "{both}");
    assert_eq!(rows(&both, "e4m3>f16/fast"), 2, "{both}");
    // The accurate rows keep the e4m3 bar (2e-2); the fast ones show the emulation's error.
    for line in both.lines().filter(|l| l.contains("e4m3>f16/")) {
        let fast = line.contains("/fast");
        assert!(fast || line.contains(" 2.0e-2 "), "{line}");
        assert_eq!(line.contains("(emulated "), fast, "{line}");
    }
    let fast = run(&["--fp8-mode", "fast"]);
    assert!(fast.contains("2 of 2 checks passed"), "{fast}");
    assert_eq!(rows(&fast, "e4m3>f16/accurate"), 0, "{fast}");
    let out = sdpa()
        .args(["validate", "--backend", "cpu", "--shape", "1,1,8,8,64"])
        .args(["--dtype", "f16", "--fp8-mode", "fast"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--fp8-mode applies to e4m3"),
        "{err}"
    );

    let json = tmp("bench-fp8.json");
    let out = sdpa()
        .args(["bench", "--backend", "cpu", "--shape", "1,1,64,64,64"])
        .args(["--dtype", "f16,e4m3", "--causal", "no"])
        .args(["--budget-ms", "20", "--json", json.to_str().unwrap()])
        .output()
        .unwrap();
    assert_success(&out);
    let records: Vec<serde_json::Value> =
        serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let modes: Vec<(String, serde_json::Value)> = records
        .iter()
        .map(|r| {
            (
                r["dtype"].as_str().unwrap().to_string(),
                r["fp8_mode"].clone(),
            )
        })
        .collect();
    assert_eq!(
        modes,
        [
            ("f16".to_string(), serde_json::Value::Null),
            ("e4m3".to_string(), "accurate".into()),
            ("e4m3".to_string(), "fast".into()),
        ]
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains(" e4m3/fast "), "{table}");
}

/// `run --fp8-mode`: fast on e4m3 runs (the cpu reference is exact in either mode), fast on
/// f16 is a one-line error naming the dtype.
#[test]
fn run_takes_the_fp8_mode() {
    let (b, h, s, d) = (1, 2, 16, 64);
    let x = values(b * h * s * d, 3);
    let paths = [tmp("fq.npy"), tmp("fo.npy"), tmp("fo2.npy")];
    write_npy(&paths[0], &x, &[b as u64, h as u64, s as u64, d as u64]);
    let q = paths[0].to_str().unwrap();
    let run = |dtype: &str, mode: &str, out: &Path| {
        sdpa()
            .args([
                "run",
                "--backend",
                "cpu",
                "--dtype",
                dtype,
                "--fp8-mode",
                mode,
            ])
            .args(["--q", q, "--k", q, "--v", q, "--out", out.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let fast = run("e4m3", "fast", &paths[1]);
    assert_success(&fast);
    assert!(String::from_utf8_lossy(&fast.stdout).contains("e4m3/head->f16 fast"));
    let acc = run("e4m3", "accurate", &paths[2]);
    assert!(acc.status.success());
    assert_eq!(
        std::fs::read(&paths[1]).unwrap(),
        std::fs::read(&paths[2]).unwrap()
    );
    let bad = run("f16", "fast", &paths[1]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success()
            && err.contains("fp8 mode fast needs e4m3 inputs, the problem is f16"),
        "{err}"
    );
    let unknown = run("e4m3", "quick", &paths[1]);
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("unknown fp8 mode \"quick\""));
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
    assert_success(&out);
    // The last line ends "(X backend)": X must be a GPU backend, not the CPU reference.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let used = stdout
        .trim_end()
        .rsplit_once('(')
        .and_then(|(_, rest)| rest.strip_suffix(" backend)"))
        .unwrap_or_else(|| panic!("no \"(X backend)\" in {stdout:?}"));
    let used: sdpa::Backend = used.parse().unwrap();
    assert!(sdpa::Backend::GPU.contains(&used), "ran on {used}");
    let bytes = std::fs::read(&paths[3]).unwrap();
    let got: Vec<f32> = npyz::NpyFile::new(&bytes[..]).unwrap().into_vec().unwrap();
    let p = sdpa::Problem::new(b, h, sq, sk, d)
        .with_causal(true)
        .with_dtype(sdpa::DType::Bf16);
    let round = |x: &[f32]| sdpa::decode(p.dtype, &sdpa::encode(p.dtype, x));
    let want = sdpa::reference(&p, &round(&q), &round(&k), &round(&v)).unwrap();
    let got: Vec<f64> = got.iter().map(|&x| f64::from(x)).collect();
    let r = sdpa_harness::check::compare(&got, &want, p.dtype, 0);
    assert!(r.pass(), "{r:?}");
}

/// The `sdpa` output of `cmd`, killed and reported as a failure when it runs past `limit`.
fn output_within(cmd: &mut Command, limit: std::time::Duration) -> std::process::Output {
    use std::process::Stdio;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            child.kill().unwrap();
            let _ = child.wait();
            panic!("{cmd:?} still running after {limit:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child.wait_with_output().unwrap()
}

/// Asserts a failed command: exit code 1, exactly one line on stderr containing `fragment`.
/// The command exited successfully; its stderr is the failure message otherwise.
fn assert_success(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn assert_one_line_error(out: &std::process::Output, fragment: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err:?}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err:?}");
    assert!(err.contains(fragment), "{err:?} lacks {fragment:?}");
}

/// `cmd` run under a shell limit such as `ulimit -v 1048576` (SIGXFSZ ignored, so a file-size
/// limit makes writes fail with EFBIG instead of killing the process).
fn under_limit(limit: &str, cmd: &Command) -> Command {
    let mut sh = Command::new("sh");
    sh.args([
        "-c",
        &format!("trap '' XFSZ; {limit} && exec \"$0\" \"$@\""),
    ])
    .arg(cmd.get_program())
    .args(cmd.get_args());
    sh
}

/// A .npy file: the preamble of `version` (1, 2 or 3), `header_len` as its length field, then
/// `rest` (header text and data) as given.
fn raw_npy(version: u8, header_len: u32, rest: &[u8]) -> Vec<u8> {
    let mut bytes = b"\x93NUMPY".to_vec();
    bytes.extend([version, 0]);
    match version {
        1 => bytes.extend((header_len as u16).to_le_bytes()),
        _ => bytes.extend(header_len.to_le_bytes()),
    }
    bytes.extend(rest);
    bytes
}

/// `sdpa run --backend cpu` on the files `q`, `k`, `v`, writing `out`.
fn run_qkv(q: &Path, k: &Path, v: &Path, out: &Path) -> Command {
    let mut cmd = sdpa();
    cmd.args(["run", "--backend", "cpu"]);
    for (flag, path) in [("--q", q), ("--k", k), ("--v", v), ("--out", out)] {
        cmd.arg(flag).arg(path);
    }
    cmd
}

/// `sdpa run --backend cpu` with `q` as the query file and a good K and V.
fn run_with_q(q: &Path, out: &Path) -> Command {
    let good = tmp("good-kv.npy");
    write_npy(&good, &values(2 * 8 * 64, 4), &[1, 2, 8, 64]);
    run_qkv(q, &good, &good, out)
}

/// A 128-byte file whose shape is 32 nested lists: refused at once, one line naming the file.
#[test]
fn a_deeply_nested_header_is_refused_at_once() {
    let mut header = b"{'descr': '<f4', 'fortran_order': False, 'shape': ".to_vec();
    header.extend([b'['; 32]);
    header.extend([b']'; 32]);
    header.push(b'}');
    while header.len() < 117 {
        header.push(b' ');
    }
    header.push(b'\n');
    let bytes = raw_npy(1, header.len() as u32, &header);
    assert_eq!(bytes.len(), 128);
    let (q, out) = (tmp("nested.npy"), tmp("nested-out.npy"));
    std::fs::write(&q, &bytes).unwrap();
    let _ = std::fs::remove_file(&out);
    let t0 = std::time::Instant::now();
    let o = output_within(
        &mut run_with_q(&q, &out),
        std::time::Duration::from_secs(20),
    );
    assert_one_line_error(&o, q.to_str().unwrap());
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        t0.elapsed()
    );
    assert!(!out.exists());
}

/// Headers that claim more than the file holds are refused before anything is allocated: a
/// 27-byte version-2 file with a 4 GiB header length, and a tiny file whose shape implies
/// petabytes. Run under a 1 GiB address-space limit, so an attempt to allocate aborts.
#[test]
fn headers_claiming_more_than_the_file_holds_are_refused_without_allocating() {
    let huge_header_len = raw_npy(2, 0xFFFF_FFF0, b"{'descr':'<f4'\n");
    assert_eq!(huge_header_len.len(), 27);
    let mut shape_header =
        b"{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1048576, 1048576, 1024), }"
            .to_vec();
    shape_header.push(b'\n');
    let huge_shape = raw_npy(1, shape_header.len() as u32, &shape_header);
    let mut short_header =
        b"{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2, 8, 64), }".to_vec();
    short_header.push(b'\n');
    let mut short_data = raw_npy(1, short_header.len() as u32, &short_header);
    short_data.extend([0u8; 100]);
    let cases: [(&str, &[u8], &str); 3] = [
        ("huge-header-len.npy", &huge_header_len, "header"),
        ("huge-shape.npy", &huge_shape, "bytes"),
        ("short-data.npy", &short_data, "bytes"),
    ];
    for (name, bytes, fragment) in cases {
        let (q, out) = (tmp(name), tmp("claims-out.npy"));
        std::fs::write(&q, bytes).unwrap();
        let _ = std::fs::remove_file(&out);
        let run = run_with_q(&q, &out);
        let o = output_within(
            &mut under_limit("ulimit -v 1048576", &run),
            std::time::Duration::from_secs(20),
        );
        assert_one_line_error(&o, q.to_str().unwrap());
        assert_one_line_error(&o, fragment);
        assert!(!out.exists(), "{name}");
    }
}

/// `--out` naming an input (by the same path, another spelling, or a hard link) is refused
/// before anything runs, and the input keeps its bytes.
#[test]
fn an_output_that_is_an_input_is_refused() {
    let dir = tmp("same-file");
    std::fs::create_dir_all(&dir).unwrap();
    let q = dir.join("q.npy");
    write_npy(&q, &values(2 * 8 * 64, 1), &[1, 2, 8, 64]);
    let before = std::fs::read(&q).unwrap();
    let link = dir.join("q-link.npy");
    let _ = std::fs::remove_file(&link);
    std::fs::hard_link(&q, &link).unwrap();
    let q_str = q.to_str().unwrap();
    let spellings = [
        q.clone(),
        dir.join(".").join("q.npy"),
        dir.join("..").join("same-file").join("q.npy"),
        link,
    ];
    for out in spellings {
        let o = sdpa()
            .args(["run", "--backend", "cpu"])
            .args(["--q", q_str, "--k", q_str, "--v", q_str])
            .args(["--out", out.to_str().unwrap()])
            .output()
            .unwrap();
        assert_one_line_error(&o, "same file");
        assert_eq!(std::fs::read(&q).unwrap(), before, "{out:?}");
    }
}

/// Writing `--out` fails (no such folder, a read-only folder, a file-size limit mid-write):
/// one line, exit 1, and nothing left behind: no partial output, no temporary file.
#[test]
fn a_failed_write_leaves_nothing_behind() {
    let dir = tmp("failed-write");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (b, h, s, d) = (1, 2, 64, 64);
    let q = dir.join("q.npy");
    write_npy(&q, &values(b * h * s * d, 1), &[1, 2, 64, 64]);
    let q_str = q.to_str().unwrap().to_string();
    let run = |out: &Path| {
        let mut cmd = sdpa();
        cmd.args(["run", "--backend", "cpu"])
            .args(["--q", &q_str, "--k", &q_str, "--v", &q_str])
            .args(["--out", out.to_str().unwrap()]);
        cmd
    };
    let listing = |d: &Path| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };

    let missing = dir.join("no-such-folder").join("o.npy");
    let o = run(&missing).output().unwrap();
    assert_one_line_error(&o, missing.to_str().unwrap());
    assert_eq!(listing(&dir), ["q.npy"]);

    // A file-size limit of 4 KiB (SIGXFSZ ignored, so the write fails with EFBIG) stands in
    // for a full disk: the 32 KiB output cannot be written whole.
    let out = dir.join("o.npy");
    let cmd = run(&out);
    let o = under_limit("ulimit -f 8", &cmd).output().unwrap();
    assert_one_line_error(&o, out.to_str().unwrap());
    assert_eq!(listing(&dir), ["q.npy"]);

    // The same failure must not clobber an existing output either.
    std::fs::write(&out, b"previous result").unwrap();
    let o = under_limit("ulimit -f 8", &cmd).output().unwrap();
    assert_one_line_error(&o, out.to_str().unwrap());
    assert_eq!(std::fs::read(&out).unwrap(), b"previous result");
    assert_eq!(listing(&dir), ["o.npy", "q.npy"]);
    std::fs::remove_file(&out).unwrap();

    let ro = dir.join("read-only");
    std::fs::create_dir_all(&ro).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    if std::fs::write(ro.join("probe"), b"").is_ok() {
        let _ = std::fs::remove_file(ro.join("probe"));
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "read-only folder: skipped, this user can write into it anyway"
        );
    } else {
        let out = ro.join("o.npy");
        let o = run(&out).output().unwrap();
        assert_one_line_error(&o, out.to_str().unwrap());
        assert!(listing(&ro).is_empty(), "{:?}", listing(&ro));
    }
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755)).unwrap();

    // And the success path leaves exactly the output.
    let o = run(&out).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(listing(&dir), ["o.npy", "q.npy", "read-only"]);
}

/// Where there is no GPU, a GPU backend named on the command line is an error (one line naming
/// it and saying why), not a silent switch to the CPU; and no output file appears. Skipped,
/// with the reason, where a GPU is present.
#[test]
fn a_named_gpu_backend_without_a_gpu_is_an_error() {
    if sdpa::Device::new(0).is_ok() {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "named backend without a GPU: skipped, this machine has a GPU"
        );
        return;
    }
    let dir = tmp("named-backend");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let q = dir.join("q.npy");
    write_npy(&q, &values(2 * 8 * 64, 1), &[1, 2, 8, 64]);
    let (q, out, json) = (
        q.to_str().unwrap().to_string(),
        dir.join("o.npy"),
        dir.join("bench.json"),
    );
    let o = sdpa()
        .args(["run", "--backend", "cutlass"])
        .args(["--q", &q, "--k", &q, "--v", &q])
        .args(["--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert_one_line_error(&o, "--backend cutlass needs");
    assert!(!out.exists());

    let o = sdpa()
        .args(["bench", "--backend", "scalar", "--shape", "1,1,64,64,64"])
        .args(["--dtype", "f16", "--budget-ms", "20"])
        .args(["--json", json.to_str().unwrap()])
        .output()
        .unwrap();
    assert_one_line_error(&o, "--backend scalar needs");
    assert!(!json.exists());

    let o = sdpa()
        .args([
            "validate",
            "--backend",
            "cpu,scalar",
            "--shape",
            "1,1,8,8,64",
        ])
        .output()
        .unwrap();
    assert_one_line_error(&o, "--backend scalar needs");

    // `auto` may choose the CPU reference, and says so.
    let o = sdpa()
        .args(["run", "--backend", "auto"])
        .args(["--q", &q, "--k", &q, "--v", &q])
        .args(["--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("(cpu backend)"));
    assert!(String::from_utf8_lossy(&o.stderr).contains("running the CPU reference only"));
}

/// Standard output closed before `sdpa` writes (a reader that went away, like `| head -1`):
/// a quiet exit, no panic.
#[test]
fn a_closed_stdout_pipe_is_a_quiet_exit() {
    for args in [
        &["info"][..],
        &["validate", "--backend", "cpu", "--shape", "1,1,8,8,64"][..],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let o = sdpa()
            .args(args)
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(!err.contains("Broken pipe"), "{args:?}: {err}");
        // 141 is what a shell reports for a command ended by SIGPIPE; 0 would do too.
        assert!(
            matches!(o.status.code(), Some(0 | 141)),
            "{args:?}: {:?} {err}",
            o.status
        );
    }
}

/// Standard output that refuses writes for another reason (a full disk): one line, exit 1.
#[test]
fn a_full_stdout_is_a_one_line_error() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "stdout on /dev/full: skipped, no /dev/full"
        );
        return;
    };
    let o = sdpa()
        .args(["validate", "--backend", "cpu", "--shape", "1,1,8,8,64"])
        .stdout(full)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    assert_one_line_error(&o, "No space left on device");
}

/// A problem that validates but whose inputs no machine holds (2^40 elements each) is a
/// one-line out-of-memory error from `validate` and `bench`, not an abort; and under a 1 GiB
/// address-space limit a 3 GiB problem is refused the same way before anything is allocated.
#[test]
fn problems_larger_than_memory_are_one_line_errors() {
    for (cmd, shape) in [
        ("validate", "1,1,1048576,1048576,1048576"),
        ("bench", "1,1,1048576,1048576,1048576"),
    ] {
        let o = output_within(
            sdpa().args([cmd, "--backend", "cpu", "--dtype", "f16", "--shape", shape]),
            std::time::Duration::from_secs(20),
        );
        assert_one_line_error(&o, "out of host memory");
    }
    let mut validate = sdpa();
    validate.args([
        "validate",
        "--backend",
        "cpu",
        "--shape",
        "1,1,1048576,1048576,64",
    ]);
    let o = output_within(
        &mut under_limit("ulimit -v 1048576", &validate),
        std::time::Duration::from_secs(20),
    );
    assert_one_line_error(&o, "out of host memory");
}

/// Arrays of the other layout: the error says how they were read and which flag reads them the
/// other way, instead of only a head-count puzzle; float64 inputs (numpy's default) are read.
#[test]
fn a_layout_mismatch_names_the_layout_and_float64_is_read() {
    // [B, S, H, D] arrays: q 5 tokens x 4 heads, k/v 9 tokens x 2 heads.
    let (q, k) = (tmp("bshd-q.npy"), tmp("bshd-k.npy"));
    write_npy(&q, &values(5 * 4 * 64, 1), &[1, 5, 4, 64]);
    write_npy(&k, &values(9 * 2 * 64, 2), &[1, 9, 2, 64]);
    let out = tmp("bshd-o.npy");
    let args = |layout: &str| {
        let mut c = sdpa();
        c.args(["run", "--backend", "cpu", "--layout", layout]);
        c.args(["--q", q.to_str().unwrap(), "--k", k.to_str().unwrap()]);
        c.args(["--v", k.to_str().unwrap(), "--out", out.to_str().unwrap()]);
        c
    };
    let o = args("bhsd").output().unwrap();
    assert_one_line_error(&o, "pass --layout bshd");
    assert!(args("bshd").output().unwrap().status.success());

    // The same q as float64: the same output.
    let want = std::fs::read(&out).unwrap();
    let f64_q = tmp("bshd-q64.npy");
    let data: Vec<f64> = values(5 * 4 * 64, 1)
        .iter()
        .map(|&x| f64::from(x))
        .collect();
    let f = std::fs::File::create(&f64_q).unwrap();
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(&[1, 5, 4, 64])
        .writer(std::io::BufWriter::new(f))
        .begin_nd()
        .unwrap();
    w.extend(data).unwrap();
    w.finish().unwrap();
    let mut c = args("bshd");
    let argv: Vec<String> = c
        .get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let q_str = q.to_str().unwrap().to_string();
    c = sdpa();
    c.args(argv.iter().map(|a| {
        if *a == q_str {
            f64_q.to_str().unwrap().to_string()
        } else {
            a.clone()
        }
    }));
    assert!(c.output().unwrap().status.success());
    assert_eq!(std::fs::read(&out).unwrap(), want);
}

/// `sdpa compare` on recorded H100 figures: the speedup table against the fastest anchor per
/// problem, and a chart naming every problem, backend and anchor; `sdpa bench --plot` on the
/// CPU backend writes one too.
#[test]
fn compare_tabulates_and_plots_recorded_runs() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let svg = tmp("compare.svg");
    let out = sdpa()
        .arg("compare")
        .args([data.join("bench-h100.json"), data.join("anchors-h100.json")])
        .arg("--plot")
        .arg(&svg)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = |problem: &str, ours: &str| {
        text.lines()
            .find(|l| l.starts_with(problem) && l.split_whitespace().nth(2) == Some(ours))
            .unwrap_or_else(|| panic!("no {problem} {ours} line in\n{text}"))
            .to_string()
    };
    // 6.80 / 3.72 and 800 / 872.
    assert!(line("mission bf16", "cutlass").ends_with("1.83x"), "{text}");
    let s8k = line("s8k-d128 bf16", "cutlass");
    assert!(s8k.contains("fa4") && s8k.ends_with("0.92x"), "{s8k}");
    let chart = std::fs::read_to_string(&svg).unwrap();
    for name in [
        "mission bf16",
        "s16k-d128-causal bf16",
        "cutlass-sm80",
        "torch-cudnn",
        "fa4",
    ] {
        assert!(chart.contains(name), "the chart lacks {name}");
    }

    let bench_svg = tmp("bench.svg");
    let out = sdpa()
        .args(["bench", "--backend", "cpu", "--shape", "1,1,64,64,64"])
        .args(["--budget-ms", "20", "--plot", bench_svg.to_str().unwrap()])
        .output()
        .unwrap();
    assert_success(&out);
    let chart = std::fs::read_to_string(&bench_svg).unwrap();
    assert!(
        chart.starts_with("<svg") && chart.contains("cpu"),
        "{chart:.200}"
    );

    let e = sdpa()
        .args(["compare", "/nonexistent.json", "/nonexistent2.json"])
        .output()
        .unwrap();
    assert!(!e.status.success());
    let msg = String::from_utf8_lossy(&e.stderr);
    assert!(msg.contains("/nonexistent.json"), "{msg}");
}

/// The text of a JSON list of `records`, written to `name` in the test folder.
fn records_file(name: &str, records: &serde_json::Value) -> PathBuf {
    let path = tmp(name);
    std::fs::write(&path, records.to_string()).unwrap();
    path
}

/// One bench record as `sdpa compare` reads it.
fn bench_record(name: &str, backend: &str, us: f64, tflops: f64) -> serde_json::Value {
    serde_json::json!({"name": name, "batch": 1, "heads": 16, "seq_q": 8192, "seq_k": 8192,
        "head_dim": 128, "causal": false, "dtype": "bf16", "backend": backend,
        "us_graph": us, "tflops": tflops, "us_graph_ci95": [us * 0.99, us * 1.01]})
}

/// `run` on a large input under a memory limit: the rounded copies of a 512 MiB (sparse) q do
/// not fit a 1.4 GiB address space, which is a one-line out-of-memory error, not an abort.
#[test]
fn run_larger_than_memory_is_a_one_line_error() {
    let header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2, 1048576, 64), }";
    let mut text = header.to_vec();
    while !(10 + text.len() + 1).is_multiple_of(64) {
        text.push(b' ');
    }
    text.push(b'\n');
    let bytes = raw_npy(1, text.len() as u32, &text);
    let (q, out) = (tmp("sparse-q.npy"), tmp("sparse-out.npy"));
    let f = std::fs::File::create(&q).unwrap();
    use std::io::Write;
    (&f).write_all(&bytes).unwrap();
    f.set_len(bytes.len() as u64 + 2 * 1048576 * 64 * 4)
        .unwrap();
    drop(f);
    let _ = std::fs::remove_file(&out);
    let o = output_within(
        &mut under_limit("ulimit -v 1500000", &run_with_q(&q, &out)),
        std::time::Duration::from_secs(30),
    );
    std::fs::remove_file(&q).unwrap();
    assert_one_line_error(&o, "out of host memory");
    assert!(!out.exists());
}

/// `compare --plot` on records whose figures no axis can hold (TFLOP/s near f64::MAX, an
/// interval down to 1e-307 us): those records are left out of the chart, each with a note, and
/// the chart of the rest is written at once; with nothing left to draw, a one-line error.
#[test]
fn compare_leaves_out_figures_no_chart_can_hold() {
    let mut tiny_ci = bench_record("tiny-ci", "cutlass", 800.0, 687.0);
    tiny_ci["us_graph_ci95"] = serde_json::json!([1e-307, 801.0]);
    let ours = records_file(
        "absurd-ours.json",
        &serde_json::json!([
            bench_record("good", "cutlass", 872.0, 630.0),
            bench_record("huge", "cutlass", 1e-300, 1.7e308),
            tiny_ci,
        ]),
    );
    let anchors = records_file("absurd-anchors.json", &serde_json::json!([]));
    let svg = tmp("absurd.svg");
    let _ = std::fs::remove_file(&svg);
    let mut cmd = sdpa();
    cmd.arg("compare")
        .args([&ours, &anchors])
        .arg("--plot")
        .arg(&svg);
    let o = output_within(&mut cmd, std::time::Duration::from_secs(20));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert_eq!(
        err.lines()
            .filter(|l| l.contains("left out of the chart"))
            .count(),
        2,
        "{err}"
    );
    assert!(err.contains("ours[1] (huge bf16 cutlass)"), "{err}");
    assert!(err.contains("ours[2] (tiny-ci bf16 cutlass)"), "{err}");
    let chart = std::fs::read_to_string(&svg).unwrap();
    assert!(
        chart.contains("good bf16") && !chart.contains("huge"),
        "{chart:.300}"
    );

    let only_bad = records_file(
        "absurd-only.json",
        &serde_json::json!([bench_record("huge", "cutlass", 1e-300, 1.7e308)]),
    );
    let mut cmd = sdpa();
    cmd.arg("compare")
        .args([&only_bad, &anchors])
        .arg("--plot")
        .arg(&svg);
    let o = output_within(&mut cmd, std::time::Duration::from_secs(20));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("no record with a TFLOP/s figure"), "{err}");
}

/// Text from records reaches the terminal and the chart without control characters: an escape
/// sequence, a bell and a newline in a name or backend come out as `\u{..}` escapes.
#[test]
fn compare_escapes_record_text_for_the_terminal_and_the_chart() {
    let evil = bench_record("evil\u{1b}[31m\u{7}", "cut\nlass\u{202e}", 872.0, 630.0);
    let mut anchor = bench_record("evil\u{1b}[31m\u{7}", "fa4\r\u{0}", 800.0, 687.0);
    anchor["device"] = serde_json::json!("H100\u{1b}]0;title\u{7}");
    let ours = records_file("evil-ours.json", &serde_json::json!([evil]));
    let anchors = records_file("evil-anchors.json", &serde_json::json!([anchor]));
    let svg = tmp("evil.svg");
    let o = sdpa()
        .arg("compare")
        .args([&ours, &anchors])
        .arg("--plot")
        .arg(&svg)
        .output()
        .unwrap();
    assert_success(&o);
    let text = String::from_utf8_lossy(&o.stdout);
    let controls = |s: &str| s.chars().filter(|&c| c.is_control() && c != '\n').count();
    assert_eq!(controls(&text), 0, "{text:?}");
    assert!(text.contains("evil\\u{1b}[31m\\u{7} bf16"), "{text}");
    assert!(text.contains("cut\\u{a}lass\\u{202e}"), "{text}");
    assert_eq!(text.lines().count(), 3, "{text}");
    let chart = std::fs::read_to_string(&svg).unwrap();
    assert_eq!(controls(&chart), 0, "control characters in the chart");
    assert!(!chart.contains('\u{202e}'));
}

/// A new output never replaces an input or another output, and a bad output path is refused
/// before any work: `compare --plot` onto an input (or a symlink to it), `bench --json` and
/// `--plot` on one file, `bench --json` onto a folder, `run --lse` into a missing folder (no
/// `--out` written either), a dangling symlink.
#[test]
fn outputs_that_would_destroy_inputs_or_fail_late_are_refused_first() {
    let dir = tmp("outputs-first");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let ours = dir.join("ours.json");
    std::fs::copy(data.join("bench-h100.json"), &ours).unwrap();
    let before = std::fs::read(&ours).unwrap();
    let link = dir.join("link.svg");
    std::os::unix::fs::symlink(&ours, &link).unwrap();
    for plot in [&ours, &link] {
        let o = sdpa()
            .arg("compare")
            .args([&ours, &data.join("anchors-h100.json")])
            .arg("--plot")
            .arg(plot)
            .output()
            .unwrap();
        assert_one_line_error(&o, "same file as OURS");
        assert_eq!(std::fs::read(&ours).unwrap(), before);
    }

    let bench = |extra: &[&std::ffi::OsStr]| {
        let mut c = sdpa();
        c.args(["bench", "--backend", "cpu", "--shape", "1,1,64,64,64"])
            .args(["--dtype", "f16", "--budget-ms", "20"])
            .args(extra);
        c.output().unwrap()
    };
    let r = dir.join("r.json");
    std::fs::write(&r, b"[\"earlier records\"]").unwrap();
    let o = bench(&["--json".as_ref(), r.as_ref(), "--plot".as_ref(), r.as_ref()]);
    assert_one_line_error(&o, "are the same file");
    assert!(o.stdout.is_empty(), "ran before refusing");
    assert_eq!(std::fs::read(&r).unwrap(), b"[\"earlier records\"]");
    let o = bench(&["--json".as_ref(), dir.as_ref()]);
    assert_one_line_error(&o, "is a folder");
    assert!(o.stdout.is_empty(), "ran before refusing");
    let dangling = dir.join("dangling.json");
    std::os::unix::fs::symlink(dir.join("nowhere.json"), &dangling).unwrap();
    let o = bench(&["--json".as_ref(), dangling.as_ref()]);
    assert_one_line_error(&o, "does not exist");
    assert!(!dir.join("nowhere.json").exists());

    let q = dir.join("q.npy");
    write_npy(&q, &values(2 * 8 * 64, 1), &[1, 2, 8, 64]);
    let (out, lse) = (dir.join("o.npy"), dir.join("missing").join("lse.npy"));
    let o = run_qkv(&q, &q, &q, &out)
        .arg("--lse")
        .arg(&lse)
        .output()
        .unwrap();
    assert_one_line_error(&o, "--lse");
    assert!(!out.exists(), "--out written before --lse failed");
    // A symlink to an input is that input.
    let q_link = dir.join("q-link.npy");
    std::os::unix::fs::symlink(&q, &q_link).unwrap();
    let q_before = std::fs::read(&q).unwrap();
    let o = run_qkv(&q, &q, &q, &q_link).output().unwrap();
    assert_one_line_error(&o, "same file");
    assert_eq!(std::fs::read(&q).unwrap(), q_before);
}

/// Every file the CLI writes replaces the old one whole or not at all, keeping its mode: an
/// SVG that cannot be written in full (a file-size limit) leaves the old chart, and a replaced
/// .npy, JSON or SVG keeps its permissions.
#[test]
fn outputs_are_replaced_atomically_and_keep_their_mode() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tmp("outputs-atomic");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let svg = dir.join("chart.svg");
    std::fs::write(&svg, b"previous chart").unwrap();
    let mut compare = sdpa();
    compare
        .arg("compare")
        .args([data.join("bench-h100.json"), data.join("anchors-h100.json")])
        .arg("--plot")
        .arg(&svg);
    let o = under_limit("ulimit -f 8", &compare).output().unwrap();
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let kept = std::fs::read(&svg).unwrap();
    assert!(
        kept == b"previous chart",
        "the old chart was replaced by {:.80}",
        String::from_utf8_lossy(&kept)
    );
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["chart.svg"], "a temporary file was left behind");

    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    std::fs::set_permissions(&svg, std::fs::Permissions::from_mode(0o640)).unwrap();
    assert_success(&compare.output().unwrap());
    assert_eq!(mode(&svg), 0o640);
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));

    let json = dir.join("r.json");
    std::fs::write(&json, b"[]").unwrap();
    std::fs::set_permissions(&json, std::fs::Permissions::from_mode(0o604)).unwrap();
    let o = sdpa()
        .args(["bench", "--backend", "cpu", "--shape", "1,1,64,64,64"])
        .args(["--dtype", "f16", "--budget-ms", "20", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert_success(&o);
    assert_eq!(mode(&json), 0o604);

    let q = dir.join("q.npy");
    write_npy(&q, &values(2 * 8 * 64, 1), &[1, 2, 8, 64]);
    let out = dir.join("o.npy");
    std::fs::write(&out, b"old").unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o600)).unwrap();
    let q = q.to_str().unwrap();
    let o = sdpa()
        .args([
            "run",
            "--backend",
            "cpu",
            "--q",
            q,
            "--k",
            q,
            "--v",
            q,
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert_success(&o);
    assert_eq!(mode(&out), 0o600);
}

/// A standard error that is full (or closed) loses the notes and nothing else: `run` still
/// writes its output and exits 0, `bench` still prints its table.
#[test]
fn a_full_stderr_changes_nothing() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "stderr on /dev/full: skipped, no /dev/full"
        );
        return;
    };
    let dir = tmp("full-stderr");
    std::fs::create_dir_all(&dir).unwrap();
    let q = dir.join("q.npy");
    write_npy(&q, &values(2 * 8 * 64, 1), &[1, 2, 8, 64]);
    let out = dir.join("o.npy");
    let _ = std::fs::remove_file(&out);
    let q = q.to_str().unwrap();
    // No --backend: without a GPU, a note says the CPU reference runs.
    let o = sdpa()
        .args(["run", "--q", q, "--k", q, "--v", q, "--out"])
        .arg(&out)
        .stderr(full.try_clone().unwrap())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0));
    assert!(out.exists());
    let o = sdpa()
        .args(["bench", "--backend", "cpu", "--shape", "1,1,64,64,64"])
        .args(["--dtype", "f16", "--budget-ms", "20"])
        .stderr(full)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&o.stdout).contains("TFLOP/s"));
}

/// A reader that goes away (`sdpa bench 2>&1 | head -1`, `sdpa autotable | head -1`): every
/// command ends the same quiet way, exit 141, whether its notes or its output hit the pipe.
#[test]
fn a_closed_pipe_ends_every_command_the_same_quiet_way() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let bench = data.join("bench-h100.json");
    let anchors = data.join("anchors-h100.json");
    let cases: [(Vec<&std::ffi::OsStr>, bool); 4] = [
        (
            [
                "bench",
                "--backend",
                "cpu",
                "--shape",
                "1,1,64,64,64",
                "--dtype",
                "f16",
            ]
            .map(std::ffi::OsStr::new)
            .to_vec(),
            true,
        ),
        (
            vec![
                "autotable".as_ref(),
                bench.as_os_str(),
                "--sm".as_ref(),
                "90".as_ref(),
            ],
            false,
        ),
        (
            vec!["compare".as_ref(), bench.as_os_str(), anchors.as_os_str()],
            false,
        ),
        (["info"].map(std::ffi::OsStr::new).to_vec(), true),
    ];
    for (args, stderr_too) in cases {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let mut cmd = sdpa();
        cmd.args(&args).stdout(writer.try_clone().unwrap());
        match stderr_too {
            true => cmd.stderr(writer),
            false => cmd.stderr(std::process::Stdio::piped()),
        };
        let o = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(141), "{args:?}: {err}");
        assert!(err.is_empty(), "{args:?}: {err}");
    }
}

/// Finite inputs that overflow the dtype (70000 in f16, 1e39 as float64) or infinities are a
/// one-line error naming the input, the element and its value, in every dtype as e4m3 already
/// refused them; the same values fit bf16. NaN or infinite ALiBi slopes are refused too.
#[test]
fn inputs_the_dtype_cannot_hold_are_refused() {
    let dir = tmp("overflow");
    std::fs::create_dir_all(&dir).unwrap();
    let (good, big, inf) = (
        dir.join("good.npy"),
        dir.join("big.npy"),
        dir.join("inf.npy"),
    );
    let mut x = values(2 * 8 * 64, 1);
    write_npy(&good, &x, &[1, 2, 8, 64]);
    x[5] = 70000.0;
    write_npy(&big, &x, &[1, 2, 8, 64]);
    x[5] = 1.0;
    x[9] = f32::NEG_INFINITY;
    write_npy(&inf, &x, &[1, 2, 8, 64]);
    let out = dir.join("o.npy");
    let run = |q: &Path, dtype: &str, extra: &[&str]| {
        let g = good.to_str().unwrap();
        let _ = std::fs::remove_file(&out);
        sdpa()
            .args(["run", "--backend", "cpu", "--dtype", dtype, "--q"])
            .arg(q)
            .args(["--k", g, "--v", g, "--out"])
            .arg(&out)
            .args(extra)
            .output()
            .unwrap()
    };
    let o = run(&big, "f16", &[]);
    assert_one_line_error(&o, "element 5 is 70000, which overflows f16");
    assert_one_line_error(&o, "--q");
    assert!(!out.exists());
    assert_success(&run(&big, "bf16", &[]));
    for dtype in ["f16", "bf16", "e4m3"] {
        assert_one_line_error(&run(&inf, dtype, &[]), "element 9 is -inf");
    }
    // float64 beyond float32: refused where it is read, naming the file.
    let f64_q = dir.join("big64.npy");
    let f = std::fs::File::create(&f64_q).unwrap();
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(&[1, 2, 8, 64])
        .writer(std::io::BufWriter::new(f))
        .begin_nd()
        .unwrap();
    let mut doubles: Vec<f64> = values(2 * 8 * 64, 1)
        .iter()
        .map(|&v| f64::from(v))
        .collect();
    doubles[3] = 1e39;
    w.extend(doubles).unwrap();
    w.finish().unwrap();
    let o = run(&f64_q, "bf16", &[]);
    assert_one_line_error(&o, "element 3 is 1e39, beyond float32");
    assert_one_line_error(&o, f64_q.to_str().unwrap());

    let slopes = dir.join("slopes.npy");
    write_npy(&slopes, &[0.5, f32::NAN], &[2]);
    let o = run(&good, "f16", &["--alibi", slopes.to_str().unwrap()]);
    assert_one_line_error(&o, "slope 1 is NaN");
    write_npy(&slopes, &[f32::INFINITY, 0.5], &[2]);
    let o = run(&good, "f16", &["--alibi", slopes.to_str().unwrap()]);
    assert_one_line_error(&o, "slope 0 is inf");
    assert!(!out.exists());
}

/// A FIFO (or another special file) named as an input is refused at once, before it is opened:
/// opening a FIFO for reading waits for a writer.
#[test]
fn a_fifo_as_an_input_is_refused_without_waiting() {
    let dir = tmp("fifo");
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("q.fifo");
    let _ = std::fs::remove_file(&fifo);
    let made = Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|s| s.success()) {
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "FIFO input: skipped, no mkfifo");
        return;
    }
    let out = dir.join("o.npy");
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let anchors = data.join("anchors-h100.json");
    let mut run = run_with_q(&fifo, &out);
    let mut compare = sdpa();
    compare.arg("compare").arg(&fifo).arg(&anchors);
    let mut autotable = sdpa();
    autotable.arg("autotable").arg(&fifo).args(["--sm", "90"]);
    for cmd in [&mut run, &mut compare, &mut autotable] {
        let o = output_within(cmd, std::time::Duration::from_secs(10));
        assert_one_line_error(&o, "FIFO");
        assert_one_line_error(&o, fifo.to_str().unwrap());
    }
    let o = output_within(
        sdpa()
            .arg("run")
            .args(["--q", "/dev/zero", "--k", "/dev/zero", "--v", "/dev/zero"])
            .arg("--out")
            .arg(&out),
        std::time::Duration::from_secs(10),
    );
    assert_one_line_error(&o, "not a regular file");
    assert!(!out.exists());
}

/// Negative numbers reach the library's own checks instead of clap's "unexpected argument":
/// `--softcap -1` is refused as a softcap, in `run`, `validate` and `bench`, and bench's
/// durations must be finite and above zero.
#[test]
fn negative_numbers_reach_the_checks_that_name_them() {
    let q = tmp("neg-q.npy");
    write_npy(&q, &values(2 * 8 * 64, 1), &[1, 2, 8, 64]);
    let q = q.to_str().unwrap();
    let out = tmp("neg-o.npy");
    let o = sdpa()
        .args([
            "run",
            "--backend",
            "cpu",
            "--softcap",
            "-1",
            "--q",
            q,
            "--k",
            q,
            "--v",
            q,
        ])
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert_one_line_error(&o, "softcap must be finite and positive, got -1");
    let o = sdpa()
        .args([
            "run",
            "--backend",
            "cpu",
            "--scale",
            "-0.5",
            "--q",
            q,
            "--k",
            q,
            "--v",
            q,
        ])
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert_one_line_error(&o, "scale must be finite and positive, got -0.5");
    for cmd in ["validate", "bench"] {
        let o = sdpa()
            .args([
                cmd,
                "--backend",
                "cpu",
                "--shape",
                "1,1,8,8,64",
                "--softcap",
                "-1",
            ])
            .args(["--budget-ms", "20"].iter().filter(|_| cmd == "bench"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("softcap must be finite and positive"),
            "{cmd}: {err}"
        );
        assert!(!err.contains("unexpected argument"), "{cmd}: {err}");
    }
    for (flag, value, shown) in [
        ("--budget-ms", "-5", "-5"),
        ("--budget-ms", "nan", "NaN"),
        ("--energy-s", "inf", "inf"),
    ] {
        let o = sdpa()
            .args([
                "bench",
                "--backend",
                "cpu",
                "--shape",
                "1,1,8,8,64",
                flag,
                value,
            ])
            .output()
            .unwrap();
        assert_one_line_error(
            &o,
            &format!("{flag} {shown}: expected a finite number above 0"),
        );
    }
}
