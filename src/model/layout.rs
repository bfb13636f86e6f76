//! The ops that move values without computing on them: a transpose of the last two axes,
//! concatenation along the last axis and its inverse (narrow, split), each a strided copy
//! (`Op::Copy`) forward and back (the plan op the attention's head permutations use, with its
//! kernels on every backend). As in ops.rs, each op whole: its builder method, its forward
//! emission and its backward rule.

use super::derive::{Emit, Saved};
use super::ops::NodeOp;
use super::{ModelBuilder, Node, Var, refuse, shape_of};
use crate::error::Result;
use crate::format::Format;
use crate::plan::{Strided, TensorId};
use crate::policy::{OpClass, OpKind};

impl ModelBuilder {
    /// x [..., r, c] with its last two axes swapped: [..., c, r] (`x.transpose(-2, -1)` made
    /// contiguous).
    pub fn transpose(&mut self, x: Var) -> Result<Var> {
        let s = self.operand("transpose", x)?;
        let [.., r, c] = s[..] else {
            return Err(refuse(
                "transpose",
                format!("x {} must have two axes or more", shape_of(&s)),
            ));
        };
        let batch = s[..s.len() - 2].iter().product();
        let mut shape = s.clone();
        let n = shape.len();
        shape.swap(n - 2, n - 1);
        Ok(self.node(Box::new(Transpose { batch, r, c }), vec![x], shape))
    }

    /// The values side by side along the last axis (`torch.cat(xs, -1)`): every one of the
    /// same shape but the last axis; held in their format where they agree, else f32 (the
    /// promotion PyTorch gives them).
    pub fn concat(&mut self, xs: &[Var]) -> Result<Var> {
        let shapes = xs
            .iter()
            .map(|&x| self.operand("concat", x))
            .collect::<Result<Vec<_>>>()?;
        let Some(first) = shapes.first() else {
            return Err(refuse("concat", "takes one value or more, got none"));
        };
        let lead = &first[..first.len() - 1];
        if let Some(other) = shapes.iter().find(|s| &s[..s.len() - 1] != lead) {
            return Err(refuse(
                "concat",
                format!(
                    "{} beside {}: every value must have the same axes but the last",
                    shape_of(first),
                    shape_of(other)
                ),
            ));
        }
        let widths: Vec<usize> = shapes.iter().map(|s| s[s.len() - 1]).collect();
        let mut shape = first.clone();
        *shape.last_mut().expect("shapes have an axis") = widths.iter().sum();
        Self::checked_shape("concat", &shape)?;
        let rows = lead.iter().product();
        Ok(self.node(Box::new(Concat { rows, widths }), xs.to_vec(), shape))
    }

    /// Columns [start, start + length) of x [..., w] (`x.narrow(-1, start, length)` made
    /// contiguous): [..., length], held in x's format.
    pub fn narrow(&mut self, x: Var, start: usize, length: usize) -> Result<Var> {
        let s = self.operand("narrow", x)?;
        let total = *s.last().expect("shapes have an axis");
        if length == 0 || start.checked_add(length).is_none_or(|end| end > total) {
            return Err(refuse(
                "narrow",
                format!(
                    "columns [{start}, {start} + {length}) of x {}: a part of one column or more \
                     inside its last axis",
                    shape_of(&s)
                ),
            ));
        }
        let mut shape = s.clone();
        *shape.last_mut().expect("shapes have an axis") = length;
        let rows = s[..s.len() - 1].iter().product();
        let part = Narrow {
            rows,
            start,
            length,
            total,
        };
        Ok(self.node(Box::new(part), vec![x], shape))
    }

    /// x [..., w] cut along its last axis into parts `widths` wide, in order (`torch.split(x,
    /// widths, -1)`): the widths must sum to w. Each part is a `narrow`.
    pub fn split(&mut self, x: Var, widths: &[usize]) -> Result<Vec<Var>> {
        let s = self.operand("split", x)?;
        let total = *s.last().expect("shapes have an axis");
        let sum = widths.iter().try_fold(0usize, |n, &w| n.checked_add(w));
        if widths.is_empty() || widths.contains(&0) || sum != Some(total) {
            return Err(refuse(
                "split",
                format!(
                    "widths {widths:?} of x {}: one part or more, each one column or more, \
                     summing to its last axis",
                    shape_of(&s)
                ),
            ));
        }
        let mut start = 0;
        let mut parts = vec![];
        for &w in widths {
            parts.push(self.narrow(x, start, w)?);
            start += w;
        }
        Ok(parts)
    }
}

/// Columns [start, start + length) of `rows` rows of `total`.
#[derive(Debug)]
pub(crate) struct Narrow {
    rows: usize,
    start: usize,
    length: usize,
    total: usize,
}

