/*
 * A minimal NVTX v3 injection library for tests: records the NVTX ranges a process emits.
 *
 * NVTX calls are no-ops until a tool is attached. A tool is a shared library named by the
 * environment variable NVTX_INJECTION64_PATH; on the first NVTX call, the NVTX implementation
 * (header-only, compiled into every client, e.g. the `nvtx` Python package) loads it and calls its
 * exported `InitializeInjectionNvtx2(getExportTable)`. The tool asks the export table for the
 * callback table of each module (CORE, CORE2 = the domain API) and stores its own functions into
 * the slots it handles; unset slots stay no-ops. This file declares that ABI itself (the few
 * types, enum values and the event-attribute layout of the NVTX v3 documentation) so it builds
 * with any C compiler and no NVTX headers. Compiled with -DOPSD_NVTX_ABI_CHECK and the official
 * headers on the include path (nvtx3/nvToolsExt.h, shipped by the nvidia-nvtx wheel and CUDA),
 * it checks every value and offset it uses against them at compile time.
 *
 * Output: one line per event, appended to $OPSD_NVTX_LOG_DIR/nvtx.<pid>.log (one file per
 * process, so several ranks can share a directory). Fields are separated by tabs:
 *   I <pid>                                          the library was initialised
 *   D <domain-handle> <name>                         nvtxDomainCreateA
 *   P <tid> <domain-name> <message> <argb-colour>    push (domain "" for the non-domain API)
 *   O <tid> <domain-name> <depth-after-pop>          pop (-1: pop without a push on this thread)
 *   S <id> <tid> <domain-name> <message>             start/end range start
 *   E <id> <tid>                                     start/end range end
 * Tabs and newlines inside messages are replaced by spaces.
 */

#define _GNU_SOURCE
#include <fcntl.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <wchar.h>

/* ---- the NVTX v3 injection ABI (as documented for tools) ---------------------------------- */

typedef void (*opsd_fn)(void);                        /* NvtxFunctionPointer */
typedef opsd_fn **opsd_fn_table;                      /* NvtxFunctionTable: array of slot pointers */
typedef const void *(*opsd_get_export_table)(uint32_t export_table_id);

enum { OPSD_ETID_CALLBACKS = 1 };                     /* NVTX_ETID_CALLBACKS */
enum { OPSD_MODULE_CORE = 1, OPSD_MODULE_CORE2 = 5 }; /* NVTX_CB_MODULE_CORE / _CORE2 */
enum {                                                /* NVTX_CBID_CORE_* */
    OPSD_CORE_RangeStartEx = 4, OPSD_CORE_RangeStartA = 5, OPSD_CORE_RangeEnd = 7,
    OPSD_CORE_RangePushEx = 8, OPSD_CORE_RangePushA = 9, OPSD_CORE_RangePop = 11
};
enum {                                                /* NVTX_CBID_CORE2_* */
    OPSD_CORE2_DomainRangeStartEx = 2, OPSD_CORE2_DomainRangeEnd = 3, OPSD_CORE2_DomainRangePushEx = 4,
    OPSD_CORE2_DomainRangePop = 5, OPSD_CORE2_DomainRegisterStringA = 10, OPSD_CORE2_DomainCreateA = 12
};
enum { OPSD_MESSAGE_ASCII = 1, OPSD_MESSAGE_UNICODE = 2, OPSD_MESSAGE_REGISTERED = 3 };

typedef struct {
    size_t struct_size;
    int (*GetModuleFunctionTable)(int module, opsd_fn_table *out_table, unsigned int *out_size);
} opsd_export_table_callbacks;                        /* NvtxExportTableCallbacks */

typedef struct {                                      /* nvtxEventAttributes_v2 */
    uint16_t version;
    uint16_t size;
    uint32_t category;
    int32_t color_type;
    uint32_t color;
    int32_t payload_type;
    int32_t reserved0;
    union { uint64_t u64; int64_t i64; double d; uint32_t u32; int32_t i32; float f; } payload;
    int32_t message_type;
    union { const char *ascii; const wchar_t *unicode; const void *registered; } message;
} opsd_event_attributes;

