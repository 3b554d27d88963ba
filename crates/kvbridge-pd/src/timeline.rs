//! The target of the PD layer's timeline marks.

/// The `tracing` target of the PD layer's per-chunk timeline marks (`DEBUG`, fields
/// `stage`, `id`, `chunk`), which `kvbridge demo --timeline` records; the same target as
/// the reference engine's marks.
pub const TIMELINE: &str = "kvbridge::timeline";
