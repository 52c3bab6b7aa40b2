//! Structured fuzzing of everything the node driver parses (issue 20, item 6): state files,
//! ndctl's and LVM's JSON, CSI requests, StorageClass parameters, mount options and volume
//! names. Property-based with proptest: coverage-guided fuzzing (cargo-fuzz, libFuzzer) needs a
//! nightly toolchain, which this machine does not have (see docs/node-driver.md, "Fuzzing").
//!
//! Each target starts from a saved corpus (the real outputs recorded in `testdata/`, the state
//! files PMEM-CSI 1.0 wrote, `testdata/fuzz/`) and mutates it both as bytes (truncation,
//! flipped and inserted bytes) and as JSON (wrong types, huge and negative numbers, removed and
//! unknown fields), or generates structured input (names with `/`, `..`, NUL, multibyte
//! characters cut at the 6-byte prefix, 1 MiB names, negative and overflowing sizes).
//! Properties: no panic, nothing lost, and every rejection names what it rejects.
//!
//! `PMEM_CSI_FUZZ_CASES` sets the cases per target (default 300, what `just test` runs);
//! `just fuzz` runs many more in a release build. Each target prints how many inputs it ran.
//! A failing input is shrunk and its seed saved by proptest in
//! `driver/tests/fuzz-regressions/<target>.txt` (committed), and replayed first on every run.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use driver::controller::ControllerService;
use driver::csi::controller_server::Controller;
use driver::csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use driver::csi::{
    CapacityRange, CreateVolumeRequest, DeleteVolumeRequest, VolumeCapability, VolumeContentSource,
};
use driver::fake::Fake;
use driver::mount_options::MountOptions;
use driver::parameters::{Origin, Parameters};
use driver::state::{QUARANTINE_SUFFIX, StateStore, VolumeState};
use driver::volumes::Volumes;
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};
use serde_json::Value;
use tonic::Code;

/// Cases per target.
fn cases() -> u32 {
    std::env::var("PMEM_CSI_FUZZ_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(300)
}

/// Runs `property` over `strategy`; each input's outcome is named (`"parsed"`, `"rejected"`,
/// …). Prints how many inputs ran and their outcomes, and fails unless at least two different
/// outcomes occurred: a generator whose every input is rejected (or accepted) tests little.
fn fuzz<S: Strategy>(
    target: &str,
    strategy: S,
    property: impl Fn(S::Value) -> Result<&'static str, TestCaseError>,
) {
    let outcomes = std::sync::Mutex::new(BTreeMap::<&'static str, u64>::new());
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        // Mutated inputs are mostly rejected early; rejection is a result, not a discard.
        max_global_rejects: 0,
        // One file per target beside this one; a leaked &'static str is what proptest takes.
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(Box::leak(
            format!(
                "{}/tests/fuzz-regressions/{}.txt",
                env!("CARGO_MANIFEST_DIR"),
                target.replace(' ', "-")
            )
            .into_boxed_str(),
        )))),
        ..Config::default()
    });
    let result = runner.run(&strategy, |input| {
        let outcome = property(input)?;
        if let Ok(mut o) = outcomes.lock() {
            *o.entry(outcome).or_default() += 1;
        }
        Ok(())
    });
    let outcomes = outcomes.into_inner().unwrap_or_default();
    eprintln!(
        "fuzz {target}: {} executions, {}; outcomes {outcomes:?}",
        outcomes.values().sum::<u64>(),
        if result.is_ok() {
            "no failure"
        } else {
            "FAILED"
        }
    );
    if let Err(e) = result {
        panic!("fuzz {target}: {e}");
    }
    assert!(
        outcomes.len() >= 2 || cases() < 50,
        "fuzz {target}: every input had the same outcome {outcomes:?}"
    );
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// The files under `testdata/<dir>` (recursively) whose names end in one of `extensions`.
fn corpus(dirs: &[&str], extensions: &[&str]) -> Vec<Vec<u8>> {
    fn walk(dir: &Path, extensions: &[&str], out: &mut Vec<Vec<u8>>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        let mut paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        paths.sort();
        for path in paths {
            if path.is_dir() {
                walk(&path, extensions, out);
            } else if path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| extensions.iter().any(|e| n.ends_with(e)))
                && let Ok(bytes) = std::fs::read(&path)
            {
                out.push(bytes);
            }
        }
    }
    let mut out = Vec::new();
    for dir in dirs {
        walk(&repo().join("testdata").join(dir), extensions, &mut out);
    }
    assert!(!out.is_empty(), "no corpus in testdata/{dirs:?}");
    out
}

