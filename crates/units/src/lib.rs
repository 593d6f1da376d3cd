//! The one definition of a page: every crate's page size (the wire
//! protocol's, the userfaultfd mappings', the memory server's slots, the
//! content hash's unit, KSM's sysfs counts) is [`PAGE_SIZE`], and page
//! counts become byte counts (and back) only through the functions here.

#![no_std]

/// Bytes in a page: the x86-64 base page, the unit of userfaultfd fills,
/// of the wire protocol's page frames and of the memory server's slots.
pub const PAGE_SIZE: usize = 4096;

/// `log2(PAGE_SIZE)`.
pub const PAGE_SHIFT: u32 = 12;

const _: () = assert!(PAGE_SIZE == 1 << PAGE_SHIFT);

/// Bytes in `pages` pages (saturating: a count that large is an error
/// caught where it is compared, not a wrapped small number).
pub const fn bytes_of(pages: u64) -> u64 {
    pages.saturating_mul(PAGE_SIZE as u64)
}

/// Whole pages in `bytes` bytes (a partial page does not count).
pub const fn pages_in(bytes: u64) -> u64 {
    bytes >> PAGE_SHIFT
}

/// Pages needed to hold `bytes` bytes (a partial page counts).
pub const fn pages_for(bytes: u64) -> u64 {
    bytes.div_ceil(PAGE_SIZE as u64)
}

/// Whether `bytes` is a whole number of pages.
pub const fn is_page_aligned(bytes: u64) -> bool {
    bytes & (PAGE_SIZE as u64 - 1) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_round_as_named() {
        assert_eq!(bytes_of(3), 3 * 4096);
        assert_eq!(bytes_of(u64::MAX), u64::MAX);
        assert_eq!(pages_in(2 * 4096 + 1), 2);
        assert_eq!(pages_for(2 * 4096 + 1), 3);
        assert_eq!(pages_for(0), 0);
        assert!(is_page_aligned(8192) && !is_page_aligned(8193));
    }
}
