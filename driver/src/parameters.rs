//! Volume parameters and contexts in PMEM-CSI 1.0's vocabulary: which keys each origin accepts,
//! how values are spelled, and how they are written back into volume contexts and node state.

use std::collections::BTreeMap;

use controllers::quantity;

/// `eraseafter`: scrub the whole device on delete (default true).
pub const ERASE_AFTER: &str = "eraseafter";
/// The documented spelling of `eraseafter`, accepted as input.
pub const ERASE_AFTER_DOC: &str = "eraseAfter";
/// `usage`: `AppDirect` (default) or `FileIO`.
pub const USAGE: &str = "usage";
/// `persistencyModel`: `normal`; legacy `none` means the same; `ephemeral` only internally.
pub const PERSISTENCY_MODEL: &str = "persistencyModel";
/// `kataContainers`: only `false` is supported.
pub const KATA_CONTAINERS: &str = "kataContainers";
/// `size`: required for inline ephemeral volumes; recorded in contexts.
pub const SIZE: &str = "size";
/// `name`: the volume name, recorded in contexts.
pub const NAME: &str = "name";
/// `deviceMode`: the backend a volume lives in, recorded in contexts and state.
pub const DEVICE_MODE: &str = "deviceMode";
/// The ephemeral flag kubelet sets in NodePublish's volume_context.
pub const EPHEMERAL: &str = "csi.storage.k8s.io/ephemeral";
/// external-provisioner's `--extra-create-metadata` keys.
pub const PVC_NAME: &str = "csi.storage.k8s.io/pvc/name";
/// See [`PVC_NAME`].
pub const PVC_NAMESPACE: &str = "csi.storage.k8s.io/pvc/namespace";
/// See [`PVC_NAME`].
pub const PV_NAME: &str = "csi.storage.k8s.io/pv/name";
/// Prefix of keys kubelet (pod info) and external-provisioner add.
pub const K8S_PREFIX: &str = "csi.storage.k8s.io/";
/// external-provisioner's identity in PV contexts (PMEM-CSI 1.0 PVs carry it).
pub const PROVISIONER_IDENTITY: &str = "storage.kubernetes.io/csiProvisionerIdentity";

/// Where a set of parameters comes from; each origin accepts different keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// CreateVolume parameters (StorageClass parameters plus external-provisioner metadata).
    CreateVolume,
    /// `volumeAttributes` of a CSI inline ephemeral volume (NodePublish with the ephemeral flag).
    Ephemeral,
    /// volume_context of NodeStage/NodePublish for a persistent volume (ours or PMEM-CSI 1.0's).
    Context,
    /// Parameters stored in node state.
    State,
}

/// How the volume is used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Usage {
    /// Mounted with DAX where the device supports it.
    #[default]
    AppDirect,
    /// Plain block I/O, never DAX.
    FileIO,
}

/// How long the volume lives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Persistency {
    /// Lives until DeleteVolume (`normal`, or PMEM-CSI's legacy `none`).
    #[default]
    Normal,
    /// A CSI inline volume: created by NodePublish, deleted by NodeUnpublish.
    Ephemeral,
}

/// Parsed, validated parameters of one volume.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Parameters {
    /// Scrub on delete.
    pub erase_after: Option<bool>,
    /// AppDirect or FileIO.
    pub usage: Option<Usage>,
    /// Normal or ephemeral.
    pub persistency: Option<Persistency>,
    /// `kataContainers=false` given explicitly (kept so contexts round-trip).
    pub kata_containers: Option<bool>,
    /// Size in bytes.
    pub size: Option<u64>,
    /// Volume name.
    pub name: Option<String>,
    /// Backend of the volume (`emulated`, `fake`, `lvm`, `direct`).
    pub device_mode: Option<String>,
    /// `csi.storage.k8s.io/*` and provisioner-identity keys, kept verbatim.
    pub kubernetes: BTreeMap<String, String>,
}

/// A rejected parameter.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParameterError {
    /// A key this origin does not accept.
    #[error("parameter {key:?} is not supported{}", origin_hint(*.origin))]
    Unknown {
        /// The key.
        key: String,
        /// Where it appeared.
        origin: Origin,
    },
    /// A value that does not parse.
    #[error("parameter {key:?}: invalid value {value:?}: {reason}")]
    Invalid {
        /// The key.
        key: String,
        /// The value.
        value: String,
        /// Why.
        reason: String,
    },
    /// Kata Containers support was not carried over from PMEM-CSI.
    #[error("Kata Containers volumes are not supported (parameter \"kataContainers\")")]
    Kata,
    /// An inline ephemeral volume without `size`.
    #[error("volume attribute \"size\" is required for inline ephemeral volumes")]
    MissingSize,
}

