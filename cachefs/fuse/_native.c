/*
 * cachefs.fuse._native: the request workers' loop in C, for the requests it can answer
 * without Python.
 *
 * A request worker calls serve(): it reads requests from its descriptor of the FUSE
 * connection with the interpreter lock released and answers these itself:
 *
 *   READ  of a handle bound to a verified cache file (bind(): the file passed the same
 *         whole-object check as a file handed to the kernel by FUSE passthrough, and stays
 *         pinned while bound; see cachefs/fuse/native.py): one pread of the file and one
 *         writev of the answer (O_DIRECT for an object's last bytes when none of them
 *         is in the page cache: read_file()). A read the file cannot answer in full
 *         (an error, a short
 *         read inside the object) goes to Python, which serves and checks it as usual;
 *         so does one of a file whose stamp moved since Python verified it (someone
 *         wrote to it: struct stamp, checked after each read).
 *   IOCTL answered ENOTTY (Python's open() sends one per file: isatty()).
 *   LOOKUP of a name whose answer Python remembered here (remember_lookup()): the same
 *         bytes again, while they are fresh. Python says for how long (the rest of the
 *         directory listing's freshness) and with the epoch token it read before looking
 *         the name up (lookup_epoch(): the table's epoch and its directory's).
 *         forget_dir() moves a directory's epoch on whenever its listing is made current
 *         or marked stale (forget_lookups() every directory's), and answers of an older
 *         epoch are never given. So the loop answers what Python would answer, without
 *         the interpreter. Directories share DIR_EPOCHS epochs by a hash of their prefix
 *         (a collision only forgets more).
 *   OPEN  of an inode Python gave a template (add_template(): a file registered for
 *         passthrough or for reads here, see cachefs/passthrough.py), read-only and without
 *         O_DIRECT: a new handle (numbered from FIRST_LOOP_FH up), answered as the
 *         template says (the kernel's backing id, or bound to the template's file here),
 *         while the epochs the template was given with are current (as a remembered
 *         lookup's: once its directory's listing changes, Python answers, and may find
 *         the inode no longer listed), and while its file has the stamp it was verified
 *         with (template_file_holds()).
 *   RELEASE of a handle opened here.
 *         Each is an event for Python (take_events(): a ring of MAX_EVENTS, queued before
 *         the answer is written; an eventfd is written when the ring stops being empty),
 *         which does the bookkeeping of the handle in order, in batches, and takes the
 *         events before it answers any request itself. A template is dropped only while
 *         no handle opened with it is open (drop_template()), so whatever the caller's
 *         registration holds for them (the pin, the kernel's backing) outlives them.
 *
 * Every other request is handed to the Python callable given to serve(), with the lock
 * held, as handle(n): the request is the first n bytes of the worker's buffer; a true
 * answer ends serve() (DESTROY).
 *
 * Concurrency: any number of workers share one table (a capsule). Its mutex guards the
 * handle map, the template map, each template's handle count, each file's reference
 * count, the event ring and the remembered lookups; it is never held across a system
 * call other than close(). A direct read opens its own O_DIRECT descriptor of the file,
 * outside the mutex, and closes it after (open_direct()); a file that refuses O_DIRECT is
 * marked so with an atomic store. The lookup epochs are read and advanced with atomics, and
 * checked again under the mutex when an answer is remembered. A bound file (of a handle
 * or a template) is freed when the last handle or template using it lets go and no read
 * of it is under way (refs, under the mutex); the registered file's one descriptor, which
 * all bound files of it share (shared_fd), is closed when the last of them and the
 * registration are gone (an atomic count: bound files are disposed of outside the mutex),
 * so a read never reaches a descriptor number reused for another file. Counters are
 * atomic adds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define OP_LOOKUP 1
#define OP_READ 15
#define OP_IOCTL 39
#define MAX_BUCKETS 64
#define MAX_LOOKUP_ANSWER 256  /* a fuse_entry_out is 128 bytes */
#define MAX_NAME 1024
#define DIR_EPOCHS 4096  /* a power of two */
/* Remembered lookups are kept in sets of this many slots (fewer in a smaller table): a
 * name's answer may be in any slot of its set, so names whose hashes meet share it
 * instead of pushing each other out. Direct-mapped (one way), a table of twice as many
 * slots as names kept 79% of them (403 of 512 in a test); four ways keep ~96%. */
#define LOOKUP_WAYS 4
#define OP_OPEN 14
#define OP_RELEASE 18
#define EVENT_OPENED 1
#define EVENT_RELEASED 2
/* Events waiting for Python; when full, OPENs and RELEASEs go to Python (which takes the
 * events first). 16,384 events: 384 KiB. */
#define MAX_EVENTS 16384
/* O_DIRECT reads (read_file()) are aligned to this: the page size, which every Linux
 * file system's logical block size divides. */
#define DIRECT_ALIGN 4096
#ifndef __NR_cachestat
#define __NR_cachestat 451  /* (the same number on every architecture) */
#endif
/* cachestat(2)'s arguments and answer, as <linux/mman.h> of Linux 6.5 declares them
 * (older headers do not). */
