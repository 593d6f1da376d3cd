/* Uses the paging runtime from C: a region 4x its budget on the servers in
 * argv[1], every page written and checked twice. Exit 0 on success. */
#include "pagefleet.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s SERVERS SECRET_FILE\n", argv[0]); return 2; }
    char err[512];
    pf_config cfg = { .size = 16u << 20, .budget_pages = 1024, .chunk_pages = 16,
                      .policy = PF_POLICY_AGING, .servers = argv[1], .secret_file = argv[2] };
    pf_region *r = pf_region_new(&cfg, err, sizeof err);
    if (!r) { fprintf(stderr, "pf_region_new: %s\n", err); return 1; }
    uint64_t *m = pf_region_base(r);
    uint64_t words = pf_region_len(r) / 8;
    for (int round = 1; round <= 2; round++) {
        for (uint64_t i = 0; i < words; i += 7) m[i] = i * 2654435761u + round;
        for (uint64_t i = 0; i < words; i += 7)
            if (m[i] != i * 2654435761u + round) { fprintf(stderr, "word %lu corrupted\n", (unsigned long)i); return 1; }
    }
    pf_stats s;
    pf_region_stats(r, &s);
    printf("page_ins=%lu page_outs=%lu resident=%lu budget=%lu\n", (unsigned long)s.page_ins,
           (unsigned long)s.page_outs, (unsigned long)s.resident_pages, (unsigned long)s.budget_pages);
    if (s.page_outs == 0 || s.page_ins == 0) { fprintf(stderr, "expected paging\n"); return 1; }
    if (pf_region_close(r, err, sizeof err) != 0) { fprintf(stderr, "close: %s\n", err); return 1; }
    /* Bad input gives an error, not a crash. */
    pf_config bad = { .size = 1u << 20, .chunk_pages = 3 };
    if (pf_region_new(&bad, err, sizeof err) != NULL || strstr(err, "chunk") == NULL) {
        fprintf(stderr, "bad config accepted: %s\n", err); return 1;
    }
    return 0;
}