fn origin_hint(origin: Origin) -> &'static str {
    match origin {
        Origin::CreateVolume => " in StorageClass parameters",
        Origin::Ephemeral => " in inline volume attributes",
        Origin::Context => " in volume_context",
        Origin::State => " in node state",
    }
}

/// Go's `strconv.ParseBool` spellings, which PMEM-CSI 1.0 accepted.
fn parse_bool(key: &str, value: &str) -> Result<bool, ParameterError> {
    match value {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(ParameterError::Invalid {
            key: key.to_string(),
            value: value.to_string(),
            reason: "expected true or false".into(),
        }),
    }
}

impl Parameters {
    /// Parses `map` as parameters of `origin`; the first offending key (in key order) is
    /// reported.
    pub fn parse(map: &BTreeMap<String, String>, origin: Origin) -> Result<Self, ParameterError> {
        let mut p = Parameters::default();
        let in_context = matches!(origin, Origin::Context | Origin::State);
        for (key, value) in map {
            let unknown = || ParameterError::Unknown {
                key: key.clone(),
                origin,
            };
            match key.as_str() {
                ERASE_AFTER | ERASE_AFTER_DOC => p.erase_after = Some(parse_bool(key, value)?),
                USAGE => {
                    p.usage = Some(match value.as_str() {
                        "AppDirect" => Usage::AppDirect,
                        "FileIO" => Usage::FileIO,
                        _ => {
                            return Err(ParameterError::Invalid {
                                key: key.clone(),
                                value: value.clone(),
                                reason: "expected AppDirect or FileIO".into(),
                            });
                        }
                    })
                }
                PERSISTENCY_MODEL => {
                    p.persistency = Some(match value.as_str() {
                        "normal" | "none" => Persistency::Normal,
                        "ephemeral" if in_context => Persistency::Ephemeral,
                        _ => {
                            return Err(ParameterError::Invalid {
                                key: key.clone(),
                                value: value.clone(),
                                reason: "expected normal".into(),
                            });
                        }
                    })
                }
                KATA_CONTAINERS => {
                    if parse_bool(key, value)? {
                        return Err(ParameterError::Kata);
                    }
                    p.kata_containers = Some(false);
                }
                SIZE if origin != Origin::CreateVolume => {
                    p.size =
                        Some(
                            quantity::parse_bytes(value).map_err(|e| ParameterError::Invalid {
                                key: key.clone(),
                                value: value.clone(),
                                reason: e.reason.to_string(),
                            })?,
                        )
                }
                NAME if in_context => p.name = Some(value.clone()),
                DEVICE_MODE if in_context => p.device_mode = Some(value.clone()),
                PVC_NAME | PVC_NAMESPACE | PV_NAME if origin == Origin::CreateVolume => {
                    p.kubernetes.insert(key.clone(), value.clone());
                }
                // Pod info (podInfoOnMount) and the ephemeral flag arrive with inline volumes.
                k if origin == Origin::Ephemeral && k.starts_with(K8S_PREFIX) => {
                    p.kubernetes.insert(key.clone(), value.clone());
                }
                k if in_context && (k.starts_with(K8S_PREFIX) || k == PROVISIONER_IDENTITY) => {
                    p.kubernetes.insert(key.clone(), value.clone());
                }
                _ => return Err(unknown()),
            }
        }
        if origin == Origin::Ephemeral {
            if p.size.is_none() {
                return Err(ParameterError::MissingSize);
            }
            p.persistency = Some(Persistency::Ephemeral);
        }
        Ok(p)
    }

    /// Whether the device is scrubbed on delete (default true).
    pub fn erase_after(&self) -> bool {
        self.erase_after.unwrap_or(true)
    }

    /// AppDirect unless FileIO was asked for.
    pub fn usage(&self) -> Usage {
        self.usage.unwrap_or_default()
    }

    /// Whether a volume created with `self` satisfies a request with `other`: the settings
    /// that change the volume (scrubbing, usage, persistency) agree.
    pub fn compatible_with(&self, other: &Parameters) -> bool {
        self.erase_after() == other.erase_after()
            && self.usage() == other.usage()
            && self.persistency.unwrap_or_default() == other.persistency.unwrap_or_default()
    }

