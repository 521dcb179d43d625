/* Native fast paths of sglang_harden.guards.lifecycle.PageLedger's bulk operations: a CPython extension module.
 *
 * Each function handles only the usual case of its operation, over the ledger's own columns (state int8, owner
 * int64, generation int64, indexed by page; passed as addresses) and a 1-D int32/int64 page buffer (a numpy array,
 * read through the buffer protocol). It either does the whole operation and returns DONE, or writes nothing and
 * returns NOT_HANDLED, and the caller runs its numpy path, which has the same rules and handles every case
 * (refusals, quarantine, errors, out-of-range pages). An extension function (METH_FASTCALL) rather than a ctypes
 * call: with the caches cold after a KV copy, one ctypes call measured ~40 us, one extension call ~12 us.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

enum { FREE = 0, RESERVED = 1, WRITING = 2, WRITTEN = 3, QUARANTINED = 4 };
enum { NOT_HANDLED = 0, DONE = 1, MISMATCH = 2 };
#define NO_OWNER (-1)
#define MIXED (-3)
#define NONE_TRACKED (-2)
#define ADDR(x) ((void *)(intptr_t)(x))

typedef struct {
    Py_buffer view;
    int wide; /* 1: int64 pages, 0: int32 */
    Py_ssize_t n;
} pages_t;

