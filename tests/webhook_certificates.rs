//! The `--self-signed` certificates of two `pmem-csi controller` replicas under a steady load of
//! pod creations (one every 100 ms, through a webhook configuration with `failurePolicy: Fail`
//! and one entry per replica, so that any failed call fails a creation, and a pod admitted
//! unmutated counts as a failure too): the Secret deleted, corrupted, its CA key lost, the CA
//! rotated and renewed before it expires. Every admission must succeed and be mutated.
//!
//! Besides the load, a recorder watches the Secret and the configuration and replays their
//! changes in resourceVersion order: at no point may the Secret hold (hence replicas serve) a
//! leaf whose CA the `caBundle` lacks. Failures of the phases are collected and reported
//! together, so that one run shows every defect.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use controllers::test_objects;
use futures::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use kube::runtime::watcher;
use testenv::controller;
use testenv::wait::until;
use testenv::{Supervised, TestEnv, http_client};
use webhooks::self_signed;

const DRIVER: &str = "pmem-csi.intel.com";
const RESOURCE: &str = "pmem-csi.intel.com/scheduler";
const SECRET: &str = "pmem-csi-intel-com-controller-secret";
const CONFIGURATION: &str = "pmem-csi-intel-com-hook";
const WAIT: Duration = Duration::from_secs(60);

struct Replica {
    process: Supervised,
    webhook: u16,
}

fn start_replica(env: &TestEnv, name: &str, webhook: u16, ca_validity: &str) -> Replica {
    let admin = testenv::ports::free_port().expect("port");
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
                // Checked every 2 s; replaced CAs kept 10 s after the new leaf is out.
                "--self-signed-leaf-validity=60s",
                &format!("--self-signed-ca-validity={ca_validity}"),
            ],
        )
        .expect("controller");
    Replica { process, webhook }
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

fn strings(data: &BTreeMap<String, ByteString>) -> BTreeMap<String, String> {
    data.iter()
        .map(|(k, v)| (k.clone(), String::from_utf8_lossy(&v.0).to_string()))
        .collect()
}

async fn secret_data(client: &kube::Client) -> BTreeMap<String, String> {
    Api::<Secret>::namespaced(client.clone(), "pmem-csi")
        .get_opt(SECRET)
        .await
        .ok()
        .flatten()
        .and_then(|s| s.data)
        .map(|d| strings(&d))
        .unwrap_or_default()
}

/// The PEM blocks of a bundle.
fn certs(bundle: &str) -> Vec<String> {
    const END: &str = "-----END CERTIFICATE-----";
    bundle
        .split_inclusive(END)
        .filter(|b| b.contains(END))
        .map(|b| b.trim_start().to_owned())
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

async fn bundle(client: &kube::Client) -> String {
    Api::<MutatingWebhookConfiguration>::all(client.clone())
        .get(CONFIGURATION)
        .await
        .ok()
        .and_then(|c| c.webhooks)
        .unwrap_or_default()
        .first()
        .and_then(|w| w.client_config.ca_bundle.clone())
        .map(|b| String::from_utf8_lossy(&b.0).to_string())
        .unwrap_or_default()
}

/// Whether the Secret is intact: a CA whose key signs, and a leaf of that CA.
fn intact(data: &BTreeMap<String, String>) -> Result<(), String> {
    let (Some(ca), Some(key), Some(leaf)) =
        (data.get("ca.crt"), data.get("ca.key"), data.get("tls.crt"))
    else {
        return Err("Secret incomplete".into());
    };
    let ca_pem = self_signed::CaPem {
        cert_pem: ca.clone(),
        key_pem: key.clone(),
    };
    let names = self_signed::SubjectNames::for_services(&["probe"], "ns", &[]);
    // rcgen signs with whatever key it is given, so the signature is checked: a key of
    // another CA yields leaves nobody can verify.
    let probe = self_signed::issue_leaf(
        &ca_pem,
        &names,
        webhooks::OffsetDateTime::now_utc(),
        self_signed::LEAF_VALIDITY,
    )
    .map_err(|e| format!("the Secret's CA cannot sign: {e}"))?;
    if !self_signed::is_signed_by(&probe.cert_pem, ca).unwrap_or(false) {
        return Err("the Secret's CA key does not belong to its certificate".into());
    }
    if !self_signed::is_signed_by(leaf, ca).unwrap_or(false) {
        return Err("the Secret's leaf is not signed by its CA".into());
    }
    Ok(())
}

/// Waits until both replicas present the serving certificate the Secret holds now, trusting
/// only the Secret's current CA.
async fn served_by_both(client: &kube::Client, replicas: &[&Replica]) -> Result<(), String> {
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
            Ok(())
        },
    )
    .await
    .map_err(|e| e.to_string())
}

