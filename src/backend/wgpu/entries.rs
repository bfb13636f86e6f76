//! The entry points of the training kernels (`shaders/train.wgsl` with `attention.wgsl`,
//! `shaders/step.wgsl`) and fused attention's tile constants: the vocabulary the loader
//! (`shaders.rs`) generates kernels for and the launches (`train.rs`) dispatch.

/// The training ops of `shaders/train.wgsl` (entry points of one module).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TrainOp {
    /// Layer norm's y and (mean, rstd) per row.
    LayernormFwd,
    /// Layer norm's backward: dx per row, and the partials of dg and db per chunk of rows
    /// (`SumPartials` adds them), in one launch.
    LayernormBwd,
    /// Partials of column sums per chunk of rows (bias gradients).
    ColumnPartials,
    /// The sum over chunks of column partials, in chunk order.
    SumPartials,
    /// f(x) of the unary family (`plan::Unary`, its id in the uniform).
    UnaryFwd,
    /// The unary family's backward: dy * f'(x).
    UnaryBwd,
    /// RMS norm's y and rstd per row.
    RmsnormFwd,
    /// RMS norm's backward: dx per row, and the partials of dg per chunk of rows.
    RmsnormBwd,
    /// The elementwise product.
    Mul,
    /// Dropout's mask times x (or dy).
    Dropout,
    /// Rotary position embeddings (or their backward).
    Rotary,
    /// A sum or mean of each row.
    RowSums,
    /// Values repeated (a row sum's backward), or scaled by a constant.
    Broadcast,
    /// The mean squared error's gradient and squared differences.
    MseFwd,
    /// Softmax of scaled scores per row, causal or not.
    SoftmaxFwd,
    /// The softmax's backward.
    SoftmaxBwd,
    /// Cross entropy per row of logits: the loss, and the probabilities or the loss's gradient.
    CrossEntropyFwd,
    /// Embedding gather.
    EmbeddingFwd,
    /// Embedding backward, first: a stable counting sort of the ids (one workgroup).
    EmbeddingSort,
    /// Embedding backward, then: each table row sums its tokens' gradients in token order.
    EmbeddingSum,
    /// Fused causal attention's output and (max, sum) per score row.
    AttentionFwd,
    /// Fused attention's backward: dq, and sum(P * dP) per score row.
    AttentionBwdQ,
    /// Fused attention's backward: dk and dv.
    AttentionBwdKv,
}

impl TrainOp {
    /// Every entry point, in the order of the shader module.
    pub const ALL: [TrainOp; 23] = [
        TrainOp::LayernormFwd,
        TrainOp::LayernormBwd,
        TrainOp::ColumnPartials,
        TrainOp::SumPartials,
        TrainOp::UnaryFwd,
        TrainOp::UnaryBwd,
        TrainOp::RmsnormFwd,
        TrainOp::RmsnormBwd,
        TrainOp::Mul,
        TrainOp::Dropout,
        TrainOp::Rotary,
        TrainOp::RowSums,
        TrainOp::Broadcast,
        TrainOp::MseFwd,
        TrainOp::SoftmaxFwd,
        TrainOp::SoftmaxBwd,
        TrainOp::CrossEntropyFwd,
        TrainOp::EmbeddingFwd,
        TrainOp::EmbeddingSort,
        TrainOp::EmbeddingSum,
        TrainOp::AttentionFwd,
        TrainOp::AttentionBwdQ,
        TrainOp::AttentionBwdKv,
    ];

    /// Whether the op's launch is a row op's workgroups followed by a column reduction's,
    /// whose partials it writes to a fourth output (the norms' backward).
    pub fn has_column_partials(self) -> bool {
        matches!(self, TrainOp::LayernormBwd | TrainOp::RmsnormBwd)
    }

