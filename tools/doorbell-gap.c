/*
 * tools/doorbell-gap.c: an LD_PRELOAD probe for tools/compare-perftest.
 *
 * Soft-RoCE rings its doorbell with a small write() on the uverbs fd, so the
 * time between two such writes is what user space spends per operation on
 * the latency path (noticing the completion, handling it, staging the next
 * request), and the time inside one is the kernel's share. Timing both in
 * our benchmark and in perftest's, with the same probe, separates what the
 * runtime adds from what the emulated device costs, which end-to-end
 * latencies under TCG are too noisy to show.
 *
 * At exit it prints one line to stderr:
 *   doorbell-gap: N doorbells, median between X ns, median inside Y ns
 *
 * Build: cc -O2 -shared -fPIC -o doorbell-gap.so doorbell-gap.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <x86intrin.h>

#define MAX_SAMPLES (1 << 20)
#define MAX_FDS 1024

static uint64_t inside[MAX_SAMPLES], between[MAX_SAMPLES];
static size_t n_inside, n_between;
static uint64_t last_end;
/* 0: not looked at yet, 1: a uverbs device, 2: anything else. */
static unsigned char fd_kind[MAX_FDS];
static ssize_t (*real_write)(int, const void *, size_t);
static uint64_t tsc_start;
static struct timespec wall_start;

static int is_uverbs(int fd)
{
	char link[64], target[128];
	ssize_t len;

	if (fd < 0 || fd >= MAX_FDS)
		return 0;
	if (!fd_kind[fd]) {
		snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
		len = readlink(link, target, sizeof(target) - 1);
		target[len > 0 ? len : 0] = '\0';
		fd_kind[fd] = strstr(target, "/dev/infiniband/uverbs") ? 1 : 2;
	}
	return fd_kind[fd] == 1;
}

ssize_t write(int fd, const void *buf, size_t count)
{
	uint64_t start, end;
	ssize_t rc;

	if (!real_write)
		real_write = (ssize_t (*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
	if (!is_uverbs(fd))
		return real_write(fd, buf, count);
	start = __rdtsc();
	rc = real_write(fd, buf, count);
	end = __rdtsc();
	if (last_end && n_between < MAX_SAMPLES)
		between[n_between++] = start - last_end;
	if (n_inside < MAX_SAMPLES)
		inside[n_inside++] = end - start;
	last_end = end;
	return rc;
}

static int by_value(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return (x > y) - (x < y);
}

__attribute__((constructor)) static void start(void)
{
	clock_gettime(CLOCK_MONOTONIC, &wall_start);
	tsc_start = __rdtsc();
}

__attribute__((destructor)) static void report(void)
{
	struct timespec wall_end;
	double ns, ns_per_tick;

	/* Setup issues a few hundred commands; the data path issues thousands. */
	if (n_between < 1000)
		return;
	clock_gettime(CLOCK_MONOTONIC, &wall_end);
	ns = (wall_end.tv_sec - wall_start.tv_sec) * 1e9 + (wall_end.tv_nsec - wall_start.tv_nsec);
	ns_per_tick = ns / (double)(__rdtsc() - tsc_start);
	qsort(inside, n_inside, sizeof(inside[0]), by_value);
	qsort(between, n_between, sizeof(between[0]), by_value);
	fprintf(stderr, "doorbell-gap: %zu doorbells, median between %.0f ns, median inside %.0f ns\n",
		n_inside, between[n_between / 2] * ns_per_tick, inside[n_inside / 2] * ns_per_tick);
}
