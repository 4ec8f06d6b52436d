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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int open_for_write(const char *path) {
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
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
    return open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
}

static PyObject *write_at(PyObject *self, PyObject *args) {
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
    Py_BEGIN_ALLOW_THREADS
    int fd = open_for_write(path);
    struct stat st;
    if (fd < 0) {
        err = errno;
    } else if (fstat(fd, &st) < 0) {
        err = errno;
        close(fd);
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
        close(fd);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (err) {
        errno = err;
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
    }
    return Py_BuildValue("(KLL)", ino, before, changed);
}

static PyMethodDef methods[] = {
    {"write_at", write_at, METH_VARARGS,
     "write_at(path, data, offset) -> (inode, ctime_ns before, after): write a cache file in one call."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cachefile", "A cache file's write in one call.", -1, methods,
};

PyMODINIT_FUNC PyInit__cachefile(void) { return PyModule_Create(&module); }
