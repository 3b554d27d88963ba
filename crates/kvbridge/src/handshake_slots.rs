//! Who gets a handshake slot: the listener's rule for a `Hello`, before any authentication,
//! as a pure function of the handshakes under way (the core task applies it).
//!
//! A source address holds at most `max_handshakes_per_source` slots; a `Hello` past that is
//! refused. Below `max_concurrent_handshakes` in all, a `Hello` takes a free slot. When all
//! are taken, a `Hello` from a source that holds at least two fewer slots than the source
//! holding most takes the oldest slot of that source (of the oldest handshake among the
//! sources tied for most); that handshake ends with a typed error naming its peer, address
//! and step. Otherwise it is refused.
//!
//! So a few hosts whose `Hello`s never finish cannot lock out another host: taking all the
//! slots takes as many distinct addresses as there are slots (each then holds one, and a
//! newcomer holding none takes no slot from a source holding one). A source keeps at least
//! what the others hold, minus one: "two fewer" means the slot moves only when the newcomer
//! then holds no more than the source it took it from, so two busy sources never take slots
//! back and forth. Our own dials count toward the total and are never taken.

use std::net::IpAddr;

/// A handshake under way: its session, and its control connection's source (`None`: we
/// dialled). Given oldest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct UnderWay {
    /// The session.
    pub(crate) id: u64,
    /// Where its `Hello` came from.
    pub(crate) source: Option<IpAddr>,
}

/// What a `Hello` gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Slot {
    /// A free slot.
    Free,
    /// The slot of this session, which ends.
    TakenFrom(u64),
    /// No slot; why.
    Refused(String),
}

/// The slot for a `Hello` from `from`, given the handshakes under way, oldest first.
pub(crate) fn slot_for(
    under_way: &[UnderWay],
    from: IpAddr,
    max_total: usize,
    max_per_source: usize,
) -> Slot {
    let holds = |ip: IpAddr| under_way.iter().filter(|h| h.source == Some(ip)).count();
    let theirs = holds(from);
    if theirs >= max_per_source {
        return Slot::Refused(format!(
            "{theirs} handshakes from {from} already under way (limit per source)"
        ));
    }
    if under_way.len() < max_total {
        return Slot::Free;
    }
    let most = under_way
        .iter()
        .filter_map(|h| h.source)
        .map(holds)
        .max()
        .unwrap_or(0);
    if theirs + 2 <= most {
        if let Some(h) = under_way
            .iter()
            .find(|h| h.source.is_some_and(|ip| holds(ip) == most))
        {
            return Slot::TakenFrom(h.id);
        }
    }
    Slot::Refused(format!(
        "{} handshakes already under way (limit), {theirs} of them from {from}",
        under_way.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    /// Sessions 1, 2, … in order, from the given sources.
    fn from(sources: &[Option<u8>]) -> Vec<UnderWay> {
        sources
            .iter()
            .enumerate()
            .map(|(i, s)| UnderWay {
                id: i as u64 + 1,
                source: s.map(ip),
            })
            .collect()
    }

    #[test]
    fn a_free_slot_is_taken_within_the_quotas() {
        let h = from(&[Some(2), Some(3), None]);
        assert_eq!(slot_for(&h, ip(2), 8, 2), Slot::Free);
        assert_eq!(slot_for(&[], ip(2), 1, 1), Slot::Free);
    }

    #[test]
    fn a_source_at_its_quota_is_refused_even_with_slots_free() {
        let h = from(&[Some(2), Some(2)]);
        let Slot::Refused(why) = slot_for(&h, ip(2), 8, 2) else {
            panic!("not refused")
        };
        assert!(
            why.contains("127.0.0.2") && why.contains("per source"),
            "{why}"
        );
    }

    /// Four sources at their quota fill the listener: a fifth takes the oldest slot of the
    /// sources tied for most.
    #[test]
    fn a_full_listener_gives_a_newcomer_the_oldest_slot_of_the_largest_holder() {
        let h = from(&[
            Some(2),
            Some(3),
            Some(2),
            Some(3),
            Some(4),
            Some(4),
            Some(5),
            Some(5),
        ]);
        assert_eq!(slot_for(&h, ip(1), 8, 2), Slot::TakenFrom(1));
        // The largest holder alone, though its handshakes are not the oldest.
        let h = from(&[Some(2), Some(3), Some(4), Some(4), Some(4), None]);
        assert_eq!(slot_for(&h, ip(1), 6, 4), Slot::TakenFrom(3));
    }

    /// A slot moves only to a source holding at least two fewer, so that it then holds no
    /// more than the source it took the slot from.
    #[test]
    fn slots_do_not_move_between_sources_that_hold_about_as_many() {
        let h = from(&[Some(2), Some(2), Some(3)]);
        assert!(matches!(slot_for(&h, ip(3), 3, 4), Slot::Refused(_)));
        assert_eq!(slot_for(&h, ip(4), 3, 4), Slot::TakenFrom(1));
        // One slot per source: a newcomer takes none.
        let h = from(&[Some(2), Some(3), Some(4)]);
        let Slot::Refused(why) = slot_for(&h, ip(5), 3, 4) else {
            panic!("a slot moved between sources holding one each")
        };
        assert!(
            why.contains("3 handshakes") && why.contains("127.0.0.5"),
            "{why}"
        );
    }

    #[test]
    fn our_own_dials_count_and_are_never_taken() {
        let h = from(&[None, None, None]);
        assert!(matches!(slot_for(&h, ip(2), 3, 2), Slot::Refused(_)));
        let h = from(&[None, Some(3), Some(3)]);
        assert_eq!(slot_for(&h, ip(2), 3, 2), Slot::TakenFrom(2));
    }
}
