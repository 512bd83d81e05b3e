//! What this node can run, probed once when the agent starts: the guest kernel, its modules and
//! the guest init must exist, and each runtime needs its VMM (QEMU from the system, Firecracker
//! from `--firecracker`/`FC_BIN`) and, for Firecracker, a KVM that really boots Linux (a boot
//! probe, never a `stat` of `/dev/kvm`).
//!
//! A problem is not a crash: the agent keeps serving, `/readyz` fails with the problem, and each
//! VM that would need the missing piece gets `Ready=False, reason=RuntimeStartFailed` naming the
//! path and the flag or variable that sets it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use imp_api::shared::VmRuntime;

/// The host files and binaries the agent was configured with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFiles {
    /// Guest kernel (`--kernel`, `FC_KERNEL`).
    pub kernel: PathBuf,
    /// The kernel's modules directory (`--modules`; default `modules` beside the kernel).
    pub modules: PathBuf,
    /// The static guest init (`--guest`, `IMP_GUEST`).
    pub guest: PathBuf,
    /// The Firecracker binary (`--firecracker`, `FC_BIN`).
    pub firecracker: PathBuf,
    /// Firecracker may run without the jailer beside it (`--allow-unjailed-firecracker`):
    /// without it a Firecracker that has none cannot run VMs here
    /// ([`crate::runtime::shim::jailer`]).
    pub allow_unjailed_firecracker: bool,
}

/// The runtime an agent uses for VMs whose class names none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultRuntime {
    /// Firecracker where KVM boots Linux and the binary exists, else QEMU.
    Auto,
    /// Always this one.
    Fixed(VmRuntime),
}

/// The probe's findings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// A problem with the kernel, modules or guest init (every VM needs them).
    pub files: Option<String>,
    /// QEMU's binary, or why there is none.
    pub qemu: Result<PathBuf, String>,
    /// Firecracker's binary, or why it cannot run VMs here.
    pub firecracker: Result<PathBuf, String>,
    /// The runtime for VMs whose class names none.
    pub default_runtime: VmRuntime,
}

impl Capabilities {
    /// Why a VM on `runtime` cannot start here, if it cannot.
    pub fn problem(&self, runtime: VmRuntime) -> Option<String> {
        if let Some(p) = &self.files {
            return Some(p.clone());
        }
        match runtime {
            VmRuntime::Qemu => self.qemu.as_ref().err().cloned(),
            VmRuntime::Firecracker => self.firecracker.as_ref().err().cloned(),
        }
    }

    /// Why the node is not ready (the default runtime cannot start VMs), if so.
    pub fn not_ready(&self) -> Option<String> {
        self.problem(self.default_runtime)
    }
}

/// Checks that a file exists, naming it and how to set it otherwise.
pub fn check_file(what: &str, path: &Path, how: &str) -> Option<String> {
    file_problem(what, path, how, std::fs::metadata(path), false)
}

/// Checks that a program exists and may be executed, naming it and how to set it otherwise.
pub fn check_executable(what: &str, path: &Path, how: &str) -> Option<String> {
    file_problem(what, path, how, std::fs::metadata(path), true)
}

/// What is wrong with `path` as `what`, from its metadata: missing, not a regular file, or
/// (for a program) without an execute bit. The message names the path and `how` to set it,
/// so a log line or a VM's condition says which setting to fix (`FC_BIN`, `FC_KERNEL` …).
fn file_problem(
    what: &str,
    path: &Path,
    how: &str,
    meta: std::io::Result<std::fs::Metadata>,
    program: bool,
) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let path = path.display();
    match meta {
        Ok(m) if !m.is_file() => Some(format!("{what} {path} is not a file: set {how}")),
        Ok(m) if program && m.permissions().mode() & 0o111 == 0 => {
            Some(format!("{what} {path} is not executable: set {how}"))
        }
        Ok(_) => None,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Some(format!("{what} {path} not found: set {how}"))
        }
        Err(e) => Some(format!("{what} {path} cannot be used ({e}): set {how}")),
    }
}

