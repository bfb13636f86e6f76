//! The device-resident step plan on CUDA: every tensor of a `Plan` allocated once on the device,
//! every op launched on the backend's one stream (train.cu kernels, cuBLAS and the split kernel
//! for the matmuls), and a step synchronised once, when its stats come back: the host writes
//! the step's tokens, targets and scalars before it and reads only the stats after it.
//!
//! With `MANTISSA_CUDA_GRAPH=on`, a section's launches are captured into a CUDA graph the
//! second time it runs (the first compiles kernels and tunes matmuls, which synchronise) and
//! the graph is replayed from then on: one launch per step instead of hundreds. The step's
//! inputs are copied into the same buffers before each replay. A plan whose launches take
//! per-step host values (the given scales of delayed fp8 scaling) is not captured, and a
//! capture that fails falls back to launches with the reason printed. Off by default until a
//! GPU has measured it against the launches.

use super::CudaBackend;
use super::matmul;
use super::nccl::Nccl;
use super::staging::HostStaging;
use super::train::{self as launch, Ptr, TensorTable, scratch};
use crate::dist::{Collective, Reducer};
use crate::error::{Error, Result};
use crate::format::Format;
use crate::plan::exec::{
    GradientSum, Memory, Reduced, StepExecutor, Timings, backward_then_sum, check_inputs,
    check_write, reduce_on_host, tensor_len,
};
use crate::plan::graph::{Graphs, Recorder};
use crate::plan::{Bucket, Op, Plan, Section, Storage, TensorId, step_algorithm};
use cudarc::driver::{CudaGraph, CudaSlice, sys};

/// The executor of a plan on a CUDA device.
pub struct CudaPlan<'a> {
    cb: &'a CudaBackend,
    plan: Plan,
    /// The page-locked buffers of a data-parallel step summed through MPI while the backward
    /// pass runs, made at its first such step. Before the device buffers: fields drop in
    /// order, and dropping it waits for the copies that may still read or write them.
    staging: Option<HostStaging>,
    /// Where each tensor lives: temporaries with disjoint lives share a buffer.
    storage: Storage,
    buffers: Vec<CudaSlice<f32>>,
    scalars: CudaSlice<f32>,
    stats: CudaSlice<f32>,
    /// Shared by the ops that need temporaries (they run one after the other on one stream).
    scratch: CudaSlice<f32>,
    /// The column reductions' counters (`launch::counters_for`): zeros between launches.
    counters: CudaSlice<u32>,
    /// Stands in for a matmul's output while that output is lent to `matmul::run`.
    spare: CudaSlice<f32>,
    /// The tensor tables of the multi-tensor ops (unscale and check, AdamW), by op index:
    /// written once here, since the tensors never move.
    tables: Vec<Option<TableOnDevice>>,
    /// The NCCL communicator of a data-parallel run, joined at its first reduction; or why
    /// `Reducer::Auto` went to MPI instead.
    nccl: Option<Nccl>,
    nccl_refused: Option<String>,
    /// What the device's stream-ordered allocator held before the plan allocated anything
    /// (None where the device has none).
    pool_base: Option<u64>,
    /// The plan's sections as CUDA graphs (`MANTISSA_CUDA_GRAPH=on`), taken out while a
    /// section runs.
    graphs: Graphs<StepGraph>,
    /// Launches of each op when it last ran op by op (`StepExecutor::launches`).
    launched: Vec<Option<usize>>,
}

/// A multi-tensor op's table and its copy on the device.
type TableOnDevice = (TensorTable, CudaSlice<u64>);

/// A captured section. CUDA graphs may be used from any thread so long as no two use one at
/// once (they are not internally synchronised); the executor owns its graphs and uses them
/// through `&mut self`, so moving it to another thread is sound. Not `Sync`.
pub struct StepGraph(CudaGraph);

// SAFETY: see `StepGraph`: access is serialised by the owning executor's `&mut self`.
unsafe impl Send for StepGraph {}

