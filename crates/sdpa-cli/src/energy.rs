//! `sdpa bench --energy-s`: energy per call under sustained load. A GPU at its power cap lowers
//! its clock, so a kernel that spends fewer joules per call keeps more of it: the figure sits
//! next to time. Read from the GPU's energy counter (NVML, loaded at run time) across the
//! measured window of `sdpa_harness::timing::sustain`, with the mean power and SM clock.

use nvml_wrapper::enum_wrappers::device::Clock;
use nvml_wrapper::{Device as NvmlDevice, Nvml};
use sdpa::{Device, Error, Result};
use sdpa_harness::timing::{Phase, sustain};
use std::time::{Duration, Instant};

/// One sustained run's figures.
#[derive(Debug, Clone, Copy)]
pub struct Energy {
    /// Wall time per call under sustained load, microseconds.
    pub us_per_call: f64,
    /// Energy per call, millijoules (the board's counter over the window / calls).
    pub mj_per_call: f64,
    /// Mean board power over the window, watts.
    pub watts: f64,
    /// Mean SM clock sampled during the window, MHz.
    pub sm_mhz: f64,
}

/// The NVML handle of the GPU a `Device` runs on, matched by PCI bus id.
pub struct Meter {
    nvml: Nvml,
    bus_id: String,
}

impl Meter {
    /// NVML, and the bus id of `dev` in NVML's form ("00000000:3B:00.0").
    pub fn open(dev: &Device) -> Result<Meter> {
        let nvml = Nvml::init().map_err(|e| {
            Error::NoDevice(format!(
                "--energy-s reads the GPU's energy counter through NVML (libnvidia-ml.so.1, \
                 installed with the driver), which did not load: {e}"
            ))
        })?;
        use cudarc::driver::sys::CUdevice_attribute as A;
        let ctx = dev.stream().context();
        let attr = |a| ctx.attribute(a).map_err(Error::from);
        let bus_id = format!(
            "{:08X}:{:02X}:{:02X}.0",
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
        );
        let meter = Meter { nvml, bus_id };
        meter.device()?.total_energy_consumption().map_err(|e| {
            Error::NoDevice(format!("NVML has no energy counter for this GPU: {e}"))
        })?;
        Ok(meter)
    }

    fn device(&self) -> Result<NvmlDevice<'_>> {
        self.nvml
            .device_by_pci_bus_id(self.bus_id.as_str())
            .map_err(|e| Error::NoDevice(format!("NVML does not know GPU {}: {e}", self.bus_id)))
    }

    /// Runs `f` (work on `dev`'s stream alone) back to back for about `seconds`
    /// (`sustain`) and reads the energy counter around its measured window, sampling the SM
    /// clock every 50 ms within it.
    pub fn measure(
        &self,
        dev: &Device,
        seconds: f64,
        f: impl FnMut() -> Result<()>,
    ) -> Result<Energy> {
        let nv = self.device()?;
        let nvml_err = |e: nvml_wrapper::error::NvmlError| Error::Cuda(format!("NVML: {e}").into());
        let mut counter_mj = [0u64; 2];
        let mut clocks = Vec::new();
        let mut last = Instant::now();
        let mut failure = None;
        let run = sustain(dev, seconds, f, |phase| {
            let read = match phase {
                Phase::Start => nv.total_energy_consumption().map(|mj| counter_mj[0] = mj),
                Phase::End => nv.total_energy_consumption().map(|mj| counter_mj[1] = mj),
                Phase::Running if last.elapsed() >= Duration::from_millis(50) => {
                    last = Instant::now();
                    nv.clock_info(Clock::SM)
                        .map(|mhz| clocks.push(f64::from(mhz)))
                }
                Phase::Running => Ok(()),
            };
            if let Err(e) = read {
                failure.get_or_insert(e);
            }
        })?;
        if let Some(e) = failure {
            return Err(nvml_err(e));
        }
        let joules = counter_mj[1].saturating_sub(counter_mj[0]) as f64 * 1e-3;
        Ok(Energy {
            us_per_call: run.us_per_call(),
            mj_per_call: joules * 1e3 / run.calls as f64,
            watts: joules / run.seconds,
            sm_mhz: match clocks.is_empty() {
                true => f64::NAN,
                false => clocks.iter().sum::<f64>() / clocks.len() as f64,
            },
        })
    }
}
