//! The guest configuration file (`/.imp/config.json`): what the host writes is what the guest
//! reads, because both use these types.

use serde::{Deserialize, Serialize};
use std::net::{IpAddr, Ipv4Addr};

/// Where the host puts the config inside the rootfs and where the guest looks first.
pub const CONFIG_PATH: &str = "/.imp/config.json";

/// The PATH a workload gets when neither the image nor the VM sets one.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Why a config file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// It is not JSON of the expected shape.
    #[error("Guest config is not valid JSON of the expected shape")]
    Json(#[from] serde_json::Error),
    /// A field holds a value that cannot work.
    #[error("Guest config field `{field}` is invalid: {reason}")]
    Invalid {
        /// The field's path, e.g. `network.prefix_len`.
        field: String,
        /// Why.
        reason: String,
    },
}

/// One environment variable (of the workload, or added to an exec), kept in order so later entries override earlier ones.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvVar {
    /// The variable's name (no `=`).
    pub name: String,
    /// The variable's value.
    #[serde(default)]
    pub value: String,
}

impl EnvVar {
    /// Builds a variable from a name and a value.
    pub fn new(name: impl Into<String>, value: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            value: value.into(),
        }
    }
}

/// Everything the guest init needs to know about its VM and workload.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct GuestConfig {
    /// The hostname to set (the VM's name).
    pub hostname: Option<String>,
    /// Kernel modules to load, by path inside the guest, in this order (dependencies first).
    pub modules: Vec<String>,
    /// The static network setup of eth0; none means loopback only.
    pub network: Option<NetworkConfig>,
    /// The OCI image config's process fields.
    pub image: ImageConfig,
    /// Replaces the image's ENTRYPOINT (and drops its CMD unless `args` is set), like a Pod's
    /// `command`.
    pub command: Option<Vec<String>>,
    /// Replaces the image's CMD, like a Pod's `args`.
    pub args: Option<Vec<String>>,
    /// The VM's environment, applied over the image's `Env` (later entries win).
    pub env: Vec<EnvVar>,
    /// The guest agent's vsock settings.
    pub agent: AgentConfig,
    /// What the guest does once the workload has ended.
    pub on_exit: PowerAction,
    /// The image's disk, made the guest's `/` before the workload starts; none keeps the
    /// initramfs (or the kernel's root device) as `/`.
    pub root: Option<RootDisk>,
    /// The init starts no workload of its own: the host runs it as an exec session with the
    /// user's terminal attached (`imp run -i/-t`), and the VM runs until asked to shut down.
    pub attach: bool,
    /// The VM's user data (`ImpVM.spec.userData`), parsed and checked by the node agent:
    /// applied by the init as root once the root disk is in place and before the workload
    /// starts; a failing step ends the VM without starting the workload ([`UserData`]).
    ///
    /// Absent in configs written before it existed (no user data). A guest built before it
    /// existed ignores it (the config's unknown fields are ignored), so a node must run a
    /// guest at least as new as its agent for user data to run.
    pub user_data: Option<UserData>,
}

impl GuestConfig {
    /// The workload's argv: `command` replaces ENTRYPOINT (and CMD unless `args` is set);
    /// `args` replaces CMD; the same rules as a Pod's command/args over an image. `None` when
    /// that leaves nothing to run.
    pub fn argv(&self) -> Option<Vec<String>> {
        let argv: Vec<String> = match (&self.command, &self.args) {
            (Some(cmd), args) => cmd.iter().chain(args.iter().flatten()).cloned().collect(),
            (None, Some(args)) => self.image.entrypoint.iter().chain(args).cloned().collect(),
            (None, None) => self
                .image
                .entrypoint
                .iter()
                .chain(&self.image.cmd)
                .cloned()
                .collect(),
        };
        (!argv.is_empty()).then_some(argv)
    }
}

