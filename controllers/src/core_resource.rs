//! `kube::Resource` for our own types of core/v1 kinds ([`crate::claim_summary::ClaimSummary`],
//! [`crate::node_summary::NodeSummary`]): decoded from the same API paths as k8s-openapi's
//! types, holding less.

/// Implements [`kube::Resource`] for `$type` (with a `metadata: ObjectMeta` field) as the core/v1
/// kind `$kind` with plural `$plural` and scope `$scope`.
macro_rules! core_v1_resource {
    ($type:ty, $kind:literal, $plural:literal, $scope:ty) => {
        impl kube::Resource for $type {
            type DynamicType = ();
            type Scope = $scope;

            fn kind(_: &()) -> std::borrow::Cow<'_, str> {
                $kind.into()
            }

            fn group(_: &()) -> std::borrow::Cow<'_, str> {
                "".into()
            }

            fn version(_: &()) -> std::borrow::Cow<'_, str> {
                "v1".into()
            }

            fn plural(_: &()) -> std::borrow::Cow<'_, str> {
                $plural.into()
            }

            fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &self.metadata
            }

            fn meta_mut(
                &mut self,
            ) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

pub(crate) use core_v1_resource;
