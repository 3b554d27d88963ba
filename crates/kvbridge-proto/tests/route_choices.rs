//! The transport decision as a table: for each batch and each set of backend offers, the
//! ways tried in order (`kvbridge_proto::route`). Each row is a case the engine met or must
//! meet; a change of the rule changes a row here first.

use kvbridge_proto::route::{data_connections, ways, Batch, Offer, Way};

const FABRIC: Offer = Offer {
    covers: true,
    copies_in_caller: false,
};
const FABRIC_MISSES: Offer = Offer {
    covers: false,
    copies_in_caller: false,
};
const SAME_HOST: Offer = Offer {
    covers: true,
    copies_in_caller: true,
};
const SAME_HOST_MISSES: Offer = Offer {
    covers: false,
    copies_in_caller: true,
};

fn batch(read: bool, striped: bool, caller_may_copy: bool) -> Batch {
    Batch {
        read,
        striped,
        caller_may_copy,
        grant: false,
    }
}

const WRITE: Batch = Batch {
    read: false,
    striped: false,
    caller_may_copy: true,
    grant: false,
};

/// A batch that names a grant token.
fn granted(b: Batch) -> Batch {
    Batch { grant: true, ..b }
}

use Way::{OneSided, TwoSided};

#[test]
fn each_batch_tries_the_ways_the_table_says() {
    #[rustfmt::skip]
    let table: &[(&str, Batch, &[Offer], &[Way])] = &[
        ("no backend: TCP", WRITE, &[], &[TwoSided]),
        ("a read, no backend: TCP", batch(true, false, true), &[], &[TwoSided]),
        ("same host, a write on a multi-thread runtime: copied by its caller, TCP if given back",
            WRITE, &[SAME_HOST], &[OneSided(0), TwoSided]),
        ("same host, a read: the writer thread's (TCP path)",
            batch(true, false, true), &[SAME_HOST], &[TwoSided]),
        ("same host, a current-thread runtime: the writer thread's",
            batch(false, false, false), &[SAME_HOST], &[TwoSided]),
        ("same host, a striped session: TCP",
            batch(false, true, true), &[SAME_HOST], &[TwoSided]),
        ("same host, a backend that knows it misses: TCP",
            WRITE, &[SAME_HOST_MISSES], &[TwoSided]),
        ("UCX covers a write", WRITE, &[FABRIC], &[OneSided(0), TwoSided]),
        ("UCX covers a read", batch(true, false, true), &[FABRIC], &[OneSided(0), TwoSided]),
        ("UCX on a striped session, a current-thread runtime",
            batch(false, true, false), &[FABRIC], &[OneSided(0), TwoSided]),
        ("UCX misses a region", WRITE, &[FABRIC_MISSES], &[TwoSided]),
        ("UCX first, whatever the order the session got them in",
            WRITE, &[SAME_HOST, FABRIC], &[OneSided(1), OneSided(0), TwoSided]),
        ("UCX misses, same host copies",
            WRITE, &[FABRIC_MISSES, SAME_HOST], &[OneSided(1), TwoSided]),
        ("UCX and same host, a read: UCX, then TCP",
            batch(true, false, true), &[SAME_HOST, FABRIC], &[OneSided(1), TwoSided]),
        ("two caller copies keep the session's order",
            WRITE, &[SAME_HOST, SAME_HOST], &[OneSided(0), OneSided(1), TwoSided]),
        ("a write under a grant token, same host and UCX cover it: TCP, the peer checks it",
            granted(WRITE), &[SAME_HOST, FABRIC], &[TwoSided]),
        ("a read under a grant token, UCX covers it: TCP, the peer checks it",
            granted(batch(true, false, true)), &[FABRIC], &[TwoSided]),
    ];
    for (case, b, offers, want) in table {
        let got: Vec<Way> = ways(*b, offers).collect();
        assert_eq!(&got, want, "{case}");
    }
}

#[test]
fn tcp_is_always_the_last_way_and_never_twice() {
    let offers = [FABRIC, SAME_HOST, FABRIC_MISSES, SAME_HOST_MISSES];
    for read in [false, true] {
        for striped in [false, true] {
            for caller in [false, true] {
                let got: Vec<Way> = ways(batch(read, striped, caller), &offers).collect();
                assert_eq!(got.last(), Some(&TwoSided));
                assert_eq!(got.iter().filter(|w| **w == TwoSided).count(), 1);
                assert!(
                    !got.contains(&OneSided(2)) && !got.contains(&OneSided(3)),
                    "an offer that misses was tried"
                );
            }
        }
    }
}

#[test]
fn data_connections_follow_the_table() {
    #[rustfmt::skip]
    let table: &[(&str, bool, usize, usize, usize)] = &[
        ("mapped peer memory: one connection, whatever is configured", true, 4, 8, 1),
        ("TCP: as configured", false, 2, 8, 2),
        ("TCP: at least one", false, 0, 8, 1),
        ("TCP: at most the maximum", false, 64, 8, 8),
    ];
    for (case, maps, configured, max, want) in table {
        assert_eq!(data_connections(*maps, *configured, *max), *want, "{case}");
    }
}
