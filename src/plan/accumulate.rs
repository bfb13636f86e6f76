//! A step over micro-batches (gradient accumulation): a rank's batch run as several backward
//! passes whose gradients are summed on the device before one update, so that a global batch
//! larger than a step's memory holds trains as the batch run whole.

use super::{Op, Plan, Section, Strided, TensorId, TensorInfo, TensorKind};
use crate::error::{Error, Result};
use crate::format::Format;

impl Plan {
    /// Makes this plan's step one of micro-batches, accumulating tensors `ids` (the gradients;
    /// in a rank's plan, the tensors its ranks sum: `split_for_ranks`) across their backward
    /// passes. Appends an accumulator per tensor and three sections after the step's ops, a
    /// multi-tensor pass each: `Section::Stash` (acc = x, after the first micro-batch's backward
    /// pass), `Section::Accumulate` (acc += x, after each later one but the last) and
    /// `Section::Gather` (x += acc, after the last one's, before the ranks' sum and
    /// `Section::Update`). Each sum is held in the format the backward pass holds x in: a "true"
    /// preset's bf16 gradient accumulates in bf16, as PyTorch's `.grad` does. With the loss of
    /// each micro-batch scaled by 1 / micro-batches (scalar `DLOSS_PER_ROW`: `StepScalars::parts`),
    /// the sum is the gradient of the whole batch's mean loss, up to the order of additions.
    pub fn accumulate(&mut self, ids: &[TensorId]) -> Result<()> {
        if !self.accumulated.is_empty() {
            return Err(Error::invalid(
                "step plan",
                "its gradients are accumulated already",
            ));
        }
        let mut pairs = Vec::with_capacity(ids.len());
        for &x in ids {
            let info = self.tensors.get(x).ok_or_else(|| {
                Error::invalid(
                    "step plan",
                    format!("tensor {x} to accumulate: it has {}", self.tensors.len()),
                )
            })?;
            let acc = self.tensors.len();
            self.tensors.push(TensorInfo {
                kind: TensorKind::Accumulator,
                ..info.clone()
            });
            pairs.push((x, acc, self.held_after_backward(x)));
        }
        let add = |x: TensorId, into: TensorId, held: Format| Op::Add {
            x,
            y: into,
            out: into,
            held,
            y_held: Format::F32,
            x_held: Format::F32,
            residual: None,
            gelu: None,
        };
        let stash = pairs.iter().map(|&(x, acc, _)| Op::Copy {
            x,
            out: acc,
            map: Strided::into_columns(1, self.tensors[x].len, (0, self.tensors[x].len)),
            held: Format::F32,
        });
        let accumulate = pairs.iter().map(|&(x, acc, held)| add(x, acc, held));
        let gather = pairs.iter().map(|&(x, acc, held)| add(acc, x, held));
        let tail: Vec<Op> = stash.chain(accumulate).chain(gather).collect();
        self.ops.extend(tail);
        self.accumulated = pairs.iter().map(|&(x, acc, _)| (x, acc)).collect();
        debug_assert_eq!(self.validate().map_err(|e| e.to_string()), Ok(self.ids));
        Ok(())
    }

    /// The tensors accumulated across micro-batches and their accumulators (`accumulate`).
    pub fn accumulated(&self) -> &[(TensorId, TensorId)] {
        &self.accumulated
    }

    /// The format `Section::Backward` leaves `t` held in: that of the last op writing it, where
    /// that op rounds it (f32 otherwise).
    fn held_after_backward(&self, t: TensorId) -> Format {
        let last = self.ops[..self.backward]
            .iter()
            .rev()
            .find(|op| op.reads_writes().1.contains(&t));
        match last {
            Some(&Op::Copy { held, .. }) => held,
            Some(op) => op.holds(t).unwrap_or(Format::F32),
            None => Format::F32,
        }
    }

    /// The ops the three accumulation sections take after the step's (`accumulate`).
    pub(super) fn accumulation_ops(&self) -> usize {
        3 * self.accumulated.len()
    }

    /// The ops of an accumulation section (`Stash`, `Accumulate`, `Gather`), None for others.
    pub(super) fn accumulation_range(&self, section: Section) -> Option<std::ops::Range<usize>> {
        let n = self.accumulated.len();
        let start = self.ops.len() - 3 * n;
        let k = match section {
            Section::Stash => 0,
            Section::Accumulate => 1,
            Section::Gather => 2,
            _ => return None,
        };
        Some(start + k * n..start + (k + 1) * n)
    }
}
