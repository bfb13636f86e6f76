//! The device-resident step plan on wgpu: every tensor of a `Plan` gets its own buffer (the
//! temporaries with disjoint lives share them), the trained state its arenas (`arena.rs`: a
//! region of four buffers per parameter, so that AdamW and the unscale run over all of it in a
//! dispatch or two), every op its dispatches (bind groups and uniforms built once, binding each
//! tensor's region), and a step is one submission of them all; the host writes the step's tokens, targets and scalars before it and reads back
//! only the stats after it (loss, finite flags, squared norms, fp8 amaxes: a few hundred bytes).
//!
//! The plan is compiled on its first use (pipelines, tiles from the autotuner, buffers), so
//! that every build error surfaces through the async error scopes as an `Error`.

use super::WgpuBackend;
use super::arena::{self, Layout};
use super::buffer::{
    Bind, BufferPool, Dispatch, Region, STORAGE, Staged, Timer, check_binding, read_region, submit,
    submit_passes, uniform,
};
use super::cast::{self, Grouping};
use super::matmul;
use super::shaders::Kernel;
use super::train::{StepLaunch, TrainLaunch, launch};
use crate::error::{Error, Result};
use crate::format::Format;
use crate::plan::exec::{
    GradientSum, Memory, Reduced, StepExecutor, Timings, backward_then_sum, check_inputs,
    check_write, tensor_len,
};
use crate::plan::{Bucket, Op, Plan, Section, Storage, TensorId, TensorKind};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use web_time::Instant;

/// No allocator baseline taken (the adapter reports no allocator figures).
const UNSET: u64 = u64::MAX;

/// A plan compiled for the device.
struct Compiled {
    /// Each tensor's bytes: its slot's buffer, or its range of an arena.
    tensors: Vec<Region>,
    /// The arenas' buffers, four a segment (`arena::ROLES`).
    arenas: Vec<[wgpu::Buffer; 4]>,
    scalars: wgpu::Buffer,
    stats: wgpu::Buffer,
    dispatches: Vec<Dispatch>,
    /// The first dispatch of each op, and the dispatch count last: op i records
    /// `dispatches[first[i]..first[i + 1]]`.
    first: Vec<usize>,
    /// Zeroed at the start of every step (stats, current-scaling amaxes).
    clears: Vec<wgpu::Buffer>,
    /// Given fp8 scales to rewrite before each step: buffer, groups of A and B, scalar slots.
    given: Vec<(wgpu::Buffer, usize, usize, [usize; 2])>,
    /// Buffers the dispatches use besides the tensors (kernel temporaries), kept for the
    /// plan's life: each op's own (amaxes, flags, scales, losses), and the operand planes
    /// every matmul of the step shares (`MatmulRun::scratch`).
    temporaries: Vec<wgpu::Buffer>,
}

impl Compiled {
    /// Queues the step's tokens, targets and scalars (and the given fp8 scales, from the
    /// scalars) for the next submission.
    fn write_inputs(
        &self,
        gpu: &super::device::Gpu,
        plan: &Plan,
        (tokens, targets, scalars): (&[u32], &[u32], &[f32]),
    ) {
        let q = &gpu.queue;
        let [ids, targeted] = [plan.tokens, plan.targets].map(|t| &self.tensors[t]);
        q.write_buffer(&ids.buffer, ids.offset, bytemuck::cast_slice(tokens));
        q.write_buffer(
            &targeted.buffer,
            targeted.offset,
            bytemuck::cast_slice(targets),
        );
        q.write_buffer(&self.scalars, 0, bytemuck::cast_slice(scalars));
        for (buffer, ga, gb, [sa, sb]) in &self.given {
            let mut values = vec![scalars[*sa]; *ga];
            values.extend(std::iter::repeat_n(scalars[*sb], *gb));
            q.write_buffer(buffer, 0, bytemuck::cast_slice(&values));
        }
    }
}

/// The executor of a plan on a wgpu device.
pub struct ResidentPlan<'a> {
    backend: &'a WgpuBackend,
    plan: Plan,
    storage: Storage,
    /// The trained state's arenas (None: a plan without AdamW, or one whose tensors cannot
    /// take them; each tensor then has its own buffer).
    layout: Option<Layout>,
    compiled: Option<Compiled>,
    /// Values written before the plan was compiled (uploaded by the compile).
    pending: HashMap<TensorId, Vec<f32>>,
    /// The device allocator's bytes before the plan allocated anything (`UNSET` where the
    /// adapter reports none), and the most it held beyond that at any submission or readback.
    baseline: AtomicU64,
    peak: AtomicU64,
}

