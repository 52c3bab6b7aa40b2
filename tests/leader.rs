//! Two `pmem-csi controller` processes with leader election: only the leader reschedules; when
//! it is killed with SIGKILL, the other takes over and handles new claims. Then two candidates
//! in-process against the real apiserver: a leader behind a hung connection steps down before
//! anyone takes over, and a 30 s clock skew does not make two leaders.

use std::time::Duration;

use controllers::leader::{LeaderMetrics, LeaderSettings, elect};
use controllers::test_objects;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::Api;
use kube::api::PostParams;
use rustix::process::Signal;
use testenv::wait::until;
use testenv::{NodeSpec, Supervised, TestEnv, TestEnvBuilder};
use testenv::{api_calls, metrics};

const DRIVER: &str = "pmem-csi.intel.com";
use controllers::well_known::SELECTED_NODE as SELECTED;
const LEASE: &str = "pmem-csi-intel-com-rescheduler";
const WAIT: Duration = Duration::from_secs(60);

fn env() -> &'static TestEnv {
    fn configure() -> TestEnvBuilder {
        TestEnv::builder().node(NodeSpec::driverless("node-1"))
    }
    TestEnv::shared(configure)
}

fn controller(env: &TestEnv, identity: &str, port: u16) -> Supervised {
    env.supervise_controller(
        &format!("controller-{identity}"),
        &[
            "--reschedule-grace=1s",
            "--leader-election",
            // Long enough that a renewal stalled on a loaded 2-core machine does not move the
            // lease between the checks below, which read the first holder's metrics.
            "--leader-election-lease-duration=8s",
            "--leader-election-retry-period=500ms",
            &format!("--leader-election-identity={identity}"),
            &format!("--admin-address=127.0.0.1:{port}"),
        ],
    )
    .expect("controller")
}

fn claim(name: &str, ns: &str, class: &str) -> PersistentVolumeClaim {
    test_objects::selected_for(test_objects::claim(ns, name, class, "1Gi"), "node-1")
}

async fn holder(leases: &Api<Lease>) -> Result<String, String> {
    leases
        .get_opt(LEASE)
        .await
        .map_err(|e| e.to_string())?
        .and_then(|l| l.spec?.holder_identity)
        .ok_or_else(|| "no holder yet".to_string())
}

async fn rescheduled(api: &Api<PersistentVolumeClaim>, name: &str) {
    until(&format!("{name} to be rescheduled"), WAIT, || async {
        let c = api.get(name).await.map_err(|e| e.to_string())?;
        match c
            .metadata
            .annotations
            .and_then(|a| a.get(SELECTED).cloned())
        {
            None => Ok(()),
            Some(n) => Err(format!("still selected for {n}")),
        }
    })
    .await
    .expect("rescheduled");
}

async fn status(port: u16) -> String {
    metrics::scrape_metrics(port).await
}

#[tokio::test]
async fn only_the_leader_acts_and_a_standby_takes_over() {
    let env = env();
    let client = env.client().await.expect("client");
    let ns = testenv::test_namespace(&client, "leader")
        .await
        .expect("ns");
    let class = format!("{ns}-pmem");
    api_calls::create_storage_class(&client, &class, DRIVER, "WaitForFirstConsumer")
        .await
        .expect("class");
    let ports = [
        testenv::ports::free_port().expect("port"),
        testenv::ports::free_port().expect("port"),
    ];
    let a = controller(env, "a", ports[0]);
    let b = controller(env, "b", ports[1]);
    let leases = Api::<Lease>::namespaced(client.clone(), "pmem-csi");
    let first = until("a leader", WAIT, || holder(&leases))
        .await
        .expect("leader");
    let (leader, standby, leader_port, standby_port) = if first == "a" {
        (a, b, ports[0], ports[1])
    } else {
        (b, a, ports[1], ports[0])
    };

    let api = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns);
    api.create(&PostParams::default(), &claim("first", &ns, &class))
        .await
        .expect("claim");
    rescheduled(&api, "first").await;
    // The rescheduler patches the claim first and writes its Event after: wait for the Event
    // (and so for the counter, which is bumped before it) before counting.
    let count = until("the Rescheduled event", WAIT, || async {
        match api_calls::events(&client, &ns, "reason=Rescheduled")
            .await
            .map_err(|e| e.to_string())?
            .len()
        {
            0 => Err("no Rescheduled event yet".to_string()),
            n => Ok(n),
        }
    })
    .await
    .expect("event");
    assert_eq!(count, 1, "only the leader patches and reports");
    let unset = "pmem_csi_rescheduler_decisions_total{verdict=\"unset\",reason=\"not-selected-no-csinode-entry\"}";
    let leader_metrics = status(leader_port).await;
    assert!(
        leader_metrics.contains(&format!("{unset} 1")),
        "{leader_metrics}"
    );
    assert!(
        leader_metrics.contains(&format!(
            "leader_election_master_status{{name=\"{LEASE}\"}} 1"
        )),
        "{leader_metrics}"
    );
    let standby_metrics = status(standby_port).await;
    assert!(
        standby_metrics.contains(&format!("{unset} 0")),
        "the standby decided nothing:\n{standby_metrics}"
    );
    assert!(
        standby_metrics.contains(&format!(
            "leader_election_master_status{{name=\"{LEASE}\"}} 0"
        )),
        "{standby_metrics}"
    );

    assert_eq!(
        holder(&leases).await.expect("holder"),
        first,
        "the lease must not have moved while the metrics were read"
    );

    leader.signal(Signal::KILL).expect("SIGKILL the leader");
    // Keep it down: a restart under the same identity would simply renew its own Lease.
    leader.stop().await;
    let second = until("the standby to take over", WAIT, || async {
        match holder(&leases).await? {
            h if h != first => Ok(h),
            h => Err(format!("still held by {h}")),
        }
    })
    .await
    .expect("takeover");
    assert_ne!(second, first);
    api.create(&PostParams::default(), &claim("second", &ns, &class))
        .await
        .expect("claim");
    rescheduled(&api, "second").await;
    standby.stop().await;
}

