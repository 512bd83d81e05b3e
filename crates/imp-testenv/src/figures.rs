//! The figures benchmarks print, gathered into one table: each [`figure`] is a line on stdout
//! (`FIGURE name = value unit (against)`) and, when `IMP_FIGURES` names a file, a
//! tab-separated row appended to it, which `scripts/bench` prints as one table after every
//! benchmark has run (CI prints the rows its test run wrote).

use std::io::Write as _;

/// The variable naming the file figures are appended to.
pub const FIGURES_ENV: &str = "IMP_FIGURES";

/// One figure: `name` (what was measured), `value` in `unit`, and what it is compared with
/// (its floor, its peer or its aim; empty when nothing).
pub fn figure(name: &str, value: f64, unit: &str, against: &str) {
    let shown = match against {
        "" => String::new(),
        a => format!(" ({a})"),
    };
    println!("FIGURE {name} = {value:.2} {unit}{shown}");
    let Some(path) = std::env::var_os(FIGURES_ENV) else {
        return;
    };
    let row = format!("{}\t{value:.2}\t{unit}\t{}\n", clean(name), clean(against));
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(row.as_bytes()));
    if let Err(e) = written {
        eprintln!(
            "cannot append a figure to {}: {e}",
            std::path::Path::new(&path).display()
        );
    }
}

/// The median of `v` (sorted in place; the mean of the two middle values for an even count);
/// NaN for none.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// `s` on one line without tabs, so a row stays a row.
fn clean(s: &str) -> String {
    s.replace(['\t', '\n'], " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_keeps_its_columns() {
        assert_eq!(clean("a\tb\nc"), "a b c");
    }

    #[test]
    fn the_median_is_the_middle_or_the_mean_of_the_two() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&mut []).is_nan());
    }
}
