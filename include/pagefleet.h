/* pagefleet.h — C ABI of the pagefleet paging runtime (libpagefleet_region.so).
 *
 * A region is guest memory (a memfd mapped MAP_SHARED) whose pages live
 * locally or on pagefleet memory servers; faults are served by a pager thread
 * inside this process (userfaultfd). Link with -lpagefleet_region.
 * All functions are thread-safe. Errors are returned as a message in `err`.
 */
#ifndef PAGEFLEET_H
#define PAGEFLEET_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pf_region pf_region;

/* The order of pagefleet_api::Policy::ALL; another value makes pf_region_new fail. */
enum pf_policy { PF_POLICY_CLOCK = 0, PF_POLICY_AGING = 1, PF_POLICY_LRU2 = 2 };

typedef struct pf_config {
    uint64_t size;          /* bytes; rounded up to whole chunks */
    uint64_t budget_pages;  /* pages allowed resident locally (0: all) */
    uint32_t chunk_pages;   /* power of two 1..64 (0: 16) */
    uint32_t policy;        /* enum pf_policy */
    const char *servers;    /* "host:port,host:port" or NULL for none */
    const char *secret_file;/* NULL: $PAGEFLEET_SECRET / default secret file */
    double sample_cpu_budget; /* share of one core for sampling faults (0: 0.01) */
} pf_config;

typedef struct pf_stats {
    uint64_t budget_pages, resident_pages, remote_pages;
    uint64_t missing_faults, minor_faults, wp_faults, zero_filled_pages;
    uint64_t page_ins, page_in_requests, page_outs, page_out_chunks;
    uint64_t bytes_in, bytes_out, sampled_chunks;
    double page_in_p50_us, page_in_p99_us;
} pf_stats;

/* Create a region; NULL on error (message in err). */
pf_region *pf_region_new(const pf_config *cfg, char *err, size_t errlen);
void *pf_region_base(const pf_region *r);
uint64_t pf_region_len(const pf_region *r);
int pf_region_memfd(const pf_region *r);
void pf_region_set_budget(pf_region *r, uint64_t pages);
void pf_region_stats(const pf_region *r, pf_stats *out);
/* Stop paging, drop the region's pages on the servers, unmap. 0 on success. */
int pf_region_close(pf_region *r, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif
