//! Data parallelism's communication: the ranks of one training run and the collectives between
//! them. The engine is never our own: MPI launches the ranks and reduces host buffers
//! (`mpi.rs`, the cargo feature `mpi`, over Open MPI or MPICH), and NCCL reduces device buffers
//! between NVIDIA GPUs (`backend::cuda::nccl`, its unique id broadcast through this layer). A
//! process started without a launcher is `Single`, a world of one.
//!
//! This layer imports only `error`: the plan executors (which reduce their gradients through
//! it) and the trainer sit above it.
//!
//! - `mod.rs`: the `Collective` contract, `Single`, the launch detection, `agree`
//! - `watchdog.rs`: the timeout on every blocking collective
//! - `mpi.rs`: the MPI world

#[cfg(all(feature = "mpi", not(target_arch = "wasm32")))]
mod mpi;
#[cfg(all(feature = "mpi", not(target_arch = "wasm32")))]
mod watchdog;

use crate::error::{Error, ErrorClass, Result};

/// The ranks of one run and the collectives between them. Every rank calls the same
/// collectives in the same order; a rank that fails between them calls `abort` (or `agree`
/// where every rank reaches the same point), so that no rank waits for ever.
pub trait Collective: Send + Sync {
    /// This rank, 0-based.
    fn rank(&self) -> usize;
    /// Ranks in the run.
    fn size(&self) -> usize;
    /// This rank among the ranks of its host (the device it opens).
    fn local_rank(&self) -> usize;
    /// Ranks on this rank's host.
    fn local_size(&self) -> usize;
    /// The engine in words ("MPI (Open MPI v4.1.4)", "one process").
    fn engine(&self) -> String;
    /// Element-wise sum over the ranks, in place.
    fn sum_f32(&self, values: &mut [f32]) -> Result<()>;
    /// Element-wise sum over the ranks, in place, in f64.
    fn sum_f64(&self, values: &mut [f64]) -> Result<()>;
    /// Element-wise maximum over the ranks, in place.
    fn max_f64(&self, values: &mut [f64]) -> Result<()>;
    /// Replaces `bytes` on every rank by rank `root`'s.
    fn broadcast(&self, bytes: &mut Vec<u8>, root: usize) -> Result<()>;
    /// Returns when every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// Ends every rank after this one failed (its message already printed); returns only where
    /// there is no other rank.
    fn abort(&self, code: i32);
}

/// Which engine sums a data-parallel step's gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Reducer {
    /// NCCL on device buffers where the executor has it (CUDA, one GPU per rank), else MPI.
    #[default]
    Auto,
    /// MPI on host buffers, on every backend.
    Mpi,
    /// NCCL on device buffers (the CUDA backend's resident executor); an error elsewhere.
    Nccl,
}

impl Reducer {
    /// Every reducer.
    pub const ALL: [Reducer; 3] = [Reducer::Auto, Reducer::Mpi, Reducer::Nccl];

    /// Its name ("auto", "mpi", "nccl").
    pub fn name(self) -> &'static str {
        match self {
            Reducer::Auto => "auto",
            Reducer::Mpi => "mpi",
            Reducer::Nccl => "nccl",
        }
    }
}

impl std::str::FromStr for Reducer {
    type Err = Error;
    fn from_str(s: &str) -> Result<Reducer> {
        let key = s.trim().to_ascii_lowercase();
        Reducer::ALL
            .into_iter()
            .find(|r| r.name() == key)
            .ok_or_else(|| Error::UnknownName {
                kind: "gradient reducer",
                given: s.into(),
                valid: Reducer::ALL.map(|r| r.name().to_string()).to_vec(),
            })
    }
}

/// How a data-parallel step sums its gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reduction {
    /// The engine that sums.
    pub reducer: Reducer,
    /// Bytes of f32 values per collective call (`--bucket-size`; 16 MiB by default).
    pub bucket_bytes: u64,
    /// Sum each bucket as soon as the backward pass is done with it, while the pass runs on
    /// (where the executor can: `StepExecutor::backward_summed`), rather than after the pass.
    pub overlap: bool,
}

impl Reduction {
    /// `bucket_bytes`' default: 16 MiB.
    pub const DEFAULT_BUCKET_BYTES: u64 = 16 << 20;

    /// f32 values per bucket (at least one).
    pub fn bucket_elements(&self) -> usize {
        usize::try_from(self.bucket_bytes / 4)
            .unwrap_or(usize::MAX)
            .max(1)
    }
}

impl Default for Reduction {
    fn default() -> Reduction {
        Reduction {
            reducer: Reducer::Auto,
            bucket_bytes: Reduction::DEFAULT_BUCKET_BYTES,
            overlap: true,
        }
    }
}

/// One process: every collective is the identity.
#[derive(Clone, Copy, Debug, Default)]
pub struct Single;

