// train.wgsl: the training ops besides matmul (the host reference is src/backend/reference/ops.rs); the
// GradScaler's unscale, AdamW and the per-op path's cross-entropy backward are step.wgsl's.
// Row ops (layer norm, RMS norm, softmax, cross entropy) give each row ROW_LANES invocations,
// which stride the row (neighbours read neighbouring values) and reduce through workgroup
// memory in a fixed tree, so a rerun gives the same bits. Column reductions (bias and norm
// parameter gradients) write one partial sum per chunk of rows, then `sum_partials` adds the
// chunks in order: the summation order of cuda/train.cu. Elementwise ops (the unary family, the
// product, the mean squared error's terms) take one invocation per element. Bindings:
// 0 params; 1-3 inputs; 4-6 outputs.

struct TrainParams {
    // Elements, or rows for row ops.
    n: u32,
    // Row length (layer norm width, vocabulary, context t for softmax).
    c: u32,
    // Tokens of the embedding scatter-add.
    tokens: u32,
    // Softmax scale (its product with a score held in `held`).
    scale: f32,
    // Fused attention: heads, head size, format ids of the matmul inputs, the stored
    // probabilities and the held matmul results.
    h: u32,
    d: u32,
    inputs: u32,
    probs: u32,
    compute: u32,
    // Format id the op's output is held in (layer norm, a unary function, the cross entropy's gradient).
    held: u32,
    // 1: the output is stored as 16-bit codes of `held` in out2, two to a word (layer norm,
    // a unary function); 0: as f32 values in out0.
    coded: u32,
    // Cross entropy: 1 writes the loss's gradient (the backward fused in), 0 the probabilities.
    grad: u32,
    // The format id whose 16-bit codes in0 holds, two to a word (a coded input: a unary function's
    // x, such as the pre-GELU activations; fused attention's q|k|v); f32's id: in0 holds f32 words.
    x_stored: u32,
    // The span [begin, end) of an id's tokens (embedding_sum) or chunks (sum_partials) this
    // dispatch adds, and SPAN_FIRST where the sums start at zero, else from what the previous
    // span wrote: all of them in one span unless the adapter's loop budget splits them
    // (src/backend/wgpu/budget.rs). The same additions in the same order either way.
    begin: u32,
    end: u32,
    span: u32,
    // RMS norm's eps.
    eps: f32,
    // The format id the input an op rounds as it reads it is rounded to (the norms' and
    // the unary family's backward's dy, the softmax's scores, its backward's dp: the rounding of the
    // matmul product they read, folded in).
    read_held: u32,
    // 1: layer norm's backward sums out2's values (f32 bits: the gradient of x from its other
    // reader) into dx, held in `held`.
    sum: u32,
    // The unary family's function (UNARY_* of unary.wgsl).
    func: u32,
    // 1: the softmax's rows are blocks of t x t scores, row i seeing columns 0..=i.
    causal: u32,
    // What a row sum, or a broadcast's product, is divided by (1, or c for a mean).
    divisor: f32,
    // Dropout: the probability of dropping, the site, the key's words (its factor on the kept
    // values is `scale`).
    drop_p: f32,
    site: u32,
    key_lo: u32,
    key_hi: u32,
    // The softmax's mask, rows of t in in1 (plan::ScoreMask): MASK_NONE, MASK_KEYS (nonzero
    // leaves the key out) or MASK_BIAS (added to the scaled scores); score row r reads mask row
    // (r / mask_block) * mask_stride + r % mask_period.
    mask_kind: u32,
    mask_block: u32,
    mask_stride: u32,
    mask_period: u32,
    // The embedding gather's table rows, where it sorts the ids for the backward (0: it does
    // not).
    sort_rows: u32,
}

const MASK_NONE: u32 = 0u;
const MASK_KEYS: u32 = 1u;
const MASK_BIAS: u32 = 2u;

@group(0) @binding(0) var<uniform> params: TrainParams;
// Words: f32 bits, or two 16-bit codes of `params.x_stored` (a coded input: a unary function's x,
// attention's q|k|v), the even element in the low half; read through `in0v`.
@group(0) @binding(1) var<storage, read> in0: array<u32>;
@group(0) @binding(2) var<storage, read> in1: array<f32>;
@group(0) @binding(3) var<storage, read> in2: array<f32>;
@group(0) @binding(4) var<storage, read_write> out0: array<f32>;
@group(0) @binding(5) var<storage, read_write> out1: array<f32>;
// Words: f32 bits, or two 16-bit codes (the even element in the low half).
@group(0) @binding(6) var<storage, read_write> out2: array<u32>;
// The norms' backward (`layernorm_bwd`, `rmsnorm_bwd`) alone: its column partials.
@group(0) @binding(7) var<storage, read_write> out3: array<f32>;

