//! Backends: one module each, one enum to name them, one place that says who supports what.

pub mod auto;
pub mod cpu;
pub mod cpu_grad;
pub(crate) mod cublas;
pub(crate) mod fused;

pub use fused::{Instance, instances};

use crate::device::Device;
use crate::error::{Error, Result, invalid};
use crate::problem::{Checked, DType, Problem};

use std::fmt;
use std::str::FromStr;

/// Which implementation runs a problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// float64 on the host: the reference (inputs downloaded, output uploaded).
    Cpu,
    /// CUDA cores only: tiled online softmax with warp reductions. Runs on sm_80 and newer.
    Scalar,
    /// Tensor cores through `nvcuda::wmma` for Q·Kᵀ and P·V, cp.async K/V pipeline (sm_80+).
    Wmma,
    /// Unfused: cuBLAS GEMM for S = Q·Kᵀ (f32), masked softmax kernel, cuBLAS GEMM for P·V.
    Cublas,
    /// CuTe on sm_90a (Hopper): TMA loads, wgmma, a producer warpgroup and two consumer warpgroups
    /// (sdpa-sys/cpp/src/cutlass/sm90); e4m3 inputs natively, Q·Kᵀ on FP8 wgmma and P·V on f16
    /// wgmma (the same kernel).
    Cutlass,
    /// CuTe on sm_80+ (A100, L4, ...): mma.sync, ldmatrix, cp.async pipeline
    /// (sdpa-sys/cpp/src/cutlass/sm80); on Hopper a fallback and a comparison point.
    CutlassSm80,
    /// The fastest supported GPU backend for the device and problem.
    Auto,
}

impl Backend {
    /// Every backend, in the order tables list them.
    pub const ALL: [Backend; 7] = [
        Backend::Cpu,
        Backend::Scalar,
        Backend::Wmma,
        Backend::Cublas,
        Backend::Cutlass,
        Backend::CutlassSm80,
        Backend::Auto,
    ];
    /// The backends that run on the GPU (what `validate` and `bench` iterate over).
    pub const GPU: [Backend; 5] = [
        Backend::Scalar,
        Backend::Wmma,
        Backend::Cublas,
        Backend::Cutlass,
        Backend::CutlassSm80,
    ];

    /// Lower-case name, as the CLI accepts it.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Scalar => "scalar",
            Backend::Wmma => "wmma",
            Backend::Cublas => "cublas",
            Backend::Cutlass => "cutlass",
            Backend::CutlassSm80 => "cutlass-sm80",
            Backend::Auto => "auto",
        }
    }

    /// The C++ core's fused kernel behind this backend (None: cpu, cublas, auto). The core
    /// also runs e4m3 inputs on the kernels without FP8 math (its simulated path).
    pub(crate) fn fused_kernel(self) -> Option<sdpa_sys::Kernel> {
        use sdpa_sys::Kernel;
        match self {
            Backend::Scalar => Some(Kernel::Scalar),
            Backend::Wmma => Some(Kernel::Wmma),
            Backend::Cutlass => Some(Kernel::Cutlass),
            Backend::CutlassSm80 => Some(Kernel::CutlassSm80),
            Backend::Cpu | Backend::Cublas | Backend::Auto => None,
        }
    }

    /// Whether this backend takes e4m3 inputs natively (FP8 tensor-core math:
    /// sdpa-sys/cpp/kernels.txt lists e4m3 instantiations of it). The others run e4m3 problems on
    /// the simulated path: inputs dequantized to the output dtype first.
    pub fn native_fp8(self) -> bool {
        sdpa_sys::INSTANCES
            .iter()
            .any(|i| i.backend == self.name() && i.dtype == "e4m3")
    }

    /// Whether this backend can run `p` on `dev`; the error says precisely why not (an invalid
    /// problem gets its validation error).
    pub fn supports(self, dev: Option<&Device>, p: &Problem) -> Result<()> {
        self.supports_checked(dev, &p.checked()?)
    }

    /// `supports` for a problem already validated.
    pub(crate) fn supports_checked(self, dev: Option<&Device>, p: &Checked) -> Result<()> {
        let unsupported = |reason: String| Error::Unsupported {
            backend: self.name(),
            reason,
        };
        if p.dtype == DType::E4m3 && self != Backend::Auto && !self.native_fp8() {
            return self.supports_checked(dev, &p.dequantized());
        }
        if let Some(kernel) = self.fused_kernel() {
            return self.fused_supports(kernel, dev, p).map_err(unsupported);
        }
        match self {
            Backend::Cpu => Ok(()),
            Backend::Cublas => {
                if p.is_fp8_kv() {
                    return Err(unsupported(
                        "reads no e4m3 K/V cache (the cutlass and cutlass-sm80 decode kernels do)"
                            .into(),
                    ));
                }
                cublas::limits(p).map_err(unsupported)?;
                let dev = dev.ok_or_else(|| unsupported("needs a GPU".into()))?;
                let (major, minor) = dev.compute_capability()?;
                if major < 8 {
                    return Err(unsupported(format!(
                        "bf16 tensor-op GEMMs need compute capability 8.0, the GPU has {major}.{minor}"
                    )));
                }
                cublas::supports(dev, p).map_err(unsupported)
            }
            Backend::Auto => self.resolve_checked(dev, p).map(|_| ()),
            Backend::Scalar | Backend::Wmma | Backend::Cutlass | Backend::CutlassSm80 => {
                unreachable!("{self} has a fused kernel")
            }
        }
    }

    /// `supports` for a fused backend: its instantiations (sdpa-sys/cpp/kernels.txt), whether this
    /// build holds its code, and what the kernel itself takes (its `can_implement` in the C++
    /// core). The limits of the problem come before the build and the device (with no device they
    /// are all that is checked), so a caller without a GPU still learns them.
    fn fused_supports(
        self,
        kernel: sdpa_sys::Kernel,
        dev: Option<&Device>,
        p: &Checked,
    ) -> std::result::Result<(), String> {
        fused::instantiated(self.name(), p)?;
        let cutlass = matches!(self, Backend::Cutlass | Backend::CutlassSm80);
        // Without CUTLASS headers the core has no instance of these to ask.
        if cutlass && !sdpa_sys::ffi::built_with_cutlass() {
            return Err("this build has no CUTLASS headers (set CUTLASS_DIR and rebuild)".into());
        }
        fused::can_implement(kernel, dev, p)?;
        // Without sm_90a code the kernel's host side is built and answers, but the kernel is
        // empty.
        if self == Backend::Cutlass && !sdpa_sys::built_with_sm90a() {
            return Err(format!(
                "built for CUDA archs {}, without 90a",
                sdpa_sys::CUDA_ARCHS
            ));
        }
        dev.map(|_| ()).ok_or_else(|| "needs a GPU".into())
    }

    /// The concrete backend `Auto` stands for on this device and problem (others: themselves).
    pub fn resolve(self, dev: Option<&Device>, p: &Problem) -> Result<Backend> {
        if self != Backend::Auto {
            return Ok(self);
        }
        self.resolve_checked(dev, &p.checked()?)
    }

    /// The concrete backend that runs `p`, having checked that it supports it: `self`, or for
    /// `Auto` the first supported backend of the measured order.
    pub(crate) fn resolve_checked(self, dev: Option<&Device>, p: &Checked) -> Result<Backend> {
        if self != Backend::Auto {
            self.supports_checked(dev, p)?;
            return Ok(self);
        }
        let mut reasons = Vec::new();
        for b in auto::candidates(sm_of(dev)?, p) {
            match b.supports_checked(dev, p) {
                Ok(()) => return Ok(b),
                Err(e) => reasons.push(e.to_string()),
            }
        }
        Err(none_runs(p, &reasons))
    }
}