impl Narrow {
    /// The part (rows x length) into its columns of the whole.
    fn to_whole(&self) -> Strided {
        Strided::into_columns(self.rows, self.length, (self.start, self.total))
    }
}

impl Narrow {
    pub(crate) const KIND: OpKind = OpKind::new("narrow", OpClass::Input);
}

impl NodeOp for Narrow {
    fn kind(&self) -> OpKind {
        Narrow::KIND
    }

    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let x = cx.t(node.inputs[0]);
        let out = cx.g.temp(self.rows * self.length);
        let map = self.to_whole().inverse();
        cx.g.copy(x, out, map, Format::F32);
        (out, vec![])
    }

    /// dx: zeros but for the part's columns, which take dy rounded to x's format as copied
    /// (PyTorch's narrow backward: a zero tensor with dy in the slice). The zeros come from a
    /// constant of one element read with strides of 0; the parts of a split each contribute a
    /// gradient of x's size, summed as any value's read twice.
    fn backward(&self, cx: &mut Emit, node: &Node, _: &Saved, dy: TensorId) {
        let x = node.inputs[0];
        let dx = cx.g.temp(cx.len(x));
        let zero = cx.g.constant(vec![0.0]);
        let every = [1, 1, self.rows as u32, self.total as u32];
        let fill = Strided {
            dims: every,
            src: [0; 4],
            dst: Strided::dense(every),
            src_offset: 0,
            dst_offset: 0,
        };
        cx.g.copy(zero, dx, fill, Format::F32);
        let held = cx.dy_read.narrower(cx.format(x));
        cx.g.copy(dy, dx, self.to_whole(), held);
        cx.contribute(x, dx, true, held);
    }
}

/// Swaps the last two axes of `batch` matrices of r x c.
#[derive(Debug)]
pub(crate) struct Transpose {
    batch: usize,
    r: usize,
    c: usize,
}

impl Transpose {
    pub(crate) const KIND: OpKind = OpKind::new("transpose", OpClass::Input);
}

impl NodeOp for Transpose {
    fn kind(&self) -> OpKind {
        Transpose::KIND
    }

    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let x = cx.t(node.inputs[0]);
        let out = cx.g.temp(cx.g.len(x));
        let map = Strided::transpose(self.batch, self.r, self.c);
        cx.g.copy(x, out, map, Format::F32);
        (out, vec![])
    }

    /// dx: dy's matrices (c x r) transposed back, rounded to `dy_read` as they are copied.
    fn backward(&self, cx: &mut Emit, node: &Node, _: &Saved, dy: TensorId) {
        let x = node.inputs[0];
        let dx = cx.g.temp(cx.len(x));
        let map = Strided::transpose(self.batch, self.r, self.c).inverse();
        let held = cx.dy_read;
        cx.g.copy(dy, dx, map, held);
        cx.contribute(x, dx, true, held);
    }
}

/// `rows` rows of each input, `widths[i]` wide, side by side.
#[derive(Debug)]
pub(crate) struct Concat {
    rows: usize,
    widths: Vec<usize>,
}

impl Concat {
    /// Input `i` (rows x its width) into its columns of the output.
    fn to_output(&self, i: usize) -> Strided {
        let offset = self.widths[..i].iter().sum();
        let total = self.widths.iter().sum();
        Strided::into_columns(self.rows, self.widths[i], (offset, total))
    }
}

impl Concat {
    pub(crate) const KIND: OpKind = OpKind::new("concat", OpClass::Input);
}

impl NodeOp for Concat {
    fn kind(&self) -> OpKind {
        Concat::KIND
    }

    /// One copy per input, each into its columns; the values keep their bits (a promoted
    /// output holds every narrower value exactly).
    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let out = cx.g.temp(self.rows * self.widths.iter().sum::<usize>());
        for (i, &x) in node.inputs.iter().enumerate() {
            let x = cx.t(x);
            let map = self.to_output(i);
            cx.g.copy(x, out, map, Format::F32);
        }
        (out, vec![])
    }

    /// Each input's gradient: its columns of dy, rounded to the input's format as copied
    /// (a promoted output's gradient is f32; PyTorch casts each part back to its input's
    /// dtype).
    fn backward(&self, cx: &mut Emit, node: &Node, _: &Saved, dy: TensorId) {
        for (i, &x) in node.inputs.iter().enumerate() {
            if !cx.needs_grad(x) {
                continue;
            }
            let map = self.to_output(i).inverse();
            let dx = cx.g.temp(cx.len(x));
            let held = cx.dy_read.narrower(cx.format(x));
            cx.g.copy(dy, dx, map, held);
            cx.contribute(x, dx, true, held);
        }
    }
}
