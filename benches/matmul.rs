//! Matmul benchmark: every algorithm on every backend present, written to
//! target/bench-matmul.json. `cargo bench --bench matmul` measures; under `cargo test` (no
//! `--bench` argument) it runs one tiny size as a smoke test.

use mantissa::algorithm::Algorithm;
use mantissa::backend::{self, BackendChoice, BackendKind, Operands};
use mantissa::bench::MatmulBench;
use pollster::FutureExt as _;

fn main() {
    let measuring = std::env::args().any(|a| a == "--bench");
    let sizes: Vec<usize> = std::env::var("MANTISSA_BENCH_SIZES")
        .ok()
        .map(|s| s.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| {
            if measuring {
                vec![256, 512, 1024]
            } else {
                vec![33]
            }
        });
    let bench = MatmulBench {
        shapes: sizes.iter().map(|&n| (n, n, n)).collect(),
        algorithms: Algorithm::ALL.to_vec(),
        // From f32 operands, and from operands held in their format (the product alone).
        operands: Operands::ALL.to_vec(),
        repetitions: if measuring { 5 } else { 1 },
        error_rows: 16,
        seed: 7,
        contract_check_limit: 1 << 24,
    };
    let mut records = Vec::new();
    for kind in [BackendKind::Cuda, BackendKind::Wgpu, BackendKind::Reference] {
        match backend::open(BackendChoice::Only(kind)).block_on() {
            Ok(b) => match bench
                .run(b.as_ref(), |r| {
                    println!(
                        "{:<40} {:<10} {:<8} n={:<5} {:>10.3} ms {:>9.4} TFLOP/s  err {:.2e}",
                        r.backend,
                        r.algorithm,
                        r.operands,
                        r.n,
                        r.seconds * 1e3,
                        r.tflops,
                        r.relative_error
                    )
                })
                .block_on()
            {
                Ok(r) => records.extend(r),
                Err(e) => {
                    eprintln!("{kind}: {e}");
                    std::process::exit(1);
                }
            },
            Err(e) => println!("skipped {kind}: {e}"),
        }
    }
    if measuring {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-matmul.json");
        match serde_json::to_string_pretty(&records).map(|t| std::fs::write(&path, t)) {
            Ok(Ok(())) => println!("wrote {}", path.display()),
            Ok(Err(e)) => eprintln!("could not write {}: {e}", path.display()),
            Err(e) => eprintln!("could not serialise: {e}"),
        }
    }
}
