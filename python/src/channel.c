/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Channels (protocol 1.6) for dlpack_ipc.Channel (__init__.py): Client._channel_open(),
 * _channel_close(), _channel_remove(), _channel_stat(), _send(), _recv() (_channel_list() is in
 * info.c). The end of a stream (libdlpc's -EPIPE, 1.10) is EOFError from _recv() (Channel makes
 * it ChannelClosed) and BrokenPipeError from _send(): never the ConnectionResetError of a lost
 * connection. Waits run in one libdlpc call with Ctrl-C checked by libdlpc's interrupt hook
 * (ipc_interruptible()): a send cannot be cut into slices, since a send that timed out has given
 * its tensor away.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dlpack_ipc.h"

/* The attach modes a received message may be mapped with (see attach.c's). */
static const struct {
	const char *name;
	uint32_t flags;
} modes[] = {
	{"read", DLPC_ATTACH_GUARDED},
	{"private", DLPC_ATTACH_PRIVATE},
	{"strict", 0},
};

/* timeout= in seconds as libdlpc's milliseconds: None or inf -> -1 (no end), 0 -> 0. */
static int timeout_ms(PyObject *o, int64_t *ms)
{
	double s;

	*ms = -1;
	if (o == Py_None)
		return 0;
	s = PyFloat_AsDouble(o);
	if (s == -1 && PyErr_Occurred())
		return -1;
	if (isnan(s) || s < 0) {
		PyErr_Format(PyExc_ValueError, "timeout must be None or >= 0, not %R", o);
		return -1;
	}
	if (isinf(s) || s > 1e12)
		return 0;
	*ms = (int64_t)ceil(s * 1000);
	return 0;
}

/* The end of a stream: @p type (EOFError, or BrokenPipeError with errno EPIPE) with libdlpc's
 * message. NULL. */
static PyObject *raise_ended(PyObject *type)
{
	PyObject *a;

	if (PyErr_Occurred())
		return NULL;
	a = type == PyExc_EOFError ? Py_BuildValue("(s)", dlpc_last_error())
				   : Py_BuildValue("(is)", EPIPE, dlpc_last_error());
	if (a) {
		PyErr_SetObject(type, a);
		Py_DECREF(a);
	}
	return NULL;
}

/* The count @p o (an integer: 0 to @p max) as @p what of channel @p name; -1 with an exception
 * that gives the value as it was passed (never reduced modulo anything). */
static int channel_count(PyObject *o, const char *what, const char *name, long long max,
			 uint32_t *out)
{
	PyObject *i = PyNumber_Index(o);
	long long v;
	int over;

	if (!i)
		return -1;
	v = PyLong_AsLongLongAndOverflow(i, &over);
	if (v == -1 && PyErr_Occurred()) {
		Py_DECREF(i);
		return -1;
	}
	if (over || v < 0 || v > max) {
		PyErr_Format(PyExc_ValueError, "cannot open channel '%s': %s %S %s %lld", name,
			     what, i,
			     over < 0 || (!over && v < 0) ? "is below" : "exceeds the limit of",
			     over < 0 || (!over && v < 0) ? 0LL : max);
		Py_DECREF(i);
		return -1;
	}
	Py_DECREF(i);
	*out = (uint32_t)v;
	return 0;
}

PyObject *ipc_client_channel_open(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	static char *kwlist[] = {"name", "capacity", "direct", "producers", NULL};
	dlpc_channel_info info = {.size = sizeof(info)};
	dlpc_channel_opts o = {.size = sizeof(o)};
	PyObject *d, *direct = Py_None, *capacity = NULL, *producers = NULL;
	const char *name;
	int r;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|OOO:_channel_open", kwlist, &name,
					 &capacity, &direct, &producers))
		return NULL;
	if ((capacity && channel_count(capacity, "capacity", name, DLPC_CHANNEL_CAPACITY_MAX,
				       &o.capacity) < 0) ||
	    (producers && channel_count(producers, "producers", name, DLPC_CHANNEL_PRODUCERS_MAX,
					&o.producers) < 0))
		return NULL;
	/* None: the kind it has, or where new the one DLPC_CHANNEL_PREFER_DIRECT picks;
	 * True or False: that kind, or FileExistsError */
	o.flags = DLPC_CHANNEL_PREFER_DIRECT;
	if (direct != Py_None) {
		r = PyObject_IsTrue(direct);
		if (r < 0)
			return NULL;
		o.flags = r ? DLPC_CHANNEL_DIRECT : DLPC_CHANNEL_QUEUED;
	}
	IPC_CALL((ClientObject *)obj, c, r, dlpc_channel_open_opts(c, name, &o, &info));
	if (r < 0)
		return ipc_raise(r);
	d = ipc_channel_dict(&info);
	if (d && PyDict_SetItemString(d, "created", r == 1 ? Py_True : Py_False) < 0)
		Py_CLEAR(d);
	return d;
}

