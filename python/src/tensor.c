/* SPDX-License-Identifier: Apache-2.0 */
/*
 * SharedTensor: a tensor attached from dlpackd (or allocated by empty()), exported through the
 * DLPack protocol. Every __dlpack__ call hands out a new libdlpc view of the same memory
 * (dlpc_tensor_share), so arrays made from it keep the mapping alive after the SharedTensor is
 * released or gone, and all deleters are plain C, safe without the GIL and at shutdown.
 */
#include <stdlib.h>
#include <string.h>

#include "dlpack_ipc.h"

static void tensor_dealloc(PyObject *self);

bool ipc_is_tensor(PyObject *o)
{
	return PyType_GetSlot(Py_TYPE(o), Py_tp_dealloc) == (void *)tensor_dealloc;
}

static const struct {
	uint8_t code, bits;
	const char *name;
} dtype_names[] = {
	{kDLBool, 8, "bool"},	     {kDLInt, 8, "int8"},	    {kDLInt, 16, "int16"},
	{kDLInt, 32, "int32"},	     {kDLInt, 64, "int64"},	    {kDLUInt, 8, "uint8"},
	{kDLUInt, 16, "uint16"},     {kDLUInt, 32, "uint32"},	    {kDLUInt, 64, "uint64"},
	{kDLFloat, 16, "float16"},   {kDLFloat, 32, "float32"},	    {kDLFloat, 64, "float64"},
	{kDLBfloat, 16, "bfloat16"}, {kDLComplex, 64, "complex64"}, {kDLComplex, 128, "complex128"},
};

PyObject *ipc_dtype_name(DLDataType dt)
{
	for (size_t i = 0; i < sizeof(dtype_names) / sizeof(dtype_names[0]); i++)
		if (dt.lanes == 1 && dt.code == dtype_names[i].code &&
		    dt.bits == dtype_names[i].bits)
			return PyUnicode_FromString(dtype_names[i].name);
	return PyUnicode_FromFormat("dlpack(code=%u, bits=%u, lanes=%u)", dt.code, dt.bits,
				    dt.lanes);
}

int ipc_dtype_parse(PyObject *o, DLDataType *dt)
{
	/* "float32", numpy.dtype("float32"), numpy.float32 (a type), torch.float32 */
	PyObject *s = PyUnicode_Check(o) ? Py_NewRef(o)
		      : PyType_Check(o)	 ? PyObject_GetAttrString(o, "__name__")
					 : PyObject_Str(o);
	const char *name = s ? PyUnicode_AsUTF8AndSize(s, NULL) : NULL;

	if (!name) {
		Py_XDECREF(s);
		return -1;
	}
	/* numpy dtypes print as "float32", torch dtypes as "torch.float32" */
	if (strncmp(name, "torch.", 6) == 0)
		name += 6;
	for (size_t i = 0; i < sizeof(dtype_names) / sizeof(dtype_names[0]); i++)
		if (strcmp(name, dtype_names[i].name) == 0) {
			dt->code = dtype_names[i].code;
			dt->bits = dtype_names[i].bits;
			dt->lanes = 1;
			Py_DECREF(s);
			return 0;
		}
	PyErr_Format(PyExc_ValueError, "unknown dtype %R", o);
	Py_DECREF(s);
	return -1;
}

static uint64_t tensor_nbytes(const DLTensor *t)
{
	uint64_t n = (uint64_t)t->dtype.bits * t->dtype.lanes;

	for (int i = 0; i < t->ndim; i++)
		n *= (uint64_t)t->shape[i];
	return (n + 7) / 8;
}

PyObject *ipc_tensor_new(ipc_state *st, DLManagedTensorVersioned *t, PyObject *name, PyObject *key,
			 int generation, bool allocated)
{
	TensorObject *self = PyObject_New(TensorObject, st->tensor_type);

	if (!self) {
		t->deleter(t);
		return NULL;
	}
	self->t = t;
	self->name = Py_NewRef(name);
	self->key = Py_NewRef(key);
	self->generation = generation;
	self->allocated = allocated;
	self->mode = NULL;
	self->has_owner = false;
	self->owner_uid = 0;
	self->owner_pid = 0;
	self->legacy_ordered = false;
	return (PyObject *)self;
}

