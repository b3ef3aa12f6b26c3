//! What was compiled, and at what cost: the ptxas report captured at build time, parsed.

use sdpa::{Device, Result};

/// Resources of one kernel for one architecture, from `ptxas -v`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelReport {
    /// Source file of the instantiation (e.g. `fwd_f16_d64.cu`).
    pub file: String,
    /// Demangled kernel signature.
    pub kernel: String,
    /// Target, e.g. `sm_90a`.
    pub arch: String,
    /// Registers per thread.
    pub registers: u32,
    /// Static shared memory per CTA in bytes.
    pub smem: u32,
    /// Stack frame per thread in bytes.
    pub stack: u32,
    /// Spill stores in bytes.
    pub spill_stores: u32,
    /// Spill loads in bytes.
    pub spill_loads: u32,
    /// ptxas serialized the kernel's wgmma (C7512, C7515, ...: "wgmma.mma_async instructions
    /// are serialized"), each waiting for the one before: as slow as a spill, without one.
    pub wgmma_serialized: bool,
}

/// ptxas's note that a function's wgmma are serialized; the function is quoted at its end.
const WGMMA_SERIALIZED: &str = "wgmma.mma_async instructions are serialized";

fn number_before(text: &str, unit: &str) -> u32 {
    text.find(unit)
        .and_then(|end| text[..end].split_whitespace().last()?.parse().ok())
        .unwrap_or(0)
}

/// Parses the text of a `-Xptxas=-v` report (files separated by `## name` lines).
pub fn parse_ptxas(report: &str) -> Vec<KernelReport> {
    let mut out = Vec::new();
    let (mut file, mut current) = (String::new(), None::<KernelReport>);
    for line in report.lines() {
        if let Some(name) = line.strip_prefix("## ") {
            file = name.trim().to_string();
        } else if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let (kernel, tail) = rest.split_once("' for '").unwrap_or((rest, "?'"));
            current = Some(KernelReport {
                file: file.clone(),
                kernel: kernel.to_string(),
                arch: tail.trim_end_matches('\'').to_string(),
                registers: 0,
                smem: 0,
                stack: 0,
                spill_stores: 0,
                spill_loads: 0,
                wgmma_serialized: false,
            });
        } else if line.contains("bytes stack frame") {
            if let Some(k) = current.as_mut() {
                k.stack = number_before(line, "bytes stack frame");
                k.spill_stores = number_before(line, "bytes spill stores");
                k.spill_loads = number_before(line, "bytes spill loads");
            }
        } else if line.contains("Used")
            && line.contains("registers")
            && let Some(mut k) = current.take()
        {
            k.registers = number_before(line, "registers");
            k.smem = number_before(line, "bytes smem");
            out.push(k);
        }
    }
    // The serialization notes name the function after its report, for the architecture that
    // has wgmma (sm_90a): mark the sm_90 reports of each function named.
    for line in report.lines().filter(|l| l.contains(WGMMA_SERIALIZED)) {
        let Some(name) = line
            .rsplit_once(" '")
            .map(|(_, n)| n.trim_end_matches('\''))
        else {
            continue;
        };
        for k in out
            .iter_mut()
            .filter(|k| k.kernel == name && k.arch.starts_with("sm_90"))
        {
            k.wgmma_serialized = true;
        }
    }
    out
}

/// Resources of each kernel as the driver reports them on `dev` (cudaFuncGetAttributes):
/// registers, static and dynamic shared memory, local memory per thread.
pub fn device_kernels(dev: &Device) -> Result<Vec<sdpa_sys::ffi::KernelAttr>> {
    // The CUDA runtime inside the core asks whatever context is current.
    dev.stream().context().bind_to_thread()?;
    Ok(sdpa_sys::ffi::kernel_attributes(&dev.info())?)
}

/// The report of the kernels in this build.
pub fn kernels() -> Vec<KernelReport> {
    parse_ptxas(sdpa_sys::PTXAS_REPORT)
}

/// CUDA architectures this build contains.
pub fn cuda_archs() -> &'static str {
    sdpa_sys::CUDA_ARCHS
}

/// Whether this build holds sm_90a code (the cutlass backend's Hopper kernel), in any of the
/// forms the architecture list names it.
pub fn built_with_sm90a() -> bool {
    sdpa_sys::built_with_sm90a()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_ptxas_report() {
        let text = "## fwd_f16_d64.cu\n\
ptxas info    : Compiling entry function 'void k<__half, 64, false>(P)' for 'sm_90a'\n\
ptxas info    : Function properties for void k<__half, 64, false>(P)\n\
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 122 registers, used 1 barriers, 36992 bytes smem\n\
ptxas info    : Compiling entry function 'void k<__half, 64, true>(P)' for 'sm_90a'\n\
ptxas info    : Function properties for void k<__half, 64, true>(P)\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 168 registers, used 2 barriers\n\
ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized \
due to insufficient register resources for the function 'void k<__half, 64, true>(P)'\n";
        let ks = parse_ptxas(text);
        let k = &ks[0];
        assert_eq!(k.file, "fwd_f16_d64.cu");
        assert_eq!(k.kernel, "void k<__half, 64, false>(P)");
        assert_eq!(k.arch, "sm_90a");
        assert_eq!(
            (k.registers, k.smem, k.stack, k.spill_stores, k.spill_loads),
            (122, 36992, 8, 4, 12)
        );
        assert!(!k.wgmma_serialized);
        assert_eq!(ks[1].kernel, "void k<__half, 64, true>(P)");
        assert!(ks[1].wgmma_serialized);
    }

    /// The spill bytes a kernel is known to have, each a step of docs/perf.md to remove: none,
    /// but cutlass's sm_90a backward at D = 64, 36 (its 128-row steps' score-mods path: softcap's
    /// tanh and ALiBi per score at 64 scores a thread).
    fn known_spill_bytes(k: &KernelReport) -> u32 {
        let d64 = k.kernel.contains("cutlass_sm90::bwd::wgmma_dkdv_kernel<")
            && k.kernel.contains(", 64, ");
        if d64 { 36 } else { 0 }
    }

    #[test]
    fn this_build_reports_every_fused_instantiation_without_spills() {
        let ks = kernels();
        let archs = cuda_archs().split(';').count();
        let mut namespaces = vec!["sdpa::scalar::", "sdpa::wmma_backend::"];
        if sdpa_sys::ffi::built_with_cutlass() {
            namespaces.push("sdpa::cutlass_sm90::");
            namespaces.push("sdpa::cutlass_sm80::");
        }
        for ns in namespaces {
            let found: Vec<_> = ks.iter().filter(|k| k.kernel.contains(ns)).collect();
            // At least 2 dtypes x 2 head dims x 2 causal per architecture built (cutlass_sm80
            // adds an 8-warp d128 variant for GPUs with less shared memory).
            assert!(found.len() >= 8 * archs, "{ns}: {ks:#?}");
            for k in found {
                assert!(k.registers > 0, "{k:?}");
                let allowed = known_spill_bytes(k);
                assert!(
                    k.spill_stores <= allowed && k.spill_loads <= allowed,
                    "{k:?} (spill bytes allowed: {allowed})"
                );
                assert!(!k.wgmma_serialized, "{k:?}: ptxas serialized its wgmma");
            }
        }
    }
}
