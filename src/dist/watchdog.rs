//! A timeout on blocking collectives. MPI's collectives have none: a rank that died without
//! aborting, or hangs in its device, would leave the others waiting for ever. A thread watches
//! the collective in progress and ends this process when it overruns, with a message that
//! says which collective and how long, so that the launcher then ends the rest.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Seconds a collective may wait for the other ranks (`MANTISSA_COLLECTIVE_TIMEOUT`).
pub const TIMEOUT_ENV: &str = "MANTISSA_COLLECTIVE_TIMEOUT";
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// The collective in progress: what, and when it must be done.
type Watched = Option<(String, Instant)>;

pub struct Watchdog {
    state: Arc<(Mutex<Watched>, Condvar)>,
    pub timeout: Duration,
}

impl Watchdog {
    /// Starts the watching thread of rank `rank`.
    pub fn start(rank: usize) -> Watchdog {
        let timeout = std::env::var(TIMEOUT_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .unwrap_or(DEFAULT_TIMEOUT);
        let state = Arc::new((Mutex::new(None), Condvar::new()));
        let watched = Arc::clone(&state);
        std::thread::spawn(move || watch(&watched, rank, timeout));
        Watchdog { state, timeout }
    }

    /// Runs `collective` (named `what` in the message) under the timeout.
    pub fn guard<T>(&self, what: &str, collective: impl FnOnce() -> T) -> T {
        let (lock, wake) = &*self.state;
        if let Ok(mut w) = lock.lock() {
            *w = Some((what.to_string(), Instant::now() + self.timeout));
            wake.notify_one();
        }
        let out = collective();
        if let Ok(mut w) = lock.lock() {
            *w = None;
        }
        out
    }
}

fn watch(state: &(Mutex<Watched>, Condvar), rank: usize, timeout: Duration) {
    let (lock, wake) = state;
    let Ok(mut w) = lock.lock() else { return };
    loop {
        let wait = match &*w {
            None => timeout,
            Some((what, deadline)) => {
                let now = Instant::now();
                if now >= *deadline {
                    eprintln!(
                        "mantissa: error: rank {rank}: {what} got no answer from the other ranks in \
                         {:.0} s (another rank failed or hangs; its message, if any, is above). \
                         Ending this rank. {TIMEOUT_ENV} sets the limit in seconds.",
                        timeout.as_secs_f64()
                    );
                    std::process::exit(1);
                }
                *deadline - now
            }
        };
        w = match wake.wait_timeout(w, wait) {
            Ok((guard, _)) => guard,
            Err(_) => return,
        };
    }
}
