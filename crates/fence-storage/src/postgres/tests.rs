//! The pool's options and identifiers, and the sessions it opens on the test database.

use super::{password::passfile_password, *};

#[test]
fn fence_reads_the_tls_and_password_options_itself() {
    let o = options(
        "postgres://u@h/db?sslmode=verify-full&sslrootcert=%2Ftmp%2Fca.pem&application_name=x",
    )
    .unwrap();
    assert_eq!(o.ssl, SslMode::VerifyFull);
    assert_eq!(o.root_cert, Some(PathBuf::from("/tmp/ca.pem")));
    assert_eq!(
        o.url,
        "postgres://u@h/db?application_name=x&sslmode=require"
    );
    assert_eq!(options("postgres://h/db").unwrap().ssl, SslMode::Prefer);
    assert_eq!(
        options("postgres://h/db?sslmode=disable").unwrap().url,
        "postgres://h/db?sslmode=disable"
    );
    assert!(options("postgres://h/db?sslmode=maybe").is_err());
    // A root certificate with a mode that would not use it: refused, saying what to give.
    for (query, want) in [
        ("sslrootcert=/ca.pem", "sslmode=prefer (the default)"),
        ("sslrootcert=/ca.pem&sslmode=prefer", "sslmode=prefer:"),
        ("sslmode=allow&sslrootcert=/ca.pem", "sslmode=allow:"),
        ("sslmode=disable&sslrootcert=/ca.pem", "sslmode=disable:"),
        (
            "sslrootcert=system&sslmode=require",
            "needs sslmode=verify-full",
        ),
        (
            "sslmode=verify-ca&sslrootcert=system",
            "not sslmode=verify-ca",
        ),
    ] {
        let said = options(&format!("postgres://h/db?{query}"))
            .unwrap_err()
            .to_string();
        assert!(said.contains(want), "{query}: {said}");
    }
    for mode in ["require", "verify-ca", "verify-full"] {
        let o = options(&format!(
            "postgres://h/db?sslrootcert=/ca.pem&sslmode={mode}"
        ))
        .unwrap();
        assert_eq!(o.root_cert, Some(PathBuf::from("/ca.pem")), "{mode}");
    }
    // `system`: the system's roots (no file of that name), verify-full by default.
    for query in [
        "sslrootcert=system",
        "sslrootcert=system&sslmode=verify-full",
    ] {
        let o = options(&format!("postgres://h/db?{query}")).unwrap();
        assert_eq!((o.ssl, o.root_cert), (SslMode::VerifyFull, None), "{query}");
    }
    let pgpass = "# comment\nother:5432:*:u:nope\nh:*:db:u:s3cr\\:et\n*:*:*:*:fallback\n";
    assert_eq!(
        passfile_password(pgpass, "h", 5432, "db", "u").as_deref(),
        Some("s3cr:et")
    );
    assert_eq!(
        passfile_password(pgpass, "x", 1, "y", "z").as_deref(),
        Some("fallback")
    );
}

/// The fence's own sessions run READ COMMITTED with deadlines on every wait, whatever
/// the database's defaults: checked on a database whose default is REPEATABLE READ (the
/// options reach the server, a space in a value escaped).
#[tokio::test]
async fn sessions_run_read_committed_with_deadlines() {
    let url = test_database_url();
    let (admin, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("the test database (PostgreSQL) answers");
    tokio::spawn(conn);
    if let Err(e) = admin.batch_execute("CREATE DATABASE fence_rr_probe").await {
        let code = e.as_db_error().map(|d| d.code().code());
        assert_eq!(code, Some("42P04"), "{e}"); // made by an earlier run
    }
    admin
        .batch_execute(
            "ALTER DATABASE fence_rr_probe SET default_transaction_isolation = 'repeatable read'",
        )
        .await
        .unwrap();
    let base = url.split('?').next().unwrap().rsplit_once('/').unwrap().0;
    let pool = connect_pool(&format!("{base}/fence_rr_probe")).unwrap();
    let client = pool.get().await.unwrap();
    let show = |name: &'static str| {
        let client = &client;
        async move {
            let row = client.query_one(&format!("SHOW {name}"), &[]).await;
            row.unwrap().get::<_, String>(0)
        }
    };
    assert_eq!(show("transaction_isolation").await, "read committed");
    assert_eq!(show("lock_timeout").await, "2s", "SESSION_LOCK_TIMEOUT");
    assert_eq!(
        show("idle_in_transaction_session_timeout").await,
        "5s",
        "SESSION_IDLE_IN_TRANSACTION_TIMEOUT"
    );
    assert_eq!(show("tcp_keepalives_idle").await, "10", "KEEPALIVE");
}

