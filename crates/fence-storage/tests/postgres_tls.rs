//! TLS to PostgreSQL as libpq's `sslmode` asks for it, against the local server (which
//! serves Debian's snakeoil certificate, issued to `localhost`).
#![cfg(feature = "postgres")]

use std::path::Path;

const SNAKEOIL: &str = "/etc/ssl/certs/ssl-cert-snakeoil.pem";

/// The test database, as every PostgreSQL test finds it: its user (with the password, if
/// any) and PORT/DATABASE.
fn database() -> (String, String) {
    let url = fence_storage::postgres::test_database_url();
    assert!(
        Path::new(SNAKEOIL).exists(),
        "{SNAKEOIL} is missing: apt install ssl-cert, and ssl = on in postgresql.conf"
    );
    // postgres://postgres[:PASSWORD]@127.0.0.1:PORT/DB[?...], as the local server,
    // services.sh or the throwaway cluster give it.
    let (user, rest) = url
        .strip_prefix("postgres://")
        .and_then(|r| r.split_once("@127.0.0.1:"))
        .expect("a test database at postgres://postgres[:PASSWORD]@127.0.0.1:PORT/DB");
    let (port, rest) = rest.split_once('/').expect("a database name");
    let db = rest.split('?').next().unwrap_or(rest);
    (user.to_owned(), format!("{port}/{db}"))
}

/// Whether the pool's connection is encrypted, as the server sees it.
async fn encrypted(url: &str) -> Result<bool, String> {
    let pool = fence_storage::postgres::connect_pool(url).map_err(|e| e.to_string())?;
    let client = pool
        .get()
        .await
        .map_err(|e| fence_storage::error_chain(&e))?;
    let row = client
        .query_one(
            "select ssl from pg_stat_ssl where pid = pg_backend_pid()",
            &[],
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok(row.get::<_, bool>(0))
}

#[tokio::test]
async fn each_sslmode_does_what_libpq_does() {
    // `user` is postgres[:PASSWORD], `db` is PORT/DATABASE.
    let (user, db) = database();
    let at = |host: &str, query: &str| format!("postgres://{user}@{host}:{db}?{query}");
    assert!(
        !encrypted(&at("127.0.0.1", "sslmode=disable"))
            .await
            .unwrap()
    );
    assert!(
        encrypted(&at("127.0.0.1", "sslmode=require"))
            .await
            .unwrap()
    );
    assert!(encrypted(&at("127.0.0.1", "sslmode=prefer")).await.unwrap());
    let snakeoil = format!("sslrootcert={SNAKEOIL}");
    assert!(
        encrypted(&at("127.0.0.1", &format!("sslmode=verify-ca&{snakeoil}")))
            .await
            .unwrap(),
        "verify-ca checks the issuer, not the name"
    );
    assert!(
        encrypted(&at("localhost", &format!("sslmode=verify-full&{snakeoil}")))
            .await
            .unwrap()
    );
    // The certificate names localhost, not 127.0.0.1.
    let e = encrypted(&at("127.0.0.1", &format!("sslmode=verify-full&{snakeoil}")))
        .await
        .unwrap_err();
    assert!(e.contains("certificate") && e.contains("127.0.0.1"), "{e}");
    // A root that did not issue the server's certificate (with sslrootcert, require
    // verifies the issuer too, as libpq does).
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("other-ca.pem");
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    std::fs::write(&other, params.self_signed(&key).unwrap().pem()).unwrap();
    for mode in ["require", "verify-ca", "verify-full"] {
        let url = at(
            "localhost",
            &format!("sslmode={mode}&sslrootcert={}", other.display()),
        );
        let e = encrypted(&url).await.unwrap_err();
        assert!(e.contains("UnknownIssuer"), "{mode}: {e}");
    }
    // Mistakes in the string are set-up errors, before any connection.
    let e = encrypted(&at("127.0.0.1", "sslmode=verify"))
        .await
        .unwrap_err();
    assert!(e.contains("sslmode=\"verify\""), "{e}");
    let e = encrypted(&at(
        "localhost",
        "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
    ))
    .await
    .unwrap_err();
    assert!(e.contains("TLS"), "{e}");
}
