cdef class SlotFile:
    cdef:
        public str path
        int fd_
        readonly unsigned long long slot_size
        readonly unsigned long long num_slots
        readonly bint direct
        readonly bint readonly
