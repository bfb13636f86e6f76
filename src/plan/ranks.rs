//! A plan made a rank's plan of a data-parallel step: the gradients' finishing ops moved after
//! the ranks' sum, and the buckets the sum takes as the backward pass finishes with them.

use super::{Op, Plan, TensorId, TensorKind, exec};
use crate::error::Result;
use crate::format::Format;

/// Tensors of a data-parallel step's gradient sum that the backward pass has finished with
/// once it has run `ops[..ready]` (`Plan::gradient_buckets`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Ops the backward pass must have run (`ops[..ready]`) before the bucket is complete.
    pub ready: usize,
    /// The bucket's tensors.
    pub ids: Vec<TensorId>,
}

impl Plan {
    /// Makes this plan a rank's plan of a data-parallel step, whose ranks sum their gradients
    /// between `Section::Backward` and `Section::Update`; returns the tensors to sum. Each
    /// gradient's first write (a matmul's dW, a column sum's db) stays in the backward pass;
    /// what finishes it (its roundings, and the additions of further parts, such as the token
    /// embedding's scatter into the tied head's gradient) moves to the start of the update, and
    /// the added parts are summed with the gradients. The ranks then round their sums once, as
    /// one rank rounds its one product, so the step is the one-rank step up to the order of f32
    /// additions (PyTorch's DDP instead sums gradients already rounded per rank). A gradient
    /// finished in any other way keeps its ops where they are and is summed as it is.
    pub fn split_for_ranks(&mut self) -> Vec<TensorId> {
        self.unfold_held_gradient_sums();
        let backward = &self.ops[..self.backward];
        let mut first = vec![usize::MAX; self.tensors.len()];
        for (i, op) in backward.iter().enumerate() {
            for w in op.reads_writes().1 {
                first[w] = first[w].min(i);
            }
        }
        let is_grad = |t: TensorId| matches!(self.tensors[t].kind, TensorKind::Grad(_));
        // The ops that finish gradient g after its first write, if all are movable.
        let mut finishing = vec![false; backward.len()];
        let mut parts = vec![];
        for g in (0..self.tensors.len()).filter(|&g| is_grad(g) && first[g] != usize::MAX) {
            let later: Vec<usize> = (first[g] + 1..backward.len())
                .filter(|&i| backward[i].reads_writes().1.contains(&g))
                .collect();
            // Roundings, and parts added in (a temporary no later op of the pass touches);
            // any other op keeps the gradient's ops where they are.
            let movable = later.iter().all(|&i| {
                let part = |x: TensorId| {
                    self.tensors[x].kind == TensorKind::Temp
                        && backward[i + 1..]
                            .iter()
                            .all(|op| !op.reads_writes().0.contains(&x))
                };
                matches!(backward[i], Op::Round { .. })
                    || matches!(
                        backward[i],
                        Op::Add {
                            x,
                            y,
                            out,
                            residual: None,
                            gelu: None,
                            ..
                        } if y == g && out == g && part(x)
                    )
            });
            if movable {
                for &i in &later {
                    finishing[i] = true;
                    if let Op::Add { x, .. } = backward[i] {
                        parts.push(x);
                    }
                }
            }
        }
        let (mut kept, mut moved) = (vec![], vec![]);
        for (i, op) in self.ops.drain(..self.backward).enumerate() {
            if finishing[i] {
                moved.push(op)
            } else {
                kept.push(op)
            }
        }
        self.backward = kept.len();
        self.ops.splice(0..0, kept.into_iter().chain(moved));
        for &x in &parts {
            self.tensors[x].kind = TensorKind::Partial;
        }
        let mut sum: Vec<TensorId> = self.state.iter().map(|s| s[1]).collect();
        sum.extend(parts);
        debug_assert_eq!(self.validate().map_err(|e| e.to_string()), Ok(self.ids));
        sum
    }

    /// A column sum or a matmul holding a gradient in a 16-bit format (a linear layer's bias or
    /// weight gradient) rounds as it writes it; a rank's plan rounds the ranks' sum instead, so
    /// the rounding becomes an op of its own right after it, which `split_for_ranks` moves
    /// with the gradient's other finishing ops.
    fn unfold_held_gradient_sums(&mut self) {
        let mut i = 0;
        while i < self.backward {
            if let Op::ColumnSums { out, held, .. } | Op::Matmul { out, held, .. } =
                &mut self.ops[i]
                && *held != Format::F32
                && matches!(self.tensors[*out].kind, TensorKind::Grad(_))
            {
                let (x, format) = (*out, std::mem::replace(held, Format::F32));
                self.ops.insert(i + 1, Op::Round { x, format });
                for end in [&mut self.forward, &mut self.backward, &mut self.gradients] {
                    if *end > i {
                        *end += 1;
                    }
                }
                i += 1;
            }
            i += 1;
        }
    }

    /// Groups `ids` (the tensors a data-parallel step sums, `split_for_ranks`) into buckets of
    /// at most `elements` values, in the order the backward pass finishes with them: a tensor
    /// is ready after the last op of `Section::Backward` that reads or writes it, a bucket
    /// after its last member. The buckets come in increasing `ready`, each id in exactly one;
    /// a tensor larger than `elements` is a bucket of its own. A step may sum bucket i over the
    /// ranks, and write the sum back, while the pass runs on from `ready` (as PyTorch's DDP
    /// launches a bucket's all-reduce once its gradients are ready): no later op of the pass
    /// touches its members.
    pub fn gradient_buckets(&self, ids: &[TensorId], elements: usize) -> Result<Vec<Bucket>> {
        let mut ready = vec![0; self.tensors.len()];
        for (i, op) in self.ops[..self.backward].iter().enumerate() {
            let (reads, writes) = op.reads_writes();
            for t in reads.into_iter().chain(writes) {
                ready[t] = i + 1;
            }
        }
        let mut order = Vec::with_capacity(ids.len());
        for &id in ids {
            exec::tensor_len(self, id)?;
            order.push((ready[id], id));
        }
        // Stable: tensors ready after the same op keep the caller's order.
        order.sort_by_key(|&(r, _)| r);
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut size = 0;
        for (r, id) in order {
            let len = self.tensors[id].len;
            match buckets.last_mut() {
                Some(b) if size + len <= elements.max(1) => {
                    b.ids.push(id);
                    b.ready = r;
                    size += len;
                }
                _ => {
                    buckets.push(Bucket {
                        ready: r,
                        ids: vec![id],
                    });
                    size = len;
                }
            }
        }
        Ok(buckets)
    }
}
