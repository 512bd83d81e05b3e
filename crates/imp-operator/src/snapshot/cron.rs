//! Five-field cron expressions (`minute hour day-of-month month day-of-week`), evaluated in UTC.
//!
//! The grammar is Vixie cron's: each field is a comma-separated list of `*`, a value, a range
//! `a-b`, or either with a step (`*/5`, `1-10/2`; `a/n` means `a-max/n`); months and weekdays
//! also take their three-letter English names (`JAN`..`DEC`, `SUN`..`SAT`, any case), and
//! day-of-week `7` is Sunday like `0`. `?` stands for `*` (robfig's parser, which the Go project
//! used, accepts it). The macros `@yearly` (`@annually`), `@monthly`, `@weekly`, `@daily`
//! (`@midnight`) and `@hourly` stand for their usual expressions.
//!
//! Day matching follows Vixie cron: when both day-of-month and day-of-week are restricted (their
//! first element does not start with `*`), a day matches if *either* does; otherwise both must.
//! So `0 0 1,15 * MON` fires on the 1st, the 15th and every Monday, and `0 0 */2 * MON` on
//! Mondays with an odd day of the month.
//!
//! Times are UTC. The Go project evaluated schedules in the operator's local time (a
//! container's, so usually UTC too); ours is always UTC, whatever the host says.
//!
//! Not supported (each is an error saying so): `@every <duration>`, `@reboot`, a seconds field,
//! `CRON_TZ=`/`TZ=` prefixes, `L`, `W` and `#`.

use std::fmt;
use std::str::FromStr;

use k8s_openapi::jiff::civil::Date;
use k8s_openapi::jiff::tz::Offset;
use k8s_openapi::jiff::{Timestamp, civil};

/// Years [`Schedule::next_after`] looks ahead before it decides an expression never fires
/// (a 29 February can be eight years away, as from 2096 to 2104).
const HORIZON_YEARS: i16 = 9;

/// One of the five fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::VariantArray)]
pub enum Field {
    /// 0-59.
    Minute,
    /// 0-23.
    Hour,
    /// 1-31.
    DayOfMonth,
    /// 1-12 or `JAN`..`DEC`.
    Month,
    /// 0-7 (0 and 7 are Sunday) or `SUN`..`SAT`.
    DayOfWeek,
}

impl Field {
    const ALL: &'static [Self] = <Self as strum::VariantArray>::VARIANTS;

    fn bounds(self) -> (u8, u8) {
        match self {
            Field::Minute => (0, 59),
            Field::Hour => (0, 23),
            Field::DayOfMonth => (1, 31),
            Field::Month => (1, 12),
            Field::DayOfWeek => (0, 7),
        }
    }

    fn names(self) -> &'static [&'static str] {
        match self {
            Field::Month => &[
                "JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC",
            ],
            Field::DayOfWeek => &["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"],
            _ => &[],
        }
    }

    /// The first value a name stands for (`JAN` is 1, `SUN` is 0).
    fn first_named(self) -> u8 {
        match self {
            Field::Month => 1,
            _ => 0,
        }
    }
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Field::Minute => "minute",
            Field::Hour => "hour",
            Field::DayOfMonth => "day-of-month",
            Field::Month => "month",
            Field::DayOfWeek => "day-of-week",
        })
    }
}

/// What is wrong with one element of a field.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    /// Neither a number nor a name this field knows.
    #[error("not a number{}", names_hint(*.0))]
    NotANumber(Field),
    /// A value outside the field's range.
    #[error("{value} is out of range {min}-{max}")]
    OutOfRange {
        /// The value.
        value: u32,
        /// Smallest allowed.
        min: u8,
        /// Largest allowed.
        max: u8,
    },
    /// A range whose start is after its end.
    #[error("range start {start} is after its end {end}")]
    Backwards {
        /// Start.
        start: u8,
        /// End.
        end: u8,
    },
    /// A step that is not a positive number.
    #[error("step must be a positive number")]
    BadStep,
    /// Nothing between two commas (or an empty field).
    #[error("empty element")]
    Empty,
    /// Cron syntax other dialects have and this one does not.
    #[error("{0} is not supported")]
    Unsupported(&'static str),
}