impl<'a> CudaPlan<'a> {
    /// Allocates the plan's buffers (constants uploaded, the rest zero).
    pub fn new(cb: &'a CudaBackend, plan: Plan) -> Result<CudaPlan<'a>> {
        cb.reset_peak();
        let pool_base = cb.pool_usage().map(|(now, _)| now);
        let storage = Storage::shared(&plan);
        let mut buffers = Vec::with_capacity(storage.slots.len());
        for &len in &storage.slots {
            buffers.push(cb.zeros::<f32>(len)?);
        }
        for (id, values) in &plan.constants {
            check_write(&plan, *id, values)?;
            cb.stream
                .memcpy_htod(values.as_slice(), &mut buffers[storage.slot_of[*id]])
                .map_err(|e| cb.device_error("uploading a plan constant", e))?;
        }
        let len = |id: TensorId| plan.tensors[id].len;
        let work = plan
            .ops
            .iter()
            .map(|op| scratch::of(op, len))
            .max()
            .unwrap_or(0);
        let counters = plan.ops.iter().map(launch::counters_for).max().unwrap_or(0);
        let graphs = Graphs::for_plan(
            &plan,
            crate::env::on("MANTISSA_CUDA_GRAPH").ok().flatten() == Some(true),
            "MANTISSA_CUDA_GRAPH is not on",
        );
        let plan_ops = plan.ops.len();
        let mut exec = CudaPlan {
            cb,
            tables: Vec::new(),
            scalars: cb.zeros::<f32>(plan.scalar_count())?,
            stats: cb.zeros::<f32>(plan.stats.len())?,
            scratch: cb.zeros::<f32>(work)?,
            counters: cb.zeros::<u32>(counters.max(1))?,
            spare: cb.zeros::<f32>(1)?,
            storage,
            buffers,
            plan,
            nccl: None,
            nccl_refused: None,
            staging: None,
            pool_base,
            graphs,
            launched: vec![None; plan_ops],
        };
        exec.tables = exec.tensor_tables()?;
        Ok(exec)
    }

    /// The multi-tensor ops' tables (`launch::TensorTable`), on the device.
    fn tensor_tables(&self) -> Result<Vec<Option<TableOnDevice>>> {
        let table = |op: &Op| match op {
            Op::UnscaleCheck { grads } => {
                TensorTable::unscale(grads.iter().map(|&g| (self.p(g), self.len(g)))).map(Some)
            }
            Op::AdamW { params, .. } => TensorTable::adamw(params.iter().map(|a| {
                let ptrs = [a.param, a.grad, a.m, a.v].map(|t| self.p(t));
                (ptrs, self.len(a.param), a.decay)
            }))
            .map(Some),
            _ => Ok(None),
        };
        self.plan
            .ops
            .iter()
            .map(|op| {
                Ok(match table(op)? {
                    Some(t) => {
                        let on_device = self.cb.upload(&t.words)?;
                        Some((t, on_device))
                    }
                    None => None,
                })
            })
            .collect()
    }

    /// Op `i`'s tensor table and its device address.
    fn table(&self, i: usize) -> Result<(&TensorTable, Ptr)> {
        match &self.tables[i] {
            Some((t, on_device)) => Ok((t, self.cb.ptr(on_device))),
            // `tensor_tables` made one for every multi-tensor op.
            None => Err(Error::invalid(
                "step plan",
                format!("op {i} is not a multi-tensor op"),
            )),
        }
    }

    fn p(&self, id: TensorId) -> Ptr {
        self.cb.ptr(self.buffer(id))
    }

    fn buffer(&self, id: TensorId) -> &CudaSlice<f32> {
        &self.buffers[self.storage.slot_of[id]]
    }

    /// Bytes of the buffers the plan holds: its storage, scratch and counters.
    fn held_bytes(&self) -> u64 {
        self.storage.bytes() + (self.scratch.len() + self.counters.len()) as u64 * 4
    }

    fn buffer_mut(&mut self, id: TensorId) -> &mut CudaSlice<f32> {
        &mut self.buffers[self.storage.slot_of[id]]
    }

    fn len(&self, id: TensorId) -> usize {
        self.plan.tensors[id].len
    }

    /// Whether tensor `id` stores 16-bit codes (`Plan::store_codes`).
    fn coded(&self, id: TensorId) -> bool {
        self.stored(id) != Format::F32
    }

    /// What tensor `id` stores: f32, or the codes of bf16 or f16.
    fn stored(&self, id: TensorId) -> Format {
        self.plan.tensors[id].stored
    }

    fn rows(&self, id: TensorId, width: usize) -> usize {
        self.len(id) / width.max(1)
    }

    /// Launches one op; `host_scalars` are the step's scalars (fp8 given scales are launch
    /// arguments of the matmul).
    fn launch(&mut self, i: usize, op: &Op, host_scalars: &[f32]) -> Result<()> {
        let cb = self.cb;
        let (scalars, stats, work) = (
            cb.ptr(&self.scalars),
            cb.ptr(&self.stats),
            cb.ptr(&self.scratch),
        );
        let counters = cb.ptr(&self.counters);
        let layout = self.plan.stats;
        match *op {
            Op::Embedding { table, ids, out, c } => {
                let tokens = self.len(ids);
                launch::embedding_fwd(cb, self.p(table), self.p(ids), self.p(out), tokens, c)
            }
            Op::EmbeddingBwd {
                dout,
                ids,
                out,
                rows,
                c,
            } => {
                let tokens = self.len(ids);
                let ptrs = [self.p(dout), self.p(ids), self.p(out)];
                launch::embedding_bwd(cb, ptrs, (rows, c, tokens), work)
            }
            Op::LayerNorm {
                x,
                g,
                b,
                out,
                stats: st,
                c,
                held,
            } => {
                let ptrs = [x, g, b, out, st].map(|id| self.p(id));
                launch::layernorm_fwd(cb, ptrs, (self.rows(x, c), c), (held, self.coded(out)))
            }
            Op::LayerNormBwd {
                dy,
                x,
                g,
                stats: st,
                dx,
                dg,
                db,
                c,
                sum,
                dy_held,
            } => {
                let ptrs = [dy, x, g, st, dx, dg, db].map(|id| self.p(id));
                let sum = sum.map(|(r, held)| (self.p(r), held));
                launch::layernorm_bwd(
                    cb,
                    ptrs,
                    (self.rows(x, c), c),
                    (dy_held, sum),
                    (work, counters),
                )
            }
            Op::Unary { f, x, out, held } => launch::unary_fwd(
                cb,
                f,
                [self.p(x), self.p(out)],
                self.len(x),
                (held, self.coded(out)),
                self.stored(x),
            ),
            Op::UnaryBwd {
                f,
                x,
                dy,
                out,
                held,
                dy_held,
            } => launch::unary_bwd(
                cb,
                f,
                [self.p(x), self.p(dy), self.p(out)],
                self.len(x),
                (held, dy_held),
                self.stored(x),
            ),
            Op::RmsNorm {
                x,
                g,
                out,
                stats: st,
                c,
                eps,
                held,
            } => {
                let ptrs = [x, g, out, st].map(|id| self.p(id));
                let shape = (self.rows(x, c), c, eps);
                launch::rmsnorm_fwd(cb, ptrs, shape, (held, self.coded(out)))
            }
            Op::RmsNormBwd {
                dy,
                x,
                g,
                stats: st,
                dx,
                dg,
                c,
                dy_held,
            } => {
                let ptrs = [dy, x, g, st, dx, dg].map(|id| self.p(id));
                launch::rmsnorm_bwd(cb, ptrs, (self.rows(x, c), c), dy_held, (work, counters))
            }
            Op::Mul { a, b, out, held } => launch::mul(
                cb,
                [self.p(a), self.p(b), self.p(out)],
                self.len(a),
                (held, self.coded(out)),
            ),
            Op::Dropout {
                x,
                out,
                p,
                seed,
                site,
                held,
            } => launch::dropout(
                cb,
                [self.p(x), self.p(out), scalars],
                self.len(x),
                (p, seed, site),
                held,
            ),
            Op::Rotary {
                x,
                table,
                out,
                t,
                c,
                d,
                inverse,
                held,
            } => launch::rotary(
                cb,
                [self.p(x), self.p(table), self.p(out)],
                self.len(x),
                (t, c, d, inverse),
                held,
            ),
            Op::RowSum {
                x,
                out,
                c,
                divisor,
                held,
            } => {
                let shape = (self.rows(x, c), c, divisor);
                launch::row_sums(cb, [self.p(x), self.p(out)], shape, held)
            }
            Op::Broadcast {
                x,
                out,
                c,
                scale,
                divisor,
                held,
            } => launch::broadcast(
                cb,
                [self.p(x), self.p(out)],
                (self.len(out), c),
                (scale, divisor),
                held,
            ),
            Op::MseLoss {
                pred,
                target,
                grad,
                held,
            } => {
                let ptrs = [self.p(pred), self.p(target), self.p(grad), stats];
                let shape = (crate::plan::Stats::LOSS, self.len(pred));
                launch::mse_fwd(cb, ptrs, shape, work, (scalars, held))
            }
            Op::Softmax {
                x,
                out,
                t,
                causal,
                mask,
                scale,
                x_held,
            } => {
                let shape = (self.rows(x, t), t, scale, causal);
                let mask = mask.map(|m| (self.p(m.mask), m));
                launch::softmax_fwd(cb, [self.p(x), self.p(out)], shape, mask, x_held)
            }
            Op::SoftmaxBwd {
                p,
                dp,
                out,
                t,
                causal,
                scale,
                dp_held,
            } => {
                let shape = (self.rows(p, t), t, scale, causal);
                launch::softmax_bwd(cb, [self.p(p), self.p(dp), self.p(out)], shape, dp_held)
            }
            Op::Attention {
                qkv,
                out,
                stats: st,
                ref spec,
            } => {
                let ptrs = [qkv, out, st].map(|id| self.p(id));
                launch::attention_fwd(cb, ptrs, spec, (self.coded(out), self.stored(qkv)))
            }
            Op::AttentionBwd {
                qkv,
                dout,
                stats: st,
                delta,
                dqkv,
                ref spec,
            } => {
                let ptrs = [qkv, dout, st, delta, dqkv].map(|id| self.p(id));
                launch::attention_bwd(cb, ptrs, spec, self.stored(qkv), work)
            }
            Op::CrossEntropy {
                logits,
                targets,
                grad,
                v,
                held,
            } => {
                let ptrs = [self.p(logits), self.p(targets), self.p(grad), stats];
                let shape = (crate::plan::Stats::LOSS, self.rows(logits, v), v);
                let coded = self.coded(grad);
                launch::cross_entropy_fwd(cb, ptrs, shape, work, (scalars, held, coded))
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
                let algorithm = step_algorithm(algorithm, scales, host_scalars);
                // The output's buffer is lent out of the list while the operands' are borrowed
                // (tensors of one op never share a buffer).
                let slot = self.storage.slot_of[out];
                std::mem::swap(&mut self.buffers[slot], &mut self.spare);
                let (sa, sb) = (self.storage.slot_of[a], self.storage.slot_of[b]);
                let stored = [a, b].map(|t| self.plan.tensors[t].stored);
                let done = matmul::run_stored(
                    cb,
                    shape,
                    &algorithm,
                    (&self.buffers[sa], &self.buffers[sb]),
                    stored,
                    &mut self.spare,
                );
                std::mem::swap(&mut self.buffers[slot], &mut self.spare);
                done?;
                // The product's rounding is a launch of its own here (as `Op::Round`).
                if held != Format::F32 {
                    launch::round(cb, self.p(out), self.len(out), held)?;
                }
                Ok(())
            }
            Op::Round { x, format } => launch::round(cb, self.p(x), self.len(x), format),
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
                let lens = (self.len(y), self.len(x));
                let ptrs = [self.p(x), self.p(y), self.p(out)];
                // No residual, no GELU: a null pointer, which the kernel reads as none.
                let (r, r_held) = match residual {
                    Some((r, format)) => (self.p(r), format),
                    None => (0, Format::F32),
                };
                let g = match gelu {
                    Some((g, format)) => (self.p(g), format, self.coded(g)),
                    None => (0, Format::F32, false),
                };
                let formats = (y_held, x_held, held, self.coded(out));
                launch::add(cb, ptrs, lens, formats, (r, r_held), g)
            }
            Op::ColumnSums {
                x,
                out,
                c,
                x_held,
                held,
            } => launch::column_sums(
                cb,
                [self.p(x), self.p(out)],
                (self.rows(x, c), c),
                (x_held, held),
                (work, counters),
            ),
            Op::Copy {
                x,
                out,
                ref map,
                held,
            } => launch::strided_copy(cb, [self.p(x), self.p(out)], map, held),
            Op::Amax { x, slot } => launch::amax_into(cb, self.p(x), self.len(x), stats, slot),
            Op::UnscaleCheck { .. } => {
                let slots = (layout.flag(0), layout.norm_sq(0));
                launch::unscale(cb, self.table(i)?, [scalars, stats], slots, work)
            }
            Op::AdamW { held, .. } => {
                launch::adamw(cb, self.table(i)?, [stats, scalars], (layout.grads, held))
            }
        }
    }

