//! The matmul autotuner: times candidate tiles once per (adapter, driver, kernel variant, shape
//! class) on the operands of the first matmul of that class, keeps the fastest, and persists the
//! choice in a JSON cache file so later runs start tuned.
//!
//! Every tile computes bit for bit the same result (each output sums its k terms in order,
//! whatever the tile), so tuning changes speed only; `tests/conformance.rs` checks that.
//!
//! Matmuls under `TUNE_MIN_FLOPS` (a 128x128x128 product) take the default tile untuned: their
//! time is mostly the dispatch's, and each candidate costs a kernel compile, which on a
//! software rasterizer or with runtime checks (browsers) takes far longer than the tile could
//! ever save.
//!
//! `MANTISSA_AUTOTUNE`: `off` (default tiles), `fast` (the default and its neighbours: one
//! dimension halved or doubled; one timed run each), `full` (every tile the device's limits
//! allow; median of three runs). The cache lives in `MANTISSA_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/mantissa`, else `~/.cache/mantissa` (`autotune.json`); in the browser the
//! demo keeps it in the page's localStorage (any `TileStore` serves).

use super::WgpuBackend;
use super::shaders::Tile;
use crate::algorithm::{Algorithm, MatmulShape};
use crate::backend::Operands;
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;

/// How hard the autotuner tries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AutotuneMode {
    #[default]
    Off,
    Fast,
    Full,
}

impl std::str::FromStr for AutotuneMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" | "0" | "no" => Ok(AutotuneMode::Off),
            "fast" | "on" | "1" | "yes" => Ok(AutotuneMode::Fast),
            "full" => Ok(AutotuneMode::Full),
            _ => Err(Error::UnknownName {
                kind: "autotune mode",
                given: s.to_string(),
                valid: ["off", "fast", "full"].map(String::from).to_vec(),
            }),
        }
    }
}

/// The least work (2mnk, times the batch) for which a matmul's tile is tuned.
pub const TUNE_MIN_FLOPS: f64 = 2.0 * 128.0 * 128.0 * 128.0;

/// The environment variable that sets the mode.
pub const AUTOTUNE_ENV: &str = "MANTISSA_AUTOTUNE";

/// A tuned tile and whether it came from a full search (a `full` request re-tunes a `fast`
/// choice).
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
struct Choice {
    tile: Tile,
    full: bool,
}

/// Where tuned tiles persist between runs: a JSON text read when the tuner starts and written
/// after every new choice. Natively a file (`FileStore`); in the browser the page's
/// localStorage (web/src/lib.rs).
pub trait TileStore: Send + Sync {
    fn load(&self) -> Option<String>;
    /// Best effort: a store that cannot be written costs a re-tune next run, not this run's
    /// result.
    fn save(&self, json: &str);
}

/// Tiles in a JSON file, rewritten atomically.
pub struct FileStore(pub PathBuf);

impl TileStore for FileStore {
    fn load(&self) -> Option<String> {
        std::fs::read_to_string(&self.0).ok()
    }

    fn save(&self, json: &str) {
        let _ = crate::cache::write_atomic(&self.0, json.as_bytes());
    }
}

/// Tuned tiles by key, and where they persist.
pub struct Autotuner {
    pub mode: AutotuneMode,
    store: Option<Box<dyn TileStore>>,
    tiles: Mutex<BTreeMap<String, Choice>>,
    /// Choices the store held when the tuner started.
    loaded: usize,
}

impl Autotuner {
    /// A tuner in `mode`, starting from the cache file at `path` when it exists and parses
    /// (a corrupt cache is ignored and rewritten, never trusted).
    pub fn new(mode: AutotuneMode, path: Option<PathBuf>) -> Autotuner {
        Autotuner::with_store(
            mode,
            path.map(|p| Box::new(FileStore(p)) as Box<dyn TileStore>),
        )
    }

    /// A tuner in `mode` persisting its choices in `store` (none: kept for the process's life).
    pub fn with_store(mode: AutotuneMode, store: Option<Box<dyn TileStore>>) -> Autotuner {
        let tiles: BTreeMap<String, Choice> = store
            .as_ref()
            .and_then(|s| s.load())
            .and_then(|text| serde_json::from_str(&text).ok())
            .unwrap_or_default();
        Autotuner {
            mode,
            store,
            loaded: tiles.len(),
            tiles: Mutex::new(tiles),
        }
    }

