//! Strided copies: the attention head permutations as one op over a 4-d index space.

/// A strided copy over a 4-d index space (the attention head permutations): element
/// (i0, i1, i2, i3) < dims moves from `src_offset + sum(i * src)` to `dst_offset + sum(i * dst)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    /// The index space (i0 slowest, i3 fastest).
    pub dims: [u32; 4],
    /// Source strides of each axis, in elements.
    pub src: [u32; 4],
    /// Destination strides of each axis, in elements.
    pub dst: [u32; 4],
    /// The source's element of index (0, 0, 0, 0).
    pub src_offset: u32,
    /// The destination's element of index (0, 0, 0, 0).
    pub dst_offset: u32,
}

impl Strided {
    /// Elements copied.
    pub fn len(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }

    /// Whether nothing is copied.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Row-major strides of `dims`.
    pub fn dense(dims: [u32; 4]) -> [u32; 4] {
        [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1]
    }

    /// The source and destination index of element `e` (row-major over `dims`).
    pub fn indices(&self, e: usize) -> (usize, usize) {
        let mut rest = e;
        let (mut s, mut d) = (self.src_offset as usize, self.dst_offset as usize);
        for axis in (0..4).rev() {
            let n = self.dims[axis] as usize;
            let i = rest % n;
            rest /= n;
            s += i * self.src[axis] as usize;
            d += i * self.dst[axis] as usize;
        }
        (s, d)
    }

    /// The copy back: each element from where this copy writes it to where it reads it.
    pub fn inverse(self) -> Strided {
        Strided {
            src: self.dst,
            dst: self.src,
            src_offset: self.dst_offset,
            dst_offset: self.src_offset,
            ..self
        }
    }

    /// `batch` row-major r x c matrices into their c x r transposes (the last two axes
    /// swapped).
    pub fn transpose(batch: usize, r: usize, c: usize) -> Strided {
        let (b, r, c) = (batch as u32, r as u32, c as u32);
        let dims = [1, b, r, c];
        Strided {
            dims,
            src: Strided::dense(dims),
            dst: [0, r * c, 1, r],
            src_offset: 0,
            dst_offset: 0,
        }
    }

    /// `rows` rows of `width` into columns [offset, offset + width) of rows of `total` (a
    /// part of a concatenation along the last axis).
    pub fn into_columns(rows: usize, width: usize, (offset, total): (usize, usize)) -> Strided {
        let dims = [1, 1, rows as u32, width as u32];
        Strided {
            dims,
            src: Strided::dense(dims),
            dst: [0, 0, total as u32, 1],
            src_offset: 0,
            dst_offset: offset as u32,
        }
    }

    /// (B, T, 3C) -> one of q, k, v as (B, H, T, D).
    pub fn split_head(part: usize, b: usize, t: usize, h: usize, d: usize) -> Strided {
        let (b, t, h, d, c) = (b as u32, t as u32, h as u32, d as u32, (h * d) as u32);
        let dims = [b, h, t, d];
        Strided {
            dims,
            src: [t * 3 * c, d, 3 * c, 1],
            dst: Strided::dense(dims),
            src_offset: part as u32 * c,
            dst_offset: 0,
        }
    }

    /// The inverse of `split_head`: q, k or v (B, H, T, D) into its third of (B, T, 3C).
    pub fn merge_head(part: usize, b: usize, t: usize, h: usize, d: usize) -> Strided {
        Strided::split_head(part, b, t, h, d).inverse()
    }

    /// (B, H, T, D) -> (B, T, H * D).
    pub fn heads_to_rows(b: usize, t: usize, h: usize, d: usize) -> Strided {
        let (b, t, h, d) = (b as u32, t as u32, h as u32, d as u32);
        let dims = [b, h, t, d];
        Strided {
            dims,
            src: Strided::dense(dims),
            dst: [t * h * d, d, h * d, 1],
            src_offset: 0,
            dst_offset: 0,
        }
    }

    /// (B, T, H * D) -> (B, H, T, D).
    pub fn rows_to_heads(b: usize, t: usize, h: usize, d: usize) -> Strided {
        Strided::heads_to_rows(b, t, h, d).inverse()
    }

    /// The host copy.
    pub fn apply(&self, x: &[f32], out: &mut [f32]) {
        for e in 0..self.len() {
            let (s, d) = self.indices(e);
            out[d] = x[s];
        }
    }
}
