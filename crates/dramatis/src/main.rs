//! dramatis: the one binary. CLI parsing and wiring only; every command's work lives in a crate.

mod bench;
mod caps;
mod cli;
mod fixture;
mod gpu;
mod synth_codec;

fn main() -> std::process::ExitCode {
    cli::main()
}
