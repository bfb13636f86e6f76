//! What the backends' autotuners share: the mode (`MANTISSA_AUTOTUNE`), the shape classes one
//! tuning serves, and the store of choices by key, persisted as JSON in the cache directory
//! (wgpu: tiles in `autotune.json`, docs/wgpu.md; CUDA: the split-bf16 path in
//! `cuda-tune.json`, docs/cuda.md).
//!
//! Matmuls under `TUNE_MIN_FLOPS` (a 128x128x128 product) are never tuned: their time is
//! mostly the launch's, and each candidate costs compiles and timed runs.
//!
//! `MANTISSA_AUTOTUNE`: `off` (defaults), `fast` (a few candidates), `full` (every
//! candidate); each timed as the median of `TUNE_RUNS`. A stored choice that is not among
//! today's candidates is re-tuned, never trusted. One shape class's search stops starting
//! candidates once `MANTISSA_TUNE_SECONDS` (default `TUNE_SECONDS`) are spent, keeping the
//! fastest so far; the backends offer their likeliest candidates first (`Search`).

use crate::algorithm::MatmulShape;
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};

/// How hard the autotuner tries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AutotuneMode {
    /// No tuning: every matmul runs the backend's default variant (`off`, `0`, `no`).
    #[default]
    Off,
    /// A few likely candidates per shape class, and any stored choice reused (`fast`, `on`, `1`,
    /// `yes`; the mode where `MANTISSA_AUTOTUNE` is unset).
    Fast,
    /// Every candidate per shape class; a choice stored by a `fast` search is re-tuned (`full`).
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

impl AutotuneMode {
    /// The mode `MANTISSA_AUTOTUNE` names (fast when unset or empty; `crate::env`'s rules).
    pub fn from_env() -> Result<AutotuneMode> {
        crate::env::word(AUTOTUNE_ENV)?.map_or(Ok(AutotuneMode::Fast), str::parse)
    }
}

/// The least work (2mnk, times the batch) for which a matmul's tile is tuned.
pub const TUNE_MIN_FLOPS: f64 = 2.0 * 128.0 * 128.0 * 128.0;

/// Timed runs per candidate, after a warm-up; the median decides. One run chose tiles at half
/// the speed of the best on an H100 (docs/h100.md).
pub const TUNE_RUNS: usize = 3;

/// The environment variable that sets the mode.
pub const AUTOTUNE_ENV: &str = "MANTISSA_AUTOTUNE";

/// The seconds one shape class's search may take (`full` over every tile of a large product
/// took minutes): once spent, no further candidate starts and the fastest timed is kept.
pub const TUNE_SECONDS: f64 = 20.0;

/// The environment variable that sets the search's budget in seconds.
pub const TUNE_SECONDS_ENV: &str = "MANTISSA_TUNE_SECONDS";

/// The budget `MANTISSA_TUNE_SECONDS` gives (`TUNE_SECONDS` when unset or empty; a number of
/// seconds >= 0, `crate::env`'s rules).
pub fn budget_from_env() -> Result<f64> {
    Ok(crate::env::number(TUNE_SECONDS_ENV)?.unwrap_or(TUNE_SECONDS))
}

/// The environment variable naming a JSON file of candidates that the tuners try, in its order,
/// instead of their own lists: `{"wgpu": [tile, ...], "cuda": [split path, ...]}`, a wgpu tile
/// as `autotune.json` stores one (`{"bm": 128, "bn": 64, "bk": 16, "reg": 8}`, the fields left
/// out at their defaults), a CUDA split-bf16 path by name (`"tripled"`). Either list may be
/// left out (that backend keeps its own). For kernel iteration on a GPU (docs/wgpu.md):
/// choices made from a listed set are stored apart (the key holds the set's fingerprint).
pub const CANDIDATES_ENV: &str = "MANTISSA_TUNE_CANDIDATES";