impl<'a> ResidentPlan<'a> {
    /// The executor of `plan` on `backend`. Nothing is allocated or compiled here: the first run
    /// (or `prepare`) compiles the plan's kernels and allocates its tensors, uploading the plan's
    /// constants and whatever was written before.
    pub fn new(backend: &'a WgpuBackend, plan: Plan) -> ResidentPlan<'a> {
        let pending = plan.constants.iter().cloned().collect();
        ResidentPlan {
            backend,
            layout: arena_layout(&plan, backend.arena_binding),
            storage: Storage::shared(&plan),
            plan,
            compiled: None,
            pending,
            baseline: AtomicU64::new(UNSET),
            peak: AtomicU64::new(0),
        }
    }

    /// Notes the device allocator's bytes now (the first call sets the baseline).
    fn sample_memory(&self) {
        if let Some(now) = self.backend.gpu.allocated_bytes() {
            let _ = self.baseline.compare_exchange(UNSET, now, Relaxed, Relaxed);
            let base = self.baseline.load(Relaxed);
            self.peak.fetch_max(now.saturating_sub(base), Relaxed);
        }
    }

    /// Bytes of the buffers the plan holds (what the allocator would count, less its
    /// alignment and the launches' parameters).
    fn held_bytes(&self) -> u64 {
        let tensors = self.tensor_bytes();
        match &self.compiled {
            Some(c) => tensors + c.temporaries.iter().map(|b| b.size()).sum::<u64>(),
            None => tensors,
        }
    }

    /// Bytes of the tensors' buffers: the slots', but that the arenas (their padding
    /// included) hold the trained state.
    fn tensor_bytes(&self) -> u64 {
        let Some(layout) = &self.layout else {
            return self.storage.bytes();
        };
        let in_arenas: u64 = (layout.members.iter())
            .flat_map(|m| m.tensors)
            .map(|t| self.plan.tensors[t].words() as u64 * 4)
            .sum();
        self.storage.bytes() - in_arenas + layout.bytes()
    }

    fn gpu_and_plan(&self) -> Result<(&super::device::Gpu, &Compiled)> {
        match &self.compiled {
            Some(c) => Ok((&self.backend.gpu, c)),
            None => Err(Error::invalid("step plan", "not compiled")),
        }
    }

    /// Reads back the stats of the step just submitted.
    async fn read_stats(&self) -> Result<Vec<f64>> {
        let (gpu, c) = self.gpu_and_plan()?;
        self.sample_memory();
        let words = read_region(gpu, &Region::whole(&c.stats), self.plan.stats.len()).await?;
        self.sample_memory();
        Ok(words.iter().map(|&w| f32::from_bits(w) as f64).collect())
    }

    async fn compiled(&mut self) -> Result<&Compiled> {
        if self.compiled.is_none() {
            // Idle pooled buffers (earlier one-off matmuls) are not the plan's: free them
            // before the baseline, and the autotuner's after the compile.
            self.backend.release_idle().await;
            self.sample_memory();
            let c = self.compile().await?;
            self.backend.release_idle().await;
            self.pending.clear();
            self.compiled = Some(c);
            self.sample_memory();
        }
        self.compiled
            .as_ref()
            .ok_or_else(|| Error::invalid("step plan", "not compiled"))
    }

    async fn compile(&self) -> Result<Compiled> {
        let gpu = &self.backend.gpu;
        for t in &self.plan.tensors {
            check_binding(gpu, "a step plan tensor", t.bytes())?;
        }
        let slots = &self.storage.slots;
        let storage = |label: &str, bytes: u64| {
            gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes.max(4).div_ceil(4) * 4,
                usage: STORAGE,
                mapped_at_creation: false,
            })
        };
        let plan = &self.plan;
        let layout = self.layout.as_ref();
        let (slot_buffers, tensors, arenas, scalars, stats) = gpu
            .scoped("allocating the step plan", || {
                // The arenas: four buffers a segment, a role each.
                let segments: Vec<[wgpu::Buffer; 4]> = layout
                    .map(|l| &l.segments[..])
                    .unwrap_or_default()
                    .iter()
                    .map(|s| arena::ROLES.map(|_| storage("mantissa.plan.arena", s.len * 4)))
                    .collect();
                let place = |id: TensorId| {
                    let l = layout?;
                    let (segment, offset) = l.place(id)?;
                    let role = l.role(id)?;
                    Some(Region {
                        buffer: segments[segment][role].clone(),
                        offset: offset * 4,
                        size: (plan.tensors[id].words() as u64 * 4).max(4),
                    })
                };
                // Temporaries with disjoint lives share a buffer (`Storage::shared`); a slot
                // of an arena's tensor is left unallocated.
                let in_arena: std::collections::HashSet<usize> = (0..plan.tensors.len())
                    .filter(|&t| place(t).is_some())
                    .map(|t| self.storage.slot_of[t])
                    .collect();
                let buffers: Vec<wgpu::Buffer> = (slots.iter().enumerate())
                    .map(|(s, &n)| {
                        let words = if in_arena.contains(&s) { 1 } else { n };
                        storage("mantissa.plan.tensor", words as u64 * 4)
                    })
                    .collect();
                let tensors: Vec<Region> = (0..plan.tensors.len())
                    .map(|t| {
                        place(t).unwrap_or_else(|| Region::whole(&buffers[self.storage.slot_of[t]]))
                    })
                    .collect();
                for (id, values) in &self.pending {
                    let words = plan.tensors[*id].to_words(values);
                    let r = &tensors[*id];
                    gpu.queue
                        .write_buffer(&r.buffer, r.offset, bytemuck::cast_slice(&words));
                }
                let scalars = storage("mantissa.plan.scalars", plan.scalar_count() as u64 * 4);
                let stats = storage("mantissa.plan.stats", plan.stats.len() as u64 * 4);
                Ok((buffers, tensors, segments, scalars, stats))
            })
            .await?;
        let mut c = Compiled {
            tensors,
            arenas,
            clears: vec![stats.clone()],
            scalars,
            stats,
            dispatches: vec![],
            first: vec![],
            given: vec![],
            temporaries: vec![],
        };
        // The operand planes of every matmul come from this pool and go back to it after
        // their op, so the next matmul takes them over (they are written and read within
        // their op's dispatches, which run in order). What an op keeps between submissions
        // (amaxes cleared at the step's start, flags, scales) is its own buffer, never one of
        // these: an earlier op's planes would overwrite it.
        let scratch = BufferPool::fitting();
        // Before them, a matmul's planes go into the buffers of slots that hold nothing live
        // while it runs (`Storage::idle_slots`), so that they add nothing to the step's memory
        // where such a slot is large enough.
        let idle = self.storage.idle_slots(&self.plan);
        // The ids an embedding's gather sorted, by the backward op that reads the sort.
        let mut sorted_ids = HashMap::new();
        let dummies = Dummies {
            read: storage("mantissa.plan.unused", 4),
            write: [0, 1, 2].map(|_| storage("mantissa.plan.unused", 4)),
        };
        for (i, op) in plan.ops.iter().enumerate() {
            c.first.push(c.dispatches.len());
            // An add folded into the matmul before it (`folds_into`) records nothing, and so
            // does a bias gradient the matmul after it sums (`sums_fold_into`), but where that
            // matmul's kernel cannot (recorded after it, below).
            if i > 0 && folds_into(plan, i - 1) || self.sums_fold(i) {
                continue;
            }
            // An embedding's gather sorts the ids for its backward (`sorts_ids_for`), which
            // then records its sum alone.
            let sort_into = match sorts_ids_for(plan, i) {
                Some((backward, rows, words)) => {
                    let sorted = storage_of(gpu, words)?;
                    c.temporaries.push(sorted.clone());
                    sorted_ids.insert(backward, sorted.clone());
                    Some((sorted, rows))
                }
                None => None,
            };
            let with = Folded {
                add: folds_into(plan, i).then(|| &plan.ops[i + 1]),
                sums: (i > 0 && self.sums_fold(i - 1)).then(|| &plan.ops[i - 1]),
                sort_into: sort_into.as_ref().map(|(b, rows)| (b, *rows)),
                sorted: sorted_ids.get(&i),
            };
            // A matmul's tile, from the autotuner.
            let mut tile = None;
            if let Op::Matmul {
                shape,
                algorithm,
                a,
                b,
                ..
            } = op
            {
                let on_device = matmul::OnDevice {
                    a: &c.tensors[*a],
                    b: &c.tensors[*b],
                    stored: [*a, *b].map(|t| self.plan.tensors[t].stored),
                };
                tile = Some(self.backend.tile_for(shape, algorithm, on_device).await?.0);
            }
            let lendable = || idle[i].iter().map(|&s| &slot_buffers[s]);
            let lent = BufferPool::fitting();
            if tile.is_some() {
                lent.give(lendable().cloned());
            }
            let what = format!("step plan op {i} ({})", op.name());
            let pools = matmul::Pools {
                lent: Some(&lent),
                scratch: &scratch,
                // What an op keeps (amaxes, flags, scales) lives as long as the plan: sized
                // exactly.
                kept: &BufferPool::exact(),
            };
            let mut recorded = gpu
                .scoped(&what, || self.record(op, tile, &c, &dummies, pools, with))
                .await?;
            if let Some(sums) = with.sums.filter(|_| !recorded.columns_summed) {
                let what = format!("step plan op {} ({})", i - 1, sums.name());
                let more = gpu
                    .scoped(&what, || {
                        self.record(sums, None, &c, &dummies, pools, Folded::default())
                    })
                    .await?;
                recorded.dispatches.extend(more.dispatches);
                recorded.clears.extend(more.clears);
                recorded.temporaries.extend(more.temporaries);
                recorded.scratch.extend(more.scratch);
            }
            c.dispatches.extend(recorded.dispatches);
            c.clears.extend(recorded.clears);
            c.given.extend(recorded.given);
            c.temporaries.extend(recorded.temporaries);
            // A lent buffer is a tensor's: it never joins the shared pool.
            let (shared, own) = recorded
                .scratch
                .into_iter()
                .filter(|b| !lendable().any(|l| l == b))
                .partition::<Vec<_>, _>(|b| scratch.reuses(b));
            scratch.give(shared);
            c.temporaries.extend(own);
        }
        c.temporaries.extend(scratch.drain());
        c.first.push(c.dispatches.len());
        Ok(c)
    }

    /// Whether op `i`'s bias gradient is summed in the matmul after it (`sums_fold_into`),
    /// as the backend's options allow.
    fn sums_fold(&self, i: usize) -> bool {
        self.backend.bias_grad_in_matmul && sums_fold_into(&self.plan, i)
    }

    /// The dispatches of one op, with what its neighbours fold into it (`Folded`).
    fn record(
        &self,
        op: &Op,
        tile: Option<super::shaders::Tile>,
        c: &Compiled,
        dummies: &Dummies,
        pools: matmul::Pools,
        with: Folded,
    ) -> Result<Recorded> {
        let backend = self.backend;
        let gpu = &backend.gpu;
        let t = &c.tensors;
        let len = |id: TensorId| self.plan.tensors[id].len;
        let stored = |id: TensorId| self.plan.tensors[id].stored;
        let coded = |id: TensorId| stored(id) != Format::F32;
        // The outputs of a train kernel writing `out` (and `second`): a coded one goes through
        // the kernels' word binding, the third.
        let outs_for = |out: TensorId, second: Option<TensorId>| {
            if coded(out) {
                [None, second, Some(out)]
            } else {
                [Some(out), second, None]
            }
        };
        let mut r = Recorded::default();
        // The dispatches of a launch (several where the loop budget splits it), each binding
        // its uniform, then `buffers`.
        let dispatches = |kernel: &Kernel,
                          groups: [u32; 3],
                          uniforms: Vec<wgpu::Buffer>,
                          buffers: &[&dyn Bind]|
         -> Result<Vec<Dispatch>> {
            let pipeline = gpu.pipeline(kernel)?;
            Ok(uniforms
                .iter()
                .map(|u| {
                    let mut bound: Vec<&dyn Bind> = vec![u];
                    bound.extend(buffers);
                    Dispatch::new(gpu, pipeline.clone(), &bound, groups)
                })
                .collect())
        };
        // A train kernel on buffers, in binding order.
        let train_with = |l: TrainLaunch, buffers: &[&dyn Bind]| -> Result<Vec<Dispatch>> {
            let l = l.launched(gpu)?;
            let uniforms = l.params.iter().map(|p| uniform(gpu, p)).collect();
            dispatches(&l.kernel, l.groups, uniforms, buffers)
        };
        // ... inputs, then outputs.
        let train_on = |l: TrainLaunch, ins: [&dyn Bind; 3], outs: [&dyn Bind; 3]| {
            train_with(l, &[ins[0], ins[1], ins[2], outs[0], outs[1], outs[2]])
        };
        // A norm's backward (`TrainOp::has_column_partials`): its column partials a fourth
        // output.
        let norm_bwd =
            |l: TrainLaunch, ins: [&dyn Bind; 3], outs: [&dyn Bind; 3], partials: &dyn Bind| {
                train_with(
                    l,
                    &[ins[0], ins[1], ins[2], outs[0], outs[1], outs[2], partials],
                )
            };
        // A train kernel on tensors; a missing one is a dummy.
        let train = |l: TrainLaunch,
                     ins: [Option<TensorId>; 3],
                     outs: [Option<TensorId>; 3]|
         -> Result<Vec<Dispatch>> {
            let ins = ins.map(|i| match i {
                Some(i) => &t[i] as &dyn Bind,
                None => &dummies.read,
            });
            let mut w = dummies.write.iter();
            let outs = outs.map(|o| match o {
                Some(o) => &t[o] as &dyn Bind,
                None => w.next().unwrap_or(&dummies.write[0]),
            });
            train_on(l, ins, outs)
        };
        // A step kernel: uniform, scalars, stats, x, then y, z, w; where its dispatches carry
        // partial results between them, in z and w (buffers of their own, kept in `carried`).
        let carried = std::cell::RefCell::new(Vec::new());
        let step_on =
            |l: StepLaunch, x: &dyn Bind, outs: [&dyn Bind; 3]| -> Result<Vec<Dispatch>> {
                let l = l.launched(gpu)?;
                let uniforms = l.params.iter().map(|p| uniform(gpu, p)).collect();
                let carry = match l.carry_words {
                    0 => None,
                    n => Some([storage_of(gpu, n)?, storage_of(gpu, n)?]),
                };
                let [z, w]: [&dyn Bind; 2] = match &carry {
                    Some([z, w]) => [z, w],
                    None => [outs[1], outs[2]],
                };
                let buffers: [&dyn Bind; 6] = [&c.scalars, &c.stats, x, outs[0], z, w];
                let d = dispatches(&l.kernel, l.groups, uniforms, &buffers)?;
                carried.borrow_mut().extend(carry.into_iter().flatten());
                Ok(d)
            };
        let step = |l: StepLaunch, x: Option<TensorId>, outs: [Option<TensorId>; 3]| {
            let x: &dyn Bind = match x {
                Some(i) => &t[i],
                None => &dummies.read,
            };
            let [y, z, w] = [0, 1, 2].map(|i| match outs[i] {
                Some(o) => &t[o] as &dyn Bind,
                None => &dummies.write[i],
            });
            step_on(l, x, [y, z, w])
        };
        let rows_of = |id: TensorId, width: usize| len(id) / width.max(1);
        let d = match *op {
            // The ids' sort for the backward, where it is folded in, to the third output.
            Op::Embedding { table, ids, out, c } => train_on(
                launch::embedding_fwd(len(out), c, with.sort_into.map(|(_, rows)| rows)),
                [&t[table], &t[ids], &dummies.read],
                [
                    &t[out],
                    &dummies.write[0],
                    match with.sort_into {
                        Some((sorted, _)) => sorted,
                        None => &dummies.write[1],
                    },
                ],
            )?,
            Op::EmbeddingBwd {
                dout,
                ids,
                out,
                rows,
                c,
            } => {
                let [sort, sum] = launch::embedding_bwd(rows, c, len(ids));
                let summed = |sorted: &wgpu::Buffer| {
                    train_on(
                        sum,
                        [&t[dout], sorted, &dummies.read],
                        [&t[out], &dummies.write[0], &dummies.write[1]],
                    )
                };
                match with.sorted {
                    Some(sorted) => summed(sorted)?,
                    None => {
                        let sorted = storage_of(gpu, launch::embedding_sort_len(rows, len(ids)))?;
                        let d = [
                            train_on(
                                sort,
                                [&dummies.read, &t[ids], &dummies.read],
                                [&dummies.write[0], &dummies.write[1], &sorted],
                            )?,
                            summed(&sorted)?,
                        ];
                        r.temporaries.push(sorted);
                        d.concat()
                    }
                }
            }
            Op::LayerNorm {
                x,
                g,
                b,
                out,
                stats,
                c,
                held,
            } => {
                let l = launch::layernorm_fwd(rows_of(x, c), c, held, coded(out));
                train(l, [Some(x), Some(g), Some(b)], outs_for(out, Some(stats)))?
            }
            Op::LayerNormBwd {
                dy,
                x,
                g,
                stats,
                dx,
                dg,
                db,
                c,
                sum,
                dy_held,
            } => {
                let rows = rows_of(x, c);
                // The gradient summed in is read as f32 words (no writer of codes writes it).
                if let Some((r, _)) = sum
                    && stored(r) != Format::F32
                {
                    return Err(Error::invalid(
                        "layer norm backward",
                        "the gradient summed into dx is stored as codes",
                    ));
                }
                let [both, sums] =
                    launch::layernorm_bwd(rows, c, dy_held, sum.map(|(_, held)| held));
                let parts = storage_of(gpu, launch::partials_len(rows, c, 2))?;
                let other: &dyn Bind = match sum {
                    Some((r, _)) => &t[r],
                    None => &dummies.write[0],
                };
                let d = [
                    norm_bwd(
                        both,
                        [&t[dy], &t[x], &t[g]],
                        [&t[dx], &t[stats], other],
                        &parts,
                    )?,
                    train_on(
                        sums,
                        [&parts, &dummies.read, &dummies.read],
                        [&t[dg], &dummies.write[0], &t[db]],
                    )?,
                ];
                r.temporaries.push(parts);
                d.concat()
            }
            Op::Unary { f, x, out, held } => {
                let l = launch::unary_fwd(f, len(x), held, coded(out), stored(x));
                train(l, [Some(x), None, None], outs_for(out, None))?
            }
            Op::UnaryBwd {
                f,
                x,
                dy,
                out,
                held,
                dy_held,
            } => train(
                launch::unary_bwd(f, len(x), held, dy_held, stored(x)),
                [Some(x), Some(dy), None],
                [Some(out), None, None],
            )?,
            Op::RmsNorm {
                x,
                g,
                out,
                stats,
                c,
                eps,
                held,
            } => {
                let l = launch::rmsnorm_fwd(rows_of(x, c), c, eps, held, coded(out));
                train(l, [Some(x), Some(g), None], outs_for(out, Some(stats)))?
            }
            Op::RmsNormBwd {
                dy,
                x,
                g,
                stats,
                dx,
                dg,
                c,
                dy_held,
            } => {
                let rows = rows_of(x, c);
                let [both, sums] = launch::rmsnorm_bwd(rows, c, dy_held);
                let parts = storage_of(gpu, launch::partials_len(rows, c, 1))?;
                let outs: [&dyn Bind; 3] = [&t[dx], &t[stats], &dummies.write[0]];
                let d = [
                    norm_bwd(both, [&t[dy], &t[x], &t[g]], outs, &parts)?,
                    train_on(
                        sums,
                        [&parts, &dummies.read, &dummies.read],
                        [&t[dg], &dummies.write[0], &dummies.write[1]],
                    )?,
                ];
                r.temporaries.push(parts);
                d.concat()
            }
            Op::Dropout {
                x,
                out,
                p,
                seed,
                site,
                held,
            } => train_on(
                launch::dropout(len(x), (p, seed, site), held),
                [&t[x], &dummies.read, &c.scalars],
                [&t[out], &dummies.write[0], &dummies.write[1]],
            )?,
            Op::Rotary {
                x,
                table,
                out,
                t,
                c,
                d,
                inverse,
                held,
            } => train(
                launch::rotary(len(x), (t, c, d), inverse, held),
                [Some(x), Some(table), None],
                [Some(out), None, None],
            )?,
            Op::RowSum {
                x,
                out,
                c,
                divisor,
                held,
            } => train(
                launch::row_sums(rows_of(x, c), c, divisor, held),
                [Some(x), None, None],
                [Some(out), None, None],
            )?,
            Op::Broadcast {
                x,
                out,
                c,
                scale,
                divisor,
                held,
            } => train(
                launch::broadcast(len(out), c, (scale, divisor), held),
                [Some(x), None, None],
                [Some(out), None, None],
            )?,
            Op::Mul { a, b, out, held } => {
                let l = launch::mul(len(a), held, coded(out));
                train(l, [Some(a), Some(b), None], outs_for(out, None))?
            }
            Op::MseLoss {
                pred,
                target,
                grad,
                held,
            } => {
                let n = len(pred);
                let squares = storage_of(gpu, n)?;
                let fwd = train_on(
                    launch::mse_fwd(n, held),
                    [&t[pred], &t[target], &c.scalars],
                    [&t[grad], &squares, &dummies.write[0]],
                )?;
                let mean = step_on(
                    launch::mean_to_stat(n, crate::plan::Stats::LOSS),
                    &squares,
                    [&dummies.write[0], &dummies.write[1], &dummies.write[2]],
                )?;
                r.temporaries.push(squares);
                [fwd, mean].concat()
            }
            Op::Attention {
                qkv,
                out,
                stats,
                ref spec,
            } => {
                attention_fits(op, spec)?;
                let mut l = launch::attention_fwd(spec, coded(out), stored(qkv));
                l.coop = backend.coop;
                train(l, [Some(qkv), None, None], outs_for(out, Some(stats)))?
            }
            Op::AttentionBwd {
                qkv,
                dout,
                stats,
                delta,
                dqkv,
                ref spec,
            } => {
                attention_fits(op, spec)?;
                launch::attention_bwd(spec, stored(qkv))
                    .into_iter()
                    .map(|mut l| {
                        l.coop = backend.coop;
                        train(
                            l,
                            [Some(qkv), Some(dout), Some(stats)],
                            [Some(dqkv), Some(delta), None],
                        )
                    })
                    .collect::<Result<Vec<_>>>()?
                    .concat()
            }
            Op::Softmax {
                x,
                out,
                t,
                causal,
                mask,
                scale,
                x_held,
            } => train(
                launch::softmax_fwd(rows_of(x, t), (t, causal, mask), scale, x_held),
                [Some(x), mask.map(|k| k.mask), None],
                [Some(out), None, None],
            )?,
            Op::SoftmaxBwd {
                p,
                dp,
                out,
                t,
                causal,
                scale,
                dp_held,
            } => train(
                launch::softmax_bwd(rows_of(p, t), (t, causal), scale, dp_held),
                [Some(p), Some(dp), None],
                [Some(out), None, None],
            )?,
            Op::CrossEntropy {
                logits,
                targets,
                grad,
                v,
                held,
            } => {
                let rows = rows_of(logits, v);
                let losses = storage_of(gpu, rows)?;
                // The gradient's codes go to the third output.
                let outs: [&dyn Bind; 3] = match coded(grad) {
                    true => [&dummies.write[0], &losses, &t[grad]],
                    false => [&t[grad], &losses, &dummies.write[0]],
                };
                let fwd = train_on(
                    launch::cross_entropy_fwd(rows, v, held, coded(grad)),
                    [&t[logits], &t[targets], &c.scalars],
                    outs,
                )?;
                let mean = step_on(
                    launch::mean_to_stat(rows, crate::plan::Stats::LOSS),
                    &losses,
                    [&dummies.write[0], &dummies.write[1], &dummies.write[2]],
                )?;
                r.temporaries.push(losses);
                [fwd, mean].concat()
            }
            Op::Matmul {
                ref shape,
                algorithm,
                a,
                b,
                out,
                scales,
                held,
            } => {
                if shape.c_len() == 0 || shape.k == 0 {
                    // An empty sum: the zero-initialised output stands.
                    return Ok(r);
                }
                let column_sums = match with.sums {
                    Some(&Op::ColumnSums { out, held, .. }) => Some((&t[out], held)),
                    _ => None,
                };
                // The add's output: the product in place, or a coded tensor of its own.
                let mut c_out = out;
                let epilogue = match with.add {
                    Some(&Op::Add {
                        x,
                        out: sum,
                        held,
                        y_held,
                        x_held,
                        residual,
                        gelu,
                        ..
                    }) => {
                        c_out = sum;
                        Some(matmul::Epilogue {
                            bias: Some(&t[x]),
                            y_held,
                            x_held,
                            held,
                            coded: coded(sum),
                            residual: residual.map(|(r, f)| (&t[r], f)),
                            gelu: gelu.map(|(g, f)| (&t[g], f, coded(g))),
                            column_sums,
                        })
                    }
                    // The product's rounding in its store, and the column sums.
                    _ if held != Format::F32 || column_sums.is_some() => Some(matmul::Epilogue {
                        column_sums,
                        ..matmul::Epilogue::held(held)
                    }),
                    _ => None,
                };
                let run = matmul::record(
                    gpu,
                    pools,
                    shape,
                    &algorithm,
                    backend.f16,
                    backend.coop.map(|co| (co, backend.coop_fallback)),
                    tile,
                    matmul::OnDevice {
                        a: &t[a],
                        b: &t[b],
                        stored: [stored(a), stored(b)],
                    },
                    Some(&t[c_out]),
                    epilogue.as_ref(),
                )?;
                if let (Some((buffer, ga, gb)), Some(slots)) = (run.given_scales, scales) {
                    r.given.push((buffer, ga, gb, slots));
                }
                r.clears.extend(run.clears);
                r.temporaries.extend(run.temporaries);
                r.scratch.extend(run.scratch);
                r.columns_summed = run.columns_summed;
                run.dispatches
            }
            Op::Round { x, format } => {
                step(launch::round(len(x), format), None, [Some(x), None, None])?
            }
            // In place (with a residual, or its GELU to z), or into a tensor of its own: z, or
            // w where it is coded (then its GELU to z). The plan has no other add
            // (`PlanBuilder::finish`).
            Op::Add {
                x,
                y,
                out,
                held,
                y_held,
                x_held,
                residual,
                gelu,
            } => {
                let g = gelu.map(|(g, format)| (format, coded(g)));
                let formats = (y_held, x_held, held);
                let launch = if out == y {
                    let z = residual.map(|r| r.0).or(gelu.map(|g| g.0));
                    let l = launch::add(len(y), len(x), formats, residual.map(|r| r.1), g);
                    (l, [Some(y), z, None])
                } else {
                    debug_assert!(residual.is_none() && (gelu.is_none() || coded(out)));
                    let outs = match coded(out) {
                        true => [Some(y), gelu.map(|g| g.0), Some(out)],
                        false => [Some(y), Some(out), None],
                    };
                    let l = launch::add_into(len(y), len(x), formats, coded(out), g);
                    (l, outs)
                };
                step(launch.0, Some(x), launch.1)?
            }
            Op::ColumnSums {
                x,
                out,
                c,
                x_held,
                held,
            } => {
                let rows = rows_of(x, c);
                let [partials, sums] = launch::column_sums(rows, c, (x_held, held));
                let parts = storage_of(gpu, launch::partials_len(rows, c, 1))?;
                let d = [
                    train_on(
                        partials,
                        [&t[x], &dummies.read, &dummies.read],
                        [&parts, &dummies.write[0], &dummies.write[1]],
                    )?,
                    train_on(
                        sums,
                        [&parts, &dummies.read, &dummies.read],
                        [&t[out], &dummies.write[0], &dummies.write[1]],
                    )?,
                ];
                r.temporaries.push(parts);
                d.concat()
            }
            Op::Copy { x, out, map, held } => step(
                launch::strided_copy(&map, held),
                Some(x),
                [Some(out), None, None],
            )?,
            Op::Amax { x, slot } => {
                let x = cast::Grouped {
                    src: &t[x],
                    stored: stored(x),
                    len: len(x),
                    grouping: Grouping::per_batch(1, len(x)),
                    offset: slot,
                };
                vec![cast::amax(gpu, &c.stats, x, None)?]
            }
            // Each tensor is a buffer of its own here: a dispatch per gradient unscales it and
            // leaves partial sums, then one dispatch reduces every gradient's into the stats.
            Op::UnscaleCheck { ref grads } => {
                let stats = &self.plan.stats;
                // Where every gradient is in the arenas, one dispatch a segment over all of
                // them (each workgroup's span is one gradient's: arena.rs); else one a gradient.
                let layout = self
                    .layout
                    .as_ref()
                    .filter(|l| grads.iter().all(|&g| l.place(g).is_some()));
                let spans: Vec<usize> = (grads.iter())
                    .map(|&g| launch::unscale_spans(len(g)))
                    .collect();
                let mut d = Vec::new();
                let mut table = Vec::with_capacity(4 * grads.len());
                let total = match layout {
                    Some(l) => {
                        // Each gradient's spans as a buffer of its own gives them, their
                        // partial slots in the gradients' order; a table of (first, end, slot)
                        // per segment.
                        let mut slot_of = Vec::with_capacity(grads.len());
                        let mut total = 0;
                        for &n in &spans {
                            slot_of.push(total);
                            total += n;
                        }
                        let (norms, flags) = (storage_of(gpu, total)?, storage_of(gpu, total)?);
                        let poisoned = l.place(grads[0]);
                        for (s, segment) in l.segments.iter().enumerate() {
                            let mut rows: Vec<u32> = Vec::new();
                            for m in l.members_of(s) {
                                let Some(index) = grads.iter().position(|&g| g == m.tensors[0])
                                else {
                                    continue;
                                };
                                let span = launch::UNSCALE_SPAN as u64;
                                for k in 0..spans[index] as u64 {
                                    let first = m.offset + k * span;
                                    let end = (first + span).min(m.offset + m.len);
                                    let slot = (slot_of[index] as u64 + k) as u32;
                                    rows.extend([first as u32, end as u32, slot]);
                                }
                            }
                            if rows.is_empty() {
                                continue;
                            }
                            let table = storage_of(gpu, rows.len())?;
                            gpu.queue
                                .write_buffer(&table, 0, bytemuck::cast_slice(&rows));
                            let region = Region {
                                buffer: c.arenas[s][0].clone(),
                                offset: 0,
                                size: segment.len.max(1) * 4,
                            };
                            let poison = poisoned.filter(|&(p, _)| p == s).map(|(_, at)| at);
                            d.extend(step_on(
                                launch::unscale_partials_table(
                                    segment.len as usize,
                                    rows.len() / 3,
                                    poison.map(|at| at as usize),
                                ),
                                &table,
                                [&region, &norms, &flags],
                            )?);
                            r.temporaries.push(table);
                        }
                        for (index, &n) in spans.iter().enumerate() {
                            table.extend([
                                slot_of[index],
                                n,
                                stats.flag(index),
                                stats.norm_sq(index),
                            ]);
                        }
                        r.temporaries.extend([norms.clone(), flags.clone()]);
                        (norms, flags)
                    }
                    None => {
                        let total: usize = spans.iter().sum();
                        let (norms, flags) = (storage_of(gpu, total)?, storage_of(gpu, total)?);
                        let mut first = 0;
                        for (index, (&grad, &n)) in grads.iter().zip(&spans).enumerate() {
                            d.extend(step_on(
                                launch::unscale_partials(len(grad), index == 0, first),
                                &dummies.read,
                                [&t[grad], &norms, &flags],
                            )?);
                            table.extend([first, n, stats.flag(index), stats.norm_sq(index)]);
                            first += n;
                        }
                        r.temporaries.extend([norms.clone(), flags.clone()]);
                        (norms, flags)
                    }
                };
                let (norms, flags) = total;
                let table: Vec<u32> = table.into_iter().map(|w| w as u32).collect();
                let rows = storage_of(gpu, table.len())?;
                gpu.queue
                    .write_buffer(&rows, 0, bytemuck::cast_slice(&table));
                let longest = spans.iter().copied().max().unwrap_or(0);
                d.extend(step_on(
                    launch::unscale_reduce(grads.len(), longest),
                    &rows,
                    [&dummies.write[0], &norms, &flags],
                )?);
                r.temporaries.push(rows);
                d
            }
            Op::AdamW { ref params, held } => {
                let mut d = Vec::new();
                let gated = self.plan.stats.grads;
                match &self.layout {
                    // One dispatch over each segment (the four roles' buffers), weight decay
                    // on the tensors before `decayed`.
                    Some(l) => {
                        for (s, segment) in l.segments.iter().enumerate() {
                            let [g, p, m1, m2] = c.arenas[s].clone().map(|buffer| Region {
                                buffer,
                                offset: 0,
                                size: segment.len * 4,
                            });
                            let (n, decayed) = (segment.len as usize, segment.decayed as usize);
                            d.extend(step_on(
                                launch::adamw(n, gated, decayed, held),
                                &g,
                                [&p, &m1, &m2],
                            )?);
                        }
                    }
                    None => {
                        for a in params {
                            let n = len(a.param);
                            d.extend(step(
                                launch::adamw(n, gated, if a.decay { n } else { 0 }, held),
                                Some(a.grad),
                                [Some(a.param), Some(a.m), Some(a.v)],
                            )?);
                        }
                    }
                }
                d
            }
        };
        r.dispatches.extend(d);
        r.temporaries.extend(carried.take());
        Ok(r)
    }
}

