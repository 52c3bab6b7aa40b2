//! Object names and label values that must fit Kubernetes' length limits.

use sha2::{Digest, Sha256};

/// `name` if it fits in `max` characters, else a prefix plus `-` and 10 hex digits of its
/// SHA-256, so that distinct long names stay distinct and stable.
pub fn shorten(name: &str, max: usize) -> String {
    if name.len() <= max {
        return name.to_string();
    }
    let hash = hex::encode(Sha256::digest(name.as_bytes()));
    let keep = max.saturating_sub(11);
    let mut end = keep.min(name.len());
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}-{}",
        name[..end].trim_end_matches(['-', '.']),
        &hash[..10]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shorten_table() {
        assert_eq!(shorten("short", 63), "short");
        let long = "x".repeat(80);
        let s = shorten(&long, 63);
        assert!(s.len() <= 63, "{s}");
        assert_ne!(
            shorten(&format!("{long}a"), 63),
            shorten(&format!("{long}b"), 63)
        );
        assert_eq!(shorten(&long, 63), s, "stable");
    }
}
