//! The HTTP API's signed heads (`Authorization: PF1 ...`) on arbitrary
//! bytes: no panic, no forged head passes, and a head signed for the same
//! method, path and body passes once, with that body and no other.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagefleet_common::httpauth::{sign, AuthError, Verifier};
use pagefleet_proto::auth::Secret;

fuzz_target!(|data: &[u8]| {
    let secret = Secret::from_bytes(b"fuzzing-secret-0123456789", "fuzz").expect("secret");
    let s = String::from_utf8_lossy(data);
    let mut parts = s.splitn(3, '\n');
    let header = parts.next().unwrap_or("");
    let method = parts.next().unwrap_or("GET");
    let path = parts.next().unwrap_or("/");
    let v = Verifier::new(secret.clone());
    assert!(
        v.verify_head(Some(header), method, path).is_err(),
        "a head not signed with the secret passed: {header:?}"
    );
    let signed = sign(&secret, method, path, data);
    let a = v
        .verify_head(Some(&signed), method, path)
        .expect("a freshly signed head");
    a.check_body(data).expect("the body it was signed for");
    if data != b"x" {
        assert_eq!(a.check_body(b"x"), Err(AuthError::BodyMismatch));
    }
    assert_eq!(
        v.verify_head(Some(&signed), method, path).unwrap_err(),
        AuthError::Replayed
    );
});
