//! A VM's user data (`spec.userData.configMapRef`): the `user-data` key of a ConfigMap in the
//! VM's namespace, read at every start and turned into the form imp-guest applies
//! ([`imp_proto::config::UserData`]), or a message saying what is wrong, which the start puts
//! on the VM as `InvalidSpec` (nothing boots).
//!
//! imp runs user data itself (imp-guest as PID 1, no cloud-init in the image), so only a
//! subset is accepted; everything else is refused by name rather than ignored:
//! - a script: text starting with `#!`;
//! - `#cloud-config` YAML with only the keys `write_files` (`path`, `content`, `permissions`
//!   as an octal string, `owner` as `user:group`, `encoding` plain text or `b64`), `users`
//!   (`name`; `uid`, `shell`, `homedir`, `groups`, `ssh_authorized_keys`; the string
//!   `default` is ignored) and `runcmd` (strings run with `sh -c`, lists run as argv).
//!
//! Pure: the reconciler reads the ConfigMap ([`config_map`] names it) and hands it to
//! [`from_config_map`].

use base64::Engine as _;
use imp_api::inputs::ConfigMapData;
use imp_api::vm::ImpVMSpec;
use imp_proto::config::{
    CloudConfig, ContentEncoding, RunCommand, UserAccount, UserData, WriteFile,
};
use serde_yaml_ng::{Mapping, Value};

/// The ConfigMap key user data is read from (cloud-init NoCloud's name).
pub const KEY: &str = "user-data";

/// The most bytes of user data accepted.
pub const MAX_BYTES: usize = 64 << 10;

/// The first line of cloud-config user data.
pub const CLOUD_CONFIG_HEADER: &str = "#cloud-config";

/// The name of the ConfigMap a VM's user data comes from, if it has user data.
pub fn config_map(vm: &ImpVMSpec) -> Option<&str> {
    vm.user_data
        .as_ref()?
        .config_map_ref
        .as_ref()
        .map(|r| r.name.as_str())
}

/// The user data in ConfigMap `name` as read (`None`: it does not exist), or what is wrong,
/// naming the ConfigMap (and the keys it has when `user-data` is not one of them).
pub fn from_config_map(name: &str, map: Option<&ConfigMapData>) -> Result<UserData, String> {
    let field = "spec.userData.configMapRef";
    let Some(map) = map else {
        return Err(format!("{field}: ConfigMap {name} does not exist"));
    };
    let Some(text) = map.data.get(KEY) else {
        if map.binary_keys.iter().any(|k| k == KEY) {
            return Err(format!(
                "{field}: ConfigMap {name} holds {KEY:?} in binaryData; user data is text, \
                 put it in data"
            ));
        }
        let keys: Vec<&str> = map
            .data
            .keys()
            .chain(&map.binary_keys)
            .map(String::as_str)
            .collect();
        let has = if keys.is_empty() {
            "it has no keys".to_owned()
        } else {
            format!("it has: {}", keys.join(", "))
        };
        return Err(format!(
            "{field}: ConfigMap {name} has no key {KEY:?} ({has})"
        ));
    };
    if text.len() > MAX_BYTES {
        return Err(format!(
            "{field}: ConfigMap {name} key {KEY}: {} bytes is more than the {MAX_BYTES} allowed",
            text.len()
        ));
    }
    parse(text).map_err(|why| format!("spec.userData (ConfigMap {name}, key {KEY}): {why}"))
}

/// Parses user data text: a `#!` script or `#cloud-config` YAML of the supported subset.
pub fn parse(text: &str) -> Result<UserData, String> {
    let first = text.lines().next().unwrap_or_default().trim_end();
    let data = if text.starts_with("#!") {
        UserData::Script(text.to_owned())
    } else if first == CLOUD_CONFIG_HEADER {
        UserData::CloudConfig(cloud_config(text)?)
    } else if first.trim().is_empty() {
        return Err(format!(
            "the first line must be {CLOUD_CONFIG_HEADER} or a #! script's interpreter, and it \
             is empty"
        ));
    } else {
        let shown: String = first.chars().take(40).collect();
        return Err(format!(
            "only #! scripts and {CLOUD_CONFIG_HEADER} are supported, and the first line is \
             {shown:?}"
        ));
    };
    data.validate()
        .map_err(|e| format!("{}: {}", e.field, e.reason))?;
    Ok(data)
}

