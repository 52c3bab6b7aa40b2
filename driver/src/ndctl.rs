//! PMEM regions and namespaces as `ndctl` reports them: typed values parsed from its JSON, the
//! command lines that change them, and the size arithmetic of fsdax and sector namespaces.
//!
//! `ndctl list` prints a lone object where there is one item and an array where there are
//! several, at every level; the parser accepts both.

use serde_json::Value;

use crate::tool::{self, ToolError};

/// The name PMEM-CSI gives the namespaces it owns in LVM mode ("own vs foreign").
pub const PMEM_CSI_NAMESPACE: &str = "pmem-csi";

/// Alignment of fsdax page metadata (`ndctl create-namespace --align` default on x86-64).
pub const FSDAX_ALIGNMENT: u64 = 2 << 20;

/// Used when a region reports no alignment of its own (PMEM-CSI's workaround for libvirt).
pub const FALLBACK_REGION_ALIGNMENT: u64 = 96 << 20;

/// Errors reading or changing namespaces.
#[derive(Debug, thiserror::Error)]
pub enum NdctlError {
    /// The tool failed.
    #[error(transparent)]
    Tool(#[from] ToolError),
    /// Its output is not what this driver understands.
    #[error("unexpected ndctl output ({what}): {output}")]
    Output {
        /// What was missing or malformed.
        what: String,
        /// The output, shortened.
        output: String,
    },
}

impl NdctlError {
    /// As a backend error: ndctl not installed stays recognisable, the rest is I/O.
    pub fn into_backend(
        self,
        op: &'static str,
        what: impl std::fmt::Display,
    ) -> crate::backend::BackendError {
        match self {
            NdctlError::Tool(e) => crate::backend::BackendError::tool(op, what, e),
            e => crate::backend::BackendError::io(op, what, e),
        }
    }
}

fn output_error(what: impl Into<String>, output: &str) -> NdctlError {
    NdctlError::Output {
        what: what.into(),
        output: output.chars().take(400).collect(),
    }
}

/// Namespace modes this driver creates or reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NamespaceMode {
    /// Memory-mapped with DAX (`usage: AppDirect`).
    Fsdax,
    /// Block translation table, atomic sectors, no DAX (`usage: FileIO` in direct mode).
    Sector,
    /// Anything else (raw, devdax): never touched.
    Other,
}

impl NamespaceMode {
    fn parse(mode: &str) -> Self {
        match mode {
            "fsdax" | "memory" => NamespaceMode::Fsdax,
            "sector" => NamespaceMode::Sector,
            _ => NamespaceMode::Other,
        }
    }

    /// The `--mode` value.
    pub fn as_str(self) -> &'static str {
        match self {
            NamespaceMode::Fsdax => "fsdax",
            NamespaceMode::Sector => "sector",
            NamespaceMode::Other => "raw",
        }
    }
}

/// One namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Namespace {
    /// `namespaceX.Y`.
    pub dev: String,
    /// Its mode.
    pub mode: NamespaceMode,
    /// Usable bytes.
    pub size: u64,
    /// Its name (PMEM-CSI: the volume ID in direct mode, `pmem-csi` in LVM mode).
    pub name: Option<String>,
    /// Block device name (`pmem0`, `pmem1.2s`), when enabled.
    pub blockdev: Option<String>,
    /// Whether it is enabled.
    pub enabled: bool,
}

impl Namespace {
    /// The block device path.
    pub fn device(&self) -> Option<String> {
        self.blockdev.as_ref().map(|b| format!("/dev/{b}"))
    }
}

/// One region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Region {
    /// The bus it hangs off (`ndbus0`).
    pub bus: String,
    /// `regionN`.
    pub dev: String,
    /// Total bytes.
    pub size: u64,
    /// Bytes not in any namespace.
    pub available: u64,
    /// The largest contiguous free range.
    pub max_extent: u64,
    /// The region's own alignment, if it reports one.
    pub align: Option<u64>,
    /// DIMMs interleaved in it.
    pub interleave_ways: u64,
    /// `pmem` (byte-addressable) or `blk`.
    pub kind: String,
    /// Whether it is enabled.
    pub enabled: bool,
    /// Its namespaces with a size.
    pub namespaces: Vec<Namespace>,
}

impl Region {
    /// The alignment PMEM-CSI sizes namespaces in: LCM(2 MiB × interleave ways, region align),
    /// with 96 MiB standing in for a region without alignment.
    pub fn namespace_alignment(&self) -> u64 {
        let fsdax = FSDAX_ALIGNMENT.saturating_mul(self.interleave_ways.max(1));
        let region = match self.align {
            Some(a) if a > 1 => a,
            _ => FALLBACK_REGION_ALIGNMENT,
        };
        lcm(fsdax, region)
    }

    /// Whether PMEM-CSI uses it: enabled and byte-addressable.
    pub fn usable(&self) -> bool {
        self.enabled && self.kind == "pmem"
    }
}

