//! The pod mutating webhook of two `pmem-csi controller` replicas with `--self-signed`,
//! called by the real kube-apiserver (one webhook entry per replica, `failurePolicy: Fail`, so
//! that any failed call fails a pod creation): the mutation rules, the certificate's life
//! cycle (creation, re-issue of a 60 s leaf, `rotate-ca`) under a steady load, bad input, and
//! the bypass reconciler flagging pods admitted while the webhook was unreachable.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use controllers::test_objects;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Secret};
use kube::Api;
use kube::api::PostParams;
use testenv::wait::until;
use testenv::{Supervised, TestEnv, http_client};
use testenv::{api_calls, controller, metrics};

const DRIVER: &str = "pmem-csi.intel.com";
const RESOURCE: &str = "pmem-csi.intel.com/scheduler";
const SECRET: &str = "pmem-csi-intel-com-controller-secret";
const CONFIGURATION: &str = "pmem-csi-intel-com-hook";
const WAIT: Duration = Duration::from_secs(60);

struct Replica {
    process: Supervised,
    webhook: u16,
    admin: u16,
}

fn start_replica(env: &TestEnv, name: &str, webhook: u16, admin: u16) -> Replica {
    let process = env
        .supervise_controller(
            name,
            &[
                "--leader-election-lease-duration=4s",
                "--leader-election-retry-period=1s",
                &format!("--leader-election-identity={name}"),
                &format!("--admin-address=127.0.0.1:{admin}"),
                &format!("--webhook-address=127.0.0.1:{webhook}"),
                "--self-signed-san=127.0.0.1",
                "--self-signed-leaf-validity=60s",
                "--tls-reload-interval=200ms",
            ],
        )
        .expect("controller");
    Replica {
        process,
        webhook,
        admin,
    }
}

fn marked(pod: &Pod) -> bool {
    let Some(container) = pod.spec.as_ref().and_then(|s| s.containers.first()) else {
        return false;
    };
    let resources = container.resources.clone().unwrap_or_default();
    [resources.requests, resources.limits].iter().all(|m| {
        m.as_ref()
            .and_then(|m| m.get(RESOURCE))
            .map(|q| q.0.as_str())
            == Some("1")
    })
}

async fn create(client: &kube::Client, pod: &Pod) -> Result<Pod, kube::Error> {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    Api::<Pod>::namespaced(client.clone(), &namespace)
        .create(&PostParams::default(), pod)
        .await
}

fn ephemeral_pod(namespace: &str, name: &str, class: &str) -> Pod {
    test_objects::pod(
        namespace,
        name,
        vec![test_objects::generic_ephemeral_volume(
            "scratch", class, "1Gi",
        )],
    )
}

async fn secret_data(client: &kube::Client) -> BTreeMap<String, String> {
    Api::<Secret>::namespaced(client.clone(), "pmem-csi")
        .get_opt(SECRET)
        .await
        .ok()
        .flatten()
        .and_then(|s| s.data)
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).to_string()))
        .collect()
}

fn der_of(pem: &str) -> Vec<u8> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()
        .and_then(Result::ok)
        .map(|c| c.as_ref().to_vec())
        .unwrap_or_default()
}