fn cloud_config(text: &str) -> Result<CloudConfig, String> {
    let doc: Value = serde_yaml_ng::from_str(text)
        .map_err(|e| format!("{CLOUD_CONFIG_HEADER} is not valid YAML: {e}"))?;
    let map = match doc {
        Value::Null => return Ok(CloudConfig::default()),
        Value::Mapping(m) => m,
        _ => return Err(format!("{CLOUD_CONFIG_HEADER} must be a mapping of keys")),
    };
    let mut out = CloudConfig::default();
    let mut unsupported = Vec::new();
    for (k, v) in &map {
        let key = scalar(k).unwrap_or_else(|| "?".to_owned());
        match key.as_str() {
            "write_files" => {
                out.write_files = list("write_files", v)?
                    .iter()
                    .enumerate()
                    .map(|(i, f)| write_file(i, f))
                    .collect::<Result<_, _>>()?;
            }
            "users" => {
                out.users = list("users", v)?
                    .iter()
                    .enumerate()
                    .filter_map(|(i, u)| user(i, u).transpose())
                    .collect::<Result<_, _>>()?;
            }
            "runcmd" => {
                out.runcmd = list("runcmd", v)?
                    .iter()
                    .enumerate()
                    .map(|(i, c)| command(i, c))
                    .collect::<Result<_, _>>()?;
            }
            _ => unsupported.push(format!("`{key}`")),
        }
    }
    match unsupported.len() {
        0 => Ok(out),
        1 => Err(format!(
            "{CLOUD_CONFIG_HEADER} key {} is not supported (imp runs write_files, users and \
             runcmd only)",
            unsupported[0]
        )),
        _ => Err(format!(
            "{CLOUD_CONFIG_HEADER} keys {} are not supported (imp runs write_files, users and \
             runcmd only)",
            unsupported.join(", ")
        )),
    }
}

/// A string, number or boolean as text; `None` for anything else.
fn scalar(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

fn list<'a>(field: &str, v: &'a Value) -> Result<&'a [Value], String> {
    match v {
        Value::Sequence(s) => Ok(s),
        Value::Null => Ok(&[]),
        _ => Err(format!("{field} must be a list")),
    }
}

fn mapping<'a>(field: &str, v: &'a Value, what: &str) -> Result<&'a Mapping, String> {
    match v {
        Value::Mapping(m) => Ok(m),
        _ => Err(format!("{field}: {what}")),
    }
}

fn string(field: &str, v: &Value) -> Result<String, String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        _ => Err(format!("{field} must be a string")),
    }
}

fn unsupported_key(field: &str, key: &Value, supported: &str) -> String {
    let key = scalar(key).unwrap_or_else(|| "?".to_owned());
    format!("{field}: key `{key}` is not supported ({supported})")
}

fn write_file(i: usize, v: &Value) -> Result<WriteFile, String> {
    let field = format!("write_files[{i}]");
    let m = mapping(&field, v, "must be a mapping with a path")?;
    let (mut path, mut content, mut permissions, mut owner, mut encoding) =
        (None, String::new(), 0o644, None, ContentEncoding::Text);
    for (k, v) in m {
        match k.as_str().unwrap_or_default() {
            "path" => path = Some(string(&format!("{field}.path"), v)?),
            "content" if v.is_null() => {}
            "content" => content = string(&format!("{field}.content"), v)?,
            "permissions" => permissions = mode(&format!("{field}.permissions"), v)?,
            "owner" => owner = Some(string(&format!("{field}.owner"), v)?),
            "encoding" => {
                let e = string(&format!("{field}.encoding"), v)?;
                encoding = match e.as_str() {
                    "text/plain" => ContentEncoding::Text,
                    "b64" | "base64" => ContentEncoding::Base64,
                    other => {
                        return Err(format!(
                            "{field}.encoding: {other:?} is not supported (plain text, or b64)"
                        ));
                    }
                };
            }
            _ => {
                return Err(unsupported_key(
                    &field,
                    k,
                    "path, content, permissions, owner and encoding are",
                ));
            }
        }
    }
    let path = path.ok_or_else(|| format!("{field}: path is required"))?;
    if encoding == ContentEncoding::Base64 {
        content.retain(|c| !c.is_ascii_whitespace());
        base64::engine::general_purpose::STANDARD
            .decode(&content)
            .map_err(|e| format!("{field}.content: not valid base64: {e}"))?;
    }
    Ok(WriteFile {
        path,
        content,
        encoding,
        permissions,
        owner,
    })
}

