//! The plan's tensors: what each holds (and so how long it lives), and how a device stores it.

use crate::format::{Format, Overflow};

/// A tensor of the plan (an index into `Plan::tensors`).
pub type TensorId = usize;

/// What a tensor holds, and so how long it lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorKind {
    /// Trained state, kept across steps: parameter i, its AdamW moments, its gradient.
    Param(usize),
    /// AdamW's first moment of parameter i.
    Moment1(usize),
    /// AdamW's second moment of parameter i.
    Moment2(usize),
    /// The gradient of parameter i.
    Grad(usize),
    /// The step's token ids and targets (u32 ids as f32 bit patterns).
    Tokens,
    /// The step's targets (u32 ids as f32 bit patterns).
    Targets,
    /// Fixed when the plan is built (`Plan::constants`).
    Constant,
    /// f32 values the host writes before a run (`StepExecutor::write`: a model's values
    /// inputs), kept until it writes them again.
    Input,
    /// A part of a gradient that a data-parallel step sums over its ranks before adding it in
    /// (`Plan::split_for_ranks`): kept between the step's two runs.
    Partial,
    /// The sum of a gradient over a step's micro-batches so far (`Plan::accumulate`): kept
    /// between the step's runs.
    Accumulator,
    /// Produced and consumed within a step.
    Temp,
}

/// A tensor of the plan: its length, what it holds and how a device stores it.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Elements (f32 values as every executor sees them).
    pub len: usize,
    /// What it holds, and so how long it lives.
    pub kind: TensorKind,
    /// What a device stores per element: f32, or the 16-bit codes of bf16 or f16 (two to a
    /// 4-byte word, the even element in the low half) for a tensor `Plan::store_codes` chose.
    /// Every executor reads and writes it as f32 values; a coded tensor's are its codes' values.
    pub stored: Format,
}

impl TensorInfo {
    /// 4-byte words of the tensor's storage.
    pub fn words(&self) -> usize {
        if self.stored.storage_bytes() == 2 {
            self.len.div_ceil(2)
        } else {
            self.len
        }
    }

    /// Bytes of the tensor's storage.
    pub fn bytes(&self) -> u64 {
        self.words() as u64 * 4
    }

    /// `values` as the device stores them (a coded tensor's values rounded to its format, as
    /// its kernels round them when they store).
    pub fn to_words(&self, values: &[f32]) -> Vec<u32> {
        if self.stored.storage_bytes() != 2 {
            return values.iter().map(|x| x.to_bits()).collect();
        }
        let code = |x: Option<&f32>| x.map_or(0, |&x| self.stored.encode(x, Overflow::Standard));
        values
            .chunks(2)
            .map(|pair| code(pair.first()) | code(pair.get(1)) << 16)
            .collect()
    }

    /// The values of stored words (`to_words`' inverse).
    pub fn from_words(&self, words: &[u32]) -> Vec<f32> {
        if self.stored.storage_bytes() != 2 {
            return words.iter().map(|&w| f32::from_bits(w)).collect();
        }
        (0..self.len)
            .map(|e| self.stored.decode(words[e / 2] >> (16 * (e % 2)) & 0xffff))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coded_words_round_trip_and_pack_two_codes() {
        let info = |len, stored| TensorInfo {
            len,
            kind: TensorKind::Temp,
            stored,
        };
        let values = [1.0f32, -2.5, 3.0e-3, f32::INFINITY, 65504.0];
        for format in [Format::Bf16, Format::F16] {
            let t = info(values.len(), format);
            let words = t.to_words(&values);
            assert_eq!((words.len(), t.words(), t.bytes()), (3, 3, 12));
            assert_eq!(words[0] & 0xffff, format.encode(1.0, Overflow::Standard));
            assert_eq!(words[0] >> 16, format.encode(-2.5, Overflow::Standard));
            let back = t.from_words(&words);
            let want: Vec<f32> = values
                .iter()
                .map(|&x| format.round(x, Overflow::Standard))
                .collect();
            assert_eq!(back, want, "{format}");
        }
        let t = info(values.len(), Format::F32);
        assert_eq!(t.from_words(&t.to_words(&values)), values);
        assert_eq!(t.bytes(), 20);
    }
}
