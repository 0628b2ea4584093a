/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Client.publish() and Client.publish_dict(): arguments, the tensors taken (take.c), the call
 * without the GIL, and errors that name the bundle's key.
 */
#include <stdlib.h>
#include <string.h>

#include "dlpack_ipc.h"

static uint32_t publish_flags(int replace, int ephemeral, int writable)
{
	return (replace ? DLPC_PUBLISH_REPLACE : 0) | (ephemeral ? DLPC_PUBLISH_EPHEMERAL : 0) |
	       (writable ? DLPC_PUBLISH_WRITABLE : 0);
}

/*
 * Say which entry @p name, and which tensor of it (@p key; NULL: the one tensor), the exception
 * set is about: the same type, the message prefixed with both (for the plain exception types a
 * producer raises; others stay as they are).
 */
static void name_key(const char *verb, const char *name, const char *key)
{
	static PyObject *const *const plain[] = {&PyExc_BufferError, &PyExc_TypeError,
						 &PyExc_ValueError, &PyExc_RuntimeError};
	PyObject *type, *value, *tb, *msg;

	PyErr_Fetch(&type, &value, &tb);
	for (size_t i = 0; i < sizeof(plain) / sizeof(plain[0]); i++) {
		if (type != *plain[i])
			continue;
		PyErr_NormalizeException(&type, &value, &tb);
		msg = key ? PyUnicode_FromFormat("cannot %s '%s': tensor '%s': %S", verb, name, key,
						 value)
			  : PyUnicode_FromFormat("cannot %s '%s': %S", verb, name, value);
		if (msg) {
			PyErr_SetObject(type, msg);
			Py_DECREF(msg);
			Py_XDECREF(type);
			Py_XDECREF(value);
			Py_XDECREF(tb);
			return;
		}
		PyErr_Clear();
		break;
	}
	PyErr_Restore(type, value, tb);
}

/*
 * Is @p obj a mapping (a state dict) rather than a tensor? A tensor has __dlpack__ (looked up
 * first: it is found at once, where a missing attribute costs an exception) and no items().
 */
static bool is_mapping(PyObject *obj)
{
	return PyDict_Check(obj) ||
	       (!PyObject_HasAttrString(obj, "__dlpack__") &&
		PyObject_HasAttrString(obj, "items") && PyObject_HasAttrString(obj, "keys"));
}

/*
 * Refuse a mapping given where one tensor goes, naming the call that takes it: publish() ->
 * publish_dict(), a channel's send() -> send_dict(). -1 with TypeError, else 0.
 */
static int refuse_mapping(const char *verb, const char *name, PyObject *obj)
{
	bool send = strcmp(verb, "publish") != 0;
	PyObject *tn;

	if (!is_mapping(obj))
		return 0;
	tn = PyType_GetQualName(Py_TYPE(obj));
	if (tn)
		PyErr_Format(PyExc_TypeError, "cannot %s '%s': %s takes one tensor, not %U; %s",
			     verb, name, send ? "send()" : "publish()", tn,
			     send ? "send_dict() sends a mapping of tensors as one message"
				  : "publish_dict() publishes a mapping of tensors as one bundle");
	Py_XDECREF(tn);
	return -1;
}