/// `permissions`: an octal string (`'0644'`, `'644'`, `'0o644'`; an unquoted `0644` is a
/// string in YAML 1.2, so it means what it means to cloud-init). A YAML number (`644`, `0o644`)
/// is refused rather than guessed: cloud-init's YAML 1.1 and this parser read them differently.
fn mode(field: &str, v: &Value) -> Result<u32, String> {
    let Value::String(s) = v else {
        return Err(format!(
            "{field}: give the mode as an octal string such as '0644' (a YAML number is \
             refused: YAML 1.1 and 1.2 read them differently)"
        ));
    };
    let digits = s.trim().trim_start_matches("0o");
    u32::from_str_radix(digits, 8)
        .ok()
        .filter(|m| !digits.is_empty() && *m <= 0o7777)
        .ok_or_else(|| format!("{field}: {s:?} is not an octal mode up to 7777"))
}

/// A `users` entry; `None` for the string `default` (cloud-init's distro user, which imp
/// does not have).
fn user(i: usize, v: &Value) -> Result<Option<UserAccount>, String> {
    let field = format!("users[{i}]");
    if let Value::String(s) = v {
        if s == "default" {
            return Ok(None);
        }
        return Err(format!(
            "{field}: {s:?}: a user is a mapping with a name (the string \"default\" is the only \
             one accepted, and ignored)"
        ));
    }
    let m = mapping(&field, v, "a user is a mapping with a name")?;
    let mut u = UserAccount::default();
    let mut named = false;
    for (k, v) in m {
        match k.as_str().unwrap_or_default() {
            "name" => {
                u.name = string(&format!("{field}.name"), v)?;
                named = true;
            }
            "uid" => {
                let n = scalar(v).and_then(|s| s.parse::<u32>().ok());
                u.uid = Some(n.ok_or_else(|| format!("{field}.uid must be a number"))?);
            }
            "shell" => u.shell = Some(string(&format!("{field}.shell"), v)?),
            "homedir" => u.homedir = Some(string(&format!("{field}.homedir"), v)?),
            "groups" => {
                u.groups = match v {
                    Value::String(s) => s
                        .split(',')
                        .map(str::trim)
                        .filter(|g| !g.is_empty())
                        .map(str::to_owned)
                        .collect(),
                    Value::Sequence(gs) => gs
                        .iter()
                        .enumerate()
                        .map(|(j, g)| string(&format!("{field}.groups[{j}]"), g))
                        .collect::<Result<_, _>>()?,
                    Value::Null => Vec::new(),
                    _ => {
                        return Err(format!(
                            "{field}.groups must be a list or a comma-separated string"
                        ));
                    }
                }
            }
            "ssh_authorized_keys" => {
                u.ssh_authorized_keys = list(&format!("{field}.ssh_authorized_keys"), v)?
                    .iter()
                    .enumerate()
                    .map(|(j, key)| string(&format!("{field}.ssh_authorized_keys[{j}]"), key))
                    .collect::<Result<_, _>>()?;
            }
            _ => {
                return Err(unsupported_key(
                    &field,
                    k,
                    "name, uid, shell, homedir, groups and ssh_authorized_keys are",
                ));
            }
        }
    }
    if !named {
        return Err(format!("{field}: name is required"));
    }
    Ok(Some(u))
}