/// Pods created one every 100 ms until stopped.
struct Load {
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
    created: Arc<AtomicU64>,
    failures: Arc<Mutex<Vec<String>>>,
}

impl Load {
    fn start(client: &kube::Client, ns: &str, prefix: &str) -> Self {
        let stop = tokio_util::sync::CancellationToken::new();
        let created = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let (client, ns, prefix) = (client.clone(), ns.to_owned(), prefix.to_owned());
        let task = tokio::spawn({
            let (stop, created, failures) = (stop.clone(), created.clone(), failures.clone());
            async move {
                let pods = Api::<Pod>::namespaced(client, &ns);
                let mut i = 0u64;
                while !stop.is_cancelled() {
                    i += 1;
                    let name = format!("{prefix}-{i}");
                    let pod = test_objects::pod_with_inline_volume(&ns, &name, DRIVER, "1Gi");
                    let problem = match pods.create(&PostParams::default(), &pod).await {
                        Ok(p) if marked(&p) => None,
                        Ok(_) => Some(format!("{name}: admitted unmutated")),
                        Err(e) => Some(format!("{name}: {e}")),
                    };
                    match problem {
                        None => {
                            created.fetch_add(1, Ordering::Relaxed);
                        }
                        Some(p) => {
                            eprintln!("{p}");
                            failures.lock().expect("failures").push(p);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        });
        Self {
            stop,
            task,
            created,
            failures,
        }
    }

    async fn finish(self) -> (u64, Vec<String>) {
        self.stop.cancel();
        self.task.await.expect("load task");
        let failures = self.failures.lock().expect("failures").clone();
        (self.created.load(Ordering::Relaxed), failures)
    }
}

/// A change of the Secret or of the configuration's bundle.
#[derive(Debug, Clone)]
enum Change {
    /// The Secret's leaf (`None`: deleted or no readable leaf; replicas keep theirs).
    Leaf(Option<String>),
    /// The bundle of the first webhook.
    Bundle(String),
}

/// Records every change of the Secret and the configuration with its resourceVersion.
struct Recorder {
    changes: Arc<Mutex<Vec<(u64, Change)>>>,
    stop: tokio_util::sync::CancellationToken,
}

impl Recorder {
    fn start(client: &kube::Client) -> Self {
        let changes = Arc::new(Mutex::new(Vec::new()));
        let stop = tokio_util::sync::CancellationToken::new();
        let rv = |m: &kube::api::ObjectMeta| {
            m.resource_version
                .as_deref()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        let secrets = Api::<Secret>::namespaced(client.clone(), "pmem-csi");
        let config = watcher::Config::default().fields(&format!("metadata.name={SECRET}"));
        let (c, s) = (changes.clone(), stop.clone());
        tokio::spawn(async move {
            let mut events = std::pin::pin!(watcher::watcher(secrets, config));
            loop {
                let event = tokio::select! {
                    e = events.next() => e,
                    _ = s.cancelled() => return,
                };
                let change = match event {
                    Some(Ok(watcher::Event::Apply(x) | watcher::Event::InitApply(x))) => {
                        let data = strings(&x.data.clone().unwrap_or_default());
                        let leaf = data
                            .get("tls.crt")
                            .filter(|l| self_signed::parse_cert(l, "leaf").is_ok())
                            .cloned();
                        (rv(&x.metadata), Change::Leaf(leaf))
                    }
                    Some(Ok(watcher::Event::Delete(x))) => (rv(&x.metadata), Change::Leaf(None)),
                    Some(_) => continue,
                    None => return,
                };
                c.lock().expect("changes").push(change);
            }
        });
        let hooks = Api::<MutatingWebhookConfiguration>::all(client.clone());
        let config = watcher::Config::default().fields(&format!("metadata.name={CONFIGURATION}"));
        let (c, s) = (changes.clone(), stop.clone());
        tokio::spawn(async move {
            let mut events = std::pin::pin!(watcher::watcher(hooks, config));
            loop {
                let event = tokio::select! {
                    e = events.next() => e,
                    _ = s.cancelled() => return,
                };
                let change = match event {
                    Some(Ok(watcher::Event::Apply(x) | watcher::Event::InitApply(x))) => {
                        let bundle = x
                            .webhooks
                            .unwrap_or_default()
                            .first()
                            .and_then(|w| w.client_config.ca_bundle.clone())
                            .map(|b| String::from_utf8_lossy(&b.0).to_string())
                            .unwrap_or_default();
                        (rv(&x.metadata), Change::Bundle(bundle))
                    }
                    Some(_) => continue,
                    None => return,
                };
                c.lock().expect("changes").push(change);
            }
        });
        Self { changes, stop }
    }

    /// Replays the changes in order; returns every moment at which replicas would serve a
    /// leaf whose CA the bundle lacks, and every bundle seen.
    fn replay(&self) -> (Vec<String>, Vec<String>) {
        self.stop.cancel();
        let mut changes = self.changes.lock().expect("changes").clone();
        changes.sort_by_key(|(rv, _)| *rv);
        let (mut leaf, mut bundle) = (None::<String>, String::new());
        let (mut violations, mut bundles) = (Vec::new(), Vec::new());
        for (rv, change) in changes {
            match change {
                // Replicas keep serving their leaf when the Secret loses it.
                Change::Leaf(l) => leaf = l.or(leaf),
                Change::Bundle(b) => {
                    bundles.push(b.clone());
                    bundle = b;
                }
            }
            let cas = certs(&bundle);
            if let Some(l) = &leaf
                && !cas.is_empty()
                && !cas
                    .iter()
                    .any(|ca| self_signed::is_signed_by(l, ca).unwrap_or(false))
            {
                violations.push(format!(
                    "at resourceVersion {rv} replicas serve a leaf whose CA is not among the {} in the caBundle",
                    cas.len()
                ));
            }
        }
        (violations, bundles)
    }
}

async fn setup(ca_validity: &str) -> (TestEnv, kube::Client, Replica, Replica, String) {
    let env = TestEnv::builder().nodes(1).start().await.expect("testenv");
    let client = env.client().await.expect("client");
    let port = || testenv::ports::free_port().expect("port");
    let a = start_replica(&env, "controller-a", port(), ca_validity);
    let b = start_replica(&env, "controller-b", port(), ca_validity);
    Api::<MutatingWebhookConfiguration>::all(client.clone())
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
    served_by_both(&client, &[&a, &b]).await.expect("served");
    let ns = testenv::test_namespace(&client, "certs").await.expect("ns");
    // The first pod may race the injection reaching the apiserver's webhook client.
    until("a pod to be admitted and mutated", WAIT, || async {
        let pod = test_objects::pod_with_inline_volume(&ns, "probe", DRIVER, "1Gi");
        match Api::<Pod>::namespaced(client.clone(), &ns)
            .create(&PostParams::default(), &pod)
            .await
        {
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
    (env, client, a, b, ns)
}

async fn replace_secret_data(client: &kube::Client, data: BTreeMap<String, String>) {
    let secrets = Api::<Secret>::namespaced(client.clone(), "pmem-csi");
    let mut secret = secrets.get(SECRET).await.expect("Secret");
    secret.data = Some(
        data.into_iter()
            .map(|(k, v)| (k, ByteString(v.into_bytes())))
            .collect(),
    );
    secrets
        .replace(SECRET, &PostParams::default(), &secret)
        .await
        .expect("replace Secret");
}

/// Deleted Secret, garbage in every key, the CA key replaced by another, `rotate-ca`, and the
/// CA key lost with every replica restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secret_repaired_and_ca_rotated_without_failed_admission() {
    let (env, client, a, b, ns) = setup("87600h").await;
    let recorder = Recorder::start(&client);
    let mut problems: Vec<String> = Vec::new();
    let load = Load::start(&client, &ns, "load");
    let ca0 = secret_data(&client)
        .await
        .get("ca.crt")
        .cloned()
        .unwrap_or_default();

    // Deleted: written back with the same CA (every replica remembers its key).
    let started = std::time::Instant::now();
    Api::<Secret>::namespaced(client.clone(), "pmem-csi")
        .delete(SECRET, &DeleteParams::default())
        .await
        .expect("delete");
    if let Err(e) = until("the deleted Secret to be written back", WAIT, || async {
        intact(&secret_data(&client).await)
    })
    .await
    {
        problems.push(format!("deleted: {e}"));
    }
    eprintln!("deleted Secret repaired after {:?}", started.elapsed());
    if der_of(secret_data(&client).await.get("ca.crt").map_or("", |s| s)) != der_of(&ca0) {
        problems.push(
            "deleted: the repaired Secret holds another CA although the key was known".into(),
        );
    }

    // Garbage in every key.
    let started = std::time::Instant::now();
    let garbage = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
    replace_secret_data(
        &client,
        ["ca.crt", "ca.key", "tls.crt", "tls.key", "ca-previous.crt"]
            .into_iter()
            .map(|k| (k.to_owned(), garbage.to_owned()))
            .collect(),
    )
    .await;
    if let Err(e) = until("the garbage Secret to be repaired", WAIT, || async {
        intact(&secret_data(&client).await)
    })
    .await
    {
        problems.push(format!("garbage: {e}"));
    }
    eprintln!("garbage Secret repaired after {:?}", started.elapsed());

    // The CA key replaced by another CA's: the certificate still parses, but signs nothing.
    let started = std::time::Instant::now();
    let mut data = secret_data(&client).await;
    let other = self_signed::issue_ca(
        "other",
        webhooks::OffsetDateTime::now_utc(),
        self_signed::LEAF_VALIDITY,
    )
    .expect("other CA");
    data.insert("ca.key".into(), other.key_pem.clone());
    replace_secret_data(&client, data).await;
    if let Err(e) = until("the wrong CA key to be repaired", WAIT, || async {
        intact(&secret_data(&client).await)
    })
    .await
    {
        problems.push(format!("wrong key: {e}"));
    }
    eprintln!("wrong CA key repaired after {:?}", started.elapsed());
    if let Err(e) = served_by_both(&client, &[&a, &b]).await {
        problems.push(format!("after the repairs: {e}"));
    }

    // rotate-ca: both CAs trusted while the leaf changes, the old one dropped afterwards.
    let started = std::time::Instant::now();
    let rotate = tokio::process::Command::new(env!("CARGO_BIN_EXE_pmem-csi"))
        .args(["controller", "rotate-ca", "--namespace=pmem-csi"])
        .env("KUBECONFIG", env.admin_kubeconfig())
        .output()
        .await
        .expect("rotate-ca");
    if !rotate.status.success() {
        problems.push(format!(
            "rotate-ca: {}",
            String::from_utf8_lossy(&rotate.stderr)
                .lines()
                .last()
                .unwrap_or("")
        ));
    }
    let new_ca = secret_data(&client)
        .await
        .get("ca.crt")
        .cloned()
        .unwrap_or_default();
    if let Err(e) = until("a leaf of the new CA, the old CA dropped", WAIT, || async {
        let data = secret_data(&client).await;
        let leaf = data.get("tls.crt").cloned().unwrap_or_default();
        let cas = certs(&bundle(&client).await);
        let ok = self_signed::is_signed_by(&leaf, &new_ca).unwrap_or(false)
            && cas.len() == 1
            && der_of(&cas[0]) == der_of(&new_ca);
        ok.then_some(()).ok_or(format!(
            "leaf of the new CA and {} CAs in the bundle",
            cas.len()
        ))
    })
    .await
    {
        problems.push(format!("rotate-ca: {e}"));
    }
    eprintln!(
        "rotation done (old CA dropped) after {:?}",
        started.elapsed()
    );
    if let Err(e) = served_by_both(&client, &[&a, &b]).await {
        problems.push(format!("after rotate-ca: {e}"));
    }
    let (created, mut failures) = load.finish().await;
    eprintln!("{created} pods admitted while the Secret was repaired and the CA rotated");

    // The CA key lost for good: every replica restarted while the Secret's CA key was garbage,
    // so no process knows it. A new CA; the replicas keep serving the old CA's leaf until the
    // bundle trusts the new one.
    let (wa, wb) = (a.webhook, b.webhook);
    a.process.stop().await;
    b.process.stop().await;
    let key_lost_ca = secret_data(&client)
        .await
        .get("ca.crt")
        .cloned()
        .unwrap_or_default();
    let mut data = secret_data(&client).await;
    data.insert("ca.key".into(), other.key_pem.clone());
    replace_secret_data(&client, data).await;
    let a = start_replica(&env, "controller-a2", wa, "87600h");
    let b = start_replica(&env, "controller-b2", wb, "87600h");
    let started = std::time::Instant::now();
    // Load again once both replicas listen with a certificate the apiserver trusts.
    until("the restarted replicas to serve", WAIT, || async {
        let config = http_client::trusting(&bundle(&client).await)?;
        for port in [wa, wb] {
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            http_client::https(addr, config.clone(), "GET", "/pod/mutate", b"").await?;
        }
        Ok(())
    })
    .await
    .expect("restarted replicas serve");
    let load = Load::start(&client, &ns, "lost");
    if let Err(e) = until("a new CA with a leaf of it", WAIT, || async {
        let data = secret_data(&client).await;
        intact(&data)?;
        (der_of(data.get("ca.crt").map_or("", |s| s)) != der_of(&key_lost_ca))
            .then_some(())
            .ok_or("the CA whose key is lost".to_string())
    })
    .await
    {
        problems.push(format!("key lost: {e}"));
    }
    eprintln!("lost CA key replaced after {:?}", started.elapsed());
    if let Err(e) = served_by_both(&client, &[&a, &b]).await {
        problems.push(format!("after the lost key: {e}"));
    }
    let (lost_created, lost_failures) = load.finish().await;
    eprintln!("{lost_created} pods admitted while a lost CA key was replaced");
    failures.extend(lost_failures);

    let (violations, bundles) = recorder.replay();
    if !bundles.iter().any(|b| certs(b).len() == 2) {
        problems.push("the bundle never carried the old and the new CA at once".into());
    }
    problems.extend(violations);
    problems.extend(failures.iter().map(|f| format!("admission: {f}")));
    if created < 100 || lost_created < 20 {
        problems.push(format!(
            "too little load: {created} and {lost_created} pods"
        ));
    }
    a.process.stop().await;
    b.process.stop().await;
    env.stop().await;
    assert!(
        problems.is_empty(),
        "{} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

/// A CA of 90 s renews itself once 60 s have passed, long before it expires, under load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ca_renewed_before_expiry_without_failed_admission() {
    let (env, client, a, b, ns) = setup("90s").await;
    let recorder = Recorder::start(&client);
    let mut problems: Vec<String> = Vec::new();
    let load = Load::start(&client, &ns, "load");
    let ca0 = secret_data(&client)
        .await
        .get("ca.crt")
        .cloned()
        .unwrap_or_default();
    let expires = self_signed::parse_cert(&ca0, "CA").expect("CA").not_after;
    let started = std::time::Instant::now();
    let renewed = until(
        "the CA to be renewed, with a leaf of the new CA",
        Duration::from_secs(120),
        || async {
            let data = secret_data(&client).await;
            intact(&data)?;
            let ca = data.get("ca.crt").cloned().unwrap_or_default();
            (der_of(&ca) != der_of(&ca0))
                .then(webhooks::OffsetDateTime::now_utc)
                .ok_or("the first CA".to_string())
        },
    )
    .await;
    match renewed {
        Ok(at) if at >= expires => {
            problems.push(format!("renewed only after expiry ({at} >= {expires})"))
        }
        Ok(at) => eprintln!(
            "CA renewed after {:?}, {} before it expired",
            started.elapsed(),
            expires - at
        ),
        Err(e) => problems.push(e.to_string()),
    }
    if let Err(e) = served_by_both(&client, &[&a, &b]).await {
        problems.push(format!("after renewal: {e}"));
    }
    let (created, failures) = load.finish().await;
    eprintln!("{created} pods admitted across the renewal");
    let (violations, bundles) = recorder.replay();
    if !bundles.iter().any(|b| certs(b).len() == 2) {
        problems.push("the bundle never carried the old and the new CA at once".into());
    }
    problems.extend(violations);
    problems.extend(failures.iter().map(|f| format!("admission: {f}")));
    if created < 100 {
        problems.push(format!("too little load: {created} pods"));
    }
    a.process.stop().await;
    b.process.stop().await;
    env.stop().await;
    assert!(
        problems.is_empty(),
        "{} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
}
