//! Recording a plan: tensors and ops pushed one by one, with the folds that merge an op into
//! the one before it where one pass does both.

use super::{Op, Plan, Stats, Strided, TensorId, TensorInfo, TensorKind, Unary};
use crate::error::Result;
use crate::format::Format;

/// Records a plan: its tensors and ops, then `finish` checks them and makes the `Plan`.
#[derive(Default)]
pub struct PlanBuilder {
    /// The tensors recorded; a `TensorId` is an index here.
    pub tensors: Vec<TensorInfo>,
    /// The ops recorded, in the order they run.
    pub ops: Vec<Op>,
    /// The values of the `Constant` tensors, set when the plan is built.
    pub constants: Vec<(TensorId, Vec<f32>)>,
}

/// What the ops of a plan are for (`PlanBuilder::finish`).
#[derive(Clone, Debug)]
pub struct Outline {
    /// `ops[..forward]` is the forward pass (to the loss and logits), `ops[..backward]` goes on
    /// to the scaled gradients, `ops[..gradients]` to the unscaled, checked gradients; the rest
    /// update the trained state.
    pub forward: usize,
    /// The end of the backward pass in `ops` (see `forward`).
    pub backward: usize,
    /// The end of the gradients' unscale and check in `ops` (see `forward`).
    pub gradients: usize,
    /// The tensors a run writes its tokens and targets into (kinds `Tokens` and `Targets`, as
    /// long as the batch has rows).
    pub tokens: TensorId,
    /// The targets' tensor (see `tokens`).
    pub targets: TensorId,
    /// The tensor the host reads after the forward pass, kept whole after it.
    pub logits: TensorId,
    /// Per parameter: (parameter, gradient, first moment, second moment).
    pub state: Vec<[TensorId; 4]>,
    /// Where the step's loss, gradient flags, squared norms and fp8 amaxes go (slots of the stats).
    pub stats: Stats,
}

impl Outline {
    /// A plan whose ops all run in every section but `Forward` (`ops[..forward]`), with no
    /// trained state: what tests and one-op plans need.
    pub fn ops_alone(
        forward: usize,
        ops: usize,
        (tokens, targets): (TensorId, TensorId),
        logits: TensorId,
    ) -> Outline {
        Outline {
            forward,
            backward: ops,
            gradients: ops,
            tokens,
            targets,
            logits,
            state: vec![],
            stats: Stats {
                grads: 0,
                linears: 0,
            },
        }
    }
}

impl PlanBuilder {
    /// A new tensor of `len` f32 values holding `kind`; stored as f32 until `Plan::store_codes`
    /// says otherwise.
    pub fn tensor(&mut self, len: usize, kind: TensorKind) -> TensorId {
        self.tensors.push(TensorInfo {
            len,
            kind,
            stored: Format::F32,
        });
        self.tensors.len() - 1
    }

    /// A new `Temp` tensor of `len` values.
    pub fn temp(&mut self, len: usize) -> TensorId {
        self.tensor(len, TensorKind::Temp)
    }

    /// A new `Constant` tensor holding `values`.
    pub fn constant(&mut self, values: Vec<f32>) -> TensorId {
        let id = self.tensor(values.len(), TensorKind::Constant);
        self.constants.push((id, values));
        id
    }

    /// Elements of tensor `id`.
    pub fn len(&self, id: TensorId) -> usize {
        self.tensors[id].len
    }

    /// The plan of the ops recorded, for `outline`'s sections, batch and state, checked once
    /// here (tensors in range, each op's lengths, stored formats, ids, sections in order: see
    /// `plan::validate`): an error names the op and its tensors.
    pub fn finish(mut self, outline: Outline) -> Result<Plan> {
        let Outline {
            mut forward,
            mut backward,
            mut gradients,
            tokens,
            targets,
            logits,
            state,
            stats,
        } = outline;
        self.fold_rounded_reads(logits, [&mut forward, &mut backward, &mut gradients]);
        self.fold_product_roundings([&mut forward, &mut backward, &mut gradients]);
        let mut plan = Plan {
            rows: self.tensors.get(tokens).map_or(0, |t| t.len),
            tensors: self.tensors,
            ops: self.ops,
            forward,
            backward,
            gradients,
            tokens,
            targets,
            logits,
            state,
            constants: self.constants,
            stats,
            ids: super::IdLimits {
                tokens: usize::MAX,
                targets: usize::MAX,
            },
            accumulated: vec![],
        };
        plan.ids = plan.validate()?;
        Ok(plan)
    }