/// The candidates `MANTISSA_TUNE_CANDIDATES` lists for `backend` ("wgpu" or "cuda"), if it is
/// set and lists that backend; the file is read once per process, and an unreadable file, bad
/// JSON, an unknown key or a candidate that does not parse is an error naming the file.
pub fn listed<T: serde::de::DeserializeOwned>(backend: &str) -> Result<Option<Vec<T>>> {
    use std::sync::OnceLock;
    static FILE: OnceLock<std::result::Result<Option<(String, serde_json::Value)>, String>> =
        OnceLock::new();
    let read = FILE.get_or_init(|| {
        let Ok(path) = std::env::var(CANDIDATES_ENV) else {
            return Ok(None);
        };
        if path.trim().is_empty() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))?;
        let Some(object) = value.as_object() else {
            return Err(format!(
                "{path}: expected an object with \"wgpu\" and/or \"cuda\" lists"
            ));
        };
        if let Some(key) = object
            .keys()
            .find(|k| !["wgpu", "cuda"].contains(&k.as_str()))
        {
            return Err(format!(
                "{path}: unknown key {key:?} (the keys are \"wgpu\" and \"cuda\")"
            ));
        }
        Ok(Some((path, value)))
    });
    let (path, value) = match read {
        Err(why) => return Err(Error::invalid(CANDIDATES_ENV, why.clone())),
        Ok(None) => return Ok(None),
        Ok(Some(read)) => read,
    };
    let Some(list) = value.get(backend) else {
        return Ok(None);
    };
    let list: Vec<T> = serde_json::from_value(list.clone())
        .map_err(|e| Error::invalid(CANDIDATES_ENV, format!("{path}: {backend:?}: {e}")))?;
    if list.is_empty() {
        return Err(Error::invalid(
            CANDIDATES_ENV,
            format!("{path}: {backend:?} lists no candidate"),
        ));
    }
    Ok(Some(list))
}

/// One shape class's search: candidates timed in the order offered, the likeliest first,
/// until the budget is spent (the first that runs is always timed); a candidate that fails to
/// compile or run is dropped, and said.
pub struct Search<'a, T> {
    key: &'a str,
    budget: f64,
    started: web_time::Instant,
    best: Option<(f64, T)>,
    failed: Option<Error>,
    timed: usize,
    left_out: usize,
}

