//! Matmul on wgpu: operands are prepared on the device into their storage format (packed bf16 or
//! f16, split bf16 planes, scaled fp8), then one tiled kernel computes C. Everything is recorded
//! into one compute pass and submitted once.

use super::buffer::{self, Bind, BufferPool, Dispatch, Region, check_binding, upload};
use super::cast::{self, Grouping, packed_words};
use super::device::Gpu;
use super::shaders::{
    Coop, F16Read, GROUP_K, Kernel, Load, MatmulVariant, Operand, Store, Tile, format_id,
};
use crate::algorithm::{Algorithm, MatmulShape, Scaling};
use crate::error::{Error, Result};
use crate::format::Format;
use crate::plan::check_stored_operands;
use bytemuck::{Pod, Zeroable};

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct MatmulParams {
    m: u32,
    n: u32,
    k: u32,
    k_begin: u32,
    a_batch: u32,
    a_row: u32,
    a_col: u32,
    a_plane: u32,
    b_batch: u32,
    b_row: u32,
    b_col: u32,
    b_plane: u32,
    c_batch: u32,
    sa_batch: u32,
    sb_batch: u32,
    sb_offset: u32,
    b_lines: u32,
    k_end: u32,
    mode: u32,
    partial_plane: u32,
    split_groups: u32,
    batches: u32,
    planes: u32,
    _pad: u32,
    epi: [u32; 4],
    epi2: [u32; 4],
}

/// `params.mode` of the matmul kernels (matmul.wgsl, "Summation order"): the groups of a span of
/// K with running totals; each group of a split into its plane; the planes added in order.
const MODE_SUM: u32 = 0;
const MODE_SPLIT: u32 = 1;
const MODE_REDUCE: u32 = 2;

/// How a split-K product runs: `splits` workgroups per output tile, each summing
/// `split_groups` groups of `GROUP_K`, into `planes` group planes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitK {
    /// Workgroups per output tile (along z, per batch).
    pub splits: u32,
    /// Groups each sums.
    pub split_groups: u32,
    /// Group planes (all of K's groups).
    pub planes: u32,
}

