//! [`Explanation`] in plain words, for a terminal. Pure.

use std::fmt::Write;

use extender::fit::format_bytes;

use crate::explanation::{Explanation, Finding, NodeReport, VolumeReport, VolumeState};

/// The explanation as text, a paragraph per section.
pub fn render(e: &Explanation) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{}", headline(e));
    if !e.findings.is_empty() {
        let _ = writeln!(out, "\nWhy:");
        for finding in &e.findings {
            let _ = writeln!(out, "  - {}", sentence(finding));
        }
    } else if e.node.is_none() && e.phase == "Pending" {
        let _ = writeln!(
            out,
            "\nNothing of the PMEM driver holds the pod back; see the scheduler's message and \
             the events below."
        );
    }
    if let Some(message) = &e.scheduler_message {
        let _ = writeln!(out, "\nThe scheduler says: {}", message.trim());
    }
    if !e.volumes.is_empty() {
        let _ = writeln!(out, "\nVolumes:");
        for v in &e.volumes {
            let _ = writeln!(out, "  {}", volume_line(v));
        }
    }
    let shown: Vec<&NodeReport> = e.nodes.iter().filter(|n| worth_showing(e, n)).collect();
    if !shown.is_empty() {
        let _ = writeln!(out, "\nNodes:");
        for n in shown {
            let _ = writeln!(out, "  {}", node_line(n));
        }
    }
    let _ = writeln!(out, "\nExtender: {}", extender_line(e));
    if !e.events.is_empty() {
        let _ = writeln!(out, "\nRecent events:");
        for ev in &e.events {
            let count = if ev.count > 1 {
                format!(" (×{})", ev.count)
            } else {
                String::new()
            };
            let _ = writeln!(
                out,
                "  {} {} {}{count}: {}",
                ev.object,
                ev.type_,
                ev.reason,
                ev.message.trim()
            );
        }
    }
    out
}

fn headline(e: &Explanation) -> String {
    match (&e.node, e.phase.as_str()) {
        (Some(node), "Running") => format!("Pod {} is Running on node {node}.", e.pod),
        (Some(node), phase) => format!(
            "Pod {} is scheduled to node {node} and {}.",
            e.pod,
            if phase == "Pending" {
                "is starting (Pending)".to_string()
            } else {
                format!("is {phase}")
            }
        ),
        (None, "Pending") => format!("Pod {} is Pending: no node has been chosen for it.", e.pod),
        (None, phase) => format!("Pod {} is {phase}.", e.pod),
    }
}

/// One finding as a sentence.
pub fn sentence(f: &Finding) -> String {
    match f {
        Finding::ClaimMissing { claim } => {
            format!("claim {claim} does not exist: create it, or fix the pod's claimName.")
        }
        Finding::ClassMissing { claim, class } => {
            format!("claim {claim} names StorageClass {class}, which does not exist.")
        }
        Finding::SelectedNodeWithoutDriver {
            claim,
            node,
            reason,
        } => format!(
            "claim {claim} waits for node {node}, where the PMEM driver does not run ({reason}); \
             the controller's rescheduler lets the scheduler choose again after its grace."
        ),
        Finding::WaitingForProvisioning {
            claim,
            node,
            last_error,
        } => match last_error {
            Some(error) => format!(
                "claim {claim} is being provisioned on node {node}; the last attempt failed: {}",
                error.trim()
            ),
            None => format!("claim {claim} is being provisioned on node {node}."),
        },
        Finding::NoCapacityObject { class, nodes } if nodes.is_empty() => format!(
            "no node has published capacity for StorageClass {class} yet (no \
             CSIStorageCapacity object): the scheduler finds no node for its volumes."
        ),
        Finding::NoCapacityObject { class, nodes } => format!(
            "node{} {} {} not published capacity for StorageClass {class} yet.",
            if nodes.len() == 1 { "" } else { "s" },
            nodes.join(", "),
            if nodes.len() == 1 { "has" } else { "have" },
        ),
        Finding::NoNodeWithRoom {
            volumes,
            bytes,
            largest_pool,
        } => format!(
            "no node has room: volume{} {} ({}) fit{} on no node where the driver runs; the \
             largest free pool is {}.",
            if volumes.len() == 1 { "" } else { "s" },
            volumes.join(", "),
            format_bytes(*bytes),
            if volumes.len() == 1 { "s" } else { "" },
            format_bytes(*largest_pool),
        ),
        Finding::DoNotFitTogether {
            volumes,
            bytes,
            fragmented,
        } => {
            let mut s = format!(
                "each of the {volumes} volumes fits alone on some node, but no node has room \
                 for all of them together ({})",
                format_bytes(*bytes)
            );
            if fragmented.is_empty() {
                s.push('.');
            } else {
                let _ = write!(
                    s,
                    "; {} {} enough free bytes in total, but split across pools too small \
                     for them.",
                    fragmented.join(", "),
                    if fragmented.len() == 1 { "has" } else { "have" }
                );
            }
            s
        }
        Finding::ExtenderRefuses { nodes } => format!(
            "the published pools have room, but the scheduler extender refuses every node: {}.",
            nodes
                .iter()
                .map(|(n, r)| format!("{n}: {r}"))
                .collect::<Vec<_>>()
                .join("; ")
        ),
        Finding::ExtenderBehind { unseen } => format!(
            "the scheduler extender has not seen {unseen} yet; the scheduler retries the pod."
        ),
    }
}

