/* Rows read with the GIL released once per request, not once per row.
 *
 * read_rows(fds, bufs, offsets) does what sum(map(os.preadv, fds, bufs, offsets)) does
 * (the portable path in rows.py): one pread per row into the row's buffer, the bytes read
 * summed, so a short read shows in the total and a failed one raises OSError. The
 * difference is the cost per row: os.preadv parses its arguments, allocates an iovec and
 * releases and takes the GIL for every 4 KiB row; here the buffers are collected first
 * (GIL held), then every pread runs in one stretch without it.
 *
 * fds: one descriptor (int) for every row, or a sequence of one per row.
 * bufs: an iterable of 1-tuples of writable contiguous buffers (what os.preadv takes).
 * offsets: a sequence of file offsets, one per row.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <unistd.h>

typedef struct {
    int fd;
    long long offset;
    Py_buffer view;
} Row;

static void release_rows(Row *rows, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&rows[i].view);
    PyMem_Free(rows);
}

/* Fill rows[i] from the i-th item of bufs and offsets; -1 with an exception set. */
static int collect(PyObject *fds, PyObject *bufs_it, PyObject *offsets, Row *rows,
                   Py_ssize_t n, Py_ssize_t *taken) {
    int one_fd = PyLong_Check(fds);
    int fd = one_fd ? (int)PyLong_AsLong(fds) : -1;
    if (one_fd && fd == -1 && PyErr_Occurred()) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyIter_Next(bufs_it);
        if (item == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "fewer buffers than offsets");
            return -1;
        }
        PyObject *buf = PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 1
                            ? PyTuple_GET_ITEM(item, 0) : item;
        int bad = PyObject_GetBuffer(buf, &rows[i].view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS);
        Py_DECREF(item);
        if (bad) return -1;
        *taken = i + 1;
        rows[i].offset = PyLong_AsLongLong(PyList_GET_ITEM(offsets, i));
        if (rows[i].offset == -1 && PyErr_Occurred()) return -1;
        if (one_fd) {
            rows[i].fd = fd;
        } else {
            rows[i].fd = (int)PyLong_AsLong(PyList_GET_ITEM(fds, i));
            if (rows[i].fd == -1 && PyErr_Occurred()) return -1;
        }
    }
    return 0;
}

static PyObject *read_rows(PyObject *self, PyObject *args) {
    PyObject *fds, *bufs, *offsets;
    if (!PyArg_ParseTuple(args, "OOO!", &fds, &bufs, &PyList_Type, &offsets)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(offsets);
    if (!PyLong_Check(fds) && !(PyList_Check(fds) && PyList_GET_SIZE(fds) == n)) {
        PyErr_SetString(PyExc_TypeError, "fds: an int, or a list as long as offsets");
        return NULL;
    }
    PyObject *bufs_it = PyObject_GetIter(bufs);
    if (bufs_it == NULL) return NULL;
    Row *rows = PyMem_Calloc(n ? n : 1, sizeof(Row));
    if (rows == NULL) {
        Py_DECREF(bufs_it);
        return PyErr_NoMemory();
    }
    Py_ssize_t taken = 0;
    int bad = collect(fds, bufs_it, offsets, rows, n, &taken);
    Py_DECREF(bufs_it);
    if (bad) {
        release_rows(rows, taken);
        return NULL;
    }
    long long total = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        ssize_t got;
        do {
            got = pread(rows[i].fd, rows[i].view.buf, (size_t)rows[i].view.len,
                        (off_t)rows[i].offset);
        } while (got < 0 && errno == EINTR);
        if (got < 0) {
            err = errno;
            break;
        }
        total += got;
    }
    Py_END_ALLOW_THREADS
    release_rows(rows, n);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLongLong(total);
}

static PyMethodDef methods[] = {
    {"read_rows", read_rows, METH_VARARGS,
     "read_rows(fds, bufs, offsets) -> int: sum(map(os.preadv, fds, bufs, offsets)), "
     "with the GIL released once."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_rows", "One pread per row, the GIL released once.", -1, methods,
};

PyMODINIT_FUNC PyInit__rows(void) { return PyModule_Create(&module); }
