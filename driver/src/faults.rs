//! Named fault points for the crash test: with `PMEM_CSI_TEST_FAULT_POINT=<name>` set, the
//! process kills itself with SIGKILL when it reaches that point, so a test can crash the driver
//! at exactly the moments that matter (after the state write, after allocation, …). Without the
//! variable a point costs one relaxed atomic load. Only builds with the `test-hooks` feature
//! (the tests') have them: in the shipped binary every point is an empty function, and no
//! environment variable can make it pause or die.

#[cfg(feature = "test-hooks")]
use std::sync::OnceLock;

/// Environment variable naming the fault point to die at.
#[cfg(feature = "test-hooks")]
pub const FAULT_POINT_ENV: &str = "PMEM_CSI_TEST_FAULT_POINT";

#[cfg(feature = "test-hooks")]
fn chosen() -> Option<&'static str> {
    static CHOSEN: OnceLock<Option<String>> = OnceLock::new();
    CHOSEN
        .get_or_init(|| {
            std::env::var(FAULT_POINT_ENV)
                .ok()
                .filter(|v| !v.is_empty())
        })
        .as_deref()
}

/// Environment variable `<point>:<milliseconds>` naming a point to pause at (partition tests
/// hold a call in flight with it).
#[cfg(feature = "test-hooks")]
pub const DELAY_ENV: &str = "PMEM_CSI_TEST_DELAY";

#[cfg(feature = "test-hooks")]
fn delay_at() -> Option<(&'static str, std::time::Duration)> {
    static DELAY: OnceLock<Option<(String, u64)>> = OnceLock::new();
    DELAY
        .get_or_init(|| {
            let v = std::env::var(DELAY_ENV).ok()?;
            let (point, ms) = v.split_once(':')?;
            Some((point.to_string(), ms.parse().ok()?))
        })
        .as_ref()
        .map(|(p, ms)| (p.as_str(), std::time::Duration::from_millis(*ms)))
}

/// Pauses here if this is the point `PMEM_CSI_TEST_DELAY` names.
#[cfg(feature = "test-hooks")]
pub fn pause(name: &str) {
    if let Some((point, delay)) = delay_at()
        && point == name
    {
        tracing::warn!(point = name, ?delay, "test delay");
        std::thread::sleep(delay);
    }
}

/// Dies here if this is the chosen fault point.
#[cfg(feature = "test-hooks")]
pub fn point(name: &str) {
    pause(name);
    if chosen() == Some(name) {
        tracing::warn!(point = name, "fault point reached, killing the process");
        let _ =
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    }
}

/// A fault point without the `test-hooks` feature: nothing.
#[cfg(not(feature = "test-hooks"))]
#[inline(always)]
pub fn point(_name: &str) {}

/// A pause point without the `test-hooks` feature: nothing.
#[cfg(not(feature = "test-hooks"))]
#[inline(always)]
pub fn pause(_name: &str) {}