/// Greatest common divisor.
pub fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Least common multiple (of the non-zero one if the other is 0; saturating).
pub fn lcm(a: u64, b: u64) -> u64 {
    if a == 0 || b == 0 {
        return a.max(b);
    }
    (a / gcd(a, b)).saturating_mul(b)
}

/// Every value of an ndctl list level: an array's items, or a lone object.
fn items(v: Option<&Value>) -> Vec<&Value> {
    match v {
        Some(Value::Array(a)) => a.iter().collect(),
        Some(o @ Value::Object(_)) => vec![o],
        _ => Vec::new(),
    }
}

fn u64_field(v: &Value, field: &str, text: &str) -> Result<u64, NdctlError> {
    v.get(field)
        .and_then(Value::as_u64)
        .ok_or_else(|| output_error(format!("no numeric {field:?}"), text))
}

fn str_field<'a>(v: &'a Value, field: &str, text: &str) -> Result<&'a str, NdctlError> {
    v.get(field)
        .and_then(Value::as_str)
        .ok_or_else(|| output_error(format!("no {field:?}"), text))
}

/// Parses one namespace object.
pub fn parse_namespace(v: &Value, text: &str) -> Result<Namespace, NdctlError> {
    Ok(Namespace {
        dev: str_field(v, "dev", text)?.to_string(),
        mode: NamespaceMode::parse(v.get("mode").and_then(Value::as_str).unwrap_or("raw")),
        size: u64_field(v, "size", text)?,
        name: v.get("name").and_then(Value::as_str).map(str::to_string),
        blockdev: v
            .get("blockdev")
            .and_then(Value::as_str)
            .map(str::to_string),
        enabled: v.get("state").and_then(Value::as_str) != Some("disabled"),
    })
}

fn parse_region(bus: &str, v: &Value, text: &str) -> Result<Region, NdctlError> {
    let mut namespaces = Vec::new();
    for ns in items(v.get("namespaces")) {
        namespaces.push(parse_namespace(ns, text)?);
    }
    Ok(Region {
        bus: bus.to_string(),
        dev: str_field(v, "dev", text)?.to_string(),
        size: u64_field(v, "size", text)?,
        available: u64_field(v, "available_size", text)?,
        max_extent: v
            .get("max_available_extent")
            .and_then(Value::as_u64)
            .unwrap_or(u64_field(v, "available_size", text)?),
        align: v.get("align").and_then(Value::as_u64),
        interleave_ways: v
            .get("mappings")
            .and_then(Value::as_array)
            .map_or(1, |m| m.len().max(1) as u64),
        kind: v
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("pmem")
            .to_string(),
        enabled: v.get("state").and_then(Value::as_str) != Some("disabled"),
        namespaces,
    })
}

/// Parses `ndctl list --buses --regions --namespaces --idle --verbose`: every region with its
/// bus and namespaces, in bus and region order. Empty output means no PMEM. Without a bus level
/// (`{"regions": […]}`, as `ndctl list -RN` prints) the regions are taken to be on `ndbus0`.
pub fn parse_regions(text: &str) -> Result<Vec<Region>, NdctlError> {
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    let root: Value =
        serde_json::from_str(text).map_err(|e| output_error(format!("not JSON: {e}"), text))?;
    let mut regions = Vec::new();
    for item in items(Some(&root)) {
        if item.get("regions").is_some() {
            let bus = item.get("dev").and_then(Value::as_str).unwrap_or("ndbus0");
            for region in items(item.get("regions")) {
                regions.push(parse_region(bus, region, text)?);
            }
        } else if item.get("available_size").is_some() {
            regions.push(parse_region("ndbus0", item, text)?);
        } else if item.get("provider").is_none() {
            return Err(output_error("neither a bus nor a region", text));
        }
    }
    regions.sort_by(|a, b| natural(&a.bus, &b.bus).then_with(|| natural(&a.dev, &b.dev)));
    Ok(regions)
}

/// Orders `region2` before `region10`.
fn natural(a: &str, b: &str) -> std::cmp::Ordering {
    let split = |s: &str| {
        let digits = s.trim_start_matches(|c: char| !c.is_ascii_digit());
        (
            s[..s.len() - digits.len()].to_string(),
            digits.parse::<u64>().unwrap_or(0),
        )
    };
    split(a).cmp(&split(b))
}

/// Lists every region with its namespaces (disabled ones included).
pub fn list() -> Result<Vec<Region>, NdctlError> {
    parse_regions(&tool::run(
        "ndctl",
        &[
            "list",
            "--buses",
            "--regions",
            "--namespaces",
            "--idle",
            "--verbose",
        ],
    )?)
}

/// Creates a namespace of `size` raw bytes named `name` in `region`; returns it as ndctl
/// printed it.
pub fn create(
    region: &str,
    mode: NamespaceMode,
    size: u64,
    name: &str,
) -> Result<Namespace, NdctlError> {
    let size = size.to_string();
    let mut args = vec![
        "create-namespace",
        "--region",
        region,
        "--mode",
        mode.as_str(),
        "--size",
        &size,
        "--name",
        name,
    ];
    match mode {
        NamespaceMode::Fsdax => args.extend(["--map", "dev"]),
        NamespaceMode::Sector => args.extend(["--sector-size", "4096"]),
        NamespaceMode::Other => {}
    }
    let text = tool::run("ndctl", &args)?;
    let v: Value =
        serde_json::from_str(&text).map_err(|e| output_error(format!("not JSON: {e}"), &text))?;
    parse_namespace(&v, &text)
}

