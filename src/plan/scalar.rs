//! The scalars the host writes before each step: their slots, AdamW's hyper-parameters (which
//! travel through them), and the one function that fills a step's array.
//!
//! The slot numbers are the one definition every kernel reads: `shaders/step.wgsl` and
//! `cuda/train.cu` include a header generated from `SLOTS` (`header_wgsl`, `header_cuda`),
//! and a test checks the kernels include what this file generates.

/// Loss scale / rows (the cross-entropy gradient of the scaled mean loss).
pub const DLOSS_PER_ROW: usize = 0;
/// 1 / loss scale.
pub const INVERSE_SCALE: usize = 1;
/// Added to the first element of gradient 0 before the check (fault injection; else 0).
pub const POISON: usize = 2;
/// AdamW's learning rate.
pub const LR: usize = 3;
/// AdamW's beta1 (first-moment decay).
pub const BETA1: usize = 4;
/// AdamW's beta2 (second-moment decay).
pub const BETA2: usize = 5;
/// AdamW's epsilon.
pub const EPS: usize = 6;
/// AdamW's decoupled weight decay.
pub const WEIGHT_DECAY: usize = 7;
/// AdamW's bias corrections 1 - beta^t, computed in f64 on the host.
pub const BIAS_CORRECTION1: usize = 8;
/// See `BIAS_CORRECTION1`: 1 - beta2^t.
pub const BIAS_CORRECTION2: usize = 9;
/// Global gradient-norm clip (0: none).
pub const CLIP: usize = 10;
/// The AdamW step t (1-based), for the host interpreter (`reference::ops::adamw` takes it).
pub const STEP: usize = 11;
/// The loss scale over the parts of a step split over ranks or micro-batches (each part's
/// weight in the mean loss of the global batch; the loss scale itself for a step run whole), for the host interpreter
/// (`reference::ops::cross_entropy_bwd` divides by its own rows).
pub const DLOSS: usize = 12;
/// 1 where the run evaluates (dropout passes its input through, as after PyTorch's
/// `model.eval()`); 0 in training.
pub const EVAL: usize = 13;
/// Which of the global batch's equal parts this run's rows are (rank x micro-batches + the
/// micro-batch): dropout counts its elements from this times its length, so that a step split
/// over ranks or micro-batches draws the masks of the unsplit step.
pub const PART: usize = 14;
/// fp8 scales: three per linear layer (input, weight, gradient).
pub const FP8: usize = 15;

/// Every slot by the name the kernels know it by (`S_<NAME>`).
pub const SLOTS: [(&str, usize); 16] = [
    ("DLOSS_PER_ROW", DLOSS_PER_ROW),
    ("INVERSE_SCALE", INVERSE_SCALE),
    ("POISON", POISON),
    ("LR", LR),
    ("BETA1", BETA1),
    ("BETA2", BETA2),
    ("EPS", EPS),
    ("WEIGHT_DECAY", WEIGHT_DECAY),
    ("BIAS_CORRECTION1", BIAS_CORRECTION1),
    ("BIAS_CORRECTION2", BIAS_CORRECTION2),
    ("CLIP", CLIP),
    ("STEP", STEP),
    ("DLOSS", DLOSS),
    ("EVAL", EVAL),
    ("PART", PART),
    ("FP8", FP8),
];

/// AdamW hyper-parameters (the host update itself is `backend::reference::ops::adamw`).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the square root of the bias-corrected second moment (the update's denominator).
    pub eps: f32,
    /// Decoupled weight decay (times lr), on the parameters that take it.
    pub weight_decay: f32,
}

