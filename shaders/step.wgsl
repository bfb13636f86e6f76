// step.wgsl: the kernels of the device-resident step plan besides matmul and train.wgsl's ops:
// rounding, adds, column sums, strided copies, the loss reduction, GradScaler's unscale and
// check, and the gated AdamW update (host reference: src/backend/reference/interp.rs).
// Bindings: 0 params; 1 the step's scalars (written by the host before each step, slots as in
// src/plan/scalar.rs, generated into the header); 2 the step's stats (written here, read back after the step);
// 3 x (read); 4 y (written); 5, 6 z and w (extra operands, as words). GELU comes from
// unary.wgsl, spliced before this file.

struct StepParams {
    // Elements (or rows, or columns) the kernel covers.
    n: u32,
    // Row length, or the length of a repeated operand.
    c: u32,
    // Format id of `round`, and the one `add` holds its output in (`adamw`'s state).
    format: u32,
    // A stats slot.
    slot: u32,
    // Strided copy: extents, source strides, destination strides; (src offset, dst offset, -, -).
    dims: vec4<u32>,
    src: vec4<u32>,
    dst: vec4<u32>,
    extra: vec4<u32>,
    // A bias add's GELU: (1 if it has one, format id it is held in, 1 if stored as codes, -).
    gelu: vec4<u32>,
    // Format ids operands are rounded to as they are read: `add`, `add_into`: (x's, -, -, -).
    read: vec4<u32>,
}

@group(0) @binding(0) var<uniform> params: StepParams;
@group(0) @binding(1) var<storage, read> scalars: array<f32>;
@group(0) @binding(2) var<storage, read_write> stats: array<f32>;
@group(0) @binding(3) var<storage, read> x: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
// Words: f32 bits, or two 16-bit codes (a bias add's GELU stored as codes).
@group(0) @binding(5) var<storage, read_write> z: array<u32>;
// Words: f32 bits (AdamW's second moment), or two 16-bit codes (`add_into`'s coded output).
@group(0) @binding(6) var<storage, read_write> w: array<u32>;

// Scalar slots: S_<NAME>, generated from src/plan/scalar.rs into the header.

// y rounded to `format` in place, through the integer encoder (no GPU float conversion).
@compute @workgroup_size(256)
fn round_to_format(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let e = flat_index(wg, nwg, lid);
    if (e >= params.n) {
        return;
    }
    let code = encode_format(bitcast<u32>(y[e]), params.format, false);
    y[e] = bitcast<f32>(decode_format(code, params.format));
}

// y = y' + x' held in format `format`, where y' is y held in format extra.y (a matmul's product
// rounded as it is read) and x' is x held in format read.x (a linear layer's bias, in the
// compute format), x repeated every c elements (c = n: elementwise; c = width: a bias per
// row); with extra.z = 1, then plus z (a residual after a bias), held in format extra.w.
// With a GELU (`params.gelu`, never with a residual), z = GELU(y) too: f32 bits, or codes two
// to a word, one invocation per word (an odd n's last word holds one code).
@compute @workgroup_size(256)
fn add(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) lid: u32) {
    let e = flat_index(wg, nwg, lid);
    if (params.gelu.z != 0u) {
        let lo = 2u * e;
        if (lo >= params.n) {
            return;
        }
        let first = held_sum(lo);
        y[lo] = first;
        var second = 0.0;
        if (lo + 1u < params.n) {
            second = held_sum(lo + 1u);
            y[lo + 1u] = second;
        }
        z[e] = gelu_pair(first, second);
        return;
    }
    if (e >= params.n) {
        return;
    }
    var sum = held_sum(e);
    if (params.extra.z != 0u) {
        sum = held(sum + bitcast<f32>(z[e]), params.extra.w);
    } else if (params.gelu.x != 0u) {
        z[e] = bitcast<u32>(held(gelu(sum), params.gelu.y));
    }
    y[e] = sum;
}

// z = y' + x' held in format `format`, y' and x' as in `add`, x repeated every c elements (a bias add
// whose output is a tensor of its own); with extra.x = 1, its 16-bit codes go to w instead, two
// to a word, one invocation per word (an odd n's last word holds one code), and a GELU of the
// values so stored (`params.gelu`) to z, as f32 bits or codes.
@compute @workgroup_size(256)
fn add_into(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let e = flat_index(wg, nwg, lid);
    if (params.extra.x != 0u) {
        let lo = 2u * e;
        if (lo >= params.n) {
            return;
        }
        let has_second = lo + 1u < params.n;
        let first = held_sum(lo);
        let second = select(0.0, held_sum(min(lo + 1u, params.n - 1u)), has_second);
        w[e] = code_pair(first, second, params.format);
        if (params.gelu.z != 0u) {
            z[e] = gelu_pair(first, second);
        } else if (params.gelu.x != 0u) {
            z[lo] = bitcast<u32>(held(gelu(first), params.gelu.y));
            if (has_second) {
                z[lo + 1u] = bitcast<u32>(held(gelu(second), params.gelu.y));
            }
        }
        return;
    }
    if (e >= params.n) {
        return;
    }
    z[e] = bitcast<u32>(held_sum(e));
}

