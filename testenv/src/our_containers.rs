//! Our control-plane-side containers (controller, extender) as testenv runs them: the rendered
//! container as a process under its ServiceAccount's kubeconfig.

use crate::nodes::DEFAULT_DRIVER_NAME;
use crate::{ProcessSpec, TestEnv, TestEnvError, manifests, node_processes};

impl TestEnv {
    /// Process `name` of our rendered container `which` (controller or extender) with
    /// `overrides`, under its ServiceAccount, logging to `logs/<log>`.
    pub fn our_process(
        &self,
        which: manifests::OurContainer,
        name: &str,
        log: &str,
        overrides: &manifests::Overrides,
    ) -> Result<ProcessSpec, TestEnvError> {
        let rendered = if which == manifests::OurContainer::Controller
            && !overrides.gives("--webhook-address")
        {
            // Without the webhook the controller runs as the base installs it.
            &self.manifests_base
        } else {
            &self.manifests
        };
        let launch = rendered.launch(which)?;
        let kubeconfig = self.account_kubeconfig(&launch.service_account, name)?;
        let pod = manifests::PodFacts {
            name: name.into(),
            namespace: manifests::NAMESPACE.into(),
            node_name: "control-plane".into(),
        };
        let mut defaults = manifests::Overrides::new()
            .set("--admin-address", "127.0.0.1:0")
            .and(&self.driver_name_override());
        if which == manifests::OurContainer::Controller {
            // The manifests' socket is the pod's; a controller serves the resizer's endpoint
            // only where a test gives it one of its own (TestEnvBuilder::with_resizer).
            defaults = defaults.remove("--resizer-endpoint");
            if !self.shipped_heartbeat {
                defaults = defaults.remove("--heartbeat-grace");
            }
        }
        let overrides = defaults.and(overrides);
        Ok(node_processes::container_process(
            rendered,
            which,
            name,
            self.tools.pmem_csi(),
            &pod,
            log,
            &overrides,
        )?
        .env("KUBECONFIG", kubeconfig))
    }

    /// The `--driver-name` our processes need when this testenv's driver is not the manifests'.
    pub(crate) fn driver_name_override(&self) -> manifests::Overrides {
        if self.driver_name == DEFAULT_DRIVER_NAME {
            manifests::Overrides::new()
        } else {
            manifests::Overrides::new().set("--driver-name", self.driver_name.clone())
        }
    }
}
