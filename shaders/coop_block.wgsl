// coop_block.wgsl: the pieces of `fn coop_block(batch, row0, col0, lindex)` of matmul_coop.wgsl. WGSL has
// no arrays of cooperative matrices to index, so every accumulator and operand tile is a named
// value: the loader (src/backend/wgpu/shaders.rs, `coop_block`) writes each piece once per
// level {{l}}, tile {{r}}, {{c}} (rows, columns of tiles per subgroup) and plane {{p}}, with the
// variant's numbers in place of the other {{names}}. Every index is bound with `let` before a
// load or store (naga's SPIR-V writer needs that for its pointers). With several subgroups
// (staged), each K step of A and B is first copied into workgroup memory by the whole
// workgroup, four halves per load, and each subgroup loads its tiles from there. A staged K
// step (BK) is T or 2T: {{s}} numbers its sub-steps of T. With two stages, the next K step is
// copied into one while the subgroups multiply out of the other.

// @@stage_memory
// Row strides of the staged tiles, padded by 8 halves against bank conflicts; {{stages}} stages
// of A_STAGE and B_STAGE halves.
const SA: u32 = {{sa}}u;
const SB: u32 = {{sb}}u;
const A_STAGE: u32 = {{a_len}}u;
const B_STAGE: u32 = {{b_len}}u;
var<workgroup> a_stage: array<f16, {{stages}}u * A_STAGE>;
var<workgroup> b_stage: array<f16, {{stages}}u * B_STAGE>;

// The K step from k0 on of every plane of A and B into the stage whose A part starts at at_a
// and B part at at_b. The padded operands need no bounds checks (rows to BM, columns to BN, K
// to BK), and every quad of four halves is aligned (kp, np and the block origins are multiples
// of 4), so each is one load.
fn stage_copy(a0: u32, b0: u32, k0: u32, lindex: u32, at_a: u32, at_b: u32) {
    for (var e = lindex; e < BM * BK / 4u; e += WG) {
        let r = e / (BK / 4u);
        let kk = (e % (BK / 4u)) * 4u;
        for (var p = 0u; p < {{planes}}u; p++) {
            let q = a_data[(a0 + p * params.a_plane + r * params.kp + k0 + kk) / 4u];
            let dst = at_a + p * BM * SA + r * SA + kk;
            a_stage[dst] = q.x;
            a_stage[dst + 1u] = q.y;
            a_stage[dst + 2u] = q.z;
            a_stage[dst + 3u] = q.w;
        }
    }
    for (var e = lindex; e < BK * BN / 4u; e += WG) {
        let kk = e / (BN / 4u);
        let c = (e % (BN / 4u)) * 4u;
        for (var p = 0u; p < {{planes}}u; p++) {
            let q = b_data[(b0 + p * params.b_plane + (k0 + kk) * params.np + c) / 4u];
            let dst = at_b + p * BK * SB + kk * SB + c;
            b_stage[dst] = q.x;
            b_stage[dst + 1u] = q.y;
            b_stage[dst + 2u] = q.z;
            b_stage[dst + 3u] = q.w;
        }
    }
}

// @@begin
fn coop_block(batch: u32, row0: u32, col0: u32, lindex: u32) {
    let a0 = batch * params.mp * params.kp + row0 * params.kp;
    let b0 = batch * params.kp * params.np + col0;
    // Uniform over the workgroup (its origin and the parameters), as the barriers below need.
    let straight = stores_straight(row0, col0);
    // Strides bound with `let`: naga's SPIR-V writer needs a store's stride so.
    let c_stride = params.n;
    let partial_stride = params.np;

// @@origin_staged
    let warp = lindex / SG;
    let row_tile0 = (warp / {{wc}}u) * {{tm}}u;
    let col_tile0 = (warp % {{wc}}u) * {{tn}}u;

// @@origin_single
    let row_tile0 = 0u;
    let col_tile0 = 0u;

// @@stage_first
    // Two stages: the span's first K step goes into stage 0 before the loop.
    if (params.k_begin < params.k_end) {
        stage_copy(a0, b0, params.k_begin, lindex, 0u, 0u);
    }
    workgroupBarrier();

// @@total
    var total_{{l}}_{{r}}_{{c}} = {{zero}};

// @@partials_load_begin
    // A span after the first goes on from the totals the previous one left.
    if ((params.span & SPAN_FIRST) == 0u) {

// @@partial_load
        let ip_{{l}}_{{r}}_{{c}} = {{l}}u * params.partial_plane + batch * params.mp * params.np
            + (row0 + (row_tile0 + {{r}}u) * {{t}}u) * params.np + col0 + (col_tile0 + {{c}}u) * {{t}}u;
        total_{{l}}_{{r}}_{{c}} = coopLoadT<{{mat}}<f32, C>>(&partials[ip_{{l}}_{{r}}_{{c}}], partial_stride);

// @@partials_load_end
    }

// @@promote_loop
    for (var k1 = params.k_begin; k1 < params.k_end; k1 += {{promote}}u) {

// @@part
        var part_{{l}}_{{r}}_{{c}} = {{zero}};

// @@k_loop
        let k_end = min(k1 + {{promote}}u, params.k_end);
        for (var k0 = k1; k0 < k_end; k0 += BK) {

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
            if (k0 + BK < params.k_end) {
                stage_copy(a0, b0, k0 + BK, lindex, (1u - cur) * A_STAGE, (1u - cur) * B_STAGE);
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

// @@k_loop_end
        }

// @@promote
        total_{{l}}_{{r}}_{{c}} = total_{{l}}_{{r}}_{{c}} + part_{{l}}_{{r}}_{{c}};

// @@promote_loop_end
    }

// @@partials_store_begin
    // A span before the last leaves its totals for the next one.
    if ((params.span & SPAN_LAST) == 0u) {

// @@partial_store
        let iq_{{l}}_{{r}}_{{c}} = {{l}}u * params.partial_plane + batch * params.mp * params.np
            + (row0 + (row_tile0 + {{r}}u) * {{t}}u) * params.np + col0 + (col_tile0 + {{c}}u) * {{t}}u;
        coopStoreT(total_{{l}}_{{r}}_{{c}}, &partials[iq_{{l}}_{{r}}_{{c}}], partial_stride);

// @@partials_store_end
        return;
    }

// @@store
    let sum_{{r}}_{{c}} = {{sum}};
    let row_{{r}}_{{c}} = row0 + (row_tile0 + {{r}}u) * {{t}}u;
    let col_{{r}}_{{c}} = col0 + (col_tile0 + {{c}}u) * {{t}}u;
    if (straight) {
        let at_{{r}}_{{c}} = batch * params.c_batch + row_{{r}}_{{c}} * params.n + col_{{r}}_{{c}};
        coopStoreT(sum_{{r}}_{{c}}, &c_data[at_{{r}}_{{c}}], c_stride);
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
