//! 16-bit codes: which tensors a plan stores as bf16 or f16 codes rather than f32 (half the
//! bytes, and the matmuls that round to that format read them without encoding), and which
//! operands a matmul can read so stored.

use super::{Op, Plan, TensorId, TensorInfo, TensorKind};
use crate::algorithm::Algorithm;
use crate::format::Format;

/// The 16-bit format a matmul under `algorithm` rounds both its operands to, and so reads as
/// stored codes of (`Plan::store_codes`): bf16 for `Algorithm::Bf16`, f16 for `Algorithm::F16`,
/// None for every other algorithm.
pub fn codes_read_by(algorithm: &Algorithm) -> Option<Format> {
    match algorithm {
        Algorithm::Bf16 => Some(Format::Bf16),
        Algorithm::F16 => Some(Format::F16),
        _ => None,
    }
}

/// Checks that a matmul under `algorithm` can read operands stored as `stored` (each f32, or
/// the codes `codes_read_by` names): what every executor checks before it hands codes to a
/// GEMM.
pub fn check_stored_operands(
    algorithm: &Algorithm,
    stored: [Format; 2],
) -> crate::error::Result<()> {
    let readable = |f: Format| f == Format::F32 || Some(f) == codes_read_by(algorithm);
    if stored.iter().all(|&f| readable(f)) {
        return Ok(());
    }
    Err(crate::error::Error::invalid(
        "matmul operands",
        format!("{algorithm} does not read operands stored as {stored:?}"),
    ))
}

impl Plan {
    /// Stores as 16-bit codes (`TensorInfo::stored`) the pre-GELU activations and fused
    /// attention's q|k|v that a bias add holds in bf16 or f16 (`store_bias_adds_as_codes`), and
    /// each temporary written by one layer norm, RMS norm, unary function (a bias add's GELU
    /// included), elementwise product or fused attention and read only by matmuls that round it to bf16,
    /// or only by matmuls that round it to f16 (`Algorithm::Bf16`, `Algorithm::F16`): its
    /// writer rounds it as it stores (its `held` becomes that format; attention must hold its
    /// output in it already), so the matmuls read the values they would have rounded from half
    /// the bytes, and need not encode them. The writer must hold its output in f32 or in that
    /// same format (one rounding either way). A norm's rows, and attention's heads, must be of
    /// even width, so that no 4-byte word spans two of them (wgpu stores each one's words
    /// whole). Returns the tensors so stored.
    pub fn store_codes(&mut self) -> Vec<TensorId> {
        let n = self.tensors.len();
        let (mut writers, mut readers) = (vec![vec![]; n], vec![vec![]; n]);
        for (i, op) in self.ops.iter().enumerate() {
            let (reads, writes) = op.reads_writes();
            for t in reads {
                readers[t].push(i);
            }
            for t in writes {
                writers[t].push(i);
            }
        }
        // What a reader rounds to as it reads: a matmul under an algorithm that rounds both
        // operands to 16 bits; no other op (it reads f32, or decodes: `Op::decodes`).
        let rounds_to = |op: &Op| {
            let Op::Matmul {
                algorithm,
                scales: None,
                ..
            } = op
            else {
                return None;
            };
            codes_read_by(algorithm)
        };
        let mut coded = vec![];
        for t in 0..n {
            if self.tensors[t].kind != TensorKind::Temp || t == self.logits {
                continue;
            }
            let [w] = writers[t][..] else { continue };
            let Some(&first) = readers[t].first() else {
                continue;
            };
            let Some(format) = rounds_to(&self.ops[first]) else {
                continue;
            };
            if !readers[t]
                .iter()
                .all(|&i| rounds_to(&self.ops[i]) == Some(format))
            {
                continue;
            }
            // Its writer rounds as it stores, once (it holds the output in f32 or in this
            // format already; attention holds it in its compute format), and stores codes.
            let mut writer = self.ops[w].clone();
            let once = match writer.held_output() {
                Some((out, held)) if out == t => {
                    let once = *held == Format::F32 || *held == format;
                    *held = format;
                    once
                }
                _ => true,
            };
            if !once || !writer.coded_output(t, format) {
                continue;
            }
            self.ops[w] = writer;
            self.tensors[t].stored = format;
            coded.push(t);
        }
        coded.extend(self.store_bias_adds_as_codes());
        debug_assert_eq!(self.validate().map_err(|e| e.to_string()), Ok(self.ids));
        coded
    }

