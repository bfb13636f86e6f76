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
// flags EPI_RESIDUAL | EPI_GELU | EPI_BIAS); params.epi2: (the residual sum's format, the
// GELU's). As `add`: sum = (y' + x') held, y' the product held, x' the bias held (a bias per
// column); then plus the residual, held; or a GELU of the sum, held, into its own tensor (f32
// bits). With no bias: the product held in the sum's format.

const EPI_RESIDUAL: u32 = 1u;
const EPI_GELU: u32 = 2u;
const EPI_BIAS: u32 = 4u;

@group(0) @binding(EPI_BINDING) var<storage, read> epi_bias: array<f32>;
@group(0) @binding(EPI_BINDING + 1u) var<storage, read> epi_residual: array<f32>;
@group(0) @binding(EPI_BINDING + 2u) var<storage, read_write> epi_gelu: array<u32>;

// The value stored at C's element e (column `col`) in place of the product v.
fn epilogue(e: u32, col: u32, v: f32) -> f32 {
    if ((params.epi.w & EPI_BIAS) == 0u) {
        return held(v, params.epi.z);
    }
    var sum = held(held(v, params.epi.x) + held(epi_bias[col], params.epi.y), params.epi.z);
    if ((params.epi.w & EPI_RESIDUAL) != 0u) {
        sum = held(sum + epi_residual[e], params.epi2.x);
    } else if ((params.epi.w & EPI_GELU) != 0u) {
        epi_gelu[e] = bitcast<u32>(held(gelu(sum), params.epi2.y));
    }
    return sum;
}