// Element e of `add`'s and `add_into`'s sum y' + x', held in `format`.
fn held_sum(e: u32) -> f32 {
    return held(held(y[e], params.extra.y) + held(x[e % params.c], params.read.x), params.format);
}

// The codes of the GELUs of two held sums, one word (an odd n's missing second is 0, whose
// GELU is 0, as gelu_fwd writes it).
fn gelu_pair(first: f32, second: f32) -> u32 {
    return code_pair(gelu(first), gelu(second), params.gelu.y);
}

// y[dst(e)] = x[src(e)] over the 4-d index space `dims` (row-major, last fastest).
@compute @workgroup_size(256)
fn strided_copy(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let e = flat_index(wg, nwg, lid);
    if (e >= params.n) {
        return;
    }
    let d = params.dims;
    let i3 = e % d.w;
    let i2 = (e / d.w) % d.z;
    let i1 = (e / (d.w * d.z)) % d.y;
    let i0 = e / (d.w * d.z * d.y);
    let i = vec4<u32>(i0, i1, i2, i3);
    let s = params.extra.x + dot(i, params.src);
    let t = params.extra.y + dot(i, params.dst);
    y[t] = held(x[s], params.format);
}

var<workgroup> partial: array<f32, 256>;
var<workgroup> bad: array<u32, 256>;

// Sums partial[0..256) and bad[0..256) into their first elements (all invocations call it).
fn reduce_workgroup(lid: u32) {
    for (var stride = 128u; stride > 0u; stride = stride / 2u) {
        workgroupBarrier();
        if (lid < stride) {
            partial[lid] += partial[lid + stride];
            bad[lid] = bad[lid] | bad[lid + stride];
        }
    }
    workgroupBarrier();
}

// A one-workgroup reduction's span (src/backend/wgpu/budget.rs): invocation lid takes elements
// lid + 256 i for the passes i in [dims.x, dims.y) (all of them in one span, unless the
// adapter's loop budget splits them over dispatches); a span without SPAN_FIRST (in dims.z)
// starts from the partial sum and flag the previous one left in z and w, one without SPAN_LAST
// leaves its own there and reduces nothing. The same additions in the same order either way.
fn span_end() -> u32 {
    return min(params.n, params.dims.y * 256u);
}

fn span_carried() -> bool {
    return (params.dims.z & SPAN_FIRST) == 0u;
}

// Leaves this lane's partial results for the next span, where there is one: then true.
fn span_leaves(lid: u32, s: f32, flag: u32) -> bool {
    if ((params.dims.z & SPAN_LAST) != 0u) {
        return false;
    }
    z[lid] = bitcast<u32>(s);
    w[lid] = flag;
    return true;
}

// stats[slot] = mean of x[0..n) (the loss: the mean of the rows' losses). One workgroup.
@compute @workgroup_size(256)
fn mean_to_stat(@builtin(local_invocation_index) lid: u32) {
    var s = 0.0;
    if (span_carried()) {
        s = bitcast<f32>(z[lid]);
    }
    for (var e = lid + params.dims.x * 256u; e < span_end(); e += 256u) {
        s += x[e];
    }
    if (span_leaves(lid, s, 0u)) {
        return;
    }
    partial[lid] = s;
    bad[lid] = 0u;
    reduce_workgroup(lid);
    if (lid == 0u) {
        stats[params.slot] = partial[0] / f32(params.n);
    }
}

// GradScaler's unscale and check of every gradient, in two kernels (a gradient may be too
// long for one workgroup to reduce quickly, and there may be many). First, per gradient over
// as many workgroups as it has spans of UNSCALE_SPAN elements: y unscaled in place (times scalar
// INVERSE_SCALE, scalar POISON added to element extra.z first where c = 1), each workgroup's
// sum of squares and non-finite flag into z[extra.x + group] and w[extra.x + group] (extra.x:
// where these partials start among all gradients'). Or (extra.y = 1) over an arena segment of
// gradients (src/backend/wgpu/arena.rs), the same spans of each, workgroup `group` taking the
// one in row `group` of the table in x: (first element, end, partial slot), three words.
const UNSCALE_SPAN: u32 = 4096u;