    /// The default cache file (none in the browser, or without a home directory).
    pub fn default_path() -> Option<PathBuf> {
        crate::cache::dir().map(|d| d.join("autotune.json"))
    }

    /// (choices held now, choices the store held at the start).
    pub fn entries(&self) -> (usize, usize) {
        let now = self.tiles.lock().map(|t| t.len()).unwrap_or(0);
        (now, self.loaded)
    }

    /// The stored tile for `key`, when it was tuned at least as thoroughly as asked now.
    fn get(&self, key: &str) -> Option<Tile> {
        let choice = self.tiles.lock().ok()?.get(key).copied()?;
        (choice.full || self.mode != AutotuneMode::Full).then_some(choice.tile)
    }

    /// Records a choice and saves every choice to the store.
    fn put(&self, key: String, tile: Tile) {
        let Ok(mut tiles) = self.tiles.lock() else {
            return;
        };
        let full = self.mode == AutotuneMode::Full;
        tiles.insert(key, Choice { tile, full });
        if let (Some(store), Ok(text)) = (&self.store, serde_json::to_string_pretty(&*tiles)) {
            store.save(&text);
        }
    }
}

/// Sizes are bucketed to the next power of two: one tuning serves a class of shapes.
fn shape_class(shape: &MatmulShape) -> String {
    let b = |x: usize| x.max(1).next_power_of_two();
    format!(
        "{}x{}x{}x{}{}{}",
        b(shape.batch),
        b(shape.m),
        b(shape.n),
        b(shape.k),
        if shape.a_transposed { "t" } else { "n" },
        if shape.b_transposed { "t" } else { "n" },
    )
}

impl WgpuBackend {
    /// The tile for this matmul, tuning it first when the mode asks and the class is new, and
    /// whether it was tuned. `a` and `b` are the f32 operands already on the device.
    pub(crate) async fn tile_for(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        a: &wgpu::Buffer,
        b: &wgpu::Buffer,
    ) -> Result<(Tile, bool)> {
        let variant = self.variant(algorithm);
        let default = variant.tile;
        if self.tuner.mode == AutotuneMode::Off || shape.flops() < TUNE_MIN_FLOPS {
            return Ok((default, false));
        }
        let s = &self.gpu.summary;
        let key = format!(
            "{} | {} | {}{}{:?} {:?} parts {} levels {} fp8 {} rowwise {} | {}",
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
            shape_class(shape)
        );
        let all = self.tile_candidates(algorithm);
        // A stored tile is used only when it is one of today's candidates for this adapter: a
        // cache edited by hand, or written by another version, is re-tuned, never trusted.
        if let Some(t) = self.tuner.get(&key).filter(|t| all.contains(t)) {
            return Ok((t, true));
        }
        let candidates: Vec<Tile> = all
            .into_iter()
            .filter(|t| self.tuner.mode == AutotuneMode::Full || neighbour(*t, default))
            .collect();
        let repetitions = if self.tuner.mode == AutotuneMode::Full {
            3
        } else {
            1
        };
        let mut best = (f64::INFINITY, default);
        for tile in candidates {
            let (seconds, _, _) = self
                .time_on_tile(shape, algorithm, tile, a, b, repetitions, Operands::F32)
                .await?;
            if seconds < best.0 {
                best = (seconds, tile);
            }
        }
        self.tuner.put(key, best.1);
        Ok((best.1, true))
    }
}

/// Whether `t` differs from `d` in at most one dimension, by a factor of two.
fn neighbour(t: Tile, d: Tile) -> bool {
    let step = |x: u32, y: u32| x == y * 2 || y == x * 2;
    let same = [(t.bm, d.bm), (t.bn, d.bn), (t.bk, d.bk)];
    let equal = same.iter().filter(|(x, y)| x == y).count();
    equal == 3 || (equal == 2 && same.iter().any(|&(x, y)| step(x, y)))
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
    }

    #[test]
    fn shape_classes_bucket_by_powers_of_two() {
        let a = MatmulShape::new(100, 120, 250);
        let b = MatmulShape::new(128, 65, 256);
        assert_eq!(shape_class(&a), shape_class(&b));
        assert_ne!(
            shape_class(&a),
            shape_class(&MatmulShape::new(100, 120, 300))
        );
    }
}