// Row ops: a workgroup of 256 invocations takes 256 / ROW_LANES rows, ROW_LANES invocations to
// a row (`ROW_LANES`, a power of two, comes from the generated header: `Gpu::row_lanes`). On a
// GPU a row's lanes stride it, so neighbours read neighbouring values, and reduce in a fixed
// tree in workgroup memory; where a CPU runs the invocations (lavapipe) one lane a row keeps
// every SIMD lane busy with its own row and the trees empty.
// Rows per chunk of a column reduction (CHUNK_ROWS in cuda/train.cu, `chunks` in
// src/backend/wgpu/train.rs); its workgroups are 32 columns x 8 row lanes.
const CHUNK_ROWS: u32 = 256u;

// A row op's lanes' partial values, or a column reduction's.
var<workgroup> row_partial: array<f32, 256>;

// The row of a row op's invocation: its index (clamped to the last row, so that a spare
// invocation of the last workgroup reads in bounds and takes part in the barriers) and its
// lane; `live`: the row exists, and the invocation may write.
struct RowSlot {
    row: u32,
    lane: u32,
    live: bool,
}

fn row_slot(wg: vec3<u32>, nwg: vec3<u32>, lid: u32) -> RowSlot {
    return row_slot_at(wg.y * nwg.x + wg.x, lid);
}

// `row_slot` in workgroup w (the flat workgroup index).
fn row_slot_at(w: u32, lid: u32) -> RowSlot {
    let row = (w * 256u + lid) / ROW_LANES;
    var s: RowSlot;
    s.row = min(row, max(params.n, 1u) - 1u);
    s.lane = lid % ROW_LANES;
    s.live = row < params.n;
    return s;
}

// The sum of the `v` of a row's lanes, in each of them, added in a fixed tree. Every
// invocation of the workgroup calls it (it has barriers).
fn row_sum(v: f32, lid: u32) -> f32 {
    row_partial[lid] = v;
    workgroupBarrier();
    let lane = lid % ROW_LANES;
    for (var s = ROW_LANES / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            row_partial[lid] += row_partial[lid + s];
        }
        workgroupBarrier();
    }
    let total = row_partial[lid - lane];
    workgroupBarrier();  // every lane has read it before the next call writes
    return total;
}

fn row_max(v: f32, lid: u32) -> f32 {
    row_partial[lid] = v;
    workgroupBarrier();
    let lane = lid % ROW_LANES;
    for (var s = ROW_LANES / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            row_partial[lid] = max(row_partial[lid], row_partial[lid + s]);
        }
        workgroupBarrier();
    }
    let total = row_partial[lid - lane];
    workgroupBarrier();
    return total;
}

// y = (x - mean) * rstd * g + b per row of c: in0 = x, in1 = g, in2 = b; out0 = y,
// out1 = (mean, rstd) per row.
@compute @workgroup_size(256)
fn layernorm_fwd(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let slot = row_slot(wg, nwg, lid);
    let r = slot.row;
    let c = params.c;
    let base = r * c;
    var s = 0.0;
    for (var i = slot.lane; i < c; i += ROW_LANES) {
        s += in0v(base + i);
    }
    let mean = row_sum(s, lid) / f32(c);
    var q = 0.0;
    for (var i = slot.lane; i < c; i += ROW_LANES) {
        let d = in0v(base + i) - mean;
        q += d * d;
    }
    let rstd = inverseSqrt(row_sum(q, lid) / f32(c) + 1e-5);
    if (!slot.live) {
        return;
    }
    if (params.coded != 0u) {
        // c is even (Plan::store_codes): the row's words are its own.
        for (var i = 2u * slot.lane; i < c; i += 2u * ROW_LANES) {
            let lo = (in0v(base + i) - mean) * rstd * in1[i] + in2[i];
            let hi = (in0v(base + i + 1u) - mean) * rstd * in1[i + 1u] + in2[i + 1u];
            out2[(base + i) / 2u] = code_pair(lo, hi, params.held);
        }
    } else {
        for (var i = slot.lane; i < c; i += ROW_LANES) {
            out0[base + i] = held((in0v(base + i) - mean) * rstd * in1[i] + in2[i], params.held);
        }
    }
    if (slot.lane == 0u) {
        out1[2u * r] = mean;
        out1[2u * r + 1u] = rstd;
    }
}

// The workgroups of a row op's rows (`params.n` of them).
fn row_workgroups() -> u32 {
    return (params.n * ROW_LANES + 255u) / 256u;
}