#ifdef OPSD_NVTX_ABI_CHECK
#define NVTX_NO_IMPL
#include "nvtx3/nvToolsExt.h"
#define SAME(a, b) _Static_assert((long)(a) == (long)(b), #a " != " #b)
SAME(OPSD_ETID_CALLBACKS, NVTX_ETID_CALLBACKS);
SAME(OPSD_MODULE_CORE, NVTX_CB_MODULE_CORE);
SAME(OPSD_MODULE_CORE2, NVTX_CB_MODULE_CORE2);
SAME(OPSD_CORE_RangeStartEx, NVTX_CBID_CORE_RangeStartEx);
SAME(OPSD_CORE_RangeStartA, NVTX_CBID_CORE_RangeStartA);
SAME(OPSD_CORE_RangeEnd, NVTX_CBID_CORE_RangeEnd);
SAME(OPSD_CORE_RangePushEx, NVTX_CBID_CORE_RangePushEx);
SAME(OPSD_CORE_RangePushA, NVTX_CBID_CORE_RangePushA);
SAME(OPSD_CORE_RangePop, NVTX_CBID_CORE_RangePop);
SAME(OPSD_CORE2_DomainRangeStartEx, NVTX_CBID_CORE2_DomainRangeStartEx);
SAME(OPSD_CORE2_DomainRangeEnd, NVTX_CBID_CORE2_DomainRangeEnd);
SAME(OPSD_CORE2_DomainRangePushEx, NVTX_CBID_CORE2_DomainRangePushEx);
SAME(OPSD_CORE2_DomainRangePop, NVTX_CBID_CORE2_DomainRangePop);
SAME(OPSD_CORE2_DomainRegisterStringA, NVTX_CBID_CORE2_DomainRegisterStringA);
SAME(OPSD_CORE2_DomainCreateA, NVTX_CBID_CORE2_DomainCreateA);
SAME(OPSD_MESSAGE_ASCII, NVTX_MESSAGE_TYPE_ASCII);
SAME(OPSD_MESSAGE_UNICODE, NVTX_MESSAGE_TYPE_UNICODE);
SAME(OPSD_MESSAGE_REGISTERED, NVTX_MESSAGE_TYPE_REGISTERED);
SAME(sizeof(opsd_event_attributes), sizeof(nvtxEventAttributes_t));
SAME(offsetof(opsd_event_attributes, color), offsetof(nvtxEventAttributes_t, color));
SAME(offsetof(opsd_event_attributes, message_type), offsetof(nvtxEventAttributes_t, messageType));
SAME(offsetof(opsd_event_attributes, message), offsetof(nvtxEventAttributes_t, message));
SAME(sizeof(opsd_export_table_callbacks), sizeof(NvtxExportTableCallbacks));
SAME(offsetof(opsd_export_table_callbacks, GetModuleFunctionTable),
     offsetof(NvtxExportTableCallbacks, GetModuleFunctionTable));
#endif

/* ---- recording ---------------------------------------------------------------------------- */

#define MAX_LINE 1024
#define MAX_NAME 480

typedef struct { char name[MAX_NAME]; } opsd_domain;  /* what a domain handle points to */

static int g_fd = -1;
static uint64_t g_next_range_id = 1;
static __thread int t_depth = 0;

static long thread_id(void) { return (long)syscall(SYS_gettid); }

static void clean_copy(char *dst, const char *src) {
    size_t i = 0;
    for (; src && src[i] && i + 1 < MAX_NAME; ++i)
        dst[i] = (src[i] == '\t' || src[i] == '\n' || src[i] == '\r') ? ' ' : src[i];
    dst[i] = '\0';
}

