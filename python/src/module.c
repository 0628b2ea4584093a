/* SPDX-License-Identifier: Apache-2.0 */
/*
 * dlpack_ipc._core: the Client type over libdlpc and module setup (multi-phase init, heap types
 * in module state). Every call that may block releases the GIL (IPC_CALL()). The connection
 * under a Client, and connecting anew, are in client.c; attaching is in attach.c.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "dlpack_ipc.h"

static int client_init(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	static char *kwlist[] = {"socket", "reconnect", NULL};
	ClientObject *self = (ClientObject *)obj;
	PyObject *sock = Py_None, *bytes = NULL;
	int reconnect = 0;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O$p:Client", kwlist, &sock, &reconnect))
		return -1;
	if (self->c) {
		PyErr_SetString(PyExc_RuntimeError,
				"this Client is connected already: close() it before connecting it "
				"anew");
		return -1;
	}
	self->reconnect = reconnect;
	/* a closed Client connected anew goes where this call says, the default socket too */
	free(self->path);
	self->path = NULL;
	if (sock != Py_None) {
		if (!PyUnicode_FSConverter(sock, &bytes))
			return -1;
		self->path = strdup(PyBytes_AsString(bytes));
		Py_DECREF(bytes);
		if (!self->path) {
			PyErr_NoMemory();
			return -1;
		}
	}
	return ipc_client_connect(self);
}

static void client_dealloc(PyObject *obj)
{
	ClientObject *self = (ClientObject *)obj;
	PyTypeObject *tp = Py_TYPE(obj);

	ipc_client_release(self);
	free(self->path);
	((freefunc)PyType_GetSlot(tp, Py_tp_free))(obj);
	Py_DECREF(tp);
}

static PyObject *client_close(PyObject *obj, PyObject *unused)
{
	(void)unused;
	ipc_client_close((ClientObject *)obj);
	Py_RETURN_NONE;
}

/* "cpu", "cuda" or "cuda:N" as a DLDevice. 0, or -1 with ValueError. */
static int parse_device(const char *device, DLDevice *dev)
{
	*dev = (DLDevice){kDLCPU, 0};
	if (strncmp(device, "cuda", 4) == 0) {
		char *end = NULL;
		long id = device[4] == ':' ? strtol(device + 5, &end, 10) : 0;

		if ((device[4] && device[4] != ':') || (end && (*end || end == device + 5)) ||
		    id < 0 || id > INT32_MAX) {
			PyErr_Format(PyExc_ValueError, "device '%s' is not \"cuda\" or \"cuda:N\"",
				     device);
			return -1;
		}
		*dev = (DLDevice){kDLCUDA, (int32_t)id};
	} else if (strcmp(device, "cpu") != 0) {
		PyErr_Format(PyExc_ValueError,
			     "device '%s' is not supported (\"cpu\", \"cuda\" or \"cuda:N\")",
			     device);
		return -1;
	}
	return 0;
}

static PyObject *client_empty(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	static char *kwlist[] = {"shape", "dtype", "device", NULL};
	ipc_state *st = ipc_state_of_type(Py_TYPE(obj));
	PyObject *shape_o, *dtype_o, *key, *res;
	const char *device = "cpu";
	DLDevice dev;
	int64_t shape[DLPC_NDIM_MAX];
	DLManagedTensorVersioned *t;
	DLDataType dt;
	int ndim, r;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|s:empty", kwlist, &shape_o, &dtype_o,
					 &device))
		return NULL;
	if (parse_device(device, &dev) < 0 || ipc_dtype_parse(dtype_o, &dt) < 0 ||
	    (ndim = ipc_parse_shape(shape_o, shape)) < 0)
		return NULL;
	IPC_CALL((ClientObject *)obj, c, r, dlpc_alloc(c, dev, dt, (int32_t)ndim, shape, &t));
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

/* The spec of empty_dict() as dlpc_alloc_bundle() takes it. */
struct bundle_spec {
	PyObject *items; /* the spec's (key, (shape, dtype)) pairs */
	size_t n;
	DLDataType *dtypes;
	int32_t *ndims;
	int64_t (*dims)[DLPC_NDIM_MAX];
	const int64_t **shapes; /* shapes[i] is dims[i] */
	DLManagedTensorVersioned **ts;
};

