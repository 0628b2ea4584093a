/* SPDX-License-Identifier: Apache-2.0 */
/* dlpack_ipc._core internals shared across the extension's files. */
#ifndef DLPACK_IPC_H
#define DLPACK_IPC_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdbool.h>
#include <sys/types.h>

#include <dlpc/dlpc.h>

/* Per-module state: the heap types. */
typedef struct {
	PyTypeObject *client_type;
	PyTypeObject *tensor_type;
	PyTypeObject *watch_type;
} ipc_state;

/* A handle replaced (or closed) while calls were still running on it: the last one closes it. */
struct ipc_old_handle;

/*
 * A connection; connects anew by itself in a forked child, and (libdlpc does) after the
 * connection broke when made with reconnect=True (see client.c). Every field is guarded by the
 * GIL.
 */
typedef struct {
	PyObject_HEAD dlpc_client *c; /* NULL once closed */
	unsigned busy;		      /* calls in flight on c (see ipc_call_begin) */
	unsigned epoch;		      /* bumped each time c is replaced */
	bool reconnect;		      /* c made with DLPC_CONNECT_RECONNECT */
	struct ipc_old_handle *old;   /* replaced handles with calls still on them */
	char *path;		      /* NULL: the default socket */
} ClientObject;

/* A tensor attached from, or allocated for, dlpackd. */
typedef struct {
	PyObject_HEAD DLManagedTensorVersioned *t; /* NULL once released */
	PyObject *name; /* str, or None for empty() memory not yet published */
	PyObject *key;	/* str */
	int generation;
	bool allocated;	  /* from empty(): publishing it is zero-copy */
	const char *mode; /* the attach mode ("read", ...; static), NULL for empty() memory */
	bool has_owner;	  /* owner_* known: attached or received (not made by empty()) */
	uint32_t owner_uid;
	int32_t owner_pid;
	bool legacy_ordered; /* the legacy stream waits for the publisher (exchange.c) */
} TensorObject;

/* state.c: the module definition the state belongs to (set by PyInit__core, module.c). */
extern const struct PyModuleDef *ipc_state_def;
/* The state of the module that made @p tp or one of its bases; NULL with TypeError. */
ipc_state *ipc_state_of_type(PyTypeObject *tp);

/*
 * errors.c: raise the OSError subclass for a negative errno with dlpc_last_error() as the
 * message; a lost connection (-EPIPE or -ECONNRESET alike) is ConnectionResetError. Returns
 * NULL; where an exception is set already (a signal handler run by libdlpc's interrupt check,
 * or a call that could not begin), that one stays.
 */
PyObject *ipc_raise(int err);

/* client.c: a Client's connection and the calls on it. */
/* Find the main thread and follow it across fork; note the interpreter's shutdown. For the
 * module's exec; -1 with an exception. */
int ipc_calls_setup(void);
/* Connect @p self (path and reconnect set) for Client.__init__; 0, or -1 with an exception. */
int ipc_client_connect(ClientObject *self);
/* Close @p self's connection (Client.close()): calls waiting on it in other threads return. */
void ipc_client_close(ClientObject *self);
/* Close it and every replaced handle, for the Client's dealloc. */
void ipc_client_release(ClientObject *self);
/* How many times @p self's connection was made anew after a lost one (0 once closed). */
unsigned long long ipc_client_reconnects(ClientObject *self);
/* Let Ctrl-C end this thread's libdlpc calls even while dlpackd does not answer (sets the
 * thread's dlpc_set_interrupt() check). With the GIL. */
void ipc_interruptible(void);
/*
 * The dlpc_client for this process, connecting anew after fork, and after a lost connection for
 * a Client made with reconnect=True; NULL with an exception set.
 */
dlpc_client *ipc_client(ClientObject *self);
/*
 * The same, kept valid until ipc_call_end() even if the Client is closed or replaces it, with
 * this thread's interrupt check set (ipc_interruptible()). Calls go through IPC_CALL(); only
 * ipc_take_call(), which runs Python code between the two, uses these directly.
 */
