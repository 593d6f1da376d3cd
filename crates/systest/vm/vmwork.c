/* vmwork: the VM guest's self-verifying memory workload.
 *
 * Fills MB MiB with pages whose every 8-byte word is a function of
 * (seed, page, version), then reads and writes pages picked with a zipf
 * skew, checking every word of every page it reads. A write bumps the
 * page's version and rewrites the page. Four times a second it prints one line
 * (on the serial console, which the runner keeps and parses):
 *
 *   vmwork: t=12 ops=48211 ops_s=4012 errors=0 phase=run
 *
 * and at the end a full pass over every page, then
 *
 *   vmwork: done ops=... errors=... verified=PAGES
 *
 * Usage: vmwork MB SECONDS WRITE_PERCENT SEED THETA_PERCENT [SPAN_PERCENT [DISK_READS [DISK_WRITE_PERCENT [IDLE]]]]
 * (SECONDS 0: run until killed; SPAN_PERCENT: the share of the filled
 * pages the reads and writes fall on, the first ones — the rest is cold
 * data, as in a large guest whose working set is smaller than its memory;
 * the final pass checks every page. DISK_READS: O_DIRECT 64 KiB reads of
 * /dev/vda per 64 operations, each into the next slot of a 32 MiB buffer
 * that is cold by the time it comes round again, so QEMU's preadv lands
 * on guest pages the host has paged out — a fault the host kernel takes
 * on QEMU's behalf. Every word read is checked against the disk pattern.
 * DISK_WRITE_PERCENT of those operations write a chunk instead, with the
 * pattern of the chunk's next generation: a later read checks the write
 * stuck, also after the VM migrated to another QEMU. IDLE 1: after the
 * fill, one operation per 10 ms — a VM that mostly sits idle yet keeps
 * checking what it reads.)
 *
 *   vmwork mkdisk MB > disk.img   writes that pattern (run on the host).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define WORDS 512 /* 8-byte words per 4 KiB page */

static uint64_t seed;

static inline uint64_t word(uint64_t page, uint32_t version, uint64_t i) {
    uint64_t x = (page * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)version << 40) ^ (i * 0xC2B2AE3D27D4EB4Full) ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    return x ^ (x >> 29);
}

static void fill(uint64_t *p, uint64_t page, uint32_t version) {
    for (uint64_t i = 0; i < WORDS; i++)
        p[i] = word(page, version, i);
}

static uint64_t check(const uint64_t *p, uint64_t page, uint32_t version) {
    uint64_t bad = 0;
    for (uint64_t i = 0; i < WORDS; i++)
        bad += p[i] != word(page, version, i);
    return bad;
}

/* The disk image's word at 8-byte index w: independent of the seed. */
static inline uint64_t disk_word(uint64_t w) {
    uint64_t x = w * 0xD6E8FEB86659FD93ull ^ 0xD15C0000D15Cull;
    x ^= x >> 32;
    x *= 0xD6E8FEB86659FD93ull;
    return x ^ (x >> 32);
}

static int mkdisk(uint64_t mb) {
    static uint64_t buf[WORDS * 16];
    for (uint64_t w = 0; w < (mb << 20) / 8; w += WORDS * 16) {
        for (uint64_t i = 0; i < WORDS * 16; i++)
            buf[i] = disk_word(w + i);
        if (fwrite(buf, sizeof buf, 1, stdout) != 1)
            return 1;
    }
    return fflush(stdout) != 0;
}

#define DISK_CHUNK (64 << 10)
#define DISK_BUF (32 << 20)

static int disk_fd = -1;
static uint64_t disk_chunks, disk_reads, disk_writes;
static uint32_t *disk_gen; /* generation each chunk was last written with */
static char *disk_buf;

/* The word at 8-byte index w of a chunk written `gen` times. */
static inline uint64_t disk_word_gen(uint64_t w, uint32_t gen) {
    return disk_word(w) ^ ((uint64_t)gen * 0x9E3779B97F4A7C15ull);
}

