//! The `Backend` training ops on CUDA: operands uploaded, the launches of `train.rs`, results
//! downloaded. (Training itself runs the resident plan, `plan.rs`; these serve the host
//! interpreter and the conformance suite, which checks each kernel against `reference::ops`.)

use super::CudaBackend;
use super::train::{self as launch, scratch};
use crate::backend::check;
use crate::error::Result;
use crate::format::Format;
use crate::plan::scalar;
use crate::plan::{AdamW, ScoreScale};
use cudarc::driver::CudaSlice;

type Triple = (Vec<f32>, Vec<f32>, Vec<f32>);

impl CudaBackend {
    /// A scalars array (src/plan/scalar.rs) on the device with `slots` set.
    fn scalars(&self, slots: &[(usize, f32)]) -> Result<CudaSlice<f32>> {
        self.upload(&scalar::with(slots))
    }

    pub(super) fn op_layernorm_fwd(
        &self,
        x: &[f32],
        g: &[f32],
        b: &[f32],
        c: usize,
    ) -> Result<Triple> {
        let rows = check::layernorm_fwd(x, g, b, c)?;
        let ins = [self.upload(x)?, self.upload(g)?, self.upload(b)?];
        let y = self.zeros::<f32>(x.len())?;
        let stats = self.zeros::<f32>(2 * rows)?;
        let p = |s: &CudaSlice<f32>| self.ptr(s);
        let ptrs = [p(&ins[0]), p(&ins[1]), p(&ins[2]), p(&y), p(&stats)];
        launch::layernorm_fwd(self, ptrs, (rows, c), (Format::F32, false))?;
        let st = self.download(&stats, 2 * rows)?;
        Ok((
            self.download(&y, x.len())?,
            st.iter().step_by(2).copied().collect(),
            st.iter().skip(1).step_by(2).copied().collect(),
        ))
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_layernorm_bwd(
        &self,
        dy: &[f32],
        x: &[f32],
        g: &[f32],
        mean: &[f32],
        rstd: &[f32],
        c: usize,
    ) -> Result<Triple> {
        let rows = check::layernorm_bwd(dy, x, g, (mean, rstd), c)?;
        let stats: Vec<f32> = mean.iter().zip(rstd).flat_map(|(&m, &r)| [m, r]).collect();
        let ins = [
            self.upload(dy)?,
            self.upload(x)?,
            self.upload(g)?,
            self.upload(&stats)?,
        ];
        let dx = self.zeros::<f32>(x.len())?;
        let (dg, db) = (self.zeros::<f32>(c)?, self.zeros::<f32>(c)?);
        let work = self.zeros::<f32>(scratch::layernorm_bwd(rows, c))?;
        let p = |s: &CudaSlice<f32>| self.ptr(s);
        launch::layernorm_bwd(
            self,
            [
                p(&ins[0]),
                p(&ins[1]),
                p(&ins[2]),
                p(&ins[3]),
                p(&dx),
                p(&dg),
                p(&db),
            ],
            rows,
            c,
            p(&work),
        )?;
        Ok((
            self.download(&dx, x.len())?,
            self.download(&dg, c)?,
            self.download(&db, c)?,
        ))
    }

    pub(super) fn op_gelu(&self, x: &[f32], dy: Option<&[f32]>) -> Result<Vec<f32>> {
        check::gelu(x, dy)?;
        let input = self.upload(x)?;
        let out = self.zeros::<f32>(x.len())?;
        match dy {
            None => launch::gelu_fwd(
                self,
                [self.ptr(&input), self.ptr(&out)],
                x.len(),
                (Format::F32, false),
                Format::F32,
            )?,
            Some(dy) => {
                let d = self.upload(dy)?;
                let ptrs = [self.ptr(&input), self.ptr(&d), self.ptr(&out)];
                launch::gelu_bwd(self, ptrs, x.len(), Format::F32)?
            }
        }
        self.download(&out, x.len())
    }

    pub(super) fn op_softmax(
        &self,
        x: &[f32],
        dp: Option<&[f32]>,
        t: usize,
        scale: ScoreScale,
    ) -> Result<Vec<f32>> {
        let rows = check::softmax(x, dp, t)?;
        let input = self.upload(x)?;
        let out = self.zeros::<f32>(x.len())?;
        match dp {
            None => launch::softmax_fwd(self, self.ptr(&input), self.ptr(&out), (rows, t, scale))?,
            Some(dp) => {
                let d = self.upload(dp)?;
                let (p, d, o) = (self.ptr(&input), self.ptr(&d), self.ptr(&out));
                launch::softmax_bwd(self, p, d, o, (rows, t, scale))?
            }
        }
        self.download(&out, x.len())
    }

    pub(super) fn op_cross_entropy_fwd(
        &self,
        logits: &[f32],
        targets: &[u32],
        v: usize,
    ) -> Result<(f64, Vec<f32>)> {
        let rows = check::cross_entropy(logits, targets, v)?;
        let (l, t) = (self.upload(logits)?, self.upload(targets)?);
        let probs = self.zeros::<f32>(logits.len())?;
        let stats = self.zeros::<f32>(1)?;
        let work = self.zeros::<f32>(scratch::cross_entropy(rows))?;
        let ptrs = [
            self.ptr(&l),
            self.ptr(&t),
            self.ptr(&probs),
            self.ptr(&stats),
        ];
        launch::cross_entropy_fwd(self, ptrs, (0, rows, v), self.ptr(&work), None)?;
        let loss = self.download(&stats, 1)?[0] as f64;
        Ok((loss, self.download(&probs, logits.len())?))
    }

    pub(super) fn op_cross_entropy_bwd(
        &self,
        probs: &[f32],
        targets: &[u32],
        v: usize,
        dloss: f64,
    ) -> Result<Vec<f32>> {
        let rows = check::cross_entropy(probs, targets, v)?;
        let (p, t) = (self.upload(probs)?, self.upload(targets)?);
        let per_row = (dloss / rows.max(1) as f64) as f32;
        let s = self.scalars(&[(scalar::DLOSS_PER_ROW, per_row)])?;
        let d = self.zeros::<f32>(probs.len())?;
        let ptrs = [self.ptr(&p), self.ptr(&t), self.ptr(&d), self.ptr(&s)];
        launch::cross_entropy_bwd(self, ptrs, rows, v)?;
        self.download(&d, probs.len())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_adamw(
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
        let n = p.len();
        let s = self.scalars(&scalar::adamw(opt, t))?;
        // No gradient flags to gate on (count 0): the update always applies.
        let stats = self.zeros::<f32>(1)?;
        let bufs = [
            self.upload(p)?,
            self.upload(g)?,
            self.upload(m)?,
            self.upload(v)?,
        ];
        let q = |x: &CudaSlice<f32>| self.ptr(x);
        launch::adamw(
            self,
            [
                q(&bufs[0]),
                q(&bufs[1]),
                q(&bufs[2]),
                q(&bufs[3]),
                q(&stats),
                q(&s),
            ],
            n,
            0,
            decay,
        )?;
        p.copy_from_slice(&self.download(&bufs[0], n)?);
        m.copy_from_slice(&self.download(&bufs[2], n)?);
        v.copy_from_slice(&self.download(&bufs[3], n)?);
        Ok(())
    }

    pub(super) fn op_embedding_fwd(
        &self,
        table: &[f32],
        ids: &[u32],
        c: usize,
    ) -> Result<Vec<f32>> {
        check::embedding_fwd(table, ids, c)?;
        let (t, i) = (self.upload(table)?, self.upload(ids)?);
        let out = self.zeros::<f32>(ids.len() * c)?;
        launch::embedding_fwd(
            self,
            self.ptr(&t),
            self.ptr(&i),
            self.ptr(&out),
            ids.len(),
            c,
        )?;
        self.download(&out, ids.len() * c)
    }

    pub(super) fn op_embedding_bwd(
        &self,
        dout: &[f32],
        ids: &[u32],
        rows: usize,
        c: usize,
    ) -> Result<Vec<f32>> {
        check::embedding_bwd(dout, ids, rows, c)?;
        let (d, i) = (self.upload(dout)?, self.upload(ids)?);
        let out = self.zeros::<f32>(rows * c)?;
        let (pd, pi, po) = (self.ptr(&d), self.ptr(&i), self.ptr(&out));
        launch::embedding_bwd(self, pd, pi, po, (rows, c, ids.len()))?;
        self.download(&out, rows * c)
    }

    pub(super) fn op_unscale_check(&self, g: &mut [f32], inverse_scale: f32) -> Result<bool> {
        let n = g.len();
        let grads = self.upload(g)?;
        let s = self.scalars(&[(scalar::INVERSE_SCALE, inverse_scale)])?;
        let stats = self.zeros::<f32>(2)?;
        let work = self.zeros::<f32>(scratch::unscale(n))?;
        let ptrs = [self.ptr(&grads), self.ptr(&s), self.ptr(&stats)];
        launch::unscale(self, ptrs, n, false, (0, 1), self.ptr(&work))?;
        g.copy_from_slice(&self.download(&grads, n)?);
        Ok(self.download(&stats, 2)?[0] == 0.0)
    }
}
