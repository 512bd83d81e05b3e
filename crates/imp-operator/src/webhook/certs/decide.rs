//! What the keeper does next, as pure functions of one read of the Secret and of the webhook
//! configurations: [`next_step`] (at most one write of the Secret per pass), [`bundle`] (the
//! `caBundle` to publish) and [`ca_patch`] (the JSON patch that publishes it).

use base64::Engine as _;
use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation, TestOperation};
use serde_json::Value;

use super::material::{Material, Unusable, pem_certs};
use super::{Policy, secs};

/// What the Secret holds, as the decisions see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stored {
    /// There is no Secret.
    Absent,
    /// There is one, and this is why it cannot be used.
    Unusable(Unusable),
    /// There is one, and it can be served.
    Usable(Material),
}

/// Which kind of webhook configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A ValidatingWebhookConfiguration.
    Validating,
    /// A MutatingWebhookConfiguration.
    Mutating,
    /// The APIService of the gateway (`spec.caBundle`; one entry in `hooks`, unnamed).
    ApiService,
}

/// One of the operator's webhook configurations, as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Published {
    /// Its kind.
    pub kind: Kind,
    /// Its name.
    pub name: String,
    /// The resourceVersion read (the patch tests it).
    pub resource_version: Option<String>,
    /// Each webhook's name and `clientConfig.caBundle`, in order.
    pub hooks: Vec<(String, Vec<u8>)>,
}

/// Why a new CA and serving certificate are made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IssueWhy {
    /// There is no Secret.
    Absent,
    /// The Secret cannot be used.
    Unusable(Unusable),
    /// The signing CA has expired (the operator was down through its rotation).
    CaExpired,
}

impl std::fmt::Display for IssueWhy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IssueWhy::Absent => f.write_str("the Secret does not exist"),
            IssueWhy::Unusable(u) => write!(f, "the Secret cannot be used: {u}"),
            IssueWhy::CaExpired => f.write_str("its CA has expired"),
        }
    }
}

/// Why the serving certificate is renewed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RenewWhy {
    /// Two thirds of its life have passed.
    Due,
    /// It has expired.
    Expired,
    /// A CA newer than the one that signed it is published.
    NewCa,
    /// It lacks a name the operator serves under.
    Names,
}

impl std::fmt::Display for RenewWhy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RenewWhy::Due => "two thirds of its validity have passed",
            RenewWhy::Expired => "it has expired",
            RenewWhy::NewCa => "a new CA is published",
            RenewWhy::Names => "it lacks a name to serve under",
        })
    }
}

/// The one write of the Secret a pass makes, if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing to write: serve and publish what the Secret holds.
    Keep,
    /// Make a new CA and a serving certificate it signs.
    Issue(IssueWhy),
    /// Put a new CA in front of the old one (both published; the serving certificate stays).
    AddCa,
    /// Sign a new serving certificate with the first CA.
    RenewServing(RenewWhy),
    /// Keep only the first CA: the serving certificate it signed has been in use long enough.
    DropOldCas,
}

/// The next step for `stored`, given what `published` holds at `now` (Unix seconds).
///
/// A serving certificate from a new CA is only made once every configuration trusts that CA
/// and the CA is [`Policy::settle`] old (unless the current certificate has expired and
/// nothing is lost by not waiting), so the API server trusts whatever is served; the old CA is
/// dropped only [`Policy::settle`] after that certificate was made.
pub fn next_step(stored: &Stored, published: &[Published], now: i64, policy: &Policy) -> Step {
    let m = match stored {
        Stored::Absent => return Step::Issue(IssueWhy::Absent),
        Stored::Unusable(why) => return Step::Issue(IssueWhy::Unusable(why.clone())),
        Stored::Usable(m) => m,
    };
    let signing = &m.cas[0];
    if signing.expired(now) {
        return Step::Issue(IssueWhy::CaExpired);
    }
    if now >= signing.renew_at() {
        return Step::AddCa;
    }
    if let Some(why) = serving_renewal(m, now, policy) {
        let settle = secs(policy.settle());
        let trusted = trusted_everywhere(published, &signing.der)
            && now >= signing.issued_at().saturating_add(settle);
        let waiting = why != RenewWhy::Expired && !trusted;
        return if waiting {
            Step::Keep
        } else {
            Step::RenewServing(why)
        };
    }
    let settled = now >= m.serving.issued_at().saturating_add(secs(policy.settle()));
    if m.cas.len() > 1 && settled {
        return Step::DropOldCas;
    }
    Step::Keep
}

/// Why the serving certificate must be replaced, if it must.
fn serving_renewal(m: &Material, now: i64, policy: &Policy) -> Option<RenewWhy> {
    if m.serving.expired(now) {
        Some(RenewWhy::Expired)
    } else if m.serving_signer != 0 {
        Some(RenewWhy::NewCa)
    } else if !m.serving.covers(policy.names()) {
        Some(RenewWhy::Names)
    } else if now >= m.serving.renew_at() {
        Some(RenewWhy::Due)
    } else {
        None
    }
}

