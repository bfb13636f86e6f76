// attention.wgsl: fused causal attention (plan::Op::Attention and AttentionBwd) in the
// flash-attention-2 design, on SIMT invocations, for every format. Spliced after train.wgsl,
// whose uniform, bindings and helpers it uses (the loader: src/backend/wgpu/shaders.rs).
//
// Numerics are the unfused plan's, step for step, as cuda/attention.cu's header says (its CUDA
// twin): q, k, v and the output's gradient rounded to the matmul inputs' format, each score
// summed in f32 over the head in order and held in the compute format, scaled and held again;
// the softmax exact, not online-rescaled: the forward's first pass finds each row's max and sum
// of exp(z - max), the second uses P = exp(z - max) / sum held in the probabilities' format (and
// rounded to the inputs' where it multiplies v), the value the unfused softmax stores; the
// backward recomputes P from the forward's (max, sum) and takes sum(P * dP) over P and dP as the
// unfused softmax backward does. Every output element (O, dq, dk, dv) sums its terms in key (or
// query) order, as the one-row-per-invocation kernels this replaces did, bit for bit; a row's
// sum of exp and its sum(P * dP) are summed by ATT_LANES lanes, each over every ATT_LANES-th
// key, and the lanes' sums added in lane order (a fixed order: a rerun gives the same bits).
// Masked keys (j > i) add nothing.
//
// Tiles (the flash-attention-2 scheme; docs/wgpu.md, "Fused attention"): a workgroup of 256
// invocations takes a block of ATT_BR rows of one (sequence, head), ATT_LANES invocations to a
// row: query rows in the forward and dq, key rows in dk|dv. The other side streams through
// workgroup memory in tiles of ATT_BC rows, each loaded once for the whole block (rows padded by
// one value against bank conflicts): a lane computes the scores of every ATT_LANES-th row of the
// tile, they meet in workgroup memory (P, dS), and each lane then accumulates its pairs of the
// row's output (pairs lane, lane + ATT_LANES, ...) over the tile in order. The scores are
// computed twice in the forward (max and sum, then P) and in dq (sum(P * dP), then dS), once in
// dk|dv, which computes both: 3 dispatches a step, no atomics. The row's own vectors (q, the
// output's gradient, or k and v) live in private arrays of ATT_MAX_D.
//
// params: n = B*H*T score rows, c = T, h, d, scale, and the format ids of the matmul inputs, the
// probabilities and the held matmul results; in0 = q|k|v (B, T, 3C: as the projection wrote it,
// heads read in place), in1 = the output's gradient (B, T, C), in2 = each row's (max, sum); out0
// = the output (or dq|dk|dv), out1 = (max, sum) per row (forward) or sum(P * dP) per row (dq
// writes it, dk|dv reads it), out2 = the output as codes (`coded`).

// From the generated header (src/backend/wgpu/train.rs, `attention_tiles`): ATT_MAX_D, the
// largest head; ATT_LANES, invocations to a row; ATT_BC, rows of a streamed tile.
const ATT_BR: u32 = 256u / ATT_LANES;
// Pairs of a row's values each lane accumulates (a pair: two neighbouring values, so that a
// coded output's word is one lane's).
const ATT_PAIRS: u32 = ATT_MAX_D / 2u / ATT_LANES;
// A tile's row stride in workgroup memory.
const ATT_PAD: u32 = ATT_MAX_D + 1u;
// No constant beyond f32's range (browsers reject one, infinities included): a max starts at
// -3.4e38, as softmax_fwd's does.
const ATT_LOW: f32 = -3.4e38;

// The streamed tiles: k and v (forward, dq), or q and the output's gradient (dk|dv).
var<workgroup> att_a: array<f32, ATT_BC * ATT_PAD>;
var<workgroup> att_b: array<f32, ATT_BC * ATT_PAD>;
// Per block row and tile row: P (forward), dS (dq), P in the inputs' format (dk|dv).
var<workgroup> att_p: array<f32, ATT_BR * ATT_BC>;
// dk|dv: dS per block row and tile row.
var<workgroup> att_s: array<f32, ATT_BR * ATT_BC>;
// dk|dv: the query tile's (max, sum, sum(P * dP)).
var<workgroup> att_q: array<f32, 3u * ATT_BC>;
// A row's lanes' two values (their max and sum, or their sum(P * dP)).
var<workgroup> att_red: array<f32, 512>;

