//! The workload's environment from an ImpVM's `env` and `envFrom`, as a Pod's is built: every
//! `envFrom` source in order (each key with its `prefix`), then `env` in order, later entries
//! winning. Values from Secrets and ConfigMaps are read by the reconciler first
//! (the operator's gateway hands them out, `imp_api::inputs::of_vm` says which), so resolving them here is a pure function.

use std::collections::BTreeMap;

use imp_api::vm::ImpVMSpec;
use imp_proto::message::EnvVar;

/// The data of the Secrets and ConfigMaps a VM refers to, by name; a missing object is absent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sources {
    /// Secret name → key → value (decoded).
    pub secrets: BTreeMap<String, BTreeMap<String, String>>,
    /// ConfigMap name → key → value.
    pub config_maps: BTreeMap<String, BTreeMap<String, String>>,
}

/// The workload's environment, or what is missing, naming the field.
pub fn resolve(vm: &ImpVMSpec, src: &Sources) -> Result<Vec<EnvVar>, String> {
    let mut out: Vec<EnvVar> = Vec::new();
    let mut set = |name: String, value: String| {
        out.retain(|e| e.name != name);
        out.push(EnvVar::new(name, value));
    };
    for (i, f) in vm.env_from.iter().enumerate() {
        let prefix = f.prefix.clone().unwrap_or_default();
        let (kind, name, optional, data) = match (&f.secret_ref, &f.config_map_ref) {
            (Some(s), _) => ("Secret", &s.name, s.optional, src.secrets.get(&s.name)),
            (None, Some(c)) => (
                "ConfigMap",
                &c.name,
                c.optional,
                src.config_maps.get(&c.name),
            ),
            (None, None) => continue,
        };
        match data {
            Some(data) => data
                .iter()
                .for_each(|(k, v)| set(format!("{prefix}{k}"), v.clone())),
            None if optional == Some(true) => {}
            None => return Err(format!("spec.envFrom[{i}]: {kind} {name} does not exist")),
        }
    }
    for (i, e) in vm.env.iter().enumerate() {
        let Some(from) = &e.value_from else {
            set(e.name.clone(), e.value.clone().unwrap_or_default());
            continue;
        };
        let (kind, name, key, optional, data) = match (
            &from.secret_key_ref,
            &from.config_map_key_ref,
        ) {
            (Some(s), _) => (
                "Secret",
                &s.name,
                &s.key,
                s.optional,
                src.secrets.get(&s.name),
            ),
            (None, Some(c)) => (
                "ConfigMap",
                &c.name,
                &c.key,
                c.optional,
                src.config_maps.get(&c.name),
            ),
            (None, None) => {
                return Err(format!(
                    "spec.env[{i}] ({}): only secretKeyRef and configMapKeyRef are supported in valueFrom",
                    e.name
                ));
            }
        };
        match data.map(|d| d.get(key)) {
            Some(Some(v)) => set(e.name.clone(), v.clone()),
            _ if optional == Some(true) => {}
            Some(None) => {
                return Err(format!(
                    "spec.env[{i}] ({}): {kind} {name} has no key {key:?}",
                    e.name
                ));
            }
            None => {
                return Err(format!(
                    "spec.env[{i}] ({}): {kind} {name} does not exist",
                    e.name
                ));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use k8s_openapi::api::core::v1::{
        ConfigMapEnvSource, ConfigMapKeySelector, EnvFromSource, EnvVar as KEnv, EnvVarSource,
        ObjectFieldSelector, SecretKeySelector,
    };

    fn secret_key(var: &str, name: &str, key: &str, optional: Option<bool>) -> KEnv {
        KEnv {
            name: var.into(),
            value: None,
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector {
                    name: name.into(),
                    key: key.into(),
                    optional,
                }),
                ..Default::default()
            }),
        }
    }

    fn sources() -> Sources {
        let mut s = Sources::default();
        s.secrets.insert(
            "db".into(),
            BTreeMap::from([("password".into(), "hunter2".into())]),
        );
        s.config_maps.insert(
            "app".into(),
            BTreeMap::from([("MODE".into(), "prod".into()), ("LEVEL".into(), "3".into())]),
        );
        s
    }

    #[test]
    fn env_from_then_env_with_later_entries_winning() {
        let vm = ImpVMSpec {
            env_from: vec![EnvFromSource {
                config_map_ref: Some(ConfigMapEnvSource {
                    name: "app".into(),
                    optional: None,
                }),
                prefix: Some("APP_".into()),
                secret_ref: None,
            }],
            env: vec![
                KEnv {
                    name: "APP_MODE".into(),
                    value: Some("dev".into()),
                    value_from: None,
                },
                secret_key("DB_PASSWORD", "db", "password", None),
                KEnv {
                    name: "LEVEL".into(),
                    value: None,
                    value_from: Some(EnvVarSource {
                        config_map_key_ref: Some(ConfigMapKeySelector {
                            name: "app".into(),
                            key: "LEVEL".into(),
                            optional: None,
                        }),
                        ..Default::default()
                    }),
                },
                secret_key("GONE", "db", "nope", Some(true)),
            ],
            ..Default::default()
        };
        let refs = imp_api::inputs::of_vm(&vm);
        assert_eq!(refs.secrets.into_iter().collect::<Vec<_>>(), ["db"]);
        assert_eq!(refs.config_maps.into_iter().collect::<Vec<_>>(), ["app"]);
        let env = resolve(&vm, &sources()).unwrap();
        let pairs: Vec<(&str, &str)> = env
            .iter()
            .map(|e| (e.name.as_str(), e.value.as_str()))
            .collect();
        assert_eq!(
            pairs,
            [
                ("APP_LEVEL", "3"),
                ("APP_MODE", "dev"),
                ("DB_PASSWORD", "hunter2"),
                ("LEVEL", "3")
            ]
        );
    }

    #[test]
    fn what_is_missing_is_named() {
        let vm = ImpVMSpec {
            env: vec![secret_key("TOKEN", "db", "token", None)],
            ..Default::default()
        };
        let e = resolve(&vm, &sources()).unwrap_err();
        assert!(
            e.contains("spec.env[0] (TOKEN): Secret db has no key \"token\""),
            "{e}"
        );
        let vm = ImpVMSpec {
            env: vec![secret_key("TOKEN", "absent", "token", None)],
            ..Default::default()
        };
        let e = resolve(&vm, &sources()).unwrap_err();
        assert!(e.contains("Secret absent does not exist"), "{e}");
        let vm = ImpVMSpec {
            env: vec![KEnv {
                name: "NODE".into(),
                value: None,
                value_from: Some(EnvVarSource {
                    field_ref: Some(ObjectFieldSelector {
                        api_version: None,
                        field_path: "spec.nodeName".into(),
                    }),
                    ..Default::default()
                }),
            }],
            ..Default::default()
        };
        let e = resolve(&vm, &sources()).unwrap_err();
        assert!(e.contains("spec.env[0] (NODE)"), "{e}");
    }
}
