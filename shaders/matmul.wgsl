// matmul.wgsl: C = op(A) . op(B) for every algorithm, tiled in workgroup memory with a 4x4 or
// 8x8 register block per invocation. Needs formats.wgsl.
//
// The loader (src/backend/wgpu/shaders.rs) splices in, per variant:
//   const BM, BN, BK: u32       workgroup tile (BM x BN outputs, BK of the inner dimension)
//   const BUFFERS: u32          workgroup buffers per operand tile: 1, or 2 (the next K step
//                               loads into one while the other is multiplied)
//   const REG: u32              outputs per invocation: REG x REG, 4 or 8 (8 only for
//                               LEVELS <= 1): four 4x4 blocks, rows (columns) BM/2 (BN/2) apart
//   const PARTS: u32            operand planes: 1, or 2/3 bf16 planes (h, m, l) for split
//   const LEVELS: u32           split levels: 0 (no split), 2 (bf16x3), 3 (bf16x6), 5 (bf16x9)
//   const FP8: bool, ROWWISE: bool
//   alias A_T, B_T              element type of the operand arrays (u32, f16 natively, or
//                               vec4<u32> for an operand loaded in quads)
//   const A_LOAD, B_LOAD: u32   how each operand's tile is loaded: LOAD_SCALAR (element by
//                               element), LOAD_K (four consecutive k in one load: A row-major,
//                               B transposed; K a multiple of 4), LOAD_K_BLOCKS (as LOAD_K, four
//                               lines at a time, stored as vec4s) or LOAD_LINES (four consecutive
//                               rows of A / columns of B in one load: A transposed, B row-major;
//                               M / N a multiple of 4); quads only for one-plane f32 and tf32
//   fn fetch_a(idx: u32) -> f32 and fn fetch_b(idx: u32) -> f32: decode one stored element;
//   fn fetch_a4(quad: u32) -> vec4<f32>, fetch_b4: four, from one quad (fetch.wgsl)
//   const EPILOGUE: bool, fn epilogue(e, col, v) -> f32: a fused bias add in the store
//                               (epilogue.wgsl, spliced after this file where EPILOGUE)
//   const CODED: bool, alias C_T, fn store_codes: C stored as 16-bit codes two a word
//                               (epilogue.wgsl; C_T u32), else f32 values (C_T f32)
//   const COLUMN_SUMS: bool, fn column_total(col) -> f32, fn set_column_total(col, v): B's
//                               column sums as well, and their binding (below)
//   const MASKED: bool, fn flagged(line: u32) -> bool: as the fallback of the cooperative-matrix
//                               kernel, compute only outputs whose row of A or column of B is
//                               flagged (coop_pack.wgsl); the flags are binding 6
//   const GROUP_K: u32          the summation group (below)
//   the pieces of matmul_step.wgsl: the accumulators (a vec4 per row of each 4x4 block and
//   level) and fn zero_accumulators, fn k_step_0 (and k_step_1 with two buffers: one K step out
//   of its buffer into the accumulators; written out per k for checked modules, so that their
//   hot code has no loop counter and no bounds clamp that varies with k), fn k_loop (the K
//   steps of one group, loads and barriers included), fn store_tiles, fn add_totals and
//   fn store_totals (a group's sums added to and stored as the running totals), fn store_plane
//   and fn load_planes (a group's sums into its plane; the planes summed in order)
// Workgroup size is (BN / REG, BM / REG).
//
// Summation order (docs/design.md): K is summed in groups of GROUP_K terms, each output's group
// from zero in its accumulators (in k order), and the groups' sums are added in order: the
// running total after group g is (total after g - 1) + (group g's sums), held between groups
// in memory (level 0 in C, level l > 0 in `partials` at (l - 1) * partial_plane; where C is
// CODED, level 0's after them, since codes cannot carry a running total). A dispatch
// sums the groups of its span [k_begin, k_end) of K (MODE_SUM): all of K, unless the adapter's
// loop budget (src/backend/wgpu/budget.rs) splits it over dispatches, at group boundaries. A
// split-K product (MODE_SPLIT) gives each of `splits` workgroups of an output tile
// `split_groups` groups (z = split * batches + batch), each group's sums stored in its own
// plane (plane g, level l at (g * levels + l) * partial_plane); then MODE_REDUCE adds the
// planes in group order, the additions the running total makes, and finishes. So spans and
// splits change no bit: every tile and split computes the same function.
struct MatmulParams {
    m: u32,
    n: u32,
    k: u32,
    // This dispatch's span of K (a multiple of BK, but for the end of K).
    k_begin: u32,
    // Element strides of the logical A (batch, row i, column p), and the plane stride.
    a_batch: u32,
    a_row: u32,
    a_col: u32,
    a_plane: u32,
    // Element strides of the logical B (batch, row p, column j), and the plane stride.
    b_batch: u32,
    b_row: u32,
    b_col: u32,
    b_plane: u32,
    c_batch: u32,
    // fp8 scales: A's at scales[batch * sa_batch + (row or 0)], B's at
    // scales[sb_offset + batch * sb_batch + (column or 0)].
    sa_batch: u32,
    sb_batch: u32,
    sb_offset: u32,
    // MASKED: where B's lines start in the flags (A's lines: batch * m + row).
    b_lines: u32,
    k_end: u32,
    // MODE_SUM, MODE_SPLIT or MODE_REDUCE (above).
    mode: u32,
    // Elements of a level's totals (all of C's batches).
    partial_plane: u32,
    // MODE_SPLIT: the groups each split sums; z is split * batches + batch.
    split_groups: u32,
    batches: u32,
    // MODE_REDUCE: the group planes to add.
    planes: u32,
    _pad: u32,
    // EPILOGUE: the fused bias add's formats and flags (epilogue.wgsl).
    epi: vec4<u32>,
    epi2: vec4<u32>,
}