/* Drop the tensor this object holds. Views already exported keep the memory. */
static void tensor_drop(TensorObject *self)
{
	DLManagedTensorVersioned *t = self->t;

	self->t = NULL;
	if (t)
		t->deleter(t);
}

static void tensor_dealloc(PyObject *obj)
{
	TensorObject *self = (TensorObject *)obj;
	PyTypeObject *tp = Py_TYPE(obj);

	tensor_drop(self);
	Py_XDECREF(self->name);
	Py_XDECREF(self->key);
	PyObject_Free(obj);
	Py_DECREF(tp);
}

DLManagedTensorVersioned *ipc_tensor_live(TensorObject *self)
{
	if (!self->t)
		PyErr_Format(PyExc_BufferError, "SharedTensor %R was released", self->name);
	return self->t;
}

/*
 * Is @p t's memory read-only? Asked of libdlpc, not read from t->flags: memory from empty()
 * that libdlpc sealed read-only (on publishing it, even if the daemon then refused) is frozen
 * after t was made, and only shares made since carry the flag.
 */
static bool readonly(const DLManagedTensorVersioned *t)
{
	DLManagedTensorVersioned *s = dlpc_tensor_share(t);
	bool ro = s ? (s->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0
		    : (t->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;

	if (s)
		s->deleter(s);
	return ro;
}

/* ---- DLPack export ---- */

static void versioned_capsule_free(PyObject *cap)
{
	if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
		DLManagedTensorVersioned *t = PyCapsule_GetPointer(cap, "dltensor_versioned");

		if (t->deleter)
			t->deleter(t);
	}
}

static void legacy_capsule_free(PyObject *cap)
{
	if (PyCapsule_IsValid(cap, "dltensor")) {
		DLManagedTensor *t = PyCapsule_GetPointer(cap, "dltensor");

		if (t->deleter)
			t->deleter(t);
	}
}

/* A private, writable, C-contiguous copy of @p src, flagged IS_COPIED. */
struct copy {
	DLManagedTensorVersioned t;
	void *data;
	int64_t dims[];
};

static void copy_deleter(DLManagedTensorVersioned *t)
{
	struct copy *c = (struct copy *)t;

	free(c->data);
	free(c);
}

static DLManagedTensorVersioned *make_copy(const DLManagedTensorVersioned *src)
{
	int ndim = src->dl_tensor.ndim;
	struct copy *c = malloc(sizeof(*c) + 2 * (size_t)ndim * sizeof(int64_t));
	uint64_t n = tensor_nbytes(&src->dl_tensor);

	if (!c || posix_memalign(&c->data, DLPC_ALIGN, n ? n : 1) != 0) {
		free(c);
		return NULL;
	}
	memcpy(c->data, src->dl_tensor.data, n);
	memcpy(c->dims, src->dl_tensor.shape, (size_t)ndim * sizeof(int64_t));
	if (ndim > 0)
		memcpy(c->dims + ndim, src->dl_tensor.strides, (size_t)ndim * sizeof(int64_t));
	c->t = *src;
	c->t.manager_ctx = c;
	c->t.deleter = copy_deleter;
	c->t.flags = DLPACK_FLAG_BITMASK_IS_COPIED;
	c->t.dl_tensor.data = c->data;
	c->t.dl_tensor.shape = c->dims;
	c->t.dl_tensor.strides = ndim > 0 ? c->dims + ndim : NULL;
	return &c->t;
}

/* Read an optional (int, int) tuple; 1 if present, 0 if None, -1 with an exception. */
static int int_pair(PyObject *o, const char *what, long *a, long *b)
{
	if (!o || o == Py_None)
		return 0;
	if (!PyTuple_Check(o) || PyTuple_Size(o) != 2) {
		PyErr_Format(PyExc_TypeError, "%s must be a tuple of two integers, not %R", what,
			     o);
		return -1;
	}
	*a = PyLong_AsLong(PyTuple_GetItem(o, 0));
	*b = PyLong_AsLong(PyTuple_GetItem(o, 1));
	return PyErr_Occurred() ? -1 : 1;
}

/*
 * Make the consumer's stream wait for the publisher of the CUDA tensor @p t, as DLPack's
 * __dlpack__(stream=...) asks: None or 1 the legacy default stream, 2 the per-thread default
 * stream, -1 no synchronization, 0 refused (ambiguous), any other integer a CUstream pointer.
 * The host never waits. 0, or -1 with an exception.
 */
static int order_stream(TensorObject *self, const DLManagedTensorVersioned *t, PyObject *stream)
{
	long long s = 1;
	int r;

	if (stream != Py_None) {
		s = PyLong_AsLongLong(stream);
		if (s == -1 && PyErr_Occurred()) {
			PyErr_Clear();
			PyErr_Format(PyExc_TypeError, "stream must be None or an integer, not %R",
				     stream);
			return -1;
		}
	}
	if (s == -1)
		return 0;
	if (s == 0 || s < -1) {
		PyErr_Format(PyExc_ValueError,
			     "stream %lld is not allowed for CUDA: use 1 (legacy default), 2 "
			     "(per-thread default), -1 (no synchronization) or a stream pointer",
			     s);
		return -1;
	}
	Py_BEGIN_ALLOW_THREADS
	r = dlpc_tensor_wait(t, (void *)(uintptr_t)s);
	Py_END_ALLOW_THREADS
	if (r < 0) {
		ipc_raise(r);
		return -1;
	}
	(void)self;
	return 0;
}

static PyObject *tensor_dlpack(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
	TensorObject *self = (TensorObject *)obj;
	PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
	DLManagedTensorVersioned *base, *out;
	long major = 0, minor = 0, dev_type, dev_id;
	int versioned, r;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|$OOOO:__dlpack__", kwlist, &stream,
					 &max_version, &dl_device, &copy))
		return NULL;
	base = ipc_tensor_live(self);
	if (!base)
		return NULL;
	/* a handle of this call's own, handed out as the capsule's: reading the arguments runs
	 * Python code (__index__), and the stream wait lets other threads run, and either may
	 * release() self meanwhile */
	base = dlpc_tensor_share(base);
	if (!base)
		return PyErr_NoMemory();
	if (base->dl_tensor.device.device_type == kDLCUDA) {
		if (copy == Py_True) {
			PyErr_Format(PyExc_BufferError,
				     "SharedTensor %R lives on a CUDA device; copy=True is not "
				     "supported (the memory is shared in place)",
				     self->name);
			goto fail;
		}
	} else if (stream != Py_None) {
		PyErr_SetString(PyExc_BufferError,
				"stream must be None for a tensor in host (CPU) memory");
		goto fail;
	}
	versioned = int_pair(max_version, "max_version", &major, &minor);
	if (versioned < 0)
		goto fail;
	r = int_pair(dl_device, "dl_device", &dev_type, &dev_id);
	if (r < 0)
		goto fail;
	if (r > 0 && (dev_type != base->dl_tensor.device.device_type ||
		      dev_id != base->dl_tensor.device.device_id)) {
		PyErr_Format(PyExc_BufferError,
			     "SharedTensor %R lives on device (%d, %d) and cannot be exported to "
			     "(%ld, %ld)",
			     self->name, (int)base->dl_tensor.device.device_type,
			     base->dl_tensor.device.device_id, dev_type, dev_id);
		goto fail;
	}
	if (copy != Py_None && copy != Py_True && copy != Py_False) {
		PyErr_Format(PyExc_TypeError, "copy must be None, True or False, not %R", copy);
		goto fail;
	}
	if (base->dl_tensor.device.device_type == kDLCUDA && order_stream(self, base, stream) < 0)
		goto fail;
	if (copy == Py_True) {
		out = make_copy(base);
		base->deleter(base);
		if (!out)
			return PyErr_NoMemory();
	} else {
		out = base;
	}
	if (versioned && major >= 1)
		return PyCapsule_New(out, "dltensor_versioned", versioned_capsule_free);
	/* a consumer from before DLPack 1.0: the legacy struct, which cannot say read-only */
	DLManagedTensor *legacy = dlpc_to_legacy(out);

	if (!legacy)
		return PyErr_NoMemory();
	return PyCapsule_New(legacy, "dltensor", legacy_capsule_free);