impl<'a, T: Copy> Search<'a, T> {
    /// A search for the shape class `key` (named in its messages) that stops starting candidates
    /// once `budget` seconds are spent.
    pub fn new(key: &'a str, budget: f64) -> Search<'a, T> {
        Search {
            key,
            budget,
            started: web_time::Instant::now(),
            best: None,
            failed: None,
            timed: 0,
            left_out: 0,
        }
    }

    /// Whether the next candidate may start (false counts it as left out).
    pub fn open(&mut self) -> bool {
        let open = self.best.is_none() || self.started.elapsed().as_secs_f64() < self.budget;
        self.left_out += usize::from(!open);
        open
    }

    /// A candidate's time in seconds, or why it could not run (`name` says which, then).
    pub fn record(&mut self, candidate: T, name: &str, seconds: Result<f64>) {
        match seconds {
            Ok(s) => {
                self.timed += 1;
                if self.best.is_none_or(|(t, _)| s < t) {
                    self.best = Some((s, candidate));
                }
            }
            Err(e) => {
                eprintln!(
                    "mantissa: {name} is dropped from the candidates for {}: {e}",
                    self.key
                );
                self.failed.get_or_insert(e);
            }
        }
    }

    /// The fastest candidate and its seconds; none when nothing was offered; the first
    /// failure when every candidate failed.
    pub fn finish(self) -> Result<Option<(T, f64)>> {
        if self.left_out > 0 {
            eprintln!(
                "mantissa: tuning {} stopped after {:.1} s ({TUNE_SECONDS_ENV}={}): {} candidates \
                 timed, {} left out",
                self.key,
                self.started.elapsed().as_secs_f64(),
                self.budget,
                self.timed,
                self.left_out
            );
        }
        match (self.best, self.failed) {
            (Some((s, c)), _) => Ok(Some((c, s))),
            (None, Some(e)) => Err(e),
            (None, None) => Ok(None),
        }
    }
}

/// A tuned choice, whether it came from a full search (a `full` request re-tunes a `fast`
/// choice), and the median seconds the search timed it at (where the tuner was told).
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
struct Choice<T> {
    choice: T,
    full: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    seconds: Option<f64>,
}

/// Where tuned choices persist between runs: a JSON text read when the tuner starts and
/// updated after every new choice. Natively a file that many processes share (`FileStore`); in
/// the browser the page's localStorage (web/src/lib.rs).
pub trait TileStore: Send + Sync {
    /// The JSON text last saved, or None where there is none (or it cannot be read: the tuner
    /// then starts afresh).
    fn load(&self) -> Option<String>;
    /// Best effort: a store that cannot be written costs a re-tune next run, not this run's
    /// result.
    fn save(&self, json: &str);
    /// Replaces the text with `merge` of the text stored now, with no other writer between
    /// the read and the write where others may write (a file: under a lock). Best effort, as
    /// `save`.
    fn update(&self, merge: &mut dyn FnMut(Option<String>) -> String) {
        let text = merge(self.load());
        self.save(&text);
    }
}

/// Choices in a JSON file that concurrent runs share: each update reads it and writes the
/// merge under an exclusive lock (`flock` on a `.lock` file beside it, where the platform has
/// one), atomically (`cache::write_atomic`), so that every run's choices are kept. A file that
/// cannot be written is said once per process (`said_once`), not silently re-tuned every run.
pub struct FileStore(pub PathBuf);

impl FileStore {
    /// `TileStore::update`, or why the file could not be locked or written.
    pub fn try_update(&self, merge: &mut dyn FnMut(Option<String>) -> String) -> Result<()> {
        let path = &self.0;
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::output(parent, e))?;
        }
        let mut lock_name = path.clone().into_os_string();
        lock_name.push(".lock");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_name)
            .map_err(|e| Error::output(&lock_name, e))?;
        #[cfg(unix)]
        {
            use std::os::fd::AsRawFd;
            // SAFETY: flock on a descriptor this function holds open; released when it closes.
            if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
                return Err(Error::output(&lock_name, std::io::Error::last_os_error()));
            }
        }
        let text = merge(self.load());
        let written = crate::cache::write_atomic(path, text.as_bytes());
        drop(lock);
        written
    }
}

/// Whether this is the first time this process is told that the cache `path` cannot be
/// written (the warning is then printed; later failures of the same file are not).
pub fn said_once(path: &std::path::Path, why: &Error) -> bool {
    static SAID: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
    let Ok(mut said) = SAID.lock() else {
        return false;
    };
    if said.iter().any(|p| p == path) {
        return false;
    }
    said.push(path.to_path_buf());
    eprintln!(
        "mantissa: warning: the cache {} cannot be written ({why}); what is tuned now is not kept, \
         and the next run tunes it again",
        path.display()
    );
    true
}

impl TileStore for FileStore {
    fn load(&self) -> Option<String> {
        crate::cache::read(&self.0).and_then(|bytes| String::from_utf8(bytes).ok())
    }

    fn save(&self, json: &str) {
        self.update(&mut |_| json.to_string());
    }

    fn update(&self, merge: &mut dyn FnMut(Option<String>) -> String) {
        if let Err(e) = self.try_update(merge) {
            said_once(&self.0, &e);
        }
    }
}

/// The choices of a stored JSON text, each entry read alone: an entry that does not parse as
/// a choice of `T`, or whose seconds are not finite and >= 0, is dropped, and the others kept
/// (one bad entry discarded the whole file). A text that is not a JSON object holds none.
fn entries<T: serde::de::DeserializeOwned>(text: Option<&str>) -> BTreeMap<String, Choice<T>> {
    let Some(Ok(serde_json::Value::Object(map))) = text.map(serde_json::from_str) else {
        return BTreeMap::new();
    };
    map.into_iter()
        .filter_map(|(key, value)| {
            let choice: Choice<T> = serde_json::from_value(value).ok()?;
            let timed_ok = choice.seconds.is_none_or(|s| s.is_finite() && s >= 0.0);
            timed_ok.then_some((key, choice))
        })
        .collect()
}

