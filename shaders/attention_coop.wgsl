// attention_coop.wgsl: fused causal attention on cooperative matrices (tensor cores), for f16
// matmul inputs (16-mixed, 16-true): the same ops and numerics as attention.wgsl, which it follows
// (spliced after train.wgsl and attention.wgsl, whose uniform, bindings and helpers it uses), but
// every product of the head's tiles (the scores S = q.k^T, dP = dO.v^T, O = P.v, dq = dS.k,
// dk = dS^T.q, dv = P^T.dO) on T x T x T cooperative matrices with f32 accumulators, their
// operands f16 in workgroup memory. Under these presets every operand is f16 by the op's
// definition (q, k, v and the output's gradient rounded to the inputs' format, P and dS too
// where they multiply), so the f16 tiles hold them exactly; the products are exact and the
// tensor cores' f32 sums stand where attention.wgsl sums in order (within the contract's
// tolerance, as the unfused ops' cooperative matmuls). The softmax, its backward and every
// rounding run on SIMT lanes between the products, reading the accumulators through workgroup
// memory (WGSL cannot reach a cooperative matrix's elements): llama.cpp's coopmat1 flash
// attention does the same.
//
// The loader's header: enable f16 and wgpu_cooperative_matrix; T (the tile side), SG (the
// subgroup size, a multiple of T), ATT_W (subgroups to a workgroup), ATT_KC (rows of a streamed
// tile, 2T); aliases CoopA, CoopB (f16 operands) and CoopC (f32 accumulators) of the device's
// T x T matrices; ATT_MAX_D. A workgroup takes a block of ATT_W * T rows of one (sequence,
// head), a subgroup T of them: query rows in the forward and dq, key rows in dk|dv. Heads of a
// multiple of T, up to four of them (64 on 16 x 16 tiles, 32 on 8 x 8; ATT_MAX_D at most): an
// output row's four fragments are named (WGSL has no arrays of cooperative matrices), those
// past d left alone.

const CB: u32 = ATT_W * T;
// SIMT lanes to a row of a subgroup's T rows.
const LPR: u32 = SG / T;
// Halves per staged row of the head, and of a staged P (or dS) row.
const HPAD: u32 = ATT_MAX_D + 8u;
const KPAD: u32 = ATT_KC + 8u;

// The block's own rows: q (forward, dq) or k (dk|dv); and the second: dO (dq) or v (dk|dv).
var<workgroup> c_own: array<f16, CB * HPAD>;
var<workgroup> c_own2: array<f16, CB * HPAD>;
// The streamed tile: k and v (forward, dq), or q and dO (dk|dv).
var<workgroup> c_a: array<f16, ATT_KC * HPAD>;
var<workgroup> c_b: array<f16, ATT_KC * HPAD>;
// Per subgroup: a tile of scores (T x KC), or its rows of an output (T x ATT_MAX_D).
var<workgroup> c_s: array<f32, ATT_W * T * ATT_MAX_D>;
// Per subgroup: dP (T x KC).
var<workgroup> c_t: array<f32, ATT_W * T * ATT_KC>;
// Per subgroup: P or dS as a product's operand (T x KC, f16), and dS^T in dk|dv.
var<workgroup> c_p: array<f16, ATT_W * T * KPAD>;
var<workgroup> c_p2: array<f16, ATT_W * T * KPAD>;
// dk|dv: the query tile's (max, sum, sum(P * dP)).
var<workgroup> c_q: array<f32, 3u * ATT_KC>;
// A row's lanes' two values.
var<workgroup> c_red: array<f32, 2u * ATT_W * SG>;

// Row r0 + r, value x of q|k|v from `base` (rows 3C apart), or (`grad`) of the output's
// gradient (rows C apart), as f16 of its inputs' value; 0 at or past `end`.
fn coop_value(grad: bool, base: u32, r: u32, x: u32, end: u32) -> f16 {
    if (r >= end) {
        return f16(0.0);
    }
    let c = params.h * params.d;
    if (grad) {
        return f16(held(in1[base + r * c + x], params.inputs));
    }
    return f16(held(in0v(base + r * 3u * c + x), params.inputs));
}

// The block's own rows r0.. (CB of them) into c_own, and into c_own2; a streamed tile's (KC)
// into c_a, and into c_b. Every invocation takes part.
fn coop_stage_own(grad: bool, base: u32, r0: u32, lid: u32) {
    for (var e = lid; e < CB * params.d; e += ATT_W * SG) {
        c_own[(e / params.d) * HPAD + e % params.d] =
            coop_value(grad, base, r0 + e / params.d, e % params.d, params.c);
    }
}