// A workgroup's block: its (sequence, head), its first row, the offset of the head's q in token
// 0 of the sequence (k at + C, v at + 2C; rows 3C apart) and of its columns in (B, T, C) (rows
// C apart); `live`: the block exists (the dispatch may have spare workgroups).
struct AttBlock {
    bh: u32,
    first: u32,
    qkv: u32,
    rows: u32,
    live: bool,
}

// The block of a workgroup, in blocks of `rows` rows (ATT_BR here; attention_coop.wgsl's CB).
fn att_block(wg: vec3<u32>, nwg: vec3<u32>, rows: u32) -> AttBlock {
    let t = params.c;
    let c = params.h * params.d;
    let per_head = (t + rows - 1u) / rows;
    let w = wg.y * nwg.x + wg.x;
    let bh = w / per_head;
    let b = bh / params.h;
    let head = bh % params.h;
    return AttBlock(
        bh,
        (w % per_head) * rows,
        b * t * 3u * c + head * params.d,
        b * t * c + head * params.d,
        bh * t < params.n
    );
}

// Rows j0.. of q|k|v from `base` (rows 3C apart), before `end` (0 past it), rounded to the
// inputs' format, into att_a (or att_b); every invocation takes part.
fn att_tile_a(base: u32, j0: u32, end: u32, lid: u32) {
    let stride = 3u * params.h * params.d;
    for (var e = lid; e < ATT_BC * params.d; e += 256u) {
        let r = e / params.d;
        let x = e % params.d;
        var v = 0.0;
        if (j0 + r < end) {
            v = held(in0v(base + (j0 + r) * stride + x), params.inputs);
        }
        att_a[r * ATT_PAD + x] = v;
    }
}

fn att_tile_b(base: u32, j0: u32, end: u32, lid: u32) {
    let stride = 3u * params.h * params.d;
    for (var e = lid; e < ATT_BC * params.d; e += 256u) {
        let r = e / params.d;
        let x = e % params.d;
        var v = 0.0;
        if (j0 + r < end) {
            v = held(in0v(base + (j0 + r) * stride + x), params.inputs);
        }
        att_b[r * ATT_PAD + x] = v;
    }
}

// Rows i0.. of the output's gradient (rows C apart from `base`) into att_b.
fn att_tile_grad(base: u32, i0: u32, end: u32, lid: u32) {
    let stride = params.h * params.d;
    for (var e = lid; e < ATT_BC * params.d; e += 256u) {
        let r = e / params.d;
        let x = e % params.d;
        var v = 0.0;
        if (i0 + r < end) {
            v = held(in1[base + (i0 + r) * stride + x], params.inputs);
        }
        att_b[r * ATT_PAD + x] = v;
    }
}

// The score of a private row against row `r` of att_a, as the unfused plan holds it, scaled as
// its softmax reads it.
fn att_score(x: ptr<function, array<f32, ATT_MAX_D>>, r: u32) -> f32 {
    var s = 0.0;
    for (var e = 0u; e < params.d; e++) {
        s += (*x)[e] * att_a[r * ATT_PAD + e];
    }
    return scaled(held(s, params.compute), params.compute);
}

// dP of a private row (the output's gradient) against row `r` of att_b (v), held.
fn att_dp(g: ptr<function, array<f32, ATT_MAX_D>>, r: u32) -> f32 {
    var s = 0.0;
    for (var e = 0u; e < params.d; e++) {
        s += (*g)[e] * att_b[r * ATT_PAD + e];
    }
    return held(s, params.compute);
}

// The stored probability: the unfused softmax's exp(z - max) / sum, held in its format.
fn att_p_of(z: f32, m: f32, l: f32) -> f32 {
    return held(exp(z - m) / l, params.probs);
}

