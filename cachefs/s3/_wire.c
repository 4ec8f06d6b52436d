/* One GET's exchange on a plain (non-TLS) kept-alive socket in one call, with the
 * interpreter lock released once: send the signed request, receive the status line and
 * headers, receive a body framed by Content-Length, and compute its MD5 when asked.
 *
 * Why: a cold small file is one GET, and its S3 thread's CPU is one of the largest
 * shares of the daemon's per file (benchmarks/RESULTS.md, twenty-seventh round). In
 * Python the exchange releases and retakes the interpreter lock for the send, the
 * head's recv(), the body's recv() and the MD5 -- with a few hundred GETs in flight the
 * lock is contended, and each hand-over costs two thread switches -- and parses the
 * head line by line and joins the body from parts. Here: one release, the head parsed
 * in C, the body received straight into the bytes object returned, hashed while it is
 * still in the processor's cache.
 *
 * Contract (cachefs/s3/http1.py, exchange_plain, is the only caller):
 *
 *   exchange(fd, request, expect, idle, progress_at, wanted, md5, report, pooled)
 *
 * With ``pooled`` (a kept-alive connection taken from the idle pool), first polls the
 * socket without waiting: readable (the server closed it, or sent something unasked) or
 * failed, it is not sent on and ``()`` is returned, for the caller to close it and take
 * another (what RangeClient's pool did in Python, with a second release of the lock).
 * Otherwise sends ``request`` (bytes) on the blocking socket ``fd`` (prepared by
 * http1.set_idle_timeout: SO_RCVTIMEO slices, SO_SNDTIMEO) and reads the answer's head
 * into a buffer of up to 16 KiB. Only the plain case is answered here: a status line
 * "HTTP/1.x NNN" with a final status other than 204 and 304, every line ending in CRLF,
 * no folded line, header names in ASCII, at most 100 headers, no Transfer-Encoding, and
 * a Content-Length of exactly ``expect`` bytes. Then the body is received (MSG_WAITALL) and
 *
 *   (status, headers, body, will_close, md5)
 *
 * is returned: ``headers`` the answer's headers whose lower-cased names start with one
 * of ``wanted`` (a tuple of lower-case bytes; the first of repeated names kept; names and
 * values stripped and decoded as latin-1), ``body`` shorter than ``expect`` only when
 * the stream ended early (for the caller to judge), ``will_close`` as http1.read_answer
 * computes it, ``md5`` the 16-byte MD5 of a complete body of a 200 when ``md5`` is true
 * and the answer states no full-object checksum (no x-amz-checksum-crc64nvme, -crc32c,
 * -crc32, -sha256 or -sha1 header), else None. Anything else -- an interim 1xx answer,
 * a malformed or unusual head, another framing or length, a head not complete when the
 * stream ends or within 16 KiB -- returns ``(received,)``: the bytes read so far, for
 * the caller's Python reader to go on from (so every such answer is judged by the one
 * parser, http1.read_answer, exactly as before).
 *
 * Waits: each recv() waits at most one SO_RCVTIMEO slice; a slice that brings nothing
 * raises TimeoutError once ``idle`` seconds passed since the last arrival (the first
 * "arrival" is ``progress_at``, the exchange's send time), as SocketReader does. Every
 * arrival's time is kept, and ``report(first_at, last_at)`` (time.monotonic() values) is
 * called with the lock retaken whenever a wait comes back after a slice with new bytes
 * (so a slow answer's progress is reported at least once a slice), and once before
 * returning or raising if bytes arrived. A shutdown() of the socket from another thread
 * (an aborted request) ends a wait at once: the stream ends, the answer is short or
 * incomplete. System call failures raise OSError with their errno (EAGAIN of a send
 * past SO_SNDTIMEO included), as Python's socket methods do.
 *
 * Thread-safety: touches only its arguments; the request buffer is held for the call,
 * the body is a bytes object no other code has seen until it is returned.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/md5.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <strings.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>

#define HEAD_READ 16384
#define MAX_HEADERS 100
#define MAX_WANTED 16

static double monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* What one call carries between its steps. */
typedef struct {
    int fd;
    double idle;
    double first_at;    /* 0: nothing arrived yet */
    double last_at;     /* the last arrival, or the send time */
    double reported_at; /* last_at when last reported */
    PyObject *report;
    PyThreadState *save; /* non-NULL while the lock is released */
} call_t;