/// One edit of an input.
#[derive(Clone, Debug)]
enum Mutation {
    /// Cut at a position (per mille of the length).
    Truncate(u16),
    /// XOR one byte.
    Flip(u16, u8),
    /// Insert bytes.
    Insert(u16, Vec<u8>),
    /// Replace the value at one JSON path (the n-th, in document order) by a hostile one.
    Replace(u16, Hostile),
    /// Remove the n-th object member.
    Remove(u16),
    /// Add an unknown member to the n-th object.
    Unknown(u16, String, Hostile),
}

/// Values of the wrong type or out of every range.
#[derive(Clone, Debug)]
enum Hostile {
    Null,
    Bool(bool),
    Number(i64),
    /// u64::MAX and more, as a JSON number literal.
    Huge(String),
    Text(String),
    EmptyArray,
    EmptyObject,
}

impl Hostile {
    fn to_json(&self) -> String {
        match self {
            Hostile::Null => "null".into(),
            Hostile::Bool(b) => b.to_string(),
            Hostile::Number(n) => n.to_string(),
            Hostile::Huge(s) => s.clone(),
            Hostile::Text(s) => Value::String(s.clone()).to_string(),
            Hostile::EmptyArray => "[]".into(),
            Hostile::EmptyObject => "{}".into(),
        }
    }
}

fn hostile() -> impl Strategy<Value = Hostile> {
    prop_oneof![
        Just(Hostile::Null),
        any::<bool>().prop_map(Hostile::Bool),
        prop_oneof![
            Just(i64::MIN),
            Just(i64::MAX),
            Just(-1i64),
            Just(0i64),
            any::<i64>()
        ]
        .prop_map(Hostile::Number),
        prop_oneof![
            Just("18446744073709551615".to_string()),
            Just("18446744073709551616".to_string()),
            Just("1e400".to_string()),
            Just("-1e400".to_string()),
            Just("1.5".to_string()),
            Just("123456789012345678901234567890".to_string()),
        ]
        .prop_map(Hostile::Huge),
        "\\PC{0,12}".prop_map(Hostile::Text),
        Just(Hostile::EmptyArray),
        Just(Hostile::EmptyObject),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        any::<u16>().prop_map(Mutation::Truncate),
        (any::<u16>(), 1u8..).prop_map(|(at, x)| Mutation::Flip(at, x)),
        (any::<u16>(), prop::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(at, b)| Mutation::Insert(at, b)),
        (any::<u16>(), hostile()).prop_map(|(at, h)| Mutation::Replace(at, h)),
        (any::<u16>(), hostile()).prop_map(|(at, h)| Mutation::Replace(at, h)),
        any::<u16>().prop_map(Mutation::Remove),
        (any::<u16>(), "[a-zA-Z_]{1,10}", hostile())
            .prop_map(|(at, k, h)| Mutation::Unknown(at, k, h)),
    ]
}

/// The JSON pointers of every value of a document, depth first (the root, `""`, first), and
/// whether each is an object.
fn pointers(v: &Value, at: String, out: &mut Vec<(String, bool)>) {
    out.push((at.clone(), v.is_object()));
    let escape = |k: &str| k.replace('~', "~0").replace('/', "~1");
    match v {
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                pointers(x, format!("{at}/{i}"), out);
            }
        }
        Value::Object(o) => {
            for (k, x) in o {
                pointers(x, format!("{at}/{}", escape(k)), out);
            }
        }
        _ => {}
    }
}

/// Placeholder for a hostile value, replaced in the serialised text: numbers beyond u64 are
/// not representable as a `Value`.
const PLACEHOLDER: &str = "\u{1}HOSTILE\u{1}";

/// `doc` serialised with the placeholder (if any) replaced by `h`.
fn with_hostile(doc: &Value, h: &Hostile) -> Vec<u8> {
    let placeholder = Value::String(PLACEHOLDER.into()).to_string();
    doc.to_string()
        .replacen(&placeholder, &h.to_json(), 1)
        .into_bytes()
}

