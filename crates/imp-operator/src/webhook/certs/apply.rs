//! The side of the webhook's certificates that talks to the API server: one pass reads the
//! Secret and the configurations, writes what [`decide::next_step`] says, publishes the
//! `caBundle`, and the served certificate follows; [`Keeper::run`] repeats it every
//! [`Policy::refresh`], and sooner (from [`FIRST_RETRY`], doubling) while something is not in
//! place yet: a pass failed, wrote, or left a configuration missing or without the bundle.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::Timestamp;
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use kube::Api;
use kube::api::{ObjectMeta, PatchParams, PostParams};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;

use super::decide::{self, Kind, Published, Step, Stored};
use super::material::{IssueError, Material};
use super::{Policy, rfc3339};
use crate::chain::DisplayChain;
use crate::webhook::tls::{self, LiveCert};

/// The field manager of the Secret and `caBundle` writes.
pub const FIELD_MANAGER: &str = "imp-operator-webhook-certs";

/// How many times a pass re-reads after losing a write to another replica.
const WRITE_ATTEMPTS: usize = 3;

/// The first delay before another pass while something is not in place.
pub const FIRST_RETRY: Duration = Duration::from_millis(500);

/// Where the certificates live and what they are for.
#[derive(Clone, Debug)]
pub struct KeeperConfig {
    /// The operator's namespace, which holds the Secret.
    pub namespace: String,
    /// The Secret's name.
    pub secret: String,
    /// Names of the operator's webhook configurations; each is looked up as a
    /// ValidatingWebhookConfiguration and as a MutatingWebhookConfiguration.
    pub configurations: Vec<String>,
    /// Names of the APIServices served on the same listener (the gateway's,
    /// `v1alpha1.subresources.imp.dev`), whose `spec.caBundle` is published too.
    pub api_services: Vec<String>,
    /// Names and lifetimes.
    pub policy: Policy,
}