static void spec_free(struct bundle_spec *b)
{
	Py_XDECREF(b->items);
	free(b->dtypes);
	free(b->ndims);
	free(b->dims);
	free(b->shapes);
	free(b->ts);
}

/* Check @p spec (a dict of key: (shape, dtype)) and fill @p b from it. 0, or -1 with an
 * exception; either way spec_free() frees @p b. */
static int spec_parse(PyObject *spec, struct bundle_spec *b)
{
	Py_ssize_t n;

	if (!PyDict_Check(spec)) {
		PyObject *type = PyType_GetQualName(Py_TYPE(spec));

		if (type)
			PyErr_Format(PyExc_TypeError,
				     "spec must be a dict of key: (shape, dtype), not %U", type);
		Py_XDECREF(type);
		return -1;
	}
	b->items = PyDict_Items(spec);
	if (!b->items)
		return -1;
	n = PyList_Size(b->items);
	if (n < 1 || n > DLPC_BUNDLE_MAX) {
		PyErr_Format(PyExc_ValueError, "spec has %zd tensors; 1 to %d", n, DLPC_BUNDLE_MAX);
		return -1;
	}
	b->n = (size_t)n;
	b->dtypes = calloc(b->n, sizeof(*b->dtypes));
	b->ndims = calloc(b->n, sizeof(*b->ndims));
	b->dims = calloc(b->n, sizeof(*b->dims));
	b->shapes = calloc(b->n, sizeof(*b->shapes));
	b->ts = calloc(b->n, sizeof(*b->ts));
	if (!b->dtypes || !b->ndims || !b->dims || !b->shapes || !b->ts) {
		PyErr_NoMemory();
		return -1;
	}
	for (size_t i = 0; i < b->n; i++) {
		PyObject *kv = PyList_GetItem(b->items, (Py_ssize_t)i), *k = PyTuple_GetItem(kv, 0),
			 *v = PyTuple_GetItem(kv, 1);

		if (!PyUnicode_Check(k) || !PyTuple_Check(v) || PyTuple_Size(v) != 2) {
			PyErr_Format(PyExc_TypeError,
				     "spec must map str keys to (shape, dtype) tuples; %R is not",
				     k);
			return -1;
		}
		if (ipc_dtype_parse(PyTuple_GetItem(v, 1), &b->dtypes[i]) < 0 ||
		    (b->ndims[i] = ipc_parse_shape(PyTuple_GetItem(v, 0), b->dims[i])) < 0)
			return -1;
		b->shapes[i] = b->dims[i];
	}
	return 0;
}

/* The tensors allocated for @p b as a dict of SharedTensor by key; each tensor goes into one,
 * or is let go here. NULL with an exception. */
static PyObject *spec_tensors(ipc_state *st, struct bundle_spec *b)
{
	PyObject *res = PyDict_New();

	for (size_t i = 0; i < b->n; i++) {
		PyObject *k = PyTuple_GetItem(PyList_GetItem(b->items, (Py_ssize_t)i), 0);
		PyObject *t = res ? ipc_tensor_new(st, b->ts[i], Py_None, k, 0, true) : NULL;

		if (!res)
			b->ts[i]->deleter(b->ts[i]);
		if (res && (!t || PyDict_SetItem(res, k, t) < 0))
			Py_CLEAR(res);
		Py_XDECREF(t);
		b->ts[i] = NULL;
	}
	return res;
}

/*
 * empty_dict({key: (shape, dtype), ...}, device): the tensors of a bundle in one allocation
 * (dlpc_alloc_bundle()), as a dict of SharedTensor in the mapping's order; publish_dict() of
 * exactly that dict is then zero-copy.
 */
static PyObject *client_empty_dict(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	static char *kwlist[] = {"spec", "device", NULL};
	ipc_state *st = ipc_state_of_type(Py_TYPE(obj));
	struct bundle_spec b = {0};
	const char *device = "cpu";
	PyObject *spec, *res = NULL;
	DLDevice dev;
	int r;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|s:empty_dict", kwlist, &spec, &device))
		return NULL;
	if (parse_device(device, &dev) < 0)
		return NULL;
	if (spec_parse(spec, &b) == 0) {
		IPC_CALL((ClientObject *)obj, c, r,
			 dlpc_alloc_bundle(c, dev, b.n, b.dtypes, b.ndims, b.shapes, b.ts));
		if (r < 0)
			ipc_raise(r);
		else
			res = spec_tensors(st, &b);
	}
	spec_free(&b);
	return res;
}