/// Bound where an op leaves a binding unused (distinct writable ones, since one buffer may
/// not be bound writable twice beside a read-only use).
struct Dummies {
    read: wgpu::Buffer,
    write: [wgpu::Buffer; 3],
}

/// What recording one op adds to the compiled plan.
#[derive(Default)]
struct Recorded {
    dispatches: Vec<Dispatch>,
    clears: Vec<wgpu::Buffer>,
    given: Vec<(wgpu::Buffer, usize, usize, [usize; 2])>,
    temporaries: Vec<wgpu::Buffer>,
    scratch: Vec<wgpu::Buffer>,
    /// A matmul's kernel summed the column sums it was given (`record`'s `sums`).
    columns_summed: bool,
}

fn storage_of(gpu: &super::device::Gpu, words: usize) -> Result<wgpu::Buffer> {
    check_binding(gpu, "step plan temporary", words as u64 * 4)?;
    Ok(gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("mantissa.plan.temporary"),
        size: words.max(1) as u64 * 4,
        usage: STORAGE,
        mapped_at_creation: false,
    }))
}

#[async_trait::async_trait]
impl StepExecutor for ResidentPlan<'_> {
    fn plan(&self) -> &Plan {
        &self.plan
    }

    fn describe(&self) -> String {
        format!(
            "device-resident on {}: {} ops, one submission per step, {}",
            self.backend.gpu.name(),
            self.plan.ops.len(),
            self.plan.describe_tensors(&self.storage)
        )
    }

    /// The dispatches recorded for each op when the plan was compiled.
    fn launches(&self) -> Option<Vec<usize>> {
        let c = self.compiled.as_ref()?;
        Some(c.first.windows(2).map(|w| w[1] - w[0]).collect())
    }

    async fn run(
        &mut self,
        section: Section,
        tokens: &[u32],
        targets: &[u32],
        scalars: &[f32],
    ) -> Result<Vec<f64>> {
        check_inputs(&self.plan, tokens, targets, scalars)?;
        self.compiled().await?;
        let (gpu, c) = self.gpu_and_plan()?;
        let ops = self.plan.range_of(section);
        let dispatches = &c.dispatches[c.first[ops.start]..c.first[ops.end]];
        gpu.scoped("a training step", || {
            c.write_inputs(gpu, &self.plan, (tokens, targets, scalars));
            submit(gpu, &c.clears.iter().collect::<Vec<_>>(), dispatches, None);
            Ok(())
        })
        .await?;
        self.read_stats().await
    }

    /// One compute pass per op, timed by the device's timestamps at the pass's beginning and
    /// end (as many ops to a submission as a query set holds); without timestamps, each op is
    /// submitted alone and waited for, timed by the host's clock.
    async fn run_timed(
        &mut self,
        section: Section,
        tokens: &[u32],
        targets: &[u32],
        scalars: &[f32],
    ) -> Result<(Vec<f64>, Timings)> {
        check_inputs(&self.plan, tokens, targets, scalars)?;
        self.compiled().await?;
        let (gpu, c) = self.gpu_and_plan()?;
        let ops = self.plan.range_of(section);
        let passes: Vec<&[Dispatch]> = ops
            .clone()
            .map(|i| &c.dispatches[c.first[i]..c.first[i + 1]])
            .collect();
        let timestamps = gpu.features.contains(wgpu::Features::TIMESTAMP_QUERY);
        let per_submission = if timestamps { Timer::MAX_PASSES } else { 1 };
        let mut seconds = Vec::with_capacity(passes.len());
        for (n, chunk) in passes.chunks(per_submission).enumerate() {
            let timer = Timer::new(gpu, chunk.len());
            let start = Instant::now();
            gpu.scoped("a timed training step", || {
                let mut clears = Vec::new();
                if n == 0 {
                    c.write_inputs(gpu, &self.plan, (tokens, targets, scalars));
                    clears.extend(c.clears.iter());
                }
                submit_passes(gpu, &clears, chunk, timer.as_ref());
                Ok(())
            })
            .await?;
            match &timer {
                Some(t) => seconds.extend(t.read_seconds(gpu).await?),
                None => {
                    gpu.idle().await?;
                    seconds.push(start.elapsed().as_secs_f64());
                }
            }
        }
        let measured_by = if timestamps {
            "the device's timestamps at the beginning and end of each op's compute pass (one pass per op)"
        } else {
            "the host's clock around each op, submitted alone and waited for (this device has no timestamps)"
        };
        let stats = self.read_stats().await?;
        Ok((
            stats,
            Timings {
                first: ops.start,
                seconds,
                measured_by: measured_by.into(),
            },
        ))
    }

    async fn prepare(&mut self) -> Result<()> {
        self.compiled().await.map(|_| ())
    }

    /// The backward pass submitted bucket by bucket (`Plan::gradient_buckets`), each followed
    /// by a copy of its gradients into a staging buffer; bucket i is read back, summed over the
    /// ranks and written back while the device runs the pass up to bucket i + 1, which was
    /// submitted before the host waited for bucket i.
    async fn backward_summed(
        &mut self,
        tokens: &[u32],
        targets: &[u32],
        scalars: &[f32],
        sum: &GradientSum<'_>,
    ) -> Result<(Vec<f64>, Reduced)> {
        let Some(buckets) = sum.host_buckets(&self.plan, self.describe())? else {
            return backward_then_sum(self, (tokens, targets, scalars), sum).await;
        };
        check_inputs(&self.plan, tokens, targets, scalars)?;
        self.compiled().await?;
        let (gpu, c) = self.gpu_and_plan()?;
        let plan = &self.plan;
        let mut reduced = sum.on_host(true);
        let mut in_flight: Option<(&Bucket, Staged)> = None;
        let mut done = 0;
        let end = plan.range_of(Section::Backward).end;
        for bucket in buckets.iter().map(Some).chain([None]) {
            // A bucket ready after a bias gradient that the matmul after it sums
            // (`sums_fold_into`) is ready after that matmul.
            let ready = |r: usize| match r {
                r if r > 0 && self.sums_fold(r - 1) => r + 1,
                r => r,
            };
            let upto = bucket.map_or(end, |b| ready(b.ready)).max(done);
            let staged = gpu
                .scoped("a training step", || {
                    let mut clears = Vec::new();
                    if done == 0 {
                        c.write_inputs(gpu, plan, (tokens, targets, scalars));
                        clears.extend(c.clears.iter());
                    }
                    submit(
                        gpu,
                        &clears,
                        &c.dispatches[c.first[done]..c.first[upto]],
                        None,
                    );
                    Ok(bucket.map(|b| {
                        let parts: Vec<_> = b
                            .ids
                            .iter()
                            .map(|&id| (&c.tensors[id], plan.tensors[id].words() as u64 * 4))
                            .collect();
                        Staged::copy(gpu, &parts)
                    }))
                })
                .await?;
            self.sample_memory();
            done = upto;
            // The device now runs the pass up to this bucket; meanwhile, the one before it.
            if let Some((b, previous)) = in_flight.take() {
                let words: Vec<u32> = bytemuck::pod_collect_to_vec(&previous.read(gpu).await?);
                let mut flat = Vec::with_capacity(words.len());
                let mut at = 0;
                for &id in &b.ids {
                    let info = &plan.tensors[id];
                    flat.extend(info.from_words(&words[at..at + info.words()]));
                    at += info.words();
                }
                sum.sum_bucket(plan, b, &mut flat, &mut reduced)?;
                // Queued before the next submission; no later op of the pass touches them.
                let mut at = 0;
                for &id in &b.ids {
                    let info = &plan.tensors[id];
                    let words = info.to_words(&flat[at..at + info.len]);
                    let r = &c.tensors[id];
                    gpu.queue
                        .write_buffer(&r.buffer, r.offset, bytemuck::cast_slice(&words));
                    at += info.len;
                }
            }
            in_flight = bucket.zip(staged);
        }
        let stats = self.read_stats().await?;
        Ok((stats, reduced))
    }

    async fn read(&mut self, id: TensorId) -> Result<Vec<f32>> {
        let len = tensor_len(&self.plan, id)?;
        let info = self.plan.tensors[id].clone();
        if self.compiled.is_none() {
            // Not on the device yet: what was written (as it will be stored), else zeros.
            return Ok(match self.pending.get(&id) {
                Some(values) => info.from_words(&info.to_words(values)),
                None => vec![0.0; len],
            });
        }
        let backend = self.backend;
        let c = self.compiled().await?;
        let words = read_region(&backend.gpu, &c.tensors[id], info.words()).await?;
        self.sample_memory();
        Ok(info.from_words(&words))
    }

    async fn write(&mut self, id: TensorId, values: &[f32]) -> Result<()> {
        check_write(&self.plan, id, values)?;
        match &self.compiled {
            None => {
                self.pending.insert(id, values.to_vec());
            }
            Some(c) => {
                let gpu = &self.backend.gpu;
                let words = self.plan.tensors[id].to_words(values);
                gpu.scoped("writing a plan tensor", || {
                    let r = &c.tensors[id];
                    gpu.queue
                        .write_buffer(&r.buffer, r.offset, bytemuck::cast_slice(&words));
                    Ok(())
                })
                .await?
            }
        }
        Ok(())
    }

    /// The peak starts again from now; and where this plan was built beside another (a
    /// measured choice's), whose buffers the baseline counted and which is dropped since, the
    /// baseline becomes what is allocated now less this plan's buffers.
    fn forget_peak(&mut self) {
        if let Some(now) = self.backend.gpu.allocated_bytes() {
            let base = self.baseline.load(Relaxed);
            if base != UNSET {
                let base = base.min(now.saturating_sub(self.held_bytes()));
                self.baseline.store(base, Relaxed);
                self.peak.store(now.saturating_sub(base), Relaxed);
            }
        }
    }

    fn memory(&self) -> Memory {
        let (peak_bytes, measured_by) = match self.baseline.load(Relaxed) {
            UNSET => (
                self.held_bytes(),
                "the plan's buffers (this adapter's allocator gives no report)".into(),
            ),
            _ => (
                self.peak.load(Relaxed),
                format!(
                    "{}'s allocator report, sampled at every submission and readback, less \
                     what was allocated before the plan",
                    self.backend.gpu.summary.backend
                ),
            ),
        };
        Memory {
            plan_bytes: self.tensor_bytes(),
            peak_bytes,
            measured_by,
        }
    }
}

