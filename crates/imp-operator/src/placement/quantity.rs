//! Kubernetes resource quantities ("4", "3500m", "8Gi", "1G") as numbers: CPU in millicores,
//! memory in bytes. The scheduler reads node capacity with them ([`crate::placement::schedule`]) and the
//! reservation Pods' requests ([`crate::placement::reservation`]); neither owns them.

/// Parses a Kubernetes CPU quantity ("4", "3500m", "0.5") into millicores.
pub fn parse_cpu_milli(q: &str) -> Option<i64> {
    let q = q.trim();
    if let Some(m) = q.strip_suffix('m') {
        return m.parse::<i64>().ok();
    }
    q.parse::<f64>().ok().map(|c| (c * 1000.0).round() as i64)
}

/// Parses a Kubernetes memory quantity ("8Gi", "8388608Ki", "1G", "1024") into bytes.
pub fn parse_bytes(q: &str) -> Option<u64> {
    let q = q.trim();
    const UNITS: [(&str, u64); 12] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("Pi", 1 << 50),
        ("Ei", 1 << 60),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
        ("P", 1_000_000_000_000_000),
        ("E", 1_000_000_000_000_000_000),
    ];
    for (suffix, mult) in UNITS {
        if let Some(n) = q.strip_suffix(suffix) {
            return n
                .parse::<f64>()
                .ok()
                .filter(|v| *v >= 0.0)
                .map(|v| (v * mult as f64) as u64);
        }
    }
    q.parse::<f64>()
        .ok()
        .filter(|v| *v >= 0.0)
        .map(|v| v as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_parse() {
        assert_eq!(parse_cpu_milli("4"), Some(4000));
        assert_eq!(parse_cpu_milli("3500m"), Some(3500));
        assert_eq!(parse_cpu_milli("0.5"), Some(500));
        assert_eq!(parse_bytes("8Gi"), Some(8 << 30));
        assert_eq!(parse_bytes("1024Ki"), Some(1 << 20));
        assert_eq!(parse_bytes("1G"), Some(1_000_000_000));
        assert_eq!(parse_bytes("2048"), Some(2048));
        assert_eq!(parse_bytes("lots"), None);
    }
}
