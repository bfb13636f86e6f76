// matmul.wgsl: C = op(A) . op(B) for every algorithm, tiled in workgroup memory with a 4x4 or
// 8x8 register block per invocation. Needs formats.wgsl.
//
// The loader (src/backend/wgpu/shaders.rs) splices in, per variant:
//   const BM, BN, BK: u32       workgroup tile (BM x BN outputs, BK of the inner dimension)
//   const REG: u32              outputs per invocation: REG x REG, 4 or 8 (8 only for
//                               LEVELS <= 1): four 4x4 blocks, rows (columns) BM/2 (BN/2) apart
//   const PARTS: u32            operand planes: 1, or 2/3 bf16 planes (h, m, l) for split
//   const LEVELS: u32           split levels: 0 (no split), 2 (bf16x3), 3 (bf16x6), 5 (bf16x9)
//   const FP8: bool, ROWWISE: bool
//   alias A_T, B_T              element type of the operand arrays (u32, or f16 natively)
//   fn fetch_a(idx: u32) -> f32 and fn fetch_b(idx: u32) -> f32: decode one stored element
//   the split products of levels L1.., in place of the lower-levels marker (src/backend/defs.rs)
//   const MASKED: bool, fn flagged(line: u32) -> bool: as the fallback of the cooperative-matrix
//                               kernel, compute only outputs whose row of A or column of B is
//                               flagged (coop_pack.wgsl); the flags are binding 5
// Workgroup size is (BN / REG, BM / REG).

struct MatmulParams {
    m: u32,
    n: u32,
    k: u32,
    _pad0: u32,
    // Element strides of the logical A (batch, row i, column p), and the plane stride.
    a_batch: u32,
    a_row: u32,
    a_col: u32,
    a_plane: u32,
    // Element strides of the logical B (batch, row p, column j), and the plane stride.
    b_batch: u32,
    b_row: u32,
    b_col: u32,
    b_plane: u32,
    c_batch: u32,
    // fp8 scales: A's at scales[batch * sa_batch + (row or 0)], B's at
    // scales[sb_offset + batch * sb_batch + (column or 0)].
    sa_batch: u32,
    sb_batch: u32,
    sb_offset: u32,
    // MASKED: where B's lines start in the flags (A's lines: batch * m + row).
    b_lines: u32,
    _pad1: u32,
    _pad2: u32,
    _pad3: u32,
}

@group(0) @binding(0) var<uniform> params: MatmulParams;
@group(0) @binding(1) var<storage, read> a_data: array<A_T>;
@group(0) @binding(2) var<storage, read> b_data: array<B_T>;
@group(0) @binding(3) var<storage, read_write> c_data: array<f32>;
@group(0) @binding(4) var<storage, read> scales: array<f32>;

const WG_X: u32 = BN / REG;
const WG_Y: u32 = BM / REG;
// Four 4x4 blocks per invocation: a quarter of the workgroup-memory reads per multiply-add.
const WIDE: bool = REG == 8u;
const THREADS: u32 = WG_X * WG_Y;
// Exactly the largest finite f32 (Tint rejects decimal literals that round up to it).
const F32_MAX: f32 = 0x1.fffffep+127f;

// [part][kk][i / 4]: four consecutive rows (columns) of one k as a vec4.
var<workgroup> a_tile: array<vec4<f32>, PARTS * BK * BM / 4u>;
var<workgroup> b_tile: array<vec4<f32>, PARTS * BK * BN / 4u>;
// MASKED: whether any line of this workgroup's tile is flagged.
var<workgroup> tile_hits: atomic<u32>;
var<workgroup> tile_flagged: u32;

// acc[r] += a[r] * b: the 4x4 outer product of a row block and a column block.
fn outer(acc: ptr<function, array<vec4<f32>, 4>>, a: vec4<f32>, b: vec4<f32>) {
    (*acc)[0] += a.x * b;
    (*acc)[1] += a.y * b;
    (*acc)[2] += a.z * b;
    (*acc)[3] += a.w * b;
}