    /// Records `op`, folding it into the op before where one pass does both with the same
    /// values: an add into y right after y's rounding rounds y as it reads it (`Op::Add`'s
    /// `y_held`); an add of r into y in place right after an in-place add into y (a residual
    /// after a bias) becomes that add's `residual`; a GELU of an in-place add's output right
    /// after it becomes that add's `gelu`; an add of r into a layer norm backward's dx right
    /// after it becomes that op's `sum` (the two gradients of the norm's input summed as dx
    /// is written).
    pub fn push(&mut self, mut op: Op) {
        if let Op::Add { x, y, y_held, .. } = &mut op
            && *y_held == Format::F32
            && *x != *y
            && let Some(&Op::Round { x: rounded, format }) = self.ops.last()
            && rounded == *y
        {
            *y_held = format;
            self.ops.pop();
        }
        if let Op::Unary { f: Unary::Gelu, x, out, held } = op
            && x != out
            && let Some(Op::Add {
                y,
                out: sum,
                residual: None,
                gelu: gelu @ None,
                ..
            }) = self.ops.last_mut()
            // In place, as the model records a bias add (`Plan::store_codes` may then give it
            // a coded output of its own).
            && *sum == x
            && *y == x
        {
            *gelu = Some((out, held));
            return;
        }
        if let Op::Add {
            x: r,
            y,
            out,
            held,
            y_held: Format::F32,
            x_held: Format::F32,
            residual: None,
            gelu: None,
        } = op
            && out == y
            && r != y
            // Not a gradient: `Plan::split_for_ranks` moves its adds one by one.
            && !matches!(self.tensors.get(y).map(|t| t.kind), Some(TensorKind::Grad(_)))
            && let Some(Op::LayerNormBwd {
                dy,
                x,
                g,
                stats,
                dx,
                dg,
                db,
                sum: sum @ None,
                ..
            }) = self.ops.last_mut()
            && *dx == y
            // r bound beside the op's own tensors (wgpu binds each buffer once per dispatch).
            && ![*dy, *x, *g, *stats, *dg, *db].contains(&r)
        {
            *sum = Some((r, held));
            return;
        }
        if let Op::Add {
            x: r,
            y,
            out,
            held: Format::F32,
            y_held: Format::F32,
            x_held: Format::F32,
            residual: None,
            gelu: None,
        } = op
            && out == y
            && r != y
            // Not a gradient: `Plan::split_for_ranks` moves its adds one by one.
            && !matches!(self.tensors.get(y).map(|t| t.kind), Some(TensorKind::Grad(_)))
            && let Some(Op::Add {
                y: before,
                out: written,
                residual: residual @ None,
                gelu: None,
                ..
            }) = self.ops.last_mut()
            && *before == y
            && *written == y
        {
            *residual = Some((r, Format::F32));
            return;
        }
        self.ops.push(op);
    }

    /// Folds each rounding of x into the next op that touches x where that op can round x as
    /// it reads it (`Op::rounded_read`: a backward pass's gradient from a matmul), or drops it
    /// where that op rounds x so by its definition (`Op::reads_rounded`), and no one
    /// else sees the rounded values: x a `Temp` that no op after reads, not the logits the host
    /// reads, the two ops in the same section (`ends`: the sections' ends in `ops`, moved with
    /// the ops). One launch and one pass over x fewer each; the same values.
    fn fold_rounded_reads(&mut self, logits: TensorId, mut ends: [&mut usize; 3]) {
        let touches = |op: &Op, x| {
            let (reads, writes) = op.reads_writes();
            reads.contains(&x) || writes.contains(&x)
        };
        let mut i = 0;
        while i < self.ops.len() {
            let Op::Round { x, format } = self.ops[i] else {
                i += 1;
                continue;
            };
            let next = (i + 1..self.ops.len()).find(|&j| touches(&self.ops[j], x));
            let fold = next.filter(|&j| {
                x != logits
                    && self
                        .tensors
                        .get(x)
                        .is_some_and(|t| t.kind == TensorKind::Temp)
                    && ends.iter().all(|end| !(i + 1..=j).contains(&**end))
                    && !self.ops[j + 1..]
                        .iter()
                        .any(|op| op.reads_writes().0.contains(&x))
            });
            let folded = fold.is_some_and(|j| {
                self.ops[j].reads_rounded(x) == Some(format)
                    || self.ops[j]
                        .rounded_read(x)
                        .filter(|held| **held == Format::F32)
                        .map(|held| *held = format)
                        .is_some()
            });
            if !folded {
                i += 1;
                continue;
            }
            self.remove_op(i, &mut ends);
        }
    }

