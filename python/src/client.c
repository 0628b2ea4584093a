/* SPDX-License-Identifier: Apache-2.0 */
/*
 * dlpack_ipc._core: a Client's connection and the calls on it (ipc_call_begin/ipc_call_end,
 * IPC_CALL()), the interrupt check that lets Ctrl-C end a wait, and connecting anew.
 *
 * A Client connects anew when its handle cannot serve: in a forked child (a new handle), and
 * (reconnect=True, as the module's default client is made) on the call after one that found the
 * connection lost, which libdlpc does itself (DLPC_CONNECT_RECONNECT). That call raised
 * ConnectionResetError; a call is never retried, since whether a lost request took effect is
 * unknown, except a waiting attach, which libdlpc asks again. Calls still running on a replaced
 * or closed handle keep it alive until the last of them ends (ipc_call_begin/ipc_call_end).
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "dlpack_ipc.h"

/* A handle replaced (or closed) while calls were still running on it. */
struct ipc_old_handle {
	struct ipc_old_handle *next;
	dlpc_client *c;
	unsigned busy; /* calls still on c: the last one closes it */
};

/*
 * Set once the interpreter shuts down: its atexit callbacks run before it finalizes, and from
 * then on no blocked call takes the GIL to run signal handlers. (Py_IsFinalizing() enters the
 * limited API only in 3.13.)
 */
static atomic_bool finalizing;

static PyObject *note_finalizing(PyObject *self, PyObject *unused)
{
	(void)self;
	(void)unused;
	atomic_store(&finalizing, true);
	Py_RETURN_NONE;
}

static PyMethodDef note_finalizing_def = {"_note_finalizing", note_finalizing, METH_NOARGS, NULL};

static int watch_finalizing(void)
{
	PyObject *atexit = PyImport_ImportModule("atexit"), *fn = NULL, *r = NULL;

	if (atexit)
		fn = PyCFunction_New(&note_finalizing_def, NULL);
	if (fn)
		r = PyObject_CallMethod(atexit, "register", "O", fn);
	Py_XDECREF(r);
	Py_XDECREF(fn);
	Py_XDECREF(atexit);
	return r ? 0 : -1;
}

/*
 * libdlpc's interrupt check (dlpc_set_interrupt()) for a thread blocked in a call without the
 * GIL: it takes the GIL and runs the Python signal handlers due. One that raises (Ctrl-C's
 * KeyboardInterrupt) ends the call with -EINTR, its exception left set for the caller to
 * return; one that does not lets the call go on waiting, as Python does for system calls.
 */
static int interrupt_check(void *arg)
{
	PyGILState_STATE g;
	int stop;

	(void)arg;
	if (atomic_load(&finalizing))
		return 0;
	g = PyGILState_Ensure();
	stop = PyErr_CheckSignals() < 0;
	PyGILState_Release(g);
	return stop;
}

/* The thread Python runs signal handlers on (threading.main_thread()); 0: not known. */
static unsigned long main_thread;

static int find_main_thread(void)
{
	PyObject *threading, *t = NULL, *ident = NULL;

	threading = PyImport_ImportModule("threading");
	if (threading)
		t = PyObject_CallMethod(threading, "main_thread", NULL);
	if (t)
		ident = PyObject_GetAttrString(t, "ident");
	if (ident)
		main_thread = PyLong_AsUnsignedLong(ident);
	Py_XDECREF(ident);
	Py_XDECREF(t);
	Py_XDECREF(threading);
	return PyErr_Occurred() ? -1 : 0;
}

/* In a child forked from another thread, that thread is the main one (os.register_at_fork). */
static PyObject *after_fork_in_child(PyObject *self, PyObject *unused)
{
	(void)self;
	(void)unused;
	main_thread = PyThread_get_thread_ident();
	Py_RETURN_NONE;
}

static PyMethodDef after_fork_def = {"_after_fork_in_child", after_fork_in_child, METH_NOARGS,
				     NULL};

static int follow_main_thread_across_fork(void)
{
	PyObject *os = PyImport_ImportModule("os"), *reg = NULL, *fn = NULL, *kw = NULL,
		 *args = NULL, *r = NULL;

	if (os)
		reg = PyObject_GetAttrString(os, "register_at_fork");
	if (reg)
		fn = PyCFunction_New(&after_fork_def, NULL);
	if (fn)
		kw = Py_BuildValue("{s:O}", "after_in_child", fn);
	if (kw)
		args = PyTuple_New(0);
	if (args)
		r = PyObject_Call(reg, args, kw);
	Py_XDECREF(r);
	Py_XDECREF(args);
	Py_XDECREF(kw);
	Py_XDECREF(fn);
	Py_XDECREF(reg);
	Py_XDECREF(os);
	return r ? 0 : -1;
}

/*
 * Only the main thread runs signal handlers, so only its calls get the check: another thread's
 * would take the GIL every DLPC_INTERRUPT_CHECK_MS for nothing, and could be caught taking it
 * while the interpreter shuts down.
 */
void ipc_interruptible(void)
{
	bool main = main_thread && PyThread_get_thread_ident() == main_thread;

	dlpc_set_interrupt(main ? interrupt_check : NULL, NULL);
}