const MODE_SUM: u32 = 0u;
const MODE_SPLIT: u32 = 1u;
const MODE_REDUCE: u32 = 2u;

@group(0) @binding(0) var<uniform> params: MatmulParams;
@group(0) @binding(1) var<storage, read> a_data: array<A_T>;
@group(0) @binding(2) var<storage, read> b_data: array<B_T>;
@group(0) @binding(3) var<storage, read_write> c_data: array<C_T>;
@group(0) @binding(4) var<storage, read> scales: array<f32>;
// The running totals of levels 1.. between groups of K, or the group planes of a split-K
// product (a word where there are none).
@group(0) @binding(5) var<storage, read_write> partials: array<f32>;

const WG_X: u32 = BN / REG;
const WG_Y: u32 = BM / REG;
const THREADS: u32 = WG_X * WG_Y;
// Exactly the largest finite f32 (Tint rejects decimal literals that round up to it).
const F32_MAX: f32 = 0x1.fffffep+127f;

// [(buffer * PARTS + part) * BK + kk][i / 4]: four consecutive rows (columns) of one k as a
// vec4. Indexed by a constant first, so a checked module clamps only the invocation's own row
// (column) block.
var<workgroup> a_tile: array<array<vec4<f32>, BM / 4u>, BUFFERS * PARTS * BK>;
var<workgroup> b_tile: array<array<vec4<f32>, BN / 4u>, BUFFERS * PARTS * BK>;
// MASKED: whether any line of this workgroup's tile is flagged.
var<workgroup> tile_hits: atomic<u32>;
var<workgroup> tile_flagged: u32;

// The lower split levels use 0 where h is not finite, so only L0 sees inf/NaN.
fn finite_or_zero(h: vec4<f32>) -> vec4<f32> {
    return select(vec4<f32>(0.0), h, abs(h) <= vec4<f32>(F32_MAX));
}

// acc / (sa * sb) without an intermediate overflow or underflow: the scales' mantissas divide
// acc (a factor in [1, 4)), their exponents are applied in two halves, so the intermediate
// leaves f32's range only when the result does.
fn unscale(acc: f32, sa: f32, sb: f32) -> f32 {
    let fa = frexp(sa);
    let fb = frexp(sb);
    let x = acc / (fa.fract * fb.fract);
    let total = -(fa.exp + fb.exp);
    let half = total / 2;
    return ldexp(ldexp(x, half), total - half);
}

// Where this workgroup's tile and batch start in A, B and C.
struct Origin {
    batch: u32,
    row0: u32,
    col0: u32,
    a_base: u32,
    b_base: u32,
}

