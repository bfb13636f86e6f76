//! The host interpreter of step plans, the reference backend's executor: tensors in host
//! memory, each op the host reference's definition (`ops.rs`, `matmul.rs`), one after the
//! other. It runs any backend's plan (fused attention included) with the numbers every other
//! executor is compared with (`backend::executor` with `resident` false).

use super::matmul::matmul;
use super::ops::{self, round_to};
use crate::error::Result;
use crate::format::{self, Format};
use crate::plan::exec::{
    GradientSum, Memory, Reduced, StepExecutor, Timings, backward_then_sum, check_inputs,
    check_write, tensor_len, update_factor,
};
use crate::plan::graph::{Graphs, Recorder};
use crate::plan::{
    AdamW, AdamWParam, Op, Plan, Section, Stats, Storage, TensorId, Unary, dropout, rotary, scalar,
    step_algorithm,
};

/// The host interpreter: tensors in host memory, each op the host reference's definition.
pub struct HostExecutor {
    plan: Plan,
    tensors: Vec<Vec<f32>>,
    /// The temporaries each op uses for the last time in a step, freed after it.
    last_uses: Vec<Vec<TensorId>>,
    /// The most bytes the tensors held at once (after any op).
    peak: u64,
    /// The step's scalars and stats where its ops read and write them (the host's model of a
    /// device's memory: a replayed recording reads the scalars of the step it runs in).
    scalars: Vec<f32>,
    stats: Vec<f64>,
    /// Sections recorded and replayed (off unless `record_sections` turns them on).
    graphs: Graphs<HostGraph>,
}

/// A section recorded by the host interpreter: its ops as launched, each op's index in the plan
/// and the op with what a launch takes from the host fixed at the recording (a matmul's given
/// fp8 scales), as a CUDA graph keeps its kernels' arguments.
pub struct HostGraph(Vec<(usize, Op)>);

impl HostExecutor {
    /// An executor of `plan`, its constants set; every other tensor reads as zeros until
    /// written. The tensors' host memory is asked for first (`memory::check`), and the
    /// constants are copied with `try_reserve`: `HostOutOfMemory` with the bytes, not an abort.
    pub fn new(plan: Plan) -> Result<HostExecutor> {
        let bytes = crate::plan::Storage::shared(&plan).bytes();
        crate::memory::check("the host interpreter's tensors", Some(bytes))?;
        let mut tensors = vec![Vec::new(); plan.tensors.len()];
        for (id, values) in &plan.constants {
            let mut copy =
                crate::memory::empty_with_capacity("a step plan constant", values.len())?;
            copy.extend_from_slice(values);
            tensors[*id] = copy;
        }
        let mut last_uses = vec![Vec::new(); plan.ops.len()];
        for (t, life) in plan.temporary_lives().into_iter().enumerate() {
            if let Some((_, last)) = life {
                last_uses[last].push(t);
            }
        }
        Ok(HostExecutor {
            plan,
            tensors,
            last_uses,
            peak: 0,
            scalars: vec![],
            stats: vec![],
            graphs: Graphs::Off("not asked for".into()),
        })
    }

    fn held_bytes(&self) -> u64 {
        let info = &self.plan.tensors;
        let stored = |(i, t): (usize, &Vec<f32>)| {
            if t.is_empty() { 0 } else { info[i].bytes() }
        };
        self.tensors.iter().enumerate().map(stored).sum()
    }

    /// Tensor `id`, allocated (zeros) on first use: `HostOutOfMemory` where the host cannot.
    fn slot(&mut self, id: TensorId) -> Result<&mut Vec<f32>> {
        let len = self.plan.tensors[id].len;
        let t = &mut self.tensors[id];
        if t.len() != len {
            if let Some(more) = len.checked_sub(t.len()) {
                t.try_reserve_exact(more)
                    .map_err(|_| crate::error::Error::HostOutOfMemory {
                        what: format!("step plan tensor {id}"),
                        bytes: crate::memory::bytes_of::<f32>(len),
                        available: crate::memory::available(),
                    })?;
            }
            t.resize(len, 0.0);
        }
        Ok(t)
    }

