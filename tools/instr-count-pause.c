/*
 * tools/instr-count-pause.c: preloaded into a client that callgrind counts
 * (tools/instr-count). Every post to a send queue is followed by a pause, long
 * enough for the peer's answer and the completions to have arrived, during
 * which callgrind's collection is off (a client request, which is a no-op
 * outside valgrind). So when the
 * program next polls its CQ or its memory, what it waits for is already
 * there: no empty polls, and the count per message is the same in every run,
 * for our runtime and for perftest alike. Without it, a busy-polling client
 * spins a number of empty polls that depends on timing.
 *
 * Both post paths are covered: the ops table behind ibv_post_send (ours, and
 * perftest with --use_old_post_send), and the ibv_wr_* API's wr_complete
 * (perftest's default).
 *
 * The pauses are also hidden from the program's clock: clock_gettime
 * returns the time less every pause so far. Work a program does by the clock
 * (reading it every couple of milliseconds, checking its peers every so
 * often) then comes as often per message as it would if the answer had been
 * there at once, instead of once per pause. (A cycle counter such as
 * perftest's and quanta's RDTSC cannot be adjusted; only their latency
 * figures see the pauses, not their instruction counts.)
 *
 * INSTR_COUNT_PAUSE_US sets the pause (default 5000 microseconds).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <infiniband/verbs.h>
#include <stdlib.h>
#include <time.h>
#include <valgrind/callgrind.h>

typedef int (*post_send_fn)(struct ibv_qp *, struct ibv_send_wr *, struct ibv_send_wr **);
typedef int (*wr_complete_fn)(struct ibv_qp_ex *);

/* One provider per process in the programs this is for: one original each. */
static post_send_fn original_post_send;
static wr_complete_fn original_wr_complete;

/* Nanoseconds paused so far (the programs counted post from one thread). */
static long long paused_total_ns;

static int clock_gettime_real(clockid_t clock, struct timespec *ts)
{
	static int (*real)(clockid_t, struct timespec *);
	if (!real)
		real = (int (*)(clockid_t, struct timespec *)) dlsym(RTLD_NEXT, "clock_gettime");
	return real(clock, ts);
}

/* The program's clock, less the pauses. */
int clock_gettime(clockid_t clock, struct timespec *ts)
{
	int rc = clock_gettime_real(clock, ts);
	/* Wall and monotonic clocks only: a CPU-time clock never saw the pauses. */
	int paused = clock == CLOCK_MONOTONIC || clock == CLOCK_MONOTONIC_RAW || clock == CLOCK_MONOTONIC_COARSE ||
		     clock == CLOCK_BOOTTIME || clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE;
	if (rc == 0 && paused && paused_total_ns > 0) {
		long long ns = ts->tv_sec * 1000000000LL + ts->tv_nsec - paused_total_ns;
		ts->tv_sec = ns / 1000000000LL;
		ts->tv_nsec = ns % 1000000000LL;
	}
	return rc;
}

/* Nothing in here is counted: collection is off from the first line to the last. */
static void instr_count_pause(void)
{
	CALLGRIND_TOGGLE_COLLECT;
	static long pause_ns = -1;
	if (pause_ns < 0) {
		const char *text = getenv("INSTR_COUNT_PAUSE_US");
		long us = text ? atol(text) : 5000;
		pause_ns = (us > 0 ? us : 5000) * 1000L;
	}
	struct timespec before, after;
	clock_gettime_real(CLOCK_MONOTONIC, &before);
	struct timespec left = { pause_ns / 1000000000L, pause_ns % 1000000000L };
	while (nanosleep(&left, &left) != 0)
		;
	clock_gettime_real(CLOCK_MONOTONIC, &after);
	paused_total_ns += (after.tv_sec - before.tv_sec) * 1000000000LL + (after.tv_nsec - before.tv_nsec);
	CALLGRIND_TOGGLE_COLLECT;
}

static int paused_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
	int rc = original_post_send(qp, wr, bad);
	instr_count_pause();
	return rc;
}

static int paused_wr_complete(struct ibv_qp_ex *qp)
{
	int rc = original_wr_complete(qp);
	instr_count_pause();
	return rc;
}

struct ibv_context *ibv_open_device(struct ibv_device *device)
{
	static struct ibv_context *(*real)(struct ibv_device *);
	if (!real)
		real = (struct ibv_context * (*)(struct ibv_device *)) dlsym(RTLD_NEXT, "ibv_open_device");
	struct ibv_context *context = real(device);
	if (context && context->ops.post_send != paused_post_send) {
		original_post_send = context->ops.post_send;
		context->ops.post_send = paused_post_send;
	}
	return context;
}

struct ibv_qp_ex *ibv_qp_to_qp_ex(struct ibv_qp *qp)
{
	static struct ibv_qp_ex *(*real)(struct ibv_qp *);
	if (!real)
		real = (struct ibv_qp_ex * (*)(struct ibv_qp *)) dlsym(RTLD_NEXT, "ibv_qp_to_qp_ex");
	struct ibv_qp_ex *qpx = real(qp);
	if (qpx && qpx->wr_complete && qpx->wr_complete != paused_wr_complete) {
		original_wr_complete = qpx->wr_complete;
		qpx->wr_complete = paused_wr_complete;
	}
	return qpx;
}