struct cachestat_args {
    uint64_t off, len;
};
struct cachestat_answer {
    uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

/* Handles the loop opens are numbered from here (Python's count from 1). */
#define FIRST_LOOP_FH (1ULL << 62)
/* Open flags the loop answers (others, e.g. O_DIRECT or any write, go to Python). */
#define LOOP_OPEN_REFUSED (O_ACCMODE | O_TRUNC | O_DIRECT | O_APPEND | O_CREAT)

/* The requests the loop times, as stats() reports them. */
enum { KIND_READ, KIND_LOOKUP, KIND_OPEN, KIND_RELEASE, KINDS };
static const char *const KIND_NAMES[KINDS] = {"read", "lookup", "open", "release"};

struct in_header {
    uint32_t len, opcode;
    uint64_t unique, nodeid;
    uint32_t uid, gid, pid;
    uint16_t total_extlen, padding;
};

struct out_header {
    uint32_t len;
    int32_t error;
    uint64_t unique;
};

struct read_in {
    uint64_t fh, offset;
    uint32_t size, read_flags;
    uint64_t lock_owner;
    uint32_t flags, padding;
};

/* A cache file's inode and status change time (ns) when Python verified it: any write to
 * the file since, by anyone, gives it another change time (cachefs/cache/objectfiles.py,
 * FileStamp). A file whose stamp moved is left to Python, which verifies it again. The
 * two fields are stored and loaded with atomics, not as a pair: a torn pair only sends a
 * request to Python. An ino of 0 means no stamp (nothing checked). */
struct stamp {
    uint64_t ino;
    int64_t changed;
};

/* A registered cache file's one descriptor, shared by every bound file reading it
 * (register_file()): closed when the last of them is disposed of. */
struct shared_fd {
    int fd;
    int refs;  /* bound files using it (atomic: dispose() runs without the mutex) */
    int no_direct;  /* set (atomically) once the file refused to be opened O_DIRECT */
    struct stamp stamp;  /* the file's as verified (stamp_file(); atomic; 0: unchecked) */
};

struct bound_file {
    uint64_t size;
    int refs;  /* the map's own reference, plus one per read under way */
    struct shared_fd *shared;
};

/* An open template: how the loop answers an OPEN of one inode itself (see
 * add_template()). */
struct open_template {
    uint64_t ino;
    uint32_t epoch, dir_slot, dir_epoch;  /* as a remembered lookup's (see serve_open) */
    uint32_t open_flags;
    int32_t backing_id;  /* the kernel's (passthrough), or 0 */
    struct bound_file *file;  /* the loop's (native reads), or NULL */
    /* The kernel's backing's file, checked at each open (the loop has no descriptor of
     * it): its path and stamp, or NULL (a bound file's stamp is its shared_fd's). */
    char *path;
    struct stamp stamp;
    uint64_t handles;  /* handles the loop opened with it and not released yet */
};

/* A slot of a map (open addressing, linear probing). In the handle map: key = fh, file =
 * the bound file or NULL, tpl = the template the loop opened it with or NULL (Python
 * opened it). In the template map: key = inode, tpl = its template. */
struct slot {
    uint64_t fh;  /* the key; 0: empty */
    struct bound_file *file;
    struct open_template *tpl;
};

struct map {
    struct slot *slots;
    size_t capacity;  /* a power of two */
    size_t used;
};

/* An event for Python (take_events()): a handle the loop opened or released. */
struct event {
    uint32_t kind;  /* EVENT_OPENED, EVENT_RELEASED */
    uint32_t pid;
    uint64_t fh, ino;
};

/* A remembered LOOKUP answer: the name, then the answer's bytes. */
struct lookup_entry {
    uint64_t parent;
    uint32_t epoch, dir_slot, dir_epoch;
    double expires;  /* CLOCK_MONOTONIC seconds */
    uint32_t name_len, answer_len;
    char bytes[];
};

struct op_stats {
    uint64_t count;
    double seconds;
    uint64_t buckets[MAX_BUCKETS + 1];
};

struct table {
    pthread_mutex_t lock;
    struct map handles;  /* bound handles and handles the loop opened */
    struct map templates;  /* open templates by inode */
    struct map files;  /* registered files by id (register_file()): size 0, one reference */
    uint64_t next_fh;
    /* events for Python: a ring */
    struct event *events;
    size_t event_head, event_count;
    int event_fd;  /* written when the ring stops being empty; -1: none */
    /* remembered lookups: in sets of lookup_ways slots by a hash of (parent, name); a
     * newer answer replaces its own name's, else an empty or useless slot of its set,
     * else the one expiring first (the bound on memory; remember_lookup()) */
    struct lookup_entry **lookups;
    size_t lookup_mask;  /* slots - 1, a power of two */
    size_t lookup_ways;  /* LOOKUP_WAYS, or the slots when fewer */
    uint32_t lookup_epoch;  /* atomic */
    uint32_t dir_epochs[DIR_EPOCHS];  /* atomic */
    /* statistics (atomic adds) */
    struct op_stats ops[KINDS];
    uint64_t read_bytes, ioctls, fallbacks, lookups_remembered, open_handovers, direct_reads;
    uint64_t changed_files;  /* opens and reads of a file whose stamp moved (Python's) */
    int no_cachestat;  /* cachestat(2) was refused once: no read asks again (atomic) */
    int n_bounds;
    double bounds[MAX_BUCKETS];
};

#define CAPSULE_NAME "cachefs.fuse._native.table"

static uint64_t hash_fh(uint64_t fh) {
    fh ^= fh >> 33;
    fh *= 0xff51afd7ed558ccdULL;
    fh ^= fh >> 33;
    return fh;
}

/* Under the lock. */
static struct slot *find_slot(struct map *m, uint64_t key) {
    size_t mask = m->capacity - 1;
    size_t i = hash_fh(key) & mask;
    while (m->slots[i].fh != 0) {
        if (m->slots[i].fh == key)
            return &m->slots[i];
        i = (i + 1) & mask;
    }
    return &m->slots[i];
}

/* Under the lock: insert into a map known to have room. */
static void put_slot(struct map *m, uint64_t key, struct bound_file *file,
                     struct open_template *tpl) {
    struct slot *s = find_slot(m, key);
    if (s->fh == 0)
        m->used++;
    s->fh = key;
    s->file = file;
    s->tpl = tpl;
}

static int grow(struct map *m) {
    size_t old_cap = m->capacity;
    struct slot *old = m->slots;
    struct slot *slots = calloc(old_cap * 2, sizeof(struct slot));
    if (slots == NULL)
        return -1;
    m->slots = slots;
    m->capacity = old_cap * 2;
    m->used = 0;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i].fh != 0)
            put_slot(m, old[i].fh, old[i].file, old[i].tpl);
    free(old);
    return 0;
}

/* Under the lock: room for one more entry (0), or -1 (out of memory). */
static int make_room(struct map *m) {
    if ((m->used + 1) * 2 > m->capacity)
        return grow(m);
    return 0;
}

/* Under the lock: remove a slot, shifting back the entries that probed past it. */
static void remove_slot(struct map *m, struct slot *s) {
    size_t mask = m->capacity - 1;
    size_t i = (size_t)(s - m->slots);
    size_t j = i;
    m->slots[i] = (struct slot){0, NULL, NULL};
    m->used--;
    for (;;) {
        j = (j + 1) & mask;
        if (m->slots[j].fh == 0)
            return;
        size_t home = hash_fh(m->slots[j].fh) & mask;
        /* may the entry at j move to the hole at i? (its home is not in (i, j]) */
        if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
            m->slots[i] = m->slots[j];
            m->slots[j] = (struct slot){0, NULL, NULL};
            i = j;
        }
    }
}

static int map_init(struct map *m) {
    m->capacity = 1024;
    m->used = 0;
    m->slots = calloc(m->capacity, sizeof(struct slot));
    return m->slots == NULL ? -1 : 0;
}

/* Whether the file of descriptor ``fd`` (or, when fd < 0, at ``path``) still has the
 * stamp ``want`` (a copy, loaded with atomics); true when there is none to check. A file
 * that cannot be stated has moved (Python decides). No lock held: a system call. */
static int stamp_holds(const struct stamp *want, int fd, const char *path) {
    if (want->ino == 0)
        return 1;
    struct stat st;
    if ((fd >= 0 ? fstat(fd, &st) : stat(path, &st)) != 0)
        return 0;
    int64_t changed = (int64_t)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec;
    return (uint64_t)st.st_ino == want->ino && changed == want->changed;
}

static void load_stamp(const struct stamp *from, struct stamp *to) {
    to->ino = __atomic_load_n(&from->ino, __ATOMIC_ACQUIRE);
    to->changed = __atomic_load_n(&from->changed, __ATOMIC_ACQUIRE);
}

static void store_stamp(struct stamp *to, uint64_t ino, int64_t changed) {
    __atomic_store_n(&to->ino, ino, __ATOMIC_RELEASE);
    __atomic_store_n(&to->changed, changed, __ATOMIC_RELEASE);
}

/* A bound file reading the shared descriptor ``sh`` (one more user of it), ``size``
 * bytes long, with one reference; NULL (ENOMEM) if out of memory. */
static struct bound_file *share_file(struct shared_fd *sh, uint64_t size) {
    struct bound_file *f = malloc(sizeof(struct bound_file));
    if (f == NULL)
        return NULL;
    __atomic_add_fetch(&sh->refs, 1, __ATOMIC_RELAXED);
    f->shared = sh;
    f->size = size;
    f->refs = 1;
    return f;
}

/* Free a bound file, and close its descriptor if it was the last to use it (without the
 * lock: close() may wait). */
static void dispose(struct bound_file *f) {
    if (f == NULL)
        return;
    struct shared_fd *sh = f->shared;
    free(f);
    if (__atomic_sub_fetch(&sh->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        close(sh->fd);
        free(sh);
    }
}

/* Drop one reference (under the lock); returns the file to dispose() once the lock is
 * released (its last reference), or NULL. */
static struct bound_file *unref(struct bound_file *f) {
    if (f == NULL || --f->refs > 0)
        return NULL;
    return f;
}

static void table_free(PyObject *capsule) {
    struct table *t = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    if (t == NULL)
        return;
    for (size_t i = 0; i < t->handles.capacity; i++) {
        if (t->handles.slots[i].fh != 0) {
            dispose(unref(t->handles.slots[i].file));
        }
    }
    for (size_t i = 0; i < t->templates.capacity; i++) {
        struct open_template *tpl = t->templates.slots[i].tpl;
        if (t->templates.slots[i].fh != 0 && tpl != NULL) {
            dispose(unref(tpl->file));
            free(tpl->path);
            free(tpl);
        }
    }
    for (size_t i = 0; i < t->files.capacity; i++) {
        if (t->files.slots[i].fh != 0)
            dispose(unref(t->files.slots[i].file));
    }
    free(t->handles.slots);
    free(t->templates.slots);
    free(t->files.slots);
    free(t->events);
    for (size_t i = 0; i <= t->lookup_mask; i++)
        free(t->lookups[i]);
    free(t->lookups);
    pthread_mutex_destroy(&t->lock);
    free(t);
}

static struct table *get_table(PyObject *capsule) {
    return PyCapsule_GetPointer(capsule, CAPSULE_NAME);
}

/* The table of a call whose only argument it is (NULL with an exception set). */
static struct table *only_table(PyObject *args) {
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "O", &capsule))
        return NULL;
    return get_table(capsule);
}

