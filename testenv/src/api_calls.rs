//! Calls on the API server that many tests make: creating a class, applying an object, reading
//! a claim's selected node and a namespace's Events.

use k8s_openapi::api::core::v1::{Event, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;

use controllers::test_objects::storage_class;
use controllers::well_known::SELECTED_NODE;

/// Creates StorageClass `name` of `provisioner` with `binding_mode` (reclaim policy Delete).
pub async fn create_storage_class(
    client: &kube::Client,
    name: &str,
    provisioner: &str,
    binding_mode: &str,
) -> Result<StorageClass, kube::Error> {
    Api::<StorageClass>::all(client.clone())
        .create(
            &PostParams::default(),
            &storage_class(name, provisioner, binding_mode),
        )
        .await
}

/// Creates or replaces `object` (server-side apply by "testenv").
pub async fn apply<K>(api: &Api<K>, object: &K) -> Result<K, kube::Error>
where
    K: Resource + Clone + DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let name = object.meta().name.clone().unwrap_or_default();
    api.patch(
        &name,
        &PatchParams::apply("testenv").force(),
        &Patch::Apply(object),
    )
    .await
}

/// The selected node of claim `name`, if any (and if the claim exists).
pub async fn selected_node(api: &Api<PersistentVolumeClaim>, name: &str) -> Option<String> {
    api.get(name)
        .await
        .ok()?
        .metadata
        .annotations?
        .get(SELECTED_NODE)
        .cloned()
}

/// The Events in `namespace` that match field selector `fields` (such as
/// `reason=Rescheduled`).
pub async fn events(
    client: &kube::Client,
    namespace: &str,
    fields: &str,
) -> Result<Vec<Event>, kube::Error> {
    let list = Api::namespaced(client.clone(), namespace)
        .list(&ListParams::default().fields(fields))
        .await?;
    Ok(list.items)
}

/// The messages of the `FailedScheduling` Events of pod `name`, newest last.
pub async fn failed_scheduling(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> Result<Vec<String>, kube::Error> {
    let events = events(
        client,
        namespace,
        &format!("involvedObject.name={name},reason=FailedScheduling"),
    )
    .await?;
    Ok(events.into_iter().filter_map(|e| e.message).collect())
}