    /// Checks a step's inputs and uploads them; clears the stats.
    fn begin_step(&mut self, tokens: &[u32], targets: &[u32], scalars: &[f32]) -> Result<()> {
        // Ids are checked on the host: a bad one would read outside a table on the device.
        check_inputs(&self.plan, tokens, targets, scalars)?;
        let cb = self.cb;
        let upload = |what: &str, values: &[f32], to: &mut CudaSlice<f32>| {
            cb.stream
                .memcpy_htod(values, to)
                .map_err(|e| cb.device_error(what, e))
        };
        let (tokens_id, targets_id) = (self.plan.tokens, self.plan.targets);
        upload(
            "tokens",
            bytemuck::cast_slice(tokens),
            self.buffer_mut(tokens_id),
        )?;
        upload(
            "targets",
            bytemuck::cast_slice(targets),
            self.buffer_mut(targets_id),
        )?;
        upload("scalars", scalars, &mut self.scalars)?;
        cb.stream
            .memset_zeros(&mut self.stats)
            .map_err(|e| cb.device_error("clearing the stats", e))
    }

    /// Launches op `i` of the plan.
    fn launch_op(&mut self, i: usize, scalars: &[f32]) -> Result<()> {
        let op = self.plan.ops[i].clone();
        let before = self.cb.launched();
        self.launch(i, &op, scalars)
            .map_err(|e| e.during(format_args!("step plan op {i} ({})", op.name())))?;
        self.launched[i] = Some(self.cb.launched() - before);
        Ok(())
    }

