//! Where a request goes: the routing policies ([`policy`]) over what the proxy knows of the
//! workers' caches ([`kv_index`] from their KV events, [`routed_prefixes`] routed and not yet
//! reported, [`prefix_tree`] approximated from the prompts sent), a pool's routing state
//! ([`pool_router`]), the request's key ([`prompt_key`]), and whether the chosen decoder
//! prefills the prompt itself ([`decider`]).
//!
//! Each child imports its siblings by `super::sibling::Name`, never a name re-exported here:
//! this module is their parent, above them (`scripts/check-layers.py --enclosing`).

pub mod decider;
pub mod kv_index;
pub mod policy;
pub mod pool_router;
pub mod prefix_tree;
pub mod prompt_key;
pub mod routed_prefixes;

/// The policy `--routing` names: what users of the crate configure.
pub use policy::RoutingPolicy;
