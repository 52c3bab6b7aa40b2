//! Heartbeat mode: a controller started with `--heartbeat-grace` reschedules claims of a node
//! whose driver stopped renewing its Lease, even though the Node, its labels and its CSINode
//! entry remain; a driver restarted within the grace keeps its claims.

use std::sync::OnceLock;
use std::time::Duration;

use controllers::test_objects;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::Api;
use kube::api::PostParams;
use testenv::api_calls;
use testenv::node_driver::NodeDriverDirs;
use testenv::node_processes::DriverOptions;
use testenv::wait::until;
use testenv::{NodeSpec, Supervised, TestEnv, TestEnvBuilder};

const DRIVER: &str = "pmem-csi.intel.com";
use controllers::well_known::SELECTED_NODE as SELECTED;
const WAIT: Duration = Duration::from_secs(60);

struct Fixture {
    env: &'static TestEnv,
    _controller: Supervised,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        fn configure() -> TestEnvBuilder {
            TestEnv::builder().nodes(1)
        }
        let env = TestEnv::shared(configure);
        let controller = env
            .supervise_controller(
                "controller",
                // The restart below must fit in the Lease's 3 s + this grace + the 2 s
                // reschedule grace: 9 s leaves room for a slow stop and start under load.
                &["--reschedule-grace=2s", "--heartbeat-grace=4s"],
            )
            .expect("controller");
        Fixture {
            env,
            _controller: controller,
        }
    })
}

fn node_driver(env: &TestEnv, node: &str, dirs: &NodeDriverDirs) -> Supervised {
    env.supervise_node_driver(node, dirs, &DriverOptions::fake("1Gi", &[]))
        .expect("node driver")
}

fn claim(name: &str, ns: &str, class: &str, node: &str) -> PersistentVolumeClaim {
    test_objects::selected_for(test_objects::claim(ns, name, class, "1Gi"), node)
}

async fn selected(api: &Api<PersistentVolumeClaim>, name: &str) -> Option<String> {
    api_calls::selected_node(api, name).await
}

async fn wait_unselected(api: &Api<PersistentVolumeClaim>, name: &str) {
    until(&format!("{name} to lose {SELECTED}"), WAIT, || async {
        match selected(api, name).await {
            None => Ok(()),
            Some(n) => Err(format!("still selected for {n}")),
        }
    })
    .await
    .expect("rescheduled");
}

#[tokio::test]
async fn stopped_driver_loses_its_claims_restarted_one_keeps_them() {
    let f = fixture();
    let client = f.env.client().await.expect("client");
    let ns = testenv::test_namespace(&client, "heartbeat")
        .await
        .expect("ns");
    let class = format!("{ns}-pmem");
    api_calls::create_storage_class(&client, &class, DRIVER, "WaitForFirstConsumer")
        .await
        .expect("class");
    let root = tempfile::tempdir().expect("tempdir");
    let dirs = NodeDriverDirs::under(root.path());
    let driver = node_driver(f.env, "node-1", &dirs);
    let leases = Api::<Lease>::namespaced(client.clone(), "pmem-csi");
    until("the heartbeat Lease", WAIT, || async {
        leases
            .get_opt("pmem-csi-intel-com-node-node-1")
            .await
            .map_err(|e| e.to_string())?
            .map(|_| ())
            .ok_or_else(|| "no lease yet".to_string())
    })
    .await
    .expect("heartbeat");

    let api = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns);
    let pp = PostParams::default();
    api.create(&pp, &claim("kept", &ns, &class, "node-1"))
        .await
        .expect("claim");

    // A restart within the grace: the Lease never expires.
    driver.stop().await;
    let driver = node_driver(f.env, "node-1", &dirs);
    // A node with labels and CSINode entry but no heartbeat at all, created now: its claim
    // is rescheduled one grace from now, by which time the restart's gap must not count.
    let silent = format!("{ns}-silent");
    NodeSpec::with_driver(&silent)
        .create(&client, DRIVER)
        .await
        .expect("node");
    api.create(&pp, &claim("silent", &ns, &class, &silent))
        .await
        .expect("claim");
    wait_unselected(&api, "silent").await;
    assert_eq!(
        selected(&api, "kept").await.as_deref(),
        Some("node-1"),
        "restarted within the grace"
    );

    // Stopped for good: the Lease expires and the claim is rescheduled.
    driver.stop().await;
    wait_unselected(&api, "kept").await;
}

/// The heartbeat has its own client budget: a node whose shared client is starved (here by a
/// budget of one request per 10 s, as a node busy publishing and sweeping would starve it)
/// still renews its Lease every period, never letting it lapse.
#[tokio::test]
async fn a_starved_node_client_does_not_starve_the_heartbeat() {
    let f = fixture();
    let client = f.env.client().await.expect("client");
    // The driver's token is bound to its Node, as on a cluster, so the Node must exist.
    NodeSpec::with_driver("starved")
        .create(&client, DRIVER)
        .await
        .expect("node");
    let root = tempfile::tempdir().expect("tempdir");
    let dirs = NodeDriverDirs::under(root.path());
    let driver = f
        .env
        .supervise_node_driver(
            "starved",
            &dirs,
            &DriverOptions::fake(
                "1Gi",
                &[
                    "--kube-api-qps=0.1",
                    "--kube-api-burst=1",
                    "--heartbeat-period=2s",
                ],
            ),
        )
        .expect("node driver");
    let leases = Api::<Lease>::namespaced(client.clone(), "pmem-csi");
    let renewals = std::sync::Arc::new(std::sync::Mutex::new(
        Vec::<k8s_openapi::jiff::Timestamp>::new(),
    ));
    let seen = until("five renewals of the heartbeat", WAIT, || {
        let (leases, renewals) = (leases.clone(), std::sync::Arc::clone(&renewals));
        async move {
            let lease = leases
                .get_opt("pmem-csi-intel-com-node-starved")
                .await
                .map_err(|e| e.to_string())?;
            let mut renewals = renewals.lock().map_err(|e| e.to_string())?;
            if let Some(t) = lease.and_then(|l| l.spec?.renew_time)
                && renewals.last() != Some(&t.0)
            {
                renewals.push(t.0);
            }
            (renewals.len() >= 5)
                .then_some(())
                .ok_or(format!("{} renewals", renewals.len()))
        }
    })
    .await;
    driver.stop().await;
    seen.expect("renewals");
    let renewals = renewals.lock().expect("renewals").clone();
    // The Lease lasts three periods (6 s): a gap that long would have let it lapse.
    let gaps: Vec<Duration> = renewals
        .windows(2)
        .map(|w| Duration::try_from(w[1] - w[0]).unwrap_or(Duration::MAX))
        .collect();
    assert!(
        gaps.iter().all(|g| *g < Duration::from_secs(6)),
        "renewal gaps: {gaps:?}"
    );
}
