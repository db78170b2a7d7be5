/* A stand-in for the handful of CUDA driver calls kvstore's copy engine makes, so the
 * engine's stream ordering can be exercised on a machine without a GPU.
 *
 * Built as `libcuda.so.1` and found by kvstore/_cuda.pyx's dlopen through
 * LD_LIBRARY_PATH (tools/gpu_check.py --device standin builds it and re-runs itself).
 * "Device memory" is host memory: a copy is a memcpy, a "kernel" is a memset or a wait.
 *
 * What it models: every stream is a FIFO of operations run in order by a thread of its
 * own, later than the call that enqueued them (the caller never waits); copy streams
 * (the ones cuStreamCreateWithPriority makes) can be told to start each operation late
 * (standin_set_copy_latency_us), so an operation that is not ordered behind another
 * really does run after it. Events follow the driver's rules: cuEventRecord captures the
 * work enqueued so far on its stream, cuStreamWaitEvent waits for the record made before
 * the call (a later record of the same event does not move it), cuEventQuery /
 * cuEventSynchronize look at the latest record, an event never recorded is complete.
 * Test controls: compute-side "kernels" (standin_fill, standin_gate + standin_open_gate)
 * and injected failures (a copy call failing at a given segment, an event record
 * failing).
 *
 * What it cannot model: real DMA engines and their overlap, the GPU's memory model
 * beyond stream order, the legacy default stream's implicit synchronisation, context
 * sticky errors, pinned-memory requirements. It proves the order kvstore asks the driver
 * for, not that a particular driver honours it.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

enum {
    OK = 0,
    ERR_INVALID_VALUE = 1,
    ERR_OUT_OF_MEMORY = 2,
    ERR_INVALID_DEVICE = 101,
    ERR_NOT_READY = 600,
    ERR_LAUNCH_FAILED = 719,
};

#define NDEV 2

/* -- events ------------------------------------------------------------------------ */
/* One record of an event: what a wait made after it waits for, whatever records of the
 * same event follow (they may run on other streams and finish first). */
typedef struct Rec {
    int done;
    int refs;               /* the event's latest-pointer, and each op or wait holding it */
} Rec;

typedef struct Event {
    Rec *latest;            /* NULL: never recorded (complete) */
} Event;

/* -- streams ----------------------------------------------------------------------- */
enum { OP_COPY, OP_RECORD, OP_WAIT, OP_FILL, OP_GATE, OP_MARK };

typedef struct Op {
    int kind;
    struct Op *next;
    size_t n;               /* OP_COPY: segments */
    CUdeviceptr *dst, *src;
    size_t *len;
    Rec *rec;               /* OP_RECORD / OP_WAIT */
    void *ptr;              /* OP_FILL */
    int value;
    size_t bytes;
    int gate;               /* OP_GATE */
} Op;

typedef struct Stream {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    Op *head, *tail;
    uint64_t enqueued, done;
    int is_copy;
    int stop;
} Stream;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static int g_gates_open[64];
static long g_copy_latency_us = 0;
static long g_fail_copy_at = -1;       /* fail the copy call whose segment index reaches it */
static long g_fail_record_in = -1;     /* fail the n-th next cuEventRecord (0: the next) */
static uint64_t g_segments = 0;        /* segments accepted by the copy calls */
static Stream *g_default = NULL;       /* stream 0 */
static int g_ctx[NDEV];
static __thread int t_dev = -1;

static void sleep_us(long us) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0) {}
}

static void rec_put(Rec *r) {           /* with g_mu held */
    if (r && --r->refs == 0) free(r);
}