/// Whether op `i` is a matmul whose product op `i + 1` adds a bias to, so that the add can run
/// in the matmul's store (its epilogue: `matmul::Epilogue`, epilogue.wgsl) with the same numbers
/// and no dispatch of its own: the matmul holds its product in f32 (a held one rounds in its own
/// epilogue), the add reads the whole product, its bias is one value per column, the product is
/// not empty, and both ops run in every section together. Either the add writes the product
/// back (in place, with its residual or GELU), every tensor it touches stored as f32; or it
/// writes a tensor of its own stored as the codes of the sum's format (`Plan::store_codes`'s
/// coded twin, rows of even length), its GELU stored as f32 or as codes, and no other op
/// touches the product, which is then never written (the sum lives from the matmul on:
/// `Plan::temporary_lives`).
fn folds_into(plan: &Plan, i: usize) -> bool {
    let (
        Some(Op::Matmul {
            shape,
            out,
            held: Format::F32,
            ..
        }),
        Some(add),
    ) = (plan.ops.get(i), plan.ops.get(i + 1))
    else {
        return false;
    };
    let Op::Add {
        x,
        y,
        out: sum,
        held,
        residual,
        gelu,
        ..
    } = *add
    else {
        return false;
    };
    let stored = |t: TensorId| plan.tensors[t].stored;
    let f32_ = |t: TensorId| stored(t) == Format::F32;
    let boundary = [Section::Forward, Section::Backward, Section::Gradients]
        .iter()
        .any(|&s| plan.range_of(s).end == i + 1);
    let in_place = sum == *out
        && residual.is_none_or(|(r, _)| f32_(r) && r != *out)
        && gelu.is_none_or(|(g, _)| f32_(g) && g != *out);
    let into_codes = || {
        let others_touch = |t: TensorId| {
            (plan.ops.iter().enumerate())
                .filter(|&(j, _)| j != i && j != i + 1)
                .any(|(_, op)| {
                    let (reads, writes) = op.reads_writes();
                    reads.contains(&t) || writes.contains(&t)
                })
        };
        sum != *out
            && stored(sum) == held
            && matches!(held, Format::Bf16 | Format::F16)
            && plan.tensors[sum].len == shape.c_len()
            && matmul::Epilogue::can_code(shape)
            && residual.is_none()
            && gelu.is_none_or(|(g, f)| (f32_(g) || stored(g) == f) && g != *out && g != sum)
            && plan.tensors[*out].kind == TensorKind::Temp
            && *out != plan.logits
            && !others_touch(*out)
    };
    y == *out
        && shape.c_len() > 0
        && shape.k > 0
        && plan.tensors[x].len == shape.n
        && f32_(x)
        && f32_(*out)
        && !boundary
        && (in_place || into_codes())
}