/// The pointer of the `n`-th value (objects only if `objects`), cycling.
fn nth_pointer(doc: &Value, n: u16, objects: bool) -> Option<String> {
    let mut all = Vec::new();
    pointers(doc, String::new(), &mut all);
    let chosen: Vec<String> = all
        .into_iter()
        .filter(|(_, is_object)| *is_object || !objects)
        .map(|(p, _)| p)
        .collect();
    (!chosen.is_empty()).then(|| chosen[usize::from(n) % chosen.len()].clone())
}

/// `input` with `mutations` applied in order.
fn mutate(input: &[u8], mutations: &[Mutation]) -> Vec<u8> {
    let mut bytes = input.to_vec();
    let at = |per_mille: u16, len: usize| len * usize::from(per_mille % 1001) / 1000;
    for m in mutations {
        match m {
            Mutation::Truncate(p) => bytes.truncate(at(*p, bytes.len())),
            Mutation::Flip(p, x) => {
                if !bytes.is_empty() {
                    let i = at(*p, bytes.len() - 1);
                    bytes[i] ^= x;
                }
            }
            Mutation::Insert(p, b) => {
                let i = at(*p, bytes.len());
                bytes.splice(i..i, b.iter().copied());
            }
            Mutation::Replace(n, h) => {
                if let Ok(mut doc) = serde_json::from_slice::<Value>(&bytes)
                    && let Some(p) = nth_pointer(&doc, *n, false)
                    && let Some(target) = doc.pointer_mut(&p)
                {
                    *target = Value::String(PLACEHOLDER.into());
                    bytes = with_hostile(&doc, h);
                }
            }
            Mutation::Remove(n) => {
                if let Ok(mut doc) = serde_json::from_slice::<Value>(&bytes)
                    && let Some(p) = nth_pointer(&doc, *n, true)
                    && let Some(object) = doc.pointer_mut(&p).and_then(Value::as_object_mut)
                    && let Some(key) = object
                        .keys()
                        .nth(usize::from(*n) % object.len().max(1))
                        .cloned()
                {
                    object.remove(&key);
                    bytes = doc.to_string().into_bytes();
                }
            }
            Mutation::Unknown(n, key, h) => {
                if let Ok(mut doc) = serde_json::from_slice::<Value>(&bytes)
                    && let Some(p) = nth_pointer(&doc, *n, true)
                    && let Some(object) = doc.pointer_mut(&p).and_then(Value::as_object_mut)
                {
                    object.insert(key.clone(), Value::String(PLACEHOLDER.into()));
                    bytes = with_hostile(&doc, h);
                }
            }
        }
    }
    bytes
}

/// A corpus file, mutated, or (one in eight) arbitrary bytes.
fn mutated(corpus: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let seeds = corpus.len();
    prop_oneof![
        7 => (0..seeds, prop::collection::vec(mutation(), 0..5))
            .prop_map(move |(i, m)| mutate(&corpus[i], &m)),
        1 => prop::collection::vec(any::<u8>(), 0..256),
    ]
}

// ---------------------------------------------------------------------------------------------
// State files
// ---------------------------------------------------------------------------------------------

