//! The property and fuzz suite: every reader of outside input (the .npy reader, the checkpoint
//! loader, the algorithm, format, preset and backend names, the raw cast stream) run on
//! arbitrary and mutated input under proptest, and the library API (`ModelBuilder` and
//! `ModelTrainer` on the reference) under random programs. The properties: no panic, no abort,
//! and what is accepted is consistent (shapes that fit the file, finite checkpoint state, names
//! that print back as themselves, raw casts equal to element-by-element conversion; a batch the
//! model cannot read refused, parameters finite, a non-finite loss never applied).
//!
//! Bounded in time: `MANTISSA_FUZZ_CASES` inputs per target (default 50000, a few seconds;
//! raise it for a long run). The number tried lands in target/tmp/fuzz.txt, which
//! scripts/test.sh sums in its summary line. A failing input is shrunk and its seed kept in tests/fuzz-regressions/, where
//! proptest replays it first on every later run (commit the file: it is the regression test).

mod common;

use mantissa::algorithm::{Algorithm, MatmulShape};
use mantissa::backend::BackendChoice;
use mantissa::cli::parse_list;
use mantissa::format::{Format, Overflow};
use mantissa::input::Input;
use mantissa::measure;
use mantissa::npy::{Matrix, read_matrix_from, read_matrix_input, write_matrix};
use mantissa::policy::{PrecisionClass, Preset};
use mantissa::train::checkpoint::{CheckpointFile, Expected};
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
    fuzz_scaled(target, 1, strategy, test)
}