/// What the recording of an op takes over from its neighbours.
#[derive(Clone, Copy, Default)]
struct Folded<'a> {
    /// A matmul's: the add after it, run in its store (`folds_into`).
    add: Option<&'a Op>,
    /// A matmul's: the column sums before it, where its kernel can sum them (`sums_fold_into`).
    sums: Option<&'a Op>,
    /// An embedding's: where its gather sorts the ids for its backward, and the table's rows
    /// (`sorts_ids_for`).
    sort_into: Option<(&'a wgpu::Buffer, usize)>,
    /// An embedding backward's: the ids its forward sorted.
    sorted: Option<&'a wgpu::Buffer>,
}

/// Where op `i` is an embedding whose gather can sort the ids for its backward (the counting
/// sort that backward's sum reads): the first embedding backward after it over the same ids and
/// a table of the same rows, with no op between them writing the ids. Sections are prefixes of
/// the plan, so any run of the backward runs the gather before it. Returns the backward's op,
/// the table's rows and the words of the sort (`launch::embedding_sort_len`).
fn sorts_ids_for(plan: &Plan, i: usize) -> Option<(usize, usize, usize)> {
    let Op::Embedding { table, ids, c, .. } = plan.ops[i] else {
        return None;
    };
    let table_rows = plan.tensors[table].len / c.max(1);
    for (j, op) in plan.ops.iter().enumerate().skip(i + 1) {
        if let Op::EmbeddingBwd {
            ids: read, rows, ..
        } = *op
            && read == ids
        {
            let words = launch::embedding_sort_len(rows, plan.tensors[ids].len);
            return (rows == table_rows && rows > 0).then_some((j, rows, words));
        }
        if op.reads_writes().1.contains(&ids) {
            return None;
        }
    }
    None
}

