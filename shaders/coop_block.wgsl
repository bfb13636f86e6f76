// coop_block.wgsl: the pieces of `fn coop_block(batch, row0, col0, lindex)` of matmul_coop.wgsl. WGSL has
// no arrays of cooperative matrices to index, so every accumulator and operand tile is a named
// value: the loader (src/backend/wgpu/shaders.rs, `coop_block`) writes each piece once per
// level {{l}}, tile {{r}}, {{c}} (rows, columns of tiles per subgroup) and plane {{p}}, with the
// variant's numbers in place of the other {{names}}. Every index is bound with `let` before a
// load or store (naga's SPIR-V writer needs that for its pointers). With several subgroups
// (staged), each K step of A and B is first copied into workgroup memory by the whole
// workgroup, eight halves (16 bytes) per load, and each subgroup loads its tiles from there. A
// staged K step (BK) is T or 2T: {{s}} numbers its sub-steps of T. With two stages, the next K
// step is copied into one while the subgroups multiply out of the other. With prefetch, the
// next K step's loads are issued into registers before this step's products and stored into
// workgroup memory after them, so their latency hides behind the products.

// @@stage_memory
// Row strides of the staged tiles, padded by 8 halves (16 bytes) against bank conflicts;
// {{stages}} stages of A_STAGE and B_STAGE halves.
const SA: u32 = {{sa}}u;
const SB: u32 = {{sb}}u;
const A_STAGE: u32 = {{a_len}}u;
const B_STAGE: u32 = {{b_len}}u;
var<workgroup> a_stage: array<f16, {{stages}}u * A_STAGE>;
var<workgroup> b_stage: array<f16, {{stages}}u * B_STAGE>;
// Eight halves of an operand: one 16-byte load (WGSL cannot bitcast a u32 to two halves, so
// the operands are bound as arrays of these, 16-byte aligned).
struct Octet {
    @align(16) lo: vec4<f16>,
    hi: vec4<f16>,
}
// A K step of one plane of A and of B in octets, and the octets each invocation moves per plane.
const A_OCTETS: u32 = BM * BK / 8u;
const B_OCTETS: u32 = BK * BN / 8u;
const A_SLOTS: u32 = {{slots_a}}u;
const B_SLOTS: u32 = {{slots_b}}u;
// One K step of this invocation's octets, between its loads from storage and its stores into
// a stage: with prefetch, the next step's loads are issued before this step's products, and
// stored after them.
var<private> a_octets: array<Octet, {{planes}}u * A_SLOTS>;
var<private> b_octets: array<Octet, {{planes}}u * B_SLOTS>;

// The K step from k0 on of every plane of A and B into this invocation's registers. The padded
// operands need no bounds checks (rows to BM, columns to BN, K to BK), and every octet is
// aligned (kp, np, the block origins and the planes are multiples of 8 halves), so each is one
// load.
fn stage_load(a0: u32, b0: u32, k0: u32, lindex: u32) {
    for (var i = 0u; i < A_SLOTS; i++) {
        let e = lindex + i * WG;
        if (e < A_OCTETS) {
            let r = e / (BK / 8u);
            let kk = (e % (BK / 8u)) * 8u;
            for (var p = 0u; p < {{planes}}u; p++) {
                a_octets[p * A_SLOTS + i] = a_data[(a0 + p * params.a_plane + r * params.kp + k0 + kk) / 8u];
            }
        }
    }
    for (var i = 0u; i < B_SLOTS; i++) {
        let e = lindex + i * WG;
        if (e < B_OCTETS) {
            let kk = e / (BN / 8u);
            let c = (e % (BN / 8u)) * 8u;
            for (var p = 0u; p < {{planes}}u; p++) {
                b_octets[p * B_SLOTS + i] = b_data[(b0 + p * params.b_plane + (k0 + kk) * params.np + c) / 8u];
            }
        }
    }
}

// One octet into a stage from `dst` on (a multiple of 8 halves: 16 bytes).
fn put_a(dst: u32, q: Octet) {
    a_stage[dst] = q.lo.x;
    a_stage[dst + 1u] = q.lo.y;
    a_stage[dst + 2u] = q.lo.z;
    a_stage[dst + 3u] = q.lo.w;
    a_stage[dst + 4u] = q.hi.x;
    a_stage[dst + 5u] = q.hi.y;
    a_stage[dst + 6u] = q.hi.z;
    a_stage[dst + 7u] = q.hi.w;
}