fn names_hint(field: Field) -> &'static str {
    match field {
        Field::Month => " or month name (JAN..DEC)",
        Field::DayOfWeek => " or weekday name (SUN..SAT)",
        _ => "",
    }
}

/// Why an expression is not a schedule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// Not five fields.
    #[error(
        "expected 5 fields (minute hour day-of-month month day-of-week) or a macro such as @daily, got {0}"
    )]
    FieldCount(usize),
    /// An `@` word that is not one of the macros.
    #[error(
        "unknown macro {0:?}: known are @yearly, @annually, @monthly, @weekly, @daily, @midnight and @hourly"
    )]
    Macro(String),
    /// A `CRON_TZ=`/`TZ=` prefix.
    #[error("time zone prefix {0:?} is not supported: schedules are UTC")]
    TimeZone(String),
    /// One element of one field is wrong.
    #[error("{field} field: {token:?}: {problem}")]
    Element {
        /// The field.
        field: Field,
        /// The element as written.
        token: String,
        /// What is wrong with it.
        problem: Problem,
    },
}

/// A set of small numbers (0..64).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Bits(u64);

impl Bits {
    fn has(self, v: u8) -> bool {
        v < 64 && self.0 & (1 << v) != 0
    }

    fn set(&mut self, v: u8) {
        self.0 |= 1 << v;
    }

    /// The smallest member `>= from`.
    fn next_from(self, from: u8) -> Option<u8> {
        if from >= 64 {
            return None;
        }
        let rest = self.0 >> from;
        (rest != 0).then(|| from + rest.trailing_zeros() as u8)
    }
}

/// A parsed schedule; [`Schedule::next_after`] gives its ticks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    minutes: Bits,
    hours: Bits,
    days: Bits,
    months: Bits,
    /// Sunday is 0 (a 7 is folded into it).
    weekdays: Bits,
    /// Day-of-month's first element starts with `*`.
    days_star: bool,
    /// Day-of-week's first element starts with `*`.
    weekdays_star: bool,
}

impl FromStr for Schedule {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        Schedule::parse(s)
    }
}

impl Schedule {
    /// Parses a five-field expression or a macro.
    pub fn parse(expr: &str) -> Result<Self, Error> {
        let expr = expr.trim();
        let expanded = match expr.strip_prefix('@') {
            Some(word) => match word.to_ascii_lowercase().as_str() {
                "yearly" | "annually" => "0 0 1 1 *",
                "monthly" => "0 0 1 * *",
                "weekly" => "0 0 * * 0",
                "daily" | "midnight" => "0 0 * * *",
                "hourly" => "0 * * * *",
                _ => return Err(Error::Macro(expr.to_owned())),
            },
            None => expr,
        };
        let fields: Vec<&str> = expanded.split_whitespace().collect();
        if let Some(prefix) = fields.first().filter(|f| f.contains('=')) {
            return Err(Error::TimeZone((*prefix).to_owned()));
        }
        if fields.len() != 5 {
            return Err(Error::FieldCount(fields.len()));
        }
        let mut sets = [Bits::default(); 5];
        for ((field, text), set) in Field::ALL.iter().zip(&fields).zip(sets.iter_mut()) {
            *set = parse_field(*field, text)?;
        }
        let [minutes, hours, days, months, mut weekdays] = sets;
        if weekdays.has(7) {
            weekdays.0 &= !(1 << 7);
            weekdays.set(0);
        }
        let star = |text: &str| text.starts_with('*') || text.starts_with('?');
        Ok(Schedule {
            minutes,
            hours,
            days,
            months,
            weekdays,
            days_star: star(fields[2]),
            weekdays_star: star(fields[4]),
        })
    }

    fn day_matches(&self, date: Date) -> bool {
        let dom = self.days.has(date.day() as u8);
        let dow = self
            .weekdays
            .has(date.weekday().to_sunday_zero_offset() as u8);
        if self.days_star || self.weekdays_star {
            dom && dow
        } else {
            dom || dow
        }
    }

