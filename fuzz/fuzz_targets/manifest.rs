//! The OCI documents a registry or an image layout hands us: index, manifest and config.
//! Whatever the bytes, parsing ends with a document or an error naming what was parsed;
//! descriptors that parse carry digests safe to use as file names.
#![no_main]

use imp_image::manifest::{Digest, Document, Platform, parse_config, select_platform};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match Document::parse(data, "fuzzed manifest") {
        Ok(Document::Index(entries)) => {
            for platform in [Platform::host(), Platform::linux("arm64")] {
                if let Ok(d) = select_platform(&entries, &platform, "fuzzed image") {
                    safe_digest(&d.digest);
                }
            }
        }
        Ok(Document::Manifest { config, layers }) => {
            safe_digest(&config.digest);
            for l in &layers {
                safe_digest(&l.digest);
            }
        }
        Err(e) => assert!(e.to_string().contains("fuzzed"), "{e}"),
    }
    match parse_config(data, "fuzzed config") {
        Ok(_) => {}
        Err(e) => assert!(e.to_string().contains("fuzzed config"), "{e}"),
    }
    if let Ok(s) = std::str::from_utf8(data)
        && let Ok(d) = Digest::parse(s, "fuzzed digest")
    {
        safe_digest(&d);
    }
});

/// A digest that passed validation is `sha256:` and 64 lowercase hex digits.
fn safe_digest(d: &Digest) {
    assert_eq!(d.hex().len(), 64, "{}", d.as_str());
    assert!(
        d.hex()
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
        "{}",
        d.as_str()
    );
}