    /// Launches the ops of `section`: its graph where one is captured, else captured now
    /// where graphs are on and the section ran before, else op by op (`Graphs::run`).
    async fn launch_section(&mut self, section: Section, scalars: &[f32]) -> Result<()> {
        let mut graphs = std::mem::replace(&mut self.graphs, Graphs::Off(String::new()));
        let ran = graphs.run(self, section, scalars).await;
        self.graphs = graphs;
        ran
    }

    /// Waits for the step and reads its stats back.
    fn read_stats(&self) -> Result<Vec<f64>> {
        let stats = self.cb.download(&self.stats, self.plan.stats.len())?;
        Ok(stats.into_iter().map(|v| v as f64).collect())
    }
}

#[async_trait::async_trait]
impl StepExecutor for CudaPlan<'_> {
    fn plan(&self) -> &Plan {
        &self.plan
    }

    fn describe(&self) -> String {
        let launched = self.graphs.describe("a CUDA graph");
        format!(
            "device-resident on {}: {} ops {launched} on one stream, one synchronisation per step, {}",
            self.cb.info.name,
            self.plan.ops.len(),
            self.plan.describe_tensors(&self.storage)
        )
    }

    /// Counted as the ops last ran one by one (a graph's capture launches each op once too);
    /// None until every op has.
    fn launches(&self) -> Option<Vec<usize>> {
        self.launched.iter().copied().collect()
    }

    async fn run(
        &mut self,
        section: Section,
        tokens: &[u32],
        targets: &[u32],
        scalars: &[f32],
    ) -> Result<Vec<f64>> {
        self.begin_step(tokens, targets, scalars)?;
        self.launch_section(section, scalars).await?;
        self.read_stats()
    }

    /// An event recorded on the stream before the first op and after each: an op's time is
    /// the device's time between the events around it, so a gap where the device waited for
    /// the host to launch the op counts as the op's.
    async fn run_timed(
        &mut self,
        section: Section,
        tokens: &[u32],
        targets: &[u32],
        scalars: &[f32],
    ) -> Result<(Vec<f64>, Timings)> {
        let cb = self.cb;
        let ops = self.plan.range_of(section);
        // Created before the step, so that creating them does not delay the launches.
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let events = (0..=ops.len())
            .map(|_| cb.stream.context().new_event(timing))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| cb.device_error("creating timing events", e))?;
        self.begin_step(tokens, targets, scalars)?;
        let record = |event: &cudarc::driver::CudaEvent| {
            event
                .record(&cb.stream)
                .map_err(|e| cb.device_error("recording a timing event", e))
        };
        record(&events[0])?;
        for (i, event) in ops.clone().zip(&events[1..]) {
            self.launch_op(i, scalars)?;
            record(event)?;
        }
        let stats = self.read_stats()?;
        let seconds = events
            .windows(2)
            .map(|w| w[0].elapsed_ms(&w[1]).map(|ms| ms as f64 * 1e-3))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| cb.device_error("reading timing events", e))?;
        Ok((
            stats,
            Timings {
                first: ops.start,
                seconds,
                measured_by: "CUDA events recorded on the step's stream between consecutive ops \
                              (an op's time includes any wait for its launch)"
                    .into(),
            },
        ))
    }

    /// Overrides `MANTISSA_CUDA_GRAPH` (what is recorded already is dropped).
    fn record_sections(&mut self, on: bool) -> Result<()> {
        self.graphs
            .set(&self.plan, on, "turned off (TrainOptions::graphs)")
    }

    async fn read(&mut self, id: TensorId) -> Result<Vec<f32>> {
        tensor_len(&self.plan, id)?;
        let info = &self.plan.tensors[id];
        let words = self.cb.download(self.buffer(id), info.words())?;
        Ok(info.from_words(bytemuck::cast_slice::<f32, u32>(&words)))
    }

    async fn write(&mut self, id: TensorId, values: &[f32]) -> Result<()> {
        check_write(&self.plan, id, values)?;
        let cb = self.cb;
        let words = self.plan.tensors[id].to_words(values);
        cb.stream
            .memcpy_htod(
                bytemuck::cast_slice::<u32, f32>(&words),
                self.buffer_mut(id),
            )
            .map_err(|e| cb.device_error("writing a plan tensor", e))
    }

    /// The allocator's high-water mark starts again from what it holds now (the other plan
    /// of a measured choice freed); where this plan was built beside the other, whose buffers
    /// the baseline counted, the baseline becomes what the pool holds now less this plan's.
    fn forget_peak(&mut self) {
        // Frees are stream-ordered: the pool holds the other plan until the stream passes them.
        let _ = self.cb.stream.synchronize();
        self.cb.reset_peak();
        if let (Some(base), Some((now, _))) = (self.pool_base, self.cb.pool_usage()) {
            self.pool_base = Some(base.min(now.saturating_sub(self.held_bytes())));
        }
    }

    fn memory(&self) -> Memory {
        let held = self.held_bytes();
        let (peak_bytes, measured_by) = match (self.pool_base, self.cb.pool_usage()) {
            (Some(base), Some((_, high))) => (
                high.saturating_sub(base),
                "the CUDA stream-ordered allocator's high-water mark (USED_MEM_HIGH), less what \
                 it held before the plan (cuBLAS's own workspace not included)"
                    .into(),
            ),
            _ => (
                held,
                "the plan's buffers (this device has no stream-ordered allocator)".into(),
            ),
        };
        Memory {
            plan_bytes: self.storage.bytes(),
            peak_bytes,
            measured_by,
        }
    }

    /// NCCL on the device buffers (`Auto` and `Nccl`; `Auto` goes to MPI's host buffers, with
    /// the reason kept, when the ranks cannot form a NCCL communicator), else MPI.
    async fn all_reduce(&mut self, sum: &GradientSum<'_>) -> Result<Reduced> {
        let Some(nccl) = self.take_nccl(sum.group, sum.reducer)? else {
            let mut reduced = reduce_on_host(self, sum).await?;
            self.say_why_not_nccl(sum.reducer, &mut reduced);
            return Ok(reduced);
        };
        let summed = self.sum_on_device(&nccl, sum.ids).and_then(|bytes| {
            nccl.wait_for(&self.cb.stream)?;
            Ok(bytes)
        });
        let reduced = summed.map(|bytes| Reduced {
            engine: format!("NCCL {}, device buffers", nccl.version),
            bytes,
            calls: 1,
            overlapped: false,
        });
        self.nccl = Some(nccl);
        reduced
    }

    /// The backward pass launched bucket by bucket (`Plan::gradient_buckets`), each bucket
    /// summed as soon as the pass is done with it while the rest of the pass runs: with NCCL,
    /// on NCCL's stream in device memory; through MPI, copied to page-locked host memory on a
    /// stream of its own, summed by the host and copied back (`staging`). The update waits
    /// for every sum. Where `sum.overlap` is off, or NCCL sums a step with an injected fault:
    /// the whole pass, then the sum.
    async fn backward_summed(
        &mut self,
        tokens: &[u32],
        targets: &[u32],
        scalars: &[f32],
        sum: &GradientSum<'_>,
    ) -> Result<(Vec<f64>, Reduced)> {
        let inputs = (tokens, targets, scalars);
        if !sum.overlap {
            return backward_then_sum(self, inputs, sum).await;
        }
        match self.take_nccl(sum.group, sum.reducer)? {
            None => self.backward_on_host(inputs, sum),
            Some(nccl) if sum.poison.is_some() => {
                self.nccl = Some(nccl);
                backward_then_sum(self, inputs, sum).await
            }
            Some(nccl) => {
                let summed = self.backward_on_nccl(&nccl, inputs, sum);
                self.nccl = Some(nccl);
                summed
            }
        }
    }
}