static int connect_to(const char *path, bool reconnect, dlpc_client **c)
{
	uint32_t flags = reconnect ? DLPC_CONNECT_RECONNECT : 0;
	int r;

	ipc_interruptible();
	Py_BEGIN_ALLOW_THREADS
	r = dlpc_connect_flags(path, flags, c);
	Py_END_ALLOW_THREADS
	if (r < 0) {
		ipc_raise(r);
		return -1;
	}
	return 0;
}

/*
 * Give up the handle @p c, which @p busy calls still use: the last of them closes it, or it is
 * closed now if none does. With the GIL.
 */
static void retire(ClientObject *self, dlpc_client *c, unsigned busy)
{
	struct ipc_old_handle *o;

	if (!busy) {
		dlpc_close(c);
		return;
	}
	o = malloc(sizeof(*o));
	/* out of memory: leak the handle rather than free it under a running call */
	if (!o)
		return;
	*o = (struct ipc_old_handle){.next = self->old, .c = c, .busy = busy};
	self->old = o;
}

/* Forget the replaced handles of a parent process without touching them (see replace()). */
static void forget_old(ClientObject *self)
{
	while (self->old) {
		struct ipc_old_handle *o = self->old;

		self->old = o->next;
		free(o);
	}
}

/*
 * Connect anew and make the new handle the one later calls use. The GIL is released while
 * connecting, so another thread may replace the handle, or close the Client, meanwhile: the
 * first to finish wins. Returns 0, or -1 with an exception set: the old handle then stays (still
 * lost, for a reconnect) and the next call tries again.
 */
static int replace(ClientObject *self)
{
	unsigned epoch = self->epoch;
	dlpc_client *c;

	if (connect_to(self->path, self->reconnect, &c) < 0)
		return -1;
	if (!self->c || self->epoch != epoch) {
		dlpc_close(c);
		if (!self->c) {
			PyErr_SetString(PyExc_ValueError, "the Client is closed");
			return -1;
		}
		return 0;
	}
	if (dlpc_inherited(self->c)) {
		/* A forked child: the parent's handles are not ours to use or free (their
		 * mutexes may be held by parent threads that do not exist here; libdlpc already
		 * closed their sockets here). Their memory stays. */
		forget_old(self);
	} else {
		retire(self, self->c, self->busy);
	}
	self->c = c;
	self->busy = 0;
	self->epoch++;
	return 0;
}

dlpc_client *ipc_client(ClientObject *self)
{
	if (!self->c) {
		PyErr_SetString(PyExc_ValueError, "the Client is closed");
		return NULL;
	}
	/* after a lost connection libdlpc connects anew itself (DLPC_CONNECT_RECONNECT); in a
	 * forked child (libdlpc says whose the handle is) the Client does */
	if (dlpc_inherited(self->c) && replace(self) < 0)
		return NULL;
	return self->c;
}

/*
 * Begin a call on the connection: the handle stays valid until ipc_call_end(), even if another
 * thread (or Python code run by __dlpack__) closes the Client, or replaces its handle,
 * meanwhile. With the GIL held.
 */
dlpc_client *ipc_call_begin(ClientObject *self)
{
	dlpc_client *c = ipc_client(self);

	ipc_interruptible();
	if (c)
		self->busy++;
	return c;
}

/* End a call begun with ipc_call_begin() on @p c, which returned @p r. With the GIL. */
void ipc_call_end(ClientObject *self, dlpc_client *c, int r)
{
	struct ipc_old_handle **pp, *o;

	(void)r;
	if (c == self->c) {
		self->busy--;
		return;
	}
	for (pp = &self->old; (o = *pp); pp = &o->next) {
		if (o->c != c)
			continue;
		if (--o->busy == 0) {
			*pp = o->next;
			dlpc_close(c);
			free(o);
		}
		return;
	}
	/* not found: a call begun in the parent process, ending in a forked child */
}

int ipc_calls_setup(void)
{
	if (find_main_thread() < 0 || follow_main_thread_across_fork() < 0 ||
	    watch_finalizing() < 0)
		return -1;
	return 0;
}

int ipc_client_connect(ClientObject *self)
{
	if (connect_to(self->path, self->reconnect, &self->c) < 0)
		return -1;
	self->busy = 0;
	self->epoch++;
	return 0;
}

void ipc_client_close(ClientObject *self)
{
	/* in a forked child the handles are the parent's: leave them alone */
	if (self->c && !dlpc_inherited(self->c)) {
		/* threads blocked in calls on it (an attach that waits forever) return at once */
		if (self->busy)
			dlpc_cancel(self->c);
		retire(self, self->c, self->busy);
	}
	self->c = NULL;
	self->busy = 0;
	self->epoch++;
}

void ipc_client_release(ClientObject *self)
{
	ipc_client_close(self);
	/* no call runs on a Client being freed (each holds a reference), so none is on these */
	for (struct ipc_old_handle *o = self->old; o; o = o->next)
		if (!dlpc_inherited(o->c))
			dlpc_close(o->c);
	forget_old(self);
}

unsigned long long ipc_client_reconnects(ClientObject *self)
{
	/* a closed Client, or one not yet used in a forked child, has connected anew 0 times */
	if (!self->c || dlpc_inherited(self->c))
		return 0;
	return dlpc_reconnects(self->c);
}