fn coop_stage_own2(grad: bool, base: u32, r0: u32, lid: u32) {
    for (var e = lid; e < CB * params.d; e += ATT_W * SG) {
        c_own2[(e / params.d) * HPAD + e % params.d] =
            coop_value(grad, base, r0 + e / params.d, e % params.d, params.c);
    }
}

fn coop_stage_a(grad: bool, base: u32, r0: u32, end: u32, lid: u32) {
    for (var e = lid; e < ATT_KC * params.d; e += ATT_W * SG) {
        c_a[(e / params.d) * HPAD + e % params.d] =
            coop_value(grad, base, r0 + e / params.d, e % params.d, end);
    }
}

fn coop_stage_b(grad: bool, base: u32, r0: u32, end: u32, lid: u32) {
    for (var e = lid; e < ATT_KC * params.d; e += ATT_W * SG) {
        c_b[(e / params.d) * HPAD + e % params.d] =
            coop_value(grad, base, r0 + e / params.d, e % params.d, end);
    }
}

// The products below take their operands from fixed arrays (a cooperative operation may not
// sit in a branch on an argument or a variable: naga's uniformity analysis takes those for
// non-uniform), each fragment of the head in a loop bounded by d.

// S: this subgroup's own rows (c_own) times the tile's (c_a) transposed, into c_s (T x KC).
fn coop_scores_s(w: u32) {
    for (var kc = 0u; kc < ATT_KC / T; kc++) {
        var acc = CoopC();
        for (var dd = 0u; dd < params.d / T; dd++) {
            let ia = w * T * HPAD + dd * T;
            let ib = kc * T * HPAD + dd * T;
            acc = coopMultiplyAdd(coopLoadT<CoopA>(&c_own[ia], HPAD),
                                  coopLoad<CoopB>(&c_a[ib], HPAD), acc);
        }
        let at = w * T * ATT_KC + kc * T;
        let stride = ATT_KC;
        let value = acc;
        coopStoreT(value, &c_s[at], stride);
    }
}

// dP (or dP^T): this subgroup's second own rows (c_own2) times the tile's second (c_b)
// transposed, into c_t (T x KC).
fn coop_scores_t(w: u32) {
    for (var kc = 0u; kc < ATT_KC / T; kc++) {
        var acc = CoopC();
        for (var dd = 0u; dd < params.d / T; dd++) {
            let ia = w * T * HPAD + dd * T;
            let ib = kc * T * HPAD + dd * T;
            acc = coopMultiplyAdd(coopLoadT<CoopA>(&c_own2[ia], HPAD),
                                  coopLoad<CoopB>(&c_b[ib], HPAD), acc);
        }
        let at = w * T * ATT_KC + kc * T;
        let stride = ATT_KC;
        let value = acc;
        coopStoreT(value, &c_t[at], stride);
    }
}

// Fragment dd (T columns of the head) of this subgroup's P (or dS: c_p) times the tile's rows
// c_b (v, or dO), added to `acc`.
fn coop_p_times_b(w: u32, dd: u32, acc: CoopC) -> CoopC {
    var out = acc;
    for (var kc = 0u; kc < ATT_KC / T; kc++) {
        let ia = w * T * KPAD + kc * T;
        let ib = kc * T * HPAD + dd * T;
        out = coopMultiplyAdd(coopLoadT<CoopA>(&c_p[ia], KPAD), coopLoadT<CoopB>(&c_b[ib], HPAD),
                              out);
    }
    return out;
}

// As coop_p_times_b, c_p times the tile's rows c_a (dS . k in dq).
fn coop_p_times_a(w: u32, dd: u32, acc: CoopC) -> CoopC {
    var out = acc;
    for (var kc = 0u; kc < ATT_KC / T; kc++) {
        let ia = w * T * KPAD + kc * T;
        let ib = kc * T * HPAD + dd * T;
        out = coopMultiplyAdd(coopLoadT<CoopA>(&c_p[ia], KPAD), coopLoadT<CoopB>(&c_a[ib], HPAD),
                              out);
    }
    return out;
}

// As coop_p_times_a, with dS^T (c_p2) in dk|dv.
fn coop_p2_times_a(w: u32, dd: u32, acc: CoopC) -> CoopC {
    var out = acc;
    for (var kc = 0u; kc < ATT_KC / T; kc++) {
        let ia = w * T * KPAD + kc * T;
        let ib = kc * T * HPAD + dd * T;
        out = coopMultiplyAdd(coopLoadT<CoopA>(&c_p2[ia], KPAD), coopLoadT<CoopB>(&c_a[ib], HPAD),
                              out);
    }
    return out;
}

