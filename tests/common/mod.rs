//! Shared by the integration tests: how a GPU test gets its device.
#![allow(dead_code)]

use sdpa::Device;
use std::io::Write;

/// GPU 0, or `None` after printing why the test is skipped. With `SDPA_REQUIRE_GPU=1` a missing
/// GPU fails the test instead, so a GPU run cannot pass by skipping.
pub fn device(test: &str) -> Option<Device> {
    match Device::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            if std::env::var("SDPA_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("{test}: SDPA_REQUIRE_GPU=1 but no GPU is usable: {e}");
            }
            // Straight to stderr: libtest would swallow an eprintln! from a passing test.
            let _ = writeln!(std::io::stderr(), "{test}: skipped, no GPU ({e})");
            None
        }
    }
}
