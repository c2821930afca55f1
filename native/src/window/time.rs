//! Event time (refold.reduce.windowed `event_time_of`, `time_text`): epoch
//! milliseconds from a row's time column, ISO-8601 text read as Python's
//! `datetime.fromisoformat` reads it, and window bounds written back as text.
//!
//! The reader takes the forms the engine writes and most producers send:
//! `YYYY-MM-DD`, then optionally `T` or a space, `HH:MM[:SS[.fff|.ffffff]]` and `Z` or
//! `±HH:MM`. Text that cannot be ISO-8601 (it does not start with four digits, or its
//! month, day, minute or second is out of range) is a bad event time; any other form
//! `fromisoformat` may read is Unsupported (Python reads that batch).

use crate::value::{row_get, Unsup, Value};

/// A row's event time: (epoch ms, written as text), or the `bad event time` detail.
pub enum EventTime {
    At(i64, bool),
    Bad(String),
}

/// `event_time_of(row, column)`; `shown` is `repr(column)`.
pub fn event_time_of(row: &[(Box<str>, Value)], column: &str, shown: &str) -> Result<EventTime, Unsup> {
    Ok(match row_get(row, column) {
        None => EventTime::Bad(format!("{shown} is missing")),
        Some(Value::Null) => EventTime::Bad(format!("{shown} is null")),
        Some(Value::Int(n)) => EventTime::At(*n, false),
        Some(Value::Str(s)) => match parse_iso(s)? {
            Some(ms) => EventTime::At(ms, true),
            None => EventTime::Bad(format!("{shown} is not ISO-8601 text")),
        },
        Some(other) => {
            let kind = match other {
                Value::Bool(_) => "bool",
                Value::Float(_) => "float",
                Value::List(_) => "list",
                Value::Tuple(_) => "tuple",
                _ => "dict",
            };
            EventTime::Bad(format!("{shown} holds a {kind}, not epoch milliseconds or ISO-8601 text"))
        }
    })
}

fn digits(b: &[u8], from: usize, n: usize) -> Option<i64> {
    let part = b.get(from..from + n)?;
    let mut v = 0i64;
    for &c in part {
        if !c.is_ascii_digit() {
            return None;
        }
        v = v * 10 + i64::from(c - b'0');
    }
    Some(v)
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days from 1970-01-01 to a civil date (proleptic Gregorian).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The civil date of a day count from 1970-01-01.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// ISO-8601 text in epoch ms (floored); None: not a time; Unsupported: a form this
/// reader leaves to Python.
pub fn parse_iso(s: &str) -> Result<Option<i64>, Unsup> {
    let b = s.as_bytes();
    let unsure = || Unsup::new("an ISO-8601 event time in a form the native core does not read");
    if digits(b, 0, 4).is_none() {
        return Ok(None);
    }
    if b.len() < 10 || b[4] != b'-' || b[7] != b'-' {
        return Err(unsure());
    }
    let (Some(year), Some(month), Some(day)) = (digits(b, 0, 4), digits(b, 5, 2), digits(b, 8, 2)) else {
        return Err(unsure());
    };
    if year < 1 || !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month) {
        return Ok(None);
    }
    let mut seconds = days_from_civil(year, month, day) * 86_400;
    let mut millis = 0i64;
    if b.len() > 10 {
        if b[10] != b'T' && b[10] != b' ' {
            return Err(unsure());
        }
        let (Some(hour), Some(minute)) = (digits(b, 11, 2), digits(b, 14, 2)) else { return Err(unsure()) };
        if b.get(13) != Some(&b':') || hour > 23 {
            return Err(unsure());
        }
        if minute > 59 {
            return Ok(None);
        }
        let mut at = 16;
        let mut second = 0;
        if b.get(at) == Some(&b':') {
            second = digits(b, at + 1, 2).ok_or_else(unsure)?;
            if second > 59 {
                return Ok(None);
            }
            at += 3;
            if b.get(at) == Some(&b'.') {
                let n = b[at + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
                let fraction = match n {
                    3 => digits(b, at + 1, 3).ok_or_else(unsure)?,
                    6 => digits(b, at + 1, 6).ok_or_else(unsure)? / 1000,
                    _ => return Err(unsure()),
                };
                millis = fraction;
                at += 1 + n;
            }
        }
        seconds += hour * 3600 + minute * 60 + second;
        match b.get(at) {
            None => {}
            Some(b'Z') if b.len() == at + 1 => {}
            Some(&sign @ (b'+' | b'-')) if b.len() == at + 6 && b[at + 3] == b':' => {
                let (Some(oh), Some(om)) = (digits(b, at + 1, 2), digits(b, at + 4, 2)) else { return Err(unsure()) };
                if oh > 23 || om > 59 {
                    return Err(unsure());
                }
                let offset = oh * 3600 + om * 60;
                seconds -= if sign == b'+' { offset } else { -offset };
            }
            _ => return Err(unsure()),
        }
    }
    Ok(Some(seconds * 1000 + millis))
}

/// `time_text(ms)`: `YYYY-MM-DDTHH:MM:SS[.mmm]Z`; None outside years 1-9999.
pub fn time_text(ms: i64) -> Option<String> {
    let days = ms.div_euclid(86_400_000);
    let rest = ms.rem_euclid(86_400_000);
    let (y, m, d) = civil_from_days(days);
    if !(1..=9999).contains(&y) {
        return None;
    }
    let (h, mi, s, milli) = (rest / 3_600_000, rest / 60_000 % 60, rest / 1000 % 60, rest % 1000);
    Some(if milli != 0 {
        format!("{y:04}-{m:02}-{d:02}T{h:02}:{mi:02}:{s:02}.{milli:03}Z")
    } else {
        format!("{y:04}-{m:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
    })
}
