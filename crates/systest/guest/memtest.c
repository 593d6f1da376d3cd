/* The DMPS "Sequential" test: write N MiB, then read every value back.
 * Run inside a small guest, so most of it lives in swap.
 * Usage: memtest MIB [random|sparse]. random (the default): every word a
 * distinct value, nothing to compress. sparse: one word in 8 holds the
 * value, the rest are zeros (compresses about 6:1 with lzo-rle, as much of
 * a real guest's memory does: what zram in the guest needs to hold it). */
#include <string.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static int sparse;

static uint64_t value(size_t i) {
    if (sparse && i % 8)
        return 0;
    return (i * 0x9E3779B97F4A7C15ull) ^ 0xC0FFEE;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    size_t mb = argc > 1 ? strtoul(argv[1], 0, 10) : 256;
    size_t n = (mb << 20) / 8;
    sparse = argc > 2 && strcmp(argv[2], "sparse") == 0;
    uint64_t *p = malloc(n * 8);
    if (!p) {
        printf("MEMTEST FAIL: cannot allocate %zu MiB\n", mb);
        return 1;
    }
    double t0 = now();
    for (size_t i = 0; i < n; i++)
        p[i] = value(i);
    /* How much of it the kernel had to put in swap. */
    FILE *f = fopen("/proc/meminfo", "r");
    char line[128];
    long total = 0, freekb = 0;
    while (f && fgets(line, sizeof line, f)) {
        sscanf(line, "SwapTotal: %ld kB", &total);
        sscanf(line, "SwapFree: %ld kB", &freekb);
    }
    if (f)
        fclose(f);
    printf("MEMTEST written, swap used %ld MiB\n", (total - freekb) >> 10);
    for (size_t i = 0; i < n; i++)
        if (p[i] != value(i)) {
            printf("MEMTEST FAIL at word %zu\n", i);
            return 1;
        }
    /* The workload's rate: MiB written and read back per second. */
    printf("MEMTEST RATE %.1f MiB/s\n", 2.0 * mb / (now() - t0));
    printf("MEMTEST OK %zu MiB\n", mb);
    return 0;
}
