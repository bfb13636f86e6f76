//! The property and fuzz suite: every reader of outside input (the .npy reader, the checkpoint
//! loader, the algorithm, format, preset and backend names, the raw cast stream) run on
//! arbitrary and mutated input under proptest. The properties: no panic, no abort, and what is
//! accepted is consistent (shapes that fit the file, finite checkpoint state, names that print
//! back as themselves, raw casts equal to element-by-element conversion).
//!
//! Bounded in time: `MANTISSA_FUZZ_CASES` inputs per target (default 50000, a few seconds;
//! raise it for a long run). The number tried lands in target/tmp/fuzz.txt, which
//! scripts/test.sh sums in its summary line. A failing input is shrunk and its seed kept in tests/fuzz-regressions/, where
//! proptest replays it first on every later run (commit the file: it is the regression test).

mod common;

use mantissa::algorithm::Algorithm;
use mantissa::backend::BackendChoice;
use mantissa::format::{Format, Overflow};
use mantissa::npy::{Matrix, read_matrix_from, write_matrix};
use mantissa::policy::{PrecisionClass, Preset};
use mantissa::train::{Checkpoint, Corpus, GptConfig, TrainOptions, Trainer};
use pollster::FutureExt as _;
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestRunner};
use std::io::{Cursor, Read};
use std::path::Path;

/// Runs `test` on `cases` inputs from `strategy`, replaying kept failures first, and records
/// how many inputs were tried.
fn fuzz<S: Strategy>(
    target: &str,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S::Value: std::fmt::Debug,
{
    let cases: u32 = std::env::var("MANTISSA_FUZZ_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(50_000);
    let regressions = format!(
        "{}/tests/fuzz-regressions/{target}.txt",
        env!("CARGO_MANIFEST_DIR")
    );
    let config = Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(Box::leak(
            regressions.into_boxed_str(),
        )))),
        ..Config::default()
    };
    let mut runner = TestRunner::new_with_rng(
        config,
        proptest::test_runner::TestRng::from_seed(
            proptest::test_runner::RngAlgorithm::ChaCha,
            &seed_bytes(common::seed(target)),
        ),
    );
    if let Err(e) = runner.run(&strategy, test) {
        panic!("{target}: {e}");
    }
    let line = format!("fuzz {target}: {cases} inputs\n");
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz.txt");
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        use std::io::Write as _;
        let _ = f.write_all(line.as_bytes());
    }
}

fn seed_bytes(seed: u64) -> [u8; 32] {
    let mut bytes = [0u8; 32];
    for (i, chunk) in bytes.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&seed.wrapping_add(i as u64).to_le_bytes());
    }
    bytes
}