PyObject *ipc_client_channel_remove(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	static char *kwlist[] = {"name", NULL};
	const char *name;
	int r;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s:_channel_remove", kwlist, &name))
		return NULL;
	IPC_CALL((ClientObject *)obj, c, r, dlpc_channel_remove(c, name));
	if (r < 0)
		return ipc_raise(r);
	Py_RETURN_NONE;
}

PyObject *ipc_client_channel_close(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	static char *kwlist[] = {"name", "all", NULL};
	const char *name;
	int all = 0, r;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|p:_channel_close", kwlist, &name, &all))
		return NULL;
	IPC_CALL((ClientObject *)obj, c, r,
		 dlpc_channel_close_flags(c, name, all ? DLPC_CHANNEL_CLOSE_ALL : 0));
	if (r < 0)
		return ipc_raise(r);
	Py_RETURN_NONE;
}

PyObject *ipc_client_channel_stat(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	static char *kwlist[] = {"name", NULL};
	dlpc_channel_info info = {.size = sizeof(info)};
	const char *name;
	int r;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s:_channel_stat", kwlist, &name))
		return NULL;
	IPC_CALL((ClientObject *)obj, c, r, dlpc_channel_stat(c, name, &info));
	if (r < 0)
		return ipc_raise(r);
	return ipc_channel_dict(&info);
}

static int send_fn(dlpc_client *c, const char *name, size_t n, const char *const *keys,
		   DLManagedTensorVersioned *const *tensors, void *arg)
{
	return dlpc_send_bundle(c, name, n, keys, tensors, arg);
}

/*
 * _send(name, obj, timeout=None) and _send_dict(name, mapping, timeout=None): @p n objects
 * (keys NULL: one tensor) taken as publish() takes them, sent as one message.
 */
static PyObject *send_objects(ClientObject *self, const char *name, Py_ssize_t n,
			      PyObject *const *objs, const char *const *keys, int64_t ms)
{
	dlpc_send_opts o = {
		.size = sizeof(o), .timeout_ms = ms, .flags = ms == 0 ? DLPC_SEND_NOWAIT : 0};
	int r;

	if (ipc_take_call(self, "send to channel", name, n, objs, keys, send_fn, &o, &r) < 0)
		return NULL;
	if (r == -EPIPE)
		return raise_ended(PyExc_BrokenPipeError);
	if (r < 0)
		return ipc_raise(r);
	Py_RETURN_NONE;
}

PyObject *ipc_client_send(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	static char *kwlist[] = {"name", "obj", "timeout", NULL};
	PyObject *o, *timeout = Py_None;
	const char *name;
	int64_t ms;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sO|$O:send", kwlist, &name, &o, &timeout) ||
	    timeout_ms(timeout, &ms) < 0)
		return NULL;
	return send_objects((ClientObject *)obj, name, 1, &o, NULL, ms);
}

PyObject *ipc_client_send_dict(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	static char *kwlist[] = {"name", "mapping", "timeout", NULL};
	PyObject *mapping, *items, *timeout = Py_None, **objs = NULL, *res = NULL;
	const char *name, **keys = NULL;
	Py_ssize_t n;
	int64_t ms;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sO|$O:send_dict", kwlist, &name, &mapping,
					 &timeout) ||
	    timeout_ms(timeout, &ms) < 0)
		return NULL;
	items = ipc_mapping_items("send to channel", name, mapping);
	if (!items)
		return NULL;
	n = PyList_Size(items);
	if (n == 0 || n > DLPC_BUNDLE_MAX)
		PyErr_Format(PyExc_ValueError,
			     "cannot send to channel '%s': %zd tensors; a message holds 1 to %d",
			     name, n, DLPC_BUNDLE_MAX);
	else if (ipc_bundle_split("send to channel", name, items, &keys, &objs) == 0)
		res = send_objects((ClientObject *)obj, name, n, objs, keys, ms);
	PyMem_Free(objs);
	PyMem_Free(keys);
	Py_DECREF(items);
	return res;
}