/// Two in-process candidates on one Lease (3 s lease, 300 ms retry) in namespace `ns`, `a`'s
/// writes going through `a_client`; a monitor that fails if both ever lead at once.
struct Race {
    a: tokio::sync::watch::Receiver<bool>,
    b: tokio::sync::watch::Receiver<bool>,
    shutdown: tokio_util::sync::CancellationToken,
    both_led: tokio::task::JoinHandle<bool>,
}

fn settings(ns: &str, lease: &str, identity: &str, skew_secs: i64) -> LeaderSettings {
    LeaderSettings {
        name: lease.into(),
        namespace: ns.into(),
        identity: identity.into(),
        lease_duration: Duration::from_secs(3),
        retry_period: Duration::from_millis(300),
        wall_clock_skew: k8s_openapi::jiff::SignedDuration::from_secs(skew_secs),
    }
}

async fn race(
    a_client: kube::Client,
    b_client: kube::Client,
    a: LeaderSettings,
    b: LeaderSettings,
) -> Race {
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = LeaderMetrics::register(&mut registry);
    let shutdown = tokio_util::sync::CancellationToken::new();
    let (a_rx, a_task) = elect(a_client, a, metrics.clone(), shutdown.clone());
    tokio::spawn(a_task);
    let mut leads = a_rx.clone();
    tokio::time::timeout(WAIT, leads.wait_for(|l| *l))
        .await
        .expect("a leads in time")
        .expect("a's election runs");
    let (b_rx, b_task) = elect(b_client, b, metrics, shutdown.clone());
    tokio::spawn(b_task);
    let (mut wa, mut wb, stop) = (a_rx.clone(), b_rx.clone(), shutdown.clone());
    let both_led = tokio::spawn(async move {
        loop {
            if *wa.borrow_and_update() && *wb.borrow_and_update() {
                return true;
            }
            tokio::select! {
                r = wa.changed() => if r.is_err() { return false },
                r = wb.changed() => if r.is_err() { return false },
                _ = stop.cancelled() => return false,
            }
        }
    });
    Race {
        a: a_rx,
        b: b_rx,
        shutdown,
        both_led,
    }
}

/// A leader whose apiserver connection hangs (open, silent) steps down at its renew deadline;
/// the standby takes over only after that, never while the old leader still acts.
#[tokio::test]
async fn a_leader_behind_a_hung_connection_steps_down_before_anyone_takes_over() {
    let env = env();
    let client = env.client().await.expect("client");
    let ns = testenv::test_namespace(&client, "leader-hung")
        .await
        .expect("ns");
    let target: std::net::SocketAddr = env
        .server()
        .trim_start_matches("https://")
        .parse()
        .expect("apiserver address");
    let proxy = testenv::proxy::TcpProxy::start(target, Default::default())
        .await
        .expect("proxy");
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = dir.path().join("via-proxy.kubeconfig");
    let admin = std::fs::read_to_string(env.admin_kubeconfig()).expect("admin kubeconfig");
    std::fs::write(
        &kubeconfig,
        admin.replace(&env.server(), &format!("https://{}", proxy.address())),
    )
    .expect("kubeconfig");
    let via_proxy = testenv::control_plane::client_from(&kubeconfig, "a")
        .await
        .expect("client via the proxy");
    let mut r = race(
        via_proxy,
        client.clone(),
        settings(&ns, "hung", "a", 0),
        settings(&ns, "hung", "b", 0),
    )
    .await;
    proxy.hang();
    tokio::time::timeout(WAIT, r.b.wait_for(|l| *l))
        .await
        .expect("b takes over in time")
        .expect("b's election runs");
    assert!(!*r.a.borrow(), "a stepped down");
    r.shutdown.cancel();
    assert!(!r.both_led.await.expect("monitor"), "a and b led at once");
    proxy.cut();
}

/// A leader whose wall clock is 30 s behind (its renewTimes look 30 s old) keeps its Lease:
/// the standby judges by when it saw the Lease change, not by the holder's clock.
#[tokio::test]
async fn a_skewed_clock_does_not_make_two_leaders() {
    let env = env();
    let client = env.client().await.expect("client");
    let ns = testenv::test_namespace(&client, "leader-skew")
        .await
        .expect("ns");
    let r = race(
        client.clone(),
        client.clone(),
        settings(&ns, "skew", "a", -30),
        settings(&ns, "skew", "b", 0),
    )
    .await;
    // Three leases' worth of renewals by a, each seen as a change.
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    let seen = std::cell::RefCell::new(std::collections::BTreeSet::new());
    until("a to renew 30 times", WAIT, || async {
        let renewed = leases
            .get("skew")
            .await
            .map_err(|e| e.to_string())?
            .spec
            .and_then(|s| s.renew_time)
            .map(|t| t.0.to_string())
            .unwrap_or_default();
        let mut seen = seen.borrow_mut();
        seen.insert(renewed);
        if seen.len() >= 30 {
            Ok(())
        } else {
            Err(format!("{} renewals seen", seen.len()))
        }
    })
    .await
    .expect("renewals");
    assert!(*r.a.borrow(), "a still leads");
    assert!(!*r.b.borrow(), "b stands by");
    r.shutdown.cancel();
    assert!(!r.both_led.await.expect("monitor"), "a and b led at once");
}
