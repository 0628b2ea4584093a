/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Publishing: Client.publish() and publish_dict(), and taking tensors from DLPack producers
 * (numpy, torch, capsules, our own SharedTensor) so that libdlpc can publish them.
 *
 * libdlpc runs deleters from whatever thread publishes, and we publish without the GIL; many
 * producers' deleters need the GIL. So libdlpc is handed our own wrapper whose deleter does
 * nothing, and the producer's deleter runs afterwards, here, with the GIL held: exactly once on
 * every path. CUDA tensors are the exception (cuda_keep below): libdlpc may keep them (legacy
 * IPC, lent VMM memory) until the daemon reclaims the entry.
 */
#include <stdlib.h>

#include "dlpack_ipc.h"

static const char USED_VERSIONED[] = "used_dltensor_versioned";
static const char USED_LEGACY[] = "used_dltensor";

struct ipc_taken {
	DLManagedTensorVersioned v;	     /* what libdlpc sees: a view of the producer's */
	DLManagedTensor *legacy;	     /* the producer's tensor, when it was legacy... */
	DLManagedTensorVersioned *versioned; /* ...or versioned */
	DLManagedTensorVersioned *own;	     /* a libdlpc share, for a SharedTensor */
	bool handed;			     /* own went to libdlpc, which deletes it */
};

static void noop_deleter(DLManagedTensorVersioned *t)
{
	(void)t;
}

DLManagedTensorVersioned *ipc_taken_tensor(struct ipc_taken *tk)
{
	if (tk->own) {
		tk->handed = true;
		return tk->own;
	}
	return &tk->v;
}

void ipc_taken_finish(struct ipc_taken *tk)
{
	if (tk->own && !tk->handed)
		tk->own->deleter(tk->own);
	if (tk->legacy && tk->legacy->deleter)
		tk->legacy->deleter(tk->legacy);
	if (tk->versioned && tk->versioned->deleter)
		tk->versioned->deleter(tk->versioned);
	PyMem_Free(tk);
}

/* Ask @p obj for a capsule: __dlpack__(max_version=(1, 0)), or __dlpack__() if it is older. */
static PyObject *export_capsule(PyObject *obj)
{
	PyObject *meth, *dev, *args, *kw, *cap;
	bool cuda = false;

	meth = PyObject_GetAttrString(obj, "__dlpack__");
	if (!meth) {
		PyObject *tn = PyType_GetQualName(Py_TYPE(obj));

		if (tn)
			PyErr_Format(PyExc_TypeError,
				     "cannot publish a %U: it supports neither DLPack (__dlpack__) "
				     "nor is it a DLPack capsule",
				     tn);
		Py_XDECREF(tn);
		return NULL;
	}
	dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
	if (dev) {
		long type = PyTuple_Check(dev) && PyTuple_Size(dev) == 2
				    ? PyLong_AsLong(PyTuple_GetItem(dev, 0))
				    : -1;

		Py_DECREF(dev);
		if (type != kDLCPU && type != kDLCUDA) {
			PyObject *tn = PyErr_Occurred() ? NULL : PyType_GetQualName(Py_TYPE(obj));

			Py_DECREF(meth);
			if (tn)
				PyErr_Format(PyExc_BufferError,
					     "cannot publish a %U on DLPack device type %ld: only "
					     "host (CPU) and CUDA memory can be shared",
					     tn, type);
			Py_XDECREF(tn);
			return NULL;
		}
		cuda = type == kDLCUDA;
	} else if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
		PyErr_Clear();
	} else {
		Py_DECREF(meth);
		return NULL;
	}
	args = PyTuple_New(0);
	/* a CUDA producer orders its work before the legacy default stream (stream=1), on which
	 * libdlpc records the event attachers wait for */
	kw = cuda ? Py_BuildValue("{s:(ii),s:i}", "max_version", DLPACK_MAJOR_VERSION,
				  DLPACK_MINOR_VERSION, "stream", 1)
		  : Py_BuildValue("{s:(ii)}", "max_version", DLPACK_MAJOR_VERSION,
				  DLPACK_MINOR_VERSION);
	cap = args && kw ? PyObject_Call(meth, args, kw) : NULL;
	Py_XDECREF(args);
	Py_XDECREF(kw);
	if (!cap && PyErr_ExceptionMatches(PyExc_TypeError)) {
		/* a producer from before DLPack 1.0 does not know max_version; a CUDA one still
		 * orders its work before the legacy default stream */
		PyErr_Clear();
		if (cuda) {
			args = PyTuple_New(0);
			kw = Py_BuildValue("{s:i}", "stream", 1);
			cap = args && kw ? PyObject_Call(meth, args, kw) : NULL;
			Py_XDECREF(args);
			Py_XDECREF(kw);
		} else {
			cap = PyObject_CallNoArgs(meth);
		}
	}
	Py_DECREF(meth);
	return cap;
}

