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

/// `GET <url>/explain?<query>` over plain HTTP.
async fn direct(url: &str, query: &str) -> Result<String, String> {
    let uri: http::Uri = format!("{}/explain?{query}", url.trim_end_matches('/'))
        .parse()
        .map_err(|e| format!("--extender {url:?}: {e}"))?;
    let client = HttpClient::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let response = client
        .get(uri.clone())
        .await
        .map_err(|e| format!("GET {uri}: {e}"))?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("GET {uri}: {e}"))?
        .to_bytes();
    let text = String::from_utf8_lossy(&body).into_owned();
    if status.is_success() {
        Ok(text)
    } else {
        Err(format!("GET {uri}: {status}: {}", text.trim()))
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
    client
        .request_text(request)
        .await
        .map(Some)
        .map_err(|e| format!("GET {path}: {e}"))
}
