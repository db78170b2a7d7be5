# The two sizes of the slot format, defined once for C and Python: a slot is a
# HEADER_SIZE-byte header followed by the payload rounded up to ALIGN, and every buffer,
# length and file offset the ring moves is ALIGN-aligned (O_DIRECT). Python code reads
# them as kvstore._slotfile.HEADER_SIZE / ALIGN (re-exported by kvstore.format.layout).
cdef enum:
    KVS_HEADER_SIZE = 4096
    KVS_ALIGN = 4096