int ipc_take_call(ClientObject *self, const char *verb, const char *name, Py_ssize_t n,
		  PyObject *const *objs, const char *const *keys, ipc_tensors_fn fn, void *arg,
		  int *ret)
{
	struct ipc_taken **taken;
	DLManagedTensorVersioned **tensors;
	Py_ssize_t got = 0;
	dlpc_client *c;
	int r = 0;

	if (!keys && n == 1 && refuse_mapping(verb, name, objs[0]) < 0)
		return -1;
	c = ipc_call_begin(self);
	if (!c)
		return -1;
	taken = PyMem_Calloc((size_t)n + 1, sizeof(*taken));
	tensors = PyMem_Calloc((size_t)n + 1, sizeof(*tensors));
	if (!taken || !tensors) {
		PyMem_Free(taken);
		PyMem_Free(tensors);
		ipc_call_end(self, c, 0);
		PyErr_NoMemory();
		return -1;
	}
	for (; got < n; got++) {
		taken[got] = ipc_take(objs[got]);
		if (!taken[got]) {
			name_key(verb, name, keys ? keys[got] : NULL);
			break;
		}
	}
	if (got == n) {
		/* only now does libdlpc own them: a failed take above leaves every one to
		 * ipc_taken_finish() */
		for (Py_ssize_t i = 0; i < n; i++)
			tensors[i] = ipc_taken_tensor(taken[i]);
		Py_BEGIN_ALLOW_THREADS
		r = fn(c, name, (size_t)n, keys, tensors, arg);
		Py_END_ALLOW_THREADS
	}
	/* the producers' deleters, with the GIL, whatever happened */
	for (Py_ssize_t i = 0; i < got; i++)
		ipc_taken_finish(taken[i]);
	PyMem_Free(taken);
	PyMem_Free(tensors);
	ipc_call_end(self, c, r);
	if (got < n)
		return -1;
	*ret = r;
	return 0;
}

static int publish_fn(dlpc_client *c, const char *name, size_t n, const char *const *keys,
		      DLManagedTensorVersioned *const *tensors, void *arg)
{
	uint32_t flags = *(const uint32_t *)arg;

	return keys ? dlpc_publish_bundle(c, name, n, keys, tensors, flags)
		    : dlpc_publish(c, name, tensors[0], flags);
}

const char *ipc_bundle_key(const char *verb, const char *name, PyObject *k)
{
	const char *key;
	Py_ssize_t len;

	if (!PyUnicode_Check(k)) {
		PyObject *tn = PyType_GetQualName(Py_TYPE(k));

		if (tn)
			PyErr_Format(PyExc_TypeError,
				     "cannot %s '%s': keys must be str, not %U (key %R)", verb,
				     name, tn, k);
		Py_XDECREF(tn);
		return NULL;
	}
	key = PyUnicode_AsUTF8AndSize(k, &len);
	if (!key)
		return NULL;
	/* libdlpc sees a C string: a NUL inside would cut the key short without a word */
	if (strlen(key) != (size_t)len || len > DLPC_KEY_MAX) {
		PyErr_Format(PyExc_ValueError,
			     "cannot %s '%s': key %.60R %s (keys are at most %d bytes of UTF-8)",
			     verb, name, k, len > DLPC_KEY_MAX ? "is too long" : "contains NUL",
			     DLPC_KEY_MAX);
		return NULL;
	}
	return key;
}

/* Publish @p n objects, with @p keys (NULL: a single tensor). Returns the generation. */
static PyObject *publish_objects(ClientObject *self, const char *name, Py_ssize_t n,
				 PyObject *const *objs, const char *const *keys, uint32_t flags)
{
	int r;

	if (ipc_take_call(self, "publish", name, n, objs, keys, publish_fn, &flags, &r) < 0)
		return NULL;
	if (r < 0)
		return ipc_raise(r);
	return PyLong_FromLong(r);
}

PyObject *ipc_client_publish(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	static char *kwlist[] = {"name", "obj", "replace", "ephemeral", "writable", NULL};
	int replace = 0, ephemeral = 0, writable = 0;
	const char *name;
	PyObject *tensor;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sO|$ppp:publish", kwlist, &name, &tensor,
					 &replace, &ephemeral, &writable))
		return NULL;
	return publish_objects((ClientObject *)obj, name, 1, &tensor, NULL,
			       publish_flags(replace, ephemeral, writable));
}

/*
 * A list of this call's own of (key, value) tuples from what a mapping's items() gave (stolen):
 * that list may be the mapping's own, which a value's __dlpack__ may change under the call,
 * and its items any sequences (two items each, or TypeError).
 */
