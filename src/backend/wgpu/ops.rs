//! The `Backend` training ops on wgpu: operands uploaded, one launch of `train.rs` each, results
//! read back. (Training itself runs the resident plan, `plan.rs`, with the same launches; these
//! serve the host interpreter and the conformance suite, which checks each kernel against
//! `reference::ops`.)

use super::WgpuBackend;
use super::train::{Out, ids_as_f32, launch};
use crate::backend::check;
use crate::error::Result;
use crate::format::Format;
use crate::plan::{AdamW, ScoreScale, scalar};

impl WgpuBackend {
    pub(super) async fn op_layernorm_fwd(
        &self,
        x: &[f32],
        g: &[f32],
        b: &[f32],
        c: usize,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let rows = check::layernorm_fwd(x, g, b, c)?;
        let outs = [Out::Fresh(x.len()), Out::Fresh(2 * rows), Out::Unused];
        let [y, stats, _] = self
            .train_op(
                launch::layernorm_fwd(rows, c, Format::F32, false),
                [x, g, b],
                outs,
            )
            .await?;
        let (mean, rstd) = stats.chunks(2).map(|s| (s[0], s[1])).unzip();
        Ok((y, mean, rstd))
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn op_layernorm_bwd(
        &self,
        dy: &[f32],
        x: &[f32],
        g: &[f32],
        mean: &[f32],
        rstd: &[f32],
        c: usize,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let rows = check::layernorm_bwd(dy, x, g, (mean, rstd), c)?;
        let stats: Vec<f32> = mean.iter().zip(rstd).flat_map(|(&m, &r)| [m, r]).collect();
        let [for_x, partials, sums] = launch::layernorm_bwd(rows, c);
        let outs = [Out::Fresh(x.len()), Out::Init(&stats), Out::Unused];
        let [dx, ..] = self.train_op(for_x, [dy, x, g], outs).await?;
        let outs = [
            Out::Fresh(launch::partials_len(rows, c, 2)),
            Out::Init(&stats),
            Out::Unused,
        ];
        let [parts, ..] = self.train_op(partials, [dy, x, &[]], outs).await?;
        let outs = [Out::Fresh(c), Out::Unused, Out::Fresh(c)];
        let [dg, _, db] = self.train_op(sums, [&parts, &[], &[]], outs).await?;
        Ok((dx, dg, db))
    }

    /// GELU forward, or its backward where `dy` is given.
    pub(super) async fn op_gelu(&self, x: &[f32], dy: Option<&[f32]>) -> Result<Vec<f32>> {
        check::gelu(x, dy)?;
        let outs = [Out::Fresh(x.len()), Out::Unused, Out::Unused];
        let [y, ..] = match dy {
            None => self.train_op(
                launch::gelu_fwd(x.len(), Format::F32, false, Format::F32),
                [x, &[], &[]],
                outs,
            ),
            Some(dy) => self.train_op(launch::gelu_bwd(x.len(), Format::F32), [x, dy, &[]], outs),
        }
        .await?;
        Ok(y)
    }

    /// Causal softmax forward of `x`, or its backward (x the probabilities) where `dp` is given.
    pub(super) async fn op_softmax(
        &self,
        x: &[f32],
        dp: Option<&[f32]>,
        t: usize,
        scale: ScoreScale,
    ) -> Result<Vec<f32>> {
        let rows = check::softmax(x, dp, t)?;
        let outs = [Out::Fresh(x.len()), Out::Unused, Out::Unused];
        let [y, ..] = match dp {
            None => self.train_op(launch::softmax_fwd(rows, t, scale), [x, &[], &[]], outs),
            Some(dp) => self.train_op(launch::softmax_bwd(rows, t, scale), [x, dp, &[]], outs),
        }
        .await?;
        Ok(y)
    }

    pub(super) async fn op_cross_entropy_fwd(
        &self,
        logits: &[f32],
        targets: &[u32],
        v: usize,
    ) -> Result<(f64, Vec<f32>)> {
        let rows = check::cross_entropy(logits, targets, v)?;
        let ids = ids_as_f32(targets);
        let outs = [Out::Fresh(logits.len()), Out::Fresh(rows), Out::Unused];
        let [probs, losses, _] = self
            .train_op(
                launch::cross_entropy_fwd(rows, v, None),
                [logits, &ids, &[]],
                outs,
            )
            .await?;
        let loss = losses.iter().map(|&l| l as f64).sum::<f64>() / rows.max(1) as f64;
        Ok((loss, probs))
    }

    pub(super) async fn op_cross_entropy_bwd(
        &self,
        probs: &[f32],
        targets: &[u32],
        v: usize,
        dloss: f64,
    ) -> Result<Vec<f32>> {
        check::cross_entropy(probs, targets, v)?;
        let per_row = (dloss / targets.len().max(1) as f64) as f32;
        let ids = ids_as_f32(targets);
        let scalars = scalar::with(&[(scalar::DLOSS_PER_ROW, per_row)]);
        let outs = [Out::Fresh(probs.len()), Out::Init(&ids), Out::Unused];
        let [_, d, ..] = self
            .step_op(
                launch::cross_entropy_bwd(probs.len(), v),
                &scalars,
                (0, probs),
                outs,
            )
            .await?;
        Ok(d)
    }

    pub(super) async fn op_embedding_fwd(
        &self,
        table: &[f32],
        ids: &[u32],
        c: usize,
    ) -> Result<Vec<f32>> {
        check::embedding_fwd(table, ids, c)?;
        let n = ids.len() * c;
        let ids = ids_as_f32(ids);
        let outs = [Out::Fresh(n), Out::Unused, Out::Unused];
        let [y, ..] = self
            .train_op(launch::embedding_fwd(n, c), [table, &ids, &[]], outs)
            .await?;
        Ok(y)
    }

    pub(super) async fn op_embedding_bwd(
        &self,
        dout: &[f32],
        ids: &[u32],
        rows: usize,
        c: usize,
    ) -> Result<Vec<f32>> {
        check::embedding_bwd(dout, ids, rows, c)?;
        let tokens = ids.len();
        let ids = ids_as_f32(ids);
        let outs = [Out::Fresh(rows * c), Out::Unused, Out::Unused];
        let [d, ..] = self
            .train_op(
                launch::embedding_bwd(rows, c, tokens),
                [dout, &ids, &[]],
                outs,
            )
            .await?;
        Ok(d)
    }

    pub(super) async fn op_unscale_check(&self, g: &mut [f32], inverse_scale: f32) -> Result<bool> {
        if g.is_empty() {
            return Ok(true);
        }
        // The flag into stats slot 0, the squared norm into slot 1.
        let scalars = scalar::with(&[(scalar::INVERSE_SCALE, inverse_scale)]);
        let outs = [Out::Init(g), Out::Unused, Out::Unused];
        let [stats, scaled, ..] = self
            .step_op(
                launch::unscale_check(g.len(), false, 0, 1),
                &scalars,
                (2, &[]),
                outs,
            )
            .await?;
        g.copy_from_slice(&scaled);
        Ok(stats[0] == 0.0)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn op_adamw(
        &self,
        opt: &AdamW,
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        t: u32,
        decay: bool,
    ) -> Result<()> {
        check::adamw(p, g, m, v)?;
        let scalars = scalar::with(&scalar::adamw(opt, t));
        // No gradient flags to gate on: the update always applies.
        let outs = [Out::Init(p), Out::Init(m), Out::Init(v)];
        let [_, np, nm, nv] = self
            .step_op(launch::adamw(p.len(), 0, decay), &scalars, (1, g), outs)
            .await?;
        p.copy_from_slice(&np);
        m.copy_from_slice(&nm);
        v.copy_from_slice(&nv);
        Ok(())
    }
}
