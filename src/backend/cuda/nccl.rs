//! NCCL on the CUDA backend: a data-parallel step's gradients summed in device memory, as
//! PyTorch's DDP does on CUDA servers. NCCL is loaded at run time like the other CUDA
//! libraries; the ranks find each other through the host collective (rank 0's unique id
//! broadcast over MPI).

use super::CudaBackend;
use crate::dist::{self, Collective};
use crate::error::{Error, Result};
use cudarc::driver::{CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id, ReduceOp, result as nccl};
use std::sync::Arc;

/// A communicator of every rank's device, on a stream of its own: a sum waits for the step's
/// kernels launched before it, and the step's kernels launched after it run meanwhile until
/// they wait for it (`sum_after`, `wait_for`), so that a bucket of gradients is summed while
/// the backward pass goes on.
pub struct Nccl {
    comm: Comm,
    stream: Arc<CudaStream>,
    /// NCCL's version ("2.27.3").
    pub version: String,
}

// SAFETY: a NCCL communicator may move between threads as long as no two threads call it at
// once; `Nccl` is owned by one executor and is not `Sync`.
unsafe impl Send for Nccl {}

fn refused(op: &str, why: impl Into<String>) -> Error {
    Error::Collective {
        engine: "NCCL",
        op: op.into(),
        why: why.into(),
    }
}

fn failed(op: &str, e: nccl::NcclError) -> Error {
    refused(op, format!("{:?}", e.0))
}

/// NCCL's version ("2.27.3"), or why this machine has none.
pub fn version() -> Result<String> {
    // SAFETY: only probes whether the library can be loaded.
    if !std::panic::catch_unwind(|| unsafe { cudarc::nccl::sys::is_culib_present() })
        .unwrap_or(false)
    {
        return Err(Error::BackendUnavailable {
            backend: "nccl".into(),
            why: "libnccl.so.2 was not found (install NCCL, e.g. the nvidia-nccl wheel, and put \
                  its lib directory on LD_LIBRARY_PATH)"
                .into(),
        });
    }
    let code = std::panic::catch_unwind(nccl::get_nccl_version)
        .map_err(|_| refused("version", "the library lacks ncclGetVersion"))?
        .map_err(|e| failed("version", e))?;
    // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
    Ok(format!(
        "{}.{}.{}",
        code / 10000,
        code / 100 % 100,
        code % 100
    ))
}

impl Nccl {
    /// Every rank of `group` joins one communicator on its own device. A collective call:
    /// every rank returns the same failure if any rank cannot join (no library, two ranks on
    /// one GPU, which NCCL refuses).
    pub fn join(cb: &CudaBackend, group: &dyn Collective) -> Result<Nccl> {
        let ready = version().and_then(|v| {
            if group.local_size() > cb.device_count() {
                return Err(refused(
                    "setup",
                    format!(
                        "{} ranks on this host share {} GPU(s); NCCL needs one GPU per rank",
                        group.local_size(),
                        cb.device_count()
                    ),
                ));
            }
            let id = match group.rank() {
                0 => Some(Id::new().map_err(|e| failed("ncclGetUniqueId", e))?),
                _ => None,
            };
            Ok((v, id))
        });
        let (version, id) = dist::agree(group, ready)?;
        let mut bytes: Vec<u8> = id
            .map(|id| id.internal().iter().map(|&c| c as u8).collect())
            .unwrap_or_default();
        group.broadcast(&mut bytes, 0)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        if bytes.len() != internal.len() {
            return Err(refused(
                "setup",
                format!("rank 0 sent a unique id of {} bytes", bytes.len()),
            ));
        }
        for (to, from) in internal.iter_mut().zip(&bytes) {
            *to = *from as std::ffi::c_char;
        }
        let stream = cb
            .stream
            .fork()
            .map_err(|e| refused("setup", format!("creating NCCL's stream: {e}")));
        let stream = dist::agree(group, stream)?;
        let comm = Comm::from_rank(
            stream.clone(),
            group.rank(),
            group.size(),
            Id::uninit(internal),
        )
        .map_err(|e| failed("ncclCommInitRank", e));
        let comm = dist::agree(group, comm)?;
        Ok(Nccl {
            comm,
            stream,
            version,
        })
    }

    /// Sums the first `len` elements of each buffer over the ranks, in place, as one group
    /// of NCCL calls on NCCL's stream, after everything launched on `step` so far. `step`
    /// does not wait for it: `wait_for` makes it.
    pub fn sum_after(
        &self,
        step: &CudaStream,
        buffers: Vec<(&mut CudaSlice<f32>, usize)>,
    ) -> Result<()> {
        self.stream
            .join(step)
            .map_err(|e| refused("ordering after the step's kernels", e.to_string()))?;
        nccl::group_start().map_err(|e| failed("ncclGroupStart", e))?;
        let mut outcome = Ok(());
        for (buffer, len) in buffers {
            let mut view = buffer.slice_mut(0..len);
            if let Err(e) = self.comm.all_reduce_in_place(&mut view, &ReduceOp::Sum) {
                outcome = Err(failed("ncclAllReduce", e));
                break;
            }
        }
        // The group is closed whatever happened inside it.
        nccl::group_end().map_err(|e| failed("ncclGroupEnd", e))?;
        outcome
    }

    /// Makes what is launched on `step` from now on wait for every sum launched so far.
    pub fn wait_for(&self, step: &CudaStream) -> Result<()> {
        step.join(&self.stream)
            .map_err(|e| refused("ordering the step after the sums", e.to_string()))
    }
}