/// What the agent says at startup about a runtime other than the default that cannot run
/// here (today: Firecracker on a node without its binary or a KVM that boots Linux), so that
/// `kubectl logs ds/imp-agent | grep FC_BIN` finds it even where the node runs QEMU: VMs
/// whose class asks for that runtime fail with `RuntimeStartFailed` and the same words.
pub fn unavailable_note(caps: &Capabilities) -> Option<String> {
    if caps.default_runtime == VmRuntime::Firecracker {
        return None;
    }
    let why = caps.firecracker.as_ref().err()?;
    Some(format!(
        "runtime firecracker cannot run VMs on this node: {why}; VMs whose class asks for it \
         fail with RuntimeStartFailed"
    ))
}

/// Why the Firecracker of `files` may not run VMs for want of its jailer, if so; an allowed
/// unconfined Firecracker is warned about once here, and again at every VM's start.
fn unjailed_problem(files: &HostFiles) -> Option<String> {
    use crate::runtime::shim::jailer;
    match jailer::for_binary(&files.firecracker, files.allow_unjailed_firecracker) {
        Ok(jailer::FirecrackerJail::Jailer(_)) => None,
        Ok(jailer::FirecrackerJail::Unjailed) => {
            tracing::warn!(
                firecracker = %files.firecracker.display(),
                opt_out = jailer::ALLOW_UNJAILED_FLAG,
                "no jailer beside Firecracker and unconfined Firecracker allowed: its VMs run as root, unconfined"
            );
            None
        }
        Err(why) => Some(why),
    }
}

