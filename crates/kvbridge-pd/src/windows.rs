//! Which pages of the receiver's buffer each sender may write: one write window per page a
//! push request reserved (and does not already hold), opened for its sender when the pages
//! are granted and closed when that chunk's `Written` arrives or the request completes.
//!
//! A request that ends otherwise (cancelled, expired, its sender down) keeps its windows
//! until its pages are granted again: an honest sender may still be writing them until it
//! acknowledges the fence, and a refused write would end its whole session. Before pages
//! go to a new request, every window still on them is closed and the writes that passed
//! it are waited for ([`PageWindows::claim`]), so nothing of the old holder lands in the
//! new holder's pages.

use kvbridge::{Channel, PeerId, RegionId, WindowDrain, WindowId};
use std::collections::HashMap;
use std::sync::Arc;

/// The open windows of the buffer and the closed ones whose writes may still land.
#[derive(Default)]
pub(crate) struct PageWindows {
    /// Per page, the window open on it: its request and its sender.
    open: HashMap<u32, (String, PeerId, WindowId)>,
    /// Per request, its pages with an open window.
    by_req: HashMap<String, Vec<u32>>,
    /// Per page, a closed window's writes that were still landing when it closed, and whose
    /// they were.
    landing: HashMap<u32, (PeerId, Arc<WindowDrain>)>,
}

/// Writes of a previous holder that must end before pages change hands.
pub(crate) type Landing = Vec<(PeerId, Arc<WindowDrain>)>;

impl PageWindows {
    /// Closes the window on `page`, if any; its writes still landing are remembered.
    fn close_page(&mut self, ch: &Channel, page: u32) {
        let Some((req, peer, wid)) = self.open.remove(&page) else {
            return;
        };
        if let Some(pages) = self.by_req.get_mut(&req) {
            pages.retain(|p| *p != page);
            if pages.is_empty() {
                self.by_req.remove(&req);
            }
        }
        if let Some(d) = ch.close_window(wid) {
            if !d.is_drained() {
                self.landing.insert(page, (peer, Arc::new(d)));
            }
        }
    }

    /// Gives `pages` to `req` of `peer` for writing: closes whatever window is still on
    /// them, opens one per page, and returns the old holders' writes that are still landing
    /// (the grant must wait for them before the new holder hears of its pages).
    pub(crate) fn claim(
        &mut self,
        ch: &Channel,
        region: RegionId,
        page_bytes: u64,
        req: &str,
        peer: &PeerId,
        pages: &[u32],
    ) -> kvbridge::Result<Landing> {
        let mut landing = Vec::new();
        for &page in pages {
            self.close_page(ch, page);
            if let Some((p, d)) = self.landing.remove(&page) {
                if !d.is_drained() {
                    landing.push((p, d));
                }
            }
        }
        for &page in pages {
            let wid = ch.open_window(region, peer, u64::from(page) * page_bytes, page_bytes)?;
            self.open.insert(page, (req.to_string(), peer.clone(), wid));
            self.by_req.entry(req.to_string()).or_default().push(page);
        }
        Ok(landing)
    }

    /// The chunk on `page` landed: its sender writes it no more.
    pub(crate) fn landed(&mut self, ch: &Channel, req: &str, page: u32) {
        if self.open.get(&page).is_some_and(|(r, _, _)| r == req) {
            self.close_page(ch, page);
        }
    }

    /// `req` completed: nothing of it is written any more.
    pub(crate) fn completed(&mut self, ch: &Channel, req: &str) {
        for page in self.by_req.remove(req).unwrap_or_default() {
            self.close_page(ch, page);
        }
        self.landing.retain(|_, (_, d)| !d.is_drained());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbridge::{ChannelConfig, Grant, Op, Region, Transport};
    use std::time::Duration;

    /// Pages claimed for a new request while the previous holder's write into them is still
    /// landing (held 1 s by the receiver after it passed the window) come with that write:
    /// the grant waits for it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_returns_the_old_holders_writes_still_landing() {
        const PAGE: u64 = 4096;
        let mut c = ChannelConfig::new("decode-0", Some("127.0.0.1:0"));
        c.transport = Transport::Tcp;
        c.hooks.write_apply_delay = Some(Duration::from_secs(1));
        let rx = Channel::new(c).await.unwrap();
        let buf = Region::alloc(2 * PAGE as usize, PAGE as usize).unwrap();
        rx.register(&buf, Grant::AllPeers.write_only().writes_in_windows())
            .unwrap();
        let mut c = ChannelConfig::new("prefill-h", None);
        c.transport = Transport::Tcp;
        let tx = Channel::new(c).await.unwrap();
        let src = Region::alloc(PAGE as usize, PAGE as usize).unwrap();
        tx.register(&src, Grant::AllPeers).unwrap();
        let decoder = tx
            .connect(&rx.local_addr().unwrap().to_string())
            .await
            .unwrap();
        let (h, v) = (
            PeerId::new("prefill-h").unwrap(),
            PeerId::new("prefill-v").unwrap(),
        );
        let mut w = PageWindows::default();
        let first = w.claim(&rx, buf.id(), PAGE, "A", &h, &[0]).unwrap();
        assert!(first.is_empty());
        let remote = buf.id();
        let write = tokio::spawn(async move {
            let r = tx
                .write(&decoder, &[Op::page(&src, 0, remote, 0, PAGE as usize)])
                .await;
            (r, tx)
        });
        // The write passed the window and is held before its bytes are applied.
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        while buf.in_use() == 0 && tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(buf.in_use() > 0, "the write never reached the receiver");
        let landing = w.claim(&rx, buf.id(), PAGE, "B", &v, &[0]).unwrap();
        assert_eq!(
            landing.len(),
            1,
            "the old holder's write was not waited for"
        );
        assert_eq!(landing[0].0, h);
        assert!(!landing[0].1.is_drained());
        tokio::time::timeout(Duration::from_secs(5), landing[0].1.drained())
            .await
            .expect("drained once the write landed");
        let (r, _tx) = write.await.unwrap();
        r.unwrap();
        // The new holder's window is open, the old one's closed.
        let w2 = w.claim(&rx, buf.id(), PAGE, "C", &h, &[1]).unwrap();
        assert!(w2.is_empty());
    }
}