/*
 * A CUDA tensor published by legacy IPC, or lent as VMM memory, stays with libdlpc until the
 * daemon's RECLAIM notice, long after publish returns, and its deleter then runs on libdlpc's
 * reclaimer thread. So it gets a wrapper of its own (plain malloc: freed without the GIL) whose
 * deleter takes the GIL for the producer's deleter; libdlpc owns it from the publish on.
 */
struct cuda_keep {
	DLManagedTensorVersioned v;
	DLManagedTensor *legacy;
	DLManagedTensorVersioned *versioned;
};

static void cuda_keep_deleter(DLManagedTensorVersioned *t)
{
	struct cuda_keep *k = (struct cuda_keep *)t;
	PyGILState_STATE g;

	/* at interpreter exit the producer's memory goes with the process anyway */
	if (!Py_IsInitialized()) {
		free(k);
		return;
	}
	g = PyGILState_Ensure();
	if (k->legacy && k->legacy->deleter)
		k->legacy->deleter(k->legacy);
	if (k->versioned && k->versioned->deleter)
		k->versioned->deleter(k->versioned);
	PyGILState_Release(g);
	free(k);
}

/* Move the producer's CUDA tensor of @p tk into a cuda_keep, handed over as tk->own. */
static struct ipc_taken *cuda_keep(struct ipc_taken *tk, const DLTensor *src)
{
	struct cuda_keep *k = calloc(1, sizeof(*k));

	if (!k) {
		PyErr_NoMemory();
		ipc_taken_finish(tk);
		return NULL;
	}
	k->legacy = tk->legacy;
	k->versioned = tk->versioned;
	tk->legacy = NULL;
	tk->versioned = NULL;
	k->v.version.major = DLPACK_MAJOR_VERSION;
	k->v.version.minor = DLPACK_MINOR_VERSION;
	k->v.flags = tk->v.flags;
	k->v.manager_ctx = k;
	k->v.deleter = cuda_keep_deleter;
	k->v.dl_tensor = *src;
	tk->own = &k->v;
	return tk;
}

struct ipc_taken *ipc_take(PyObject *obj)
{
	struct ipc_taken *tk = PyMem_Calloc(1, sizeof(*tk));
	PyObject *cap;
	const DLTensor *src;

	if (!tk) {
		PyErr_NoMemory();
		return NULL;
	}
	if (ipc_is_tensor(obj)) {
		TensorObject *t = (TensorObject *)obj;

		if (!t->t) {
			PyErr_SetString(PyExc_BufferError,
					"cannot publish a released SharedTensor");
			goto fail;
		}
		tk->own = dlpc_tensor_share(t->t);
		if (!tk->own) {
			PyErr_NoMemory();
			goto fail;
		}
		return tk;
	}
	if (PyCapsule_CheckExact(obj)) {
		cap = Py_NewRef(obj);
	} else {
		cap = export_capsule(obj);
		if (!cap)
			goto fail;
	}
	/* From the rename on, the tensor is ours: every path below ends in its deleter. */
	if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
		tk->versioned = PyCapsule_GetPointer(cap, "dltensor_versioned");
		PyCapsule_SetName(cap, USED_VERSIONED);
		src = &tk->versioned->dl_tensor;
		tk->v.flags = tk->versioned->flags;
		if (tk->versioned->version.major != DLPACK_MAJOR_VERSION) {
			PyErr_Format(
				PyExc_BufferError,
				"cannot publish a DLPack %u.%u tensor: only major version %d is "
				"understood",
				tk->versioned->version.major, tk->versioned->version.minor,
				DLPACK_MAJOR_VERSION);
			Py_DECREF(cap);
			ipc_taken_finish(tk);
			return NULL;
		}
	} else if (PyCapsule_IsValid(cap, "dltensor")) {
		tk->legacy = PyCapsule_GetPointer(cap, "dltensor");
		PyCapsule_SetName(cap, USED_LEGACY);
		src = &tk->legacy->dl_tensor;
	} else {
		const char *name = PyCapsule_CheckExact(cap) ? PyCapsule_GetName(cap) : NULL;
		PyObject *tn;

		PyErr_Clear();
		tn = name ? PyUnicode_FromFormat("a capsule named \"%s\"", name)
			  : PyType_GetQualName(Py_TYPE(cap));
		if (tn)
			PyErr_Format(PyExc_BufferError,
				     "cannot publish: expected an unused DLPack capsule "
				     "(\"dltensor\" or \"dltensor_versioned\"), got %s%U",
				     name ? "" : "a ", tn);
		Py_XDECREF(tn);
		Py_DECREF(cap);
		goto fail;
	}
	Py_DECREF(cap);
	if (src->device.device_type == kDLCUDA)
		return cuda_keep(tk, src);
	tk->v.version.major = DLPACK_MAJOR_VERSION;
	tk->v.version.minor = DLPACK_MINOR_VERSION;
	tk->v.manager_ctx = tk;
	tk->v.deleter = noop_deleter;
	tk->v.dl_tensor = *src;
	return tk;
