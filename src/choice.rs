//! Measured choices (`auto`): where the engine has two ways to run the same function (attention
//! fused or as separate ops), it builds both, times each on the device, keeps the faster and
//! remembers the choice in the tuning cache (`tune::Tuner`, `train-choices.json` in the cache
//! directory), so that the next run on the same device, config shape and preset skips the
//! timing. A candidate that cannot be built or run there is dropped with its reason.
//! `MANTISSA_AUTOTUNE=off` keeps the backend's static preference; `full` re-times choices a
//! `fast` run cached.
//!
//! What is timed is the caller's (`Trials`): the trainer times the forward and backward pass of
//! its step, which leave the weights, moments and every other state of the run as they were.
//! On several ranks every rank times, and the ranks take the slowest rank's time of each
//! candidate, so that all choose alike.

use crate::dist::Collective;
use crate::error::{Error, Result};
use crate::tune::{AutotuneMode, TileStore, Tuner};

/// Untimed runs of each candidate before its timed ones (the first compiles and tunes).
pub const CHOICE_WARMUP: u32 = 1;
/// Timed runs of each candidate: the median decides (as many as the matmul tuners time).
pub const CHOICE_RUNS: usize = crate::tune::TUNE_RUNS;
/// The cache file of the choices.
pub const CHOICE_CACHE: &str = "train-choices.json";

/// How a choice was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ChosenBy {
    /// Named by the user (`--attention fused`).
    Named,
    /// The backend's static preference: nothing timed (`MANTISSA_AUTOTUNE=off`, or a trainer
    /// that was not asked to choose).
    Default,
    /// A choice timed by an earlier run, from the cache.
    Cached,
    /// Timed now.
    Timed,
}

impl ChosenBy {
    /// "named", "default", "cached" or "timed", as the JSON says it.
    pub fn name(self) -> &'static str {
        match self {
            ChosenBy::Named => "named",
            ChosenBy::Default => "default",
            ChosenBy::Cached => "cached",
            ChosenBy::Timed => "timed",
        }
    }
}

/// One candidate of a choice, as this run saw it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Candidate {
    /// The candidate's name.
    pub name: String,
    /// The median seconds of its timed runs (None: not timed).
    pub seconds: Option<f64>,
    /// Why it was dropped: it failed to build or to run here.
    pub dropped: Option<String>,
}

/// Which of the ways to run something a run took, and how it came to it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Choice {
    /// What was chosen ("attention").
    pub what: String,
    /// The candidate taken.
    pub chosen: String,
    /// How it came to be taken.
    pub by: ChosenBy,
    /// The candidates built or timed (empty where nothing was).
    pub candidates: Vec<Candidate>,
}

impl Choice {
    /// A choice made without building or timing anything.
    pub fn untimed(what: &str, chosen: &str, by: ChosenBy) -> Choice {
        Choice {
            what: what.into(),
            chosen: chosen.into(),
            by,
            candidates: vec![],
        }
    }
}

impl std::fmt::Display for Choice {
    /// "attention fused (timed: fused 4.10 ms; unfused 5.27 ms)", or "(cached)", "(named)".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} (", self.what, self.chosen)?;
        match self.by {
            ChosenBy::Default => write!(f, "the backend's default, not timed")?,
            by => write!(f, "{}", by.name())?,
        }
        for (i, c) in self.candidates.iter().enumerate() {
            write!(f, "{} {}", if i == 0 { ":" } else { ";" }, c.name)?;
            match (&c.dropped, c.seconds) {
                (Some(why), _) => write!(f, " dropped: {why}")?,
                (None, Some(s)) => write!(f, " {:.2} ms", s * 1e3)?,
                (None, None) => write!(f, " not timed")?,
            }
        }
        write!(f, ")")
    }
}