/// Whether every webhook of every configuration read trusts the CA `ca_der` (true when there
/// are none: nothing calls a webhook that is not registered).
pub fn trusted_everywhere(published: &[Published], ca_der: &[u8]) -> bool {
    published.iter().all(|p| {
        p.hooks
            .iter()
            .all(|(_, bundle)| pem_certs(bundle).is_ok_and(|ders| ders.iter().any(|d| d == ca_der)))
    })
}

/// The `caBundle` to publish: every CA of `m` not expired at `now`, the signing one first.
pub fn bundle(m: &Material, now: i64) -> Vec<u8> {
    m.cas
        .iter()
        .filter(|c| !c.expired(now))
        .map(|c| c.pem())
        .collect::<String>()
        .into_bytes()
}

/// The JSON patch that sets `bundle` as the `caBundle` of every webhook of `config` that holds
/// another, or `None` when all hold it. It tests the resourceVersion read and each webhook's
/// name first, so it fails (and nothing changes) if the configuration changed since.
pub fn ca_patch(config: &Published, bundle: &[u8]) -> Option<Patch> {
    let mut ops = Vec::new();
    if let Some(rv) = &config.resource_version {
        ops.push(PatchOperation::Test(TestOperation {
            path: PointerBuf::from_tokens(["metadata", "resourceVersion"]),
            value: Value::String(rv.clone()),
        }));
    }
    let encoded = base64::engine::general_purpose::STANDARD.encode(bundle);
    let mut changed = false;
    for (i, (name, current)) in config.hooks.iter().enumerate() {
        if current.as_slice() == bundle {
            continue;
        }
        changed = true;
        let index = i.to_string();
        let path = match config.kind {
            Kind::ApiService => PointerBuf::from_tokens(["spec", "caBundle"]),
            Kind::Validating | Kind::Mutating => {
                ops.push(PatchOperation::Test(TestOperation {
                    path: PointerBuf::from_tokens(["webhooks", index.as_str(), "name"]),
                    value: Value::String(name.clone()),
                }));
                PointerBuf::from_tokens(["webhooks", index.as_str(), "clientConfig", "caBundle"])
            }
        };
        ops.push(PatchOperation::Add(AddOperation {
            path,
            value: Value::String(encoded.clone()),
        }));
    }
    changed.then_some(Patch(ops))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::super::material::tests::{T0, policy};
    use super::*;

    fn published(bundles: &[&[u8]]) -> Vec<Published> {
        vec![Published {
            kind: Kind::Validating,
            name: "imp-validating-webhook".into(),
            resource_version: Some("7".into()),
            hooks: bundles
                .iter()
                .enumerate()
                .map(|(i, b)| (format!("hook{i}"), b.to_vec()))
                .collect(),
        }]
    }

    #[test]
    fn nothing_usable_is_replaced_whole() {
        let p = policy(6, 30);
        assert_eq!(
            next_step(&Stored::Absent, &[], T0, &p),
            Step::Issue(IssueWhy::Absent)
        );
        let why = Unusable::Missing("ca.key");
        assert_eq!(
            next_step(&Stored::Unusable(why.clone()), &[], T0, &p),
            Step::Issue(IssueWhy::Unusable(why))
        );
        let m = Material::issue(&p, T0).unwrap();
        assert_eq!(
            next_step(&Stored::Usable(m), &[], T0 + 30, &p),
            Step::Issue(IssueWhy::CaExpired)
        );
    }

    #[test]
    fn the_serving_certificate_is_renewed_after_two_thirds_of_its_life() {
        let p = policy(6, 30);
        let m = Material::issue(&p, T0).unwrap();
        let pubd = published(&[&bundle(&m, T0)]);
        let s = Stored::Usable(m);
        assert_eq!(next_step(&s, &pubd, T0, &p), Step::Keep);
        assert_eq!(next_step(&s, &pubd, T0 + 3, &p), Step::Keep);
        assert_eq!(
            next_step(&s, &pubd, T0 + 4, &p),
            Step::RenewServing(RenewWhy::Due)
        );
        assert_eq!(
            next_step(&s, &pubd, T0 + 6, &p),
            Step::RenewServing(RenewWhy::Expired)
        );
    }

    #[test]
    fn a_serving_certificate_without_a_wanted_name_is_renewed() {
        let p = policy(600, 6000);
        let m = Material::issue(&p, T0).unwrap();
        let pubd = published(&[&bundle(&m, T0)]);
        let more = Policy::new(
            super::super::Names::for_service("imp-webhook", "other-ns", &[], &[]),
            p.serving_validity(),
            p.ca_validity(),
        )
        .unwrap();
        // Not while the CA is younger than settle (41 s here): nothing is lost by waiting.
        let s = Stored::Usable(m);
        assert_eq!(next_step(&s, &pubd, T0 + 1, &more), Step::Keep);
        assert_eq!(
            next_step(&s, &pubd, T0 + 60, &more),
            Step::RenewServing(RenewWhy::Names)
        );
    }

    #[test]
    fn a_ca_rotation_waits_for_publication_then_for_the_replicas() {
        let p = policy(6, 30);
        let first = Material::issue(&p, T0).unwrap();
        let m = first.with_new_serving(&p, T0 + 18).unwrap();
        let old_bundle = bundle(&m, T0);
        // Two thirds of the CA's life: a new CA goes in front; the serving one stays.
        assert_eq!(
            next_step(
                &Stored::Usable(m.clone()),
                &published(&[&old_bundle]),
                T0 + 20,
                &p
            ),
            Step::AddCa
        );
        let rotated = m.with_new_ca(&p, T0 + 20).unwrap();
        let both = bundle(&rotated, T0 + 20);
        assert_eq!(
            pem_certs(&both).unwrap(),
            [rotated.cas[0].der.clone(), m.cas[0].der.clone()]
        );
        let s = Stored::Usable(rotated.clone());
        // Not yet in every configuration: the old CA's serving certificate stays.
        let half = published(&[&both, &old_bundle]);
        assert_eq!(next_step(&s, &half, T0 + 23, &p), Step::Keep);
        // Everywhere, but only just (settle: 1.5 s, counted as 2): the API server may not
        // have seen it yet.
        let everywhere = published(&[&both, &both]);
        assert_eq!(next_step(&s, &everywhere, T0 + 21, &p), Step::Keep);
        assert_eq!(
            next_step(&s, &everywhere, T0 + 22, &p),
            Step::RenewServing(RenewWhy::NewCa)
        );
        // The new serving certificate: the old CA stays until every replica has re-read.
        let renewed = rotated.with_new_serving(&p, T0 + 22).unwrap();
        let s = Stored::Usable(renewed.clone());
        assert_eq!(next_step(&s, &everywhere, T0 + 23, &p), Step::Keep);
        assert_eq!(next_step(&s, &everywhere, T0 + 24, &p), Step::DropOldCas);
        let dropped = renewed.without_old_cas();
        assert_eq!(
            pem_certs(&bundle(&dropped, T0 + 24)).unwrap(),
            [renewed.cas[0].der.clone()]
        );
        assert_eq!(
            next_step(&Stored::Usable(dropped), &everywhere, T0 + 24, &p),
            Step::Keep
        );
    }

    #[test]
    fn an_expired_serving_certificate_does_not_wait_for_publication() {
        let p = policy(6, 30);
        let rotated = Material::issue(&p, T0)
            .unwrap()
            .with_new_ca(&p, T0 + 5)
            .unwrap();
        assert_eq!(
            next_step(&Stored::Usable(rotated), &published(&[b""]), T0 + 11, &p),
            Step::RenewServing(RenewWhy::Expired)
        );
    }

    #[test]
    fn no_configuration_trusts_nothing_and_blocks_nothing() {
        assert!(trusted_everywhere(&[], b"ca"));
        assert!(!trusted_everywhere(&published(&[b""]), b"ca"));
        assert!(!trusted_everywhere(&published(&[b"not pem"]), b"ca"));
    }

    #[test]
    fn expired_cas_are_not_published() {
        let p = policy(6, 30);
        let m = Material::issue(&p, T0).unwrap();
        let rotated = m.with_new_ca(&p, T0 + 20).unwrap();
        assert_eq!(
            pem_certs(&bundle(&rotated, T0 + 30)).unwrap(),
            [rotated.cas[0].der.clone()]
        );
    }

    #[test]
    fn the_patch_sets_only_the_bundles_that_differ_after_testing_what_was_read() {
        let cfg = published(&[b"new", b"old"]);
        let patch = ca_patch(&cfg[0], b"new").unwrap();
        let json = serde_json::to_value(&patch).unwrap();
        assert_eq!(
            json,
            serde_json::json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": "7"},
                {"op": "test", "path": "/webhooks/1/name", "value": "hook1"},
                {"op": "add", "path": "/webhooks/1/clientConfig/caBundle", "value": "bmV3"},
            ])
        );
        assert_eq!(ca_patch(&published(&[b"new", b"new"])[0], b"new"), None);
        // It applies to the configuration as the server stores it.
        let mut doc = serde_json::json!({
            "metadata": {"name": "imp-validating-webhook", "resourceVersion": "7"},
            "webhooks": [
                {"name": "hook0", "clientConfig": {"url": "https://x/validate", "caBundle": "bmV3"}},
                {"name": "hook1", "clientConfig": {"url": "https://x/validate"}},
            ]
        });
        json_patch::patch(&mut doc, &patch).unwrap();
        assert_eq!(doc["webhooks"][1]["clientConfig"]["caBundle"], "bmV3");
        assert_eq!(
            doc["webhooks"][1]["clientConfig"]["url"],
            "https://x/validate"
        );
        // A configuration changed since it was read is left alone.
        doc["metadata"]["resourceVersion"] = "8".into();
        doc["webhooks"][1]["clientConfig"]
            .as_object_mut()
            .unwrap()
            .remove("caBundle");
        assert!(json_patch::patch(&mut doc.clone(), &patch).is_err());
    }
}
