//! The `cifpool-tools` binary; everything lives in the library.

fn main() -> std::process::ExitCode {
    cifpool_tools::cli::main()
}
