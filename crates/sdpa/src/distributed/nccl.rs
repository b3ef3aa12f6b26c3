//! NCCL, opened at run time: the library found where the toolkit and PyTorch put it, the few
//! entry points the ring calls, and communicators whose every wait has a deadline.
//!
//! The types (`ncclConfig_t`, `ncclUniqueId`, `ncclComm_t`) are cudarc's NCCL bindings. Its
//! functions are not called: its loader tries `libnccl.so` and CUDA-versioned names but not
//! `libnccl.so.2`, the only name the PyPI packages (`nvidia-nccl-cu12`, `-cu13`) and Debian's
//! `libnccl2` install, and it panics where the library is missing. Here the library is opened
//! by full path where needed, and its absence is `DistError::NcclNotFound`.
//!
//! Communicators are made non-blocking (`config.blocking = 0`): every NCCL call returns at
//! once, and the host polls `ncclCommGetAsyncError` until the operation is through, an error
//! comes back, or the deadline passes, when the communicator is aborted (`ncclCommAbort`, which
//! also ends its kernels still waiting for a peer). That is what turns a dead or missing peer
//! into an error instead of a hang.

use super::error::DistError;
use cudarc::nccl::sys::{ncclComm_t, ncclConfig_t, ncclUniqueId};
use libloading::Library;
use std::ffi::{CStr, OsString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// `ncclResult_t` values the ring tells apart.
const SUCCESS: c_int = 0;
const IN_PROGRESS: c_int = 7;
/// `ncclDataType_t::ncclUint8`, `ncclUint64`; `ncclRedOp_t::ncclMax`.
pub(crate) const UINT8: c_int = 1;
pub(crate) const UINT64: c_int = 5;
pub(crate) const MAX: c_int = 2;
/// `NCCL_VERSION(2, 30, 0)`: the header cudarc's `ncclConfig_t` was generated from. NCCL reads
/// a config by its `size` and `version`, so a newer library takes it as is and an older one
/// reads the fields it knows.
const CONFIG_VERSION: u32 = 23000;
const CONFIG_MAGIC: u32 = 0xcafe_beef;
const UNDEF_INT: c_int = i32::MIN;

type Stream = *mut c_void;

/// The entry points of an opened NCCL.
pub(crate) struct Nccl {
    path: String,
    version: c_int,
    get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> c_int,
    comm_init_rank_config: unsafe extern "C" fn(
        *mut ncclComm_t,
        c_int,
        ncclUniqueId,
        c_int,
        *mut ncclConfig_t,
    ) -> c_int,
    comm_get_async_error: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int,
    comm_finalize: unsafe extern "C" fn(ncclComm_t) -> c_int,
    comm_destroy: unsafe extern "C" fn(ncclComm_t) -> c_int,
    comm_abort: unsafe extern "C" fn(ncclComm_t) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    get_last_error: unsafe extern "C" fn(ncclComm_t) -> *const c_char,
    group_start: unsafe extern "C" fn() -> c_int,
    group_end: unsafe extern "C" fn() -> c_int,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, ncclComm_t, Stream) -> c_int,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, ncclComm_t, Stream) -> c_int,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        ncclComm_t,
        Stream,
    ) -> c_int,
    /// Kept open for the process's life: the pointers above point into it.
    _lib: Library,
}

/// The process's NCCL, opened on first use.
pub(crate) fn library() -> Result<&'static Nccl, DistError> {
    static NCCL: OnceLock<Result<Nccl, DistError>> = OnceLock::new();
    NCCL.get_or_init(|| open(&candidates(&|k| std::env::var_os(k))))
        .as_ref()
        .map_err(Clone::clone)
}

/// The NCCL version the library reports, as `NCCL_VERSION_CODE` (2.28.9 is 22809); and where
/// it was opened from.
pub fn nccl_version() -> Result<(i32, String), DistError> {
    let n = library()?;
    Ok((n.version, n.path.clone()))
}