// The lower split levels use 0 where h is not finite, so only L0 sees inf/NaN.
fn finite_or_zero(h: vec4<f32>) -> vec4<f32> {
    return select(vec4<f32>(0.0), h, abs(h) <= vec4<f32>(F32_MAX));
}

// acc / (sa * sb) without an intermediate overflow or underflow: the scales' mantissas divide
// acc (a factor in [1, 4)), their exponents are applied in two halves, so the intermediate
// leaves f32's range only when the result does.
fn unscale(acc: f32, sa: f32, sb: f32) -> f32 {
    let fa = frexp(sa);
    let fb = frexp(sb);
    let x = acc / (fa.fract * fb.fract);
    let total = -(fa.exp + fb.exp);
    let half = total / 2;
    return ldexp(ldexp(x, half), total - half);
}

fn a_at(part: u32, kk: u32, ty: u32) -> vec4<f32> {
    return a_tile[(part * BK + kk) * (BM / 4u) + ty];
}

fn b_at(part: u32, kk: u32, tx: u32) -> vec4<f32> {
    return b_tile[(part * BK + kk) * (BN / 4u) + tx];
}

@compute @workgroup_size(WG_X, WG_Y, 1)
fn matmul(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
          @builtin(local_invocation_index) lindex: u32) {
    let batch = wg.z;
    let row0 = wg.y * BM;
    let col0 = wg.x * BN;
    let a_base = batch * params.a_batch;
    let b_base = batch * params.b_batch;
    var acc0: array<vec4<f32>, 4>;
    var acc1: array<vec4<f32>, 4>;
    var acc2: array<vec4<f32>, 4>;
    var acc3: array<vec4<f32>, 4>;
    var acc4: array<vec4<f32>, 4>;
    // WIDE: the blocks at (+BN/2 columns), (+BM/2 rows) and both.
    var acc_r: array<vec4<f32>, 4>;
    var acc_d: array<vec4<f32>, 4>;
    var acc_rd: array<vec4<f32>, 4>;

    if (MASKED) {
        if (lindex == 0u) {
            atomicStore(&tile_hits, 0u);
        }
        workgroupBarrier();
        for (var t = lindex; t < BM + BN; t += THREADS) {
            var hit = false;
            if (t < BM) {
                hit = row0 + t < params.m && flagged(batch * params.m + row0 + t);
            } else {
                let col = col0 + t - BM;
                hit = col < params.n && flagged(params.b_lines + batch * params.n + col);
            }
            if (hit) {
                atomicOr(&tile_hits, 1u);
            }
        }
        workgroupBarrier();
        if (lindex == 0u) {
            tile_flagged = atomicLoad(&tile_hits);
        }
        // Uniform across the workgroup, so the barriers below stay in uniform control flow.
        if (workgroupUniformLoad(&tile_flagged) == 0u) {
            return;
        }
    }

    for (var k0 = 0u; k0 < params.k; k0 += BK) {
        // A tile: consecutive invocations take consecutive k (contiguous for row-major A).
        for (var t = lindex; t < BM * BK; t += THREADS) {
            let i = t / BK;
            let kk = t % BK;
            let row = row0 + i;
            let p = k0 + kk;
            let inside = row < params.m && p < params.k;
            let idx = a_base + row * params.a_row + p * params.a_col;
            for (var part = 0u; part < PARTS; part++) {
                var v = 0.0;
                if (inside) {
                    v = fetch_a(idx + part * params.a_plane);
                }
                a_tile[(part * BK + kk) * (BM / 4u) + i / 4u][i % 4u] = v;
            }
        }
        // B tile: consecutive invocations take consecutive columns (contiguous for row-major B).
        for (var t = lindex; t < BN * BK; t += THREADS) {
            let j = t % BN;
            let kk = t / BN;
            let col = col0 + j;
            let p = k0 + kk;
            let inside = col < params.n && p < params.k;
            let idx = b_base + p * params.b_row + col * params.b_col;
            for (var part = 0u; part < PARTS; part++) {
                var v = 0.0;
                if (inside) {
                    v = fetch_b(idx + part * params.b_plane);
                }
                b_tile[(part * BK + kk) * (BN / 4u) + j / 4u][j % 4u] = v;
            }
        }
        workgroupBarrier();

        for (var kk = 0u; kk < BK; kk++) {
            let ah = a_at(0u, kk, lid.y);
            let bh = b_at(0u, kk, lid.x);
            outer(&acc0, ah, bh);
            if (WIDE) {
                let ah2 = a_at(0u, kk, lid.y + WG_Y);
                let bh2 = b_at(0u, kk, lid.x + WG_X);
                outer(&acc_r, ah, bh2);
                outer(&acc_d, ah2, bh);
                outer(&acc_rd, ah2, bh2);
            }
            if (LEVELS >= 2u) {
                // Parts 0 (h, as 0 where not finite: only L0 meets inf/NaN), 1 (m), 2 (l).
                let a0 = finite_or_zero(ah);
                let b0 = finite_or_zero(bh);
                let a1 = a_at(1u, kk, lid.y);
                let b1 = b_at(1u, kk, lid.x);
                var a2 = vec4<f32>();
                var b2 = vec4<f32>();
                if (LEVELS >= 3u) {
                    a2 = a_at(2u, kk, lid.y);
                    b2 = b_at(2u, kk, lid.x);
                }
                // The products of levels L1.. (src/algorithm.rs SPLIT_LEVELS), by the loader:
{{lower_levels}}
            }
        }
        workgroupBarrier();
    }

    // Levels summed smallest first.
    var sum: array<vec4<f32>, 4>;
    for (var r = 0u; r < 4u; r++) {
        var v = acc0[r];
        if (LEVELS == 2u) {
            v = acc1[r] + acc0[r];
        } else if (LEVELS == 3u) {
            v = (acc2[r] + acc1[r]) + acc0[r];
        } else if (LEVELS == 5u) {
            v = (((acc4[r] + acc3[r]) + acc2[r]) + acc1[r]) + acc0[r];
        }
        sum[r] = v;
    }
    store_block(batch, row0 + lid.y * 4u, col0 + lid.x * 4u, sum);
    if (WIDE) {
        store_block(batch, row0 + lid.y * 4u, col0 + (lid.x + WG_X) * 4u, acc_r);
        store_block(batch, row0 + (lid.y + WG_Y) * 4u, col0 + lid.x * 4u, acc_d);
        store_block(batch, row0 + (lid.y + WG_Y) * 4u, col0 + (lid.x + WG_X) * 4u, acc_rd);
    }
}

// The 4x4 block of C at (row, col): bounds, the MASKED selection and fp8 descaling.
fn store_block(batch: u32, row_start: u32, col_start: u32, v: array<vec4<f32>, 4>) {
    for (var r = 0u; r < 4u; r++) {
        let row = row_start + r;
        if (row >= params.m) {
            continue;
        }
        let row_flagged = flagged(batch * params.m + row);
        for (var c = 0u; c < 4u; c++) {
            let col = col_start + c;
            let mine = !MASKED || row_flagged || flagged(params.b_lines + batch * params.n + col);
            if (col < params.n && mine) {
                var out = v[r][c];
                if (FP8) {
                    let sa = scales[batch * params.sa_batch + select(0u, row, ROWWISE)];
                    let sb = scales[params.sb_offset + batch * params.sb_batch + select(0u, col, ROWWISE)];
                    out = unscale(out, sa, sb);
                }
                c_data[batch * params.c_batch + row * params.n + col] = out;
            }
        }
    }
}
