//! Placeholder; filled in by the webhook and extender issue.