fn put_b(dst: u32, q: Octet) {
    b_stage[dst] = q.lo.x;
    b_stage[dst + 1u] = q.lo.y;
    b_stage[dst + 2u] = q.lo.z;
    b_stage[dst + 3u] = q.lo.w;
    b_stage[dst + 4u] = q.hi.x;
    b_stage[dst + 5u] = q.hi.y;
    b_stage[dst + 6u] = q.hi.z;
    b_stage[dst + 7u] = q.hi.w;
}

// This invocation's octets into the stage whose A part starts at at_a and B part at at_b.
fn stage_store(lindex: u32, at_a: u32, at_b: u32) {
    for (var i = 0u; i < A_SLOTS; i++) {
        let e = lindex + i * WG;
        if (e < A_OCTETS) {
            let r = e / (BK / 8u);
            let kk = (e % (BK / 8u)) * 8u;
            for (var p = 0u; p < {{planes}}u; p++) {
                put_a(at_a + p * BM * SA + r * SA + kk, a_octets[p * A_SLOTS + i]);
            }
        }
    }
    for (var i = 0u; i < B_SLOTS; i++) {
        let e = lindex + i * WG;
        if (e < B_OCTETS) {
            let kk = e / (BN / 8u);
            let c = (e % (BN / 8u)) * 8u;
            for (var p = 0u; p < {{planes}}u; p++) {
                put_b(at_b + p * BK * SB + kk * SB + c, b_octets[p * B_SLOTS + i]);
            }
        }
    }
}

// The K step from k0 on straight into a stage.
fn stage_copy(a0: u32, b0: u32, k0: u32, lindex: u32, at_a: u32, at_b: u32) {
    stage_load(a0, b0, k0, lindex);
    stage_store(lindex, at_a, at_b);
}