/* 0: readable int32/int64 C-contiguous buffer of `ndim` dimensions; -1: not (no Python error left set). */
static int open_pages_nd(PyObject *obj, pages_t *p, int ndim) {
    if (PyObject_GetBuffer(obj, &p->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        return -1;
    }
    const char *f = p->view.format ? p->view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    char c = f[0];
    int ok = p->view.ndim == ndim && p->view.shape != NULL && f[1] == 0 &&
             ((p->view.itemsize == 8 && (c == 'q' || c == 'l')) || (p->view.itemsize == 4 && (c == 'i' || c == 'l')));
    if (!ok) {
        PyBuffer_Release(&p->view);
        return -1;
    }
    p->wide = p->view.itemsize == 8;
    p->n = p->view.shape[0];
    return 0;
}

static int open_pages(PyObject *obj, pages_t *p) { return open_pages_nd(obj, p, 1); }

static inline int64_t page_at(const pages_t *p, Py_ssize_t i) {
    return p->wide ? ((const int64_t *)p->view.buf)[i] : (int64_t)((const int32_t *)p->view.buf)[i];
}

static int all_in_range(const pages_t *p, int64_t num_pages) {
    for (Py_ssize_t i = 0; i < p->n; i++) {
        int64_t page = page_at(p, i);
        if (page < 0 || page >= num_pages) return 0;
    }
    return 1;
}

/* reserve: every page FREE -> initial, owner, generation. */
static int do_reserve(int8_t *state, int64_t *owner, int64_t *gen, int64_t num_pages, PyObject *pages,
                       int64_t initial, int64_t owner_id, int64_t generation) {
    pages_t p;
    if (open_pages(pages, &p) != 0) return NOT_HANDLED;
    int result = DONE;
    for (Py_ssize_t i = 0; i < p.n; i++) {
        int64_t page = page_at(&p, i);
        if (page < 0 || page >= num_pages || state[page] != FREE) {
            result = NOT_HANDLED;
            break;
        }
    }
    if (result == DONE) {
        for (Py_ssize_t i = 0; i < p.n; i++) {
            int64_t page = page_at(&p, i);
            state[page] = (int8_t)initial;
            owner[page] = owner_id;
            gen[page] = generation;
        }
    }
    PyBuffer_Release(&p.view);
    return result;
}

/* begin/finish write: every page owned by owner_id and in state `before` (or already `goal`) -> goal. */
static int do_move(int8_t *state, const int64_t *owner, int64_t num_pages, PyObject *pages, int64_t owner_id,
                    int64_t before, int64_t goal) {
    pages_t p;
    if (open_pages(pages, &p) != 0) return NOT_HANDLED;
    int result = DONE;
    for (Py_ssize_t i = 0; i < p.n; i++) {
        int64_t page = page_at(&p, i);
        if (page < 0 || page >= num_pages || owner[page] != owner_id ||
            (state[page] != before && state[page] != goal)) {
            result = NOT_HANDLED;
            break;
        }
    }
    if (result == DONE) {
        for (Py_ssize_t i = 0; i < p.n; i++) state[page_at(&p, i)] = (int8_t)goal;
    }
    PyBuffer_Release(&p.view);
    return result;
}

/* release: every page owned by owner_id, not FREE or QUARANTINED, and (writer drained or none WRITING) -> FREE. */
static int do_release(int8_t *state, int64_t *owner, int64_t num_pages, PyObject *pages, int64_t owner_id,
                       int64_t writer_drained) {
    pages_t p;
    if (open_pages(pages, &p) != 0) return NOT_HANDLED;
    int result = DONE;
    for (Py_ssize_t i = 0; i < p.n; i++) {
        int64_t page = page_at(&p, i);
        if (page < 0 || page >= num_pages || owner[page] != owner_id || state[page] == FREE ||
            state[page] == QUARANTINED || (state[page] == WRITING && !writer_drained)) {
            result = NOT_HANDLED;
            break;
        }
    }
    if (result == DONE) {
        for (Py_ssize_t i = 0; i < p.n; i++) {
            int64_t page = page_at(&p, i);
            state[page] = FREE;
            owner[page] = NO_OWNER;
        }
    }
    PyBuffer_Release(&p.view);
    return result;
}

/* Number of pages owned by owner_id; -1 when not handled. */
static int64_t do_count_owned(const int64_t *owner, int64_t num_pages, PyObject *pages, int64_t owner_id) {
    pages_t p;
    if (open_pages(pages, &p) != 0) return -1;
    int64_t count = 0;
    if (!all_in_range(&p, num_pages)) {
        count = -1;
    } else {
        for (Py_ssize_t i = 0; i < p.n; i++) count += owner[page_at(&p, i)] == owner_id;
    }
    PyBuffer_Release(&p.view);
    return count;
}

/* The one owner id of all pages (none FREE); NONE_TRACKED: all FREE; MIXED: anything else; -4 not handled. */
static int64_t do_sole_owner(const int8_t *state, const int64_t *owner, int64_t num_pages, PyObject *pages) {
    pages_t p;
    if (open_pages(pages, &p) != 0) return -4;
    int64_t result = -4;
    if (all_in_range(&p, num_pages)) {
        Py_ssize_t free_pages = 0;
        int64_t first = p.n ? owner[page_at(&p, 0)] : NO_OWNER;
        result = first;
        for (Py_ssize_t i = 0; i < p.n; i++) {
            int64_t page = page_at(&p, i);
            if (state[page] == FREE) {
                free_pages++;
            } else if (owner[page] != first) {
                result = MIXED;
            }
        }
        if (free_pages == p.n) {
            result = NONE_TRACKED;
        } else if (free_pages) {
            result = MIXED;
        }
    }
    PyBuffer_Release(&p.view);
    return result;
}

/* release_unwritable: the tracked (non-FREE) pages all of one owner and none WRITING or QUARANTINED (no writer can
 * still write them) -> FREE; FREE pages among them (e.g. decode's generated tokens, never tracked) stay FREE.
 * Returns that owner id; NONE_TRACKED: every page FREE; MIXED or -4: nothing written. */
static int64_t release_unwritable_core(int8_t *state, int64_t *owner, int64_t num_pages, const pages_t *p) {
    if (!all_in_range(p, num_pages)) return -4;
    Py_ssize_t tracked = 0;
    int64_t first = NO_OWNER;
    int64_t result = NONE_TRACKED;
    for (Py_ssize_t i = 0; i < p->n; i++) {
        int64_t page = page_at(p, i);
        int8_t st = state[page];
        if (st == FREE) continue;
        if (tracked++ == 0) first = owner[page];
        if (owner[page] != first || st == WRITING || st == QUARANTINED) result = MIXED;
    }
    if (tracked && result != MIXED) result = first;
    if (result >= 0) {
        for (Py_ssize_t i = 0; i < p->n; i++) {
            int64_t page = page_at(p, i);
            state[page] = FREE;
            owner[page] = NO_OWNER;
        }
    }
    return result;
}

static int64_t do_release_unwritable(int8_t *state, int64_t *owner, int64_t num_pages, PyObject *pages) {
    pages_t p;
    if (open_pages(pages, &p) != 0) return -4;
    int64_t result = release_unwritable_core(state, owner, num_pages, &p);
    PyBuffer_Release(&p.view);
    return result;
}

/* The same over n int32 (wide 0) or int64 (wide 1) page numbers at a raw host address (a CPU tensor's memory,
 * read without making a numpy array of it). */
static int64_t do_release_unwritable_at(int8_t *state, int64_t *owner, int64_t num_pages, int64_t addr, int64_t n,
                                        int64_t wide) {
    if (addr == 0 || n < 0 || (wide != 0 && wide != 1)) return -4;
    pages_t p;
    p.view.buf = ADDR(addr);
    p.n = (Py_ssize_t)n;
    p.wide = (int)wide;
    return release_unwritable_core(state, owner, num_pages, &p);
}

/* Page tags: every entry / page_size names a page owned by owner_id at `generation` and WRITTEN.
 * DONE: all are; MISMATCH: one is not; NOT_HANDLED: unreadable buffer or an entry outside the pool. */
static int owned_written(const int8_t *state, const int64_t *owner, const int64_t *gen, int64_t num_pages,
                         const pages_t *p, Py_ssize_t first, Py_ssize_t n, int64_t page_size, int64_t owner_id,
                         int64_t generation) {
    int result = DONE;
    for (Py_ssize_t i = first; i < first + n; i++) {
        int64_t entry = page_at(p, i);
        if (entry < 0) {
            result = NOT_HANDLED;
            break;
        }
        int64_t page = page_size > 1 ? entry / page_size : entry;
        if (page >= num_pages) {
            result = NOT_HANDLED;
            break;
        }
        if (result == DONE && (owner[page] != owner_id || gen[page] != generation || state[page] != WRITTEN))
            result = MISMATCH; /* keep scanning: an out-of-range entry later still means NOT_HANDLED */
    }
    return result;
}

static int do_owned_written(const int8_t *state, const int64_t *owner, const int64_t *gen, int64_t num_pages,
                            PyObject *pages, int64_t page_size, int64_t owner_id, int64_t generation) {
    pages_t p;
    if (open_pages(pages, &p) != 0) return NOT_HANDLED;
    int result = owned_written(state, owner, gen, num_pages, &p, 0, p.n, page_size, owner_id, generation);
    PyBuffer_Release(&p.view);
    return result;
}

/* The same over table[row, :length] of a C-contiguous 2-D int32/int64 table (numpy's slice: length clipped to
 * the row). A negative row or length is NOT_HANDLED (numpy's indexing rules apply on the caller's path). */
static int do_row_owned_written(const int8_t *state, const int64_t *owner, const int64_t *gen, int64_t num_pages,
                                PyObject *table, int64_t row, int64_t length, int64_t page_size, int64_t owner_id,
                                int64_t generation) {
    pages_t p;
    if (open_pages_nd(table, &p, 2) != 0) return NOT_HANDLED;
    int result = NOT_HANDLED;
    Py_ssize_t rows = p.view.shape[0], width = p.view.shape[1];
    if (row >= 0 && row < rows && length >= 0) {
        Py_ssize_t n = length < width ? (Py_ssize_t)length : width;
        result = owned_written(state, owner, gen, num_pages, &p, (Py_ssize_t)row * width, n, page_size, owner_id,
                               generation);
    }
    PyBuffer_Release(&p.view);
    return result;
}

/* ---- Python bindings: positional arguments, ints except the one page array */

static int parse(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, Py_ssize_t pages_at, int64_t *out,
                 PyObject **pages) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        if (i == pages_at) {
            *pages = args[i];
            out[i] = 0;
            continue;
        }
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}