/// The split-K plan of `variant` (its tile's `splits`) over K (padded K on cooperative
/// matrices) with `plane` elements per plane and level, or None where it does not split: fewer
/// than two groups or splits, the planes beyond a binding or 256 MiB, the batches times splits
/// beyond a dispatch's 65535 workgroups, or a reduction that the loop budget cannot hold. A
/// split that would run past the loop budget takes more, shorter splits.
pub fn split_k(
    gpu: &Gpu,
    variant: &MatmulVariant,
    k: u32,
    plane: u64,
    batch: u32,
) -> Option<SplitK> {
    let planes = k.div_ceil(GROUP_K);
    let wanted = variant.tile.splits.min(planes);
    if wanted < 2 || variant.masked {
        return None;
    }
    let levels = u64::from(variant.level_count());
    let bytes = u64::from(planes) * levels * plane * 4;
    if bytes > gpu.limits.max_storage_buffer_binding_size.min(256 << 20) {
        return None;
    }
    let loops = variant.k_loops();
    // Groups a split may take within the budget (all where there is none).
    let most = match gpu.usable_loop_iterations() {
        None => planes,
        Some(usable) => {
            let reduce = variant.reduce_loops(planes);
            if reduce > usable {
                return None;
            }
            (usable.saturating_sub(loops.fixed) / loops.per_unit.max(1)).min(planes.into()) as u32
        }
    };
    if most == 0 {
        return None;
    }
    let split_groups = planes.div_ceil(wanted).min(most);
    let splits = planes.div_ceil(split_groups);
    if splits < 2 || u64::from(splits) * u64::from(batch) > 65535 {
        return None;
    }
    Some(SplitK {
        splits,
        split_groups,
        planes,
    })
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct CoopParams {
    m: u32,
    n: u32,
    k: u32,
    kp: u32,
    mp: u32,
    np: u32,
    a_plane: u32,
    b_plane: u32,
    c_batch: u32,
    b_lines: u32,
    k_begin: u32,
    k_end: u32,
    mode: u32,
    partial_plane: u32,
    split_groups: u32,
    batches: u32,
    planes: u32,
    _pad: [u32; 3],
    epi: [u32; 4],
    epi2: [u32; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct PackParams {
    rows: u32,
    cols: u32,
    rows_p: u32,
    cols_p: u32,
    src_batch: u32,
    src_row: u32,
    src_col: u32,
    plane_words: u32,
    words: u32,
    parts: u32,
    by_row: u32,
    line_offset: u32,
    /// What the source holds: f32 bits, or the 16-bit codes of this format id.
    src_format: u32,
    pad: [u32; 3],
}

/// A matmul recorded on the device: its buffers and dispatches, ready to submit (repeatedly).
pub struct MatmulRun {
    /// Buffers zeroed before each submission: the amaxes and per-line flags the run's
    /// dispatches accumulate into.
    pub clears: Vec<wgpu::Buffer>,
    /// The run's compute dispatches, in submission order (`product` says which compute C).
    pub dispatches: Vec<Dispatch>,
    /// Which of `dispatches` compute the product from the prepared operands (the rest, and
    /// the clears, prepare them: scales, flags, packed or split planes). Once a run has been
    /// submitted whole, these alone compute C again from what it left (the bench's prepared
    /// mode).
    pub product: Vec<usize>,
    /// The result C: f32, row-major, `shape.c_len()` elements (`out` where the caller gave one).
    pub c: Region,
    /// Pooled buffers the run keeps between submissions (amaxes, flags, scales: cleared or
    /// rewritten before each), returned to the pool when the run is done.
    pub temporaries: Vec<wgpu::Buffer>,
    /// Pooled operand planes, written and read within the run's own dispatches: a run
    /// submitted after this one may take them over (a step plan's matmuls share them).
    pub scratch: Vec<wgpu::Buffer>,
    /// The kernel variant that computes the product (its operands' storage, tile, cooperative
    /// matrices or SIMT).
    pub variant: MatmulVariant,
    /// Given fp8 scales: the buffer holding A's scale for each of its `.1` groups, then B's
    /// for its `.2` (a step plan rewrites them before each step).
    pub given_scales: Option<(wgpu::Buffer, usize, usize)>,
    /// Whether the kernel summed B's columns as the epilogue asked (`Epilogue::column_sums`).
    pub columns_summed: bool,
}

impl MatmulRun {
    /// The dispatches that compute the product from prepared operands.
    pub fn product_dispatches(&self) -> Vec<Dispatch> {
        self.product
            .iter()
            .map(|&i| self.dispatches[i].clone())
            .collect()
    }

    /// Every pooled buffer of the run, C included (to give back once it is read).
    pub fn into_buffers(self) -> impl Iterator<Item = wgpu::Buffer> {
        self.temporaries
            .into_iter()
            .chain(self.scratch)
            .chain([self.c.buffer])
    }
}

/// Where a run's buffers come from: operand planes from `lent` where one fits, else from
/// `scratch` (free again once the run's own dispatches have read them), everything the run
/// keeps between submissions (C, amaxes, flags, scales) from `kept`. A one-off matmul takes
/// all from the backend's pool; a step plan lends the buffers of tensors that hold nothing
/// live during the op, shares `scratch` among its matmuls and never lets a kept buffer be one
/// of them.
#[derive(Clone, Copy)]
pub struct Pools<'a> {
    /// Buffers of tensors with nothing live during the op, lent for operand planes (None: none).
    pub lent: Option<&'a BufferPool>,
    /// Where operand planes come from where nothing lent fits.
    pub scratch: &'a BufferPool,
    /// Where the buffers the run keeps between submissions come from (C, amaxes, flags, scales).
    pub kept: &'a BufferPool,
}

impl<'a> Pools<'a> {
    /// All from one pool.
    pub fn one(pool: &'a BufferPool) -> Pools<'a> {
        Pools {
            lent: None,
            scratch: pool,
            kept: pool,
        }
    }

    /// A buffer for an operand plane of `bytes`.
    fn plane(&self, gpu: &Gpu, bytes: u64) -> Result<wgpu::Buffer> {
        match self.lent.and_then(|lent| lent.take_idle(bytes)) {
            Some(buffer) => Ok(buffer),
            None => self.scratch.take(gpu, bytes),
        }
    }
}

/// One operand as the matmul kernel reads it.
struct Prepared {
    buffer: Region,
    /// Element stride between split planes (0 without planes).
    plane: usize,
    /// Taken from the pool (else it is the caller's f32 upload).
    pooled: bool,
}

/// Which side of the product an operand is on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    A,
    B,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::A => "operand A",
            Side::B => "operand B",
        }
    }
}

/// Both operands of a matmul on the device, and what each stores: f32 values, or 16-bit codes
/// (a step plan's coded tensors, `Plan::store_codes`).
#[derive(Clone, Copy)]
pub struct OnDevice<'a> {
    /// Operand A: `shape.batch` row-major m × k matrices (k × m where `a_transposed`).
    pub a: &'a Region,
    /// Operand B: `shape.batch` row-major k × n matrices (n × k where `b_transposed`).
    pub b: &'a Region,
    /// What A and B store: `Format::F32` values, or the 16-bit codes of that format.
    pub stored: [Format; 2],
}

impl<'a> OnDevice<'a> {
    /// Both operands f32 values.
    pub fn f32(a: &'a Region, b: &'a Region) -> OnDevice<'a> {
        OnDevice {
            a,
            b,
            stored: [Format::F32; 2],
        }
    }
}

