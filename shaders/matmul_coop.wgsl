// matmul_coop.wgsl: C = A . B on cooperative matrices (tensor cores where the hardware has
// them): T x T x T f16 tiles (T = 16 on NVIDIA, 8 on Apple and lavapipe), f32 accumulators. A
// workgroup of one or more subgroups computes a BM x BN block of C (with several, each K step of
// the operands is staged in workgroup memory and shared). Needs formats.wgsl; operands come
// from coop_pack.wgsl.
//
// The loader splices in, per variant:
//   enable f16; enable wgpu_cooperative_matrix;
//   const BM, BN: u32           block of C per workgroup (multiples of T)
//   const T: u32                the cooperative tile size
//   const BK: u32               K per step: T, or 2T for staged blocks
//   const SG: u32               the subgroup size
//   const WG: u32               the workgroup size: SG times the subgroups per workgroup
//   const SCALED: bool          operands scaled per line by coop_pack (bf16 planes), else f16(x)
//   const EPILOGUE: bool, fn epilogue(e, col, v) -> f32
//                               a fused bias add in the store (epilogue.wgsl; its blocks then
//                               store through `staging`)
//   const CODED: bool, alias C_T, fn store_codes: C stored as 16-bit codes two a word
//                               (epilogue.wgsl; C_T u32), else f32 values (C_T f32)
//   alias OPERAND_T             f16, or Octet (eight halves, coop_block.wgsl) for staged blocks
//   fn coop_block(batch, row0, col0, lindex)
//                               the block's products into C: one accumulator per split level and
//                               tile, promoted into an f32 total every 256 of K (tensor cores do
//                               not accumulate long sums in exact f32), levels summed smallest
//                               first (docs/design.md); each tile stored straight into C, or
//                               through `staging` and `store_tile`
//   const GROUP_K: u32          the summation group (matmul.wgsl, "Summation order")
//
// Summation order, as matmul.wgsl's, with one more level inside a group: each level's products
// of a promotion interval of 256 are summed on the cooperative matrices, each interval's sum
// added into the group's f32 total, and the groups' totals added in order, held between groups
// in `partials` (level l's at l * partial_plane, padded rows of np). A dispatch sums its span's
// groups (MODE_SUM: all of the padded K, unless the adapter's loop budget splits it, at group
// boundaries); a split-K product (MODE_SPLIT) stores each group's totals in its plane (plane g,
// level l at (g * levels + l) * partial_plane), and MODE_REDUCE adds the planes in order and
// stores C. Spans and splits change no bit.

struct CoopParams {
    m: u32,
    n: u32,
    k: u32,
    // K padded to T, rows of A padded to BM, columns of B padded to BN.
    kp: u32,
    mp: u32,
    np: u32,
    // Elements per operand plane.
    a_plane: u32,
    b_plane: u32,
    c_batch: u32,
    // Where B's lines start in amax_bits and flags (A's lines: batch * m + row).
    b_lines: u32,
    // This dispatch's span of the padded K, and MODE_SUM, MODE_SPLIT or MODE_REDUCE.
    k_begin: u32,
    k_end: u32,
    mode: u32,
    // Elements of a level's totals (batch * mp * np).
    partial_plane: u32,
    // MODE_SPLIT: the groups each split sums; z is split * batches + batch.
    split_groups: u32,
    batches: u32,
    // MODE_REDUCE: the group planes to add.
    planes: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
    // EPILOGUE: the fused bias add's formats and flags (epilogue.wgsl).
    epi: vec4<u32>,
    epi2: vec4<u32>,
}

const MODE_SUM: u32 = 0u;
const MODE_SPLIT: u32 = 1u;
const MODE_REDUCE: u32 = 2u;

