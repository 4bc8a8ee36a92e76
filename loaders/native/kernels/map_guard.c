/* A SIGBUS guard for the shard maps the disk tier reads in place (loaders/native/map_guard.py says why).
 *
 * A page of a file mapping that lies past the file's end (the file was truncated under the process) raises SIGBUS
 * when it is read. Where the faulting address lies in a registered range, the handler maps anonymous zero pages
 * over the rest of that range (MAP_FIXED), counts the fault and returns: the instruction is retried and reads
 * zeros, so the step finishes, and the caller, which polls the count after every step, fails it with an error.
 * A fault anywhere else goes to the handler that was installed before (faulthandler's, or the default: death).
 *
 * Only async-signal-safe work happens in the handler: a scan of a fixed table, mmap, an atomic add.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_RANGES 4096

struct range {
    uintptr_t lo, hi;
    long faults; /* faults absorbed in this range */
};

static struct range ranges[MAX_RANGES]; /* a slot with hi == 0 is free */
static volatile int n_ranges;
static volatile long faults;
static struct sigaction previous;
static volatile int installed;
static uintptr_t page_size = 4096; /* read once at install: sysconf is not async-signal-safe */

static void chain(int sig, siginfo_t *info, void *ctx) {
    if (previous.sa_flags & SA_SIGINFO) {
        if (previous.sa_sigaction) {
            previous.sa_sigaction(sig, info, ctx);
            return;
        }
    } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
        return;
    }
    /* the default action: die of the signal, as without the guard */
    signal(sig, SIG_DFL);
    raise(sig);
}

static void on_sigbus(int sig, siginfo_t *info, void *ctx) {
    uintptr_t addr = (uintptr_t)info->si_addr;
    int n = n_ranges;
    for (int i = 0; i < n; i++) {
        if (addr >= ranges[i].lo && addr < ranges[i].hi) {
            uintptr_t from = addr & ~(page_size - 1);
            void *got = mmap((void *)from, ranges[i].hi - from, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            if (got != MAP_FAILED) {
                __atomic_add_fetch(&ranges[i].faults, 1, __ATOMIC_SEQ_CST);
                __atomic_add_fetch(&faults, 1, __ATOMIC_SEQ_CST);
                return;
            }
            break;
        }
    }
    chain(sig, info, ctx);
}

/* Install the handler once; 0 on success. */
int lm_guard_install(void) {
    if (installed)
        return 0;
    page_size = (uintptr_t)sysconf(_SC_PAGESIZE);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &previous) != 0)
        return -1;
    installed = 1;
    return 0;
}

/* Guard [addr, addr + len): 0 on success, -1 when the table is full. Called under the caller's lock. */
int lm_guard_add(void *addr, size_t len) {
    int n = n_ranges;
    for (int i = 0; i < n; i++) {
        if (ranges[i].hi == 0) { /* a slot freed by lm_guard_remove: matches nothing while hi is 0 */
            ranges[i].lo = (uintptr_t)addr;
            ranges[i].faults = 0;
            __atomic_store_n(&ranges[i].hi, (uintptr_t)addr + len, __ATOMIC_SEQ_CST);
            return 0;
        }
    }
    if (n >= MAX_RANGES)
        return -1;
    ranges[n].lo = (uintptr_t)addr;
    ranges[n].faults = 0;
    ranges[n].hi = (uintptr_t)addr + len;
    __atomic_store_n(&n_ranges, n + 1, __ATOMIC_SEQ_CST);
    return 0;
}

/* Stop guarding the range that starts at addr (its map is being closed). */
int lm_guard_remove(void *addr) {
    int n = n_ranges;
    for (int i = 0; i < n; i++) {
        if (ranges[i].hi != 0 && ranges[i].lo == (uintptr_t)addr) {
            __atomic_store_n(&ranges[i].hi, 0, __ATOMIC_SEQ_CST); /* matches nothing from here on */
            return 0;
        }
    }
    return -1;
}

/* Faults absorbed so far in the process (each one a guarded read found past its file's end). */
long lm_guard_faults(void) { return __atomic_load_n(&faults, __ATOMIC_SEQ_CST); }

/* Faults absorbed in the guarded range that starts at addr; -1 when no guarded range starts there. */
long lm_guard_faults_at(void *addr) {
    int n = n_ranges;
    for (int i = 0; i < n; i++)
        if (ranges[i].hi != 0 && ranges[i].lo == (uintptr_t)addr)
            return __atomic_load_n(&ranges[i].faults, __ATOMIC_SEQ_CST);
    return -1;
}