    /// The first tick strictly after `t` (ticks fall on whole minutes, UTC), or `None` if the
    /// expression never fires (e.g. `0 0 30 2 *`, the 30th of February).
    pub fn next_after(&self, t: Timestamp) -> Option<Timestamp> {
        let floor = t.as_second() - i64::from(t.subsec_nanosecond() < 0);
        let start = Timestamp::from_second(floor.div_euclid(60) * 60 + 60).ok()?;
        let dt = Offset::UTC.to_datetime(start);
        let mut at = Cursor {
            year: dt.year(),
            month: dt.month() as u8,
            day: dt.day() as u8,
            hour: dt.hour() as u8,
            minute: dt.minute() as u8,
        };
        let last_year = at.year.saturating_add(HORIZON_YEARS);
        while at.year <= last_year {
            if !self.months.has(at.month) {
                match self.months.next_from(at.month + 1) {
                    Some(m) => at.month = m,
                    None => {
                        at.year = at.year.checked_add(1)?;
                        at.month = self.months.next_from(1)?;
                    }
                }
                (at.day, at.hour, at.minute) = (1, 0, 0);
                continue;
            }
            let date = Date::new(at.year, at.month as i8, at.day as i8).ok()?;
            if !self.day_matches(date) {
                at.next_day(date)?;
                continue;
            }
            let Some(hour) = self.hours.next_from(at.hour) else {
                at.next_day(date)?;
                continue;
            };
            if hour != at.hour {
                (at.hour, at.minute) = (hour, 0);
            }
            let Some(minute) = self.minutes.next_from(at.minute) else {
                if at.hour == 23 {
                    at.next_day(date)?;
                } else {
                    (at.hour, at.minute) = (at.hour + 1, 0);
                }
                continue;
            };
            let dt = civil::DateTime::from_parts(
                date,
                civil::Time::new(at.hour as i8, minute as i8, 0, 0).ok()?,
            );
            return Offset::UTC.to_timestamp(dt).ok();
        }
        None
    }
}

/// Where the search for the next tick is.
struct Cursor {
    year: i16,
    month: u8,
    day: u8,
    hour: u8,
    minute: u8,
}

impl Cursor {
    /// Midnight of the day after `today` (which is this cursor's date).
    fn next_day(&mut self, today: Date) -> Option<()> {
        (self.hour, self.minute) = (0, 0);
        if (self.day as i8) < today.days_in_month() {
            self.day += 1;
        } else if self.month < 12 {
            (self.month, self.day) = (self.month + 1, 1);
        } else {
            (self.year, self.month, self.day) = (self.year.checked_add(1)?, 1, 1);
        }
        Some(())
    }
}

fn parse_field(field: Field, text: &str) -> Result<Bits, Error> {
    let mut bits = Bits::default();
    for element in text.split(',') {
        parse_element(field, element, &mut bits).map_err(|problem| Error::Element {
            field,
            token: element.to_owned(),
            problem,
        })?;
    }
    Ok(bits)
}

fn parse_element(field: Field, element: &str, bits: &mut Bits) -> Result<(), Problem> {
    if element.is_empty() {
        return Err(Problem::Empty);
    }
    if let Some(problem) = unsupported(field, element) {
        return Err(problem);
    }
    let (min, max) = field.bounds();
    let (range, step) = match element.split_once('/') {
        Some((range, step)) => {
            let step: u8 = step.parse().map_err(|_| Problem::BadStep)?;
            if step == 0 {
                return Err(Problem::BadStep);
            }
            (range, Some(step))
        }
        None => (element, None),
    };
    let (start, end) = if range == "*" || range == "?" {
        (min, max)
    } else if let Some((a, b)) = range.split_once('-') {
        let (a, b) = (value(field, a)?, value(field, b)?);
        if a > b {
            return Err(Problem::Backwards { start: a, end: b });
        }
        (a, b)
    } else {
        let a = value(field, range)?;
        // `a/n` runs from a to the field's end; a bare value is itself.
        (a, if step.is_some() { max } else { a })
    };
    let step = step.unwrap_or(1);
    let mut v = start;
    while v <= end {
        bits.set(v);
        match v.checked_add(step) {
            Some(n) => v = n,
            None => break,
        }
    }
    Ok(())
}

