//! The character corpus: vocabulary, 90/10 train/validation split, seeded batches.

use crate::error::{Error, Result};
use crate::input::Input;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::path::Path;

/// The largest corpus `Corpus::load` reads: 256 MiB of text (250 times Shakespeare's; its ids
/// and splits take about 4 bytes per character more).
pub const MAX_CORPUS_BYTES: u64 = 256 << 20;

/// A text encoded as character ids.
#[derive(Clone, Debug)]
pub struct Corpus {
    /// The distinct characters, sorted; a character's id is its index.
    pub vocab: Vec<char>,
    pub train: Vec<u32>,
    pub val: Vec<u32>,
}

impl Corpus {
    /// Reads the corpus at `path` (`-`: standard input) through `input::Input`: a regular file
    /// of at most `MAX_CORPUS_BYTES` of UTF-8 text.
    pub fn load(path: &Path) -> Result<Corpus> {
        let text = Input::open_within(path, "corpus", MAX_CORPUS_BYTES)?
            .read_all("corpus", MAX_CORPUS_BYTES)?;
        let text = String::from_utf8(text).map_err(|e| {
            Error::file(
                path,
                format!("cannot read the corpus: not UTF-8 text ({e})"),
            )
        })?;
        Corpus::from_text(&text).map_err(|e| Error::file(path, e))
    }

    pub fn from_text(text: &str) -> Result<Corpus> {
        let mut vocab: Vec<char> = text.chars().collect();
        vocab.sort_unstable();
        vocab.dedup();
        let ids: Vec<u32> = text
            .chars()
            .map(|ch| vocab.binary_search(&ch).unwrap_or(0) as u32)
            .collect();
        if ids.len() < 64 {
            return Err(Error::invalid(
                "corpus",
                format!(
                    "{} characters is too short to train on (need at least 64)",
                    ids.len()
                ),
            ));
        }
        let split = ids.len() * 9 / 10;
        Ok(Corpus {
            vocab,
            train: ids[..split].to_vec(),
            val: ids[split..].to_vec(),
        })
    }

    /// Unigram entropy of the training text in nats: the loss of a model that ignores context.
    pub fn unigram_entropy(&self) -> f64 {
        let mut counts = vec![0usize; self.vocab.len()];
        for &i in &self.train {
            counts[i as usize] += 1;
        }
        let n = self.train.len() as f64;
        counts
            .iter()
            .filter(|&&c| c > 0)
            .map(|&c| -(c as f64 / n) * (c as f64 / n).ln())
            .sum()
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&i| self.vocab.get(i as usize).copied().unwrap_or('?'))
            .collect()
    }

    /// Refuses a corpus whose training or validation split cannot hold a context of `t`
    /// tokens and its target (checked before a run creates anything).
    pub fn check_context(&self, t: usize) -> Result<()> {
        for validation in [false, true] {
            self.batch(validation, 1, t, 0, 0)?;
        }
        Ok(())
    }

    /// `batch` sequences of `t` tokens and their next-token targets, from a generator seeded by
    /// (seed, index): the same index always gives the same batch (resuming needs no RNG state).
    pub fn batch(
        &self,
        validation: bool,
        batch: usize,
        t: usize,
        seed: u64,
        index: u64,
    ) -> Result<(Vec<u32>, Vec<u32>)> {
        let data = if validation { &self.val } else { &self.train };
        if data.len() <= t + 1 {
            return Err(Error::invalid(
                "corpus",
                format!(
                    "the {} split has {} characters, fewer than a context of {t}",
                    if validation { "validation" } else { "training" },
                    data.len()
                ),
            ));
        }
        let mut rng = StdRng::seed_from_u64(
            seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ validation as u64,
        );
        let (mut x, mut y) = (Vec::with_capacity(batch * t), Vec::with_capacity(batch * t));
        for _ in 0..batch {
            let start = rng.random_range(0..data.len() - t - 1);
            x.extend_from_slice(&data[start..start + t]);
            y.extend_from_slice(&data[start + 1..start + t + 1]);
        }
        Ok((x, y))
    }
}
