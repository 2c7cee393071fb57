/*
 * tools/live-heap.c: an LD_PRELOAD tracker of the blocks a process holds,
 * for finding what makes a long-running server's heap grow.
 *
 * glibc's count of the heap in use (what `ping_pong --heap-report-ms`
 * prints) says how much is held, not by whom. This tracker records every
 * block malloc, calloc, realloc, posix_memalign and aligned_alloc hand out
 * (its size, a sequence number, and the call stack) until it is freed, and
 * every LIVE_HEAP_PERIOD seconds (default 30) writes the blocks live then to
 * $LIVE_HEAP_DIR/snap.PID.NNN: a header line "seq S live N", then one line per
 * block, "SEQ SIZE FRAME...". It writes the process's /proc/self/maps to
 * $LIVE_HEAP_DIR/maps.PID once, so that tools/live-heap-report can name the
 * frames. A block allocated after one snapshot and still live at a much
 * later one is held for good: a leak, or capacity that grew.
 *
 * Use (tests/long_lived.rs passes a server environment of its own; add
 * these to it, and give the guest the directory with rxe-vm --rw DIR):
 *   LD_PRELOAD=.../live-heap.so LIVE_HEAP_DIR=DIR [LIVE_HEAP_PERIOD=S] server ...
 *   tools/live-heap-report DIR/snap.PID.* DIR/maps.PID
 *
 * Costs: a call stack per allocation (a long_lived server ran at about 90
 * cycles/s instead of 120), and about 110 MB for the table and the copy a
 * snapshot takes. While MOST_LIVE blocks are live the tracker records no
 * more (a snapshot's header then ends in "full"), rather than slow to a
 * crawl. Allocations made before the tracker's
 * constructor ran (the dynamic loader's) are served from a small static
 * buffer and never tracked.
 *
 * Build: cc -O2 -shared -fPIC -o live-heap.so tools/live-heap.c -ldl -lpthread
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define TABLE_SLOTS (1u << 19)
/* Most blocks live at once before the tracker stops: the table stays at
 * most three quarters full, so its linear probes stay short. */
#define MOST_LIVE (TABLE_SLOTS / 4 * 3)
#define FRAMES 10

struct block {
	uintptr_t ptr; /* 0: a free slot */
	size_t size;
	uint64_t seq;
	void *frames[FRAMES];
};

static struct block *table, *copy;
static size_t live;
static int full;
static volatile int table_lock;
static uint64_t next_seq;
/* Set while the tracker itself runs: backtrace() and stdio allocate. */
static __thread int busy;

static void *(*real_malloc)(size_t);
static void (*real_free)(void *);
static void *(*real_calloc)(size_t, size_t);
static void *(*real_realloc)(void *, size_t);
static int (*real_posix_memalign)(void **, size_t, size_t);
static void *(*real_aligned_alloc)(size_t, size_t);

/* dlsym itself allocates before the real functions are known. */
static char early[65536];
static size_t early_used;

static int is_early(void *p)
{
	return (char *)p >= early && (char *)p < early + sizeof(early);
}

static void *early_alloc(size_t n)
{
	size_t at = early_used;

	early_used += (n + 15) & ~(size_t)15;
	if (early_used > sizeof(early))
		abort();
	return early + at;
}

static void lock(void)
{
	while (__sync_lock_test_and_set(&table_lock, 1))
		;
}

static void unlock(void)
{
	__sync_lock_release(&table_lock);
}

static size_t home(uintptr_t p)
{
	return (size_t)(((p >> 4) * 0x9E3779B97F4A7C15ull) >> 45) & (TABLE_SLOTS - 1);
}

static void record(void *p, size_t size)
{
	void *frames[FRAMES + 2];
	int n, k;
	size_t i;

	if (!p || !table || busy)
		return;
	busy = 1;
	/* The first two frames are this tracker's own. */
	n = backtrace(frames, FRAMES + 2);
	lock();
	if (live >= MOST_LIVE) {
		full = 1;
	} else {
		for (i = home((uintptr_t)p); table[i].ptr; i = (i + 1) & (TABLE_SLOTS - 1))
			;
		table[i].ptr = (uintptr_t)p;
		table[i].size = size;
		table[i].seq = ++next_seq;
		memset(table[i].frames, 0, sizeof(table[i].frames));
		for (k = 2; k < n; k++)
			table[i].frames[k - 2] = frames[k];
		live++;
	}
	unlock();
	busy = 0;
}