/// Sets `NCCL_NVLS_ENABLE=0` (NVLink multicast off) where the environment does not choose, for
/// the NCCL rings, which refuse to start until it is set (see the module: the ring does not use
/// multicast, and NCCL reads the choice from the environment only).
///
/// # Safety
/// As [`std::env::set_var`]: no other thread may read or write the environment meanwhile. Call
/// it first in `main`, before the program (or a library it calls) starts threads.
pub unsafe fn init_env() {
    if std::env::var_os(NVLS_VAR).is_none() {
        // SAFETY: forwarded to the caller.
        unsafe { std::env::set_var(NVLS_VAR, "0") };
    }
}

const NVLS_VAR: &str = "NCCL_NVLS_ENABLE";

/// That the environment (read through `var`) says whether NCCL may use NVLink multicast,
/// before a communicator is started: NCCL's default would set it up wherever the GPUs support
/// it.
pub(crate) fn nvls_chosen(var: &dyn Fn(&str) -> Option<OsString>) -> Result<(), DistError> {
    match var(NVLS_VAR) {
        Some(_) => Ok(()),
        None => Err(DistError::Env(format!(
            "{NVLS_VAR} is not set: the ring does not use NVLink multicast, and NCCL sets it up \
             wherever the GPUs support it unless told not to (on shared hosts it can put the GPUs \
             out of service); set {NVLS_VAR}=0 where the program is launched (or 1 to let NCCL \
             use it), or call sdpa::distributed::init_env() first in main"
        ))),
    }
}

/// Where NCCL is looked for, in order. `SDPA_NCCL_LIB` (the library, or a folder holding
/// `libnccl.so.2`) replaces the search; otherwise the dynamic loader's own search
/// (`LD_LIBRARY_PATH`, the loader cache), then the PyPI package beside the CUDA packages on
/// `LD_LIBRARY_PATH` (`site-packages/nvidia/cu13/lib` has `site-packages/nvidia/nccl/lib`
/// next to it), then Python environments (`VIRTUAL_ENV`, `CONDA_PREFIX`, `/opt/torch/.venv`),
/// then the toolkit (`CUDA_HOME`, `/usr/local/cuda`).
pub(crate) fn candidates(env: &dyn Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    const SONAME: &str = "libnccl.so.2";
    if let Some(p) = env("SDPA_NCCL_LIB").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return vec![if p.is_dir() { p.join(SONAME) } else { p }];
    }
    let mut out = vec![PathBuf::from(SONAME), PathBuf::from("libnccl.so")];
    let ld = env("LD_LIBRARY_PATH").unwrap_or_default();
    for dir in std::env::split_paths(&ld) {
        // pip's layout: site-packages/nvidia/<package>/lib.
        if let Some(nvidia) = dir
            .parent()
            .and_then(Path::parent)
            .filter(|n| n.file_name().is_some_and(|f| f == "nvidia"))
        {
            out.push(nvidia.join("nccl/lib").join(SONAME));
        }
    }
    // The folders the variables name (those set), then the default.
    let folders = |vars: [&'static str; 2], default: &str| {
        vars.into_iter()
            .filter_map(env)
            .map(PathBuf::from)
            .chain([PathBuf::from(default)])
    };
    for prefix in folders(["VIRTUAL_ENV", "CONDA_PREFIX"], "/opt/torch/.venv") {
        let lib = prefix.join("lib");
        let mut pythons: Vec<PathBuf> = std::fs::read_dir(&lib)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("python3"))
            })
            .collect();
        pythons.sort();
        if pythons.is_empty() {
            pythons.push(lib.join("python3"));
        }
        for py in pythons {
            out.push(py.join("site-packages/nvidia/nccl/lib").join(SONAME));
        }
    }
    for home in folders(["CUDA_HOME", "CUDA_PATH"], "/usr/local/cuda") {
        out.push(home.join("lib64").join(SONAME));
    }
    let mut seen = std::collections::HashSet::new();
    out.retain(|p| seen.insert(p.clone()));
    out
}

