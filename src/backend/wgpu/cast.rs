//! Element kernels: casts, fp8 quantization, amax and scales, the bf16 split. Each function
//! returns a `Dispatch` so that callers can chain several into one submission.

use super::buffer::{Bind, Dispatch};
use super::device::Gpu;
use super::shaders::{Kernel, format_id};
use crate::error::Result;
use crate::format::Format;
use bytemuck::{Pod, Zeroable};

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct CastParams {
    len: u32,
    format: u32,
    saturate: u32,
    batch_len: u32,
    div: u32,
    modulus: u32,
    groups_per_batch: u32,
    scale_offset: u32,
}

impl CastParams {
    /// A cast of `len` elements with no scale groups.
    fn plain(len: usize, format: Format, saturate: bool) -> CastParams {
        CastParams {
            len: len as u32,
            format: format_id(format),
            saturate: saturate as u32,
            batch_len: 1,
            div: 1,
            modulus: 1,
            groups_per_batch: 1,
            scale_offset: 0,
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct ScaleParams {
    len: u32,
    batch_len: u32,
    div: u32,
    modulus: u32,
    groups_per_batch: u32,
    groups: u32,
    fmax_bits: u32,
    offset: u32,
    /// What the amax reads: f32 bits, or the 16-bit codes of this format id.
    src_format: u32,
    pad: [u32; 3],
}

impl ScaleParams {
    fn new(len: usize, grouping: Grouping, fmax_bits: u32, offset: usize) -> ScaleParams {
        ScaleParams {
            len: len as u32,
            batch_len: grouping.batch_len,
            div: grouping.div,
            modulus: grouping.modulus,
            groups_per_batch: grouping.groups_per_batch,
            groups: grouping.groups() as u32,
            fmax_bits,
            offset: offset as u32,
            src_format: format_id(Format::F32),
            pad: [0; 3],
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct SplitParams {
    len: u32,
    plane_words: u32,
    parts: u32,
    _pad: u32,
}

/// Which scale group each element of a stored operand belongs to:
/// group(e) = (e / batch_len) * groups_per_batch + ((e % batch_len) / div) % modulus.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grouping {
    /// Elements per batch.
    pub batch_len: u32,
    /// Consecutive elements that share a group (the row length for row groups, 1 for column
    /// groups).
    pub div: u32,
    /// Groups a batch cycles through (1, rows, or columns).
    pub modulus: u32,
    /// Groups per batch.
    pub groups_per_batch: u32,
    /// Batches.
    pub batches: u32,
}

impl Grouping {
    /// One group per batch of `batch_len` elements.
    pub fn per_batch(batches: usize, batch_len: usize) -> Grouping {
        let l = batch_len.max(1) as u32;
        Grouping {
            batch_len: l,
            div: l,
            modulus: 1,
            groups_per_batch: 1,
            batches: batches as u32,
        }
    }

    /// One group per line of a row-major `rows x cols` matrix per batch: per row when
    /// `by_row`, per column otherwise.
    pub fn per_line(batches: usize, rows: usize, cols: usize, by_row: bool) -> Grouping {
        let (rows, cols) = (rows.max(1) as u32, cols.max(1) as u32);
        let (div, modulus) = if by_row { (cols, rows) } else { (1, cols) };
        Grouping {
            batch_len: rows * cols,
            div,
            modulus,
            groups_per_batch: modulus,
            batches: batches as u32,
        }
    }

    /// Groups in all (batches times groups per batch).
    pub fn groups(&self) -> usize {
        self.batches as usize * self.groups_per_batch as usize
    }
}

/// Words a packed array of `len` elements of `format` occupies.
pub fn packed_words(format: Format, len: usize) -> usize {
    let per = 4 / format.storage_bytes().min(4);
    len.div_ceil(per)
}

/// f32 words in `src` -> packed codes of `format` in `dst`.
pub fn encode(
    gpu: &Gpu,
    src: &dyn Bind,
    dst: &wgpu::Buffer,
    len: usize,
    format: Format,
    saturate: bool,
) -> Result<Dispatch> {
    let params = CastParams::plain(len, format, saturate);
    element_cast(
        gpu,
        Kernel::Encode,
        params,
        src,
        dst,
        src,
        packed_words(format, len),
    )
}

/// Packed codes of `format` in `src` -> f32 words in `dst`.
pub fn decode(
    gpu: &Gpu,
    src: &dyn Bind,
    dst: &wgpu::Buffer,
    len: usize,
    format: Format,
) -> Result<Dispatch> {
    let params = CastParams::plain(len, format, false);
    element_cast(gpu, Kernel::Decode, params, src, dst, src, len)
}

/// f32 words in `src` -> fp8 codes of sat_cast(x * s) in `dst`, s = scales[offset + group(e)].
#[allow(clippy::too_many_arguments)]
pub fn quantize(
    gpu: &Gpu,
    src: &dyn Bind,
    dst: &wgpu::Buffer,
    scales: &dyn Bind,
    len: usize,
    format: Format,
    grouping: Grouping,
    scale_offset: usize,
) -> Result<Dispatch> {
    let params = CastParams {
        len: len as u32,
        format: format_id(format),
        saturate: 1,
        batch_len: grouping.batch_len,
        div: grouping.div,
        modulus: grouping.modulus,
        groups_per_batch: grouping.groups_per_batch,
        scale_offset: scale_offset as u32,
    };
    element_cast(
        gpu,
        Kernel::Quantize,
        params,
        src,
        dst,
        scales,
        packed_words(format, len),
    )
}

fn element_cast(
    gpu: &Gpu,
    kernel: Kernel,
    params: CastParams,
    src: &dyn Bind,
    dst: &wgpu::Buffer,
    scales: &dyn Bind,
    items: usize,
) -> Result<Dispatch> {
    let pipeline = gpu.pipeline(&kernel)?;
    let uniform = super::buffer::uniform(gpu, &params);
    Ok(Dispatch::new(
        gpu,
        pipeline,
        &[&uniform, src, dst, scales],
        Dispatch::element_groups(gpu, items)?,
    ))
}

/// One operand of scale.wgsl's kernels: its source (f32 values, or the 16-bit codes of
/// `stored`), its length, its scale groups and where they start in the amaxes and scales.
#[derive(Clone, Copy)]
pub struct Grouped<'a> {
    /// The elements.
    pub src: &'a dyn Bind,
    /// How they are stored: f32 values, or 16-bit codes of this format.
    pub stored: Format,
    /// How many.
    pub len: usize,
    /// Which scale group each is in.
    pub grouping: Grouping,
    /// Where its groups start in the amaxes and scales.
    pub offset: usize,
}

impl Grouped<'_> {
    /// Its uniform, with the largest finite value of the format it is scaled to (0: none).
    fn params(&self, fmax_bits: u32) -> ScaleParams {
        ScaleParams {
            src_format: format_id(self.stored),
            ..ScaleParams::new(self.len, self.grouping, fmax_bits, self.offset)
        }
    }
}

/// The uniform and bindings of scale.wgsl's kernels for one operand or two (a matmul's A and
/// B, in one dispatch each): the second's length and groups zero where there is none.
fn scale_bindings<'a>(
    gpu: &Gpu,
    (a, fa): (Grouped<'a>, u32),
    b: Option<(Grouped<'a>, u32)>,
) -> ([ScaleParams; 2], wgpu::Buffer, &'a dyn Bind) {
    let none = ScaleParams {
        len: 0,
        groups: 0,
        ..a.params(fa)
    };
    let params = [a.params(fa), b.map_or(none, |(b, fb)| b.params(fb))];
    let uniform = super::buffer::uniform(gpu, &params);
    (params, uniform, b.map_or(a.src, |(b, _)| b.src))
}

/// Two dispatches: atomic amax of each group of `a` (and `b`) into the amaxes (which must be
/// zeroed first), then s = FMAX / amax into `scales`, FMAX the largest finite value of each
/// operand's format.
pub fn current_scales<'a>(
    gpu: &Gpu,
    (amax_bits, scales): (&wgpu::Buffer, &wgpu::Buffer),
    a: (Grouped<'a>, Format),
    b: Option<(Grouped<'a>, Format)>,
) -> Result<[Dispatch; 2]> {
    fn fmax((g, f): (Grouped, Format)) -> (Grouped, u32) {
        (g, f.max().to_bits())
    }
    let (params, uniform, src_b) = scale_bindings(gpu, fmax(a), b.map(fmax));
    let buffers: [&dyn Bind; 5] = [&uniform, a.0.src, amax_bits, scales, src_b];
    let amax = Dispatch::new(
        gpu,
        gpu.pipeline(&Kernel::Amax)?,
        &buffers,
        amax_groups(gpu, &params)?,
    );
    let groups = params.iter().map(|p| p.groups as usize).sum();
    let scale = Dispatch::new(
        gpu,
        gpu.pipeline(&Kernel::ScaleFromAmax)?,
        &buffers,
        Dispatch::element_groups(gpu, groups)?,
    );
    Ok([amax, scale])
}

/// Elements per workgroup of scale.wgsl's `amax` (its AMAX_SPAN).
const AMAX_SPAN: usize = 4096;

/// Workgroups of scale.wgsl's `amax`: one per span of each operand (`element_groups` counts
/// one per 256 items).
fn amax_groups(gpu: &Gpu, params: &[ScaleParams; 2]) -> Result<[u32; 3]> {
    let spans: usize = (params.iter())
        .map(|p| (p.len as usize).div_ceil(AMAX_SPAN))
        .sum();
    Dispatch::element_groups(gpu, spans * 256)
}

/// Atomic amax of each group of `a` (and `b`, in the same dispatch) into the amaxes (which
/// must be zeroed first).
pub fn amax(
    gpu: &Gpu,
    amax_bits: &wgpu::Buffer,
    a: Grouped,
    b: Option<Grouped>,
) -> Result<Dispatch> {
    let (params, uniform, src_b) = scale_bindings(gpu, (a, 0), b.map(|b| (b, 0)));
    // The scales binding is not written by `amax`; amax_bits stands in for it.
    Ok(Dispatch::new(
        gpu,
        gpu.pipeline(&Kernel::Amax)?,
        &[&uniform, a.src, amax_bits, amax_bits, src_b],
        amax_groups(gpu, &params)?,
    ))
}

/// The bf16 split of `len` f32 words into `parts` packed planes; returns the dispatch and the
/// words per plane.
pub fn split_bf16(
    gpu: &Gpu,
    src: &dyn Bind,
    dst: &wgpu::Buffer,
    len: usize,
    parts: usize,
) -> Result<(Dispatch, usize)> {
    let plane_words = packed_words(Format::Bf16, len);
    let params = SplitParams {
        len: len as u32,
        plane_words: plane_words as u32,
        parts: parts as u32,
        _pad: 0,
    };
    let uniform = super::buffer::uniform(gpu, &params);
    let pipeline = gpu.pipeline(&Kernel::SplitBf16)?;
    Ok((
        Dispatch::new(
            gpu,
            pipeline,
            &[&uniform, src, dst],
            Dispatch::element_groups(gpu, plane_words)?,
        ),
        plane_words,
    ))
}

#[cfg(test)]
mod uniform_layout {
    use super::*;
    use crate::backend::wgpu::shaders::assert_uniform_layout;

    /// Each uniform struct here is its kernel's, member for member (`assert_uniform_layout`).
    #[test]
    fn uniforms_match_their_wgsl_structs() {
        assert_uniform_layout!(
            "cast.wgsl",
            CastParams {
                len,
                format,
                saturate,
                batch_len,
                div,
                modulus,
                groups_per_batch,
                scale_offset
            }
        );
        assert_uniform_layout!(
            "scale.wgsl",
            ScaleParams {
                len,
                batch_len,
                div,
                modulus,
                groups_per_batch,
                groups,
                fmax_bits,
                offset,
                src_format
            }
        );
        assert_uniform_layout!(
            "split.wgsl",
            SplitParams {
                len,
                plane_words,
                parts
            }
        );
    }
}
