//! `--node-selector`: `k=v[,k=v]`, or PMEM-CSI 1.0's JSON map; required and non-empty.

use std::collections::BTreeMap;

/// A malformed selector.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("--node-selector {value:?}: {reason}")]
pub struct NodeSelectorError {
    /// The flag value.
    pub value: String,
    /// Why.
    pub reason: String,
}

/// Label key/values a node must all carry to be meant for the driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeSelector(pub BTreeMap<String, String>);

impl NodeSelector {
    /// Parses `k=v[,k=v]` or a JSON object of strings.
    pub fn parse(value: &str) -> Result<Self, NodeSelectorError> {
        let err = |reason: &str| NodeSelectorError {
            value: value.to_string(),
            reason: reason.to_string(),
        };
        let trimmed = value.trim();
        let map: BTreeMap<String, String> = if trimmed.starts_with('{') {
            serde_json::from_str(trimmed)
                .map_err(|e| err(&format!("not a JSON map of strings: {e}")))?
        } else {
            let mut map = BTreeMap::new();
            for pair in trimmed.split(',').filter(|p| !p.trim().is_empty()) {
                let (k, v) = pair
                    .split_once('=')
                    .ok_or_else(|| err(&format!("{pair:?} is not key=value")))?;
                let (k, v) = (k.trim(), v.trim());
                if k.is_empty() {
                    return Err(err(&format!("{pair:?} has an empty key")));
                }
                if map.insert(k.to_string(), v.to_string()).is_some() {
                    return Err(err(&format!("key {k:?} appears twice")));
                }
            }
            map
        };
        if map.is_empty() {
            return Err(err("must select at least one label"));
        }
        Ok(Self(map))
    }

    /// Whether `labels` carry every key with its value.
    pub fn matches(&self, labels: Option<&BTreeMap<String, String>>) -> bool {
        self.0
            .iter()
            .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_table() {
        let map = |pairs: &[(&str, &str)]| {
            Ok::<_, ()>(NodeSelector(
                pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ))
        };
        for (input, want) in [
            ("storage=pmem", map(&[("storage", "pmem")])),
            (
                "storage=pmem, zone = a",
                map(&[("storage", "pmem"), ("zone", "a")]),
            ),
            (r#"{"storage":"pmem"}"#, map(&[("storage", "pmem")])),
            ("key=", map(&[("key", "")])),
            ("", Err(())),
            ("{}", Err(())),
            ("storage", Err(())),
            ("=pmem", Err(())),
            ("a=1,a=2", Err(())),
            (r#"{"a":1}"#, Err(())),
        ] {
            assert_eq!(
                NodeSelector::parse(input).map_err(|_| ()),
                want,
                "{input:?}"
            );
        }
    }

    #[test]
    fn matches_table() {
        let s = NodeSelector::parse("storage=pmem,zone=a").expect("valid");
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert!(s.matches(Some(&labels(&[
            ("storage", "pmem"),
            ("zone", "a"),
            ("x", "y")
        ]))));
        assert!(!s.matches(Some(&labels(&[("storage", "pmem")]))));
        assert!(!s.matches(Some(&labels(&[("storage", "pmem"), ("zone", "b")]))));
        assert!(!s.matches(None));
    }
}