const LOAD_SCALAR: u32 = 0u;
const LOAD_K: u32 = 1u;
const LOAD_LINES: u32 = 2u;
const LOAD_K_BLOCKS: u32 = 3u;

// Slots of the A and B tiles a K step loads: four lines at one k each, or with LOAD_K_BLOCKS
// four lines by four k.
const A_SLOTS: u32 = select(BM * BK / 4u, BM * BK / 16u, A_LOAD == LOAD_K_BLOCKS);
const B_SLOTS: u32 = select(BN * BK / 4u, BN * BK / 16u, B_LOAD == LOAD_K_BLOCKS);

// Four rows of A from `row` on at column p of plane offset `plane` (0 outside A). Written
// out, like everything the K step runs, so that checked modules add no loop counter.
fn a_rows(o: Origin, row: u32, p: u32, plane: u32) -> vec4<f32> {
    var v = vec4<f32>();
    if (p < params.k) {
        let base = o.a_base + p * params.a_col + plane;
        // A transposed, M a multiple of 4: the four rows are one aligned quad (a_row is 1).
        if (A_LOAD == LOAD_LINES && row < params.m) {
            return fetch_a4((base + row) >> 2u);
        }
        if (row < params.m) {
            v.x = fetch_a(base + row * params.a_row);
        }
        if (row + 1u < params.m) {
            v.y = fetch_a(base + (row + 1u) * params.a_row);
        }
        if (row + 2u < params.m) {
            v.z = fetch_a(base + (row + 2u) * params.a_row);
        }
        if (row + 3u < params.m) {
            v.w = fetch_a(base + (row + 3u) * params.a_row);
        }
    }
    return v;
}

// Four columns of B from `col` on at row p of plane offset `plane` (0 outside B).
fn b_cols(o: Origin, col: u32, p: u32, plane: u32) -> vec4<f32> {
    var v = vec4<f32>();
    if (p < params.k) {
        let base = o.b_base + p * params.b_row + plane;
        // B row-major, N a multiple of 4: the four columns are one aligned quad (b_col is 1).
        if (B_LOAD == LOAD_LINES && col < params.n) {
            return fetch_b4((base + col) >> 2u);
        }
        if (col < params.n) {
            v.x = fetch_b(base + col * params.b_col);
        }
        if (col + 1u < params.n) {
            v.y = fetch_b(base + (col + 1u) * params.b_col);
        }
        if (col + 2u < params.n) {
            v.z = fetch_b(base + (col + 2u) * params.b_col);
        }
        if (col + 3u < params.n) {
            v.w = fetch_b(base + (col + 3u) * params.b_col);
        }
    }
    return v;
}

// Slot t of the A tile (t < A_SLOTS) into the buffer starting at `at`: four rows at one k,
// a vec4 per plane. Consecutive slots take consecutive k (contiguous for row-major A).
fn load_a(o: Origin, k0: u32, t: u32, at: u32) {
    if (t >= A_SLOTS) {
        return;
    }
    if (A_LOAD == LOAD_K) {
        load_a_quads(o, k0, t, at);
        return;
    }
    if (A_LOAD == LOAD_K_BLOCKS) {
        load_a_blocks(o, k0, t, at);
        return;
    }
    let i4 = t / BK;
    let kk = t % BK;
    let row = o.row0 + i4 * 4u;
    a_tile[at + kk][i4] = a_rows(o, row, k0 + kk, 0u);
    if (PARTS > 1u) {
        a_tile[at + BK + kk][i4] = a_rows(o, row, k0 + kk, params.a_plane);
    }
    if (PARTS > 2u) {
        a_tile[at + 2u * BK + kk][i4] = a_rows(o, row, k0 + kk, 2u * params.a_plane);
    }
}

// Slot t of the B tile (t < B_SLOTS): four columns at one k. Consecutive slots take
// consecutive columns (contiguous for row-major B).
fn load_b(o: Origin, k0: u32, t: u32, at: u32) {
    if (t >= B_SLOTS) {
        return;
    }
    if (B_LOAD == LOAD_K) {
        load_b_quads(o, k0, t, at);
        return;
    }
    if (B_LOAD == LOAD_K_BLOCKS) {
        load_b_blocks(o, k0, t, at);
        return;
    }
    let j4 = t % (BN / 4u);
    let kk = t / (BN / 4u);
    let col = o.col0 + j4 * 4u;
    b_tile[at + kk][j4] = b_cols(o, col, k0 + kk, 0u);
    if (PARTS > 1u) {
        b_tile[at + BK + kk][j4] = b_cols(o, col, k0 + kk, params.b_plane);
    }
    if (PARTS > 2u) {
        b_tile[at + 2u * BK + kk][j4] = b_cols(o, col, k0 + kk, 2u * params.b_plane);
    }
}

