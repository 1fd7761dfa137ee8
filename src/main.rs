//! The `cifpool` binary; everything lives in the library.

fn main() -> std::process::ExitCode {
    cifpool::cli::main()
}