    /// Tensor `id` as its device storage holds it: a coded tensor's values rounded to its
    /// format, as a device's kernels round them when they store its codes.
    fn store(&mut self, id: TensorId) {
        let info = &self.plan.tensors[id];
        if info.stored != Format::F32 {
            self.tensors[id] = info.from_words(&info.to_words(&self.tensors[id]));
        }
    }

    fn ids(&self, id: TensorId) -> &[u32] {
        bytemuck::cast_slice(&self.tensors[id])
    }

    /// Runs `op` (its inputs allocated: a tensor no op has written reads as zeros, as a
    /// device's fresh buffer does). The plan is valid (`PlanBuilder::finish`) and the batch
    /// checked (`check_inputs`): lengths and ids fit.
    fn exec(&mut self, op: &Op, scalars: &[f32], stats: &mut [f64]) -> Result<()> {
        for t in op.reads_writes().0 {
            self.slot(t)?;
        }
        let t = &self.tensors;
        match *op {
            Op::Embedding { table, ids, out, c } => {
                self.tensors[out] = ops::embedding_fwd(&t[table], self.ids(ids), c);
            }
            Op::EmbeddingBwd {
                dout,
                ids,
                out,
                rows,
                c,
            } => {
                self.tensors[out] = ops::embedding_bwd(&t[dout], self.ids(ids), rows, c);
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
                let (mut y, mean, rstd) = ops::layernorm_fwd(&t[x], &t[g], &t[b], c);
                round_to(&mut y, held);
                self.tensors[out] = y;
                self.tensors[st] = mean.iter().zip(&rstd).flat_map(|(&m, &r)| [m, r]).collect();
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
                let mean: Vec<f32> = t[st].iter().step_by(2).copied().collect();
                let rstd: Vec<f32> = t[st].iter().skip(1).step_by(2).copied().collect();
                let dy = rounded(&t[dy], dy_held);
                let (mut x_grad, g_grad, b_grad) =
                    ops::layernorm_bwd(&dy, &t[x], &t[g], &mean, &rstd, c);
                // The add it took in: dx + r, held (`Op::Add`'s sum, the same operands).
                if let Some((r, held)) = sum {
                    x_grad.iter_mut().zip(&t[r]).for_each(|(d, r)| *d += r);
                    round_to(&mut x_grad, held);
                }
                self.tensors[dx] = x_grad;
                self.tensors[dg] = g_grad;
                self.tensors[db] = b_grad;
            }
            Op::Unary { f, x, out, held } => {
                let mut y = ops::unary_fwd(f, &t[x]);
                round_to(&mut y, held);
                self.tensors[out] = y;
            }
            Op::UnaryBwd {
                f,
                x,
                dy,
                out,
                held,
                dy_held,
            } => {
                let mut dx = ops::unary_bwd(f, &t[x], &rounded(&t[dy], dy_held));
                round_to(&mut dx, held);
                self.tensors[out] = dx;
            }
            Op::RmsNorm {
                x,
                g,
                out,
                stats: st,
                c,
                eps,
                held,
            } => {
                let (mut y, rstd) = ops::rmsnorm_fwd(&t[x], &t[g], c, eps);
                round_to(&mut y, held);
                self.tensors[out] = y;
                self.tensors[st] = rstd;
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
                let dy = rounded(&t[dy], dy_held);
                let (x_grad, g_grad) = ops::rmsnorm_bwd(&dy, &t[x], &t[g], &t[st], c);
                self.tensors[dx] = x_grad;
                self.tensors[dg] = g_grad;
            }
            Op::Dropout {
                x,
                out,
                p,
                seed,
                site,
                held,
            } => {
                let (step, part) = (scalars[scalar::STEP] as u32, scalars[scalar::PART] as u32);
                let mut y = if scalars[scalar::EVAL] != 0.0 {
                    t[x].clone()
                } else {
                    dropout::apply(&t[x], (step, site, part), dropout::key(seed), p)
                };
                round_to(&mut y, held);
                self.tensors[out] = y;
            }
            Op::Rotary {
                x,
                table,
                out,
                t: positions,
                c,
                d,
                inverse,
                held,
            } => {
                let mut y = rotary::apply(&t[x], &t[table], (positions, c, d), inverse);
                round_to(&mut y, held);
                self.tensors[out] = y;
            }
            Op::RowSum {
                x,
                out,
                c,
                divisor,
                held,
            } => {
                let mut y = ops::row_sums(&t[x], c, divisor as f64);
                round_to(&mut y, held);
                self.tensors[out] = y;
            }
            Op::Broadcast {
                x,
                out,
                c,
                scale,
                divisor,
                held,
            } => {
                let mut y = ops::broadcast(&t[x], c, scale, divisor);
                round_to(&mut y, held);
                self.tensors[out] = y;
            }
            Op::Mul { a, b, out, held } => {
                let mut y = ops::mul(&t[a], &t[b]);
                round_to(&mut y, held);
                self.tensors[out] = y;
            }
            // The fused loss and gradient, as `CrossEntropy`'s: the two definitions.
            Op::MseLoss {
                pred,
                target,
                grad,
                held,
            } => {
                stats[Stats::LOSS] = ops::mse_fwd(&t[pred], &t[target]);
                let dloss = scalars[scalar::DLOSS] as f64;
                let mut d = ops::mse_bwd(&t[pred], &t[target], dloss);
                round_to(&mut d, held);
                self.tensors[grad] = d;
            }
            Op::Softmax {
                x,
                out,
                t: width,
                causal,
                mask,
                scale,
                x_held,
            } => {
                let x = rounded(&t[x], x_held);
                let mask = mask.map(|m| (&t[m.mask][..], m));
                self.tensors[out] = ops::softmax_scaled_masked_fwd(&x, width, scale, causal, mask);
            }
            Op::SoftmaxBwd {
                p,
                dp,
                out,
                t: width,
                causal,
                scale,
                dp_held,
            } => {
                let dp = rounded(&t[dp], dp_held);
                self.tensors[out] = ops::softmax_scaled_bwd(&t[p], &dp, width, scale, causal);
            }
            Op::Attention {
                qkv,
                out,
                stats: st,
                ref spec,
            } => {
                let (y, row_stats) = ops::attention_fwd(&t[qkv], spec);
                self.tensors[out] = y;
                self.tensors[st] = row_stats;
            }
            Op::AttentionBwd {
                qkv,
                dout,
                delta,
                dqkv,
                ref spec,
                ..
            } => {
                let (grad, dots) = ops::attention_bwd(&t[qkv], &t[dout], spec);
                self.tensors[dqkv] = grad;
                self.tensors[delta] = dots;
            }
            // The fused loss and gradient are, by definition, the two ops they replace.
            Op::CrossEntropy {
                logits,
                targets,
                grad,
                v,
                held,
            } => {
                let (loss, probs) = ops::cross_entropy_fwd(&t[logits], self.ids(targets), v);
                stats[Stats::LOSS] = loss;
                // The definition divides by the rows itself: pass it the loss scale (over the
                // ranks).
                let dloss = scalars[scalar::DLOSS] as f64;
                let mut d = ops::cross_entropy_bwd(&probs, self.ids(targets), v, dloss);
                round_to(&mut d, held);
                self.tensors[grad] = d;
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
                let algorithm = step_algorithm(algorithm, scales, scalars);
                let mut c = matmul(shape, &algorithm, &t[a], &t[b])?;
                round_to(&mut c, held);
                self.tensors[out] = c;
            }
            Op::Round { x, format } => round_to(&mut self.tensors[x], format),
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
                let mut target = match out == y {
                    true => std::mem::take(&mut self.tensors[y]),
                    false => t[y].clone(),
                };
                round_to(&mut target, y_held);
                let src = rounded(&self.tensors[x], x_held);
                for (i, t) in target.iter_mut().enumerate() {
                    *t += src[i % src.len()];
                }
                round_to(&mut target, held);
                if let Some((r, format)) = residual {
                    target
                        .iter_mut()
                        .zip(&self.tensors[r])
                        .for_each(|(t, r)| *t += r);
                    round_to(&mut target, format);
                }
                self.tensors[out] = target;
                // The two ops it replaces: GELU reads the sum as stored.
                if let Some((g, held)) = gelu {
                    self.store(out);
                    let mut y = ops::unary_fwd(Unary::Gelu, &self.tensors[out]);
                    round_to(&mut y, held);
                    self.tensors[g] = y;
                }
            }
            Op::ColumnSums {
                x,
                out,
                c,
                x_held,
                held,
            } => {
                let mut sums = ops::column_sums(&rounded(&t[x], x_held), c);
                round_to(&mut sums, held);
                self.tensors[out] = sums;
            }
            Op::Copy { x, out, map, held } => {
                let mut target = std::mem::take(self.slot(out)?);
                map.apply(&rounded(&self.tensors[x], held), &mut target);
                self.tensors[out] = target;
            }
            Op::Amax { x, slot } => {
                let a = format::amax(t[x].iter().copied()) as f64;
                stats[slot] = stats[slot].max(a);
            }
            Op::UnscaleCheck { ref grads } => {
                for (index, &grad) in grads.iter().enumerate() {
                    let mut g = std::mem::take(&mut self.tensors[grad]);
                    if index == 0
                        && let Some(first) = g.first_mut()
                    {
                        *first += scalars[scalar::POISON];
                    }
                    let finite = ops::unscale_check(&mut g, scalars[scalar::INVERSE_SCALE]);
                    stats[self.plan.stats.flag(index)] = if finite { 0.0 } else { 1.0 };
                    stats[self.plan.stats.norm_sq(index)] =
                        g.iter().map(|&x| x as f64 * x as f64).sum();
                    self.tensors[grad] = g;
                }
            }
            Op::AdamW { ref params, held } => {
                let Some(factor) = update_factor(&self.plan.stats, stats, scalars[scalar::CLIP])
                else {
                    return Ok(());
                };
                let opt = AdamW {
                    lr: scalars[scalar::LR],
                    beta1: scalars[scalar::BETA1],
                    beta2: scalars[scalar::BETA2],
                    eps: scalars[scalar::EPS],
                    weight_decay: scalars[scalar::WEIGHT_DECAY],
                };
                let step = scalars[scalar::STEP] as u32;
                for &AdamWParam {
                    param,
                    grad,
                    m,
                    v,
                    decay,
                } in params
                {
                    let mut p = std::mem::take(&mut self.tensors[param]);
                    let mut mm = std::mem::take(&mut self.tensors[m]);
                    let mut vv = std::mem::take(&mut self.tensors[v]);
                    // Copy the gradient only where the clip scales it.
                    let g: std::borrow::Cow<[f32]> = if factor == 1.0 {
                        self.tensors[grad].as_slice().into()
                    } else {
                        self.tensors[grad].iter().map(|x| x * factor).collect()
                    };
                    ops::adamw(&opt, &mut p, &g, &mut mm, &mut vv, step, decay);
                    for x in [&mut p, &mut mm, &mut vv] {
                        round_to(x, held);
                    }
                    self.tensors[param] = p;
                    self.tensors[m] = mm;
                    self.tensors[v] = vv;
                }
            }
        }
        Ok(())
    }

    /// Runs `section`: op by op with `seconds` (the host's clock around each op goes there),
    /// else as `self.graphs` says (launched, recorded or replayed).
    async fn interpret(
        &mut self,
        section: Section,
        tokens: &[u32],
        targets: &[u32],
        scalars: &[f32],
        seconds: Option<&mut Vec<f64>>,
    ) -> Result<Vec<f64>> {
        let mut stats = self.begin(tokens, targets, scalars)?;
        if seconds.is_some() {
            let ops = self.plan.range_of(section);
            self.interpret_ops(ops, scalars, &mut stats, seconds)?;
            return Ok(stats);
        }
        self.stats = stats;
        let mut graphs = std::mem::replace(&mut self.graphs, Graphs::Off(String::new()));
        let ran = graphs.run(self, section, scalars).await;
        self.graphs = graphs;
        ran?;
        Ok(std::mem::take(&mut self.stats))
    }

    /// Checks a run's inputs and takes its batch; returns its stats, zero.
    fn begin(&mut self, tokens: &[u32], targets: &[u32], scalars: &[f32]) -> Result<Vec<f64>> {
        check_inputs(&self.plan, tokens, targets, scalars)?;
        self.tensors[self.plan.tokens] = bytemuck::cast_slice(tokens).to_vec();
        self.tensors[self.plan.targets] = bytemuck::cast_slice(targets).to_vec();
        self.scalars = scalars.to_vec();
        Ok(vec![0.0; self.plan.stats.len()])
    }

    /// Runs `ops` of the plan into `stats`.
    fn interpret_ops(
        &mut self,
        ops: std::ops::Range<usize>,
        scalars: &[f32],
        stats: &mut [f64],
        mut seconds: Option<&mut Vec<f64>>,
    ) -> Result<()> {
        for i in ops {
            let op = self.plan.ops[i].clone();
            self.run_op(i, &op, scalars, stats, seconds.as_deref_mut())?;
        }
        Ok(())
    }

    /// Runs `op` as op `i` of the plan: its writes stored as their tensors hold them, the
    /// temporaries it reads last freed.
    fn run_op(
        &mut self,
        i: usize,
        op: &Op,
        scalars: &[f32],
        stats: &mut [f64],
        seconds: Option<&mut Vec<f64>>,
    ) -> Result<()> {
        let start = web_time::Instant::now();
        self.exec(op, scalars, stats)?;
        for t in op.reads_writes().1 {
            self.store(t);
        }
        if let Some(seconds) = seconds {
            seconds.push(start.elapsed().as_secs_f64());
        }
        self.peak = self.peak.max(self.held_bytes());
        // Written whole before any read in every step: nothing to keep.
        for &t in &self.last_uses[i] {
            self.tensors[t] = Vec::new();
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl StepExecutor for HostExecutor {
    fn plan(&self) -> &Plan {
        &self.plan
    }

    fn describe(&self) -> String {
        let recorded = match self.graphs {
            Graphs::On { .. } => format!(", {}", self.graphs.describe("a recording")),
            Graphs::Off(_) => String::new(),
            Graphs::Failed(_) => format!(", {}", self.graphs.describe("a recording")),
        };
        format!("host interpreter, the reference's definition of each op{recorded}")
    }

    async fn run(
        &mut self,
        section: Section,
        tokens: &[u32],
        targets: &[u32],
        scalars: &[f32],
    ) -> Result<Vec<f64>> {
        self.interpret(section, tokens, targets, scalars, None)
            .await
    }

    async fn run_timed(
        &mut self,
        section: Section,
        tokens: &[u32],
        targets: &[u32],
        scalars: &[f32],
    ) -> Result<(Vec<f64>, Timings)> {
        let mut timings = Timings {
            first: self.plan.range_of(section).start,
            seconds: Vec::new(),
            measured_by: format!("the host's clock around each op ({})", self.describe()),
        };
        let stats = self
            .interpret(
                section,
                tokens,
                targets,
                scalars,
                Some(&mut timings.seconds),
            )
            .await?;
        Ok((stats, timings))
    }

    async fn read(&mut self, id: TensorId) -> Result<Vec<f32>> {
        tensor_len(&self.plan, id)?;
        Ok(self.slot(id)?.clone())
    }

    async fn write(&mut self, id: TensorId, values: &[f32]) -> Result<()> {
        check_write(&self.plan, id, values)?;
        self.tensors[id] = values.to_vec();
        self.store(id);
        Ok(())
    }

    fn record_sections(&mut self, on: bool) -> Result<()> {
        self.graphs.set(&self.plan, on, "not asked for")
    }

    /// The backward pass bucket by bucket (`Plan::gradient_buckets`), each bucket summed as
    /// soon as the pass is done with it. The host is this executor's device, so nothing runs
    /// meanwhile: the schedule is a wgpu plan's, without the overlap, and it checks that
    /// summing a bucket early gives the bits of summing after the pass.
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
        let mut stats = self.begin(tokens, targets, scalars)?;
        let mut reduced = sum.on_host(false);
        let mut done = 0;
        for bucket in &buckets {
            self.interpret_ops(done..bucket.ready, scalars, &mut stats, None)?;
            done = bucket.ready;
            let mut flat = Vec::new();
            for &id in &bucket.ids {
                flat.extend_from_slice(self.slot(id)?);
            }
            sum.sum_bucket(&self.plan, bucket, &mut flat, &mut reduced)?;
            let mut at = 0;
            for &id in &bucket.ids {
                let len = self.plan.tensors[id].len;
                self.write(id, &flat[at..at + len]).await?;
                at += len;
            }
        }
        let rest = done..self.plan.range_of(Section::Backward).end;
        self.interpret_ops(rest, scalars, &mut stats, None)?;
        Ok((stats, reduced))
    }

    fn memory(&self) -> Memory {
        Memory {
            plan_bytes: Storage::shared(&self.plan).bytes(),
            peak_bytes: self.peak.max(self.held_bytes()),
            measured_by: "the interpreter's tensors in host memory, summed after every op (each \
                          temporary freed after its last use)"
                .into(),
        }
    }
}

impl Recorder for HostExecutor {
    type Graph = HostGraph;

    async fn launch(&mut self, section: Section, scalars: &[f32]) -> Result<()> {
        let mut stats = std::mem::take(&mut self.stats);
        let ops = self.plan.range_of(section);
        self.interpret_ops(ops, scalars, &mut stats, None)?;
        self.stats = stats;
        Ok(())
    }

    /// The ops of `section` as launched now: a matmul's given fp8 scales, which a launch takes
    /// from the host, become part of its algorithm (`step_algorithm`).
    async fn record(
        &mut self,
        section: Section,
        scalars: &[f32],
    ) -> std::result::Result<HostGraph, String> {
        let launched = |op: &Op| {
            let mut op = op.clone();
            if let Op::Matmul {
                algorithm, scales, ..
            } = &mut op
            {
                *algorithm = step_algorithm(*algorithm, scales.take(), scalars);
            }
            op
        };
        let ops = self.plan.range_of(section);
        Ok(HostGraph(
            ops.map(|i| (i, launched(&self.plan.ops[i]))).collect(),
        ))
    }

    /// The recorded ops, reading the scalars of the step they run in.
    async fn replay(&mut self, graph: &mut HostGraph) -> Result<()> {
        let (scalars, mut stats) = (self.scalars.clone(), std::mem::take(&mut self.stats));
        let mut ran = Ok(());
        for (i, op) in &graph.0 {
            ran = self.run_op(*i, op, &scalars, &mut stats, None);
            if ran.is_err() {
                break;
            }
        }
        self.stats = stats;
        ran
    }
}

/// `x` as an op that rounds it to `format` as it reads it sees it (`Op::rounded_read`).
fn rounded(x: &[f32], format: Format) -> std::borrow::Cow<'_, [f32]> {
    if format == Format::F32 {
        return x.into();
    }
    let mut x = x.to_vec();
    round_to(&mut x, format);
    x.into()
}