/// A state file of any content in a state directory, opened by the driver at start-up: no
/// panic, and its bytes are kept, either where they were (parsed) or quarantined beside it
/// (corrupt); a file that parses is never quarantined.
#[test]
fn state_files() {
    let mut seeds = corpus(&["pmem-csi-1.0"], &[".json"]);
    seeds.push(
        serde_json::to_vec(&VolumeState {
            id: "pvc-12-0123".into(),
            size: 64 << 20,
            parameters: BTreeMap::from([
                ("name".into(), "pvc-12".into()),
                ("deviceMode".into(), "fake".into()),
                ("eraseafter".into(), "true".into()),
            ]),
            growing_from: None,
        })
        .unwrap_or_default(),
    );
    fuzz("state files", mutated(seeds), |bytes| {
        let dir = tempfile::tempdir().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let file = dir.path().join("pvc-12-0123.json");
        std::fs::write(&file, &bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let parses = serde_json::from_slice::<VolumeState>(&bytes).is_ok();
        let store = StateStore::open(dir.path()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let opened = Volumes::open(Arc::new(Fake::new(1 << 30)), store, 4 << 20);
        if let Err(e) = &opened {
            prop_assert!(!e.to_string().is_empty(), "a refusal says why");
        }
        let quarantined = PathBuf::from(format!("{}{QUARANTINE_SUFFIX}", file.display()));
        let kept = [&file, &quarantined]
            .iter()
            .filter_map(|p| std::fs::read(p).ok())
            .any(|b| b == bytes);
        prop_assert!(kept, "the state file's bytes were lost");
        if parses {
            prop_assert!(file.exists(), "a state file that parses was moved aside");
        }
        Ok(match (parses, opened.is_ok()) {
            (true, true) => "parsed, opened",
            (true, false) => "parsed, repair refused",
            (false, true) => "quarantined, opened",
            (false, false) => "quarantined, repair refused",
        })
    });
}

// ---------------------------------------------------------------------------------------------
// ndctl and LVM JSON
// ---------------------------------------------------------------------------------------------

/// ndctl's output in any shape: parsed or rejected without panic; what parses can be sized
/// (alignment, LVM's namespace budget) without overflow.
#[test]
fn ndctl_json() {
    let seeds = corpus(&["ndctl"], &[".json"]);
    let strategy = (mutated(seeds), 0u8..=100, any::<u64>());
    fuzz("ndctl JSON", strategy, |(bytes, percentage, own_raw)| {
        let text = String::from_utf8_lossy(&bytes);
        Ok(match driver::ndctl::parse_regions(&text) {
            Ok(regions) => {
                for region in &regions {
                    let align = region.namespace_alignment();
                    prop_assert!(align > 0, "alignment of {region:?}");
                    let budget = driver::lvm::namespace_budget(region, percentage, own_raw);
                    prop_assert!(budget <= region.available.min(region.max_extent));
                    prop_assert_eq!(budget % align, 0);
                    let _ = (region.usable(), driver::lvm::vg_name(region));
                    for ns in &region.namespaces {
                        let _ = ns.device();
                    }
                }
                if regions.is_empty() {
                    "no regions"
                } else {
                    "regions"
                }
            }
            Err(e) => {
                prop_assert!(e.to_string().contains("ndctl"), "{e}");
                "rejected"
            }
        })
    });
}

/// `vgs` and `lvs` output in any shape: parsed or rejected without panic.
#[test]
fn lvm_json() {
    let seeds = corpus(&["lvm"], &[".json"]);
    let strategy = (mutated(seeds), any::<u64>());
    fuzz("LVM JSON", strategy, |(bytes, size)| {
        let text = String::from_utf8_lossy(&bytes);
        let vgs = match driver::lvm::parse_vgs(&text) {
            Ok(vgs) => {
                if let Some(vg) = driver::lvm::choose_vg(&vgs, size) {
                    prop_assert!(vg.free >= size);
                }
                !vgs.is_empty()
            }
            Err(e) => {
                prop_assert!(!e.to_string().is_empty());
                false
            }
        };
        let lvs = match driver::lvm::parse_lvs(&text) {
            Ok(lvs) => {
                for lv in &lvs {
                    let _ = driver::lvm::lv_path(&lv.vg, &lv.name);
                }
                !lvs.is_empty()
            }
            Err(e) => {
                prop_assert!(!e.to_string().is_empty());
                false
            }
        };
        Ok(match (vgs, lvs) {
            (true, true) => "groups and volumes",
            (true, false) => "groups",
            (false, true) => "volumes",
            (false, false) => "neither",
        })
    });
}

// ---------------------------------------------------------------------------------------------
// Names, parameters, mount options
// ---------------------------------------------------------------------------------------------

/// Volume names as a CSI caller may send them (Kubernetes sends `pvc-<uid>`).
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "pvc-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}",
        2 => "\\PC{0,20}",
        1 => Just(String::new()),
        1 => Just(".".to_string()),
        1 => Just("..".to_string()),
        1 => "\\.[a-z]{0,8}",
        1 => "[a-z]{0,3}/[a-z./]{0,8}",
        1 => "\\.\\./[a-z./]{0,8}",
        1 => "[a-z]{0,4}\u{0}[a-z]{0,4}",
        // A multibyte character across the 6-byte prefix.
        1 => "[a-z]{3,5}[äø€😀]{1,3}[a-z]{0,4}",
        1 => Just("x".repeat(1 << 20)),
    ]
}