/// What the matmul's store does to the product (epilogue.wgsl): a linear layer's bias add, as
/// the step plan's `Op::Add` would do it reading the product in place right after the matmul:
/// C = (C' + x') held in `held`, C' the product held in `y_held`, x' the bias (one per column
/// of C) held in `x_held`; then plus a residual (held in its format), or a GELU of C (held in
/// its format) into a tensor of its own, as f32 or as codes. With no bias, C = C' held in
/// `held` (the plan's `Op::Matmul` rounding its product).
pub struct Epilogue<'a> {
    /// The bias: one value per column of C.
    pub bias: Option<&'a Region>,
    /// The format the product is held in as the add reads it.
    pub y_held: Format,
    /// The format the bias is held in as the add reads it.
    pub x_held: Format,
    /// The format the sum is held in.
    pub held: Format,
    /// With a bias: C stored as the 16-bit codes of `held`, two a word (C's rows of even
    /// length: `Epilogue::can_code`), as a plan stores a coded tensor; else as f32 values.
    pub coded: bool,
    /// A residual added after (same layout as C) and the format that sum is held in.
    pub residual: Option<(&'a Region, Format)>,
    /// A GELU of the sum into this tensor (C's layout), held in its format; stored as its
    /// codes where the flag says (only where C is coded), else as f32.
    pub gelu: Option<(&'a Region, Format, bool)>,
    /// B's column sums over K into this tensor (f32, n values), held in its format: a linear
    /// layer's bias gradient beside its weight gradient x^T . dy, summed from the dy the
    /// product reads. Taken where the kernel can (`MatmulVariant::can_sum_columns`, one
    /// matrix): `MatmulRun::columns_summed` says whether it did.
    pub column_sums: Option<(&'a Region, Format)>,
}

impl Epilogue<'_> {
    /// The product stored as it is.
    pub fn plain() -> Epilogue<'static> {
        Epilogue::held(Format::F32)
    }

    /// The product rounded to `held` as it is stored.
    pub fn held(held: Format) -> Epilogue<'static> {
        Epilogue {
            bias: None,
            y_held: Format::F32,
            x_held: Format::F32,
            held,
            coded: false,
            residual: None,
            gelu: None,
            column_sums: None,
        }
    }

    /// Whether a product of `shape` can be stored as codes: rows of even length, so that no
    /// word holds two rows' codes (each invocation stores whole words).
    pub fn can_code(shape: &MatmulShape) -> bool {
        shape.n.is_multiple_of(2)
    }

    /// What the kernel's store does for this epilogue.
    fn store(&self) -> Store {
        match (self.bias, self.held) {
            (Some(_), _) => Store::BiasAdd { coded: self.coded },
            (None, Format::F32) => Store::Plain,
            (None, _) => Store::Held,
        }
    }
}

/// An epilogue's bindings (a bias add's three, a small buffer of the run's where it has no
/// residual or GELU; none for a rounding) and its words of the kernel's uniform.
struct BoundEpilogue {
    store: Store,
    buffers: Vec<Region>,
    /// Where B's column sums go, if asked.
    column_sums: Option<Region>,
    epi: [u32; 4],
    epi2: [u32; 4],
}

impl BoundEpilogue {
    fn of(gpu: &Gpu, pools: Pools, e: &Epilogue, run: &mut MatmulRun) -> Result<BoundEpilogue> {
        let sums_held = e.column_sums.map_or(0, |(_, f)| format_id(f));
        if e.bias.is_none() {
            return Ok(BoundEpilogue {
                store: e.store(),
                buffers: vec![],
                column_sums: e.column_sums.map(|(r, _)| r.clone()),
                epi: [0, 0, format_id(e.held), 0],
                epi2: [0, 0, sums_held, 0],
            });
        }
        // A kernel may not bind one buffer writable twice: the GELU's stand-in is its own.
        let spare = pools.kept.take(gpu, 4)?;
        run.temporaries.push(spare.clone());
        // epilogue.wgsl's EPI_RESIDUAL, EPI_GELU, EPI_BIAS and EPI_GELU_CODES.
        let flags = u32::from(e.residual.is_some())
            | (u32::from(e.gelu.is_some()) << 1)
            | (u32::from(e.bias.is_some()) << 2)
            | (u32::from(e.gelu.is_some_and(|g| g.2)) << 3);
        // A buffer bound for reading may not be bound writable too: the bias's stand-in is
        // another.
        let bias = match e.bias {
            Some(b) => b.clone(),
            None => {
                let stand_in = pools.kept.take(gpu, 4)?;
                run.temporaries.push(stand_in.clone());
                Region::whole(&stand_in)
            }
        };
        let residual = e.residual.map_or(bias.clone(), |(r, _)| r.clone());
        let gelu = e.gelu.map_or(Region::whole(&spare), |(g, ..)| g.clone());
        Ok(BoundEpilogue {
            store: e.store(),
            buffers: vec![bias, residual, gelu],
            column_sums: e.column_sums.map(|(r, _)| r.clone()),
            epi: [
                format_id(e.y_held),
                format_id(e.x_held),
                format_id(e.held),
                flags,
            ],
            epi2: [
                e.residual.map_or(0, |(_, f)| format_id(f)),
                e.gelu.map_or(0, |(_, f, _)| format_id(f)),
                sums_held,
                0,
            ],
        })
    }
}