// An output fragment into the subgroup's rows of c_s (T x ATT_MAX_D, column dd * T on).
fn coop_park(w: u32, dd: u32, acc: CoopC) {
    let at = w * T * ATT_MAX_D + dd * T;
    let stride = ATT_MAX_D;
    let value = acc;
    coopStoreT(value, &c_s[at], stride);
}

// The subgroup's parked output row r (in c_s) into out0 from `at`, held in the compute format,
// as f32 or (`coded`) as codes of it into out2: this lane's pairs of the row's d values.
fn coop_write_row(w: u32, r: u32, sub: u32, at: u32, coded: bool) {
    let row = w * T * ATT_MAX_D + r * ATT_MAX_D;
    for (var u = 0u; u < ATT_MAX_D / 2u; u += LPR) {
        let e = 2u * (u + sub);
        if (e < params.d) {
            let x = c_s[row + e];
            let y = c_s[row + e + 1u];
            if (coded) {
                out2[(at + e) / 2u] = code_pair(x, y, params.compute);
            } else {
                out0[at + e] = held(x, params.compute);
                if (e + 1u < params.d) {
                    out0[at + e + 1u] = held(y, params.compute);
                }
            }
        }
    }
}

// The row's max and sum over its lanes (this lane's m and l): as attention_fwd combines them.
fn coop_combine(lid: u32, m: f32, l: f32) -> vec2<f32> {
    c_red[lid] = m;
    c_red[ATT_W * SG + lid] = l;
    workgroupBarrier();
    let first = lid - lid % LPR;
    var mm = ATT_LOW;
    for (var s = 0u; s < LPR; s++) {
        mm = max(mm, c_red[first + s]);
    }
    var ll = 0.0;
    for (var s = 0u; s < LPR; s++) {
        ll += c_red[ATT_W * SG + first + s] * exp(c_red[first + s] - mm);
    }
    if (mm > 3.4e38) {
        ll = mm - mm;
    }
    workgroupBarrier();
    return vec2<f32>(mm, ll);
}

@compute @workgroup_size(ATT_W * SG, 1, 1)
fn attention_coop_fwd(@builtin(workgroup_id) wg: vec3<u32>,
                      @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) lid: u32) {
    let blk = att_block(wg, nwg, CB);
    // Uniform over the workgroup, as the barriers and cooperative operations below need.
    if (!blk.live) {
        return;
    }
    let t = params.c;
    let c = params.h * params.d;
    let w = lid / SG;
    let lane = lid % SG;
    let r = lane / LPR;
    let sub = lane % LPR;
    let i = blk.first + w * T + r;
    let live = i < t;
    coop_stage_own(false, blk.qkv, blk.first, lid);
    let keys = min(blk.first + CB, t);
    // Pass 1: each row's max and sum of exp(z - max), this lane's keys, then its lanes'.
    var m = ATT_LOW;
    var l = 0.0;
    for (var j0 = 0u; j0 < keys; j0 += ATT_KC) {
        coop_stage_a(false, blk.qkv + c, j0, keys, lid);
        workgroupBarrier();
        coop_scores_s(w);
        workgroupBarrier();
        for (var jj = sub; jj < ATT_KC; jj += LPR) {
            if (live && j0 + jj <= i) {
                let z = scaled(held(c_s[w * T * ATT_KC + r * ATT_KC + jj], params.compute),
                               params.compute);
                if (z > m) {
                    l = l * exp(m - z) + 1.0;
                    m = z;
                } else {
                    l += exp(z - m);
                }
            }
        }
        workgroupBarrier();
    }
    let ml = coop_combine(lid, m, l);
    // Pass 2: P into workgroup memory as f16, then O += P . v on the cooperative matrices.
    var o0 = CoopC();
    var o1 = CoopC();
    var o2 = CoopC();
    var o3 = CoopC();
    for (var j0 = 0u; j0 < keys; j0 += ATT_KC) {
        coop_stage_a(false, blk.qkv + c, j0, keys, lid);
        coop_stage_b(false, blk.qkv + 2u * c, j0, keys, lid);
        workgroupBarrier();
        coop_scores_s(w);
        workgroupBarrier();
        for (var jj = sub; jj < ATT_KC; jj += LPR) {
            var p = 0.0;
            if (live && j0 + jj <= i) {
                let z = scaled(held(c_s[w * T * ATT_KC + r * ATT_KC + jj], params.compute),
                               params.compute);
                p = held(att_p_of(z, ml.x, ml.y), params.inputs);
            }
            c_p[w * T * KPAD + r * KPAD + jj] = f16(p);
        }
        workgroupBarrier();
        o0 = coop_p_times_b(w, 0u, o0);
        if (params.d > T) {
            o1 = coop_p_times_b(w, 1u, o1);
        }
        if (params.d > 2u * T) {
            o2 = coop_p_times_b(w, 2u, o2);
        }
        if (params.d > 3u * T) {
            o3 = coop_p_times_b(w, 3u, o3);
        }
        workgroupBarrier();
    }
    coop_park(w, 0u, o0);
    if (params.d > T) {
        coop_park(w, 1u, o1);
    }
    if (params.d > 2u * T) {
        coop_park(w, 2u, o2);
    }
    if (params.d > 3u * T) {
        coop_park(w, 3u, o3);
    }
    workgroupBarrier();
    if (!live) {
        return;
    }
    coop_write_row(w, r, sub, blk.rows + i * c, params.coded != 0u);
    if (sub == 0u) {
        let row = blk.bh * t + i;
        out1[2u * row] = ml.x;
        out1[2u * row + 1u] = ml.y;
    }
}