@group(0) @binding(0) var<uniform> params: CoopParams;
// f16, or Octet where the block is staged (copied eight halves, 16 bytes, per load).
@group(0) @binding(1) var<storage, read> a_data: array<OPERAND_T>;
@group(0) @binding(2) var<storage, read> b_data: array<OPERAND_T>;
@group(0) @binding(3) var<storage, read_write> c_data: array<C_T>;
@group(0) @binding(4) var<storage, read> amax_bits: array<u32>;
// The running totals between groups of K, or the group planes of a split-K product (a word
// where there are none).
@group(0) @binding(5) var<storage, read_write> partials: array<f32>;
// One bit per line, set by coop_pack.wgsl.
@group(0) @binding(6) var<storage, read> flags: array<u32>;

fn flagged(line: u32) -> bool {
    return (flags[line / 32u] & (1u << (line % 32u))) != 0u;
}

// One T x T tile per subgroup: where a tile passes on its way to C when its block is on an
// edge of C, or its values are scaled, or C's rows are not aligned for a cooperative store.
var<workgroup> staging: array<f32, WG / SG * T * T>;

// Whether a block's tiles go from the accumulators straight into C: unscaled, the whole block
// inside C, and every row of C starting on 16 bytes (the alignment cooperative stores need).
fn stores_straight(row0: u32, col0: u32) -> bool {
    return !SCALED && !EPILOGUE && row0 + BM <= params.m && col0 + BN <= params.n && params.n % 4u == 0u
        && params.c_batch % 4u == 0u;
}

// The T x T tile of C at (row, col), which this subgroup has just stored in its slot of
// `staging`, into C: bounds, flagged lines and the scaled planes' descaling per element; CODED,
// a word of two codes at a time (T and C's rows even, so a pair is inside C whole or outside).
fn store_tile(batch: u32, row: u32, col: u32, lindex: u32) {
    let slot = (lindex / SG) * T * T;
    if (CODED) {
        for (var e = 2u * (lindex % SG); e < T * T; e += 2u * SG) {
            let r = row + e / T;
            let c = col + e % T;
            if (r < params.m && c < params.n) {
                let v = vec2<f32>(descaled(batch, r, c, staging[slot + e]), descaled(batch, r, c + 1u, staging[slot + e + 1u]));
                store_codes(batch * params.c_batch + r * params.n + c, c, v, vec2<bool>(mine(batch, r, c), mine(batch, r, c + 1u)));
            }
        }
        return;
    }
    for (var e = lindex % SG; e < T * T; e += SG) {
        let r = row + e / T;
        let c = col + e % T;
        if (r >= params.m || c >= params.n || !mine(batch, r, c)) {
            continue;
        }
        var out = descaled(batch, r, c, staging[slot + e]);
        if (EPILOGUE) {
            out = epilogue(batch * params.c_batch + r * params.n + c, c, out);
        }
        c_data[batch * params.c_batch + r * params.n + c] = bitcast<C_T>(out);
    }
}

// Whether output (r, c) is this kernel's: not where a line is flagged, which the SIMT kernel
// computes (coop_pack.wgsl).
fn mine(batch: u32, r: u32, c: u32) -> bool {
    return !SCALED || !(flagged(batch * params.m + r) || flagged(params.b_lines + batch * params.n + c));
}

// Output (r, c)'s sum v, the scaled planes' shifts undone.
fn descaled(batch: u32, r: u32, c: u32, v: f32) -> f32 {
    if (!SCALED) {
        return v;
    }
    let la = batch * params.m + r;
    let lb = params.b_lines + batch * params.n + c;
    return ldexp_wide(v, -(shift_for_amax(amax_bits[la]) + shift_for_amax(amax_bits[lb])));
}

// x * 2^e for |e| up to ~330 (WGSL's ldexp is defined for exponents within f32's range).
fn ldexp_wide(x: f32, e: i32) -> f32 {
    let e1 = e / 3;
    let e2 = (e - e1) / 2;
    return ldexp(ldexp(ldexp(x, e1), e2), e - e1 - e2);
}

@compute @workgroup_size(WG, 1, 1)
fn matmul_coop(@builtin(workgroup_id) wg: vec3<u32>,
               @builtin(local_invocation_index) lindex: u32) {
    coop_block(wg.z % params.batches, wg.z / params.batches, wg.y * BM, wg.x * BN, lindex);
}
