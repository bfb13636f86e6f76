//! The examples (examples/*.rs, built with the tests): each trains its model from the command
//! line on the reference and on wgpu (lavapipe here) under a mixed preset, with what it
//! claims: the spirals MLP past 95% accuracy, the language models' validation loss falling; a
//! bad argument exits 2.

mod common;

use std::process::Command;

/// The built example `name` (target/<profile>/examples/, beside the test executables' deps/).
fn example(name: &str) -> Command {
    let exe = std::env::current_exe().expect("the test executable's path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>");
    let mut cmd = Command::new(dir.join("examples").join(name));
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"));
    cmd
}

/// `name` run with `args` on `backend`: its standard output, after checking it succeeded.
fn run(name: &str, backend: &str, args: &[&str]) -> String {
    let out = example(name)
        .args(["--backend", backend])
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!("{name}: {e} (built? `cargo build --examples`, as scripts/test.sh does)")
        });
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{name} on {backend}: {:?}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The numbers after `label` in `text` ("accuracy 99.8%" -> 99.8).
fn numbers_after(text: &str, label: &str) -> Vec<f64> {
    let line = text
        .lines()
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("no {label:?} in {text}"));
    line[label.len()..]
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|w| w.parse().ok())
        .collect()
}

/// The MLP tells the spirals apart: past 95% on its training points and on fresh ones, in the
/// example's 400 full-batch steps.
fn mlp_learns_the_spirals(backend: &str) {
    let text = run("mlp", backend, &["--precision", "bf16-mixed"]);
    let accuracy = numbers_after(&text, "accuracy");
    assert!(
        accuracy[0] >= 95.0 && accuracy[1] >= 95.0,
        "mlp on {backend}: {text}"
    );
}

/// The language model example `name`: its validation loss falls in a few steps.
fn language_model_learns(name: &str, backend: &str) {
    let text = run(
        name,
        backend,
        &["--precision", "bf16-mixed", "--steps", "3"],
    );
    let loss = numbers_after(&text, "validation loss");
    assert!(loss[1] < loss[0], "{name} on {backend}: {text}");
}

/// Every example on `backend`, each its own process, run side by side (on lavapipe each
/// spends most of its time compiling kernels on one core).
fn examples_learn(backend: &str) {
    std::thread::scope(|s| {
        s.spawn(|| mlp_learns_the_spirals(backend));
        for name in ["custom_block", "char_gpt"] {
            s.spawn(move || language_model_learns(name, backend));
        }
    });
}

#[test]
fn examples_learn_on_the_reference() {
    examples_learn("reference");
}

#[test]
fn examples_learn_on_wgpu() {
    common::on(common::wgpu(), "examples_learn_on_wgpu", |_| {
        examples_learn("wgpu");
    });
}

#[test]
fn a_bad_argument_exits_2() {
    for args in [["--precision", "fp64"], ["--steps", "-1"]] {
        let out = example("mlp").args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
    }
}
