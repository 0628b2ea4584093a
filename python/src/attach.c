/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Client.attach() and Client.attach_dict(): the attach modes (how this process maps an entry's
 * memory), the owner check, and waits: one ATTACH request for the whole timeout, which Ctrl-C
 * ends through libdlpc's interrupt check (ipc_interruptible()).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "dlpack_ipc.h"

/*
 * A timeout this long or longer (1e15 ms, some 31,700 years) waits without bound: a longer one
 * could overflow int64 milliseconds, or libdlpc's clock plus the timeout.
 */
#define WAIT_BOUND_MS 1e15

/*
 * The modes, by what the caller means to do with the memory. "read" is the default: it keeps
 * the read-only flag for consumers that honour it, and maps copy-on-write so that a consumer
 * that ignores the flag (PyTorch) writes into pages of its own instead of crashing.
 */
static const struct {
	const char *name;
	uint32_t flags;
} modes[] = {
	{"read", DLPC_ATTACH_GUARDED},	  /* read-only flag; stray writes stay private */
	{"private", DLPC_ATTACH_PRIVATE}, /* writable; writes stay private */
	{"strict", 0},			  /* read-only flag and mapping: a write is SIGSEGV */
	{"write", DLPC_ATTACH_WRITABLE},  /* shared writable: writes seen by everyone */
};

/* What one attach asks for, from its keyword arguments. */
struct attach_req {
	const char *name;
	PyObject *timeout;
	const char *mode; /* one of modes[].name: static storage */
	uint32_t flags;	  /* DLPC_ATTACH_* */
	uint32_t owner_uid;
	void *stream; /* CUDA entries: the consumer's stream, named at attach (NULL: later) */
};

/* Resolve mode=, writable= (the older spelling of mode="write") and owner= into @p req. */
static int resolve(struct attach_req *req, const char *mode, PyObject *writable, PyObject *owner)
{
	int w = -1; /* writable= not given */
	size_t i;

	if (writable && writable != Py_None && (w = PyObject_IsTrue(writable)) < 0)
		return -1;
	if (!mode)
		mode = w == 1 ? "write" : "read";
	for (i = 0; i < sizeof(modes) / sizeof(modes[0]); i++)
		if (strcmp(mode, modes[i].name) == 0)
			break;
	if (i == sizeof(modes) / sizeof(modes[0])) {
		PyErr_Format(
			PyExc_ValueError,
			"mode must be \"read\", \"private\", \"strict\" or \"write\", not '%s'",
			mode);
		return -1;
	}
	if (w >= 0 && w != (modes[i].flags == DLPC_ATTACH_WRITABLE)) {
		PyErr_Format(PyExc_ValueError,
			     "writable=%s contradicts mode=\"%s\" (writable=True is the older "
			     "spelling of mode=\"write\")",
			     w ? "True" : "False", modes[i].name);
		return -1;
	}
	req->mode = modes[i].name;
	/* CUDA entries: the consumer's stream is known at __dlpack__(stream=...), not here */
	req->flags = modes[i].flags | DLPC_ATTACH_DEFER_SYNC;
	if (owner && owner != Py_None) {
		unsigned long uid;

		if (!PyLong_Check(owner) || PyBool_Check(owner)) {
			PyErr_Format(PyExc_TypeError,
				     "owner must be a uid (an int) or None, not %R", owner);
			return -1;
		}
		uid = PyLong_AsUnsignedLong(owner);
		if ((uid == (unsigned long)-1 && PyErr_Occurred()) || uid >= UINT32_MAX) {
			PyErr_Clear();
			PyErr_Format(PyExc_ValueError, "owner must be a uid from 0 to %u, not %R",
				     UINT32_MAX - 1, owner);
			return -1;
		}
		req->flags |= DLPC_ATTACH_OWNER;
		req->owner_uid = (uint32_t)uid;
	}
	return 0;
}

