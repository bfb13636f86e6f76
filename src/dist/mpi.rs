//! The MPI world (rsmpi over the system's Open MPI or MPICH): launch, bootstrap and
//! host-buffer reductions.

use super::Collective;
use super::watchdog::Watchdog;
use crate::error::{Error, Result};
use mpi::collective::SystemOperation;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;
use std::sync::Mutex;

/// Elements per MPI call: MPI counts are C ints.
const CHUNK: usize = 1 << 28;

struct Handles {
    world: SimpleCommunicator,
    // Finalizes MPI when dropped, after `world`.
    _universe: mpi::environment::Universe,
}

// SAFETY: MPI is initialised with MPI_THREAD_SERIALIZED (checked in `init`), and every call
// goes through the mutex that owns these handles, so no two threads call MPI at once.
unsafe impl Send for Handles {}

pub struct Mpi {
    handles: Mutex<Handles>,
    rank: usize,
    size: usize,
    local_rank: usize,
    local_size: usize,
    version: String,
    watchdog: Watchdog,
}

pub fn library_version() -> String {
    let (major, minor) = mpi::environment::version();
    let library = mpi::environment::library_version()
        .ok()
        .and_then(|v| {
            v.lines()
                .next()
                .map(|l| l.trim().trim_end_matches(',').to_string())
        })
        .unwrap_or_default();
    match library.split(',').next() {
        Some(name) if !name.is_empty() => format!("{name}, MPI {major}.{minor}"),
        _ => format!("MPI {major}.{minor}"),
    }
}

impl Mpi {
    pub fn init() -> Result<Mpi> {
        let unavailable = |why: String| Error::BackendUnavailable {
            backend: "mpi".into(),
            why,
        };
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Serialized)
            .ok_or_else(|| unavailable("MPI was already initialised".into()))?;
        if threading < mpi::Threading::Serialized {
            return Err(unavailable(format!(
                "the MPI library offers thread level {threading:?}, and mantissa needs Serialized"
            )));
        }
        let world = universe.world();
        let local = world.split_shared(world.rank());
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        Ok(Mpi {
            local_rank: local.rank() as usize,
            local_size: local.size() as usize,
            handles: Mutex::new(Handles {
                world,
                _universe: universe,
            }),
            rank,
            size,
            version: library_version(),
            watchdog: Watchdog::start(rank),
        })
    }

    /// Runs `f` on the world communicator under the lock and the timeout.
    fn call<T>(&self, what: &str, f: impl FnOnce(&SimpleCommunicator) -> T) -> Result<T> {
        let handles = self.handles.lock().map_err(|_| Error::Collective {
            engine: "MPI",
            op: what.into(),
            why: "a previous collective panicked".into(),
        })?;
        Ok(self.watchdog.guard(what, || f(&handles.world)))
    }

    fn reduce<T>(&self, what: &str, values: &mut [T], op: SystemOperation) -> Result<()>
    where
        T: Copy + Default + mpi::datatype::Equivalence,
    {
        self.call(what, |world| {
            for chunk in values.chunks_mut(CHUNK) {
                let send = chunk.to_vec();
                world.all_reduce_into(&send[..], chunk, op);
            }
        })
    }
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn local_rank(&self) -> usize {
        self.local_rank
    }
    fn local_size(&self) -> usize {
        self.local_size
    }
    fn engine(&self) -> String {
        format!("MPI ({})", self.version)
    }
    fn sum_f32(&self, values: &mut [f32]) -> Result<()> {
        self.reduce("the all-reduce (sum)", values, SystemOperation::sum())
    }
    fn sum_f64(&self, values: &mut [f64]) -> Result<()> {
        self.reduce("the all-reduce (sum)", values, SystemOperation::sum())
    }
    fn max_f64(&self, values: &mut [f64]) -> Result<()> {
        self.reduce("the all-reduce (max)", values, SystemOperation::max())
    }
    fn broadcast(&self, bytes: &mut Vec<u8>, root: usize) -> Result<()> {
        if root >= self.size {
            return Err(Error::invalid(
                "broadcast root",
                format!("rank {root} of a world of {}", self.size),
            ));
        }
        self.call("a broadcast", |world| {
            let from = world.process_at_rank(root as i32);
            let mut len = bytes.len() as u64;
            from.broadcast_into(&mut len);
            bytes.resize(len as usize, 0);
            for chunk in bytes.chunks_mut(CHUNK) {
                from.broadcast_into(chunk);
            }
        })
    }
    fn barrier(&self) -> Result<()> {
        self.call("a barrier", |world| world.barrier())
    }
    fn abort(&self, code: i32) {
        if self.size > 1 {
            // Another thread may hold the lock in a collective that will never end: abort
            // without it (MPI_Abort is meant to be callable in this state).
            let world = SimpleCommunicator::world();
            world.abort(code);
        }
    }
}
