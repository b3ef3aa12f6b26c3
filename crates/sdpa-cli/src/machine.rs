//! What a bench record says about the machine beyond the GPU's name: the driver, the SM clock
//! and the power limit at the time of the run (NVML, loaded at run time; without it, none).

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::Clock;
use serde_json::{Value, json};

/// The driver version, SM clock now and at most (MHz) and the enforced power limit (W) of GPU
/// `ordinal`; each field null where NVML is missing or does not say.
pub fn metadata(ordinal: u32) -> Value {
    let Ok(nvml) = Nvml::init() else {
        return json!({"driver": null, "sm_clock_mhz": null, "sm_clock_max_mhz": null,
                      "power_limit_w": null});
    };
    let dev = nvml.device_by_index(ordinal).ok();
    json!({
        "driver": nvml.sys_driver_version().ok(),
        "sm_clock_mhz": dev.as_ref().and_then(|d| d.clock_info(Clock::SM).ok()),
        "sm_clock_max_mhz": dev.as_ref().and_then(|d| d.max_clock_info(Clock::SM).ok()),
        "power_limit_w": dev.as_ref().and_then(|d| d.enforced_power_limit().ok()).map(|mw| f64::from(mw) / 1e3),
    })
}

/// One line for the bench header, e.g. "driver 580.159.04, SM 1755/1980 MHz, power limit 700 W".
pub fn describe(m: &Value) -> String {
    let or_unknown = |v: &Value| match v {
        Value::Null => "?".to_string(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    format!(
        "driver {}, SM {}/{} MHz, power limit {} W",
        or_unknown(&m["driver"]),
        or_unknown(&m["sm_clock_mhz"]),
        or_unknown(&m["sm_clock_max_mhz"]),
        or_unknown(&m["power_limit_w"])
    )
}
