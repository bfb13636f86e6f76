// split.wgsl: the bf16 split x = h + m + l (docs/design.md) into packed bf16 planes. Needs
// formats.wgsl, whose `split_one` computes h = bf16(x), m = bf16(x - h), l = bf16(x - h - m).

struct SplitParams {
    len: u32,
    // Words per plane; plane p starts at word p * plane_words.
    plane_words: u32,
    // Planes written: 2 (h, m) or 3 (h, m, l).
    parts: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> params: SplitParams;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(256)
fn split_bf16(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let word = flat_index(wg, nwg, lid);
    if (word >= params.plane_words) {
        return;
    }
    var planes = vec3<u32>(0u);
    for (var t = 0u; t < 2u; t++) {
        let e = word * 2u + t;
        if (e < params.len) {
            planes |= split_one(src[e]) << vec3<u32>(t * 16u);
        }
    }
    dst[word] = planes.x;
    dst[params.plane_words + word] = planes.y;
    if (params.parts == 3u) {
        dst[2u * params.plane_words + word] = planes.z;
    }
}
