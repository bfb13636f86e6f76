//! The `mantissa` tool as a user runs it: output, files, exit codes, and nothing written on bad
//! input.

mod common;

use mantissa::format::{Format, Overflow};
use mantissa::measure;
use mantissa::npy::{Matrix, read_matrix, write_matrix};
use npyz::WriterBuilder;
use std::path::Path;
use std::process::{Command, Output, Stdio};

fn mantissa(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mantissa"))
        .args(args)
        .env("XDG_RUNTIME_DIR", "/tmp")
        .output()
        .expect("run mantissa")
}

/// The train.json `mantissa train` wrote into `dir`.
fn train_log(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("train.json")).unwrap()).unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn finfo_prints_torch_constants() {
    let o = mantissa(&["finfo"]);
    assert!(o.status.success(), "{}", text(&o));
    let out = text(&o);
    for needle in [
        "448",
        "0.015625",
        "0.125",
        "57344",
        "6.10352e-05",
        "3.38953e+38",
        "0.000976562",
        "1.19209e-07",
    ] {
        assert!(out.contains(needle), "finfo lacks {needle}:\n{out}");
    }
    let o = mantissa(&["finfo", "e4m3", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(v[0]["max"], 448.0);
}

#[test]
fn cast_shows_why_3141_and_31415_share_an_f16() {
    let o = mantissa(&["cast", "3.141", "3.1415", "3.142", "--to", "f16"]);
    assert!(o.status.success(), "{}", text(&o));
    let out = text(&o);
    let lines: Vec<&str> = out.lines().filter(|l| l.starts_with("3.14")).collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(
        lines[0].contains("0x4248") && lines[1].contains("0x4248") && lines[2].contains("0x4249"),
        "{out}"
    );
    assert!(lines[0].contains("0 | 10000 | 1001001000"), "{out}");
}

#[test]
fn bad_names_exit_2_with_the_valid_ones() {
    let o = mantissa(&["cast", "1.0", "--to", "fp12"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).contains("unknown format 'fp12'") && text(&o).contains("e5m2"),
        "{}",
        text(&o)
    );
    let o = mantissa(&["finfo", "float7"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn raw_cast_streams_and_checks_lengths() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("x.f32");
    let values = measure::wide_range(100_003, 5);
    std::fs::write(&input, bytemuck::cast_slice::<f32, u8>(&values)).unwrap();
    let output = dir.path().join("x.bf16");
    let o = mantissa(&[
        "cast",
        "--raw",
        "--from",
        "f32",
        "--to",
        "bf16",
        "-i",
        input.to_str().unwrap(),
        "-o",
        output.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let got = std::fs::read(&output).unwrap();
    assert_eq!(got.len(), values.len() * 2);
    for (i, v) in values.iter().enumerate() {
        let code = u16::from_le_bytes([got[2 * i], got[2 * i + 1]]) as u32;
        assert_eq!(
            code,
            Format::Bf16.encode(*v, Overflow::Standard),
            "value {i}"
        );
    }
    // Through standard input, saturating to e4m3.
    let mut child = Command::new(env!("CARGO_BIN_EXE_mantissa"))
        .args([
            "cast",
            "--raw",
            "--from",
            "f32",
            "--to",
            "e4m3",
            "--saturate",
        ])
        .stdin(Stdio::from(std::fs::File::open(&input).unwrap()))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = Vec::new();
    std::io::Read::read_to_end(child.stdout.as_mut().unwrap(), &mut out).unwrap();
    assert!(child.wait().unwrap().success());
    assert_eq!(out.len(), values.len());
    assert!(
        out.iter()
            .zip(&values)
            .all(|(&c, &v)| c as u32 == Format::E4m3.encode(v, Overflow::Saturate))
    );
    // A length that is not a multiple of the element size: exit 2, nothing written.
    let odd = dir.path().join("odd.bin");
    std::fs::write(&odd, [0u8; 7]).unwrap();
    let dest = dir.path().join("never.bf16");
    let o = mantissa(&[
        "cast",
        "--raw",
        "--from",
        "f32",
        "--to",
        "bf16",
        "-i",
        odd.to_str().unwrap(),
        "-o",
        dest.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("not a multiple of the element size 4"),
        "{}",
        text(&o)
    );
    assert!(!dest.exists());
}

fn write_fortran(path: &Path, rows: usize, cols: usize, row_major: &[f32]) {
    let mut f = std::fs::File::create(path).unwrap();
    let mut w = npyz::WriteOptions::<f32>::new()
        .default_dtype()
        .order(npyz::Order::Fortran)
        .shape(&[rows as u64, cols as u64])
        .writer(&mut f)
        .begin_nd()
        .unwrap();
    for j in 0..cols {
        for i in 0..rows {
            w.push(&row_major[i * cols + j]).unwrap();
        }
    }
    w.finish().unwrap();
}

#[test]
fn matmul_reads_c_and_fortran_order_and_checks() {
    let dir = tempfile::tempdir().unwrap();
    let (m, k, n) = (7, 13, 5);
    let a = measure::normal(m * k, 1);
    let b = measure::normal(k * n, 2);
    let pa = dir.path().join("a.npy");
    let pb = dir.path().join("b.npy");
    let pc = dir.path().join("c.npy");
    write_matrix(&pa, &Matrix::new(m, k, a.clone()).unwrap()).unwrap();
    write_fortran(&pb, k, n, &b);
    let o = mantissa(&[
        "matmul",
        pa.to_str().unwrap(),
        pb.to_str().unwrap(),
        "--algorithm",
        "bf16x3",
        "--backend",
        "reference",
        "--check",
        "-o",
        pc.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("7x13 . 13x5 -> 7x5") && text(&o).contains("contract: OK"),
        "{}",
        text(&o)
    );
    let c = read_matrix(&pc).unwrap();
    assert_eq!((c.rows, c.cols), (m, n));
    // Independent check: the f64 product of the inputs, to bf16x3's accuracy.
    let exact = measure::exact_product(&mantissa::MatmulShape::new(m, n, k), &a, &b);
    assert!(measure::relative_error(&c.data, &exact) < 3e-5);
}

/// A float32 .npy (format 1.0) with `shape` in its header and `data` zero bytes after it.
fn npy_with_header(shape: &str, data: usize) -> Vec<u8> {
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend((header.len() as u16).to_le_bytes());
    bytes.extend(header.as_bytes());
    bytes.extend(vec![0u8; data]);
    bytes
}

#[test]
fn matmul_bad_input_exits_2_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    write_matrix(
        Path::new(&p("a.npy")),
        &Matrix::new(2, 3, vec![1.0; 6]).unwrap(),
    )
    .unwrap();
    write_matrix(
        Path::new(&p("b.npy")),
        &Matrix::new(4, 2, vec![1.0; 8]).unwrap(),
    )
    .unwrap();
    npyz::to_file_1d(p("v.npy"), vec![1.0f32, 2.0]).unwrap();
    {
        let mut f = std::fs::File::create(p("d.npy")).unwrap();
        let mut w = npyz::WriteOptions::<f64>::new()
            .default_dtype()
            .shape(&[2, 2])
            .writer(&mut f)
            .begin_nd()
            .unwrap();
        w.extend([1.0f64; 4]).unwrap();
        w.finish().unwrap();
    }
    let full = std::fs::read(p("a.npy")).unwrap();
    std::fs::write(p("t.npy"), &full[..full.len() - 5]).unwrap();
    std::fs::write(p("junk.npy"), b"not numpy at all").unwrap();
    // Headers that claim more than the file holds: refused before anything is allocated,
    // including a shape whose product wraps 64 bits (once read as 0 values and "contract: OK").
    std::fs::write(
        p("huge.npy"),
        npy_with_header("(4611686018427387904, 4)", 24),
    )
    .unwrap();
    std::fs::write(p("big.npy"), npy_with_header("(100000, 100000)", 24)).unwrap();
    let cases = [
        ("huge.npy", "b.npy", "more than the file"),
        ("big.npy", "b.npy", "more than the file"),
        ("a.npy", "b.npy", "do not match"),
        ("a.npy", "v.npy", "2-D"),
        ("d.npy", "b.npy", "float32"),
        ("t.npy", "b.npy", "truncated"),
        ("junk.npy", "b.npy", "not a valid .npy"),
        ("missing.npy", "b.npy", "missing.npy"),
    ];
    for (a, b, needle) in cases {
        let out = p("c.npy");
        let o = mantissa(&["matmul", &p(a), &p(b), "--backend", "reference", "-o", &out]);
        assert_eq!(o.status.code(), Some(2), "{a} x {b}: {}", text(&o));
        let msg = text(&o);
        assert!(
            msg.contains(needle),
            "{a} x {b}: expected '{needle}' in: {msg}"
        );
        assert_eq!(msg.lines().count(), 1, "one-line error: {msg}");
        assert!(!Path::new(&out).exists(), "{a} x {b} wrote an output");
    }
    let o = mantissa(&["matmul", &p("a.npy"), &p("a.npy"), "--algorithm", "bf17"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("bf16x9"));
}

#[test]
fn bench_writes_json() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let o = mantissa(&[
        "bench",
        "matmul",
        "--sizes",
        "9,4x5x6",
        "--algorithms",
        "f32,e4m3:rowwise",
        "--backends",
        "reference",
        "--reps",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let records = v.as_array().unwrap();
    assert_eq!(records.len(), 4);
    assert_eq!(records[1]["algorithm"], "e4m3:rowwise");
    assert_eq!(records[1]["bytes_per_element_a"], 1);
    assert_eq!(records[2]["m"], 4);
    assert!(records[0]["relative_error"].as_f64().unwrap() < 1e-6);
}

#[test]
fn info_lists_backends() {
    let o = mantissa(&["info"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("reference") && text(&o).contains("precision classes"),
        "{}",
        text(&o)
    );
}

/// Output files never damage what the tool was not asked to write: a device target is written
/// in place (run as root, a rename would replace /dev/null with a regular file), an input named
/// like an old temporary (`OUT.partial`) is read, not emptied or deleted, and an unrelated file
/// of that name beside the output survives.
#[cfg(unix)]
#[test]
fn outputs_replace_no_device_and_delete_no_neighbour() {
    use std::os::unix::fs::FileTypeExt;
    let dir = tempfile::tempdir().unwrap();
    let values = measure::normal(1000, 9);
    let bytes = bytemuck::cast_slice::<f32, u8>(&values).to_vec();
    let output = dir.path().join("x.bf16");
    let input = dir.path().join("x.partial");
    std::fs::write(&input, &bytes).unwrap();
    let neighbour = dir.path().join("x.bf16.partial");
    std::fs::write(&neighbour, "keep me").unwrap();
    let cast = |i: &Path, o: &Path| {
        mantissa(&[
            "cast",
            "--raw",
            "--from",
            "f32",
            "--to",
            "bf16",
            "-i",
            i.to_str().unwrap(),
            "-o",
            o.to_str().unwrap(),
        ])
    };
    let o = cast(&input, &output);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(std::fs::read(&input).unwrap(), bytes, "the input is intact");
    assert_eq!(std::fs::read(&output).unwrap().len(), 2000);
    assert_eq!(std::fs::read_to_string(&neighbour).unwrap(), "keep me");
    let names = std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(names, 3, "no temporary is left behind");
    let o = cast(&input, Path::new("/dev/null"));
    assert!(o.status.success(), "{}", text(&o));
    let null = std::fs::metadata("/dev/null").unwrap();
    assert!(
        null.file_type().is_char_device(),
        "/dev/null is still a device"
    );
}

/// Arguments are checked before anything is created, with one line naming the flag: exit 2,
/// never a panic or an abort.
#[test]
fn bad_arguments_exit_2_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("never");
    let out = out.to_str().unwrap();
    let short = dir.path().join("short.txt");
    std::fs::write(&short, "abcdefghij".repeat(20)).unwrap();
    let short = short.to_str().unwrap();
    let cases: [(&[&str], &str); 10] = [
        (
            &[
                "train", "--corpus", short, "--config", "small", "--steps", "1", "--out", out,
            ],
            "fewer than a context of 256",
        ),
        (
            &[
                "bench",
                "matmul",
                "--sizes",
                "0x4x4",
                "--backends",
                "reference",
            ],
            "--sizes",
        ),
        (
            &["bench", "matmul", "--sizes", ",", "--backends", "reference"],
            "--sizes",
        ),
        (
            &[
                "bench",
                "matmul",
                "--sizes",
                "99999999999",
                "--backends",
                "reference",
            ],
            "--sizes",
        ),
        (
            &[
                "report",
                "--backends",
                "reference",
                "--sizes",
                "4x0x4",
                "--out",
                out,
            ],
            "--sizes",
        ),
        (
            &["train", "--lr", "nan", "--steps", "1", "--out", out],
            "--lr",
        ),
        (&["train", "--lr=-1", "--steps", "1", "--out", out], "--lr"),
        (
            &[
                "train",
                "--eval-interval",
                "0",
                "--steps",
                "1",
                "--out",
                out,
            ],
            "--eval-interval",
        ),
        (
            &["sample", "--checkpoint", out, "--temperature", "nan"],
            "--temperature",
        ),
        (
            &["train", "--graphs", "maybe", "--steps", "1", "--out", out],
            "--graphs",
        ),
    ];
    for (args, flag) in cases {
        let o = mantissa(args);
        let msg = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {msg}");
        assert!(msg.contains(flag), "{args:?}: expected {flag} in {msg}");
        assert_eq!(msg.lines().count(), 1, "{args:?}: one line: {msg}");
    }
    assert!(!Path::new(out).exists(), "nothing was created");
}

/// `--graphs on` on the host interpreter replays a recording of each section from the second
/// step and trains the losses of `--graphs off`, bit for bit; wgpu, which records nothing,
/// refuses it before it writes anything.
#[test]
fn graphs_on_trains_as_off_and_wgpu_refuses_it() {
    let train = |backend: &str, graphs: &str, out: &Path| {
        mantissa(&[
            "train",
            "--config",
            "tiny",
            "--backend",
            backend,
            "--steps",
            "3",
            "--eval-batches",
            "1",
            "--precision",
            "16-mixed",
            "--graphs",
            graphs,
            "--out",
            out.to_str().unwrap(),
        ])
    };
    let losses = |dir: &Path| -> Vec<u64> {
        let log = train_log(dir);
        let steps = log[0]["steps"].as_array().unwrap().clone();
        steps
            .iter()
            .map(|s| s["loss"].as_f64().unwrap().to_bits())
            .collect()
    };
    let (on, off) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let o = train("reference", "on", on.path());
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("replayed as a recording from the second step"),
        "{}",
        text(&o)
    );
    let o = train("reference", "off", off.path());
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&o).contains("recording"), "{}", text(&o));
    assert_eq!(losses(on.path()).len(), 3);
    assert_eq!(losses(on.path()), losses(off.path()));
    common::on(
        common::wgpu(),
        "cli::graphs_on_trains_as_off_and_wgpu_refuses_it (wgpu)",
        |_| {
            let dir = tempfile::tempdir().unwrap();
            let out = dir.path().join("never");
            let o = train("wgpu", "on", &out);
            assert_eq!(o.status.code(), Some(2), "{}", text(&o));
            assert!(text(&o).contains("record sections"), "{}", text(&o));
            let written: Vec<_> = std::fs::read_dir(&out).map_or(vec![], |d| d.collect());
            assert!(written.is_empty(), "wrote {written:?}");
        },
    );
}

/// Exit codes that tell the truth about training: one preset that stops is a failed run (exit 4,
/// the step named, resumed steps counted); a comparison of presets is the result (exit 0, the
/// summary names the one that stopped).
#[test]
fn a_stopped_run_exits_4_naming_its_step() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().to_str().unwrap();
    let train = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--config",
            "tiny",
            "--backend",
            "reference",
            "--eval-interval",
            "100",
            "--out",
            out,
        ];
        args.extend_from_slice(extra);
        mantissa(&args)
    };
    let stopped_at = |o: &Output| -> u32 {
        let log = train_log(dir.path());
        let at = log[0]["stopped_at"]
            .as_u64()
            .unwrap_or_else(|| panic!("{}", text(o)));
        at as u32
    };
    // An absurd learning rate: the weights overflow and the loss goes non-finite.
    let wild = ["--precision", "32-true", "--lr", "1e30", "--steps", "20"];
    let o = train(&wild);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    let at = stopped_at(&o);
    assert!((1..20).contains(&at), "{}", text(&o));
    assert!(
        text(&o).contains(&format!("stopped at step {at}")),
        "{}",
        text(&o)
    );
    // Resumed after 3 good steps, the step counts from the run's start.
    let o = train(&["--precision", "32-true", "--steps", "3"]);
    assert!(o.status.success(), "{}", text(&o));
    let ck = dir.path().join("32-true.safetensors");
    let o = train(&[&wild[..], &["--resume", ck.to_str().unwrap()]].concat());
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    let resumed_at = stopped_at(&o);
    assert!(resumed_at > 3, "{}", text(&o));
    // Compared with a preset that absorbs it (16-mixed skips and lowers its scale): exit 0.
    let o = train(&[
        "--precision",
        "32-true,16-mixed",
        "--lr",
        "1e30",
        "--steps",
        "20",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        text(&o).contains("32-true: stopped at step"),
        "{}",
        text(&o)
    );
}

/// `WGPU_ADAPTER_NAME` that matches nothing says so and lists the adapters that exist.
#[test]
fn an_adapter_filter_that_matches_nothing_lists_the_adapters() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.npy");
    write_matrix(&a, &Matrix::new(2, 2, vec![1.0; 4]).unwrap()).unwrap();
    let a = a.to_str().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_mantissa"))
        .args(["matmul", a, a, "--backend", "wgpu"])
        .env("XDG_RUNTIME_DIR", "/tmp")
        .env("WGPU_ADAPTER_NAME", "no-such-adapter-anywhere")
        .output()
        .unwrap();
    let msg = text(&o);
    assert_ne!(o.status.code(), Some(0), "{msg}");
    let listed = mantissa(&["info"]);
    let any = !text(&listed).contains("wgpu found no adapter");
    if any {
        assert!(
            msg.contains("'no-such-adapter-anywhere' matches none of the adapters found: '"),
            "{msg}"
        );
    } else {
        assert!(msg.contains("found no adapter"), "{msg}");
    }
}

/// A training step takes little beyond its plan's tensors (temporaries sharing storage): the
/// reference counts its tensors in host memory under every preset, wgpu the device allocator's
/// report (lavapipe here) under two drawn by the seed (each preset's kernels compile for
/// seconds on lavapipe; all six with MANTISSA_TEST_EXHAUSTIVE=1), as train.json records them.
/// Unshared, the reference alone would hold 1.8x; matmul planes per op, wgpu more.
#[test]
fn a_training_step_takes_little_beyond_its_plan() {
    let all = [
        "32-true",
        "16-mixed",
        "bf16-mixed",
        "16-true",
        "bf16-true",
        "transformer-engine",
    ];
    let seed = common::seed("a_training_step_takes_little_beyond_its_plan");
    let check = |backend: &str, presets: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let o = mantissa(&[
            "train",
            "--config",
            "tiny",
            "--backend",
            backend,
            "--steps",
            "2",
            "--eval-batches",
            "1",
            "--precision",
            &presets.join(","),
            "--out",
            dir.path().to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", text(&o));
        let log = train_log(dir.path());
        let runs = log.as_array().unwrap();
        assert_eq!(runs.len(), presets.len());
        for run in runs {
            let m = &run["memory"];
            let plan = m["plan_bytes"].as_f64().unwrap();
            let peak = m["peak_bytes"].as_f64().unwrap();
            assert!(
                peak <= 1.1 * plan && peak >= 0.5 * plan,
                "{backend} {}: peak {peak} bytes, plan {plan} ({})",
                run["preset"],
                m["measured_by"]
            );
        }
        assert!(text(&o).contains("x the plan's tensors"), "{}", text(&o));
    };
    check("reference", &all);
    common::on(
        common::wgpu(),
        "cli::a_training_step_takes_little_beyond_its_plan (wgpu)",
        |_| check("wgpu", &common::sample(&all, 2, seed)),
    );
}

#[test]
fn a_plan_over_the_memory_limit_stops_before_allocating_and_names_a_batch_that_fits() {
    let check = |backend: &str| {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run");
        let train = |extra: &[&str]| {
            let mut args = vec![
                "train",
                "--config",
                "tiny",
                "--backend",
                backend,
                "--steps",
                "1",
                "--eval-batches",
                "1",
                "--out",
                out.to_str().unwrap(),
            ];
            args.extend_from_slice(extra);
            mantissa(&args)
        };
        // tiny's 32-true plan at its batch of 16 holds 6.9 MiB of tensors (7.5 before the cross
        // entropy's probabilities left it and temporaries were given slots largest first).
        let o = train(&["--memory-limit", "4MiB"]);
        assert_eq!(o.status.code(), Some(1), "{backend}: {}", text(&o));
        let said = text(&o);
        for part in [
            "needs 6.9 MiB",
            "batch of 16",
            "limit of 4.0 MiB",
            "try --batch 4",
        ] {
            assert!(said.contains(part), "{backend}: no '{part}' in: {said}");
        }
        let written: Vec<_> = std::fs::read_dir(&out).map_or(vec![], |d| d.collect());
        assert!(written.is_empty(), "{backend}: wrote {written:?}");
        // The batch it names fits, and trains; so does the batch of 16 in the micro-batches it
        // names (with their accumulators).
        for fitting in [&["--batch", "4"], &["--grad-accum", "4"]] {
            assert!(
                said.contains(&fitting.join(" ")),
                "{backend}: no {fitting:?} in: {said}"
            );
            let o = train(&[&["--memory-limit", "4MiB"][..], fitting].concat());
            assert!(o.status.success(), "{backend} {fitting:?}: {}", text(&o));
            let log = train_log(&out);
            let plan = log[0]["memory"]["plan_bytes"].as_u64().unwrap();
            assert!(plan <= 4 << 20, "{backend} {fitting:?}: {plan} bytes");
        }
        // Micro-batches that do not divide the batch: bad input, before anything is built.
        let o = train(&["--grad-accum", "3"]);
        assert_eq!(o.status.code(), Some(2), "{backend}: {}", text(&o));
        assert!(
            text(&o).contains("3 micro-batches do not divide a share of 16"),
            "{}",
            text(&o)
        );
    };
    check("reference");
    common::on(
        common::wgpu(),
        "cli::a_plan_over_the_memory_limit_stops_before_allocating (wgpu)",
        |_| check("wgpu"),
    );
    for (flag, value) in [
        ("--memory-limit", "12zz"),
        ("--memory-limit", "0"),
        ("--batch", "0"),
    ] {
        let o = mantissa(&[
            "train",
            "--config",
            "tiny",
            "--backend",
            "reference",
            flag,
            value,
        ]);
        assert_eq!(o.status.code(), Some(2), "{flag} {value}: {}", text(&o));
        assert!(text(&o).contains(flag), "{}", text(&o));
    }
}

/// `mantissa bench train --grad-accum N`: the step in N micro-batches, its work counted as a
/// step runs it (the forward and backward pass N times, the accumulation sections and the
/// update once): the same FLOPs as the batch whole, more bytes (the accumulators), the same
/// tokens a step; a count that does not divide the batch is refused before anything runs.
#[test]
fn bench_train_counts_a_step_of_micro_batches() {
    let dir = tempfile::tempdir().unwrap();
    let run = |micro: &str| {
        let json = dir.path().join(format!("bench-{micro}.json"));
        let o = mantissa(&[
            "bench",
            "train",
            "--config",
            "tiny",
            "--precision",
            "bf16-mixed",
            "--backends",
            "reference",
            "--attention",
            "unfused",
            "--warmup",
            "0",
            "--steps",
            "1",
            "--grad-accum",
            micro,
            "--json",
            json.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", text(&o));
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        v[0].clone()
    };
    let (whole, split) = (run("1"), run("4"));
    assert_eq!(split["micro_batches"].as_u64(), Some(4), "{split}");
    assert_eq!(whole["tokens_per_step"], split["tokens_per_step"]);
    let work = |r: &serde_json::Value, key: &str| r["work"][key].as_u64().unwrap();
    assert_eq!(
        work(&whole, "flops"),
        work(&split, "flops"),
        "{whole} {split}"
    );
    assert!(
        work(&split, "bytes") > work(&whole, "bytes"),
        "{whole} {split}"
    );
    let o = mantissa(&[
        "bench",
        "train",
        "--config",
        "tiny",
        "--backends",
        "reference",
        "--grad-accum",
        "3",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("micro-batches"), "{}", text(&o));
}

/// `mantissa bench train --profile`: the step's time and memory in the table and the JSON, and
/// a profile that accounts for every op of the plan once (in plan order, each in one part of
/// the step and under one label, the totals the sums of the ops), with each op's bytes, FLOPs
/// and fraction of the device's measured limits, and the step's work in a table of its own.
#[test]
fn bench_train_profiles_every_op_of_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let o = mantissa(&[
        "bench",
        "train",
        "--config",
        "tiny",
        "--precision",
        "bf16-mixed",
        "--backends",
        "reference",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--profile",
        "--json",
        json.to_str().unwrap(),
    ]);
    let msg = text(&o);
    assert!(o.status.success(), "{msg}");
    for want in [
        "ms/step",
        "peak MiB",
        "profile of reference bf16-mixed",
        "matmul bf16",
    ] {
        assert!(msg.contains(want), "no {want:?} in {msg}");
    }
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let p = &v[0]["profile"];
    let ops = p["ops"].as_array().expect("every op in the JSON");
    assert!(ops.len() > 50, "{} ops", ops.len());
    let mut total = 0.0;
    for (i, op) in ops.iter().enumerate() {
        assert_eq!(op["index"].as_u64(), Some(i as u64), "plan order");
        let s = op["seconds"].as_f64().unwrap();
        assert!(s.is_finite() && s >= 0.0, "{op}");
        assert!(!op["label"].as_str().unwrap().is_empty(), "{op}");
        total += s;
    }
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 + 1e-9 * b.abs();
    assert!(close(p["total_seconds"].as_f64().unwrap(), total), "{p}");
    for rows in ["parts", "labels"] {
        let rows = p[rows].as_array().unwrap();
        let count: u64 = rows.iter().map(|r| r["ops"].as_u64().unwrap()).sum();
        let seconds: f64 = rows.iter().map(|r| r["seconds"].as_f64().unwrap()).sum();
        assert_eq!(count, ops.len() as u64, "{rows:?}");
        assert!(close(seconds, total), "{rows:?}");
    }
    assert_eq!(p["parts"].as_array().unwrap().len(), 3);
    // Each op's cost by its definition: products (matmuls, fused attention) have FLOPs, the rest
    // bytes alone, and the step's work is their sum; each has a fraction of the device's
    // limits, measured.
    for op in ops {
        let label = op["label"].as_str().unwrap();
        let (bytes, flops) = (op["bytes"].as_u64().unwrap(), op["flops"].as_u64().unwrap());
        assert!(bytes > 0, "{op}");
        // (Fused attention's products count too, where `--attention auto` took it.)
        let product = label.starts_with("matmul") || label.starts_with("attention");
        assert_eq!(product, flops > 0, "{op}");
        assert!(op["of_limit"].as_f64().is_some_and(|f| f > 0.0), "{op}");
    }
    let work = &v[0]["work"];
    assert_eq!(work["ops"].as_u64(), Some(ops.len() as u64), "{work}");
    assert!(
        work["launches"].is_null(),
        "the host launches nothing: {work}"
    );
    for what in ["bytes", "flops"] {
        let sum: u64 = ops.iter().map(|o| o[what].as_u64().unwrap()).sum();
        assert_eq!(work[what].as_u64(), Some(sum), "{what}: {work}");
    }
    let limits = &p["limits"];
    assert!(
        limits["copy_bytes_per_second"].as_f64().unwrap() > 0.0,
        "{limits}"
    );
    assert_eq!(limits["matmul"][0]["algorithm"], "bf16", "{limits}");
    for want in [
        "ops/step",
        "launches/step",
        "GFLOP/step",
        "limits: copy",
        "of limit",
    ] {
        assert!(msg.contains(want), "no {want:?} in {msg}");
    }
}

/// Writes an integer `.npy` of `shape` holding `ids` (any integer type npyz writes).
fn write_ids<T: npyz::Serialize + npyz::AutoSerialize + Copy>(
    path: &Path,
    shape: &[u64],
    ids: &[T],
) {
    let mut f = std::fs::File::create(path).unwrap();
    let mut w = npyz::WriteOptions::<T>::new()
        .default_dtype()
        .shape(shape)
        .writer(&mut f)
        .begin_nd()
        .unwrap();
    w.extend(ids.iter().copied()).unwrap();
    w.finish().unwrap();
}

/// Tensors as (name, shape, f32 values).
type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// Writes `tensors` as a safetensors file.
fn write_tensors(path: &Path, tensors: &Tensors) {
    use safetensors::tensor::{Dtype, TensorView};
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, s, v)| {
            let view = TensorView::new(Dtype::F32, s.clone(), bytemuck::cast_slice(v)).unwrap();
            (n.clone(), view)
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// `--export-init` writes the seeded weights under PyTorch's names, and `--init` of that file
/// trains the seeded run's losses bit for bit; `--init` and `--batches` refuse a bad file with
/// one line naming it and the tensor, dimension or element (exit 2), before anything is written.
#[test]
fn init_and_batches_start_a_run_or_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name);
    let s = |name: &str| p(name).to_str().unwrap().to_string();
    let out = s("out");
    let o = mantissa(&[
        "train",
        "--seed",
        "5",
        "--export-init",
        &s("init.safetensors"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    // It trains nothing, so it writes nowhere else: --out is refused by name, as any flag of
    // a training run.
    let o = mantissa(&[
        "train",
        "--export-init",
        &s("other.safetensors"),
        "--out",
        &out,
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("--out is not used"), "{}", text(&o));
    assert!(!p("out").exists() && !p("other.safetensors").exists());
    let train = |extra: &[&str], out: &str| {
        let mut args = vec![
            "train",
            "--seed",
            "5",
            "--steps",
            "2",
            "--backend",
            "reference",
        ];
        args.extend_from_slice(&["--eval-interval", "10", "--out", out]);
        args.extend_from_slice(extra);
        let o = mantissa(&args);
        assert!(o.status.success(), "{extra:?}: {}", text(&o));
        let losses: Vec<f64> = train_log(Path::new(out))[0]["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["loss"].as_f64().unwrap())
            .collect();
        losses
    };
    let seeded = train(&[], &s("seeded"));
    assert_eq!(
        train(&["--init", &s("init.safetensors")], &s("from-file")),
        seeded
    );

    // The exported tensors, to break one at a time.
    let bytes = std::fs::read(p("init.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let good: Tensors = file
        .tensors()
        .into_iter()
        .map(|(n, t)| {
            (
                n,
                t.shape().to_vec(),
                bytemuck::pod_collect_to_vec(t.data()),
            )
        })
        .collect();
    let changed = |f: &dyn Fn(&mut Tensors)| {
        let mut t = good.clone();
        f(&mut t);
        t
    };
    let at = |name: &str| good.iter().position(|(n, ..)| n == name).unwrap();
    let inits = [
        (
            changed(&|t| drop(t.remove(at("blocks.1.fc.bias")))),
            "tensor blocks.1.fc.bias is missing",
        ),
        (
            changed(&|t| t.push(("blocks.2.ln1.weight".into(), vec![64], vec![1.0; 64]))),
            "tensor blocks.2.ln1.weight is not a parameter",
        ),
        (
            changed(&|t| t[at("blocks.0.qkv.weight")].1 = vec![64, 192]),
            "tensor blocks.0.qkv.weight is [64, 192], this model's is [192, 64]",
        ),
        (
            changed(&|t| t[at("head.weight")].2[3] += 1.0),
            "head.weight differs from tok.weight",
        ),
        (
            changed(&|t| t[at("pos.weight")].2[7] = f32::NAN),
            "pos.weight[7] is NaN",
        ),
    ];
    let cases: Vec<(Vec<String>, String)> = inits
        .into_iter()
        .enumerate()
        .map(|(i, (tensors, why))| {
            let name = format!("init{i}.safetensors");
            write_tensors(&p(&name), &tensors);
            (
                vec!["--init".into(), s(&name), "--steps".into(), "2".into()],
                why.to_string(),
            )
        })
        .collect();
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/parity_tiny_batches.npy"
    );
    write_ids::<u8>(&p("b8.npy"), &[3, 8, 33], &[1; 3 * 8 * 33]);
    write_ids::<i32>(&p("t16.npy"), &[3, 16, 17], &[1; 3 * 16 * 17]);
    let mut ids = vec![1i64; 3 * 16 * 33];
    ids[33 + 2] = 200;
    write_ids::<i64>(&p("vocab.npy"), &[3, 16, 33], &ids);
    ids[33 + 2] = -1;
    write_ids::<i64>(&p("negative.npy"), &[3, 16, 33], &ids);
    write_ids::<f32>(&p("float.npy"), &[3, 16, 33], &[1.0; 3 * 16 * 33]);
    write_ids::<u16>(&p("flat.npy"), &[16, 33], &[1; 16 * 33]);
    let batches: [(&str, &str, &str); 7] = [
        (
            "b8.npy",
            "2",
            "a batch of 8 rows (dimension 1), this run's is 16",
        ),
        (
            "t16.npy",
            "2",
            "rows of 17 ids (dimension 2), this run's context needs T+1 = 33",
        ),
        (
            "vocab.npy",
            "2",
            "id 200 at [0, 1, 2] is outside the vocabulary of 76",
        ),
        ("negative.npy", "2", "element 35 is -1, not a token id"),
        ("float.npy", "2", "dtype"),
        ("flat.npy", "2", "2 dimension(s) [16, 33], expected 3"),
        (
            fixture,
            "301",
            "300 batches (dimension 0), fewer than the 301 steps asked for",
        ),
    ];
    let mut cases = cases;
    for (file, steps, why) in batches {
        let path = if file.starts_with('/') {
            file.to_string()
        } else {
            s(file)
        };
        cases.push((
            vec!["--batches".into(), path, "--steps".into(), steps.into()],
            why.into(),
        ));
    }
    let (init, checkpoint) = (s("init.safetensors"), s("seeded/32-true.safetensors"));
    let both = ["--init", &init, "--resume", &checkpoint, "--steps", "2"].map(String::from);
    for (extra, why) in cases
        .into_iter()
        .chain([(both.to_vec(), "--init starts a run".into())])
    {
        let mut args = vec!["train", "--backend", "reference", "--out", &out];
        args.extend(extra.iter().map(String::as_str));
        let o = mantissa(&args);
        let msg = text(&o);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {msg}");
        assert!(
            msg.contains(why.as_str()),
            "{extra:?}: expected '{why}' in {msg}"
        );
        if extra.len() <= 4 {
            let file = Path::new(&extra[1]).file_name().unwrap().to_str().unwrap();
            assert!(msg.contains(file), "{extra:?}: the file is named in {msg}");
        }
        assert_eq!(msg.lines().count(), 1, "{extra:?}: one line: {msg}");
        assert!(!p("out").exists(), "{extra:?}: nothing was written");
    }
}

/// `mantissa` with `args`, killed if it runs past `seconds` (then `None`): a hang is a failure
/// of the test, not of the suite.
fn mantissa_within(args: &[&str], envs: &[(&str, &str)], seconds: u64) -> Option<Output> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_mantissa"))
        .args(args)
        .envs(envs.iter().copied())
        .env("XDG_RUNTIME_DIR", "/tmp")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run mantissa");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(seconds);
    while child.try_wait().expect("wait").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Some(child.wait_with_output().expect("output"))
}

fn mkfifo(path: &Path) -> bool {
    Command::new("mkfifo")
        .arg(path)
        .status()
        .is_ok_and(|s| s.success())
}

/// Inputs are looked at before they are read: a device, a FIFO, a directory or a sparse 2 GB
/// file where a checkpoint, a corpus or an operand is expected is refused at once, with exit 2
/// and its path (the device was read until the kernel killed the tool; the FIFO waited for
/// ever; the sparse file was read whole to reject its header).
#[test]
fn special_files_are_refused_before_they_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let fifo = p("fifo");
    if !mkfifo(Path::new(&fifo)) {
        common::skip(
            "cli::special_files_are_refused_before_they_are_read",
            "no mkfifo",
        );
        return;
    }
    let sparse = p("sparse.safetensors");
    std::fs::File::create(&sparse)
        .unwrap()
        .set_len(2 << 30)
        .unwrap();
    // A safetensors header that claims 2 GB of tensors in a file of a few bytes.
    let header = r#"{"x":{"dtype":"F32","shape":[500000000],"data_offsets":[0,2000000000]}}"#;
    let mut forged = (header.len() as u64).to_le_bytes().to_vec();
    forged.extend(header.as_bytes());
    std::fs::write(p("forged.safetensors"), &forged).unwrap();
    write_matrix(
        Path::new(&p("b.npy")),
        &Matrix::new(2, 2, vec![1.0; 4]).unwrap(),
    )
    .unwrap();
    let out = p("run");
    let cases: Vec<(Vec<String>, String, &str)> = vec![
        (
            vec!["sample".into(), "--checkpoint".into(), "/dev/zero".into()],
            "/dev/zero".into(),
            "device",
        ),
        (
            vec!["sample".into(), "--checkpoint".into(), fifo.clone()],
            fifo.clone(),
            "FIFO",
        ),
        (
            vec!["sample".into(), "--checkpoint".into(), sparse.clone()],
            sparse.clone(),
            "checkpoint",
        ),
        (
            vec![
                "sample".into(),
                "--checkpoint".into(),
                p("forged.safetensors"),
            ],
            p("forged.safetensors"),
            "header says",
        ),
        (
            vec![
                "sample".into(),
                "--checkpoint".into(),
                dir.path().to_str().unwrap().into(),
            ],
            dir.path().to_str().unwrap().into(),
            "directory",
        ),
        (
            vec![
                "sample".into(),
                "--checkpoint".into(),
                sparse.clone(),
                "--corpus".into(),
                "/dev/zero".into(),
            ],
            "/dev/zero".into(),
            "device",
        ),
        (
            vec![
                "train".into(),
                "--resume".into(),
                "/dev/zero".into(),
                "--steps".into(),
                "1".into(),
                "--backend".into(),
                "reference".into(),
                "--out".into(),
                out.clone(),
            ],
            "/dev/zero".into(),
            "device",
        ),
        (
            vec![
                "train".into(),
                "--resume".into(),
                fifo.clone(),
                "--steps".into(),
                "1".into(),
                "--backend".into(),
                "reference".into(),
                "--out".into(),
                out.clone(),
            ],
            fifo.clone(),
            "FIFO",
        ),
        (
            vec![
                "train".into(),
                "--corpus".into(),
                "/dev/zero".into(),
                "--steps".into(),
                "1".into(),
                "--out".into(),
                out.clone(),
            ],
            "/dev/zero".into(),
            "device",
        ),
        (
            vec![
                "matmul".into(),
                fifo.clone(),
                p("b.npy"),
                "--backend".into(),
                "reference".into(),
            ],
            fifo.clone(),
            "FIFO",
        ),
        (
            vec![
                "matmul".into(),
                p("b.npy"),
                "/dev/zero".into(),
                "--backend".into(),
                "reference".into(),
            ],
            "/dev/zero".into(),
            "device",
        ),
        (
            vec![
                "cast".into(),
                "--raw".into(),
                "--from".into(),
                "f32".into(),
                "--to".into(),
                "bf16".into(),
                "-i".into(),
                fifo.clone(),
            ],
            fifo.clone(),
            "FIFO",
        ),
    ];
    for (args, path, why) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = mantissa_within(&args, &[], 30).unwrap_or_else(|| panic!("{args:?} hung"));
        let msg = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {msg}");
        assert!(msg.contains(&path) && msg.contains(why), "{args:?}: {msg}");
    }
    assert!(
        !Path::new(&out).exists(),
        "train wrote before its inputs were checked"
    );
}

/// A FIFO where the autotune cache lives does not block a tuned wgpu matmul: the cache is
/// ignored with a warning (it waited for a writer for ever).
#[test]
fn a_fifo_at_the_cache_path_does_not_block_a_matmul() {
    common::on(common::wgpu(), "cli::a_fifo_at_the_cache_path", |_| {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache");
        std::fs::create_dir(&cache).unwrap();
        if !mkfifo(&cache.join("autotune.json")) {
            return;
        }
        let a = dir.path().join("a.npy");
        write_matrix(&a, &Matrix::new(8, 8, measure::normal(64, 3)).unwrap()).unwrap();
        let args = [
            "matmul",
            a.to_str().unwrap(),
            a.to_str().unwrap(),
            "--backend",
            "wgpu",
            "--check",
        ];
        let envs = [
            ("MANTISSA_CACHE_DIR", cache.to_str().unwrap()),
            // `full`: on a software adapter such as lavapipe `fast` tunes nothing.
            ("MANTISSA_AUTOTUNE", "full"),
        ];
        let o = mantissa_within(&args, &envs, 120).expect("the matmul waited on the FIFO");
        assert!(o.status.success(), "{}", text(&o));
        assert!(
            text(&o).contains("cache ignored") && text(&o).contains("FIFO"),
            "{}",
            text(&o)
        );
    });
}

/// The wgpu switches are read strictly: a value that is neither on nor off is refused by name,
/// exit 2 (`MANTISSA_WGSL_CHECKS=maybe` ran without the checks, silently).
#[test]
fn unknown_switch_values_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.npy");
    write_matrix(&a, &Matrix::new(4, 4, measure::normal(16, 5)).unwrap()).unwrap();
    let args = [
        "matmul",
        a.to_str().unwrap(),
        a.to_str().unwrap(),
        "--backend",
        "wgpu",
    ];
    for var in ["MANTISSA_WGSL_CHECKS", "MANTISSA_COOP"] {
        let o = mantissa_within(&args, &[(var, "maybe")], 60).expect("it ended");
        assert_eq!(o.status.code(), Some(2), "{var}: {}", text(&o));
        assert!(text(&o).contains(&format!("{var}=maybe")), "{}", text(&o));
    }
}

/// Host memory is asked for, not assumed: a product whose C is 4e18 bytes (from two empty
/// operands) and a step plan for a batch of 2^20 are refused with the bytes they need, exit 1
/// (they aborted the process, exit 134).
#[test]
fn sizes_beyond_host_memory_are_errors_not_aborts() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.npy");
    let b = dir.path().join("b.npy");
    std::fs::write(&a, npy_with_header("(1000000000, 0)", 0)).unwrap();
    std::fs::write(&b, npy_with_header("(0, 1000000000)", 0)).unwrap();
    for backend in ["reference", "auto"] {
        let o = mantissa(&[
            "matmul",
            a.to_str().unwrap(),
            b.to_str().unwrap(),
            "--backend",
            backend,
        ]);
        assert_eq!(o.status.code(), Some(1), "{backend}: {}", text(&o));
        let msg = text(&o);
        assert!(
            msg.contains("out of host memory") && msg.contains("4000000000000000000 bytes"),
            "{backend}: {msg}"
        );
    }
    let out = dir.path().join("run");
    let o = mantissa(&[
        "train",
        "--batch",
        "1048576",
        "--backend",
        "reference",
        "--steps",
        "1",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("batch of 1048576") && text(&o).contains("try --batch"),
        "{}",
        text(&o)
    );
    assert!(!out.exists() || std::fs::read_dir(&out).unwrap().count() == 0);
}

/// The gate cannot pass on nothing: a backend named but absent fails it (exit 3, said), an
/// empty list or one naming an item twice is bad input (exit 2), and a missing corpus is an
/// error, not missing training lines.
#[test]
fn the_report_gate_cannot_pass_on_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("report");
    let out = out.to_str().unwrap();
    let quick = [
        "--sizes",
        "8",
        "--algorithms",
        "f32",
        "--families",
        "normal",
        "--train-steps",
        "0",
        "--out",
        out,
    ];
    let report = |extra: &[&str]| {
        let mut args = vec!["report"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&quick);
        mantissa(&args)
    };
    let cuda_present = mantissa(&["info"])
        .stdout
        .windows(6)
        .any(|w| w == b"cuda: ")
        && !text(&mantissa(&["info"])).contains("cuda: absent");
    if !cuda_present {
        let o = report(&["--backends", "cuda"]);
        assert_eq!(o.status.code(), Some(3), "{}", text(&o));
        assert!(
            text(&o).contains("cuda was named but not checked"),
            "{}",
            text(&o)
        );
        assert!(!text(&o).contains("PASSED"), "{}", text(&o));
        // `all` skips it, saying why.
        let o = report(&["--backends", "all"]);
        let said = text(&o);
        assert!(
            said.contains("skipped cuda") || said.contains("skipped: "),
            "{said}"
        );
    }
    let o = report(&["--backends", "reference"]);
    assert!(o.status.success(), "{}", text(&o));
    for (flag, value) in [
        ("--backends", ""),
        ("--backends", "reference,reference"),
        ("--algorithms", ""),
        ("--algorithms", "f32,,bf16"),
        ("--train-presets", ""),
        ("--families", "normal,normal"),
        ("--sizes", "8,8"),
    ] {
        let mut args = vec![
            "report",
            "--backends",
            "reference",
            flag,
            value,
            "--out",
            out,
        ];
        if flag == "--backends" {
            args.drain(1..3);
        }
        let o = mantissa(&args);
        assert_eq!(o.status.code(), Some(2), "{flag} '{value}': {}", text(&o));
        assert!(text(&o).contains(flag), "{flag} '{value}': {}", text(&o));
    }
    for (flag, value) in [("--precision", ""), ("--precision", "32-true,32-true")] {
        let o = mantissa(&["train", flag, value, "--out", out]);
        assert_eq!(o.status.code(), Some(2), "{flag} '{value}': {}", text(&o));
    }
    let o = mantissa(&[
        "train",
        "--autocast-override",
        "softmax=bf16,softmax=f16",
        "--backend",
        "reference",
        "--steps",
        "1",
        "--out",
        out,
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("softmax twice"), "{}", text(&o));
    let o = mantissa(&[
        "report",
        "--backends",
        "reference",
        "--sizes",
        "8",
        "--algorithms",
        "f32",
        "--families",
        "normal",
        "--train-steps",
        "1",
        "--corpus",
        "/nonexistent/corpus.txt",
        "--out",
        out,
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("/nonexistent/corpus.txt"), "{}", text(&o));
}

/// Output that cannot be written is a failure of the machine (exit 1, as docs/cli.md says; it
/// was 2), found before the work where the run writes at its end: `train --out` fails before
/// its first step, writing nothing.
#[test]
fn outputs_that_cannot_be_written_exit_1_before_the_work() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.npy");
    write_matrix(&a, &Matrix::new(2, 2, vec![1.0; 4]).unwrap()).unwrap();
    let a = a.to_str().unwrap();
    let nowhere = dir.path().join("no such folder").join("c.npy");
    let o = mantissa(&[
        "matmul",
        a,
        a,
        "--backend",
        "reference",
        "-o",
        nowhere.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        !text(&o).contains("C = A . B"),
        "checked before the product: {}",
        text(&o)
    );
    // --out under a regular file, and a checkpoint's path taken by a folder.
    let file = dir.path().join("file");
    std::fs::write(&file, "x").unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir_all(run.join("32-true.safetensors")).unwrap();
    for out in [file.join("run"), run.clone()] {
        let o = mantissa(&[
            "train",
            "--backend",
            "reference",
            "--steps",
            "2",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        assert!(!text(&o).contains("step "), "trained first: {}", text(&o));
    }
    assert_eq!(
        std::fs::read_dir(&run).unwrap().count(),
        1,
        "wrote into --out"
    );
    // Standard output that cannot be written: exit 1 and one line, not a panic.
    let o = Command::new(env!("CARGO_BIN_EXE_mantissa"))
        .arg("finfo")
        .stdout(
            std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/full")
                .unwrap(),
        )
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(!text(&o).contains("panicked"), "{}", text(&o));
    // `-` is standard output: C as .npy there, the lines about it on standard error.
    let o = mantissa(&["matmul", a, a, "--backend", "reference", "-o", "-"]);
    assert!(o.status.success(), "{}", text(&o));
    let c = mantissa::npy::read_matrix_from(
        std::io::Cursor::new(o.stdout.clone()),
        Some(o.stdout.len() as u64),
        Path::new("-"),
    )
    .unwrap();
    assert_eq!(c.data, vec![2.0; 4]);
}

/// A reader that goes away ends the tool quietly, as other Unix tools (it panicked on the
/// broken pipe).
#[test]
fn a_closed_pipe_ends_the_tool_quietly() {
    use std::io::BufRead;
    // Far more than a pipe holds, so that the tool is still writing when its reader leaves.
    let values: Vec<String> = (0..20_000).map(|i| format!("{i}.5")).collect();
    let mut child = Command::new(env!("CARGO_BIN_EXE_mantissa"))
        .arg("cast")
        .args(&values)
        .env("XDG_RUNTIME_DIR", "/tmp")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(!first.is_empty());
    assert!(!text(&o).contains("panicked"), "{}", text(&o));
    assert_ne!(o.status.code(), Some(101), "a panic's exit code");
}

/// No panic on any argument: a 100,000-digit number to `cast` (the table's formatting width
/// overflowed), and fp8 scales in an `--algorithms` list.
#[test]
fn arguments_of_any_length_and_scales_in_lists() {
    let digits = "1".repeat(100_000);
    let o = mantissa(&["cast", &digits, "--to", "f16"]);
    assert!(
        o.status.success(),
        "{}",
        &text(&o)[..200.min(text(&o).len())]
    );
    assert!(text(&o).contains("inf"));
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let o = mantissa(&[
        "bench",
        "matmul",
        "--sizes",
        "16",
        "--algorithms",
        "e4m3:given=1/1,e4m3",
        "--backends",
        "reference",
        "--reps",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("e4m3:given=1/1"), "{}", text(&o));
    for (args, flag) in [
        (
            vec!["sample", "--checkpoint", "x", "--tokens", "1000000000"],
            "--tokens",
        ),
        (
            vec!["bench", "matmul", "--reps", "0", "--backends", "reference"],
            "--reps",
        ),
        (
            vec!["report", "--reps", "100000000", "--backends", "reference"],
            "--reps",
        ),
    ] {
        let o = mantissa(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        assert!(text(&o).contains(flag), "{args:?}: {}", text(&o));
    }
}

/// A run ended by SIGTERM while it writes an output leaves no temporary behind (a signal ends
/// the process without the temporary's drop).
#[test]
fn sigterm_removes_the_pending_temporary() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.bf16");
    let mut child = Command::new(env!("CARGO_BIN_EXE_mantissa"))
        .args(["cast", "--raw", "--from", "f32", "--to", "bf16", "-o"])
        .arg(&out)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The input stays open: the tool is converting into its temporary until it is stopped.
    let mut input = child.stdin.take().unwrap();
    input.write_all(&[0u8; 4096]).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let pending = || std::fs::read_dir(dir.path()).unwrap().count();
    while pending() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no temporary appeared"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = child.wait().unwrap();
    drop(input);
    assert!(!status.success());
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// A .npy header's shape is read by the parser the reader uses (round four's M3): a shape in
/// double quotes went past the size check to a 2 PiB allocation request (exit 1), and a
/// repeated 'shape' key, whose last value the reader takes, wrapped the size check's product
/// to three batches. Both are refused as bad input, naming the file.
#[test]
fn forged_npy_headers_are_read_as_the_reader_reads_them() {
    let dir = tempfile::tempdir().unwrap();
    let npy = |name: &str, header: &str, data: usize| {
        let mut header = header.to_string();
        while !(10 + header.len() + 1).is_multiple_of(64) {
            header.push(' ');
        }
        header.push('\n');
        let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
        bytes.extend((header.len() as u16).to_le_bytes());
        bytes.extend(header.as_bytes());
        bytes.extend(vec![0u8; data]);
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        path.to_str().unwrap().to_string()
    };
    let row = 16 * 33;
    let cases = [
        (
            npy(
                "dquote.npy",
                r#"{"descr": "|u1", "fortran_order": False, "shape": (1099511627776, 16, 33), }"#,
                row,
            ),
            "1099511627776x16x33",
        ),
        (
            npy(
                "twice.npy",
                "{'descr': '|u1', 'fortran_order': False, 'shape': (1,), 'shape': (1152921504606846979, 16, 33), }",
                3 * row,
            ),
            "'shape' twice",
        ),
    ];
    for (path, why) in cases {
        let args = [
            "train",
            "--batches",
            &path,
            "--steps",
            "5",
            "--backend",
            "reference",
            "--out",
        ];
        let out = dir.path().join("out");
        let mut args = args.to_vec();
        args.push(out.to_str().unwrap());
        let o = mantissa(&args);
        assert_eq!(o.status.code(), Some(2), "{path}: {}", text(&o));
        assert!(
            text(&o).contains(&path) && text(&o).contains(why),
            "{}",
            text(&o)
        );
        assert!(!out.exists(), "{}", text(&o));
        let o = mantissa(&["matmul", &path, &path, "--backend", "reference"]);
        assert_eq!(o.status.code(), Some(2), "{path}: {}", text(&o));
    }
}

/// The rule for non-finite state (round four's H1 and M6): a run whose weights overflow stops
/// with exit 4 at the step it went non-finite, its validation loss NaN, and writes no
/// checkpoint (`--lr 1e30` exited 0, and `sample` then panicked on its checkpoint, exit 101);
/// `sample` refuses weights whose logits are not finite (a checkpoint of finite, huge weights)
/// with exit 2, and a prompt character outside the vocabulary before echoing anything (it was
/// dropped silently, and echoed).
#[test]
fn overflowing_weights_stop_a_run_and_are_refused_by_sample() {
    use mantissa::train::{Corpus, TrainOptions, Trainer};
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let o = mantissa(&[
        "train",
        "--steps",
        "1",
        "--lr",
        "1e30",
        "--eval-batches",
        "1",
        "--backend",
        "reference",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert!(
        text(&o).contains("stopped at step 1") && text(&o).contains("validation loss NaN"),
        "{}",
        text(&o)
    );
    assert!(
        !out.join("32-true.safetensors").exists(),
        "a checkpoint of NaN losses"
    );
    assert_eq!(train_log(&out)[0]["stopped_at"], 1);

    // A checkpoint of finite weights so large that the logits overflow.
    let corpus = Corpus::load(Path::new("data/shakespeare.txt")).unwrap();
    let options = TrainOptions::new(
        mantissa::train::GptConfig::named("tiny", corpus.vocab.len()).unwrap(),
        mantissa::Preset::True32,
        1,
    );
    let mut t = Trainer::new(&mantissa::backend::Reference, &corpus, options).unwrap();
    let huge: Vec<Vec<f32>> = (t.gpt.config.init(1).unwrap().into_iter())
        .map(|p| p.into_iter().map(|x| x * 1e30 + 1e30).collect())
        .collect();
    pollster::block_on(t.set_weights(&huge)).unwrap();
    let ck = dir.path().join("huge.safetensors");
    pollster::block_on(t.save(&ck)).unwrap();
    let ck = ck.to_str().unwrap();
    for temperature in ["0.8", "0"] {
        let o = mantissa(&[
            "sample",
            "--checkpoint",
            ck,
            "--tokens",
            "3",
            "--temperature",
            temperature,
        ]);
        assert_eq!(o.status.code(), Some(2), "{temperature}: {}", text(&o));
        assert!(text(&o).contains("inf or NaN"), "{}", text(&o));
        assert!(!text(&o).contains("panicked"), "{}", text(&o));
    }
    let o = mantissa(&["sample", "--checkpoint", ck, "--prompt", "ROMEO€:"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("--prompt") && text(&o).contains("'€'"),
        "{}",
        text(&o)
    );
    assert!(o.stdout.is_empty(), "echoed: {}", text(&o));
}

/// Every count has a bound (round four's M4, M5): `bench train --steps 4294967295` wrapped to
/// no step and reported NaN with exit 0, and `--eval-batches 100000000000` evaluated for
/// hours; each is refused by name before anything runs.
#[test]
fn counts_beyond_their_bounds_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let out = out.to_str().unwrap();
    let bench = [
        "bench",
        "train",
        "--precision",
        "32-true",
        "--backends",
        "reference",
    ];
    for (flag, value, other) in [
        ("--steps", "4294967295", ["--warmup", "0"]),
        ("--warmup", "4294967295", ["--steps", "1"]),
        ("--steps", "0", ["--warmup", "0"]),
    ] {
        let mut args = bench.to_vec();
        args.extend([flag, value]);
        args.extend(other);
        let o = mantissa_within(&args, &[], 60).expect("it ended");
        assert_eq!(o.status.code(), Some(2), "{flag} {value}: {}", text(&o));
        assert!(text(&o).contains(flag), "{}", text(&o));
    }
    for value in ["0", "100000000000"] {
        let args = [
            "train",
            "--eval-batches",
            value,
            "--steps",
            "1",
            "--out",
            out,
        ];
        let o = mantissa_within(&args, &[], 60).expect("it ended");
        assert_eq!(o.status.code(), Some(2), "{value}: {}", text(&o));
        assert!(text(&o).contains("--eval-batches"), "{}", text(&o));
    }
}

/// Standard output carries data alone when it is an output (round four's H2): `--export-init -`
/// wrote its message after the safetensors bytes, and `--init` refused the file. The export
/// round-trips into `--init`; with `--resume` it exports the checkpoint's weights (it exported
/// the seeded ones); a flag it does not use is refused by name (M1: it ignored them all, a bad
/// `--precision` or `--batches` included). `bench --json -` writes JSON alone there too.
#[test]
fn exports_to_standard_output_carry_data_alone_and_unused_flags_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let o = mantissa(&["train", "--seed", "3", "--export-init", "-"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("wrote -"),
        "{}",
        text(&o)
    );
    std::fs::write(p("x.safetensors"), &o.stdout).unwrap();
    let o = mantissa(&["train", "--seed", "3", "--export-init", &p("y.safetensors")]);
    assert!(o.status.success(), "{}", text(&o));
    let again = ["train", "--init", &p("x.safetensors"), "--export-init", "-"];
    let o = mantissa(&again);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(o.stdout, std::fs::read(p("y.safetensors")).unwrap());

    // A checkpoint two steps on from seed 3: --resume exports its weights, not seed 3's.
    let run = p("run");
    let o = mantissa(&[
        "train",
        "--seed",
        "3",
        "--steps",
        "2",
        "--eval-batches",
        "1",
        "--backend",
        "reference",
        "--out",
        &run,
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let ck = format!("{run}/32-true.safetensors");
    let o = mantissa(&[
        "train",
        "--resume",
        &ck,
        "--export-init",
        &p("r.safetensors"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let corpus = mantissa::train::Corpus::load(Path::new("data/shakespeare.txt")).unwrap();
    let config = mantissa::train::GptConfig::named("tiny", corpus.vocab.len()).unwrap();
    let trained = mantissa::train::Checkpoint::load(
        Path::new(&ck),
        &mantissa::train::Expected::gpt(&config, &corpus.vocab),
    );
    let read =
        mantissa::train::init::read_init(Path::new(&p("r.safetensors")), &config, &corpus.vocab);
    assert!(
        read.unwrap() == trained.unwrap().params,
        "not the checkpoint's weights"
    );
    for (flag, value) in [
        ("--precision", "bogus"),
        ("--backend", "bogus"),
        ("--batches", "/nonexistent.npy"),
        ("--attention", "bogus"),
        ("--batch", "0"),
        ("--steps", "5"),
        ("--out", "elsewhere"),
    ] {
        let o = mantissa(&["train", "--export-init", &p("z.safetensors"), flag, value]);
        assert_eq!(o.status.code(), Some(2), "{flag}: {}", text(&o));
        assert!(
            text(&o).contains(&format!("{flag} is not used")),
            "{}",
            text(&o)
        );
    }
    let o = mantissa(&[
        "train",
        "--export-init",
        "-",
        "--seed",
        "1",
        "--resume",
        &ck,
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(o.stdout.is_empty() && !Path::new(&p("z.safetensors")).exists());

    let o = mantissa(&[
        "bench",
        "matmul",
        "--sizes",
        "8",
        "--algorithms",
        "f32",
        "--backends",
        "reference",
        "--reps",
        "1",
        "--json",
        "-",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let records: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON alone");
    assert_eq!(records.as_array().map(Vec::len), Some(1), "{records}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("f32"),
        "the table: {}",
        text(&o)
    );
}

/// The host-memory check honours the process's address-space limit (`ulimit -v`): a batch
/// within MemAvailable but beyond the limit passed the check and aborted the run; it is
/// refused with the bytes and a batch that fits (exit 1).
#[cfg(target_os = "linux")]
#[test]
fn a_batch_beyond_the_address_space_limit_is_refused_with_one_that_fits() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mantissa"));
    cmd.args([
        "train",
        "--batch",
        "20000",
        "--backend",
        "reference",
        "--steps",
        "1",
    ])
    .arg("--out")
    .arg(dir.path().join("out"))
    .env("XDG_RUNTIME_DIR", "/tmp");
    // SAFETY: setrlimit between fork and exec touches nothing the parent holds.
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 6 << 30,
                rlim_max: 6 << 30,
            };
            match libc::setrlimit(libc::RLIMIT_AS, &limit) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
    let o = cmd.output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("try --batch"), "{}", text(&o));
}

/// A step plan whose tensor is larger than a device limit allows is a limit of the machine,
/// exit 1, with a batch that fits (round four's M11: exit 2, as bad input, with no batch).
#[test]
fn a_batch_beyond_a_device_limit_is_a_machine_limit_with_one_that_fits() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let args = [
        "train",
        "--batch",
        "1048576",
        "--backend",
        "wgpu",
        "--steps",
        "1",
        "--out",
        out.to_str().unwrap(),
    ];
    let o = mantissa_within(&args, &[("MANTISSA_AUTOTUNE", "off")], 300).expect("it ended");
    if text(&o).contains("not available") {
        return common::skip("device_limit_batch", &text(&o));
    }
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("try --batch"), "{}", text(&o));
}

/// The environment switches are read by one parser on every backend (round four): a value a
/// switch does not take is refused by name with the words it takes whichever backend runs
/// (`MANTISSA_TUNE_SECONDS=-1` and `MANTISSA_CUDA_SPLIT=bogus` were ignored on the reference),
/// case and spaces aside (`MANTISSA_ACTIVATIONS=F32` was refused), an empty value as unset
/// (`MANTISSA_COOP=` was an error).
#[test]
fn switches_read_alike_on_every_backend() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.npy");
    write_matrix(&a, &Matrix::new(4, 4, measure::normal(16, 5)).unwrap()).unwrap();
    let a = a.to_str().unwrap();
    let args = ["matmul", a, a, "--backend", "reference"];
    for (var, value, words) in [
        ("MANTISSA_TUNE_SECONDS", "-1", "seconds >= 0"),
        ("MANTISSA_CUDA_SPLIT", "bogus", "gemms"),
        ("MANTISSA_COOP", "maybe", "auto, on"),
        ("MANTISSA_ROW_LANES", "3", "power of two"),
    ] {
        let o = mantissa_within(&args, &[(var, value)], 60).expect("it ended");
        assert_eq!(o.status.code(), Some(2), "{var}={value}: {}", text(&o));
        assert!(text(&o).contains(&format!("{var}=")), "{}", text(&o));
        assert!(text(&o).contains(words), "{}", text(&o));
    }
    for (var, value) in [
        ("MANTISSA_ACTIVATIONS", "F32"),
        ("MANTISSA_AUTOTUNE", " Off "),
        ("MANTISSA_COOP", ""),
        ("MANTISSA_WGSL_CHECKS", "  "),
        ("MANTISSA_BACKEND", ""),
    ] {
        let o = mantissa_within(&args, &[(var, value)], 60).expect("it ended");
        assert!(o.status.success(), "{var}={value:?}: {}", text(&o));
    }
}
