//! The matmul autotuner: times candidate tiles once per (adapter, driver, kernel variant, shape
//! class) on the operands of the first matmul of that class, keeps the fastest, and persists the
//! choice in a JSON cache file so later runs start tuned.
//!
//! Every tile, and every split of K, computes bit for bit the same result (each output sums K
//! in groups of `GROUP_K` in order, whatever the tile or split: matmul.wgsl, "Summation
//! order"), so tuning changes speed only; tests/autotune.rs and tests/coop.rs check that. On a
//! cooperative-matrix device the tuner also times SIMT tiles (`Tile::simt`), which compute
//! the SIMT kernel's bits: both meet the algorithm's contract, and the cached choice keeps a
//! machine's runs alike.
//!
//! Matmuls under `TUNE_MIN_FLOPS` (a 128x128x128 product) take the default tile untuned: their
//! time is mostly the dispatch's, and each candidate costs a kernel compile, which on a
//! software rasterizer or with runtime checks (browsers) takes far longer than the tile could
//! ever save.
//!
//! On a software adapter (lavapipe, SwiftShader, WARP) `fast` tunes nothing (`mode_on`): one
//! candidate's compile takes seconds there (`mantissa train --config tiny` spent 9 of its 10
//! minutes tuning 12 shape classes on lavapipe, 2 CPU cores), and a CPU's fastest tile says
//! nothing of a GPU's; `full` still tunes, as asked.
//!
//! `MANTISSA_AUTOTUNE`: `off` (default tiles), `fast` (the default and its neighbours: one
//! dimension halved or doubled; on cooperative matrices also the published designs'
//! staged blocks, `Tile::coop_designs`, tried right after the default), `full` (every tile the device's limits allow); each candidate
//! timed as the median of `TUNE_RUNS` after a warm-up, nearest the default first, within the
//! search's budget (`MANTISSA_TUNE_SECONDS`; a tile that fails to compile or run is dropped and
//! said). The cache lives in
//! `MANTISSA_CACHE_DIR`, else `$XDG_CACHE_HOME/mantissa`, else `~/.cache/mantissa` (`autotune.json`); in the browser the
//! demo keeps it in the page's localStorage (any `TileStore` serves).

use super::WgpuBackend;
use super::matmul::OnDevice;
use super::shaders::{GROUP_K, Tile};
use crate::algorithm::{Algorithm, MatmulShape};
use crate::backend::Operands;
use crate::backend::sources::Sources;
use crate::error::{Error, Result};
use std::path::PathBuf;

/// The source files of the matmul kernels and of the kernels that prepare their operands.
pub const MATMUL_FILES: [&str; 10] = [
    "formats.wgsl",
    "fetch.wgsl",
    "matmul.wgsl",
    "matmul_step.wgsl",
    "matmul_coop.wgsl",
    "coop_block.wgsl",
    "coop_pack.wgsl",
    "cast.wgsl",
    "scale.wgsl",
    "split.wgsl",
];

pub use crate::tune::{
    AUTOTUNE_ENV, AutotuneMode, FileStore, TUNE_MIN_FLOPS, TileStore, Tuner, shape_class,
};

/// The tile store of the wgpu backend.
pub type Autotuner = Tuner<Tile>;

impl Autotuner {
    /// The default cache file (none in the browser, or without a home directory).
    pub fn default_path() -> Option<PathBuf> {
        Tuner::<Tile>::path_in_cache("autotune.json")
    }
}

/// The mode a backend opened with `asked` tunes in: `fast` keeps the default tiles on a
/// software adapter (the module's comment says why).
pub fn mode_on(asked: AutotuneMode, software: bool) -> AutotuneMode {
    match asked {
        AutotuneMode::Fast if software => AutotuneMode::Off,
        mode => mode,
    }
}