/// Tuned choices (wgpu: tiles; CUDA: the split-bf16 path) by key, and where they persist.
pub struct Tuner<T> {
    /// The mode (`AutotuneMode as u8`): changeable while the backend is shared, as the browser
    /// demo does between its tables.
    mode: AtomicU8,
    store: Option<Box<dyn TileStore>>,
    tiles: Mutex<BTreeMap<String, Choice<T>>>,
    /// Choices the store held when the tuner started.
    loaded: usize,
    /// Seconds one shape class's search may take (`Search`).
    budget: f64,
}

impl<T: Copy + serde::Serialize + serde::de::DeserializeOwned> Tuner<T> {
    /// A tuner in `mode`, starting from the cache file at `path` when it exists and parses
    /// (a corrupt cache is ignored and rewritten, never trusted).
    pub fn new(mode: AutotuneMode, path: Option<PathBuf>) -> Tuner<T> {
        Tuner::with_store(
            mode,
            path.map(|p| Box::new(FileStore(p)) as Box<dyn TileStore>),
        )
    }

    /// A tuner in `mode` persisting its choices in `store` (none: kept for the process's life).
    pub fn with_store(mode: AutotuneMode, store: Option<Box<dyn TileStore>>) -> Tuner<T> {
        let text = store.as_ref().and_then(|s| s.load());
        let tiles: BTreeMap<String, Choice<T>> = entries(text.as_deref());
        Tuner {
            mode: AtomicU8::new(mode as u8),
            store,
            loaded: tiles.len(),
            tiles: Mutex::new(tiles),
            budget: TUNE_SECONDS,
        }
    }

    /// This tuner with `seconds` for each shape class's search (`budget_from_env`).
    pub fn with_budget(mut self, seconds: f64) -> Tuner<T> {
        self.budget = seconds;
        self
    }

    /// A search for `key` within this tuner's budget.
    pub fn search<'a>(&self, key: &'a str) -> Search<'a, T> {
        Search::new(key, self.budget)
    }

    /// The cache file `name` in the cache directory (none in the browser, or without a home
    /// directory).
    pub fn path_in_cache(name: &str) -> Option<PathBuf> {
        crate::cache::dir().map(|d| d.join(name))
    }

    /// How hard the tuner tries now.
    pub fn mode(&self) -> AutotuneMode {
        match self.mode.load(Ordering::Relaxed) {
            0 => AutotuneMode::Off,
            1 => AutotuneMode::Fast,
            _ => AutotuneMode::Full,
        }
    }

    /// Tunes from now on in `mode`; choices already made are kept.
    pub fn set_mode(&self, mode: AutotuneMode) {
        self.mode.store(mode as u8, Ordering::Relaxed);
    }

    /// (choices held now, choices the store held at the start).
    pub fn entries(&self) -> (usize, usize) {
        let now = self.tiles.lock().map(|t| t.len()).unwrap_or(0);
        (now, self.loaded)
    }

    /// The stored choice for `key`, when it was tuned at least as thoroughly as asked now.
    pub fn get(&self, key: &str) -> Option<T> {
        let choice = self.tiles.lock().ok()?.get(&stored_key(key)).copied()?;
        (choice.full || self.mode() != AutotuneMode::Full).then_some(choice.choice)
    }

    /// The median seconds the search that made the stored choice for `key` timed it at.
    pub fn seconds(&self, key: &str) -> Option<f64> {
        self.tiles.lock().ok()?.get(&stored_key(key))?.seconds
    }

    /// Records a choice and saves every choice to the store.
    pub fn put(&self, key: String, choice: T) {
        self.put_timed(key, choice, None);
    }

    /// Records a choice with the median seconds it was timed at, and adds it to the store:
    /// merged into what the store holds now (other processes' choices kept), whose choices
    /// this tuner then holds too.
    pub fn put_timed(&self, key: String, choice: T, seconds: Option<f64>) {
        let Ok(mut tiles) = self.tiles.lock() else {
            return;
        };
        let full = self.mode() == AutotuneMode::Full;
        let (key, choice) = (
            stored_key(&key),
            Choice {
                choice,
                full,
                seconds,
            },
        );
        tiles.insert(key.clone(), choice);
        if let Some(store) = &self.store {
            let mut stored = BTreeMap::new();
            store.update(&mut |now| {
                stored = entries::<T>(now.as_deref());
                stored.insert(key.clone(), choice);
                serde_json::to_string_pretty(&stored).unwrap_or_default()
            });
            for (k, c) in stored {
                tiles.entry(k).or_insert(c);
            }
        }
    }
}