/// What a choice builds and times: candidates by index.
#[async_trait::async_trait(?Send)]
pub trait Trials {
    /// Makes candidate `i` ready to run; an error drops it.
    async fn build(&mut self, i: usize) -> Result<()>;
    /// Runs candidate `i` once, leaving the state of the run it serves as it was; an error
    /// drops it.
    async fn run(&mut self, i: usize) -> Result<()>;
}

/// Times candidates and caches their choices.
pub struct Chooser {
    cache: Tuner<u8>,
    /// Seconds from some fixed instant (a fake in tests).
    clock: Box<dyn Fn() -> f64 + Send + Sync>,
    /// Untimed runs of each candidate before the timed ones.
    pub warmup: u32,
    /// Timed runs of each candidate (their median decides).
    pub runs: usize,
}

impl Chooser {
    /// The mode of `MANTISSA_AUTOTUNE`, choices cached in the cache directory (`cache::dir`), the
    /// wall clock.
    pub fn from_env() -> Result<Chooser> {
        let path = Tuner::<u8>::path_in_cache(CHOICE_CACHE);
        let store = path.map(|p| Box::new(crate::tune::FileStore(p)) as Box<dyn TileStore>);
        Ok(Chooser::new(AutotuneMode::from_env()?, store, wall_clock()))
    }

    /// A chooser in `mode`, its choices kept in `store` (none: for this process alone), timing
    /// with `clock` (seconds).
    pub fn new(
        mode: AutotuneMode,
        store: Option<Box<dyn TileStore>>,
        clock: Box<dyn Fn() -> f64 + Send + Sync>,
    ) -> Chooser {
        Chooser {
            cache: Tuner::with_store(mode, store),
            clock,
            warmup: CHOICE_WARMUP,
            runs: CHOICE_RUNS,
        }
    }

    /// How hard choices are timed (`MANTISSA_AUTOTUNE`: off, fast, full).
    pub fn mode(&self) -> AutotuneMode {
        self.cache.mode()
    }

