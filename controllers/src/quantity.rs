//! Kubernetes resource quantities (`1Gi`, `500M`, `1.5Gi`, `1e9`) as byte counts, for the
//! `size` attribute of inline ephemeral volumes.

/// A malformed or unrepresentable quantity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not a valid quantity: {reason}")]
pub struct QuantityError {
    /// The rejected text.
    pub value: String,
    /// Why.
    pub reason: &'static str,
}

/// Parses `text` into bytes, rounding a fractional result up (Kubernetes rounds quantities up
/// when converting to integers).
pub fn parse_bytes(text: &str) -> Result<u64, QuantityError> {
    let err = |reason| QuantityError {
        value: text.to_string(),
        reason,
    };
    let text_trimmed = text.trim();
    if text_trimmed.is_empty() {
        return Err(err("empty"));
    }
    if text_trimmed.starts_with('-') {
        return Err(err("negative"));
    }
    let number_end = text_trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+'))
        .unwrap_or(text_trimmed.len());
    let (number, suffix) = text_trimmed.split_at(number_end);
    let number = number.strip_prefix('+').unwrap_or(number);
    let (multiplier_num, multiplier_exp10): (u128, i32) = match suffix {
        "" => (1, 0),
        "Ki" => (1 << 10, 0),
        "Mi" => (1 << 20, 0),
        "Gi" => (1 << 30, 0),
        "Ti" => (1 << 40, 0),
        "Pi" => (1 << 50, 0),
        "Ei" => (1 << 60, 0),
        "m" => (1, -3),
        "k" => (1, 3),
        "M" => (1, 6),
        "G" => (1, 9),
        "T" => (1, 12),
        "P" => (1, 15),
        "E" => (1, 18),
        s if s.starts_with(['e', 'E']) => {
            let exp: i32 = s[1..].parse().map_err(|_| err("bad exponent"))?;
            if !(-30..=30).contains(&exp) {
                return Err(err("exponent out of range"));
            }
            (1, exp)
        }
        _ => return Err(err("unknown suffix")),
    };
    let (int_part, frac_part) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number, ""),
    };
    if int_part.is_empty() && frac_part.is_empty() {
        return Err(err("no digits"));
    }
    if frac_part.contains('.') || frac_part.len() > 18 || int_part.len() > 30 {
        return Err(err("malformed number"));
    }
    let digits: u128 = format!("{int_part}{frac_part}")
        .parse()
        .map_err(|_| err("malformed number"))?;
    // value = digits * 10^(exp - frac_len) * multiplier
    let exp = multiplier_exp10 - frac_part.len() as i32;
    let scaled = digits
        .checked_mul(multiplier_num)
        .ok_or_else(|| err("too large"))?;
    let bytes = if exp >= 0 {
        scaled
            .checked_mul(10u128.pow(exp as u32))
            .ok_or_else(|| err("too large"))?
    } else {
        let div = 10u128.pow((-exp) as u32);
        scaled.div_ceil(div)
    };
    u64::try_from(bytes).map_err(|_| err("too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_table() {
        for (text, want) in [
            ("0", Ok(0)),
            ("100", Ok(100)),
            ("1Ki", Ok(1024)),
            ("64Mi", Ok(64 << 20)),
            ("1Gi", Ok(1 << 30)),
            ("2Ti", Ok(2 << 40)),
            ("1k", Ok(1000)),
            ("1M", Ok(1_000_000)),
            ("1.5Gi", Ok(3 << 29)),
            ("0.5", Ok(1)),
            ("1500m", Ok(2)),
            ("1e3", Ok(1000)),
            ("1E6", Ok(1_000_000)),
            ("+5", Ok(5)),
            (" 7 ", Ok(7)),
            ("", Err("empty")),
            ("-1Gi", Err("negative")),
            ("1Xi", Err("unknown suffix")),
            ("Gi", Err("no digits")),
            ("1.2.3", Err("malformed number")),
            ("99999Ei", Err("too large")),
            ("1e99", Err("exponent out of range")),
        ] {
            assert_eq!(parse_bytes(text).map_err(|e| e.reason), want, "{text:?}");
        }
    }
}