impl WgpuBackend {
    /// The tile for this matmul, tuning it first when the mode asks and the class is new;
    /// whether it was tuned, and the median seconds the tuner timed it at (from f32 operands,
    /// their preparation included; none for a choice stored without it). `a` and `b` are the
    /// f32 operands already on the device.
    pub(crate) async fn tile_for(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        operands: OnDevice<'_>,
    ) -> Result<(Tile, bool, Option<f64>)> {
        let variant = self.variant(algorithm);
        let default = variant.tile;
        if self.tuner.mode() == AutotuneMode::Off || shape.flops() < TUNE_MIN_FLOPS {
            return Ok((default, false, None));
        }
        let s = &self.gpu.summary;
        // MANTISSA_TUNE_CANDIDATES: the listed tiles, in their order (those this variant
        // cannot run are dropped with the reason); else this device's candidates.
        let listed: Option<Vec<Tile>> = crate::tune::listed("wgpu")?;
        let offered = self.tile_candidates(algorithm);
        let mut unfit = Vec::new();
        let all = match &listed {
            Some(tiles) => tiles
                .iter()
                .copied()
                .filter(|t| match self.fits(&variant, *t, &offered) {
                    Ok(()) => true,
                    Err(why) => {
                        unfit.push((*t, why));
                        false
                    }
                })
                .collect(),
            // On cooperative matrices, SIMT tiles too: the scaling passes and small blocks can
            // cost the cooperative path more than its products save (docs/h100.md).
            None => with_splits(
                offered
                    .iter()
                    .copied()
                    .chain(self.simt_candidates(algorithm))
                    .chain(self.encoded_candidates(algorithm))
                    .collect(),
                shape,
            ),
        };
        let key = format!(
            "{} | {} | {}{}{:?} {:?} parts {} levels {} fp8 {} rowwise {} | {} | {}",
            s.name,
            s.driver,
            // Runtime checks change which tile is fastest.
            if self.gpu.runtime_checks {
                "checked "
            } else {
                ""
            },
            if variant.coop.is_some() { "coop " } else { "" },
            variant.a,
            variant.b,
            variant.parts,
            variant.levels,
            variant.fp8,
            variant.rowwise,
            shape_class(shape),
            // A choice made among other candidates (another version's) is made again, so new
            // candidates are tried where an older cache holds a choice.
            candidates_fingerprint(&all)
        );
        // A stored tile is used only when it is one of today's candidates for this adapter: a
        // cache edited by hand, or written by another version, is re-tuned, never trusted.
        if let Some(t) = self.tuner.get(&key).filter(|t| all.contains(t)) {
            return Ok((t, true, self.tuner.seconds(&key)));
        }
        // The default first, then on cooperative matrices the published designs (the staged
        // blocks a GPU most likely wants, in that order), then the default's neighbours (`fast`
        // stops there), then the rest: a search cut short by the budget has timed the likeliest.
        let designs = match variant.coop {
            Some(c) => Tile::coop_designs(c.size),
            None => Vec::new(),
        };
        // On cooperative matrices the SIMT default comes right after the default (on an H100 it
        // outran the cooperative path on every matmul of the bf16-mixed step), and its
        // neighbours rank with the default's.
        let simt_default = Tile::default_for(variant.parts).on_simt(true);
        let near = |t: Tile| match t.simt {
            true => t == simt_default || neighbour(t, simt_default),
            false => neighbour(t, default),
        };
        // A tile's splits of K, and the tile encoding its operands first, rank with the tile,
        // right after it.
        let rank = |t: &Tile| {
            let t = t.with_splits(1).with_encoded(false);
            let design = designs.iter().position(|d| *d == t);
            (
                t != default,
                t != simt_default,
                design.is_none(),
                design,
                !near(t),
            )
        };
        let mut candidates: Vec<Tile> = all
            .into_iter()
            .filter(|t| {
                let base = t.with_splits(1).with_encoded(false);
                listed.is_some()
                    || self.tuner.mode() == AutotuneMode::Full
                    || near(base)
                    || designs.contains(&base)
            })
            .collect();
        if listed.is_none() {
            candidates.sort_by_key(rank);
        }
        let mut search = self.tuner.search(&key);
        for (tile, why) in unfit {
            search.record(
                tile,
                &format!("listed tile {tile}"),
                Err(Error::invalid("tile", why)),
            );
        }
        // With listed tiles or replaced kernel sources, each candidate's product must be the
        // first one's, bit for bit (every tile computes the same bits: docs/wgpu.md), or it is
        // dropped: a tile or an edited kernel that computes something else never wins.
        let checked = listed.is_some() || Sources::Current.replaces_any(&MATMUL_FILES);
        // The first product of each kernel (cooperative, SIMT): the two meet the contract
        // with bits of their own.
        let mut firsts: [Option<Vec<f32>>; 2] = [None, None];
        for tile in candidates {
            if !search.open() {
                continue;
            }
            let mut timed = self
                .time_on_tile(
                    shape,
                    algorithm,
                    tile,
                    operands,
                    crate::tune::TUNE_RUNS,
                    Operands::F32,
                )
                .await
                .map(|(seconds, _, _)| seconds);
            if checked && timed.is_ok() {
                match self
                    .product_on_tile(shape, algorithm, tile, operands, crate::format::Format::F32)
                    .await
                {
                    Err(e) => timed = Err(e),
                    Ok(c) => match &firsts[usize::from(tile.simt)] {
                        None => firsts[usize::from(tile.simt)] = Some(c),
                        Some(want) => {
                            let differ = c
                                .iter()
                                .zip(want)
                                .filter(|(x, y)| {
                                    x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan())
                                })
                                .count();
                            if differ > 0 {
                                timed = Err(Error::invalid(
                                    "tile",
                                    format!(
                                        "its product differs from the first candidate's in {differ} of {} outputs",
                                        c.len()
                                    ),
                                ));
                            }
                        }
                    },
                }
            }
            search.record(tile, &format!("tile {tile}"), timed);
        }
        match search.finish()? {
            Some((best, seconds)) => {
                self.tuner.put_timed(key, best, Some(seconds));
                Ok((best, true, Some(seconds)))
            }
            None => Ok((default, false, None)),
        }
    }
}