static void emit(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void emit(const char *fmt, ...) {
    char line[MAX_LINE];
    va_list args;
    if (g_fd < 0) return;
    va_start(args, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, args);
    va_end(args);
    if (n < 0) return;
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    /* one write(2) per line on an O_APPEND descriptor: lines of threads do not interleave */
    ssize_t ignored = write(g_fd, line, (size_t)n);
    (void)ignored;
}

static const char *domain_name(const void *domain) {
    return domain ? ((const opsd_domain *)domain)->name : "";
}

static void message_of(const opsd_event_attributes *attr, char *out) {
    if (!attr) { out[0] = '\0'; return; }
    switch (attr->message_type) {
    case OPSD_MESSAGE_ASCII: clean_copy(out, attr->message.ascii); break;
    case OPSD_MESSAGE_REGISTERED: clean_copy(out, (const char *)attr->message.registered); break;
    case OPSD_MESSAGE_UNICODE: clean_copy(out, "<unicode>"); break;
    default: out[0] = '\0';
    }
}

static int push(const void *domain, const char *message, uint32_t color) {
    emit("P\t%ld\t%s\t%s\t0x%08X", thread_id(), domain_name(domain), message, color);
    return t_depth++;
}

static int pop(const void *domain) {
    t_depth = t_depth > 0 ? t_depth - 1 : -1;
    emit("O\t%ld\t%s\t%d", thread_id(), domain_name(domain), t_depth);
    int depth = t_depth;
    if (t_depth < 0) t_depth = 0;
    return depth;
}

static uint64_t start(const void *domain, const char *message) {
    uint64_t id = __sync_fetch_and_add(&g_next_range_id, 1);
    emit("S\t%llu\t%ld\t%s\t%s", (unsigned long long)id, thread_id(), domain_name(domain), message);
    return id;
}

static void end(uint64_t id) { emit("E\t%llu\t%ld", (unsigned long long)id, thread_id()); }

/* CORE2: the domain API (what the `nvtx` package calls for a named domain) */
static void *domain_create_a(const char *name) {
    opsd_domain *d = calloc(1, sizeof *d);
    if (!d) return NULL;
    clean_copy(d->name, name);
    emit("D\t%p\t%s", (void *)d, d->name);
    return d;
}
static const void *domain_register_string_a(const void *domain, const char *s) {
    (void)domain;
    char *copy = malloc(MAX_NAME);
    if (copy) clean_copy(copy, s);
    return copy;
}
static int domain_push_ex(const void *domain, const opsd_event_attributes *attr) {
    char msg[MAX_NAME];
    message_of(attr, msg);
    return push(domain, msg, attr ? attr->color : 0);
}
static int domain_pop(const void *domain) { return pop(domain); }
static uint64_t domain_start_ex(const void *domain, const opsd_event_attributes *attr) {
    char msg[MAX_NAME];
    message_of(attr, msg);
    return start(domain, msg);
}
static void domain_end(const void *domain, uint64_t id) { (void)domain; end(id); }

/* CORE: the non-domain API */
static int core_push_ex(const opsd_event_attributes *attr) { return domain_push_ex(NULL, attr); }
static int core_push_a(const char *message) {
    char msg[MAX_NAME];
    clean_copy(msg, message);
    return push(NULL, msg, 0);
}
static int core_pop(void) { return pop(NULL); }
static uint64_t core_start_ex(const opsd_event_attributes *attr) { return domain_start_ex(NULL, attr); }
static uint64_t core_start_a(const char *message) {
    char msg[MAX_NAME];
    clean_copy(msg, message);
    return start(NULL, msg);
}

/* ---- initialisation ----------------------------------------------------------------------- */

static void set_slot(opsd_fn_table table, unsigned int size, unsigned int cbid, opsd_fn fn) {
    if (table && cbid < size && table[cbid]) *table[cbid] = fn;
}

static int open_log(void) {
    if (g_fd >= 0) return 1;
    const char *dir = getenv("OPSD_NVTX_LOG_DIR");
    if (!dir || !*dir) return 0;
    char path[4096];
    snprintf(path, sizeof path, "%s/nvtx.%ld.log", dir, (long)getpid());
    g_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    return g_fd >= 0;
}

__attribute__((visibility("default"))) int InitializeInjectionNvtx2(opsd_get_export_table get_export_table) {
    if (!get_export_table || !open_log()) return 0;  /* 0: NVTX stays a no-op */
    const opsd_export_table_callbacks *callbacks = get_export_table(OPSD_ETID_CALLBACKS);
    if (!callbacks || !callbacks->GetModuleFunctionTable) return 0;
    opsd_fn_table table = NULL;
    unsigned int size = 0;
    if (callbacks->GetModuleFunctionTable(OPSD_MODULE_CORE2, &table, &size)) {
        set_slot(table, size, OPSD_CORE2_DomainCreateA, (opsd_fn)domain_create_a);
        set_slot(table, size, OPSD_CORE2_DomainRegisterStringA, (opsd_fn)domain_register_string_a);
        set_slot(table, size, OPSD_CORE2_DomainRangePushEx, (opsd_fn)domain_push_ex);
        set_slot(table, size, OPSD_CORE2_DomainRangePop, (opsd_fn)domain_pop);
        set_slot(table, size, OPSD_CORE2_DomainRangeStartEx, (opsd_fn)domain_start_ex);
        set_slot(table, size, OPSD_CORE2_DomainRangeEnd, (opsd_fn)domain_end);
    }
    table = NULL;
    size = 0;
    if (callbacks->GetModuleFunctionTable(OPSD_MODULE_CORE, &table, &size)) {
        set_slot(table, size, OPSD_CORE_RangePushEx, (opsd_fn)core_push_ex);
        set_slot(table, size, OPSD_CORE_RangePushA, (opsd_fn)core_push_a);
        set_slot(table, size, OPSD_CORE_RangePop, (opsd_fn)core_pop);
        set_slot(table, size, OPSD_CORE_RangeStartEx, (opsd_fn)core_start_ex);
        set_slot(table, size, OPSD_CORE_RangeStartA, (opsd_fn)core_start_a);
        set_slot(table, size, OPSD_CORE_RangeEnd, (opsd_fn)end);
    }
    emit("I\t%ld", (long)getpid());
    return 1;
}
