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
 * While messages flow, the program's clock also runs slower than the real
 * one, by INSTR_COUNT_TIME_SCALE (default 1000; 1 for the real rate). Under
 * callgrind in a TCG guest a message's work, pauses aside, takes about a
 * millisecond; on a NIC a round trip takes about a microsecond. Work paced
 * by the clock, such as a timer read about every 2 ms, would otherwise come
 * about once per message, a thousand times as often as on the hardware the
 * count stands for. The slowing covers the spells between one pause and the
 * next, each for at most its first 10 ms of real time: before the first
 * post (set-up) and after a spell's first 10 ms (a teardown that waits for
 * 50 ms of quiet, say) the clock runs at the real rate, so such waits do not
 * grow a thousandfold. Only the program's view of time changes: its sleeps
 * and the pauses run in real time.
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

/* The clock as the program sees it: what is taken away from the real one.
 * Only the thread that posts changes it (around a pause); other threads read
 * it through their clock, so it is published under a sequence lock: odd
 * while a change is under way, and a reader retries until it reads the
 * same even number before and after. */
struct clock_view {
	/* Every finished pause. */
	long long paused_total_ns;
	/* What the slowing took from the finished spells between pauses. */
	long long slowed_total_ns;
	/* The real CLOCK_MONOTONIC time the last pause ended: the start of the
	 * spell the program is in; 0 before the first pause and during one. */
	long long spell_start_ns;
	/* The real CLOCK_MONOTONIC time the pause under way began; 0 outside
	 * one. A thread that reads its clock during a pause sees it stand
	 * still, as the posting thread would. */
	long long pause_start_ns;
};
static struct clock_view view;
static unsigned long view_seq;

static struct clock_view read_view(void)
{
	struct clock_view copy;
	unsigned long before, after;
	do {
		before = __atomic_load_n(&view_seq, __ATOMIC_ACQUIRE);
		copy.paused_total_ns = __atomic_load_n(&view.paused_total_ns, __ATOMIC_RELAXED);
		copy.slowed_total_ns = __atomic_load_n(&view.slowed_total_ns, __ATOMIC_RELAXED);
		copy.spell_start_ns = __atomic_load_n(&view.spell_start_ns, __ATOMIC_RELAXED);
		copy.pause_start_ns = __atomic_load_n(&view.pause_start_ns, __ATOMIC_RELAXED);
		__atomic_thread_fence(__ATOMIC_ACQUIRE);
		after = __atomic_load_n(&view_seq, __ATOMIC_RELAXED);
	} while ((before & 1) || before != after);
	return copy;
}

/* The one writer: `change` is the view as it is to be. */
static void publish_view(const struct clock_view *change)
{
	unsigned long seq = __atomic_load_n(&view_seq, __ATOMIC_RELAXED);
	__atomic_store_n(&view_seq, seq + 1, __ATOMIC_RELAXED);
	__atomic_thread_fence(__ATOMIC_RELEASE);
	__atomic_store_n(&view.paused_total_ns, change->paused_total_ns, __ATOMIC_RELAXED);
	__atomic_store_n(&view.slowed_total_ns, change->slowed_total_ns, __ATOMIC_RELAXED);
	__atomic_store_n(&view.spell_start_ns, change->spell_start_ns, __ATOMIC_RELAXED);
	__atomic_store_n(&view.pause_start_ns, change->pause_start_ns, __ATOMIC_RELAXED);
	__atomic_store_n(&view_seq, seq + 2, __ATOMIC_RELEASE);
}

static int clock_gettime_real(clockid_t clock, struct timespec *ts)
{
	static int (*real)(clockid_t, struct timespec *);
	if (!real)
		real = (int (*)(clockid_t, struct timespec *)) dlsym(RTLD_NEXT, "clock_gettime");
	return real(clock, ts);
}