/// The first candidate that opens and has NCCL's entry points.
fn open(candidates: &[PathBuf]) -> Result<Nccl, DistError> {
    let mut tried = Vec::new();
    for path in candidates {
        // A bare name goes through the loader's search; a path that is not there says so in
        // fewer words than the loader would.
        if path.components().count() > 1 && !path.exists() {
            tried.push(format!("{}: no such file", path.display()));
            continue;
        }
        // SAFETY: NCCL's initialisers only register the library; nothing runs until called.
        match unsafe { Library::new(path) } {
            Ok(lib) => match Nccl::bind(lib, path) {
                Ok(n) => return Ok(n),
                Err(e) => tried.push(format!("{}: {e}", path.display())),
            },
            Err(e) => {
                // libloading says "dlopen failed"; the loader's own words are its source.
                let why = std::error::Error::source(&e).map_or(e.to_string(), |s| s.to_string());
                tried.push(format!("{}: {why}", path.display()));
            }
        }
    }
    Err(DistError::NcclNotFound { searched: tried })
}

impl Nccl {
    fn bind(lib: Library, path: &Path) -> Result<Nccl, String> {
        /// A symbol of `lib` as a function pointer of the type its use gives.
        fn sym<T: Copy>(lib: &Library, name: &str) -> Result<T, String> {
            // SAFETY: each name is bound to the C signature nccl.h gives it (the field's type).
            unsafe { lib.get::<T>(name.as_bytes()) }
                .map(|s| *s)
                .map_err(|e| format!("not NCCL ({name}: {e})"))
        }
        let get_version: unsafe extern "C" fn(*mut c_int) -> c_int = sym(&lib, "ncclGetVersion")?;
        let mut version = 0;
        // SAFETY: writes one int.
        unsafe { get_version(&mut version) };
        if version < 21800 {
            return Err(format!(
                "NCCL {version} is too old: non-blocking communicators need 2.18 or newer"
            ));
        }
        Ok(Nccl {
            path: path.display().to_string(),
            version,
            get_unique_id: sym(&lib, "ncclGetUniqueId")?,
            comm_init_rank_config: sym(&lib, "ncclCommInitRankConfig")?,
            comm_get_async_error: sym(&lib, "ncclCommGetAsyncError")?,
            comm_finalize: sym(&lib, "ncclCommFinalize")?,
            comm_destroy: sym(&lib, "ncclCommDestroy")?,
            comm_abort: sym(&lib, "ncclCommAbort")?,
            get_error_string: sym(&lib, "ncclGetErrorString")?,
            get_last_error: sym(&lib, "ncclGetLastError")?,
            group_start: sym(&lib, "ncclGroupStart")?,
            group_end: sym(&lib, "ncclGroupEnd")?,
            send: sym(&lib, "ncclSend")?,
            recv: sym(&lib, "ncclRecv")?,
            all_reduce: sym(&lib, "ncclAllReduce")?,
            _lib: lib,
        })
    }

    /// `Ok` for success or "in progress" (a non-blocking call that goes on in the background),
    /// else the error with NCCL's words for it.
    fn check(
        &self,
        call: &'static str,
        code: c_int,
        comm: Option<ncclComm_t>,
    ) -> Result<(), DistError> {
        if code == SUCCESS || code == IN_PROGRESS {
            return Ok(());
        }
        Err(self.error(call, code, comm))
    }