// Layer norm's backward in one dispatch: its first workgroups dx per row, the rest the partials
// of dg and db per chunk of rows (two passes over the same inputs that write apart, so one
// launch): in0 = dy, in1 = x, in2 = g; out1 = (mean, rstd) per row (read); out0 = dx, or
// (params.sum) dx + out2's values held in `held` (out2 read); out3 = dg's chunks, then db's
// (`sum_partials` adds them).
@compute @workgroup_size(256)
fn layernorm_bwd(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let w = wg.y * nwg.x + wg.x;
    if (w < row_workgroups()) {
        layernorm_bwd_x(w, lid);
    } else {
        layernorm_bwd_partials(w - row_workgroups(), lid);
    }
}

// Layer norm's dx, in row workgroup w.
fn layernorm_bwd_x(w: u32, lid: u32) {
    let slot = row_slot_at(w, lid);
    let r = slot.row;
    let c = params.c;
    let base = r * c;
    let mean = out1[2u * r];
    let rstd = out1[2u * r + 1u];
    var sd = 0.0;
    var sdx = 0.0;
    for (var i = slot.lane; i < c; i += ROW_LANES) {
        let xhat = (in1[base + i] - mean) * rstd;
        let d = read_at(base + i) * in2[i];
        sd += d;
        sdx += d * xhat;
    }
    let mean_d = row_sum(sd, lid) / f32(c);
    let mean_dx = row_sum(sdx, lid) / f32(c);
    if (!slot.live) {
        return;
    }
    for (var i = slot.lane; i < c; i += ROW_LANES) {
        let xhat = (in1[base + i] - mean) * rstd;
        let d = read_at(base + i) * in2[i];
        let dx = rstd * (d - mean_d - xhat * mean_dx);
        if (params.sum != 0u) {
            out0[base + i] = held(dx + bitcast<f32>(out2[base + i]), params.held);
        } else {
            out0[base + i] = dx;
        }
    }
}

// A column reduction's workgroup: 32 columns from `col0` over one chunk of rows [first, end),
// 8 row lanes (invocation lid takes column col0 + lid % 32 and rows first + lid / 32 + 8k). It
// depends on the workgroup alone, so the early return of a spare workgroup stays uniform.
struct ColumnBlock {
    col0: u32,
    chunk: u32,
    first: u32,
    end: u32,
}

fn column_block(wg: vec3<u32>, nwg: vec3<u32>, rows: u32, c: u32) -> ColumnBlock {
    return column_block_at(wg.y * nwg.x + wg.x, rows, c);
}

// `column_block` of workgroup w (the flat index among the reduction's workgroups).
fn column_block_at(w: u32, rows: u32, c: u32) -> ColumnBlock {
    let blocks = (c + 31u) / 32u;
    var b: ColumnBlock;
    b.col0 = (w % blocks) * 32u;
    b.chunk = w / blocks;
    b.first = b.chunk * CHUNK_ROWS;
    b.end = min(b.first + CHUNK_ROWS, rows);
    return b;
}

// The sum of the 8 lanes' `s` in lane order, in lane 0 (uniform control flow only).
fn lanes_sum(s: f32, lid: u32) -> f32 {
    workgroupBarrier();  // the previous call's readers are done
    row_partial[lid] = s;
    workgroupBarrier();
    var t = 0.0;
    if (lid < 32u) {
        for (var k = 0u; k < 8u; k++) {
            t += row_partial[k * 32u + lid];
        }
    }
    return t;
}

// partial[chunk, j] = the chunk's sum of x[row, j], x rounded to `read_held` as it is read (a
// linear layer's output gradient, held in the compute format): in0 = x; out0 = partials;
// n = rows.
@compute @workgroup_size(256)
fn column_partials(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let c = params.c;
    let b = column_block(wg, nwg, params.n, c);
    if (b.first >= params.n) {
        return;
    }
    // Spare columns of the last block read column c - 1 and write nothing.
    let col = b.col0 + lid % 32u;
    let j = min(col, c - 1u);
    var s = 0.0;
    for (var r = b.first + lid / 32u; r < b.end; r += 8u) {
        s += read_at(r * c + j);
    }
    let t = lanes_sum(s, lid);
    if (lid < 32u && col < c) {
        out0[b.chunk * c + col] = t;
    }
}

// Partials of layer norm's dg = sum dy * xhat and db = sum dy per column, in column workgroup
// w: out3 = dg's chunks, then db's (2 * chunks * c values).
fn layernorm_bwd_partials(w: u32, lid: u32) {
    let c = params.c;
    let b = column_block_at(w, params.n, c);
    if (b.first >= params.n) {
        return;
    }
    let col = b.col0 + lid % 32u;
    let j = min(col, c - 1u);
    var dg = 0.0;
    var db = 0.0;
    for (var r = b.first + lid / 32u; r < b.end; r += 8u) {
        let e = r * c + j;
        dg += read_at(e) * ((in1[e] - out1[2u * r]) * out1[2u * r + 1u]);
        db += read_at(e);
    }
    let tg = lanes_sum(dg, lid);
    let tb = lanes_sum(db, lid);
    let chunks = (params.n + CHUNK_ROWS - 1u) / CHUNK_ROWS;
    if (lid < 32u && col < c) {
        out3[b.chunk * c + col] = tg;
        out3[(chunks + b.chunk) * c + col] = tb;
    }
}

