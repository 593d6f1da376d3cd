//! Every decoder, client- and server-side, on arbitrary bytes: no panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagefleet_proto::*;

fuzz_target!(|data: &[u8]| {
    let _ = Header::decode(data);
    for op in [Opcode::Put, Opcode::Get, Opcode::Delete] {
        if let Ok(r) = PagesReq::decode(op, data) {
            // What decodes must re-encode to the same descriptor.
            let mut b = Vec::new();
            encode_pages_req(
                r.prefix.region,
                &r.sel,
                r.prefix.flags & !flags::RUN,
                &mut b,
            );
            if r.prefix.flags & flags::WHOLE_REGION == 0 && op != Opcode::Put {
                assert_eq!(&b[..], data);
            }
        }
    }
    let _ = Hello::decode(data);
    let _ = HelloOk::decode(data);
    let _ = Welcome::decode(data);
    let _ = StatReq::decode(data);
    let _ = StatOk::decode(data);
    let _ = PutOk::decode(data);
    let _ = DeleteOk::decode(data);
    let _ = GetOkHead::decode(data, data.len());
    let _ = WireError::decode(data, 1);
});