/*
 * stream=: the CUDA stream the consumer works on, named at attach (docs/gpu.md, "Which stream
 * orders what"): 1 the legacy default stream, 2 the per-thread default stream, any other
 * positive integer a cudaStream_t / CUstream. The attach then orders it after the publisher
 * (no host wait) and the release after it, as dlpc_attach_opts.stream does. 0, -1 with an
 * exception.
 */
static int resolve_stream(struct attach_req *req, PyObject *stream)
{
	long long s;

	if (!stream || stream == Py_None)
		return 0;
	s = PyLong_Check(stream) && !PyBool_Check(stream) ? PyLong_AsLongLong(stream) : 0;
	if (s == -1 && PyErr_Occurred())
		PyErr_Clear();
	if (s <= 0) {
		PyErr_Format(
			PyExc_ValueError,
			"stream must be None, 1 (legacy default), 2 (per-thread default) or a "
			"CUDA stream pointer (an int such as torch.cuda.Stream's cuda_stream), "
			"not %R",
			stream);
		return -1;
	}
	req->stream = (void *)(uintptr_t)s;
	req->flags &= ~(uint32_t)DLPC_ATTACH_DEFER_SYNC;
	return 0;
}

static int parse(const char *fn, PyObject *args, PyObject *kwargs, struct attach_req *req)
{
	static char *kwlist[] = {"name",  "timeout",  "mode",	"writable",
				 "owner", "populate", "stream", NULL};
	PyObject *writable = NULL, *owner = NULL, *stream = NULL;
	const char *mode = NULL;
	int populate = 0;
	char fmt[32];

	snprintf(fmt, sizeof(fmt), "s|$OzOOpO:%s", fn);
	req->timeout = Py_None;
	if (!PyArg_ParseTupleAndKeywords(args, kwargs, fmt, kwlist, &req->name, &req->timeout,
					 &mode, &writable, &owner, &populate, &stream))
		return -1;
	if (resolve(req, mode, writable, owner) < 0)
		return -1;
	/* the whole mapping faulted in before the call returns, for a consumer that reads it all */
	if (populate)
		req->flags |= DLPC_ATTACH_POPULATE;
	return resolve_stream(req, stream);
}

/*
 * Parse a timeout in seconds as Python's own calls do (queue, threading): None or inf -> wait as
 * long as it takes, 0 -> fail at once. -1 with an exception.
 */
static int parse_timeout(PyObject *o, double *secs, bool *forever)
{
	*forever = true;
	*secs = INFINITY;
	if (o == Py_None)
		return 0;
	*secs = PyFloat_AsDouble(o);
	if (*secs == -1 && PyErr_Occurred())
		return -1;
	if (isnan(*secs) || *secs < 0) {
		PyErr_Format(PyExc_ValueError, "timeout must be None or >= 0, not %R", o);
		return -1;
	}
	*forever = isinf(*secs);
	return 0;
}

/* Raise TimeoutError for a wait on @p req that ran out after @p secs. */
static void raise_timeout(const struct attach_req *req, double secs)
{
	char msg[DLPC_NAME_MAX + 96], who[40] = "";
	PyObject *args;

	if (req->flags & DLPC_ATTACH_OWNER)
		snprintf(who, sizeof(who), " published by uid %u", (unsigned)req->owner_uid);
	snprintf(msg, sizeof(msg), "no entry named '%s'%s appeared within %g s", req->name, who,
		 secs);
	args = Py_BuildValue("(is)", ETIMEDOUT, msg);
	if (args) {
		PyErr_SetObject(PyExc_OSError, args);
		Py_DECREF(args);
	}
}

/*
 * Attach, waiting as one request for the whole timeout (libdlpc runs the main thread's interrupt
 * check meanwhile, so Ctrl-C ends it, and a reconnecting client asks again for the time left
 * after a daemon restart). Fills *single or *bundle. Returns the generation, or -1 with a Python
 * exception set.
 */