/* Report progress with the lock retaken (it is released again after). -1 with the
 * exception set when report raised. */
static int report_progress(call_t *c) {
    if (c->first_at == 0 || c->last_at == c->reported_at)
        return 0;
    c->reported_at = c->last_at;
    int held = c->save == NULL;
    if (!held) {
        PyEval_RestoreThread(c->save);
        c->save = NULL;
    }
    PyObject *r = PyObject_CallFunction(c->report, "dd", c->first_at, c->last_at);
    Py_XDECREF(r);
    if (!held)
        c->save = PyEval_SaveThread();
    return r == NULL ? -1 : 0;
}

/* recv() into buf: the byte count (0 at the end of the stream), -1 with errno set, or -2
 * (the silence passed ``idle``: errno ETIMEDOUT), or -3 (report raised). With waitall,
 * waits for all n bytes but comes back after a slice with what arrived. */
static ssize_t recv_some(call_t *c, char *buf, size_t n, int waitall) {
    for (;;) {
        ssize_t k = recv(c->fd, buf, n, waitall ? MSG_WAITALL : 0);
        if (k > 0) {
            double now = monotonic();
            if (c->first_at == 0)
                c->first_at = now;
            c->last_at = now;
            if (waitall && (size_t)k < n && report_progress(c) < 0)
                return -3; /* a slice passed mid-body: tell the waiter it progresses */
            return k;
        }
        if (k == 0)
            return 0;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return -1;
        /* A slice passed without a byte: bytes that came before it are reported now
         * (the head of an answer whose body stalls), then the silence is judged. */
        if (report_progress(c) < 0)
            return -3;
        if (monotonic() - c->last_at >= c->idle) {
            errno = ETIMEDOUT;
            return -2;
        }
    }
}

static int is_space(char ch) {
    return ch == ' ' || ch == '\t' || ch == '\r' || ch == '\n' || ch == '\v' || ch == '\f';
}

static int lower(int ch) { return (ch >= 'A' && ch <= 'Z') ? ch + 32 : ch; }

/* Whether [s, s+n) equals the lower-case ``lit`` ignoring case. */
static int equals_ci(const char *s, size_t n, const char *lit) {
    size_t m = strlen(lit);
    if (n != m)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (lower((unsigned char)s[i]) != lit[i])
            return 0;
    return 1;
}

/* Whether the lower-case ``needle`` occurs in [s, s+n) ignoring case. */
static int contains_ci(const char *s, size_t n, const char *needle) {
    size_t m = strlen(needle);
    for (size_t i = 0; i + m <= n; i++) {
        size_t j = 0;
        while (j < m && lower((unsigned char)s[i + j]) == needle[j])
            j++;
        if (j == m)
            return 1;
    }
    return 0;
}

typedef struct {
    const char *name, *value;
    size_t name_len, value_len;
} header_t;

typedef struct {
    int status;
    int http10;
    long long length;  /* -1: none */
    int will_close;
    int states_checksum;
    size_t head_len;   /* bytes of the head, the blank line included */
    header_t kept[MAX_HEADERS];
    int nkept;
} head_t;

/* The end of the head in buf[0:n] (just past the blank line), or 0 if not complete. */
static size_t head_end(const char *buf, size_t n) {
    for (size_t i = 0; i + 1 < n; i++) {
        if (buf[i] != '\n')
            continue;
        if (buf[i + 1] == '\n')
            return i + 2;
        if (buf[i + 1] == '\r' && i + 2 < n && buf[i + 2] == '\n')
            return i + 3;
    }
    return 0;
}

/* Parse a complete head: 1 for the plain case (see the contract), 0 for the Python
 * reader to judge. */
