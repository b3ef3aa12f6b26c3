//! `sdpa`: inspect the build and the GPU, validate backends against the f64 reference, time
//! them on the named problems, and run attention on .npy files.

mod autotable;
mod bench;
mod npy;
mod run;
mod validate;

use clap::{Parser, Subcommand};
use sdpa::{Backend, Device};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "sdpa",
    version,
    about = "Scaled dot-product attention on NVIDIA GPUs"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The GPU, the backends it can run, and every kernel's registers / shared memory / spills.
    Info,
    /// Checks backends against the float64 reference on fresh random inputs.
    Validate(validate::Args),
    /// Times backends on the named problems (CUDA events, graph and single-launch medians).
    Bench(bench::Args),
    /// Runs attention on .npy inputs and writes a float32 .npy output.
    Run(run::Args),
    /// Prints crates/sdpa/src/backend/auto_table.rs from `sdpa bench --json` records.
    Autotable(autotable::Args),
}

fn main() -> ExitCode {
    let result = match Cli::parse().cmd {
        Cmd::Info => info(),
        Cmd::Validate(a) => validate::main(a),
        Cmd::Bench(a) => bench::main(a),
        Cmd::Run(a) => run::main(a),
        Cmd::Autotable(a) => autotable::main(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("sdpa: {e}");
            ExitCode::FAILURE
        }
    }
}

/// GPU 0, or `None` after one line saying why (then only the CPU reference runs).
pub(crate) fn open_device() -> Option<Device> {
    match Device::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("sdpa: {e}; running the CPU reference only");
            None
        }
    }
}

fn info() -> sdpa::Result<ExitCode> {
    println!(
        "sdpa {} (CUDA archs {})",
        env!("CARGO_PKG_VERSION"),
        sdpa::info::cuda_archs()
    );
    let dev = open_device();
    if let Some(dev) = &dev {
        let (major, minor) = dev.compute_capability()?;
        println!(
            "device 0: {} (sm_{major}{minor}, {} SMs)",
            dev.name()?,
            dev.sm_count()?
        );
    }
    println!("\nbackends (on the mission problem, f16):");
    let probe = sdpa::named_problem("mission")?;
    for b in Backend::ALL {
        match b.supports(dev.as_ref(), &probe) {
            Ok(()) => match b.resolve(dev.as_ref(), &probe) {
                Ok(r) if r != b => println!("  {:8} available (-> {r})", b.name()),
                _ => println!("  {:8} available", b.name()),
            },
            Err(e) => println!("  {:8} unavailable: {e}", b.name()),
        }
    }
    let sm = match &dev {
        Some(d) => {
            let (major, minor) = d.compute_capability()?;
            Some(major * 10 + minor)
        }
        None => None,
    };
    println!("\nauto dispatch (measured by `sdpa bench`, crates/sdpa/src/backend/auto_table.rs):");
    for r in sdpa::backend::auto::table() {
        if sm.is_some_and(|s| s != r.sm) {
            continue;
        }
        let order: Vec<_> = r.order.iter().map(|b| b.name()).collect();
        println!(
            "  sm_{} {:<4} d{:<3} {:<10} {:<6} -> {}",
            r.sm,
            r.dtype,
            r.head_dim,
            if r.causal { "causal" } else { "non-causal" },
            format!("{:?}", r.size),
            order.join(" > ")
        );
    }
    println!("\nkernels (ptxas report captured at build time):");
    println!(
        "  {:<44} {:>7} {:>5} {:>6} {:>6} {:>7}",
        "kernel", "arch", "regs", "smem", "stack", "spills"
    );
    for k in sdpa::info::kernels() {
        println!(
            "  {:<44} {:>7} {:>5} {:>6} {:>6} {:>7}",
            short_kernel_name(&k.kernel),
            k.arch,
            k.registers,
            k.smem,
            k.stack,
            k.spill_stores + k.spill_loads
        );
    }
    if let Some(dev) = &dev {
        println!("\nkernels on this device (cudaFuncGetAttributes):");
        println!(
            "  {:<8} {:<24} {:>5} {:>7} {:>8} {:>6}",
            "backend", "kernel", "regs", "smem", "dyn smem", "local"
        );
        for k in sdpa::info::device_kernels(dev)? {
            println!(
                "  {:<8} {:<24} {:>5} {:>7} {:>8} {:>6}",
                k.backend, k.name, k.registers, k.static_smem, k.dynamic_smem, k.local_bytes
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `void sdpa::scalar::fwd_kernel<__half, 64, true>(sdpa::scalar::Params)` ->
/// `scalar::fwd_kernel<__half, 64, true>`.
fn short_kernel_name(k: &str) -> String {
    let k = k.strip_prefix("void ").unwrap_or(k);
    let k = k.strip_prefix("sdpa::").unwrap_or(k);
    let end = k.find('(').unwrap_or(k.len());
    k[..end].to_string()
}