/// The block device that holds the image's root filesystem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootDisk {
    /// The device node, e.g. `/dev/vda`.
    pub device: String,
    /// Its filesystem type, e.g. `ext4`.
    #[serde(default = "default_fstype")]
    pub fstype: String,
    /// Mount options passed to the filesystem (`data`), e.g. `errors=remount-ro`.
    #[serde(default)]
    pub options: Option<String>,
}

impl RootDisk {
    /// An ext4 root disk on `device`.
    pub fn ext4(device: impl Into<String>) -> Self {
        Self {
            device: device.into(),
            fstype: default_fstype(),
            options: None,
        }
    }
}

fn default_fstype() -> String {
    "ext4".to_string()
}

/// The process fields of an OCI image config.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ImageConfig {
    /// `Entrypoint`.
    pub entrypoint: Vec<String>,
    /// `Cmd`.
    pub cmd: Vec<String>,
    /// `Env`, as `NAME=value` strings.
    pub env: Vec<String>,
    /// `WorkingDir`; empty means `/`.
    pub working_dir: Option<String>,
    /// `User`: `uid`, `uid:gid`, `name` or `name:group`; empty means root.
    pub user: Option<String>,
}

/// A static IPv4 setup for one interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkConfig {
    /// The interface to configure.
    #[serde(default = "default_interface")]
    pub interface: String,
    /// The VM's address.
    pub address: Ipv4Addr,
    /// The prefix length of its subnet (0..=32).
    pub prefix_len: u8,
    /// The default route's next hop.
    #[serde(default)]
    pub gateway: Option<Ipv4Addr>,
    /// Name servers for `/etc/resolv.conf`.
    #[serde(default)]
    pub dns: Vec<IpAddr>,
    /// Search domains for `/etc/resolv.conf`.
    #[serde(default)]
    pub search: Vec<String>,
    /// The MTU, if not the driver's default.
    #[serde(default)]
    pub mtu: Option<u32>,
}

fn default_interface() -> String {
    "eth0".to_string()
}

/// The guest agent's vsock settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct AgentConfig {
    /// Whether to serve the exec/health/metrics API at all.
    pub enabled: bool,
    /// The vsock port the API listens on.
    pub port: u32,
    /// The host port (CID 2) to report the workload's exit to; none means no report.
    pub exit_report_port: Option<u32>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            port: crate::DEFAULT_API_PORT,
            exit_report_port: None,
        }
    }
}

/// How the guest ends once its workload has ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PowerAction {
    /// `reboot(RB_POWER_OFF)`: QEMU exits (ACPI); the default.
    #[default]
    PowerOff,
    /// `reboot(RB_AUTOBOOT)`: for VMMs that exit on reset (Firecracker with `reboot=k`,
    /// QEMU with `-no-reboot`).
    Reboot,
}

/// Where the init writes a user-data script before it runs it (mode 0700).
pub const USER_DATA_SCRIPT: &str = "/run/imp/user-data";

/// A VM's user data in the form the guest applies: a `#!` script, or the `#cloud-config`
/// subset imp runs itself (`write_files`, then `users`, then `runcmd`). The node agent turns
/// the ConfigMap's text into this (`imp_agent::node::userdata`); [`UserData::validate`] holds
/// the rules both sides rely on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UserData {
    /// A script starting with `#!`: written to [`USER_DATA_SCRIPT`] and executed.
    Script(String),
    /// The `#cloud-config` subset.
    CloudConfig(CloudConfig),
}

/// The `#cloud-config` keys imp supports, applied in this order.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct CloudConfig {
    /// Files to write (parent directories are created).
    pub write_files: Vec<WriteFile>,
    /// Accounts to add (`/etc/passwd`, `/etc/group`, home, SSH keys).
    pub users: Vec<UserAccount>,
    /// Commands to run in order, as root, from `/`.
    pub runcmd: Vec<RunCommand>,
}