/// The client probes its connections too, after 10 s of silence rather than two hours;
/// keepalive settings in the URL win.
#[test]
fn sessions_send_keepalives_unless_the_url_says_otherwise() {
    let (config, _) = session("postgres://u@h/db").unwrap();
    assert!(config.get_keepalives());
    assert_eq!(config.get_keepalives_idle(), Duration::from_secs(10));
    assert_eq!(
        config.get_keepalives_interval(),
        Some(Duration::from_secs(5))
    );
    assert_eq!(config.get_keepalives_retries(), Some(3));
    let (config, _) =
        session("postgres://u@h/db?keepalives_idle=60&keepalives_interval=7&keepalives_retries=9")
            .unwrap();
    assert_eq!(config.get_keepalives_idle(), Duration::from_secs(60));
    assert_eq!(
        config.get_keepalives_interval(),
        Some(Duration::from_secs(7))
    );
    assert_eq!(config.get_keepalives_retries(), Some(9));
}

#[test]
fn identifiers_are_checked_by_one_rule() {
    assert!(Ident::new("table", "leases").is_ok());
    assert!(Ident::new("table", &"a".repeat(63)).is_ok());
    for bad in ["", "Fence", "x;drop", "1x", "a.b", "a b", &"a".repeat(64)] {
        let e = Ident::new("table", bad).unwrap_err();
        assert!(e.to_string().starts_with("invalid table name"), "{e}");
    }
}

/// The lease server's own deadline on a statement follows the session's statement_timeout:
/// the URL's, which wins over the fence's 5 s, in either spelling of `-c`.
#[test]
fn the_session_statement_timeout_is_the_urls_when_it_gives_one() {
    let of = |url: &str| session_statement_timeout(url);
    let five = Some(Duration::from_secs(5));
    assert_eq!(of("postgres://u@h/db"), five);
    assert_eq!(
        of("postgres://u@h/db?options=-c%20statement_timeout%3D30s"),
        Some(Duration::from_secs(30))
    );
    assert_eq!(
        of(
            "postgres://h/db?options=-c%20statement_timeout%3D9s%20-c%20lock_timeout%3D1s%20-c%20statement_timeout%3D2min"
        ),
        Some(Duration::from_secs(120))
    );
    assert_eq!(
        of("postgres://h/db?options=-cstatement_timeout%3D1500"),
        Some(Duration::from_millis(1_500))
    );
    assert_eq!(
        of("postgres://h/db?options=--statement-timeout%3D3s"),
        Some(Duration::from_secs(3))
    );
    assert_eq!(
        of("postgres://h/db?options=-c%20statement_timeout%3D0"),
        None
    );
    assert_eq!(
        of("postgres://h/db?options=-c%20statement_timeout%3D1.5s"),
        Some(Duration::from_millis(1_500))
    );
    assert_eq!(
        of("postgres://h/db?options=-c%20STATEMENT_TIMEOUT%3D0.5min"),
        Some(Duration::from_secs(30))
    );
    // A value it cannot read: the session may allow anything, so no deadline of 5 s.
    assert_eq!(
        of("postgres://h/db?options=-c%20statement_timeout%3D5fortnights"),
        None
    );
    assert_eq!(of("postgres://h/db?options=-c%20lock_timeout%3D9s"), five);
}
