/* A cache file's write in one call: open (making its directory if missing), fstat, pwrite
 * until done, fstat, close -- with the interpreter lock released once.
 *
 * Why: a cold small file's bytes are written by the S3 worker thread that fetched them
 * (cachefs/read/fetcher.py, the GET's sink). In Python each of those four system calls
 * releases and retakes the interpreter lock, and with a few hundred GETs in flight the
 * lock is contended: a thread that gives it up for a 5 us call sleeps until another
 * thread hands it back, two context switches each time. One release per write instead
 * of four cuts those hand-overs (benchmarks/RESULTS.md, sixteenth round).
 *
 * Contract: exactly ObjectFiles.write_at's (cachefs/cache/objectfiles.py): the file is
 * created 0600 and its directory 0700 (an existing directory is fine); the bytes are
 * written at the offset; (inode number, the file's status change time in ns before the
 * write, and after it) is returned (cachefs/cache/objectfiles.py, FileStamp); any failure raises
 * OSError with the failing call's errno and the path, and leaves the file closed.
 * Touches only its arguments; the buffer is held (PyBuffer) for the call.
 *
 * write_kept is the same write leaving the file open (ObjectFiles.write_kept): the file
 * is opened read-write and (inode, change time before, after, descriptor) returned, the descriptor the caller's to
 * close (O_CLOEXEC); on a failure it is closed, as above. The S3 thread that wrote a
 * small file hands that descriptor to the kernel for passthrough (cachefs/passthrough.py:
 * registered by the thread that wrote it), without opening the file again.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int open_for_write(const char *path, int mode) {
    int fd = open(path, mode | O_CREAT | O_CLOEXEC, 0600);
    if (fd >= 0 || errno != ENOENT)
        return fd;
    /* The object's directory (objects/<two hex digits>) does not exist yet. */
    const char *slash = strrchr(path, '/');
    if (slash == NULL || slash == path || (size_t)(slash - path) >= PATH_MAX) {
        errno = ENOENT;
        return -1;
    }
    char dir[PATH_MAX];
    memcpy(dir, path, (size_t)(slash - path));
    dir[slash - path] = '\0';
    if (mkdir(dir, 0700) < 0 && errno != EEXIST)
        return -1;
    return open(path, mode | O_CREAT | O_CLOEXEC, 0600);
}

/* The write of both functions: the file's inode, change times and, with keep, its
 * descriptor (kept open; else closed), or NULL with the exception set. */
static PyObject *write_file(PyObject *args, int keep) {
    const char *path;
    Py_buffer data;
    long long offset;
    if (!PyArg_ParseTuple(args, "sy*L", &path, &data, &offset))
        return NULL;
    if (offset < 0) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "negative offset");
        return NULL;
    }
    int err = 0;
    unsigned long long ino = 0;
    long long before = 0, changed = 0;
    int fd;
    struct stat st;
    Py_BEGIN_ALLOW_THREADS
    fd = open_for_write(path, keep ? O_RDWR : O_WRONLY);
    if (fd < 0) {
        err = errno;
    } else if (fstat(fd, &st) < 0) {
        err = errno;
        close(fd);
        fd = -1;
    } else {
        before = (long long)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec;
        const char *p = data.buf;
        size_t left = (size_t)data.len;
        off_t at = (off_t)offset;
        while (left > 0) {
            ssize_t n = pwrite(fd, p, left, at);
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                err = errno;
                break;
            }
            p += n;
            left -= (size_t)n;
            at += n;
        }
        if (!err) {
            if (fstat(fd, &st) < 0)
                err = errno;
            else {
                ino = (unsigned long long)st.st_ino;
                changed = (long long)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec;
            }
        }
        if (err || !keep) {
            close(fd);
            fd = -1;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (err) {
        errno = err;
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
    }
    if (!keep)
        return Py_BuildValue("(KLL)", ino, before, changed);
    PyObject *result = Py_BuildValue("(KLLi)", ino, before, changed, fd);
    if (result == NULL)
        close(fd);
    return result;
}

static PyObject *write_at(PyObject *self, PyObject *args) {
    return write_file(args, 0);
}

static PyObject *write_kept(PyObject *self, PyObject *args) {
    return write_file(args, 1);
}

static PyMethodDef methods[] = {
    {"write_at", write_at, METH_VARARGS,
     "write_at(path, data, offset) -> (inode, ctime_ns before, after): write a cache file "
     "in one call."},
    {"write_kept", write_kept, METH_VARARGS,
     "write_kept(path, data, offset) -> (inode, ctime_ns before, after, fd): write_at, the "
     "file left open "
     "read-write."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cachefile", "A cache file's write in one call.", -1, methods,
};

PyMODINIT_FUNC PyInit__cachefile(void) { return PyModule_Create(&module); }