    /// The map written into volume contexts and node state, in PMEM-CSI 1.0's spelling.
    pub fn to_context(&self) -> BTreeMap<String, String> {
        let mut m = self.kubernetes.clone();
        if let Some(v) = self.erase_after {
            m.insert(ERASE_AFTER.into(), v.to_string());
        }
        if let Some(u) = self.usage {
            m.insert(
                USAGE.into(),
                match u {
                    Usage::AppDirect => "AppDirect",
                    Usage::FileIO => "FileIO",
                }
                .into(),
            );
        }
        if let Some(p) = self.persistency {
            m.insert(
                PERSISTENCY_MODEL.into(),
                match p {
                    Persistency::Normal => "normal",
                    Persistency::Ephemeral => "ephemeral",
                }
                .into(),
            );
        }
        if let Some(k) = self.kata_containers {
            m.insert(KATA_CONTAINERS.into(), k.to_string());
        }
        if let Some(s) = self.size {
            m.insert(SIZE.into(), s.to_string());
        }
        if let Some(n) = &self.name {
            m.insert(NAME.into(), n.clone());
        }
        if let Some(d) = &self.device_mode {
            m.insert(DEVICE_MODE.into(), d.clone());
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// (case, input pairs, origin, expected result)
    type Case = (
        &'static str,
        Vec<(&'static str, &'static str)>,
        Origin,
        Result<Parameters, ParameterError>,
    );

    #[test]
    fn parse_table() {
        use Origin::*;
        let ok = |p: Parameters| Ok::<_, ParameterError>(p);
        let cases: Vec<Case> = vec![
            ("empty", vec![], CreateVolume, ok(Parameters::default())),
            (
                "eraseafter lower-case",
                vec![("eraseafter", "false")],
                CreateVolume,
                ok(Parameters {
                    erase_after: Some(false),
                    ..Default::default()
                }),
            ),
            (
                "eraseAfter documented spelling, Go bool spelling",
                vec![("eraseAfter", "F")],
                CreateVolume,
                ok(Parameters {
                    erase_after: Some(false),
                    ..Default::default()
                }),
            ),
            (
                "bad bool",
                vec![("eraseafter", "maybe")],
                CreateVolume,
                Err(ParameterError::Invalid {
                    key: "eraseafter".into(),
                    value: "maybe".into(),
                    reason: "expected true or false".into(),
                }),
            ),
            (
                "usage FileIO",
                vec![("usage", "FileIO")],
                CreateVolume,
                ok(Parameters {
                    usage: Some(Usage::FileIO),
                    ..Default::default()
                }),
            ),
            (
                "legacy persistency none",
                vec![("persistencyModel", "none")],
                CreateVolume,
                ok(Parameters {
                    persistency: Some(Persistency::Normal),
                    ..Default::default()
                }),
            ),
            (
                "ephemeral persistency not from a StorageClass",
                vec![("persistencyModel", "ephemeral")],
                CreateVolume,
                Err(ParameterError::Invalid {
                    key: "persistencyModel".into(),
                    value: "ephemeral".into(),
                    reason: "expected normal".into(),
                }),
            ),
            (
                "kata false accepted",
                vec![("kataContainers", "false")],
                CreateVolume,
                ok(Parameters {
                    kata_containers: Some(false),
                    ..Default::default()
                }),
            ),
            (
                "kata true refused",
                vec![("kataContainers", "true")],
                CreateVolume,
                Err(ParameterError::Kata),
            ),
            (
                "unknown key",
                vec![("foo", "bar")],
                CreateVolume,
                Err(ParameterError::Unknown {
                    key: "foo".into(),
                    origin: CreateVolume,
                }),
            ),
            (
                "size not a StorageClass parameter",
                vec![("size", "1Gi")],
                CreateVolume,
                Err(ParameterError::Unknown {
                    key: "size".into(),
                    origin: CreateVolume,
                }),
            ),
            (
                "extra-create-metadata",
                vec![
                    ("csi.storage.k8s.io/pvc/name", "data"),
                    ("csi.storage.k8s.io/pv/name", "pvc-1"),
                ],
                CreateVolume,
                ok(Parameters {
                    kubernetes: map(&[
                        ("csi.storage.k8s.io/pvc/name", "data"),
                        ("csi.storage.k8s.io/pv/name", "pvc-1"),
                    ]),
                    ..Default::default()
                }),
            ),
            (
                "pod info not a StorageClass parameter",
                vec![("csi.storage.k8s.io/pod.name", "x")],
                CreateVolume,
                Err(ParameterError::Unknown {
                    key: "csi.storage.k8s.io/pod.name".into(),
                    origin: CreateVolume,
                }),
            ),
            (
                "inline without size",
                vec![("eraseafter", "true")],
                Ephemeral,
                Err(ParameterError::MissingSize),
            ),
            (
                "inline with size and pod info",
                vec![
                    ("size", "64Mi"),
                    ("csi.storage.k8s.io/pod.name", "p"),
                    ("csi.storage.k8s.io/ephemeral", "true"),
                ],
                Ephemeral,
                ok(Parameters {
                    size: Some(64 << 20),
                    persistency: Some(Persistency::Ephemeral),
                    kubernetes: map(&[
                        ("csi.storage.k8s.io/pod.name", "p"),
                        ("csi.storage.k8s.io/ephemeral", "true"),
                    ]),
                    ..Default::default()
                }),
            ),
            (
                "inline bad size names the key",
                vec![("size", "lots")],
                Ephemeral,
                Err(ParameterError::Invalid {
                    key: "size".into(),
                    value: "lots".into(),
                    reason: "unknown suffix".into(),
                }),
            ),
            (
                "inline name refused",
                vec![("size", "1Mi"), ("name", "x")],
                Ephemeral,
                Err(ParameterError::Unknown {
                    key: "name".into(),
                    origin: Ephemeral,
                }),
            ),
            (
                "PMEM-CSI 1.0 PV context",
                vec![
                    ("eraseafter", "true"),
                    ("name", "pvc-1"),
                    ("deviceMode", "lvm"),
                    ("size", "4194304"),
                    (
                        "storage.kubernetes.io/csiProvisionerIdentity",
                        "1611-8081-pmem-csi.intel.com",
                    ),
                ],
                Context,
                ok(Parameters {
                    erase_after: Some(true),
                    name: Some("pvc-1".into()),
                    device_mode: Some("lvm".into()),
                    size: Some(4 << 20),
                    kubernetes: map(&[(
                        "storage.kubernetes.io/csiProvisionerIdentity",
                        "1611-8081-pmem-csi.intel.com",
                    )]),
                    ..Default::default()
                }),
            ),
            (
                "context unknown key",
                vec![("cacheSize", "1")],
                Context,
                Err(ParameterError::Unknown {
                    key: "cacheSize".into(),
                    origin: Context,
                }),
            ),
        ];
        for (name, pairs, origin, want) in cases {
            assert_eq!(Parameters::parse(&map(&pairs), origin), want, "{name}");
        }
    }

    #[test]
    fn context_round_trips() {
        let p = Parameters {
            erase_after: Some(false),
            usage: Some(Usage::FileIO),
            persistency: Some(Persistency::Normal),
            kata_containers: Some(false),
            size: Some(123),
            name: Some("pvc-9".into()),
            device_mode: Some("emulated".into()),
            kubernetes: map(&[("csi.storage.k8s.io/pvc/name", "data")]),
        };
        let ctx = p.to_context();
        assert_eq!(ctx.get("eraseafter").map(String::as_str), Some("false"));
        assert_eq!(
            ctx.get("persistencyModel").map(String::as_str),
            Some("normal")
        );
        assert_eq!(Parameters::parse(&ctx, Origin::State), Ok(p));
    }

    #[test]
    fn compatibility_uses_defaults() {
        let default = Parameters::default();
        let explicit = Parameters {
            erase_after: Some(true),
            usage: Some(Usage::AppDirect),
            persistency: Some(Persistency::Normal),
            ..Default::default()
        };
        assert!(default.compatible_with(&explicit));
        let no_erase = Parameters {
            erase_after: Some(false),
            ..Default::default()
        };
        assert!(!default.compatible_with(&no_erase));
    }

    #[test]
    fn errors_name_the_key() {
        let err = Parameters::parse(&map(&[("bogus", "1")]), Origin::CreateVolume)
            .expect_err("unknown key");
        assert_eq!(
            err.to_string(),
            "parameter \"bogus\" is not supported in StorageClass parameters"
        );
        assert_eq!(
            ParameterError::Kata.to_string(),
            "Kata Containers volumes are not supported (parameter \"kataContainers\")"
        );
    }
}
