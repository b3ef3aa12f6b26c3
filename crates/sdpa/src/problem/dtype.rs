//! Element types and what e4m3 inputs add: their scale layout and the FP8 mode.

use crate::error::{Result, invalid};
use std::fmt;
use std::str::FromStr;

/// Element type of Q, K, V and the output.
///
/// f16 and bf16 are input and output types; e4m3 is an input type only, f32 an output type
/// only ([`DType::INPUTS`], [`DType::OUTPUTS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
    /// FP8 E4M3 codes with dequantization scales ([`crate::fp8`]): an input type only; the
    /// output of an e4m3 problem is f16 or bf16
    /// ([`Problem::output_dtype`](crate::Problem::output_dtype)).
    E4m3,
    /// IEEE single precision: an output type only, of f16/bf16 inputs (a result that is merged
    /// or accumulated further before it is rounded, such as ring attention's partial blocks).
    /// The `cutlass` (sm_90a) and `cpu` backends write it.
    F32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F16 | DType::Bf16 => 2,
            DType::E4m3 => 1,
            DType::F32 => 4,
        }
    }
    /// Name as the CLI and bench records spell it.
    pub fn name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::E4m3 => "e4m3",
            DType::F32 => "f32",
        }
    }
    /// Unit roundoff (half the spacing of values near 1): 2^-11 for f16, 2^-8 for bf16, 2^-4
    /// for e4m3, 2^-24 for f32.
    pub fn unit_roundoff(self) -> f64 {
        match self {
            DType::F16 => 2f64.powi(-11),
            DType::Bf16 => 2f64.powi(-8),
            DType::E4m3 => 2f64.powi(-4),
            DType::F32 => 2f64.powi(-24),
        }
    }
    /// Whether Q, K and V may be of this type (all but f32).
    pub fn is_input(self) -> bool {
        self != DType::F32
    }
    /// Whether the output may be of this type (all but e4m3).
    pub fn is_output(self) -> bool {
        self != DType::E4m3
    }
    /// The 16-bit float dtypes: every backend's native input types, and each problem's default
    /// output type.
    pub const ALL: [DType; 2] = [DType::F16, DType::Bf16];
    /// Every input dtype, in the order tables list them.
    pub const INPUTS: [DType; 3] = [DType::F16, DType::Bf16, DType::E4m3];
    /// Every output dtype, in the order tables list them.
    pub const OUTPUTS: [DType; 3] = [DType::F16, DType::Bf16, DType::F32];
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f16" | "fp16" | "half" | "float16" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::Bf16),
            "e4m3" | "fp8" | "float8_e4m3fn" => Ok(DType::E4m3),
            "f32" | "fp32" | "float32" => Ok(DType::F32),
            _ => Err(invalid!(
                "unknown dtype {s:?} (expected f16, bf16, e4m3 or f32)"
            )),
        }
    }
}

/// How an e4m3 tensor's dequantization scales are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Scaling {
    /// One scale for the whole tensor.
    PerTensor,
    /// One scale per (batch, head) pair: outlier heads do not cost the others their precision.
    #[default]
    PerHead,
}

impl Scaling {
    /// Name as the CLI spells it.
    pub fn name(self) -> &'static str {
        match self {
            Scaling::PerTensor => "tensor",
            Scaling::PerHead => "head",
        }
    }
}

impl fmt::Display for Scaling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Scaling {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "tensor" | "per-tensor" => Ok(Scaling::PerTensor),
            "head" | "per-head" => Ok(Scaling::PerHead),
            _ => Err(invalid!(
                "unknown fp8 scaling {s:?} (expected tensor or head)"
            )),
        }
    }
}

/// How an e4m3 problem computes P·V (Q·Kᵀ is the same in both modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Fp8Mode {
    /// P·V in 16 bit: P stays f16/bf16, so the error stays near the 16-bit kernels'. The
    /// default, and what training-quality numerics need.
    #[default]
    Accurate,
    /// P·V on e4m3 tensor cores where the backend has them: P offset into (0, 256] and rounded
    /// to e4m3 (3 mantissa bits), the row sum taken from the unrounded P. About 1e-2 relative
    /// error on zero-mean outputs, as FlashAttention-3 and cuDNN ship (README, "FP8: accurate or
    /// fast"). A permission, not a demand: a backend or kernel without an e4m3 P·V runs the
    /// problem exactly as in [`Fp8Mode::Accurate`]; the `cutlass` backend's sm_90a kernel takes
    /// it at head_dim 64 and 128, with no mask or the causal one.
    Fast,
}

impl Fp8Mode {
    /// Name as the CLI and bench records spell it.
    pub fn name(self) -> &'static str {
        match self {
            Fp8Mode::Accurate => "accurate",
            Fp8Mode::Fast => "fast",
        }
    }
    /// Both modes, the default first.
    pub const ALL: [Fp8Mode; 2] = [Fp8Mode::Accurate, Fp8Mode::Fast];
}

impl fmt::Display for Fp8Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Fp8Mode {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "accurate" => Ok(Fp8Mode::Accurate),
            "fast" => Ok(Fp8Mode::Fast),
            _ => Err(invalid!(
                "unknown fp8 mode {s:?} (expected accurate or fast)"
            )),
        }
    }
}