/* reserve(state, owner, gen, num_pages, pages, initial, owner_id, generation) */
static PyObject *py_reserve(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[8];
    PyObject *pages = NULL;
    if (parse(args, nargs, 8, 4, a, &pages)) return NULL;
    return PyLong_FromLong(do_reserve(ADDR(a[0]), ADDR(a[1]), ADDR(a[2]), a[3], pages, a[5], a[6], a[7]));
}

/* move(state, owner, num_pages, pages, owner_id, before, goal) */
static PyObject *py_move(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[7];
    PyObject *pages = NULL;
    if (parse(args, nargs, 7, 3, a, &pages)) return NULL;
    return PyLong_FromLong(do_move(ADDR(a[0]), ADDR(a[1]), a[2], pages, a[4], a[5], a[6]));
}

/* release(state, owner, num_pages, pages, owner_id, writer_drained) */
static PyObject *py_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[6];
    PyObject *pages = NULL;
    if (parse(args, nargs, 6, 3, a, &pages)) return NULL;
    return PyLong_FromLong(do_release(ADDR(a[0]), ADDR(a[1]), a[2], pages, a[4], a[5]));
}

/* count_owned(owner, num_pages, pages, owner_id) */
static PyObject *py_count_owned(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[4];
    PyObject *pages = NULL;
    if (parse(args, nargs, 4, 2, a, &pages)) return NULL;
    return PyLong_FromLongLong(do_count_owned(ADDR(a[0]), a[1], pages, a[3]));
}

