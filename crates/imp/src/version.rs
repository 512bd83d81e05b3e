//! `imp version`: what a bug report needs first: imp's version and commit, and what this
//! machine would run a local VM with: the QEMU and Firecracker binaries and their versions, the
//! guest kernel and init `imp run` would boot, and whether KVM can run Linux guests here (the
//! same cached boot probe `imp run` consults).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use clap::Args;
use imp_agent::runtime::state::StateDir;

use crate::args::Common;
use crate::local::run::locate;

/// `imp version`.
#[derive(Args, Debug)]
pub struct VersionArgs {
    /// Do not run the KVM boot probe when it has no remembered answer (it may take 10 s).
    #[arg(long)]
    pub no_probe: bool,
    #[command(flatten)]
    common: Common,
}

/// The commit this binary was built from (from `build.rs`).
pub const COMMIT: &str = env!("IMP_GIT_COMMIT");

/// `imp version`: prints one `what: value` line per thing found.
pub fn main(args: VersionArgs) -> anyhow::Result<()> {
    let mut out = String::new();
    let mut line = |what: &str, value: String| {
        let _ = writeln!(out, "{:<12} {value}", format!("{what}:"));
    };
    line(
        "imp",
        format!("{} (commit {COMMIT})", env!("CARGO_PKG_VERSION")),
    );
    let qemu = imp_vmm::qemu::Launcher::detect().ok().map(|l| l.qemu);
    line(
        "qemu",
        match &qemu {
            Some(path) => tool_version(path, &["--version"]),
            None => "not found (apt-get install qemu-system-x86)".into(),
        },
    );
    for kept in imp_vmm::qemu::kept_binaries() {
        line("qemu kept", tool_version(&kept, &["--version"]));
    }
    let firecracker = locate(
        "firecracker",
        None,
        "IMP_FIRECRACKER",
        "firecracker/firecracker",
    )
    .ok()
    .or_else(|| on_path("firecracker"));
    line(
        "firecracker",
        match &firecracker {
            Some(path) => tool_version(path, &["--version"]),
            None => "not found (IMP_FIRECRACKER, or target/firecracker/firecracker; scripts/test \
                     fetches it)"
                .into(),
        },
    );
    let kernel = locate("guest kernel", None, "IMP_KERNEL", "guest-kernel/vmlinux");
    line(
        "kernel",
        match &kernel {
            Ok(path) => match kernel_version(path) {
                Some(v) => format!("{} (Linux {v})", path.display()),
                None => format!("{} (no Linux version string found)", path.display()),
            },
            Err(e) => format!("{e:#}"),
        },
    );
    line(
        "guest init",
        match locate("guest init", None, "IMP_GUEST", "imp-guest/imp-guest") {
            Ok(path) => tool_version(&path, &["--version"]),
            Err(e) => format!("{e:#}"),
        },
    );
    let state = StateDir::resolve(args.common.state_dir)?;
    line(
        "kvm",
        kvm_verdict(
            qemu.as_deref(),
            kernel.as_deref().ok(),
            &state,
            args.no_probe,
        )?,
    );
    line("state", state.root().display().to_string());
    print!("{out}");
    Ok(())
}