fn command(i: usize, v: &Value) -> Result<RunCommand, String> {
    let field = format!("runcmd[{i}]");
    match v {
        Value::String(s) => Ok(RunCommand::Shell(s.clone())),
        Value::Sequence(args) => args
            .iter()
            .enumerate()
            .map(|(j, a)| scalar(a).ok_or_else(|| format!("{field}[{j}] must be a string")))
            .collect::<Result<_, _>>()
            .map(RunCommand::Argv),
        _ => Err(format!(
            "{field} must be a string (run with sh -c) or a list (run as argv)"
        )),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::collections::BTreeMap;

    fn map(pairs: &[(&str, &str)]) -> ConfigMapData {
        ConfigMapData {
            data: pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>(),
            ..Default::default()
        }
    }

    #[test]
    fn the_config_map_is_named_by_the_spec() {
        let mut vm = ImpVMSpec::default();
        assert_eq!(config_map(&vm), None);
        vm.user_data = Some(imp_api::vm::UserDataSource {
            config_map_ref: Some(imp_api::shared::LocalObjectRef {
                name: "init".into(),
            }),
        });
        assert_eq!(config_map(&vm), Some("init"));
    }

    #[test]
    fn a_script_is_kept_as_it_is() {
        let text = "#!/bin/sh\necho hi > /tmp/marker\n";
        assert_eq!(parse(text).unwrap(), UserData::Script(text.into()));
    }

    #[test]
    fn the_cloud_config_subset_is_parsed() {
        let text = r#"#cloud-config
write_files:
  - path: /etc/app/app.conf
    content: |
      mode=prod
    permissions: '0600'
    owner: app:app
  - path: /usr/local/bin/tool
    encoding: b64
    content: IyEvYmluL3NoCmVjaG8gaGkK
    permissions: '0755'
  - path: /etc/empty
users:
  - default
  - name: app
    uid: 1500
    shell: /bin/ash
    homedir: /srv/app
    groups: wheel, audio
    ssh_authorized_keys:
      - ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAbc app@example
  - name: ops
    groups: [wheel]
runcmd:
  - echo one > /tmp/marker
  - [touch, /tmp/two]
  - [sleep, 1]
"#;
        let UserData::CloudConfig(c) = parse(text).unwrap() else {
            panic!("cloud-config expected")
        };
        assert_eq!(
            c.write_files,
            [
                WriteFile {
                    path: "/etc/app/app.conf".into(),
                    content: "mode=prod\n".into(),
                    encoding: ContentEncoding::Text,
                    permissions: 0o600,
                    owner: Some("app:app".into()),
                },
                WriteFile {
                    path: "/usr/local/bin/tool".into(),
                    content: "IyEvYmluL3NoCmVjaG8gaGkK".into(),
                    encoding: ContentEncoding::Base64,
                    permissions: 0o755,
                    owner: None,
                },
                WriteFile {
                    path: "/etc/empty".into(),
                    content: String::new(),
                    encoding: ContentEncoding::Text,
                    permissions: 0o644,
                    owner: None,
                },
            ]
        );
        assert_eq!(
            c.users,
            [
                UserAccount {
                    name: "app".into(),
                    uid: Some(1500),
                    shell: Some("/bin/ash".into()),
                    homedir: Some("/srv/app".into()),
                    groups: vec!["wheel".into(), "audio".into()],
                    ssh_authorized_keys: vec![
                        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAbc app@example".into()
                    ],
                },
                UserAccount {
                    name: "ops".into(),
                    groups: vec!["wheel".into()],
                    ..Default::default()
                },
            ]
        );
        assert_eq!(
            c.runcmd,
            [
                RunCommand::Shell("echo one > /tmp/marker".into()),
                RunCommand::Argv(vec!["touch".into(), "/tmp/two".into()]),
                RunCommand::Argv(vec!["sleep".into(), "1".into()]),
            ]
        );
    }

    #[test]
    fn an_unquoted_leading_zero_mode_is_octal_as_in_cloud_init() {
        let UserData::CloudConfig(c) =
            parse("#cloud-config\nwrite_files:\n  - path: /x\n    permissions: 0755\n").unwrap()
        else {
            panic!("cloud-config expected")
        };
        assert_eq!(c.write_files[0].permissions, 0o755);
    }

    #[test]
    fn an_empty_cloud_config_does_nothing() {
        assert_eq!(
            parse("#cloud-config\n").unwrap(),
            UserData::CloudConfig(CloudConfig::default())
        );
        assert_eq!(
            parse("#cloud-config\r\nruncmd:\r\n").unwrap(),
            UserData::CloudConfig(CloudConfig::default())
        );
    }

    #[test]
    fn what_is_not_supported_is_refused_by_name() {
        for (text, needle) in [
            (
                "#cloud-config\npackages: [curl]\nruncmd: [ls]\n",
                "key `packages` is not supported",
            ),
            (
                "#cloud-config\nbootcmd: [ls]\nmounts: []\n",
                "keys `bootcmd`, `mounts` are not supported",
            ),
            (
                "#cloud-config\nwrite_files:\n  - path: /x\n    defer: true\n",
                "write_files[0]: key `defer` is not supported",
            ),
            (
                "#cloud-config\nwrite_files:\n  - path: /x\n    encoding: gz+b64\n    content: x\n",
                "write_files[0].encoding: \"gz+b64\" is not supported",
            ),
            (
                "#cloud-config\nwrite_files:\n  - path: /x\n    encoding: b64\n    content: '*'\n",
                "write_files[0].content: not valid base64",
            ),
            (
                "#cloud-config\nwrite_files:\n  - path: /x\n    permissions: 644\n",
                "write_files[0].permissions: give the mode as an octal string",
            ),
            (
                "#cloud-config\nwrite_files:\n  - path: /x\n    permissions: '0999'\n",
                "is not an octal mode",
            ),
            (
                "#cloud-config\nwrite_files:\n  - content: x\n",
                "write_files[0]: path is required",
            ),
            (
                "#cloud-config\nwrite_files:\n  - path: x\n",
                "write_files[0].path: \"x\" is not an absolute file path",
            ),
            (
                "#cloud-config\nwrite_files:\n  - path: /x\n    owner: app\n",
                "write_files[0].owner: \"app\" is not user:group",
            ),
            (
                "#cloud-config\nusers:\n  - name: app\n    sudo: ALL\n",
                "users[0]: key `sudo` is not supported",
            ),
            (
                "#cloud-config\nusers:\n  - app\n",
                "users[0]: \"app\": a user is a mapping",
            ),
            (
                "#cloud-config\nusers:\n  - uid: 5\n",
                "users[0]: name is required",
            ),
            (
                "#cloud-config\nusers:\n  - name: 'a b'\n",
                "users[0].name: \"a b\" is not",
            ),
            (
                "#cloud-config\nruncmd:\n  - {a: b}\n",
                "runcmd[0] must be a string (run with sh -c) or a list",
            ),
            ("#cloud-config\nruncmd: ls\n", "runcmd must be a list"),
            ("#cloud-config\n- a\n", "must be a mapping of keys"),
            ("#cloud-config\nruncmd: [\n", "is not valid YAML"),
            ("#include\nhttp://x/\n", "the first line is \"#include\""),
            (
                "echo hi\n",
                "only #! scripts and #cloud-config are supported",
            ),
            ("\n#cloud-config\n", "it is empty"),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(needle), "{text:?}: {e}");
        }
    }

    #[test]
    fn a_missing_config_map_or_key_is_named_with_the_keys_it_has() {
        let e = from_config_map("init", None).unwrap_err();
        assert_eq!(
            e,
            "spec.userData.configMapRef: ConfigMap init does not exist"
        );
        let e = from_config_map("init", Some(&map(&[("userdata", "x"), ("a", "b")]))).unwrap_err();
        assert_eq!(
            e,
            "spec.userData.configMapRef: ConfigMap init has no key \"user-data\" (it has: a, \
             userdata)"
        );
        let e = from_config_map("init", Some(&ConfigMapData::default())).unwrap_err();
        assert!(e.ends_with("(it has no keys)"), "{e}");
        let binary = ConfigMapData {
            binary_keys: vec![KEY.to_owned()],
            ..Default::default()
        };
        let e = from_config_map("init", Some(&binary)).unwrap_err();
        assert!(e.contains("in binaryData"), "{e}");
    }

    #[test]
    fn user_data_over_the_limit_is_refused_and_errors_name_the_config_map() {
        let big = format!("#!/bin/sh\n#{}\n", "x".repeat(MAX_BYTES));
        let e = from_config_map("init", Some(&map(&[(KEY, &big)]))).unwrap_err();
        assert!(e.contains("is more than the 65536 allowed"), "{e}");
        let e =
            from_config_map("init", Some(&map(&[(KEY, "#cloud-config\nntp: {}\n")]))).unwrap_err();
        assert_eq!(
            e,
            "spec.userData (ConfigMap init, key user-data): #cloud-config key `ntp` is not \
             supported (imp runs write_files, users and runcmd only)"
        );
        let ok = from_config_map("init", Some(&map(&[(KEY, "#!/bin/sh\ntrue\n")]))).unwrap();
        assert!(matches!(ok, UserData::Script(_)));
    }
}
