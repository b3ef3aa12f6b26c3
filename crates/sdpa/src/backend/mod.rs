//! Backends: one module each, one enum to name them, one place that says who supports what.

pub mod auto;
mod auto_table;
pub mod cpu;
pub(crate) mod cublas;
pub(crate) mod fused;

use crate::device::Device;
use crate::error::{Error, Result, invalid};
use crate::problem::Problem;
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
    /// The fastest supported GPU backend for the device and problem.
    Auto,
}

impl Backend {
    /// Every backend, in the order tables list them.
    pub const ALL: [Backend; 5] = [
        Backend::Cpu,
        Backend::Scalar,
        Backend::Wmma,
        Backend::Cublas,
        Backend::Auto,
    ];
    /// The backends that run on the GPU (what `validate` and `bench` iterate over).
    pub const GPU: [Backend; 3] = [Backend::Scalar, Backend::Wmma, Backend::Cublas];

    /// Lower-case name, as the CLI accepts it.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Scalar => "scalar",
            Backend::Wmma => "wmma",
            Backend::Cublas => "cublas",
            Backend::Auto => "auto",
        }
    }

    /// Whether this backend can run `p` on `dev`; the error says precisely why not (an invalid
    /// problem gets its validation error).
    pub fn supports(self, dev: Option<&Device>, p: &Problem) -> Result<()> {
        p.validate()?;
        let unsupported = |reason: String| Error::Unsupported {
            backend: self.name(),
            reason,
        };
        match self {
            Backend::Cpu => Ok(()),
            Backend::Scalar | Backend::Wmma => {
                fused::supports(p).map_err(unsupported)?;
                let dev = dev.ok_or_else(|| unsupported("needs a GPU".into()))?;
                let (major, minor) = dev.compute_capability()?;
                if major < 8 {
                    return Err(unsupported(format!(
                        "needs compute capability 8.0 or newer, the GPU has {major}.{minor}"
                    )));
                }
                Ok(())
            }
            Backend::Cublas => {
                let dev = dev.ok_or_else(|| unsupported("needs a GPU".into()))?;
                let (major, minor) = dev.compute_capability()?;
                if major < 8 {
                    return Err(unsupported(format!(
                        "bf16 tensor-op GEMMs need compute capability 8.0, the GPU has {major}.{minor}"
                    )));
                }
                cublas::supports(dev, p).map_err(unsupported)
            }
            Backend::Auto => self.resolve(dev, p).map(|_| ()),
        }
    }

    /// The concrete backend `Auto` stands for on this device and problem (others: themselves).
    pub fn resolve(self, dev: Option<&Device>, p: &Problem) -> Result<Backend> {
        if self != Backend::Auto {
            return Ok(self);
        }
        let sm = match dev {
            Some(d) => {
                let (major, minor) = d.compute_capability()?;
                Some(major * 10 + minor)
            }
            None => None,
        };
        let mut reasons = Vec::new();
        for &b in auto::order(sm, p) {
            match b.supports(dev, p) {
                Ok(()) => return Ok(b),
                Err(e) => reasons.push(e.to_string()),
            }
        }
        Err(Error::Unsupported {
            backend: "auto",
            reason: format!("no GPU backend can run {p}: {}", reasons.join("; ")),
        })
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
