/* SPDX-License-Identifier: Apache-2.0 */
/*
 * dlpack_ipc._core: libdlpc's errors as Python exceptions (ipc_raise()). A negative errno picks
 * the exception, dlpc_last_error() gives its message, in Python's words.
 */
#include <errno.h>
#include <string.h>

#include "dlpack_ipc.h"

/* Is @p r libdlpc's word that the connection is gone (dlpackd closed it: stopped, restarted)? */
static bool conn_lost(int r)
{
	return r == -EPIPE || r == -ECONNRESET;
}

/*
 * libdlpc's (and dlpackd's) message @p msg in Python's words: the C spellings of what a Python
 * caller says otherwise are replaced by the Python ones. Decoded leniently (a message cut at
 * its length limit may end inside a character). A new reference, or NULL with an exception.
 */
static PyObject *python_text(const char *msg)
{
	static const char *const words[][2] = {
		{"publish with REPLACE", "publish with replace=True"},
		{"attach it as a bundle", "attach it with attach_dict()"},
		{"dlpc_alloc_bundle: ", "empty_dict(): "},
		{"dlpc_alloc: ", "empty(): "},
		{"(dlpc_close() or dlpc_cancel())", "(Client.close())"},
	};
	PyObject *text = PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg), "replace");

	for (size_t i = 0; text && i < sizeof(words) / sizeof(words[0]); i++) {
		PyObject *from, *to, *t;

		if (!strstr(msg, words[i][0]))
			continue;
		from = PyUnicode_FromString(words[i][0]);
		to = PyUnicode_FromString(words[i][1]);
		t = from && to ? PyUnicode_Replace(text, from, to, -1) : NULL;
		Py_XDECREF(from);
		Py_XDECREF(to);
		Py_DECREF(text);
		text = t;
	}
	return text;
}

PyObject *ipc_raise(int err)
{
	const char *msg = dlpc_last_error();
	PyObject *text, *args;

	/* libdlpc's interrupt check ran a signal handler that raised: that exception is the one
	 * to see, whatever the call then returned */
	if (PyErr_Occurred())
		return NULL;
	text = python_text(msg);
	if (!text)
		return NULL;
	if (conn_lost(err)) {
		/* One error whatever the timing: whether a write found the socket closed (EPIPE)
		 * or a read did (ECONNRESET) is a race, and means the same to the caller. (A
		 * watch's message says so already.) */
		args = Py_BuildValue(
			"(iN)", ECONNRESET,
			strstr(msg, "dlpackd closed the connection")
				? Py_NewRef(text)
				: PyUnicode_FromFormat("dlpackd closed the connection (%U)", text));
		if (args) {
			PyErr_SetObject(PyExc_OSError, args);
			Py_DECREF(args);
		}
		Py_DECREF(text);
		return NULL;
	}

	switch (err) {
	case -ENOMEM:
		Py_DECREF(text);
		return PyErr_NoMemory();
	case -EINVAL:
		PyErr_SetObject(PyExc_ValueError, text);
		Py_DECREF(text);
		return NULL;
	case -ENOTSUP:
		PyErr_SetObject(PyExc_BufferError, text);
		Py_DECREF(text);
		return NULL;
	}
	/* OSError(errno, text) picks the subclass: FileNotFoundError, TimeoutError, ... */
	args = Py_BuildValue("(iN)", -err, text);
	if (args) {
		PyErr_SetObject(PyExc_OSError, args);
		Py_DECREF(args);
	}
	return NULL;
}
