//! The loop budget (src/backend/wgpu/budget.rs): measured when the device opens.

mod common;

use mantissa::backend::Backend;
use mantissa::backend::wgpu::WgpuOptions;

/// Mesa's llvmpipe stops a shader's loops after 65535 iterations in Debian 12's Mesa 22 and
/// not at all in Mesa 26 (scripts/lavapipe-coop.sh); what the probe measures elsewhere is
/// printed.
#[test]
fn the_budget_is_what_the_driver_allows() {
    let test = "the_budget_is_what_the_driver_allows";
    let Some(b) = common::fresh_wgpu(test, WgpuOptions::default()) else {
        return;
    };
    let driver = &b.summary().driver;
    eprintln!("{}: {driver}: loop budget {:?}", b.name(), b.loop_budget());
    if driver.contains("llvmpipe") && driver.contains("Mesa 22.") {
        assert_eq!(b.loop_budget(), Some(65535), "{driver}");
    }
    if driver.contains("llvmpipe") && driver.contains("Mesa 26.") {
        assert_eq!(b.loop_budget(), None, "{driver}");
    }
}
