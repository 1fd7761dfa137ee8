//! The `cifpool-tools` binary; everything lives in the library.

/// The allocator of the `cifpool` binary: the benches, the lab and the simulator run the service inside
/// this process, and under the system allocator they measured a service that production never runs
/// (the allocator's own work was 7 % of the service's CPU in a reservation run under glibc's).
#[cfg(all(unix, not(target_env = "musl")))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    cifpool_tools::cli::main()
}
