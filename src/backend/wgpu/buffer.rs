//! Buffers: a size-class pool, uploads, one-pass command recording and async readback.

use super::device::{Gpu, Pipeline};
use crate::error::{DeviceFault, Error, Result};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use wgpu::util::DeviceExt;

/// Storage buffers are reused by size class (powers of two), so repeated ops of one shape
/// allocate nothing after the first.
#[derive(Default)]
pub struct BufferPool {
    free: Mutex<BTreeMap<u64, Vec<wgpu::Buffer>>>,
    mode: PoolMode,
}

#[derive(Clone, Copy, Default, PartialEq, Eq)]
enum PoolMode {
    /// Sizes rounded up to powers of two, reused within their class.
    #[default]
    Classes,
    /// Exactly what is asked (in whole 16-byte quads), nothing kept for reuse: for buffers
    /// that live as long as a step plan, where rounding up would only add to the step's memory.
    Exact,
    /// Exactly what is asked when nothing idle fits, else the smallest idle buffer that does:
    /// a step plan's shared scratch, where the same few sizes recur and a class's rounding
    /// would be held for the whole step.
    Fitting,
}

/// The usages of every storage buffer: bound to kernels, copied from and to.
pub const STORAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

impl BufferPool {
    /// A pool that allocates exact sizes and reuses nothing (`exact`).
    pub fn exact() -> BufferPool {
        BufferPool {
            mode: PoolMode::Exact,
            ..BufferPool::default()
        }
    }

    /// A pool that reuses the smallest idle buffer that fits, else allocates the exact size
    /// (`PoolMode::Fitting`).
    pub fn fitting() -> BufferPool {
        BufferPool {
            mode: PoolMode::Fitting,
            ..BufferPool::default()
        }
    }

    fn exact_size(bytes: u64) -> u64 {
        bytes.max(16).next_multiple_of(16)
    }

    fn class(bytes: u64) -> u64 {
        bytes.max(256).next_power_of_two()
    }

    /// A storage buffer of at least `bytes` bytes (contents undefined).
    pub fn take(&self, gpu: &Gpu, bytes: u64) -> Result<wgpu::Buffer> {
        let exact = |label| {
            gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: Self::exact_size(bytes),
                usage: STORAGE,
                mapped_at_creation: false,
            })
        };
        match self.mode {
            PoolMode::Exact => return Ok(exact("mantissa.kept")),
            PoolMode::Fitting => {
                return Ok(self
                    .take_idle(bytes)
                    .unwrap_or_else(|| exact("mantissa.scratch")));
            }
            PoolMode::Classes => {}
        }
        let class = Self::class(bytes);
        if let Some(b) = self
            .free
            .lock()
            .ok()
            .and_then(|mut f| f.get_mut(&class).and_then(Vec::pop))
        {
            return Ok(b);
        }
        // A class may round past the buffer limit while the request itself fits.
        let size = if class > gpu.limits.max_buffer_size {
            bytes.div_ceil(4) * 4
        } else {
            class
        };
        Ok(gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("mantissa.pool"),
            size,
            usage: STORAGE,
            mapped_at_creation: false,
        }))
    }

    /// The smallest idle buffer of at least `bytes`, if the pool holds one (never a new one).
    pub fn take_idle(&self, bytes: u64) -> Option<wgpu::Buffer> {
        let mut free = self.free.lock().ok()?;
        let size = *free.range(bytes..).find(|(_, v)| !v.is_empty())?.0;
        free.get_mut(&size).and_then(Vec::pop)
    }

    /// Whether `b` (one of this pool's) goes back to it for reuse: not one an `Exact` pool
    /// made, nor one a class pool made past its classes.
    pub fn reuses(&self, b: &wgpu::Buffer) -> bool {
        match self.mode {
            PoolMode::Classes => b.size().is_power_of_two(),
            PoolMode::Exact => false,
            PoolMode::Fitting => true,
        }
    }

    /// Takes every idle buffer out of the pool.
    pub fn drain(&self) -> Vec<wgpu::Buffer> {
        self.free
            .lock()
            .map(|mut f| std::mem::take(&mut *f).into_values().flatten().collect())
            .unwrap_or_default()
    }

    /// Returns buffers to the pool.
    pub fn give(&self, buffers: impl IntoIterator<Item = wgpu::Buffer>) {
        if let Ok(mut free) = self.free.lock() {
            for b in buffers {
                if self.reuses(&b) {
                    free.entry(b.size()).or_default().push(b);
                }
            }
        }
    }
}

