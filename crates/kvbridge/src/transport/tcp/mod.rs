//! TCP, the two-sided path: every op header travels with its batch and the receiving side
//! validates it against its own regions before a payload byte lands. One reader and one
//! writer per data connection.

pub(crate) mod reader;
pub(crate) mod writer;