/// The key a choice is stored under: the backend's; the switches that change the kernels
/// timed, where set (`env::keyed`: MANTISSA_COOP, MANTISSA_F16, MANTISSA_ROW_LANES, ...); and
/// where MANTISSA_KERNEL_DIR replaces kernel sources, their fingerprint (choices made with
/// edited kernels are kept apart from those of the built-in ones, and from each other's).
fn stored_key(key: &str) -> String {
    let mut key = key.to_string();
    let switches = crate::env::keyed();
    if !switches.is_empty() {
        key = format!("{key} | {switches}");
    }
    match crate::backend::sources::replacements() {
        Ok(Some(r)) => format!("{key} | kernels {}", r.fingerprint),
        _ => key,
    }
}

/// Sizes are bucketed to the next power of two: one tuning serves a class of shapes.
pub fn shape_class(shape: &MatmulShape) -> String {
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

/// A store in memory, shared between tuners as a file would be (the tests' cache file).
#[cfg(test)]
#[derive(Clone, Default)]
pub(crate) struct MemoryStore(pub std::sync::Arc<Mutex<Option<String>>>);

#[cfg(test)]
impl TileStore for MemoryStore {
    fn load(&self) -> Option<String> {
        self.0.lock().unwrap().clone()
    }
    fn save(&self, json: &str) {
        *self.0.lock().unwrap() = Some(json.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use MemoryStore as Memory;

    #[test]
    fn choices_persist_and_a_full_request_retunes_a_fast_choice() {
        let store = Memory::default();
        let fast = Tuner::<u8>::with_store(AutotuneMode::Fast, Some(Box::new(store.clone())));
        assert_eq!(fast.get("k"), None);
        fast.put("k".into(), 3);
        let again = Tuner::<u8>::with_store(AutotuneMode::Fast, Some(Box::new(store.clone())));
        assert_eq!((again.get("k"), again.entries()), (Some(3), (1, 1)));
        // The time a choice was tuned at persists with it; a choice stored without one has none.
        assert_eq!(again.seconds("k"), None);
        again.put_timed("t".into(), 4, Some(0.25));
        let timed = Tuner::<u8>::with_store(AutotuneMode::Fast, Some(Box::new(store.clone())));
        assert_eq!((timed.get("t"), timed.seconds("t")), (Some(4), Some(0.25)));
        let full = Tuner::<u8>::with_store(AutotuneMode::Full, Some(Box::new(store.clone())));
        assert_eq!(
            full.get("k"),
            None,
            "a fast choice does not answer a full request"
        );
        // A store holding another type's choices, or garbage, starts empty.
        *store.0.lock().unwrap() = Some("{ not json".into());
        let fresh = Tuner::<u8>::with_store(AutotuneMode::Fast, Some(Box::new(store)));
        assert_eq!(fresh.entries(), (0, 0));
    }

    /// Tuners that started from the same store (concurrent runs) each add their choices to
    /// what it holds when they write: all are kept (only the last writer's were), in a file
    /// many threads write at once too.
    #[test]
    fn concurrent_tuners_keep_every_choice() {
        let store = Memory::default();
        let a = Tuner::<u8>::with_store(AutotuneMode::Fast, Some(Box::new(store.clone())));
        let b = Tuner::<u8>::with_store(AutotuneMode::Fast, Some(Box::new(store.clone())));
        a.put("a".into(), 1);
        b.put("b".into(), 2);
        let c = Tuner::<u8>::with_store(AutotuneMode::Fast, Some(Box::new(store)));
        assert_eq!((c.get("a"), c.get("b")), (Some(1), Some(2)));
        assert_eq!(b.get("a"), Some(1), "a writer takes in what it merged");

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache").join("choices.json");
        std::thread::scope(|scope| {
            for t in 0..4u8 {
                let path = path.clone();
                scope.spawn(move || {
                    let tuner = Tuner::<u8>::new(AutotuneMode::Fast, Some(path));
                    for k in 0..10u8 {
                        tuner.put(format!("{t}/{k}"), k);
                    }
                });
            }
        });
        let all = Tuner::<u8>::new(AutotuneMode::Fast, Some(path));
        assert_eq!(all.entries(), (40, 40));
    }

    /// One entry that cannot be read (another type, negative seconds: "autotuned at -5000 ms")
    /// drops that entry alone, and the next write keeps the others (the whole file was
    /// discarded and rewritten with the new choice alone).
    #[test]
    fn a_bad_entry_drops_that_entry_alone() {
        let store = Memory::default();
        *store.0.lock().unwrap() = Some(
            r#"{"good": {"choice": 3, "full": false, "seconds": 0.5},
                "other type": {"choice": "tripled", "full": false},
                "negative": {"choice": 4, "full": true, "seconds": -5.0},
                "no choice": {"full": true}}"#
                .into(),
        );
        let t = Tuner::<u8>::with_store(AutotuneMode::Fast, Some(Box::new(store.clone())));
        assert_eq!(t.entries(), (1, 1));
        assert_eq!((t.get("good"), t.get("negative")), (Some(3), None));
        t.put("new".into(), 5);
        let again = Tuner::<u8>::with_store(AutotuneMode::Fast, Some(Box::new(store)));
        assert_eq!((again.get("good"), again.get("new")), (Some(3), Some(5)));
        assert_eq!(again.entries(), (2, 2));
    }

    /// A cache that cannot be written is said, once per file and process (it was ignored in
    /// silence, every run re-tuning).
    #[test]
    fn an_unwritable_cache_is_said_once() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a file");
        std::fs::write(&file, "x").unwrap();
        let store = FileStore(file.join("choices.json"));
        let e = store.try_update(&mut |_| "{}".into()).unwrap_err();
        assert!(said_once(&store.0, &e));
        assert!(!said_once(&store.0, &e), "said twice");
        let tuner = Tuner::<u8>::with_store(AutotuneMode::Fast, Some(Box::new(store)));
        tuner.put("k".into(), 1);
        assert_eq!(tuner.get("k"), Some(1), "kept for this run");
    }

    #[test]
    fn a_search_keeps_the_fastest_drops_failures_and_stops_when_spent() {
        let mut s = Search::new("k", 1e9);
        assert!(s.open());
        s.record(1u8, "one", Err(Error::invalid("x", "does not compile")));
        assert!(s.open());
        s.record(2, "two", Ok(3.0));
        s.record(3, "three", Ok(1.0));
        s.record(4, "four", Ok(2.0));
        assert_eq!(s.finish().unwrap(), Some((3, 1.0)));
        // A spent budget still times the first candidate that runs, then starts no other.
        let mut s = Search::new("k", 0.0);
        assert!(s.open());
        s.record(1u8, "one", Err(Error::invalid("x", "fails")));
        assert!(s.open(), "nothing timed yet");
        s.record(2, "two", Ok(5.0));
        assert!(!s.open());
        assert_eq!(s.finish().unwrap(), Some((2, 5.0)));
        // Every candidate failing is the first failure.
        let mut s = Search::<u8>::new("k", 1.0);
        s.record(1, "one", Err(Error::invalid("first", "fails")));
        s.record(2, "two", Err(Error::invalid("second", "fails")));
        assert!(s.finish().unwrap_err().to_string().contains("first"));
        assert_eq!(Search::<u8>::new("k", 1.0).finish().unwrap(), None);
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
