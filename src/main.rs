//! The `mantissa` command-line tool.

fn main() {
    std::process::exit(mantissa::cli::main());
}
