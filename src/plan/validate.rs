//! A plan checked once, when `PlanBuilder::finish` makes it: tensor ids in range, every op's
//! lengths consistent with its dims, stored formats each op can read and write, ids that name
//! rows of their tables, sections in order. Every executor then runs a `Plan` without checking
//! it again; what changes from run to run (the batch, the scalars, written tensors) is checked
//! per run (`exec::check_inputs`, `exec::check_write`).

use super::{Op, Plan, TensorId, TensorKind, check_stored_operands};
use crate::error::{Error, Result};
use crate::format::Format;

/// The bounds of the ids a run may bring: tokens and targets must each be below theirs (the
/// rows of the tables they index, the classes of the loss they pick); `usize::MAX` where no op
/// reads them as ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdLimits {
    /// Rows of the tables the token ids index.
    pub tokens: usize,
    /// Classes of the loss the targets pick.
    pub targets: usize,
}

impl Plan {
    /// Checks the whole plan (see the module's header); returns the bounds of the ids a run
    /// may bring.
    pub(super) fn validate(&self) -> Result<IdLimits> {
        let n = self.tensors.len();
        let refuse = |why: String| Err(Error::invalid("step plan", why));
        for (what, id) in [
            ("tokens", self.tokens),
            ("targets", self.targets),
            ("logits", self.logits),
        ] {
            if id >= n {
                return refuse(format!("its {what} are tensor {id} of {n}"));
            }
        }
        if !(self.forward <= self.backward
            && self.backward <= self.gradients
            && self.gradients + self.accumulation_ops() <= self.ops.len())
        {
            return refuse(format!(
                "its sections end at ops {}, {} and {}, not in order within its {} ops",
                self.forward,
                self.backward,
                self.gradients,
                self.ops.len()
            ));
        }
        let (tokens, targets) = (&self.tensors[self.tokens], &self.tensors[self.targets]);
        if self.tokens == self.targets
            || tokens.kind != TensorKind::Tokens
            || targets.kind != TensorKind::Targets
            || tokens.len != self.rows
            || targets.len != self.rows
        {
            return refuse(format!(
                "its batch must be two tensors of kinds Tokens and Targets of {} values each \
                 (tensors {} {:?} of {} and {} {:?} of {})",
                self.rows,
                self.tokens,
                tokens.kind,
                tokens.len,
                self.targets,
                targets.kind,
                targets.len
            ));
        }
        for (i, ids) in self.state.iter().enumerate() {
            let kinds = [
                TensorKind::Param(i),
                TensorKind::Grad(i),
                TensorKind::Moment1(i),
                TensorKind::Moment2(i),
            ];
            let fits = ids.iter().zip(kinds).all(|(&t, kind)| {
                t < n
                    && self.tensors[t].kind == kind
                    && self.tensors[t].len == self.tensors[ids[0]].len
            });
            if !fits {
                return refuse(format!(
                    "parameter {i}'s state {ids:?} is not a parameter, its gradient and its two \
                     moments of one length"
                ));
            }
        }
        for (id, values) in &self.constants {
            match self.tensors.get(*id) {
                Some(t) if t.len == values.len() => {}
                _ => {
                    return refuse(format!(
                        "constant tensor {id} given {} values (the plan has {n} tensors)",
                        values.len()
                    ));
                }
            }
        }
        for (t, info) in self.tensors.iter().enumerate() {
            if !matches!(info.stored, Format::F32 | Format::Bf16 | Format::F16) {
                return refuse(format!(
                    "tensor {t} is stored as {}; tensors are stored as f32 or as bf16 or f16 codes",
                    info.stored
                ));
            }
        }
        let mut limits = IdLimits {
            tokens: usize::MAX,
            targets: usize::MAX,
        };
        let written: Vec<bool> = {
            let mut w = vec![false; n];
            for op in &self.ops {
                op.reads_writes()
                    .1
                    .into_iter()
                    .filter(|&t| t < n)
                    .for_each(|t| w[t] = true);
            }
            w
        };
        for (i, op) in self.ops.iter().enumerate() {
            // Nothing to unscale or update: a plan of no parameters has neither op (an
            // executor may take a list's first element as its segment's).
            let empty = match op {
                Op::UnscaleCheck { grads } => grads.is_empty(),
                Op::AdamW { params, .. } => params.is_empty(),
                _ => false,
            };
            if empty {
                return refuse(format!("op {i} ({op:?}) has no gradient to work on"));
            }
            let check = Check { plan: self, i, op };
            check.tensors()?;
            op.check_lengths(&check)?;
            check.codes()?;
            for (ids, rows) in op.id_reads(|t| self.tensors[t].len) {
                if ids == self.tokens {
                    limits.tokens = limits.tokens.min(rows);
                } else if ids == self.targets {
                    limits.targets = limits.targets.min(rows);
                } else if self.tensors[ids].kind == TensorKind::Constant && !written[ids] {
                    let values = self.constants.iter().rev().find(|(c, _)| *c == ids);
                    let out_of_range = values.and_then(|(_, v)| {
                        v.iter()
                            .map(|x| x.to_bits())
                            .find(|&id| id as usize >= rows)
                    });
                    match (values, out_of_range) {
                        (Some(_), None) => {}
                        (None, _) => {
                            return Err(
                                check.fail(format!("its ids, tensor {ids}, have no values"))
                            );
                        }
                        (Some(_), Some(bad)) => {
                            return Err(
                                check.fail(format!("id {bad} is outside a table of {rows} rows"))
                            );
                        }
                    }
                } else {
                    return Err(check.fail(format!(
                        "its ids, tensor {ids}, are neither the batch's tokens or targets nor a \
                         constant no op writes"
                    )));
                }
            }
        }
        if written[self.tokens] || written[self.targets] {
            return refuse("an op writes the batch's tokens or targets".into());
        }
        Ok(limits)
    }
}