static PyObject *own_pairs(const char *verb, const char *name, PyObject *items)
{
	PyObject *copy = PySequence_List(items), *out = NULL;
	Py_ssize_t n;

	Py_DECREF(items);
	if (!copy)
		return NULL;
	n = PyList_Size(copy);
	out = PyList_New(n);
	for (Py_ssize_t i = 0; out && i < n; i++) {
		PyObject *kv = PyList_GetItem(copy, i), *pair;

		pair = PySequence_Check(kv) && !PyUnicode_Check(kv) ? PySequence_Tuple(kv) : NULL;
		if (pair && PyTuple_Size(pair) == 2) {
			PyList_SetItem(out, i, pair);
			continue;
		}
		if (pair || !PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
			PyErr_Clear();
			PyErr_Format(
				PyExc_TypeError,
				"cannot %s '%s': the mapping's items() must give (key, tensor) "
				"pairs, not %.60R",
				verb, name, kv);
		}
		Py_XDECREF(pair);
		Py_CLEAR(out);
	}
	Py_DECREF(copy);
	return out;
}

PyObject *ipc_mapping_items(const char *verb, const char *name, PyObject *mapping)
{
	bool send = strcmp(verb, "publish") != 0;
	PyObject *items = PyMapping_Check(mapping) ? PyMapping_Items(mapping) : NULL, *tn;

	if (items)
		return own_pairs(verb, name, items);
	tn = PyType_GetQualName(Py_TYPE(mapping));
	/* a non-mapping lacks items(): say what is wanted, not that an attribute is missing */
	if (tn && (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_AttributeError))) {
		PyErr_Clear();
		PyErr_Format(PyExc_TypeError,
			     "cannot %s '%s': %s takes a mapping of str keys to tensors, not %U%s",
			     verb, name, send ? "send_dict()" : "publish_dict()", tn,
			     !PyObject_HasAttrString(mapping, "__dlpack__") ? ""
			     : send ? " (send() sends one tensor)"
				    : " (publish() publishes one tensor)");
	}
	Py_XDECREF(tn);
	return NULL;
}

int ipc_bundle_split(const char *verb, const char *name, PyObject *items, const char ***keys,
		     PyObject ***objs)
{
	Py_ssize_t n = PyList_Size(items);

	*keys = PyMem_Calloc((size_t)n, sizeof(**keys));
	*objs = PyMem_Calloc((size_t)n, sizeof(**objs));
	if (!*keys || !*objs) {
		PyErr_NoMemory();
		return -1;
	}
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *kv = PyList_GetItem(items, i);

		/* valid while items holds the key */
		(*keys)[i] = ipc_bundle_key(verb, name, PyTuple_GetItem(kv, 0));
		if (!(*keys)[i])
			return -1;
		(*objs)[i] = PyTuple_GetItem(kv, 1);
	}
	/* one tensor travels as the bundle of one tensor under the key "": such a mapping would
	 * come back as a single tensor, not as the dict it was */
	if (n == 1 && !(*keys)[0][0]) {
		PyErr_Format(PyExc_ValueError,
			     "cannot %s '%s': a mapping whose only key is '' would come back as "
			     "one tensor, not a dict: give the tensor a key, or pass it alone",
			     verb, name);
		return -1;
	}
	return 0;
}

PyObject *ipc_client_publish_dict(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	static char *kwlist[] = {"name", "mapping", "replace", "ephemeral", "writable", NULL};
	int replace = 0, ephemeral = 0, writable = 0;
	const char *name, **keys = NULL;
	PyObject *mapping, *items, **objs = NULL, *r = NULL;
	Py_ssize_t n;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sO|$ppp:publish_dict", kwlist, &name,
					 &mapping, &replace, &ephemeral, &writable))
		return NULL;
	items = ipc_mapping_items("publish", name, mapping);
	if (!items)
		return NULL;
	n = PyList_Size(items);
	if (n == 0)
		PyErr_SetString(PyExc_ValueError, "cannot publish an empty mapping");
	else if (ipc_bundle_split("publish", name, items, &keys, &objs) == 0)
		r = publish_objects((ClientObject *)obj, name, n, objs, keys,
				    publish_flags(replace, ephemeral, writable));
	PyMem_Free(keys);
	PyMem_Free(objs);
	Py_DECREF(items);
	return r;
}