static int parse_head(const char *buf, size_t len, const char *const *wanted,
                      const size_t *wanted_len, int nwanted, head_t *h) {
    const char *p = buf, *end = buf + len;
    const char *eol = memchr(p, '\n', (size_t)(end - p));
    if (eol == NULL || eol == p || eol[-1] != '\r')
        return 0;
    /* "HTTP/1.x NNN[ reason]" */
    size_t line = (size_t)(eol - 1 - p);
    if (line < 12 || memcmp(p, "HTTP/1.", 7) != 0 || p[8] != ' ')
        return 0;
    if (p[7] < '0' || p[7] > '9')
        return 0;
    h->http10 = p[7] == '0';
    for (int i = 9; i < 12; i++)
        if (p[i] < '0' || p[i] > '9')
            return 0;
    if (line > 12 && p[12] != ' ')
        return 0;
    h->status = (p[9] - '0') * 100 + (p[10] - '0') * 10 + (p[11] - '0');
    if (h->status < 200 || h->status == 204 || h->status == 304)
        return 0;
    h->length = -1;
    h->states_checksum = 0;
    h->nkept = 0;
    const char *connection = NULL;
    size_t connection_len = 0;
    int count = 0;
    for (p = eol + 1; p < end; p = eol + 1) {
        eol = memchr(p, '\n', (size_t)(end - p));
        if (eol == NULL || eol == p || eol[-1] != '\r')
            return 0; /* (a bare LF: the Python reader's case) */
        if (eol - 1 == p) { /* the blank line */
            h->head_len = (size_t)(eol + 1 - buf);
            break;
        }
        if (++count > MAX_HEADERS)
            return 0;
        if (*p == ' ' || *p == '\t')
            return 0; /* a folded line */
        const char *colon = memchr(p, ':', (size_t)(eol - 1 - p));
        if (colon == NULL)
            return 0;
        const char *n0 = p, *n1 = colon, *v0 = colon + 1, *v1 = eol - 1;
        while (n0 < n1 && is_space(*n0))
            n0++;
        while (n1 > n0 && is_space(n1[-1]))
            n1--;
        while (v0 < v1 && is_space(*v0))
            v0++;
        while (v1 > v0 && is_space(v1[-1]))
            v1--;
        size_t nl = (size_t)(n1 - n0), vl = (size_t)(v1 - v0);
        for (size_t i = 0; i < nl; i++)
            if ((unsigned char)n0[i] >= 0x80)
                return 0; /* (lower-cased by Python's rules there) */
        int first = 1; /* the first of this name (repeated names: the first is kept) */
        for (int i = 0; i < h->nkept; i++)
            if (h->kept[i].name_len == nl && strncasecmp(h->kept[i].name, n0, nl) == 0)
                first = 0;
        if (equals_ci(n0, nl, "transfer-encoding"))
            return 0;
        if (equals_ci(n0, nl, "content-length")) {
            if (h->length >= 0)
                continue; /* repeated: the first is kept */
            if (vl == 0 || vl > 18)
                return 0;
            long long v = 0;
            for (size_t i = 0; i < vl; i++) {
                if (v0[i] < '0' || v0[i] > '9')
                    return 0;
                v = v * 10 + (v0[i] - '0');
            }
            h->length = v;
        } else if (equals_ci(n0, nl, "connection")) {
            if (connection == NULL) {
                connection = v0;
                connection_len = vl;
            }
        } else if (nl > 15 && strncasecmp(n0, "x-amz-checksum-", 15) == 0) {
            const char *kind = n0 + 15;
            size_t kl = nl - 15;
            if (equals_ci(kind, kl, "crc64nvme") || equals_ci(kind, kl, "crc32c") ||
                equals_ci(kind, kl, "crc32") || equals_ci(kind, kl, "sha256") ||
                equals_ci(kind, kl, "sha1"))
                h->states_checksum = 1;
        }
        if (first) {
            int keep = 0;
            for (int i = 0; i < nwanted && !keep; i++) {
                if (wanted_len[i] > nl)
                    continue;
                keep = 1;
                for (size_t j = 0; j < wanted_len[i]; j++)
                    if (lower((unsigned char)n0[j]) != wanted[i][j]) {
                        keep = 0;
                        break;
                    }
            }
            if (keep || nwanted == 0) {
                header_t *k = &h->kept[h->nkept++];
                k->name = n0;
                k->name_len = nl;
                k->value = v0;
                k->value_len = vl;
            }
        }
    }
    if (h->head_len == 0 || h->length < 0)
        return 0;
    h->will_close = (connection != NULL && contains_ci(connection, connection_len, "close")) ||
                    (h->http10 && !(connection != NULL &&
                                    contains_ci(connection, connection_len, "keep-alive")));
    return 1;
}

/* Raise for a failed step (with the lock held): OSError from errno, TimeoutError for
 * the idle timeout; nothing to do if report raised. */