/// Split-K's counts offered for a tile (where K has that many groups).
pub const SPLITS: [u32; 4] = [2, 4, 8, 16];

/// `tiles`, each followed by its splits of K (`SPLITS`) where `shape`'s K has at least two
/// summation groups and the tile gives it fewer than 1024 workgroups (a GPU is full before
/// that; more splits only add the reduction's traffic). Every split computes the tile's bits.
pub fn with_splits(tiles: Vec<Tile>, shape: &MatmulShape) -> Vec<Tile> {
    let groups = (shape.k as u64).div_ceil(GROUP_K.into());
    let mut out = Vec::with_capacity(tiles.len());
    for t in tiles {
        out.push(t);
        let workgroups = (shape.m as u64).div_ceil(t.bm.into())
            * (shape.n as u64).div_ceil(t.bn.into())
            * shape.batch as u64;
        if groups >= 2 && workgroups < 1024 {
            out.extend(
                SPLITS
                    .iter()
                    .filter(|&&s| u64::from(s) <= groups)
                    .map(|&s| t.with_splits(s)),
            );
        }
    }
    out
}

/// Names a list of candidates in a tuning's key: their number and a hash of them (a hash that
/// changes with the compiler costs a re-tune, no more).
fn candidates_fingerprint(all: &[Tile]) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    all.hash(&mut h);
    format!("{} candidates {:016x}", all.len(), h.finish())
}

/// Whether `t` differs from `d` in at most one dimension, by a factor of two (its register
/// block aside), or is `d`'s shape with the other number of workgroup buffers or the other way
/// of loading quads.
fn neighbour(t: Tile, d: Tile) -> bool {
    let step = |x: u32, y: u32| x == y * 2 || y == x * 2;
    let same = [(t.bm, d.bm), (t.bn, d.bn), (t.bk, d.bk)];
    let equal = same.iter().filter(|(x, y)| x == y).count();
    let as_d = t.buffers == d.buffers && t.quad_blocks == d.quad_blocks;
    equal == 3 || (equal == 2 && as_d && same.iter().any(|&(x, y)| step(x, y)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_mode_tries_the_default_and_its_neighbours() {
        let d = Tile::default_for(1);
        let all = Tile::candidates(1, 256, 16384);
        let fast: Vec<Tile> = all.iter().copied().filter(|t| neighbour(*t, d)).collect();
        assert_eq!(fast[0], d);
        assert!(fast.len() >= 4 && fast.len() < all.len(), "{fast:?}");
        assert!(
            all.iter()
                .all(|t| t.threads() <= 256 && t.workgroup_bytes(1) <= 16384)
        );
        // The default double-buffered is tried; other shapes only single-buffered.
        assert!(fast.contains(&d.with_buffers(2)), "{fast:?}");
        assert!(
            fast.iter()
                .all(|t| t.buffers == 1 || (t.bm, t.bn, t.bk) == (d.bm, d.bn, d.bk))
        );
        // Two buffers take twice the workgroup memory: offered only where it fits.
        assert!(
            Tile::candidates(3, 256, 16384)
                .iter()
                .all(|t| t.workgroup_bytes(3) <= 16384)
        );
        assert!(!Tile::candidates(3, 256, 16384).contains(&Tile::default_for(3).with_buffers(2)));
    }

    #[test]
    fn a_software_adapter_tunes_only_when_asked_for_every_candidate() {
        use AutotuneMode::{Fast, Full, Off};
        assert_eq!(mode_on(Fast, true), Off);
        assert_eq!(mode_on(Full, true), Full);
        assert_eq!(mode_on(Off, true), Off);
        assert_eq!(mode_on(Fast, false), Fast);
        assert_eq!(mode_on(Full, false), Full);
    }
}
