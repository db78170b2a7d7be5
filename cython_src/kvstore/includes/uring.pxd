# The C boundary of kvstore's I/O core, in one place.
#
# Static-inline helpers of liburing.h are called directly (they compile into our module);
# the library's non-inline entry points (queue init/exit, register) are reached
# through the `cpdef` functions of the `liburing` binding, which resolve through Cython
# capsules at import, so nothing is linked. Never `cimport *` from liburing.lib.uring:
# it retypes size_t.
from liburing.lib.uring cimport (
    __io_uring, __io_uring_sqe, __io_uring_cqe,
    __io_uring_get_sqe, __io_uring_prep_read, __io_uring_prep_write,
    __io_uring_prep_readv, __io_uring_prep_writev,
    __io_uring_prep_read_fixed, __io_uring_prep_write_fixed, __io_uring_prep_fsync,
    __io_uring_sqe_set_data64, __io_uring_sqe_set_flags,
    __io_uring_cq_ready, __io_uring_cq_advance,
    __IOSQE_FIXED_FILE, __IORING_FSYNC_DATASYNC,
)
from liburing.queue cimport (
    io_uring, io_uring_queue_init, io_uring_queue_exit,
)
from liburing.register cimport (
    io_uring_register_buffers, io_uring_unregister_buffers,
    io_uring_register_files, io_uring_unregister_files,
)
from liburing.common cimport iovec


# kvstore's own io_uring_enter (csrc/kvstore_enter.h): liburing 2.6's submit-and-wait as a
# static-inline function that returns -errno and never touches Python, so the pump's
# kernel calls need no GIL even when they fail (the binding's wrappers raise OSError, with
# the GIL, on every negative result).
cdef extern from "kvstore_enter.h" nogil:
    int kvs_submit_and_wait(__io_uring *ring, unsigned int wait_nr) noexcept
    int kvs_wait_one(__io_uring *ring) noexcept
    unsigned int kvs_sq_unconsumed(__io_uring *ring) noexcept
    void kvs_pause(long usec) noexcept
    void kvs_count(int which) noexcept
    unsigned long long kvs_stat(int which) noexcept
    void kvs_flag_set(int *flag) noexcept
    int kvs_flag_take(int *flag) noexcept
