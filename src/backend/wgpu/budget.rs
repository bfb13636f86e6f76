//! The loop budget. Some drivers stop a shader's loops, silently, once one invocation has run a
//! fixed number of loop iterations in all: Mesa's llvmpipe (lavapipe, the software Vulkan
//! device of machines without a GPU) counts every pass through the end of any loop of a shader
//! against one counter of 65535 per invocation (Debian 12's Mesa 22; Mesa 26 has no such
//! counter). A loop that runs n times passes its end n + 1 times (the last is its exit test),
//! and a loop in a branch no lane takes passes once. A matmul whose K loop met the counter
//! summed the first part of K alone, and reported success.
//!
//! The budget is measured when the device opens (`measure`): one invocation is asked to run a
//! loop of `PROBE_ITERATIONS` and counts what it ran; a short count is the budget, a whole one
//! means none. Where there is one, every kernel whose loops grow with the sizes it is given
//! counts its iterations per invocation from its structure (`looped`: each loop with its exit
//! test, loops a compiler may unroll and loops in branches not taken included) and stays within
//! half the budget (`Gpu::usable_loop_iterations`; the other half covers loops a driver adds
//! when it lowers the code): by giving the work more invocations (the row ops' lanes), or by
//! splitting it over dispatches that carry their partial results in memory (`Gpu::loop_ranges`:
//! the matmul over K, long sums), or, where neither can be done, by refusing the size with
//! `Error::LoopBudget`. Where there is no budget nothing changes: the same kernels, one
//! dispatch each.

use super::buffer::{Dispatch, read_words, submit, upload};
use super::device::Gpu;
use super::shaders::Kernel;
use crate::error::{Error, Result};

/// Iterations the probe asks of its loop: an adapter that runs them all is taken to have no
/// budget (a limit above this would go unseen; the known one is 65535).
pub const PROBE_ITERATIONS: u32 = 1 << 22;

pub use super::shaders::looped;

/// Measures `gpu`'s loop budget into `Gpu::loop_budget` (a smaller `assumed` stands in for
/// it: tests that need a budget where the adapter has none).
pub async fn measure_into(gpu: &mut Gpu, assumed: Option<u32>) -> Result<()> {
    let measured = measure(gpu).await?;
    gpu.loop_budget = match (measured, assumed) {
        (Some(m), Some(a)) => Some(m.min(a)),
        (m, a) => m.or(a),
    };
    Ok(())
}

/// The adapter's budget: what one invocation of `loop_probe.wgsl` counts of a loop of
/// `PROBE_ITERATIONS`, where that is short (else None).
pub(super) async fn measure(gpu: &Gpu) -> Result<Option<u32>> {
    let probe = upload(gpu, "mantissa.loop_probe", &[PROBE_ITERATIONS, 0]);
    gpu.scoped("measuring the loop budget", || {
        let pipeline = gpu.pipeline(&Kernel::LoopProbe)?;
        let dispatch = Dispatch::new(gpu, pipeline, &[&probe], [1, 1, 1]);
        submit(gpu, &[], &[dispatch], None);
        Ok(())
    })
    .await?;
    let counted = read_words(gpu, &probe, 2).await?[1];
    Ok((counted < PROBE_ITERATIONS).then_some(counted))
}

impl Gpu {
    /// Loop iterations a kernel may plan on per invocation here: half the budget (None: no
    /// budget, anything goes).
    pub fn usable_loop_iterations(&self) -> Option<u64> {
        self.loop_budget.map(|b| u64::from(b) / 2)
    }

    /// Checks that a kernel running `iterations` loop iterations per invocation (from its
    /// structure) fits the budget; `what` names the kernel and sizes, `advice` what to do.
    pub fn check_loops(&self, what: &str, iterations: u64, advice: &str) -> Result<()> {
        match (self.loop_budget, self.usable_loop_iterations()) {
            (Some(budget), Some(usable)) if iterations > usable => Err(Error::LoopBudget {
                what: what.to_string(),
                iterations,
                budget,
                device: self.name().to_string(),
                advice: advice.to_string(),
            }),
            _ => Ok(()),
        }
    }

    /// `units` of a kernel's long loop (K steps, tokens, chunks of a sum) as the ranges [begin,
    /// end) its dispatches take, each within the budget: a dispatch taking r units runs `fixed +
    /// per_unit * r` loop iterations per invocation. One range of all where there is no budget;
    /// an error where not even one unit fits.
    pub fn loop_ranges(
        &self,
        what: &str,
        fixed: u64,
        per_unit: u64,
        units: u64,
    ) -> Result<Vec<(u64, u64)>> {
        ranges(self.usable_loop_iterations(), fixed, per_unit, units).or_else(|needed| {
            self.check_loops(what, needed, "no smaller piece of it can be run")?;
            Ok(vec![(0, units)])
        })
    }
}

/// `units` in ranges of at most what `usable` iterations allow (`Gpu::loop_ranges`), or the
/// iterations one unit needs where that is more.
fn ranges(
    usable: Option<u64>,
    fixed: u64,
    per_unit: u64,
    units: u64,
) -> std::result::Result<Vec<(u64, u64)>, u64> {
    let Some(usable) = usable else {
        return Ok(vec![(0, units)]);
    };
    let per_dispatch = usable.saturating_sub(fixed) / per_unit.max(1);
    if per_dispatch == 0 {
        return Err(fixed + per_unit);
    }
    if units == 0 {
        return Ok(vec![(0, 0)]);
    }
    Ok((0..units.div_ceil(per_dispatch))
        .map(|i| (i * per_dispatch, ((i + 1) * per_dispatch).min(units)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::ranges;

    #[test]
    fn ranges_cover_the_units_in_order_each_within_the_budget() {
        assert_eq!(ranges(None, 10, 3, 1000), Ok(vec![(0, 1000)]));
        for (usable, fixed, per_unit, units) in
            [(100, 10, 3, 1000), (100, 10, 3, 30), (13, 10, 3, 7)]
        {
            let r = ranges(Some(usable), fixed, per_unit, units).unwrap();
            assert_eq!(r.first().unwrap().0, 0);
            assert_eq!(r.last().unwrap().1, units);
            assert!(r.windows(2).all(|w| w[0].1 == w[1].0));
            assert!(
                r.iter()
                    .all(|&(b, e)| b < e && fixed + per_unit * (e - b) <= usable)
            );
        }
        assert_eq!(ranges(Some(100), 10, 3, 30), Ok(vec![(0, 30)]));
        assert_eq!(ranges(Some(100), 10, 3, 31), Ok(vec![(0, 30), (30, 31)]));
        assert_eq!(ranges(Some(12), 10, 3, 5), Err(13));
    }
}