/// `fuzz` with one input in `per` of the count: for targets whose inputs cost a product or a
/// file each.
fn fuzz_scaled<S: Strategy>(
    target: &str,
    per: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S::Value: std::fmt::Debug,
{
    let cases: u32 = std::env::var("MANTISSA_FUZZ_CASES")
        .ok()
        .and_then(|c| c.parse::<u32>().ok())
        .unwrap_or(50_000)
        .div_ceil(per);
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

/// An .npy header written by hand: any shape (huge ones too), any dtype, either order, keys in
/// single or double quotes, a 'shape' given twice (the reader takes the last), followed by
/// `data` bytes.
fn forged_npy() -> impl Strategy<Value = Vec<u8>> {
    let dim = || prop_oneof![0..8u64, any::<u64>(), (0..64u32).prop_map(|s| 1u64 << s)];
    let descr = prop::sample::select(vec!["<f4", ">f4", "<f8", "<i4", "|u1", "<f2", "zz"]);
    (
        proptest::collection::vec(dim(), 0..4),
        descr,
        any::<bool>(),
        proptest::collection::vec(any::<u8>(), 0..256),
        any::<bool>(),
        prop::option::of(proptest::collection::vec(dim(), 0..4)),
    )
        .prop_map(|(dims, descr, fortran, data, double, before)| {
            let shape = |dims: &[u64]| match dims.len() {
                1 => format!("({},)", dims[0]),
                _ => format!(
                    "({})",
                    dims.iter()
                        .map(u64::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            let q = if double { '"' } else { '\'' };
            let earlier = before.map_or(String::new(), |b| format!("{q}shape{q}: {}, ", shape(&b)));
            let mut header = format!(
                "{{{q}descr{q}: {q}{descr}{q}, {earlier}{q}fortran_order{q}: {}, {q}shape{q}: {}, }}",
                if fortran { "True" } else { "False" },
                shape(&dims)
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
/// and fits in the file; read as a stream of unknown length (standard input), the same
/// verdict, header first.
fn check_npy(bytes: &[u8]) -> Result<(), TestCaseError> {
    let len = bytes.len() as u64;
    let file = read_matrix_from(Cursor::new(bytes), Some(len), Path::new("fuzz.npy"));
    if let Ok(m) = &file {
        prop_assert_eq!(Some(m.data.len()), m.rows.checked_mul(m.cols));
        prop_assert!(m.data.len() as u64 * 4 <= len);
    }
    let stream = read_matrix_input(Input::from_reader(Cursor::new(bytes.to_vec()), "-"));
    // The same matrix to the bit: a NaN read from both is the same NaN (`==` would call them
    // different: a fuzzed file holding a signalling NaN failed so).
    let bits = |m: &Matrix| {
        let data: Vec<u32> = m.data.iter().map(|x| x.to_bits()).collect();
        (m.rows, m.cols, data)
    };
    if let Ok(m) = &stream {
        prop_assert!(
            file.as_ref().is_ok_and(|f| bits(f) == bits(m)),
            "a stream read what the file did not"
        );
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
fn checkpoint_bytes() -> (Vec<u8>, GptConfig, mantissa::train::Vocab) {
    let corpus = Corpus::from_text(&"To be, or not to be: that is the question.\n".repeat(40))
        .expect("corpus");
    let mut config = GptConfig::named("tiny", corpus.vocab.len()).unwrap();
    (config.n_embd, config.block_size, config.batch_size) = (16, 8, 2);
    let options = TrainOptions::new(config.clone(), Preset::Mixed16, 1);
    let mut t = Trainer::new(&mantissa::backend::Reference, &corpus, options).unwrap();
    t.step().block_on().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ck.safetensors");
    t.save(&path).block_on().unwrap();
    (std::fs::read(&path).unwrap(), config, corpus.vocab.clone())
}

#[test]
fn checkpoint_loader_takes_any_bytes() {
    let (valid, config, vocab) = checkpoint_bytes();
    let header = 8 + u64::from_le_bytes(valid[..8].try_into().unwrap()) as usize;
    let path = Path::new("fuzz.safetensors");
    Checkpoint::from_bytes(&valid, path, &Expected::gpt(&config, &vocab))
        .expect("the unedited file loads");
    let seed = valid.clone();
    fuzz(
        "checkpoint",
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..512),
            edits(header).prop_map(move |e| apply(&seed, &e)),
        ],
        |bytes| {
            if let Ok(ck) = Checkpoint::from_bytes(&bytes, path, &Expected::gpt(&config, &vocab)) {
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
        "e5m2:given=0.5/2",
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
        // As a list: nothing empty, nothing twice, and what parses prints back as itself.
        if let Ok(list) = parse_list::<Algorithm>("--algorithms", &s) {
            prop_assert!(!list.is_empty());
            let printed: Vec<String> = list.iter().map(Algorithm::to_string).collect();
            let again = parse_list::<Algorithm>("--algorithms", &printed.join(","));
            prop_assert!(again.as_ref().is_ok_and(|a| *a == list), "'{}'", s);
        }
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

/// Checkpoint files that declare anything (a header length up to 2^64, tensors of any size and
/// offsets) over a few bytes that are there: refused before the declared sizes are read or
/// allocated, or read whole when the file is exactly what its header says and the model takes.
/// Special files are refused before they are opened for reading.
#[test]
fn checkpoint_files_declaring_any_size_are_read_header_first() {
    let (valid, config, vocab) = checkpoint_bytes();
    let dir = tempfile::tempdir().unwrap();
    for special in ["/dev/zero", "/dev/null", "/dev/urandom"] {
        let e = CheckpointFile::open(Path::new(special))
            .err()
            .expect("refused");
        assert!(e.to_string().contains("device"), "{e}");
    }
    assert!(CheckpointFile::open(dir.path()).is_err());
    let path = dir.path().join("ck.safetensors");
    let size = prop_oneof![0..4096u64, any::<u64>(), (0..64u32).prop_map(|s| 1u64 << s)];
    let declared = (size.clone(), size.clone(), size, proptest::collection::vec(any::<u8>(), 0..64))
        .prop_map(|(n, shape, end, tail)| {
            let header = format!(
                r#"{{"__metadata__":{{"mantissa":"{{}}"}},"param.wte":{{"dtype":"F32","shape":[{shape}],"data_offsets":[0,{end}]}}}}"#
            );
            let n = if n % 2 == 0 { header.len() as u64 } else { n };
            let mut bytes = n.to_le_bytes().to_vec();
            bytes.extend(header.as_bytes());
            bytes.extend(tail);
            bytes
        });
    fuzz_scaled(
        "checkpoint-file",
        25,
        prop_oneof![declared, edits(256).prop_map(move |e| apply(&valid, &e))],
        |bytes| {
            std::fs::write(&path, &bytes).unwrap();
            if let Ok(read) =
                CheckpointFile::open(&path).and_then(|f| f.read(&Expected::gpt(&config, &vocab)))
            {
                prop_assert_eq!(read, bytes);
            }
            Ok(())
        },
    );
}

/// Inputs of the long-sum property: N(0,1) or wide-range, or constants (one value, repeated:
/// their roundings add up coherently).
fn long_sum_inputs(k: usize, family: u8, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let n = 4 * k;
    match family % 3 {
        0 => (measure::normal(n, seed), measure::normal(n, seed + 1)),
        1 => (
            measure::wide_range(n, seed),
            measure::wide_range(n, seed + 1),
        ),
        _ => {
            let v = measure::uniform(2, 0.01, 100.0, seed);
            (vec![v[0]; n], vec![v[1]; n])
        }
    }
}

/// Long sums against their band: a 4x4 product that stops at a fraction of K (1/2 to 15/16
/// kept) is outside it for every algorithm on inputs of random sign; an honest f32 sum of the
/// algorithms that round their inputs once, in 1 to 8 accumulators, is inside it on every input.
#[test]
fn long_sums_missing_terms_are_seen_and_honest_ones_are_not() {
    let algorithms = prop::sample::select(mantissa::report::ReportConfig::default_algorithms());
    let input = (
        algorithms,
        1000..20_000usize,
        8..16usize,
        0..3u8,
        1..9usize,
        any::<u64>(),
    );
    fuzz_scaled(
        "long-sums",
        500,
        input,
        |(alg, k, sixteenths, family, lanes, seed)| {
            let shape = MatmulShape::new(4, 4, k);
            let (a, b) = long_sum_inputs(k, family, seed);
            let reference = mantissa::backend::reference::matmul;
            let want = reference(&shape, &alg, &a, &b).unwrap();
            if family % 3 != 2 {
                let kept = k * sixteenths / 16;
                let a_kept: Vec<f32> = (0..4 * kept)
                    .map(|e| a[(e / kept) * k + e % kept])
                    .collect();
                let short = MatmulShape::new(4, 4, kept);
                let got = reference(&short, &alg, &a_kept, &b[..kept * 4]).unwrap();
                let check = measure::check_product(&alg, &shape, (&a, &b), &got, &want).unwrap();
                let nothing_finite = want.iter().all(|w| !w.is_finite());
                prop_assert!(
                    nothing_finite || !check.whole.holds(),
                    "{alg}: {kept} of {k} terms not seen: {}",
                    check.whole
                );
            }
            if alg.split_levels() == 0 && !alg.is_fp8() {
                let (fa, fb) = alg.operand_formats();
                let got: Vec<f32> = (0..16)
                    .map(|e| {
                        let (i, j) = (e / 4, e % 4);
                        let mut acc = vec![0f32; lanes];
                        for p in 0..k {
                            let x = fa.round(a[i * k + p], Overflow::Standard);
                            let y = fb.round(b[p * 4 + j], Overflow::Standard);
                            acc[p % lanes] = x.mul_add(y, acc[p % lanes]);
                        }
                        acc.iter().sum()
                    })
                    .collect();
                let check = measure::check_product(&alg, &shape, (&a, &b), &got, &want).unwrap();
                prop_assert!(
                    check.holds(),
                    "{alg} honest in {lanes} lanes: {:?}",
                    check.findings()
                );
            }
            Ok(())
        },
    );
}

/// A random program against the library API: a model written from a few declared values and
/// up to six ops picked at random (any operands, any shapes, NaN and huge settings among
/// them), built, and if it builds trained on the reference by a random sequence of calls
/// (values, parameters, steps, losses, gradients, settings), each with well-formed or broken
/// arguments.
#[derive(Clone, Debug)]
struct Program {
    /// Rows, width, vocabulary.
    dims: (usize, usize, usize),
    /// Each declared parameter's initialisation (zeros, ones, std 0.5, 1e6, NaN, inf, -1).
    inits: [u8; 4],
    /// (op, first operand, second, third, its setting).
    ops: Vec<(u8, u8, u8, u8, u8)>,
    /// Cross entropy (else mse), and the operand of the loss.
    loss: (bool, u8),
    /// Preset, attention fused, unfused or left to the backend, and whether every values input
    /// is written before the calls.
    run: (u8, u8, bool),
    /// (call, its argument's form, a setting).
    calls: Vec<(u8, u8, u8)>,
}

fn program() -> impl Strategy<Value = Program> {
    let op = (0..29u8, any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>());
    (
        (1..4usize, 1..5usize, 1..6usize),
        [0..16u8, 0..16u8, 0..16u8, 0..16u8],
        proptest::collection::vec(op, 0..7),
        (any::<bool>(), any::<u8>()),
        (0..5u8, 0..3u8, any::<bool>()),
        proptest::collection::vec((0..12u8, 0..6u8, any::<u8>()), 0..12),
    )
        .prop_map(|(dims, inits, ops, loss, run, calls)| Program {
            dims,
            inits,
            ops,
            loss,
            run,
            calls,
        })
}

/// Builds the program's model: an error where the builder refuses it, as it must, by name.
fn build_model(p: &Program) -> mantissa::Result<mantissa::model::Model> {
    use mantissa::model::{Init, ModelBuilder};
    let (r, c, v) = p.dims;
    let init = |i: u8| match i {
        0 => Init::Zeros,
        1 => Init::Ones,
        12 => Init::Normal { std: 1e6 },
        13 => Init::Normal { std: f32::NAN },
        14 => Init::Normal { std: f32::INFINITY },
        15 => Init::Normal { std: -1.0 },
        _ => Init::Normal { std: 0.5 },
    };
    let mut m = ModelBuilder::new();
    let tokens = m.tokens(&[r])?;
    let targets = m.targets(&[r])?;
    let x = m.values(&[r, c])?;
    let y = m.values(&[r, c])?;
    let table = m.param("table", &[v, c], init(p.inits[0]), true)?;
    let w = m.param("w", &[c, c], init(p.inits[1]), true)?;
    let b = m.param("b", &[c], init(p.inits[2]), false)?;
    let g = m.param("g", &[c], init(p.inits[3]), false)?;
    let head = m.param("head", &[c, v], Init::Normal { std: 0.5 }, true)?;
    // A path through every parameter, so that a model may build: the random ops add to it.
    let embedded = m.embedding(table, tokens)?;
    let normed = m.layer_norm(embedded, g, b)?;
    let base = m.linear(normed, w, b)?;
    let mut vars = vec![tokens, targets, x, y, table, w, b, g, head, embedded, base];
    for &(op, i, j, k, s) in &p.ops {
        let pick = |n: u8| vars[n as usize % vars.len()];
        let (a, bb, cc) = (pick(i), pick(j), pick(k));
        let made = match op {
            0 => m.linear(a, bb, cc),
            1 => m.matmul(a, bb, s % 2 == 1),
            2 => m.layer_norm(a, bb, cc),
            3 => m.rms_norm(a, bb, [1e-5, 0.0, -1.0, f32::NAN][s as usize % 4]),
            4 => m.gelu(a),
            5 => m.silu(a),
            6 => m.add(a, bb),
            7 => m.mul(a, bb),
            8 => m.causal_attention(a, [1, 2, 3, 0, usize::MAX][s as usize % 5]),
            9 => m.causal_softmax(a, [1.0, 0.5, -2.0, 1e300, f64::NAN][s as usize % 5]),
            10 => m.reshape(a, &[[r * c, 1], [1, r * c], [r, c], [c, r]][s as usize % 4]),
            11 => m.embedding(a, bb),
            12 => m.reshape(a, &[1, r, c]),
            13 => m.constant_ids(&[r], (0..r as u32).map(|i| i * s as u32).collect()),
            14 => m.add(a, a),
            15 => m.relu(a),
            16 => m.tanh(a),
            17 => m.sigmoid(a),
            18 => m.bmm(a, bb, s % 2 == 1),
            19 => m.transpose(a),
            20 => m.concat(&[a, bb, cc][..1 + s as usize % 3]),
            21 => m.softmax(a),
            22 => m.sum(a),
            23 => m.mean(a),
            24 => m.scale(a, [2.0, -0.5, 0.0, 1e39, f64::NAN][s as usize % 5]),
            25 => m.sub(a, bb),
            26 => m.dropout(a, [0.1, 0.0, 0.99, 1.0, -0.5, f64::NAN][s as usize % 6]),
            27 => m.attention(a, [1, 2, 3, 0, usize::MAX][s as usize % 5]),
            _ => m.matmul(a, head, false),
        };
        // A refused op leaves the builder as it was; the program goes on.
        if let Ok(var) = made {
            vars.push(var);
        }
    }
    let last = vars[p.loss.1 as usize % vars.len()];
    let out = m.add(base, last).unwrap_or(base);
    let logits = m.matmul(out, head, false)?;
    let loss = match p.loss.0 {
        true => m.cross_entropy(logits, targets)?,
        false => {
            let back = m.matmul(logits, head, true)?;
            m.mse(back, y)?
        }
    };
    m.finish(loss)
}

/// The API's contract on a program: no panic and no abort; every refusal bad input (or a
/// step diverged without loss scaling); a step's loss finite unless the step was skipped
/// (nothing applied); a refused `set_params` changes nothing; the parameters finite after
/// every call.
fn run_program(p: &Program) -> Result<(), TestCaseError> {
    use mantissa::model::ModelTrainer;
    use mantissa::policy::precision::PrecisionRequest;
    let bad_input = |e: &mantissa::Error| e.class() == mantissa::error::ErrorClass::BadInput;
    let model = match build_model(p) {
        Ok(model) => model,
        Err(e) => {
            prop_assert!(bad_input(&e), "{e}");
            return Ok(());
        }
    };
    let preset = [
        Preset::True32,
        Preset::MixedBf16,
        Preset::Mixed16,
        Preset::TrueBf16,
        Preset::True16,
    ][p.run.0 as usize];
    let request = PrecisionRequest::of(preset);
    let fused = [None, Some(true), Some(false)][p.run.1 as usize];
    let backend = mantissa::backend::Reference;
    let mut t = match ModelTrainer::new(&backend, model, &request, fused, 7) {
        Ok(t) => t,
        Err(e) => {
            prop_assert!(bad_input(&e), "{e}");
            return Ok(());
        }
    };
    let (r, _, v) = p.dims;
    let shapes = t.model.values_inputs();
    let written = |k: usize| -> Vec<f32> {
        let len: usize = shapes[k].iter().product();
        (0..len).map(|i| (i as f32 * 0.37).sin()).collect()
    };
    let mut set = vec![false; shapes.len()];
    if p.run.2 {
        for (k, set) in set.iter_mut().enumerate() {
            t.set_values(k, &written(k)).block_on().unwrap();
            *set = true;
        }
    }
    // Whether a run of (ids form, targets form) must be refused: ids the model reads but not
    // given or not fitting, targets likewise, targets given to a model that reads none, or a
    // values input it reads never written (each trained on zeros, once).
    let reads_targets = t.model.reads_targets();
    let reads_values: Vec<bool> = (0..shapes.len()).map(|k| t.model.reads_values(k)).collect();
    let must_refuse = |ids: u8, targets: u8, set: &[bool]| {
        ids >= 4
            || (reads_targets && targets >= 4)
            || (!reads_targets && targets != 4)
            || (0..set.len()).any(|k| !set[k] && reads_values[k])
    };
    // Ids of forms 0 to 3 fit the model; 4 is none, 5 too many, out of range or u32::MAX.
    let ids = |form: u8, seed: u8| -> Vec<u32> {
        match (form, seed % 3) {
            (0..=3, _) => (0..r as u32)
                .map(|i| (i + seed as u32) % v as u32)
                .collect(),
            (4, _) => vec![],
            (_, 0) => vec![0; r + 1],
            (_, 1) => vec![v as u32; r],
            _ => vec![u32::MAX; r],
        }
    };
    for &(call, form, s) in &p.calls {
        let result: mantissa::Result<()> = match call {
            0..=2 => {
                let k = if s == 255 {
                    99
                } else {
                    s as usize % shapes.len().max(1)
                };
                let mut values = if k < shapes.len() {
                    written(k)
                } else {
                    vec![1.0]
                };
                match form {
                    4 => values.push(0.0),
                    5 => values[0] = f32::NAN,
                    _ => {}
                }
                let written = t.set_values(k, &values).block_on();
                if written.is_ok() {
                    set[k] = true;
                }
                written
            }
            3 => {
                let before = t.params().block_on().unwrap();
                let mut given: Vec<Vec<f32>> = before.iter().map(|p| vec![0.25; p.len()]).collect();
                match form {
                    1 => drop(given.pop()),
                    2 => given.last_mut().unwrap().push(1.0),
                    3 => given.last_mut().unwrap()[0] = f32::NAN,
                    4 => given.last_mut().unwrap()[0] = 1e30,
                    _ => {}
                }
                let set = t.set_params(&given).block_on();
                if set.is_err() {
                    prop_assert!(
                        t.params().block_on().unwrap() == before,
                        "a refused call wrote"
                    );
                }
                set
            }
            4..=7 => {
                let applied = t.applied;
                let refuse = must_refuse(form, s % 6, &set);
                let stepped = t.step(&ids(form, s), &ids(s % 6, s)).block_on();
                prop_assert!(!refuse || stepped.is_err(), "ran: {stepped:?}");
                if let Ok(stepped) = &stepped {
                    prop_assert!(
                        stepped.loss.is_finite() || stepped.skipped,
                        "a non-finite loss applied: {stepped:?}"
                    );
                    prop_assert_eq!(t.applied, applied + u32::from(!stepped.skipped));
                } else {
                    prop_assert_eq!(t.applied, applied, "a refused or diverged step applied");
                }
                stepped.map(drop)
            }
            8 | 9 => {
                let refuse = must_refuse(form, s % 6, &set);
                let (ids, targets) = (ids(form, s), ids(s % 6, s));
                let ran = match call {
                    8 => t.loss(&ids, &targets).block_on().map(drop),
                    _ => t.gradients(&ids, &targets).block_on().map(drop),
                };
                prop_assert!(!refuse || ran.is_err(), "call {call} ran");
                ran
            }
            10 => {
                t.adamw.lr = [1e-3, 0.1, f32::NAN, f32::INFINITY, -1.0, 0.0][form as usize];
                Ok(())
            }
            _ => {
                t.grad_clip = [0.0, 1.0, -1.0, f32::NAN, f32::INFINITY, 1e-3][form as usize];
                Ok(())
            }
        };
        if let Err(e) = &result {
            // A step whose gradients are not finite without loss scaling diverged: nothing
            // applied (`ModelTrainer::step`).
            let diverged = matches!(e, mantissa::Error::Diverged { .. }) && (4..=7).contains(&call);
            prop_assert!(bad_input(e) || diverged, "call {call} form {form}: {e}");
        }
        let params = t.params().block_on().unwrap();
        prop_assert!(
            params.iter().flatten().all(|x| x.is_finite()),
            "call {call} form {form} left a parameter non-finite"
        );
    }
    Ok(())
}

#[test]
fn model_api_takes_any_program() {
    fuzz_scaled("model_api", 20, program(), |p| run_program(&p));
}
