//! How bytes reach the peer. `tcp/` is the two-sided path over the session's data
//! connections; it completes batches through the data path's table of waiting batches
//! (`datapath/pending.rs`) and never calls back into the data path itself.

pub(crate) mod tcp;