/// One edit of a valid file: set a byte, cut the file short, insert or remove bytes.
#[derive(Clone, Debug)]
enum Edit {
    Set(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
}

/// Up to 8 edits, positions anywhere, or (`head` > 0) mostly within the first `head` bytes,
/// where the headers that hold sizes live.
fn edits(head: usize) -> impl Strategy<Value = Vec<Edit>> {
    let pos = prop_oneof![0..head.max(1), any::<usize>()];
    let edit = prop_oneof![
        4 => (pos.clone(), any::<u8>()).prop_map(|(p, b)| Edit::Set(p, b)),
        1 => any::<usize>().prop_map(Edit::Truncate),
        1 => (pos.clone(), proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(p, b)| Edit::Insert(p, b)),
        1 => (pos, 1..64usize).prop_map(|(p, n)| Edit::Remove(p, n)),
    ];
    proptest::collection::vec(edit, 1..8)
}

fn apply(seed: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for e in edits {
        let at = |p: usize, len: usize| if len == 0 { 0 } else { p % len };
        match e {
            Edit::Set(p, v) if !b.is_empty() => {
                let i = at(*p, b.len());
                b[i] = *v;
            }
            Edit::Set(..) => {}
            Edit::Truncate(n) => b.truncate(at(*n, b.len() + 1)),
            Edit::Insert(p, bytes) => {
                let i = at(*p, b.len() + 1);
                b.splice(i..i, bytes.iter().copied());
            }
            Edit::Remove(p, n) => {
                let i = at(*p, b.len() + 1);
                let end = (i + n).min(b.len());
                b.drain(i..end);
            }
        }
    }
    b
}

/// An .npy header written by hand: any shape (huge ones too), any dtype, either order, followed
/// by `data` bytes.
fn forged_npy() -> impl Strategy<Value = Vec<u8>> {
    let dim = prop_oneof![0..8u64, any::<u64>(), (0..64u32).prop_map(|s| 1u64 << s)];
    let descr = prop::sample::select(vec!["<f4", ">f4", "<f8", "<i4", "|u1", "<f2", "zz"]);
    (
        proptest::collection::vec(dim, 0..4),
        descr,
        any::<bool>(),
        proptest::collection::vec(any::<u8>(), 0..256),
    )
        .prop_map(|(dims, descr, fortran, data)| {
            let shape = match dims.len() {
                1 => format!("({},)", dims[0]),
                _ => format!(
                    "({})",
                    dims.iter()
                        .map(u64::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            let mut header = format!(
                "{{'descr': '{descr}', 'fortran_order': {}, 'shape': {shape}, }}",
                if fortran { "True" } else { "False" }
            );
            while (10 + header.len() + 1) % 64 != 0 {
                header.push(' ');
            }
            header.push('\n');
            let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
            bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
            bytes.extend_from_slice(header.as_bytes());
            bytes.extend_from_slice(&data);
            bytes
        })
}

/// The reader's contract on any bytes: an error, or a matrix whose data is exactly its shape
/// and fits in the file.
fn check_npy(bytes: &[u8]) -> Result<(), TestCaseError> {
    let len = bytes.len() as u64;
    if let Ok(m) = read_matrix_from(Cursor::new(bytes), Some(len), Path::new("fuzz.npy")) {
        prop_assert_eq!(Some(m.data.len()), m.rows.checked_mul(m.cols));
        prop_assert!(m.data.len() as u64 * 4 <= len);
    }
    Ok(())
}

#[test]
fn npy_reader_takes_any_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.npy");
    write_matrix(
        &path,
        &Matrix::new(3, 5, (0..15).map(|i| i as f32).collect()).unwrap(),
    )
    .unwrap();
    let valid = std::fs::read(&path).unwrap();
    fuzz(
        "npy",
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..512),
            forged_npy(),
            edits(128).prop_map(move |e| apply(&valid, &e)),
        ],
        |bytes| check_npy(&bytes),
    );
}

/// A tiny model's checkpoint (a few steps into 16-mixed, so that every field is set).
fn checkpoint_bytes() -> (Vec<u8>, GptConfig, Vec<char>) {
    let corpus = Corpus::from_text(&"To be, or not to be: that is the question.\n".repeat(40))
        .expect("corpus");
    let mut config = GptConfig::named("tiny", corpus.vocab.len()).unwrap();
    (config.n_embd, config.block_size, config.batch_size) = (16, 8, 2);
    let options = TrainOptions::new(config.clone(), Preset::Mixed16, 1);
    let mut t = Trainer::new(&mantissa::backend::Reference, &corpus, options).unwrap();
    t.step().block_on().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ck.safetensors");
    Checkpoint::save(&mut t, &path).block_on().unwrap();
    (std::fs::read(&path).unwrap(), config, corpus.vocab.clone())
}

#[test]
fn checkpoint_loader_takes_any_bytes() {
    let (valid, config, vocab) = checkpoint_bytes();
    let header = 8 + u64::from_le_bytes(valid[..8].try_into().unwrap()) as usize;
    let path = Path::new("fuzz.safetensors");
    Checkpoint::from_bytes(&valid, path, &config, &vocab).expect("the unedited file loads");
    let seed = valid.clone();
    fuzz(
        "checkpoint",
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..512),
            edits(header).prop_map(move |e| apply(&seed, &e)),
        ],
        |bytes| {
            if let Ok(ck) = Checkpoint::from_bytes(&bytes, path, &config, &vocab) {
                // Accepted: the tensor bytes are the file's own (the checksum held), and every
                // value is one a run can continue from.
                let all = ck.params.iter().chain(&ck.adam_m).chain(&ck.adam_v);
                prop_assert!(all.flatten().all(|x| x.is_finite()));
                prop_assert!(ck.adam_v.iter().flatten().all(|&x| x >= 0.0));
                prop_assert!(ck.meta.loss_scale.is_none_or(|s| s.is_finite() && s > 0.0));
                prop_assert_eq!(&bytes[header..], &valid[header..]);
            }
            Ok(())
        },
    );
}