impl Collective for Single {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn local_rank(&self) -> usize {
        0
    }
    fn local_size(&self) -> usize {
        1
    }
    fn engine(&self) -> String {
        "one process".into()
    }
    fn sum_f32(&self, _: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn sum_f64(&self, _: &mut [f64]) -> Result<()> {
        Ok(())
    }
    fn max_f64(&self, _: &mut [f64]) -> Result<()> {
        Ok(())
    }
    fn broadcast(&self, _: &mut Vec<u8>, _: usize) -> Result<()> {
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn abort(&self, _: i32) {}
}

/// The environment variables MPI launchers set to the world size (Open MPI's mpirun, MPICH's
/// Hydra, MVAPICH).
const LAUNCHER_SIZE_ENV: [&str; 3] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"];

/// The world size an MPI launcher started this process with, if one did.
pub fn launched_size() -> Option<usize> {
    LAUNCHER_SIZE_ENV
        .iter()
        .find_map(|k| std::env::var(k).ok()?.trim().parse().ok())
}

/// Whether this build can join an MPI launch.
pub const HAS_MPI: bool = cfg!(all(feature = "mpi", not(target_arch = "wasm32")));

/// The world this process belongs to: MPI's when an MPI launcher started it, else `Single`.
/// Started by a launcher without MPI built in, it refuses, rather than run N unrelated copies
/// that write the same files.
pub fn world() -> Result<Box<dyn Collective>> {
    match launched_size() {
        None => Ok(Box::new(Single)),
        #[cfg(all(feature = "mpi", not(target_arch = "wasm32")))]
        Some(_) => Ok(Box::new(mpi::Mpi::init()?)),
        #[cfg(not(all(feature = "mpi", not(target_arch = "wasm32"))))]
        Some(n) => Err(Error::BackendUnavailable {
            backend: "mpi".into(),
            why: format!(
                "an MPI launcher started {n} ranks, but this build has no MPI; rebuild with \
                 `cargo build --release --features mpi` (needs Open MPI or MPICH, and libclang)"
            ),
        }),
    }
}

/// What `mantissa info` says about MPI in this build.
pub fn describe_mpi() -> String {
    if !HAS_MPI {
        return "not built in (cargo feature `mpi`)".into();
    }
    match launched_size() {
        Some(n) => format!("built in ({}); launched as {n} rank(s)", library_version()),
        None => format!(
            "built in ({}); launch with mpirun -np N mantissa train ...",
            library_version()
        ),
    }
}

/// The MPI library's own version line.
pub fn library_version() -> String {
    #[cfg(all(feature = "mpi", not(target_arch = "wasm32")))]
    {
        mpi::library_version()
    }
    #[cfg(not(all(feature = "mpi", not(target_arch = "wasm32"))))]
    {
        "none".into()
    }
}

const CLASSES: [ErrorClass; 4] = [
    ErrorClass::BadInput,
    ErrorClass::Machine,
    ErrorClass::ContractBreak,
    ErrorClass::Diverged,
];

/// Every rank passes its own result of the same phase (opening its device, building its plan);
/// if any rank failed, every rank returns the failure of the lowest failing rank (that rank its
/// own error, the others `Error::Rank` with its message and class), so that all of them stop
/// together and say why.
pub fn agree<T>(group: &dyn Collective, result: Result<T>) -> Result<T> {
    if group.size() <= 1 {
        return result;
    }
    // The lowest failing rank, as a maximum of negated ranks (no failure: -size).
    let mine = match &result {
        Ok(_) => -(group.size() as f64),
        Err(_) => -(group.rank() as f64),
    };
    let mut lowest = [mine];
    group.max_f64(&mut lowest)?;
    let failed = -lowest[0];
    if failed >= group.size() as f64 {
        return result;
    }
    let failed = failed as usize;
    let mut message = match &result {
        Err(e) if group.rank() == failed => {
            let class = CLASSES.iter().position(|&c| c == e.class()).unwrap_or(1) as u8;
            let mut bytes = vec![class];
            bytes.extend_from_slice(e.to_string().as_bytes());
            bytes
        }
        _ => vec![],
    };
    group.broadcast(&mut message, failed)?;
    match result {
        Err(e) if group.rank() == failed => Err(e),
        _ => Err(Error::Rank {
            rank: failed,
            class: CLASSES
                .get(message.first().copied().unwrap_or(1) as usize)
                .copied()
                .unwrap_or(ErrorClass::Machine),
            message: String::from_utf8_lossy(message.get(1..).unwrap_or_default()).into_owned(),
        }),
    }
}

/// Rows `[start, end)` of a global batch of `rows` that rank `rank` of `size` takes, or why the
/// batch cannot be split.
pub fn shard(rows: usize, rank: usize, size: usize) -> Result<std::ops::Range<usize>> {
    if size == 0 || !rows.is_multiple_of(size) {
        return Err(Error::invalid(
            "data-parallel batch",
            format!(
                "a batch of {rows} sequences does not divide among {size} ranks; launch a rank \
                 count that divides it"
            ),
        ));
    }
    let per = rows / size;
    Ok(rank * per..(rank + 1) * per)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_is_identity_and_agree_passes_results_through() {
        let mut v = [1.0f32, -2.0];
        Single.sum_f32(&mut v).unwrap();
        assert_eq!(v, [1.0, -2.0]);
        assert_eq!(agree(&Single, Ok(3)).unwrap(), 3);
        assert!(matches!(
            agree::<()>(&Single, Err(Error::invalid("x", "y"))),
            Err(Error::Invalid { .. })
        ));
    }

    #[test]
    fn shards_cover_the_batch_and_refuse_what_does_not_divide() {
        let parts: Vec<_> = (0..4).map(|r| shard(12, r, 4).unwrap()).collect();
        assert_eq!(parts, vec![0..3, 3..6, 6..9, 9..12]);
        let e = shard(12, 0, 5).unwrap_err().to_string();
        assert!(e.contains("12") && e.contains("5 ranks"), "{e}");
        assert!(shard(12, 0, 0).is_err());
    }
}
