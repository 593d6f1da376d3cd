//! Network interfaces.

/// The index of network interface `name` in this thread's network
/// namespace, if there is one.
pub fn interface_index(name: &str) -> Option<u32> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: a NUL-terminated name that outlives the call; only read.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (i != 0).then_some(i)
}