/// Probes the node. `cache_dir` remembers the KVM boot probe's answer per kernel.
pub async fn probe(files: &HostFiles, default: DefaultRuntime, cache_dir: &Path) -> Capabilities {
    let file_problem = check_file("guest kernel", &files.kernel, "--kernel or FC_KERNEL")
        .or_else(|| check_file("guest init", &files.guest, "--guest or IMP_GUEST"))
        .or_else(|| {
            (!files.modules.is_dir()).then(|| {
                format!(
                    "kernel modules directory {} does not exist: set --modules",
                    files.modules.display()
                )
            })
        });
    let qemu = match imp_vmm::qemu::Launcher::detect() {
        Ok(l) => Ok(l.qemu),
        Err(e) => Err(e.to_string()),
    };
    let fc_file = check_executable(
        "Firecracker binary",
        &files.firecracker,
        "--firecracker or FC_BIN",
    )
    .or_else(|| unjailed_problem(files));
    // The KVM boot probe matters to Firecracker only: without its binary it is not run.
    let kvm_boots = match (&qemu, &file_problem, &fc_file) {
        (Ok(q), None, None) if imp_vmm::kvm::device_usable() => {
            imp_vmm::kvm::probe_boot_cached(q, &files.kernel, Duration::from_secs(10), cache_dir)
                .await
        }
        _ => false,
    };
    let firecracker = match fc_file {
        Some(p) => Err(p),
        None if !kvm_boots => Err(format!(
            "Firecracker {} needs a KVM that boots Linux guests, and this node's does not \
             (a real boot probe under /dev/kvm failed); use runtime qemu",
            files.firecracker.display()
        )),
        None => Ok(files.firecracker.clone()),
    };
    let default_runtime = match default {
        DefaultRuntime::Fixed(r) => r,
        DefaultRuntime::Auto if firecracker.is_ok() => VmRuntime::Firecracker,
        DefaultRuntime::Auto => VmRuntime::Qemu,
    };
    Capabilities {
        files: file_problem,
        qemu,
        firecracker,
        default_runtime,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_file_names_its_path_and_the_setting() {
        let p = check_file(
            "guest kernel",
            Path::new("/no/such/vmlinux"),
            "--kernel or FC_KERNEL",
        )
        .unwrap_or_default();
        assert!(p.contains("/no/such/vmlinux"), "{p}");
        assert!(p.contains("FC_KERNEL"), "{p}");
        let caps = Capabilities {
            files: None,
            qemu: Ok("/usr/bin/qemu".into()),
            firecracker: Err("Firecracker /x missing: set FC_BIN".into()),
            default_runtime: VmRuntime::Qemu,
        };
        assert_eq!(caps.problem(VmRuntime::Qemu), None);
        assert!(caps.problem(VmRuntime::Firecracker).is_some());
        assert_eq!(caps.not_ready(), None);
        let broken = Capabilities {
            files: Some(p.clone()),
            ..caps
        };
        assert_eq!(broken.problem(VmRuntime::Qemu), Some(p.clone()));
        assert_eq!(broken.not_ready(), Some(p));
    }

    /// The guide's `kubectl logs ds/imp-agent | grep FC_BIN`: a missing, non-executable or
    /// non-file Firecracker binary is named with the variable that sets it.
    #[test]
    fn a_firecracker_binary_that_cannot_run_names_fc_bin() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("imp-caps-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let how = "--firecracker or FC_BIN";
        let missing = check_executable("Firecracker binary", &dir.join("nope"), how).unwrap();
        assert!(
            missing.contains("not found") && missing.contains("FC_BIN"),
            "{missing}"
        );
        let plain = dir.join("firecracker");
        std::fs::write(&plain, b"#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o644)).unwrap();
        let not_exec = check_executable("Firecracker binary", &plain, how).unwrap();
        assert!(
            not_exec.contains("not executable") && not_exec.contains("FC_BIN"),
            "{not_exec}"
        );
        // A data file need not be executable.
        assert_eq!(check_file("guest kernel", &plain, "--kernel"), None);
        std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(check_executable("Firecracker binary", &plain, how), None);
        let a_dir = check_executable("Firecracker binary", &dir, how).unwrap();
        assert!(a_dir.contains("is not a file"), "{a_dir}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A node whose Firecracker has no jailer beside it runs no Firecracker VMs (their start
    /// fails with RuntimeStartFailed and these words), unless the agent was told to allow it.
    #[tokio::test]
    async fn a_firecracker_without_its_jailer_cannot_run_vms_here() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("imp-caps-jail-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("modules")).unwrap();
        let fc = dir.join("firecracker");
        std::fs::write(&fc, b"#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&fc, std::fs::Permissions::from_mode(0o755)).unwrap();
        for f in ["vmlinux", "imp-guest"] {
            std::fs::write(dir.join(f), b"").unwrap();
        }
        let files = HostFiles {
            kernel: dir.join("vmlinux"),
            modules: dir.join("modules"),
            guest: dir.join("imp-guest"),
            firecracker: fc.clone(),
            allow_unjailed_firecracker: false,
        };
        let caps = probe(&files, DefaultRuntime::Auto, &dir.join("cache")).await;
        let why = caps.problem(VmRuntime::Firecracker).unwrap();
        assert!(
            why.contains("without its jailer") && why.contains("--allow-unjailed-firecracker"),
            "{why}"
        );
        assert_eq!(caps.default_runtime, VmRuntime::Qemu, "auto never picks it");
        assert_eq!(
            unjailed_problem(&HostFiles {
                allow_unjailed_firecracker: true,
                ..files.clone()
            }),
            None
        );
        std::fs::write(dir.join("jailer"), b"").unwrap();
        assert_eq!(unjailed_problem(&files), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_unusable_firecracker_is_noted_unless_it_is_the_default() {
        let why = "Firecracker binary /x not found: set --firecracker or FC_BIN".to_owned();
        let qemu_node = Capabilities {
            files: None,
            qemu: Ok("/usr/bin/qemu".into()),
            firecracker: Err(why.clone()),
            default_runtime: VmRuntime::Qemu,
        };
        let note = unavailable_note(&qemu_node).unwrap();
        assert!(
            note.contains(&why) && note.contains("RuntimeStartFailed"),
            "{note}"
        );
        // As the default runtime the problem is the node's readiness, said there.
        let fc_node = Capabilities {
            default_runtime: VmRuntime::Firecracker,
            ..qemu_node.clone()
        };
        assert_eq!(unavailable_note(&fc_node), None);
        assert_eq!(fc_node.not_ready(), Some(why));
        let fine = Capabilities {
            firecracker: Ok("/usr/local/bin/firecracker".into()),
            ..qemu_node
        };
        assert_eq!(unavailable_note(&fine), None);
    }
}
