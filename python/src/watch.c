/* SPDX-License-Identifier: Apache-2.0 */
/*
 * dlpack_ipc._core.Watch: dlpc_watch for Python. A wait is one dlpc_watch_next() without the GIL;
 * Ctrl-C interrupts it through libdlpc's interrupt check, as it does a call on a Client.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "dlpack_ipc.h"

typedef struct {
	PyObject_HEAD dlpc_watch *w;
	bool busy;	    /* a call is waiting without the GIL */
	bool close_pending; /* close() came meanwhile: the waiting call closes */
} WatchObject;

static int watch_init(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	static char *kwlist[] = {"prefix", "socket", NULL};
	WatchObject *self = (WatchObject *)obj;
	PyObject *sock = Py_None, *bytes = NULL;
	const char *prefix = "", *path = NULL;
	dlpc_watch *w;
	int err;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|sO:Watch", kwlist, &prefix, &sock))
		return -1;
	if (self->w) {
		PyErr_SetString(PyExc_RuntimeError, "Watch is already open");
		return -1;
	}
	if (sock != Py_None) {
		if (!PyUnicode_FSConverter(sock, &bytes))
			return -1;
		path = PyBytes_AsString(bytes);
	}
	ipc_interruptible();
	Py_BEGIN_ALLOW_THREADS
	w = dlpc_watch_open(path, prefix, &err);
	Py_END_ALLOW_THREADS
	Py_XDECREF(bytes);
	if (!w) {
		ipc_raise(err);
		return -1;
	}
	self->w = w;
	return 0;
}

static void watch_close_now(WatchObject *self)
{
	int fd;

	if (self->busy) {
		/* the waiting call closes it once woken: a socket shut down reads as ended */
		fd = self->close_pending ? -1 : dlpc_watch_fd(self->w);
		if (fd >= 0)
			shutdown(fd, SHUT_RDWR);
		self->close_pending = true;
		return;
	}
	dlpc_watch_close(self->w);
	self->w = NULL;
}

static void watch_dealloc(PyObject *obj)
{
	WatchObject *self = (WatchObject *)obj;
	PyTypeObject *tp = Py_TYPE(obj);

	/* never busy here: a waiting call holds a reference to self */
	dlpc_watch_close(self->w);
	((freefunc)PyType_GetSlot(tp, Py_tp_free))(obj);
	Py_DECREF(tp);
}

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static const char *const kinds[] = {
	[DLPC_WATCH_PUBLISHED] = "published",
	[DLPC_WATCH_REPLACED] = "replaced",
	[DLPC_WATCH_UNPUBLISHED] = "unpublished",
	[DLPC_WATCH_CHANNEL_OPENED] = "channel_opened",
	[DLPC_WATCH_CHANNEL_REMOVED] = "channel_removed",
};

/* The event as a dict; the Python side makes the namedtuple. */
static PyObject *event_dict(const dlpc_watch_event *ev)
{
	const dlpc_entry_info *e = &ev->entry;
	PyObject *dtype = Py_None, *shape = Py_None, *reason = Py_None, *d;
	char device[32];

	/* a single tensor: one, under the key "" (one under a key is a bundle) */
	if (e->tensors && e->ntensors == 1 && !(e->tensors[0].key && e->tensors[0].key[0])) {
		shape = PyTuple_New(e->tensors[0].ndim);
		dtype = ipc_dtype_name(e->tensors[0].dtype);
		for (int32_t k = 0; shape && k < e->tensors[0].ndim; k++) {
			PyObject *extent = PyLong_FromLongLong(e->tensors[0].shape[k]);

			if (!extent || PyTuple_SetItem(shape, k, extent) < 0)
				Py_CLEAR(shape);
		}
		if (!shape || !dtype) {
			Py_XDECREF(shape);
			Py_XDECREF(dtype);
			return NULL;
		}
	} else {
		Py_INCREF(dtype);
		Py_INCREF(shape);
	}
	if (ev->kind == DLPC_WATCH_UNPUBLISHED)
		reason = PyUnicode_FromString(ev->reason == DLPC_WATCH_BY_DISCONNECT ? "disconnect"
										     : "request");
	else
		Py_INCREF(reason);
	if (!reason) {
		Py_DECREF(shape);
		Py_DECREF(dtype);
		return NULL;
	}
	ipc_device_text(e->device, device, sizeof(device));
	d = Py_BuildValue("{s:s,s:s,s:K,s:K,s:s,s:N,s:N,s:n,s:K,s:K,s:I,s:i,s:d,s:I,s:N,s:I,s:i,"
			  "s:K}",
			  "kind", kinds[ev->kind], "name", e->name, "generation",
			  (unsigned long long)e->generation, "previous_generation",
			  (unsigned long long)ev->previous_generation, "device", device, "dtype",
			  dtype, "shape", shape, "ntensors", (Py_ssize_t)e->ntensors, "nbytes",
			  (unsigned long long)e->nbytes, "refs", (unsigned long long)e->refs, "uid",
			  e->owner_uid, "pid", e->owner_pid, "created", e->created_ns / 1e9,
			  "flags", e->flags, "reason", reason, "actor_uid", ev->actor_uid,
			  "actor_pid", ev->actor_pid, "seq", (unsigned long long)ev->seq);
	return d;
}

