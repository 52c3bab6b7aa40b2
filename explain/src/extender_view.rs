//! Asking the scheduler extender for its view of a pod (`GET /explain` on its admin port):
//! directly at `--extender URL`, or through the apiserver's proxy to an extender pod of the
//! driver's namespace. Failing to ask is a fact to report, never an error of `explain`.

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};

use crate::facts::ExtenderFacts;
use crate::options::{ExplainConfig, ExtenderAccess};
use extender::pod_view::PodView;

/// The labels of the extender's pods (manifests/components/scheduler-extender).
pub const EXTENDER_SELECTOR: &str =
    "app.kubernetes.io/name=pmem-csi-extender,app.kubernetes.io/component=extender";
/// The extender's admin port when its pod names none (`--admin-address` default).
pub const ADMIN_PORT: i32 = 10012;
/// How long one ask may take.
const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The extender's view of pod `name`, or why there is none.
pub async fn ask(
    client: &Client,
    config: &ExplainConfig,
    namespace: &str,
    name: &str,
) -> ExtenderFacts {
    let query = format!("namespace={namespace}&pod={name}");
    let answer = match &config.extender {
        ExtenderAccess::Url(url) => tokio::time::timeout(TIMEOUT, direct(url, &query)).await,
        ExtenderAccess::PodProxy => {
            match tokio::time::timeout(TIMEOUT, proxied(client, &config.driver_namespace, &query))
                .await
            {
                Ok(Ok(None)) => return ExtenderFacts::NotInstalled,
                Ok(Ok(Some(body))) => Ok(Ok(body)),
                Ok(Err(e)) => Ok(Err(e)),
                Err(e) => Err(e),
            }
        }
    };
    let body = match answer {
        Ok(Ok(body)) => body,
        Ok(Err(message)) => return ExtenderFacts::Unreachable(message),
        Err(_) => {
            return ExtenderFacts::Unreachable(format!("no answer within {}s", TIMEOUT.as_secs()));
        }
    };
    match serde_json::from_str::<PodView>(&body) {
        Ok(view) => ExtenderFacts::View(Box::new(view)),
        Err(e) => ExtenderFacts::Unreachable(format!("its answer does not decode: {e}")),
    }
}

/// `GET <url>/explain?<query>` over plain HTTP, asking again while the extender answers 429
/// (its budget of apiserver reads is spent; the caller's timeout bounds the waits).
async fn direct(url: &str, query: &str) -> Result<String, String> {
    loop {
        match direct_answer(url, query).await {
            Err(Busy(wait)) => tokio::time::sleep(wait).await,
            Ok(answer) => return answer,
        }
    }
}

/// The extender's budget for `/explain` is spent: ask again after this.
struct Busy(std::time::Duration);

/// How long a 429's `Retry-After` asks to wait (1 s when absent; at most 5 s).
fn retry_after(headers: &http::HeaderMap) -> std::time::Duration {
    let secs = headers
        .get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(1);
    std::time::Duration::from_secs(secs.clamp(1, 5))
}

/// One `GET <url>/explain?<query>`: the answer or why there is none, or [`Busy`].
async fn direct_answer(url: &str, query: &str) -> Result<Result<String, String>, Busy> {
    let uri: http::Uri = match format!("{}/explain?{query}", url.trim_end_matches('/')).parse() {
        Ok(uri) => uri,
        Err(e) => return Ok(Err(format!("--extender {url:?}: {e}"))),
    };
    let client = HttpClient::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let response = match client.get(uri.clone()).await {
        Ok(response) => response,
        Err(e) => return Ok(Err(format!("GET {uri}: {e}"))),
    };
    let status = response.status();
    if status == http::StatusCode::TOO_MANY_REQUESTS {
        return Err(Busy(retry_after(response.headers())));
    }
    let body = match response.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(e) => return Ok(Err(format!("GET {uri}: {e}"))),
    };
    let text = String::from_utf8_lossy(&body).into_owned();
    if status.is_success() {
        Ok(Ok(text))
    } else {
        Ok(Err(format!("GET {uri}: {status}: {}", text.trim())))
    }
}

/// Through the apiserver's pod proxy to a running extender pod; `None` when there is none.
async fn proxied(client: &Client, namespace: &str, query: &str) -> Result<Option<String>, String> {
    let pods = Api::<Pod>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().labels(EXTENDER_SELECTOR))
        .await
        .map_err(|e| format!("listing extender pods in namespace {namespace}: {e}"))?;
    if pods.items.is_empty() {
        return Ok(None);
    }
    let Some(pod) = pods
        .items
        .iter()
        .find(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
    else {
        return Err(format!(
            "no extender pod in namespace {namespace} is Running ({} found)",
            pods.items.len()
        ));
    };
    let port = pod
        .spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some("admin"))
        .map_or(ADMIN_PORT, |p| p.container_port);
    let path = format!(
        "/api/v1/namespaces/{namespace}/pods/{}:{port}/proxy/explain?{query}",
        pod.name_any()
    );
    let request = http::Request::get(&path)
        .body(Vec::new())
        .map_err(|e| format!("{path}: {e}"))?;
    loop {
        match client.request_text(request.clone()).await {
            Ok(text) => return Ok(Some(text)),
            // The extender's budget is spent (the apiserver passes its 429 on).
            Err(kube::Error::Api(e)) if e.code == 429 => {
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
            Err(e) => return Err(format!("GET {path}: {e}")),
        }
    }
}