/* Wrap a received tensor as a SharedTensor named after its channel. */
static PyObject *wrap(ipc_state *st, DLManagedTensorVersioned *t, PyObject *name, PyObject *key,
		      const char *mode)
{
	dlpc_attach_info info = {.size = sizeof(info)};
	TensorObject *self;
	int gen = 0;

	if (dlpc_tensor_attach_info(t, &info) == 0)
		gen = (int)(info.generation > INT32_MAX ? INT32_MAX : info.generation);
	self = (TensorObject *)ipc_tensor_new(st, t, name, key, gen, false);
	if (!self)
		return NULL;
	self->mode = mode;
	self->has_owner = true;
	self->owner_uid = info.owner_uid;
	self->owner_pid = info.owner_pid;
	return (PyObject *)self;
}

/* _recv(name, timeout=None, mode=None, bundle=False): a SharedTensor, or a dict by key. */
PyObject *ipc_client_recv(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	static char *kwlist[] = {"name", "timeout", "mode", "bundle", NULL};
	ipc_state *st = ipc_state_of_type(Py_TYPE(obj));
	dlpc_recv_opts o = {.size = sizeof(o)};
	PyObject *timeout = Py_None, *pname, *res = NULL;
	const char *name, *mode = "read";
	int bundle = 0, r;
	dlpc_bundle *b = NULL;
	size_t i;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|$Ozp:recv", kwlist, &name, &timeout,
					 &mode, &bundle) ||
	    timeout_ms(timeout, &o.timeout_ms) < 0)
		return NULL;
	mode = mode ? mode : "read";
	for (i = 0; i < sizeof(modes) / sizeof(modes[0]); i++)
		if (strcmp(mode, modes[i].name) == 0)
			break;
	if (i == sizeof(modes) / sizeof(modes[0]))
		return PyErr_Format(PyExc_ValueError,
				    "mode must be \"read\", \"private\" or \"strict\", not '%s'",
				    mode);
	o.flags = modes[i].flags;
	mode = modes[i].name;
	IPC_CALL((ClientObject *)obj, c, r, dlpc_recv_bundle(c, name, &o, &b));
	if (r == -EPIPE)
		return raise_ended(PyExc_EOFError);
	if (r < 0)
		return ipc_raise(r);
	pname = PyUnicode_FromString(name);
	if (!bundle && pname) {
		if (dlpc_bundle_count(b) != 1 || dlpc_bundle_key(b, 0)[0]) {
			/* a bundle where one tensor was expected: the caller gets it as a dict */
			bundle = 1;
		} else {
			PyObject *key = PyUnicode_FromString("");

			res = key ? wrap(st, dlpc_bundle_take(b, 0), pname, key, mode) : NULL;
			Py_XDECREF(key);
		}
	}
	if (bundle && pname) {
		res = PyDict_New();
		for (i = 0; res && i < dlpc_bundle_count(b); i++) {
			PyObject *key = PyUnicode_FromString(dlpc_bundle_key(b, i));
			PyObject *t =
				key ? wrap(st, dlpc_bundle_take(b, i), pname, key, mode) : NULL;

			if (!t || PyDict_SetItem(res, key, t) < 0)
				Py_CLEAR(res);
			Py_XDECREF(key);
			Py_XDECREF(t);
		}
	}
	dlpc_bundle_free(b);
	Py_XDECREF(pname);
	return res;
}

/* _channel_empty(name, shape, dtype): recycled writable memory from the connection's pool. */
PyObject *ipc_client_channel_empty(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	static char *kwlist[] = {"name", "shape", "dtype", NULL};
	ipc_state *st = ipc_state_of_type(Py_TYPE(obj));
	PyObject *shape_o, *dtype_o, *key, *res;
	int64_t shape[DLPC_NDIM_MAX];
	DLManagedTensorVersioned *t;
	const char *name;
	DLDataType dt;
	int ndim, r;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sOO:_channel_empty", kwlist, &name,
					 &shape_o, &dtype_o) ||
	    ipc_dtype_parse(dtype_o, &dt) < 0 || (ndim = ipc_parse_shape(shape_o, shape)) < 0)
		return NULL;
	IPC_CALL((ClientObject *)obj, c, r,
		 dlpc_channel_alloc(c, name, dt, (int32_t)ndim, shape, &t));
	if (r < 0)
		return ipc_raise(r);
	key = PyUnicode_FromString("");
	if (!key) {
		t->deleter(t);
		return NULL;
	}
	res = ipc_tensor_new(st, t, Py_None, key, 0, true);
	Py_DECREF(key);
	return res;
}