/* One O_DIRECT read (or, write set, write of the next generation) of
 * chunk `pick` through the next buffer slot; returns the wrong words. */
static uint64_t disk_op(uint64_t pick, int write) {
    static uint64_t slot;
    uint64_t c = pick % disk_chunks, off = c * DISK_CHUNK;
    uint64_t *p = (uint64_t *)(disk_buf + (slot++ % (DISK_BUF / DISK_CHUNK)) * DISK_CHUNK);
    if (write) {
        for (uint64_t i = 0; i < DISK_CHUNK / 8; i++)
            p[i] = disk_word_gen(off / 8 + i, disk_gen[c] + 1);
        if (pwrite(disk_fd, p, DISK_CHUNK, off) != DISK_CHUNK) {
            printf("vmwork: ERROR disk write at %llu failed\n", (unsigned long long)off);
            return 1;
        }
        disk_gen[c]++;
        disk_writes++;
        return 0;
    }
    if (pread(disk_fd, p, DISK_CHUNK, off) != DISK_CHUNK) {
        printf("vmwork: ERROR disk read at %llu failed\n", (unsigned long long)off);
        return 1;
    }
    uint64_t bad = 0;
    for (uint64_t i = 0; i < DISK_CHUNK / 8; i++)
        bad += p[i] != disk_word_gen(off / 8 + i, disk_gen[c]);
    disk_reads++;
    return bad;
}

static uint64_t rng = 0x243F6A8885A308D3ull;
static inline uint64_t next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}
static inline double unit(void) { return (next() >> 11) * (1.0 / 9007199254740992.0); }