/// Checks sizes and records the matmul of the operands already on the device into `out` (a
/// pooled buffer when none), on cooperative matrices `coop` (with its SIMT fallback or not)
/// where the algorithm has such a variant, on `tile` (the variant's default tile when none).
/// Operands are f32 values, or 16-bit codes where they say so.
#[allow(clippy::too_many_arguments)]
pub fn record(
    gpu: &Gpu,
    pools: Pools,
    shape: &MatmulShape,
    algorithm: &Algorithm,
    f16: F16Read,
    coop: Option<(Coop, bool)>,
    tile: Option<Tile>,
    operands: OnDevice,
    out: Option<&Region>,
    epilogue: Option<&Epilogue>,
) -> Result<MatmulRun> {
    // Codes are read as they are stored: the SIMT kernel reads them as the codes it would have
    // encoded, the cooperative kernel packs from them.
    check_stored_operands(algorithm, operands.stored)?;
    let mut variant = MatmulVariant::for_algorithm(algorithm, f16);
    let fallback = coop.is_none_or(|(_, f)| f);
    // A SIMT tile chosen on a cooperative-matrix device (`Tile::simt`) runs matmul.wgsl.
    let coop = coop.filter(|_| !tile.is_some_and(|t| t.simt));
    if let Some(v) = coop.and_then(|(c, _)| MatmulVariant::coop(algorithm, c)) {
        variant = v;
    }
    if let Some(t) = tile {
        variant = variant.with_tile(t.on_simt(false).with_encoded(false));
    }
    // 16-bit operands held in f32 rounded as read, unless the tile encodes them first.
    if !tile.is_some_and(|t| t.encoded) {
        variant = variant.reading(operands.stored);
    }
    let coded = epilogue.filter(|e| e.store().coded());
    if let Some(e) = coded {
        let sixteen = |f: Format| f.storage_bytes() == 2;
        if !Epilogue::can_code(shape)
            || !sixteen(e.held)
            || e.gelu.is_some_and(|g| g.2 && !sixteen(g.1))
        {
            return Err(Error::invalid(
                "matmul epilogue",
                format!(
                    "a product of {} columns held in {} cannot be stored as 16-bit codes: each \
                     row must fill whole words, of a 16-bit format",
                    shape.n, e.held
                ),
            ));
        }
    }
    let coded = coded.is_some();
    let c_bytes = match coded {
        true => shape.c_len().div_ceil(2) as u64 * 4,
        false => shape.c_len() as u64 * 4,
    };
    check_binding(gpu, "result C", c_bytes)?;
    let c = match out {
        Some(c) => c.clone(),
        None => Region::whole(&pools.kept.take(gpu, c_bytes)?),
    };
    if variant.coop.is_some() {
        return record_coop(
            gpu, pools, shape, algorithm, variant, fallback, operands, c, epilogue,
        );
    }
    record_simt(gpu, pools, shape, algorithm, variant, operands, c, epilogue)
}

#[allow(clippy::too_many_arguments)]
fn record_simt(
    gpu: &Gpu,
    pools: Pools,
    shape: &MatmulShape,
    algorithm: &Algorithm,
    variant: MatmulVariant,
    OnDevice { a, b, stored }: OnDevice,
    c: Region,
    epilogue: Option<&Epilogue>,
) -> Result<MatmulRun> {
    let mut run = MatmulRun {
        clears: vec![],
        dispatches: vec![],
        product: vec![],
        c,
        temporaries: vec![],
        scratch: vec![],
        variant,
        given_scales: None,
        columns_summed: false,
    };
    let scales = fp8_scales(gpu, pools, shape, algorithm, a, b, &mut run)?;
    let scale_buffer = scales.as_ref().map(|s| s.scales.clone());
    let bound = epilogue
        .map(|e| BoundEpilogue::of(gpu, pools, e, &mut run))
        .transpose()?;
    simt(
        gpu,
        pools,
        shape,
        algorithm,
        variant,
        (a, b),
        stored,
        &scales,
        match &scale_buffer {
            Some(s) => s,
            None => a,
        },
        None,
        bound.as_ref(),
        &mut run,
    )?;
    if let Some(s) = scales {
        run.temporaries.extend([s.scales, s.amax_bits]);
    }
    Ok(run)
}