/// Checks that a buffer of `bytes` can be bound as storage on this device.
pub fn check_binding(gpu: &Gpu, what: &str, bytes: u64) -> Result<()> {
    let (limit, name) = if gpu.limits.max_storage_buffer_binding_size < gpu.limits.max_buffer_size {
        (
            gpu.limits.max_storage_buffer_binding_size,
            "max_storage_buffer_binding_size",
        )
    } else {
        (gpu.limits.max_buffer_size, "max_buffer_size")
    };
    if bytes > limit {
        return Err(Error::TooLarge {
            what: what.to_string(),
            requested: bytes,
            limit,
            limit_name: name,
            device: gpu.name().to_string(),
        });
    }
    Ok(())
}

/// Uploads `words` into a new storage buffer.
pub fn upload(gpu: &Gpu, label: &str, words: &[u32]) -> wgpu::Buffer {
    let contents: &[u8] = if words.is_empty() {
        &[0u8; 4]
    } else {
        bytemuck::cast_slice(words)
    };
    gpu.device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents,
            usage: STORAGE,
        })
}

/// A uniform buffer holding `params`.
pub fn uniform<T: bytemuck::Pod>(gpu: &Gpu, params: &T) -> wgpu::Buffer {
    gpu.device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("mantissa.params"),
            contents: bytemuck::bytes_of(params),
            usage: wgpu::BufferUsages::UNIFORM,
        })
}

/// Bytes of a buffer a kernel binds: all of it, or a range (a step plan's tensor in an arena:
/// `plan.rs`). Offsets are multiples of the device's storage offset alignment.
#[derive(Clone, Debug, PartialEq)]
pub struct Region {
    /// The buffer.
    pub buffer: wgpu::Buffer,
    /// Where the range starts, in bytes.
    pub offset: u64,
    /// Its length in bytes.
    pub size: u64,
}

impl Region {
    /// All of `buffer`.
    pub fn whole(buffer: &wgpu::Buffer) -> Region {
        Region {
            buffer: buffer.clone(),
            offset: 0,
            size: buffer.size(),
        }
    }
}

/// What a dispatch binds: a whole buffer, or a region of one.
pub trait Bind {
    /// The binding resource.
    fn resource(&self) -> wgpu::BindingResource<'_>;
    /// Its bytes.
    fn bytes(&self) -> u64;
}

impl Bind for wgpu::Buffer {
    fn resource(&self) -> wgpu::BindingResource<'_> {
        self.as_entire_binding()
    }
    fn bytes(&self) -> u64 {
        self.size()
    }
}

impl Bind for Region {
    fn resource(&self) -> wgpu::BindingResource<'_> {
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: &self.buffer,
            offset: self.offset,
            size: std::num::NonZeroU64::new(self.size),
        })
    }
    fn bytes(&self) -> u64 {
        self.size
    }
}

/// One dispatch of a kernel with its bindings.
#[derive(Clone)]
pub struct Dispatch {
    /// The compiled kernel.
    pub pipeline: Arc<Pipeline>,
    /// Its buffers, bound.
    pub bind_group: wgpu::BindGroup,
    /// Workgroups dispatched (x, y, z).
    pub groups: [u32; 3],
}

