// matmul_step.wgsl: the pieces of matmul.wgsl the loader writes out per variant
// (src/backend/wgpu/shaders.rs, `k_step`): each piece once per split level {{l}}, 4x4 block
// {{q}} (0; with REG 8 also 1: BN/2 columns on, 2: BM/2 rows on, 3: both), row {{r}} of a
// block and workgroup buffer {{s}}, with the variant's numbers in place of the other
// {{names}}.
//
// Unrolled variants (those for checked modules: browsers, MANTISSA_WGSL_CHECKS) write the K
// step's body once per k: {{k}} is then the constant k, {{kk}} names its values. Every index is
// a constant but the invocation's own block row (`ty`, `ty2`) and column (`tx`, `tx2`), so a
// checked module's clamps are the same four values at every k and there is no loop to bound:
// the checked step runs the unchecked one's instructions (tests/shaders.rs). Other variants
// loop over k ({{k}} is `kk`), which drivers unroll themselves when nothing bounds the loop,
// and which lavapipe compiles several times faster.

// @@accumulator
var<private> acc_{{l}}_{{q}}_{{r}}: vec4<f32>;

// @@zero_begin
// The accumulators at zero: a group's sums start there.
fn zero_accumulators() {

// @@zero
    acc_{{l}}_{{q}}_{{r}} = vec4<f32>();

// @@step_begin
// The K step in workgroup buffer {{s}}, multiplied into the accumulators.
fn k_step_{{s}}(ty: u32, tx: u32, ty2: u32, tx2: u32) {

// @@k_loop
    for (var kk = 0u; kk < BK; kk++) {

// @@k_loop_end
    }

// @@k_begin
    // k = {{k}}
    let ah_{{kk}} = a_tile[{{k}}][ty];
    let bh_{{kk}} = b_tile[{{k}}][tx];

// @@k_wide
    let ah2_{{kk}} = a_tile[{{k}}][ty2];
    let bh2_{{kk}} = b_tile[{{k}}][tx2];

// @@k_split
    // The lower levels read h as 0 where it is not finite: only L0 meets inf/NaN.
    let a0_{{kk}} = finite_or_zero(ah_{{kk}});
    let b0_{{kk}} = finite_or_zero(bh_{{kk}});

// @@k_plane
    let a{{p}}_{{kk}} = a_tile[{{p}}u * BK + {{k}}][ty];
    let b{{p}}_{{kk}} = b_tile[{{p}}u * BK + {{k}}][tx];

// @@product
    acc_{{l}}_{{q}}_0 += {{a}}.x * {{b}};
    acc_{{l}}_{{q}}_1 += {{a}}.y * {{b}};
    acc_{{l}}_{{q}}_2 += {{a}}.z * {{b}};
    acc_{{l}}_{{q}}_3 += {{a}}.w * {{b}};

// @@step_end
}

// @@loop_single
// Every K step of [k_begin, k_end) (one group): load it, multiply it, each behind a barrier.
fn k_loop(o: Origin, lindex: u32, ty: u32, tx: u32, ty2: u32, tx2: u32, k_begin: u32, k_end: u32) {
    for (var k0 = k_begin; k0 < k_end; k0 += BK) {
        load_tiles(o, k0, lindex, 0u);
        workgroupBarrier();
        k_step_0(ty, tx, ty2, tx2);
        column_step(o, lindex, 0u);
        workgroupBarrier();
    }
}

// @@loop_double
// Every K step of [k_begin, k_end) (one group), two buffers: the next step loads into one while
// the other is multiplied, so a step waits at one barrier instead of two. A buffer is rewritten
// only after the barrier that follows its last read. The same products in the same order as one
// buffer.
fn k_loop(o: Origin, lindex: u32, ty: u32, tx: u32, ty2: u32, tx2: u32, k_begin: u32, k_end: u32) {
    if (k_begin < k_end) {
        load_tiles(o, k_begin, lindex, 0u);
    }
    workgroupBarrier();
    for (var k0 = k_begin; k0 < k_end; k0 += 2u * BK) {
        let second = k0 + BK < k_end;
        if (second) {
            load_tiles(o, k0 + BK, lindex, PARTS * BK);
        }
        k_step_0(ty, tx, ty2, tx2);
        column_step(o, lindex, 0u);
        workgroupBarrier();
        if (second) {
            if (k0 + 2u * BK < k_end) {
                load_tiles(o, k0 + 2u * BK, lindex, 0u);
            }
            k_step_1(ty, tx, ty2, tx2);
            column_step(o, lindex, PARTS * BK);
        }
        workgroupBarrier();
    }
}

// @@store_begin
// The accumulators into C, each 4x4 block's levels summed smallest first.
fn store_tiles(o: Origin, ty: u32, tx: u32, ty2: u32, tx2: u32) {

// @@store
    store_row(o.batch, o.row0 + {{row}} * 4u + {{r}}u, o.col0 + {{col}} * 4u, {{sum}});

// @@add_totals_begin
// The running totals the earlier groups left, added to this group's sums.
fn add_totals(o: Origin, ty: u32, tx: u32, ty2: u32, tx2: u32) {

// @@add_total
    acc_{{l}}_{{q}}_{{r}} += load_partial_row({{l}}u, o.batch, o.row0 + {{row}} * 4u + {{r}}u, o.col0 + {{col}} * 4u);

// @@store_totals_begin
// The accumulators as the running totals, for the next group.
fn store_totals(o: Origin, ty: u32, tx: u32, ty2: u32, tx2: u32) {

// @@store_total
    store_partial_row({{l}}u, o.batch, o.row0 + {{row}} * 4u + {{r}}u, o.col0 + {{col}} * 4u, acc_{{l}}_{{q}}_{{r}});

// @@store_plane_begin
// The accumulators as group g's sums, into its plane (split-K).
fn store_plane(o: Origin, g: u32, ty: u32, tx: u32, ty2: u32, tx2: u32) {

// @@store_plane
    store_plane_row({{l}}u, g, o.batch, o.row0 + {{row}} * 4u + {{r}}u, o.col0 + {{col}} * 4u, acc_{{l}}_{{q}}_{{r}});

// @@load_planes_begin
// The accumulators as the group planes' sums added in group order (split-K's reduction): the
// additions a running total makes.
fn load_planes(o: Origin, ty: u32, tx: u32, ty2: u32, tx2: u32) {

// @@load_plane_first
    acc_{{l}}_{{q}}_{{r}} = load_plane_row({{l}}u, 0u, o.batch, o.row0 + {{row}} * 4u + {{r}}u, o.col0 + {{col}} * 4u);

// @@load_planes_loop
    for (var g = 1u; g < params.planes; g++) {

// @@load_plane_add
        acc_{{l}}_{{q}}_{{r}} += load_plane_row({{l}}u, g, o.batch, o.row0 + {{row}} * 4u + {{r}}u, o.col0 + {{col}} * 4u);

// @@load_planes_loop_end
    }

// @@end
}