/// Records the SIMT kernel (`matmul.wgsl`) on prepared operands into `run.c`; with `flags`,
/// the masked fallback of the cooperative kernel.
#[allow(clippy::too_many_arguments)]
fn simt(
    gpu: &Gpu,
    pools: Pools,
    shape: &MatmulShape,
    algorithm: &Algorithm,
    variant: MatmulVariant,
    (a, b): (&Region, &Region),
    stored: [Format; 2],
    scales: &Option<Scales>,
    scale_buffer: &dyn Bind,
    flags: Option<&wgpu::Buffer>,
    epilogue: Option<&BoundEpilogue>,
    run: &mut MatmulRun,
) -> Result<()> {
    // Checked modules get the K step written out: it is what keeps them fast.
    let variant = variant
        .with_unrolled(gpu.runtime_checks)
        .with_store(epilogue.map_or(Store::Plain, |e| e.store));
    // B's column sums, where asked and the kernel can: one matrix (their plane row is row m).
    let sums = epilogue
        .and_then(|e| e.column_sums.as_ref())
        .filter(|_| variant.can_sum_columns() && shape.batch == 1);
    let variant = variant.with_column_sums(sums.is_some());
    run.columns_summed = sums.is_some();
    let pa = prepare(
        gpu,
        pools,
        shape,
        algorithm,
        Side::A,
        (variant.a, stored[0]),
        a,
        scales,
        run,
    )?;
    let pb = prepare(
        gpu,
        pools,
        shape,
        algorithm,
        Side::B,
        (variant.b, stored[1]),
        b,
        scales,
        run,
    )?;
    // Quad loads along the dimension each operand is contiguous in, where its kind and sizes
    // allow: chosen with the prepared buffers in hand.
    let loads = [
        Load::for_operand(
            variant.a,
            !shape.a_transposed,
            if shape.a_transposed { shape.m } else { shape.k },
            pa.buffer.size,
            variant.tile,
        ),
        Load::for_operand(
            variant.b,
            shape.b_transposed,
            if shape.b_transposed { shape.k } else { shape.n },
            pb.buffer.size,
            variant.tile,
        ),
    ];
    // The loads now say what the tile's `quad_blocks` asked: one kernel either way.
    let variant = variant
        .with_loads(loads)
        .with_tile(variant.tile.with_quad_blocks(false));
    // The split is the dispatches', not the kernel's: one pipeline whatever the splits.
    let splits = variant.tile.splits;
    let variant = variant.with_tile(variant.tile.with_splits(1));
    let pipeline = gpu.pipeline(&Kernel::Matmul(variant))?;
    let (m, n, k) = (shape.m as u32, shape.n as u32, shape.k as u32);
    let (a_row, a_col) = if shape.a_transposed { (1, m) } else { (k, 1) };
    let (b_row, b_col) = if shape.b_transposed { (1, k) } else { (n, 1) };
    let rowwise = matches!(algorithm.scaling(), Some(Scaling::Rowwise));
    let (sa_batch, sb_batch) = if rowwise { (m, n) } else { (1, 1) };
    let levels = variant.level_count();
    let batch = shape.batch as u32;
    // A split's planes hold the column sums' groups in one more row.
    let plane = shape.c_len() as u64 + if sums.is_some() { u64::from(n) } else { 0 };
    let params = MatmulParams {
        m,
        n,
        k,
        k_begin: 0,
        a_batch: m * k,
        a_row,
        a_col,
        a_plane: pa.plane as u32,
        b_batch: k * n,
        b_row,
        b_col,
        b_plane: pb.plane as u32,
        c_batch: m * n,
        sa_batch,
        sb_batch,
        sb_offset: batch * sa_batch,
        b_lines: batch * m,
        k_end: k,
        mode: MODE_SUM,
        partial_plane: plane as u32,
        split_groups: 0,
        batches: batch,
        planes: 0,
        _pad: 0,
        epi: epilogue.map_or([0; 4], |e| e.epi),
        epi2: epilogue.map_or([0; 4], |e| e.epi2),
    };
    let tiles = [n.div_ceil(variant.tile.bn), m.div_ceil(variant.tile.bm)];
    let dispatch = |params: MatmulParams, partials: &wgpu::Buffer, z: u32, run: &mut MatmulRun| {
        let uniform = buffer::uniform(gpu, &params);
        let mut buffers: Vec<&dyn Bind> =
            vec![&uniform, &pa.buffer, &pb.buffer, &run.c, scale_buffer];
        buffers.push(partials);
        buffers.extend(flags.map(|f| f as &dyn Bind));
        if let Some(e) = epilogue {
            buffers.extend(e.buffers.iter().map(|b| b as &dyn Bind));
        }
        buffers.extend(sums.map(|s| s as &dyn Bind));
        run.product.push(run.dispatches.len());
        run.dispatches.push(Dispatch::new(
            gpu,
            pipeline.clone(),
            &buffers,
            [tiles[0], tiles[1], z],
        ));
    };
    match split_k(
        gpu,
        &variant.with_tile(variant.tile.with_splits(splits)),
        k,
        plane,
        batch,
    ) {
        Some(sk) => {
            // Each split's groups into their planes, then the planes added in group order.
            let bytes = u64::from(sk.planes) * u64::from(levels) * plane * 4;
            check_binding(gpu, "split-K's group planes", bytes)?;
            let planes = pools.scratch.take(gpu, bytes)?;
            run.scratch.push(planes.clone());
            let split = MatmulParams {
                mode: MODE_SPLIT,
                split_groups: sk.split_groups,
                ..params
            };
            dispatch(split, &planes, sk.splits * batch, run);
            let reduce = MatmulParams {
                mode: MODE_REDUCE,
                planes: sk.planes,
                ..params
            };
            dispatch(reduce, &planes, batch, run);
        }
        None => {
            // The running totals of levels 1.. between groups (level 0's are in C, but where C
            // holds codes).
            let spans = k_spans(gpu, &variant, k)?;
            let in_c = u32::from(!variant.store.coded());
            let totals = running_totals(gpu, pools, k, levels - in_c, plane, run)?;
            for &(k_begin, k_end) in &spans {
                let span = MatmulParams {
                    k_begin,
                    k_end,
                    ..params
                };
                dispatch(span, &totals, batch, run);
            }
        }
    }
    run.scratch.extend(
        [pa, pb]
            .into_iter()
            .filter(|p| p.pooled)
            .map(|p| p.buffer.buffer),
    );
    Ok(())
}