/// Whether op `i` is a linear layer's bias gradient (the column sums of dy) that the weight
/// gradient's matmul right after it (x^T . dy, one matrix) can sum from the dy it reads, with
/// no dispatch and no read of dy of its own (`matmul::Epilogue::column_sums`): the matmul
/// reads dy rounded as the sums do (its algorithm's B format is their `x_held`, one plane, no
/// fp8), adds no bias in its store, the sums are stored as f32 in a tensor of their own, and
/// both ops run in every section together. Where the matmul's kernel cannot sum columns (a
/// cooperative-matrix tile), the sums are recorded after it as an op of their own.
fn sums_fold_into(plan: &Plan, i: usize) -> bool {
    let (
        Some(&Op::ColumnSums {
            x, out, c, x_held, ..
        }),
        Some(Op::Matmul {
            shape,
            algorithm,
            a,
            b,
            out: product,
            ..
        }),
    ) = (plan.ops.get(i), plan.ops.get(i + 1))
    else {
        return false;
    };
    let boundary = [Section::Forward, Section::Backward, Section::Gradients]
        .iter()
        .any(|&s| plan.range_of(s).end == i + 1);
    *b == x
        && shape.a_transposed
        && !shape.b_transposed
        && shape.batch == 1
        && shape.n == c
        && shape.k > 0
        && shape.c_len() > 0
        && shape.k * c == plan.tensors[x].len
        && !algorithm.is_split()
        && !algorithm.is_fp8()
        && algorithm.operand_formats().1 == x_held
        && plan.tensors[out].stored == Format::F32
        && ![*a, x, *product].contains(&out)
        && !folds_into(plan, i + 1)
        && !boundary
}