    fn error(&self, call: &'static str, code: c_int, comm: Option<ncclComm_t>) -> DistError {
        let text = |p: *const c_char| {
            // SAFETY: NCCL returns NUL-terminated static or per-communicator strings.
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        };
        // SAFETY: any code has a string.
        let mut message = text(unsafe { (self.get_error_string)(code) }).unwrap_or_default();
        // SAFETY: `comm` is a live communicator (or absent).
        if let Some(last) = comm.and_then(|c| text(unsafe { (self.get_last_error)(c) }))
            && !last.is_empty()
        {
            message = format!("{message}: {last}");
        }
        DistError::Nccl {
            call,
            code,
            message,
        }
    }

    /// A new unique id (on the rank that hands it to the others).
    pub(crate) fn unique_id(&self) -> Result<[u8; 128], DistError> {
        let mut id = ncclUniqueId { internal: [0; 128] };
        // SAFETY: writes the id.
        self.check(
            "ncclGetUniqueId",
            unsafe { (self.get_unique_id)(&mut id) },
            None,
        )?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// Brackets NCCL calls that must be issued together (the sends and receives of one ring
    /// step; the init of several ranks in one process).
    pub(crate) fn group<R>(
        &self,
        f: impl FnOnce() -> Result<R, DistError>,
    ) -> Result<R, DistError> {
        // SAFETY: no arguments.
        self.check("ncclGroupStart", unsafe { (self.group_start)() }, None)?;
        let r = f();
        // SAFETY: closes the group opened above, also when `f` failed (its calls then run or
        // fail together, and the caller aborts).
        let end = self.check("ncclGroupEnd", unsafe { (self.group_end)() }, None);
        let r = r?;
        end.map(|_| r)
    }
}

/// One rank's communicator. Dropped: finalized and destroyed, or aborted where that does not
/// finish in time or the communicator failed.
pub(crate) struct Comm {
    nccl: &'static Nccl,
    raw: ncclComm_t,
    /// Set once aborted: the handle is gone, and every later use is refused.
    aborted: Option<String>,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time (`&mut self` for
// every call that issues work).
unsafe impl Send for Comm {}

impl Comm {
    /// Starts rank `rank` of `world` on the CUDA device current on this thread, non-blocking:
    /// the communicator is usable once [`Comm::wait`] returns. Several ranks of one process
    /// start inside one [`Nccl::group`].
    pub(crate) fn start(
        nccl: &'static Nccl,
        id: &[u8; 128],
        rank: usize,
        world: usize,
    ) -> Result<Comm, DistError> {
        let mut config = nonblocking_config();
        let id = ncclUniqueId {
            internal: id.map(|b| b as c_char),
        };
        let mut raw: ncclComm_t = std::ptr::null_mut();
        let (rank, world) = (to_int(rank)?, to_int(world)?);
        // SAFETY: `raw` receives the handle; `config` lives through the call.
        let code = unsafe { (nccl.comm_init_rank_config)(&mut raw, world, id, rank, &mut config) };
        if raw.is_null() {
            return Err(nccl.error("ncclCommInitRankConfig", code, None));
        }
        let comm = Comm {
            nccl,
            raw,
            aborted: None,
        };
        nccl.check("ncclCommInitRankConfig", code, Some(raw))?;
        Ok(comm)
    }

    /// Waits until the communicator's last call is through (not its GPU work: that is ordered
    /// on the stream it was issued on). Past `deadline`, or on an error, the communicator is
    /// aborted and the error returned.
    pub(crate) fn wait(&mut self, what: &str, deadline: Deadline) -> Result<(), DistError> {
        loop {
            match self.poll()? {
                true => return Ok(()),
                false if deadline.passed() => {
                    let e = deadline.timeout(what);
                    self.abort(&e.to_string());
                    return Err(e);
                }
                false => std::thread::sleep(Duration::from_micros(200)),
            }
        }
    }

    /// Whether the last call is through (`false`: still in progress). An asynchronous error
    /// (a peer gone, a network failure) aborts the communicator and comes back as `Err`.
    pub(crate) fn poll(&mut self) -> Result<bool, DistError> {
        let raw = self.live()?;
        let mut state = SUCCESS;
        // SAFETY: a live communicator; writes one int.
        let code = unsafe { (self.nccl.comm_get_async_error)(raw, &mut state) };
        self.nccl.check("ncclCommGetAsyncError", code, Some(raw))?;
        match state {
            SUCCESS => Ok(true),
            IN_PROGRESS => Ok(false),
            e => {
                let err = self.nccl.error("NCCL (asynchronous)", e, Some(raw));
                self.abort(&err.to_string());
                Err(err)
            }
        }
    }

    /// Ends the communicator now: its pending operations and kernels stop. Idempotent.
    pub(crate) fn abort(&mut self, why: &str) {
        if self.aborted.is_none() {
            // SAFETY: a live communicator, not used after this.
            unsafe { (self.nccl.comm_abort)(self.raw) };
            self.aborted = Some(why.to_string());
        }
    }

    /// The handle, unless aborted.
    pub(crate) fn live(&self) -> Result<ncclComm_t, DistError> {
        match &self.aborted {
            Some(why) => Err(DistError::Aborted(why.clone())),
            None => Ok(self.raw),
        }
    }

    /// Makes one call on the live communicator (`f` gets its handle) and checks the code.
    fn issue(
        &self,
        call: &'static str,
        f: impl FnOnce(ncclComm_t) -> c_int,
    ) -> Result<(), DistError> {
        let raw = self.live()?;
        self.nccl.check(call, f(raw), Some(raw))
    }

    /// Sends `bytes` bytes at `buf` to `peer` on `stream` (inside a group with the matching
    /// receive).
    ///
    /// # Safety
    /// `buf` must be a device buffer of `bytes` bytes, not written until the send completes on
    /// `stream`.
    pub(crate) unsafe fn send(
        &self,
        buf: u64,
        bytes: usize,
        peer: usize,
        stream: Stream,
    ) -> Result<(), DistError> {
        let peer = to_int(peer)?;
        self.issue("ncclSend", |raw| {
            // SAFETY: forwarded to the caller.
            unsafe { (self.nccl.send)(buf as *const c_void, bytes, UINT8, peer, raw, stream) }
        })
    }

    /// Receives `bytes` bytes from `peer` into `buf` on `stream`.
    ///
    /// # Safety
    /// `buf` must be a device buffer of `bytes` bytes, neither read nor written until the
    /// receive completes on `stream`.
    pub(crate) unsafe fn recv(
        &self,
        buf: u64,
        bytes: usize,
        peer: usize,
        stream: Stream,
    ) -> Result<(), DistError> {
        let peer = to_int(peer)?;
        self.issue("ncclRecv", |raw| {
            // SAFETY: forwarded to the caller.
            unsafe { (self.nccl.recv)(buf as *mut c_void, bytes, UINT8, peer, raw, stream) }
        })
    }

    /// The element-wise maximum of `count` u64s at `buf` over all ranks, in place, on `stream`.
    ///
    /// # Safety
    /// `buf` must be a device buffer of `count` u64s, untouched until the reduction completes.
    pub(crate) unsafe fn max_u64(
        &self,
        buf: u64,
        count: usize,
        stream: Stream,
    ) -> Result<(), DistError> {
        let p = buf as *mut c_void;
        self.issue("ncclAllReduce", |raw| {
            // SAFETY: forwarded to the caller; NCCL reduces in place when both pointers agree.
            unsafe { (self.nccl.all_reduce)(p, p, count, UINT64, MAX, raw, stream) }
        })
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if self.aborted.is_some() {
            return;
        }
        // Finalize flushes what is still queued; a peer that is gone would make it wait
        // forever, so it gets a short deadline and an abort after.
        // SAFETY: a live communicator.
        let code = unsafe { (self.nccl.comm_finalize)(self.raw) };
        let flushed = (code == SUCCESS || code == IN_PROGRESS)
            && self
                .wait(
                    "finalizing the communicator",
                    Deadline::after(Duration::from_secs(10)),
                )
                .is_ok();
        if flushed {
            // SAFETY: finalized; not used after this.
            unsafe { (self.nccl.comm_destroy)(self.raw) };
        } else {
            self.abort("dropped");
        }
    }
}

/// The config of a non-blocking communicator, NCCL's defaults otherwise
/// (`NCCL_CONFIG_INITIALIZER`).
fn nonblocking_config() -> ncclConfig_t {
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
        graphUsageMode: UNDEF_INT,
        numRmaCtx: UNDEF_INT,
        maxP2pPeers: UNDEF_INT,
    }
}

fn to_int(x: usize) -> Result<c_int, DistError> {
    c_int::try_from(x).map_err(|_| DistError::Mismatch(format!("{x} does not fit NCCL's int")))
}

/// When waiting for other ranks stops: `limit` after it was made, or never where that lies
/// beyond what `Instant` can hold (`Duration::MAX` as a timeout means "no limit", not a panic).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline {
    /// `None`: never.
    at: Option<Instant>,
    limit: Duration,
}

impl Deadline {
    pub(crate) fn after(limit: Duration) -> Deadline {
        Deadline {
            at: Instant::now().checked_add(limit),
            limit,
        }
    }
    pub(crate) fn limit(&self) -> Duration {
        self.limit
    }
    pub(crate) fn passed(&self) -> bool {
        self.at.is_some_and(|at| Instant::now() >= at)
    }
    /// The time left; `Duration::MAX` for a deadline that never comes.
    pub(crate) fn left(&self) -> Duration {
        self.at.map_or(Duration::MAX, |at| {
            at.saturating_duration_since(Instant::now())
        })
    }
    /// The same deadline, `by` later (and its limit `by` longer).
    pub(crate) fn extended(&self, by: Duration) -> Deadline {
        Deadline {
            at: self.at.and_then(|at| at.checked_add(by)),
            limit: self.limit.saturating_add(by),
        }
    }
    pub(crate) fn timeout(&self, what: &str) -> DistError {
        DistError::Timeout {
            what: what.to_string(),
            after: self.limit,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let m: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn an_explicit_library_replaces_the_search() {
        let c = candidates(&env(&[("SDPA_NCCL_LIB", "/opt/nccl/libnccl.so.2.99")]));
        assert_eq!(c, [PathBuf::from("/opt/nccl/libnccl.so.2.99")]);
        let dir = std::env::temp_dir();
        let c = candidates(&env(&[("SDPA_NCCL_LIB", dir.to_str().unwrap())]));
        assert_eq!(c, [dir.join("libnccl.so.2")]);
    }

    #[test]
    fn the_search_finds_pip_packages_beside_the_cuda_ones() {
        let venv = "/opt/torch/.venv/lib/python3.12/site-packages/nvidia";
        let ld = format!("/usr/local/cuda/lib64:{venv}/cu13/lib");
        let c = candidates(&env(&[("LD_LIBRARY_PATH", &ld), ("CUDA_HOME", "/cuda")]));
        assert_eq!(c[0], PathBuf::from("libnccl.so.2"));
        assert_eq!(c[1], PathBuf::from("libnccl.so"));
        let pip = PathBuf::from(format!("{venv}/nccl/lib/libnccl.so.2"));
        assert!(c.contains(&pip), "{c:?}");
        assert!(
            c.contains(&PathBuf::from("/cuda/lib64/libnccl.so.2")),
            "{c:?}"
        );
        assert!(
            c.contains(&PathBuf::from("/usr/local/cuda/lib64/libnccl.so.2")),
            "{c:?}"
        );
        let unique: std::collections::HashSet<_> = c.iter().collect();
        assert_eq!(unique.len(), c.len(), "no path tried twice");
    }

    #[test]
    fn a_missing_library_is_a_typed_error_naming_every_place_tried() {
        let e = match open(&[
            PathBuf::from("/nonexistent/libnccl.so.2"),
            PathBuf::from("libnccl-not-here.so.2"),
        ]) {
            Err(e) => e,
            Ok(_) => panic!("opened a library that does not exist"),
        };
        let DistError::NcclNotFound { searched } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(searched.len(), 2);
        assert_eq!(searched[0], "/nonexistent/libnccl.so.2: no such file");
        assert!(
            searched[1].starts_with("libnccl-not-here.so.2: "),
            "{searched:?}"
        );
        assert!(e.to_string().contains("SDPA_NCCL_LIB"), "{e}");
    }

    #[test]
    fn a_library_that_is_not_nccl_is_refused() {
        // libm is on every Linux machine and has no ncclGetVersion.
        let e = match open(&[PathBuf::from("libm.so.6")]) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("libm taken for NCCL"),
        };
        assert!(e.contains("not NCCL (ncclGetVersion"), "{e}");
    }

    #[test]
    fn the_config_is_what_nccl_config_initializer_gives_but_non_blocking() {
        let c = nonblocking_config();
        assert_eq!(c.size, std::mem::size_of::<ncclConfig_t>());
        assert_eq!((c.magic, c.version, c.blocking), (0xcafebeef, 23000, 0));
        assert_eq!((c.minCTAs, c.maxP2pPeers), (i32::MIN, i32::MIN));
        assert!(c.netName.is_null() && c.commName.is_null());
    }

    /// Where NCCL is installed (the GPU machines; `SDPA_NCCL_LIB` elsewhere), it opens and
    /// reports its version, and opening it wrote nothing to the environment; else the search's
    /// error.
    #[test]
    fn nccl_opens_where_installed() {
        let nvls = std::env::var_os(NVLS_VAR);
        match library() {
            Ok(n) => {
                assert!(n.version >= 21800, "{}", n.version);
                let (v, path) = nccl_version().unwrap();
                assert_eq!((v, path.as_str()), (n.version, n.path.as_str()));
                eprintln!("NCCL {v} from {path}");
            }
            Err(e) => {
                assert!(matches!(e, DistError::NcclNotFound { .. }), "{e}");
                eprintln!("nccl_opens_where_installed: NCCL not here ({e})");
            }
        }
        assert_eq!(std::env::var_os(NVLS_VAR), nvls);
    }

    #[test]
    fn nccl_rings_need_the_multicast_choice_made() {
        let e = nvls_chosen(&env(&[])).unwrap_err();
        assert!(matches!(e, DistError::Env(_)), "{e}");
        let e = e.to_string();
        assert!(
            e.contains("NCCL_NVLS_ENABLE=0") && e.contains("init_env"),
            "{e}"
        );
        nvls_chosen(&env(&[("NCCL_NVLS_ENABLE", "0")])).unwrap();
        nvls_chosen(&env(&[("NCCL_NVLS_ENABLE", "2")])).unwrap();
    }

    #[test]
    fn deadlines_time_out_with_what_was_waited_for() {
        let d = Deadline::after(Duration::ZERO);
        assert!(d.passed());
        assert_eq!(d.left(), Duration::ZERO);
        let e = d.timeout("rank 3's K/V").to_string();
        assert!(e.starts_with("rank 3's K/V: no answer within 0ns"), "{e}");
    }

    /// A limit past what `Instant` holds is a deadline that never comes (it panicked before:
    /// `Instant + Duration::MAX`), however it is extended.
    #[test]
    fn a_deadline_beyond_instant_never_comes() {
        for limit in [Duration::MAX, Duration::from_secs(u64::MAX)] {
            let d = Deadline::after(limit);
            assert!(!d.passed());
            assert_eq!(d.left(), Duration::MAX);
            let e = d.extended(Duration::MAX);
            assert!(!e.passed());
            assert_eq!(e.limit(), Duration::MAX);
        }
    }
}