/// Quartz-style day marks (`L`, `5L`, `15W`, `LW`, `5#3`), which Vixie cron does not have.
fn unsupported(field: Field, element: &str) -> Option<Problem> {
    if !matches!(field, Field::DayOfMonth | Field::DayOfWeek) {
        return None;
    }
    let up = element.to_ascii_uppercase();
    if up.contains('#') {
        return Some(Problem::Unsupported("# (nth weekday)"));
    }
    let digits_then = |mark: char| {
        up.strip_suffix(mark)
            .is_some_and(|head| head.bytes().all(|b| b.is_ascii_digit()))
    };
    if up == "LW" || digits_then('L') {
        return Some(Problem::Unsupported("L (last)"));
    }
    if digits_then('W') && up.len() > 1 {
        return Some(Problem::Unsupported("W (nearest weekday)"));
    }
    None
}

fn value(field: Field, text: &str) -> Result<u8, Problem> {
    let (min, max) = field.bounds();
    if let Some(i) = field
        .names()
        .iter()
        .position(|n| n.eq_ignore_ascii_case(text))
    {
        return Ok(field.first_named() + i as u8);
    }
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Problem::NotANumber(field));
    }
    let v: u32 = text.parse().unwrap_or(u32::MAX);
    if v < u32::from(min) || v > u32::from(max) {
        return Err(Problem::OutOfRange { value: v, min, max });
    }
    Ok(v as u8)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn next(expr: &str, from: &str) -> String {
        Schedule::parse(expr)
            .unwrap()
            .next_after(at(from))
            .map(|t| t.to_string())
            .unwrap_or_else(|| "never".to_owned())
    }

    /// The first `n` ticks after `from`.
    fn ticks(expr: &str, from: &str, n: usize) -> Vec<String> {
        let s = Schedule::parse(expr).unwrap();
        let mut t = at(from);
        let mut out = Vec::new();
        for _ in 0..n {
            t = s.next_after(t).unwrap();
            out.push(t.to_string());
        }
        out
    }

    fn err(expr: &str) -> String {
        Schedule::parse(expr).unwrap_err().to_string()
    }

    #[test]
    fn every_minute_is_the_next_whole_minute_strictly_after() {
        assert_eq!(
            next("* * * * *", "2025-03-04T10:20:30Z"),
            "2025-03-04T10:21:00Z"
        );
        assert_eq!(
            next("* * * * *", "2025-03-04T10:20:00Z"),
            "2025-03-04T10:21:00Z"
        );
        assert_eq!(
            next("* * * * *", "2025-03-04T10:20:59.999Z"),
            "2025-03-04T10:21:00Z"
        );
        assert_eq!(
            next("* * * * *", "2025-12-31T23:59:00Z"),
            "2026-01-01T00:00:00Z"
        );
    }

    #[test]
    fn steps_ranges_and_lists() {
        assert_eq!(
            ticks("*/15 * * * *", "2025-03-04T10:20:00Z", 4),
            [
                "2025-03-04T10:30:00Z",
                "2025-03-04T10:45:00Z",
                "2025-03-04T11:00:00Z",
                "2025-03-04T11:15:00Z"
            ]
        );
        assert_eq!(
            ticks("0 1-10/4 * * *", "2025-03-04T00:00:00Z", 4),
            [
                "2025-03-04T01:00:00Z",
                "2025-03-04T05:00:00Z",
                "2025-03-04T09:00:00Z",
                "2025-03-05T01:00:00Z"
            ]
        );
        assert_eq!(
            ticks("5,7,50-51 * * * *", "2025-03-04T10:06:00Z", 4),
            [
                "2025-03-04T10:07:00Z",
                "2025-03-04T10:50:00Z",
                "2025-03-04T10:51:00Z",
                "2025-03-04T11:05:00Z"
            ]
        );
        // `a/n` runs to the field's end.
        assert_eq!(
            ticks("50/5 * * * *", "2025-03-04T10:00:00Z", 3),
            [
                "2025-03-04T10:50:00Z",
                "2025-03-04T10:55:00Z",
                "2025-03-04T11:50:00Z"
            ]
        );
        // A step larger than the range leaves its start.
        assert_eq!(
            next("10-20/30 * * * *", "2025-03-04T10:00:00Z"),
            "2025-03-04T10:10:00Z"
        );
    }

    #[test]
    fn names_are_case_insensitive_and_work_in_ranges() {
        assert_eq!(
            Schedule::parse("0 0 * jan-mar MON-fri").unwrap(),
            Schedule::parse("0 0 * 1-3 1-5").unwrap()
        );
        assert_eq!(
            Schedule::parse("0 0 * DEC SUN,sat").unwrap(),
            Schedule::parse("0 0 * 12 0,6").unwrap()
        );
    }

    #[test]
    fn weekday_seven_is_sunday() {
        assert_eq!(
            Schedule::parse("0 0 * * 7").unwrap(),
            Schedule::parse("0 0 * * 0").unwrap()
        );
        assert_eq!(
            Schedule::parse("0 0 * * 5-7").unwrap(),
            Schedule::parse("0 0 * * 0,5,6").unwrap()
        );
        // 2025-03-09 is a Sunday.
        assert_eq!(
            next("0 12 * * 7", "2025-03-04T00:00:00Z"),
            "2025-03-09T12:00:00Z"
        );
    }

    #[test]
    fn day_of_month_or_day_of_week_when_both_are_restricted() {
        // 2025-03: Mondays are 3, 10, 17, 24, 31.
        assert_eq!(
            ticks("0 0 1,15 * MON", "2025-03-01T00:00:00Z", 4),
            [
                "2025-03-03T00:00:00Z",
                "2025-03-10T00:00:00Z",
                "2025-03-15T00:00:00Z",
                "2025-03-17T00:00:00Z"
            ]
        );
        // Only one restricted: both must hold (the star one always does).
        assert_eq!(
            ticks("0 0 * * MON", "2025-03-01T00:00:00Z", 2),
            ["2025-03-03T00:00:00Z", "2025-03-10T00:00:00Z"]
        );
        assert_eq!(
            ticks("0 0 13 * *", "2025-03-01T00:00:00Z", 2),
            ["2025-03-13T00:00:00Z", "2025-04-13T00:00:00Z"]
        );
        // A field starting with `*` counts as unrestricted even with a step (Vixie): Mondays
        // on odd days only.
        assert_eq!(
            ticks("0 0 */2 * 1", "2025-03-01T00:00:00Z", 3),
            [
                "2025-03-03T00:00:00Z",
                "2025-03-17T00:00:00Z",
                "2025-03-31T00:00:00Z"
            ]
        );
    }

    #[test]
    fn macros() {
        for (m, e) in [
            ("@yearly", "0 0 1 1 *"),
            ("@annually", "0 0 1 1 *"),
            ("@monthly", "0 0 1 * *"),
            ("@weekly", "0 0 * * 0"),
            ("@daily", "0 0 * * *"),
            ("@midnight", "0 0 * * *"),
            ("@hourly", "0 * * * *"),
            ("@HOURLY", "0 * * * *"),
        ] {
            assert_eq!(
                Schedule::parse(m).unwrap(),
                Schedule::parse(e).unwrap(),
                "{m}"
            );
        }
        assert_eq!(
            next("@yearly", "2025-03-04T10:00:00Z"),
            "2026-01-01T00:00:00Z"
        );
        assert_eq!(
            next("@weekly", "2025-03-04T10:00:00Z"),
            "2025-03-09T00:00:00Z"
        );
    }

    #[test]
    fn months_and_month_lengths() {
        // The 31st skips months without one.
        assert_eq!(
            ticks("0 0 31 * *", "2025-01-31T00:00:00Z", 3),
            [
                "2025-03-31T00:00:00Z",
                "2025-05-31T00:00:00Z",
                "2025-07-31T00:00:00Z"
            ]
        );
        // 29 February: the next leap year, even eight years away.
        assert_eq!(
            next("0 0 29 2 *", "2025-03-01T00:00:00Z"),
            "2028-02-29T00:00:00Z"
        );
        assert_eq!(
            next("0 0 29 2 *", "2096-03-01T00:00:00Z"),
            "2104-02-29T00:00:00Z"
        );
        assert_eq!(next("0 0 30 2 *", "2025-03-01T00:00:00Z"), "never");
        // Crossing a year end into a restricted month.
        assert_eq!(
            next("30 6 * FEB *", "2025-12-15T00:00:00Z"),
            "2026-02-01T06:30:00Z"
        );
        // Hours and minutes carry correctly at the end of a day.
        assert_eq!(
            next("15 3 * * *", "2025-03-04T23:59:00Z"),
            "2025-03-05T03:15:00Z"
        );
        assert_eq!(
            next("0-5 23 * * *", "2025-03-04T23:05:00Z"),
            "2025-03-05T23:00:00Z"
        );
    }

    #[test]
    fn ticks_are_strictly_increasing_and_match() {
        let s = Schedule::parse("*/7 */5 1-10,20 * MON-WED").unwrap();
        let mut t = at("2024-02-20T00:00:00Z");
        for _ in 0..500 {
            let n = s.next_after(t).unwrap();
            assert!(n > t);
            let dt = Offset::UTC.to_datetime(n);
            assert_eq!(dt.second(), 0);
            assert!(s.minutes.has(dt.minute() as u8));
            assert!(s.hours.has(dt.hour() as u8));
            assert!(s.day_matches(dt.date()));
            t = n;
        }
    }

    #[test]
    fn errors_name_the_field_and_the_token() {
        assert_eq!(
            err("61 * * * *"),
            "minute field: \"61\": 61 is out of range 0-59"
        );
        assert_eq!(
            err("0 24 * * *"),
            "hour field: \"24\": 24 is out of range 0-23"
        );
        assert_eq!(
            err("0 0 0 * *"),
            "day-of-month field: \"0\": 0 is out of range 1-31"
        );
        assert_eq!(
            err("0 0 1 13 *"),
            "month field: \"13\": 13 is out of range 1-12"
        );
        assert_eq!(
            err("0 0 * * 8"),
            "day-of-week field: \"8\": 8 is out of range 0-7"
        );
        assert_eq!(
            err("0 0 * FOO *"),
            "month field: \"FOO\": not a number or month name (JAN..DEC)"
        );
        assert_eq!(
            err("0 0 * * 1,MOON"),
            "day-of-week field: \"MOON\": not a number or weekday name (SUN..SAT)"
        );
        assert_eq!(
            err("5-1 * * * *"),
            "minute field: \"5-1\": range start 5 is after its end 1"
        );
        assert_eq!(
            err("*/0 * * * *"),
            "minute field: \"*/0\": step must be a positive number"
        );
        assert_eq!(
            err("*/x * * * *"),
            "minute field: \"*/x\": step must be a positive number"
        );
        assert_eq!(err("1,,2 * * * *"), "minute field: \"\": empty element");
        assert_eq!(err("x * * * *"), "minute field: \"x\": not a number");
        assert_eq!(err("-1 * * * *"), "minute field: \"-1\": not a number");
        assert_eq!(
            err("99999999999 * * * *"),
            "minute field: \"99999999999\": 4294967295 is out of range 0-59"
        );
        assert!(
            err("* * * *").starts_with("expected 5 fields"),
            "{}",
            err("* * * *")
        );
        assert!(err("0 * * * * *").contains("got 6"));
        assert!(err("").contains("got 0"));
        assert!(err("@every 5m").starts_with("unknown macro \"@every 5m\""));
        assert!(err("@reboot").starts_with("unknown macro"));
        assert_eq!(
            err("0 0 L * *"),
            "day-of-month field: \"L\": L (last) is not supported"
        );
        assert_eq!(
            err("0 0 * * 5#3"),
            "day-of-week field: \"5#3\": # (nth weekday) is not supported"
        );
        assert_eq!(
            err("0 0 15W * *"),
            "day-of-month field: \"15W\": W (nearest weekday) is not supported"
        );
        assert!(err("CRON_TZ=UTC 0 0 * * *").contains("time zone prefix"));
        assert!(err("TZ=UTC * * * *").contains("time zone prefix"));
    }

    #[test]
    fn whitespace_and_question_mark() {
        assert_eq!(
            Schedule::parse("  0\t0  ? * ?  ").unwrap(),
            Schedule::parse("0 0 * * *").unwrap()
        );
    }
}
