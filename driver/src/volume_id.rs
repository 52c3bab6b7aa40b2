//! Volume IDs as PMEM-CSI 1.0 derives them from the volume name, so that a volume provisioned by
//! either driver is found by the other.

use sha2::{Digest, Sha224};

/// How many leading bytes of the name PMEM-CSI keeps in front of the hash.
const NAME_PREFIX_BYTES: usize = 6;

/// `<first ≤ 6 bytes of name>-<hex SHA-224 of name>`: short enough for LVM and ndctl names,
/// recognisable in `lvs` output, and deterministic, so a retried CreateVolume finds the volume
/// of its first attempt. PMEM-CSI slices bytes; Kubernetes volume names are ASCII, and for other
/// names the prefix stops before a character it would split (PMEM-CSI would emit invalid UTF-8).
pub fn volume_id(name: &str) -> String {
    let mut end = name.len().min(NAME_PREFIX_BYTES);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    let prefix = &name[..end];
    let digest = Sha224::digest(name.as_bytes());
    format!("{prefix}-{}", hex::encode(digest))
}

/// Why a volume named `name` cannot exist, if it cannot. Its ID names a state file and, in the
/// other modes, an LV or a namespace, so the part of the name the ID keeps must be what LVM
/// accepts in a volume name (letters, digits, `+`, `_`, `.`, `-`), start with neither `.` (a
/// hidden state file, or `..`) nor `-`, and hold no `/` or NUL. Names from Kubernetes
/// (`pvc-<uid>`, kubelet's `csi-<hash>`) always pass; only a hand-made CSI call can fail.
pub fn name_problem(name: &str) -> Option<String> {
    if name.is_empty() {
        return None;
    }
    let id = volume_id(name);
    let prefix = id.rsplit_once('-').map_or("", |(prefix, _)| prefix);
    let allowed = |c: char| c.is_ascii_alphanumeric() || "+_.-".contains(c);
    if let Some(bad) = prefix.chars().find(|c| !allowed(*c)) {
        return Some(format!(
            "{name:?} cannot name a volume: its first {NAME_PREFIX_BYTES} bytes become part of \
             the volume ID and may only hold letters, digits, '+', '_', '.' and '-', not {bad:?}"
        ));
    }
    if prefix.starts_with(['.', '-']) {
        return Some(format!(
            "{name:?} cannot name a volume: the volume ID starts with its first character, \
             which must not be '.' or '-'"
        ));
    }
    None
}

/// Whether `name` has the shape of a volume ID (`<prefix>-<56 hex digits>`): what a backend
/// sharing its namespace with other users (ndctl namespaces) may treat as its own.
pub fn looks_like_volume_id(name: &str) -> bool {
    name.rsplit_once('-').is_some_and(|(prefix, hash)| {
        prefix.len() <= NAME_PREFIX_BYTES
            && hash.len() == 56
            && hash
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_problems() {
        for fine in [
            "pvc-a63bc7db-3cbd-404d-9c9d-d7b1969cbaa8",
            "csi-0123abcd",
            "sanity-node-full-1",
            "a_b+c.d",
            // Only the prefix the ID keeps matters.
            "pvc-12/../x\0é",
            "",
        ] {
            assert_eq!(name_problem(fine), None, "{fine:?}");
        }
        for (bad, says) in [
            (".", "'.' or '-'"),
            ("..", "'.' or '-'"),
            (".hidden", "'.' or '-'"),
            ("-x", "'.' or '-'"),
            ("a/b", "'/'"),
            ("../etc", "'/'"),
            ("a\0b", "'\\0'"),
            ("pvc ab", "' '"),
            ("abcdé", "'é'"),
        ] {
            let problem = name_problem(bad).unwrap_or_default();
            assert!(problem.contains(says), "{bad:?}: {problem}");
        }
    }

    #[test]
    fn volume_id_shapes() {
        assert!(looks_like_volume_id(&volume_id("pvc-0123456789")));
        assert!(looks_like_volume_id(&volume_id("")));
        assert!(looks_like_volume_id(&volume_id("a-b-c")));
        for foreign in [
            "pmem-csi",
            "backup",
            "",
            "pvc-01-xyz",
            &format!("toolong-{}", "a".repeat(56)),
        ] {
            assert!(!looks_like_volume_id(foreign), "{foreign}");
        }
    }

    #[test]
    fn volume_id_table() {
        // Expected values computed independently (Python hashlib.sha224).
        for (name, want) in [
            (
                "pvc-0123456789",
                "pvc-01-d8facedeacd41b848edcb7ec163ce14e4e553c6be9bd7f678e97cc63",
            ),
            (
                "a",
                "a-abd37534c7d9a2efb9465de931cd7055ffdb8879563ae98078d6d6d5",
            ),
            // PMEM-CSI 1.0's own log (issue #933) and its sanity volume names.
            (
                "pvc-a63bc7db-3cbd-404d-9c9d-d7b1969cbaa8",
                "pvc-a6-d3bf70885af9aa7fe39e0007671b912cf9749730ad814c8694225c2a",
            ),
            (
                "sanity1",
                "sanity-34f9848cf39af21e4fc0b9e97c93b7e7d14d2048336cbfda266e4d5b",
            ),
            (
                "",
                "-d14a028c2a3a2bc9476102bb288234c415a2b01f828ea62ac5b3e42f",
            ),
        ] {
            assert_eq!(volume_id(name), want, "{name:?}");
        }
    }

    #[test]
    fn prefix_never_splits_a_character() {
        assert!(volume_id("äöüßéèx").starts_with("äöü-"));
        assert!(volume_id("aäöü").starts_with("aäö-"));
    }
}