/* An optional expectation: None is 0 (not checked), otherwise an int above 0. */
static int expected_arg(PyObject *o, const char *what, long long *out)
{
	*out = 0;
	if (o == Py_None)
		return 0;
	*out = PyLong_AsLongLong(o);
	if (*out == -1 && PyErr_Occurred())
		return -1;
	if (*out <= 0) {
		PyErr_Format(PyExc_ValueError, "unpublish: %s must be None or above 0, not %lld",
			     what, *out);
		return -1;
	}
	return 0;
}

static PyObject *client_unpublish(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	static char *kwlist[] = {"name", "generation", "created_ns", NULL};
	PyObject *gen_o = Py_None, *created_o = Py_None;
	long long gen, created;
	const char *name;
	int r;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|$OO:unpublish", kwlist, &name, &gen_o,
					 &created_o) ||
	    expected_arg(gen_o, "generation", &gen) < 0 ||
	    expected_arg(created_o, "created_ns", &created) < 0)
		return NULL;
	IPC_CALL((ClientObject *)obj, c, r,
		 dlpc_unpublish_if(c, name, (uint64_t)gen, (int64_t)created));
	if (r < 0)
		return ipc_raise(r);
	Py_RETURN_NONE;
}

static PyObject *client_last_published(PyObject *obj, PyObject *unused)
{
	dlpc_client *c = ipc_client((ClientObject *)obj);
	uint64_t gen;
	int64_t created;

	(void)unused;
	/* the GIL is kept: nothing closes or replaces the handle meanwhile */
	if (!c)
		return NULL;
	if (dlpc_last_published(c, &gen, &created) < 0)
		Py_RETURN_NONE;
	return Py_BuildValue("(KL)", (unsigned long long)gen, (long long)created);
}

#define KW (METH_VARARGS | METH_KEYWORDS)
#define FN(f) (PyCFunction)(void (*)(void))(f)