fail:
	PyMem_Free(tk);
	return NULL;
}

/* ---- Client.publish(), Client.publish_dict() ---- */

static uint32_t publish_flags(int replace, int ephemeral, int writable)
{
	return (replace ? DLPC_PUBLISH_REPLACE : 0) | (ephemeral ? DLPC_PUBLISH_EPHEMERAL : 0) |
	       (writable ? DLPC_PUBLISH_WRITABLE : 0);
}

/* Publish @p n objects, with @p keys (NULL: a single tensor). Returns the generation. */
static PyObject *publish_objects(ClientObject *self, const char *name, Py_ssize_t n,
				 PyObject *const *objs, const char *const *keys, uint32_t flags)
{
	dlpc_client *c = ipc_call_begin(self);
	struct ipc_taken **taken;
	DLManagedTensorVersioned **tensors;
	Py_ssize_t got = 0;
	int r = 0;

	if (!c)
		return NULL;
	taken = PyMem_Calloc((size_t)n + 1, sizeof(*taken));
	tensors = PyMem_Calloc((size_t)n + 1, sizeof(*tensors));
	if (!taken || !tensors) {
		PyMem_Free(taken);
		PyMem_Free(tensors);
		ipc_call_end(self, c, 0);
		return PyErr_NoMemory();
	}
	for (; got < n; got++) {
		taken[got] = ipc_take(objs[got]);
		if (!taken[got])
			break;
	}
	if (got == n) {
		/* only now does libdlpc own them: a failed take above leaves every one to
		 * ipc_taken_finish() */
		for (Py_ssize_t i = 0; i < n; i++)
			tensors[i] = ipc_taken_tensor(taken[i]);
		Py_BEGIN_ALLOW_THREADS
		if (keys)
			r = dlpc_publish_bundle(c, name, (size_t)n, keys, tensors, flags);
		else
			r = dlpc_publish(c, name, tensors[0], flags);
		Py_END_ALLOW_THREADS
	}
	/* the producers' deleters, with the GIL, whatever happened */
	for (Py_ssize_t i = 0; i < got; i++)
		ipc_taken_finish(taken[i]);
	PyMem_Free(taken);
	PyMem_Free(tensors);
	ipc_call_end(self, c, r);
	if (got < n)
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
	items = PyMapping_Items(mapping);
	if (!items)
		return NULL;
	n = PyList_Size(items);
	if (n == 0) {
		PyErr_SetString(PyExc_ValueError, "cannot publish an empty mapping");
		goto out;
	}
	keys = PyMem_Calloc((size_t)n, sizeof(*keys));
	objs = PyMem_Calloc((size_t)n, sizeof(*objs));
	if (!keys || !objs) {
		PyErr_NoMemory();
		goto out;
	}
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *kv = PyList_GetItem(items, i);
		PyObject *k = PyTuple_GetItem(kv, 0);

		if (!PyUnicode_Check(k)) {
			PyObject *tn = PyType_GetQualName(Py_TYPE(k));

			if (tn)
				PyErr_Format(PyExc_TypeError, "keys must be str, not %U", tn);
			Py_XDECREF(tn);
			goto out;
		}
		/* valid while items holds the key */
		keys[i] = PyUnicode_AsUTF8AndSize(k, NULL);
		if (!keys[i])
			goto out;
		objs[i] = PyTuple_GetItem(kv, 1);
	}
	r = publish_objects((ClientObject *)obj, name, n, objs, keys,
			    publish_flags(replace, ephemeral, writable));
out:
	PyMem_Free(keys);
	PyMem_Free(objs);
	Py_DECREF(items);
	return r;
}