static PyObject *fail(call_t *c, ssize_t k, int err) {
    if (k == -3)
        return NULL;
    if (report_progress(c) < 0)
        return NULL;
    if (k == -2) {
        PyErr_Format(PyExc_TimeoutError, "no byte for %.1f s", monotonic() - c->last_at);
        return NULL;
    }
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static PyObject *exchange(PyObject *self, PyObject *args) {
    int fd, want_md5, pooled;
    Py_buffer request;
    Py_ssize_t expect;
    double idle, progress_at;
    PyObject *wanted_obj, *report;
    if (!PyArg_ParseTuple(args, "iy*nddO!pOp", &fd, &request, &expect, &idle, &progress_at,
                          &PyTuple_Type, &wanted_obj, &want_md5, &report, &pooled))
        return NULL;
    const char *wanted[MAX_WANTED];
    size_t wanted_len[MAX_WANTED];
    Py_ssize_t nwanted = PyTuple_GET_SIZE(wanted_obj);
    if (expect < 0 || nwanted > MAX_WANTED) {
        PyBuffer_Release(&request);
        PyErr_SetString(PyExc_ValueError, "negative expect or too many wanted prefixes");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nwanted; i++) {
        PyObject *w = PyTuple_GET_ITEM(wanted_obj, i);
        Py_ssize_t n;
        wanted[i] = PyUnicode_Check(w) ? PyUnicode_AsUTF8AndSize(w, &n) : NULL;
        if (wanted[i] == NULL) {
            PyBuffer_Release(&request);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "wanted: a tuple of str");
            return NULL;
        }
        wanted_len[i] = (size_t)n;
    }
    PyObject *body = PyBytes_FromStringAndSize(NULL, expect);
    if (body == NULL) {
        PyBuffer_Release(&request);
        return NULL;
    }
    char *head = PyMem_RawMalloc(HEAD_READ);
    head_t *h = PyMem_RawMalloc(sizeof(head_t));
    if (head == NULL || h == NULL) {
        PyMem_RawFree(head);
        PyMem_RawFree(h);
        PyBuffer_Release(&request);
        Py_DECREF(body);
        return PyErr_NoMemory();
    }
    call_t c = {fd, idle, 0, progress_at, progress_at, report, NULL};
    ssize_t k = 0;
    int err = 0, plain = 0;
    size_t have = 0, got = 0;
    unsigned char digest[MD5_DIGEST_LENGTH];
    int digested = 0;
    h->head_len = 0;

    c.save = PyEval_SaveThread();
    int dropped = 0;
    if (pooled) {
        struct pollfd pfd = {fd, POLLIN, 0};
        int r;
        while ((r = poll(&pfd, 1, 0)) < 0 && errno == EINTR)
            ;
        dropped = r != 0;
    }
    if (dropped) {
        PyEval_RestoreThread(c.save);
        PyBuffer_Release(&request);
        Py_DECREF(body);
        PyMem_RawFree(head);
        PyMem_RawFree(h);
        return PyTuple_New(0);
    }
    /* the request */
    const char *out = request.buf;
    size_t left = (size_t)request.len;
    while (left > 0) {
        ssize_t n = send(fd, out, left, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            k = -1;
            err = errno;
            break;
        }
        out += n;
        left -= (size_t)n;
    }
    /* the head */
    size_t end = 0;
    while (k >= 0 && have < HEAD_READ) {
        k = recv_some(&c, head + have, HEAD_READ - have, 0);
        if (k < 0) {
            err = errno;
            break;
        }
        if (k == 0)
            break; /* the stream ended: the Python reader's case */
        size_t from = have >= 2 ? have - 2 : 0;
        have += (size_t)k;
        if ((end = head_end(head + from, have - from)) != 0) {
            end += from;
            break;
        }
    }
    if (k >= 0 && end != 0 && (plain = parse_head(head, end, wanted, wanted_len,
                                                   (int)nwanted, h)) &&
        h->length != (long long)expect)
        plain = 0;
    if (plain) {
        /* the body: what the head's recv() took of it, then the rest at once */
        char *dst = PyBytes_AS_STRING(body);
        got = have - end;
        if (got > (size_t)expect)
            got = (size_t)expect; /* (more than the answer: left unread, as in Python) */
        memcpy(dst, head + end, got);
        while (got < (size_t)expect) {
            k = recv_some(&c, dst + got, (size_t)expect - got, 1);
            if (k <= 0) {
                err = errno;
                break;
            }
            got += (size_t)k;
        }
        if (k >= 0 && got == (size_t)expect && want_md5 && h->status == 200 &&
            !h->states_checksum) {
            MD5((const unsigned char *)dst, got, digest);
            digested = 1;
        }
    }
    PyEval_RestoreThread(c.save);
    c.save = NULL;
    PyBuffer_Release(&request);

    PyObject *result = NULL;
    if (k < 0) {
        fail(&c, k, err);
        goto done;
    }
    if (report_progress(&c) < 0)
        goto done;
    if (!plain) {
        PyObject *received = PyBytes_FromStringAndSize(head, (Py_ssize_t)have);
        if (received != NULL)
            result = PyTuple_Pack(1, received);
        Py_XDECREF(received);
        goto done;
    }
    if (got < (size_t)expect && _PyBytes_Resize(&body, (Py_ssize_t)got) < 0) {
        body = NULL;
        goto done;
    }
    PyObject *headers = PyDict_New();
    if (headers == NULL)
        goto done;
    for (int i = 0; i < h->nkept; i++) {
        header_t *kh = &h->kept[i];
        char name[256];
        size_t nl = kh->name_len < sizeof(name) ? kh->name_len : sizeof(name);
        if (kh->name_len > sizeof(name)) {
            /* (a name this long is never a wanted one; with no prefixes, kept whole) */
            PyObject *n = PyUnicode_DecodeLatin1(kh->name, (Py_ssize_t)kh->name_len, NULL);
            PyObject *lowered = n ? PyObject_CallMethod(n, "lower", NULL) : NULL;
            PyObject *v = PyUnicode_DecodeLatin1(kh->value, (Py_ssize_t)kh->value_len, NULL);
            int bad = lowered == NULL || v == NULL || PyDict_SetItem(headers, lowered, v) < 0;
            Py_XDECREF(n);
            Py_XDECREF(lowered);
            Py_XDECREF(v);
            if (bad) {
                Py_DECREF(headers);
                goto done;
            }
            continue;
        }
        for (size_t j = 0; j < nl; j++)
            name[j] = (char)lower((unsigned char)kh->name[j]);
        PyObject *n = PyUnicode_DecodeLatin1(name, (Py_ssize_t)nl, NULL);
        PyObject *v = PyUnicode_DecodeLatin1(kh->value, (Py_ssize_t)kh->value_len, NULL);
        int bad = n == NULL || v == NULL || PyDict_SetItem(headers, n, v) < 0;
        Py_XDECREF(n);
        Py_XDECREF(v);
        if (bad) {
            Py_DECREF(headers);
            goto done;
        }
    }
    PyObject *md5 = digested ? PyBytes_FromStringAndSize((const char *)digest, MD5_DIGEST_LENGTH)
                             : Py_NewRef(Py_None);
    if (md5 == NULL) {
        Py_DECREF(headers);
        goto done;
    }
    result = Py_BuildValue("(iNNON)", h->status, headers, body,
                           h->will_close ? Py_True : Py_False, md5);
    body = NULL; /* (stolen by N, or released by Py_BuildValue on failure) */
done:
    Py_XDECREF(body);
    PyMem_RawFree(head);
    PyMem_RawFree(h);
    return result;
}

static PyObject *md5(PyObject *self, PyObject *args) {
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data))
        return NULL;
    unsigned char digest[MD5_DIGEST_LENGTH];
    Py_BEGIN_ALLOW_THREADS
    MD5((const unsigned char *)data.buf, (size_t)data.len, digest);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)digest, MD5_DIGEST_LENGTH);
}

static PyMethodDef methods[] = {
    {"exchange", exchange, METH_VARARGS,
     "exchange(fd, request, expect, idle, progress_at, wanted, md5, report, pooled) -> "
     "(status, headers, body, will_close, md5), (received,) or (): one GET's exchange on a "
     "plain socket in one call (see _wire.c)."},
    {"md5", md5, METH_VARARGS, "md5(data) -> bytes: the MD5 digest of data (tests)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_wire", "One GET's exchange on a plain socket in one call.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__wire(void) { return PyModule_Create(&module); }
