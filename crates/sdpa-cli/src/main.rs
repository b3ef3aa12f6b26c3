//! `sdpa`: inspect the build and the GPU, validate backends against the f64 reference, time
//! them on the named problems, and run attention on .npy files.

/// `println!` for the commands: the same formatting, but a failed write to standard output comes
/// back as `Err(Failure::Stdout)` for the caller's `?` instead of panicking.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::write_stdout(format_args!($($arg)*))
    };
}

/// `eprintln!` for diagnostics: the same formatting, but a standard error that is closed or
/// full loses the line instead of panicking, so a note can never decide how a command ends.
macro_rules! note {
    ($($arg:tt)*) => {
        $crate::write_stderr(format_args!($($arg)*), true)
    };
}

/// `eprint!` (no newline) with `note!`'s handling of write errors.
macro_rules! note_start {
    ($($arg:tt)*) => {
        $crate::write_stderr(format_args!($($arg)*), false)
    };
}

mod autotable;
mod bench;
mod compare;
mod energy;
mod input;
mod machine;
mod npy;
mod output;
mod plot;
mod progress;
#[cfg(feature = "distributed")]
mod ring;
mod run;
mod validate;
mod validate_backward;

use clap::{Parser, Subcommand};
use sdpa::{Backend, Device, Problem};
use std::io::{self, Write};
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
    /// Prints crates/sdpa/src/backend/auto/table.rs from `sdpa bench --json` records.
    Autotable(autotable::Args),
    /// Our bench records against the anchors' (speedup table; `--plot` draws both).
    Compare(compare::Args),
    /// Ring attention over several GPUs (NCCL): `ring bench --ranks N`, `ring validate`.
    #[cfg(feature = "distributed")]
    Ring(ring::Args),
}

/// Why a command failed: the library said so, or standard output refused a write.
pub(crate) enum Failure {
    Sdpa(sdpa::Error),
    Stdout(io::Error),
}

impl From<sdpa::Error> for Failure {
    fn from(e: sdpa::Error) -> Self {
        Failure::Sdpa(e)
    }
}

/// What the commands return.
pub(crate) type CliResult<T> = std::result::Result<T, Failure>;

/// One line (`args` and a newline) on standard output; see `outln!`.
pub(crate) fn write_stdout(args: std::fmt::Arguments) -> CliResult<()> {
    let mut out = io::stdout().lock();
    out.write_fmt(args)
        .and_then(|()| out.write_all(b"\n"))
        .map_err(Failure::Stdout)
}

/// `args` on standard error, with a newline where `newline`; a failed write is ignored (see
/// `note!`).
pub(crate) fn write_stderr(args: std::fmt::Arguments, newline: bool) {
    let mut err = io::stderr().lock();
    let _ = err.write_fmt(args).and_then(|()| {
        if newline {
            err.write_all(b"\n")
        } else {
            Ok(())
        }
    });
}

/// Exit status for a reader that closed standard output early (`sdpa info | head -1`): what a
/// shell reports for a command ended by SIGPIPE, as `ls` and `cat` end there, without a message.
const CLOSED_PIPE: u8 = 141;

fn main() -> ExitCode {
    let result = match Cli::parse().cmd {
        Cmd::Info => info(),
        Cmd::Validate(a) => validate::main(a),
        Cmd::Bench(a) => bench::main(a),
        Cmd::Run(a) => run::main(a),
        Cmd::Autotable(a) => autotable::main(a),
        Cmd::Compare(a) => compare::main(a),
        #[cfg(feature = "distributed")]
        Cmd::Ring(a) => ring::main(a),
    };
    // Whatever is still buffered must reach standard output too, or the run did not succeed.
    let result =
        result.and_then(|code| io::stdout().flush().map(|()| code).map_err(Failure::Stdout));
    match result {
        Ok(code) => code,
        Err(Failure::Stdout(e)) if e.kind() == io::ErrorKind::BrokenPipe => {
            ExitCode::from(CLOSED_PIPE)
        }
        Err(Failure::Stdout(e)) => {
            note!("sdpa: writing standard output: {e}");
            ExitCode::FAILURE
        }
        Err(Failure::Sdpa(e)) => {
            note!("sdpa: {e}");
            ExitCode::FAILURE
        }
    }
}

/// GPU 0, or `None` after one line saying why (then only the CPU reference runs).
pub(crate) fn open_device() -> Option<Device> {
    match Device::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            note!("sdpa: {e}; running the CPU reference only");
            None
        }
    }
}

