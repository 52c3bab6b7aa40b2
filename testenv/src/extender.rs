//! The extender testenv runs beside kube-scheduler: its ports, reserved before the scheduler's
//! configuration is written, its start, and what tests do with it.

use std::net::SocketAddr;

use crate::builder::TestEnvBuilder;
use crate::{Supervised, TestEnv, TestEnvError, manifests, ports, process, signal_running};

/// The extender testenv runs beside kube-scheduler.
#[derive(Debug)]
pub(crate) struct ExtenderProcess {
    process: Supervised,
    address: SocketAddr,
    admin: SocketAddr,
}

/// The extender's route and admin ports when `builder` runs it, with kube-scheduler's
/// configuration naming the route: the scheduler starts before the extender does.
pub(crate) fn reserve_ports(
    builder: &mut TestEnvBuilder,
) -> Result<Option<(u16, u16)>, TestEnvError> {
    if builder.extender.is_none() {
        return Ok(None);
    }
    let (route, admin) = (ports::free_port()?, ports::free_port()?);
    builder.scheduler = builder
        .scheduler
        .clone()
        .manifest_extender(route, &builder.driver_name)?;
    Ok(Some((route, admin)))
}

impl TestEnv {
    /// Starts the extender supervised on `route` and `admin` (from [`reserve_ports`]) as the
    /// manifests run it, changed by test items `args`, with environment `env`.
    pub(crate) fn start_extender(
        &self,
        args: &[String],
        (route, admin): (u16, u16),
        env: &[(String, String)],
    ) -> Result<ExtenderProcess, TestEnvError> {
        let address = SocketAddr::from(([127, 0, 0, 1], route));
        let admin = SocketAddr::from(([127, 0, 0, 1], admin));
        // The manifests' emptyDir, as a directory of this testenv: it outlives restarts of
        // the supervised extender as the emptyDir outlives container restarts.
        let state = self.dir().join("extender-state");
        std::fs::create_dir_all(&state).map_err(|source| TestEnvError::WorkDir {
            parent: state.clone(),
            source,
        })?;
        let overrides = manifests::Overrides::new()
            .set("--extender-address", address.to_string())
            .set("--admin-address", admin.to_string())
            .set(
                "--reservations-file",
                state.join("reservations.jsonl").display().to_string(),
            )
            .and(&self.driver_name_override())
            .and(&manifests::Overrides::from_args(args));
        let mut spec = self.our_process(
            manifests::OurContainer::Extender,
            "extender",
            "extender.log",
            &overrides,
        )?;
        for (key, value) in env {
            spec = spec.env(key, value);
        }
        Ok(ExtenderProcess {
            process: self.supervise(spec),
            address,
            admin,
        })
    }

    /// The extender's route and admin addresses, when it runs.
    pub fn extender_addresses(&self) -> Option<(SocketAddr, SocketAddr)> {
        self.extender.as_ref().map(|e| (e.address, e.admin))
    }

    /// Takes the extender process out of the testenv's hands (to stop or kill it).
    pub fn take_extender(&mut self) -> Option<Supervised> {
        self.extender.take().map(|e| e.process)
    }

    /// Sends `signal` to the extender, which its supervisor restarts (fault tests).
    pub fn signal_extender(
        &self,
        signal: rustix::process::Signal,
    ) -> Result<(), process::ProcessError> {
        signal_running(
            self.extender.as_ref().map(|e| &e.process),
            "extender",
            signal,
        )
    }

    /// How often the extender's supervisor restarted it, when testenv runs it.
    pub fn extender_restarts(&self) -> Option<u32> {
        self.extender.as_ref().map(|e| e.process.state().restarts)
    }
}