// LOAD_K: slot t of the A tile holds four consecutive k of one row, read as one aligned quad
// (K is a multiple of 4, so a quad is inside A or past its K whole) and spread over four k of
// the tile. Consecutive slots take consecutive quads of a row.
fn load_a_quads(o: Origin, k0: u32, t: u32, at: u32) {
    let r = t / (BK / 4u);
    let kk = (t % (BK / 4u)) * 4u;
    let row = o.row0 + r;
    var v = vec4<f32>();
    if (row < params.m && k0 + kk < params.k) {
        v = fetch_a4((o.a_base + row * params.a_row + k0 + kk) >> 2u);
    }
    a_tile[at + kk][r / 4u][r % 4u] = v.x;
    a_tile[at + kk + 1u][r / 4u][r % 4u] = v.y;
    a_tile[at + kk + 2u][r / 4u][r % 4u] = v.z;
    a_tile[at + kk + 3u][r / 4u][r % 4u] = v.w;
}

// LOAD_K for B (transposed): four consecutive k of one column.
fn load_b_quads(o: Origin, k0: u32, t: u32, at: u32) {
    let c = t / (BK / 4u);
    let kk = (t % (BK / 4u)) * 4u;
    let col = o.col0 + c;
    var v = vec4<f32>();
    if (col < params.n && k0 + kk < params.k) {
        v = fetch_b4((o.b_base + col * params.b_col + k0 + kk) >> 2u);
    }
    b_tile[at + kk][c / 4u][c % 4u] = v.x;
    b_tile[at + kk + 1u][c / 4u][c % 4u] = v.y;
    b_tile[at + kk + 2u][c / 4u][c % 4u] = v.z;
    b_tile[at + kk + 3u][c / 4u][c % 4u] = v.w;
}

// LOAD_K_BLOCKS: slot t of the A tile holds four rows by four consecutive k, read as four
// aligned quads (one per row, as LOAD_K reads them) and written as four vec4s of the tile, one
// per k: 16-byte stores into workgroup memory, where LOAD_K writes each quad as four scalars.
// Consecutive slots take consecutive quads of the same rows.
fn load_a_blocks(o: Origin, k0: u32, t: u32, at: u32) {
    let i4 = t / (BK / 4u);
    let kk = (t % (BK / 4u)) * 4u;
    let row = o.row0 + i4 * 4u;
    let q0 = a_quad(o, row, k0 + kk);
    let q1 = a_quad(o, row + 1u, k0 + kk);
    let q2 = a_quad(o, row + 2u, k0 + kk);
    let q3 = a_quad(o, row + 3u, k0 + kk);
    a_tile[at + kk][i4] = vec4<f32>(q0.x, q1.x, q2.x, q3.x);
    a_tile[at + kk + 1u][i4] = vec4<f32>(q0.y, q1.y, q2.y, q3.y);
    a_tile[at + kk + 2u][i4] = vec4<f32>(q0.z, q1.z, q2.z, q3.z);
    a_tile[at + kk + 3u][i4] = vec4<f32>(q0.w, q1.w, q2.w, q3.w);
}

// Four consecutive k of A's row `row` from p on (0 outside A).
fn a_quad(o: Origin, row: u32, p: u32) -> vec4<f32> {
    if (row < params.m && p < params.k) {
        return fetch_a4((o.a_base + row * params.a_row + p) >> 2u);
    }
    return vec4<f32>();
}

