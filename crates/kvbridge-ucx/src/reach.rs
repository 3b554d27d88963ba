//! Who can reach a UCX worker under a given `UCX_TLS`, without the engine's authentication.
//!
//! UCX authenticates nobody. Every transport a worker opens accepts whoever reaches it, and
//! a context with remote memory access answers the active messages that emulate it in
//! software (UCX 1.13's tcp and shared-memory transports emulate every put and get) by
//! copying to and from the address the message names, checking no key
//! (`tests/forged_bounds.rs`, `tests/scan_only_write.rs`). Reaching a worker is therefore
//! reaching its process's whole memory. Who can reach it depends on the transport:
//! - `posix` (segments opened through `/proc/<pid>/fd`, mode 0600), `cma`
//!   (`process_vm_readv`/`writev`, which need ptrace access) and `self` (this process):
//!   only processes of the same user, a trust domain the engine does not defend within;
//! - `sysv`: its segments are created with mode 0660, so also every process of the user's
//!   group; `sm`, `shm` and `mm` include it;
//! - `tcp`, and every RDMA transport (`rc`, `ud`, `dc` and their variants, `ib`): any host
//!   (or local user) that reaches one of the ports or queue pairs UCX opens: a port scan
//!   finds tcp's;
//! - a name not listed here, `all`, an unset setting and `^` exclusion lists: counted as
//!   reaching beyond the user, since they may open any of the above.

/// The transports only this user's processes can reach a worker through.
pub const SAME_USER: &[&str] = &["posix", "cma", "self"];

/// UCX's `TLS` setting as UCX reads it: a comma-separated list of transports and aliases,
/// `all`, a leading `^` for "every transport but these", a leading `\` for a name that is not
/// an alias, a `:aux` suffix (the transport serves only the wire-up).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TlsSetting {
    /// `^...`: the names are the transports left out.
    pub(crate) excluding: bool,
    /// The names, lower-cased, without `\` and `:aux`; `all` stands as itself.
    pub(crate) names: Vec<String>,
}

impl TlsSetting {
    /// Reads `tls` (`None` or blank: UCX's default, every transport, as `all`).
    pub(crate) fn read(tls: Option<&str>) -> Self {
        let Some(tls) = tls.map(str::trim).filter(|t| !t.is_empty()) else {
            return TlsSetting {
                excluding: false,
                names: vec!["all".to_string()],
            };
        };
        let (excluding, list) = match tls.strip_prefix('^') {
            Some(rest) => (true, rest),
            None => (false, tls),
        };
        // Lower-cased: a name in another case counts as the transport it spells, so no
        // check below is escaped by case.
        let names = list
            .split(',')
            .map(|item| {
                let item = item.trim();
                let item = item.strip_prefix('\\').unwrap_or(item);
                item.split(':').next().unwrap_or(item).to_ascii_lowercase()
            })
            .filter(|n| !n.is_empty())
            .collect();
        TlsSetting { excluding, names }
    }

    /// Whether UCX may open transport `tl` under this setting.
    pub(crate) fn may_open(&self, tl: &str) -> bool {
        let named = self
            .names
            .iter()
            .any(|n| n == tl || (!self.excluding && n == "all"));
        named != self.excluding
    }
}

/// The parts of `tls` (`UCX_TLS`; `None`: unset) through which a process of another user or
/// another host may reach a worker: each such transport or alias by name, or the whole
/// setting where it is `all`, unset or an exclusion list. Empty: only this user's processes
/// can reach it ([`SAME_USER`]).
pub fn beyond_this_user(tls: Option<&str>) -> Vec<String> {
    let setting = TlsSetting::read(tls);
    if setting.excluding {
        return vec![tls.unwrap_or_default().trim().to_string()];
    }
    let mut beyond: Vec<String> = Vec::new();
    for name in setting.names {
        let name = if name == "all" && tls.is_none_or(|t| t.trim().is_empty()) {
            "all (UCX_TLS unset)".to_string()
        } else {
            name
        };
        if !SAME_USER.contains(&name.as_str()) && !beyond.contains(&name) {
            beyond.push(name);
        }
    }
    beyond
}

/// Whether UCX may open any of `transports` under `tls` (`UCX_TLS`; `None`: unset, every
/// transport), aliases by their own names (`sm`, not what it expands to).
pub fn may_open_any(tls: Option<&str>, transports: &[&str]) -> bool {
    let setting = TlsSetting::read(tls);
    transports.iter().any(|t| setting.may_open(t))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_posix_cma_and_self_keep_a_worker_to_this_user() {
        for tls in [
            "posix,cma,self",
            "posix",
            "self,cma",
            " \\posix , cma:aux ",
            "posix,self,",
            "POSIX,Cma",
        ] {
            assert_eq!(beyond_this_user(Some(tls)), Vec::<String>::new(), "{tls}");
        }
        let cases: &[(Option<&str>, &[&str])] = &[
            (None, &["all (UCX_TLS unset)"]),
            (Some(""), &["all (UCX_TLS unset)"]),
            (Some("all"), &["all"]),
            (Some("tcp"), &["tcp"]),
            (Some("posix,TCP"), &["tcp"]),
            (Some("sm,self"), &["sm"]),
            (Some("sm,self,tcp"), &["sm", "tcp"]),
            (Some("posix,sysv,cma"), &["sysv"]),
            (Some("rc_x,ud,posix,self"), &["rc_x", "ud"]),
            (Some("posix,tcp:aux"), &["tcp"]),
            (Some("\\tcp,tcp"), &["tcp"]),
            (Some("shm,knem"), &["shm", "knem"]),
            (Some("^tcp"), &["^tcp"]),
            (
                Some("^rc,ud,dc,tcp,sysv,knem,xpmem"),
                &["^rc,ud,dc,tcp,sysv,knem,xpmem"],
            ),
        ];
        for (tls, want) in cases {
            assert_eq!(beyond_this_user(*tls), *want, "{tls:?}");
        }
    }

    #[test]
    fn any_of_several_transports_may_open() {
        let shared = ["sm", "posix", "sysv", "cma"];
        assert!(!may_open_any(Some("tcp,self"), &shared));
        assert!(may_open_any(Some("rc,\\sysv"), &shared));
        assert!(may_open_any(Some("^sm,posix"), &shared));
        assert!(!may_open_any(Some("^sm,posix,sysv,cma"), &shared));
        assert!(may_open_any(None, &shared));
    }

    #[test]
    fn a_setting_opens_what_it_names_or_does_not_exclude() {
        let s = TlsSetting::read(Some("sm,\\tcp:aux"));
        assert!(s.may_open("tcp") && s.may_open("sm") && !s.may_open("rc"));
        let s = TlsSetting::read(Some("^tcp,ud"));
        assert!(!s.may_open("tcp") && !s.may_open("ud") && s.may_open("rc"));
        assert!(TlsSetting::read(None).may_open("tcp"));
        assert!(TlsSetting::read(Some("all")).may_open("tcp"));
    }
}