// out[j] = the sum over chunks of partial[chunk, j], in chunk order: in0 = partials of
// `tokens` chunks, one or two parts (n = parts * c); part 0 into out0, part 1 into out2 (as
// f32 bits: layer norm's db); the complete sums (the last span's) held in `held`.
@compute @workgroup_size(256)
fn sum_partials(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let e = flat_index(wg, nwg, lid);
    if (e >= params.n) {
        return;
    }
    let c = params.c;
    let chunks = params.tokens;
    let part = e / c;
    let j = e % c;
    var s = 0.0;
    if ((params.span & SPAN_FIRST) == 0u) {
        s = select(bitcast<f32>(out2[j]), out0[j], part == 0u);
    }
    for (var k = params.begin; k < params.end; k++) {
        s += in0v((part * chunks + k) * c + j);
    }
    if ((params.span & SPAN_LAST) != 0u) {
        s = held(s, params.held);
    }
    if (part == 0u) {
        out0[j] = s;
    } else {
        out2[j] = bitcast<u32>(s);
    }
}

// ---- RMS norm (torch.nn.RMSNorm), row ops as layer norm's ----

// y = x * rstd * g per row of c, rstd = 1 / sqrt(mean(x^2) + eps): in0 = x, in1 = g;
// out0 = y held in params.held, or (coded) out2 = y's codes; out1 = rstd per row.
@compute @workgroup_size(256)
fn rmsnorm_fwd(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let slot = row_slot(wg, nwg, lid);
    let r = slot.row;
    let c = params.c;
    let base = r * c;
    var q = 0.0;
    for (var i = slot.lane; i < c; i += ROW_LANES) {
        let v = in0v(base + i);
        q += v * v;
    }
    let rstd = inverseSqrt(row_sum(q, lid) / f32(c) + params.eps);
    if (!slot.live) {
        return;
    }
    if (params.coded != 0u) {
        // c is even (Plan::store_codes): the row's words are its own.
        for (var i = 2u * slot.lane; i < c; i += 2u * ROW_LANES) {
            let lo = in0v(base + i) * rstd * in1[i];
            let hi = in0v(base + i + 1u) * rstd * in1[i + 1u];
            out2[(base + i) / 2u] = code_pair(lo, hi, params.held);
        }
    } else {
        for (var i = slot.lane; i < c; i += ROW_LANES) {
            out0[base + i] = held(in0v(base + i) * rstd * in1[i], params.held);
        }
    }
    if (slot.lane == 0u) {
        out1[r] = rstd;
    }
}

// RMS norm's backward in one dispatch, as layer norm's: dx per row, rstd * (d - xhat *
// mean(d * xhat)) with d = dy * g, xhat = x * rstd, then the partials of dg: in0 = dy, in1 = x,
// in2 = g; out1 = rstd per row (read); out0 = dx; out3 = dg's chunks.
@compute @workgroup_size(256)
fn rmsnorm_bwd(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let w = wg.y * nwg.x + wg.x;
    if (w < row_workgroups()) {
        rmsnorm_bwd_x(w, lid);
    } else {
        rmsnorm_bwd_partials(w - row_workgroups(), lid);
    }
}

// RMS norm's dx, in row workgroup w.
fn rmsnorm_bwd_x(w: u32, lid: u32) {
    let slot = row_slot_at(w, lid);
    let r = slot.row;
    let c = params.c;
    let base = r * c;
    let rstd = out1[r];
    var sdx = 0.0;
    for (var i = slot.lane; i < c; i += ROW_LANES) {
        sdx += read_at(base + i) * in2[i] * (in1[base + i] * rstd);
    }
    let mean_dx = row_sum(sdx, lid) / f32(c);
    if (!slot.live) {
        return;
    }
    for (var i = slot.lane; i < c; i += ROW_LANES) {
        let xhat = in1[base + i] * rstd;
        out0[base + i] = rstd * (read_at(base + i) * in2[i] - xhat * mean_dx);
    }
}

// Partials of RMS norm's dg = sum dy * xhat per column, in column workgroup w: out3 = dg's
// chunks (chunks * c values).
fn rmsnorm_bwd_partials(w: u32, lid: u32) {
    let c = params.c;
    let b = column_block_at(w, params.n, c);
    if (b.first >= params.n) {
        return;
    }
    let col = b.col0 + lid % 32u;
    let j = min(col, c - 1u);
    var dg = 0.0;
    for (var r = b.first + lid / 32u; r < b.end; r += 8u) {
        let e = r * c + j;
        dg += read_at(e) * (in1[e] * out1[r]);
    }
    let t = lanes_sum(dg, lid);
    if (lid < 32u && col < c) {
        out3[b.chunk * c + col] = t;
    }
}

