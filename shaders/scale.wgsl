// scale.wgsl: amax reductions and fp8 current-scaling factors. Needs formats.wgsl.
//
// amax uses atomicMax on the bits of |x|: for non-negative floats the integer order of the bits
// is the value order, so the reduction is exact and independent of float modes.

struct ScaleParams {
    len: u32,
    // Group of element e, as in cast.wgsl.
    batch_len: u32,
    div: u32,
    modulus: u32,
    groups_per_batch: u32,
    groups: u32,
    // Largest finite value of the fp8 format, as f32 bits.
    fmax_bits: u32,
    // Where this operand's groups start in `amax_bits` and `scales`.
    offset: u32,
    // What `src` holds (amax): f32 bits (FMT_F32), or two 16-bit codes of this format a word.
    src_format: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

// Two operands' (a matmul's A and B) in one dispatch: A's workgroups first, then B's; b's
// len and groups 0 where there is only A.
struct ScalePair {
    a: ScaleParams,
    b: ScaleParams,
}

@group(0) @binding(0) var<uniform> pair: ScalePair;
@group(0) @binding(1) var<storage, read> src_a: array<u32>;
@group(0) @binding(2) var<storage, read_write> amax_bits: array<atomic<u32>>;
@group(0) @binding(3) var<storage, read_write> scales: array<f32>;
@group(0) @binding(4) var<storage, read> src_b: array<u32>;

// Word e of operand `side`'s source (0: A, 1: B).
fn src_word(side: u32, e: u32) -> u32 {
    if (side == 0u) {
        return src_a[e];
    }
    return src_b[e];
}

// Elements per workgroup of `amax` (the dispatch: cast::amax_groups).
const AMAX_SPAN: u32 = 4096u;

var<workgroup> span_max: atomic<u32>;

fn group_of(params: ScaleParams, e: u32) -> u32 {
    let within = e % params.batch_len;
    return (e / params.batch_len) * params.groups_per_batch + (within / params.div) % params.modulus;
}

fn flush(params: ScaleParams, group: u32, first: u32, run: u32) {
    if (group == first) {
        atomicMax(&span_max, run);
    } else {
        atomicMax(&amax_bits[params.offset + group], run);
    }
}

// One atomic per element on one address serialises (on the H100 a tensorwise amax of 16M
// values took longer than the matmul it scales). Each workgroup takes AMAX_SPAN consecutive
// elements (coalesced: invocation i reads i, i + 256, ...); each invocation keeps a running max
// while its group stays the same; maxima of the span's first group meet in workgroup memory;
// only the others (a group boundary inside the span) go to memory.
@compute @workgroup_size(256)
fn amax(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    // Uniform across the workgroup, as the barriers below need.
    let span = wg.y * nwg.x + wg.x;
    let spans_a = (pair.a.len + AMAX_SPAN - 1u) / AMAX_SPAN;
    if (span < spans_a) {
        amax_span(pair.a, 0u, span * AMAX_SPAN, lid);
    } else if ((span - spans_a) * AMAX_SPAN < pair.b.len) {
        amax_span(pair.b, 1u, (span - spans_a) * AMAX_SPAN, lid);
    }
}

// The span of operand `side` from `start` on (inside it).
fn amax_span(params: ScaleParams, side: u32, start: u32, lid: u32) {
    // Explicitly: trusted modules do not zero workgroup memory.
    if (lid == 0u) {
        atomicStore(&span_max, 0u);
    }
    workgroupBarrier();
    let first = group_of(params, start);
    var group = first;
    var run = 0u;
    let end = min(start + AMAX_SPAN, params.len);
    for (var e = start + lid; e < end; e += 256u) {
        var bits = src_word(side, e);
        if (params.src_format != FMT_F32) {
            bits = decode_format(unpack_code(src_word(side, e >> 1u), e, params.src_format), params.src_format);
        }
        let magnitude = bits & 0x7fffffffu;
        if (magnitude >= 0x7f800000u) {
            continue;
        }
        let g = group_of(params, e);
        if (g != group) {
            flush(params, group, first, run);
            group = g;
            run = 0u;
        }
        run = max(run, magnitude);
    }
    flush(params, group, first, run);
    workgroupBarrier();
    if (lid == 0u) {
        let m = atomicLoad(&span_max);
        if (m != 0u) {
            atomicMax(&amax_bits[params.offset + first], m);
        }
    }
}

// a / b for positive finite f32 a (normal) and b (normal or subnormal), rounded to nearest
// even by long division of the significands; overflow is capped at f32's max. GPU float
// division is only accurate to a few ulps, and the scale must equal the host's bit for bit.
fn div_rn(a: u32, b: u32) -> u32 {
    var ea = i32((a >> 23u) & 0xffu) - 127;
    var eb = i32((b >> 23u) & 0xffu) - 127;
    var sa = (a & 0x7fffffu) | 0x800000u;
    var sb = b & 0x7fffffu;
    if ((b >> 23u) == 0u) {
        eb = -126;
        let lead = firstLeadingBit(sb);
        sb = sb << (23u - lead);
        eb = eb - i32(23u - lead);
    } else {
        sb = sb | 0x800000u;
    }
    var e = ea - eb;
    if (sa < sb) {
        sa = sa << 1u;
        e = e - 1;
    }
    // sa / sb is in [1, 2): 24 quotient bits, then the remainder decides the rounding.
    var rem = sa;
    var q = 0u;
    for (var i = 0u; i < 24u; i++) {
        q = q << 1u;
        if (rem >= sb) {
            rem = rem - sb;
            q = q | 1u;
        }
        rem = rem << 1u;
    }
    if (rem > sb || (rem == sb && (q & 1u) == 1u)) {
        q = q + 1u;
    }
    if (q == 0x1000000u) {
        q = q >> 1u;
        e = e + 1;
    }
    if (e > 127) {
        return 0x7f7fffffu;
    }
    // The quotients used here (fmax / amax) are never below f32's normal range.
    return (u32(e + 127) << 23u) | (q & 0x7fffffu);
}

// s = FMAX / amax per group; 1 where the group holds no nonzero finite value. A's groups, then
// B's.
@compute @workgroup_size(256)
fn scale_from_amax(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wg, nwg, lid);
    if (i < pair.a.groups) {
        scale_group(pair.a, i);
    } else if (i - pair.a.groups < pair.b.groups) {
        scale_group(pair.b, i - pair.a.groups);
    }
}

// Group g's scale of the operand `params` describes.
fn scale_group(params: ScaleParams, g: u32) {
    let amax = atomicLoad(&amax_bits[params.offset + g]);
    if (amax == 0u) {
        scales[params.offset + g] = 1.0;
    } else {
        scales[params.offset + g] = bitcast<f32>(div_rn(params.fmax_bits, amax));
    }
}