// @@begin
fn coop_block(batch: u32, split: u32, row0: u32, col0: u32, lindex: u32) {
    let a0 = batch * params.mp * params.kp + row0 * params.kp;
    let b0 = batch * params.kp * params.np + col0;
    // Uniform over the workgroup (its origin and the parameters), as the barriers below need.
    let straight = stores_straight(row0, col0);
    // Strides bound with `let`: naga's SPIR-V writer needs a store's stride so.
    let c_stride = params.n;
    let partial_stride = params.np;
    // The K this workgroup sums: its dispatch's span, or its split's groups; none where it adds
    // the group planes (MODE_REDUCE).
    // (Bound with `let` and `select`: naga's uniformity analysis takes a variable assigned in a
    // branch for a non-uniform value, which the cooperative operations below may not follow.)
    let reduce = params.mode == MODE_REDUCE;
    let is_split = params.mode == MODE_SPLIT;
    let split_begin = min(params.k_begin + split * params.split_groups * GROUP_K, params.k_end);
    let k_begin = select(params.k_begin, split_begin, is_split);
    let k_end = select(
        select(params.k_end, min(k_begin + params.split_groups * GROUP_K, params.k_end), is_split),
        k_begin,
        reduce
    );

// @@origin_staged
    let warp = lindex / SG;
    let row_tile0 = (warp / {{wc}}u) * {{tm}}u;
    let col_tile0 = (warp % {{wc}}u) * {{tn}}u;

// @@origin_single
    let row_tile0 = 0u;
    let col_tile0 = 0u;

// @@stage_first
    // Two stages, or prefetch: the first K step goes into stage 0 before the loop.
    if (k_begin < k_end) {
        stage_copy(a0, b0, k_begin, lindex, 0u, 0u);
    }
    workgroupBarrier();

// @@total
    var total_{{l}}_{{r}}_{{c}} = {{zero}};

// @@totals_init_begin
    // The running totals (`partials`, level l's at l * partial_plane, padded rows of np) start
    // at -0, which adds to any value exactly (+0 included), where K has more than one group
    // and this is the first span: every group can then add them unconditionally (a branch on
    // the group's index would be non-uniform to naga, which cooperative operations may not
    // follow).
    if (params.mode == MODE_SUM && k_begin == 0u && params.kp > GROUP_K) {

// @@totals_init
        let i0_{{l}}_{{r}}_{{c}} = {{l}}u * params.partial_plane + batch * params.mp * params.np
            + (row0 + (row_tile0 + {{r}}u) * {{t}}u) * params.np + col0 + (col_tile0 + {{c}}u) * {{t}}u;
        // (The totals are still zero here: times -1 they are -0.)
        let minus_zero_{{l}}_{{r}}_{{c}} = total_{{l}}_{{r}}_{{c}} * -1.0;
        coopStoreT(minus_zero_{{l}}_{{r}}_{{c}}, &partials[i0_{{l}}_{{r}}_{{c}}], partial_stride);

// @@groups_begin
    }
    // The groups of GROUP_K, in order: each summed from zero, then added to the running totals
    // or stored as its plane.
    var g0 = k_begin;
    loop {
        if (g0 >= k_end) {
            break;
        }
        let g1 = min(g0 + GROUP_K, k_end);

// @@group_zero
        total_{{l}}_{{r}}_{{c}} = {{zero}};

// @@promote_loop
        for (var k1 = g0; k1 < g1; k1 += {{promote}}u) {

// @@part
        var part_{{l}}_{{r}}_{{c}} = {{zero}};

// @@k_loop
        let k_stop = min(k1 + {{promote}}u, g1);
        for (var k0 = k1; k0 < k_stop; k0 += BK) {

// @@stage_copy
            // One stage: copy this K step, wait for every subgroup's part of it.
            stage_copy(a0, b0, k0, lindex, 0u, 0u);
            workgroupBarrier();
            let at_a = 0u;
            let at_b = 0u;

// @@stage_next
            // Two stages: this K step is in stage (k0 / BK) % 2 (copied one step ago); the next
            // goes into the other meanwhile. A stage is rewritten only after the barrier that
            // follows its last read.
            let cur = (k0 / BK) % 2u;
            let at_a = cur * A_STAGE;
            let at_b = cur * B_STAGE;
            if (k0 + BK < k_end) {
                stage_copy(a0, b0, k0 + BK, lindex, (1u - cur) * A_STAGE, (1u - cur) * B_STAGE);
            }

// @@prefetch_load
            // Prefetch: this K step is in stage {{cur}} (stored one step ago); the next one's
            // loads are issued now, so that they are in flight while this step multiplies,
            // and stored after it.
            let cur = {{cur}};
            let at_a = cur * A_STAGE;
            let at_b = cur * B_STAGE;
            let more = k0 + BK < k_end;
            if (more) {
                stage_load(a0, b0, k0 + BK, lindex);
            }

// @@sub_begin
            {

// @@sub_end
            }

// @@load_a_staged
            let ia_{{p}}_{{r}} = at_a + {{p}}u * BM * SA + (row_tile0 + {{r}}u) * {{t}}u * SA
                + {{s}}u * {{t}}u;
            let a_{{p}}_{{r}} = coopLoadT<{{mat}}<f16, A>>(&a_stage[ia_{{p}}_{{r}}], SA);

// @@load_a
            let ia_{{p}}_{{r}} = a0 + {{p}}u * params.a_plane + {{row}}u * params.kp + k0;
            let a_{{p}}_{{r}} = coopLoadT<{{mat}}<f16, A>>(&a_data[ia_{{p}}_{{r}}], params.kp);

// @@load_b_staged
            let ib_{{p}}_{{c}} = at_b + {{p}}u * BK * SB + {{s}}u * {{t}}u * SB
                + (col_tile0 + {{c}}u) * {{t}}u;
            let b_{{p}}_{{c}} = coopLoadT<{{mat}}<f16, B>>(&b_stage[ib_{{p}}_{{c}}], SB);

// @@load_b
            let ib_{{p}}_{{c}} = b0 + {{p}}u * params.b_plane + k0 * params.np + {{col}}u;
            let b_{{p}}_{{c}} = coopLoadT<{{mat}}<f16, B>>(&b_data[ib_{{p}}_{{c}}], params.np);

// @@product
            part_{{l}}_{{r}}_{{c}} = coopMultiplyAdd(a_{{pa}}_{{r}}, b_{{pb}}_{{c}}, part_{{l}}_{{r}}_{{c}});

// @@stage_release
            // The stage read here is rewritten after this barrier (one stage: by the next K
            // step's copy; two: by the copy one step on), and the copy of the next step is
            // complete at it.
            workgroupBarrier();

// @@prefetch_store_single
            // One stage: every subgroup's reads of it end at this barrier; then the next K
            // step goes in, complete at the second.
            workgroupBarrier();
            if (more) {
                stage_store(lindex, 0u, 0u);
            }
            workgroupBarrier();

// @@prefetch_store_double
            // Two stages: the next K step into the other stage, whose last reads ended at the
            // previous step's barrier; complete at this one.
            if (more) {
                stage_store(lindex, (1u - cur) * A_STAGE, (1u - cur) * B_STAGE);
            }
            workgroupBarrier();

// @@k_loop_end
        }

// @@promote
        total_{{l}}_{{r}}_{{c}} = total_{{l}}_{{r}}_{{c}} + part_{{l}}_{{r}}_{{c}};

// @@promote_loop_end
    }

// @@group_end
        if (params.mode == MODE_SPLIT) {

// @@plane_store
            let iq_{{l}}_{{r}}_{{c}} = (g0 / GROUP_K * {{levels}}u + {{l}}u) * params.partial_plane
                + batch * params.mp * params.np + (row0 + (row_tile0 + {{r}}u) * {{t}}u) * params.np
                + col0 + (col_tile0 + {{c}}u) * {{t}}u;
            coopStoreT(total_{{l}}_{{r}}_{{c}}, &partials[iq_{{l}}_{{r}}_{{c}}], partial_stride);

// @@totals_add_begin
        } else if (params.kp > GROUP_K) {

// @@total_add
            let ip_{{l}}_{{r}}_{{c}} = {{l}}u * params.partial_plane + batch * params.mp * params.np
                + (row0 + (row_tile0 + {{r}}u) * {{t}}u) * params.np + col0 + (col_tile0 + {{c}}u) * {{t}}u;
            total_{{l}}_{{r}}_{{c}} = total_{{l}}_{{r}}_{{c}} + coopLoadT<{{mat}}<f32, C>>(&partials[ip_{{l}}_{{r}}_{{c}}], partial_stride);
            coopStoreT(total_{{l}}_{{r}}_{{c}}, &partials[ip_{{l}}_{{r}}_{{c}}], partial_stride);

// @@groups_end
        }
        g0 = g1;
    }

// @@reduce_begin
    // Split-K's reduction: the group planes added in group order, the additions the running
    // totals make.
    if (reduce) {

// @@reduce_first
        let ir_{{l}}_{{r}}_{{c}} = {{l}}u * params.partial_plane + batch * params.mp * params.np
            + (row0 + (row_tile0 + {{r}}u) * {{t}}u) * params.np + col0 + (col_tile0 + {{c}}u) * {{t}}u;
        total_{{l}}_{{r}}_{{c}} = coopLoadT<{{mat}}<f32, C>>(&partials[ir_{{l}}_{{r}}_{{c}}], partial_stride);

// @@reduce_loop
        for (var g = 1u; g < params.planes; g++) {

// @@reduce_add
            let ig_{{l}}_{{r}}_{{c}} = (g * {{levels}}u + {{l}}u) * params.partial_plane
                + batch * params.mp * params.np + (row0 + (row_tile0 + {{r}}u) * {{t}}u) * params.np
                + col0 + (col_tile0 + {{c}}u) * {{t}}u;
            total_{{l}}_{{r}}_{{c}} = total_{{l}}_{{r}}_{{c}} + coopLoadT<{{mat}}<f32, C>>(&partials[ig_{{l}}_{{r}}_{{c}}], partial_stride);

// @@reduce_end
        }
    } else if (params.mode == MODE_SPLIT || k_end < params.kp) {
        // A split's planes, or a span before the last: nothing of C is this dispatch's.
        return;
    }

// @@store
    let sum_{{r}}_{{c}} = {{sum}};
    let row_{{r}}_{{c}} = row0 + (row_tile0 + {{r}}u) * {{t}}u;
    let col_{{r}}_{{c}} = col0 + (col_tile0 + {{c}}u) * {{t}}u;
    if (straight) {

// @@store_straight
        let at_{{r}}_{{c}} = batch * params.c_batch + row_{{r}}_{{c}} * params.n + col_{{r}}_{{c}};
        coopStoreT(sum_{{r}}_{{c}}, &c_data[at_{{r}}_{{c}}], c_stride);

// @@store_staged
    } else {
        let slot_{{r}}_{{c}} = (lindex / SG) * {{t}}u * {{t}}u;
        coopStoreT(sum_{{r}}_{{c}}, &staging[slot_{{r}}_{{c}}], {{t}}u);
        workgroupBarrier();
        store_tile(batch, row_{{r}}_{{c}}, col_{{r}}_{{c}}, lindex);
        // The slot is written again by the next tile.
        workgroupBarrier();
    }

// @@end
}