dlpc_client *ipc_call_begin(ClientObject *self);
/* End a call begun on @p c, which returned @p r. */
void ipc_call_end(ClientObject *self, dlpc_client *c, int r);
/* What IPC_CALL() leaves in its result where the call could not begin (an exception is set). */
#define IPC_CALL_NOT_BEGUN INT_MIN
/*
 * The one way to call libdlpc on a Client: begin the call on @p self (ClientObject *), naming its
 * handle @p c, evaluate @p call (an expression using @p c) without the GIL, Ctrl-C checked
 * (ipc_call_begin() sets the interrupt check), store its result in @p r (int) and end the call
 * with the GIL held again. Where the call cannot begin (the Client is closed, or connecting anew
 * failed) @p call does not run and @p r is IPC_CALL_NOT_BEGUN, an exception set: a negative @p r
 * goes to ipc_raise(), which then keeps that exception.
 */
#define IPC_CALL(self, c, r, call)                                                                 \
	do {                                                                                       \
		dlpc_client *c = ipc_call_begin(self);                                             \
		PyThreadState *ipc_saved_;                                                         \
                                                                                                   \
		if (!c) {                                                                          \
			(r) = IPC_CALL_NOT_BEGUN;                                                  \
			break;                                                                     \
		}                                                                                  \
		ipc_saved_ = PyEval_SaveThread();                                                  \
		(r) = (call);                                                                      \
		PyEval_RestoreThread(ipc_saved_);                                                  \
		ipc_call_end(self, c, r);                                                          \
	} while (0)

/* attach.c: Client.attach() and Client.attach_dict(). */
PyObject *ipc_client_attach(PyObject *obj, PyObject *args, PyObject *kwargs);
PyObject *ipc_client_attach_dict(PyObject *obj, PyObject *args, PyObject *kwargs);

/* publish.c: Client.publish() and Client.publish_dict(). */
PyObject *ipc_client_publish(PyObject *obj, PyObject *args, PyObject *kwargs);
PyObject *ipc_client_publish_dict(PyObject *obj, PyObject *args, PyObject *kwargs);

/* info.c: Client._list(), _channel_list() and stat(); a channel's info as a dict (for
 * _channel_open() and _channel_stat()). */
PyObject *ipc_channel_dict(const dlpc_channel_info *i);
PyObject *ipc_client_list(PyObject *obj, PyObject *args, PyObject *kwargs);
PyObject *ipc_client_stat(PyObject *obj, PyObject *unused);
PyObject *ipc_client_channel_list(PyObject *obj, PyObject *args, PyObject *kwargs);

/* channel.c: Client._channel_open(), _channel_remove(), _channel_stat(), _send(), _send_dict()
 * and _recv(), for dlpack_ipc.Channel. */
PyObject *ipc_client_channel_open(PyObject *obj, PyObject *args, PyObject *kwargs);
PyObject *ipc_client_channel_close(PyObject *obj, PyObject *args, PyObject *kwargs);
PyObject *ipc_client_channel_remove(PyObject *obj, PyObject *args, PyObject *kwargs);
PyObject *ipc_client_channel_stat(PyObject *obj, PyObject *args, PyObject *kwargs);
PyObject *ipc_client_send(PyObject *obj, PyObject *args, PyObject *kwargs);
PyObject *ipc_client_send_dict(PyObject *obj, PyObject *args, PyObject *kwargs);
PyObject *ipc_client_recv(PyObject *obj, PyObject *args, PyObject *kwargs);
PyObject *ipc_client_channel_empty(PyObject *obj, PyObject *args, PyObject *kwargs);

/* watch.c: the Watch type over dlpc_watch. */
extern PyType_Spec ipc_watch_spec;

/* tensor.c */
extern PyType_Spec ipc_tensor_spec;
/* Wrap @p t (owned) as a SharedTensor; on failure @p t is released. */
PyObject *ipc_tensor_new(ipc_state *st, DLManagedTensorVersioned *t, PyObject *name, PyObject *key,
			 int generation, bool allocated);
