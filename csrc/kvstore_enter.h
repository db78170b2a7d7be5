/* kvstore's io_uring_enter: liburing 2.6's io_uring_submit_and_wait, without the GIL.
 *
 * The `liburing` binding's cpdef wrappers turn a negative result into a Python OSError
 * (error.pyx trap_error), which takes the GIL; a caller declared `nogil` then takes it
 * again to check for that error. The ring's pump must never need the GIL (a thread that
 * holds it, e.g. vLLM's step loop, makes every take cost up to a switch interval), so it
 * calls the kernel through this header instead: a static-inline copy of what
 * __io_uring_submit_and_wait() does (liburing 2.6, src/queue.c) for the rings kvstore
 * creates (io_uring_queue_init with flags 0: no SQPOLL, no registered ring fd; IOPOLL and
 * a registered ring fd are handled anyway), returning -errno on failure. It reads only
 * the struct io_uring fields of liburing.h (the binding's copy, the same ABI).
 */
#ifndef KVSTORE_ENTER_H
#define KVSTORE_ENTER_H

#include <errno.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <liburing.h>

#ifndef _NSIG
#define _NSIG 65
#endif

/* liburing's private int_flags.h: the ring fd is registered (enter with its index). */
#define KVS_INT_FLAG_REG_RING 1

/* Retry counters of the pump (enter results it resumed from), for tests and diagnostics:
 * 0 EINTR, 1 EAGAIN, 2 EBUSY, 3 waits for a completion after an EAGAIN/EBUSY,
 * 4 sleeps (EAGAIN/EBUSY with nothing in the kernel's hands). Process-wide, atomic. */
#define KVS_NSTATS 5
static unsigned long long kvs_stats[KVS_NSTATS];

static inline void kvs_count(int which)
{
    if (which >= 0 && which < KVS_NSTATS)
        __atomic_fetch_add(&kvs_stats[which], 1ULL, __ATOMIC_RELAXED);
}

static inline unsigned long long kvs_stat(int which)
{
    if (which < 0 || which >= KVS_NSTATS)
        return 0;
    return __atomic_load_n(&kvs_stats[which], __ATOMIC_RELAXED);
}

static inline int kvs_enter(struct io_uring *ring, unsigned to_submit, unsigned wait_nr,
                            unsigned flags)
{
    long ret;
    if (ring->int_flags & KVS_INT_FLAG_REG_RING)
        flags |= IORING_ENTER_REGISTERED_RING;
    ret = syscall(__NR_io_uring_enter, ring->enter_ring_fd, to_submit, wait_nr, flags,
                  NULL, _NSIG / 8);
    return ret < 0 ? -errno : (int)ret;
}

/* Publish the SQEs prepared since the last flush; returns how many the kernel has not
 * consumed yet (liburing's __io_uring_flush_sq). */
static inline unsigned kvs_flush_sq(struct io_uring *ring)
{
    struct io_uring_sq *sq = &ring->sq;
    unsigned tail = sq->sqe_tail;
    if (sq->sqe_head != tail) {
        sq->sqe_head = tail;
        /* the kernel must see the SQE contents before the new tail */
        io_uring_smp_store_release(sq->ktail, tail);
    }
    return tail - IO_URING_READ_ONCE(*sq->khead);
}

/* SQEs published to the kernel that it has not consumed yet (no flush). */
static inline unsigned kvs_sq_unconsumed(struct io_uring *ring)
{
    return IO_URING_READ_ONCE(*ring->sq.ktail) - IO_URING_READ_ONCE(*ring->sq.khead);
}

/* io_uring_submit_and_wait: submit what is prepared, wait for wait_nr completions.
 * Returns the number submitted (>= 0) or -errno (EINTR, EAGAIN, EBUSY, ...). */
static inline int kvs_submit_and_wait(struct io_uring *ring, unsigned wait_nr)
{
    unsigned submitted, flags = 0;
    int cq_needs_enter;
    if (ring->flags & IORING_SETUP_SQPOLL)
        return -EOPNOTSUPP;   /* kvstore never creates one; the SQ handshake differs */
    submitted = kvs_flush_sq(ring);
    cq_needs_enter = wait_nr != 0 || (ring->flags & IORING_SETUP_IOPOLL)
        || (IO_URING_READ_ONCE(*ring->sq.kflags) & (IORING_SQ_CQ_OVERFLOW | IORING_SQ_TASKRUN));
    if (!submitted && !cq_needs_enter)
        return 0;
    if (cq_needs_enter)
        flags |= IORING_ENTER_GETEVENTS;
    return kvs_enter(ring, submitted, wait_nr, flags);
}

/* Wait for one completion without submitting anything (after EAGAIN/EBUSY). */
static inline int kvs_wait_one(struct io_uring *ring)
{
    return kvs_enter(ring, 0, 1, IORING_ENTER_GETEVENTS);
}

/* A short pause when the kernel refused work and holds none of ours (EAGAIN). */
static inline void kvs_pause(long usec)
{
    struct timespec ts;
    ts.tv_sec = usec / 1000000;
    ts.tv_nsec = (usec % 1000000) * 1000;
    nanosleep(&ts, NULL);
}

/* A wake-up flag another thread sets while a pump runs (Ring.wake): the pump takes it at
 * the top of its loop once its target has nothing left to queue, and returns early, so
 * its caller can start new work on the ring. */
static inline void kvs_flag_set(int *flag)
{
    __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
}

static inline int kvs_flag_take(int *flag)
{
    return __atomic_exchange_n(flag, 0, __ATOMIC_ACQ_REL);
}

#endif