impl CudaPlan<'_> {
    /// The communicator, taken out of the executor while it is used, where `reducer` asks for
    /// NCCL and the ranks form one (joined at the first call, a collective one); None for MPI.
    fn take_nccl(&mut self, group: &dyn Collective, reducer: Reducer) -> Result<Option<Nccl>> {
        if reducer != Reducer::Mpi && self.nccl.is_none() && self.nccl_refused.is_none() {
            match Nccl::join(self.cb, group) {
                Ok(n) => self.nccl = Some(n),
                Err(e) if reducer == Reducer::Auto => self.nccl_refused = Some(e.to_string()),
                Err(e) => return Err(e),
            }
        }
        Ok(match reducer {
            Reducer::Mpi => None,
            Reducer::Auto | Reducer::Nccl => self.nccl.take(),
        })
    }

    /// Where `Reducer::Auto` went to MPI because the ranks could not form a NCCL communicator,
    /// the record says why.
    fn say_why_not_nccl(&self, reducer: Reducer, reduced: &mut Reduced) {
        if let (Reducer::Auto, Some(why)) = (reducer, &self.nccl_refused) {
            reduced.engine.push_str(&format!(" (not NCCL: {why})"));
        }
    }

    /// The buffers of tensors `ids` with their lengths, in the order of `ids`, borrowed
    /// together; an error where two share storage.
    fn buffers_of(&mut self, ids: &[TensorId]) -> Result<Vec<(&mut CudaSlice<f32>, usize)>> {
        let mut parts = Vec::with_capacity(ids.len());
        for &id in ids {
            parts.push((self.storage.slot_of[id], tensor_len(&self.plan, id)?));
        }
        let mut by_slot: Vec<Option<&mut CudaSlice<f32>>> =
            self.buffers.iter_mut().map(Some).collect();
        parts
            .into_iter()
            .map(|(slot, len)| {
                let buffer = by_slot
                    .get_mut(slot)
                    .and_then(Option::take)
                    .ok_or_else(|| {
                        Error::invalid(
                            "gradient reduction",
                            "two of the tensors share device storage",
                        )
                    })?;
                Ok((buffer, len))
            })
            .collect()
    }

    /// Launches the sum of tensors `ids` on NCCL's stream after the kernels launched so far
    /// (one group of calls); returns the bytes summed.
    fn sum_on_device(&mut self, nccl: &Nccl, ids: &[TensorId]) -> Result<u64> {
        let step = &self.cb.stream;
        let buffers = self.buffers_of(ids)?;
        let bytes = buffers.iter().map(|&(_, len)| len as u64 * 4).sum();
        nccl.sum_after(step, buffers)?;
        Ok(bytes)
    }

    /// `backward_summed` on NCCL (see there).
    fn backward_on_nccl(
        &mut self,
        nccl: &Nccl,
        (tokens, targets, scalars): (&[u32], &[u32], &[f32]),
        sum: &GradientSum<'_>,
    ) -> Result<(Vec<f64>, Reduced)> {
        let buckets = self.plan.gradient_buckets(sum.ids, sum.bucket)?;
        self.begin_step(tokens, targets, scalars)?;
        let mut reduced = Reduced {
            engine: format!("NCCL {}, device buffers", nccl.version),
            bytes: 0,
            calls: 0,
            overlapped: true,
        };
        self.launch_by_buckets(&buckets, scalars, |exec, _, bucket| {
            reduced.bytes += exec.sum_on_device(nccl, &bucket.ids)?;
            reduced.calls += 1;
            Ok(())
        })?;
        nccl.wait_for(&self.cb.stream)?;
        Ok((self.read_stats()?, reduced))
    }

    /// Launches the backward pass (the step begun), calling `after` with each bucket (and its
    /// index) right after the bucket's last op is launched.
    fn launch_by_buckets(
        &mut self,
        buckets: &[Bucket],
        scalars: &[f32],
        mut after: impl FnMut(&mut Self, usize, &Bucket) -> Result<()>,
    ) -> Result<()> {
        let mut done = 0;
        for (b, bucket) in buckets.iter().enumerate() {
            for i in done..bucket.ready {
                self.launch_op(i, scalars)?;
            }
            done = bucket.ready;
            after(self, b, bucket)?;
        }
        for i in done..self.plan.range_of(Section::Backward).end {
            self.launch_op(i, scalars)?;
        }
        Ok(())
    }
}