static void forget(void *p)
{
	size_t i, j, h;

	if (!p || !table)
		return;
	lock();
	for (i = home((uintptr_t)p); table[i].ptr && table[i].ptr != (uintptr_t)p;
	     i = (i + 1) & (TABLE_SLOTS - 1))
		;
	if (table[i].ptr) {
		live--;
		/* Backward-shift deletion keeps every probe chain unbroken. */
		for (j = i;;) {
			table[i].ptr = 0;
			for (;;) {
				j = (j + 1) & (TABLE_SLOTS - 1);
				if (!table[j].ptr)
					goto done;
				h = home(table[j].ptr);
				if (i <= j ? (i < h && h <= j) : (i < h || h <= j))
					continue;
				break;
			}
			table[i] = table[j];
			i = j;
		}
	}
done:
	unlock();
}

static void write_maps(const char *dir)
{
	char path[512], buf[4096];
	FILE *in, *out;
	size_t n;

	snprintf(path, sizeof(path), "%s/maps.%d", dir, (int)getpid());
	in = fopen("/proc/self/maps", "r");
	out = fopen(path, "w");
	if (in && out)
		while ((n = fread(buf, 1, sizeof(buf), in)) > 0)
			fwrite(buf, 1, n, out);
	if (in)
		fclose(in);
	if (out)
		fclose(out);
}

static void *snapshots(void *arg)
{
	const char *dir = arg;
	const char *period_env = getenv("LIVE_HEAP_PERIOD");
	int period = period_env ? atoi(period_env) : 30;
	char path[512];
	size_t i, n;
	uint64_t seq;
	int was_full, k;
	FILE *f;

	busy = 1;
	write_maps(dir);
	for (int snap = 0;; snap++) {
		sleep(period > 0 ? period : 30);
		/* Copied under the lock, written outside it. */
		lock();
		for (i = 0, n = 0; i < TABLE_SLOTS; i++)
			if (table[i].ptr)
				copy[n++] = table[i];
		seq = next_seq;
		was_full = full;
		unlock();
		snprintf(path, sizeof(path), "%s/snap.%d.%03d", dir, (int)getpid(), snap);
		f = fopen(path, "w");
		if (!f)
			continue;
		fprintf(f, "seq %llu live %zu%s\n", (unsigned long long)seq, n,
			was_full ? " full" : "");
		for (i = 0; i < n; i++) {
			fprintf(f, "%llu %zu", (unsigned long long)copy[i].seq, copy[i].size);
			for (k = 0; k < FRAMES && copy[i].frames[k]; k++)
				fprintf(f, " %lx", (unsigned long)(uintptr_t)copy[i].frames[k]);
			fputc('\n', f);
		}
		fclose(f);
	}
	return NULL;
}

__attribute__((constructor)) static void start(void)
{
	void *frames[2];
	const char *dir = getenv("LIVE_HEAP_DIR");
	pthread_t thread;

	busy = 1;
	real_malloc = dlsym(RTLD_NEXT, "malloc");
	real_free = dlsym(RTLD_NEXT, "free");
	real_calloc = dlsym(RTLD_NEXT, "calloc");
	real_realloc = dlsym(RTLD_NEXT, "realloc");
	real_posix_memalign = dlsym(RTLD_NEXT, "posix_memalign");
	real_aligned_alloc = dlsym(RTLD_NEXT, "aligned_alloc");
	/* backtrace() loads its unwinder (and allocates) on first use. */
	backtrace(frames, 2);
	if (dir) {
		table = real_calloc(TABLE_SLOTS, sizeof(*table));
		copy = real_calloc(TABLE_SLOTS, sizeof(*copy));
		if (table && copy)
			pthread_create(&thread, NULL, snapshots, (void *)dir);
		else
			table = NULL;
	}
	busy = 0;
}

void *malloc(size_t n)
{
	void *p;

	if (!real_malloc)
		return early_alloc(n);
	p = real_malloc(n);
	record(p, n);
	return p;
}

void *calloc(size_t count, size_t size)
{
	void *p;

	if (!real_calloc) {
		if (size && count > SIZE_MAX / size)
			return NULL;
		/* The early buffer is zero (static) and never reused. */
		return early_alloc(count * size);
	}
	p = real_calloc(count, size);
	record(p, count * size);
	return p;
}

void free(void *p)
{
	if (is_early(p))
		return;
	forget(p);
	real_free(p);
}

void *realloc(void *p, size_t n)
{
	void *q;

	if (is_early(p)) {
		size_t left = (size_t)(early + sizeof(early) - (char *)p);

		q = malloc(n);
		if (q)
			memcpy(q, p, n < left ? n : left);
		return q;
	}
	forget(p);
	q = real_realloc(p, n);
	if (q)
		record(q, n);
	else if (p && n)
		record(p, 0); /* refused: the old block is still held (size unknown) */
	return q;
}

int posix_memalign(void **out, size_t align, size_t n)
{
	int rc = real_posix_memalign(out, align, n);

	if (!rc)
		record(*out, n);
	return rc;
}

void *aligned_alloc(size_t align, size_t n)
{
	void *p = real_aligned_alloc(align, n);

	record(p, n);
	return p;
}