bool ipc_is_tensor(PyObject *o);
/* The tensor @p self holds, or NULL with BufferError when it was released. */
DLManagedTensorVersioned *ipc_tensor_live(TensorObject *self);
/* "float32", "bfloat16", ...; parse the reverse. */
PyObject *ipc_dtype_name(DLDataType dt);
int ipc_dtype_parse(PyObject *o, DLDataType *dt);
/* A shape (an int or a sequence of ints) into @p shape; ndim, or -1 with an exception set. */
int ipc_parse_shape(PyObject *o, int64_t shape[DLPC_NDIM_MAX]);
/* Install __dlpack_c_exchange_api__ on the SharedTensor type. */
int ipc_exchange_install(PyTypeObject *tp);

/* take.c: taking tensors from producers (DLPack, the buffer protocol, stand-ins) to publish. */
struct ipc_taken;
/*
 * Take the tensor @p obj holds: a SharedTensor, a DLPack capsule, what an object's __dlpack__
 * exports, or where that refuses, its buffer or a stand-in (take.c). Returns NULL with an
 * exception set. The producer's tensor is ours from the moment its capsule is renamed (or its
 * buffer taken): ipc_taken_finish() must run, with the GIL, on every path.
 */
struct ipc_taken *ipc_take(PyObject *obj);
/* The tensor to hand to dlpc_publish*(); its deleter may run without the GIL. */
DLManagedTensorVersioned *ipc_taken_tensor(struct ipc_taken *tk);
/* After dlpc_publish*() returned: run the producer's deleter (GIL held) and free @p tk. */
void ipc_taken_finish(struct ipc_taken *tk);
/* What ipc_take_call() hands the tensors to: a libdlpc call, run without the GIL. */
typedef int (*ipc_tensors_fn)(dlpc_client *c, const char *name, size_t n, const char *const *keys,
			      DLManagedTensorVersioned *const *tensors, void *arg);
/*
 * Take @p n objects as publish() takes them (@p keys: a bundle's, NULL for one tensor) and pass
 * their tensors to @p fn, Ctrl-C checked as in IPC_CALL(); every producer's deleter runs, with
 * the GIL, whatever happens. A failed take names the key ("cannot @p verb '@p name': tensor
 * 'key': ..."). 0 with fn's result in *@p ret, or -1 with an exception set (publish.c).
 */
int ipc_take_call(ClientObject *self, const char *verb, const char *name, Py_ssize_t n,
		  PyObject *const *objs, const char *const *keys, ipc_tensors_fn fn, void *arg,
		  int *ret);
/*
 * The UTF-8 of bundle key @p k (valid while @p k lives), or NULL with an exception set: a key is
 * a str of at most DLPC_KEY_MAX bytes without NUL, and the message names it ("cannot @p verb
 * '@p name': key ..."). The one check of publish_dict() and Channel.send_dict() (publish.c).
 */
const char *ipc_bundle_key(const char *verb, const char *name, PyObject *k);
/*
 * publish.c: the keys and objects of a mapping's @p items (ipc_mapping_items()) for
 * ipc_take_call(), each key checked by ipc_bundle_key(); valid while @p items lives. 0, or -1
 * with an exception; either way the caller frees *@p keys and *@p objs with PyMem_Free().
 */
int ipc_bundle_split(const char *verb, const char *name, PyObject *items, const char ***keys,
		     PyObject ***objs);
/* publish.c: the items of @p mapping, for publish_dict() (@p verb "publish") or send_dict()
 * ("send to channel"); NULL with TypeError naming the call where it is not a mapping. */
PyObject *ipc_mapping_items(const char *verb, const char *name, PyObject *mapping);
/* info.c: an entry's device as dlpackctl says it ("cpu", "cuda:N", "other") into @p buf. */
void ipc_device_text(DLDevice dev, char *buf, size_t len);

#endif