impl CudaPlan<'_> {
    /// `backward_summed` through MPI's host buffers (see there).
    fn backward_on_host(
        &mut self,
        inputs: (&[u32], &[u32], &[f32]),
        sum: &GradientSum<'_>,
    ) -> Result<(Vec<f64>, Reduced)> {
        let buckets = self.plan.gradient_buckets(sum.ids, sum.bucket)?;
        let mut lens = Vec::with_capacity(buckets.len());
        for bucket in &buckets {
            let len: Result<usize> = bucket
                .ids
                .iter()
                .map(|&id| tensor_len(&self.plan, id))
                .sum();
            lens.push(len?);
        }
        let mut staging = match self.staging.take() {
            Some(staging) => staging,
            None => HostStaging::new(self.cb)?,
        };
        let summed = staging
            .fit(self.cb, &lens)
            .and_then(|()| self.backward_staged(&mut staging, &buckets, inputs, sum));
        self.staging = Some(staging);
        summed
    }

    /// Launches the whole pass with each bucket's copy out behind its last op; then, bucket
    /// by bucket as its copy completes, sums it over the ranks and copies it back, while the
    /// device runs the rest of the pass.
    fn backward_staged(
        &mut self,
        staging: &mut HostStaging,
        buckets: &[Bucket],
        (tokens, targets, scalars): (&[u32], &[u32], &[f32]),
        sum: &GradientSum<'_>,
    ) -> Result<(Vec<f64>, Reduced)> {
        let cb = self.cb;
        self.begin_step(tokens, targets, scalars)?;
        let mut copied = Vec::with_capacity(buckets.len());
        self.launch_by_buckets(buckets, scalars, |exec, b, bucket| {
            let parts = exec.buffers_of(&bucket.ids)?;
            let parts = parts.into_iter().map(|(d, len)| (&*d, len)).collect();
            copied.push(staging.copy_out(cb, &cb.stream, b, parts)?);
            Ok(())
        })?;
        let mut reduced = sum.on_host(true);
        self.say_why_not_nccl(sum.reducer, &mut reduced);
        for (b, (bucket, copy)) in buckets.iter().zip(&copied).enumerate() {
            let values = staging.values(cb, b, copy)?;
            sum.sum_bucket(&self.plan, bucket, values, &mut reduced)?;
            staging.copy_in(cb, b, self.buffers_of(&bucket.ids)?)?;
        }
        staging.wait_for(cb, &cb.stream)?;
        Ok((self.read_stats()?, reduced))
    }
}

