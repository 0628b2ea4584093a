/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Taking tensors from DLPack producers (numpy, torch, capsules, our own SharedTensor) so that
 * libdlpc can publish them.
 *
 * libdlpc runs deleters from whatever thread publishes, and we publish without the GIL; many
 * producers' deleters need the GIL. So libdlpc is handed our own wrapper whose deleter does
 * nothing, and the producer's deleter runs afterwards, here, with the GIL held: exactly once on
 * every path.
 */
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

	meth = PyObject_GetAttrString(obj, "__dlpack__");
	if (!meth) {
		PyErr_Format(PyExc_TypeError,
			     "cannot publish a %.100s: it supports neither DLPack (__dlpack__) nor "
			     "is it a DLPack capsule",
			     Py_TYPE(obj)->tp_name);
		return NULL;
	}
	dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
	if (dev) {
		long type = PyTuple_Check(dev) && PyTuple_GET_SIZE(dev) == 2
				    ? PyLong_AsLong(PyTuple_GET_ITEM(dev, 0))
				    : -1;

		Py_DECREF(dev);
		if (type != kDLCPU) {
			Py_DECREF(meth);
			if (!PyErr_Occurred())
				PyErr_Format(
					PyExc_BufferError,
					"cannot publish a %.100s on DLPack device type %ld: only "
					"host (CPU) memory can be shared",
					Py_TYPE(obj)->tp_name, type);
			return NULL;
		}
	} else if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
		PyErr_Clear();
	} else {
		Py_DECREF(meth);
		return NULL;
	}
	args = PyTuple_New(0);
	kw = Py_BuildValue("{s:(ii)}", "max_version", DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION);
	cap = args && kw ? PyObject_Call(meth, args, kw) : NULL;
	Py_XDECREF(args);
	Py_XDECREF(kw);
	if (!cap && PyErr_ExceptionMatches(PyExc_TypeError)) {
		/* a producer from before DLPack 1.0 does not know max_version */
		PyErr_Clear();
		cap = PyObject_CallNoArgs(meth);
	}
	Py_DECREF(meth);
	return cap;
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

		PyErr_Clear();
		PyErr_Format(PyExc_BufferError,
			     "cannot publish: expected an unused DLPack capsule (\"dltensor\" or "
			     "\"dltensor_versioned\"), got %s%s%s",
			     name ? "a capsule named \"" : "a ",
			     name ? name : Py_TYPE(cap)->tp_name, name ? "\"" : "");
		Py_DECREF(cap);
		goto fail;
	}
	Py_DECREF(cap);
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
