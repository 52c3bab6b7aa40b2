//! The pod mutating webhook and the scheduler extender. Empty until the webhook and extender issue lands.