static int attach_waiting(ClientObject *self, const struct attach_req *req,
			  DLManagedTensorVersioned **single, dlpc_bundle **bundle)
{
	dlpc_attach_opts opts = {.size = sizeof(opts),
				 .flags = req->flags,
				 .owner_uid = req->owner_uid,
				 .stream = req->stream};
	double secs;
	bool forever;
	int r;

	if (parse_timeout(req->timeout, &secs, &forever) < 0)
		return -1;
	/* a wait is at least 1 ms (0 would mean "fail at once"); beyond WAIT_BOUND_MS, none */
	if (forever || secs * 1000 >= WAIT_BOUND_MS)
		opts.timeout_ms = -1;
	else
		opts.timeout_ms = secs == 0 ? 0 : (int64_t)ceil(secs * 1000);
	IPC_CALL(self, c, r,
		 single ? dlpc_attach(c, req->name, &opts, single)
			: dlpc_attach_bundle(c, req->name, &opts, bundle));
	if (r == -ETIMEDOUT && opts.timeout_ms > 0 && !PyErr_Occurred()) {
		raise_timeout(req, secs);
		return -1;
	}
	if (r < 0) {
		ipc_raise(r);
		return -1;
	}
	return r;
}

/* Wrap the attached tensor @p t (owned) as a SharedTensor that knows its mode and owner. */
static PyObject *wrap(ipc_state *st, const struct attach_req *req, DLManagedTensorVersioned *t,
		      PyObject *name, PyObject *key, int gen)
{
	dlpc_attach_info info = {.size = sizeof(info)};
	TensorObject *self = (TensorObject *)ipc_tensor_new(st, t, name, key, gen, false);

	if (!self)
		return NULL;
	self->mode = req->mode;
	/* who published it (a tensor attached through libdlpc always has an owner) */
	if (dlpc_tensor_attach_info(t, &info) == 0) {
		self->has_owner = true;
		self->owner_uid = info.owner_uid;
		self->owner_pid = info.owner_pid;
	}
	return (PyObject *)self;
}

PyObject *ipc_client_attach(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	ipc_state *st = ipc_state_of_type(Py_TYPE(obj));
	struct attach_req req = {0};
	PyObject *pname, *key, *res;
	DLManagedTensorVersioned *t;
	int gen;

	if (parse("attach", args, kwargs, &req) < 0)
		return NULL;
	gen = attach_waiting((ClientObject *)obj, &req, &t, NULL);
	if (gen < 0)
		return NULL;
	pname = PyUnicode_FromString(req.name);
	key = PyUnicode_FromString("");
	res = pname && key ? wrap(st, &req, t, pname, key, gen) : NULL;
	if (!res && !(pname && key))
		t->deleter(t);
	Py_XDECREF(pname);
	Py_XDECREF(key);
	return res;
}

PyObject *ipc_client_attach_dict(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	ipc_state *st = ipc_state_of_type(Py_TYPE(obj));
	struct attach_req req = {0};
	PyObject *pname = NULL, *dict = NULL;
	dlpc_bundle *b;
	int gen;

	if (parse("attach_dict", args, kwargs, &req) < 0)
		return NULL;
	gen = attach_waiting((ClientObject *)obj, &req, NULL, &b);
	if (gen < 0)
		return NULL;
	pname = PyUnicode_FromString(req.name);
	dict = pname ? PyDict_New() : NULL;
	for (size_t i = 0; dict && i < dlpc_bundle_count(b); i++) {
		PyObject *key = PyUnicode_FromString(dlpc_bundle_key(b, i));
		PyObject *t = key ? wrap(st, &req, dlpc_bundle_take(b, i), pname, key, gen) : NULL;

		if (!t || PyDict_SetItem(dict, key, t) < 0)
			Py_CLEAR(dict);
		Py_XDECREF(key);
		Py_XDECREF(t);
	}
	dlpc_bundle_free(b);
	Py_XDECREF(pname);
	return dict;
}
