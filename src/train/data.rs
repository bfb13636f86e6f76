//! The corpus as token ids (its characters, or GPT-2's byte-level BPE), its 90/10
//! train/validation split, seeded batches.

use crate::error::{Error, Result};
use crate::input::Input;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::path::Path;

pub use super::tokens::GPT2_TOKENS;

/// The largest corpus `Corpus::load` reads: 256 MiB of text (250 times Shakespeare's; its ids
/// and splits take about 4 bytes per character more).
pub const MAX_CORPUS_BYTES: u64 = 256 << 20;

/// How a text becomes token ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tokenizer {
    /// A token per distinct character of the corpus (`Vocab::Chars`).
    Chars,
    /// GPT-2's byte-level BPE (`Vocab::Gpt2`).
    Gpt2,
}

/// A corpus's tokens: what an id means.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Vocab {
    /// The distinct characters of the corpus, sorted; a character's id is its index.
    Chars(Vec<char>),
    /// GPT-2's byte-level BPE (tiktoken's `r50k_base`: 50257 tokens, the last
    /// `<|endoftext|>`), whose encoder ships with the engine.
    Gpt2,
}

impl Vocab {
    /// Distinct tokens.
    pub fn len(&self) -> usize {
        match self {
            Vocab::Chars(chars) => chars.len(),
            Vocab::Gpt2 => GPT2_TOKENS,
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The tokenizer that makes it.
    pub fn tokenizer(&self) -> Tokenizer {
        match self {
            Vocab::Chars(_) => Tokenizer::Chars,
            Vocab::Gpt2 => Tokenizer::Gpt2,
        }
    }

    /// What a checkpoint records of it (`GptMeta`): the tokenizer's name where it is not one
    /// of characters, and the characters in token order (empty for GPT-2's).
    pub fn saved(&self) -> (Option<String>, String) {
        match self {
            Vocab::Chars(chars) => (None, chars.iter().collect()),
            Vocab::Gpt2 => (Some("gpt2".into()), String::new()),
        }
    }

    /// The vocabulary a checkpoint recorded (`saved`), in words.
    pub fn describe_saved(tokenizer: Option<&str>, chars: &str) -> String {
        match tokenizer {
            None => format!("{} characters", chars.chars().count()),
            Some("gpt2") => Vocab::Gpt2.describe(),
            Some(other) => format!("the tokenizer '{other}'"),
        }
    }

    /// It in words ("65 characters", "GPT-2's byte-level BPE (50257 tokens)").
    pub fn describe(&self) -> String {
        match self {
            Vocab::Chars(chars) => format!("{} characters", chars.len()),
            Vocab::Gpt2 => format!("GPT-2's byte-level BPE ({GPT2_TOKENS} tokens)"),
        }
    }
}

/// A text encoded as token ids.
#[derive(Clone, Debug)]
pub struct Corpus {
    /// What its ids mean.
    pub vocab: Vocab,
    /// The first 90% of the text, as ids.
    pub train: Vec<u32>,
    /// The last 10% of the text, as ids (validation).
    pub val: Vec<u32>,
}

/// Fewest tokens a corpus may have.
const MIN_TOKENS: usize = 64;

impl Corpus {
    /// Reads the corpus at `path` (`-`: standard input) through `input::Input`: a regular file
    /// of at most `MAX_CORPUS_BYTES` of UTF-8 text, a token per character.
    pub fn load(path: &Path) -> Result<Corpus> {
        Corpus::load_as(path, Tokenizer::Chars)
    }

    /// `load`, tokenized by `tokenizer`. GPT-2's tokens of a corpus file are cached
    /// (`token_cache`): a cache that does not hold this text's tokens is rebuilt, never trusted.
    pub fn load_as(path: &Path, tokenizer: Tokenizer) -> Result<Corpus> {
        let text = Corpus::read_text(path)?;
        Corpus::from_file_text(&text, tokenizer).map_err(|e| Error::file(path, e))
    }

    /// The text of the corpus at `path` (`load`'s checks), not tokenized yet: `sample` reads it
    /// before the checkpoint that names its tokenizer.
    pub fn read_text(path: &Path) -> Result<String> {
        let text = Input::open_within(path, "corpus", MAX_CORPUS_BYTES)?
            .read_all("corpus", MAX_CORPUS_BYTES)?;
        String::from_utf8(text).map_err(|e| {
            Error::file(
                path,
                format!("cannot read the corpus: not UTF-8 text ({e})"),
            )
        })
    }

    /// A corpus file's `text` tokenized by `tokenizer`, GPT-2's through the token cache.
    pub fn from_file_text(text: &str, tokenizer: Tokenizer) -> Result<Corpus> {
        match tokenizer {
            Tokenizer::Chars => Corpus::from_text(text),
            Tokenizer::Gpt2 => Corpus::split(Vocab::Gpt2, super::tokens::gpt2_cached(text)?),
        }
    }

    /// Encodes `text` a token per character and splits it 90/10; refused under 64 characters.
    pub fn from_text(text: &str) -> Result<Corpus> {
        Corpus::from_text_as(text, Tokenizer::Chars)
    }

    /// Encodes `text` with `tokenizer` and splits it 90/10; refused under 64 tokens.
    pub fn from_text_as(text: &str, tokenizer: Tokenizer) -> Result<Corpus> {
        match tokenizer {
            Tokenizer::Chars => {
                let mut vocab: Vec<char> = text.chars().collect();
                vocab.sort_unstable();
                vocab.dedup();
                let ids: Vec<u32> = text
                    .chars()
                    .map(|ch| vocab.binary_search(&ch).unwrap_or(0) as u32)
                    .collect();
                Corpus::split(Vocab::Chars(vocab), ids)
            }
            Tokenizer::Gpt2 => Corpus::split(Vocab::Gpt2, super::tokens::gpt2_encode(text)?),
        }
    }

    /// `ids` of `vocab` split 90/10; refused under `MIN_TOKENS`.
    fn split(vocab: Vocab, mut ids: Vec<u32>) -> Result<Corpus> {
        if ids.len() < MIN_TOKENS {
            return Err(Error::invalid(
                "corpus",
                format!(
                    "{} tokens ({}) is too short to train on (need at least {MIN_TOKENS})",
                    ids.len(),
                    vocab.describe()
                ),
            ));
        }
        let val = ids.split_off(ids.len() * 9 / 10);
        Ok(Corpus {
            vocab,
            train: ids,
            val,
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

    /// The text of `ids` ('?' for an id outside the vocabulary; U+FFFD for bytes of GPT-2's
    /// tokens that are not UTF-8 on their own).
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids)).into_owned()
    }

    /// The bytes of `ids`' text: a GPT-2 token may hold part of a character, so a stream of
    /// them is decoded as bytes and shown where they complete one (`trainer::sample_streaming`).
    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        match &self.vocab {
            Vocab::Chars(chars) => (ids.iter())
                .map(|&i| chars.get(i as usize).copied().unwrap_or('?'))
                .collect::<String>()
                .into_bytes(),
            Vocab::Gpt2 => super::tokens::gpt2_decode(ids),
        }
    }

    /// The ids of `text`: GPT-2's tokens of it, or its characters', every one of which must
    /// be in the vocabulary (else why not, naming the first that is not).
    pub fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, String> {
        let chars = match &self.vocab {
            Vocab::Chars(chars) => chars,
            Vocab::Gpt2 => return super::tokens::gpt2_encode(text).map_err(|e| e.to_string()),
        };
        text.chars()
            .enumerate()
            .map(|(i, ch)| match chars.binary_search(&ch) {
                Ok(id) => Ok(id as u32),
                Err(_) => Err(format!(
                    "character {i}, {ch:?} (U+{:04X}), is not in the corpus's vocabulary of {} \
                     characters",
                    ch as u32,
                    chars.len()
                )),
            })
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

/// Batches given in a file (`mantissa train --batches`) instead of sampled ones: a C-order `.npy`
/// integer array [steps, B, T+1] of token ids, one batch a step in order (x = the first T ids
/// of a row, y = the last T), as `scripts/anchors/torch_step_parity.py` writes them.
#[derive(Clone, Debug)]
pub struct Batches {
    /// Rows per batch and tokens per row (without the last target).
    pub batch: usize,
    /// Tokens per row (without the last target).
    pub t: usize,
    /// steps x batch x (t + 1) ids (shared: each preset of a run takes them).
    ids: std::sync::Arc<[u32]>,
}

impl Batches {
    /// Reads a batch file (a regular file, opened by `input::Input`) for batches of `batch`
    /// rows of `t` tokens over a vocabulary of `vocab` ids, holding at least `steps` batches.
    /// Every refusal names the file and the dimension or element; the header is checked against
    /// the run and the file's length before the data is read.
    pub fn load(path: &Path, batch: usize, t: usize, vocab: usize, steps: u32) -> Result<Batches> {
        let (file, len) = crate::input::Input::open(path)?
            .into_file()
            .map_err(|_| Error::file(path, "batches are read from a file, not a stream"))?;
        let mut source = std::io::BufReader::new(file);
        Batches::read(&mut source, Some(len), path, (batch, t, vocab, steps))
    }

    /// `load` over any seekable source of `file_bytes` bytes (when known).
    pub fn read(
        source: &mut (impl std::io::Read + std::io::Seek),
        file_bytes: Option<u64>,
        path: &Path,
        (batch, t, vocab, steps): (usize, usize, usize, u32),
    ) -> Result<Batches> {
        let bad = |why: String| Error::file(path, format!("not usable as batches: {why}"));
        let data_start = crate::npy::check_claimed_shape(path, source, file_bytes)?;
        let npy =
            npyz::NpyFile::new(source).map_err(|e| bad(format!("not a valid .npy file ({e})")))?;
        let shape: Vec<u64> = npy.shape().to_vec();
        let [n, b, row] = shape[..] else {
            return Err(bad(format!(
                "{} dimension(s) {shape:?}, expected 3: [steps, batch, T+1]",
                shape.len()
            )));
        };
        if npy.order() != npyz::Order::C {
            return Err(bad(
                "Fortran order; write it in C order (numpy.ascontiguousarray)".into(),
            ));
        }
        if b != batch as u64 {
            return Err(bad(format!(
                "a batch of {b} rows (dimension 1), this run's is {batch}"
            )));
        }
        if row != t as u64 + 1 {
            return Err(bad(format!(
                "rows of {row} ids (dimension 2), this run's context needs T+1 = {}",
                t + 1
            )));
        }
        if n < steps as u64 {
            return Err(bad(format!(
                "{n} batch{} (dimension 0), fewer than the {steps} steps asked for",
                if n == 1 { "" } else { "es" }
            )));
        }
        let dtype = npy.dtype();
        // check_claimed_shape has held n * b * row within the file's bytes; checked again here,
        // where it becomes a size.
        let count = [b, row]
            .iter()
            .try_fold(n, |acc, &d| acc.checked_mul(d))
            .and_then(|c| usize::try_from(c).ok())
            .ok_or_else(|| bad(format!("a shape {shape:?} whose size overflows")))?;
        let mut ids = crate::memory::empty_with_capacity::<u32>("the batches", count)?;
        use npyz::TypeChar::{Int, Uint};
        match &dtype {
            npyz::DType::Plain(ty) => match (ty.type_char(), ty.size_field()) {
                (Uint, 1) => ids_of::<u8, _>(npy, &mut ids, count),
                (Int, 1) => ids_of::<i8, _>(npy, &mut ids, count),
                (Uint, 2) => ids_of::<u16, _>(npy, &mut ids, count),
                (Int, 2) => ids_of::<i16, _>(npy, &mut ids, count),
                (Uint, 4) => ids_of::<u32, _>(npy, &mut ids, count),
                (Int, 4) => ids_of::<i32, _>(npy, &mut ids, count),
                (Uint, 8) => ids_of::<u64, _>(npy, &mut ids, count),
                (Int, 8) => ids_of::<i64, _>(npy, &mut ids, count),
                _ => Err(String::new()),
            },
            _ => Err(String::new()),
        }
        .map_err(|why| match why.is_empty() {
            true => format!(
                "dtype {}; token ids are integers (int8 .. int64, uint8 .. uint64)",
                dtype.descr()
            ),
            false => why,
        })
        .map_err(bad)?;
        if ids.len() != count {
            return Err(bad(format!("truncated: {} of {count} ids", ids.len())));
        }
        let width = dtype.num_bytes().unwrap_or(1) as u64;
        crate::npy::check_no_trailing(path, data_start, width * count as u64, file_bytes)?;
        if let Some(e) = ids.iter().position(|&id| id as usize >= vocab) {
            let (row_len, batch_len) = (t + 1, batch * (t + 1));
            return Err(bad(format!(
                "id {} at [{}, {}, {}] is outside the vocabulary of {vocab}",
                ids[e],
                e / batch_len,
                e % batch_len / row_len,
                e % row_len
            )));
        }
        Ok(Batches {
            batch,
            t,
            ids: ids.into(),
        })
    }

    /// Batches held.
    pub fn len(&self) -> usize {
        self.ids.len() / (self.batch * (self.t + 1))
    }

    /// Whether no batch is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Batch `index` (0-based) as (ids, targets), `batch` rows of `t` each; None past the end.
    pub fn get(&self, index: usize) -> Option<(Vec<u32>, Vec<u32>)> {
        let row = self.t + 1;
        let all = self.ids.chunks(self.batch * row).nth(index)?;
        let ids = all
            .chunks(row)
            .flat_map(|r| &r[..self.t])
            .copied()
            .collect();
        let targets = all.chunks(row).flat_map(|r| &r[1..]).copied().collect();
        Some((ids, targets))
    }
}

/// The first `count` integers of type `T` in `npy`, appended to `ids` as ids (a negative or
/// too large one refused by its index).
fn ids_of<T, R>(
    npy: npyz::NpyFile<R>,
    ids: &mut Vec<u32>,
    count: usize,
) -> std::result::Result<(), String>
where
    T: npyz::Deserialize + TryInto<u32> + Copy + std::fmt::Display,
    R: std::io::Read,
{
    let reader = npy.data::<T>().map_err(|e| e.to_string())?;
    for (i, v) in reader.take(count).enumerate() {
        let v = v.map_err(|e| format!("truncated or unreadable data ({e})"))?;
        ids.push(
            v.try_into()
                .map_err(|_| format!("element {i} is {v}, not a token id"))?,
        );
    }
    Ok(())
}
