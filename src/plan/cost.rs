//! What ops cost by their definitions: the bytes they must move through device memory and the
//! multiply-add FLOPs of their products (each op's own in `Op::cost`, op.rs). A profile divides
//! them by an op's measured time (achieved GB/s or TFLOP/s) and by the device's measured rates
//! (how far from the limit).

use super::Plan;
use std::ops::Range;

/// The least an op (or a run of ops) moves and computes: each tensor it reads read once, each
/// it writes written once, in the format the plan stores it in; FLOPs of its matrix products
/// only (2 per multiply-add; causal attention counts the products at and below the diagonal).
/// Element and row ops have no FLOPs here: memory bounds them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Cost {
    /// Bytes read and written.
    pub bytes: u64,
    /// Floating-point operations of the matmuls and attention products.
    pub flops: u64,
}

impl std::ops::Add for Cost {
    type Output = Cost;
    fn add(self, o: Cost) -> Cost {
        Cost {
            bytes: self.bytes + o.bytes,
            flops: self.flops + o.flops,
        }
    }
}

impl std::iter::Sum for Cost {
    fn sum<I: Iterator<Item = Cost>>(iter: I) -> Cost {
        iter.fold(Cost::default(), |a, b| a + b)
    }
}

impl Cost {
    /// Whether products bound the op (it has FLOPs), so its rate is TFLOP/s, not GB/s.
    pub fn computes(&self) -> bool {
        self.flops > 0
    }
}

impl Plan {
    /// The cost of ops `range` (`Op::cost`).
    pub fn cost(&self, range: Range<usize>) -> Cost {
        self.ops[range]
            .iter()
            .map(|op| op.cost(&self.tensors))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Algorithm, MatmulShape};
    use crate::format::Format;
    use crate::plan::{Attention, Op, Outline, PlanBuilder, Strided, TensorKind};

    #[test]
    fn costs_follow_the_definitions() {
        let mut g = PlanBuilder::default();
        let tokens = g.tensor(4, TensorKind::Tokens);
        let targets = g.tensor(4, TensorKind::Targets);
        let (a, b) = (g.temp(4 * 8), g.temp(8 * 16));
        let c = g.temp(4 * 16);
        g.push(Op::Matmul {
            shape: MatmulShape::new(4, 16, 8),
            algorithm: Algorithm::F32,
            a,
            b,
            out: c,
            scales: None,
            held: crate::format::Format::F32,
        });
        let table = g.temp(10 * 16);
        let rows = g.temp(4 * 16);
        g.push(Op::Embedding {
            table,
            ids: tokens,
            out: rows,
            c: 16,
        });
        let half = g.temp(2 * 16);
        let map = Strided {
            dims: [1, 1, 1, 32],
            src: [0, 0, 0, 1],
            dst: [0, 0, 0, 1],
            src_offset: 0,
            dst_offset: 0,
        };
        g.push(Op::Copy {
            x: c,
            out: half,
            map,
            held: Format::F32,
        });
        let plan = g
            .finish(Outline::ops_alone(3, 3, (tokens, targets), c))
            .unwrap();
        let cost = |i: usize| plan.ops[i].cost(&plan.tensors);
        // 4x8 and 8x16 read, 4x16 written, f32; 2 m n k FLOPs.
        assert_eq!(
            cost(0),
            Cost {
                bytes: 4 * (32 + 128 + 64),
                flops: 2 * 4 * 16 * 8
            }
        );
        // 4 ids, then 4 rows of 16 read from the table and written.
        assert_eq!(cost(1).bytes, 4 * 4 + 2 * 4 * 64);
        // 32 elements read and written, of a 64-element source.
        assert_eq!(cost(2).bytes, 2 * 4 * 32);
        assert_eq!(plan.cost(0..3), cost(0) + cost(1) + cost(2));
        assert!(cost(0).computes() && !cost(1).computes());
    }

    #[test]
    fn causal_attention_counts_the_lower_triangle() {
        let spec = Attention {
            b: 2,
            t: 4,
            h: 3,
            d: 8,
            scale: 1.0,
            algorithm: Algorithm::F32,
            probs: Format::F32,
            compute: Format::F32,
        };
        let mut g = PlanBuilder::default();
        let tokens = g.tensor(8, TensorKind::Tokens);
        let targets = g.tensor(8, TensorKind::Targets);
        let qkv = g.temp(spec.qkv_len());
        let (out, stats) = (g.temp(spec.out_len()), g.temp(2 * spec.score_rows()));
        g.push(Op::Attention {
            qkv,
            out,
            stats,
            spec,
        });
        let plan = g
            .finish(Outline::ops_alone(1, 1, (tokens, targets), out))
            .unwrap();
        // 10 (query, key) pairs of 4 tokens per head; 2 products of d multiply-adds each.
        let flops = 2 * 2 * (2 * 3 * 10) * 8;
        assert_eq!(plan.ops[0].cost(&plan.tensors).flops, flops);
    }
}
