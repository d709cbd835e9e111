//! Concurrent identical reads share one request.
//!
//! A burst of callers each reading the node list, the cluster's VMs or a
//! storage's status at the same moment would send pveproxy one identical
//! request each. For the reads listed in [`SHARED_OPS`] (idempotent GETs
//! whose answer is the same for every caller at that instant), the first
//! caller sends the request and the callers that ask while it is in flight
//! wait for its answer instead of sending their own. Nobody gets an answer
//! older than its own question's arrival: a flight is joined only while it
//! is in flight, and a finished one is never reused.
//!
//! Only a success is shared. When the first caller's request fails (or it
//! is cancelled), each waiter sends its own request, so every caller gets
//! its own error with its own classification.

use std::collections::HashMap;
use std::sync::Mutex;

use bytes::Bytes;
use tokio::sync::watch;

/// The reads that may be shared: idempotent, and the same for every
/// caller at one instant. Not `nextid` (its callers each want an id), not
/// task or guest reads (one caller each).
pub(super) const SHARED_OPS: &[&str] = &[
    "nodes",
    "cluster_resources",
    "node_vms",
    "node_storages",
    "storage_status",
    "pci_mappings",
];

/// A read in flight: `None` until it ends; then the body of its success,
/// or `None` inside for a failure.
type Flight = watch::Receiver<Option<Option<Bytes>>>;

/// The reads in flight, by request line.
#[derive(Default)]
pub(super) struct InFlight {
    flights: Mutex<HashMap<String, Flight>>,
}

/// What a caller of a shared read is.
pub(super) enum Role<'a> {
    /// It sends the request and publishes the answer through this.
    Leader(Lead<'a>),
    /// It waits for the answer of the request in flight.
    Follower(Flight),
}

/// The first caller's duty: publish what its request got. Dropped without
/// publishing (cancelled), its followers send their own requests.
pub(super) struct Lead<'a> {
    owner: &'a InFlight,
    key: String,
    tx: Option<watch::Sender<Option<Option<Bytes>>>>,
}

impl Lead<'_> {
    /// Publishes the body of a success (`None`: it failed).
    pub(super) fn finish(mut self, body: Option<Bytes>) {
        self.owner.end(&self.key);
        if let Some(tx) = self.tx.take() {
            // Followers that gave up waiting are gone; nothing to tell.
            let _ = tx.send(Some(body));
        }
    }
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        if self.tx.is_some() {
            self.owner.end(&self.key);
        }
    }
}

impl InFlight {
    /// Joins the flight of `key`, or starts it.
    pub(super) fn join(&self, key: String) -> Role<'_> {
        let mut flights = self.flights.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(rx) = flights.get(&key) {
            return Role::Follower(rx.clone());
        }
        let (tx, rx) = watch::channel(None);
        flights.insert(key.clone(), rx);
        Role::Leader(Lead {
            owner: self,
            key,
            tx: Some(tx),
        })
    }

    /// Ends the flight of `key`: later callers start their own.
    fn end(&self, key: &str) {
        self.flights
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
    }
}

/// What a follower gets: the leader's success, or `None` (it failed or
/// was cancelled), when the follower sends its own request.
pub(super) async fn wait(mut flight: Flight) -> Option<Bytes> {
    match flight.wait_for(Option::is_some).await {
        Ok(v) => v.clone().flatten(),
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn followers_get_the_leaders_success_and_nothing_of_a_failure() {
        let f = InFlight::default();
        let Role::Leader(lead) = f.join("GET /nodes".into()) else {
            panic!("the first caller leads");
        };
        let Role::Follower(a) = f.join("GET /nodes".into()) else {
            panic!("a second caller follows");
        };
        let other = f.join("GET /nodes/pve1/qemu".into());
        assert!(matches!(other, Role::Leader(_)), "another read flies alone");
        let waiting = tokio::spawn(wait(a));
        lead.finish(Some(Bytes::from_static(b"{\"data\":[]}")));
        assert_eq!(
            waiting.await.unwrap().as_deref(),
            Some(&b"{\"data\":[]}"[..])
        );
        // Finished: the next caller leads a new flight.
        let Role::Leader(lead) = f.join("GET /nodes".into()) else {
            panic!("a finished flight is not joined");
        };
        let Role::Follower(b) = f.join("GET /nodes".into()) else {
            panic!("follows");
        };
        let waiting = tokio::spawn(wait(b));
        lead.finish(None);
        assert_eq!(waiting.await.unwrap(), None, "a failure is not shared");
        // A cancelled leader sets its followers free.
        let Role::Leader(lead) = f.join("GET /nodes".into()) else {
            panic!("leads");
        };
        let Role::Follower(c) = f.join("GET /nodes".into()) else {
            panic!("follows");
        };
        drop(lead);
        assert_eq!(wait(c).await, None);
        assert!(matches!(f.join("GET /nodes".into()), Role::Leader(_)));
    }
}
