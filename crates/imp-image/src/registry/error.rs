//! What a registry's refusal means: oci-client's errors and raw HTTP answers sorted into the
//! few cases a caller acts on (credentials refused, access denied, nothing there).

use std::io;

use oci_client::errors::{OciDistributionError, OciErrorCode};

/// Why a registry request failed. Every variant names the registry and what was being done.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The registry refused the credentials (or asked for some and got none).
    #[error("Registry {registry} refused the credentials (HTTP 401) while {what}: {detail}")]
    Unauthorized {
        /// The registry host.
        registry: String,
        /// What was being done.
        what: String,
        /// What the registry or token endpoint said.
        detail: String,
    },
    /// The credentials were accepted but do not allow the operation.
    #[error("Registry {registry} denied access (HTTP 403) while {what}: {detail}")]
    Forbidden {
        /// The registry host.
        registry: String,
        /// What was being done.
        what: String,
        /// What the registry said.
        detail: String,
    },
    /// The registry has no manifest under the reference.
    #[error("Registry {registry} has no {what}")]
    NotFound {
        /// The registry host.
        registry: String,
        /// What was looked up (`manifest <reference>`).
        what: String,
    },
    /// The registry does not allow deleting manifests.
    #[error("Registry {registry} does not allow deleting {what} (HTTP {status}): {detail}")]
    DeleteUnsupported {
        /// The registry host.
        registry: String,
        /// The manifest to delete.
        what: String,
        /// The HTTP status.
        status: u16,
        /// What the registry said.
        detail: String,
    },
    /// A registry request failed in oci-client.
    #[error("Registry {registry}: {what}")]
    Request {
        /// The registry host.
        registry: String,
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: OciDistributionError,
    },
    /// A registry request failed in the HTTP client.
    #[error("Registry {registry}: {what}")]
    Http {
        /// The registry host.
        registry: String,
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: reqwest::Error,
    },
    /// The registry answered with an unexpected status.
    #[error("Registry {registry} answered HTTP {status} while {what}: {detail}")]
    Status {
        /// The registry host.
        registry: String,
        /// What was being done.
        what: String,
        /// The HTTP status.
        status: u16,
        /// The body, shortened.
        detail: String,
    },
    /// A manifest or blob is larger than the limit its reader set (a hostile or broken
    /// registry), so it was not read further.
    #[error("Registry {registry} sent more than {limit} bytes for {what}")]
    TooLarge {
        /// The registry host.
        registry: String,
        /// Which manifest or blob.
        what: String,
        /// The most that was accepted.
        limit: u64,
    },
    /// Content does not hash to the digest that names it (or is not of its declared size).
    #[error(
        "Digest mismatch for {what} from registry {registry}: expected {expected}, got {actual}"
    )]
    DigestMismatch {
        /// The registry host.
        registry: String,
        /// Which manifest or blob.
        what: String,
        /// The digest it should have.
        expected: String,
        /// The digest it has.
        actual: String,
    },
    /// Downloading a blob failed part way (including oci-client's own digest check).
    #[error("Registry {registry}: downloading {what}")]
    Download {
        /// The registry host.
        registry: String,
        /// Which blob.
        what: String,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
}

/// What an oci-client error means here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Unauthorized,
    Forbidden,
    NotFound,
    Other,
}

/// Sorts an oci-client error by its HTTP status or its OCI error codes.
pub(super) fn kind_of(e: &OciDistributionError) -> Kind {
    let by_status = |s: u16| match s {
        401 => Kind::Unauthorized,
        403 => Kind::Forbidden,
        404 => Kind::NotFound,
        _ => Kind::Other,
    };
    match e {
        OciDistributionError::UnauthorizedError { .. }
        | OciDistributionError::AuthenticationFailure(_) => Kind::Unauthorized,
        OciDistributionError::ImageManifestNotFoundError(_) => Kind::NotFound,
        OciDistributionError::ServerError { code, .. } => by_status(*code),
        OciDistributionError::RequestError(r) => {
            r.status().map_or(Kind::Other, |s| by_status(s.as_u16()))
        }
        OciDistributionError::RegistryError { envelope, .. } => {
            let has = |c: OciErrorCode| envelope.errors.iter().any(|e| e.code == c);
            if has(OciErrorCode::Unauthorized) {
                Kind::Unauthorized
            } else if has(OciErrorCode::Denied) {
                Kind::Forbidden
            } else if has(OciErrorCode::ManifestUnknown)
                || has(OciErrorCode::NameUnknown)
                || has(OciErrorCode::NotFound)
            {
                Kind::NotFound
            } else {
                Kind::Other
            }
        }
        _ => Kind::Other,
    }
}

/// Maps an oci-client error met while doing `what`; `missing` names what a 404 means is not
/// there (a manifest looked up), where it means that rather than a failure.
pub(super) fn registry_error(
    registry: &str,
    what: String,
    missing: Option<&str>,
    e: OciDistributionError,
) -> Error {
    match (kind_of(&e), missing) {
        (Kind::Unauthorized, _) => Error::Unauthorized {
            registry: registry.to_owned(),
            what,
            detail: shorten(&e.to_string()),
        },
        (Kind::Forbidden, _) => Error::Forbidden {
            registry: registry.to_owned(),
            what,
            detail: shorten(&e.to_string()),
        },
        (Kind::NotFound, Some(m)) => Error::NotFound {
            registry: registry.to_owned(),
            what: m.to_owned(),
        },
        _ => Error::Request {
            registry: registry.to_owned(),
            what,
            source: e,
        },
    }
}

/// A registry's answer cut to 300 characters, for a message.
pub(super) fn shorten(s: &str) -> String {
    let s = s.trim();
    match s.char_indices().nth(300) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_errors_are_classified() {
        let e = registry_error(
            "r:5000",
            "pushing".into(),
            None,
            OciDistributionError::ServerError {
                code: 401,
                url: "http://r:5000/v2/".into(),
                message: "no".into(),
            },
        )
        .to_string();
        assert!(e.contains("Registry r:5000") && e.contains("401"), "{e}");
        let e = registry_error(
            "r:5000",
            "x".into(),
            None,
            OciDistributionError::UnauthorizedError { url: "u".into() },
        );
        assert!(matches!(e, Error::Unauthorized { .. }));
        let not_found = || OciDistributionError::ServerError {
            code: 404,
            url: "u".into(),
            message: String::new(),
        };
        let e = registry_error(
            "r:5000",
            "x".into(),
            Some("manifest r:5000/a:b"),
            not_found(),
        );
        assert!(matches!(e, Error::NotFound { .. }), "{e}");
        assert!(e.to_string().contains("manifest r:5000/a:b"), "{e}");
        let e = registry_error("r:5000", "x".into(), None, not_found());
        assert!(matches!(e, Error::Request { .. }), "{e}");
    }

    #[test]
    fn long_answers_are_shortened_on_a_character() {
        assert_eq!(shorten("  short \n"), "short");
        let long = "é".repeat(400);
        let s = shorten(&long);
        assert_eq!(s.chars().count(), 301);
        assert!(s.ends_with('…'));
    }
}