/* sole_owner(state, owner, num_pages, pages) */
static PyObject *py_sole_owner(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[4];
    PyObject *pages = NULL;
    if (parse(args, nargs, 4, 3, a, &pages)) return NULL;
    return PyLong_FromLongLong(do_sole_owner(ADDR(a[0]), ADDR(a[1]), a[2], pages));
}

/* release_unwritable(state, owner, num_pages, pages) */
static PyObject *py_release_unwritable(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[4];
    PyObject *pages = NULL;
    if (parse(args, nargs, 4, 3, a, &pages)) return NULL;
    return PyLong_FromLongLong(do_release_unwritable(ADDR(a[0]), ADDR(a[1]), a[2], pages));
}

/* release_unwritable_at(state, owner, num_pages, addr, n, wide) */
static PyObject *py_release_unwritable_at(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[6];
    if (parse(args, nargs, 6, -1, a, NULL)) return NULL;
    return PyLong_FromLongLong(do_release_unwritable_at(ADDR(a[0]), ADDR(a[1]), a[2], a[3], a[4], a[5]));
}

/* owned_written(state, owner, gen, num_pages, pages, page_size, owner_id, generation) */
static PyObject *py_owned_written(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[8];
    PyObject *pages = NULL;
    if (parse(args, nargs, 8, 4, a, &pages)) return NULL;
    return PyLong_FromLong(do_owned_written(ADDR(a[0]), ADDR(a[1]), ADDR(a[2]), a[3], pages, a[5], a[6], a[7]));
}

/* row_owned_written(state, owner, gen, num_pages, table, row, length, page_size, owner_id, generation) */
static PyObject *py_row_owned_written(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[10];
    PyObject *table = NULL;
    if (parse(args, nargs, 10, 4, a, &table)) return NULL;
    return PyLong_FromLong(
        do_row_owned_written(ADDR(a[0]), ADDR(a[1]), ADDR(a[2]), a[3], table, a[5], a[6], a[7], a[8], a[9]));
}

#define FN(name) {#name, (PyCFunction)(void (*)(void))py_##name, METH_FASTCALL, NULL}
static PyMethodDef methods[] = {FN(reserve), FN(move), FN(release), FN(count_owned), FN(sole_owner),
                                FN(release_unwritable), FN(release_unwritable_at), FN(owned_written),
                                FN(row_owned_written), {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "sglang_harden_ledger_native", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_sglang_harden_ledger_native(void) { return PyModule_Create(&module); }