// dq (out0's first third of each row) and sum(P * dP) per row into out1.
@compute @workgroup_size(ATT_W * SG, 1, 1)
fn attention_coop_bwd_q(@builtin(workgroup_id) wg: vec3<u32>,
                        @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_index) lid: u32) {
    let blk = att_block(wg, nwg, CB);
    if (!blk.live) {
        return;
    }
    let t = params.c;
    let c = params.h * params.d;
    let w = lid / SG;
    let lane = lid % SG;
    let r = lane / LPR;
    let sub = lane % LPR;
    let i = blk.first + w * T + r;
    let live = i < t;
    let row = blk.bh * t + min(i, t - 1u);
    coop_stage_own(false, blk.qkv, blk.first, lid);
    coop_stage_own2(true, blk.rows, blk.first, lid);
    let m = in2[2u * row];
    let l = in2[2u * row + 1u];
    let keys = min(blk.first + CB, t);
    // Sweep 1: sum(P * dP), this lane's keys, then its lanes' in lane order.
    var pdp = 0.0;
    for (var j0 = 0u; j0 < keys; j0 += ATT_KC) {
        coop_stage_a(false, blk.qkv + c, j0, keys, lid);
        coop_stage_b(false, blk.qkv + 2u * c, j0, keys, lid);
        workgroupBarrier();
        coop_scores_s(w);
        coop_scores_t(w);
        workgroupBarrier();
        for (var jj = sub; jj < ATT_KC; jj += LPR) {
            if (live && j0 + jj <= i) {
                let at = w * T * ATT_KC + r * ATT_KC + jj;
                let z = scaled(held(c_s[at], params.compute), params.compute);
                pdp += att_p_of(z, m, l) * held(c_t[at], params.compute);
            }
        }
        workgroupBarrier();
    }
    c_red[lid] = pdp;
    workgroupBarrier();
    var rp = 0.0;
    for (var s = 0u; s < LPR; s++) {
        rp += c_red[lid - sub + s];
    }
    workgroupBarrier();
    // Sweep 2: dS into workgroup memory as f16, then dq += dS . k.
    var q0 = CoopC();
    var q1 = CoopC();
    var q2 = CoopC();
    var q3 = CoopC();
    for (var j0 = 0u; j0 < keys; j0 += ATT_KC) {
        coop_stage_a(false, blk.qkv + c, j0, keys, lid);
        coop_stage_b(false, blk.qkv + 2u * c, j0, keys, lid);
        workgroupBarrier();
        coop_scores_s(w);
        coop_scores_t(w);
        workgroupBarrier();
        for (var jj = sub; jj < ATT_KC; jj += LPR) {
            var ds = 0.0;
            if (live && j0 + jj <= i) {
                let at = w * T * ATT_KC + r * ATT_KC + jj;
                let z = scaled(held(c_s[at], params.compute), params.compute);
                ds = att_ds(att_p_of(z, m, l), held(c_t[at], params.compute), rp);
            }
            c_p[w * T * KPAD + r * KPAD + jj] = f16(ds);
        }
        workgroupBarrier();
        q0 = coop_p_times_a(w, 0u, q0);
        if (params.d > T) {
            q1 = coop_p_times_a(w, 1u, q1);
        }
        if (params.d > 2u * T) {
            q2 = coop_p_times_a(w, 2u, q2);
        }
        if (params.d > 3u * T) {
            q3 = coop_p_times_a(w, 3u, q3);
        }
        workgroupBarrier();
    }
    coop_park(w, 0u, q0);
    if (params.d > T) {
        coop_park(w, 1u, q1);
    }
    if (params.d > 2u * T) {
        coop_park(w, 2u, q2);
    }
    if (params.d > 3u * T) {
        coop_park(w, 3u, q3);
    }
    workgroupBarrier();
    if (!live) {
        return;
    }
    coop_write_row(w, r, sub, blk.qkv + i * 3u * c, false);
    if (sub == 0u) {
        out1[row] = rp;
    }
}