/* Gray et al.'s zipf generator (as YCSB uses): rank 0 is the hottest. */
static double zeta_n, alpha, eta, theta;
static uint64_t zn;
static void zipf_init(uint64_t n, double t) {
    zn = n;
    theta = t;
    zeta_n = 0;
    for (uint64_t i = 1; i <= n; i++)
        zeta_n += 1.0 / pow((double)i, t);
    double zeta2 = 1.0 + 1.0 / pow(2.0, t);
    alpha = 1.0 / (1.0 - t);
    eta = (1.0 - pow(2.0 / n, 1.0 - t)) / (1.0 - zeta2 / zeta_n);
}
static uint64_t zipf(void) {
    double u = unit(), uz = u * zeta_n;
    if (uz < 1.0)
        return 0;
    if (uz < 1.0 + pow(0.5, theta))
        return 1;
    uint64_t r = (uint64_t)(zn * pow(eta * u - eta + 1.0, alpha));
    return r < zn ? r : zn - 1;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "mkdisk") == 0)
        return mkdisk(strtoull(argv[2], 0, 10));
    if (argc < 6) {
        fprintf(stderr, "usage: vmwork MB SECONDS WRITE_PERCENT SEED THETA_PERCENT [SPAN_PERCENT [DISK_READS [DISK_WRITE_PERCENT [IDLE]]]]\n"
                        "       vmwork mkdisk MB > disk.img\n");
        return 2;
    }
    uint64_t mb = strtoull(argv[1], 0, 10);
    double secs = strtod(argv[2], 0);
    uint64_t wpct = strtoull(argv[3], 0, 10);
    seed = strtoull(argv[4], 0, 10) * 0x2545F4914F6CDD1Dull;
    double th = strtod(argv[5], 0) / 100.0;
    uint64_t span_pct = argc > 6 ? strtoull(argv[6], 0, 10) : 100;
    if (span_pct == 0 || span_pct > 100)
        span_pct = 100;
    if (th <= 0 || th >= 1)
        th = 0.99;
    uint64_t disk_per_batch = argc > 7 ? strtoull(argv[7], 0, 10) : 0;
    uint64_t disk_wpct = argc > 8 ? strtoull(argv[8], 0, 10) : 0;
    int idle = argc > 9 && strtoull(argv[9], 0, 10) != 0;
    if (disk_per_batch) {
        disk_fd = open("/dev/vda", (disk_wpct ? O_RDWR : O_RDONLY) | O_DIRECT);
        off_t size = disk_fd < 0 ? -1 : lseek(disk_fd, 0, SEEK_END);
        disk_buf = mmap(0, DISK_BUF, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (size < DISK_CHUNK || disk_buf == MAP_FAILED) {
            printf("vmwork: FAIL no readable disk /dev/vda for DISK_READS\n");
            return 1;
        }
        disk_chunks = size / DISK_CHUNK;
        disk_gen = calloc(disk_chunks, sizeof *disk_gen);
    }
    uint64_t pages = (mb << 20) / 4096;
    uint64_t *mem = mmap(0, pages * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uint32_t *version = calloc(pages, sizeof *version);
    if (mem == MAP_FAILED || !version || pages == 0) {
        printf("vmwork: FAIL cannot allocate %llu MiB\n", (unsigned long long)mb);
        return 1;
    }
    double t0 = now(), last = t0;
    for (uint64_t q = 0; q < pages; q++) {
        fill(mem + q * WORDS, q, 0);
        if ((q & 4095) == 0 && now() - last >= 1.0) {
            last = now();
            printf("vmwork: t=%.0f filled=%llu/%llu phase=fill\n", last - t0, (unsigned long long)q,
                   (unsigned long long)pages);
            fflush(stdout);
        }
    }
    uint64_t span = pages * span_pct / 100;
    if (span == 0)
        span = 1;
    zipf_init(span, th);
    printf("vmwork: filled %llu MiB in %.1f s\n", (unsigned long long)mb, now() - t0);
    fflush(stdout);
    uint64_t ops = 0, errors = 0, at_last = 0;
    double start = now();
    last = start;
    for (;;) {
        if (idle) {
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, 0);
        }
        for (int k = 0; k < (idle ? 1 : 64); k++) {
            /* Scatter ranks over the memory: hot pages are not neighbours. */
            uint64_t q = (zipf() * 0x9E3779B97F4A7C15ull) % span;
            uint64_t *p = mem + q * WORDS;
            if (next() % 100 < wpct) {
                version[q]++;
                fill(p, q, version[q]);
            } else {
                uint64_t bad = check(p, q, version[q]);
                if (bad && errors < 10)
                    printf("vmwork: ERROR page %llu version %u: %llu bad words\n", (unsigned long long)q,
                           version[q], (unsigned long long)bad);
                errors += bad;
            }
            ops++;
        }
        for (uint64_t k = 0; k < disk_per_batch; k++) {
            uint64_t bad = disk_op(next(), next() % 100 < disk_wpct);
            if (bad && errors < 10)
                printf("vmwork: ERROR disk: %llu bad words\n", (unsigned long long)bad);
            errors += bad;
        }
        double t = now();
        if (t - last >= 0.25) {
            printf("vmwork: t=%.2f ops=%llu ops_s=%.0f errors=%llu disk_reads=%llu disk_writes=%llu phase=run\n",
                   t - start, (unsigned long long)ops, (ops - at_last) / (t - last), (unsigned long long)errors,
                   (unsigned long long)disk_reads, (unsigned long long)disk_writes);
            fflush(stdout);
            last = t;
            at_last = ops;
        }
        if (secs > 0 && t - start >= secs)
            break;
    }
    uint64_t bad = 0;
    for (uint64_t q = 0; q < pages; q++)
        bad += check(mem + q * WORDS, q, version[q]);
    for (uint64_t c = 0; c < disk_chunks; c++)
        bad += disk_op(c, 0);
    errors += bad;
    printf("vmwork: done ops=%llu errors=%llu verified=%llu disk_reads=%llu disk_writes=%llu\n",
           (unsigned long long)ops, (unsigned long long)errors, (unsigned long long)pages,
           (unsigned long long)disk_reads, (unsigned long long)disk_writes);
    fflush(stdout);
    return errors != 0;
}