impl Dispatch {
    /// A dispatch binding `buffers` (whole buffers or regions) in order (binding 0, 1, ...).
    pub fn new(
        gpu: &Gpu,
        pipeline: Arc<Pipeline>,
        buffers: &[&dyn Bind],
        groups: [u32; 3],
    ) -> Dispatch {
        let entries: Vec<wgpu::BindGroupEntry> = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: b.resource(),
            })
            .collect();
        let bind_group = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.layout,
            entries: &entries,
        });
        Dispatch {
            pipeline,
            bind_group,
            groups,
        }
    }

    /// Workgroups for `items` invocations of a 256-wide element kernel, folded into two
    /// dimensions past the per-dimension limit (the kernels use `flat_index`).
    pub fn element_groups(gpu: &Gpu, items: usize) -> Result<[u32; 3]> {
        let groups = items.div_ceil(256).max(1) as u64;
        let max = gpu.limits.max_compute_workgroups_per_dimension as u64;
        let x = groups.min(max);
        let y = groups.div_ceil(x);
        if y > max {
            return Err(Error::TooLarge {
                what: format!("an element kernel over {items} items"),
                requested: items as u64 * 4,
                limit: max * max * 256 * 4,
                limit_name: "max_compute_workgroups_per_dimension^2",
                device: gpu.name().to_string(),
            });
        }
        Ok([x as u32, y as u32, 1])
    }
}

/// Timestamp queries at the beginning and end of each of a submission's passes, where the
/// device has them.
pub struct Timer {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    passes: u32,
}

impl Timer {
    /// Most passes one timer covers: wgpu's limit on a query set, two queries a pass.
    pub const MAX_PASSES: usize = wgpu::QUERY_SET_MAX_QUERIES as usize / 2;

    /// A timer for `passes` passes (at most `MAX_PASSES`), or None where the device has no
    /// timestamps.
    pub fn new(gpu: &Gpu, passes: usize) -> Option<Timer> {
        if !gpu.features.contains(wgpu::Features::TIMESTAMP_QUERY) || passes > Self::MAX_PASSES {
            return None;
        }
        let passes = passes.max(1) as u32;
        let set = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("mantissa.timer"),
            ty: wgpu::QueryType::Timestamp,
            count: 2 * passes,
        });
        let resolve = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("mantissa.timer.resolve"),
            size: 16 * passes as u64,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        Some(Timer {
            set,
            resolve,
            passes,
        })
    }

    /// Seconds from the beginning to the end of each pass of the last submission.
    pub async fn read_seconds(&self, gpu: &Gpu) -> Result<Vec<f64>> {
        let bytes = read_bytes(gpu, &self.resolve, 16 * self.passes as u64).await?;
        let ticks: &[u64] = bytemuck::cast_slice(&bytes);
        let period_ns = gpu.queue.get_timestamp_period() as f64;
        Ok(ticks
            .chunks_exact(2)
            .map(|t| t[1].saturating_sub(t[0]) as f64 * period_ns * 1e-9)
            .collect())
    }
}

/// Clears `clears`, then records `dispatches` in one compute pass and submits it (timed by
/// `timer`, a timer of one pass).
pub fn submit(gpu: &Gpu, clears: &[&wgpu::Buffer], dispatches: &[Dispatch], timer: Option<&Timer>) {
    submit_passes(gpu, clears, &[dispatches], timer)
}

/// Clears `clears`, then records each group of dispatches as a compute pass of its own (pass
/// i timed by `timer`'s queries 2i and 2i + 1) and submits them together.
pub fn submit_passes(
    gpu: &Gpu,
    clears: &[&wgpu::Buffer],
    passes: &[&[Dispatch]],
    timer: Option<&Timer>,
) {
    let mut encoder = gpu
        .device
        .create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("mantissa"),
        });
    for b in clears {
        encoder.clear_buffer(b, 0, None);
    }
    // A timer for another number of passes is a caller's mistake: its queries would be
    // half written.
    debug_assert!(timer.is_none_or(|t| t.passes as usize == passes.len()));
    let timer = timer.filter(|t| t.passes as usize == passes.len());
    for (i, dispatches) in passes.iter().enumerate() {
        let timestamp_writes = timer.map(|t| wgpu::ComputePassTimestampWrites {
            query_set: &t.set,
            beginning_of_pass_write_index: Some(2 * i as u32),
            end_of_pass_write_index: Some(2 * i as u32 + 1),
        });
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("mantissa"),
            timestamp_writes,
        });
        for d in dispatches.iter() {
            pass.set_pipeline(&d.pipeline.pipeline);
            pass.set_bind_group(0, &d.bind_group, &[]);
            pass.dispatch_workgroups(d.groups[0], d.groups[1], d.groups[2]);
        }
    }
    if let Some(t) = timer {
        encoder.resolve_query_set(&t.set, 0..2 * t.passes, &t.resolve, 0);
    }
    gpu.queue.submit([encoder.finish()]);
}

