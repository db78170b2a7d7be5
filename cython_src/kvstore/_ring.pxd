from libc.stdint cimport uint32_t, uint64_t, int64_t, uintptr_t
from liburing.lib.type cimport __iovec
from kvstore.includes.uring cimport io_uring

cdef enum:
    OP_READ = 0
    OP_WRITE = 1
    OP_FSYNC = 2
    MAX_BUFFERS = 64
    MAX_ACTIVE = 8       # batches one ring keeps in flight at once (a stream's parts)

cdef struct SlotWork:
    # The slot codec's part of one op (Ring.slot_io): the header is stamped just before a
    # write is first submitted, and a read is checked as soon as it completes.
    const char *key
    uint32_t key_len
    uint64_t slot
    uint64_t generation
    uint64_t payload_len
    char *hdr            # 4096-byte header
    char *payload
    int verify           # reads: 0 none, 1 header, 2 header + payload checksum
    int status           # reads: SlotCheck code (0 = good) once the read completed
    int stamped          # writes: the header is stamped (once, before the first submission)
    int parts_left       # ops of this slot not finished yet (2 when header and payload are
                         # separate fixed-buffer ops, else 1)
    int64_t error        # first -errno among its ops, or 0
    int64_t moved        # bytes its ops moved

cdef struct Op:
    int opcode
    int fd
    int fixed_file       # registered file index, or -1
    int fixed_buf        # registered buffer index, or -1
    char *addr           # where the next byte goes / comes from
    unsigned int remaining
    uint64_t offset      # file offset of the next byte
    int64_t done         # bytes transferred so far
    int64_t result       # final: bytes, or -errno
    unsigned int forced_short  # test seam: truncate the first submission
    int finished
    int niov             # 0: one buffer (addr/remaining); else header + payload iovecs
    __iovec iov[2]       # vectored ops: what is left to transfer
    __iovec sub[2]       # vectored ops: what the SQE in flight points at (stable memory)
    SlotWork *work       # slot codec work, or NULL for raw I/O
    void *batch          # the Batch this op belongs to (its CQEs carry the op's address)

cdef struct Batch:
    Op *ops
    Py_ssize_t n
    Py_ssize_t *queue    # circular queue of op indices waiting for submission
    Py_ssize_t qhead
    Py_ssize_t qlen
    Py_ssize_t inflight
    Py_ssize_t max_inflight  # ops in flight at most (the queue depth, times the ops per slot)
    Py_ssize_t completed
    SlotWork **checks        # slot_io reads whose last op completed, not yet checked
    Py_ssize_t nchecks
    bint active              # in the ring's active list (its ops may be in flight)

cdef class SlotIOPart


cdef class Ring:
    cdef:
        io_uring _ring
        bint _open
        unsigned int depth
        list _buffers            # HostBuffers usable as I/O memory (registered or not)
        object _iov              # liburing iovec keeping registered views alive
        bint _bufs_registered
        uintptr_t _buf_start[64]     # registered pieces (<= 1 GiB each): fixed-buffer indices
        uintptr_t _buf_end[64]
        int _nbufs
        uintptr_t _mem_start[64]     # the whole buffers given to register_buffers
        uintptr_t _mem_end[64]
        int _nmem
        int *_files
        int _nfiles
        bint _files_registered
        dict _fd_names
        public object fault_injector
        Batch *_active[MAX_ACTIVE]  # batches with ops queued or in flight, oldest first
        int _nactive
        Py_ssize_t _inflight     # ops in the kernel's hands, over every active batch
        int _wake                # set by another thread (`wake`): a pump returns early

    cdef int _pump(self, Batch *b, bint wakeable=*) except -1
    cdef int _pump_nogil(self, Batch *b, bint wakeable) except -1 nogil
    cdef int _fill(self) noexcept nogil
    cdef Py_ssize_t _reap(self) noexcept nogil
    cdef void _run_checks(self) noexcept nogil
    cdef int _activate(self, Batch *b) except -1
    cdef void _deactivate(self, Batch *b) noexcept
    cdef int _start(self, Batch *b, int opcode, a_fd, a_off, a_len) except -1
    cdef void _drain(self) noexcept
    cdef void _wait_idle(self, Batch *b) noexcept
    cdef _check_part(self, SlotIOPart part)
    cdef void _forget(self, Batch *b) noexcept
    cdef void _requeue(self, Batch *b, Py_ssize_t i) noexcept nogil
    cdef void _finish(self, Batch *b, Op *op) noexcept nogil
    cdef int _buffer_index(self, uintptr_t addr, uint64_t length) noexcept
    cdef bint _in_memory(self, uintptr_t addr, uint64_t length) noexcept
    cdef _check_op(self, int opcode, int fd, uint64_t offset, uintptr_t addr, uint64_t length)
    cdef _inject(self, Batch *b, int opcode, fds, offsets, lengths)
    cdef int _init_op(self, Op *op, int opcode, int fd, uint64_t offset) except -1
    cdef int _set_buffer(self, Op *op, uintptr_t addr, uint64_t length) except -1
    cdef _run_batch(self, Batch *b, int opcode, a_fd, a_off, a_len)
    cdef _abandon(self, Batch *b)
    cdef _release(self, Batch *b)


cdef class SlotIOPart:
    cdef Batch b
    cdef SlotWork *works
    cdef Ring ring
    cdef object keys      # the C side borrows pointers into these bytes
    cdef object out
    cdef object status
    cdef Py_ssize_t nslots
    cdef bint ended