/// Volume IDs: deterministic, `<prefix of the name>-<56 hex>`, the prefix at most 6 bytes and
/// a prefix of the name (never a split character).
#[test]
fn volume_ids() {
    fuzz("volume names", name(), |name| {
        let id = driver::volume_id::volume_id(&name);
        prop_assert_eq!(&id, &driver::volume_id::volume_id(&name));
        let (prefix, hash) = id
            .rsplit_once('-')
            .ok_or_else(|| TestCaseError::fail("no -"))?;
        prop_assert!(prefix.len() <= 6);
        prop_assert!(name.starts_with(prefix));
        prop_assert_eq!(hash.len(), 56);
        prop_assert!(driver::volume_id::looks_like_volume_id(&id), "{id}");
        Ok(match driver::volume_id::name_problem(&name) {
            None => "usable",
            Some(problem) => {
                prop_assert!(problem.contains("cannot name a volume"), "{problem}");
                "refused"
            }
        })
    });
}

const KNOWN_KEYS: [&str; 8] = [
    "eraseafter",
    "usage",
    "persistencyModel",
    "kataContainers",
    "size",
    "name",
    "deviceMode",
    "csi.storage.k8s.io/fstype",
];

fn parameters() -> impl Strategy<Value = BTreeMap<String, String>> {
    let key = prop_oneof![
        4 => prop::sample::select(&KNOWN_KEYS[..]).prop_map(str::to_string),
        1 => "\\PC{0,12}",
    ];
    let value = prop_oneof![
        prop::sample::select(
            &[
                "true",
                "false",
                "AppDirect",
                "FileIO",
                "normal",
                "ephemeral",
                "none",
                "cache",
                "64Mi",
                "1Gi",
                "-1",
                "0",
                "18446744073709551616",
                "1e400",
                "4Ei",
                "99999999Ei",
                "fake",
                "lvm",
                "direct",
                "emulated",
                "",
            ][..]
        )
        .prop_map(str::to_string),
        "\\PC{0,12}",
    ];
    prop::collection::btree_map(key, value, 0..5)
}

/// StorageClass parameters and volume attributes: parsed, or rejected naming the key.
#[test]
fn storage_class_parameters() {
    let origins = prop::sample::select(vec![
        Origin::CreateVolume,
        Origin::Ephemeral,
        Origin::Context,
        Origin::State,
    ]);
    fuzz("parameters", (parameters(), origins), |(map, origin)| {
        let Err(e) = Parameters::parse(&map, origin) else {
            return Ok("accepted");
        };
        let message = e.to_string();
        prop_assert!(
            map.keys().any(|k| message.contains(&format!("{k:?}"))) || message.contains("\"size\""),
            "{message} names none of {map:?}"
        );
        Ok("rejected")
    });
}

/// Mount options: split into flags and data, or rejected naming the option.
#[test]
fn mount_option_lists() {
    let option = prop_oneof![
        prop::sample::select(
            &[
                "noatime",
                "ro",
                "rw",
                "nosuid",
                "suid",
                "dev",
                "nodev",
                "exec",
                "noexec",
                "dax",
                "dax=always",
                "discard",
                "bind",
                "remount",
                "relatime",
                "",
                ",",
                "a,,b",
            ][..]
        )
        .prop_map(str::to_string),
        "\\PC{0,10}",
        "[a-z]{1,5}\u{0}",
    ];
    fuzz(
        "mount options",
        prop::collection::vec(option, 0..6),
        |options| {
            Ok(match MountOptions::parse(&options) {
                Ok(parsed) => {
                    let flags = parsed.bind_flags(false);
                    prop_assert!(flags.contains(rustix::mount::MountFlags::NOSUID));
                    prop_assert!(flags.contains(rustix::mount::MountFlags::NODEV));
                    prop_assert!(!parsed.data_with(&[]).contains('\0'));
                    "accepted"
                }
                Err(e) => {
                    prop_assert!(e.to_string().contains("mount"), "{e}");
                    "rejected"
                }
            })
        },
    );
}

// ---------------------------------------------------------------------------------------------
// CSI requests
// ---------------------------------------------------------------------------------------------

fn capability() -> impl Strategy<Value = VolumeCapability> {
    let access_type = prop_oneof![
        Just(None),
        Just(Some(AccessType::Block(BlockVolume {}))),
        (
            prop::sample::select(&["", "ext4", "xfs", "btrfs", "ext4\u{0}", "../x"][..]),
            prop::collection::vec("[a-z=,]{0,10}", 0..3)
        )
            .prop_map(|(fs, flags)| Some(AccessType::Mount(MountVolume {
                fs_type: fs.to_string(),
                mount_flags: flags,
                volume_mount_group: String::new(),
            }))),
    ];
    (
        access_type,
        prop_oneof![Just(None), (-2i32..9).prop_map(Some)],
    )
        .prop_map(|(access_type, mode)| VolumeCapability {
            access_type,
            access_mode: mode.map(|mode| AccessMode { mode }),
        })
}