/// `/path (first line of its --version)`, or why it could not be asked.
fn tool_version(path: &Path, args: &[&str]) -> String {
    match Command::new(path).args(args).output() {
        Ok(out) => {
            // imp-guest says its version on stderr (it is not a plain command-line tool).
            let text = [out.stdout, out.stderr].concat();
            let text = String::from_utf8_lossy(&text);
            let first = text.lines().map(str::trim).find(|l| !l.is_empty());
            match first {
                Some(v) => format!("{} ({v})", path.display()),
                None => format!("{} (its --version printed nothing)", path.display()),
            }
        }
        Err(e) => format!("{} (cannot run it: {e})", path.display()),
    }
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// The kernel's release from its `Linux version …` banner (an ELF vmlinux holds it as it is; a
/// bzImage names it in its setup header).
fn kernel_version(path: &Path) -> Option<String> {
    let bytes = std::fs::read(path).ok()?;
    const BANNER: &[u8] = b"Linux version ";
    if let Some(at) = bytes.windows(BANNER.len()).position(|w| w == BANNER) {
        return word_at(&bytes, at + BANNER.len());
    }
    // bzImage: "HdrS" at 0x202, the version string's offset (from 0x200) at 0x20e.
    if bytes.get(0x202..0x206) == Some(b"HdrS") {
        let off = u16::from_le_bytes([*bytes.get(0x20e)?, *bytes.get(0x20f)?]);
        return word_at(&bytes, usize::from(off) + 0x200);
    }
    None
}

/// The printable word starting at `at`.
fn word_at(bytes: &[u8], at: usize) -> Option<String> {
    let rest = bytes.get(at..)?;
    let end = rest
        .iter()
        .position(|&b| !b.is_ascii_graphic())
        .unwrap_or(rest.len().min(128));
    (end > 0).then(|| String::from_utf8_lossy(&rest[..end]).into_owned())
}

/// Whether local VMs would run under KVM, and why.
fn kvm_verdict(
    qemu: Option<&Path>,
    kernel: Option<&Path>,
    state: &StateDir,
    no_probe: bool,
) -> anyhow::Result<String> {
    use imp_vmm::kvm;
    if let Ok(accel) = std::env::var("IMP_QEMU_ACCEL") {
        return Ok(format!("IMP_QEMU_ACCEL={accel} chooses, no probe"));
    }
    if !kvm::device_usable() {
        return Ok("no: /dev/kvm cannot be opened read-write; QEMU uses TCG (software)".into());
    }
    let (Some(qemu), Some(kernel)) = (qemu, kernel) else {
        return Ok(
            "unknown: /dev/kvm opens, but the boot probe needs QEMU and a guest kernel".into(),
        );
    };
    let cache = state.cache();
    let cached = kvm::cached_verdict(kernel, &cache);
    if no_probe && cached.is_none() {
        return Ok("unknown: /dev/kvm opens; not probed yet (--no-probe)".into());
    }
    let boots = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(kvm::probe_boot_cached(
            qemu,
            kernel,
            std::time::Duration::from_secs(10),
            &cache,
        ));
    let how = if cached.is_some() {
        "boot probe, cached"
    } else {
        "boot probe"
    };
    Ok(if boots {
        format!("yes: the guest kernel boots under KVM ({how}); QEMU uses KVM")
    } else {
        format!(
            "no: /dev/kvm opens, but the guest kernel does not boot under it ({how}); QEMU uses \
             TCG (software)"
        )
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_kernel_release_is_read_from_its_banner_or_header() {
        let dir = std::env::temp_dir().join(format!("imp-version-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let elf = dir.join("vmlinux");
        let mut data = vec![0u8; 4096];
        data.extend_from_slice(b"Linux version 6.1.0-57-cloud-amd64 (debian-kernel@lists)\0");
        std::fs::write(&elf, &data).unwrap();
        assert_eq!(
            kernel_version(&elf).as_deref(),
            Some("6.1.0-57-cloud-amd64")
        );
        let bz = dir.join("bzImage");
        let mut data = vec![0u8; 0x1000];
        data[0x202..0x206].copy_from_slice(b"HdrS");
        data[0x20e..0x210].copy_from_slice(&0x0d00u16.to_le_bytes());
        data[0xf00..0xf0c].copy_from_slice(b"6.12.3-imp #");
        std::fs::write(&bz, &data).unwrap();
        assert_eq!(kernel_version(&bz).as_deref(), Some("6.12.3-imp"));
        std::fs::write(&bz, b"nothing").unwrap();
        assert_eq!(kernel_version(&bz), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
