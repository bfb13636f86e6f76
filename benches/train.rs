//! Training-step benchmark: every preset on every backend present (CUDA, wgpu, the reference),
//! written to target/bench-train.json: step time, tokens/s and peak memory.
//! `cargo bench --bench train` measures `small` (`MANTISSA_BENCH_CONFIG` to change it); under
//! `cargo test` (no `--bench` argument) it runs one step of two presets on `tiny` as a smoke test.

use mantissa::backend::{self, BackendChoice, BackendKind};
use mantissa::bench::TrainBench;
use mantissa::policy::Preset;
use mantissa::train::{Corpus, GptConfig};
use pollster::FutureExt as _;

fn main() {
    let measuring = std::env::args().any(|a| a == "--bench");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let fail = |what: &str, e: &dyn std::fmt::Display| -> ! {
        eprintln!("{what}: {e}");
        std::process::exit(1)
    };
    let corpus =
        Corpus::load(&root.join("data/shakespeare.txt")).unwrap_or_else(|e| fail("corpus", &e));
    let name = std::env::var("MANTISSA_BENCH_CONFIG")
        .unwrap_or_else(|_| if measuring { "small" } else { "tiny" }.into());
    let config = GptConfig::named(&name, corpus.vocab.len()).unwrap_or_else(|e| fail("config", &e));
    let bench = TrainBench {
        config,
        presets: if measuring {
            Preset::ALL.to_vec()
        } else {
            vec![Preset::True32, Preset::MixedBf16]
        },
        warmup: if measuring { 3 } else { 1 },
        steps: if measuring { 20 } else { 1 },
        seed: 1,
        attention: None,
        graphs: None,
        profile: 0,
        grad_accum: 1,
    };
    let mut records = Vec::new();
    for kind in [BackendKind::Cuda, BackendKind::Wgpu, BackendKind::Reference] {
        // The reference runs `small` at seconds a step: measured only when asked for.
        if measuring && kind == BackendKind::Reference && name != "tiny" {
            continue;
        }
        match backend::open(BackendChoice::Only(kind)).block_on() {
            Ok(b) => match bench
                .run(b.as_ref(), &corpus, |r| {
                    println!(
                        "{:<40} {:<18} {:<8} {:>9.2} ms/step {:>10.0} tokens/s  peak {:>8.1} MiB ({:.2}x plan)",
                        r.backend,
                        r.preset,
                        r.attention,
                        r.step_seconds * 1e3,
                        r.tokens_per_second,
                        r.memory.peak_bytes as f64 / (1u64 << 20) as f64,
                        r.memory.overhead()
                    )
                })
                .block_on()
            {
                Ok(r) => records.extend(r),
                Err(e) => fail(&kind.to_string(), &e),
            },
            Err(e) => println!("skipped {kind}: {e}"),
        }
    }
    if measuring {
        let path = root.join("target/bench-train.json");
        match serde_json::to_string_pretty(&records).map(|t| std::fs::write(&path, t)) {
            Ok(Ok(())) => println!("wrote {}", path.display()),
            Ok(Err(e)) => eprintln!("could not write {}: {e}", path.display()),
            Err(e) => eprintln!("could not serialise: {e}"),
        }
    }
}