// dk and dv (out0's second and third thirds) for a block of key rows: the query tiles from the
// block's first key on (reads out1's sum(P * dP)).
@compute @workgroup_size(ATT_W * SG, 1, 1)
fn attention_coop_bwd_kv(@builtin(workgroup_id) wg: vec3<u32>,
                         @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_index) lid: u32) {
    let blk = att_block(wg, nwg, CB);
    if (!blk.live) {
        return;
    }
    let t = params.c;
    let c = params.h * params.d;
    let w = lid / SG;
    let lane = lid % SG;
    let r = lane / LPR;
    let sub = lane % LPR;
    let j = blk.first + w * T + r;
    let live = j < t;
    coop_stage_own(false, blk.qkv + c, blk.first, lid);
    coop_stage_own2(false, blk.qkv + 2u * c, blk.first, lid);
    let first_row = blk.bh * t;
    var k0 = CoopC();
    var k1 = CoopC();
    var k2 = CoopC();
    var k3 = CoopC();
    var v0 = CoopC();
    var v1 = CoopC();
    var v2 = CoopC();
    var v3 = CoopC();
    for (var i0 = blk.first; i0 < t; i0 += ATT_KC) {
        coop_stage_a(false, blk.qkv, i0, t, lid);
        coop_stage_b(true, blk.rows, i0, t, lid);
        if (lid < ATT_KC && i0 + lid < t) {
            let row = first_row + i0 + lid;
            c_q[lid] = in2[2u * row];
            c_q[ATT_KC + lid] = in2[2u * row + 1u];
            c_q[2u * ATT_KC + lid] = out1[row];
        }
        workgroupBarrier();
        // S^T = k . q^T and dP^T = v . dO^T, this subgroup's keys by the tile's queries.
        coop_scores_s(w);
        coop_scores_t(w);
        workgroupBarrier();
        for (var ii = sub; ii < ATT_KC; ii += LPR) {
            let i = i0 + ii;
            var p = 0.0;
            var ds = 0.0;
            if (live && i >= j && i < t) {
                let at = w * T * ATT_KC + r * ATT_KC + ii;
                let z = scaled(held(c_s[at], params.compute), params.compute);
                let pr = att_p_of(z, c_q[ii], c_q[ATT_KC + ii]);
                ds = att_ds(pr, held(c_t[at], params.compute), c_q[2u * ATT_KC + ii]);
                p = held(pr, params.inputs);
            }
            c_p[w * T * KPAD + r * KPAD + ii] = f16(p);
            c_p2[w * T * KPAD + r * KPAD + ii] = f16(ds);
        }
        workgroupBarrier();
        // dv += P^T . dO, dk += dS^T . q.
        v0 = coop_p_times_b(w, 0u, v0);
        k0 = coop_p2_times_a(w, 0u, k0);
        if (params.d > T) {
            v1 = coop_p_times_b(w, 1u, v1);
            k1 = coop_p2_times_a(w, 1u, k1);
        }
        if (params.d > 2u * T) {
            v2 = coop_p_times_b(w, 2u, v2);
            k2 = coop_p2_times_a(w, 2u, k2);
        }
        if (params.d > 3u * T) {
            v3 = coop_p_times_b(w, 3u, v3);
            k3 = coop_p2_times_a(w, 3u, k3);
        }
        workgroupBarrier();
    }
    let at = blk.qkv + min(j, t - 1u) * 3u * c;
    // dk through the parking rows, then dv.
    coop_park(w, 0u, k0);
    if (params.d > T) {
        coop_park(w, 1u, k1);
    }
    if (params.d > 2u * T) {
        coop_park(w, 2u, k2);
    }
    if (params.d > 3u * T) {
        coop_park(w, 3u, k3);
    }
    workgroupBarrier();
    if (live) {
        coop_write_row(w, r, sub, at + c, false);
    }
    workgroupBarrier();
    coop_park(w, 0u, v0);
    if (params.d > T) {
        coop_park(w, 1u, v1);
    }
    if (params.d > 2u * T) {
        coop_park(w, 2u, v2);
    }
    if (params.d > 3u * T) {
        coop_park(w, 3u, v3);
    }
    workgroupBarrier();
    if (live) {
        coop_write_row(w, r, sub, at + 2u * c, false);
    }
}