// LOAD_K_BLOCKS for B (transposed): four columns by four consecutive k.
fn load_b_blocks(o: Origin, k0: u32, t: u32, at: u32) {
    let j4 = t / (BK / 4u);
    let kk = (t % (BK / 4u)) * 4u;
    let col = o.col0 + j4 * 4u;
    let q0 = b_quad(o, col, k0 + kk);
    let q1 = b_quad(o, col + 1u, k0 + kk);
    let q2 = b_quad(o, col + 2u, k0 + kk);
    let q3 = b_quad(o, col + 3u, k0 + kk);
    b_tile[at + kk][j4] = vec4<f32>(q0.x, q1.x, q2.x, q3.x);
    b_tile[at + kk + 1u][j4] = vec4<f32>(q0.y, q1.y, q2.y, q3.y);
    b_tile[at + kk + 2u][j4] = vec4<f32>(q0.z, q1.z, q2.z, q3.z);
    b_tile[at + kk + 3u][j4] = vec4<f32>(q0.w, q1.w, q2.w, q3.w);
}

// Four consecutive k of B's column `col` from p on (0 outside B).
fn b_quad(o: Origin, col: u32, p: u32) -> vec4<f32> {
    if (col < params.n && p < params.k) {
        return fetch_b4((o.b_base + col * params.b_col + p) >> 2u);
    }
    return vec4<f32>();
}

// The K step from k0 on of A and B into the buffer starting at `at` (0, or PARTS * BK for the
// second), a slot per invocation at a time.
fn load_tiles(o: Origin, k0: u32, lindex: u32, at: u32) {
    for (var t = lindex; t < A_SLOTS; t += THREADS) {
        load_a(o, k0, t, at);
    }
    for (var t = lindex; t < B_SLOTS; t += THREADS) {
        load_b(o, k0, t, at);
    }
}

@compute @workgroup_size(WG_X, WG_Y, 1)
fn matmul(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
          @builtin(local_invocation_index) lindex: u32) {
    let batch = wg.z % params.batches;
    let split = wg.z / params.batches;
    let o = Origin(batch, wg.y * BM, wg.x * BN, batch * params.a_batch, batch * params.b_batch);

    if (MASKED) {
        if (lindex == 0u) {
            atomicStore(&tile_hits, 0u);
        }
        workgroupBarrier();
        for (var t = lindex; t < BM + BN; t += THREADS) {
            var hit = false;
            if (t < BM) {
                hit = o.row0 + t < params.m && flagged(batch * params.m + o.row0 + t);
            } else {
                let col = o.col0 + t - BM;
                hit = col < params.n && flagged(params.b_lines + batch * params.n + col);
            }
            if (hit) {
                atomicOr(&tile_hits, 1u);
            }
        }
        workgroupBarrier();
        if (lindex == 0u) {
            tile_flagged = atomicLoad(&tile_hits);
        }
        // Uniform across the workgroup, so the barriers below stay in uniform control flow.
        if (workgroupUniformLoad(&tile_flagged) == 0u) {
            return;
        }
    }

    // 4x4 blocks: this invocation's at (lid.y, lid.x); with REG 8 also WG_Y (WG_X) blocks on.
    let ty = lid.y;
    let tx = lid.x;
    let ty2 = lid.y + WG_Y;
    let tx2 = lid.x + WG_X;
    if (params.mode == MODE_REDUCE) {
        load_planes(o, ty, tx, ty2, tx2);
        store_tiles(o, ty, tx, ty2, tx2);
        load_column_planes(o, lindex);
        store_column_totals(o, lindex, true);
        return;
    }
    var k_begin = params.k_begin;
    var k_end = params.k_end;
    if (params.mode == MODE_SPLIT) {
        k_begin = min(params.k_begin + split * params.split_groups * GROUP_K, params.k_end);
        k_end = min(k_begin + params.split_groups * GROUP_K, params.k_end);
    }
    // The groups of this dispatch's span (or split), in order: at least one in MODE_SUM, whose
    // last dispatch stores C even where K is empty. Everything here is uniform across the
    // workgroup (the parameters and its split), as k_loop's barriers need.
    var g0 = k_begin;
    loop {
        if (params.mode == MODE_SPLIT && g0 >= k_end) {
            break;
        }
        let g1 = min(g0 + GROUP_K, k_end);
        zero_accumulators();
        zero_column_sums();
        k_loop(o, lindex, ty, tx, ty2, tx2, g0, g1);
        if (params.mode == MODE_SPLIT) {
            store_plane(o, g0 / GROUP_K, ty, tx, ty2, tx2);
            store_column_plane(o, lindex, g0 / GROUP_K);
        } else {
            if (g0 != 0u) {
                add_totals(o, ty, tx, ty2, tx2);
                add_column_totals(o, lindex);
            }
            if (g1 >= params.k) {
                store_tiles(o, ty, tx, ty2, tx2);
                store_column_totals(o, lindex, true);
            } else {
                store_totals(o, ty, tx, ty2, tx2);
                store_column_totals(o, lindex, false);
            }
        }
        g0 = g1;
        if (g0 >= k_end) {
            break;
        }
    }
}