/// The arenas of `plan`'s trained state (its AdamW's parameters, their gradients and moments:
/// `arena.rs`), in segments of at most `binding` bytes; None where it has no AdamW, a tensor of
/// it is stored as codes, or one is longer than a binding (said once: each tensor then has a
/// buffer of its own, and AdamW and the unscale a dispatch each).
fn arena_layout(plan: &Plan, binding: u64) -> Option<Layout> {
    let params = plan.ops.iter().find_map(|op| match op {
        Op::AdamW { params, .. } => Some(params),
        _ => None,
    })?;
    let tensors = |p: &crate::plan::AdamWParam| [p.grad, p.param, p.m, p.v];
    if (params.iter().flat_map(tensors)).any(|t| plan.tensors[t].stored != Format::F32) {
        return None;
    }
    let said = |line: String| {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| eprintln!("mantissa: {line}"));
    };
    match Layout::of(params, |t| plan.tensors[t].len, binding / 4) {
        Ok(layout) => {
            if layout.segments.len() > 1 {
                said(format!(
                    "the trained state takes {} arena segments of at most {} MiB (the adapter's \
                     largest storage binding): AdamW and the unscale run a dispatch or two a segment",
                    layout.segments.len(),
                    binding >> 20
                ));
            }
            Some(layout)
        }
        Err(why) => {
            said(format!(
                "the trained state stays in a buffer per tensor ({why}): AdamW and the unscale \
                 run a dispatch per tensor"
            ));
            None
        }
    }
}

/// attention.wgsl holds a row's vectors in arrays of `ATT_MAX_D` (64).
fn attention_fits(op: &Op, spec: &crate::plan::Attention) -> Result<()> {
    if spec.d > super::train::ATT_MAX_D as usize {
        return Err(Error::invalid(
            "step plan",
            format!(
                "{} on wgpu takes heads of at most 64, not {}; record attention unfused",
                op.name(),
                spec.d
            ),
        ));
    }
    Ok(())
}