/// Copies the first `bytes` of `src` back to the host. Nothing blocks: natively the poll below
/// returns once the copy is done, in the browser the mapping resolves from the event loop.
pub async fn read_bytes(gpu: &Gpu, src: &wgpu::Buffer, bytes: u64) -> Result<Vec<u8>> {
    Staged::copy(gpu, &[(&Region::whole(src), bytes)])
        .read(gpu)
        .await
}

/// A copy of the first bytes of some buffers into one mappable buffer, one after another,
/// submitted after everything submitted before it; `read` waits for that submission alone, so
/// that work submitted after it can go on meanwhile (a data-parallel step's bucket of
/// gradients, summed on the host while the device runs the rest of the backward pass).
pub struct Staged {
    staging: wgpu::Buffer,
    bytes: u64,
    submission: wgpu::SubmissionIndex,
    mapped: futures_channel::oneshot::Receiver<std::result::Result<(), wgpu::BufferAsyncError>>,
}

impl Staged {
    /// Stages `parts`: (a buffer's region, its first bytes, a multiple of 4).
    pub fn copy(gpu: &Gpu, parts: &[(&Region, u64)]) -> Staged {
        let bytes: u64 = parts.iter().map(|p| p.1).sum();
        let size = bytes.div_ceil(4).max(1) * 4;
        let staging = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("mantissa.readback"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder = gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("readback"),
            });
        let mut at = 0;
        for &(src, len) in parts {
            // A lone part of an odd length copies whole words (the staging buffer has them).
            let len = if parts.len() == 1 { size } else { len };
            encoder.copy_buffer_to_buffer(&src.buffer, src.offset, &staging, at, len);
            at += len;
        }
        let submission = gpu.queue.submit([encoder.finish()]);
        let (tx, mapped) = futures_channel::oneshot::channel();
        staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        Staged {
            staging,
            bytes,
            submission,
            mapped,
        }
    }

    /// The staged bytes, once the device has copied them.
    pub async fn read(self, gpu: &Gpu) -> Result<Vec<u8>> {
        #[cfg(not(target_arch = "wasm32"))]
        gpu.device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(self.submission),
                timeout: None,
            })
            .map_err(|e| Error::device(gpu.name(), "waiting for the GPU", e, None))?;
        #[cfg(target_arch = "wasm32")]
        let _ = self.submission;
        let lost = DeviceFault::Lost("the device was lost before the readback finished");
        let mapped = self
            .mapped
            .await
            .map_err(|_| Error::device(gpu.name(), "readback", lost, None))?;
        mapped.map_err(|e| Error::device(gpu.name(), "readback", e, None))?;
        let view = self
            .staging
            .slice(..)
            .get_mapped_range()
            .map_err(|e| Error::device(gpu.name(), "readback", e, None))?;
        let out = view[..self.bytes as usize].to_vec();
        drop(view);
        self.staging.unmap();
        Ok(out)
    }
}

/// Reads `count` u32 words back.
pub async fn read_words(gpu: &Gpu, src: &wgpu::Buffer, count: usize) -> Result<Vec<u32>> {
    read_region(gpu, &Region::whole(src), count).await
}

/// Reads the first `count` u32 words of a region back.
pub async fn read_region(gpu: &Gpu, src: &Region, count: usize) -> Result<Vec<u32>> {
    let bytes = Staged::copy(gpu, &[(src, count as u64 * 4)])
        .read(gpu)
        .await?;
    Ok(bytemuck::pod_collect_to_vec(&bytes))
}
