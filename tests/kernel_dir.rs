//! Kernel iteration without a rebuild (docs/wgpu.md, "Kernel iteration"): `MANTISSA_KERNEL_DIR`
//! replaces kernel source files at run time, `MANTISSA_TUNE_CANDIDATES` the tuner's candidates.
//! A replaced kernel is what runs; one that fails to validate or to meet its contract against the
//! host reference is refused, said, and the built-in one runs; a directory or a list that cannot
//! be used is refused before anything runs. Through the tool, as a user runs it (each process
//! reads the variables once).

mod common;

use mantissa::npy::{Matrix, read_matrix, write_matrix};
use std::path::Path;
use std::process::{Command, Output};

fn mantissa(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mantissa"));
    c.args(args).env("XDG_RUNTIME_DIR", "/tmp");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run mantissa")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Skips where there is no wgpu adapter; in CI (which installs lavapipe) fails instead.
fn no_adapter(test: &str, said: &str) {
    assert!(
        !std::env::var("CI").is_ok_and(|v| v == "true"),
        "{test}: wgpu required in CI but absent: {said}"
    );
    common::skip(test, "no wgpu adapter");
}

fn repo_shader(name: &str) -> String {
    std::fs::read_to_string(format!("{}/shaders/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

/// matmul.wgsl with the value its final store writes to C replaced by `value` (of `out`).
fn edited_matmul(value: &str) -> String {
    let text = repo_shader("matmul.wgsl");
    let store = "c_data[at + col] = bitcast<C_T>(out);";
    assert!(
        text.contains(store),
        "matmul.wgsl's store moved: update this test"
    );
    text.replace(store, &store.replace("(out)", &format!("({value})")))
}

/// The f32 product of fixed operands on wgpu (37x45 by 45x29, K past nothing special), with
/// `env`; its bits and the tool's output.
fn product(dir: &Path, env: &[(&str, &str)]) -> Option<(Vec<u32>, String)> {
    let a = dir.join("a.npy");
    let b = dir.join("b.npy");
    if !a.exists() {
        let seed = common::seed("kernel_dir product");
        let ma = Matrix::new(37, 45, mantissa::measure::normal(37 * 45, seed)).unwrap();
        let mb = Matrix::new(45, 29, mantissa::measure::normal(45 * 29, seed + 1)).unwrap();
        write_matrix(&a, &ma).unwrap();
        write_matrix(&b, &mb).unwrap();
    }
    let c = dir.join("c.npy");
    let _ = std::fs::remove_file(&c);
    let o = mantissa(
        &[
            "matmul",
            a.to_str().unwrap(),
            b.to_str().unwrap(),
            "--algorithm",
            "f32",
            "--backend",
            "wgpu",
            "--check",
            "-o",
            c.to_str().unwrap(),
        ],
        env,
    );
    if !o.status.success() && text(&o).contains("backend 'wgpu' is not available") {
        no_adapter("kernel_dir", &text(&o));
        return None;
    }
    assert!(o.status.success(), "{}", text(&o));
    let c = read_matrix(&c).unwrap();
    Some((c.data.iter().map(|x| x.to_bits()).collect(), text(&o)))
}

#[test]
fn a_kernel_dir_that_cannot_be_used_is_refused_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let run = |what: &str| {
        let o = mantissa(
            &[
                "bench",
                "matmul",
                "--sizes",
                "64",
                "--algorithms",
                "f32",
                "--backends",
                "reference,wgpu",
                "--reps",
                "1",
            ],
            &[("MANTISSA_KERNEL_DIR", what)],
        );
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(text(&o).contains("MANTISSA_KERNEL_DIR"), "{}", text(&o));
        text(&o)
    };
    assert!(run(&format!("{d}/missing")).contains("is not a directory"));
    assert!(run(d).contains("none of the kernel source files"));
    std::fs::write(dir.path().join("matmull.wgsl"), "").unwrap();
    let said = run(d);
    assert!(
        said.contains("matmull.wgsl") && said.contains("matmul.wgsl"),
        "{said}"
    );
    // `info` says which sources it would build from, or why it cannot.
    let o = mantissa(&["info"], &[("MANTISSA_KERNEL_DIR", d)]);
    assert!(text(&o).contains("kernel sources: refused"), "{}", text(&o));
    std::fs::remove_file(dir.path().join("matmull.wgsl")).unwrap();
    std::fs::write(dir.path().join("unary.wgsl"), repo_shader("unary.wgsl")).unwrap();
    let o = mantissa(&["info"], &[("MANTISSA_KERNEL_DIR", d)]);
    assert!(
        text(&o).contains("kernel sources: 1 file(s) from") && text(&o).contains("unary.wgsl"),
        "{}",
        text(&o)
    );
}

#[test]
fn a_replaced_kernel_is_what_runs_and_one_that_fails_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let Some((builtin, _)) = product(dir.path(), &[]) else {
        return;
    };
    let kernels = dir.path().join("k");
    std::fs::create_dir(&kernels).unwrap();
    let k = kernels.to_str().unwrap();
    let env = [("MANTISSA_KERNEL_DIR", k)];
    // One ulp up wherever the product is not exact in a narrower sense: within the contract, so
    // the replaced kernel runs, and its bits show that it did. (In the plain store only: a bias
    // add in the store must store the add's values exactly, or the kernel is refused.)
    std::fs::write(
        kernels.join("matmul.wgsl"),
        edited_matmul("out * select(1.00000012, 1.0, EPILOGUE)"),
    )
    .unwrap();
    let (replaced, said) = product(dir.path(), &env).unwrap();
    assert!(!said.contains("refused"), "{said}");
    let differ = replaced
        .iter()
        .zip(&builtin)
        .filter(|(x, y)| x != y)
        .count();
    assert!(
        differ > 0,
        "the replaced kernel did not run: every bit is the built-in one's"
    );
    // A tenth of a percent off breaks the contract: refused at its first check, said, and the
    // built-in kernel computes the product.
    std::fs::write(kernels.join("matmul.wgsl"), edited_matmul("out * 1.001")).unwrap();
    let (refused, said) = product(dir.path(), &env).unwrap();
    assert!(
        said.contains("matmul.wgsl refused") && said.contains("break the f32 contract"),
        "{said}"
    );
    assert_eq!(refused, builtin);
    // A kernel that does not validate: refused with the file and line of its error.
    let broken = format!("{}\nfn broken( {{\n", repo_shader("matmul.wgsl"));
    let line = broken.lines().count();
    std::fs::write(kernels.join("matmul.wgsl"), broken).unwrap();
    let (refused, said) = product(dir.path(), &env).unwrap();
    assert!(
        said.contains("is refused") && said.contains(&format!("matmul.wgsl:{line}:")),
        "{said}"
    );
    assert_eq!(refused, builtin);
    // An epilogue whose coded store swaps each word's two codes (a bias add into codes, as
    // the 16-bit presets' q|k|v): refused at its first check, before anything runs.
    std::fs::remove_file(kernels.join("matmul.wgsl")).unwrap();
    let pair = "code_pair(sum.x, sum.y, params.epi.z)";
    let epilogue = repo_shader("epilogue.wgsl");
    assert!(
        epilogue.contains(pair),
        "epilogue.wgsl's coded store moved: update this test"
    );
    let swapped = epilogue.replace(pair, "code_pair(sum.y, sum.x, params.epi.z)");
    std::fs::write(kernels.join("epilogue.wgsl"), swapped).unwrap();
    let (product_bits, said) = product(dir.path(), &env).unwrap();
    assert!(
        said.contains("epilogue.wgsl refused") && said.contains("stored as codes"),
        "{said}"
    );
    assert_eq!(product_bits, builtin);
}

#[test]
fn listed_tiles_are_the_candidates_and_unfit_ones_are_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let list = dir.path().join("candidates.json");
    let bench = |list: &Path| {
        mantissa(
            &[
                "bench",
                "matmul",
                "--sizes",
                "160x96x200",
                "--algorithms",
                "f32",
                "--backends",
                "wgpu",
                "--reps",
                "1",
            ],
            &[
                ("MANTISSA_TUNE_CANDIDATES", list.to_str().unwrap()),
                ("MANTISSA_CACHE_DIR", cache.to_str().unwrap()),
                // Listed tiles are all timed in either mode; `fast` tunes nothing on a
                // software adapter such as lavapipe.
                ("MANTISSA_AUTOTUNE", "full"),
            ],
        )
    };
    std::fs::write(
        &list,
        r#"{"wgpu": [{"bm": 32, "bn": 32, "bk": 8}, {"bm": 64, "bn": 64, "bk": 16, "reg": 5}, {"bm": 64, "bn": 32, "bk": 16, "reg": 8}]}"#,
    )
    .unwrap();
    let o = bench(&list);
    if text(&o).contains("backend 'wgpu' is not available") {
        no_adapter("listed tiles", &text(&o));
        return;
    }
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("listed tile 64x64x16 reg 5x5 is dropped"),
        "{}",
        text(&o)
    );
    let stored: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(cache.join("autotune.json")).unwrap())
            .unwrap();
    let (key, choice) = stored.as_object().unwrap().iter().next().unwrap();
    assert!(key.contains("2 candidates"), "{key}");
    let bm = choice["choice"]["bm"].as_u64().unwrap();
    assert!(bm == 32 || bm == 64, "{choice}");
    // A list that cannot be read is refused before anything runs.
    for bad in [
        r#"{"wgpu": []}"#,
        r#"{"vulkan": []}"#,
        "[1, 2]",
        r#"{"wgpu": [{"bn": 64}]}"#,
    ] {
        std::fs::write(&list, bad).unwrap();
        let o = bench(&list);
        assert_eq!(o.status.code(), Some(2), "{bad}: {}", text(&o));
        assert!(
            text(&o).contains("MANTISSA_TUNE_CANDIDATES"),
            "{}",
            text(&o)
        );
    }
}