/// Waits until both replicas present the serving certificate the Secret holds now, trusting
/// only the Secret's current CA; returns that certificate.
async fn served_by_both(client: &kube::Client, replicas: &[&Replica]) -> Vec<u8> {
    until(
        "both replicas to serve the Secret's certificate",
        WAIT,
        || async {
            let data = secret_data(client).await;
            let (Some(ca), Some(leaf)) = (data.get("ca.crt"), data.get("tls.crt")) else {
                return Err("Secret incomplete".to_string());
            };
            let config = http_client::trusting(ca)?;
            let want = der_of(leaf);
            for r in replicas {
                let addr = std::net::SocketAddr::from(([127, 0, 0, 1], r.webhook));
                let reply =
                    http_client::https(addr, config.clone(), "GET", "/pod/mutate", b"").await?;
                if reply.peer_certificate.as_deref() != Some(want.as_slice()) {
                    return Err(format!(
                        "replica on {} serves another certificate",
                        r.webhook
                    ));
                }
            }
            Ok(want.clone())
        },
    )
    .await
    .expect("served")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook() {
    let env = TestEnv::builder().nodes(1).start().await.expect("testenv");
    let client = env.client().await.expect("client");
    for (name, provisioner, mode) in [
        ("pmem-late", DRIVER, "WaitForFirstConsumer"),
        ("pmem-now", DRIVER, "Immediate"),
        ("other-late", "other.example.com", "WaitForFirstConsumer"),
    ] {
        api_calls::create_storage_class(&client, name, provisioner, mode)
            .await
            .expect("class");
    }
    let port = || testenv::ports::free_port().expect("port");
    let a = start_replica(&env, "controller-a", port(), port());
    let b = start_replica(&env, "controller-b", port(), port());
    let hooks = Api::<MutatingWebhookConfiguration>::all(client.clone());
    hooks
        .create(
            &PostParams::default(),
            &controller::pod_webhook_configuration(
                env.manifests(),
                &[
                    (
                        "a.pmem-csi.intel.com",
                        format!("https://127.0.0.1:{}/pod/mutate", a.webhook),
                    ),
                    (
                        "b.pmem-csi.intel.com",
                        format!("https://127.0.0.1:{}/pod/mutate", b.webhook),
                    ),
                ],
                Some("Fail"),
            )
            .expect("the manifests' webhook"),
        )
        .await
        .expect("webhook configuration");

    // A fresh cluster: the leader creates the Secret and injects the CA.
    until("the CA to be injected", WAIT, || async {
        let config = hooks.get(CONFIGURATION).await.map_err(|e| e.to_string())?;
        controller::ca_injected(&config)
            .then_some(())
            .ok_or("no caBundle yet".to_string())
    })
    .await
    .expect("caBundle");
    served_by_both(&client, &[&a, &b]).await;

    let ns = testenv::test_namespace(&client, "webhook")
        .await
        .expect("ns");
    let claims = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns);

    // The first pod may race the injection reaching the apiserver's webhook client.
    until("a pod to be admitted and mutated", WAIT, || async {
        let pod = test_objects::pod_with_inline_volume(&ns, "probe", DRIVER, "1Gi");
        match create(&client, &pod).await {
            Ok(p) if marked(&p) => Ok(()),
            Ok(_) => Err("admitted unchanged".to_string()),
            Err(e) => {
                let _ = Api::<Pod>::namespaced(client.clone(), &ns)
                    .delete("probe", &Default::default())
                    .await;
                Err(e.to_string())
            }
        }
    })
    .await
    .expect("mutated");

    // Mutated: a late-binding claim of ours created right before its pod, a generic ephemeral
    // volume of ours, an inline volume of ours.
    claims
        .create(
            &PostParams::default(),
            &test_objects::claim(&ns, "late", "pmem-late", "1Gi"),
        )
        .await
        .expect("claim");
    let pod = create(
        &client,
        &test_objects::pod_with_claim(&ns, "with-claim", "late"),
    )
    .await
    .expect("pod");
    assert!(
        marked(&pod),
        "claim created right before the pod: {:?}",
        pod.spec
    );
    let pod = create(&client, &ephemeral_pod(&ns, "ephemeral", "pmem-late"))
        .await
        .expect("pod");
    assert!(marked(&pod), "generic ephemeral volume");
    let pod = create(
        &client,
        &test_objects::pod_with_inline_volume(&ns, "inline", DRIVER, "1Gi"),
    )
    .await
    .expect("pod");
    assert!(marked(&pod), "inline volume");

    // Unchanged: opted out, another scheduler, no volumes, another driver's claim, an
    // Immediate claim, a bound claim, another driver's inline volume.
    let mut opted_out = test_objects::pod_with_inline_volume(&ns, "opted-out", DRIVER, "1Gi");
    opted_out.metadata.labels = Some(BTreeMap::from([(
        "pmem-csi.intel.com/webhook".to_string(),
        "ignore".to_string(),
    )]));
    let mut other_scheduler =
        test_objects::pod_with_inline_volume(&ns, "other-scheduler", DRIVER, "1Gi");
    if let Some(spec) = other_scheduler.spec.as_mut() {
        spec.scheduler_name = Some("my-scheduler".into());
    }
    let mut no_volumes = test_objects::pod_with_claim(&ns, "no-volumes", "x");
    if let Some(spec) = no_volumes.spec.as_mut() {
        spec.volumes = None;
    }
    for (claim, class, bound) in [
        ("theirs", "other-late", false),
        ("immediate", "pmem-now", false),
        ("bound", "pmem-late", true),
    ] {
        let mut c = test_objects::claim(&ns, claim, class, "1Gi");
        if bound {
            c = test_objects::bound_to(c, "some-pv");
        }
        claims
            .create(&PostParams::default(), &c)
            .await
            .expect("claim");
    }
    let other_inline =
        test_objects::pod_with_inline_volume(&ns, "other-inline", "other.example.com", "1Gi");
    for pod in [
        opted_out,
        other_scheduler,
        no_volumes,
        test_objects::pod_with_claim(&ns, "their-claim", "theirs"),
        test_objects::pod_with_claim(&ns, "immediate-claim", "immediate"),
        test_objects::pod_with_claim(&ns, "bound-claim", "bound"),
        other_inline,
    ] {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let created = create(&client, &pod).await.expect("pod");
        assert!(!marked(&created), "{name} must be unchanged");
        let resources = created
            .spec
            .and_then(|s| s.containers.into_iter().next())
            .and_then(|c| c.resources);
        assert!(
            resources.is_none_or(|r| r.requests.is_none_or(|m| !m.contains_key(RESOURCE))),
            "{name}"
        );
    }

    // Bad input straight to a replica: 4xx with a message, and it keeps serving.
    let ca = secret_data(&client)
        .await
        .get("ca.crt")
        .cloned()
        .unwrap_or_default();
    let config = http_client::trusting(&ca).expect("CA");
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], a.webhook));
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/webhook/bad");
    let mut cases = 0;
    for entry in std::fs::read_dir(&dir).expect("bad cases") {
        let path = entry.expect("entry").path();
        let body = std::fs::read(&path).expect("read");
        let reply = http_client::https(addr, config.clone(), "POST", "/pod/mutate", &body)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(
            (400..500).contains(&reply.status) && !reply.body.trim().is_empty(),
            "{}: {} {:?}",
            path.display(),
            reply.status,
            reply.body
        );
        cases += 1;
    }
    assert!(cases >= 50, "{cases} bad cases");
    let over_limit = vec![b'{'; 4 << 20];
    let reply = http_client::https(addr, config.clone(), "POST", "/pod/mutate", &over_limit)
        .await
        .expect("over-limit body");
    assert_eq!(reply.status, 413);
    let good = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("testdata/webhook/good/pod-with-pvc.json"),
    )
    .expect("good review");
    let reply = http_client::https(addr, config.clone(), "POST", "/pod/mutate", &good)
        .await
        .expect("good");
    assert_eq!(reply.status, 200, "{}", reply.body);
    let good_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/webhook/good");
    let samples: Vec<Vec<u8>> = std::fs::read_dir(&good_dir)
        .expect("good samples")
        .map(|e| std::fs::read(e.expect("entry").path()).expect("read"))
        .collect();
    for (i, body) in testenv::mutations::mutations(&samples, 200, 13)
        .iter()
        .enumerate()
    {
        let reply = http_client::https(addr, config.clone(), "POST", "/pod/mutate", body)
            .await
            .unwrap_or_else(|e| panic!("mutation {i}: {e}"));
        assert!(
            reply.status == 200 || ((400..500).contains(&reply.status) && !reply.body.is_empty()),
            "mutation {i}: {} {:?}\n{}",
            reply.status,
            reply.body,
            String::from_utf8_lossy(body)
        );
    }

    // Certificates change under a steady load of pod creations; none may fail.
    let failures = Arc::new(AtomicU64::new(0));
    let created = Arc::new(AtomicU64::new(0));
    let stop = tokio_util::sync::CancellationToken::new();
    let load = {
        let (client, ns, failures, created, stop) = (
            client.clone(),
            ns.clone(),
            failures.clone(),
            created.clone(),
            stop.clone(),
        );
        tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.is_cancelled() {
                i += 1;
                let pod =
                    test_objects::pod_with_inline_volume(&ns, &format!("load-{i}"), DRIVER, "1Gi");
                match create(&client, &pod).await {
                    Ok(p) if marked(&p) => {
                        created.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {
                        eprintln!("load-{i}: admitted unmarked");
                        failures.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        eprintln!("load-{i}: {e}");
                        failures.fetch_add(1, Ordering::Relaxed);
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let first = der_of(
        secret_data(&client)
            .await
            .get("tls.crt")
            .map(String::as_str)
            .unwrap_or(""),
    );
    until(
        "the 60 s leaf to be re-issued",
        Duration::from_secs(90),
        || async {
            let now = der_of(
                secret_data(&client)
                    .await
                    .get("tls.crt")
                    .map(String::as_str)
                    .unwrap_or(""),
            );
            (now != first && !now.is_empty())
                .then_some(())
                .ok_or("same leaf".to_string())
        },
    )
    .await
    .expect("re-issued");
    let reissued = served_by_both(&client, &[&a, &b]).await;
    assert_ne!(reissued, first);

    let old_ca = secret_data(&client)
        .await
        .get("ca.crt")
        .cloned()
        .unwrap_or_default();
    let rotate = tokio::process::Command::new(env!("CARGO_BIN_EXE_pmem-csi"))
        .args(["controller", "rotate-ca", "--namespace=pmem-csi"])
        .env("KUBECONFIG", env.admin_kubeconfig())
        .output()
        .await
        .expect("rotate-ca");
    assert!(
        rotate.status.success(),
        "{}",
        String::from_utf8_lossy(&rotate.stderr)
    );
    until("a leaf of the new CA", WAIT, || async {
        let data = secret_data(&client).await;
        let ca = data.get("ca.crt").cloned().unwrap_or_default();
        let leaf = data.get("tls.crt").cloned().unwrap_or_default();
        let ok = ca != old_ca && webhooks::self_signed::is_signed_by(&leaf, &ca).unwrap_or(false);
        ok.then_some(()).ok_or("not yet".to_string())
    })
    .await
    .expect("rotated");
    served_by_both(&client, &[&a, &b]).await;
    let bundle = hooks
        .get(CONFIGURATION)
        .await
        .expect("configuration")
        .webhooks
        .unwrap_or_default()
        .first()
        .and_then(|w| w.client_config.ca_bundle.clone())
        .map(|b| String::from_utf8_lossy(&b.0).to_string())
        .unwrap_or_default();
    assert_eq!(
        bundle.matches("BEGIN CERTIFICATE").count(),
        2,
        "old and new CA during rotation"
    );
    // A few more calls under the new leaf.
    let after = created.load(Ordering::Relaxed);
    until("more pods under the new leaf", WAIT, || async {
        (created.load(Ordering::Relaxed) > after + 5)
            .then_some(())
            .ok_or("waiting".to_string())
    })
    .await
    .expect("load continues");
    stop.cancel();
    load.await.expect("load task");
    assert_eq!(
        failures.load(Ordering::Relaxed),
        0,
        "failed or unmutated pod creations"
    );
    assert!(created.load(Ordering::Relaxed) > 50);

    // An apply that wipes the caBundle is repaired.
    let mut wiped = hooks.get(CONFIGURATION).await.expect("configuration");
    for w in wiped.webhooks.iter_mut().flatten() {
        w.client_config.ca_bundle = None;
    }
    hooks
        .replace(CONFIGURATION, &PostParams::default(), &wiped)
        .await
        .expect("wipe");
    until("the CA to be injected again", WAIT, || async {
        let config = hooks.get(CONFIGURATION).await.map_err(|e| e.to_string())?;
        config
            .webhooks
            .unwrap_or_default()
            .iter()
            .all(|w| w.client_config.ca_bundle.is_some())
            .then_some(())
            .ok_or("wiped".to_string())
    })
    .await
    .expect("re-injected");

    for replica in [&a, &b] {
        let text = metrics::scrape_metrics(replica.admin).await;
        assert!(
            text.contains("controller_runtime_webhook_latency_seconds"),
            "{text}"
        );
    }
    let total: u64 = futures::future::join_all([a.admin, b.admin].map(metrics::scrape_metrics))
        .await
        .iter()
        .map(|t| {
            metrics::metric_value(
                t,
                "controller_runtime_webhook_requests_total{webhook=\"/pod/mutate\",code=\"200\"}",
            )
        })
        .sum();
    assert!(total >= 100, "{total} successful reviews");

    // Webhook unreachable with failurePolicy Ignore: the pod is admitted unmarked; once a
    // controller is back, the bypass reconciler reports it while it is Pending.
    let (a_ports, _) = ((a.webhook, a.admin), b.webhook);
    a.process.stop().await;
    b.process.stop().await;
    let mut ignore = hooks.get(CONFIGURATION).await.expect("configuration");
    for w in ignore.webhooks.iter_mut().flatten() {
        w.failure_policy = Some("Ignore".into());
    }
    hooks
        .replace(CONFIGURATION, &PostParams::default(), &ignore)
        .await
        .expect("Ignore");
    claims
        .create(
            &PostParams::default(),
            &test_objects::claim(&ns, "late-2", "pmem-late", "1Gi"),
        )
        .await
        .expect("claim");
    // No node publishes capacity here, so the pod stays Pending.
    let bypassed = until("a pod to be admitted without the webhook", WAIT, || async {
        match create(
            &client,
            &test_objects::pod_with_claim(&ns, "bypassed", "late-2"),
        )
        .await
        {
            Ok(p) => Ok(p),
            Err(e) => Err(e.to_string()),
        }
    })
    .await
    .expect("admitted");
    assert!(!marked(&bypassed), "the webhook is down");
    let a = start_replica(&env, "controller-a2", a_ports.0, a_ports.1);
    until("the bypass to be reported", WAIT, || async {
        let events = Api::<k8s_openapi::api::core::v1::Event>::namespaced(client.clone(), &ns)
            .list(
                &kube::api::ListParams::default()
                    .fields("involvedObject.name=bypassed,reason=SchedulerExtenderBypassed"),
            )
            .await
            .map_err(|e| e.to_string())?;
        (!events.items.is_empty())
            .then_some(())
            .ok_or("no event yet".to_string())
    })
    .await
    .expect("SchedulerExtenderBypassed");
    assert_eq!(
        metrics::metric_value(
            &metrics::scrape_metrics(a.admin).await,
            "pmem_csi_pods_bypassed "
        ),
        1
    );
    a.process.stop().await;
    let leftovers = env.stop().await;
    assert_eq!(
        leftovers.wait_clean(Duration::from_secs(10)).await,
        Vec::<String>::new()
    );
}