    /// Chooses `what` among `names` under cache key `key`: `preferred` (already built by the
    /// caller) where the mode is off; else the cached choice where it still builds; else each
    /// candidate built and timed (`warmup` runs, then the median of `runs`), the fastest of
    /// those that built and ran kept and cached. Every rank of `group` calls this and gets the
    /// same answer. Fails only where no candidate could run (with `preferred`'s own error,
    /// where it failed here) or the group fails.
    pub async fn choose(
        &self,
        what: &'static str,
        key: &str,
        names: &[&str],
        preferred: usize,
        trials: &mut dyn Trials,
        group: &dyn Collective,
    ) -> Result<(usize, Choice)> {
        let chosen = |i: usize, by, candidates| Choice {
            what: what.into(),
            chosen: names[i].into(),
            by,
            candidates,
        };
        if self.mode() == AutotuneMode::Off || names.len() < 2 {
            return Ok((preferred, chosen(preferred, ChosenBy::Default, vec![])));
        }
        let key = format!("{what} {key}");
        // The first error of each candidate here (the caller's error where none runs).
        let mut errors: Vec<Option<Error>> = names.iter().map(|_| None).collect();
        let mut candidates: Vec<Candidate> = names
            .iter()
            .map(|n| Candidate {
                name: n.to_string(),
                seconds: None,
                dropped: None,
            })
            .collect();
        // A cached choice every rank holds, and that still builds.
        let cached = self
            .cache
            .get(&key)
            .map(usize::from)
            .filter(|&i| i < names.len());
        let code = cached.map_or(0.0, |i| i as f64 + 1.0);
        if let Some(i) = agreed(group, code)?.map(|c| c as usize - 1) {
            let built = trials.build(i).await;
            if all_ok(group, built.is_ok())? {
                return Ok((i, chosen(i, ChosenBy::Cached, vec![])));
            }
            candidates[i].dropped = Some(reason(&built, "failed on another rank"));
            errors[i] = built.err();
        }
        for (i, c) in candidates.iter_mut().enumerate() {
            if c.dropped.is_none() {
                let built = trials.build(i).await;
                if !all_ok(group, built.is_ok())? {
                    c.dropped = Some(reason(&built, "failed on another rank"));
                    errors[i] = built.err();
                }
            }
        }
        // Rounds over the candidates (warm-ups first), so that a drift of the device's clock
        // falls on every candidate alike.
        let mut times: Vec<Vec<f64>> = vec![vec![]; names.len()];
        for round in 0..self.warmup as usize + self.runs.max(1) {
            for (i, c) in candidates.iter_mut().enumerate() {
                if c.dropped.is_some() {
                    continue;
                }
                let start = (self.clock)();
                match trials.run(i).await {
                    Ok(()) if round >= self.warmup as usize => {
                        times[i].push((self.clock)() - start)
                    }
                    Ok(()) => {}
                    Err(e) => {
                        c.dropped = Some(e.to_string());
                        errors[i] = Some(e);
                    }
                }
            }
        }
        // Each candidate's median, the slowest rank's; a candidate dropped anywhere is out.
        let mut medians: Vec<f64> = candidates
            .iter()
            .zip(&mut times)
            .map(|(c, t)| match c.dropped {
                Some(_) => f64::INFINITY,
                None => crate::backend::median(t),
            })
            .collect();
        group.max_f64(&mut medians)?;
        for (c, &m) in candidates.iter_mut().zip(&medians) {
            match (m.is_finite(), &c.dropped) {
                (true, _) => c.seconds = Some(m),
                (false, None) => c.dropped = Some("failed on another rank".into()),
                (false, Some(_)) => {}
            }
        }
        let best = medians
            .iter()
            .enumerate()
            .filter(|(_, m)| m.is_finite())
            .min_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i);
        let Some(best) = best else {
            let said = candidates
                .iter()
                .map(|c| format!("{}: {}", c.name, c.dropped.as_deref().unwrap_or("")))
                .collect::<Vec<_>>()
                .join("; ");
            return Err(match errors.swap_remove(preferred) {
                Some(e) => e,
                None => Error::invalid(what, format!("no way to run it works here: {said}")),
            });
        };
        self.cache.put(key, best as u8);
        Ok((best, chosen(best, ChosenBy::Timed, candidates)))
    }
}

/// The wall clock, in seconds since its first reading.
pub fn wall_clock() -> Box<dyn Fn() -> f64 + Send + Sync> {
    let start = web_time::Instant::now();
    Box::new(move || start.elapsed().as_secs_f64())
}

/// `code` where every rank of `group` holds the same nonzero code, else None.
fn agreed(group: &dyn Collective, code: f64) -> Result<Option<f64>> {
    let mut seen = [code, -code];
    group.max_f64(&mut seen)?;
    Ok((seen[0] == -seen[1] && seen[0] > 0.0).then_some(seen[0]))
}

/// Whether `ok` holds on every rank of `group`.
fn all_ok(group: &dyn Collective, ok: bool) -> Result<bool> {
    let mut failed = [if ok { 0.0 } else { 1.0 }];
    group.max_f64(&mut failed)?;
    Ok(failed[0] == 0.0)
}