fail:
	base->deleter(base);
	return NULL;
}

/*
 * SharedTensor.torch(): torch.from_dlpack(self); for a bool tensor where this torch cannot
 * import DLPack's bool (torch 1.x), the same memory imported as uint8 and viewed as torch.bool.
 * Zero-copy either way.
 */
static PyObject *tensor_torch(PyObject *obj, PyObject *unused)
{
	TensorObject *self = (TensorObject *)obj;
	DLManagedTensorVersioned *t = ipc_tensor_live(self), *share;
	PyObject *torch, *r, *cap, *u8, *dt;
	DLManagedTensor *legacy;

	(void)unused;
	if (!t)
		return NULL;
	torch = PyImport_ImportModule("torch");
	if (!torch)
		return NULL;
	r = PyObject_CallMethod(torch, "from_dlpack", "O", obj);
	/* from_dlpack ran Python code, which may have released self: t is read again */
	t = self->t;
	if (r || !t || t->dl_tensor.dtype.code != kDLBool ||
	    !(PyErr_ExceptionMatches(PyExc_RuntimeError) ||
	      PyErr_ExceptionMatches(PyExc_BufferError) ||
	      PyErr_ExceptionMatches(PyExc_TypeError) ||
	      PyErr_ExceptionMatches(PyExc_ValueError))) {
		Py_DECREF(torch);
		return r;
	}
	PyErr_Clear();
	/* a handle of its own before anything else can run (the stream wait lets threads run) */
	share = dlpc_tensor_share(t);
	if (!share) {
		PyErr_NoMemory();
		goto out;
	}
	/* what __dlpack__(stream=None) orders for a CUDA tensor: the legacy default stream */
	if (share->dl_tensor.device.device_type == kDLCUDA &&
	    order_stream(self, share, Py_None) < 0) {
		share->deleter(share);
		goto out;
	}
	legacy = dlpc_to_legacy(share);
	if (!legacy) {
		PyErr_NoMemory();
		goto out;
	}
	legacy->dl_tensor.dtype = (DLDataType){kDLUInt, 8, 1};
	cap = PyCapsule_New(legacy, "dltensor", legacy_capsule_free);
	if (!cap) {
		legacy->deleter(legacy);
		goto out;
	}
	u8 = PyObject_CallMethod(torch, "from_dlpack", "O", cap);
	Py_DECREF(cap);
	dt = u8 ? PyObject_GetAttrString(torch, "bool") : NULL;
	r = dt ? PyObject_CallMethod(u8, "view", "O", dt) : NULL;
	Py_XDECREF(dt);
	Py_XDECREF(u8);
out:
	Py_DECREF(torch);
	return r;
}

