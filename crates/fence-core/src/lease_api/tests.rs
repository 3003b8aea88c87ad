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

/// A field or parameter name is the client's: one with a line break (or any byte but visible
/// ASCII) is quoted and escaped in the error, which goes into the answer and the log, so it
/// cannot forge a log line.
#[test]
fn a_name_with_a_line_break_is_escaped_not_copied() {
    let key = "k".repeat(22);
    let forged = "x\nWARN forged: \"lease granted\"";
    let body = serde_json::json!({"owner": "a", "lease_key": key, forged: 1}).to_string();
    let e = ClaimRequest::from_json(body.as_bytes()).unwrap_err();
    let said = e.to_string();
    assert!(!said.contains('\n') && !said.contains('\r'), "{said:?}");
    assert!(
        said.starts_with(r#""x\nWARN forged: \"lease granted\"": unknown field"#),
        "{said}"
    );
    let twice = "{\"a\\r\\nb\": 1, \"a\\r\\nb\": 2}";
    let said = ClaimRequest::from_json(twice.as_bytes())
        .unwrap_err()
        .to_string();
    assert!(said.starts_with(r#""a\r\nb": given twice"#), "{said}");
    for query in ["x%0Ay=1", "x%0Ay=1&x%0Ay=2", "x%0D%0Ay=%zz"] {
        let said = ListQuery::from_query(query).unwrap_err().to_string();
        assert!(
            !said.contains('\n') && !said.contains('\r'),
            "{query}: {said:?}"
        );
    }
    // An ordinary name reads as before.
    let body = format!(r#"{{"owner": "a", "lease_key": "{key}", "extra": 1}}"#);
    let said = ClaimRequest::from_json(body.as_bytes())
        .unwrap_err()
        .to_string();
    assert!(said.starts_with("extra: unknown field"), "{said}");
}

/// The wait parser accepts exactly what [`WAIT_PATTERN`] matches, run as a regular
/// expression (as a client generated from the OpenAPI document runs it), over every value of
/// the forms it describes and the near misses.
#[test]
fn the_wait_grammar_is_exactly_its_pattern() {
    let pattern = regex::Regex::new(WAIT_PATTERN).unwrap();
    let matches = |v: &str| pattern.is_match(v);
    let mut values = Vec::new();
    for n in (0..=61_000)
        .step_by(7)
        .chain([59, 60, 61, 59_999, 60_000, 60_001])
    {
        for unit in ["ms", "s", "", "m", "S", " ms"] {
            values.push(format!("{n}{unit}"));
            values.push(format!("0{n}{unit}"));
        }
    }
    values.extend(
        [
            "",
            "ms",
            "s",
            "-1s",
            "+1s",
            "1.5s",
            "1e3ms",
            "10 s",
            "1m",
            "soon",
            "99999999999999999999ms",
        ]
        .map(String::from),
    );
    for v in &values {
        assert_eq!(parse_wait(v).is_ok(), matches(v), "{v:?}");
    }
    assert_eq!(
        parse_wait("60").unwrap(),
        std::time::Duration::from_secs(60)
    );
    assert_eq!(
        parse_wait("250ms").unwrap(),
        std::time::Duration::from_millis(250)
    );
    assert!(parse_wait("61s").unwrap_err().contains("60s"));
}

/// The OpenAPI document served at `/openapi.json` states the rules these types enforce:
/// the wait pattern, the id and key patterns and lengths, the reason's length, the TTL and
/// list ranges.
#[test]
fn the_openapi_document_states_the_enforced_rules() {
    let doc: Value = serde_json::from_str(include_str!("../../../../docs/openapi.json")).unwrap();
    let schema = |name: &str| doc["components"]["schemas"][name].clone();
    let wait = doc["paths"]["/v1/leases/{job}/claim"]["post"]["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "wait")
        .unwrap()["schema"]
        .clone();
    assert_eq!(wait["pattern"], WAIT_PATTERN);
    for id in ["JobId", "Owner"] {
        assert_eq!(schema(id)["pattern"], "^[!-~]+$", "{id}");
        assert_eq!(schema(id)["minLength"], 1, "{id}");
        assert_eq!(schema(id)["maxLength"], crate::MAX_ID_LEN, "{id}");
    }
    assert_eq!(schema("LeaseKey")["minLength"], LeaseKey::MIN_LEN);
    assert_eq!(schema("LeaseKey")["maxLength"], LeaseKey::MAX_LEN);
    assert_eq!(schema("TtlMs")["minimum"], Ttl::MIN.as_millis());
    assert_eq!(schema("TtlMs")["maximum"], Ttl::MAX.as_millis());
    assert_eq!(
        schema("RevokeRequest")["properties"]["reason"]["maxLength"],
        MAX_REASON_LEN
    );
    let list = &doc["paths"]["/v1/leases"]["get"]["parameters"];
    let param = |name: &str| {
        list.as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap()["schema"]
            .clone()
    };
    assert_eq!(param("limit")["maximum"], MAX_LIST_LIMIT);
    assert_eq!(param("after")["$ref"], "#/components/schemas/JobId");
    assert_eq!(param("prefix")["maxLength"], crate::MAX_ID_LEN);

    // The patterns, run as regular expressions, against the parsers.
    let re = |p: &Value| regex::Regex::new(p.as_str().unwrap()).unwrap();
    let (job_id, prefix) = (
        re(&schema("JobId")["pattern"]),
        re(&param("prefix")["pattern"]),
    );
    let reason = re(&schema("RevokeRequest")["properties"]["reason"]["pattern"]);
    for s in [
        "a", "a/b", "a%b", "~!", "a b", "é", "a\tb", "\u{7f}", "x\n", "",
    ] {
        let id_ok = JobId::new(s).is_ok();
        assert_eq!(job_id.is_match(s) && !s.is_empty(), id_ok, "job id {s:?}");
        let listed = ListQuery::from_query(&format!("prefix={}", percent_encode(s))).is_ok();
        assert_eq!(prefix.is_match(s), listed, "prefix {s:?}");
        let body = serde_json::json!({ "reason": s }).to_string();
        assert_eq!(
            reason.is_match(s),
            RevokeRequest::from_json(body.as_bytes()).is_ok(),
            "reason {s:?}"
        );
    }
    for control in ["\u{0}", "\u{1f}", "\u{80}", "\u{9f}"] {
        assert!(!reason.is_match(&format!("a{control}b")), "{control:?}");
    }
}

#[test]
fn out_of_range_numbers_state_the_range_enforced() {
    let key = "k".repeat(22);
    let err = ClaimRequest::from_json(
        format!(r#"{{"owner":"w","lease_key":"{key}","ttl_ms":-1}}"#).as_bytes(),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "ttl_ms: must be an integer from 100 to 86400000 (milliseconds), got -1"
    );
    let long = "é".repeat(MAX_REASON_LEN);
    let ok = RevokeRequest::from_json(format!(r#"{{"reason":"{long}"}}"#).as_bytes());
    assert!(
        ok.is_ok(),
        "512 characters are allowed, whatever their bytes"
    );
    let err =
        RevokeRequest::from_json(format!(r#"{{"reason":"{long}e"}}"#).as_bytes()).unwrap_err();
    assert!(err.to_string().contains("512 characters"), "{err}");
    assert!(ListQuery::from_query("limit=+5").is_err());
    assert!(ListQuery::from_query("limit=5").is_ok());
}

/// JSON Schema's `integer` admits `7.0`; so do the bodies, where the number is exact.
#[test]
fn whole_numbers_written_with_a_fraction_are_integers_where_exact() {
    let key = "k".repeat(22);
    let renew = |g: &str| {
        RenewRequest::from_json(
            format!(r#"{{"owner":"w","lease_key":"{key}","generation":{g},"ttl_ms":1000.0}}"#)
                .as_bytes(),
        )
    };
    assert_eq!(renew("7.0").unwrap().generation, Generation::new(7));
    assert_eq!(renew("7").unwrap().generation, Generation::new(7));
    // Found by schemathesis: without serde_json's `float_roundtrip`, its fast float parser
    // read this one ULP low (2233946853001952.75) and the body was refused as not whole.
    for exact in [
        2_233_946_853_001_953_u64,
        9_007_199_254_740_991,
        4_503_599_627_370_497,
    ] {
        assert_eq!(
            renew(&format!("{exact}.0")).unwrap().generation,
            Generation::new(exact),
            "{exact}.0"
        );
    }
    for refused in ["7.5", "-1.0", "9007199254740993.0", "1e300", "-0.5"] {
        assert!(renew(refused).is_err(), "{refused}");
    }
    assert_eq!(
        renew("18446744073709551615").unwrap().generation,
        Generation::new(u64::MAX)
    );
}