    /// Folds each rounding of a matmul's product right after it, in the same section, into the
    /// matmul (`Op::Matmul`'s `held`: a weight gradient's rounding, which no reader took in
    /// `fold_rounded_reads`), where the backend can round as it stores (wgpu's epilogue) or
    /// launches the rounding itself (`ends` as there).
    fn fold_product_roundings(&mut self, mut ends: [&mut usize; 3]) {
        let mut i = 1;
        while i < self.ops.len() {
            let Op::Round { x, format } = self.ops[i] else {
                i += 1;
                continue;
            };
            let in_section = !ends.iter().any(|end| **end == i);
            match &mut self.ops[i - 1] {
                Op::Matmul { out, held, .. } if in_section && *out == x && *held == Format::F32 => {
                    *held = format
                }
                _ => {
                    i += 1;
                    continue;
                }
            }
            self.remove_op(i, &mut ends);
        }
    }

    /// Removes op `i`, the sections' ends after it moving with the ops.
    fn remove_op(&mut self, i: usize, ends: &mut [&mut usize; 3]) {
        self.ops.remove(i);
        for end in ends.iter_mut() {
            if **end > i {
                **end -= 1;
            }
        }
    }

    /// A strided copy of x into out (`Op::Copy`: out[map.dst(e)] = x[map.src(e)]), rounded to
    /// `held` as copied.
    pub fn copy(&mut self, x: TensorId, out: TensorId, map: Strided, held: Format) {
        self.push(Op::Copy { x, out, map, held });
    }

