/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The DLPack C exchange API on SharedTensor: a type-level capsule "dlpack_exchange_api" whose
 * functions convert SharedTensors without calling Python methods.
 */
#include <errno.h>

#include "dlpack_ipc.h"
#include "exchange.h"

static PyTypeObject *exchange_type; /* SharedTensor type the table creates objects of */

static int x_allocator(DLTensor *proto, DLManagedTensorVersioned **out, void *error_ctx,
		       void (*set_error)(void *, const char *, const char *))
{
	int r = dlpc_alloc(NULL, proto->device, proto->dtype, proto->ndim, proto->shape, out);

	if (r < 0) {
		set_error(error_ctx, r == -ENOMEM ? "MemoryError" : "BufferError",
			  dlpc_last_error());
		return -1;
	}
	return 0;
}

/*
 * A consumer of the exchange API launches its work on the stream current_work_stream() gives:
 * NULL, the legacy default stream, for CUDA. Order that stream after the publisher of a CUDA
 * tensor (a device-side wait, as __dlpack__(stream=None) does), so that the "no sync" exports
 * never hand out memory before the publisher's work on it is done. Once per tensor: stream
 * order lasts, and exports are meant to be cheap. While a blocking stream captures a graph the
 * legacy stream cannot be used, so the first export of a tensor fails then, saying so.
 * 0, or -1 with an exception.
 */
static int order_for_consumer(TensorObject *self, const DLManagedTensorVersioned *t)
{
	int r;

	if (t->dl_tensor.device.device_type != kDLCUDA || self->legacy_ordered)
		return 0;
	r = dlpc_tensor_wait(t, (void *)(uintptr_t)1 /* CU_STREAM_LEGACY */);
	/* a forked child (EBADFD), no driver (ENODEV): as for every GPU call */
	if (r < 0 && r != -EIO) {
		ipc_raise(r);
		return -1;
	}
	if (r < 0) {
		PyErr_Format(PyExc_BufferError,
			     "cannot order the legacy default stream after the publisher of this "
			     "CUDA tensor (export it once before capturing a CUDA graph): %s",
			     dlpc_last_error());
		return -1;
	}
	self->legacy_ordered = true;
	return 0;
}

static int x_from_py(void *py_object, DLManagedTensorVersioned **out)
{
	PyObject *obj = py_object;
	DLManagedTensorVersioned *t;

	if (!ipc_is_tensor(obj)) {
		PyObject *type = PyType_GetQualName(Py_TYPE(obj));

		if (type)
			PyErr_Format(PyExc_TypeError, "expected a SharedTensor, got %U", type);
		Py_XDECREF(type);
		return -1;
	}
	t = ipc_tensor_live((TensorObject *)obj);
	if (!t || order_for_consumer((TensorObject *)obj, t) < 0)
		return -1;
	*out = dlpc_tensor_share(t);
	if (!*out) {
		PyErr_NoMemory();
		return -1;
	}
	return 0;
}

static int x_to_py(DLManagedTensorVersioned *t, void **out)
{
	DLManagedTensorVersioned *probe = dlpc_tensor_share(t);
	ipc_state *st = ipc_state_of_type(exchange_type);
	PyObject *key, *obj;

	/* only libdlpc memory can be shared further; the tensor is ours either way */
	if (!probe) {
		t->deleter(t);
		PyErr_SetString(PyExc_BufferError,
				"a SharedTensor can only hold memory made by dlpack_ipc");
		return -1;
	}
	probe->deleter(probe);
	key = PyUnicode_FromString("");
	obj = key ? ipc_tensor_new(st, t, Py_None, key, 0, false) : NULL;
	Py_XDECREF(key);
	if (!obj)
		return -1;
	*out = obj;
	return 0;
}

static int x_dltensor_from_py(void *py_object, DLTensor *out)
{
	DLManagedTensorVersioned *t;

	if (!ipc_is_tensor(py_object)) {
		PyErr_SetString(PyExc_TypeError, "expected a SharedTensor");
		return -1;
	}
	t = ipc_tensor_live(py_object);
	if (!t || order_for_consumer(py_object, t) < 0)
		return -1;
	*out = t->dl_tensor;
	return 0;
}

static int x_stream(DLDeviceType type, int32_t id, void **out)
{
	(void)type;
	(void)id;
	/* host memory has no stream; CUDA tensors are ordered on the legacy default stream */
	*out = NULL;
	return 0;
}

static const DLPackExchangeAPI exchange_api = {
	.header = {.version = {DLPACK_MAJOR_VERSION, DLPC_EXCHANGE_API_MINOR}, .prev_api = NULL},
	.managed_tensor_allocator = x_allocator,
	.managed_tensor_from_py_object_no_sync = x_from_py,
	.managed_tensor_to_py_object_no_sync = x_to_py,
	.dltensor_from_py_object_no_sync = x_dltensor_from_py,
	.current_work_stream = x_stream,
};

int ipc_exchange_install(PyTypeObject *tp)
{
	PyObject *cap = PyCapsule_New((void *)&exchange_api, "dlpack_exchange_api", NULL);
	int r;

	if (!cap)
		return -1;
	exchange_type = tp;
	/*
	 * A class attribute: the limited API has no way to put one into an immutable type (no
	 * tp_dict, no PyType_Freeze() before 3.14), so SharedTensor is left mutable for this.
	 */
	r = PyObject_SetAttrString((PyObject *)tp, "__dlpack_c_exchange_api__", cap);
	Py_DECREF(cap);
	return r;
}