/// One entry of `write_files`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteFile {
    /// The file's absolute path in the guest.
    pub path: String,
    /// The content, as [`WriteFile::encoding`] says.
    #[serde(default)]
    pub content: String,
    /// How `content` is encoded.
    #[serde(default)]
    pub encoding: ContentEncoding,
    /// The file's mode bits (`permissions: '0644'`).
    #[serde(default = "default_file_mode")]
    pub permissions: u32,
    /// `user:group` (names or numbers) to own the file; none keeps root's.
    #[serde(default)]
    pub owner: Option<String>,
}

fn default_file_mode() -> u32 {
    0o644
}

/// How a written file's content is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContentEncoding {
    /// The text as it is.
    #[default]
    Text,
    /// Standard base64 (cloud-init's `b64`).
    Base64,
}

/// One entry of `users`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct UserAccount {
    /// The login name.
    pub name: String,
    /// The uid; none takes the first free one from 1000.
    pub uid: Option<u32>,
    /// The login shell; none is `/bin/sh`.
    pub shell: Option<String>,
    /// The home directory; none is `/home/<name>`.
    pub homedir: Option<String>,
    /// Supplementary groups (created when missing).
    pub groups: Vec<String>,
    /// Lines for `~/.ssh/authorized_keys`.
    pub ssh_authorized_keys: Vec<String>,
}

/// One entry of `runcmd`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunCommand {
    /// A string: run with `/bin/sh -c`.
    Shell(String),
    /// A list: run as this argv (the program found on PATH).
    Argv(Vec<String>),
}

impl RunCommand {
    /// The argv that runs it.
    pub fn argv(&self) -> Vec<String> {
        match self {
            Self::Shell(s) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
            Self::Argv(a) => a.clone(),
        }
    }
}

/// A user-data value that cannot work: the field in cloud-config terms (`write_files[0].path`)
/// and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserDataInvalid {
    /// The field, e.g. `users[1].name`.
    pub field: String,
    /// Why.
    pub reason: String,
}

/// Whether `name` can be an account or group name: 1-32 of `A-Za-z0-9._-`, not starting with
/// `-` (what `useradd` accepts and nothing that breaks `/etc/passwd`).
pub fn valid_account_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 32
        && !name.starts_with('-')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