/* new_table(bounds, lookup_slots): a table; ``bounds`` are the latency histograms'
 * upper bounds, ``lookup_slots`` (a power of two) how many lookup answers it may hold. */
static PyObject *new_table(PyObject *self, PyObject *args) {
    PyObject *bounds;
    Py_ssize_t lookup_slots;
    if (!PyArg_ParseTuple(args, "On", &bounds, &lookup_slots))
        return NULL;
    if (lookup_slots < 1 || (lookup_slots & (lookup_slots - 1)) != 0) {
        PyErr_SetString(PyExc_ValueError, "lookup_slots must be a power of two");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(bounds, "bounds must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAX_BUCKETS) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many histogram bounds");
        return NULL;
    }
    struct table *t = calloc(1, sizeof(struct table));
    if (t == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        t->bounds[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
    }
    Py_DECREF(seq);
    if (PyErr_Occurred()) {
        free(t);
        return NULL;
    }
    t->n_bounds = (int)n;
    int failed = map_init(&t->handles) | map_init(&t->templates) | map_init(&t->files);
    t->lookups = calloc((size_t)lookup_slots, sizeof(struct lookup_entry *));
    t->events = calloc(MAX_EVENTS, sizeof(struct event));
    if (failed || t->lookups == NULL || t->events == NULL) {
        free(t->handles.slots);
        free(t->templates.slots);
        free(t->files.slots);
        free(t->lookups);
        free(t->events);
        free(t);
        return PyErr_NoMemory();
    }
    t->next_fh = FIRST_LOOP_FH;
    t->event_fd = -1;
    t->lookup_mask = (size_t)lookup_slots - 1;
    t->lookup_ways = lookup_slots < LOOKUP_WAYS ? (size_t)lookup_slots : LOOKUP_WAYS;
    t->lookup_epoch = 1;
    /* Adaptive: a worker finding the mutex held spins a little before it sleeps. It is
     * held for a few map operations only, and with more workers than cores a sleep and
     * its wake-up (two futex calls) cost more than the wait. */
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ADAPTIVE_NP);
    pthread_mutex_init(&t->lock, &attr);
    pthread_mutexattr_destroy(&attr);
    PyObject *capsule = PyCapsule_New(t, CAPSULE_NAME, table_free);
    if (capsule == NULL) {
        free(t->handles.slots);
        free(t->templates.slots);
        free(t->files.slots);
        free(t->lookups);
        free(t->events);
        free(t);
    }
    return capsule;
}

/* register_file(table, file_id, fd): registration ``file_id`` (> 0) reads a duplicate of
 * ``fd`` (the caller closes its own). Handles bound to it (bind()) and templates made with
 * it (add_template()) share that one descriptor, each with a bound file of its own (its
 * size, its references), so a registered file costs one descriptor however many use it:
 * the daemon keeps up to tens of thousands registered (cachefs/descriptors.py). The
 * descriptor is closed when the registration is dropped (unregister_file()) and the last
 * handle or template using it lets go. A registration under an id in use replaces it. */
