//! Two `pmem-csi controller` processes with leader election: only the leader reschedules; when
//! it is killed with SIGKILL, the other takes over and handles new claims.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::Api;
use kube::api::PostParams;
use rustix::process::Signal;
use testenv::objects;
use testenv::wait::until;
use testenv::{NodeSpec, Supervised, TestEnv, TestEnvBuilder};

const DRIVER: &str = "pmem-csi.intel.com";
const SELECTED: &str = "volume.kubernetes.io/selected-node";
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
    objects::selected_for(objects::claim(ns, name, class, "1Gi"), "node-1")
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
    objects::scrape_metrics(port).await
}

#[tokio::test]
async fn only_the_leader_acts_and_a_standby_takes_over() {
    let env = env();
    let client = env.client().await.expect("client");
    let ns = testenv::test_namespace(&client, "leader")
        .await
        .expect("ns");
    let class = format!("{ns}-pmem");
    objects::create_storage_class(&client, &class, DRIVER, "WaitForFirstConsumer")
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
        match objects::events(&client, &ns, "reason=Rescheduled")
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