fn bytes() -> impl Strategy<Value = i64> {
    prop_oneof![
        Just(0i64),
        Just(-1i64),
        Just(i64::MIN),
        Just(i64::MAX),
        Just(1i64 << 20),
        Just(64i64 << 20),
        Just((4i64 << 20) + 1),
        Just(1i64 << 40),
        any::<i64>(),
        (0i64..(256 << 20)),
    ]
}

/// What Kubernetes sends, field by field, or (about one field in three) something hostile.
fn create_request() -> impl Strategy<Value = CreateVolumeRequest> {
    let name = prop_oneof![
        2 => "pvc-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}",
        1 => name(),
    ];
    let valid_capability = (
        prop::sample::select(&[1, 2, 6, 7][..]),
        prop_oneof![
            Just(AccessType::Block(BlockVolume {})),
            prop::sample::select(&["", "ext4", "xfs"][..]).prop_map(|fs| AccessType::Mount(
                MountVolume {
                    fs_type: fs.to_string(),
                    mount_flags: Vec::new(),
                    volume_mount_group: String::new(),
                }
            )),
        ],
    )
        .prop_map(|(mode, access_type)| VolumeCapability {
            access_type: Some(access_type),
            access_mode: Some(AccessMode { mode }),
        });
    let capabilities = prop_oneof![
        3 => prop::collection::vec(valid_capability, 1..2),
        1 => prop::collection::vec(capability(), 0..3),
    ];
    let size = prop_oneof![
        3 => prop::sample::select(&[0i64, 1, 4 << 20, 64 << 20, (64 << 20) + 1][..]),
        1 => bytes(),
    ];
    let valid_parameters = prop::collection::btree_map(
        prop::sample::select(&["eraseafter", "csi.storage.k8s.io/fstype", "usage"][..]),
        prop::sample::select(&["true", "false", "ext4"][..]),
        0..2,
    )
    .prop_map(|m| {
        m.into_iter()
            .filter(|(k, v)| match *k {
                "eraseafter" => *v != "ext4",
                "csi.storage.k8s.io/fstype" => *v == "ext4",
                _ => false,
            })
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<BTreeMap<_, _>>()
    });
    let parameters = prop_oneof![3 => valid_parameters, 1 => parameters()];
    (
        name,
        size.clone(),
        prop_oneof![3 => Just(0i64), 1 => size],
        capabilities,
        parameters,
        prop::bool::weighted(0.05),
    )
        .prop_map(
            |(name, required, limit, capabilities, parameters, source)| CreateVolumeRequest {
                name,
                capacity_range: Some(CapacityRange {
                    required_bytes: required,
                    limit_bytes: limit,
                }),
                volume_capabilities: capabilities,
                parameters: parameters.into_iter().collect::<HashMap<_, _>>(),
                secrets: HashMap::new(),
                volume_content_source: source.then(VolumeContentSource::default),
                accessibility_requirements: None,
                mutable_parameters: HashMap::new(),
            },
        )
}

/// How a rejection of a CreateVolume request names its field (`VolumeError`'s `<field>: …` and
/// `<field> is required`, `ParameterError`'s `parameter "<key>"`).
const FIELDS: [&str; 8] = [
    "name: ",
    "name is required",
    "required_bytes",
    "limit_bytes",
    "volume_capabilities",
    "volume_capability.",
    "volume_content_source: ",
    "parameter \"",
];

/// CreateVolume with any request on the fake backend: OK (then a safe ID, a size within the
/// range, a state file inside the state directory; repeating it answers the same volume and
/// DeleteVolume removes it, twice), or an error of the caller's making that names the field.
/// A runtime and the Controller service of a 1 GiB fake node whose state is in `state`.
fn fake_node(state: &Path) -> (tokio::runtime::Runtime, ControllerService) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let store = StateStore::open(state).expect("state");
    let volumes = Volumes::open(Arc::new(Fake::new(1 << 30)), store, 4 << 20).expect("volumes");
    let service = ControllerService {
        volumes: Arc::new(volumes),
        node_id: "node-1".into(),
        topology_key: "pmem-csi.intel.com/node".into(),
    };
    (runtime, service)
}