impl UserData {
    /// Checks what the guest relies on: absolute paths without `..`, modes within `0o7777`,
    /// owners as `user:group`, account fields that cannot break `/etc/passwd`, no empty
    /// command, no NUL anywhere.
    pub fn validate(&self) -> Result<(), UserDataInvalid> {
        let bad = |field: String, reason: String| Err(UserDataInvalid { field, reason });
        let c = match self {
            Self::Script(s) if !s.starts_with("#!") => {
                return bad("script".into(), "does not start with #!".into());
            }
            Self::Script(s) if s.contains('\0') => {
                return bad("script".into(), "holds a NUL byte".into());
            }
            Self::Script(_) => return Ok(()),
            Self::CloudConfig(c) => c,
        };
        let absolute = |p: &str| {
            p.starts_with('/')
                && p.len() > 1
                && !p.contains('\0')
                && !p.split('/').any(|part| part == "..")
        };
        let passwd_field = |v: &str| !v.contains([':', '\n', '\r', '\0']);
        for (i, f) in c.write_files.iter().enumerate() {
            if !absolute(&f.path) || f.path.ends_with('/') {
                return bad(
                    format!("write_files[{i}].path"),
                    format!("{:?} is not an absolute file path without '..'", f.path),
                );
            }
            if f.permissions > 0o7777 {
                return bad(
                    format!("write_files[{i}].permissions"),
                    format!("{:o} is more than 7777", f.permissions),
                );
            }
            if let Some(o) = &f.owner
                && !matches!(o.split_once(':'), Some((u, g)) if !u.is_empty() && !g.is_empty()
                    && !g.contains(':') && passwd_field(u) && passwd_field(g))
            {
                return bad(
                    format!("write_files[{i}].owner"),
                    format!("{o:?} is not user:group"),
                );
            }
            if f.content.contains('\0') && f.encoding == ContentEncoding::Text {
                return bad(
                    format!("write_files[{i}].content"),
                    "holds a NUL byte (use encoding: b64 for binary content)".into(),
                );
            }
        }
        for (i, u) in c.users.iter().enumerate() {
            if !valid_account_name(&u.name) {
                return bad(
                    format!("users[{i}].name"),
                    format!(
                        "{:?} is not 1-32 of A-Z a-z 0-9 . _ - (not starting with -)",
                        u.name
                    ),
                );
            }
            for (key, v) in [("shell", &u.shell), ("homedir", &u.homedir)] {
                if let Some(v) = v
                    && !(absolute(v) && passwd_field(v))
                {
                    return bad(
                        format!("users[{i}].{key}"),
                        format!("{v:?} is not an absolute path without ':' or '..'"),
                    );
                }
            }
            for (j, g) in u.groups.iter().enumerate() {
                if !valid_account_name(g) {
                    return bad(
                        format!("users[{i}].groups[{j}]"),
                        format!("{g:?} is not a group name"),
                    );
                }
            }
            for (j, k) in u.ssh_authorized_keys.iter().enumerate() {
                if k.trim().is_empty() || k.contains(['\n', '\r', '\0']) {
                    return bad(
                        format!("users[{i}].ssh_authorized_keys[{j}]"),
                        "is empty or not one line".into(),
                    );
                }
            }
        }
        for (i, r) in c.runcmd.iter().enumerate() {
            let argv = r.argv();
            let empty = match r {
                RunCommand::Shell(s) => s.trim().is_empty(),
                RunCommand::Argv(a) => a.first().is_none_or(|p| p.is_empty()),
            };
            if empty {
                return bad(format!("runcmd[{i}]"), "is empty".into());
            }
            if argv.iter().any(|a| a.contains('\0')) {
                return bad(format!("runcmd[{i}]"), "holds a NUL byte".into());
            }
        }
        Ok(())
    }
}