// Whether output (row, col) is this kernel's to write: all of them, or (MASKED) those of a
// flagged line.
fn mine(batch: u32, row: u32, col: u32) -> bool {
    return !MASKED || flagged(batch * params.m + row) || flagged(params.b_lines + batch * params.n + col);
}

// Where level `level`'s running totals start in `partials` (level 0's only where C is CODED).
fn total_at(level: u32) -> u32 {
    if (level == 0u) {
        return (max(LEVELS, 1u) - 1u) * params.partial_plane;
    }
    return (level - 1u) * params.partial_plane;
}

// Level `level`'s running totals of row `row` of C from column col_start on, four outputs (0
// outside C).
fn load_partial_row(level: u32, batch: u32, row: u32, col_start: u32) -> vec4<f32> {
    var v = vec4<f32>();
    if (row >= params.m) {
        return v;
    }
    let at = batch * params.c_batch + row * params.n;
    for (var c = 0u; c < 4u; c++) {
        let col = col_start + c;
        if (col < params.n) {
            if (level == 0u && !CODED) {
                v[c] = bitcast<f32>(c_data[at + col]);
            } else {
                v[c] = partials[total_at(level) + at + col];
            }
        }
    }
    return v;
}

// Level `level`'s running totals of four outputs of row `row` from column col_start on, as
// they are (no scales applied), for the next group.
fn store_partial_row(level: u32, batch: u32, row: u32, col_start: u32, v: vec4<f32>) {
    if (row >= params.m) {
        return;
    }
    let at = batch * params.c_batch + row * params.n;
    for (var c = 0u; c < 4u; c++) {
        let col = col_start + c;
        if (col < params.n && mine(batch, row, col)) {
            if (level == 0u && !CODED) {
                c_data[at + col] = bitcast<C_T>(v[c]);
            } else {
                partials[total_at(level) + at + col] = v[c];
            }
        }
    }
}

// Where level `level` of group plane `g` starts in `partials`.
fn plane_at(level: u32, g: u32) -> u32 {
    return (g * max(LEVELS, 1u) + level) * params.partial_plane;
}

// Level `level`'s sums of group `g`, four outputs of row `row` from column col_start on (0
// outside C).
fn load_plane_row(level: u32, g: u32, batch: u32, row: u32, col_start: u32) -> vec4<f32> {
    var v = vec4<f32>();
    if (row >= params.m) {
        return v;
    }
    let at = plane_at(level, g) + batch * params.c_batch + row * params.n;
    for (var c = 0u; c < 4u; c++) {
        let col = col_start + c;
        if (col < params.n) {
            v[c] = partials[at + col];
        }
    }
    return v;
}

// Level `level`'s sums of group `g`, four outputs, into its plane.
fn store_plane_row(level: u32, g: u32, batch: u32, row: u32, col_start: u32, v: vec4<f32>) {
    if (row >= params.m) {
        return;
    }
    let at = plane_at(level, g) + batch * params.c_batch + row * params.n;
    for (var c = 0u; c < 4u; c++) {
        let col = col_start + c;
        if (col < params.n) {
            partials[at + col] = v[c];
        }
    }
}

// Row `row` of C from column col_start on, four outputs: bounds, the MASKED selection and
// fp8 descaling; CODED, two words of codes (col_start is a multiple of 4 and C's rows of even
// length, so each pair is inside C whole or outside it).
fn store_row(batch: u32, row: u32, col_start: u32, v: vec4<f32>) {
    if (row >= params.m) {
        return;
    }
    let at = batch * params.c_batch + row * params.n;
    if (CODED) {
        for (var c = 0u; c < 4u; c += 2u) {
            let col = col_start + c;
            if (col < params.n) {
                let pair = vec2<f32>(descaled(batch, row, col, v[c]), descaled(batch, row, col + 1u, v[c + 1u]));
                store_codes(at + col, col, pair, vec2<bool>(mine(batch, row, col), mine(batch, row, col + 1u)));
            }
        }
        return;
    }
    for (var c = 0u; c < 4u; c++) {
        let col = col_start + c;
        if (col < params.n && mine(batch, row, col)) {
            var out = descaled(batch, row, col, v[c]);
            if (EPILOGUE) {
                out = epilogue(at + col, col, out);
            }
            c_data[at + col] = bitcast<C_T>(out);
        }
    }
}