#[test]
fn create_volume_requests() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state");
    let (runtime, service) = fake_node(&state);
    fuzz("CreateVolume requests", create_request(), |request| {
        runtime.block_on(async {
            let required = request
                .capacity_range
                .as_ref()
                .map_or(0, |r| r.required_bytes);
            let limit = request.capacity_range.as_ref().map_or(0, |r| r.limit_bytes);
            match service
                .create_volume(tonic::Request::new(request.clone()))
                .await
            {
                Ok(response) => {
                    let volume = response.into_inner().volume.ok_or_else(|| {
                        TestCaseError::fail("an OK CreateVolume without a volume")
                    })?;
                    let id = volume.volume_id;
                    prop_assert!(
                        !id.is_empty()
                            && !id.contains('/')
                            && !id.contains('\0')
                            && id != "."
                            && id != "..",
                        "unsafe volume ID {id:?}"
                    );
                    prop_assert!(volume.capacity_bytes >= required.max(0));
                    if limit > 0 {
                        prop_assert!(volume.capacity_bytes <= limit);
                    }
                    let file = state.join(format!("{id}.json"));
                    prop_assert!(file.exists(), "no state file {}", file.display());
                    let again = service
                        .create_volume(tonic::Request::new(request.clone()))
                        .await
                        .map_err(|s| TestCaseError::fail(format!("repeated: {s:?}")))?;
                    prop_assert_eq!(
                        again.into_inner().volume.map(|v| v.volume_id),
                        Some(id.clone())
                    );
                    for _ in 0..2 {
                        service
                            .delete_volume(tonic::Request::new(DeleteVolumeRequest {
                                volume_id: id.clone(),
                                secrets: HashMap::new(),
                            }))
                            .await
                            .map_err(|s| TestCaseError::fail(format!("delete: {s:?}")))?;
                    }
                    prop_assert!(!file.exists(), "state of a deleted volume left");
                    Ok("created, repeated, deleted twice")
                }
                Err(status) => {
                    prop_assert!(
                        matches!(
                            status.code(),
                            Code::InvalidArgument | Code::OutOfRange | Code::ResourceExhausted
                        ),
                        "{:?}: {}",
                        status.code(),
                        status.message()
                    );
                    if status.code() != Code::ResourceExhausted {
                        prop_assert!(
                            FIELDS.iter().any(|f| status.message().contains(f)),
                            "{:?} names no field: {}",
                            status.code(),
                            status.message()
                        );
                    }
                    Ok(match status.code() {
                        Code::InvalidArgument => "InvalidArgument",
                        Code::OutOfRange => "OutOfRange",
                        _ => "ResourceExhausted",
                    })
                }
            }
        })
    });
    let left: Vec<_> = std::fs::read_dir(&state)
        .expect("state dir")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "state left behind: {left:?}");
}

/// What fuzzing found, replayed exactly: a name whose ID would be a hidden file (`.` → `.-<hash>`)
/// answered Internal ("cannot name a state file") instead of InvalidArgument; sizes whose
/// rounding overflowed answered OutOfRange naming no field.
#[test]
fn found_by_fuzzing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (runtime, service) = fake_node(dir.path());
    let block = VolumeCapability {
        access_mode: Some(AccessMode { mode: 1 }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    };
    for (name, required, limit, code, says) in [
        (".", 1 << 20, 4 << 20, Code::InvalidArgument, "name: "),
        ("..", 0, 0, Code::InvalidArgument, "name: "),
        ("a/../b", 0, 0, Code::InvalidArgument, "'/'"),
        ("pvc-1", i64::MAX, 0, Code::OutOfRange, "required_bytes"),
        ("pvc-1", i64::MAX, i64::MAX, Code::OutOfRange, "limit_bytes"),
    ] {
        let request = CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(CapacityRange {
                required_bytes: required,
                limit_bytes: limit,
            }),
            volume_capabilities: vec![block.clone()],
            ..Default::default()
        };
        let status = runtime
            .block_on(service.create_volume(tonic::Request::new(request)))
            .expect_err(name);
        assert_eq!(status.code(), code, "{name}: {}", status.message());
        assert!(
            status.message().contains(says),
            "{name}: {}",
            status.message()
        );
    }
    assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
}