static void rec_done(Rec *r) {
    pthread_mutex_lock(&g_mu);
    r->done = 1;
    rec_put(r);
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

static void rec_wait(Rec *r) {          /* waits, then drops the caller's reference */
    pthread_mutex_lock(&g_mu);
    while (r && !r->done) pthread_cond_wait(&g_cv, &g_mu);
    rec_put(r);
    pthread_mutex_unlock(&g_mu);
}

static Rec *rec_latest(Event *e) {      /* a reference to the event's latest record */
    pthread_mutex_lock(&g_mu);
    Rec *r = e->latest;
    if (r) r->refs++;
    pthread_mutex_unlock(&g_mu);
    return r;
}

static void run_op(Stream *s, Op *op) {
    size_t i;
    if (s->is_copy && g_copy_latency_us > 0 && (op->kind == OP_COPY))
        sleep_us(g_copy_latency_us);
    switch (op->kind) {
    case OP_COPY:
        for (i = 0; i < op->n; i++)
            memmove((void *)(uintptr_t)op->dst[i], (const void *)(uintptr_t)op->src[i], op->len[i]);
        free(op->dst); free(op->src); free(op->len);
        break;
    case OP_RECORD:
        rec_done(op->rec);
        break;
    case OP_WAIT:
        rec_wait(op->rec);
        break;
    case OP_FILL:
        memset(op->ptr, op->value, op->bytes);
        break;
    case OP_GATE:
        pthread_mutex_lock(&g_mu);
        while (!g_gates_open[op->gate]) pthread_cond_wait(&g_cv, &g_mu);
        pthread_mutex_unlock(&g_mu);
        break;
    default:
        break;
    }
}

static void *stream_main(void *arg) {
    Stream *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->head && !s->stop) pthread_cond_wait(&s->cv, &s->mu);
        if (!s->head && s->stop) { pthread_mutex_unlock(&s->mu); return NULL; }
        Op *op = s->head;
        pthread_mutex_unlock(&s->mu);
        run_op(s, op);
        pthread_mutex_lock(&s->mu);
        s->head = op->next;
        if (!s->head) s->tail = NULL;
        s->done++;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        free(op);
    }
}

static Stream *stream_new(int is_copy) {
    Stream *s = calloc(1, sizeof(Stream));
    if (!s) return NULL;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->is_copy = is_copy;
    if (pthread_create(&s->thread, NULL, stream_main, s) != 0) { free(s); return NULL; }
    return s;
}

static Stream *stream_of(void *h) {
    if (h) return h;
    pthread_mutex_lock(&g_mu);
    if (!g_default) g_default = stream_new(0);
    pthread_mutex_unlock(&g_mu);
    return g_default;
}

