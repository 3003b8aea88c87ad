//! A third-party API that cannot check fencing tokens but deduplicates by `Idempotency-Key`
//! (a payment provider): with the derived key `lease.idempotency_key(step)`, a stale holder
//! and the new holder sending the same step are charged once (contract section 11).
//!
//! Our own sink stands in for the provider: idempotency on, and every request carries the
//! same constant "credential" as its fencing pair, so its fence never refuses anything: only
//! the key deduplicates, as at a provider.

use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use fence_core::headers::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyKey};
use fence_lease::{LeaseClient, ManualClock, MemoryLeaseStore, Ttl};
use fence_sink::{FenceLayer, MemoryStore, RequestBody};
use http::{Request, Response};
use http_body_util::BodyExt;
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};

/// The provider: one charge per request that reaches it, answered with its number.
fn provider(
    charges: Arc<AtomicUsize>,
) -> impl Service<
    Request<String>,
    Response = Response<fence_sink::ResponseBody<String>>,
    Error = Infallible,
    Future: Send,
> + Clone {
    ServiceBuilder::new()
        .layer(FenceLayer::new(MemoryStore::new()))
        .service(service_fn(move |_: Request<RequestBody<String>>| {
            let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
            async move { Ok::<_, Infallible>(Response::new(format!("ch_{n}"))) }
        }))
}

/// `POST /v1/charges` with the merchant's constant credential and `key`: (body, replayed).
async fn charge<S>(provider: &mut S, key: &IdempotencyKey) -> (String, bool)
where
    S: Service<Request<String>, Response = Response<fence_sink::ResponseBody<String>>>,
    S::Error: std::fmt::Debug,
{
    let request = Request::post("/v1/charges")
        .header("x-fencing-job", "merchant-account")
        .header("x-fencing-token", "1")
        .header(IDEMPOTENCY_KEY, key.as_str())
        .body(r#"{"amount": 4200, "currency": "eur"}"#.to_owned())
        .unwrap();
    let response = provider.ready().await.unwrap().call(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let replayed = response.headers().contains_key(IDEMPOTENT_REPLAYED);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (String::from_utf8(body.to_vec()).unwrap(), replayed)
}

#[tokio::test]
async fn a_stale_and_a_new_holder_sending_the_same_step_are_charged_once() {
    let clock = ManualClock::new(1_700_000_000_000);
    let store = Arc::new(MemoryLeaseStore::with_clock(Arc::new(clock.clone())));
    let ttl = Ttl::from_millis(1_000).unwrap();
    let job: fence_core::JobId = "order-7".parse().unwrap();
    let charges = Arc::new(AtomicUsize::new(0));
    let mut provider = provider(charges.clone());

    // A holds the job and charges; then it stalls, its lease runs out and B takes over.
    let a = LeaseClient::from_arc(store.clone())
        .owner("a".parse().unwrap())
        .ttl(ttl);
    let lease_a = a.claim(job.clone()).await.unwrap();
    let key_a = lease_a.view().idempotency_key("charge");
    assert_eq!(charge(&mut provider, &key_a).await, ("ch_1".into(), false));
    clock.advance(Duration::from_secs(5));
    let lease_b = LeaseClient::from_arc(store.clone())
        .owner("b".parse().unwrap())
        .ttl(ttl)
        .claim(job.clone())
        .await
        .unwrap();
    assert_eq!(lease_b.generation().get(), 2);
    let key_b = lease_b.view().idempotency_key("charge");
    assert_eq!(key_a, key_b, "the same step of the same job: the same key");

    // B repeats the step A already sent (B cannot know it was): the provider replays A's
    // charge instead of charging again. So does A's late retry.
    assert_eq!(charge(&mut provider, &key_b).await, ("ch_1".into(), true));
    assert_eq!(charge(&mut provider, &key_a).await, ("ch_1".into(), true));
    assert_eq!(charges.load(Ordering::SeqCst), 1, "charged once");

    // Another step, or the same step of another job, is another charge.
    let refund = lease_b.view().idempotency_key("refund");
    assert_ne!(refund, key_b);
    assert_eq!(charge(&mut provider, &refund).await, ("ch_2".into(), false));
    let other = IdempotencyKey::for_step(&"order-8".parse().unwrap(), "charge");
    assert_ne!(other, key_b);
    assert_eq!(charge(&mut provider, &other).await, ("ch_3".into(), false));

    // The control: keys made per holder (a fresh one each time, as many clients do) let
    // the new holder's repeat through as a second charge.
    let fresh = |who: &str| IdempotencyKey::for_step(&job, &format!("charge-by-{who}"));
    assert!(!charge(&mut provider, &fresh("a")).await.1);
    assert!(!charge(&mut provider, &fresh("b")).await.1);
    assert_eq!(
        charges.load(Ordering::SeqCst),
        5,
        "per-holder keys charge twice"
    );
}