static long long real_monotonic_ns(void)
{
	struct timespec ts;
	clock_gettime_real(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* INSTR_COUNT_TIME_SCALE, read once (1: the real rate). Threads that race
 * to read it first compute the same value. */
static long long time_scale(void)
{
	static long long scale = -1;
	long long known = __atomic_load_n(&scale, __ATOMIC_RELAXED);
	if (known < 0) {
		const char *text = getenv("INSTR_COUNT_TIME_SCALE");
		long long value = text ? atoll(text) : 1000;
		known = value > 0 ? value : 1;
		__atomic_store_n(&scale, known, __ATOMIC_RELAXED);
	}
	return known;
}

/* The longest real time of a spell that is slowed: a message's work under
 * callgrind in the guest takes well under it, and a wait that outlasts it
 * (a teardown's 50 ms drain, say) runs at the real rate from then on. */
#define SLOWED_SPELL_NS 10000000LL

/* What slowing takes from a spell of `spell_ns` real nanoseconds. */
static long long slowed_ns(long long spell_ns)
{
	long long scale = time_scale();
	if (spell_ns <= 0 || scale == 1)
		return 0;
	long long slowed = spell_ns < SLOWED_SPELL_NS ? spell_ns : SLOWED_SPELL_NS;
	return slowed - slowed / scale;
}

/* The latest time each clock gave the program (ids up to CLOCK_BOOTTIME). */
static long long last_read_ns[CLOCK_BOOTTIME + 1];

/* The program's clock: less the pauses, and slowed while messages flow. */
int clock_gettime(clockid_t clock, struct timespec *ts)
{
	int rc = clock_gettime_real(clock, ts);
	/* Wall and monotonic clocks only: a CPU-time clock never saw the pauses. */
	int paused = clock == CLOCK_MONOTONIC || clock == CLOCK_MONOTONIC_RAW || clock == CLOCK_MONOTONIC_COARSE ||
		     clock == CLOCK_BOOTTIME || clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE;
	if (rc != 0 || !paused)
		return rc;
	long long real = ts->tv_sec * 1000000000LL + ts->tv_nsec;
	struct clock_view now = read_view();
	long long taken = now.paused_total_ns + now.slowed_total_ns;
	if (now.pause_start_ns > 0 || now.spell_start_ns > 0) {
		long long monotonic = clock == CLOCK_MONOTONIC ? real : real_monotonic_ns();
		if (now.pause_start_ns > 0) {
			/* Still at the pause's start, for as long as it lasts. */
			long long into_pause = monotonic - now.pause_start_ns;
			taken += into_pause > 0 ? into_pause : 0;
		} else {
			taken += slowed_ns(monotonic - now.spell_start_ns);
		}
	}
	if (taken == 0)
		return rc;
	long long ns = real - taken;
	/* Never earlier than this clock last read: the real clocks are read
	 * apart from the view, and a slowed nanosecond is a thousand real ones. */
	long long *last = &last_read_ns[clock];
	long long seen = __atomic_load_n(last, __ATOMIC_RELAXED);
	while (ns > seen && !__atomic_compare_exchange_n(last, &seen, ns, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
		;
	if (ns < seen)
		ns = seen;
	ts->tv_sec = ns / 1000000000LL;
	ts->tv_nsec = ns % 1000000000LL;
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
	/* Only this thread changes the view: its plain copy is current. */
	struct clock_view change = view;
	long long before = real_monotonic_ns();
	/* The spell since the last pause ends here: what slowing took from it
	 * stays taken, and the clock stands still until the pause ends. */
	if (change.spell_start_ns > 0)
		change.slowed_total_ns += slowed_ns(before - change.spell_start_ns);
	change.spell_start_ns = 0;
	change.pause_start_ns = before;
	publish_view(&change);
	struct timespec left = { pause_ns / 1000000000L, pause_ns % 1000000000L };
	while (nanosleep(&left, &left) != 0)
		;
	long long after = real_monotonic_ns();
	change.paused_total_ns += after - before;
	change.pause_start_ns = 0;
	change.spell_start_ns = after;
	publish_view(&change);
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