/// Why a candidate was dropped: its own error, or `elsewhere` where it failed on another rank.
fn reason(built: &Result<()>, elsewhere: &str) -> String {
    match built {
        Err(e) => e.to_string(),
        Ok(()) => elsewhere.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::Single;
    use pollster::FutureExt as _;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use crate::tune::MemoryStore as Memory;

    /// Candidates whose runs advance a fake clock by their cost (microseconds, one per run
    /// and candidate), some failing to build or to run; every call counted.
    struct Fake {
        now: Arc<AtomicU64>,
        costs: Vec<Vec<u64>>,
        build_fails: Vec<bool>,
        run_fails_at: Vec<Option<usize>>,
        builds: Vec<usize>,
        runs: Vec<usize>,
    }

    impl Fake {
        fn new(costs: Vec<Vec<u64>>) -> (Fake, Box<dyn Fn() -> f64 + Send + Sync>) {
            let now = Arc::new(AtomicU64::new(0));
            let n = costs.len();
            let clock_now = now.clone();
            let clock = Box::new(move || clock_now.load(Ordering::Relaxed) as f64 * 1e-6);
            let fake = Fake {
                now,
                costs,
                build_fails: vec![false; n],
                run_fails_at: vec![None; n],
                builds: vec![0; n],
                runs: vec![0; n],
            };
            (fake, clock)
        }
    }

    #[async_trait::async_trait(?Send)]
    impl Trials for Fake {
        async fn build(&mut self, i: usize) -> Result<()> {
            self.builds[i] += 1;
            match self.build_fails[i] {
                true => Err(Error::invalid(
                    "fake",
                    format!("candidate {i} does not build"),
                )),
                false => Ok(()),
            }
        }
        async fn run(&mut self, i: usize) -> Result<()> {
            let r = self.runs[i];
            self.runs[i] += 1;
            if self.run_fails_at[i] == Some(r) {
                return Err(Error::invalid("fake", format!("candidate {i} failed")));
            }
            let cost = self.costs[i][r % self.costs[i].len()];
            self.now.fetch_add(cost, Ordering::Relaxed);
            Ok(())
        }
    }

    const NAMES: [&str; 2] = ["fused", "unfused"];

    fn choose(chooser: &Chooser, fake: &mut Fake, preferred: usize) -> Result<(usize, Choice)> {
        chooser
            .choose("attention", "dev|tiny", &NAMES, preferred, fake, &Single)
            .block_on()
    }

    #[test]
    fn the_median_decides_and_the_choice_is_cached() {
        let store = Memory::default();
        // Fused: a warm-up of 1000, then 30 with one outlier of 1; unfused steady at 20.
        let (mut fake, clock) = Fake::new(vec![vec![1000, 30, 1, 30], vec![20]]);
        let chooser = Chooser::new(AutotuneMode::Fast, Some(Box::new(store.clone())), clock);
        let (i, choice) = choose(&chooser, &mut fake, 0).unwrap();
        assert_eq!(
            (i, choice.chosen.as_str(), choice.by),
            (1, "unfused", ChosenBy::Timed)
        );
        assert_eq!(fake.runs, vec![4, 4], "a warm-up and 3 timed runs each");
        let micros: Vec<_> = (choice.candidates.iter())
            .map(|c| c.seconds.map(|s| (s * 1e6).round()))
            .collect();
        assert_eq!(micros, vec![Some(30.0), Some(20.0)]);
        assert!(
            choice
                .to_string()
                .starts_with("attention unfused (timed: fused 0.03 ms")
        );

        // The next chooser on the same store builds the cached choice alone and runs nothing.
        let (mut again, clock) = Fake::new(vec![vec![1], vec![1000]]);
        let chooser = Chooser::new(AutotuneMode::Fast, Some(Box::new(store.clone())), clock);
        let (i, choice) = choose(&chooser, &mut again, 0).unwrap();
        assert_eq!((i, choice.by), (1, ChosenBy::Cached));
        assert_eq!((again.builds, again.runs), (vec![0, 1], vec![0, 0]));
        assert_eq!(choice.to_string(), "attention unfused (cached)");

        // A full request re-times a fast choice; off keeps the preference, untimed.
        let (mut full, clock) = Fake::new(vec![vec![1], vec![1000]]);
        let chooser = Chooser::new(AutotuneMode::Full, Some(Box::new(store.clone())), clock);
        assert_eq!(choose(&chooser, &mut full, 1).unwrap().0, 0);
        let (mut off, clock) = Fake::new(vec![vec![1], vec![1000]]);
        let chooser = Chooser::new(AutotuneMode::Off, Some(Box::new(store)), clock);
        let (i, choice) = choose(&chooser, &mut off, 1).unwrap();
        assert_eq!(
            (i, choice.by, off.builds, off.runs),
            (1, ChosenBy::Default, vec![0, 0], vec![0, 0])
        );
    }

    #[test]
    fn a_candidate_that_fails_is_dropped_and_the_other_kept() {
        // Fused is faster but does not build: unfused is kept and cached.
        let store = Memory::default();
        let (mut fake, clock) = Fake::new(vec![vec![1], vec![50]]);
        fake.build_fails[0] = true;
        let chooser = Chooser::new(AutotuneMode::Fast, Some(Box::new(store.clone())), clock);
        let (i, choice) = choose(&chooser, &mut fake, 0).unwrap();
        assert_eq!((i, fake.runs.clone()), (1, vec![0, 4]));
        let dropped = choice.candidates[0].dropped.as_deref().unwrap();
        assert!(dropped.contains("does not build"), "{dropped}");
        assert!(choice.to_string().contains("fused dropped: "), "{choice}");

        // Unfused fails at its third run; fused is kept.
        let (mut fake, clock) = Fake::new(vec![vec![100], vec![1]]);
        fake.run_fails_at[1] = Some(2);
        let chooser = Chooser::new(AutotuneMode::Fast, None, clock);
        let (i, choice) = choose(&chooser, &mut fake, 1).unwrap();
        assert_eq!((i, fake.runs.clone()), (0, vec![4, 3]));
        assert!(
            choice.candidates[1]
                .dropped
                .as_deref()
                .unwrap()
                .contains("failed")
        );

        // Nothing runs: the preferred candidate's own error.
        let (mut fake, clock) = Fake::new(vec![vec![1], vec![1]]);
        fake.build_fails = vec![true, true];
        let chooser = Chooser::new(AutotuneMode::Fast, None, clock);
        let e = choose(&chooser, &mut fake, 1).unwrap_err().to_string();
        assert!(e.contains("candidate 1 does not build"), "{e}");
    }

    #[test]
    fn a_stale_or_corrupt_cache_is_timed_again() {
        // The cached choice no longer builds: it is dropped, the rest timed and cached.
        let store = Memory::default();
        let (mut first, clock) = Fake::new(vec![vec![1], vec![50]]);
        let chooser = Chooser::new(AutotuneMode::Fast, Some(Box::new(store.clone())), clock);
        assert_eq!(choose(&chooser, &mut first, 1).unwrap().0, 0);
        let (mut stale, clock) = Fake::new(vec![vec![1], vec![50]]);
        stale.build_fails[0] = true;
        let chooser = Chooser::new(AutotuneMode::Fast, Some(Box::new(store.clone())), clock);
        let (i, choice) = choose(&chooser, &mut stale, 0).unwrap();
        assert_eq!(
            (i, choice.by, stale.builds.clone()),
            (1, ChosenBy::Timed, vec![1, 1])
        );
        let (mut next, clock) = Fake::new(vec![vec![1], vec![50]]);
        let chooser = Chooser::new(AutotuneMode::Fast, Some(Box::new(store.clone())), clock);
        assert_eq!(
            choose(&chooser, &mut next, 0).unwrap().1.by,
            ChosenBy::Cached
        );

        // A cache that is not JSON, or holds an index beyond the candidates, is timed again.
        for text in [
            "{ not json",
            r#"{"attention dev|tiny":{"choice":7,"full":true}}"#,
        ] {
            *store.0.lock().unwrap() = Some(text.into());
            let (mut fake, clock) = Fake::new(vec![vec![1], vec![50]]);
            let chooser = Chooser::new(AutotuneMode::Fast, Some(Box::new(store.clone())), clock);
            let (i, choice) = choose(&chooser, &mut fake, 1).unwrap();
            assert_eq!((i, choice.by), (0, ChosenBy::Timed), "{text}");
            let saved = store.0.lock().unwrap().clone().unwrap();
            assert!(saved.contains(r#""choice": 0"#), "{saved}");
        }
    }
}