static void enqueue(Stream *s, Op *op) {
    op->next = NULL;
    pthread_mutex_lock(&s->mu);
    if (s->tail) s->tail->next = op; else s->head = op;
    s->tail = op;
    s->enqueued++;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void stream_sync(Stream *s) {
    pthread_mutex_lock(&s->mu);
    uint64_t target = s->enqueued;
    while (s->done < target) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

/* -- the driver API kvstore resolves ------------------------------------------------- */
CUresult cuInit(unsigned int flags) { (void)flags; return OK; }
CUresult cuDriverGetVersion(int *v) { *v = 12080; return OK; }

CUresult cuGetErrorName(CUresult rc, const char **name) {
    switch (rc) {
    case OK: *name = "CUDA_SUCCESS"; break;
    case ERR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case ERR_OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case ERR_INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; break;
    case ERR_NOT_READY: *name = "CUDA_ERROR_NOT_READY"; break;
    case ERR_LAUNCH_FAILED: *name = "CUDA_ERROR_LAUNCH_FAILED (stand-in: injected)"; break;
    default: *name = "CUDA_ERROR_UNKNOWN"; return ERR_INVALID_VALUE;
    }
    return OK;
}

CUresult cuDeviceGet(int *dev, int ordinal) {
    if (ordinal < 0 || ordinal >= NDEV) return ERR_INVALID_DEVICE;
    *dev = ordinal;
    return OK;
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    if (dev < 0 || dev >= NDEV) return ERR_INVALID_DEVICE;
    *ctx = &g_ctx[dev];
    return OK;
}

CUresult cuDevicePrimaryCtxRelease_v2(int dev) { return dev >= 0 && dev < NDEV ? OK : ERR_INVALID_DEVICE; }

CUresult cuCtxSetCurrent(void *ctx) {
    t_dev = ctx ? (int)((int *)ctx - g_ctx) : -1;
    return OK;
}

CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest) { *least = 0; *greatest = -5; return OK; }

CUresult cuStreamCreateWithPriority(void **out, unsigned int flags, int prio) {
    (void)flags; (void)prio;
    Stream *s = stream_new(1);
    if (!s) return ERR_OUT_OF_MEMORY;
    *out = s;
    return OK;
}

CUresult cuStreamDestroy_v2(void *h) {
    Stream *s = h;
    if (!s) return ERR_INVALID_VALUE;
    stream_sync(s);
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    free(s);
    return OK;
}

CUresult cuStreamSynchronize(void *h) { stream_sync(stream_of(h)); return OK; }

CUresult cuEventCreate(void **out, unsigned int flags) {
    (void)flags;
    Event *e = calloc(1, sizeof(Event));
    if (!e) return ERR_OUT_OF_MEMORY;
    *out = e;
    return OK;
}

CUresult cuEventDestroy_v2(void *h) {
    Event *e = h;
    pthread_mutex_lock(&g_mu);
    rec_put(e->latest);
    pthread_mutex_unlock(&g_mu);
    free(e);
    return OK;
}

CUresult cuEventRecord(void *h, void *stream) {
    Event *e = h;
    pthread_mutex_lock(&g_mu);
    int fail = g_fail_record_in == 0;
    if (g_fail_record_in >= 0) g_fail_record_in--;
    pthread_mutex_unlock(&g_mu);
    if (fail) return ERR_LAUNCH_FAILED;
    Op *op = calloc(1, sizeof(Op));
    Rec *r = calloc(1, sizeof(Rec));
    if (!op || !r) { free(op); free(r); return ERR_OUT_OF_MEMORY; }
    r->refs = 2;            /* the event's latest-pointer and the record op */
    pthread_mutex_lock(&g_mu);
    rec_put(e->latest);
    e->latest = r;
    pthread_mutex_unlock(&g_mu);
    op->kind = OP_RECORD;
    op->rec = r;
    enqueue(stream_of(stream), op);
    return OK;
}

CUresult cuStreamWaitEvent(void *stream, void *h, unsigned int flags) {
    (void)flags;
    Op *op = calloc(1, sizeof(Op));
    if (!op) return ERR_OUT_OF_MEMORY;
    op->kind = OP_WAIT;
    op->rec = rec_latest(h);    /* the record made before this call */
    enqueue(stream_of(stream), op);
    return OK;
}

CUresult cuEventSynchronize(void *h) {
    rec_wait(rec_latest(h));
    return OK;
}

CUresult cuEventQuery(void *h) {
    Event *e = h;
    pthread_mutex_lock(&g_mu);
    int ready = !e->latest || e->latest->done;
    pthread_mutex_unlock(&g_mu);
    return ready ? OK : ERR_NOT_READY;
}

/* Enqueue segments [0, n) of a copy; with an injected failure inside them, enqueue the
 * ones before it (as a driver may have) and fail. */
static CUresult copy_call(CUdeviceptr *dst, CUdeviceptr *src, size_t *len, size_t n, size_t *fail_idx,
                          void *stream) {
    size_t take = n;
    CUresult rc = OK;
    pthread_mutex_lock(&g_mu);
    if (g_fail_copy_at >= 0 && (uint64_t)g_fail_copy_at < g_segments + n) {
        take = (size_t)(g_fail_copy_at - (long)g_segments);
        g_fail_copy_at = -1;
        rc = ERR_LAUNCH_FAILED;
    }
    g_segments += take;
    pthread_mutex_unlock(&g_mu);
    if (fail_idx) *fail_idx = rc == OK ? (size_t)-1 : take;
    if (take) {
        Op *op = calloc(1, sizeof(Op));
        if (!op) return ERR_OUT_OF_MEMORY;
        op->kind = OP_COPY;
        op->n = take;
        op->dst = malloc(take * sizeof(CUdeviceptr));
        op->src = malloc(take * sizeof(CUdeviceptr));
        op->len = malloc(take * sizeof(size_t));
        if (!op->dst || !op->src || !op->len) return ERR_OUT_OF_MEMORY;
        memcpy(op->dst, dst, take * sizeof(CUdeviceptr));
        memcpy(op->src, src, take * sizeof(CUdeviceptr));
        memcpy(op->len, len, take * sizeof(size_t));
        enqueue(stream_of(stream), op);
    }
    return rc;
}

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t len, void *stream) {
    return copy_call(&dst, &src, &len, 1, NULL, stream);
}

CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                            void *attrs, size_t *attr_idxs, size_t num_attrs, size_t *fail_idx,
                            void *stream) {
    (void)attrs; (void)attr_idxs; (void)num_attrs;
    return copy_call(dsts, srcs, sizes, count, fail_idx, stream);
}

CUresult cuGetProcAddress_v2(const char *symbol, void **fn, int version, uint64_t flags, int *status) {
    (void)version; (void)flags;
    if (status) *status = 0;
    if (strcmp(symbol, "cuMemcpyBatchAsync") == 0) { *fn = (void *)cuMemcpyBatchAsync; return OK; }
    *fn = NULL;
    return ERR_INVALID_VALUE;
}

CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned int flags) { (void)p; (void)n; (void)flags; return OK; }
CUresult cuMemHostUnregister(void *p) { (void)p; return OK; }

/* -- test controls (not driver API) --------------------------------------------------- */
void *standin_stream_create(void) { return stream_new(0); }   /* a "compute" stream */
void standin_stream_destroy(void *s) { cuStreamDestroy_v2(s); }

/* A kernel that writes `bytes` bytes of `value` at ptr, in stream order. */
int standin_fill(void *stream, void *ptr, int value, size_t bytes) {
    Op *op = calloc(1, sizeof(Op));
    if (!op) return ERR_OUT_OF_MEMORY;
    op->kind = OP_FILL; op->ptr = ptr; op->value = value; op->bytes = bytes;
    enqueue(stream_of(stream), op);
    return OK;
}

/* A kernel that runs until standin_open_gate(gate): the stream's later work waits. */
int standin_gate(void *stream, int gate) {
    if (gate < 0 || gate >= 64) return ERR_INVALID_VALUE;
    Op *op = calloc(1, sizeof(Op));
    if (!op) return ERR_OUT_OF_MEMORY;
    op->kind = OP_GATE; op->gate = gate;
    pthread_mutex_lock(&g_mu);
    g_gates_open[gate] = 0;
    pthread_mutex_unlock(&g_mu);
    enqueue(stream_of(stream), op);
    return OK;
}

void standin_open_gate(int gate) {
    pthread_mutex_lock(&g_mu);
    g_gates_open[gate] = 1;
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

/* Each copy on a copy stream starts this late (a slow DMA engine). */
void standin_set_copy_latency_us(long us) { g_copy_latency_us = us; }

/* The copy call that reaches segment `k` from now fails there (its earlier segments are
 * enqueued); -1 disarms. */
void standin_fail_copy_after(long k) {
    pthread_mutex_lock(&g_mu);
    g_fail_copy_at = k < 0 ? -1 : (long)g_segments + k;
    pthread_mutex_unlock(&g_mu);
}

/* The n-th next cuEventRecord fails (0: the next one); -1 disarms. */
void standin_fail_event_record(long n) {
    pthread_mutex_lock(&g_mu);
    g_fail_record_in = n;
    pthread_mutex_unlock(&g_mu);
}

/* Operations enqueued on a stream and not yet run. */
unsigned long long standin_pending(void *stream) {
    Stream *s = stream_of(stream);
    pthread_mutex_lock(&s->mu);
    unsigned long long n = s->enqueued - s->done;
    pthread_mutex_unlock(&s->mu);
    return n;
}