impl GuestConfig {
    /// Parses and validates a config file's contents.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        let config: GuestConfig = serde_json::from_slice(bytes)?;
        config.validate()?;
        Ok(config)
    }

    /// Serializes the config as the host writes it.
    pub fn to_json(&self) -> Result<Vec<u8>, ConfigError> {
        self.validate()?;
        Ok(serde_json::to_vec_pretty(self)?)
    }

    /// Checks the values that parsing alone cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field: &str, reason: String| {
            Err(ConfigError::Invalid {
                field: field.to_string(),
                reason,
            })
        };
        if let Some(h) = &self.hostname
            && (h.is_empty() || h.len() > 64 || h.contains(['/', '\0', ' ']))
        {
            return invalid(
                "hostname",
                format!("{h:?} is not a hostname (1-64 chars, no '/', spaces or NUL)"),
            );
        }
        for (i, m) in self.modules.iter().enumerate() {
            if !m.starts_with('/') {
                return invalid(
                    &format!("modules[{i}]"),
                    format!("{m:?} is not an absolute path"),
                );
            }
        }
        if let Some(r) = &self.root
            && (!r.device.starts_with("/dev/") || r.fstype.is_empty())
        {
            return invalid(
                "root",
                format!("device {:?} must be under /dev/ and fstype set", r.device),
            );
        }
        if let Some(n) = &self.network {
            if n.prefix_len > 32 {
                return invalid(
                    "network.prefix_len",
                    format!("{} is more than 32", n.prefix_len),
                );
            }
            if n.interface.is_empty() || n.interface.len() > 15 {
                return invalid(
                    "network.interface",
                    format!("{:?} is not 1-15 bytes", n.interface),
                );
            }
        }
        for (i, e) in self.env.iter().enumerate() {
            if e.name.is_empty() || e.name.contains(['=', '\0']) {
                return invalid(
                    &format!("env[{i}].name"),
                    format!("{:?} is empty or holds '=' or NUL", e.name),
                );
            }
        }
        for (i, e) in self.image.env.iter().enumerate() {
            if !e.contains('=') || e.starts_with('=') {
                return invalid(
                    &format!("image.env[{i}]"),
                    format!("{e:?} is not NAME=value"),
                );
            }
        }
        if self.agent.port == 0 {
            return invalid("agent.port", "0 is not a vsock port".to_string());
        }
        if self.agent.exit_report_port == Some(0) {
            return invalid(
                "agent.exit_report_port",
                "0 is not a vsock port".to_string(),
            );
        }
        if let Some(u) = &self.user_data
            && let Err(e) = u.validate()
        {
            return invalid(&format!("user_data.{}", e.field), e.reason);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_object_is_a_valid_config_with_defaults() {
        let c = GuestConfig::from_json(b"{}").unwrap();
        assert!(c.agent.enabled);
        assert_eq!(c.agent.port, crate::DEFAULT_API_PORT);
        assert_eq!(c.on_exit, PowerAction::PowerOff);
        assert!(c.network.is_none());
    }

    #[test]
    fn what_the_host_writes_the_guest_reads() {
        let c = GuestConfig {
            hostname: Some("vm-1".into()),
            modules: vec!["/.imp/modules/virtio_ring.ko".into()],
            network: Some(NetworkConfig {
                interface: "eth0".into(),
                address: Ipv4Addr::new(10, 0, 0, 5),
                prefix_len: 24,
                gateway: Some(Ipv4Addr::new(10, 0, 0, 1)),
                dns: vec!["10.0.0.1".parse().unwrap()],
                search: vec!["svc.local".into()],
                mtu: Some(1450),
            }),
            image: ImageConfig {
                entrypoint: vec!["/bin/app".into()],
                cmd: vec!["--serve".into()],
                env: vec!["PATH=/app/bin".into()],
                working_dir: Some("/app".into()),
                user: Some("app:app".into()),
            },
            command: None,
            args: Some(vec!["--once".into()]),
            env: vec![EnvVar::new("MODE", "test")],
            agent: AgentConfig {
                enabled: true,
                port: 10000,
                exit_report_port: Some(10001),
            },
            on_exit: PowerAction::Reboot,
            root: Some(RootDisk::ext4("/dev/vda")),
            attach: true,
            user_data: Some(UserData::CloudConfig(CloudConfig {
                write_files: vec![WriteFile {
                    path: "/etc/app.conf".into(),
                    content: "x=1\n".into(),
                    encoding: ContentEncoding::Text,
                    permissions: 0o600,
                    owner: Some("app:app".into()),
                }],
                users: vec![UserAccount {
                    name: "app".into(),
                    uid: Some(1001),
                    groups: vec!["wheel".into()],
                    ..Default::default()
                }],
                runcmd: vec![
                    RunCommand::Shell("echo hi".into()),
                    RunCommand::Argv(vec!["touch".into(), "/x".into()]),
                ],
            })),
        };
        let json = c.to_json().unwrap();
        assert_eq!(GuestConfig::from_json(&json).unwrap(), c);
        assert_eq!(c.argv().unwrap(), ["/bin/app", "--once"]);
        let none = GuestConfig::default();
        assert_eq!(none.argv(), None);
    }

    #[test]
    fn network_defaults_to_eth0() {
        let c = GuestConfig::from_json(br#"{"network":{"address":"10.1.2.3","prefix_len":16}}"#)
            .unwrap();
        assert_eq!(c.network.unwrap().interface, "eth0");
    }

    #[test]
    fn bad_values_name_the_field() {
        for (json, field) in [
            (
                r#"{"network":{"address":"10.1.2.3","prefix_len":33}}"#,
                "network.prefix_len",
            ),
            (r#"{"modules":["virtio.ko"]}"#, "modules[0]"),
            (r#"{"env":[{"name":"A=B","value":"x"}]}"#, "env[0].name"),
            (r#"{"image":{"env":["NOEQUALS"]}}"#, "image.env[0]"),
            (r#"{"agent":{"port":0}}"#, "agent.port"),
            (r#"{"hostname":"a b"}"#, "hostname"),
        ] {
            let err = GuestConfig::from_json(json.as_bytes()).unwrap_err();
            assert!(
                err.to_string().contains(&format!("`{field}`")),
                "{json}: {err}"
            );
        }
    }

    #[test]
    fn user_data_travels_as_tagged_json_and_bad_values_name_the_field() {
        let c = GuestConfig::from_json(
            br#"{"user_data":{"cloud_config":{"runcmd":[{"shell":"echo hi"},{"argv":["true"]}]}}}"#,
        )
        .unwrap();
        let Some(UserData::CloudConfig(cc)) = c.user_data else {
            panic!("cloud-config expected")
        };
        assert_eq!(cc.runcmd[0].argv(), ["/bin/sh", "-c", "echo hi"]);
        assert_eq!(cc.runcmd[1].argv(), ["true"]);
        let c = GuestConfig::from_json(br##"{"user_data":{"script":"#!/bin/sh\necho hi\n"}}"##)
            .unwrap();
        assert!(matches!(c.user_data, Some(UserData::Script(_))));
        let f = r#"{"user_data":{"cloud_config":{"write_files":[{"path":"/etc/x"}]}}}"#;
        let Some(UserData::CloudConfig(cc)) =
            GuestConfig::from_json(f.as_bytes()).unwrap().user_data
        else {
            panic!("cloud-config expected")
        };
        assert_eq!(
            (cc.write_files[0].permissions, cc.write_files[0].encoding),
            (0o644, ContentEncoding::Text)
        );
        for (json, field) in [
            (r#"{"script":"echo no shebang"}"#, "user_data.script"),
            (
                r#"{"cloud_config":{"write_files":[{"path":"etc/x"}]}}"#,
                "user_data.write_files[0].path",
            ),
            (
                r#"{"cloud_config":{"write_files":[{"path":"/etc/../x"}]}}"#,
                "user_data.write_files[0].path",
            ),
            (
                r#"{"cloud_config":{"write_files":[{"path":"/x","permissions":4096}]}}"#,
                "user_data.write_files[0].permissions",
            ),
            (
                r#"{"cloud_config":{"write_files":[{"path":"/x","owner":"app"}]}}"#,
                "user_data.write_files[0].owner",
            ),
            (
                r#"{"cloud_config":{"users":[{"name":"a:b"}]}}"#,
                "user_data.users[0].name",
            ),
            (
                r#"{"cloud_config":{"users":[{"name":"a","shell":"sh"}]}}"#,
                "user_data.users[0].shell",
            ),
            (
                r#"{"cloud_config":{"users":[{"name":"a","ssh_authorized_keys":["k\nk"]}]}}"#,
                "user_data.users[0].ssh_authorized_keys[0]",
            ),
            (
                r#"{"cloud_config":{"runcmd":[{"argv":[]}]}}"#,
                "user_data.runcmd[0]",
            ),
        ] {
            let json = format!(r#"{{"user_data":{json}}}"#);
            let err = GuestConfig::from_json(json.as_bytes()).unwrap_err();
            assert!(
                err.to_string().contains(&format!("`{field}`")),
                "{json}: {err}"
            );
        }
    }

    #[test]
    fn malformed_json_is_a_json_error() {
        let err = GuestConfig::from_json(br#"{"network":{"address":"not-an-ip","prefix_len":1}}"#)
            .unwrap_err();
        assert!(matches!(err, ConfigError::Json(_)), "{err}");
    }
}