/// Why a pass failed (the next pass tries again).
#[derive(Debug, thiserror::Error)]
pub enum KeeperError {
    /// An API call failed; `what` names the call and the object.
    #[error("{what}")]
    Kube {
        /// The call and its object.
        what: String,
        /// What the client said.
        #[source]
        source: kube::Error,
    },
    /// A certificate could not be made.
    #[error(transparent)]
    Issue(#[from] IssueError),
    /// The Secret's serving key is not PEM (it was checked when read: never expected).
    #[error("Reading the serving key of Secret {secret}")]
    ServeKey {
        /// `namespace/name` of the Secret.
        secret: String,
        /// What the PEM reader said.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// rustls refused the Secret's serving certificate and key.
    #[error("Serving the certificate of Secret {secret}")]
    Serve {
        /// `namespace/name` of the Secret.
        secret: String,
        /// What rustls said.
        #[source]
        source: rustls::Error,
    },
    /// Other replicas kept writing the Secret between this one's read and write.
    #[error("Secret {secret} changed under each of {WRITE_ATTEMPTS} writes")]
    Contended {
        /// `namespace/name` of the Secret.
        secret: String,
    },
}

/// What a pass leaves.
#[derive(Debug)]
pub struct Pass {
    /// What the Secret holds.
    pub material: Material,
    /// Whether nothing is left to do: nothing written, every configuration found and holding
    /// the bundle.
    pub settled: bool,
}

/// Keeps the Secret, the configurations' `caBundle` and the served certificate current.
pub struct Keeper {
    config: KeeperConfig,
    secrets: Api<Secret>,
    validating: Api<ValidatingWebhookConfiguration>,
    mutating: Api<MutatingWebhookConfiguration>,
    api_services: Api<APIService>,
    /// Configurations found under neither kind on the last pass (warned about once).
    missing: Mutex<Vec<String>>,
}

impl Keeper {
    /// A keeper working through `client`.
    pub fn new(client: kube::Client, config: KeeperConfig) -> Self {
        Keeper {
            secrets: Api::namespaced(client.clone(), &config.namespace),
            validating: Api::all(client.clone()),
            mutating: Api::all(client.clone()),
            api_services: Api::all(client),
            missing: Mutex::new(Vec::new()),
            config,
        }
    }

    /// `namespace/name` of the Secret, for logs and errors.
    pub fn secret(&self) -> String {
        format!("{}/{}", self.config.namespace, self.config.secret)
    }

    /// Makes passes until one gives a certificate to serve (each failure logged, retried from
    /// [`FIRST_RETRY`] up to [`Policy::refresh`]), or `None` once `shutdown` resolves.
    pub async fn start(&self, shutdown: impl Future<Output = ()>) -> Option<Arc<LiveCert>> {
        tokio::pin!(shutdown);
        let mut delay = FIRST_RETRY;
        loop {
            match self.pass().await.and_then(|p| self.certified(&p.material)) {
                Ok(key) => return Some(Arc::new(LiveCert::new(key))),
                Err(error) => tracing::warn!(
                    secret = %self.secret(),
                    error = %DisplayChain(&error),
                    "getting the webhook certificate failed; retrying"
                ),
            }
            tokio::select! {
                () = &mut shutdown => return None,
                () = tokio::time::sleep(delay) => {}
            }
            delay = delay.saturating_mul(2).min(self.config.policy.refresh());
        }
    }

    /// Makes passes until `shutdown` resolves, serving through `live` what each leaves in the
    /// Secret: every [`Policy::refresh`] once settled, sooner while not.
    pub async fn run(self, live: Arc<LiveCert>, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let refresh = self.config.policy.refresh();
        // None once a pass has settled; else the delay of the last retry.
        let mut backoff = Some(FIRST_RETRY);
        loop {
            let delay = backoff.unwrap_or(refresh).min(refresh);
            tokio::select! {
                () = &mut shutdown => return,
                () = tokio::time::sleep(delay) => {}
            }
            let settled = self
                .pass()
                .await
                .and_then(|p| self.serve(&live, &p.material).map(|()| p.settled));
            if let Err(error) = &settled {
                tracing::warn!(
                    secret = %self.secret(),
                    error = %DisplayChain(error),
                    "keeping the webhook certificates failed; retrying"
                );
            }
            backoff = match settled {
                Ok(true) => None,
                _ => Some(backoff.map_or(FIRST_RETRY, |d| d.saturating_mul(2).min(refresh))),
            };
        }
    }

    /// One pass: read, decide, write (re-reading after a lost race), publish. Returns what the
    /// Secret holds afterwards.
    pub async fn pass(&self) -> Result<Pass, KeeperError> {
        for _ in 0..WRITE_ATTEMPTS {
            let read = self.read_secret().await?;
            let stored = match &read {
                None => Stored::Absent,
                Some(s) => {
                    match Material::from_data(s.data.as_ref().unwrap_or(&Default::default())) {
                        Ok(m) => Stored::Usable(m),
                        Err(why) => Stored::Unusable(why),
                    }
                }
            };
            let (published, all_found) = self.read_configurations().await?;
            let now = Timestamp::now().as_second();
            let step = decide::next_step(&stored, &published, now, &self.config.policy);
            let current = match &stored {
                Stored::Usable(m) => Some(m),
                _ => None,
            };
            let (material, changed) = advance(&step, current, &self.config.policy, now)?;
            let version = if changed {
                match self.write(read.as_ref(), &material).await? {
                    Some(written) => {
                        self.log(&step, &material);
                        written.metadata.resource_version
                    }
                    None => {
                        tracing::info!(
                            secret = %self.secret(),
                            "another replica wrote the webhook Secret first; using what it wrote"
                        );
                        continue;
                    }
                }
            } else {
                read.and_then(|s| s.metadata.resource_version)
            };
            let in_place = self
                .publish(&material, &published, version.as_deref(), now)
                .await?;
            let settled = !changed && all_found && in_place;
            return Ok(Pass { material, settled });
        }
        Err(KeeperError::Contended {
            secret: self.secret(),
        })
    }

    /// Serves the serving certificate of `m` through `live` unless it already does.
    pub fn serve(&self, live: &LiveCert, m: &Material) -> Result<(), KeeperError> {
        if live.leaf_der().as_deref() == Some(m.serving.der.as_slice()) {
            return Ok(());
        }
        live.set(self.certified(m)?);
        tracing::info!(
            secret = %self.secret(),
            serial = %m.serving.serial,
            not_after = %rfc3339(m.serving.not_after),
            "serving the new webhook certificate"
        );
        Ok(())
    }

    fn certified(&self, m: &Material) -> Result<CertifiedKey, KeeperError> {
        let key =
            PrivateKeyDer::from_pem_slice(m.serving_key_pem().as_bytes()).map_err(|source| {
                KeeperError::ServeKey {
                    secret: self.secret(),
                    source,
                }
            })?;
        tls::certified_key(vec![CertificateDer::from(m.serving.der.clone())], key).map_err(
            |source| KeeperError::Serve {
                secret: self.secret(),
                source,
            },
        )
    }

    async fn read_secret(&self) -> Result<Option<Secret>, KeeperError> {
        self.secrets
            .get_opt(&self.config.secret)
            .await
            .map_err(|source| KeeperError::Kube {
                what: format!("Reading Secret {}", self.secret()),
                source,
            })
    }

    /// Creates the Secret, or updates the one read with its resourceVersion; `None` when
    /// another replica wrote it first (409).
    async fn write(
        &self,
        read: Option<&Secret>,
        m: &Material,
    ) -> Result<Option<Secret>, KeeperError> {
        let pp = PostParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PostParams::default()
        };
        let (verb, result) = match read {
            None => {
                let secret = Secret {
                    metadata: ObjectMeta {
                        name: Some(self.config.secret.clone()),
                        namespace: Some(self.config.namespace.clone()),
                        labels: Some(
                            [
                                ("app.kubernetes.io/name", "imp"),
                                ("app.kubernetes.io/component", "webhook"),
                                ("app.kubernetes.io/managed-by", "imp-operator"),
                            ]
                            .into_iter()
                            .map(|(k, v)| (k.to_owned(), v.to_owned()))
                            .collect(),
                        ),
                        ..ObjectMeta::default()
                    },
                    type_: Some("kubernetes.io/tls".to_owned()),
                    data: Some(m.to_data()),
                    ..Secret::default()
                };
                ("Creating", self.secrets.create(&pp, &secret).await)
            }
            Some(old) => {
                let mut secret = old.clone();
                secret.data = Some(m.to_data());
                secret.string_data = None;
                (
                    "Updating",
                    self.secrets
                        .replace(&self.config.secret, &pp, &secret)
                        .await,
                )
            }
        };
        match result {
            Ok(s) => Ok(Some(s)),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(None),
            Err(source) => Err(KeeperError::Kube {
                what: format!("{verb} Secret {}", self.secret()),
                source,
            }),
        }
    }

    /// Every configuration named, under each kind it exists as, and whether each name was
    /// found under one kind at least.
    async fn read_configurations(&self) -> Result<(Vec<Published>, bool), KeeperError> {
        let mut found = Vec::new();
        let mut missing = Vec::new();
        for name in &self.config.configurations {
            let kube_err = |kind: &str, source| KeeperError::Kube {
                what: format!("Reading {kind} {name}"),
                source,
            };
            let validating = self
                .validating
                .get_opt(name)
                .await
                .map_err(|e| kube_err("ValidatingWebhookConfiguration", e))?;
            let mutating = self
                .mutating
                .get_opt(name)
                .await
                .map_err(|e| kube_err("MutatingWebhookConfiguration", e))?;
            if validating.is_none() && mutating.is_none() {
                missing.push(name.clone());
            }
            found.extend(validating.map(from_validating));
            found.extend(mutating.map(from_mutating));
        }
        for name in &self.config.api_services {
            let service =
                self.api_services
                    .get_opt(name)
                    .await
                    .map_err(|source| KeeperError::Kube {
                        what: format!("Reading APIService {name}"),
                        source,
                    })?;
            match service {
                Some(s) => found.push(from_api_service(s)),
                None => missing.push(name.clone()),
            }
        }
        let all_found = missing.is_empty();
        self.note_missing(missing);
        Ok((found, all_found))
    }

    /// Warns once each time the set of configurations found under neither kind changes.
    fn note_missing(&self, now: Vec<String>) {
        let mut last = match self.missing.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        if *last != now {
            if !now.is_empty() {
                tracing::warn!(
                    configurations = ?now,
                    "no webhook configuration or APIService of these names: their caBundle is published once they exist"
                );
            }
            *last = now;
        }
    }

    /// Sets the bundle of `m` in every configuration that holds another, if the Secret still
    /// is at `version` (a replica with a stale read never takes a newer CA out). Returns
    /// whether every configuration holds it now.
    async fn publish(
        &self,
        m: &Material,
        published: &[Published],
        version: Option<&str>,
        now: i64,
    ) -> Result<bool, KeeperError> {
        let wanted = decide::bundle(m, now);
        let patches: Vec<_> = published
            .iter()
            .filter_map(|p| decide::ca_patch(p, &wanted).map(|patch| (p, patch)))
            .collect();
        if patches.is_empty() {
            return Ok(true);
        }
        let again = self.read_secret().await?;
        if again.and_then(|s| s.metadata.resource_version).as_deref() != version {
            tracing::debug!(secret = %self.secret(), "the Secret changed since it was read; publishing on the next pass");
            return Ok(false);
        }
        let mut all = true;
        let pp = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        };
        for (p, patch) in patches {
            let patch = kube::api::Patch::Json::<()>(patch);
            let result = match p.kind {
                Kind::Validating => self.validating.patch(&p.name, &pp, &patch).await.map(drop),
                Kind::Mutating => self.mutating.patch(&p.name, &pp, &patch).await.map(drop),
                Kind::ApiService => self
                    .api_services
                    .patch(&p.name, &pp, &patch)
                    .await
                    .map(drop),
            };
            match result {
                Ok(()) => tracing::info!(
                    kind = ?p.kind,
                    configuration = %p.name,
                    cas = m.cas.iter().filter(|c| !c.expired(now)).count(),
                    ca_not_after = %rfc3339(m.cas[0].not_after),
                    "published the webhook CA bundle"
                ),
                // The configuration changed since it was read (the patch's test failed).
                Err(kube::Error::Api(s)) if s.code == 409 || s.code == 422 => {
                    all = false;
                    tracing::info!(
                        kind = ?p.kind,
                        configuration = %p.name,
                        reason = %s.message,
                        "the configuration changed since it was read; publishing on the next pass"
                    );
                }
                Err(source) => {
                    return Err(KeeperError::Kube {
                        what: format!("Patching the caBundle of {:?} {}", p.kind, p.name),
                        source,
                    });
                }
            }
        }
        Ok(all)
    }

