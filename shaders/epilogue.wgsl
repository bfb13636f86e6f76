// epilogue.wgsl: what the matmul's store does to the product. A linear layer's bias add, where
// the step plan's `Op::Add` reads the product in place right after it (src/backend/wgpu/plan.rs,
// "fused epilogues"): step.wgsl's `add` on the value the matmul was about to store, so the
// product makes no trip through memory and the add no dispatch of its own. Without a bias
// (EPI_BIAS clear), the product rounded to the format it is held in (`Op::Matmul`'s `held`: a
// weight gradient autocast holds in the compute format). Spliced after matmul.wgsl or
// matmul_coop.wgsl (whose `params` hold the epilogue's formats) and unary.wgsl, in the variants
// with EPILOGUE (the loader sets EPI_BINDING, the first binding after the kernel's own).
//
// params.epi: (the format the product is held in as the add reads it, the bias's, the sum's,
// flags EPI_RESIDUAL | EPI_GELU | EPI_BIAS | EPI_GELU_CODES); params.epi2: (the residual sum's
// format, the GELU's). As `add`: sum = (y' + x') held, y' the product held, x' the bias held (a
// bias per column); then plus the residual, held; or a GELU of the sum, held, into its own
// tensor (f32 bits, or with EPI_GELU_CODES its 16-bit codes, two a word). With no bias: the
// product held in the sum's format.
//
// Where CODED (C stored as the 16-bit codes of the sum's format, as `add_into` stores a coded
// output: the kernels' `c_data` is then an array of words), the kernel stores C two outputs at
// a time through `store_codes`: C's rows are of even length (the loader's condition), so an
// even element and the one after it are in the same row and the same invocation's hands.

const EPI_RESIDUAL: u32 = 1u;
const EPI_GELU: u32 = 2u;
const EPI_BIAS: u32 = 4u;
const EPI_GELU_CODES: u32 = 8u;

@group(0) @binding(EPI_BINDING) var<storage, read> epi_bias: array<f32>;
@group(0) @binding(EPI_BINDING + 1u) var<storage, read> epi_residual: array<f32>;
@group(0) @binding(EPI_BINDING + 2u) var<storage, read_write> epi_gelu: array<u32>;

// The value stored at C's element e (column `col`) in place of the product v; its GELU, where
// asked, stored as f32 bits.
fn epilogue(e: u32, col: u32, v: f32) -> f32 {
    let sum = epilogue_sum(e, col, v);
    if ((params.epi.w & EPI_GELU) != 0u) {
        epi_gelu[e] = bitcast<u32>(held(gelu(sum), params.epi2.y));
    }
    return sum;
}

// The held sum (or held product) that C's element e holds.
fn epilogue_sum(e: u32, col: u32, v: f32) -> f32 {
    if ((params.epi.w & EPI_BIAS) == 0u) {
        return held(v, params.epi.z);
    }
    var sum = held(held(v, params.epi.x) + held(epi_bias[col], params.epi.y), params.epi.z);
    if ((params.epi.w & EPI_RESIDUAL) != 0u) {
        sum = held(sum + epi_residual[e], params.epi2.x);
    }
    return sum;
}

// CODED: C's elements e (even) and e + 1 (columns col, col + 1) from the products v, as the
// word of their codes, and their GELUs; only the elements `mine` says (a cooperative kernel
// and its masked fallback each write their own outputs, in dispatches one after the other:
// where a word holds one of each, each keeps the other's half).
fn store_codes(e: u32, col: u32, v: vec2<f32>, mine: vec2<bool>) {
    let sum = vec2<f32>(epilogue_sum(e, col, v.x), epilogue_sum(e + 1u, col + 1u, v.y));
    let w = e / 2u;
    c_data[w] = bitcast<C_T>(merged(code_pair(sum.x, sum.y, params.epi.z), bitcast<u32>(c_data[w]), mine));
    if ((params.epi.w & EPI_GELU) == 0u) {
        return;
    }
    let g = vec2<f32>(gelu(sum.x), gelu(sum.y));
    if ((params.epi.w & EPI_GELU_CODES) != 0u) {
        epi_gelu[w] = merged(code_pair(g.x, g.y, params.epi2.y), epi_gelu[w], mine);
        return;
    }
    if (mine.x) {
        epi_gelu[e] = bitcast<u32>(held(g.x, params.epi2.y));
    }
    if (mine.y) {
        epi_gelu[e + 1u] = bitcast<u32>(held(g.y, params.epi2.y));
    }
}

// The word `fresh` where `mine` says, `old`'s half elsewhere.
fn merged(fresh: u32, old: u32, mine: vec2<bool>) -> u32 {
    if (all(mine)) {
        return fresh;
    }
    let lo = select(old, fresh, mine.x) & 0xffffu;
    let hi = select(old, fresh, mine.y) & 0xffff0000u;
    return lo | hi;
}