// Element i of in0: the f32 its word holds, or where the input is a coded tensor
// (`params.x_stored`: a unary function's x, attention's q|k|v) the value of its code.
fn in0v(i: u32) -> f32 {
    if (params.x_stored == FMT_F32) {
        return bitcast<f32>(in0[i]);
    }
    return code_value(in0[i >> 1u], i, params.x_stored);
}

// Element i of in0 (through `in0v`) as an op that rounds it as it reads it sees it (the
// norms' backward's dy, the softmax's scores): rounded to `params.read_held`.
fn read_at(i: u32) -> f32 {
    return held(in0v(i), params.read_held);
}

// f(x) of the unary family (`unary` of unary.wgsl, f = params.func): in0 = x; out0 = y, or
// (coded) out2 = y's codes, one word per invocation.
@compute @workgroup_size(256)
fn unary_fwd(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let e = flat_index(wg, nwg, lid);
    if (params.coded != 0u) {
        let lo = 2u * e;
        if (lo >= params.n) {
            return;
        }
        // An odd n's last word holds one code.
        let hi = select(0.0, unary(params.func, in0v(min(lo + 1u, params.n - 1u))), lo + 1u < params.n);
        out2[e] = code_pair(unary(params.func, in0v(lo)), hi, params.held);
        return;
    }
    if (e >= params.n) {
        return;
    }
    out0[e] = held(unary(params.func, in0v(e)), params.held);
}

// dx = dy * f'(x): in0 = x, in1 = dy (rounded to `read_held` as it is read); out0 = dx, held
// in `held`.
@compute @workgroup_size(256)
fn unary_bwd(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let e = flat_index(wg, nwg, lid);
    if (e >= params.n) {
        return;
    }
    out0[e] = held(held(in1[e], params.read_held) * unary_grad(params.func, in0v(e)), params.held);
}

// out = a * b elementwise, the f32 product held in params.held: in0 = a, in1 = b; out0 = the
// product, or (coded) out2 = its codes, one word per invocation.
@compute @workgroup_size(256)
fn elementwise_mul(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let e = flat_index(wg, nwg, lid);
    if (params.coded != 0u) {
        let lo = 2u * e;
        if (lo >= params.n) {
            return;
        }
        let last = min(lo + 1u, params.n - 1u);
        let hi = select(0.0, in0v(last) * in1[last], lo + 1u < params.n);
        out2[e] = code_pair(in0v(lo) * in1[lo], hi, params.held);
        return;
    }
    if (e >= params.n) {
        return;
    }
    out0[e] = held(in0v(e) * in1[e], params.held);
}

// The mean squared error's gradient and terms over n elements: in0 = predictions, in1 =
// targets, in2 = the plan's scalars; out0 = 2 (pred - target) * DLOSS / n held in params.held,
// out1 = (pred - target)^2 (their mean is the caller's, as the cross entropy's rows' losses).
@compute @workgroup_size(256)
fn mse_fwd(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let e = flat_index(wg, nwg, lid);
    if (e >= params.n) {
        return;
    }
    let d = in0v(e) - in1[e];
    out0[e] = held(d * (2.0 * in2[S_DLOSS] / f32(params.n)), params.held);
    out1[e] = d * d;
}

// The high word of a * b (WGSL has no 64-bit integers): from the 16-bit halves.
fn mul_hi(a: u32, b: u32) -> u32 {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let carry = ((p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu)) >> 16u;
    return a1 * b1 + (p01 >> 16u) + (p10 >> 16u) + carry;
}

