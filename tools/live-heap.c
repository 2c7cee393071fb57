/*
 * tools/live-heap.c: an LD_PRELOAD tracker of the blocks a process holds,
 * for finding what makes a long-running server's heap grow.
 *
 * glibc's count of the heap in use (what `ping_pong --heap-report-ms`
 * prints) says how much is held, not by whom. This tracker records every
 * block the allocator hands out (its size, a sequence number, and the call
 * stack) until it is freed, and every LIVE_HEAP_PERIOD seconds (default 30)
 * writes the blocks live then to $LIVE_HEAP_DIR/snap.PID.NNN: a header line
 * "seq S live N", then one line per block, "SEQ SIZE FRAME...". With each
 * snapshot it rewrites $LIVE_HEAP_DIR/maps.PID (the process's mappings, so
 * that tools/live-heap-report can name the frames, in libraries opened
 * late too). A block allocated after one snapshot and still live at a much
 * later one is held for good: a leak, or capacity that grew.
 *
 * Use (tests/long_lived.rs passes a server environment of its own; add
 * these to it, and give the guest the directory with rxe-vm --rw DIR):
 *   LD_PRELOAD=.../live-heap.so LIVE_HEAP_DIR=DIR [LIVE_HEAP_PERIOD=S] server ...
 *   tools/live-heap-report DIR/snap.PID.* DIR/maps.PID
 *
 * What it sees: the blocks of malloc, calloc, realloc (and reallocarray),
 * posix_memalign, aligned_alloc, memalign, valloc and pvalloc. It calls
 * glibc's own __libc_* functions underneath, so it works from the first
 * allocation of the process, before its constructor has run (those early
 * blocks go untracked). Without LIVE_HEAP_DIR it tracks nothing, nor does a
 * forked child.
 *
 * Costs: a call stack per allocation (a long_lived server ran at about 90
 * cycles/s instead of 120), and about 110 MB for the table and the copy a
 * snapshot takes, during which allocating threads wait. While MOST_LIVE
 * blocks are live the tracker records no more (that snapshot's header then
 * ends in "full"), rather than slow to a crawl.
 *
 * Build: cc -O2 -shared -fPIC -o live-heap.so tools/live-heap.c -lpthread
 */
#define _GNU_SOURCE
#include <errno.h>
#include <execinfo.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* glibc's allocator itself, under the names it exports for this. */
extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void *__libc_valloc(size_t);
extern void *__libc_pvalloc(size_t);

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
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t next_seq;
static char dir[PATH_MAX];
static int period = 30;
/* Set while the tracker itself runs (backtrace() and stdio allocate);
 * initial-exec, so reading it never allocates. */
static __thread int busy __attribute__((tls_model("initial-exec")));

static void lock(void)
{
	pthread_mutex_lock(&table_lock);
}

static void unlock(void)
{
	pthread_mutex_unlock(&table_lock);
}

/* Around a fork: the table's lock is held across it, so the child's copy
 * is consistent; `busy`, so that other fork handlers run meanwhile that
 * allocate do not wait for the lock this thread holds. */
static void before_fork(void)
{
	busy = 1;
	lock();
}

static void after_fork(void)
{
	unlock();
	busy = 0;
}

/* The child takes no snapshots: it tracks nothing either. */
static void after_fork_in_child(void)
{
	table = NULL;
	after_fork();
}

static size_t home(uintptr_t p)
{
	return (size_t)(((p >> 4) * 0x9E3779B97F4A7C15ull) >> 45) & (TABLE_SLOTS - 1);
}

/* Not inlined: the two frames it skips are its own and its caller's. */
static __attribute__((noinline)) void record(void *p, size_t size)
{
	void *frames[FRAMES + 2];
	int n, k;
	size_t i;

	if (!p || !table || busy)
		return;
	busy = 1;
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

	if (!p || !table || busy)
		return;
	busy = 1;
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
	busy = 0;
}

static void write_maps(void)
{
	char path[PATH_MAX + 32], buf[4096];
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

static void *snapshots(void *unused)
{
	char path[PATH_MAX + 32];
	size_t i, n;
	uint64_t seq;
	int was_full, k;
	FILE *f;

	(void)unused;
	busy = 1;
	for (int snap = 0;; snap++) {
		sleep(period);
		/* Copied under the lock, written outside it. */
		lock();
		for (i = 0, n = 0; i < TABLE_SLOTS; i++)
			if (table[i].ptr)
				copy[n++] = table[i];
		seq = next_seq;
		was_full = full;
		full = 0;
		unlock();
		write_maps();
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
	const char *dir_env = getenv("LIVE_HEAP_DIR");
	const char *period_env = getenv("LIVE_HEAP_PERIOD");
	pthread_t thread;

	if (!dir_env || strlen(dir_env) >= sizeof(dir))
		return;
	busy = 1;
	strcpy(dir, dir_env);
	if (period_env && atoi(period_env) > 0)
		period = atoi(period_env);
	/* backtrace() loads its unwinder (and allocates) on first use. */
	backtrace(frames, 2);
	pthread_atfork(before_fork, after_fork, after_fork_in_child);
	table = __libc_calloc(TABLE_SLOTS, sizeof(*table));
	copy = __libc_calloc(TABLE_SLOTS, sizeof(*copy));
	if (table && copy) {
		write_maps();
		pthread_create(&thread, NULL, snapshots, NULL);
	} else {
		table = NULL;
	}
	busy = 0;
}

void *malloc(size_t n)
{
	void *p = __libc_malloc(n);

	record(p, n);
	return p;
}

void *calloc(size_t count, size_t size)
{
	void *p = __libc_calloc(count, size);

	/* calloc refused an overflowing product, so a block's is exact. */
	record(p, count * size);
	return p;
}

void free(void *p)
{
	forget(p);
	__libc_free(p);
}

void *realloc(void *p, size_t n)
{
	void *q;

	forget(p);
	q = __libc_realloc(p, n);
	/* Refused, the old block is still held, and goes untracked: recorded
	 * again it would pass for a block allocated now. */
	if (q)
		record(q, n);
	return q;
}

void *memalign(size_t align, size_t n)
{
	void *p = __libc_memalign(align, n);

	record(p, n);
	return p;
}

int posix_memalign(void **out, size_t align, size_t n)
{
	void *p;

	if (align < sizeof(void *) || (align & (align - 1)))
		return EINVAL;
	p = __libc_memalign(align, n);
	if (!p)
		return ENOMEM;
	record(p, n);
	*out = p;
	return 0;
}

void *aligned_alloc(size_t align, size_t n)
{
	return memalign(align, n);
}

void *valloc(size_t n)
{
	void *p = __libc_valloc(n);

	record(p, n);
	return p;
}

void *pvalloc(size_t n)
{
	void *p = __libc_pvalloc(n);

	record(p, n);
	return p;
}
