/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Taking tensors from producers so that libdlpc can publish them: DLPack producers (numpy,
 * torch, capsules, our own SharedTensor), and where a producer refuses to export, the buffer
 * protocol or a stand-in (see take_object).
 *
 * libdlpc runs deleters from whatever thread publishes, and we publish without the GIL; many
 * producers' deleters need the GIL. So libdlpc is handed our own wrapper whose deleter does
 * nothing, and the producer's deleter runs afterwards, here, with the GIL held: exactly once on
 * every path. CUDA tensors are the exception (cuda_keep below): libdlpc may keep them (legacy
 * IPC, lent VMM memory) until the daemon reclaims the entry.
 */
#include <stdlib.h>
#include <string.h>

#include "dlpack_ipc.h"

static const char USED_VERSIONED[] = "used_dltensor_versioned";
static const char USED_LEGACY[] = "used_dltensor";

struct ipc_taken {
	DLManagedTensorVersioned v;	     /* what libdlpc sees: a view of the producer's */
	DLManagedTensor *legacy;	     /* the producer's tensor, when it was legacy... */
	DLManagedTensorVersioned *versioned; /* ...or versioned */
	DLManagedTensorVersioned *own;	     /* a libdlpc share, for a SharedTensor */
	bool handed;			     /* own went to libdlpc, which deletes it */
	bool has_buf;			     /* buf is held: the buffer protocol's fallback */
	Py_buffer buf;
	int64_t *dims; /* shape and strides (in elements) of buf, PyMem */
	void *packed;  /* buf copied C-contiguous where DLPack cannot say its strides, PyMem */
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
	PyObject *type, *value, *tb;

	/* a deleter may run Python code (ctypes, cffi): not with the caller's exception set */
	PyErr_Fetch(&type, &value, &tb);
	if (tk->own && !tk->handed)
		tk->own->deleter(tk->own);
	if (tk->legacy && tk->legacy->deleter)
		tk->legacy->deleter(tk->legacy);
	if (tk->versioned && tk->versioned->deleter)
		tk->versioned->deleter(tk->versioned);
	if (tk->has_buf)
		PyBuffer_Release(&tk->buf);
	PyMem_Free(tk->dims);
	PyMem_Free(tk->packed);
	PyMem_Free(tk);
	PyErr_Restore(type, value, tb);
}

/*
 * Ask @p obj for a capsule: __dlpack__(max_version=(1, 0)), or __dlpack__() if it is older.
 * *absent (where not NULL) says whether it failed for want of a __dlpack__.
 */