/// The GPU for a command that will run `backends`, opened only if one of them can use it.
/// `named`: the user listed the backends, so a GPU backend among them must get a GPU: without
/// one that is an error naming the backend. Otherwise (defaults, `auto`, `cpu`) the command
/// falls back to the CPU reference with `open_device`'s one line.
pub(crate) fn device_for(backends: &[Backend], named: bool) -> sdpa::Result<Option<Device>> {
    if backends.iter().all(|&b| b == Backend::Cpu) {
        return Ok(None);
    }
    let needs_gpu = backends
        .iter()
        .find(|&&b| b != Backend::Cpu && b != Backend::Auto);
    match needs_gpu {
        Some(&b) if named => Device::new(0).map(Some).map_err(|e| {
            let why = match e {
                sdpa::Error::NoDevice(msg) => msg,
                other => other.to_string(),
            };
            sdpa::Error::NoDevice(format!("{why}; --backend {b} needs one"))
        }),
        _ => Ok(open_device()),
    }
}

/// The backend that runs `p` when `b` is asked for: `auto` picks the best GPU backend, or the
/// CPU reference where there is no GPU; every other backend is itself.
pub(crate) fn chosen_backend(
    dev: Option<&Device>,
    p: &Problem,
    b: Backend,
) -> sdpa::Result<Backend> {
    match (b, dev) {
        (Backend::Auto, None) => Ok(Backend::Cpu),
        _ => b.resolve(dev, p),
    }
}

fn info() -> CliResult<ExitCode> {
    outln!(
        "sdpa {} (CUDA archs {})",
        env!("CARGO_PKG_VERSION"),
        sdpa_harness::info::cuda_archs()
    )?;
    let dev = open_device();
    if let Some(dev) = &dev {
        let (major, minor) = dev.compute_capability()?;
        outln!(
            "device 0: {} (sm_{major}{minor}, {} SMs)",
            dev.name()?,
            dev.sm_count()?
        )?;
    }
    outln!("\nbackends (on the mission problem, f16):")?;
    let probe = sdpa_harness::named_problem("mission")?;
    for b in Backend::ALL {
        match b.supports(dev.as_ref(), &probe) {
            Ok(()) => match b.resolve(dev.as_ref(), &probe) {
                Ok(r) if r != b => outln!("  {:8} available (-> {r})", b.name())?,
                _ => outln!("  {:8} available", b.name())?,
            },
            Err(e) => outln!("  {:8} unavailable: {e}", b.name())?,
        }
    }
    let sm = match &dev {
        Some(d) => {
            let (major, minor) = d.compute_capability()?;
            Some(major * 10 + minor)
        }
        None => None,
    };
    outln!("\nauto dispatch (measured by `sdpa bench`, crates/sdpa/src/backend/auto/table.rs):")?;
    for r in sdpa::backend::auto::table() {
        if sm.is_some_and(|s| s != r.sm) {
            continue;
        }
        let order: Vec<_> = r.order.iter().map(|b| b.name()).collect();
        let dtype = match r.fp8_mode {
            sdpa::Fp8Mode::Fast => format!("{} fast", r.dtype),
            sdpa::Fp8Mode::Accurate => r.dtype.to_string(),
        };
        outln!(
            "  sm_{} {:<9} d{:<3} {:<10} {:<6} -> {}",
            r.sm,
            dtype,
            r.head_dim,
            if r.causal { "causal" } else { "non-causal" },
            format!("{:?}", r.size),
            order.join(" > ")
        )?;
    }
    outln!("\nkernels (ptxas report captured at build time):")?;
    outln!(
        "  {:<44} {:>7} {:>5} {:>6} {:>6} {:>7}  wgmma",
        "kernel",
        "arch",
        "regs",
        "smem",
        "stack",
        "spills"
    )?;
    for k in sdpa_harness::info::kernels() {
        outln!(
            "  {:<44} {:>7} {:>5} {:>6} {:>6} {:>7}  {}",
            short_kernel_name(&k.kernel),
            k.arch,
            k.registers,
            k.smem,
            k.stack,
            k.spill_stores + k.spill_loads,
            if k.wgmma_serialized { "serialized" } else { "" }
        )?;
    }
    if let Some(dev) = &dev {
        outln!("\nkernels on this device (cudaFuncGetAttributes):")?;
        outln!(
            "  {:<8} {:<24} {:>5} {:>7} {:>8} {:>6}",
            "backend",
            "kernel",
            "regs",
            "smem",
            "dyn smem",
            "local"
        )?;
        for k in sdpa_harness::info::device_kernels(dev)? {
            outln!(
                "  {:<8} {:<24} {:>5} {:>7} {:>8} {:>6}",
                k.backend,
                k.name,
                k.registers,
                k.static_smem,
                k.dynamic_smem,
                k.local_bytes
            )?;
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

#[cfg(test)]
mod help_tests {
    use super::Cli;
    use clap::CommandFactory;

    /// `bench --help` and `validate --help` name every named problem the harness knows.
    #[test]
    fn help_lists_every_named_problem() {
        for sub in ["bench", "validate"] {
            let mut cmd = Cli::command();
            let help = cmd
                .find_subcommand_mut(sub)
                .unwrap()
                .render_help()
                .to_string();
            for p in sdpa_harness::NAMED_PROBLEMS {
                assert!(help.contains(p.name), "{sub} --help lacks {}", p.name);
            }
        }
    }
}