    /// The entry point's name in `shaders/train.wgsl`.
    pub fn entry_point(self) -> &'static str {
        match self {
            TrainOp::LayernormFwd => "layernorm_fwd",
            TrainOp::LayernormBwd => "layernorm_bwd",
            TrainOp::ColumnPartials => "column_partials",
            TrainOp::SumPartials => "sum_partials",
            TrainOp::UnaryFwd => "unary_fwd",
            TrainOp::UnaryBwd => "unary_bwd",
            TrainOp::RmsnormFwd => "rmsnorm_fwd",
            TrainOp::RmsnormBwd => "rmsnorm_bwd",
            TrainOp::Mul => "elementwise_mul",
            TrainOp::Dropout => "dropout",
            TrainOp::Rotary => "rotary",
            TrainOp::RowSums => "row_sums",
            TrainOp::Broadcast => "broadcast",
            TrainOp::MseFwd => "mse_fwd",
            TrainOp::SoftmaxFwd => "softmax_fwd",
            TrainOp::SoftmaxBwd => "softmax_bwd",
            TrainOp::CrossEntropyFwd => "cross_entropy_fwd",
            TrainOp::EmbeddingFwd => "embedding_fwd",
            TrainOp::EmbeddingSort => "embedding_sort",
            TrainOp::EmbeddingSum => "embedding_sum",
            TrainOp::AttentionFwd => "attention_fwd",
            TrainOp::AttentionBwdQ => "attention_bwd_q",
            TrainOp::AttentionBwdKv => "attention_bwd_kv",
        }
    }
}

impl TrainOp {
    /// Whether the op is fused attention's (attention.wgsl, spliced after train.wgsl).
    pub fn is_attention(self) -> bool {
        matches!(
            self,
            TrainOp::AttentionFwd | TrainOp::AttentionBwdQ | TrainOp::AttentionBwdKv
        )
    }
}

/// Fused attention's tiles (attention.wgsl; the loader writes these into its header): the
/// largest head, invocations to a row (of a workgroup's 256), rows of a streamed tile.
pub const ATT_MAX_D: u32 = 64;
/// Invocations to a row of a block; a block is 256 / ATT_LANES rows.
pub const ATT_LANES: u32 = 8;
/// Rows of a streamed tile (k and v, or q and the output's gradient).
pub const ATT_BC: u32 = 16;

/// Subgroups to a workgroup of fused attention on cooperative matrices (attention_coop.wgsl),
/// each taking a tile's side of rows.
pub const ATT_COOP_SUBGROUPS: u32 = 2;

/// Rows of a workgroup's block of fused attention.
pub const fn att_block_rows() -> u32 {
    256 / ATT_LANES
}

/// The kernels of the device-resident step plan (`shaders/step.wgsl`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StepOp {
    /// y rounded to a format in place.
    Round,
    /// y = y' + x (a bias or residual add into the product), with its residual and GELU.
    Add,
    /// z = y' + x, an add whose output is a tensor of its own (f32, or 16-bit codes in w).
    AddInto,
    /// y[dst(e)] = x[src(e)] over a 4-d index space (`Strided`).
    StridedCopy,
    /// A stats slot = the mean of x (the loss). One workgroup.
    MeanToStat,
    /// GradScaler's unscale of a gradient in place, with per-workgroup partial sums of squares and
    /// non-finite flags.
    UnscalePartials,
    /// Each gradient's partials into its finite flag and squared norm in the stats.
    UnscaleReduce,
    /// AdamW on one parameter, gated on the gradients' flags, clipped to the global norm.
    Adamw,
}

impl StepOp {
    /// Every entry point, in the order of the shader module.
    pub const ALL: [StepOp; 8] = [
        StepOp::Round,
        StepOp::Add,
        StepOp::AddInto,
        StepOp::StridedCopy,
        StepOp::MeanToStat,
        StepOp::UnscalePartials,
        StepOp::UnscaleReduce,
        StepOp::Adamw,
    ];

    /// The entry point's name in `shaders/step.wgsl`.
    pub fn entry_point(self) -> &'static str {
        match self {
            StepOp::Round => "round_to_format",
            StepOp::Add => "add",
            StepOp::AddInto => "add_into",
            StepOp::StridedCopy => "strided_copy",
            StepOp::MeanToStat => "mean_to_stat",
            StepOp::UnscalePartials => "unscale_partials",
            StepOp::UnscaleReduce => "unscale_reduce",
            StepOp::Adamw => "adamw",
        }
    }
}