    /// Rounds x to `format` in place (nothing for f32, nor where the op that last wrote x left
    /// it held in `format`: `Op::holds`): the op just pushed holds its output in `format`
    /// where it wrote x and can (a layer norm, GELU, an add, the cross entropy's gradient: one
    /// pass over x instead of two), else a `Round` op follows. A matmul's product keeps its
    /// rounding as an op until `finish`: the next reader may take it as it reads, with no
    /// launch on any backend, else the matmul (`fold_product_roundings`).
    pub fn round(&mut self, x: TensorId, format: Format) {
        if format == Format::F32 {
            return;
        }
        let last_write = self
            .ops
            .iter()
            .rev()
            .find(|op| op.reads_writes().1.contains(&x));
        if last_write.and_then(|op| op.holds(x)) == Some(format) {
            return;
        }
        let last = self.ops.last_mut();
        match last
            .filter(|op| !matches!(op, Op::Matmul { .. }))
            .and_then(Op::held_output)
        {
            Some((out, held)) if out == x && *held == Format::F32 => *held = format,
            _ => self.push(Op::Round { x, format }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_add_right_after_its_input_s_rounding_rounds_it_as_it_reads() {
        let (bf16, f16) = (Format::Bf16, Format::F16);
        let mut g = PlanBuilder::default();
        let (bias, y, other) = (g.temp(4), g.temp(16), g.temp(16));
        g.push(Op::Round { x: y, format: bf16 });
        g.push(Op::add_in_place(bias, y));
        g.round(y, f16);
        assert!(matches!(
            g.ops[..],
            [Op::Add {
                x,
                y: read,
                out,
                held,
                y_held,
                x_held: Format::F32,
                residual: None,
                gelu: None,
            }] if x == bias && read == y && out == y && held == f16 && y_held == bf16
        ));
        // Not after another tensor's rounding, nor the sum of a tensor with itself.
        for (rounded, x) in [(other, bias), (y, y)] {
            let mut g = PlanBuilder::default();
            for len in [4, 16, 16] {
                g.temp(len);
            }
            g.push(Op::Round {
                x: rounded,
                format: bf16,
            });
            g.push(Op::add_in_place(x, y));
            assert!(
                matches!(g.ops[..], [Op::Round { .. }, Op::Add { y_held, .. }] if y_held == Format::F32)
            );
        }
    }

    #[test]
    fn a_rounding_folds_into_the_next_op_that_reads_it_where_no_one_else_sees_it() {
        let (bf16, f32_) = (Format::Bf16, Format::F32);
        // ops: round dy (tensor 1); an op on other tensors; GELU's backward reading dy; then
        // `after`.
        let fold = |dy_kind: TensorKind, logits_is_dy: bool, end: usize, after: Option<Op>| {
            let mut g = PlanBuilder::default();
            let (x, dy, out, a, b) = (
                g.temp(8),
                g.tensor(8, dy_kind),
                g.temp(8),
                g.temp(8),
                g.temp(8),
            );
            let gelu_bwd = Op::UnaryBwd {
                f: Unary::Gelu,
                x,
                dy,
                out,
                held: bf16,
                dy_held: f32_,
            };
            g.ops = vec![
                Op::Round {
                    x: dy,
                    format: bf16,
                },
                Op::Unary {
                    f: Unary::Gelu,
                    x: a,
                    out: b,
                    held: f32_,
                },
                gelu_bwd,
            ];
            g.ops.extend(after);
            let mut ends = [end, 3, 3];
            let [e0, e1, e2] = &mut ends;
            g.fold_rounded_reads(if logits_is_dy { dy } else { usize::MAX }, [e0, e1, e2]);
            (g.ops, ends)
        };
        let (ops, ends) = fold(TensorKind::Temp, false, 3, None);
        assert!(
            matches!(ops[..], [Op::Unary { f: Unary::Gelu, .. }, Op::UnaryBwd { f: Unary::Gelu, dy_held, .. }] if dy_held == bf16),
            "{ops:?}"
        );
        assert_eq!(ends, [2, 2, 2]);
        // Not where another op reads the rounded values after, not across a section's end, not
        // the logits or a gradient the host reads.
        // GELU of dy (tensor 1) into b.
        let reader = Op::Unary {
            f: Unary::Gelu,
            x: 1,
            out: 4,
            held: f32_,
        };
        for (kind, logits, end, after) in [
            (TensorKind::Temp, false, 3, Some(reader)),
            (TensorKind::Temp, false, 1, None),
            (TensorKind::Temp, false, 2, None),
            (TensorKind::Temp, true, 3, None),
            (TensorKind::Grad(0), false, 3, None),
        ] {
            let (ops, _) = fold(kind, logits, end, after);
            assert!(
                matches!(ops[0], Op::Round { .. }),
                "{kind:?} {logits} {end}: {ops:?}"
            );
        }
    }

    #[test]
    fn a_product_s_rounding_no_reader_takes_folds_into_the_matmul() {
        use crate::algorithm::Algorithm;
        use crate::algorithm::MatmulShape;
        let bf16 = Format::Bf16;
        // ops: dW = x^T dy; round dW (or x); then, with `reader`, GELU's backward reading dW.
        let build = |rounded: usize, reader: bool| {
            let mut g = PlanBuilder::default();
            let (x, dy, dw, out) = (g.temp(8), g.temp(8), g.temp(4), g.temp(4));
            let mut shape = MatmulShape::new(2, 2, 4);
            shape.a_transposed = true;
            g.push(Op::Matmul {
                shape,
                algorithm: Algorithm::Bf16,
                a: x,
                b: dy,
                out: dw,
                scales: None,
                held: Format::F32,
            });
            // `round` leaves a product's rounding an op for `finish`.
            g.round([dw, x][rounded], bf16);
            assert!(matches!(g.ops[..], [Op::Matmul { .. }, Op::Round { .. }]));
            if reader {
                g.push(Op::UnaryBwd {
                    f: Unary::Gelu,
                    x: dy,
                    dy: dw,
                    out,
                    held: bf16,
                    dy_held: Format::F32,
                });
            }
            g
        };
        let fold = |mut g: PlanBuilder, end: usize| {
            let n = g.ops.len();
            let mut ends = [end, n, n];
            let [e0, e1, e2] = &mut ends;
            g.fold_rounded_reads(usize::MAX, [e0, e1, e2]);
            let [e0, e1, e2] = &mut ends;
            g.fold_product_roundings([e0, e1, e2]);
            (g.ops, ends)
        };
        let (ops, ends) = fold(build(0, false), 2);
        assert!(
            matches!(ops[..], [Op::Matmul { held, .. }] if held == bf16),
            "{ops:?}"
        );
        assert_eq!(ends, [1, 1, 1]);
        // Not another tensor's rounding, nor one across a section's end.
        for (rounded, end) in [(1, 2), (0, 1)] {
            let (ops, _) = fold(build(rounded, false), end);
            assert!(
                matches!(
                    ops[..],
                    [
                        Op::Matmul {
                            held: Format::F32,
                            ..
                        },
                        Op::Round { .. }
                    ]
                ),
                "{rounded} {end}: {ops:?}"
            );
        }
        // A reader that rounds as it reads takes it first (no launch on any backend).
        let (ops, _) = fold(build(0, true), 3);
        assert!(
            matches!(ops[..], [Op::Matmul { held: Format::F32, .. }, Op::UnaryBwd { dy_held, .. }] if dy_held == bf16),
            "{ops:?}"
        );
    }

    #[test]
    fn a_rounding_to_the_format_the_attention_backward_rounds_its_dout_to_is_dropped() {
        use crate::algorithm::Algorithm;
        use crate::plan::Attention;
        for (algorithm, format, dropped) in [
            (Algorithm::Bf16, Format::Bf16, true),
            (Algorithm::Bf16, Format::F16, false),
            (Algorithm::F16, Format::F16, true),
            (Algorithm::Bf16x3, Format::Bf16, false),
            (Algorithm::F32, Format::Bf16, false),
        ] {
            let spec = Attention {
                b: 1,
                t: 2,
                h: 1,
                d: 4,
                scale: 0.5,
                algorithm,
                probs: Format::Bf16,
                compute: format,
            };
            let mut g = PlanBuilder::default();
            let (qkv, dout, stats, delta, dqkv) =
                (g.temp(24), g.temp(8), g.temp(4), g.temp(2), g.temp(24));
            g.ops = vec![
                Op::Round { x: dout, format },
                Op::AttentionBwd {
                    qkv,
                    dout,
                    stats,
                    delta,
                    dqkv,
                    spec,
                },
            ];
            let mut ends = [2, 2, 2];
            let [e0, e1, e2] = &mut ends;
            g.fold_rounded_reads(usize::MAX, [e0, e1, e2]);
            assert_eq!(g.ops.len() == 1, dropped, "{algorithm} {format}");
        }
    }

    #[test]
    fn an_add_into_a_layer_norm_backward_s_dx_right_after_it_is_that_op_s_sum() {
        let ln_bwd = |g: &mut PlanBuilder, dx_kind: TensorKind| {
            let (dy, x, gain, stats) = (g.temp(8), g.temp(8), g.temp(4), g.temp(4));
            let (dx, dg, db) = (g.tensor(8, dx_kind), g.temp(4), g.temp(4));
            let op = Op::LayerNormBwd {
                dy,
                x,
                g: gain,
                stats,
                dx,
                dg,
                db,
                c: 4,
                sum: None,
                dy_held: Format::F32,
            };
            (op, dy, dx)
        };
        let mut g = PlanBuilder::default();
        let (op, _, dx) = ln_bwd(&mut g, TensorKind::Temp);
        let r = g.temp(8);
        g.push(op);
        g.push(Op::add_in_place(r, dx));
        g.round(dx, Format::Bf16);
        assert!(
            matches!(g.ops[..], [Op::LayerNormBwd { sum: Some((s, Format::Bf16)), .. }] if s == r),
            "{:?}",
            g.ops
        );
        // Not where r is one of the op's own tensors, nor into a gradient.
        let mut g = PlanBuilder::default();
        let (op, dy, dx) = ln_bwd(&mut g, TensorKind::Temp);
        g.push(op);
        g.push(Op::add_in_place(dy, dx));
        assert_eq!(g.ops.len(), 2);
        let mut g = PlanBuilder::default();
        let (op, _, dx) = ln_bwd(&mut g, TensorKind::Grad(0));
        let r = g.temp(8);
        g.push(op);
        g.push(Op::add_in_place(r, dx));
        assert_eq!(g.ops.len(), 2);
    }

    #[test]
    fn a_residual_after_a_bias_is_one_add() {
        let (bf16, f32_) = (Format::Bf16, Format::F32);
        let mut g = PlanBuilder::default();
        let (bias, y, r) = (g.temp(4), g.temp(16), g.temp(16));
        g.push(Op::add_in_place(bias, y));
        g.round(y, bf16);
        g.push(Op::add_in_place(r, y));
        g.round(y, Format::F16);
        let [op] = &g.ops[..] else {
            panic!("{:?}", g.ops)
        };
        assert!(matches!(
            *op,
            Op::Add {
                x,
                held,
                residual: Some((res, Format::F16)),
                ..
            } if x == bias && held == bf16 && res == r
        ));
        assert_eq!(op.reads_writes(), (vec![bias, y, r], vec![y]));
        // Not into a gradient (`split_for_ranks` moves its adds one by one), nor after an add
        // that was not in place or already took a residual.
        let mut g = PlanBuilder::default();
        let (bias, dw, r) = (g.temp(4), g.tensor(16, TensorKind::Grad(0)), g.temp(16));
        g.push(Op::add_in_place(bias, dw));
        g.push(Op::add_in_place(r, dw));
        assert_eq!(g.ops.len(), 2);
        let mut g = PlanBuilder::default();
        let (bias, y, out, r) = (g.temp(4), g.temp(16), g.temp(16), g.temp(16));
        g.push(Op::Add {
            x: bias,
            y,
            out,
            held: f32_,
            y_held: f32_,
            x_held: f32_,
            residual: None,
            gelu: None,
        });
        g.push(Op::add_in_place(r, y));
        g.push(Op::add_in_place(bias, out));
        g.push(Op::add_in_place(r, out));
        g.push(Op::add_in_place(r, out));
        assert_eq!(g.ops.len(), 4, "{:?}", g.ops);
    }

    #[test]
    fn a_gelu_right_after_its_bias_add_is_that_add_s() {
        let (bf16, f16) = (Format::Bf16, Format::F16);
        let mut g = PlanBuilder::default();
        let (bias, y, act, r) = (g.temp(4), g.temp(16), g.temp(16), g.temp(16));
        g.push(Op::add_in_place(bias, y));
        g.round(y, bf16);
        g.push(Op::Unary {
            f: Unary::Gelu,
            x: y,
            out: act,
            held: Format::F32,
        });
        g.round(act, f16);
        let [op] = &g.ops[..] else {
            panic!("{:?}", g.ops)
        };
        assert!(matches!(
            *op,
            Op::Add { out, held, gelu: Some((a, f)), .. } if out == y && held == bf16 && a == act && f == f16
        ));
        assert_eq!(op.reads_writes(), (vec![bias, y], vec![y, act]));
        // A residual after it stays an add of its own (an add takes a GELU or a residual).
        g.push(Op::add_in_place(r, y));
        assert_eq!(g.ops.len(), 2, "{:?}", g.ops);
        // Not after an add with a residual, nor one into a tensor of its own, nor of another
        // tensor than the add wrote.
        let mut g = PlanBuilder::default();
        let (bias, y, act, r) = (g.temp(4), g.temp(16), g.temp(16), g.temp(16));
        let gelu = |x| Op::Unary {
            f: Unary::Gelu,
            x,
            out: act,
            held: bf16,
        };
        g.push(Op::add_in_place(bias, y));
        g.push(Op::add_in_place(r, y));
        g.push(gelu(y));
        let out = g.temp(16);
        g.push(Op::Add {
            x: bias,
            y,
            out,
            held: bf16,
            y_held: Format::F32,
            x_held: Format::F32,
            residual: None,
            gelu: None,
        });
        g.push(gelu(out));
        g.push(Op::add_in_place(bias, r));
        g.push(gelu(y));
        assert_eq!(g.ops.len(), 6, "{:?}", g.ops);
        assert!(
            g.ops
                .iter()
                .all(|op| !matches!(op, Op::Add { gelu: Some(_), .. }))
        );
    }
}