    /// One line per write: which, why, and until when.
    fn log(&self, step: &Step, m: &Material) {
        let secret = self.secret();
        let ca_not_after = rfc3339(m.cas[0].not_after);
        let not_after = rfc3339(m.serving.not_after);
        let serial = &m.serving.serial;
        match step {
            Step::Keep => {}
            Step::Issue(why) => tracing::info!(
                %secret, reason = %why, %ca_not_after, %serial, %not_after,
                "issued a new webhook CA and serving certificate"
            ),
            Step::AddCa => tracing::info!(
                %secret, %ca_not_after,
                old_ca_not_after = %m.cas.get(1).map(|c| rfc3339(c.not_after)).unwrap_or_default(),
                "rotating the webhook CA: the new one is published beside the old one"
            ),
            Step::RenewServing(why) => tracing::info!(
                %secret, reason = %why, %serial, %not_after, %ca_not_after,
                "renewed the webhook serving certificate"
            ),
            Step::DropOldCas => tracing::info!(
                %secret, %ca_not_after,
                "dropped the old webhook CA: every replica serves a certificate of the new one"
            ),
        }
    }
}

/// The material `step` leads to from `current`, and whether it must be written.
fn advance(
    step: &Step,
    current: Option<&Material>,
    policy: &Policy,
    now: i64,
) -> Result<(Material, bool), IssueError> {
    let Some(m) = current else {
        return Ok((Material::issue(policy, now)?, true));
    };
    Ok(match step {
        Step::Keep => (m.clone(), false),
        Step::Issue(_) => (Material::issue(policy, now)?, true),
        Step::AddCa => (m.with_new_ca(policy, now)?, true),
        Step::RenewServing(_) => (m.with_new_serving(policy, now)?, true),
        Step::DropOldCas => (m.without_old_cas(), true),
    })
}

