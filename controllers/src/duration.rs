//! Durations in flags: `500ms`, `30s`, `10m`, `1h`, or combinations such as `1m30s`.

use std::time::Duration;

/// Parses a Go-style duration of non-negative whole numbers.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let mut total = Duration::ZERO;
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err("empty duration".into());
    }
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if digits == 0 {
            return Err(format!("{text:?}: expected a number"));
        }
        let n: u64 = rest[..digits]
            .parse()
            .map_err(|_| format!("{text:?}: number too large"))?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let part = match &rest[..unit_len] {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n.saturating_mul(60)),
            "h" => Duration::from_secs(n.saturating_mul(3600)),
            "" => return Err(format!("{text:?}: missing unit (ms, s, m, h)")),
            u => return Err(format!("{text:?}: unknown unit {u:?}")),
        };
        total = total.saturating_add(part);
        rest = &rest[unit_len..];
    }
    Ok(total)
}

/// Formats whole seconds the way the flags take them (`1h`, `1m30s`, `45s`; `0s`), so that
/// messages quote a grace as the operator wrote it.
pub fn format(duration: Duration) -> String {
    let secs = duration.as_secs();
    if secs == 0 {
        return "0s".into();
    }
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    [(h, "h"), (m, "m"), (s, "s")]
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, unit)| format!("{n}{unit}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_table() {
        for (text, want) in [
            ("30s", Ok(Duration::from_secs(30))),
            ("500ms", Ok(Duration::from_millis(500))),
            ("10m", Ok(Duration::from_secs(600))),
            ("1h", Ok(Duration::from_secs(3600))),
            ("1m30s", Ok(Duration::from_secs(90))),
            ("0", Ok(Duration::ZERO)),
            ("", Err(())),
            ("30", Err(())),
            ("s", Err(())),
            ("3d", Err(())),
            ("-1s", Err(())),
        ] {
            assert_eq!(parse_duration(text).map_err(|_| ()), want, "{text:?}");
        }
    }

    #[test]
    fn format_round_trips() {
        for text in ["1h", "1m30s", "45s", "2h0m5s", "0s"] {
            let d = parse_duration(text).expect("parses");
            assert_eq!(parse_duration(&format(d)), Ok(d), "{text}");
        }
        assert_eq!(format(Duration::from_secs(3600)), "1h");
        assert_eq!(format(Duration::from_secs(3725)), "1h2m5s");
    }
}