// The gradient of a score from its probability and dP (the unfused softmax backward's, held as
// the unfused plan holds it), rounded to the matmul inputs' format.
fn att_ds(p: f32, dp: f32, pdp: f32) -> f32 {
    let compute = params.compute;
    return held(scaled(held(p * (dp - pdp), compute), compute), params.inputs);
}

// Pair u of a tile row of att_a or att_b (values 2u and 2u + 1; the second is not read past d,
// its value then unused).
fn att_pair_a(r: u32, u: u32) -> vec2<f32> {
    return vec2<f32>(att_a[r * ATT_PAD + 2u * u], att_a[r * ATT_PAD + 2u * u + 1u]);
}

fn att_pair_b(r: u32, u: u32) -> vec2<f32> {
    return vec2<f32>(att_b[r * ATT_PAD + 2u * u], att_b[r * ATT_PAD + 2u * u + 1u]);
}

// A private row of q|k|v (row `i` of the head's part at `base`, rows 3C apart) rounded to the
// inputs' format.
fn att_own(x: ptr<function, array<f32, ATT_MAX_D>>, base: u32, i: u32) {
    let stride = 3u * params.h * params.d;
    for (var e = 0u; e < params.d; e++) {
        (*x)[e] = held(in0v(base + i * stride + e), params.inputs);
    }
}

