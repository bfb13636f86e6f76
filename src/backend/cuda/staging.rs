//! Page-locked host buffers for a data-parallel step summed through MPI on the CUDA backend.
//! Each bucket of gradients (`Plan::gradient_buckets`) is copied out on a stream of its own as
//! soon as the backward pass is done with it; the host sums it over the ranks while the device
//! runs the pass on, and copies it back on the same stream; the update waits for that stream.
//! Page-locked memory is what lets the copies run beside the kernels: a copy from pageable
//! memory goes through a driver buffer and holds the host until it is done.

use super::CudaBackend;
use crate::error::{Error, Result};
use cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PinnedHostSlice, result,
};
use std::sync::Arc;

/// A bucket's values: the first `len` elements of each of these device buffers, one after
/// another.
pub type Parts<B> = Vec<(B, usize)>;

pub struct HostStaging {
    /// Runs the copies, ordered after the step's kernels by events.
    stream: Arc<CudaStream>,
    /// One page-locked buffer per bucket, of exactly its length.
    buckets: Vec<PinnedHostSlice<f32>>,
}

// SAFETY: the page-locked buffers are plain host memory owned by this value, and the stream
// is a CUDA stream handle (usable from any thread); `HostStaging` is owned by one executor
// and used through `&mut self`.
unsafe impl Send for HostStaging {}

impl HostStaging {
    pub fn new(cb: &CudaBackend) -> Result<HostStaging> {
        let stream = cb
            .stream
            .fork()
            .map_err(|e| cb.device_error("creating the stream of the gradient copies", e))?;
        Ok(HostStaging {
            stream,
            buckets: vec![],
        })
    }

    /// Makes one buffer of each length of `lens`, keeping those of the right length (the
    /// buckets are the same every step).
    pub fn fit(&mut self, cb: &CudaBackend, lens: &[usize]) -> Result<()> {
        self.buckets.truncate(lens.len());
        for (i, &len) in lens.iter().enumerate() {
            if self.buckets.get(i).is_some_and(|b| b.len() == len) {
                continue;
            }
            // Flags 0: ordinary page-locked memory. cudarc's default is write-combined, which
            // the host reads slowly, and the host reads every value here.
            // SAFETY: the values are written by the copy out before anything reads them.
            let buffer = unsafe { cb.ctx.alloc_pinned_with_flags::<f32>(len, 0) }.map_err(|e| {
                cb.device_error(
                    &format!("allocating {} bytes of page-locked host memory", len * 4),
                    e,
                )
            })?;
            match i < self.buckets.len() {
                true => self.buckets[i] = buffer,
                false => self.buckets.push(buffer),
            }
        }
        Ok(())
    }

    /// After everything launched on `step` so far, copies `parts` into bucket `b`'s buffer;
    /// the event says when the copy is done.
    pub fn copy_out(
        &mut self,
        cb: &CudaBackend,
        step: &CudaStream,
        b: usize,
        parts: Parts<&CudaSlice<f32>>,
    ) -> Result<CudaEvent> {
        let fail = |e| cb.device_error("copying gradients to the host", e);
        self.stream.join(step).map_err(fail)?;
        let host = bucket(cb, &mut self.buckets, b)?;
        check_parts(host.len(), parts.iter().map(|(d, len)| (d.len(), *len)))?;
        let mut at = 0;
        for (buffer, len) in parts {
            let (src, _) = buffer.device_ptr(&self.stream);
            // SAFETY: `src` holds at least `len` values and the bucket exactly the parts
            // (`check_parts`). The host range is page-locked memory that the host neither
            // reads nor writes before the event recorded below (`values`), and that lives
            // until this stream is done (`Drop`).
            unsafe {
                result::memcpy_dtoh_async(&mut host[at..at + len], src, self.stream.cu_stream())
            }
            .map_err(fail)?;
            at += len;
        }
        self.stream.record_event(None).map_err(fail)
    }

    /// Bucket `b`'s values, once `copied` (its `copy_out`) is done.
    pub fn values(&mut self, cb: &CudaBackend, b: usize, copied: &CudaEvent) -> Result<&mut [f32]> {
        copied
            .synchronize()
            .map_err(|e| cb.device_error("waiting for gradients copied to the host", e))?;
        bucket(cb, &mut self.buckets, b)
    }

    /// Copies bucket `b`'s values back into `parts`, after the copies launched before.
    pub fn copy_in(
        &mut self,
        cb: &CudaBackend,
        b: usize,
        parts: Parts<&mut CudaSlice<f32>>,
    ) -> Result<()> {
        let fail = |e| cb.device_error("copying summed gradients to the device", e);
        let host = bucket(cb, &mut self.buckets, b)?;
        check_parts(host.len(), parts.iter().map(|(d, len)| (d.len(), *len)))?;
        let mut at = 0;
        for (buffer, len) in parts {
            let (dst, _) = buffer.device_ptr_mut(&self.stream);
            // SAFETY: as in `copy_out`; the host writes this range again only after the next
            // `copy_out` of the bucket, which this stream runs after this copy, is done.
            unsafe { result::memcpy_htod_async(dst, &host[at..at + len], self.stream.cu_stream()) }
                .map_err(fail)?;
            at += len;
        }
        Ok(())
    }

    /// Makes what is launched on `step` from now on wait for every copy launched so far.
    pub fn wait_for(&self, cb: &CudaBackend, step: &CudaStream) -> Result<()> {
        step.join(&self.stream)
            .map_err(|e| cb.device_error("ordering the step after the gradient copies", e))
    }
}

impl Drop for HostStaging {
    /// The buffers are freed only once no copy runs into or out of them (an error may end a
    /// step with copies in flight).
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
    }
}

/// Bucket `b`'s host buffer.
fn bucket<'h>(
    cb: &CudaBackend,
    buckets: &'h mut [PinnedHostSlice<f32>],
    b: usize,
) -> Result<&'h mut [f32]> {
    let count = buckets.len();
    let Some(buffer) = buckets.get_mut(b) else {
        return Err(Error::invalid(
            "gradient staging",
            format!("no buffer for bucket {b} of {count}"),
        ));
    };
    // Waits on the buffer's own event, which nothing records (the copies have theirs).
    buffer
        .as_mut_slice()
        .map_err(|e| cb.device_error("reading page-locked host memory", e))
}

/// Checks that parts of these (device buffer length, part length) fill exactly `room` values.
fn check_parts(room: usize, parts: impl Iterator<Item = (usize, usize)>) -> Result<()> {
    let mut total = 0;
    for (have, len) in parts {
        if len > have {
            return Err(Error::invalid(
                "gradient staging",
                format!("a part of {len} values in a device buffer of {have}"),
            ));
        }
        total += len;
    }
    match total == room {
        true => Ok(()),
        false => Err(Error::invalid(
            "gradient staging",
            format!("a bucket of {total} values in a host buffer of {room}"),
        )),
    }
}