// The first word of Philox4x32-10 of counter c under key k (src/plan/dropout.rs).
fn philox_first(counter: vec4<u32>, key: vec2<u32>) -> u32 {
    var c = counter;
    var k = key;
    for (var round = 0u; round < 10u; round++) {
        let hi0 = mul_hi(0xD2511F53u, c.x);
        let lo0 = 0xD2511F53u * c.x;
        let hi1 = mul_hi(0xCD9E8D57u, c.z);
        let lo1 = 0xCD9E8D57u * c.z;
        c = vec4<u32>(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
        k += vec2<u32>(0x9E3779B9u, 0xBB67AE85u);
    }
    return c.x;
}

// out0[e] = in0[e] * (kept ? scale : 0), held: element e kept where the uniform of
// philox_first(part n + e, step, site, 0) (its top 24 bits times 2^-24) is >= drop_p; the step
// and the batch's part from the scalars (in2). The forward, and on dy the backward. Where the run evaluates (S_EVAL),
// out0[e] = in0[e], held.
@compute @workgroup_size(256)
fn dropout(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let e = flat_index(wg, nwg, lid);
    if (e >= params.n) {
        return;
    }
    if (in2[S_EVAL] != 0.0) {
        out0[e] = held(in0v(e), params.held);
        return;
    }
    let step = u32(in2[S_STEP]);
    let first = u32(in2[S_PART]) * params.n;
    let word = philox_first(vec4<u32>(first + e, step, params.site, 0u), vec2<u32>(params.key_lo, params.key_hi));
    let u = f32(word >> 8u) * (1.0 / 16777216.0);
    out0[e] = held(in0v(e) * select(0.0, params.scale, u >= params.drop_p), params.held);
}

// Rotary position embeddings (src/plan/rotary.rs): in0 = x, rows of c = heads x d (d =
// params.d), row r at position r % t (t = params.tokens); in1 = the table, (cos, sin) of pair i
// at position p at 2 (p d/2 + i); out0 = each head's halves rotated pair by pair, held in
// `held`. params.grad = 1 rotates by the opposite angles (the backward).
@compute @workgroup_size(256)
fn rotary(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let e = flat_index(wg, nwg, lid);
    if (e >= params.n) {
        return;
    }
    let half = params.d / 2u;
    let row = e / params.c;
    let k = (e % params.c) % params.d;
    let i = k % half;
    let angle = ((row % params.tokens) * half + i) * 2u;
    let cos_a = in1[angle];
    let sin_a = select(in1[angle + 1u], -in1[angle + 1u], params.grad != 0u);
    var y: f32;
    if (k < half) {
        y = in0v(e) * cos_a - in0v(e + half) * sin_a;
    } else {
        y = in0v(e) * cos_a + in0v(e - half) * sin_a;
    }
    out0[e] = held(y, params.held);
}

// out0[row] = (the sum of the row's c values) / divisor, held in `held`: a sum (divisor 1) or
// a mean (divisor c) over the last axis; in0 = x (rows of c).
@compute @workgroup_size(256)
fn row_sums(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let slot = row_slot(wg, nwg, lid);
    let c = params.c;
    let base = slot.row * c;
    var s = 0.0;
    for (var j = slot.lane; j < c; j += ROW_LANES) {
        s += in0v(base + j);
    }
    let total = row_sum(s, lid);
    if (slot.live && slot.lane == 0u) {
        out0[slot.row] = held(total / params.divisor, params.held);
    }
}

// out0[e] = in0[e / c] * scale / divisor, held in `held`: each value repeated c times (a row
// sum's or mean's backward), or with c = 1 x times a constant; n = out's length.
@compute @workgroup_size(256)
fn broadcast(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let e = flat_index(wg, nwg, lid);
    if (e >= params.n) {
        return;
    }
    out0[e] = held(in0v(e / params.c) * params.scale / params.divisor, params.held);
}

// A score times the scale, held in `fmt` (plan::ScoreScale): what a softmax reads.
fn scaled(s: f32, fmt: u32) -> f32 {
    return held(s * params.scale, fmt);
}

// The last column a softmax row sees: with `params.causal`, row i of each t x t block sees
// 0..=i; else every column.
fn last_seen(row: u32, t: u32) -> u32 {
    return select(t - 1u, row % t, params.causal != 0u);
}

// Where softmax row `row`'s mask row starts in in1 (a mask bound: params.mask_kind).
fn mask_at(row: u32, t: u32) -> u32 {
    return (row / params.mask_block * params.mask_stride + row % params.mask_period) * t;
}

// Whether softmax row `row` sees key j <= last_seen: where a key mask is bound, its row for
// this score row says 0 there.
fn key_seen(row: u32, j: u32, t: u32) -> bool {
    return params.mask_kind != MASK_KEYS || in1[mask_at(row, t) + j] == 0.0;
}

// Score j of softmax row `row` as the softmax reads it: scaled and held, plus a bias where one
// is bound (in f32).
fn masked_score(row: u32, j: u32, t: u32, e: u32) -> f32 {
    let z = scaled(read_at(e), params.held);
    if (params.mask_kind == MASK_BIAS) {
        return z + in1[mask_at(row, t) + j];
    }
    return z;
}

// Softmax of the scaled scores per row of t = c (`last_seen`, `key_seen`, `masked_score`): in0
// = scores (rounded to `read_held` as they are read); out0 = probabilities (0 where masked, and
// throughout a row that sees no key: with a bias, where it is -inf on every key seen).
@compute @workgroup_size(256)
fn softmax_fwd(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let slot = row_slot(wg, nwg, lid);
    let t = params.c;
    let i = last_seen(slot.row, t);
    let base = slot.row * t;
    var m = -3.4e38;
    for (var j = slot.lane; j <= i; j += ROW_LANES) {
        if (key_seen(slot.row, j, t)) {
            m = max(m, masked_score(slot.row, j, t, base + j));
        }
    }
    m = row_max(m, lid);
    var s = 0.0;
    for (var j = slot.lane; j <= i; j += ROW_LANES) {
        if (key_seen(slot.row, j, t)) {
            s += exp(masked_score(slot.row, j, t, base + j) - m);
        }
    }
    let sum = row_sum(s, lid);
    if (!slot.live) {
        return;
    }
    // A bias of -inf on every key seen leaves none (its sum 0, not NaN).
    let none = params.mask_kind == MASK_BIAS && sum == 0.0;
    for (var j = slot.lane; j < t; j += ROW_LANES) {
        var p = 0.0;
        if (j <= i && key_seen(slot.row, j, t) && !none) {
            p = exp(masked_score(slot.row, j, t, base + j) - m) / sum;
        }
        out0[base + j] = p;
    }
}

// in0 = p, in1 = dp (rounded to `read_held` as it is read); out0 = d(scores) =
// scaled(held(p * (dp - sum(p * dp)))): the gradient of the held scaled scores, held, times the
// scale.
@compute @workgroup_size(256)
fn softmax_bwd(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let slot = row_slot(wg, nwg, lid);
    let t = params.c;
    let i = last_seen(slot.row, t);
    let base = slot.row * t;
    var s = 0.0;
    for (var j = slot.lane; j <= i; j += ROW_LANES) {
        s += in0v(base + j) * held(in1[base + j], params.read_held);
    }
    let dot = row_sum(s, lid);
    if (!slot.live) {
        return;
    }
    for (var j = slot.lane; j < t; j += ROW_LANES) {
        var d = 0.0;
        if (j <= i) {
            d = scaled(held(in0v(base + j) * (held(in1[base + j], params.read_held) - dot), params.held), params.held);
        }
        out0[base + j] = d;
    }
}

// Per row of v = c logits: in0 = logits, in1 = targets (as f32 bits of u32 ids); out0 =
// probabilities or, with params.grad (as a step plan runs it), the loss's gradient
// (p - onehot) * DLOSS_PER_ROW, held in params.held (in2 = the plan's scalars), or (coded) its
// codes in out2; out1 = the row's loss. The mean over rows is the caller's.
@compute @workgroup_size(256)
fn cross_entropy_fwd(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) lid: u32) {
    let slot = row_slot(wg, nwg, lid);
    let r = slot.row;
    let v = params.c;
    let base = r * v;
    var m = -3.4e38;
    for (var i = slot.lane; i < v; i += ROW_LANES) {
        m = max(m, in0v(base + i));
    }
    m = row_max(m, lid);
    var s = 0.0;
    for (var i = slot.lane; i < v; i += ROW_LANES) {
        s += exp(in0v(base + i) - m);
    }
    let sum = row_sum(s, lid);
    if (!slot.live) {
        return;
    }
    let label = bitcast<u32>(in1[r]);
    if (params.grad != 0u && params.coded != 0u) {
        let k = in2[S_DLOSS_PER_ROW];
        // v is even (Plan::store_codes): the row's words are its own.
        for (var i = 2u * slot.lane; i < v; i += 2u * ROW_LANES) {
            let lo = (exp(in0v(base + i) - m) / sum - select(0.0, 1.0, i == label)) * k;
            let hi = (exp(in0v(base + i + 1u) - m) / sum - select(0.0, 1.0, i + 1u == label)) * k;
            out2[(base + i) / 2u] = code_pair(lo, hi, params.held);
        }
    } else if (params.grad != 0u) {
        let k = in2[S_DLOSS_PER_ROW];
        for (var i = slot.lane; i < v; i += ROW_LANES) {
            var onehot = 0.0;
            if (i == label) {
                onehot = 1.0;
            }
            out0[base + i] = held((exp(in0v(base + i) - m) / sum - onehot) * k, params.held);
        }
    } else {
        for (var i = slot.lane; i < v; i += ROW_LANES) {
            out0[base + i] = exp(in0v(base + i) - m) / sum;
        }
    }
    if (slot.lane == 0u) {
        out1[r] = log(sum) + m - in0v(base + label);
    }
}

