//! The workspace's example programs as test subjects: the path of one, built first when it is
//! missing or older than its sources, so a test that runs it never passes for want of it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace's root directory (the examples and `scripts/` live there).
pub(crate) fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `<target>/<profile>/examples/<name>` of the test executable running now, built with
/// `cargo build --example <name>` (same profile and target directory) when it is missing or
/// older than any `.rs` file under `examples/`, `src/` and `crates/*/src/` of `workspace_root`.
///
/// `cargo test --workspace` builds every example next to the test binaries, so this builds
/// nothing then; a narrower `cargo test --test X` after an edit does not, and this catches up.
///
/// # Panics
///
/// When cargo cannot build it: the test fails, saying how to build it by hand.
pub fn example_binary(workspace_root: &Path, name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("path of the test executable");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("a test executable lives in <target>/<profile>/deps");
    let bin = profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    if is_stale(&bin, workspace_root) {
        build(workspace_root, profile_dir, name);
    }
    assert!(
        bin.exists(),
        "{} does not exist; build it with `cargo build --example {name}`",
        bin.display()
    );
    bin
}

/// `<target>/<profile>/<bin>` of the test executable running now: binary `bin` of workspace
/// package `package` (for instance the CLI, `redeliver` of `redeliver-cli`), built with
/// `cargo build -p <package> --bin <bin>` (same profile and target directory) when it is missing
/// or older than any source, as [`example_binary`] does for examples.
///
/// # Panics
///
/// When cargo cannot build it.
pub fn package_binary(workspace_root: &Path, package: &str, bin: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("path of the test executable");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("a test executable lives in <target>/<profile>/deps");
    let path = profile_dir.join(format!("{bin}{}", std::env::consts::EXE_SUFFIX));
    if is_stale(&path, workspace_root) {
        run_cargo(
            workspace_root,
            profile_dir,
            &["build", "--quiet", "-p", package, "--bin", bin],
            &format!("the {bin} binary of {package}"),
        );
    }
    assert!(
        path.exists(),
        "{} does not exist; build it with `cargo build -p {package} --bin {bin}`",
        path.display()
    );
    path
}

/// Missing, or older than a source it is built from. Only then is cargo run: building one
/// example resolves features for its package alone, so doing it right after
/// `cargo test --workspace` built it would rebuild it for nothing.
fn is_stale(bin: &Path, root: &Path) -> bool {
    let Ok(built) = std::fs::metadata(bin).and_then(|m| m.modified()) else {
        return true;
    };
    let newer = |p: &Path| {
        std::fs::metadata(p)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t > built)
    };
    // The whole examples directory: an example's modules live in subdirectories.
    let mut dirs = vec![root.join("src"), root.join("examples")];
    if let Ok(crates) = std::fs::read_dir(root.join("crates")) {
        dirs.extend(crates.flatten().map(|c| c.path().join("src")));
    }
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|x| x == "rs") && newer(&path) {
                return true;
            }
        }
    }
    false
}

fn build(root: &Path, profile_dir: &Path, name: &str) {
    run_cargo(
        root,
        profile_dir,
        &["build", "--quiet", "--example", name],
        &format!("the {name} example"),
    );
}

fn run_cargo(root: &Path, profile_dir: &Path, args: &[&str], what: &str) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root).args(args);
    // Same profile as this test binary: `release` when it was built with --release.
    if profile_dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    if let Some(target_dir) = profile_dir.parent() {
        cmd.env("CARGO_TARGET_DIR", target_dir);
    }
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run cargo to build {what}: {e}"));
    assert!(status.success(), "cargo {} failed", args.join(" "));
}
