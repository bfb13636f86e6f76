//! Rotary position embeddings (Su et al., "RoFormer", 2021) in the half-split layout of
//! Hugging Face's Llama (`rotate_half`): in each head of d values, value i < d/2 and value
//! i + d/2 form pair i, rotated by the angle p * f_i at position p, f_i = base^(-2i/d):
//!
//!   out[i]         = x[i] cos - x[i + d/2] sin
//!   out[i + d/2]   = x[i + d/2] cos + x[i] sin
//!
//! The angles' cos and sin come from one table the plan holds as a constant (`table`), so that
//! every backend reads the same values (a GPU's own cos of a large angle is not defined to
//! any accuracy in WGSL); the rotation is computed in f32 by the kernels (`rotary` in
//! `shaders/train.wgsl` and `cuda/train.cu`) and in f64 here, each held once in the output's
//! format. The backward rotates dy by the opposite angles (the transpose of a rotation).

use crate::error::Result;

/// cos and sin of every position's angles, (cos, sin) of pair i at position p at
/// `2 (p d/2 + i)`: f_i = 1 / base^(2i/d) rounded to f32, the angle p f_i a product in f32 (as
/// Hugging Face computes `inv_freq` and `freqs`), its cos and sin in f64 rounded to f32.
pub fn table(t: usize, d: usize, base: f64) -> Result<Vec<f32>> {
    let half = d / 2;
    let mut values = crate::memory::empty_with_capacity("a rotary table", t * 2 * half)?;
    let freqs: Vec<f32> = (0..half)
        .map(|i| (1.0 / base.powf((2 * i) as f64 / d as f64)) as f32)
        .collect();
    for p in 0..t {
        for &f in &freqs {
            let angle = (p as f32 * f) as f64;
            values.push(angle.cos() as f32);
            values.push(angle.sin() as f32);
        }
    }
    Ok(values)
}

/// The host definition: rows of c = heads x d, row r at position r % t, rotated by `table`'s
/// angles (by the opposite ones where `inverse`), in f64, rounded to f32.
pub fn apply(
    x: &[f32],
    table: &[f32],
    (t, c, d): (usize, usize, usize),
    inverse: bool,
) -> Vec<f32> {
    let half = d / 2;
    let sign = if inverse { -1.0 } else { 1.0 };
    let mut out = vec![0.0; x.len()];
    for (r, (row, y)) in x.chunks(c).zip(out.chunks_mut(c)).enumerate() {
        let angles = &table[(r % t) * 2 * half..][..2 * half];
        for (head, yh) in row.chunks(d).zip(y.chunks_mut(d)) {
            for i in 0..half {
                let (cos, sin) = (angles[2 * i] as f64, sign * angles[2 * i + 1] as f64);
                let (a, b) = (head[i] as f64, head[i + half] as f64);
                yh[i] = (a * cos - b * sin) as f32;
                yh[i + half] = (b * cos + a * sin) as f32;
            }
        }
    }
    out
}