static PyObject *tensor_dlpack_device(PyObject *obj, PyObject *unused)
{
	DLManagedTensorVersioned *t = ipc_tensor_live((TensorObject *)obj);

	(void)unused;
	if (!t)
		return NULL;
	return Py_BuildValue("(ii)", (int)t->dl_tensor.device.device_type,
			     t->dl_tensor.device.device_id);
}

static PyObject *tensor_release(PyObject *obj, PyObject *unused)
{
	(void)unused;
	tensor_drop((TensorObject *)obj);
	Py_RETURN_NONE;
}

static PyObject *tensor_enter(PyObject *obj, PyObject *unused)
{
	(void)unused;
	return Py_NewRef(obj);
}

static PyObject *tensor_exit(PyObject *obj, PyObject *args)
{
	(void)args;
	tensor_drop((TensorObject *)obj);
	Py_RETURN_FALSE;
}

/* ---- the buffer protocol: np.asarray(t), memoryview(t); writable for empty() memory ---- */

/* What a buffer export owns: its own view of the memory, and shape/strides in Py_ssize_t. */
struct buffer_hold {
	DLManagedTensorVersioned *share;
	Py_ssize_t dims[];
};

static const char *buffer_format(DLDataType dt)
{
	static const struct {
		uint8_t code, bits;
		const char *fmt;
	} formats[] = {
		{kDLBool, 8, "?"},	{kDLInt, 8, "b"},	 {kDLInt, 16, "h"},
		{kDLInt, 32, "i"},	{kDLInt, 64, "q"},	 {kDLUInt, 8, "B"},
		{kDLUInt, 16, "H"},	{kDLUInt, 32, "I"},	 {kDLUInt, 64, "Q"},
		{kDLFloat, 16, "e"},	{kDLFloat, 32, "f"},	 {kDLFloat, 64, "d"},
		{kDLComplex, 64, "Zf"}, {kDLComplex, 128, "Zd"},
	};

	for (size_t i = 0; i < sizeof(formats) / sizeof(formats[0]); i++)
		if (dt.lanes == 1 && dt.code == formats[i].code && dt.bits == formats[i].bits)
			return formats[i].fmt;
	return NULL;
}