static PyObject *register_file(PyObject *self, PyObject *args) {
    PyObject *capsule;
    unsigned long long id;
    int fd;
    if (!PyArg_ParseTuple(args, "OKi", &capsule, &id, &fd))
        return NULL;
    struct table *t = get_table(capsule);
    if (t == NULL)
        return NULL;
    if (id == 0) {
        PyErr_SetString(PyExc_ValueError, "file id 0 cannot be registered");
        return NULL;
    }
    struct shared_fd *sh = malloc(sizeof(struct shared_fd));
    if (sh == NULL)
        return PyErr_NoMemory();
    sh->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (sh->fd < 0) {
        int saved = errno;
        free(sh);
        errno = saved;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    sh->refs = 0;
    sh->no_direct = 0;
    store_stamp(&sh->stamp, 0, 0);
    struct bound_file *holder = share_file(sh, 0);  /* (the registration's reference) */
    if (holder == NULL) {
        close(sh->fd);
        free(sh);
        return PyErr_NoMemory();
    }
    struct bound_file *old = NULL;
    int failed = 0;
    pthread_mutex_lock(&t->lock);
    if (make_room(&t->files) != 0) {
        failed = 1;
    } else {
        struct slot *s = find_slot(&t->files, id);
        if (s->fh != 0)
            old = unref(s->file);
        put_slot(&t->files, id, holder, NULL);
    }
    pthread_mutex_unlock(&t->lock);
    dispose(old);
    if (failed) {
        dispose(holder);
        return PyErr_NoMemory();
    }
    Py_RETURN_NONE;
}

/* Under the lock: take ``key`` out of ``m`` (a handle released, a registration dropped);
 * whether it was there. Its file's reference is dropped: *gone is the file to dispose() once
 * the lock is released, or NULL. */
static int take_out(struct map *m, uint64_t key, struct bound_file **gone) {
    struct slot *s = key != 0 ? find_slot(m, key) : NULL;
    if (s == NULL || s->fh == 0)
        return 0;
    *gone = unref(s->file);
    if (s->tpl != NULL)
        s->tpl->handles--;  /* (a handle the loop opened with that template) */
    remove_slot(m, s);
    return 1;
}

/* unregister_file() and unbind(): (table, key) -> bool, ``key`` taken out of the
 * registered files (``files``) or of the handles. */
static PyObject *take_out_call(PyObject *args, int files) {
    PyObject *capsule;
    unsigned long long key;
    if (!PyArg_ParseTuple(args, "OK", &capsule, &key))
        return NULL;
    struct table *t = get_table(capsule);
    if (t == NULL)
        return NULL;
    struct bound_file *gone = NULL;
    pthread_mutex_lock(&t->lock);
    int found = take_out(files ? &t->files : &t->handles, key, &gone);
    pthread_mutex_unlock(&t->lock);
    dispose(gone);
    return PyBool_FromLong(found);
}

/* unregister_file(table, file_id) -> bool: drop registration ``file_id`` (whether there
 * was one); handles and templates using it keep its descriptor until they let go. */
static PyObject *unregister_file(PyObject *self, PyObject *args) {
    return take_out_call(args, 1);
}

/* stamp_file(table, file_id, ino, changed) -> bool: the stamp registration ``file_id``'s
 * file had when Python verified it (whether there is such a registration): from now its
 * reads and opens here check that the file still has it (stamp_holds()). */
static PyObject *stamp_file(PyObject *self, PyObject *args) {
    PyObject *capsule;
    unsigned long long id, ino;
    long long changed;
    if (!PyArg_ParseTuple(args, "OKKL", &capsule, &id, &ino, &changed))
        return NULL;
    struct table *t = get_table(capsule);
    if (t == NULL)
        return NULL;
    pthread_mutex_lock(&t->lock);
    struct slot *r = id != 0 ? find_slot(&t->files, id) : NULL;
    int found = r != NULL && r->fh != 0;
    if (found)
        store_stamp(&r->file->shared->stamp, ino, changed);
    pthread_mutex_unlock(&t->lock);
    return PyBool_FromLong(found);
}

/* Under the lock: the descriptor of registration ``file_id``, or NULL if there is none. */
static struct shared_fd *registered(struct table *t, uint64_t file_id) {
    struct slot *r = file_id != 0 ? find_slot(&t->files, file_id) : NULL;
    return r != NULL && r->fh != 0 ? r->file->shared : NULL;
}

/* bind(table, fh, file_id, size) -> bool: reads of handle ``fh`` are answered from
 * registration ``file_id``, up to ``size`` bytes; False if there is no such registration
 * (its reads stay Python's). */
static PyObject *bind(PyObject *self, PyObject *args) {
    PyObject *capsule;
    unsigned long long fh, file_id, size;
    if (!PyArg_ParseTuple(args, "OKKK", &capsule, &fh, &file_id, &size))
        return NULL;
    struct table *t = get_table(capsule);
    if (t == NULL)
        return NULL;
    if (fh == 0) {
        PyErr_SetString(PyExc_ValueError, "handle 0 cannot be bound");
        return NULL;
    }
    struct bound_file *old = NULL, *f = NULL;
    struct shared_fd *sh = NULL;
    int failed = 0;
    pthread_mutex_lock(&t->lock);
    struct slot *s = find_slot(&t->handles, fh);
    if (s->fh != 0 && s->tpl != NULL) {
        failed = 2;  /* a handle the loop opened: it has its file */
    } else if ((sh = registered(t, file_id)) == NULL) {
        failed = 3;
    } else if (make_room(&t->handles) != 0 || (f = share_file(sh, size)) == NULL) {
        failed = 1;
    } else {
        s = find_slot(&t->handles, fh);
        if (s->fh != 0)
            old = unref(s->file);  /* a handle number bound twice: the newer wins */
        put_slot(&t->handles, fh, f, NULL);
    }
    pthread_mutex_unlock(&t->lock);
    dispose(old);
    if (failed == 3)
        Py_RETURN_FALSE;
    if (failed == 2) {
        PyErr_SetString(PyExc_ValueError, "the handle was opened by the loop");
        return NULL;
    }
    if (failed)
        return PyErr_NoMemory();
    Py_RETURN_TRUE;
}

/* unbind(table, fh) -> bool: whether ``fh`` was bound (or opened by the loop: then it is
 * released here, as a RELEASE the loop answered would be, without an event); its reads go
 * to Python from now. */
static PyObject *unbind(PyObject *self, PyObject *args) {
    return take_out_call(args, 0);
}

/* stats(table) -> dict: per timed request kind (read, lookup) (count, seconds, buckets);
 * read_bytes, ioctls, fallbacks (reads given to Python), bound (handles), and
 * lookups_remembered (answers stored so far). */
static PyObject *stats(PyObject *self, PyObject *args) {
    struct table *t = only_table(args);
    if (t == NULL)
        return NULL;
    PyObject *out = PyDict_New();
    if (out == NULL)
        return NULL;
    for (int k = 0; k < KINDS; k++) {
        struct op_stats *o = &t->ops[k];
        PyObject *buckets = PyList_New(t->n_bounds + 1);
        if (buckets == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        for (int i = 0; i <= t->n_bounds; i++) {
            PyList_SET_ITEM(buckets, i, PyLong_FromUnsignedLongLong(
                __atomic_load_n(&o->buckets[i], __ATOMIC_RELAXED)));
        }
        double seconds;
        __atomic_load(&o->seconds, &seconds, __ATOMIC_RELAXED);
        PyObject *item = Py_BuildValue(
            "KdN", (unsigned long long)__atomic_load_n(&o->count, __ATOMIC_RELAXED), seconds,
            buckets);
        if (item == NULL || PyDict_SetItemString(out, KIND_NAMES[k], item) != 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    pthread_mutex_lock(&t->lock);
    size_t bound = t->handles.used, templates = t->templates.used, events = t->event_count;
    pthread_mutex_unlock(&t->lock);
    const struct { const char *name; unsigned long long value; } counts[] = {
        {"read_bytes", __atomic_load_n(&t->read_bytes, __ATOMIC_RELAXED)},
        {"ioctls", __atomic_load_n(&t->ioctls, __ATOMIC_RELAXED)},
        {"fallbacks", __atomic_load_n(&t->fallbacks, __ATOMIC_RELAXED)},
        {"bound", bound},
        {"lookups_remembered", __atomic_load_n(&t->lookups_remembered, __ATOMIC_RELAXED)},
        {"templates", templates},
        {"events", events},
        {"open_handovers", __atomic_load_n(&t->open_handovers, __ATOMIC_RELAXED)},
        {"direct_reads", __atomic_load_n(&t->direct_reads, __ATOMIC_RELAXED)},
        {"changed_files", __atomic_load_n(&t->changed_files, __ATOMIC_RELAXED)},
    };
    for (size_t i = 0; i < sizeof(counts) / sizeof(counts[0]); i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(counts[i].value);
        if (v == NULL || PyDict_SetItemString(out, counts[i].name, v) != 0) {
            Py_XDECREF(v);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(v);
    }
    return out;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Count one request of ``kind`` that took ``seconds``. */
static void count_request(struct table *t, int kind, double seconds) {
    struct op_stats *o = &t->ops[kind];
    __atomic_fetch_add(&o->count, 1, __ATOMIC_RELAXED);
    double old, new_;
    __atomic_load(&o->seconds, &old, __ATOMIC_RELAXED);
    do {
        new_ = old + seconds;
    } while (!__atomic_compare_exchange(&o->seconds, &old, &new_, 1, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED));
    int i = 0;
    while (i < t->n_bounds && seconds > t->bounds[i])  /* bisect_left, as metrics.py */
        i++;
    __atomic_fetch_add(&o->buckets[i], 1, __ATOMIC_RELAXED);
}

/* Write an answer; errors of an interrupted request (ENOENT) or an ended connection
 * (ENODEV) are dropped, as the Python loop drops them. Returns -1 on another error. */
static int answer(int fd, uint64_t unique, int error, const void *data, size_t n) {
    struct out_header oh = {(uint32_t)(sizeof(oh) + n), error, unique};
    struct iovec iov[2] = {{&oh, sizeof(oh)}, {(void *)data, n}};
    for (;;) {
        ssize_t w = writev(fd, iov, n ? 2 : 1);
        if (w >= 0)
            return 0;
        if (errno == EINTR)
            continue;
        if (errno == ENOENT || errno == ENODEV)
            return 0;
        return -1;
    }
}

/* ``n`` rounded up to whole DIRECT_ALIGN units. */
static size_t whole_units(size_t n) {
    return (n + DIRECT_ALIGN - 1) & ~(size_t)(DIRECT_ALIGN - 1);
}

/* Whether any of ``len`` bytes from ``off`` of ``fd`` is in the page cache: 1, 0, or -1
 * when the kernel cannot say (cachestat(2) is Linux 6.5 and later). */
static int in_page_cache(int fd, uint64_t off, uint64_t len) {
    struct cachestat_args range = {off, len};
    struct cachestat_answer st;
    if (syscall(__NR_cachestat, fd, &range, &st, 0) != 0)
        return -1;
    return st.nr_cache > 0;
}

/* An O_DIRECT descriptor of the file for one read, which the caller closes; -1 when
 * none can be had (a file the kernel or its file system refuses O_DIRECT is marked, and
 * not asked again). Opened per read rather than kept with the file: a registered file then
 * holds one descriptor, not two, for as long as it stays registered (the daemon's budget
 * of descriptors, cachefs/descriptors.py), and a small file has one such read per open
 * (it costs the open of a /proc/self/fd link and a close). */
static int open_direct(struct bound_file *f) {
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", f->shared->fd);
    int dfd = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (dfd < 0 && errno != EMFILE && errno != ENFILE && errno != EINTR && errno != ENOMEM)
        __atomic_store_n(&f->shared->no_direct, 1, __ATOMIC_RELAXED);  /* refused for good */
    return dfd;
}

/* Read up to ``n`` bytes at ``off`` of a bound file into ``dst`` (``room`` bytes of
 * space, at least ``n``), as pread(). The last bytes of an object (a small file's READ is
 * all of it) are read O_DIRECT when none of them is in the page cache: the kernel caches
 * them for the FUSE file the answer fills, so a second copy in the cache file's pages
 * would only double the memory they take and add a copy out of it. Bytes that are there
 * (a file just written and not yet synced, one read ahead or through Python) are read
 * from it: O_DIRECT would first write dirty pages back. A read short of the object's end
 * is a plain one too: the cache file's own readahead then reads what follows while this
 * answer goes out (a large file read in order; one direct read per READ would wait for
 * the disk each time). A direct read needs ``off`` and ``dst`` aligned to DIRECT_ALIGN
 * and reads whole DIRECT_ALIGN units, so it may fill ``dst`` past ``n`` (never past
 * ``room``); any direct read that cannot be done that way is a plain pread. */
static ssize_t read_file(struct table *t, struct bound_file *f, char *dst, size_t n,
                         uint64_t off, size_t room) {
    size_t whole = whole_units(n);
    if (off + n >= f->size && off % DIRECT_ALIGN == 0 && (uintptr_t)dst % DIRECT_ALIGN == 0 &&
        whole <= room && !__atomic_load_n(&f->shared->no_direct, __ATOMIC_RELAXED) &&
        !__atomic_load_n(&t->no_cachestat, __ATOMIC_RELAXED)) {
        /* (neither asked again once refused: a kernel before 6.5 or a seccomp filter
         * refuses cachestat for good, a file system O_DIRECT for the file's life) */
        int cached = in_page_cache(f->shared->fd, off, n);
        if (cached < 0 && (errno == ENOSYS || errno == EPERM))
            __atomic_store_n(&t->no_cachestat, 1, __ATOMIC_RELAXED);
        int dfd = cached == 0 ? open_direct(f) : -1;
        if (dfd >= 0) {
            ssize_t r = pread(dfd, dst, whole, (off_t)off);
            close(dfd);
            if (r >= 0) {
                __atomic_fetch_add(&t->direct_reads, 1, __ATOMIC_RELAXED);
                return r < (ssize_t)n ? r : (ssize_t)n;
            }
            /* (EINVAL: an alignment this file system wants larger; the plain read
             * below answers, as it does every read the direct one fails) */
        }
    }
    return pread(f->shared->fd, dst, n, (off_t)off);
}

/* A READ of a bound handle: 1 when answered, 0 when Python must answer it. */
static int serve_read(struct table *t, int fd, const struct in_header *h, const char *body,
                      size_t body_len, char *data, size_t data_cap) {
    if (body_len < 24)
        return 0;
    struct read_in in;
    memcpy(&in, body, body_len < sizeof(in) ? body_len : sizeof(in));
    if (in.fh == 0)
        return 0;
    double t0 = now();
    struct bound_file *f = NULL;
    pthread_mutex_lock(&t->lock);
    struct slot *s = find_slot(&t->handles, in.fh);
    if (s->fh != 0 && s->file != NULL) {
        f = s->file;
        f->refs++;
    }
    pthread_mutex_unlock(&t->lock);
    if (f == NULL)
        return 0;
    size_t want = 0;
    if (in.offset < f->size) {
        uint64_t left = f->size - in.offset;
        want = in.size < left ? in.size : (size_t)left;
    }
    if (want > data_cap)
        want = 0;  /* larger than negotiated: never sent; let Python answer */
    size_t got = 0;
    int ok = want > 0 || in.offset >= f->size;
    while (ok && got < want) {
        ssize_t r = read_file(t, f, data + got, want - got, in.offset + got,
                              whole_units(data_cap) - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            ok = 0;  /* an error, or the file ends inside the object: Python serves it */
            break;
        }
        got += (size_t)r;
    }
    if (ok) {
        /* Checked after the read: a write changes the stamp before it changes bytes, so
         * bytes read before a change that this check does not see were the verified ones. */
        struct stamp want_stamp;
        load_stamp(&f->shared->stamp, &want_stamp);
        if (!stamp_holds(&want_stamp, f->shared->fd, NULL)) {
            __atomic_fetch_add(&t->changed_files, 1, __ATOMIC_RELAXED);
            ok = 0;  /* changed since it was verified: Python reads and checks each block */
        }
    }
    pthread_mutex_lock(&t->lock);
    struct bound_file *gone = unref(f);
    pthread_mutex_unlock(&t->lock);
    dispose(gone);
    if (!ok) {
        __atomic_fetch_add(&t->fallbacks, 1, __ATOMIC_RELAXED);
        return 0;
    }
    if (answer(fd, h->unique, 0, data, got) != 0)
        answer(fd, h->unique, -EIO, NULL, 0);
    __atomic_fetch_add(&t->read_bytes, got, __ATOMIC_RELAXED);
    count_request(t, KIND_READ, now() - t0);
    return 1;
}

/* -- remembered lookups ---------------------------------------------------------------- */

/* The first slot of the set where (parent, name)'s answer may be kept. */
static size_t lookup_set(const struct table *t, uint64_t parent, const char *name,
                         size_t len) {
    uint64_t h = 0xcbf29ce484222325ULL ^ hash_fh(parent);  /* FNV-1a over the name */
    for (size_t i = 0; i < len; i++) {
        h ^= (unsigned char)name[i];
        h *= 0x100000001b3ULL;
    }
    return (size_t)hash_fh(h) & t->lookup_mask & ~(t->lookup_ways - 1);
}

static int is_answer_of(const struct lookup_entry *e, uint64_t parent, const char *name,
                        size_t len) {
    return e != NULL && e->parent == parent && e->name_len == len &&
           memcmp(e->bytes, name, len) == 0;
}

/* Whether an answer would never be given again: expired, or of an epoch gone by. */
static int is_useless(const struct table *t, const struct lookup_entry *e, double at) {
    return at >= e->expires ||
           e->epoch != __atomic_load_n(&t->lookup_epoch, __ATOMIC_ACQUIRE) ||
           e->dir_epoch != __atomic_load_n(&t->dir_epochs[e->dir_slot], __ATOMIC_ACQUIRE);
}

/* Under the lock: the slot of set ``first`` to keep a new answer of (parent, name) in:
 * the name's own (so a set never holds two answers of one name), else an empty one, else
 * a useless one, else the one expiring first. */
static size_t lookup_victim(const struct table *t, size_t first, uint64_t parent,
                            const char *name, size_t len, double at) {
    size_t victim = first;
    int rank = 3;  /* of the victim so far: 0 empty, 1 useless, 2 in use */
    for (size_t i = first; i < first + t->lookup_ways; i++) {
        const struct lookup_entry *e = t->lookups[i];
        if (is_answer_of(e, parent, name, len))
            return i;
        int r = e == NULL ? 0 : is_useless(t, e, at) ? 1 : 2;
        if (r < rank || (r == 2 && rank == 2 && e->expires < t->lookups[victim]->expires)) {
            victim = i;
            rank = r;
        }
    }
    return victim;
}

static uint64_t epoch_token(struct table *t, size_t dir_slot) {
    return ((uint64_t)__atomic_load_n(&t->lookup_epoch, __ATOMIC_ACQUIRE) << 32) |
           __atomic_load_n(&t->dir_epochs[dir_slot], __ATOMIC_ACQUIRE);
}

/* lookup_epoch(table, dir_key) -> int: the epoch token to give remember_lookup() for a
 * lookup in the directory ``dir_key`` (a hash of its prefix) that starts now (read before
 * the lookup reads anything). */
static PyObject *lookup_epoch(PyObject *self, PyObject *args) {
    PyObject *capsule;
    unsigned long long dir_key;
    if (!PyArg_ParseTuple(args, "OK", &capsule, &dir_key))
        return NULL;
    struct table *t = get_table(capsule);
    if (t == NULL)
        return NULL;
    return PyLong_FromUnsignedLongLong(epoch_token(t, dir_key & (DIR_EPOCHS - 1)));
}

/* forget_dir(table, dir_key): no answer remembered so far for directory ``dir_key`` is
 * given again. */
static PyObject *forget_dir(PyObject *self, PyObject *args) {
    PyObject *capsule;
    unsigned long long dir_key;
    if (!PyArg_ParseTuple(args, "OK", &capsule, &dir_key))
        return NULL;
    struct table *t = get_table(capsule);
    if (t == NULL)
        return NULL;
    __atomic_fetch_add(&t->dir_epochs[dir_key & (DIR_EPOCHS - 1)], 1, __ATOMIC_ACQ_REL);
    Py_RETURN_NONE;
}

/* forget_lookups(table): no answer remembered so far is given again. */
static PyObject *forget_lookups(PyObject *self, PyObject *args) {
    struct table *t = only_table(args);
    if (t == NULL)
        return NULL;
    __atomic_fetch_add(&t->lookup_epoch, 1, __ATOMIC_ACQ_REL);
    Py_RETURN_NONE;
}

/* remember_lookup(table, token, dir_key, parent, name, answer, fresh_for) -> bool: answer
 * LOOKUPs of ``name`` in directory inode ``parent`` (whose prefix hashes to ``dir_key``)
 * with ``answer`` (a fuse_entry_out) for the next ``fresh_for`` seconds, unless an epoch
 * moved past ``token`` (lookup_epoch()) meanwhile (then False). */
static PyObject *remember_lookup(PyObject *self, PyObject *args) {
    PyObject *capsule;
    unsigned long long token, dir_key, parent;
    const char *name, *answer;
    Py_ssize_t name_len, answer_len;
    double fresh_for;
    if (!PyArg_ParseTuple(args, "OKKKy#y#d", &capsule, &token, &dir_key, &parent, &name,
                          &name_len, &answer, &answer_len, &fresh_for))
        return NULL;
    struct table *t = get_table(capsule);
    if (t == NULL)
        return NULL;
    if (name_len > MAX_NAME || answer_len > MAX_LOOKUP_ANSWER) {
        PyErr_SetString(PyExc_ValueError, "name or answer too long to remember");
        return NULL;
    }
    size_t dir_slot = dir_key & (DIR_EPOCHS - 1);
    if (!(fresh_for > 0) || token != epoch_token(t, dir_slot))
        Py_RETURN_FALSE;
    struct lookup_entry *e = malloc(sizeof(*e) + (size_t)name_len + (size_t)answer_len);
    if (e == NULL)
        return PyErr_NoMemory();
    e->parent = parent;
    e->epoch = (uint32_t)(token >> 32);
    e->dir_slot = (uint32_t)dir_slot;
    e->dir_epoch = (uint32_t)token;
    e->expires = now() + fresh_for;
    e->name_len = (uint32_t)name_len;
    e->answer_len = (uint32_t)answer_len;
    memcpy(e->bytes, name, (size_t)name_len);
    memcpy(e->bytes + name_len, answer, (size_t)answer_len);
    size_t first = lookup_set(t, parent, name, (size_t)name_len);
    double at = now();
    struct lookup_entry *old = NULL;
    int stored = 0;
    pthread_mutex_lock(&t->lock);
    /* (checked again here: a forget since the first check must win; one after this is
     * seen by every answer, which compares the entry's epochs with the current ones) */
    if (token == epoch_token(t, dir_slot)) {
        size_t i = lookup_victim(t, first, parent, name, (size_t)name_len, at);
        old = t->lookups[i];
        t->lookups[i] = e;
        stored = 1;
    }
    pthread_mutex_unlock(&t->lock);
    free(stored ? old : e);
    if (stored)
        __atomic_fetch_add(&t->lookups_remembered, 1, __ATOMIC_RELAXED);
    return PyBool_FromLong(stored);
}

/* A LOOKUP: 1 when answered from a remembered answer, 0 when Python must answer it. */
static int serve_lookup(struct table *t, int fd, const struct in_header *h, const char *body,
                        size_t body_len) {
    size_t len = strnlen(body, body_len);
    if (len == body_len || len == 0)
        return 0;  /* not NUL-terminated, or empty: Python decides */
    double t0 = now();
    char answer_buf[MAX_LOOKUP_ANSWER];
    size_t answer_len = 0;
    int hit = 0;
    size_t first = lookup_set(t, h->nodeid, body, len);
    uint32_t epoch = __atomic_load_n(&t->lookup_epoch, __ATOMIC_ACQUIRE);
    pthread_mutex_lock(&t->lock);
    for (size_t i = first; i < first + t->lookup_ways; i++) {
        const struct lookup_entry *e = t->lookups[i];
        if (!is_answer_of(e, h->nodeid, body, len))
            continue;  /* (a set holds at most one answer of a name) */
        if (e->epoch == epoch &&
            e->dir_epoch == __atomic_load_n(&t->dir_epochs[e->dir_slot], __ATOMIC_ACQUIRE) &&
            t0 < e->expires) {
            answer_len = e->answer_len;
            memcpy(answer_buf, e->bytes + e->name_len, answer_len);
            hit = 1;
        }
        break;
    }
    pthread_mutex_unlock(&t->lock);
    if (!hit)
        return 0;
    if (answer(fd, h->unique, 0, answer_buf, answer_len) != 0)
        answer(fd, h->unique, -EIO, NULL, 0);
    count_request(t, KIND_LOOKUP, now() - t0);
    return 1;
}

/* -- open templates and the events Python takes ---------------------------------------- */

struct open_in {
    uint32_t flags, open_flags;
};

struct open_out {
    uint64_t fh;
    uint32_t open_flags;
    int32_t backing_id;
};

struct release_in {
    uint64_t fh;
    uint32_t flags, release_flags;
    uint64_t lock_owner;
};

/* add_template(table, ino, token, dir_key, open_flags, backing_id, file_id, size[, path,
 *              stamp_ino, stamp_changed]) -> bool:
 * answer OPENs of inode ``ino`` here (read-only opens without O_DIRECT): a new handle,
 * answered with ``open_flags`` and ``backing_id`` (the kernel's passthrough backing, or
 * 0), and bound to registration ``file_id`` up to ``size`` bytes unless it is 0 -- while
 * the epochs stay those of ``token`` (lookup_epoch() of the inode's directory
 * ``dir_key``, read before Python saw the inode listed): once its directory's listing
 * changes, its opens go to Python, which may find the inode no longer listed. If the
 * inode has a template already, only its epochs are renewed. False if ``token`` is not
 * current, or ``file_id`` is not registered (nothing done). Each handle opened and
 * released here is an event for Python (take_events()). With the kernel's backing, ``path``
 * and the stamp are its file's as verified, checked at each open (a renewal renews them);
 * a bound file's are its registration's (stamp_file()). */
static PyObject *add_template(PyObject *self, PyObject *args) {
    PyObject *capsule;
    unsigned long long ino, size, token, dir_key, file_id, stamp_ino = 0;
    long long stamp_changed = 0;
    const char *path = NULL;
    unsigned int open_flags;
    int backing_id;
    if (!PyArg_ParseTuple(args, "OKKKIiKK|zKL", &capsule, &ino, &token, &dir_key, &open_flags,
                          &backing_id, &file_id, &size, &path, &stamp_ino, &stamp_changed))
        return NULL;
    struct table *t = get_table(capsule);
    if (t == NULL)
        return NULL;
    if (ino == 0) {
        PyErr_SetString(PyExc_ValueError, "inode 0 has no template");
        return NULL;
    }
    struct open_template *tpl = calloc(1, sizeof(*tpl));
    if (tpl == NULL)
        return PyErr_NoMemory();
    size_t dir_slot = dir_key & (DIR_EPOCHS - 1);
    tpl->ino = ino;
    tpl->epoch = (uint32_t)(token >> 32);
    tpl->dir_slot = (uint32_t)dir_slot;
    tpl->dir_epoch = (uint32_t)token;
    tpl->open_flags = open_flags;
    tpl->backing_id = backing_id;
    if (path != NULL && stamp_ino != 0) {
        tpl->path = strdup(path);
        if (tpl->path == NULL) {
            free(tpl);
            return PyErr_NoMemory();
        }
        store_stamp(&tpl->stamp, stamp_ino, stamp_changed);
    }
    int added = 0, renewed = 0, failed = 0;
    pthread_mutex_lock(&t->lock);
    if (token == epoch_token(t, dir_slot)) {  /* (under the mutex: see remember_lookup) */
        struct slot *s = find_slot(&t->templates, ino);
        struct shared_fd *sh = file_id != 0 ? registered(t, file_id) : NULL;
        if (s->fh != 0) {
            s->tpl->epoch = tpl->epoch;  /* the same inode is the same file: renew */
            s->tpl->dir_slot = tpl->dir_slot;
            s->tpl->dir_epoch = tpl->dir_epoch;
            if (tpl->path != NULL && s->tpl->path != NULL) {
                char *old = s->tpl->path;  /* (swapped: freed below with tpl) */
                s->tpl->path = tpl->path;
                tpl->path = old;
                store_stamp(&s->tpl->stamp, stamp_ino, stamp_changed);
            }
            renewed = 1;
        } else if (file_id != 0 && sh == NULL) {
            /* (not registered: not added) */
        } else if (make_room(&t->templates) != 0 ||
                   (sh != NULL && (tpl->file = share_file(sh, size)) == NULL)) {
            failed = 1;
        } else {
            put_slot(&t->templates, ino, NULL, tpl);  /* (its file's reference is its own) */
            added = 1;
        }
    }
    pthread_mutex_unlock(&t->lock);
    if (!added) {
        dispose(tpl->file);
        free(tpl->path);
        free(tpl);
        if (failed)
            return PyErr_NoMemory();
    }
    return PyBool_FromLong(added || renewed);
}

/* drop_template(table, ino) -> bool: the loop no longer opens inode ``ino`` (True; also
 * when it had no template), or -- while handles the loop opened with it are not released
 * -- the template is kept (False): whatever the caller's registration holds for them
 * (a pin, the kernel's backing) must stay. */
static PyObject *drop_template(PyObject *self, PyObject *args) {
    PyObject *capsule;
    unsigned long long ino;
    if (!PyArg_ParseTuple(args, "OK", &capsule, &ino))
        return NULL;
    struct table *t = get_table(capsule);
    if (t == NULL)
        return NULL;
    struct open_template *tpl = NULL;
    struct bound_file *gone = NULL;
    int dropped = 1;
    pthread_mutex_lock(&t->lock);
    struct slot *s = ino != 0 ? find_slot(&t->templates, ino) : NULL;
    if (s != NULL && s->fh != 0) {
        if (s->tpl->handles > 0) {
            dropped = 0;
        } else {
            tpl = s->tpl;
            gone = unref(tpl->file);
            remove_slot(&t->templates, s);
        }
    }
    pthread_mutex_unlock(&t->lock);
    dispose(gone);
    if (tpl != NULL)
        free(tpl->path);
    free(tpl);
    return PyBool_FromLong(dropped);
}

/* set_event_fd(table, fd): an eventfd written whenever the event ring stops being empty. */
static PyObject *set_event_fd(PyObject *self, PyObject *args) {
    PyObject *capsule;
    int fd;
    if (!PyArg_ParseTuple(args, "Oi", &capsule, &fd))
        return NULL;
    struct table *t = get_table(capsule);
    if (t == NULL)
        return NULL;
    pthread_mutex_lock(&t->lock);
    t->event_fd = fd;
    pthread_mutex_unlock(&t->lock);
    Py_RETURN_NONE;
}

/* take_events(table) -> bytes: the events since the last call, oldest first, each
 * struct.pack("<IIQQ", kind, pid, fh, ino) (kind 1: opened, 2: released). */
static PyObject *take_events(PyObject *self, PyObject *args) {
    struct table *t = only_table(args);
    if (t == NULL)
        return NULL;
    if (__atomic_load_n(&t->event_count, __ATOMIC_ACQUIRE) == 0)
        return PyBytes_FromStringAndSize(NULL, 0);
    struct event *copy = NULL;
    size_t n;
    for (;;) {
        n = __atomic_load_n(&t->event_count, __ATOMIC_ACQUIRE);
        free(copy);
        copy = malloc((n + 1) * sizeof(struct event));
        if (copy == NULL)
            return PyErr_NoMemory();
        pthread_mutex_lock(&t->lock);
        if (t->event_count <= n) {
            n = t->event_count;
            for (size_t i = 0; i < n; i++)
                copy[i] = t->events[(t->event_head + i) % MAX_EVENTS];
            t->event_head = (t->event_head + n) % MAX_EVENTS;
            __atomic_store_n(&t->event_count, 0, __ATOMIC_RELEASE);
            pthread_mutex_unlock(&t->lock);
            break;
        }
        pthread_mutex_unlock(&t->lock);  /* more arrived meanwhile: a larger copy */
    }
    PyObject *out = PyBytes_FromStringAndSize((const char *)copy, (Py_ssize_t)(n * sizeof(struct event)));
    free(copy);
    return out;
}

/* Under the lock: queue an event; returns whether the ring was empty (then the caller
 * writes the event fd, after unlocking). The caller checked there is room. */
static int push_event(struct table *t, uint32_t kind, uint32_t pid, uint64_t fh, uint64_t ino) {
    size_t n = t->event_count;
    t->events[(t->event_head + n) % MAX_EVENTS] = (struct event){kind, pid, fh, ino};
    __atomic_store_n(&t->event_count, n + 1, __ATOMIC_RELEASE);
    return n == 0;
}

static void signal_events(struct table *t) {
    int fd = t->event_fd;
    if (fd >= 0) {
        uint64_t one = 1;
        ssize_t w = write(fd, &one, sizeof(one));
        (void)w;  /* EAGAIN: the counter is full, a wake-up is pending anyway */
    }
}

/* Whether the file of inode ``ino``'s template (if any) still has the stamp it was
 * verified with. What to check is copied under the mutex and checked after it (a system
 * call): a descriptor number that a dropped template's file gave up meanwhile names
 * another file or none, whose stamp differs -- Python then answers, as for a change. */
static int template_file_holds(struct table *t, uint64_t ino) {
    struct stamp want = {0, 0};
    int fd = -1;
    char path[PATH_MAX];
    path[0] = 0;
    pthread_mutex_lock(&t->lock);
    struct slot *ts = find_slot(&t->templates, ino);
    struct open_template *tpl = ts->fh != 0 ? ts->tpl : NULL;
    if (tpl != NULL && tpl->file != NULL) {
        load_stamp(&tpl->file->shared->stamp, &want);
        fd = tpl->file->shared->fd;
    } else if (tpl != NULL && tpl->path != NULL) {
        load_stamp(&tpl->stamp, &want);
        snprintf(path, sizeof(path), "%s", tpl->path);
    }
    pthread_mutex_unlock(&t->lock);
    return stamp_holds(&want, fd, path);
}

/* An OPEN: 1 when answered from the inode's template, 0 when Python must answer it. */
static int serve_open(struct table *t, int fd, const struct in_header *h, const char *body,
                      size_t body_len) {
    if (body_len < sizeof(struct open_in))
        return 0;
    struct open_in in;
    memcpy(&in, body, sizeof(in));
    if (in.flags & LOOP_OPEN_REFUSED)
        return 0;
    double t0 = now();
    if (!template_file_holds(t, h->nodeid)) {
        __atomic_fetch_add(&t->changed_files, 1, __ATOMIC_RELAXED);
        return 0;  /* changed since it was verified: Python decides */
    }
    struct open_out out = {0, 0, 0};
    int answered = 0, was_empty = 0;
    pthread_mutex_lock(&t->lock);
    struct slot *ts = find_slot(&t->templates, h->nodeid);
    struct open_template *tpl = ts->fh != 0 ? ts->tpl : NULL;
    if (tpl != NULL &&
        (tpl->epoch != __atomic_load_n(&t->lookup_epoch, __ATOMIC_ACQUIRE) ||
         tpl->dir_epoch != __atomic_load_n(&t->dir_epochs[tpl->dir_slot], __ATOMIC_ACQUIRE)))
        tpl = NULL;  /* its directory's listing changed since: Python looks again */
    if (tpl != NULL) {
        if (t->event_count >= MAX_EVENTS || make_room(&t->handles) != 0) {
            __atomic_fetch_add(&t->open_handovers, 1, __ATOMIC_RELAXED);
        } else {
            uint64_t fh = t->next_fh++;
            if (tpl->file != NULL)
                tpl->file->refs++;
            put_slot(&t->handles, fh, tpl->file, tpl);
            tpl->handles++;
            /* (the event is queued before the answer is written: any request of this
             * handle that reaches Python finds it taken first) */
            was_empty = push_event(t, EVENT_OPENED, h->pid, fh, h->nodeid);
            out = (struct open_out){fh, tpl->open_flags, tpl->backing_id};
            answered = 1;
        }
    }
    pthread_mutex_unlock(&t->lock);
    if (!answered)
        return 0;
    if (was_empty)
        signal_events(t);
    if (answer(fd, h->unique, 0, &out, sizeof(out)) != 0)
        answer(fd, h->unique, -EIO, NULL, 0);
    count_request(t, KIND_OPEN, now() - t0);
    return 1;
}

/* A RELEASE: 1 when the handle was opened here and is released here, 0 when Python must
 * answer it (its own handle, or the event ring is full: then Python takes the events and
 * releases it with unbind()). */
static int serve_release(struct table *t, int fd, const struct in_header *h,
                         const char *body, size_t body_len) {
    if (body_len < 8)
        return 0;
    uint64_t fh;
    memcpy(&fh, body, sizeof(fh));
    if (fh < FIRST_LOOP_FH)
        return 0;
    double t0 = now();
    int answered = 0, was_empty = 0;
    struct bound_file *gone = NULL;
    pthread_mutex_lock(&t->lock);
    struct slot *s = find_slot(&t->handles, fh);
    if (s->fh != 0 && s->tpl != NULL && t->event_count < MAX_EVENTS) {
        s->tpl->handles--;
        gone = unref(s->file);
        was_empty = push_event(t, EVENT_RELEASED, h->pid, fh, s->tpl->ino);
        remove_slot(&t->handles, s);
        answered = 1;
    }
    pthread_mutex_unlock(&t->lock);
    if (!answered)
        return 0;
    dispose(gone);
    if (was_empty)
        signal_events(t);
    answer(fd, h->unique, 0, NULL, 0);
    count_request(t, KIND_RELEASE, now() - t0);
    return 1;
}

/* serve(table, fd, buf, handle, data_size): the worker loop (see the module comment).
 * Returns when the connection ended or handle() answered true; raises what handle()
 * raised, or OSError for a failed read of the device. */
static PyObject *serve(PyObject *self, PyObject *args) {
    PyObject *capsule, *buf_obj, *handle;
    int fd;
    Py_ssize_t data_size;
    if (!PyArg_ParseTuple(args, "OiOOn", &capsule, &fd, &buf_obj, &handle, &data_size))
        return NULL;
    struct table *t = get_table(capsule);
    if (t == NULL)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(buf_obj, &view, PyBUF_WRITABLE) != 0)
        return NULL;
    /* (page-aligned and in whole units: a direct read of an answer's last bytes reads the
     * rest of their unit) */
    char *data = NULL;
    if (data_size < 0 ||
        posix_memalign((void **)&data, DIRECT_ALIGN, whole_units((size_t)data_size)) != 0) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    char *buf = view.buf;
    size_t cap = (size_t)view.len;
    PyObject *result = NULL;
    int saved_errno = 0;
    PyThreadState *ts = PyEval_SaveThread();
    for (;;) {
        ssize_t n = read(fd, buf, cap);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ENOENT)
                continue;  /* ENOENT: the request was interrupted before we read it */
            /* ECONNABORTED: the connection ended (the last file of a detached mount
             * closed, or an abort) while this read was taking a request: an end too */
            if (errno == ENODEV || errno == ECONNABORTED) {
                PyEval_RestoreThread(ts);
                result = Py_None;  /* unmounted (or aborted) */
                Py_INCREF(result);
                break;
            }
            saved_errno = errno;
            PyEval_RestoreThread(ts);
            break;
        }
        if (n == 0) {
            PyEval_RestoreThread(ts);
            result = Py_None;
            Py_INCREF(result);
            break;
        }
        if ((size_t)n >= sizeof(struct in_header)) {
            const struct in_header *h = (const struct in_header *)buf;
            if (h->opcode == OP_READ &&
                serve_read(t, fd, h, buf + sizeof(*h), (size_t)n - sizeof(*h), data,
                           (size_t)data_size))
                continue;
            if (h->opcode == OP_LOOKUP &&
                serve_lookup(t, fd, h, buf + sizeof(*h), (size_t)n - sizeof(*h)))
                continue;
            if (h->opcode == OP_OPEN &&
                serve_open(t, fd, h, buf + sizeof(*h), (size_t)n - sizeof(*h)))
                continue;
            if (h->opcode == OP_RELEASE &&
                serve_release(t, fd, h, buf + sizeof(*h), (size_t)n - sizeof(*h)))
                continue;
            if (h->opcode == OP_IOCTL) {
                answer(fd, h->unique, -ENOTTY, NULL, 0);
                __atomic_fetch_add(&t->ioctls, 1, __ATOMIC_RELAXED);
                continue;
            }
        }
        PyEval_RestoreThread(ts);
        PyObject *arg = PyLong_FromSsize_t(n);
        PyObject *r = arg ? PyObject_CallOneArg(handle, arg) : NULL;
        Py_XDECREF(arg);
        if (r == NULL)
            break;  /* the exception propagates */
        int stop = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (stop != 0) {
            if (stop > 0) {
                result = Py_None;
                Py_INCREF(result);
            }
            break;
        }
        ts = PyEval_SaveThread();
    }
    free(data);
    PyBuffer_Release(&view);
    if (saved_errno) {
        errno = saved_errno;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return result;
}

static PyMethodDef methods[] = {
    {"new_table", new_table, METH_VARARGS, "A table of bound handles."},
    {"register_file", register_file, METH_VARARGS, "Register a file for handles to read."},
    {"unregister_file", unregister_file, METH_VARARGS, "Drop a file's registration."},
    {"bind", bind, METH_VARARGS, "Answer reads of a handle from a registered file."},
    {"unbind", unbind, METH_VARARGS, "Stop answering reads of a handle."},
    {"stats", stats, METH_VARARGS, "Counts of the requests answered here."},
    {"lookup_epoch", lookup_epoch, METH_VARARGS, "The epoch of lookups starting now."},
    {"forget_lookups", forget_lookups, METH_VARARGS, "Give no remembered lookup again."},
    {"forget_dir", forget_dir, METH_VARARGS, "Give no remembered lookup of a directory again."},
    {"add_template", add_template, METH_VARARGS, "Answer an inode's opens."},
    {"drop_template", drop_template, METH_VARARGS, "Stop answering an inode's opens."},
    {"stamp_file", stamp_file, METH_VARARGS, "Check a registered file's stamp from now."},
    {"set_event_fd", set_event_fd, METH_VARARGS, "An eventfd told of new events."},
    {"take_events", take_events, METH_VARARGS, "The handles opened and released since."},
    {"remember_lookup", remember_lookup, METH_VARARGS, "Answer a name's lookups."},
    {"serve", serve, METH_VARARGS, "A request worker's loop."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cachefs.fuse._native",
    "The request workers' loop in C (see cachefs/fuse/native.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    return PyModule_Create(&module);
}
