//! C ABI (`include/pagefleet.h`) so other runtimes (the QEMU shim, C programs)
//! can use regions.

use crate::{Config, OnFatal, Policy, Region, Secret};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::AsRawFd;

/// pf_config: how to create a region (C ABI).
#[repr(C)]
pub struct PfConfig {
    /// Guest memory, bytes.
    pub size: u64,
    /// Pages allowed resident (0: all).
    pub budget_pages: u64,
    /// Pages per chunk.
    pub chunk_pages: u32,
    /// The victim policy: its index in `Policy::ALL` (`enum pf_policy`;
    /// a test holds the header to that order).
    pub policy: u32,
    /// Memory servers, comma-separated HOST:PORT (NULL: none).
    pub servers: *const c_char,
    /// Cluster secret file (NULL: the default).
    pub secret_file: *const c_char,
    /// CPU share of one core the sampling may cost (0: default).
    pub sample_cpu_budget: f64,
}

/// pf_stats: a region's counters (C ABI).
#[repr(C)]
pub struct PfStats {
    /// Pages allowed resident (0: all).
    pub budget_pages: u64,
    /// Pages resident now.
    pub resident_pages: u64,
    /// Pages on memory servers.
    pub remote_pages: u64,
    /// MISSING faults served (first touch or page-in).
    pub missing_faults: u64,
    /// Pages the sampler found touched since it unmapped them (each a minor
    /// fault the kernel resolved).
    pub minor_faults: u64,
    /// Write-protect faults (migration change tracking).
    pub wp_faults: u64,
    /// Never-touched pages filled with zeros.
    pub zero_filled_pages: u64,
    /// Pages brought in from memory servers.
    pub page_ins: u64,
    /// GET requests that brought them.
    pub page_in_requests: u64,
    /// Pages sent out to memory servers.
    pub page_outs: u64,
    /// Chunks evicted.
    pub page_out_chunks: u64,
    /// Bytes received from memory servers.
    pub bytes_in: u64,
    /// Bytes sent to them.
    pub bytes_out: u64,
    /// Chunks the sampling hand has swept.
    pub sampled_chunks: u64,
    /// Median page-in latency, µs.
    pub page_in_p50_us: f64,
    /// 99th-percentile page-in latency, µs.
    pub page_in_p99_us: f64,
}

/// Copy `msg` (truncated, NUL-terminated) into the caller's error buffer.
///
/// # Safety
/// `err` must be NULL or point to `len` writable bytes.
unsafe fn set_err(err: *mut c_char, len: usize, msg: &str) {
    if err.is_null() || len == 0 {
        return;
    }
    let n = msg.len().min(len - 1);
    // SAFETY: the caller gives a buffer of `len` bytes; n < len.
    unsafe {
        std::ptr::copy_nonoverlapping(msg.as_ptr(), err as *mut u8, n);
        *err.add(n) = 0;
    }
}