static PyObject *export_capsule(PyObject *obj, bool *absent)
{
	PyObject *meth, *dev, *args, *kw, *cap;
	bool cuda = false;

	meth = PyObject_GetAttrString(obj, "__dlpack__");
	if (absent)
		*absent = !meth && PyErr_ExceptionMatches(PyExc_AttributeError);
	if (!meth) {
		PyObject *tn = PyType_GetQualName(Py_TYPE(obj));

		if (tn)
			PyErr_Format(PyExc_TypeError,
				     "an object of type %U has no __dlpack__ method "
				     "and is not a DLPack capsule",
				     tn);
		Py_XDECREF(tn);
		return NULL;
	}
	dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
	if (dev) {
		PyObject *item = PyTuple_Check(dev) && PyTuple_Size(dev) == 2
					 ? PyTuple_GetItem(dev, 0)
					 : NULL;
		PyObject *tn = PyType_GetQualName(Py_TYPE(obj));
		long type = item && PyLong_Check(item) ? PyLong_AsLong(item) : -1;

		/* an index too large to be a device type is no device we know */
		if (tn && PyErr_Occurred())
			PyErr_Clear();
		if (tn && (!item || !PyLong_Check(item)))
			PyErr_Format(PyExc_TypeError,
				     "%U.__dlpack_device__() returned %R, not a (device type, "
				     "device id) pair of ints",
				     tn, dev);
		else if (tn && type != kDLCPU && type != kDLCUDA)
			PyErr_Format(
				PyExc_BufferError,
				"a tensor of type %U on DLPack device type %R: only host (CPU) "
				"and CUDA memory can be shared",
				tn, item);
		Py_XDECREF(tn);
		Py_DECREF(dev);
		if (PyErr_Occurred()) {
			Py_DECREF(meth);
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
static int cuda_keep(struct ipc_taken *tk, const DLTensor *src)
{
	struct cuda_keep *k = calloc(1, sizeof(*k));

	if (!k) {
		PyErr_NoMemory();
		return -1;
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
	return 0;
}

/*
 * Take the producer's tensor out of the unused DLPack capsule @p cap (a reference stolen), with
 * its dtype replaced by @p as where that is not NULL. 0, or -1 with an exception set.
 */
static int take_capsule(struct ipc_taken *tk, PyObject *cap, const DLDataType *as)
{
	const DLTensor *src;
	DLTensor t;

	/* From the rename on, the tensor is ours: ipc_taken_finish() runs its deleter. */
	if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
		tk->versioned = PyCapsule_GetPointer(cap, "dltensor_versioned");
		PyCapsule_SetName(cap, USED_VERSIONED);
		src = &tk->versioned->dl_tensor;
		tk->v.flags = tk->versioned->flags;
		if (tk->versioned->version.major != DLPACK_MAJOR_VERSION) {
			PyErr_Format(PyExc_BufferError,
				     "a DLPack %u.%u tensor: only major version %d "
				     "is understood",
				     tk->versioned->version.major, tk->versioned->version.minor,
				     DLPACK_MAJOR_VERSION);
			Py_DECREF(cap);
			return -1;
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
				     "expected an unused DLPack capsule "
				     "(\"dltensor\" or \"dltensor_versioned\"), got %s%U",
				     name ? "" : "a ", tn);
		Py_XDECREF(tn);
		Py_DECREF(cap);
		return -1;
	}
	Py_DECREF(cap);
	/* the producer's struct stays as it made it: the dtype goes into our copy */
	t = *src;
	if (as) {
		if (as->bits != t.dtype.bits || t.dtype.lanes != 1) {
			PyErr_SetString(PyExc_BufferError, "the producer's stand-in has another "
							   "element size");
			return -1;
		}
		t.dtype = *as;
	}
	if (t.device.device_type == kDLCUDA)
		return cuda_keep(tk, &t);
	tk->v.version.major = DLPACK_MAJOR_VERSION;
	tk->v.version.minor = DLPACK_MINOR_VERSION;
	tk->v.manager_ctx = tk;
	tk->v.deleter = noop_deleter;
	tk->v.dl_tensor = t;
	return 0;
}

/*
 * The DLPack type of the buffer-protocol format @p fmt with items of @p size bytes: native byte
 * order, one item per element, a size the format's kind can have. false for anything else
 * (structs, foreign byte order, object pointers, char, long double, a size a producer got
 * wrong), which DLPack cannot say.
 */
static bool buffer_dtype(const char *fmt, Py_ssize_t size, DLDataType *dt)
{
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
	static const char native = '<';
#else
	static const char native = '>';
#endif
	if (!fmt)
		fmt = "B"; /* plain bytes */
	if (*fmt == '@' || *fmt == '=' || *fmt == native)
		fmt++;
	if (size != 1 && size != 2 && size != 4 && size != 8 && size != 16)
		return false;
	*dt = (DLDataType){.bits = (uint8_t)(size * 8), .lanes = 1};
	if (strcmp(fmt, "?") == 0 && size == 1)
		dt->code = kDLBool;
	else if (fmt[0] && !fmt[1] && strchr("bhilqn", fmt[0]) && size <= 8)
		dt->code = kDLInt;
	else if (fmt[0] && !fmt[1] && strchr("BHILQN", fmt[0]) && size <= 8)
		dt->code = kDLUInt;
	else if ((strcmp(fmt, "e") == 0 && size == 2) || (strcmp(fmt, "f") == 0 && size == 4) ||
		 (strcmp(fmt, "d") == 0 && size == 8))
		dt->code = kDLFloat;
	else if ((strcmp(fmt, "Zf") == 0 && size == 8) || (strcmp(fmt, "Zd") == 0 && size == 16))
		dt->code = kDLComplex;
	else
		return false;
	return true;
}

/*
 * Why the buffer @p b of @p obj cannot be published as it says it is laid out, as a new
 * string: a producer's bug (the buffer protocol promises shape, and strides where asked for,
 * and a length that is the item size times the item count). NULL where it is sound, or with
 * an exception set.
 */
static PyObject *buffer_unsound(const Py_buffer *b)
{
	int64_t items = 1, n;

	if (b->itemsize <= 0)
		return PyUnicode_FromFormat("its item size is %zd", b->itemsize);
	if (b->ndim < 0 || b->ndim > DLPC_NDIM_MAX)
		return PyUnicode_FromFormat("it has %d dimensions (0 to %d can be published)",
					    b->ndim, DLPC_NDIM_MAX);
	if (b->ndim > 1 && !b->shape)
		return PyUnicode_FromFormat("it has %d dimensions and no shape", b->ndim);
	if (b->len < 0)
		return PyUnicode_FromFormat("its length is %zd", b->len);
	for (int i = 0; b->shape && i < b->ndim; i++) {
		if (b->shape[i] < 0)
			return PyUnicode_FromFormat("extent %d is %zd", i, b->shape[i]);
		/* a zero extent makes the product 0: it stays 0 */
		if (__builtin_mul_overflow(items, (int64_t)b->shape[i], &items))
			return PyUnicode_FromFormat("its shape's item count overflows 64 bits");
	}
	if (b->ndim == 1 && !b->shape)
		items = b->len / b->itemsize;
	if (__builtin_mul_overflow(items, (int64_t)b->itemsize, &n) || n != (int64_t)b->len)
		return PyUnicode_FromFormat("its length %zd is not its item size %zd times its "
					    "%lld items",
					    b->len, b->itemsize, (long long)items);
	return NULL;
}

/*
 * The buffer protocol's fallback for what DLPack would not export (numpy 1.x refuses read-only
 * arrays: np.load(mmap_mode="r"), np.frombuffer(bytes), np.broadcast_to(...)). The buffer is
 * held until the publish has copied it, like any host tensor; strides go along as they are (zero
 * and negative ones too), or, where they are not whole elements, the buffer is copied
 * C-contiguous first. A buffer without strides is C-contiguous; one without a shape (ndim 1)
 * is its length in items.
 *
 * 1 taken, 0 not applicable (no exception set; *why says, as a new string, why a buffer that
 * was there cannot be published, and *why_type which exception that is: TypeError for its
 * format or suboffsets, ValueError for a shape that does not add up), -1 with an exception.
 */
static int take_buffer(struct ipc_taken *tk, PyObject *obj, PyObject **why, PyObject **why_type)
{
	Py_buffer *b = &tk->buf;
	DLDataType dt;
	bool whole = true;
	int ndim;
	int64_t stride = 1;

	*why = NULL;
	if (!PyObject_CheckBuffer(obj))
		return 0;
	if (PyObject_GetBuffer(obj, b, PyBUF_RECORDS_RO) < 0) {
		PyErr_Clear();
		return 0;
	}
	*why = buffer_unsound(b);
	*why_type = PyExc_ValueError;
	if (!*why && !PyErr_Occurred())
		*why_type = PyExc_TypeError;
	if (!*why && !PyErr_Occurred() && b->suboffsets)
		*why = PyUnicode_FromString("it is an indirect buffer (suboffsets)");
	if (!*why && !PyErr_Occurred() && !buffer_dtype(b->format, b->itemsize, &dt))
		*why = PyUnicode_FromFormat("its format '%s' (item size %zd) has no DLPack "
					    "dtype",
					    b->format ? b->format : "B", b->itemsize);
	if (*why || PyErr_Occurred()) {
		PyBuffer_Release(b);
		return *why ? 0 : -1;
	}
	tk->has_buf = true;
	ndim = b->ndim;
	if (ndim > 0) {
		tk->dims = PyMem_Calloc(2 * (size_t)ndim, sizeof(*tk->dims));
		if (!tk->dims) {
			PyErr_NoMemory();
			return -1;
		}
	}
	/* from the last dimension: C-contiguous strides where the producer gave none */
	for (int i = ndim - 1; i >= 0; i--) {
		tk->dims[i] = b->shape ? b->shape[i] : b->len / b->itemsize;
		if (b->strides) {
			tk->dims[ndim + i] = b->strides[i] / b->itemsize;
			whole = whole && b->strides[i] % b->itemsize == 0;
		} else {
			tk->dims[ndim + i] = stride;
			/* no overflow: buffer_unsound() bounded the item count */
			stride *= tk->dims[i] ? tk->dims[i] : 1;
		}
	}
	tk->v.version.major = DLPACK_MAJOR_VERSION;
	tk->v.version.minor = DLPACK_MINOR_VERSION;
	tk->v.manager_ctx = tk;
	tk->v.deleter = noop_deleter;
	tk->v.flags = b->readonly ? DLPACK_FLAG_BITMASK_READ_ONLY : 0;
	tk->v.dl_tensor = (DLTensor){
		.data = b->buf,
		.device = {kDLCPU, 0},
		.ndim = ndim,
		.dtype = dt,
		.shape = ndim > 0 ? tk->dims : NULL,
		.strides = ndim > 0 ? tk->dims + ndim : NULL,
	};
	if (!whole) {
		/* e.g. a field of a numpy structured array: gather it here */
		tk->packed = PyMem_Malloc(b->len ? (size_t)b->len : 1);
		if (!tk->packed) {
			PyErr_NoMemory();
			return -1;
		}
		if (PyBuffer_ToContiguous(tk->packed, b, b->len, 'C') < 0)
			return -1;
		tk->v.dl_tensor.data = tk->packed;
		tk->v.dl_tensor.strides = NULL;
	}
	return 1;
}

/*
 * Ask dlpack_ipc._publishable() what stands in for @p obj, whose export failed: a new reference
 * to (substitute, dtype name or None), None where nothing does, NULL with an exception.
 */
static PyObject *stand_in(PyObject *obj)
{
	PyObject *mod = PyImport_ImportModule("dlpack_ipc"), *r;

	if (!mod)
		return NULL;
	r = PyObject_CallMethod(mod, "_publishable", "O", obj);
	Py_DECREF(mod);
	if (r && r != Py_None && (!PyTuple_Check(r) || PyTuple_Size(r) != 2)) {
		Py_DECREF(r);
		PyErr_SetString(PyExc_SystemError, "dlpack_ipc._publishable() returned no pair");
		return NULL;
	}
	return r;
}

/* Did the producer refuse to export (as opposed to failing in some other way)? */
static bool refused(void)
{
	return PyErr_ExceptionMatches(PyExc_BufferError) ||
	       PyErr_ExceptionMatches(PyExc_TypeError) ||
	       PyErr_ExceptionMatches(PyExc_RuntimeError) ||
	       PyErr_ExceptionMatches(PyExc_ValueError);
}

/*
 * Is @p obj an instance of @p attr of the module @p module? 1 yes, 0 no, -1 with an exception.
 * Costs nothing where @p module was never imported; 0 while it is still being imported (and has
 * no @p attr yet).
 */
static int instance_of_imported(PyObject *obj, const char *module, const char *attr)
{
	PyObject *name = PyUnicode_FromString(module), *m, *type;
	int r;

	if (!name)
		return -1;
	m = PyImport_GetModule(name);
	Py_DECREF(name);
	if (!m)
		return PyErr_Occurred() ? -1 : 0;
	type = PyObject_GetAttrString(m, attr);
	Py_DECREF(m);
	if (!type) {
		PyErr_Clear();
		return 0;
	}
	r = PyObject_IsInstance(obj, type);
	Py_DECREF(type);
	return r;
}

/*
 * Is @p obj a torch tensor with its negative bit set (a view such as x.conj().imag)? torch
 * exports those through DLPack without applying the bit: the values would come out negated.
 * 1 yes, 0 no, -1 with an exception. Costs nothing where torch was never imported.
 */
static int torch_negative(PyObject *obj)
{
	PyObject *neg;
	int r = instance_of_imported(obj, "torch", "Tensor");

	if (r <= 0)
		return r;
	neg = PyObject_CallMethod(obj, "is_neg", NULL);
	if (!neg) {
		/* a torch without the bit (before 1.10) */
		if (!PyErr_ExceptionMatches(PyExc_AttributeError))
			return -1;
		PyErr_Clear();
		return 0;
	}
	r = PyObject_IsTrue(neg);
	Py_DECREF(neg);
	return r;
}

/*
 * Publish what dlpack_ipc._publishable() says stands in for @p obj, whose export failed. 1 taken,
 * 0 nothing stands in (no exception set), -1 with an exception.
 */
static int take_object(struct ipc_taken *tk, PyObject *obj, bool ask);

static int take_stand_in(struct ipc_taken *tk, PyObject *obj)
{
	PyObject *sub = stand_in(obj), *cap;
	DLDataType as;
	int r;

	if (!sub)
		return -1;
	if (sub == Py_None) {
		Py_DECREF(sub);
		return 0;
	}
	if (PyTuple_GetItem(sub, 1) == Py_None) {
		r = take_object(tk, PyTuple_GetItem(sub, 0), false);
	} else if (ipc_dtype_parse(PyTuple_GetItem(sub, 1), &as) < 0) {
		r = -1;
	} else {
		/* the same bytes under another dtype: torch's uint8 view of a bool tensor */
		cap = export_capsule(PyTuple_GetItem(sub, 0), NULL);
		r = cap ? take_capsule(tk, cap, &as) : -1;
	}
	Py_DECREF(sub);
	return r < 0 ? -1 : 1;
}

/*
 * Is @p obj a numpy scalar? Its buffer is not always its value: a datetime64's or timedelta64's
 * is its 8 bytes as uint8. 1 yes, 0 no, -1 with an exception. Costs nothing where numpy was
 * never imported.
 */
static int numpy_scalar(PyObject *obj)
{
	return instance_of_imported(obj, "numpy", "generic");
}

/*
 * Take what @p obj exports through DLPack. Where it refuses, try in turn the buffer protocol
 * (not for a numpy scalar) and, if @p ask, the stand-in dlpack_ipc._publishable() names (a
 * torch tensor that requires grad, with the conjugate or negative bit, or of dtype bool where
 * torch has no DLPack bool; a numpy array in foreign byte order; a numpy scalar as a 0-d array;
 * an object with only __array_interface__). If none applies, the producer's own error stands;
 * for an object without __dlpack__, why its buffer would not do where it has one (TypeError
 * for a format or layout DLPack cannot say, ValueError for a shape that does not add up). 0, or
 * -1 with an exception set.
 */
static int take_object(struct ipc_taken *tk, PyObject *obj, bool ask)
{
	PyObject *cap, *type, *value, *tb, *why = NULL, *why_type = NULL;
	bool absent = false;
	int r = ask ? torch_negative(obj) : 0;

	if (r < 0)
		return -1;
	if (r > 0) {
		/* its export would succeed, with the wrong values: the stand-in applies the bit */
		r = take_stand_in(tk, obj);
		if (r == 0)
			PyErr_SetString(PyExc_BufferError,
					"a torch tensor with its negative bit set "
					"(call resolve_neg() first)");
		return r > 0 ? 0 : -1;
	}
	cap = export_capsule(obj, &absent);
	if (cap)
		return take_capsule(tk, cap, NULL);
	if (!refused())
		return -1;
	PyErr_Fetch(&type, &value, &tb);
	r = numpy_scalar(obj);
	if (r == 0)
		r = take_buffer(tk, obj, &why, &why_type);
	else if (r > 0)
		r = 0;
	if (r == 0 && ask)
		r = take_stand_in(tk, obj);
	if (r == 0 && absent && why) {
		/* no DLPack at all: what is wrong with its buffer says more than that */
		PyObject *tn = PyType_GetQualName(Py_TYPE(obj));

		if (tn)
			PyErr_Format(why_type,
				     "cannot take this %U through the buffer protocol: %U", tn,
				     why);
		Py_XDECREF(tn);
		r = -1;
	} else if (r == 0) {
		/* nothing stands in: the producer's reason is the one to see */
		Py_XDECREF(why);
		PyErr_Restore(type, value, tb);
		return -1;
	}
	Py_XDECREF(why);
	Py_XDECREF(type);
	Py_XDECREF(value);
	Py_XDECREF(tb);
	return r > 0 ? 0 : -1;
}

struct ipc_taken *ipc_take(PyObject *obj)
{
	struct ipc_taken *tk = PyMem_Calloc(1, sizeof(*tk));
	int r;

	if (!tk) {
		PyErr_NoMemory();
		return NULL;
	}
	if (ipc_is_tensor(obj)) {
		TensorObject *t = (TensorObject *)obj;

		if (!t->t) {
			PyErr_SetString(PyExc_BufferError, "the SharedTensor was released");
			PyMem_Free(tk);
			return NULL;
		}
		tk->own = dlpc_tensor_share(t->t);
		if (!tk->own) {
			PyMem_Free(tk);
			PyErr_NoMemory();
			return NULL;
		}
		return tk;
	}
	if (PyCapsule_CheckExact(obj))
		r = take_capsule(tk, Py_NewRef(obj), NULL);
	else
		r = take_object(tk, obj, true);
	if (r < 0) {
		ipc_taken_finish(tk);
		return NULL;
	}
	return tk;
}