impl Recorder for CudaPlan<'_> {
    type Graph = StepGraph;

    async fn launch(&mut self, section: Section, scalars: &[f32]) -> Result<()> {
        for i in self.plan.range_of(section) {
            self.launch_op(i, scalars)?;
        }
        Ok(())
    }

    /// The ops of `section` captured from the stream (not run); the stream leaves capture
    /// whatever happens.
    async fn record(
        &mut self,
        section: Section,
        scalars: &[f32],
    ) -> std::result::Result<StepGraph, String> {
        let stream = self.cb.stream.clone();
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        stream.begin_capture(mode).map_err(|e| e.to_string())?;
        let launched = self
            .plan
            .range_of(section)
            .try_for_each(|i| self.launch_op(i, scalars));
        // Graphs allocate as they run where an op allocates (its temporaries): freed on the
        // next launch if the op did not free them.
        let flags = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
        let ended = stream.end_capture(flags);
        launched.map_err(|e| e.to_string())?;
        match ended {
            Ok(Some(graph)) => Ok(StepGraph(graph)),
            Ok(None) => Err("the capture recorded nothing".into()),
            Err(e) => Err(e.to_string()),
        }
    }

    async fn replay(&mut self, graph: &mut StepGraph) -> Result<()> {
        graph
            .0
            .launch()
            .map_err(|e| self.cb.device_error("launching the step's CUDA graph", e))
    }
}