static PyMethodDef client_methods[] = {
	{"publish", FN(ipc_client_publish), KW,
	 "publish($self, /, name, obj, *, replace=False, ephemeral=False, writable=False)\n--\n\n"
	 "Publish obj under name until unpublish(); returns the generation (1, then one more\n"
	 "per replace). As dlpack_ipc.publish(), on this connection:\n"
	 "replace: take over the name if it is published (by this uid, or as root).\n"
	 "ephemeral: the entry goes when this connection closes (close(), or the process exits).\n"
	 "writable: attachers may map it shared and writable (attach(mode=\"write\"))."},
	{"publish_dict", FN(ipc_client_publish_dict), KW,
	 "publish_dict($self, /, name, mapping, *, replace=False, ephemeral=False, "
	 "writable=False)\n--\n\n"
	 "Publish a mapping of str keys to tensors (a state dict) as one entry; returns the\n"
	 "generation. replace, ephemeral and writable as for publish()."},
	{"attach", FN(ipc_client_attach), KW,
	 "attach($self, /, name, *, timeout=None, mode=None, writable=None, owner=None,\n"
	 "       populate=False, stream=None)\n--\n\n"
	 "The tensor published under name, as a SharedTensor over the same memory.\n\n"
	 "timeout: None (or float(\"inf\")) waits for name as long as it takes (Ctrl-C\n"
	 "interrupts), 0 not at all (FileNotFoundError), seconds then TimeoutError.\n"
	 "mode: \"read\" (the default: read-only, a stray write stays in this process),\n"
	 "\"private\" (writable, copy-on-write), \"strict\" (a write is SIGSEGV) or \"write\"\n"
	 "(shared writable; writable=True is the older spelling); see dlpack_ipc.attach().\n"
	 "owner: a uid: an entry under name published by another uid counts as absent.\n"
	 "populate: map every page before returning, so that reading it all takes no page\n"
	 "faults (for a consumer that reads everything: model weights).\n"
	 "stream: CUDA entries: the consumer's stream (an int), ordered after the publisher\n"
	 "now and followed by the release; see dlpack_ipc.attach()."},
	{"attach_dict", FN(ipc_client_attach_dict), KW,
	 "attach_dict($self, /, name, *, timeout=None, mode=None, writable=None, owner=None,\n"
	 "            populate=False, stream=None)\n--\n\n"
	 "Every tensor of the state dict published under name, as a dict of SharedTensor by\n"
	 "key in the publisher's order. timeout, mode, writable, owner, populate and stream\n"
	 "as for attach()."},
	{"empty", FN(client_empty), KW,
	 "empty($self, /, shape, dtype, device='cpu')\n--\n\n"
	 "Writable shared memory for a tensor of shape and dtype, to fill in place; publish()\n"
	 "then shares it without a copy. device: \"cpu\", \"cuda\" or \"cuda:N\"."},
	{"empty_dict", FN(client_empty_dict), KW,
	 "empty_dict($self, /, spec, device='cpu')\n--\n\n"
	 "A state dict to fill in place: {key: (shape, dtype)} -> {key: SharedTensor} in one\n"
	 "allocation on device; publish_dict() of the whole dict shares it without a copy."},
	{"unpublish", FN(client_unpublish), KW,
	 "unpublish($self, /, name, *, generation=None, created_ns=None)\n--\n\n"
	 "Remove the entry name (its publisher's uid, or root, may). Attached tensors stay\n"
	 "valid until they are released.\n"
	 "generation, created_ns: remove it only if it still is that entry (EntryInfo's fields),\n"
	 "checked and removed in one step by the daemon; otherwise OSError with errno ESTALE and\n"
	 "nothing changes. A generation starts again at 1 once a name is freed: created_ns\n"
	 "tells the entry meant from one published anew."},
	{"_last_published", FN(client_last_published), METH_NOARGS,
	 "_last_published($self, /)\n--\n\n"
	 "(generation, created_ns) of this thread's last publish on this client, or None."},
	{"_list", FN(ipc_client_list), KW, "_list($self, /, prefix='')\n--\n\nLIST, as dicts."},
	{"_channel_open", FN(ipc_client_channel_open), KW,
	 "_channel_open($self, /, name, capacity=0, direct=None, producers=0)\n--\n\nOpen "
	 "(create) a channel, direct or queued (None: as it is); its info as a dict, with "
	 "created."},
	{"_channel_close", FN(ipc_client_channel_close), KW,
	 "_channel_close($self, /, name, all=False)\n--\n\nThis connection sends no more to a "
	 "channel (all: no producer does)."},
	{"_channel_remove", FN(ipc_client_channel_remove), KW,
	 "_channel_remove($self, /, name)\n--\n\nRemove a channel."},
	{"_channel_stat", FN(ipc_client_channel_stat), KW,
	 "_channel_stat($self, /, name)\n--\n\nA channel's info, as a dict."},
	{"_channel_list", FN(ipc_client_channel_list), KW,
	 "_channel_list($self, /, prefix='')\n--\n\nLIST of channels, as dicts."},
	{"_send", FN(ipc_client_send), KW,
	 "_send($self, /, name, obj, *, timeout=None)\n--\n\nSend obj to a channel."},
	{"_send_dict", FN(ipc_client_send_dict), KW,
	 "_send_dict($self, /, name, mapping, *, timeout=None)\n--\n\nSend a bundle to a "
	 "channel."},
	{"_channel_empty", FN(ipc_client_channel_empty), KW,
	 "_channel_empty($self, /, name, shape, dtype)\n--\n\nRecycled memory for a "
	 "channel."},
	{"_recv", FN(ipc_client_recv), KW,
	 "_recv($self, /, name, *, timeout=None, mode=None, bundle=False)\n--\n\nReceive "
	 "from a channel."},
	{"stat", ipc_client_stat, METH_NOARGS,
	 "stat($self, /)\n--\n\nThe daemon's counters, as a dict of ints (see "
	 "dlpack_ipc.stat())."},
	{"close", client_close, METH_NOARGS,
	 "close($self, /)\n--\n\n"
	 "Close the connection. A call waiting on it in another thread raises "
	 "OSError(ECANCELED); later calls raise ValueError. Closing twice does nothing."},
	{NULL},
};

static PyObject *client_reconnects(PyObject *obj, void *unused)
{
	ClientObject *self = (ClientObject *)obj;

	(void)unused;
	return PyLong_FromUnsignedLongLong(ipc_client_reconnects(self));
}

static PyGetSetDef client_getset[] = {
	{"reconnects", client_reconnects, NULL,
	 "How many times this connection was made anew after dlpackd went away (reconnect=True). "
	 "Tensors attached before stay valid; ephemeral entries published before are gone.",
	 NULL},
	{NULL},
};