fn from_validating(c: ValidatingWebhookConfiguration) -> Published {
    Published {
        kind: Kind::Validating,
        name: c.metadata.name.unwrap_or_default(),
        resource_version: c.metadata.resource_version,
        hooks: c
            .webhooks
            .unwrap_or_default()
            .into_iter()
            .map(|w| {
                (
                    w.name,
                    w.client_config.ca_bundle.map(|b| b.0).unwrap_or_default(),
                )
            })
            .collect(),
    }
}

fn from_api_service(s: APIService) -> Published {
    Published {
        kind: Kind::ApiService,
        name: s.metadata.name.unwrap_or_default(),
        resource_version: s.metadata.resource_version,
        hooks: vec![(
            String::new(),
            s.spec
                .and_then(|spec| spec.ca_bundle)
                .map(|b| b.0)
                .unwrap_or_default(),
        )],
    }
}

fn from_mutating(c: MutatingWebhookConfiguration) -> Published {
    Published {
        kind: Kind::Mutating,
        name: c.metadata.name.unwrap_or_default(),
        resource_version: c.metadata.resource_version,
        hooks: c
            .webhooks
            .unwrap_or_default()
            .into_iter()
            .map(|w| {
                (
                    w.name,
                    w.client_config.ca_bundle.map(|b| b.0).unwrap_or_default(),
                )
            })
            .collect(),
    }
}
