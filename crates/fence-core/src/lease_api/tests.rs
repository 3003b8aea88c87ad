//! The typed lease API's tests: paths, bodies, queries, percent-encoding.

use super::*;

#[test]
fn paths_percent_encode_the_job() {
    let job: JobId = "a/b%c?d#e f".replace(' ', "+").parse().unwrap();
    assert_eq!(
        lease_path(&job, Some(Action::Claim)),
        "/v1/leases/a%2Fb%25c%3Fd%23e%2Bf/claim"
    );
    assert_eq!(
        lease_path(&"x~_.-9".parse().unwrap(), None),
        "/v1/leases/x~_.-9"
    );
}

#[test]
fn requests_round_trip_and_bad_ones_name_the_field() {
    let key = "k".repeat(22);
    let renew = RenewRequest {
        owner: "w".parse().unwrap(),
        generation: Generation::new(u64::MAX),
        lease_key: key.parse().unwrap(),
        ttl: Ttl::MIN,
    };
    let json = serde_json::to_string(&renew).unwrap();
    assert_eq!(
        json,
        format!(
            r#"{{"owner":"w","generation":18446744073709551615,"lease_key":"{key}","ttl_ms":100}}"#
        )
    );
    assert_eq!(RenewRequest::from_json(json.as_bytes()).unwrap(), renew);
    let claim =
        ClaimRequest::from_json(format!(r#"{{"owner": "w", "lease_key": "{key}"}}"#).as_bytes())
            .unwrap();
    assert_eq!(claim.ttl, Ttl::DEFAULT, "ttl_ms defaults to 30 s");
    let with_key = |rest: &str| format!(r#"{{"lease_key": "{key}", {rest}}}"#);
    for (body, want) in [
        ("[]".to_owned(), "body: must be a JSON object"),
        (with_key(r#""generation": 1"#), "owner: missing"),
        (
            with_key(r#""owner": "w", "generation": -1"#),
            "generation: must be an integer from 0",
        ),
        (
            with_key(r#""owner": "w", "generation": 1, "ttl_ms": 5"#),
            "ttl_ms: unknown field",
        ),
        (
            r#"{"owner": "w", "generation": 1}"#.into(),
            "lease_key: missing",
        ),
        (
            r#"{"owner": "w", "generation": 1, "lease_key": 7}"#.into(),
            "lease_key: must be a string",
        ),
        (
            r#"{"owner": "w", "generation": 1, "lease_key": ""}"#.into(),
            "lease_key: must be 22 to 128",
        ),
    ] {
        let e = FinishRequest::from_json(body.as_bytes()).unwrap_err();
        assert!(e.to_string().starts_with(want), "{e} lacks {want}");
    }
}

#[test]
fn states_are_lower_case_words() {
    for (state, word) in [
        (LeaseState::Free, "free"),
        (LeaseState::Held, "held"),
        (LeaseState::Expired, "expired"),
        (LeaseState::Completed, "completed"),
    ] {
        assert_eq!(serde_json::to_value(state).unwrap(), word);
        assert_eq!(state.as_str(), word);
        assert_eq!(
            serde_json::from_value::<LeaseState>(word.into()).unwrap(),
            state
        );
    }
    assert!(serde_json::from_value::<LeaseState>("Held".into()).is_err());
}

#[test]
fn a_field_given_twice_is_refused_not_read_as_the_last() {
    let key = "k".repeat(22);
    let body = format!(r#"{{"owner": "a", "lease_key": "{key}", "owner": "b"}}"#);
    let e = ClaimRequest::from_json(body.as_bytes()).unwrap_err();
    assert!(e.to_string().starts_with("owner: given twice"), "{e}");
    let e = ClaimRequest::from_json(b"[1]").unwrap_err();
    assert!(e.to_string().contains("must be a JSON object"), "{e}");
    let e = ClaimRequest::from_json(b"{\"owner\":").unwrap_err();
    assert!(e.to_string().contains("not valid JSON"), "{e}");
}