static int tensor_getbuffer(PyObject *obj, Py_buffer *view, int flags)
{
	TensorObject *self = (TensorObject *)obj;
	DLManagedTensorVersioned *t = ipc_tensor_live(self);
	const char *fmt;
	struct buffer_hold *h;
	int ndim;

	if (!t)
		return -1;
	if (t->dl_tensor.device.device_type != kDLCPU) {
		PyErr_Format(PyExc_BufferError,
			     "SharedTensor %R lives on a CUDA device: no buffer protocol; use "
			     "__dlpack__ (torch.from_dlpack, cupy.from_dlpack)",
			     self->name);
		return -1;
	}
	ndim = t->dl_tensor.ndim;
	fmt = buffer_format(t->dl_tensor.dtype);
	if (!fmt) {
		PyErr_Format(PyExc_BufferError,
			     "SharedTensor %R: dtype has no buffer format; use __dlpack__",
			     self->name);
		return -1;
	}
	h = PyMem_Malloc(sizeof(*h) + 2 * (size_t)ndim * sizeof(Py_ssize_t));
	if (!h) {
		PyErr_NoMemory();
		return -1;
	}
	/* The buffer keeps the memory on its own: release() of the tensor does not unmap it.
	 * The share's flags are current (memory frozen since t was made says so). */
	h->share = dlpc_tensor_share(t);
	if (!h->share) {
		PyMem_Free(h);
		PyErr_NoMemory();
		return -1;
	}
	if ((flags & PyBUF_WRITABLE) && (h->share->flags & DLPACK_FLAG_BITMASK_READ_ONLY)) {
		h->share->deleter(h->share);
		PyMem_Free(h);
		PyErr_Format(PyExc_BufferError, "SharedTensor %R is read-only", self->name);
		return -1;
	}
	for (int i = 0; i < ndim; i++) {
		h->dims[i] = (Py_ssize_t)t->dl_tensor.shape[i];
		h->dims[ndim + i] =
			(Py_ssize_t)(t->dl_tensor.strides[i] * (t->dl_tensor.dtype.bits / 8));
	}
	view->buf = t->dl_tensor.data;
	view->obj = Py_NewRef(obj);
	view->len = (Py_ssize_t)tensor_nbytes(&t->dl_tensor);
	view->readonly = (h->share->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
	view->itemsize = t->dl_tensor.dtype.bits / 8;
	view->format = (flags & PyBUF_FORMAT) ? (char *)fmt : NULL;
	view->ndim = ndim;
	view->shape = (flags & PyBUF_ND) ? h->dims : NULL;
	view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? h->dims + ndim : NULL;
	view->suboffsets = NULL;
	view->internal = h;
	return 0;
}

static void tensor_releasebuffer(PyObject *obj, Py_buffer *view)
{
	struct buffer_hold *h = view->internal;

	(void)obj;
	h->share->deleter(h->share);
	PyMem_Free(h);
}

/* ---- attributes ---- */

static PyObject *get_name(PyObject *obj, void *closure)
{
	(void)closure;
	return Py_NewRef(((TensorObject *)obj)->name);
}

static PyObject *get_key(PyObject *obj, void *closure)
{
	(void)closure;
	return Py_NewRef(((TensorObject *)obj)->key);
}

static PyObject *get_generation(PyObject *obj, void *closure)
{
	(void)closure;
	return PyLong_FromLong(((TensorObject *)obj)->generation);
}

static PyObject *get_mode(PyObject *obj, void *closure)
{
	const char *mode = ((TensorObject *)obj)->mode;

	(void)closure;
	return mode ? PyUnicode_FromString(mode) : Py_NewRef(Py_None);
}

/* dlpack_ipc.Owner(uid, pid) of the publisher, or None where it is not known. */
static PyObject *get_owner(PyObject *obj, void *closure)
{
	TensorObject *self = (TensorObject *)obj;
	PyObject *mod, *owner;

	(void)closure;
	if (!self->has_owner)
		Py_RETURN_NONE;
	/* the namedtuple lives in the package's Python part, beside list()'s and watch()'s */
	mod = PyImport_ImportModule("dlpack_ipc");
	if (!mod)
		return NULL;
	owner = PyObject_CallMethod(mod, "Owner", "(kl)", (unsigned long)self->owner_uid,
				    (long)self->owner_pid);
	Py_DECREF(mod);
	return owner;
}

static PyObject *get_shape(PyObject *obj, void *closure)
{
	DLManagedTensorVersioned *t = ipc_tensor_live((TensorObject *)obj);
	PyObject *shape;

	(void)closure;
	if (!t)
		return NULL;
	shape = PyTuple_New(t->dl_tensor.ndim);
	for (int i = 0; shape && i < t->dl_tensor.ndim; i++) {
		PyObject *extent = PyLong_FromLongLong(t->dl_tensor.shape[i]);

		if (!extent || PyTuple_SetItem(shape, i, extent) < 0)
			Py_CLEAR(shape);
	}
	return shape;
}

static PyObject *get_dtype(PyObject *obj, void *closure)
{
	DLManagedTensorVersioned *t = ipc_tensor_live((TensorObject *)obj);

	(void)closure;
	return t ? ipc_dtype_name(t->dl_tensor.dtype) : NULL;
}

static PyObject *get_device(PyObject *obj, void *closure)
{
	DLManagedTensorVersioned *t = ipc_tensor_live((TensorObject *)obj);

	(void)closure;
	if (!t)
		return NULL;
	if (t->dl_tensor.device.device_type == kDLCPU)
		return PyUnicode_FromString("cpu");
	if (t->dl_tensor.device.device_type == kDLCUDA)
		return PyUnicode_FromFormat("cuda:%d", t->dl_tensor.device.device_id);
	return PyUnicode_FromFormat("dlpack:%d:%d", (int)t->dl_tensor.device.device_type,
				    t->dl_tensor.device.device_id);
}

static PyObject *get_nbytes(PyObject *obj, void *closure)
{
	DLManagedTensorVersioned *t = ipc_tensor_live((TensorObject *)obj);

	(void)closure;
	return t ? PyLong_FromUnsignedLongLong(tensor_nbytes(&t->dl_tensor)) : NULL;
}

static PyObject *get_readonly(PyObject *obj, void *closure)
{
	DLManagedTensorVersioned *t = ipc_tensor_live((TensorObject *)obj);

	(void)closure;
	return t ? PyBool_FromLong(readonly(t)) : NULL;
}

static PyObject *get_data_ptr(PyObject *obj, void *closure)
{
	DLManagedTensorVersioned *t = ipc_tensor_live((TensorObject *)obj);

	(void)closure;
	return t ? PyLong_FromVoidPtr(t->dl_tensor.data) : NULL;
}

static PyObject *get_released(PyObject *obj, void *closure)
{
	(void)closure;
	return PyBool_FromLong(((TensorObject *)obj)->t == NULL);
}

static PyObject *tensor_repr(PyObject *obj)
{
	TensorObject *self = (TensorObject *)obj;
	DLManagedTensorVersioned *t = self->t;
	PyObject *dtype, *dims, *r;

	if (!t)
		return PyUnicode_FromFormat("<SharedTensor %R key=%R, released>", self->name,
					    self->key);
	dtype = ipc_dtype_name(t->dl_tensor.dtype);
	dims = get_shape(obj, NULL);
	r = dtype && dims
		    ? PyUnicode_FromFormat("<SharedTensor %R key=%R %U%R generation=%d%s>",
					   self->name, self->key, dtype, dims, self->generation,
					   readonly(t) ? " read-only" : " writable")
		    : NULL;
	Py_XDECREF(dtype);
	Py_XDECREF(dims);
	return r;
}

static PyMethodDef tensor_methods[] = {
	{"__dlpack__", (PyCFunction)(void (*)(void))tensor_dlpack, METH_VARARGS | METH_KEYWORDS,
	 "__dlpack__($self, /, *, stream=None, max_version=None, dl_device=None, copy=None)\n--\n\n"
	 "Export as a DLPack capsule: a legacy \"dltensor\" unless max_version is (1, x) or "
	 "later."},
	{"__dlpack_device__", tensor_dlpack_device, METH_NOARGS,
	 "__dlpack_device__($self, /)\n--\n\nThe (device type, device id) pair of the tensor."},
	{"torch", tensor_torch, METH_NOARGS,
	 "torch($self, /)\n--\n\n"
	 "The tensor as a torch.Tensor over the same memory: torch.from_dlpack(self), except "
	 "that a bool tensor, which torch before 2.x cannot import through DLPack, is imported "
	 "as uint8 and viewed as torch.bool. torch ignores the read-only flag (see attach's "
	 "mode)."},
	{"release", tensor_release, METH_NOARGS,
	 "release($self, /)\n--\n\nDrop this object's hold on the memory. Arrays already made from "
	 "it keep "
	 "theirs. Idempotent."},
	{"__enter__", tensor_enter, METH_NOARGS, NULL},
	{"__exit__", tensor_exit, METH_VARARGS, NULL},
	{NULL},
};

static PyGetSetDef tensor_getset[] = {
	{"name", get_name, NULL, "the entry's name (None for unpublished empty() memory)", NULL},
	{"key", get_key, NULL, "the key inside the bundle (\"\" for a single tensor)", NULL},
	{"generation", get_generation, NULL, "the entry's generation when attached", NULL},
	{"mode", get_mode, NULL,
	 "how it was attached: \"read\", \"private\", \"strict\" or \"write\" (None for empty() "
	 "memory)",
	 NULL},
	{"owner", get_owner, NULL,
	 "Owner(uid, pid) of the process that published the attached entry (None for empty() "
	 "memory)",
	 NULL},
	{"shape", get_shape, NULL, "extents, as a tuple", NULL},
	{"dtype", get_dtype, NULL, "element type, numpy-style (\"bfloat16\" where numpy has none)",
	 NULL},
	{"device", get_device, NULL, "\"cpu\", or \"cuda:N\" (N: this process's ordinal)", NULL},
	{"nbytes", get_nbytes, NULL, "bytes of data", NULL},
	{"readonly", get_readonly, NULL,
	 "whether the tensor is exported read-only (DLPack's flag; the buffer protocol refuses "
	 "writes). In mode \"read\" the memory is still mapped copy-on-write",
	 NULL},
	{"data_ptr", get_data_ptr, NULL, "address of the first element", NULL},
	{"released", get_released, NULL, "whether release() was called", NULL},
	{NULL},
};

static PyType_Slot tensor_slots[] = {
	{Py_tp_dealloc, tensor_dealloc},
	{Py_tp_repr, tensor_repr},
	{Py_tp_methods, tensor_methods},
	{Py_tp_getset, tensor_getset},
	{Py_bf_getbuffer, tensor_getbuffer},
	{Py_bf_releasebuffer, tensor_releasebuffer},
	{Py_tp_doc, "A tensor shared through dlpackd. Hand it to numpy.from_dlpack or "
		    "torch.from_dlpack; they view the same memory."},
	{0, NULL},
};

PyType_Spec ipc_tensor_spec = {
	.name = "dlpack_ipc.SharedTensor",
	.basicsize = sizeof(TensorObject),
	/* not Py_TPFLAGS_IMMUTABLETYPE: ipc_exchange_install() sets a class attribute */
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
	.slots = tensor_slots,
};

/* An int or a sequence of ints >= 0 into @p shape (DLPC_NDIM_MAX of them at most). The number
 * of dimensions, or -1 with an exception. */
int ipc_parse_shape(PyObject *shape_o, int64_t shape[DLPC_NDIM_MAX])
{
	PyObject *seq = PyLong_Check(shape_o)
				? PyTuple_Pack(1, shape_o)
				: PySequence_Fast(shape_o, "shape must be a sequence of ints");
	Py_ssize_t ndim;

	if (!seq)
		return -1;
	ndim = PySequence_Size(seq);
	if (ndim > DLPC_NDIM_MAX) {
		Py_DECREF(seq);
		PyErr_Format(PyExc_ValueError, "shape has %zd dimensions; at most %d", ndim,
			     DLPC_NDIM_MAX);
		return -1;
	}
	for (Py_ssize_t i = 0; i < ndim; i++) {
		PyObject *extent = PySequence_GetItem(seq, i);

		shape[i] = extent ? PyLong_AsLongLong(extent) : -1;
		Py_XDECREF(extent);
		if (shape[i] < 0 && !PyErr_Occurred())
			PyErr_SetString(PyExc_ValueError, "shape extents must be >= 0");
		if (PyErr_Occurred()) {
			Py_DECREF(seq);
			return -1;
		}
	}
	Py_DECREF(seq);
	return (int)ndim;
}