@compute @workgroup_size(256)
fn unscale_partials(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let group = flat_index(wg, nwg, 0u) / 256u;
    var start = group * UNSCALE_SPAN;
    var end = min(params.n, start + UNSCALE_SPAN);
    var slot = params.extra.x + group;
    if (params.extra.y == 1u) {
        start = bitcast<u32>(x[3u * group]);
        end = bitcast<u32>(x[3u * group + 1u]);
        slot = bitcast<u32>(x[3u * group + 2u]);
    }
    var s = 0.0;
    var nonfinite = 0u;
    let inverse = scalars[S_INVERSE_SCALE];
    for (var e = start + lid; e < end; e += 256u) {
        var g = y[e];
        if (params.c == 1u && e == params.extra.z) {
            g = g + scalars[S_POISON];
        }
        g = g * inverse;
        y[e] = g;
        if ((bitcast<u32>(g) & 0x7f800000u) == 0x7f800000u) {
            nonfinite = 1u;
        }
        s += g * g;
    }
    partial[lid] = s;
    bad[lid] = nonfinite;
    reduce_workgroup(lid);
    if (lid == 0u) {
        z[slot] = bitcast<u32>(partial[0]);
        w[slot] = bad[0];
    }
}

// Then one dispatch for every gradient: workgroup i sums gradient i's partials, in order, into
// its flag and squared norm in the stats. x holds a row of four words per gradient: its first
// partial, its number of partials, its flag's stats slot and its squared norm's.
@compute @workgroup_size(256)
fn unscale_reduce(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wg, nwg, 0u) / 256u;
    let first = bitcast<u32>(x[4u * i]);
    let count = bitcast<u32>(x[4u * i + 1u]);
    var s = 0.0;
    var nonfinite = 0u;
    for (var j = lid; j < count; j += 256u) {
        s += bitcast<f32>(z[first + j]);
        nonfinite = nonfinite | w[first + j];
    }
    partial[lid] = s;
    bad[lid] = nonfinite;
    reduce_workgroup(lid);
    if (lid == 0u) {
        stats[bitcast<u32>(x[4u * i + 2u])] = f32(bad[0]);
        stats[bitcast<u32>(x[4u * i + 3u])] = partial[0];
    }
}

// The clipping factor an AdamW workgroup shares, or -1 where a gradient is not finite.
var<workgroup> gate: f32;

// AdamW on parameter y with gradient x and moments z, w, skipped unless every gradient's flag
// (stats[1 .. 1 + count)) is clear; gradients clipped to the global norm CLIP (squared norms at
// stats[1 + count .. 1 + 2 count)). count = extra.x, weight decay on the first extra.y
// elements (an arena's tensors with weight decay come first). The three
// are computed in f32 and held in `format` as they are written.
@compute @workgroup_size(256)
fn adamw(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    // The gate and the clipping factor, once per workgroup (not per element): the first
    // invocation sums the squared norms in order, the others wait for it.
    if (lid == 0u) {
        let count = params.extra.x;
        var norm_sq = 0.0;
        var finite = true;
        for (var i = 0u; i < count; i++) {
            if (stats[1u + i] != 0.0) {
                finite = false;
                break;
            }
            norm_sq += stats[1u + count + i];
        }
        let norm = sqrt(norm_sq);
        let clip = scalars[S_CLIP];
        var factor = 1.0;
        if (clip > 0.0 && norm > clip) {
            factor = clip / norm;
        }
        if (!finite) {
            factor = -1.0;
        }
        gate = factor;
    }
    let factor = workgroupUniformLoad(&gate);
    let e = flat_index(wg, nwg, lid);
    if (e >= params.n || factor < 0.0) {
        return;
    }
    let lr = scalars[S_LR];
    let beta1 = scalars[S_BETA1];
    let beta2 = scalars[S_BETA2];
    let g = x[e] * factor;
    let m = beta1 * bitcast<f32>(z[e]) + (1.0 - beta1) * g;
    let v = beta2 * bitcast<f32>(w[e]) + (1.0 - beta2) * g * g;
    z[e] = bitcast<u32>(held(m, params.format));
    w[e] = bitcast<u32>(held(v, params.format));
    var wd = 0.0;
    if (e < params.extra.y) {
        wd = lr * scalars[S_WEIGHT_DECAY];
    }
    let denom = sqrt(v / scalars[S_BIAS_CORRECTION2]) + scalars[S_EPS];
    y[e] = held(y[e] * (1.0 - wd) - (lr / scalars[S_BIAS_CORRECTION1]) * m / denom, params.format);
}