/* Seconds from now until @p deadline (CLOCK_MONOTONIC seconds) as dlpc_watch_next()'s timeout:
 * -1 without one, at most INT_MAX ms (some 24 days) at a time, 0 once it passed. */
static int wait_ms(double deadline)
{
	double ms;

	if (isinf(deadline))
		return -1;
	ms = ceil((deadline - now_s()) * 1000);
	return ms <= 0 ? 0 : ms >= INT_MAX ? INT_MAX : (int)ms;
}

/*
 * Wait for the next event until @p deadline as one dlpc_watch_next(), Ctrl-C checked by
 * libdlpc's interrupt check (ipc_interruptible()); another thread's close() wakes it (see
 * watch_close_now()). Asked again only after a signal on a thread without the check, whose
 * handlers Python runs elsewhere, or after INT_MAX ms. With the GIL; 1, 0 (none in time) or a
 * negative errno, or -EINTR with an exception set.
 */
static int wait_event(WatchObject *self, double deadline, dlpc_watch_event *ev)
{
	dlpc_watch *w = self->w;
	int r, ms;

	do {
		ms = wait_ms(deadline);
		ipc_interruptible();
		Py_BEGIN_ALLOW_THREADS
		r = dlpc_watch_next(w, ev, ms);
		Py_END_ALLOW_THREADS
		if (r == -EINTR && !PyErr_Occurred() && PyErr_CheckSignals() == 0)
			r = 0;
	} while (r == 0 && ms != 0 && !self->close_pending && wait_ms(deadline) != 0);
	return r;
}

/* _next(timeout=None): the next event as a dict, or None when @p timeout seconds passed. */
static PyObject *watch_next(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	static char *kwlist[] = {"timeout", NULL};
	WatchObject *self = (WatchObject *)obj;
	PyObject *timeout = Py_None, *ret = NULL;
	dlpc_watch_event ev;
	double secs = INFINITY;
	int r;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O:_next", kwlist, &timeout))
		return NULL;
	if (timeout != Py_None) {
		secs = PyFloat_AsDouble(timeout);
		if (secs == -1 && PyErr_Occurred())
			return NULL;
		if (isnan(secs) || secs < 0) {
			PyErr_Format(PyExc_ValueError, "timeout must be None or >= 0, not %R",
				     timeout);
			return NULL;
		}
	}
	if (!self->w) {
		PyErr_SetString(PyExc_ValueError, "the Watch is closed");
		return NULL;
	}
	if (self->busy) {
		PyErr_SetString(PyExc_RuntimeError, "the Watch is being read by another thread");
		return NULL;
	}
	self->busy = true;
	Py_INCREF(obj);
	r = wait_event(self, now_s() + secs, &ev);
	if (r == 1)
		ret = event_dict(&ev);
	else if (PyErr_Occurred())
		; /* a signal handler raised (KeyboardInterrupt) */
	else if (self->close_pending)
		PyErr_SetString(PyExc_ValueError, "the Watch was closed while waiting");
	else if (r < 0)
		ipc_raise(r);
	else
		ret = Py_NewRef(Py_None);
	self->busy = false;
	if (self->close_pending) {
		self->close_pending = false;
		watch_close_now(self);
	}
	Py_DECREF(obj);
	return ret;
}

static PyObject *watch_fileno(PyObject *obj, PyObject *unused)
{
	WatchObject *self = (WatchObject *)obj;
	int fd;

	(void)unused;
	if (!self->w) {
		PyErr_SetString(PyExc_ValueError, "the Watch is closed");
		return NULL;
	}
	fd = dlpc_watch_fd(self->w);
	return fd < 0 ? ipc_raise(fd) : PyLong_FromLong(fd);
}

static PyObject *watch_close(PyObject *obj, PyObject *unused)
{
	(void)unused;
	watch_close_now((WatchObject *)obj);
	Py_RETURN_NONE;
}

static PyObject *watch_closed(PyObject *obj, void *unused)
{
	WatchObject *self = (WatchObject *)obj;

	(void)unused;
	return PyBool_FromLong(!self->w || self->close_pending);
}

static PyMethodDef watch_methods[] = {
	{"_next", (PyCFunction)(void (*)(void))watch_next, METH_VARARGS | METH_KEYWORDS,
	 "_next($self, /, timeout=None)\n--\n\nThe next event as a dict, or None."},
	{"fileno", watch_fileno, METH_NOARGS,
	 "fileno($self, /)\n--\n\nThe watch's socket, for select() and poll()."},
	{"close", watch_close, METH_NOARGS,
	 "close($self, /)\n--\n\nEnd the watch and its connection; iteration stops."},
	{NULL},
};

static PyGetSetDef watch_getset[] = {
	{"closed", watch_closed, NULL, "whether close() was called", NULL},
	{NULL},
};

static PyType_Slot watch_slots[] = {
	{Py_tp_init, watch_init},
	{Py_tp_dealloc, watch_dealloc},
	{Py_tp_methods, watch_methods},
	{Py_tp_getset, watch_getset},
	{Py_tp_new, PyType_GenericNew},
	{Py_tp_doc, "A watch on dlpackd's names (Watch(prefix='', socket=None))."},
	{0, NULL},
};

PyType_Spec ipc_watch_spec = {
	.name = "dlpack_ipc._core.Watch",
	.basicsize = sizeof(WatchObject),
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
	.slots = watch_slots,
};
