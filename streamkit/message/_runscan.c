/* The Sequencer's bulk path in C: how far a run of envelopes goes on committing alone.
 *
 * `scan(envelopes, start, stop, journal, producer, last_clock)` walks
 * envelopes[start:stop] while each one is what `Sequencer.commit_run` commits
 * without a decision of its own: a dict message whose "uuid" is a canonical
 * 36-character UUID string with OUTSIDE_TXN flags, of `producer`, in
 * `journal` (the same str object), with a Clock above the one before. It
 * returns (the index it stopped at, the last Clock), and never decides
 * anything else: the envelope it stops at goes through the Python loop,
 * which handles it exactly as before (another producer or journal, a
 * duplicate, other flags, a UUID int() reads but this does not). So this
 * module only makes the common case cheaper; sequencer.py runs without it.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *str_message, *str_journal, *str_uuid;

/* 0-15 for a hex digit, -1 otherwise. */
static inline int hex_value(Py_UCS1 c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* The two 64-bit halves of a canonical "8-4-4-4-12" UUID string; 0 if it is not one. */
static int parse_uuid(PyObject *raw, uint64_t *hi, uint64_t *lo) {
    if (!PyUnicode_CheckExact(raw) || !PyUnicode_IS_COMPACT_ASCII(raw)
            || PyUnicode_GET_LENGTH(raw) != 36) {
        return 0;
    }
    const Py_UCS1 *text = PyUnicode_1BYTE_DATA(raw);
    uint64_t halves[2] = {0, 0};
    int digits = 0;
    for (int i = 0; i < 36; i++) {
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (text[i] != '-') return 0;
            continue;
        }
        int v = hex_value(text[i]);
        if (v < 0) return 0;
        halves[digits / 16] = (halves[digits / 16] << 4) | (uint64_t)v;
        digits++;
    }
    *hi = halves[0];
    *lo = halves[1];
    return 1;
}

/* A missing attribute or key ends the stretch (the Python loop then meets it itself);
 * any other error (a MemoryError, a KeyboardInterrupt in a property) is raised. */
static int absent(void) {
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

/* 1 if `env` continues the stretch (its Clock then in *last_clock), 0 if not, -1 on error. */
static int step(PyObject *env, PyObject *journal, uint64_t producer, uint64_t *last_clock) {
    PyObject *message = PyObject_GetAttr(env, str_message);
    if (message == NULL) return absent();
    if (!PyDict_CheckExact(message)) {
        Py_DECREF(message);
        return 0;
    }
    PyObject *raw = PyDict_GetItemWithError(message, str_uuid);  /* borrowed */
    uint64_t hi = 0, lo = 0;
    int ok = raw != NULL && parse_uuid(raw, &hi, &lo);
    Py_DECREF(message);  /* (raw is not used after this) */
    if (raw == NULL && PyErr_Occurred()) return -1;
    if (!ok) return 0;
    /* Flags: the low 10 bits of the clock sequence (OUTSIDE_TXN is 0). */
    if (((lo >> 48) & 0x3FF) != 0 || (lo & 0xFFFFFFFFFFFFULL) != producer) return 0;
    PyObject *env_journal = PyObject_GetAttr(env, str_journal);
    if (env_journal == NULL) return absent();
    int same_journal = env_journal == journal;  /* only its identity counts */
    Py_DECREF(env_journal);
    if (!same_journal) return 0;
    /* The 60-bit timestamp (time_hi, time_mid, time_low) and the 4-bit sequence. */
    uint64_t clock = ((hi >> 32) | (hi & 0xFFFF0000ULL) << 16 | (hi & 0x0FFFULL) << 48) << 4
                     | ((lo >> 58) & 0xF);
    if (clock <= *last_clock) return 0;
    *last_clock = clock;
    return 1;
}

static PyObject *scan(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "scan(envelopes, start, stop, journal, producer, last_clock)");
        return NULL;
    }
    PyObject *envelopes = args[0], *journal = args[3];
    Py_ssize_t start = PyNumber_AsSsize_t(args[1], NULL);
    if (start == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t stop = PyNumber_AsSsize_t(args[2], NULL);  /* clamped; the list bounds it */
    if (stop == -1 && PyErr_Occurred()) return NULL;
    uint64_t producer = PyLong_AsUnsignedLongLong(args[4]), last_clock = 0;
    if (!PyErr_Occurred()) last_clock = PyLong_AsUnsignedLongLong(args[5]);
    if (PyErr_Occurred() || !PyList_CheckExact(envelopes) || start < 0) {
        /* Not a Clock's range, not a list, a negative index: all left to the Python loop. */
        PyErr_Clear();
        return Py_BuildValue("(nO)", start, args[5]);
    }
    Py_ssize_t index = start;
    /* The size is checked and the envelope held each time round: attribute lookups
     * could run Python code (a property) that changes the list. */
    for (; index < stop && index < PyList_GET_SIZE(envelopes); index++) {
        PyObject *env = PyList_GET_ITEM(envelopes, index);
        Py_INCREF(env);
        int go_on = step(env, journal, producer, &last_clock);
        Py_DECREF(env);
        if (go_on < 0) return NULL;
        if (!go_on) break;
    }
    return Py_BuildValue("(nK)", index, (unsigned long long)last_clock);
}

static PyMethodDef methods[] = {
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL,
     "scan(envelopes, start, stop, journal, producer, last_clock) -> (index, last_clock)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_runscan", "The Sequencer's bulk path in C (optional).", -1, methods,
};

PyMODINIT_FUNC PyInit__runscan(void) {
    str_message = PyUnicode_InternFromString("message");
    str_journal = PyUnicode_InternFromString("journal");
    str_uuid = PyUnicode_InternFromString("uuid");
    if (str_message == NULL || str_journal == NULL || str_uuid == NULL) {
        Py_XDECREF(str_message);
        Py_XDECREF(str_journal);
        Py_XDECREF(str_uuid);
        return NULL;
    }
    return PyModule_Create(&module_def);
}