@compute @workgroup_size(256)
fn attention_fwd(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let blk = att_block(wg, nwg, ATT_BR);
    // Uniform over the workgroup, as the barriers below need.
    if (!blk.live) {
        return;
    }
    let t = params.c;
    let c = params.h * params.d;
    let r = lid / ATT_LANES;
    let lane = lid % ATT_LANES;
    let i = blk.first + r;
    let live = i < t;
    var q: array<f32, ATT_MAX_D>;
    att_own(&q, blk.qkv, min(i, t - 1u));
    // The keys the block sees (causal): up to its last row.
    let keys = min(blk.first + ATT_BR, t);
    // Pass 1: this lane's keys' max and sum of exp(z - max), rescaled as the max grows.
    var m = ATT_LOW;
    var l = 0.0;
    for (var j0 = 0u; j0 < keys; j0 += ATT_BC) {
        att_tile_a(blk.qkv + c, j0, keys, lid);
        workgroupBarrier();
        for (var jj = lane; jj < ATT_BC; jj += ATT_LANES) {
            if (live && j0 + jj <= i) {
                let z = att_score(&q, jj);
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
    // The row's: the lanes' max, and their sums rescaled to it, added in lane order. The
    // unfused sum is exp(inf - inf) = NaN for a row holding +inf: so is this one (a score above
    // 3.4e38, whose exp overflows anyway, counts as infinite).
    att_red[lid] = m;
    att_red[256u + lid] = l;
    workgroupBarrier();
    var mm = ATT_LOW;
    for (var s = 0u; s < ATT_LANES; s++) {
        mm = max(mm, att_red[r * ATT_LANES + s]);
    }
    var ll = 0.0;
    for (var s = 0u; s < ATT_LANES; s++) {
        ll += att_red[256u + r * ATT_LANES + s] * exp(att_red[r * ATT_LANES + s] - mm);
    }
    if (mm > 3.4e38) {
        ll = mm - mm;
    }
    // Pass 2: out = P . v, this lane's pairs of the row, key by key.
    var acc: array<vec2<f32>, ATT_PAIRS>;
    for (var j0 = 0u; j0 < keys; j0 += ATT_BC) {
        att_tile_a(blk.qkv + c, j0, keys, lid);
        att_tile_b(blk.qkv + 2u * c, j0, keys, lid);
        workgroupBarrier();
        for (var jj = lane; jj < ATT_BC; jj += ATT_LANES) {
            var p = 0.0;
            if (live && j0 + jj <= i) {
                p = held(att_p_of(att_score(&q, jj), mm, ll), params.inputs);
            }
            att_p[r * ATT_BC + jj] = p;
        }
        workgroupBarrier();
        for (var jj = 0u; jj < ATT_BC; jj++) {
            if (j0 + jj <= i) {
                let p = att_p[r * ATT_BC + jj];
                for (var u = 0u; u < ATT_PAIRS; u++) {
                    let pair = lane + u * ATT_LANES;
                    if (2u * pair < params.d) {
                        acc[u] += p * att_pair_b(jj, pair);
                    }
                }
            }
        }
        workgroupBarrier();
    }
    if (!live) {
        return;
    }
    let at = blk.rows + i * c;
    for (var u = 0u; u < ATT_PAIRS; u++) {
        let e = 2u * (lane + u * ATT_LANES);
        if (e < params.d) {
            if (params.coded != 0u) {
                // Codes of `compute` into out2, two to a word (d and C are even:
                // Plan::store_codes).
                out2[(at + e) / 2u] = code_pair(acc[u].x, acc[u].y, params.compute);
            } else {
                out0[at + e] = held(acc[u].x, params.compute);
                if (e + 1u < params.d) {
                    out0[at + e + 1u] = held(acc[u].y, params.compute);
                }
            }
        }
    }
    if (lane == 0u) {
        let row = blk.bh * t + i;
        out1[2u * row] = mm;
        out1[2u * row + 1u] = ll;
    }
}

// dq (out0's first third of each row) and sum(P * dP) per row into out1.
@compute @workgroup_size(256)
fn attention_bwd_q(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let blk = att_block(wg, nwg, ATT_BR);
    if (!blk.live) {
        return;
    }
    let t = params.c;
    let c = params.h * params.d;
    let r = lid / ATT_LANES;
    let lane = lid % ATT_LANES;
    let i = blk.first + r;
    let live = i < t;
    let ic = min(i, t - 1u);
    let row = blk.bh * t + ic;
    var q: array<f32, ATT_MAX_D>;
    var g: array<f32, ATT_MAX_D>;
    att_own(&q, blk.qkv, ic);
    for (var e = 0u; e < params.d; e++) {
        g[e] = held(in1[blk.rows + ic * c + e], params.inputs);
    }
    let m = in2[2u * row];
    let l = in2[2u * row + 1u];
    let keys = min(blk.first + ATT_BR, t);
    // Sweep 1: sum(P * dP), this lane's keys, then the lanes' in lane order.
    var pdp = 0.0;
    for (var j0 = 0u; j0 < keys; j0 += ATT_BC) {
        att_tile_a(blk.qkv + c, j0, keys, lid);
        att_tile_b(blk.qkv + 2u * c, j0, keys, lid);
        workgroupBarrier();
        for (var jj = lane; jj < ATT_BC; jj += ATT_LANES) {
            if (live && j0 + jj <= i) {
                pdp += att_p_of(att_score(&q, jj), m, l) * att_dp(&g, jj);
            }
        }
        workgroupBarrier();
    }
    att_red[lid] = pdp;
    workgroupBarrier();
    var rp = 0.0;
    for (var s = 0u; s < ATT_LANES; s++) {
        rp += att_red[r * ATT_LANES + s];
    }
    // Sweep 2: dS, then dq = dS . k, this lane's pairs, key by key.
    var dq: array<vec2<f32>, ATT_PAIRS>;
    for (var j0 = 0u; j0 < keys; j0 += ATT_BC) {
        att_tile_a(blk.qkv + c, j0, keys, lid);
        att_tile_b(blk.qkv + 2u * c, j0, keys, lid);
        workgroupBarrier();
        for (var jj = lane; jj < ATT_BC; jj += ATT_LANES) {
            var ds = 0.0;
            if (live && j0 + jj <= i) {
                ds = att_ds(att_p_of(att_score(&q, jj), m, l), att_dp(&g, jj), rp);
            }
            att_p[r * ATT_BC + jj] = ds;
        }
        workgroupBarrier();
        for (var jj = 0u; jj < ATT_BC; jj++) {
            if (j0 + jj <= i) {
                let ds = att_p[r * ATT_BC + jj];
                for (var u = 0u; u < ATT_PAIRS; u++) {
                    let pair = lane + u * ATT_LANES;
                    if (2u * pair < params.d) {
                        dq[u] += ds * att_pair_a(jj, pair);
                    }
                }
            }
        }
        workgroupBarrier();
    }
    if (!live) {
        return;
    }
    let at = blk.qkv + i * 3u * c;
    for (var u = 0u; u < ATT_PAIRS; u++) {
        let e = 2u * (lane + u * ATT_LANES);
        if (e < params.d) {
            out0[at + e] = held(dq[u].x, params.compute);
            if (e + 1u < params.d) {
                out0[at + e + 1u] = held(dq[u].y, params.compute);
            }
        }
    }
    if (lane == 0u) {
        out1[row] = rp;
    }
}

// dk and dv (out0's second and third thirds) for a block of key rows: the query tiles from the
// block's first key on, each query i >= j adding its term in query order (reads out1's
// sum(P * dP)).
@compute @workgroup_size(256)
fn attention_bwd_kv(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let blk = att_block(wg, nwg, ATT_BR);
    if (!blk.live) {
        return;
    }
    let t = params.c;
    let c = params.h * params.d;
    let r = lid / ATT_LANES;
    let lane = lid % ATT_LANES;
    let j = blk.first + r;
    let live = j < t;
    var k: array<f32, ATT_MAX_D>;
    var v: array<f32, ATT_MAX_D>;
    att_own(&k, blk.qkv + c, min(j, t - 1u));
    att_own(&v, blk.qkv + 2u * c, min(j, t - 1u));
    // Row 0 of the head among the score rows.
    let first_row = blk.bh * t;
    var dk: array<vec2<f32>, ATT_PAIRS>;
    var dv: array<vec2<f32>, ATT_PAIRS>;
    for (var i0 = blk.first; i0 < t; i0 += ATT_BC) {
        att_tile_a(blk.qkv, i0, t, lid);
        att_tile_grad(blk.rows, i0, t, lid);
        if (lid < ATT_BC && i0 + lid < t) {
            let row = first_row + i0 + lid;
            att_q[lid] = in2[2u * row];
            att_q[ATT_BC + lid] = in2[2u * row + 1u];
            att_q[2u * ATT_BC + lid] = out1[row];
        }
        workgroupBarrier();
        for (var ii = lane; ii < ATT_BC; ii += ATT_LANES) {
            let i = i0 + ii;
            var p = 0.0;
            var ds = 0.0;
            if (live && i >= j && i < t) {
                // The score and dP of query i against this key, as the dq pass computes them.
                var s = 0.0;
                var dp = 0.0;
                for (var e = 0u; e < params.d; e++) {
                    s += att_a[ii * ATT_PAD + e] * k[e];
                    dp += att_b[ii * ATT_PAD + e] * v[e];
                }
                let pr = att_p_of(scaled(held(s, params.compute), params.compute),
                                  att_q[ii], att_q[ATT_BC + ii]);
                ds = att_ds(pr, held(dp, params.compute), att_q[2u * ATT_BC + ii]);
                p = held(pr, params.inputs);
            }
            att_p[r * ATT_BC + ii] = p;
            att_s[r * ATT_BC + ii] = ds;
        }
        workgroupBarrier();
        for (var ii = 0u; ii < ATT_BC; ii++) {
            let i = i0 + ii;
            if (i >= j && i < t) {
                let p = att_p[r * ATT_BC + ii];
                let ds = att_s[r * ATT_BC + ii];
                for (var u = 0u; u < ATT_PAIRS; u++) {
                    let pair = lane + u * ATT_LANES;
                    if (2u * pair < params.d) {
                        dv[u] += p * att_pair_b(ii, pair);
                        dk[u] += ds * att_pair_a(ii, pair);
                    }
                }
            }
        }
        workgroupBarrier();
    }
    if (!live) {
        return;
    }
    let at = blk.qkv + j * 3u * c;
    for (var u = 0u; u < ATT_PAIRS; u++) {
        let e = 2u * (lane + u * ATT_LANES);
        if (e < params.d) {
            out0[at + c + e] = held(dk[u].x, params.compute);
            out0[at + 2u * c + e] = held(dv[u].x, params.compute);
            if (e + 1u < params.d) {
                out0[at + c + e + 1u] = held(dk[u].y, params.compute);
                out0[at + 2u * c + e + 1u] = held(dv[u].y, params.compute);
            }
        }
    }
}
