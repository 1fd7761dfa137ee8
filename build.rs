//! Records the git commit the binary is built from, for `cifpool_build_info{git_sha}` and `--version`:
//! `CIFPOOL_GIT_SHA` if set (an image build without `.git` passes it), else `git rev-parse`, else
//! `unknown`. Also rebuilds the crate when a migration is added, removed or edited: `sqlx::migrate!`
//! embeds the directory at compile time and cannot ask Cargo to watch it on a stable compiler.

use std::path::Path;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=CIFPOOL_GIT_SHA");
    println!("cargo:rerun-if-changed=migrations");
    // Re-run when HEAD moves; only for files that exist (a missing one would re-run every build).
    let head = Path::new(".git/HEAD");
    if head.exists() {
        println!("cargo:rerun-if-changed=.git/HEAD");
        if let Ok(text) = std::fs::read_to_string(head)
            && let Some(reference) = text.trim().strip_prefix("ref: ")
            && Path::new(".git").join(reference).exists()
        {
            println!("cargo:rerun-if-changed=.git/{reference}");
        }
    }
    let sha = std::env::var("CIFPOOL_GIT_SHA").ok().filter(|s| !s.is_empty()).or_else(|| {
        let out = Command::new("git").args(["rev-parse", "--short=12", "HEAD"]).output().ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    });
    println!("cargo:rustc-env=CIFPOOL_GIT_SHA={}", sha.unwrap_or_else(|| "unknown".into()));
}
