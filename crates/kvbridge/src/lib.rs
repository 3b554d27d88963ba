//! kvbridge engine.
