//! Signed tokens at the destination (contract section 6): forged, unsigned and rotated-out
//! tokens get 403, never reach the service and never move `highest`.

mod common;

use std::convert::Infallible;

use common::CountingSink;
use fence_core::{
    Generation, JobId,
    signing::{TokenSigner, TokenVerifier},
};
use fence_sink::{FenceLayer, MemoryStore, RequestBody};
use http::{Request, Response};
use tower::{Layer, ServiceExt, service_fn};

fn signer(seed: u8) -> TokenSigner {
    TokenSigner::from_seed([seed; 32])
}

/// A lease end an hour from now (once, for the whole test binary): these tests are about
/// signatures, not expiry, and a lease longer than any the server grants is refused.
static LATER_MS: std::sync::LazyLock<u64> =
    std::sync::LazyLock::new(|| fence_storage::clock::system_now_ms() + 3_600_000);

fn later() -> u64 {
    *LATER_MS
}

fn token(s: &TokenSigner, job: &str, generation: u64) -> String {
    s.sign(
        &job.parse::<JobId>().unwrap(),
        Generation::new(generation),
        later(),
    )
}

/// The signature part of a token.
fn signature(token: &str) -> &str {
    token.rsplit('.').next().unwrap()
}

fn new_sink(verifier: TokenVerifier) -> CountingSink<MemoryStore> {
    CountingSink::new(FenceLayer::new(MemoryStore::new()).require_signatures(verifier))
}

#[tokio::test]
async fn forged_tokens_get_403_and_never_move_highest() {
    let (key, other) = (signer(1), signer(2));
    let sink = new_sink(TokenVerifier::new([key.verify_key()]));
    assert_eq!(sink.send("job", &token(&key, "job", 5)).await.0, 200);
    let good = token(&key, "job", 6);
    let sig6 = signature(&good);
    let refused = [
        token(&other, "job", 6), // right syntax, wrong key
        token(&key, "other-job", 6).replace("other-job", "job"), // a valid signature for another job
        format!("6.{}.{}", later(), signature(&token(&key, "job", 7))), // for another generation
        format!("6.{}.{sig6}", later() + 1),                     // for another lease end
        format!("6.{}.{}", later(), "A".repeat(86)),             // well-formed garbage
        "18446744073709551615".into(), // the attacker's huge number, unsigned
        format!("18446744073709551615.{}.{sig6}", later()),
        "6".into(), // unsigned
    ];
    for forged in &refused {
        let (status, problem) = sink.send("job", forged).await;
        assert_eq!(status, 403, "{forged}");
        assert_eq!(problem["type"], "urn:fence:invalid-signature", "{forged}");
        assert_eq!(problem["job"], "job");
    }
    // Not of either syntax: 400, whatever the keys.
    let malformed = [
        format!("6.{}.{}", later(), &sig6[..sig6.len() - 2]), // truncated
        format!("6.{}.{sig6}==", later()),                    // padded
        format!("6.{}.{}", later(), "+".repeat(86)),          // standard base64, not base64url
        format!("6.{sig6}"),                                  // version 1: two parts
        "6.".into(),
        "x.abc".into(),
        "1.5".into(),
    ];
    for bad in &malformed {
        let (status, problem) = sink.send("job", bad).await;
        assert_eq!(status, 400, "{bad}");
        assert_eq!(problem["type"], "urn:fence:malformed-token", "{bad}");
    }
    assert_eq!(sink.calls(), 1, "no forged request reached the service");
    // highest is still 5: the legitimate holder of 5 keeps writing, and 6 then bumps.
    assert_eq!(sink.send("job", &token(&key, "job", 5)).await.0, 200);
    assert_eq!(sink.send("job", &good).await.0, 200);
    assert_eq!(
        sink.send("job", &token(&key, "job", 5)).await.0,
        409,
        "a verified newer token still fences older ones"
    );
}

#[tokio::test]
async fn rotated_out_keys_are_rejected_once_removed() {
    let (old, new) = (signer(3), signer(4));
    let during = new_sink(TokenVerifier::new([old.verify_key(), new.verify_key()]));
    assert_eq!(
        during.send("j", &token(&old, "j", 1)).await.0,
        200,
        "the old key is listed"
    );
    assert_eq!(
        during.send("j", &token(&new, "j", 2)).await.0,
        200,
        "the new key is listed"
    );
    let after = new_sink(TokenVerifier::new([new.verify_key()]));
    assert_eq!(
        after.send("j", &token(&old, "j", 1)).await.0,
        403,
        "the old key was removed"
    );
    assert_eq!(after.send("j", &token(&new, "j", 1)).await.0, 200);
}

#[tokio::test]
async fn without_verification_a_signed_token_counts_by_its_generation() {
    let key = signer(5);
    let layer = FenceLayer::new(MemoryStore::new());
    let inner = service_fn(|_req: Request<RequestBody<String>>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    });
    let send = |t: String| {
        let svc = layer.layer(inner);
        async move {
            let req = Request::post("/")
                .header("x-fencing-job", "j")
                .header("x-fencing-token", t)
                .body(String::new())
                .unwrap();
            svc.oneshot(req).await.unwrap().status()
        }
    };
    assert_eq!(send(token(&key, "j", 7)).await, 200);
    assert_eq!(send("6".into()).await, 409);
    assert_eq!(send("7".into()).await, 200);
}