/// A C string argument (NULL: none).
///
/// # Safety
/// `p` must be NULL or point to a NUL-terminated string.
unsafe fn opt_str(p: *const c_char) -> Option<String> {
    // SAFETY: non-NULL and NUL-terminated by the caller's contract.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// # Safety
/// `cfg` must point to a valid pf_config; `err` to `errlen` writable bytes or be NULL.
#[no_mangle]
pub unsafe extern "C" fn pf_region_new(
    cfg: *const PfConfig,
    err: *mut c_char,
    errlen: usize,
) -> *mut c_void {
    let r = (|| -> Result<Region, String> {
        // SAFETY: `cfg` is NULL or a valid pf_config (the caller's contract).
        let c = unsafe { cfg.as_ref() }.ok_or("pf_region_new: cfg is NULL")?;
        let pages = pagefleet_units::pages_for(c.size);
        let mut k = Config::new(
            c.size,
            if c.budget_pages == 0 {
                pages
            } else {
                c.budget_pages
            },
        );
        if c.chunk_pages != 0 {
            k.chunk_pages = c.chunk_pages as usize;
        }
        k.policy = Policy::from_index(c.policy).ok_or_else(|| {
            format!(
                "pf_region_new: policy {} is not one of 0..{} ({})",
                c.policy,
                Policy::ALL.len(),
                Policy::names()
            )
        })?;
        if c.sample_cpu_budget > 0.0 {
            k.sample_cpu_budget = c.sample_cpu_budget;
        }
        // SAFETY: pf_config's strings are NULL or NUL-terminated.
        k.servers = unsafe { opt_str(c.servers) }
            .map(|s| {
                s.split(',')
                    .map(str::trim)
                    .filter(|x| !x.is_empty())
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default();
        if !k.servers.is_empty() {
            // SAFETY: as above.
            let f = unsafe { opt_str(c.secret_file) }.map(std::path::PathBuf::from);
            k.secret = Some(Secret::resolve(f.as_deref()).map_err(|e| e.to_string())?);
        }
        // A C host decides itself what to do with a poisoned page (SIGBUS).
        k.on_fatal = OnFatal::Poison;
        k.name = "pagefleet-capi".into();
        Region::new(k).map_err(|e| e.to_string())
    })();
    match r {
        Ok(r) => Box::into_raw(Box::new(r)) as *mut c_void,
        Err(e) => {
            // SAFETY: `err` is NULL or `errlen` writable bytes (the caller's contract).
            unsafe { set_err(err, errlen, &e) };
            std::ptr::null_mut()
        }
    }
}

/// # Safety
/// `r` must come from pf_region_new and not be closed.
#[no_mangle]
pub unsafe extern "C" fn pf_region_base(r: *const c_void) -> *mut c_void {
    // SAFETY: `r` is a live region from pf_region_new (the caller's contract).
    unsafe { &*(r as *const Region) }.as_ptr() as *mut c_void
}

/// # Safety
/// As pf_region_base.
#[no_mangle]
pub unsafe extern "C" fn pf_region_len(r: *const c_void) -> u64 {
    // SAFETY: `r` is a live region from pf_region_new (the caller's contract).
    unsafe { &*(r as *const Region) }.len() as u64
}

/// # Safety
/// As pf_region_base.
#[no_mangle]
pub unsafe extern "C" fn pf_region_memfd(r: *const c_void) -> c_int {
    // SAFETY: `r` is a live region from pf_region_new (the caller's contract).
    unsafe { &*(r as *const Region) }.memfd().as_raw_fd()
}

/// # Safety
/// As pf_region_base.
#[no_mangle]
pub unsafe extern "C" fn pf_region_set_budget(r: *mut c_void, pages: u64) {
    // SAFETY: `r` is a live region from pf_region_new (the caller's contract).
    unsafe { &*(r as *const Region) }.set_budget(pages)
}

/// # Safety
/// As pf_region_base; `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn pf_region_stats(r: *const c_void, out: *mut PfStats) {
    // SAFETY: `r` is a live region from pf_region_new (the caller's contract).
    let s = unsafe { &*(r as *const Region) }.stats();
    let stats = PfStats {
        budget_pages: s.budget_pages,
        resident_pages: s.resident_pages,
        remote_pages: s.remote_pages,
        missing_faults: s.missing_faults,
        minor_faults: s.minor_faults,
        wp_faults: s.wp_faults,
        zero_filled_pages: s.zero_filled_pages,
        page_ins: s.page_ins,
        page_in_requests: s.page_in_requests,
        page_outs: s.page_outs,
        page_out_chunks: s.page_out_chunks,
        bytes_in: s.bytes_in,
        bytes_out: s.bytes_out,
        sampled_chunks: s.sampled_chunks,
        page_in_p50_us: s.page_in_p50_us(),
        page_in_p99_us: s.page_in_p99_us(),
    };
    // SAFETY: `out` is writable (the caller's contract).
    unsafe { out.write(stats) };
}

/// # Safety
/// `r` must come from pf_region_new; it is freed.
#[no_mangle]
pub unsafe extern "C" fn pf_region_close(r: *mut c_void, err: *mut c_char, errlen: usize) -> c_int {
    if r.is_null() {
        return 0;
    }
    // SAFETY: `r` came from Box::into_raw in pf_region_new and is freed once.
    let r = unsafe { Box::from_raw(r as *mut Region) };
    match r.close() {
        Ok(()) => 0,
        Err(e) => {
            // SAFETY: `err` is NULL or `errlen` writable bytes (the caller's contract).
            unsafe { set_err(err, errlen, &e.to_string()) };
            -1
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::Policy;

    /// `include/pagefleet.h` numbers the policies as `Policy::ALL` does:
    /// `PF_POLICY_<NAME> = <index>`, every one, in order.
    #[test]
    fn the_header_lists_every_policy_in_order() {
        let h = include_str!("../../../include/pagefleet.h");
        let start = h
            .find("enum pf_policy {")
            .expect("enum pf_policy in the header");
        let body = &h[start..start + h[start..].find('}').unwrap()];
        let want: Vec<String> = Policy::ALL
            .iter()
            .enumerate()
            .map(|(i, p)| format!("PF_POLICY_{} = {i}", p.name().to_uppercase()))
            .collect();
        let got: Vec<String> = body["enum pf_policy {".len()..]
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        assert_eq!(got, want);
    }
}