fn volume_line(v: &VolumeReport) -> String {
    let mut parts = Vec::new();
    if let Some(claim) = &v.claim {
        parts.push(format!("claim {claim}"));
    }
    if let Some(class) = &v.class {
        parts.push(format!("class {class}"));
    }
    if let Some(bytes) = v.requested {
        parts.push(format_bytes(bytes));
    }
    let state = match v.state {
        VolumeState::Bound => match (&v.pv, &v.node, v.capacity) {
            (Some(pv), Some(node), Some(cap)) => {
                format!("bound to PV {pv} on node {node} ({})", format_bytes(cap))
            }
            (Some(pv), Some(node), None) => format!("bound to PV {pv} on node {node}"),
            (Some(pv), None, _) => format!("bound to PV {pv}"),
            _ => "bound".to_string(),
        },
        VolumeState::Provisioning => format!(
            "being provisioned on node {}",
            v.selected_node.as_deref().unwrap_or("?")
        ),
        VolumeState::Unscheduled => "waits for the scheduler to choose a node".to_string(),
        VolumeState::ClaimMissing if v.kind == "ephemeral" => {
            "claim not created yet (the ephemeral volume controller creates it)".to_string()
        }
        VolumeState::ClaimMissing => "claim missing".to_string(),
        VolumeState::ClassMissing => "class missing".to_string(),
        VolumeState::Inline => match &v.node {
            Some(node) => format!("CSI inline volume on node {node}"),
            None => "CSI inline volume, made when the pod starts on its node".to_string(),
        },
        VolumeState::NotOurs => "not a PMEM volume".to_string(),
    };
    parts.push(state);
    let mut line = format!("{}: {}", v.volume, parts.join(", "));
    if let Some(error) = &v.last_error {
        let _ = write!(line, "; last error: {}", error.trim());
    }
    line
}

/// Once the pod is scheduled only its node and its volumes' nodes matter; before, every node
/// that could take it, and those holding something of it.
fn worth_showing(e: &Explanation, n: &NodeReport) -> bool {
    let holds = !n.volumes.is_empty() || n.reserved_for_pod.is_some();
    match &e.node {
        Some(node) => holds || node == &n.node,
        None => holds || n.driver_running || !n.published_classes.is_empty(),
    }
}

fn node_line(n: &NodeReport) -> String {
    let mut line = format!("{}: ", n.node);
    match &n.driverless_reason {
        Some(reason) => {
            let _ = write!(line, "PMEM driver not running ({reason})");
        }
        None => line.push_str("driver runs"),
    }
    if n.published_classes.is_empty() {
        line.push_str("; no capacity published");
    } else {
        let _ = write!(
            line,
            "; free pools {}",
            n.pools
                .iter()
                .map(|p| format_bytes(*p))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if let Some(together) = n.fits_together {
        let alone: Vec<String> = n
            .alone
            .iter()
            .map(|a| {
                format!(
                    "{} {} {}",
                    a.volume,
                    format_bytes(a.bytes),
                    if a.fits { "fits" } else { "does not fit" }
                )
            })
            .collect();
        if n.alone.len() > 1 {
            let _ = write!(
                line,
                "; alone: {}; together they {}",
                alone.join(", "),
                if together { "fit" } else { "do not fit" }
            );
        } else {
            let _ = write!(line, "; {}", alone.join(", "));
        }
    }
    if let Some(x) = &n.extender {
        match (&x.reason, x.free_after) {
            (Some(reason), _) => {
                let _ = write!(line, "; extender: {reason}");
            }
            (None, Some(free)) => {
                let _ = write!(line, "; extender: fits, {} left after", format_bytes(free));
            }
            (None, None) => {}
        }
    }
    if let Some(bytes) = n.reserved_for_pod {
        let _ = write!(line, "; {} reserved for this pod", format_bytes(bytes));
    }
    if !n.volumes.is_empty() {
        let _ = write!(line, "; holds {}", n.volumes.join(", "));
    }
    line
}

fn extender_line(e: &Explanation) -> String {
    match e.extender.status.as_str() {
        "answered" if e.extender.reserved.is_empty() => {
            "answered; it holds no reservation for this pod.".to_string()
        }
        "answered" => format!(
            "answered; it holds a reservation for this pod{}: {}.",
            e.extender
                .reservation_age_seconds
                .map(|s| format!(" (made {s}s ago)"))
                .unwrap_or_default(),
            e.extender
                .reserved
                .iter()
                .map(|r| format!("{} on {}", format_bytes(r.bytes), r.node))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        "not_installed" => {
            "not installed (no scheduler extender pod in the driver's namespace); the \
             scheduler relies on capacity tracking alone."
                .to_string()
        }
        _ => format!(
            "not reachable ({}); the rest of this explanation does without its view.",
            e.extender.message.as_deref().unwrap_or("no reason given")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentences_table() {
        for (finding, want) in [
            (
                Finding::NoNodeWithRoom {
                    volumes: vec!["data".into()],
                    bytes: 2 << 30,
                    largest_pool: 1 << 30,
                },
                "no node has room: volume data (2.0GiB) fits on no node where the driver runs; the largest free pool is 1.0GiB.",
            ),
            (
                Finding::NoCapacityObject {
                    class: "fresh".into(),
                    nodes: vec![],
                },
                "no node has published capacity for StorageClass fresh yet (no CSIStorageCapacity object): the scheduler finds no node for its volumes.",
            ),
            (
                Finding::NoCapacityObject {
                    class: "pmem".into(),
                    nodes: vec!["n2".into()],
                },
                "node n2 has not published capacity for StorageClass pmem yet.",
            ),
            (
                Finding::WaitingForProvisioning {
                    claim: "ns/a".into(),
                    node: "n1".into(),
                    last_error: Some("boom ".into()),
                },
                "claim ns/a is being provisioned on node n1; the last attempt failed: boom",
            ),
        ] {
            assert_eq!(sentence(&finding), want);
        }
    }
}
