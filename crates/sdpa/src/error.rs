//! One error type for the whole crate. Every failure is a value: bad arguments, unsupported
//! problems, a machine without a GPU or driver, and CUDA failures inside the core.

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong, each variant with a message naming the offending value.
/// `Send + Sync + 'static`, so it crosses threads and boxes into other error types. New
/// variants may come (`#[non_exhaustive]`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An argument is malformed: shapes, dtypes, buffer sizes, names.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The problem is valid but this backend (or this device) cannot run it.
    #[error("backend {backend} does not support this problem: {reason}")]
    Unsupported {
        /// Backend name as `Backend::name` prints it.
        backend: &'static str,
        /// Which limit was hit, with the offending value.
        reason: String,
    },
    /// No usable GPU: no driver library, no device, or the ordinal does not exist.
    #[error("no GPU: {0}")]
    NoDevice(String),
    /// A CUDA call failed (driver API via cudarc, or inside the C++ core).
    #[error("CUDA error: {0}")]
    Cuda(#[source] CudaError),
    /// An allocation larger than the memory left: checked before allocating, so the process
    /// never aborts on it.
    #[error(
        "out of {kind} memory: needs {} ({needed} bytes), {}",
        human_bytes(*.needed),
        .available.map_or("how much is available is unknown".to_string(), |a| format!("{} available", human_bytes(a)))
    )]
    OutOfMemory {
        /// Host or device.
        kind: MemoryKind,
        /// Bytes the allocation needs (`usize::MAX` when the size overflows).
        needed: usize,
        /// Bytes available when it was checked, where known.
        available: Option<usize>,
    },
    /// Attention across GPUs or processes (`sdpa::distributed`): NCCL missing or failing, the
    /// ranks' rendezvous, ranks that disagree on the problem, a rank that stopped answering.
    #[cfg(feature = "distributed")]
    #[error("distributed: {0}")]
    Distributed(#[from] crate::distributed::DistError),
    /// Reading or writing a file.
    #[error("{path}: {msg}")]
    Io {
        /// The file.
        path: String,
        /// What went wrong.
        msg: String,
    },
}

/// Where an allocation lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    /// Host RAM.
    Host,
    /// GPU memory.
    Device,
}

impl std::fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MemoryKind::Host => "host",
            MemoryKind::Device => "device",
        })
    }
}

/// A failed CUDA call: what failed, and the driver's error where the failure came from the
/// driver API (`std::error::Error::source`).
#[derive(Debug)]
pub struct CudaError {
    message: String,
    driver: Option<cudarc::driver::DriverError>,
}

impl std::fmt::Display for CudaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for CudaError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.driver
            .as_ref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl From<String> for CudaError {
    fn from(message: String) -> Self {
        CudaError {
            message,
            driver: None,
        }
    }
}

impl From<&str> for CudaError {
    fn from(message: &str) -> Self {
        message.to_string().into()
    }
}

impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Error::Cuda(CudaError {
            message: e.to_string(),
            driver: Some(e),
        })
    }
}

impl From<cxx::Exception> for Error {
    fn from(e: cxx::Exception) -> Self {
        Error::Cuda(e.what().into())
    }
}

/// `1536` -> `1.5 KiB`.
fn human_bytes(b: usize) -> String {
    let units = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let (mut x, mut u) = (b as f64, 0);
    while x >= 1024.0 && u + 1 < units.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} bytes")
    } else {
        format!("{x:.1} {}", units[u])
    }
}

/// Shorthand for an `InvalidArgument` error from a format string.
macro_rules! invalid {
    ($($arg:tt)*) => { $crate::error::Error::InvalidArgument(format!($($arg)*)) };
}
pub(crate) use invalid;

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn cuda_errors_chain_their_source() {
        let e = Error::Cuda("kernel launch failed".into());
        assert_eq!(e.to_string(), "CUDA error: kernel launch failed");
        let inner = e.source().expect("the CUDA error is the source");
        assert_eq!(inner.to_string(), "kernel launch failed");
        assert!(
            inner.source().is_none(),
            "no driver error behind a core message"
        );
    }
}