// Embedding gather: out0[r, i] = in0v(id(r), i); in1 = ids (f32 bits of u32), c = width,
// n = rows * c. With params.sort_rows (the table's rows), the workgroup after the gather's
// sorts the ids for the embedding's backward into out2 (`sort_ids`), which then needs no
// dispatch of its own for it: the ids are the same when the backward reads them.
@compute @workgroup_size(256)
fn embedding_fwd(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    // Uniform across the workgroup, as the sort's barriers need.
    if (params.sort_rows != 0u && wg.y * nwg.x + wg.x == (params.n + 255u) / 256u) {
        sort_ids(lid, params.sort_rows);
        return;
    }
    let e = flat_index(wg, nwg, lid);
    if (e >= params.n) {
        return;
    }
    let r = e / params.c;
    out0[e] = in0v(bitcast<u32>(in1[r]) * params.c + e % params.c);
}

// Embedding scatter-add as a sorted segment sum (CUDA's twin: embedding_sort and embedding_sum
// in cuda/train.cu), no float atomics: `embedding_sort` groups the token indices by id, then
// `embedding_sum` sums each id's rows of dout over its own tokens in token order.

// Invocations of the sort's one workgroup (`SORT_LANES` in src/backend/wgpu/train.rs).
const SORT_LANES: u32 = 256u;