/// Printable-ish strings near the valid names: valid names with edits, and arbitrary text.
fn names(valid: Vec<&'static str>) -> impl Strategy<Value = String> {
    let near = (prop::sample::select(valid), edits(0))
        .prop_map(|(name, e)| String::from_utf8_lossy(&apply(name.as_bytes(), &e)).into_owned());
    prop_oneof![near, any::<String>(), "[a-z0-9:=,.+-]{0,24}"]
}

/// Parsing never panics, and a name that parses prints back as a name of the same thing.
fn round_trip<T>(s: &str) -> Result<(), TestCaseError>
where
    T: std::str::FromStr + std::fmt::Display + PartialEq + std::fmt::Debug,
    T::Err: std::fmt::Display,
{
    if let Ok(v) = s.parse::<T>() {
        let again = v.to_string().parse::<T>();
        prop_assert!(again.as_ref().is_ok_and(|a| *a == v), "'{s}' -> {v}");
    }
    Ok(())
}

#[test]
fn name_parsers_take_any_text() {
    let valid = vec![
        "f32",
        "tf32",
        "bf16",
        "f16",
        "bf16x3",
        "bf16x6",
        "bf16x9",
        "e4m3",
        "e5m2",
        "e4m3-e5m2:rowwise",
        "e5m2:given=0.5,2",
        "e4m3:tensorwise",
        "32-true",
        "16-mixed",
        "bf16-mixed",
        "transformer-engine",
        "highest",
        "medium",
        "float8_e4m3fn",
        "auto",
        "reference",
        "wgpu",
        "cuda",
    ];
    fuzz("names", names(valid), |s| {
        round_trip::<Algorithm>(&s)?;
        round_trip::<Format>(&s)?;
        round_trip::<Preset>(&s)?;
        round_trip::<PrecisionClass>(&s)?;
        let _ = s.parse::<BackendChoice>();
        Ok(())
    });
}

/// A reader that hands out its bytes in reads of the given sizes (then the rest), as pipes do.
struct Chunked<'a> {
    bytes: &'a [u8],
    sizes: std::vec::IntoIter<usize>,
}

impl Read for Chunked<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let want = self.sizes.next().unwrap_or(usize::MAX).min(buf.len());
        let n = want.min(self.bytes.len());
        buf[..n].copy_from_slice(&self.bytes[..n]);
        self.bytes = &self.bytes[n..];
        Ok(n)
    }
}

#[test]
fn raw_casts_take_any_bytes_in_any_reads() {
    let formats = prop::sample::select(Format::ALL.to_vec());
    let overflow = prop::sample::select(vec![Overflow::Saturate, Overflow::Standard]);
    let input = (
        formats.clone(),
        formats,
        overflow,
        proptest::collection::vec(any::<u8>(), 0..300),
        proptest::collection::vec(1..9usize, 0..40),
    );
    fuzz("raw-cast", input, |(from, to, overflow, bytes, sizes)| {
        let mut reader = Chunked {
            bytes: &bytes,
            sizes: sizes.into_iter(),
        };
        let mut out = Vec::new();
        let result = mantissa::format::convert_raw(&mut reader, &mut out, from, to, overflow);
        let (a, b) = (from.storage_bytes(), to.storage_bytes());
        prop_assert_eq!(result.is_ok(), bytes.len() % a == 0, "{:?}", result.err());
        // Element by element, whatever the reads: decode from `from`, encode to `to`.
        let want: Vec<u8> = bytes
            .chunks_exact(a)
            .flat_map(|c| {
                let mut w = [0u8; 4];
                w[..a].copy_from_slice(c);
                let x = from.decode(u32::from_le_bytes(w));
                to.encode(x, overflow).to_le_bytes()[..b].to_vec()
            })
            .collect();
        prop_assert_eq!(out, want);
        Ok(())
    });
}