/// Records the cooperative-matrix matmul (`coop_pack.wgsl`, `matmul_coop.wgsl`): both operands
/// packed to padded f16 (scaled bf16 planes with per-line flags, or f16(x)), the cooperative
/// kernel, and for scaled operands the masked SIMT kernel for the flagged lines.
#[allow(clippy::too_many_arguments)]
fn record_coop(
    gpu: &Gpu,
    pools: Pools,
    shape: &MatmulShape,
    algorithm: &Algorithm,
    variant: MatmulVariant,
    fallback: bool,
    OnDevice { a, b, stored }: OnDevice,
    c: Region,
    epilogue: Option<&Epilogue>,
) -> Result<MatmulRun> {
    let variant = variant.with_store(epilogue.map_or(Store::Plain, |e| e.store()));
    let tile = variant.tile;
    let (m, n, k, batch) = (
        shape.m as u32,
        shape.n as u32,
        shape.k as u32,
        shape.batch as u32,
    );
    let (mp, np, kp) = (
        m.next_multiple_of(tile.bm),
        n.next_multiple_of(tile.bn),
        k.next_multiple_of(tile.bk),
    );
    let mut run = MatmulRun {
        clears: vec![],
        dispatches: vec![],
        product: vec![],
        c,
        temporaries: vec![],
        scratch: vec![],
        variant,
        given_scales: None,
        columns_summed: false,
    };
    let bound = epilogue
        .map(|e| BoundEpilogue::of(gpu, pools, e, &mut run))
        .transpose()?;
    let scaled = variant.scaled();
    let lines = if scaled { batch * (m + n) } else { 1 };
    let amax_bits = pools.kept.take(gpu, lines as u64 * 4)?;
    // One bit per line.
    let flags = pools.kept.take(gpu, lines.div_ceil(32) as u64 * 4)?;
    // Unscaled f16 operands use neither (f16(x) flags no line).
    if scaled {
        run.clears.extend([amax_bits.clone(), flags.clone()]);
        let (ga, gb) = groupings(shape, Scaling::Rowwise);
        let (ga, gb) = operand_groups(shape, (a, b), stored, (ga, gb));
        run.dispatches
            .push(cast::amax(gpu, &amax_bits, ga, Some(gb))?);
    }
    let parts = if scaled { variant.parts } else { 0 };
    let planes = parts.max(1);
    let (a_row, a_col) = if shape.a_transposed { (1, m) } else { (k, 1) };
    let a_words = batch * mp * kp / 2;
    let pack_a = PackParams {
        rows: m,
        cols: k,
        rows_p: mp,
        cols_p: kp,
        src_batch: m * k,
        src_row: a_row,
        src_col: a_col,
        plane_words: a_words,
        words: a_words,
        parts,
        by_row: 1,
        line_offset: 0,
        src_format: format_id(stored[0]),
        pad: [0; 3],
    };
    let (b_row, b_col) = if shape.b_transposed { (1, k) } else { (n, 1) };
    let b_words = batch * kp * np / 2;
    let pack_b = PackParams {
        rows: k,
        cols: n,
        rows_p: kp,
        cols_p: np,
        src_batch: k * n,
        src_row: b_row,
        src_col: b_col,
        plane_words: b_words,
        words: b_words,
        parts,
        by_row: 0,
        line_offset: batch * m,
        src_format: format_id(stored[1]),
        pad: [0; 3],
    };
    // Both operands' planes in one dispatch, A's words first.
    let planes_of = |params: &PackParams, what: &str| {
        let bytes = u64::from(planes) * u64::from(params.plane_words) * 4;
        check_binding(gpu, what, bytes)?;
        pools.plane(gpu, bytes)
    };
    let pa = planes_of(&pack_a, "operand A as padded f16")?;
    let pb = planes_of(&pack_b, "operand B as padded f16")?;
    let uniform = buffer::uniform(gpu, &[pack_a, pack_b]);
    run.dispatches.push(Dispatch::new(
        gpu,
        gpu.pipeline(&Kernel::CoopPack)?,
        &[&uniform, a, &pa, &amax_bits, &flags, b, &pb],
        Dispatch::element_groups(gpu, (a_words + b_words) as usize)?,
    ));
    let partial_plane = u64::from(batch * mp * np);
    let levels = variant.level_count();
    let params = CoopParams {
        m,
        n,
        k,
        kp,
        mp,
        np,
        a_plane: 2 * a_words,
        b_plane: 2 * b_words,
        c_batch: m * n,
        b_lines: batch * m,
        k_begin: 0,
        k_end: kp,
        mode: MODE_SUM,
        partial_plane: partial_plane as u32,
        split_groups: 0,
        batches: batch,
        planes: 0,
        _pad: [0; 3],
        epi: bound.as_ref().map_or([0; 4], |e| e.epi),
        epi2: bound.as_ref().map_or([0; 4], |e| e.epi2),
    };
    // The split is the dispatches', not the kernel's: one pipeline whatever the splits.
    let pipeline = gpu.pipeline(&Kernel::Matmul(variant.with_tile(tile.with_splits(1))))?;
    let dispatch = |params: CoopParams, partials: &wgpu::Buffer, z: u32, run: &mut MatmulRun| {
        let uniform = buffer::uniform(gpu, &params);
        run.product.push(run.dispatches.len());
        let mut buffers: Vec<&dyn Bind> =
            vec![&uniform, &pa, &pb, &run.c, &amax_bits, partials, &flags];
        if let Some(e) = &bound {
            buffers.extend(e.buffers.iter().map(|b| b as &dyn Bind));
        }
        run.dispatches.push(Dispatch::new(
            gpu,
            pipeline.clone(),
            &buffers,
            [np / tile.bn, mp / tile.bm, z],
        ));
    };
    match split_k(gpu, &variant, kp, partial_plane, batch) {
        Some(sk) => {
            let bytes = u64::from(sk.planes) * u64::from(levels) * partial_plane * 4;
            check_binding(gpu, "split-K's group planes", bytes)?;
            let planes = pools.scratch.take(gpu, bytes)?;
            run.scratch.push(planes.clone());
            let split = CoopParams {
                mode: MODE_SPLIT,
                split_groups: sk.split_groups,
                ..params
            };
            dispatch(split, &planes, sk.splits * batch, &mut run);
            let reduce = CoopParams {
                mode: MODE_REDUCE,
                planes: sk.planes,
                ..params
            };
            dispatch(reduce, &planes, batch, &mut run);
        }
        None => {
            // Every level's running totals between groups.
            let totals = running_totals(gpu, pools, kp, levels, partial_plane, &mut run)?;
            for (k_begin, k_end) in k_spans(gpu, &variant, kp)? {
                let span = CoopParams {
                    k_begin,
                    k_end,
                    ..params
                };
                dispatch(span, &totals, batch, &mut run);
            }
        }
    }
    run.scratch.extend([pa, pb]);
    if scaled && fallback {
        simt(
            gpu,
            pools,
            shape,
            algorithm,
            variant.fallback_for(stored),
            (a, b),
            stored,
            &None,
            &amax_bits,
            Some(&flags),
            bound.as_ref(),
            &mut run,
        )?;
    }
    run.temporaries.extend([amax_bits, flags]);
    Ok(run)
}

