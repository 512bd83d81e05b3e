//! Go-style duration strings (`90s`, `1h30m`, `500ms`), kept exactly as written so a user's
//! manifest round-trips unchanged, and parsed on use.

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

/// The pattern a Go duration string must match (no sign: imp never accepts negative durations).
pub const DURATION_PATTERN: &str = r"^(0|([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+)$";

/// A duration as the Go project's API writes it (`metav1.Duration` or a duration string).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct GoDuration(pub String);

/// Why a duration string could not be parsed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DurationError {
    /// The string is empty.
    #[error("empty duration")]
    Empty,
    /// A number had no unit after it, or an unknown unit.
    #[error(
        "invalid duration {0:?}: expected a number followed by ns, us, ms, s, m or h (for example 90s or 1h30m)"
    )]
    Syntax(String),
    /// The value does not fit.
    #[error("duration {0:?} is too large")]
    Overflow(String),
}

impl GoDuration {
    /// Builds a duration from a literal known to be valid, for defaults.
    pub fn from_static(s: &'static str) -> Self {
        Self(s.to_owned())
    }

    /// Parses the string into a [`Duration`].
    pub fn parse(&self) -> Result<Duration, DurationError> {
        parse_go(&self.0)
    }

    /// The string as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for GoDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl JsonSchema for GoDuration {
    fn schema_name() -> Cow<'static, str> {
        "GoDuration".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "pattern": DURATION_PATTERN,
        })
    }
}

/// Parses a Go duration string without sign (`0`, `1.5h`, `1h30m10s`, `250ms`).
pub fn parse_go(s: &str) -> Result<Duration, DurationError> {
    if s.is_empty() {
        return Err(DurationError::Empty);
    }
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let syntax = || DurationError::Syntax(s.to_owned());
    let mut total_nanos: u128 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(syntax)?;
        if num_len == 0 {
            return Err(syntax());
        }
        let (num, after) = rest.split_at(num_len);
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, next) = after.split_at(unit_len);
        let unit_nanos: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return Err(syntax()),
        };
        let (int_part, frac_part) = match num.split_once('.') {
            Some((i, f)) => (i, f),
            None => (num, ""),
        };
        if int_part.is_empty()
            || frac_part.contains('.')
            || (num.contains('.') && frac_part.is_empty())
        {
            return Err(syntax());
        }
        let int: u128 = int_part
            .parse()
            .map_err(|_| DurationError::Overflow(s.to_owned()))?;
        let mut value = int
            .checked_mul(unit_nanos)
            .ok_or_else(|| DurationError::Overflow(s.to_owned()))?;
        let mut scale = unit_nanos;
        for digit in frac_part.bytes() {
            scale /= 10;
            if scale == 0 {
                break;
            }
            value += u128::from(digit - b'0') * scale;
        }
        total_nanos = total_nanos
            .checked_add(value)
            .ok_or_else(|| DurationError::Overflow(s.to_owned()))?;
        rest = next;
    }
    let secs = u64::try_from(total_nanos / 1_000_000_000)
        .map_err(|_| DurationError::Overflow(s.to_owned()))?;
    // The remainder is below 10^9 and always fits.
    let nanos = (total_nanos % 1_000_000_000) as u32;
    Ok(Duration::new(secs, nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_spellings() {
        assert_eq!(parse_go("0").unwrap(), Duration::ZERO);
        assert_eq!(parse_go("0s").unwrap(), Duration::ZERO);
        assert_eq!(parse_go("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_go("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_go("1.5h").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_go("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_go("1m0.5s").unwrap(), Duration::from_millis(60_500));
        assert_eq!(parse_go("3us").unwrap(), Duration::from_micros(3));
        assert_eq!(parse_go("3µs").unwrap(), Duration::from_micros(3));
    }

    #[test]
    fn rejects_bad_spellings() {
        for bad in ["", "10", "s", "1x", "-1s", "1.s", ".5s", "1..2s", "1h 2m"] {
            assert!(parse_go(bad).is_err(), "{bad:?} should be rejected");
        }
        assert!(matches!(
            parse_go("99999999999999999999999h"),
            Err(DurationError::Overflow(_))
        ));
    }

    #[test]
    fn pattern_agrees_with_parser_on_samples() {
        // The pattern is what the API server enforces; the parser is what we act on.
        let good = ["0", "0s", "60s", "1h0m0s", "1.5h", "500ms"];
        for g in good {
            assert!(parse_go(g).is_ok(), "{g}");
        }
    }
}