static PyType_Slot client_slots[] = {
	{Py_tp_init, client_init},
	{Py_tp_dealloc, client_dealloc},
	{Py_tp_methods, client_methods},
	{Py_tp_getset, client_getset},
	{Py_tp_new, PyType_GenericNew},
	{Py_tp_doc, "A connection to dlpackd (Client(socket=None, *, reconnect=False))."},
	{0, NULL},
};

static PyType_Spec client_spec = {
	.name = "dlpack_ipc._core.Client",
	.basicsize = sizeof(ClientObject),
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
	.slots = client_slots,
};

static int module_exec(PyObject *m)
{
	ipc_state *st = PyModule_GetState(m);

	if (ipc_calls_setup() < 0)
		return -1;
	st->client_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &client_spec, NULL);
	st->tensor_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &ipc_tensor_spec, NULL);
	st->watch_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &ipc_watch_spec, NULL);
	if (!st->client_type || !st->tensor_type || !st->watch_type)
		return -1;
	if (ipc_exchange_install(st->tensor_type) < 0 || PyModule_AddType(m, st->client_type) < 0 ||
	    PyModule_AddType(m, st->tensor_type) < 0 || PyModule_AddType(m, st->watch_type) < 0)
		return -1;
	/* the project's version, as built (libdlpc_version: the library loaded, at run time) */
	if (PyModule_AddStringConstant(m, "__version__", DLPD_VERSION) < 0 ||
	    PyModule_AddStringConstant(m, "libdlpc_version", dlpc_version()) < 0 ||
	    PyModule_AddIntConstant(m, "NAME_MAX", DLPC_NAME_MAX) < 0 ||
	    PyModule_AddIntConstant(m, "NDIM_MAX", DLPC_NDIM_MAX) < 0 ||
	    PyModule_AddIntConstant(m, "BUNDLE_MAX", DLPC_BUNDLE_MAX) < 0 ||
	    PyModule_AddIntConstant(m, "KEY_MAX", DLPC_KEY_MAX) < 0 ||
	    PyModule_AddIntConstant(m, "PUBLISH_EPHEMERAL", DLPC_PUBLISH_EPHEMERAL) < 0 ||
	    PyModule_AddIntConstant(m, "PUBLISH_WRITABLE", DLPC_PUBLISH_WRITABLE) < 0)
		return -1;
	return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg)
{
	ipc_state *st = PyModule_GetState(m);

	Py_VISIT(st->client_type);
	Py_VISIT(st->tensor_type);
	Py_VISIT(st->watch_type);
	return 0;
}

static int module_clear(PyObject *m)
{
	ipc_state *st = PyModule_GetState(m);

	Py_CLEAR(st->client_type);
	Py_CLEAR(st->tensor_type);
	Py_CLEAR(st->watch_type);
	return 0;
}

static PyObject *cuda_hold_releases(PyObject *m, PyObject *unused)
{
	(void)m;
	(void)unused;
	dlpc_cuda_hold_releases();
	Py_RETURN_NONE;
}

static PyObject *cuda_resume_releases(PyObject *m, PyObject *unused)
{
	(void)m;
	(void)unused;
	dlpc_cuda_resume_releases();
	Py_RETURN_NONE;
}

/* dlpack_ipc.cuda_releases_held() (a context manager in Python) takes and ends the hold */
static PyMethodDef module_methods[] = {
	{"_cuda_hold_releases", cuda_hold_releases, METH_NOARGS, NULL},
	{"_cuda_resume_releases", cuda_resume_releases, METH_NOARGS, NULL},
	{NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot module_slots[] = {
	{Py_mod_exec, module_exec},
	{0, NULL},
};

static struct PyModuleDef module_def = {
	PyModuleDef_HEAD_INIT,
	.m_name = "dlpack_ipc._core",
	.m_doc = "libdlpc for Python: share DLPack tensors between processes through dlpackd.",
	.m_size = sizeof(ipc_state),
	.m_methods = module_methods,
	.m_slots = module_slots,
	.m_traverse = module_traverse,
	.m_clear = module_clear,
};

PyMODINIT_FUNC PyInit__core(void);

PyMODINIT_FUNC PyInit__core(void)
{
	ipc_state_def = &module_def;
	return PyModuleDef_Init(&module_def);
}
