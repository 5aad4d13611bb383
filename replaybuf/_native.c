/* The frame loop of ChunkCodec.decode_many_into (replaybuf/storage/_codecs.py) in C.
 *
 * A shard's blosc chunks are checked (crc32c) and decoded one after another with the GIL
 * released once for the whole run, through the c-blosc and crc32c functions the caller found
 * (their addresses, from ctypes): no library is linked here. Through ctypes each frame cost two
 * GIL hand-offs and ~2 us of Python, and two threads decoding reached 1.5x one thread; one call
 * per run lets them reach the c-blosc's own scaling (~1.75x on 2 cores).
 *
 * decode_many(decompress, extend, data, ranges, out, offsets, nbytes, checksum) -> (k, code):
 * k = -1 when every chunk decoded, else the failing chunk (the ones before it decoded) and
 * code 1: too short for a blosc chunk, 2: crc32c mismatch, 3: sizes or decode wrong.
 *
 * gather(out, addresses, nbytes) copies nbytes from each address (int64s) into out, one after
 * another, with the GIL released: the frames a batch samples from many memory maps
 * (storage/_hotmap.py), which the caller keeps referenced and checked. Building one numpy view
 * over all the maps for a fancy index cost ~0.1 ms of Python a batch, a fifth of the copy.
 *
 * pread_many(fds, starts, sizes, out, got) reads sizes[k] bytes at starts[k] of fds[k] (int64s)
 * into out, one range after another, with the GIL released: got[k] is the bytes read (fewer
 * where the file ends first), -1 where fds[k] < 0 (absent), or -1 - errno where a read failed. A sampled batch reads a
 * small range per frame; a preadv each from Python cost ~4 us.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <errno.h>
#include <string.h>
#include <unistd.h>

typedef int (*decompress_fn)(const void *, void *, size_t, int);
typedef uint32_t (*extend_fn)(uint32_t, const void *, size_t);

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static PyObject *decode_many(PyObject *self, PyObject *args) {
    unsigned long long decompress_address, extend_address;
    Py_buffer data, ranges, out, offsets;
    Py_ssize_t nbytes;
    int checksum;
    if (!PyArg_ParseTuple(args, "KKy*y*w*y*np", &decompress_address, &extend_address, &data, &ranges, &out,
                          &offsets, &nbytes, &checksum))
        return NULL;
    Py_ssize_t count = ranges.len / (Py_ssize_t)(2 * sizeof(int64_t));
    Py_ssize_t failed = -1;
    int code = 0;
    if (offsets.len / (Py_ssize_t)sizeof(int64_t) < count || nbytes < 0) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&ranges);
        PyBuffer_Release(&out);
        PyBuffer_Release(&offsets);
        PyErr_SetString(PyExc_ValueError, "decode_many: offsets shorter than ranges, or nbytes < 0");
        return NULL;
    }
    decompress_fn decompress = (decompress_fn)(uintptr_t)decompress_address;
    extend_fn extend = (extend_fn)(uintptr_t)extend_address;
    const unsigned char *base = (const unsigned char *)data.buf;
    unsigned char *target = (unsigned char *)out.buf;
    const int64_t *bounds = (const int64_t *)ranges.buf;
    const int64_t *places = (const int64_t *)offsets.buf;
    Py_ssize_t size = data.len, tail = checksum ? 4 : 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < count; k++) {
        int64_t start = bounds[2 * k], stop = bounds[2 * k + 1], place = places[k];
        int64_t payload = stop - start - tail;
        if (start < 0 || payload < 16 || stop > size) {
            failed = k, code = 1;
            break;
        }
        if (place < 0 || place + nbytes > out.len) {
            failed = k, code = 3;
            break;
        }
        if (checksum && extend(0, base + start, (size_t)payload) != le32(base + stop - 4)) {
            failed = k, code = 2;
            break;
        }
        if (le32(base + start + 4) != (uint32_t)nbytes || le32(base + start + 12) != (uint32_t)payload ||
            decompress(base + start, target + place, (size_t)nbytes, 1) != (int)nbytes) {
            failed = k, code = 3;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    PyBuffer_Release(&ranges);
    PyBuffer_Release(&out);
    PyBuffer_Release(&offsets);
    return Py_BuildValue("(ni)", failed, code);
}

static PyObject *gather(PyObject *self, PyObject *args) {
    Py_buffer out, addresses;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "w*y*n", &out, &addresses, &nbytes))
        return NULL;
    Py_ssize_t count = addresses.len / (Py_ssize_t)sizeof(int64_t);
    if (nbytes < 0 || count * nbytes > out.len) {
        PyBuffer_Release(&out);
        PyBuffer_Release(&addresses);
        PyErr_SetString(PyExc_ValueError, "gather: out is smaller than len(addresses) * nbytes, or nbytes < 0");
        return NULL;
    }
    unsigned char *target = (unsigned char *)out.buf;
    const int64_t *sources = (const int64_t *)addresses.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < count; k++)
        memcpy(target + k * nbytes, (const void *)(uintptr_t)sources[k], (size_t)nbytes);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    PyBuffer_Release(&addresses);
    Py_RETURN_NONE;
}

static PyObject *pread_many(PyObject *self, PyObject *args) {
    Py_buffer fds, starts, sizes, out, got;
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*", &fds, &starts, &sizes, &out, &got))
        return NULL;
    Py_ssize_t count = fds.len / (Py_ssize_t)sizeof(int64_t);
    const int64_t *files = (const int64_t *)fds.buf, *at = (const int64_t *)starts.buf, *want = (const int64_t *)sizes.buf;
    int64_t *done = (int64_t *)got.buf;
    int64_t total = 0;
    int ok = starts.len >= fds.len && sizes.len >= fds.len && got.len >= fds.len;
    for (Py_ssize_t k = 0; ok && k < count; k++) {
        if (want[k] < 0 || at[k] < 0)
            ok = 0;
        total += want[k];
    }
    if (!ok || total > out.len) {
        PyBuffer_Release(&fds);
        PyBuffer_Release(&starts);
        PyBuffer_Release(&sizes);
        PyBuffer_Release(&out);
        PyBuffer_Release(&got);
        PyErr_SetString(PyExc_ValueError, "pread_many: arrays of unequal lengths, a negative range, or out too small");
        return NULL;
    }
    unsigned char *target = (unsigned char *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < count; k++) {
        int64_t read_so_far = 0;
        if (files[k] < 0) {
            done[k] = -1;
        } else {
            while (read_so_far < want[k]) {
                ssize_t n = pread((int)files[k], target + read_so_far, (size_t)(want[k] - read_so_far), (off_t)(at[k] + read_so_far));
                if (n < 0 && errno == EINTR)
                    continue;
                if (n < 0) {
                    read_so_far = -1 - (int64_t)errno;
                    break;
                }
                if (n == 0)
                    break;
                read_so_far += n;
            }
            done[k] = read_so_far;
        }
        target += want[k];
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&fds);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&out);
    PyBuffer_Release(&got);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode_many", decode_many, METH_VARARGS, "Check and decode a run of blosc chunks with the GIL released once."},
    {"gather", gather, METH_VARARGS, "Copy nbytes from each address into out, one after another, with the GIL released."},
    {"pread_many", pread_many, METH_VARARGS, "Read byte ranges of open files into out, one after another, with the GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