// Output (row, col)'s sum v, fp8's scales undone.
fn descaled(batch: u32, row: u32, col: u32, v: f32) -> f32 {
    if (!FP8) {
        return v;
    }
    let sa = scales[batch * params.sa_batch + select(0u, row, ROWWISE)];
    let sb = scales[params.sb_offset + batch * params.sb_batch + select(0u, col, ROWWISE)];
    return unscale(v, sa, sb);
}

// COLUMN_SUMS (a weight gradient x^T . dy, one matrix): B's column sums as well, the bias
// gradient beside it (cuBLASLt's BGRADB epilogue), so that dy is not read again for them. Summed
// as every output is (each group of K from zero in k order, the groups' sums added in order):
// each column by one invocation of the workgroups of the first tile row (invocation i takes
// columns i, i + THREADS, ...), from the B tile its K step multiplies (the values the product
// reads); the running totals between groups in `column_sums` itself, a split's group sums in
// row m of its planes (the planes hold one more row), the finished sums held in the format
// params.epi2.z names.
const SUM_COLS: u32 = (BN + THREADS - 1u) / THREADS;
var<private> column_acc: array<f32, SUM_COLS>;

// The tile column of this invocation's c-th sum, where it is one: in a workgroup of the first
// tile row, a column of the tile and of B.
fn sum_column(o: Origin, lindex: u32, c: u32) -> u32 {
    let j = lindex + c * THREADS;
    if (COLUMN_SUMS && o.row0 == 0u && j < BN && o.col0 + j < params.n) {
        return j;
    }
    return BN;
}

fn zero_column_sums() {
    for (var c = 0u; c < SUM_COLS; c++) {
        column_acc[c] = 0.0;
    }
}

// The K step in the buffer starting at `at` into this invocation's column sums, in k order.
fn column_step(o: Origin, lindex: u32, at: u32) {
    for (var c = 0u; c < SUM_COLS; c++) {
        let j = sum_column(o, lindex, c);
        if (j < BN) {
            for (var kk = 0u; kk < BK; kk++) {
                column_acc[c] += b_tile[at + kk][j / 4u][j % 4u];
            }
        }
    }
}

// The running totals the earlier groups left, added to this group's sums.
fn add_column_totals(o: Origin, lindex: u32) {
    for (var c = 0u; c < SUM_COLS; c++) {
        let j = sum_column(o, lindex, c);
        if (j < BN) {
            column_acc[c] += column_total(o.col0 + j);
        }
    }
}

// The sums as the running totals, or (finished) held.
fn store_column_totals(o: Origin, lindex: u32, finished: bool) {
    for (var c = 0u; c < SUM_COLS; c++) {
        let j = sum_column(o, lindex, c);
        if (j < BN) {
            var v = column_acc[c];
            if (finished) {
                v = held(v, params.epi2.z);
            }
            set_column_total(o.col0 + j, v);
        }
    }
}

// Group g's sums into row m of its plane (split-K).
fn store_column_plane(o: Origin, lindex: u32, g: u32) {
    for (var c = 0u; c < SUM_COLS; c++) {
        let j = sum_column(o, lindex, c);
        if (j < BN) {
            partials[plane_at(0u, g) + params.m * params.n + o.col0 + j] = column_acc[c];
        }
    }
}

// The group planes' sums added in group order (split-K's reduction).
fn load_column_planes(o: Origin, lindex: u32) {
    for (var c = 0u; c < SUM_COLS; c++) {
        let j = sum_column(o, lindex, c);
        if (j < BN) {
            let at = params.m * params.n + o.col0 + j;
            column_acc[c] = partials[plane_at(0u, 0u) + at];
            for (var g = 1u; g < params.planes; g++) {
                column_acc[c] += partials[plane_at(0u, g) + at];
            }
        }
    }
}
