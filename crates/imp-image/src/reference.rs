//! Where an image comes from: a registry reference, a local OCI layout or an `oci-archive` tar.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use oci_client::Reference;

use super::ImageError;

/// An image to pull, as a user writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageSource {
    /// A registry reference by tag or digest, e.g. `127.0.0.1:5000/x@sha256:…`.
    Registry(Reference),
    /// An OCI image layout directory (`oci-layout` + `index.json`), optionally one tag of it.
    OciLayout {
        /// The layout directory.
        dir: PathBuf,
        /// The `org.opencontainers.image.ref.name` to pick; None needs a single-image index.
        tag: Option<String>,
    },
    /// A tar of an OCI image layout, optionally one tag of it.
    OciArchive {
        /// The tar file.
        file: PathBuf,
        /// The tag to pick, as for [`ImageSource::OciLayout`].
        tag: Option<String>,
    },
}

/// Splits `PATH[:TAG]`, taking the last `:` as the tag separator when what follows is a tag.
fn path_and_tag(input: &str, rest: &str) -> Result<(PathBuf, Option<String>), ImageError> {
    let (path, tag) = match rest.rsplit_once(':') {
        Some((p, t)) if !t.is_empty() && !t.contains('/') => (p, Some(t.to_owned())),
        _ => (rest, None),
    };
    if path.is_empty() {
        return Err(ImageError::InvalidSource {
            input: input.to_owned(),
            reason: "the path is empty".into(),
        });
    }
    Ok((PathBuf::from(path), tag))
}

impl FromStr for ImageSource {
    type Err = ImageError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.is_empty() {
            return Err(ImageError::InvalidSource {
                input: s.to_owned(),
                reason: "it is empty".into(),
            });
        }
        if let Some(rest) = s.strip_prefix("oci-archive:") {
            let (file, tag) = path_and_tag(s, rest)?;
            return Ok(Self::OciArchive { file, tag });
        }
        if let Some(rest) = s.strip_prefix("oci:") {
            let (dir, tag) = path_and_tag(s, rest)?;
            return Ok(Self::OciLayout { dir, tag });
        }
        if s.starts_with('/') || s.starts_with("./") || s.starts_with("../") || s == "." {
            return Ok(Self::OciLayout {
                dir: PathBuf::from(s),
                tag: None,
            });
        }
        let reference = Reference::from_str(s).map_err(|source| ImageError::InvalidReference {
            input: s.to_owned(),
            source,
        })?;
        Ok(Self::Registry(reference))
    }
}

impl fmt::Display for ImageSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tagged = |f: &mut fmt::Formatter<'_>, kind: &str, p: &PathBuf, t: &Option<String>| {
            write!(f, "{kind}:{}", p.display())?;
            if let Some(t) = t {
                write!(f, ":{t}")?;
            }
            Ok(())
        };
        match self {
            Self::Registry(r) => write!(f, "{}", r.whole()),
            Self::OciLayout { dir, tag } => tagged(f, "oci", dir, tag),
            Self::OciArchive { file, tag } => tagged(f, "oci-archive", file, tag),
        }
    }
}

/// True for a registry host that is this machine (plain HTTP is allowed only there).
pub fn is_loopback_registry(registry: &str) -> bool {
    let host = if let Some(rest) = registry.strip_prefix('[') {
        rest.split(']').next().unwrap_or(rest)
    } else {
        registry.rsplit_once(':').map_or(registry, |(h, _)| h)
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn parses_every_form() {
        let r: ImageSource = "docker.io/library/busybox:1.36".parse().unwrap();
        let ImageSource::Registry(r) = r else {
            panic!("{r:?}")
        };
        assert_eq!(r.registry(), "docker.io");
        assert_eq!(r.tag(), Some("1.36"));
        let d = format!("127.0.0.1:5000/x@sha256:{}", "a".repeat(64));
        let ImageSource::Registry(r) = d.parse().unwrap() else {
            panic!()
        };
        assert_eq!(r.registry(), "127.0.0.1:5000");
        assert!(r.digest().is_some());
        assert_eq!(
            "oci:/tmp/l:v1".parse::<ImageSource>().unwrap(),
            ImageSource::OciLayout {
                dir: "/tmp/l".into(),
                tag: Some("v1".into())
            }
        );
        assert_eq!(
            "oci:/tmp/l".parse::<ImageSource>().unwrap(),
            ImageSource::OciLayout {
                dir: "/tmp/l".into(),
                tag: None
            }
        );
        assert_eq!(
            "oci-archive:./a.tar:latest".parse::<ImageSource>().unwrap(),
            ImageSource::OciArchive {
                file: "./a.tar".into(),
                tag: Some("latest".into())
            }
        );
        assert_eq!(
            "./dir".parse::<ImageSource>().unwrap(),
            ImageSource::OciLayout {
                dir: "./dir".into(),
                tag: None
            }
        );
    }

    #[test]
    fn bad_input_names_itself() {
        let e = "oci:".parse::<ImageSource>().unwrap_err();
        assert!(e.to_string().contains("\"oci:\""), "{e}");
        let e = "UPPER/Case:tag".parse::<ImageSource>().unwrap_err();
        assert!(e.to_string().contains("UPPER/Case"), "{e}");
    }

    #[test]
    fn loopback_registries() {
        assert!(is_loopback_registry("127.0.0.1:5000"));
        assert!(is_loopback_registry("localhost:5000"));
        assert!(is_loopback_registry("localhost"));
        assert!(is_loopback_registry("[::1]:5000"));
        assert!(!is_loopback_registry("docker.io"));
        assert!(!is_loopback_registry("10.0.0.1:5000"));
    }
}
