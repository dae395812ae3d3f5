/* Decoding JSON lines into Envelopes in C: the per-line loop of JsonLinesDecoder.
 *
 * `decode_dicts(lines, start, begin, journal, out, loads, envelope_type)` walks
 * lines[start:], appending Envelope(journal, begin, end, loads(line)) to `out`
 * for each line that `loads` reads as a JSON object, where end = begin +
 * len(line) + 1 (the newline). It returns (the index it stopped at, that
 * line's begin) and stops at the first line that is anything else (invalid
 * JSON, an array, a number): that line goes through the Python loop, which
 * reports it exactly as before, and the caller resumes here after it. So this
 * module only makes the common case cheaper; json_lines.py runs without it.
 *
 * The Envelope is made without calling its __init__: the dataclass's slots
 * are set directly, which is what its generated __init__ does, for about a
 * tenth of the cost. `envelope_type` must be such a class (four object
 * slots, checked on every call); anything else is a TypeError.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

enum { JOURNAL, BEGIN, END, MESSAGE, FIELDS };
static const char *const field_names[FIELDS] = {"journal", "begin", "end", "message"};
static PyObject *field_strs[FIELDS];

/* The byte offsets of the four slots in an instance of `type`; 0 on success. */
static int slot_offsets(PyTypeObject *type, Py_ssize_t offsets[FIELDS]) {
    /* A heap type: static builtin types have no tp_dict of their own on 3.12+. */
    if (!PyType_HasFeature(type, Py_TPFLAGS_HEAPTYPE) || type->tp_dict == NULL
            || type->tp_dictoffset != 0 || type->tp_itemsize != 0) goto wrong;
    for (int i = 0; i < FIELDS; i++) {
        PyObject *descr = PyDict_GetItemWithError(type->tp_dict, field_strs[i]);  /* borrowed */
        if (descr == NULL) {
            if (PyErr_Occurred()) return -1;
            goto wrong;
        }
        /* The type's own slot (not a descriptor taken from another class). */
        if (Py_TYPE(descr) != &PyMemberDescr_Type || PyDescr_TYPE(descr) != type) goto wrong;
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type != T_OBJECT_EX || (member->flags & READONLY)
                || member->offset < (Py_ssize_t)sizeof(PyObject)
                || member->offset + (Py_ssize_t)sizeof(PyObject *) > type->tp_basicsize) {
            goto wrong;
        }
        for (int j = 0; j < i; j++) {
            if (offsets[j] == member->offset) goto wrong;  /* two names, one slot */
        }
        offsets[i] = member->offset;
    }
    return 0;
wrong:
    PyErr_Format(PyExc_TypeError, "decode_dicts: %.200s is not a slotted "
                 "(journal, begin, end, message) class", type->tp_name);
    return -1;
}

/* A new instance of `type` holding the four values (new references stolen). */
static PyObject *envelope(PyTypeObject *type, const Py_ssize_t offsets[FIELDS],
                          PyObject *values[FIELDS]) {
    PyObject *env = type->tp_alloc(type, 0);
    if (env == NULL) {
        for (int i = 0; i < FIELDS; i++) Py_DECREF(values[i]);
        return NULL;
    }
    for (int i = 0; i < FIELDS; i++) {
        *(PyObject **)((char *)env + offsets[i]) = values[i];
    }
    return env;
}

static PyObject *decode_dicts(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "decode_dicts(lines, start, begin, journal, out, loads, envelope_type)");
        return NULL;
    }
    PyObject *lines = args[0], *journal = args[3], *out = args[4], *loads = args[5];
    if (!PyList_CheckExact(lines) || !PyList_CheckExact(out)) {
        PyErr_SetString(PyExc_TypeError, "decode_dicts: lines and out must be lists");
        return NULL;
    }
    if (!PyType_Check(args[6])) {
        PyErr_SetString(PyExc_TypeError, "decode_dicts: envelope_type must be a class");
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)args[6];
    Py_ssize_t offsets[FIELDS];
    if (slot_offsets(type, offsets) < 0) return NULL;
    Py_ssize_t index = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (index == -1 && PyErr_Occurred()) return NULL;
    if (index < 0) {
        PyErr_SetString(PyExc_ValueError, "decode_dicts: start must not be negative");
        return NULL;
    }
    /* An offset that is not an int, or beyond a long long, is left to the Python loop. */
    long long begin = PyLong_Check(args[2]) ? PyLong_AsLongLong(args[2]) : -1;
    if (begin < 0) {
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_OverflowError)) return NULL;
        PyErr_Clear();
        return Py_BuildValue("(nO)", index, args[2]);
    }
    /* Each line's begin is the line before's end: one int per line, as in Python. */
    PyObject *begin_obj = Py_NewRef(args[2]);
    /* The size is checked and the line held each time round: `loads` is any callable. */
    for (; index < PyList_GET_SIZE(lines); index++) {
        PyObject *line = PyList_GET_ITEM(lines, index);
        if (!PyBytes_CheckExact(line)) {
            PyErr_SetString(PyExc_TypeError, "decode_dicts: lines must be bytes");
            goto error;
        }
        if (begin > LLONG_MAX - 1 - PyBytes_GET_SIZE(line)) break;  /* end would overflow */
        Py_INCREF(line);
        long long end = begin + PyBytes_GET_SIZE(line) + 1;
        PyObject *message = PyObject_Vectorcall(loads, &line, 1, NULL);
        Py_DECREF(line);
        if (message == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_ValueError)) goto error;
            PyErr_Clear();  /* invalid JSON: the Python loop parses it again and reports it */
            break;
        }
        if (!PyDict_CheckExact(message)) {
            Py_DECREF(message);
            break;
        }
        PyObject *end_obj = PyLong_FromLongLong(end);
        if (end_obj == NULL) {
            Py_DECREF(message);
            goto error;
        }
        PyObject *values[FIELDS] = {Py_NewRef(journal), begin_obj, Py_NewRef(end_obj), message};
        PyObject *env = envelope(type, offsets, values);
        begin_obj = end_obj;  /* values held the old begin; end_obj's second reference is ours */
        if (env == NULL) goto error;
        int failed = PyList_Append(out, env);
        Py_DECREF(env);
        if (failed) goto error;
        begin = end;
    }
    PyObject *result = Py_BuildValue("(nO)", index, begin_obj);
    Py_DECREF(begin_obj);
    return result;
error:
    Py_DECREF(begin_obj);
    return NULL;
}

static PyMethodDef methods[] = {
    {"decode_dicts", (PyCFunction)(void (*)(void))decode_dicts, METH_FASTCALL,
     "decode_dicts(lines, start, begin, journal, out, loads, envelope_type) -> (index, begin)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_lines", "JSON lines into Envelopes in C (optional).", -1, methods,
};

PyMODINIT_FUNC PyInit__lines(void) {
    for (int i = 0; i < FIELDS; i++) {
        field_strs[i] = PyUnicode_InternFromString(field_names[i]);
        if (field_strs[i] == NULL) {
            while (i-- > 0) Py_CLEAR(field_strs[i]);
            return NULL;
        }
    }
    return PyModule_Create(&module_def);
}
