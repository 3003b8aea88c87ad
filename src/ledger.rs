//! The ledger gRPC service of the examples and tests (`examples/proto/ledger.proto`): books
//! every charge that reaches it, with the fencing metadata it came with. A charge to an
//! account named `slow-<ms>` takes that long, and, in books made with [`Books::holding`],
//! one to the account `held` waits for [`Books::release_held`] (tests hold a call in flight
//! with them).

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicUsize, Ordering},
};

use tonic::{Request, Response, Status, Streaming};

/// The code generated from `ledger.proto` (package `ledger.v1`).
#[allow(missing_docs, unreachable_pub, clippy::all)]
pub mod proto {
    tonic::include_proto!("ledger.v1");
}

use proto::{ChargeReply, ChargeRequest, ledger_server::Ledger};

/// One booked charge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its number, from 1.
    pub entry: u64,
    /// The account charged.
    pub account: String,
    /// The amount.
    pub amount_cents: i64,
    /// The `x-fencing-job` metadata of its call, if any.
    pub job: Option<String>,
    /// The `x-fencing-token` metadata of its call, if any.
    pub token: Option<String>,
}

/// A ledger in memory. Clones share the books.
#[derive(Debug, Clone, Default)]
pub struct Books {
    entries: Arc<Mutex<Vec<Entry>>>,
    /// Unary charges that reached the service, booked or not yet.
    reached: Arc<AtomicUsize>,
    /// What a charge to the account `held` waits for, in books made with `holding`: closed
    /// by `release_held`. None: such a charge is booked like any other.
    held: Option<Arc<tokio::sync::Semaphore>>,
}

impl Books {
    /// Books where a charge to the account `held` waits until [`release_held`](Self::release_held)
    /// (a test's call held in flight past the fence). The examples' books book it at once.
    #[must_use]
    pub fn holding() -> Self {
        Self {
            held: Some(Arc::new(tokio::sync::Semaphore::new(0))),
            ..Self::default()
        }
    }

    /// How many unary charges have reached the service so far (those still running too): a
    /// test's sign that a call is in flight past the fence.
    pub fn reached(&self) -> usize {
        self.reached.load(Ordering::SeqCst)
    }

    /// Lets every charge to the account `held` go on, now and from now on.
    pub fn release_held(&self) {
        if let Some(held) = &self.held {
            held.close();
        }
    }

    /// Every charge booked so far, in order.
    pub fn entries(&self) -> Vec<Entry> {
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn book(&self, request: &ChargeRequest, metadata: &tonic::metadata::MetadataMap) -> u64 {
        let text = |name: &str| {
            metadata
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let entry = entries.len() as u64 + 1;
        entries.push(Entry {
            entry,
            account: request.account.clone(),
            amount_cents: request.amount_cents,
            job: text("x-fencing-job"),
            token: text("x-fencing-token"),
        });
        entry
    }
}

#[tonic::async_trait]
impl Ledger for Books {
    async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        self.reached.fetch_add(1, Ordering::SeqCst);
        if let Some(held) = &self.held
            && request.get_ref().account == "held"
        {
            // Closed, not granted: the semaphore never has a permit.
            let _ = held.acquire().await;
        }
        if let Some(ms) = request.get_ref().account.strip_prefix("slow-") {
            let ms = ms.parse().unwrap_or(0u64).min(60_000);
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        }
        let entry = self.book(request.get_ref(), request.metadata());
        Ok(Response::new(ChargeReply { entry, booked: 1 }))
    }

    async fn charge_many(
        &self,
        request: Request<Streaming<ChargeRequest>>,
    ) -> Result<Response<ChargeReply>, Status> {
        let metadata = request.metadata().clone();
        let mut stream = request.into_inner();
        let mut charges = Vec::new();
        while let Some(charge) = stream.message().await? {
            charges.push(charge);
        }
        let (mut entry, booked) = (0, u32::try_from(charges.len()).unwrap_or(u32::MAX));
        for charge in &charges {
            entry = self.book(charge, &metadata);
        }
        Ok(Response::new(ChargeReply { entry, booked }))
    }
}