    /// The second rule of `store_codes`: a temporary y that an in-place bias add holding bf16
    /// or f16 writes last, and that after it only ops that decode codes read (a unary function
    /// and its backward: the MLP's pre-activations; fused attention forward and backward: the
    /// q|k|v projection; all held until the backward pass), gets a coded twin: the add writes
    /// its output as codes into a new temporary, which those readers read instead, while y,
    /// the matmul's f32 product the add reads, dies at the add. The values are the add's held
    /// values either way. Returns the new tensors.
    fn store_bias_adds_as_codes(&mut self) -> Vec<TensorId> {
        let mut coded = vec![];
        for a in 0..self.ops.len() {
            let Op::Add {
                y,
                out,
                held,
                residual: None,
                ..
            } = self.ops[a]
            else {
                continue;
            };
            let candidate = out == y
                && matches!(held, Format::Bf16 | Format::F16)
                && self.tensors[y].kind == TensorKind::Temp
                && self.tensors[y].stored == Format::F32
                && y != self.logits;
            if !candidate {
                continue;
            }
            let later = &self.ops[a + 1..];
            // Every later op reads y, if at all, as its input that may be coded, and touches
            // it no other way.
            let decodes = |op: &Op| {
                op.operands()
                    .iter()
                    .filter(|o| o.tensor == y)
                    .all(|o| matches!(o.read, Some(super::op::Read::Decoded)) && o.write.is_none())
            };
            let read_later = later.iter().any(|op| op.reads_writes().0.contains(&y));
            if !read_later || !later.iter().all(decodes) {
                continue;
            }
            let twin = self.tensors.len();
            self.tensors.push(TensorInfo {
                len: self.tensors[y].len,
                kind: TensorKind::Temp,
                stored: held,
            });
            if let Op::Add { out, .. } = &mut self.ops[a] {
                *out = twin;
            }
            // Each later op names y, if at all, as its coded input (`decodes`).
            for op in &mut self.ops[a + 1..] {
                *op = op.map_tensors(|t| if t == y { twin } else { t });
            }
            debug_assert!(
                self.ops[a + 1..]
                    .iter()
                    .all(|op| !op.reads_writes().0.contains(&y))
            );
            coded.push(twin);
        }
        coded
    }