/// The checks of op `i` of `plan` (the per-op rules are the op's: `Op::check_lengths`).
pub(super) struct Check<'p> {
    pub(super) plan: &'p Plan,
    i: usize,
    op: &'p Op,
}

impl Check<'_> {
    /// An error naming the op.
    pub(super) fn fail(&self, why: String) -> Error {
        Error::invalid(
            "step plan",
            format!("op {} ({}): {why}", self.i, self.op.name()),
        )
    }

    pub(super) fn len(&self, t: TensorId) -> usize {
        self.plan.tensors[t].len
    }

    /// Tensor `t` (`what` of the op) holds `expected` values.
    pub(super) fn holds(&self, what: &str, t: TensorId, expected: usize) -> Result<()> {
        match self.len(t) {
            got if got == expected => Ok(()),
            got => Err(self.fail(format!(
                "{what} (tensor {t}) has {got} values, expected {expected}"
            ))),
        }
    }

    /// The rows of `t` (`what` of the op) as rows of `width` (named `dim`).
    pub(super) fn rows(
        &self,
        what: &str,
        t: TensorId,
        (dim, width): (&str, usize),
    ) -> Result<usize> {
        let len = self.len(t);
        if width == 0 || !len.is_multiple_of(width) {
            return Err(self.fail(format!(
                "{what} (tensor {t}) has {len} values, not rows of {dim} = {width}"
            )));
        }
        Ok(len / width)
    }

    /// Every tensor id in range; a tensor written once by the op, and read by it as well only
    /// where the op updates it in place (then read once).
    fn tensors(&self) -> Result<()> {
        let n = self.plan.tensors.len();
        let (reads, writes) = self.op.reads_writes();
        if let Some(&t) = reads.iter().chain(&writes).find(|&&t| t >= n) {
            return Err(self.fail(format!("tensor {t} is not one of the plan's {n}")));
        }
        let updated = self.op.updated_in_place();
        for (k, &t) in writes.iter().enumerate() {
            let read = reads.iter().filter(|&&r| r == t).count();
            if writes[..k].contains(&t) || read > usize::from(updated.contains(&t)) {
                return Err(self.fail(format!(
                    "tensor {t} is both written and read, or written twice"
                )));
            }
        }
        Ok(())
    }

    /// A tensor stored as 16-bit codes is read only where the op decodes it (`Op::decodes`,
    /// a matmul whose algorithm rounds to its format: `check_stored_operands`) and written
    /// only by an op that holds its output in that format and stores codes
    /// (`Op::coded_output`).
    fn codes(&self) -> Result<()> {
        let tensors = &self.plan.tensors;
        let coded = |t: TensorId| tensors[t].stored != Format::F32;
        let (reads, writes) = self.op.reads_writes();
        for t in reads.into_iter().filter(|&t| coded(t)) {
            // A matmul reads its operands as codes where its algorithm rounds to their format;
            // every other op decodes its coded input alone.
            let readable = if let Op::Matmul {
                algorithm, a, b, ..
            } = self.op
            {
                check_stored_operands(algorithm, [*a, *b].map(|t| tensors[t].stored)).is_ok()
            } else {
                self.op.decodes(t)
            };
            if !readable {
                return Err(self.fail(format!(
                    "it does not read tensor {t} stored as {} codes",
                    tensors[t].stored
                )));
            }
        }
        for t in writes.into_iter().filter(|&t| coded(t)) {
            if !self.op.coded_output(t, tensors[t].stored) {
                return Err(self.fail(format!(
                    "it does not write tensor {t} as {} codes",
                    tensors[t].stored
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Algorithm, MatmulShape};
    use crate::plan::{AdamWParam, Outline, PlanBuilder, ScoreScale, Strided, Unary};

    /// The plan of `ops` on tensors of these lengths (and kinds; `Temp` where not given), with
    /// a batch of `rows` tokens and targets after them.
    fn plan_of(lens: &[usize], rows: usize, ops: Vec<Op>) -> Result<Plan> {
        let mut g = PlanBuilder::default();
        for &len in lens {
            g.temp(len);
        }
        let batch = (
            g.tensor(rows, TensorKind::Tokens),
            g.tensor(rows, TensorKind::Targets),
        );
        g.ops = ops;
        let n = g.ops.len();
        g.finish(Outline::ops_alone(n, n, batch, 0))
    }

    /// `ops` on tensors of `lens` are refused with an error naming `name` and saying `why`.
    fn refused(lens: &[usize], ops: Vec<Op>, name: &str, why: &str) {
        let err = match plan_of(lens, 2, ops) {
            Ok(_) => panic!("{name} ({why}) accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(name) && err.contains(why), "{err}");
    }

    #[test]
    fn plans_refuse_ops_whose_tensors_do_not_fit() {
        let norm_of = |c, g, b, stats| Op::LayerNorm {
            x: 0,
            g,
            b,
            out: 1,
            stats,
            c,
            held: Format::F32,
        };
        let norm = |g, b, stats| norm_of(4, g, b, stats);
        // x and the output 12 (3 rows of 4), gain and bias 4 or 3, stats 6 or 5.
        let lens = [12, 12, 4, 4, 6, 3, 5];
        assert!(plan_of(&lens, 2, vec![norm(2, 3, 4)]).is_ok());
        refused(
            &lens,
            vec![norm(5, 3, 4)],
            "layer norm",
            "the gain (tensor 5) has 3 values, expected 4",
        );
        refused(&lens, vec![norm(2, 3, 6)], "layer norm", "expected 6");
        refused(
            &lens,
            vec![norm_of(5, 2, 3, 4)],
            "layer norm",
            "not rows of c = 5",
        );
        let bwd = |stats| Op::LayerNormBwd {
            dy: 0,
            x: 1,
            g: 2,
            stats,
            dx: 7,
            dg: 8,
            db: 3,
            c: 4,
            dy_held: Format::F32,
            sum: None,
        };
        let lens = [12, 12, 4, 4, 6, 3, 5, 12, 4];
        assert!(plan_of(&lens, 2, vec![bwd(4)]).is_ok());
        refused(
            &lens,
            vec![bwd(6)],
            "layer norm backward",
            "(mean, rstd) pairs (tensor 6) has 5 values",
        );
        refused(
            &[12, 5, 12],
            vec![Op::UnaryBwd {
                f: Unary::Gelu,
                x: 0,
                dy: 1,
                out: 2,
                held: Format::F32,
                dy_held: Format::F32,
            }],
            "gelu backward",
            "dy (tensor 1) has 5 values",
        );
        refused(
            &[8, 7, 8],
            vec![Op::SoftmaxBwd {
                p: 0,
                dp: 1,
                out: 2,
                t: 2,
                causal: true,
                scale: ScoreScale {
                    scale: 1.0,
                    held: Format::F32,
                },
                dp_held: Format::F32,
            }],
            "causal softmax backward",
            "has 7 values",
        );
        refused(
            &[12, 12],
            vec![Op::CrossEntropy {
                logits: 0,
                targets: 3,
                grad: 1,
                v: 4,
                held: Format::F32,
            }],
            "cross entropy",
            "the targets (tensor 3) has 2 values, expected 3",
        );
        refused(
            &[12, 12, 11, 12],
            vec![Op::AdamW {
                params: vec![AdamWParam {
                    param: 0,
                    grad: 1,
                    m: 2,
                    v: 3,
                    decay: true,
                }],
                held: crate::format::Format::F32,
            }],
            "adamw",
            "the first moment (tensor 2) has 11 values",
        );
        // Two ids (the batch's tokens, tensor 2) of rows of 3.
        refused(
            &[5, 9],
            vec![Op::EmbeddingBwd {
                dout: 0,
                ids: 2,
                out: 1,
                rows: 3,
                c: 3,
            }],
            "embedding backward",
            "the output's gradient (tensor 0) has 5 values, expected 6",
        );
        refused(
            &[16, 16, 16],
            vec![Op::Matmul {
                shape: MatmulShape::new(4, 4, 3),
                algorithm: Algorithm::F32,
                a: 0,
                b: 1,
                out: 2,
                scales: None,
                held: crate::format::Format::F32,
            }],
            "matmul",
            "operand A",
        );
        refused(
            &[16, 16, 16],
            vec![Op::Matmul {
                shape: MatmulShape::new(4, 4, 4),
                algorithm: Algorithm::F32,
                a: 0,
                b: 1,
                out: 2,
                scales: Some([0, 99]),
                held: crate::format::Format::F32,
            }],
            "matmul",
            "scalar slots",
        );
        refused(
            &[3, 16],
            vec![Op::add_in_place(0, 1)],
            "add",
            "do not repeat",
        );
        let add = |residual, gelu, out| Op::Add {
            x: 0,
            y: 1,
            out,
            held: Format::F32,
            y_held: Format::F32,
            x_held: Format::F32,
            residual,
            gelu,
        };
        let lens = [4, 16, 16, 16];
        assert!(plan_of(&lens, 2, vec![add(Some((2, Format::F32)), None, 1)]).is_ok());
        let both = add(Some((2, Format::F32)), Some((3, Format::F32)), 1);
        refused(&lens, vec![both], "add", "a residual or a GELU, not both");
        refused(
            &lens,
            vec![add(Some((2, Format::F32)), None, 3)],
            "add",
            "writes in place",
        );
        refused(
            &lens,
            vec![add(None, Some((2, Format::F32)), 3)],
            "add",
            "writes in place or into a coded tensor",
        );
        refused(
            &[4, 16],
            vec![Op::add_in_place(1, 1)],
            "add",
            "both written and read",
        );
        let map = Strided {
            dims: [1, 1, 2, 3],
            src: [0, 0, 3, 1],
            dst: [0, 0, 3, 1],
            src_offset: 1,
            dst_offset: 0,
        };
        assert!(
            plan_of(
                &[7, 6],
                2,
                vec![Op::Copy {
                    x: 0,
                    out: 1,
                    map,
                    held: Format::F32
                }]
            )
            .is_ok()
        );
        refused(
            &[6, 6],
            vec![Op::Copy {
                x: 0,
                out: 1,
                map,
                held: Format::F32,
            }],
            "strided copy",
            "element 6 of x",
        );
        refused(
            &[4],
            vec![Op::Amax { x: 0, slot: 1 }],
            "amax",
            "stats slot 1 of 1",
        );
        refused(
            &[4],
            vec![Op::UnscaleCheck { grads: vec![0] }],
            "unscale",
            "1 gradients, the stats hold 0",
        );
        refused(
            &[4],
            vec![Op::Unary {
                f: Unary::Gelu,
                x: 0,
                out: 9,
                held: Format::F32,
            }],
            "gelu",
            "tensor 9 is not one of the plan's 3",
        );
    }

    #[test]
    fn plans_refuse_model_ops_whose_tensors_do_not_fit() {
        let rms = |g, stats, eps| Op::RmsNorm {
            x: 0,
            g,
            out: 1,
            stats,
            c: 4,
            eps,
            held: Format::F32,
        };
        // x and the output 12 (3 rows of 4), gain 4 or 3, rstd 3 or 6.
        let lens = [12, 12, 4, 3, 3, 6];
        assert!(plan_of(&lens, 2, vec![rms(2, 4, 1e-6)]).is_ok());
        refused(
            &lens,
            vec![rms(3, 4, 1e-6)],
            "rms norm",
            "the gain (tensor 3) has 3 values, expected 4",
        );
        refused(
            &lens,
            vec![rms(2, 5, 1e-6)],
            "rms norm",
            "the rstd of each row (tensor 5) has 6 values, expected 3",
        );
        refused(&lens, vec![rms(2, 4, -1.0)], "rms norm", "eps -1");
        refused(&lens, vec![rms(2, 4, f32::NAN)], "rms norm", "eps NaN");
        let bwd = |dg| Op::RmsNormBwd {
            dy: 0,
            x: 1,
            g: 2,
            stats: 4,
            dx: 3,
            dg,
            c: 4,
            dy_held: Format::F32,
        };
        let lens = [12, 12, 4, 12, 3, 4, 5];
        assert!(plan_of(&lens, 2, vec![bwd(5)]).is_ok());
        refused(&lens, vec![bwd(6)], "rms norm backward", "gain's gradient");
        let mul = |b| Op::Mul {
            a: 0,
            b,
            out: 2,
            held: Format::F32,
        };
        let lens = [6, 6, 6, 5];
        assert!(plan_of(&lens, 2, vec![mul(1)]).is_ok());
        refused(
            &lens,
            vec![mul(3)],
            "mul",
            "b (tensor 3) has 5 values, expected 6",
        );
        refused(
            &[5, 4],
            vec![Op::Unary {
                f: Unary::Silu,
                x: 0,
                out: 1,
                held: Format::F32,
            }],
            "silu",
            "the output (tensor 1) has 4 values, expected 5",
        );
        let mse = |pred, target| Op::MseLoss {
            pred,
            target,
            grad: 2,
            held: Format::F32,
        };
        // The batch (2 rows) may hold the targets; an empty prediction has no mean.
        let lens = [2, 3, 2, 0];
        assert!(plan_of(&lens, 2, vec![mse(0, 5)]).is_ok());
        refused(&lens, vec![mse(0, 1)], "mean squared error", "the targets");
        refused(&lens, vec![mse(3, 1)], "mean squared error", "are empty");
    }

    #[test]
    fn plans_refuse_ids_outside_their_tables_and_codes_no_op_reads() {
        let embedding = |table, ids| Op::Embedding {
            table,
            ids,
            out: 1,
            c: 2,
        };
        // Ids must be the batch's or a constant's; a constant's name rows of the table.
        refused(
            &[6, 4, 2],
            vec![embedding(0, 2)],
            "embedding",
            "neither the batch's",
        );
        let mut g = PlanBuilder::default();
        let (table, out) = (g.temp(6), g.temp(4));
        let ids = g.constant(vec![f32::from_bits(1), f32::from_bits(3)]);
        let batch = (
            g.tensor(2, TensorKind::Tokens),
            g.tensor(2, TensorKind::Targets),
        );
        g.push(embedding(table, ids));
        let err = g
            .finish(Outline::ops_alone(1, 1, batch, out))
            .unwrap_err()
            .to_string();
        assert!(err.contains("id 3 is outside a table of 3 rows"), "{err}");
        // The batch's ids are bounded per run by the tables they index.
        let plan = plan_of(&[6, 4], 2, vec![embedding(0, 2)]).unwrap();
        assert_eq!((plan.ids.tokens, plan.ids.targets), (3, usize::MAX));
        // An op writing the batch.
        let round = Op::Round {
            x: 2,
            format: Format::Bf16,
        };
        refused(
            &[6, 4],
            vec![round, embedding(0, 2)],
            "",
            "writes the batch",
        );
        // A coded tensor read by an op that reads f32, or written by one that stores f32.
        let mut g = PlanBuilder::default();
        let (x, y) = (g.temp(4), g.temp(4));
        g.tensors[x].stored = Format::Bf16;
        let batch = (
            g.tensor(2, TensorKind::Tokens),
            g.tensor(2, TensorKind::Targets),
        );
        g.push(Op::Softmax {
            x,
            out: y,
            t: 2,
            causal: true,
            mask: None,
            scale: ScoreScale {
                scale: 1.0,
                held: Format::F32,
            },
            x_held: Format::F32,
        });
        let err = g
            .finish(Outline::ops_alone(1, 1, batch, y))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("does not read tensor 0 stored as bf16 codes"),
            "{err}"
        );
        let mut g = PlanBuilder::default();
        let (x, y) = (g.temp(4), g.temp(4));
        g.tensors[y].stored = Format::F16;
        let batch = (
            g.tensor(2, TensorKind::Tokens),
            g.tensor(2, TensorKind::Targets),
        );
        g.push(Op::Unary {
            f: Unary::Gelu,
            x,
            out: y,
            held: Format::Bf16,
        });
        let err = g
            .finish(Outline::ops_alone(1, 1, batch, y))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("does not write tensor 1 as f16 codes"),
            "{err}"
        );
    }

    #[test]
    fn plans_refuse_sections_out_of_order_and_a_batch_of_other_kinds() {
        let mut g = PlanBuilder::default();
        let x = g.temp(4);
        let batch = (
            g.tensor(2, TensorKind::Tokens),
            g.tensor(2, TensorKind::Targets),
        );
        g.push(Op::Round {
            x,
            format: Format::Bf16,
        });
        let err = g
            .finish(Outline::ops_alone(2, 1, batch, x))
            .unwrap_err()
            .to_string();
        assert!(err.contains("not in order"), "{err}");
        let mut g = PlanBuilder::default();
        let x = g.temp(4);
        let tokens = g.tensor(2, TensorKind::Tokens);
        let err = g
            .finish(Outline::ops_alone(0, 0, (tokens, x), x))
            .unwrap_err()
            .to_string();
        assert!(err.contains("kinds Tokens and Targets"), "{err}");
    }
}
