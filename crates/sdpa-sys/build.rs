//! Builds the CUDA core (`cpp/`, through CMake) and the cxx bridge, then links them with the
//! static CUDA runtime. Needs nothing preinstalled: what the machine lacks of a CUDA toolkit
//! (CUDA_HOME / nvcc on PATH), CUTLASS (CUTLASS_DIR) and a cmake >= 3.24, it installs from the
//! toolchain pinned in third_party/toolchain.txt, from PyPI into a cache directory outside the
//! source tree, once, and reuses it.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

// The CUDA architectures each GPU-architecture feature compiles for. sm_80 as machine code
// and PTX (newer GPUs can compile the sm_80 kernels from it at load time); sm_90a as machine
// code only: its PTX runs on no other GPU, and would be a third of the binary.
const ARCH_FEATURES: &[(&str, &str)] = &[("sm80", "80"), ("sm90", "90a-real")];

/// The architectures of the default features (all of them).
fn default_archs() -> String {
    let archs: Vec<&str> = ARCH_FEATURES.iter().map(|(_, arch)| *arch).collect();
    archs.join(";")
}

struct Toolchain {
    cuda: PathBuf,
    cutlass_include: PathBuf,
    cmake: PathBuf,
}

fn main() {
    for var in [
        "CUDA_HOME",
        "CUDA_PATH",
        "CUTLASS_DIR",
        "CMAKE",
        "SDPA_TOOLCHAIN_DIR",
        "SDPA_CUDA_ARCHS",
        "SDPA_BACKENDS",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let cpp = manifest.join("cpp");
    let pins = manifest.join("third_party/toolchain.txt");
    for p in [
        cpp.clone(),
        manifest.join("cmake"),
        pins.clone(),
        manifest.join("src/bridge.cc"),
        manifest.join("src/bridge.h"),
    ] {
        println!("cargo:rerun-if-changed={}", p.display());
    }

    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-env-changed=DOCS_RS");
    if env::var_os("DOCS_RS").is_some() {
        // Documentation builds (docs.rs) compile no CUDA: the crate's items need only the
        // kernel list and an empty build report.
        fs::write(out_dir.join("ptxas.txt"), "").unwrap();
        let list = read_kernel_list(&cpp.join("kernels.txt"));
        let chosen = Selection::from_features(&list);
        write_instances(&chosen.kernels, &out_dir);
        write_if_changed(&out_dir.join("kernels.rs"), &kernel_enum_rust(&list));
        println!("cargo:rustc-env=SDPA_CUDA_ARCHS=none (documentation build)");
        println!(
            "cargo:rustc-env=SDPA_DEFAULT_CUDA_ARCHS={}",
            default_archs()
        );
        return;
    }
    let list = read_kernel_list(&cpp.join("kernels.txt"));
    let chosen = Selection::from_features(&list);
    let archs = chosen.archs.clone();
    let tc = locate(&pins).unwrap_or_else(|msg| fail(&msg));
    let nvcc = tc.cuda.join("bin/nvcc");

    // The cmake crate runs whatever $CMAKE names. Build scripts are single-threaded.
    unsafe { env::set_var("CMAKE", &tc.cmake) };
    let mut cfg = cmake::Config::new(&cpp);
    cfg.profile("Release")
        .define("SDPA_KERNELS", chosen.cmake_list())
        .define("CMAKE_CUDA_COMPILER", &nvcc)
        .define("CUDAToolkit_ROOT", &tc.cuda)
        .define("CMAKE_CUDA_ARCHITECTURES", &archs)
        .define("SDPA_CUTLASS_INCLUDE", &tc.cutlass_include)
        .build_target("sdpa_core");
    // CMake's build tree lives in cargo's target folder, not in OUT_DIR: `cargo test`, `cargo
    // clippy` and release builds run this script with different OUT_DIRs, and with a tree of
    // their own each the whole CUDA core compiled again (minutes on 2 cores; CMake builds it in
    // its Release configuration whatever cargo's profile). One tree per (source folder,
    // toolchain, CUTLASS, archs, kernels) lets every later run find the objects up to date. The source
    // folder is in the key because CMake refuses a tree configured from another one, and the
    // same target folder builds other copies of cpp/: `cargo package` verifies the packaged
    // copy there, and checkouts may share a CARGO_TARGET_DIR.
    // Cargo locks each profile's folder, not the target folder: a debug and a release build may
    // run at once, so the tree has a lock of its own.
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let mut _tree_lock = None;
    let mut tree = out.clone();
    if let Some(target_dir) = out.ancestors().nth(4) {
        let key = format!(
            "{}\n{}\n{}\n{archs}\n{}",
            cpp.display(),
            nvcc.display(),
            tc.cutlass_include.display(),
            chosen.cmake_list()
        );
        tree = target_dir.join(format!("sdpa-core-{:016x}", fnv1a(key.as_bytes())));
        _tree_lock = Some(lock_tree(&tree));
        cfg.out_dir(&tree);
    }

    // The headers generated from the one definition of each argument block (src/args.rs, by
    // cxx) and of the kernel list (cpp/kernels.txt), where the CUDA core and the bridge both
    // include them as sdpa/args.h and sdpa/kernels.h. Rewritten only when their text changes,
    // so that a build of another cargo profile rebuilds nothing.
    let mut bridge = cxx_build::bridges(["src/args.rs", "src/lib.rs"]);
    let generated = tree.join("include");
    let args_h = out.join("cxxbridge/include/sdpa-sys/src/args.rs.h");
    let args_h =
        fs::read_to_string(&args_h).unwrap_or_else(|e| fail(&format!("{}: {e}", args_h.display())));
    write_if_changed(&generated.join("sdpa/args.h"), &args_h);
    write_if_changed(&generated.join("sdpa/kernels.h"), &kernel_enum_cpp(&list));
    write_if_changed(&out_dir.join("kernels.rs"), &kernel_enum_rust(&list));
    cfg.define("SDPA_GENERATED_INCLUDE", &generated);

    let dst = cfg.build();
    let build = dst.join("build");

    write_ptxas_report(&build, &cpp, &out_dir);
    write_instances(&chosen.kernels, &out_dir);

    bridge
        .file("src/bridge.cc")
        .include(cpp.join("include"))
        .include(&generated)
        .std("c++17")
        .compile("sdpa_bridge");

    println!("cargo:rustc-link-search=native={}", build.display());
    println!("cargo:rustc-link-lib=static=sdpa_core");
    for lib in ["lib64", "lib", "targets/x86_64-linux/lib"] {
        let d = tc.cuda.join(lib);
        if d.join("libcudart_static.a").exists() {
            println!("cargo:rustc-link-search=native={}", d.display());
            break;
        }
    }
    // cudart_static loads libcuda with dlopen at run time: no link-time dependency on a driver.
    println!("cargo:rustc-link-lib=static=cudart_static");
    for lib in ["dl", "pthread", "rt"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    println!("cargo:rustc-env=SDPA_CUDA_ARCHS={archs}");
    println!(
        "cargo:rustc-env=SDPA_DEFAULT_CUDA_ARCHS={}",
        default_archs()
    );
}

/// Holds `tree`'s lock file until dropped, waiting for another build that holds it.
fn lock_tree(tree: &Path) -> fs::File {
    use fs4::fs_std::FileExt;
    fs::create_dir_all(tree).unwrap_or_else(|e| fail(&format!("{}: {e}", tree.display())));
    let path = tree.join(".sdpa-build-lock");
    let file =
        fs::File::create(&path).unwrap_or_else(|e| fail(&format!("{}: {e}", path.display())));
    if !file.try_lock_exclusive().unwrap_or(false) {
        println!(
            "cargo:warning=waiting for another build of the CUDA core in {}",
            tree.display()
        );
        file.lock_exclusive()
            .unwrap_or_else(|e| fail(&format!("locking {}: {e}", path.display())));
    }
    file
}

fn fail(msg: &str) -> ! {
    eprintln!("\nsdpa-sys: {msg}\n");
    std::process::exit(1);
}

/// Finds the toolkit, CUTLASS and cmake the machine gives, and fills what is missing from the
/// pinned PyPI toolchain.
fn locate(pins: &Path) -> Result<Toolchain, String> {
    let cuda = match env::var_os("CUDA_HOME").or_else(|| env::var_os("CUDA_PATH")) {
        Some(home) => {
            let home = PathBuf::from(home);
            if !home.join("bin/nvcc").exists() {
                return Err(format!(
                    "CUDA_HOME={} has no bin/nvcc; point it at a CUDA 13.0 toolkit or unset it",
                    home.display()
                ));
            }
            Some(home)
        }
        None => which("nvcc")
            .and_then(|n| n.parent()?.parent().map(Path::to_path_buf))
            .or_else(|| Some(PathBuf::from("/usr/local/cuda")))
            .filter(|home| toolkit_is_recent(home)),
    };
    if let Some(home) = &cuda {
        // Shown with `cargo build -vv`: a dependency's build says nothing while all is well.
        eprintln!(
            "sdpa-sys: CUDA toolkit: {} (the machine's own)",
            home.display()
        );
    }
    let cutlass_include = env::var_os("CUTLASS_DIR").map(|d| {
        let d = PathBuf::from(d);
        if d.join("include/cute").exists() {
            d.join("include")
        } else {
            d
        }
    });
    let cmake = env::var_os("CMAKE")
        .map(PathBuf::from)
        .or_else(|| which("cmake").filter(|c| cmake_is_recent(c)));

    // What the machine lacks comes from the pinned PyPI toolchain, piece by piece.
    let cuda = match cuda {
        Some(home) => home,
        None => ensure_pypi_piece(pins, Piece::Cuda)?.join("nvidia/cu13"),
    };
    let cutlass_include = match cutlass_include {
        Some(inc) => inc,
        None => ensure_pypi_piece(pins, Piece::Cutlass)?.join("cutlass_library/source/include"),
    };
    let cmake = match cmake {
        Some(cmake) => cmake,
        None => ensure_pypi_piece(pins, Piece::Cmake)?.join("cmake/data/bin/cmake"),
    };
    Ok(Toolchain {
        cuda,
        cutlass_include,
        cmake,
    })
}

/// Whether `home` holds an nvcc of CUDA 12.4 or newer (what CUTLASS 4.2 needs). An older or
/// absent one is passed over for the pinned toolkit, with a line saying so.
fn toolkit_is_recent(home: &Path) -> bool {
    let nvcc = home.join("bin/nvcc");
    let Ok(out) = Command::new(&nvcc).arg("--version").output() else {
        return false;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text
        .split("release ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .unwrap_or("0");
    let mut parts = version
        .split('.')
        .map(|p| p.trim().parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    let recent = (major, minor) >= (12, 4);
    if !recent {
        println!(
            "cargo:warning=sdpa-sys: {} is CUDA {version}; CUTLASS 4.2 needs 12.4 or newer, \
             using the pinned toolkit instead",
            nvcc.display()
        );
    }
    recent
}

fn which(name: &str) -> Option<PathBuf> {
    env::split_paths(&env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

fn cmake_is_recent(cmake: &Path) -> bool {
    let Ok(out) = Command::new(cmake).arg("--version").output() else {
        return false;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text.split_whitespace().nth(2).unwrap_or("0");
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (3, 24)
}

/// FNV-1a: a hash that stays the same across Rust releases, to name the cache directory.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The pieces of the pinned toolchain, each installed on its own (third_party/toolchain.txt
/// names the packages) when the machine does not give it.
#[derive(Clone, Copy, PartialEq)]
enum Piece {
    Cuda,
    Cutlass,
    Cmake,
}

impl Piece {
    fn of(pin: &str) -> Piece {
        if pin.starts_with("nvidia-cutlass") {
            Piece::Cutlass
        } else if pin.starts_with("cmake") {
            Piece::Cmake
        } else {
            Piece::Cuda
        }
    }

    fn name(self) -> &'static str {
        match self {
            Piece::Cuda => "cuda",
            Piece::Cutlass => "cutlass",
            Piece::Cmake => "cmake",
        }
    }

    /// What a user sets to give their own instead.
    fn own(self) -> &'static str {
        match self {
            Piece::Cuda => "CUDA_HOME to a CUDA 12.4+ toolkit (13.0 for the GPU machines' driver)",
            Piece::Cutlass => "CUTLASS_DIR to CUTLASS 4.2 (the folder holding include/cute)",
            Piece::Cmake => "CMAKE to a cmake 3.24 or newer",
        }
    }

    /// The download from PyPI, in MB (the wheels of toolchain.txt's pins).
    fn download_mb(self) -> u32 {
        match self {
            Piece::Cuda => 105,
            Piece::Cutlass => 7,
            Piece::Cmake => 30,
        }
    }
}

/// The folder holding `piece` of the pinned PyPI toolchain, installed there first if it is not
/// yet: `pip install --no-deps --target`, once, into a cache outside the source tree
/// (`SDPA_TOOLCHAIN_DIR`, else `$XDG_CACHE_HOME/sdpa` or `~/.cache/sdpa`). An offline build
/// (`CARGO_NET_OFFLINE`) downloads nothing and says what to give instead.
fn ensure_pypi_piece(pins_file: &Path, piece: Piece) -> Result<PathBuf, String> {
    let pins_text = fs::read_to_string(pins_file)
        .map_err(|e| format!("cannot read {}: {e}", pins_file.display()))?;
    let pins: Vec<&str> = pins_text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && Piece::of(l) == piece)
        .collect();
    let cache = match env::var_os("SDPA_TOOLCHAIN_DIR") {
        Some(d) => PathBuf::from(d),
        None => env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .ok_or("neither SDPA_TOOLCHAIN_DIR, XDG_CACHE_HOME nor HOME is set")?
            .join("sdpa"),
    };
    let root = cache.join(format!(
        "{}-{:016x}",
        piece.name(),
        fnv1a(pins.join("\n").as_bytes())
    ));
    eprintln!(
        "sdpa-sys: {}: the pinned PyPI install in {} (set {} to use your own)",
        piece.name(),
        root.display(),
        piece.own()
    );
    if root.join(".complete").exists() {
        return Ok(root);
    }
    let what = format!(
        "{} ({}, about {} MB from PyPI)",
        piece.name(),
        pins.join(" "),
        piece.download_mb()
    );
    if env::var("CARGO_NET_OFFLINE").is_ok_and(|v| v == "true" || v == "1") {
        return Err(format!(
            "the build is offline (CARGO_NET_OFFLINE) and needs {what}, which this machine \
             lacks.\nSet {}, or build once online to install it into {}.",
            piece.own(),
            cache.display()
        ));
    }
    fs::create_dir_all(&cache).map_err(|e| format!("cannot create {}: {e}", cache.display()))?;
    let tmp = cache.join(format!(".tmp-{}-{}", piece.name(), std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    eprintln!("sdpa-sys: installing {what}");
    let started = std::time::Instant::now();
    let python = ["python3", "python"]
        .into_iter()
        .find(|p| which(p).is_some())
        .ok_or("no python3 on PATH to install the toolchain with pip")?;
    let out = Command::new(python)
        .args(["-m", "pip", "install", "--no-deps", "--no-input", "--quiet"])
        .args([
            "--disable-pip-version-check",
            "--no-warn-script-location",
            "--target",
        ])
        .arg(&tmp)
        .args(&pins)
        .output()
        .map_err(|e| format!("could not run {python} -m pip: {e}"))?;
    if !out.status.success() {
        let _ = fs::remove_dir_all(&tmp);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(8).collect();
        return Err(format!(
            "could not install {what} (offline?).\n\
             pip said:\n  {}\n\
             Either give this machine access to PyPI, or set {} (third_party/README.md).",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n  "),
            piece.own()
        ));
    }
    if piece == Piece::Cuda {
        fix_up_toolkit(&tmp.join("nvidia/cu13"))?;
    }
    fs::write(tmp.join(".complete"), pins.join("\n")).map_err(|e| e.to_string())?;
    let installed_mb = dir_bytes(&tmp) / 1_000_000;
    if fs::rename(&tmp, &root).is_err() {
        // Another build installed it meanwhile; use theirs.
        let _ = fs::remove_dir_all(&tmp);
        if !root.join(".complete").exists() {
            return Err(format!(
                "could not move {} into {}",
                piece.name(),
                root.display()
            ));
        }
    }
    // Shown once, by the build that downloaded it.
    println!(
        "cargo:warning=sdpa-sys: installed {what} in {:.0} s: {installed_mb} MB in {}",
        started.elapsed().as_secs_f64(),
        root.display()
    );
    Ok(root)
}

/// The bytes of the files under `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// Makes the PyPI layout look like a normal toolkit to nvcc and CMake's FindCUDAToolkit.
fn fix_up_toolkit(cuda: &Path) -> Result<(), String> {
    let link = |target: &str, at: PathBuf| -> Result<(), String> {
        if at.exists() {
            return Ok(());
        }
        std::os::unix::fs::symlink(target, &at)
            .map_err(|e| format!("symlink {} -> {target}: {e}", at.display()))
    };
    // nvcc's profile looks for lib64 ("cannot find -lcudart_static" without it).
    link("lib", cuda.join("lib64"))?;
    // FindCUDAToolkit wants unversioned names ("missing: CUDA_CUDART").
    for (name, versioned) in [
        ("libcudart.so", "libcudart.so.13"),
        ("libcublas.so", "libcublas.so.13"),
        ("libcublasLt.so", "libcublasLt.so.13"),
    ] {
        if cuda.join("lib").join(versioned).exists() {
            link(versioned, cuda.join("lib").join(name))?;
        }
    }
    Ok(())
}

/// cpp/kernels.txt: one (backend, dtype, head_dim) per line, the fused-kernel instantiations,
/// and whether the backend's backward is instantiated for it too (`bwd`).
#[derive(Clone)]
struct KernelLine {
    backend: String,
    dtype: String,
    head_dim: usize,
    backward: bool,
}

fn read_kernel_list(list: &Path) -> Vec<KernelLine> {
    let text =
        fs::read_to_string(list).unwrap_or_else(|e| fail(&format!("{}: {e}", list.display())));
    let mut lines = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        let (backend, dtype, head_dim, backward) = match f[..] {
            [backend, dtype, head_dim] => (backend, dtype, head_dim, false),
            [backend, dtype, head_dim, "bwd"] => (backend, dtype, head_dim, true),
            _ => fail(&format!(
                "{}: expected 'backend dtype head_dim [bwd]', got '{line}'",
                list.display()
            )),
        };
        let head_dim: usize = head_dim
            .parse()
            .unwrap_or_else(|_| fail(&format!("{}: bad head_dim in '{line}'", list.display())));
        lines.push(KernelLine {
            backend: backend.to_string(),
            dtype: dtype.to_string(),
            head_dim,
            backward,
        });
    }
    lines
}

/// The fused kernels in the order the list first names them: (name, enumerator), e.g.
/// ("cutlass-sm80", "CutlassSm80"). The order gives each its value in both languages.
fn kernels(list: &[KernelLine]) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for l in list {
        if out.iter().all(|(name, _)| *name != l.backend) {
            let camel: String = l
                .backend
                .split('-')
                .map(|w| {
                    let mut c = w.chars();
                    c.next()
                        .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                        .unwrap_or_default()
                })
                .collect();
            out.push((l.backend.clone(), camel));
        }
    }
    out
}

/// `sdpa/kernels.h`: `sdpa::Kernel` and its names, for the core and the bridge.
fn kernel_enum_cpp(list: &[KernelLine]) -> String {
    let ks = kernels(list);
    let mut s = String::from(
        "// Generated from cpp/kernels.txt by crates/sdpa-sys/build.rs; do not edit.\n\
         #pragma once\n\n#include <cstdint>\n\nnamespace sdpa {\n\n\
         // The fused kernels of the core, one per backend folder under cpp/src/.\n\
         enum class Kernel : int32_t {\n",
    );
    for (i, (_, camel)) in ks.iter().enumerate() {
        s.push_str(&format!("  {camel} = {i},\n"));
    }
    s.push_str("};\n\n// The name `sdpa` gives the kernel's backend.\n");
    s.push_str("inline const char* name(Kernel kernel) {\n  switch (kernel) {\n");
    for (name, camel) in &ks {
        s.push_str(&format!(
            "    case Kernel::{camel}:\n      return \"{name}\";\n"
        ));
    }
    s.push_str("  }\n  return \"unknown kernel\";\n}\n\n}  // namespace sdpa\n");
    s
}

/// `$OUT_DIR/kernels.rs`: the same enum in Rust, passed to the core by value (`ExternType`).
fn kernel_enum_rust(list: &[KernelLine]) -> String {
    let ks = kernels(list);
    let mut s = String::from(
        "/// The fused kernels of the core, one per backend folder under cpp/src/ (generated \
         from\n/// cpp/kernels.txt: `sdpa::Kernel` of sdpa/kernels.h).\n\
         #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]\n#[repr(i32)]\npub enum Kernel {\n",
    );
    for (i, (name, camel)) in ks.iter().enumerate() {
        s.push_str(&format!("    /// `{name}`\n    {camel} = {i},\n"));
    }
    s.push_str("}\n\nimpl Kernel {\n    /// Every kernel, in the list's order.\n");
    s.push_str("    pub const ALL: &[Kernel] = &[");
    for (_, camel) in &ks {
        s.push_str(&format!("Kernel::{camel}, "));
    }
    s.push_str("];\n\n    /// The name `sdpa` gives the kernel's backend.\n");
    s.push_str("    pub fn name(self) -> &'static str {\n        match self {\n");
    for (name, camel) in &ks {
        s.push_str(&format!("            Kernel::{camel} => {name:?},\n"));
    }
    s.push_str("        }\n    }\n}\n");
    s
}

/// The GPU-architecture features that bring each backend's kernels (any of them; none: every
/// build has it, as the scalar kernels, the GPU reference). The sm90 kernels hand the problems
/// they do not take (decode among them) to the cutlass-sm80 kernels, which run on Hopper too.
const BACKEND_FEATURES: &[(&str, &[&str])] = &[
    ("scalar", &[]),
    ("wmma", &["sm80"]),
    ("cutlass-sm80", &["sm80", "sm90"]),
    ("cutlass", &["sm90"]),
];

/// What this build compiles: the lines of cpp/kernels.txt the crate's features choose (GPU
/// architectures, which bring backends; dtypes; head dims), for the architectures they name.
/// For development, `SDPA_BACKENDS` (comma-separated, as `sdpa` names backends) replaces the
/// backends and `SDPA_CUDA_ARCHS` (a CMake list) the architectures the features give.
struct Selection {
    archs: String,
    kernels: Vec<KernelLine>,
}

impl Selection {
    fn from_features(list: &[KernelLine]) -> Selection {
        let feature =
            |name: &str| env::var_os(format!("CARGO_FEATURE_{}", name.to_uppercase())).is_some();
        let archs = match env::var("SDPA_CUDA_ARCHS") {
            Ok(archs) => archs,
            Err(_) => {
                let archs: Vec<&str> = ARCH_FEATURES
                    .iter()
                    .filter(|(f, _)| feature(f))
                    .map(|(_, arch)| *arch)
                    .collect();
                if archs.is_empty() {
                    fail(
                        "no GPU architecture chosen: enable the feature sm80 (Ampere, Ada), \
                         sm90 (Hopper) or both (the default features)",
                    );
                }
                archs.join(";")
            }
        };
        let backends = match env::var("SDPA_BACKENDS") {
            Ok(value) => named_backends(list, &value),
            Err(_) => kernels(list)
                .into_iter()
                .map(|(name, _)| name)
                .filter(|name| {
                    let Some((_, archs)) = BACKEND_FEATURES.iter().find(|(b, _)| b == name) else {
                        fail(&format!(
                            "cpp/kernels.txt names the backend '{name}', which build.rs's \
                             BACKEND_FEATURES does not map to a GPU-architecture feature"
                        ));
                    };
                    archs.is_empty() || archs.iter().any(|f| feature(f))
                })
                .collect(),
        };
        let dtype_feature = |dtype: &str| if dtype == "e4m3" { "fp8" } else { dtype }.to_string();
        let mut dtypes: Vec<String> = list.iter().map(|l| dtype_feature(&l.dtype)).collect();
        let mut dims: Vec<String> = list.iter().map(|l| format!("hdim{}", l.head_dim)).collect();
        for (what, names) in [("dtype", &mut dtypes), ("head dim", &mut dims)] {
            names.sort();
            names.dedup();
            if !names.iter().any(|f| feature(f)) {
                fail(&format!(
                    "no {what} chosen: enable at least one of the features {} (the default \
                     features enable them all)",
                    names.join(", ")
                ));
            }
        }
        let kernels = list
            .iter()
            .filter(|l| {
                backends.contains(&l.backend)
                    && feature(&dtype_feature(&l.dtype))
                    && feature(&format!("hdim{}", l.head_dim))
            })
            .cloned()
            .collect();
        Selection { archs, kernels }
    }

    /// The chosen instantiations as the CMake list SdpaKernels.cmake reads:
    /// `backend/dtype/head_dim[/bwd];...`.
    fn cmake_list(&self) -> String {
        let entries: Vec<String> = self
            .kernels
            .iter()
            .map(|l| {
                let bwd = if l.backward { "/bwd" } else { "" };
                format!("{}/{}/{}{bwd}", l.backend, l.dtype, l.head_dim)
            })
            .collect();
        entries.join(";")
    }
}

/// The backends `SDPA_BACKENDS` names, each checked against the list.
fn named_backends(list: &[KernelLine], value: &str) -> Vec<String> {
    let all: Vec<String> = kernels(list).into_iter().map(|(name, _)| name).collect();
    let mut built = Vec::new();
    for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        if !all.iter().any(|a| a == name) {
            fail(&format!(
                "SDPA_BACKENDS names '{name}', which cpp/kernels.txt does not list (it has {})",
                all.join(", ")
            ));
        }
        if !built.iter().any(|b| b == name) {
            built.push(name.to_string());
        }
    }
    if built.is_empty() {
        fail(&format!(
            "SDPA_BACKENDS is set but names no backend (cpp/kernels.txt has {})",
            all.join(", ")
        ));
    }
    // cutlass's instances hand decode steps and FP8 K/V caches to cutlass-sm80's (as the sm90
    // feature brings both): it does not link without them.
    if built.iter().any(|b| b == "cutlass") && !built.iter().any(|b| b == "cutlass-sm80") {
        built.push("cutlass-sm80".to_string());
    }
    built
}

fn write_if_changed(path: &Path, text: &str) {
    if fs::read_to_string(path).is_ok_and(|old| old == text) {
        return;
    }
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).unwrap_or_else(|e| fail(&format!("{}: {e}", dir.display())));
    }
    fs::write(path, text).unwrap_or_else(|e| fail(&format!("{}: {e}", path.display())));
}

/// `$OUT_DIR/instances.rs`: the instantiations this build compiles as a Rust table, so the
/// safe layer knows which (backend, dtype, head_dim) exist without a second list.
fn write_instances(kernels: &[KernelLine], out_dir: &Path) {
    let mut rust = String::from("&[\n");
    for l in kernels {
        rust.push_str(&format!(
            "    Instance {{ backend: {:?}, dtype: {:?}, head_dim: {}, backward: {} }},\n",
            l.backend, l.dtype, l.head_dim, l.backward
        ));
    }
    rust.push(']');
    write_if_changed(&out_dir.join("instances.rs"), &rust);
}

/// Concatenates the per-object ptxas reports (cmake/ptxas-log.sh) into one file for
/// `sdpa_sys::PTXAS_REPORT`. A report whose source file is gone (deleted or moved since this
/// build tree compiled it) is left out: CMake leaves its object and report behind.
fn write_ptxas_report(build: &Path, cpp: &Path, out_dir: &Path) {
    // One report per source, the newest: a source that moved to another CMake target (e.g.
    // the sm_90a kernels to sdpa_core_sm90) leaves its old report behind in an existing tree.
    let mut newest: std::collections::BTreeMap<String, (std::time::SystemTime, PathBuf)> =
        Default::default();
    let mut stack = vec![build.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "ptxas") && source_exists(&p, cpp) {
                let key = object_source(&p).map_or_else(|| p.display().to_string(), |(_, s)| s);
                let time = e.metadata().and_then(|m| m.modified()).ok();
                let time = time.unwrap_or(std::time::SystemTime::UNIX_EPOCH);
                if newest.get(&key).is_none_or(|(t, _)| time > *t) {
                    newest.insert(key, (time, p));
                }
            }
        }
    }
    let mut files: Vec<PathBuf> = newest.into_values().map(|(_, p)| p).collect();
    files.sort();
    let mut report = String::new();
    for f in files {
        let name = f
            .file_name()
            .unwrap()
            .to_string_lossy()
            .replace(".o.ptxas", "");
        report.push_str(&format!("## {name}\n"));
        report.push_str(&fs::read_to_string(&f).unwrap_or_default());
    }
    fs::write(out_dir.join("ptxas.txt"), report).unwrap();
}

/// `(build tree, source path)` of `<build>/CMakeFiles/<target>.dir/<source>.o.ptxas`.
fn object_source(report: &Path) -> Option<(String, String)> {
    let text = report.to_string_lossy();
    let (build, rest) = text.split_once("/CMakeFiles/")?;
    let (_, rel) = rest.split_once(".dir/")?;
    Some((
        build.to_string(),
        rel.trim_end_matches(".o.ptxas").to_string(),
    ))
}

/// Whether the source of `.../<target>.dir/src/<path>.cu.o.ptxas` still exists as
/// `cpp/src/<path>.cu` (true when the path does not have that shape).
fn source_exists(report: &Path, cpp: &Path) -> bool {
    match object_source(report) {
        // Sources generated from cpp/kernels.txt live in the build tree, under gen/.
        Some((build, src)) => cpp.join(&src).exists() || Path::new(&build).join(&src).exists(),
        None => true,
    }
}