var<workgroup> sort_partial: array<u32, 256>;

// A stable counting sort of the ids, one workgroup. in1 = ids (tokens of them, as f32 bits);
// out2 = the sort (`sort_ids`); n = rows.
@compute @workgroup_size(256)
fn embedding_sort(@builtin(local_invocation_index) t: u32) {
    sort_ids(t, params.n);
}

// The counting sort of `embedding_sort`, lane t of its workgroup, over `rows` ids. Lane t owns
// the tokens [t * per, (t + 1) * per) and counts them by id into counts[id * SORT_LANES + t];
// an exclusive scan of counts in that (id, lane) order gives each (id, lane) its first place, so
// that scattering the tokens in order, each lane its own, keeps every id's tokens in token
// order. out2 = counts (rows * SORT_LANES), offsets (rows + 1: where each id's tokens start,
// then where the last ends), sorted (params.tokens).
fn sort_ids(t: u32, rows: u32) {
    let tokens = params.tokens;
    let per = (tokens + SORT_LANES - 1u) / SORT_LANES;
    let own = min(t * per, tokens);
    let own_end = min(own + per, tokens);
    for (var id = 0u; id < rows; id++) {
        out2[id * SORT_LANES + t] = 0u;
    }
    // Ids are checked against the table before a step (an id beyond it is left out here).
    for (var r = own; r < own_end; r++) {
        let id = bitcast<u32>(in1[r]);
        if (id < rows) {
            out2[id * SORT_LANES + t] = out2[id * SORT_LANES + t] + 1u;
        }
    }
    storageBarrier();
    // Exclusive scan of counts: lane t the slice of rows values from t * rows, the slices'
    // sums scanned by lane 0, then each slice rewritten from its start.
    let lo = t * rows;
    var sum = 0u;
    for (var e = lo; e < lo + rows; e++) {
        sum += out2[e];
    }
    sort_partial[t] = sum;
    workgroupBarrier();
    if (t == 0u) {
        var run = 0u;
        for (var i = 0u; i < SORT_LANES; i++) {
            let v = sort_partial[i];
            sort_partial[i] = run;
            run += v;
        }
        out2[rows * SORT_LANES + rows] = run;
    }
    workgroupBarrier();
    var run = sort_partial[t];
    for (var e = lo; e < lo + rows; e++) {
        let v = out2[e];
        out2[e] = run;
        run += v;
    }
    storageBarrier();
    let offsets = rows * SORT_LANES;
    for (var id = t; id < rows; id += SORT_LANES) {
        out2[offsets + id] = out2[id * SORT_LANES];
    }
    storageBarrier();  // the offsets read before the scatter moves the places on
    let sorted = offsets + rows + 1u;
    for (var r = own; r < own_end; r++) {
        let id = bitcast<u32>(in1[r]);
        if (id < rows) {
            let place = out2[id * SORT_LANES + t];
            out2[sorted + place] = r;
            out2[id * SORT_LANES + t] = place + 1u;
        }
    }
}

// Table entry (id, i) sums dout over id's tokens in token order: those of ranks [begin, end)
// among them in this dispatch. in0 = dout, in1 = embedding_sort's output (u32 bits); n = rows
// * c.
@compute @workgroup_size(256)
fn embedding_sum(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let e = flat_index(wg, nwg, lid);
    if (e >= params.n) {
        return;
    }
    let id = e / params.c;
    let i = e % params.c;
    let offsets = params.n / params.c * SORT_LANES;
    let sorted = offsets + params.n / params.c + 1u;
    let first = bitcast<u32>(in1[offsets + id]);
    let stop = min(first + params.end, bitcast<u32>(in1[offsets + id + 1u]));
    var sum = 0.0;
    if ((params.span & SPAN_FIRST) == 0u) {
        sum = out0[e];
    }
    for (var k = first + params.begin; k < stop; k++) {
        sum += in0v(bitcast<u32>(in1[sorted + k]) * params.c + i);
    }
    out0[e] = sum;
}

// Fused causal attention (plan::Op::Attention and AttentionBwd) is attention.wgsl's, spliced
// after this file.