/// A matmul's operands as scale.wgsl's kernels take them: each its groups, B's after A's.
fn operand_groups<'a>(
    shape: &MatmulShape,
    (a, b): (&'a dyn Bind, &'a dyn Bind),
    stored: [Format; 2],
    (ga, gb): (Grouping, Grouping),
) -> (cast::Grouped<'a>, cast::Grouped<'a>) {
    let a = cast::Grouped {
        src: a,
        stored: stored[0],
        len: shape.a_len(),
        grouping: ga,
        offset: 0,
    };
    let b = cast::Grouped {
        src: b,
        stored: stored[1],
        len: shape.b_len(),
        grouping: gb,
        offset: ga.groups(),
    };
    (a, b)
}

/// K (the padded K on cooperative matrices) as the spans the kernel's dispatches sum, each
/// within the adapter's loop budget (budget.rs): all of it in one where there is no budget.
pub fn k_spans(gpu: &Gpu, variant: &MatmulVariant, k: u32) -> Result<Vec<(u32, u32)>> {
    let loops = variant.k_loops();
    let what = format!("{} over K = {k}", Kernel::Matmul(*variant).label());
    let units = k.div_ceil(loops.unit_k);
    let ranges = gpu.loop_ranges(&what, loops.fixed, loops.per_unit, units.into())?;
    let at = |unit: u64| (unit as u32).saturating_mul(loops.unit_k).min(k);
    Ok(ranges
        .into_iter()
        .map(|(begin, end)| (at(begin), at(end)))
        .collect())
}

/// The buffer where `levels` planes of `plane` running totals wait between groups of K: from the
/// scratch pool (written and read within the run's dispatches) where K has more than one group
/// and there are any, else a word to bind in its place.
fn running_totals(
    gpu: &Gpu,
    pools: Pools,
    k: u32,
    levels: u32,
    plane: u64,
    run: &mut MatmulRun,
) -> Result<wgpu::Buffer> {
    let groups = k > GROUP_K && levels > 0;
    let buffer = if groups {
        let bytes = u64::from(levels) * plane * 4;
        check_binding(gpu, "the running totals between groups of K", bytes)?;
        pools.scratch.take(gpu, bytes)?
    } else {
        pools.kept.take(gpu, 4)?
    };
    if groups {
        run.scratch.push(buffer.clone());
    } else {
        run.temporaries.push(buffer.clone());
    }
    Ok(buffer)
}

struct Scales {
    scales: wgpu::Buffer,
    amax_bits: wgpu::Buffer,
}

/// fp8 scales for both operands: A's groups first, then B's. Current scaling computes them on
/// the device (amax, then FMAX / amax); given scales are uploaded.
fn fp8_scales(
    gpu: &Gpu,
    pools: Pools,
    shape: &MatmulShape,
    algorithm: &Algorithm,
    a: &Region,
    b: &Region,
    run: &mut MatmulRun,
) -> Result<Option<Scales>> {
    let Algorithm::Fp8 {
        a: fa,
        b: fb,
        scaling,
    } = *algorithm
    else {
        return Ok(None);
    };
    let (ga, gb) = groupings(shape, scaling);
    let total = ga.groups() + gb.groups();
    let amax_bits = pools.kept.take(gpu, total as u64 * 4)?;
    if let Scaling::Given { a: sa, b: sb } = scaling {
        let mut values = vec![sa.to_bits(); ga.groups()];
        values.extend(std::iter::repeat_n(sb.to_bits(), gb.groups()));
        let scales = upload(gpu, "mantissa.scales", &values);
        run.given_scales = Some((scales.clone(), ga.groups(), gb.groups()));
        return Ok(Some(Scales { scales, amax_bits }));
    }
    let scales = pools.kept.take(gpu, total as u64 * 4)?;
    run.clears.push(amax_bits.clone());
    let f32_ = [Format::F32; 2];
    let (ga, gb) = operand_groups(shape, (a, b), f32_, (ga, gb));
    let both = (&amax_bits, &scales);
    run.dispatches
        .extend(cast::current_scales(gpu, both, (ga, fa), Some((gb, fb)))?);
    Ok(Some(Scales { scales, amax_bits }))
}

