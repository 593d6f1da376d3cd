//! The registry's records as etcd returns them, whatever they hold:
//! `view_of` (members, host reports, claims and guests turned into the
//! cluster view placement reads) and the claim arithmetic of a migration's
//! memory promise (`Claims::adjusted`). etcd is reached over TLS with the
//! cluster's identity, but a record can still be stale, half-written by an
//! older version or edited by hand; none may panic a daemon, and the view
//! must keep its promises: a member without a readable report is dead and
//! has no memory, claims only ever take memory away, lent memory never
//! exceeds its capacity.
//!
//! Input: records, one per line (`\n`), each `KIND NAME \t VALUE`, where
//! KIND (the first byte, mod 5) picks the key: `members/NAME`,
//! `hosts/NAME`, `claims/NAME`, `guests/NAME/g`, or NAME as the whole key.
//! The line's VALUE is the record's bytes (JSON when well-formed).
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagefleet_api::HostReport;
use pagefleet_registry::{view_of, Claims, Member, Pool, PREFIX};

fn records(data: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for line in data.split(|b| *b == b'\n').take(64) {
        let Some((&kind, rest)) = line.split_first() else {
            continue;
        };
        let (name, value) = match rest.iter().position(|b| *b == b'\t') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, &[][..]),
        };
        let name = String::from_utf8_lossy(name);
        let key = match kind % 5 {
            0 => format!("{PREFIX}members/{name}"),
            1 => format!("{PREFIX}hosts/{name}"),
            2 => format!("{PREFIX}claims/{name}"),
            3 => format!("{PREFIX}guests/{name}/g"),
            _ => name.into_owned(),
        };
        out.push((key, value.to_vec()));
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let kvs = records(data);
    let ttl = i64::from(data.first().copied().unwrap_or(10));
    let view = view_of(kvs.iter().map(|(k, v)| (k.as_str(), v.as_slice())), ttl);
    // One host per member record that decodes, in order.
    let members: Vec<(&str, Member)> = kvs
        .iter()
        .filter_map(|(k, v)| {
            let name = k.strip_prefix(PREFIX)?.strip_prefix("members/")?;
            Some((name, serde_json::from_slice::<Member>(v).ok()?))
        })
        .collect();
    assert_eq!(view.hosts.len(), members.len());
    for (h, (name, m)) in view.hosts.iter().zip(&members) {
        assert_eq!(h.http, m.http);
        // Dead exactly when no report was readable.
        assert_eq!(h.host.is_none(), h.error.is_some());
        if let Some(r) = &h.host {
            assert!(r.lend_used <= r.lend_capacity);
            let key = format!("{PREFIX}hosts/{name}");
            let raw = kvs
                .iter()
                .find(|(k, _)| *k == key)
                .and_then(|(_, v)| serde_json::from_slice::<HostReport>(v).ok())
                .expect("a report the view shows was in the records");
            // Claims take memory away, never add it.
            assert!(r.guest_free <= raw.guest_free);
        }
    }
    // A promise adjusted by any amount stays within 0..=u64::MAX and moves
    // by exactly the amount when there is room.
    let claims = kvs
        .iter()
        .find(|(k, _)| k.contains("/claims/"))
        .map(|(_, v)| Claims::decode(v))
        .unwrap_or_default();
    for (i, chunk) in data.chunks_exact(8).take(8).enumerate() {
        let delta = i64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        let pool = if i % 2 == 0 { Pool::Guest } else { Pool::Lend };
        let next = claims.adjusted(pool, delta);
        let want =
            (i128::from(claims.held(pool)) + i128::from(delta)).clamp(0, i128::from(u64::MAX));
        assert_eq!(i128::from(next.held(pool)), want);
        let other = if pool == Pool::Guest {
            Pool::Lend
        } else {
            Pool::Guest
        };
        assert_eq!(next.held(other), claims.held(other));
    }
});