/// The compute capability `Auto`'s table is keyed by (major·10 + minor), where there is a device.
pub(crate) fn sm_of(dev: Option<&Device>) -> Result<Option<u32>> {
    dev.map(|d| {
        d.compute_capability()
            .map(|(major, minor)| major * 10 + minor)
    })
    .transpose()
}

/// `Auto`'s refusal: no backend runs `p`, with each one's reason.
pub(crate) fn none_runs(p: &Checked, reasons: &[String]) -> Error {
    Error::Unsupported {
        backend: Backend::Auto.name(),
        reason: format!("no GPU backend can run {p}: {}", reasons.join("; ")),
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Backend {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Backend::ALL
            .into_iter()
            .find(|b| b.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                let names: Vec<_> = Backend::ALL.iter().map(|b| b.name()).collect();
                invalid!("unknown backend {s:?} (known: {})", names.join(", "))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An f32 output is refused ahead, with a typed error, by every backend that does not write
    /// it: cublas by its own limits (no device needed), the fused kernels but cutlass (sm90) by
    /// their `can_implement`; cpu writes it.
    #[test]
    fn only_cutlass_and_cpu_take_an_f32_output() {
        for dtype in DType::ALL {
            let p = Problem::new(1, 4, 64, 64, 64)
                .with_kv_heads(2)
                .with_causal(true)
                .with_dtype(dtype)
                .with_out_dtype(DType::F32);
            assert!(Backend::Cpu.supports(None, &p).is_ok(), "{p}");
            match Backend::Cublas.supports(None, &p) {
                Err(Error::Unsupported { backend, reason }) => {
                    assert_eq!(backend, "cublas");
                    assert!(reason.contains("not f32"), "{reason}");
                }
                other => panic!("cublas {p}: {other:?}"),
            }
            let cutlass = sdpa_sys::ffi::built_with_cutlass();
            for b in [Backend::Scalar, Backend::Wmma, Backend::CutlassSm80] {
                if b == Backend::CutlassSm80 && !cutlass {
                    continue;
                }
                match b.supports(None, &p) {
                    Err(Error::Unsupported { backend, reason }) => {
                        assert_eq!(backend, b.name());
                        assert!(
                            reason.contains("only cutlass (sm90) writes"),
                            "{b}: {reason}"
                        );
                    }
                    other => panic!("{b} {p}: {other:?}"),
                }
            }
        }
    }
}