/// Disables and destroys namespace `dev`.
pub fn destroy(dev: &str) -> Result<(), NdctlError> {
    tool::run("ndctl", &["destroy-namespace", "--force", dev])?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_is_the_lcm_of_fsdax_and_region_alignment() {
        let region = |align, ways| Region {
            bus: "ndbus0".into(),
            dev: "region0".into(),
            size: 0,
            available: 0,
            max_extent: 0,
            align,
            interleave_ways: ways,
            kind: "pmem".into(),
            enabled: true,
            namespaces: Vec::new(),
        };
        const MI: u64 = 1 << 20;
        for (align, ways, want) in [
            (Some(16 * MI), 1, 16 * MI),
            (Some(16 * MI), 2, 16 * MI),
            (Some(16 * MI), 3, 48 * MI),
            (Some(MI), 1, 2 * MI),
            (None, 1, 96 * MI),
            (Some(1), 1, 96 * MI),
            (Some(0), 4, 96 * MI),
        ] {
            assert_eq!(
                region(align, ways).namespace_alignment(),
                want,
                "{align:?} × {ways}"
            );
        }
    }

    fn recorded(name: &str) -> String {
        crate::tool::recorded("ndctl", name)
    }

    #[test]
    fn recorded_listings_parse() {
        let fresh = parse_regions(&recorded("list-RNiv-fresh.json")).expect("fresh");
        assert_eq!(fresh.len(), 2);
        for (region, dev) in fresh.iter().zip(["region0", "region1"]) {
            assert_eq!(region.dev, dev);
            assert_eq!(region.bus, "ndbus0");
            assert_eq!(region.size, 4 << 30);
            assert_eq!(region.available, 4 << 30);
            assert_eq!(region.align, Some(16 << 20));
            assert!(region.usable());
            assert!(
                region.namespaces.iter().all(|ns| ns.size == 0),
                "{region:?}"
            );
        }
        let both = parse_regions(&recorded("list-RNiv-both-regions.json")).expect("both");
        assert_eq!(both[0].dev, "region0", "sorted by region");
        assert_eq!(both[0].available, 2 << 30);
        let own: Vec<_> = both[0]
            .namespaces
            .iter()
            .filter(|ns| ns.name.as_deref() == Some(PMEM_CSI_NAMESPACE))
            .collect();
        assert_eq!(own.len(), 2);
        assert!(
            own.iter()
                .all(|ns| ns.mode == NamespaceMode::Fsdax && ns.enabled)
        );
        assert_eq!(own[1].device().as_deref(), Some("/dev/pmem0"));
        let volume = both[1]
            .namespaces
            .iter()
            .find(|ns| ns.size > 0)
            .expect("volume namespace");
        assert_eq!(
            volume.name.as_deref(),
            Some("pvc-5f3c6b62-0b5d-4d3a-8b1e-3a4a3a9b1c2d")
        );
        assert_eq!(volume.size, 130023424);
        let seed = both[1]
            .namespaces
            .iter()
            .find(|ns| ns.size == 0)
            .expect("seed");
        assert!(!seed.enabled && seed.mode == NamespaceMode::Other);
        let sector = parse_regions(&recorded("list-RNiv-with-sector.json")).expect("sector");
        assert!(
            sector[1]
                .namespaces
                .iter()
                .any(|ns| ns.mode == NamespaceMode::Sector
                    && ns.blockdev.as_deref().is_some_and(|b| b.ends_with('s')))
        );
        assert!(parse_regions("").expect("empty").is_empty());
        assert!(parse_regions("[{\"oops\":1}]").is_err());
        assert!(parse_regions("not json").is_err());
    }

    #[test]
    fn recorded_creations_parse() {
        for (file, mode, size) in [
            (
                "create-namespace-fsdax-64M.json",
                NamespaceMode::Fsdax,
                65011712,
            ),
            (
                "create-namespace-fsdax-16M.json",
                NamespaceMode::Fsdax,
                14680064,
            ),
            (
                "create-namespace-sector-32M.json",
                NamespaceMode::Sector,
                32440320,
            ),
        ] {
            let text = recorded(file);
            let v: Value = serde_json::from_str(&text).expect("JSON");
            let ns = parse_namespace(&v, &text).expect(file);
            assert_eq!(
                (ns.mode, ns.size, ns.name.as_deref()),
                (mode, size, Some("probe")),
                "{file}"
            );
            assert!(ns.device().is_some(), "{file}");
        }
    }

    #[test]
    fn natural_order() {
        let mut names = vec!["region10", "region2", "region1"];
        names.sort_by(|a, b| natural(a, b));
        assert_eq!(names, ["region1", "region2", "region10"]);
    }
}
