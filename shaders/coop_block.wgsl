// coop_block.wgsl: the pieces of `fn coop_block(a0, b0, lindex)` of matmul_coop.wgsl. WGSL has
// no arrays of cooperative matrices to index, so every accumulator and operand tile is a named
// value: the loader (src/backend/wgpu/shaders.rs, `coop_block`) writes each piece once per
// level {{l}}, tile {{r}}, {{c}} (rows, columns of tiles per subgroup) and plane {{p}}, with the
// variant's numbers in place of the other {{names}}. Every index is bound with `let` before a
// load or store (naga's SPIR-V writer needs that for its pointers). With several subgroups
// (staged), each K step of A and B is first copied into workgroup memory by the whole
// workgroup, and each subgroup loads its tiles from there.

// @@stage_memory
// Row strides of the staged tiles, padded by 8 halves against bank conflicts.
const SA: u32 = {{sa}}u;
const SB: u32 = {{sb}}u;
var<workgroup> a_stage: array<f16, {{a_len}}>;
var<workgroup> b_stage: array<f16, {{b_len}}>;

// @@begin
fn coop_block(a0: u32, b0: u32, lindex: u32) {

// @@origin_staged
    let warp = lindex / SG;
    let row_tile0 = (warp / {{wc}}u) * {{tm}}u;
    let col_tile0 = (warp % {{wc}}u) * {{tn}}u;

// @@origin_single
    let row_tile0 = 0u;
    let col_tile0 = 0u;

// @@total
    var total_{{l}}_{{r}}_{{c}} = {{zero}};

// @@promote_loop
    for (var k1 = 0u; k1 < params.kp; k1 += {{promote}}u) {

// @@part
        var part_{{l}}_{{r}}_{{c}} = {{zero}};

// @@k_loop
        let k_end = min(k1 + {{promote}}u, params.kp);
        for (var k0 = k1; k0 < k_end; k0 += {{t}}u) {

// @@stage_copy
            // The padded operands need no bounds checks: rows to BM, columns to BN, K to T.
            for (var e = lindex; e < BM * T; e += WG) {
                let r = e / T;
                let kk = e % T;
                for (var p = 0u; p < {{planes}}u; p++) {
                    let src_a = a0 + p * params.a_plane + r * params.kp + k0 + kk;
                    let dst_a = p * BM * SA + r * SA + kk;
                    a_stage[dst_a] = a_data[src_a];
                }
            }
            for (var e = lindex; e < T * BN; e += WG) {
                let kk = e / BN;
                let c = e % BN;
                for (var p = 0u; p < {{planes}}u; p++) {
                    let src_b = b0 + p * params.b_plane + (k0 + kk) * params.np + c;
                    let dst_b = p * T * SB + kk * SB + c;
                    b_stage[dst_b] = b_data[src_b];
                }
            }
            workgroupBarrier();

// @@load_a_staged
            let ia_{{p}}_{{r}} = {{p}}u * BM * SA + (row_tile0 + {{r}}u) * {{t}}u * SA;
            let a_{{p}}_{{r}} = coopLoadT<{{mat}}<f16, A>>(&a_stage[ia_{{p}}_{{r}}], SA);

// @@load_a
            let ia_{{p}}_{{r}} = a0 + {{p}}u * params.a_plane + {{row}}u * params.kp + k0;
            let a_{{p}}_{{r}} = coopLoadT<{{mat}}<f16, A>>(&a_data[ia_{{p}}_{{r}}], params.kp);

// @@load_b_staged
            let ib_{{p}}_{{c}} = {{p}}u * T * SB + (col_tile0 + {{c}}u) * {{t}}u;
            let b_{{p}}_{{c}} = coopLoadT<{{mat}}<f16, B>>(&b_stage[ib_{{p}}_{{c}}], SB);

// @@load_b
            let ib_{{p}}_{{c}} = b0 + {{p}}u * params.b_plane + k0 * params.np + {{col}}u;
            let b_{{p}}_{{c}} = coopLoadT<{{mat}}<f16, B>>(&b_data[ib_{{p}}_{{c}}], params.np);

// @@product
            part_{{l}}_{{r}}_{{c}} = coopMultiplyAdd(a_{{pa}}_{{r}}, b_{{pb}}_{{c}}, part_{{l}}_{{r}}_{{c}});

// @@stage_release
            // The next K step overwrites the stage.
            workgroupBarrier();

// @@k_loop_end
        }

// @@promote
        total_{{l}}_{{r}}_{{c}} = total_{{l}}_{{r}}_{{c}} + part_{{l}}_{{r}}_{{c}};

// @@promote_loop_end
    }

// @@store
    let sum_{{r}}_{{c}} = {{sum}};
    let at_{{r}}_{{c}} = (row_tile0 + {{r}}u) * {{t}}u * BN + (col_tile0 + {{c}}u) * {{t}}u;
    coopStoreT(sum_{{r}}_{{c}}, &staging[at_{{r}}_{{c}}], BN);

// @@end
}