impl Default for AdamW {
    /// nanoGPT's shakespeare-char settings.
    fn default() -> Self {
        AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

impl AdamW {
    /// Refuses settings no step can use (a NaN learning rate made every weight NaN after a
    /// step that reported itself applied): the learning rate and weight decay finite and >= 0,
    /// the betas in [0, 1), epsilon finite and > 0.
    pub fn check(&self) -> crate::error::Result<()> {
        let settings = [
            (
                "learning rate",
                self.lr,
                self.lr.is_finite() && self.lr >= 0.0,
                "finite and >= 0",
            ),
            (
                "beta1",
                self.beta1,
                (0.0..1.0).contains(&self.beta1),
                "in [0, 1)",
            ),
            (
                "beta2",
                self.beta2,
                (0.0..1.0).contains(&self.beta2),
                "in [0, 1)",
            ),
            (
                "epsilon",
                self.eps,
                self.eps.is_finite() && self.eps > 0.0,
                "finite and > 0",
            ),
            (
                "weight decay",
                self.weight_decay,
                self.weight_decay.is_finite() && self.weight_decay >= 0.0,
                "finite and >= 0",
            ),
        ];
        match settings.into_iter().find(|(_, _, ok, _)| !ok) {
            Some((what, value, _, range)) => Err(crate::error::Error::invalid(
                "AdamW",
                format!("{what} {value} is not {range}"),
            )),
            None => Ok(()),
        }
    }

    /// The bias corrections (1 - beta1^t, 1 - beta2^t) at step `t` (1-based), in f64.
    pub fn bias_corrections(&self, t: u32) -> (f64, f64) {
        let bias = |beta: f32| 1.0 - (beta as f64).powi(t as i32);
        (bias(self.beta1), bias(self.beta2))
    }
}

/// AdamW's slots at step `t` (1-based): hyper-parameters and the bias corrections.
pub fn adamw(o: &AdamW, t: u32) -> [(usize, f32); 7] {
    let (bc1, bc2) = o.bias_corrections(t);
    [
        (LR, o.lr),
        (BETA1, o.beta1),
        (BETA2, o.beta2),
        (EPS, o.eps),
        (WEIGHT_DECAY, o.weight_decay),
        (BIAS_CORRECTION1, bc1 as f32),
        (BIAS_CORRECTION2, bc2 as f32),
    ]
}

/// What a step's scalars are made of.
#[derive(Clone, Copy, Debug)]
pub struct StepScalars<'a> {
    /// The optimizer's hyper-parameters.
    pub adamw: &'a AdamW,
    /// Global gradient-norm clip (0: none).
    pub clip: f32,
    /// The dynamic loss scale (1 without loss scaling).
    pub loss_scale: f32,
    /// Added to the first element of gradient 0 (fault injection; else 0).
    pub poison: f32,
    /// The AdamW step (1-based).
    pub t: u32,
    /// The equal parts of the global batch (ranks x micro-batches; 1 for a step run whole):
    /// this plan's rows are one part, and the gradients are of the global batch's mean loss,
    /// so that their sum over the parts is the gradient of the step run whole.
    pub parts: usize,
    /// Which part this run's rows are (`PART`).
    pub part: usize,
    /// Delayed scaling's (input, weight, gradient) scales per fp8 linear layer; unit scales
    /// for the layers it does not cover.
    pub fp8: &'a [[f32; 3]],
    /// The run evaluates: dropout passes its input through (`EVAL`).
    pub eval: bool,
}

impl StepScalars<'_> {
    /// The scalars array of a plan with `rows` rows and `scalar_count` slots.
    pub fn array(&self, rows: usize, scalar_count: usize) -> Vec<f32> {
        let mut s = vec![0.0; scalar_count];
        let parts = self.parts.max(1) as f64;
        s[DLOSS_PER_ROW] = (self.loss_scale as f64 / (rows as f64 * parts)) as f32;
        s[INVERSE_SCALE] = 1.0 / self.loss_scale;
        s[POISON] = self.poison;
        for (slot, v) in adamw(self.adamw, self.t) {
            s[slot] = v;
        }
        s[CLIP] = self.clip;
        s[STEP] = self.t as f32;
        s[DLOSS] = (self.loss_scale as f64 / parts) as f32;
        s[EVAL] = f32::from(u8::from(self.eval));
        s[PART] = self.part as f32;
        // Unit scales where no fp8 state is given (a forward pass outside training).
        for (l, slots) in s[FP8.min(scalar_count)..].chunks_mut(3).enumerate() {
            let scales = self.fp8.get(l).copied().unwrap_or([1.0; 3]);
            slots.copy_from_slice(&scales[..slots.len()]);
        }
        s
    }
}

/// The slots as WGSL constants (`const S_LR: u32 = 3u;`), spliced before the step kernels.
pub fn header_wgsl() -> String {
    SLOTS
        .iter()
        .map(|(name, slot)| format!("const S_{name}: u32 = {slot}u;\n"))
        .collect()
}

/// The slots as CUDA constants, for `cuda/train.cu`.
pub fn header_cuda() -> String {
    SLOTS
        .iter()
        .map(|(name, slot)| format!("#define S_{name} {slot}u\n"))
        .collect()
}
