//! Giving freed heap memory back to the kernel.
//!
//! glibc's malloc keeps what a long-lived daemon frees in its arenas (one per
//! thread that allocated, up to 8 per CPU), so RSS follows the high-water mark
//! of every arena — a daemon whose index shrinks when a guest leaves, or whose
//! short-lived request threads come and go, only ever grows. Trimming returns
//! every whole free page of every arena (glibc ≥ 2.8 madvises inside arenas,
//! not only at the top).

/// Return free heap pages to the kernel. Cheap (it walks the free lists of
/// a few MiB): call it from a housekeeping loop every few seconds.
pub fn give_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointers and only returns free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// One malloc arena for the whole process. Call first thing in `main`,
/// before any thread starts. A daemon whose many short-lived threads each
/// got an arena (up to 8 per CPU) keeps each arena's partly used pages;
/// in the soak, pagefleetd's heap RSS stayed 2-4 MiB higher and kept
/// creeping with 16 arenas, and was flat with one. The hot paths allocate
/// little, and what they do goes through glibc's per-thread cache first.
pub fn one_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes an allocator setting; no thread exists yet.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        // Blocks of 128 KiB and more (session frame buffers, the content
        // index's tables, scan buffers) always get their own mapping and go
        // back whole when freed. glibc would otherwise raise this threshold
        // to the size of each large block freed (up to 32 MiB), and from then
        // on place such blocks in the heap among small long-lived ones,
        // where freeing them leaves holes the heap cannot give back.
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
}