    /// How many tensors the plan stores as 16-bit codes (`store_codes`).
    pub fn coded_tensors(&self) -> usize {
        let coded = self.tensors.iter().filter(|t| t.stored != Format::F32);
        coded.count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::MatmulShape;
    use crate::plan::{Outline, PlanBuilder, Storage, Unary};

    /// A layer norm of width `c` (output held in `held`) read by a matmul under `algorithm`,
    /// and by `extra` if given: (plan, the norm's output).
    fn norm_then_matmul(
        c: usize,
        held: Format,
        algorithm: Algorithm,
        extra: bool,
    ) -> (Plan, TensorId) {
        let mut g = PlanBuilder::default();
        let rows = 3;
        let x = g.constant(vec![0.25; rows * c]);
        let (gain, bias) = (g.constant(vec![1.0; c]), g.constant(vec![0.0; c]));
        let (out, stats, w) = (
            g.temp(rows * c),
            g.temp(2 * rows),
            g.constant(vec![0.5; c * 2]),
        );
        let y = g.temp(rows * 2);
        g.push(Op::LayerNorm {
            x,
            g: gain,
            b: bias,
            out,
            stats,
            c,
            held,
        });
        let shape = MatmulShape::new(rows, 2, c);
        g.push(Op::Matmul {
            shape,
            algorithm,
            a: out,
            b: w,
            out: y,
            scales: None,
            held: crate::format::Format::F32,
        });
        if extra {
            g.push(Op::Amax { x: out, slot: 0 });
        }
        let batch = (
            g.tensor(rows, TensorKind::Tokens),
            g.tensor(rows, TensorKind::Targets),
        );
        let plan = g.finish(Outline::ops_alone(0, 0, batch, y)).unwrap();
        (plan, out)
    }

    #[test]
    fn codes_only_where_every_reader_rounds_to_them() {
        let (f32_, bf16, f16) = (Format::F32, Format::Bf16, Format::F16);
        for (c, held, algorithm, extra, coded) in [
            (4, f32_, Algorithm::Bf16, false, Some(bf16)),
            (4, f16, Algorithm::F16, false, Some(f16)),
            // Held in f16, read as bf16: two roundings, not one.
            (4, f16, Algorithm::Bf16, false, None),
            (4, f32_, Algorithm::F32, false, None),
            (4, f32_, Algorithm::Tf32, false, None),
            (4, f32_, Algorithm::Bf16x3, false, None),
            // A reader other than a matmul reads f32.
            (4, f32_, Algorithm::Bf16, true, None),
            // Rows of odd width would share words.
            (5, f32_, Algorithm::Bf16, false, None),
        ] {
            let (mut plan, out) = norm_then_matmul(c, held, algorithm, extra);
            let bytes = Storage::shared(&plan).bytes();
            let stored = plan.store_codes();
            let case = format!("width {c}, held {held}, read by {algorithm}, extra reader {extra}");
            match coded {
                Some(format) => {
                    assert_eq!(stored, vec![out], "{case}");
                    assert_eq!(plan.tensors[out].stored, format, "{case}");
                    assert!(matches!(plan.ops[0], Op::LayerNorm { held, .. } if held == format));
                    assert_eq!(
                        Storage::shared(&plan).bytes(),
                        bytes - 3 * c as u64 * 2,
                        "{case}"
                    );
                }
                None => {
                    assert!(stored.is_empty(), "{case}");
                    assert!(matches!(plan.ops[0], Op::LayerNorm { held: h, .. } if h == held));
                }
            }
        }
    }

    /// A matmul's product y, a bias added into it in place (held in `held`), then GELU (folded
    /// into the add: it writes the activation, tensor 4, too) and its backward reading y, and
    /// `extra` besides (a reader or writer of y that does not decode codes). y is tensor 3, the
    /// add op 1.
    fn bias_add_then_gelu(held: Format, extra: Option<fn(TensorId, TensorId) -> Op>) -> Plan {
        let mut g = PlanBuilder::default();
        let (rows, c) = (3, 4);
        let x = g.constant(vec![0.25; rows * c]);
        let (w, bias) = (g.constant(vec![0.5; c * c]), g.constant(vec![0.1; c]));
        let (y, act, dx) = (g.temp(rows * c), g.temp(rows * c), g.temp(rows * c));
        g.push(Op::Matmul {
            shape: MatmulShape::new(rows, c, c),
            algorithm: Algorithm::Bf16,
            a: x,
            b: w,
            out: y,
            scales: None,
            held: crate::format::Format::F32,
        });
        g.push(Op::add_in_place(bias, y));
        g.round(y, held);
        g.push(Op::Unary {
            f: Unary::Gelu,
            x: y,
            out: act,
            held,
        });
        assert!(matches!(
            g.ops[..],
            [_, Op::Add { gelu: Some((a, h)), .. }] if a == act && h == held
        ));
        if let Some(extra) = extra {
            g.push(extra(y, dx));
        }
        g.push(Op::UnaryBwd {
            f: Unary::Gelu,
            x: y,
            dy: act,
            out: dx,
            held: Format::F32,
            dy_held: Format::F32,
        });
        let ops = g.ops.len();
        let batch = (
            g.tensor(rows, TensorKind::Tokens),
            g.tensor(rows, TensorKind::Targets),
        );
        g.finish(Outline::ops_alone(2, ops, batch, dx)).unwrap()
    }

    #[test]
    fn pre_gelu_codes_only_where_only_gelu_reads_them() {
        let amax: fn(TensorId, TensorId) -> Op = |y, _| Op::Amax { x: y, slot: 0 };
        let overwrite: fn(TensorId, TensorId) -> Op = |y, _| Op::Round {
            x: y,
            format: Format::F16,
        };
        for (held, extra, coded) in [
            (Format::Bf16, None, true),
            (Format::F16, None, true),
            // Not rounded: codes would not hold the values.
            (Format::F32, None, false),
            (Format::Bf16, Some(amax), false),
            (Format::Bf16, Some(overwrite), false),
        ] {
            let mut plan = bias_add_then_gelu(held, extra);
            let y = 3;
            let bytes = Storage::shared(&plan).bytes();
            let stored = plan.store_codes();
            let case = format!("held {held}, extra op {}", extra.is_some());
            if !coded {
                assert!(stored.is_empty(), "{case}: {stored:?}");
                assert!(
                    matches!(plan.ops[1], Op::Add { out, .. } if out == y),
                    "{case}"
                );
                continue;
            }
            let twin = plan.tensors.len() - 1;
            assert_eq!(stored, vec![twin], "{case}");
            assert_eq!(plan.tensors[twin].stored, held, "{case}");
            assert!(matches!(
                plan.ops[1],
                Op::Add { y: from, out, gelu: Some((4, _)), .. } if from == y && out == twin
            ));
            assert!(
                matches!(plan.ops[2], Op::UnaryBwd { f: Unary::Gelu, x, .. } if x == twin),
                "{case}"
            );
            // y lives from the matmul to the add alone now; its twin adds at most its own
            // bytes, half of y's.
            assert_eq!(plan.temporary_lives()[y], Some((0, 1)), "{case}");
            assert!(Storage::shared(&plan).bytes() <= bytes + 12 * 2, "{case}");
        }
    }

    /// A SwiGLU block's RMS norm output and product, read only by bf16 matmuls, are stored as
    /// their codes (their writers holding bf16); SiLU's output, which the product reads as
    /// f32, is not.
    #[test]
    fn rms_norm_and_product_outputs_store_codes_for_16_bit_matmuls() {
        let mut g = PlanBuilder::default();
        let (rows, c) = (3, 4);
        let x = g.constant(vec![0.5; rows * c]);
        let (gain, w) = (g.constant(vec![1.0; c]), g.constant(vec![0.25; c * c]));
        let [normed, gate, up, act, prod, out] = [0; 6].map(|_| g.temp(rows * c));
        let rstd = g.temp(rows);
        let matmul = |a, out| Op::Matmul {
            shape: MatmulShape::new(rows, c, c),
            algorithm: Algorithm::Bf16,
            a,
            b: w,
            out,
            scales: None,
            held: crate::format::Format::F32,
        };
        g.push(Op::RmsNorm {
            x,
            g: gain,
            out: normed,
            stats: rstd,
            c,
            eps: 1e-6,
            held: Format::F32,
        });
        g.push(matmul(normed, gate));
        g.push(matmul(normed, up));
        g.push(Op::Unary {
            f: Unary::Silu,
            x: gate,
            out: act,
            held: Format::F32,
        });
        g.push(Op::Mul {
            a: act,
            b: up,
            out: prod,
            held: Format::F32,
        });
        g.push(matmul(prod, out));
        let batch = (
            g.tensor(rows, TensorKind::Tokens),
            g.tensor(rows, TensorKind::Targets),
        );
        let mut plan = g.finish(Outline::ops_alone(6, 6, batch, out)).unwrap();
        assert_eq!(plan.store_codes(), vec![normed, prod]);
        assert!(matches!(
            plan.ops[0],
            Op::RmsNorm {
                held: Format::Bf16,
                ..
            }
        ));
        assert!(matches!(
            plan.ops[3],
            Op::Unary {
                f: Unary::Silu,
                held: Format::F32,
                ..
            }
        ));
        assert!(matches!(
            plan.ops[4],
            Op::Mul {
                held: Format::Bf16,
                ..
            }
        ));
    }

    #[test]
    fn executors_refuse_codes_their_matmul_would_not_read() {
        let (f32_, bf16, f16) = (Format::F32, Format::Bf16, Format::F16);
        assert!(check_stored_operands(&Algorithm::Bf16, [bf16, f32_]).is_ok());
        assert!(check_stored_operands(&Algorithm::F16, [f32_, f16]).is_ok());
        assert!(check_stored_operands(&Algorithm::F32, [f32_, f32_]).is_ok());
        for (algorithm, stored) in [
            (Algorithm::Bf16, [f16, f32_]),
            (Algorithm::F16, [f32_, bf16]),
            (Algorithm::F32, [bf16, f32_]),
            (Algorithm::Bf16x3, [bf16, bf16]),
        ] {
            let err = check_stored_operands(&algorithm, stored)
                .unwrap_err()
                .to_string();
            assert!(err.contains("does not read operands stored as"), "{err}");
        }
    }
}
