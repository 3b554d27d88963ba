//! Sans-IO wire protocol of kvbridge.