/// Scale groups of the stored A and B: per batch (tensorwise, given), or per logical row of A
/// and logical column of B (rowwise), whatever the transposition.
fn groupings(shape: &MatmulShape, scaling: Scaling) -> (Grouping, Grouping) {
    let (m, n, k) = (shape.m, shape.n, shape.k);
    match scaling {
        Scaling::Rowwise => (
            // A stored m x k (rows are rows) or k x m (rows are columns).
            if shape.a_transposed {
                Grouping::per_line(shape.batch, k, m, false)
            } else {
                Grouping::per_line(shape.batch, m, k, true)
            },
            // B stored k x n (columns are columns) or n x k (columns are rows).
            if shape.b_transposed {
                Grouping::per_line(shape.batch, n, k, true)
            } else {
                Grouping::per_line(shape.batch, k, n, false)
            },
        ),
        _ => (
            Grouping::per_batch(shape.batch, m * k),
            Grouping::per_batch(shape.batch, k * n),
        ),
    }
}

/// Converts one f32 operand into the storage the kernel reads.
#[allow(clippy::too_many_arguments)]
fn prepare(
    gpu: &Gpu,
    pools: Pools,
    shape: &MatmulShape,
    algorithm: &Algorithm,
    side: Side,
    (operand, stored): (Operand, Format),
    src: &Region,
    scales: &Option<Scales>,
    run: &mut MatmulRun,
) -> Result<Prepared> {
    let len = if side == Side::A {
        shape.a_len()
    } else {
        shape.b_len()
    };
    let (fa, fb) = algorithm.operand_formats();
    let format = if side == Side::A { fa } else { fb };
    check_binding(gpu, side.name(), packed_words(stored, len) as u64 * 4)?;
    if algorithm.is_split() {
        let parts = algorithm.split_parts();
        let bytes = (parts * packed_words(format, len)) as u64 * 4;
        check_binding(
            gpu,
            &format!("{} as {parts} bf16 planes", side.name()),
            bytes,
        )?;
        let dst = pools.plane(gpu, bytes)?;
        let (dispatch, plane_words) = cast::split_bf16(gpu, src, &dst, len, parts)?;
        run.dispatches.push(dispatch);
        return Ok(Prepared {
            buffer: Region::whole(&dst),
            plane: plane_words * 2,
            pooled: true,
        });
    }
    match operand {
        // f32 is read as is; tf32 (and bf16 for the cooperative kernel's fallback) is rounded
        // as it is read.
        Operand::F32 | Operand::Tf32 | Operand::Bf16Rounded | Operand::F16Rounded => Ok(Prepared {
            buffer: src.clone(),
            plane: 0,
            pooled: false,
        }),
        // Stored as the codes it reads (record checked the format).
        Operand::Bf16 | Operand::F16(_) if stored != Format::F32 => Ok(Prepared {
            buffer: src.clone(),
            plane: 0,
            pooled: false,
        }),
        Operand::Bf16 | Operand::F16(_) => {
            let bytes = packed_words(format, len) as u64 * 4;
            let dst = pools.plane(gpu, bytes)?;
            run.dispatches
                .push(cast::encode(gpu, src, &dst, len, format, false)?);
            Ok(Prepared {
                buffer: Region::whole(&dst),
                plane: 0,
                pooled: true,
            })
        }
        Operand::Fp8(_) => {
            let bytes = packed_words(format, len) as u64 * 4;
            let dst = pools.plane(gpu, bytes)?;
            let (ga, gb) = groupings(shape, algorithm.scaling().unwrap_or_default());
            let (grouping, offset) = if side == Side::A {
                (ga, 0)
            } else {
                (gb, ga.groups())
            };
            let scales: &dyn Bind = match scales {
                Some(s) => &s.scales,
                None => src,
            };
            run.dispatches.push(cast::quantize(
                gpu, src, &dst, scales, len, format, grouping, offset,
            )?);
            Ok(Prepared {
                buffer: Region::whole(&dst),
                plane: 0,
                pooled: true,
            })
        }
    }
}

#[cfg(test)]
mod uniform_layout {
    use super::*;
    use crate::backend::wgpu::shaders::assert_uniform_layout;

    /// Each uniform struct here is its kernel's, member for member (`assert_uniform_layout`).
    #[test]
    fn uniforms_match_their_wgsl_structs() {
        assert_uniform_layout!(
            "matmul.wgsl",
            MatmulParams {
                m,
                n,
                k,
                k_begin,
                a_batch,
                a_row,
                a_col,
                a_plane,
                b_batch,
                b_row,
                b_col,
                b_plane,
                c_batch,
                sa_batch,
                sb_batch,
                sb_offset,
                b_lines,
                k_end,
                mode,
                partial_plane,
                split_groups,
                batches,
                planes,
                epi,
                epi2
            }
        );
        assert_uniform_layout!(
            "matmul_coop.wgsl",
            CoopParams {
                m,
                n,
                k,
                kp,
                mp,
                np,
                a_plane,
                b_plane,
                c_batch,
                b_lines,
                k_begin,
                k_end,
                mode,
                partial_plane,
                split_groups,
                batches,
                planes,
                epi,
                epi2
            }
        );
        assert_uniform_layout!(
            "coop_pack.wgsl",
            PackParams {
                rows,
                cols,
                rows_p,
                cols_p,
                src_batch,
                src_row,
                src_col,
                plane_words,
                words,
                parts,
                by_row,
                line_offset,
                src_format
            }
        );
    }
}
